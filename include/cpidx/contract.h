// cpidx/contract.h: the few constants and pure functions of the contract (CONTRACT.md
// sections 1, 3, 4, 5), shared verbatim by the CPU reference and the CUDA kernels.
// Everything here is O(1) and usable from host and device code.
#pragma once

#include <cstdint>
#include <cstring>

#include "cpidx/status.h"

#if defined(__CUDACC__)
#define CPIDX_HD __host__ __device__ __forceinline__
#else
#define CPIDX_HD inline
#endif

namespace cpidx {

// ---- Fixed sizes of the supported model family -------------------------------------------
constexpr int kBlockSize = 128;   // BS: sparse block = index-cache page, in tokens
constexpr int kHeadDim = 128;     // D: index head dim (the only compiled value)
constexpr int kMaxTopK = 64;      // K: blocks selected per (head, row), 1..kMaxTopK
constexpr int kMaxQueryLen = 8;   // Q: decode query tokens per request, 1..kMaxQueryLen
constexpr int kMaxHeads = 8;      // T: index heads, 1..kMaxHeads
constexpr int kMaxWorldSize = 8;  // P: context-parallel ranks of the GPU decode (the CPU
                                  // reference takes any P)
// The sparse table (section 6) names 16-token pages: this many to a 128-token block.
constexpr int kPagesPerBlock = kBlockSize / 16;

// Forced blocks replace their score (CONTRACT.md section 4.1).
constexpr float kInitScore = 1e30f;
constexpr float kLocalScore = 1e29f;

enum class DType : int { kBF16 = 0, kFP8E4M3 = 1 };
CPIDX_HD int dtype_bytes(DType t) { return t == DType::kBF16 ? 2 : 1; }
const char* to_string(DType t);

// ---- Geometry (CONTRACT.md section 1) --------------------------------------------------
struct Geometry {
  int total_heads = 0;   // T
  int world_size = 1;    // P
  int rank = 0;          // r
  int local_heads = 0;   // L = T/P if T >= P else 1
  int replicas = 1;      // R = 1 if T >= P else P/T
  int head_offset = 0;   // (r / R) * L: first owned global head
};

// Fails (naming both numbers) unless T % P == 0 (T >= P) or P % T == 0 (T < P).
Status make_geometry(int total_heads, int world_size, int rank, Geometry* out);

// What each rank contributes to cp_decode's two all-gathers (CONTRACT.md section 5) for `rows`
// decode rows (num_reqs * query_len): its local queries [rows, L, D] bf16 and its shard's keys
// [T, rows, K]. Size a peer communicator (comm_peer.h) with larger() at max_tokens.
struct CpGatherBytes {
  size_t queries = 0, keys = 0;
  size_t larger() const { return queries > keys ? queries : keys; }
};
CpGatherBytes cp_gather_bytes(const Geometry& geo, int64_t rows, int topk);

// ---- Positions and blocks (CONTRACT.md sections 3 and 5) ---------------------------------
CPIDX_HD int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Visible block count of a row at position pos (pos < 0: padding row, nothing visible).
CPIDX_HD int64_t visible_blocks(int64_t pos) { return pos >= 0 ? pos / kBlockSize + 1 : 0; }

// Number of global blocks g < num_blocks with g % world == rank (round-robin shard size).
CPIDX_HD int64_t owned_blocks(int64_t num_blocks, int world, int rank) {
  return num_blocks > rank ? (num_blocks - 1 - rank) / world + 1 : 0;
}

// Score after forcing: init blocks first (1e30), then the trailing `local` blocks (1e29).
CPIDX_HD float forced_score(float score, int64_t block, int64_t visible, int init, int local) {
  if (block < init) score = kInitScore;
  int64_t local_start = visible - local;
  if (local_start < 0) local_start = 0;
  if (block >= local_start) score = kLocalScore;
  return score;
}

// ---- Ordered keys (CONTRACT.md section 4.2) ----------------------------------------------
// key = ordered32(score) << 32 | block_id. Larger key = earlier in the output.
//  - ordered32 is monotone in the score, maps -0 to +0, and sends every NaN to 1, below
//    -inf (0x007FFFFF) but above the padding key 0.
//  - the block id sits in the low 32 bits, so on equal scores the higher id wins, and any
//    non-negative int32 block id fits (no 16-bit cap).
using Key = uint64_t;
constexpr Key kPadKey = 0;

CPIDX_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}
CPIDX_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

CPIDX_HD uint32_t ordered32(float score) {
  uint32_t u = float_bits(score);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 1u;  // NaN, any sign or payload
  if (u == 0x80000000u) u = 0;                     // -0 == +0
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Inverse of ordered32 for every code it produces (NaN decodes to a quiet NaN).
CPIDX_HD float unordered32(uint32_t o) {
  if (o == 1u) return bits_float(0x7FC00000u);
  return bits_float((o & 0x80000000u) ? (o ^ 0x80000000u) : ~o);
}

CPIDX_HD Key make_key(float score, int64_t block) {
  return (static_cast<Key>(ordered32(score)) << 32) | static_cast<uint32_t>(block);
}
CPIDX_HD int32_t key_block(Key k) { return static_cast<int32_t>(static_cast<uint32_t>(k)); }
CPIDX_HD float key_score(Key k) { return unordered32(static_cast<uint32_t>(k >> 32)); }
CPIDX_HD bool key_is_pad(Key k) { return k == kPadKey; }

// Device-side error flag bits (CONTRACT.md section 8), OR-ed into a caller-readable int32.
enum DeviceError : int32_t {
  kErrNone = 0,
  kErrSeqLenOutOfRange = 1,  // seq_len < 0 or > max_seq_len: clamped into [0, max_seq_len]
  kErrPageOutOfRange = 2,    // block-table entry outside [0, num_pages): clamped
};

// Clamp helpers used identically by the reference and the kernels.
CPIDX_HD int32_t clamp_seq_len(int32_t s, int32_t max_seq_len, int32_t* err) {
  if (s < 0) { *err |= kErrSeqLenOutOfRange; return 0; }
  if (s > max_seq_len) { *err |= kErrSeqLenOutOfRange; return max_seq_len; }
  return s;
}
CPIDX_HD int64_t clamp_page(int64_t page, int64_t num_pages, int32_t* err) {
  if (page < 0) { *err |= kErrPageOutOfRange; return 0; }
  if (page >= num_pages) { *err |= kErrPageOutOfRange; return num_pages - 1; }
  return page;
}

}  // namespace cpidx
