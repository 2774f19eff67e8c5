// Test inputs shared by the CPU and GPU suites: the golden SplitMix64 stream, random decode /
// prefill batches (bf16 or fp8 cache, shuffled block tables), hand-built batches with exact
// dots, output poisoning, and a helper that runs one function per thread rank. Independent of
// GoogleTest.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "cpidx/comm.h"
#include "cpidx/contract.h"
#include "cpidx/params.h"
#include "cpidx/reference.h"

namespace cpidx_test {

using cpidx::DType;

// A fresh seed for each run (tests trace it, so a failing draw can be replayed).
inline uint64_t fresh_seed() {
  std::random_device device;
  return (uint64_t{device()} << 32) ^ device();
}

// Golden inputs (spec/golden/README.md): draw i of seed s gives int(z >> 60) - 8 in [-8, 7].
class GoldenStream {
 public:
  explicit GoldenStream(uint64_t seed) : seed_(seed) {}
  int next() {
    ++i_;
    uint64_t z = seed_ + i_ * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return static_cast<int>(z >> 60) - 8;
  }

 private:
  uint64_t seed_;
  uint64_t i_ = 0;
};

constexpr int32_t kPoison = 0x7B7B7B7B;
constexpr int kD = cpidx::kHeadDim;
constexpr int kBS = cpidx::kBlockSize;

// How random values are drawn: wide spread (few ties) or small integers (many equal maxima).
enum class Values { kRandom, kTies };

// A decode batch with every head's queries: query [n][T][D], the cache, a block table whose
// unused columns hold garbage (so reading them would trip the page error flag).
struct DecodeData {
  int total_heads = 0;
  int query_len = 1;
  int32_t max_seq_len = 0;
  DType dtype = DType::kBF16;
  std::vector<int32_t> seq_lens;
  std::vector<uint16_t> query;       // [n][T][D] bf16 bits
  std::vector<uint16_t> cache_bf16;  // [pages][BS][D]
  std::vector<uint8_t> cache_fp8;    // [pages][BS][D]
  int64_t num_pages = 0;
  std::vector<int32_t> block_table;  // [num_reqs][bt_row_stride]
  int64_t bt_row_stride = 0;
  float scale = 1.0f;

  int num_reqs() const { return static_cast<int>(seq_lens.size()); }
  int64_t rows() const { return static_cast<int64_t>(num_reqs()) * query_len; }
  int64_t max_blocks() const { return cpidx::cdiv(max_seq_len, kBS); }

  // Inputs for global heads [head_begin, head_begin + heads).
  cpidx::DecodeInputs inputs(int head_begin, int heads) const {
    cpidx::DecodeInputs in;
    in.query = query.data() + static_cast<int64_t>(head_begin) * kD;
    in.q_row_stride = static_cast<int64_t>(total_heads) * kD;
    in.q_head_stride = kD;
    in.num_heads = heads;
    in.cache.dtype = dtype;
    in.cache.data = dtype == DType::kBF16 ? static_cast<const void*>(cache_bf16.data())
                                          : static_cast<const void*>(cache_fp8.data());
    in.cache.num_pages = num_pages;
    in.block_table = block_table.data();
    in.bt_row_stride = bt_row_stride;
    in.seq_lens = seq_lens.data();
    in.num_reqs = num_reqs();
    in.query_len = query_len;
    in.max_seq_len = max_seq_len;
    in.scale = scale;
    return in;
  }
  cpidx::DecodeInputs all_heads() const { return inputs(0, total_heads); }
};

inline uint16_t bf16_of(float f) { return cpidx::ref::float_to_bf16(f); }

// Prefill inputs over a decode batch's arrays: its query rows as `tokens` tokens of its first
// `heads` heads, its cache and block table, and the caller's cu_seqlens_q, context_lens and
// seq_lens of `num_reqs` requests.
inline cpidx::PrefillInputs prefill_over(const DecodeData& d, int heads, int64_t tokens,
                                         const int32_t* cu_seqlens_q, const int32_t* context_lens,
                                         const int32_t* seq_lens, int num_reqs) {
  cpidx::PrefillInputs in;
  const cpidx::DecodeInputs all = d.all_heads();
  in.query = all.query;
  in.q_row_stride = all.q_row_stride;
  in.q_head_stride = all.q_head_stride;
  in.num_heads = heads;
  in.cache = all.cache;
  in.block_table = all.block_table;
  in.bt_row_stride = all.bt_row_stride;
  in.cu_seqlens_q = cu_seqlens_q;
  in.context_lens = context_lens;
  in.seq_lens = seq_lens;
  in.num_reqs = num_reqs;
  in.num_tokens = tokens;
  in.max_seq_len = all.max_seq_len;
  in.scale = all.scale;
  return in;
}

// A hand-built bf16 decode batch (one head) whose dots are set token by token, for tests that
// pin one rule: every query is e0 + e1, so its dot with a key is key[0] + key[1]. Request r's
// block b is page r * max_blocks + b, so cache token t (page t / 128, slot t % 128) is token t
// of request 0 for t < max_seq_len. Every token starts at dot `fill`; scale is 1.
struct ExactDots {
  DecodeData d;

  ExactDots(int query_len, const std::vector<int32_t>& seq_lens, int32_t max_seq_len,
            float fill = -8.0f) {
    d.total_heads = 1;
    d.query_len = query_len;
    d.seq_lens = seq_lens;
    d.max_seq_len = max_seq_len;
    d.query.assign(static_cast<size_t>(d.rows()) * kD, bf16_of(0.0f));
    for (int64_t r = 0; r < d.rows(); ++r) {
      d.query[static_cast<size_t>(r * kD)] = bf16_of(1.0f);
      d.query[static_cast<size_t>(r * kD + 1)] = bf16_of(1.0f);
    }
    d.bt_row_stride = d.max_blocks();
    d.num_pages = d.num_reqs() * d.bt_row_stride;
    d.cache_bf16.assign(static_cast<size_t>(d.num_pages) * kBS * kD, bf16_of(0.0f));
    d.block_table.resize(static_cast<size_t>(d.num_pages));
    std::iota(d.block_table.begin(), d.block_table.end(), 0);
    for (int64_t t = 0; t < d.num_pages * kBS; ++t) set_dot(t, fill);
  }

  // The dot of every query with cache token t becomes `dot`: a bf16 value (NaN and inf too), or
  // an integer below 2^16 in magnitude (split into two bf16 parts, e.g. 1001 = 1000 + 1).
  void set_dot(int64_t t, float dot) {
    const float hi = cpidx::ref::bf16_to_float(bf16_of(dot));
    d.cache_bf16[static_cast<size_t>(t * kD)] = bf16_of(hi);
    d.cache_bf16[static_cast<size_t>(t * kD + 1)] = bf16_of(std::isfinite(hi) ? dot - hi : 0.0f);
  }
  // Every token of cache block (page) b.
  void set_block(int64_t b, float dot) {
    for (int j = 0; j < kBS; ++j) set_dot(b * kBS + j, dot);
  }
  // Prefill inputs over this batch: `tokens` query rows placed by cu_seqlens_q / context_lens /
  // seq_lens (one entry a request), which must outlive the inputs.
  cpidx::PrefillInputs prefill(const std::vector<int32_t>& cu, const std::vector<int32_t>& ctx,
                               const std::vector<int32_t>& seq, int64_t tokens) const {
    return prefill_over(d, 1, tokens, cu.data(), ctx.data(), seq.data(),
                        static_cast<int>(ctx.size()));
  }
};

// `count` keys as a corrupted or custom gather may hand the merge: a quarter each random 64-bit
// patterns, pads, NaN-score keys of blocks 0-8, and keys of blocks 0-6 at `scores` scores (1, 2,
// ...): many equal keys, the rows' own blocks among them.
inline std::vector<cpidx::Key> garbage_keys(std::mt19937_64& rng, size_t count, int scores) {
  std::vector<cpidx::Key> keys(count);
  for (auto& k : keys) {
    switch (rng() % 4) {
      case 0:
        k = rng();
        break;
      case 1:
        k = cpidx::kPadKey;
        break;
      case 2:
        k = cpidx::make_key(std::nanf(""), static_cast<int64_t>(rng() % 9));
        break;
      default:
        k = cpidx::make_key(1.0f + static_cast<float>(rng() % scores),
                            static_cast<int64_t>(rng() % 7));
        break;
    }
  }
  return keys;
}

// Golden decode inputs: queries then cache from one stream, block_table[req][b] = b * B + req.
inline DecodeData golden_decode(uint64_t seed, int total_heads, int query_len,
                                const std::vector<int32_t>& seq_lens, float scale) {
  DecodeData d;
  d.total_heads = total_heads;
  d.query_len = query_len;
  d.seq_lens = seq_lens;
  d.scale = scale;
  const int32_t longest = *std::max_element(seq_lens.begin(), seq_lens.end());
  const int64_t blocks = std::max<int64_t>(1, cpidx::cdiv(longest, kBS));
  const int reqs = d.num_reqs();
  d.max_seq_len = static_cast<int32_t>(blocks * kBS);
  GoldenStream stream(seed);
  d.query.resize(static_cast<size_t>(d.rows()) * total_heads * kD);
  for (auto& q : d.query) q = bf16_of(static_cast<float>(stream.next()));
  d.num_pages = reqs * blocks;
  d.cache_bf16.resize(static_cast<size_t>(d.num_pages) * kBS * kD);
  for (auto& k : d.cache_bf16) k = bf16_of(static_cast<float>(stream.next()));
  d.bt_row_stride = blocks;
  d.block_table.resize(static_cast<size_t>(reqs * blocks));
  for (int req = 0; req < reqs; ++req) {
    for (int64_t b = 0; b < blocks; ++b) {
      d.block_table[static_cast<size_t>(req * blocks + b)] = static_cast<int32_t>(b * reqs + req);
    }
  }
  return d;
}

inline float draw_value(std::mt19937_64& rng, Values values) {
  if (values == Values::kTies) return static_cast<float>(static_cast<int>(rng() % 3) - 1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  return normal(rng);
}

// A random decode batch. max_seq_len >= every seq_len; pages are shuffled, and two spare
// block-table columns plus the columns past each request's length hold garbage.
inline DecodeData random_decode(uint64_t seed, int total_heads, int query_len,
                                const std::vector<int32_t>& seq_lens, int32_t max_seq_len,
                                DType dtype = DType::kBF16, Values values = Values::kRandom,
                                float scale = 0.0883883f) {
  std::mt19937_64 rng(seed);
  DecodeData d;
  d.total_heads = total_heads;
  d.query_len = query_len;
  d.seq_lens = seq_lens;
  d.max_seq_len = max_seq_len;
  d.dtype = dtype;
  d.scale = scale;
  d.query.resize(static_cast<size_t>(d.rows()) * total_heads * kD);
  for (auto& q : d.query) {
    q = bf16_of(values == Values::kTies ? static_cast<float>(static_cast<int>(rng() % 5) - 2)
                                        : draw_value(rng, values));
  }
  const int reqs = d.num_reqs();
  const int64_t blocks = d.max_blocks();
  d.num_pages = reqs * blocks + 3;
  const size_t elems = static_cast<size_t>(d.num_pages) * kBS * kD;
  if (dtype == DType::kBF16) {
    d.cache_bf16.resize(elems);
    for (auto& k : d.cache_bf16) k = bf16_of(draw_value(rng, values));
  } else {
    d.cache_fp8.resize(elems);
    for (auto& k : d.cache_fp8) {
      if (values == Values::kTies) {
        const uint8_t codes[3] = {0xB8, 0x00, 0x38};  // -1, 0, +1 in e4m3
        k = codes[rng() % 3];
      } else {
        do k = static_cast<uint8_t>(rng());
        while ((k & 0x7F) == 0x7F);  // skip NaN codes
      }
    }
  }
  std::vector<int32_t> pages(static_cast<size_t>(d.num_pages));
  std::iota(pages.begin(), pages.end(), 0);
  std::shuffle(pages.begin(), pages.end(), rng);
  d.bt_row_stride = blocks + 2;
  d.block_table.assign(static_cast<size_t>(reqs * d.bt_row_stride), 0);
  for (int req = 0; req < reqs; ++req) {
    const int64_t used =
        std::min(blocks, cpidx::cdiv(std::max(seq_lens[static_cast<size_t>(req)], 0), kBS));
    for (int64_t b = 0; b < d.bt_row_stride; ++b) {
      d.block_table[static_cast<size_t>(req * d.bt_row_stride + b)] =
          b < used ? pages[static_cast<size_t>(req * blocks + b)] : (b % 2 ? -1000003 : 1 << 30);
    }
  }
  return d;
}

// Ids [heads][rows][K], contiguous, filled with kPoison.
struct IdsBuffer {
  IdsBuffer(int heads, int64_t rows, int topk)
      : heads(heads),
        rows(rows),
        topk(topk),
        ids(static_cast<size_t>(heads) * rows * topk, kPoison) {}
  cpidx::TopkOutput out() {
    return cpidx::TopkOutput{ids.data(), rows * topk, static_cast<int64_t>(topk)};
  }
  const int32_t* row(int head, int64_t r) const {
    return ids.data() + (static_cast<int64_t>(head) * rows + r) * topk;
  }
  bool any_poison() const { return std::find(ids.begin(), ids.end(), kPoison) != ids.end(); }
  bool all_poison() const {
    return std::all_of(ids.begin(), ids.end(), [](int32_t v) { return v == kPoison; });
  }
  int heads;
  int64_t rows;
  int topk;
  std::vector<int32_t> ids;
};

// Runs fn(rank, comm) on world_size threads with thread communicators; returns once all end.
inline void run_ranks(int world_size, const std::function<void(int, cpidx::Communicator&)>& fn) {
  auto comms = cpidx::make_thread_communicators(world_size);
  std::vector<std::thread> threads;
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] { fn(r, *comms[static_cast<size_t>(r)]); });
  }
  for (auto& t : threads) t.join();
}

// The world sizes a geometry accepts for total_heads, out of {1, 2, 4, 8}.
inline std::vector<int> valid_worlds(int total_heads) {
  std::vector<int> worlds;
  for (int p : {1, 2, 4, 8}) {
    cpidx::Geometry g;
    if (cpidx::make_geometry(total_heads, p, 0, &g).is_ok()) worlds.push_back(p);
  }
  return worlds;
}

// Selection (K, init, local) in one call, as the tests write it.
inline cpidx::Selection sel_of(int k, int init = 0, int local = 1) {
  cpidx::Selection s;
  s.topk = k;
  s.init_blocks = init;
  s.local_blocks = local;
  return s;
}

// `reqs` lengths uniform in [1, max_len]; with `pad`, request 1 is a padding request.
inline std::vector<int32_t> lengths(std::mt19937& rng, int reqs, int32_t max_len, bool pad) {
  std::vector<int32_t> s(static_cast<size_t>(reqs));
  std::uniform_int_distribution<int32_t> dist(1, max_len);
  for (auto& x : s) x = dist(rng);
  if (pad && reqs > 2) s[1] = 0;
  return s;
}

// A rank's communicator that forwards everything to `inner` and records the byte counts of its
// all_gathers (none for a step refused before any collective; the agreements go through
// check_agree / check_agree_all, forwarded).
class RecordingComm final : public cpidx::Communicator {
 public:
  explicit RecordingComm(cpidx::Communicator& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  cpidx::MemorySpace memory_space() const override { return inner_.memory_space(); }
  cpidx::Status all_gather(const void* send, void* recv, size_t bytes,
                           cudaStream_t stream) override {
    sizes.push_back(bytes);
    return inner_.all_gather(send, recv, bytes, stream);
  }
  cpidx::Status check_agree(long long value, const char* what) override {
    return inner_.check_agree(value, what);
  }
  cpidx::Status check_agree_all(const long long* values, const char* const* names,
                                int count) override {
    return inner_.check_agree_all(values, names, count);
  }
  cpidx::Status barrier() override { return inner_.barrier(); }
  size_t max_bytes_per_rank() const override { return inner_.max_bytes_per_rank(); }
  const cpidx::DeviceChannel* device_channel() const override { return inner_.device_channel(); }
  int device() const override { return inner_.device(); }
  std::vector<size_t> sizes;

 private:
  cpidx::Communicator& inner_;
};

}  // namespace cpidx_test
