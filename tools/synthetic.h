// tools/synthetic.h: the demo's self-contained input builder: one synthetic decode step with
// random-normal bf16 queries, a random-normal bf16 or fp8 paged index cache and a shuffled block
// table. Deterministic in the seed alone (not the thread count), so MPI ranks build identical data.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cpidx/contract.h"
#include "cpidx/params.h"

namespace cpidx::tools {

// SplitMix64: tiny, fast, and good enough to seed and to draw demo data.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

 private:
  uint64_t state_;
};

struct SyntheticConfig {
  int total_heads = 4;        // T
  int num_reqs = 8;
  int32_t context = 65536;    // L: seq_lens are uniform in (L - 128, L], and max_seq_len = L
  int query_len = 1;          // Q
  DType cache_dtype = DType::kBF16;
  uint64_t seed = 1;
  int threads = 0;            // builder threads; 0 = all cores (the data do not depend on it)
};

// One decode step. Queries hold all T heads, [n, T, D]; `for_heads` gives the DecodeInputs view
// of any contiguous head range (the rank's local heads) without copying.
struct SyntheticStep {
  SyntheticConfig config;
  std::vector<int32_t> seq_lens;     // [num_reqs]
  std::vector<int32_t> block_table;  // [num_reqs, max_blocks], each request's pages shuffled
  int64_t max_blocks = 0;            // cdiv(context, BS): block-table row stride
  std::vector<uint8_t> cache;        // [num_pages, BS, D] raw bf16 (2 bytes) or fp8 (1 byte)
  int64_t num_pages = 0;
  std::vector<uint16_t> query;       // [n, T, D] bf16 bits
  float scale = 0;

  int64_t num_rows() const { return static_cast<int64_t>(config.num_reqs) * config.query_len; }
  DecodeInputs for_heads(int head_offset, int num_heads) const;
};

SyntheticStep build_synthetic_step(const SyntheticConfig& config);

// Round-to-nearest-even float -> bf16 bits, and a nearest float -> fp8 e4m3 (finite, saturating).
uint16_t to_bf16(float f);
uint8_t to_fp8e4m3(float f);

}  // namespace cpidx::tools
