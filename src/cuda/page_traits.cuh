// src/cuda/page_traits.cuh: how the scoring consumers read a 128-token key page from shared
// memory, per cache dtype (bf16; fp8 e4m3 widened to fp16): the page's size and row pitch, the
// MMA's input type, and the bank swizzle of their 16- or 8-byte loads, undone in registers so
// the MMAs see the operands of a straight load.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include <type_traits>

#include "cpidx/contract.h"
#include "k_steps.h"
#include "kernels.h"

namespace cpidx {
namespace cuda {

// A page is read by the consumers in 4 chunks j of 32 dims each; lane (g, c4) of a warp holds 8
// dims of chunk j of its rows, [dim(j, c4), + 8) = the k-steps' grouping (k_steps.h), and a load
// brings kChunksPerLoad of them (the query fragments take the same dims). bf16 rows lie 256 B
// apart, a whole number of bank rows, so the two rows of one shared-memory phase of a 16-byte
// load would hit the same banks. Each lane instead loads chunk j ^ swz in its j-th load, with
// swz = g & kSwizzleMask (16 bytes over: the phase's rows read different bank groups,
// conflict-free), and unswizzle() puts every chunk back in its slot, so the MMAs see exactly the
// operands (and do exactly the arithmetic) of a straight load. kSwizzleMask 0: loaded straight
// (fp8; and every dtype above 16 columns, score_topk.cu).
template <DType kDType, int kChunksPerLoad = 1>
struct PageTraits;
template <>
struct PageTraits<DType::kBF16, 1> {
  static constexpr int kBytes = kBlockSize * kHeadDim * 2;
  static constexpr int kRowBytes = kHeadDim * 2;
  static constexpr int kSwizzleMask = 1;
  static constexpr bool kHalf = false;  // bf16 MMAs on the queries as given
  static constexpr int kChunksPerLoad = 1;
  using Raw = uint4;
  __host__ __device__ static constexpr int dim(int j, int c4) { return kstep_dim(j, c4); }
  // Where a query row's dims [8 c, 8 c + 8) are staged in shared memory (in 8-dim chunks), so
  // that lane c4's of chunk j, dim(j, c4), lie at kstep_dim(j, c4): here as they are.
  __host__ __device__ static constexpr int query_chunk(int p) { return p; }
  // 8 bf16 of token `tok`: chunk l's dims [dim(l, c4), +8), 2 dim(l, c4) bytes in.
  __device__ static Raw load(const uint8_t* page, int tok, int l, int c4) {
    return *reinterpret_cast<const uint4*>(page + tok * kRowBytes + 2 * dim(l, c4));
  }
  __device__ static uint4 widen(Raw r, int) { return r; }
};
// fp8 keys are widened to fp16, one instruction per pair and exact (every e4m3 value, NaN
// included, is an fp16 value); the MMAs are fp16, so the queries are scaled into fp16's range
// (scale_query_chunk in score_topk.cu) and the dots scaled back. Widening to bf16 instead
// takes e4m3 -> fp16 -> fp32 -> bf16: four instructions a pair, most of the consumers' issue.
// Straight loads: the consumers are issue-bound, and the 4-chunk groups and selects of a swizzle
// (g & 3) cost them more than the loads' bank conflicts (-7 to -9.5% without them from 8 x 256K
// up: docs/perf/README.md, v28c). fp8 rows are 128 B apart, so a load's eight rows g hit the
// same banks: 8 wavefronts a load, for 256 bytes at 8 bytes a lane (one chunk), for 512 at 16
// (kChunksPerLoad 2: chunks 2l and 2l + 1 are the halves of load l), which halves a page's key
// loads and their wavefronts (v40).
template <int kChunks>
struct PageTraits<DType::kFP8E4M3, kChunks> {
  static_assert(kChunks == 1 || kChunks == 2, "8 or 16 bytes a load");
  static constexpr int kChunksPerLoad = kChunks;
  static constexpr int kBytes = kBlockSize * kHeadDim;
  static constexpr int kRowBytes = kHeadDim;
  static constexpr int kSwizzleMask = 0;
  static constexpr bool kHalf = true;
  using Raw = std::conditional_t<kChunksPerLoad == 2, uint4, uint2>;
  // At 8 bytes a load, lanes c4 and c4 ^ 1 trade their odd chunks (a k-step's 16 dims are the
  // same, k_steps.h): otherwise a lane's chunks 2 l and 2 l + 1 lie side by side and ptxas fuses
  // their loads into one of 16 bytes, whose registers make the 96-register instance spill 24 B
  // in its page loop (as 16-byte loads did there, v40). With the trade ptxas spills 4 B there,
  // stored once and loaded after the page loop, and 8-28 B at 64 columns (0-8 before; v59 in
  // docs/perf/README.md measured no loss at 8 columns, a gain at 32-64). The queries are staged
  // with those chunks traded: the 8-dim chunk at position p of a staged row is query_chunk(p)
  // (odd chunks 8 a + 2 b + 1 and 8 a + 2 (b ^ 1) + 1 swapped), so the query fragments are read
  // at kstep_dim(j, c4), from one base, and meet dim(j, c4) (queries_meet_keys, below).
  __host__ __device__ static constexpr int dim(int j, int c4) {
    return kstep_dim(j, kChunksPerLoad == 1 ? c4 ^ (j & 1) : c4);
  }
  __host__ __device__ static constexpr int query_chunk(int p) {
    return kChunksPerLoad == 1 ? p ^ ((p & 1) << 1) : p;
  }
  // Four e4m3 bytes (little-endian) -> two registers of two fp16 each, order kept.
  __device__ static uint2 cvt4(uint32_t four) {
    uint2 h;
    asm("{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %2;\n\t"
        "cvt.rn.f16x2.e4m3x2 %0, lo;\n\tcvt.rn.f16x2.e4m3x2 %1, hi;\n\t}"
        : "=r"(h.x), "=r"(h.y)
        : "r"(four));
    return h;
  }
  // kChunksPerLoad x 8 e4m3 of token `tok`: load l's chunks' dims, from dim(l * kChunksPerLoad,
  // c4) on (at 16 bytes, chunk 2 l + 1's follow chunk 2 l's).
  __device__ static Raw load(const uint8_t* page, int tok, int l, int c4) {
    return *reinterpret_cast<const Raw*>(page + tok * kRowBytes + dim(l * kChunksPerLoad, c4));
  }
  // Chunk l * kChunksPerLoad + c of load l, widened to fp16 pairs.
  __device__ static uint4 widen(Raw raw, int c) {
    uint32_t lo = raw.x, hi = raw.y;
    if constexpr (kChunksPerLoad == 2) {
      lo = c ? raw.z : raw.x;
      hi = c ? raw.w : raw.y;
    }
    const uint2 a = cvt4(lo), b = cvt4(hi);
    return make_uint4(a.x, a.y, b.x, b.y);
  }
};

// Whether a page's query_chunk staging (chunk c stored at position query_chunk(c), so position p
// holds query_chunk(p): an involution) puts at kstep_dim(j, c4), where query_frag reads, the 8
// dims its keys' dim(j, c4) names, for every chunk and lane.
template <typename Page>
constexpr bool queries_meet_keys() {
  for (int p = 0; p < kHeadDim / 8; ++p)
    if (Page::query_chunk(Page::query_chunk(p)) != p) return false;
  for (int j = 0; j < 4; ++j)
    for (int c4 = 0; c4 < 4; ++c4)
      if (Page::query_chunk(kstep_dim(j, c4) / 8) != Page::dim(j, c4) / 8) return false;
  return true;
}
static_assert(queries_meet_keys<PageTraits<DType::kBF16, 1>>() &&
                  queries_meet_keys<PageTraits<DType::kFP8E4M3, 1>>() &&
                  queries_meet_keys<PageTraits<DType::kFP8E4M3, 2>>(),
              "query fragments must hold the dims the key fragments hold");

// r[i] holds chunk i ^ swz of a group of N; afterwards r[j] holds chunk j (swz < N). Selects,
// not branches: the lanes of a warp differ in swz.
__device__ __forceinline__ uint4 pick(bool second, uint4 a, uint4 b) {
  return make_uint4(second ? b.x : a.x, second ? b.y : a.y, second ? b.z : a.z, second ? b.w : a.w);
}
__device__ __forceinline__ uint2 pick(bool second, uint2 a, uint2 b) {
  return make_uint2(second ? b.x : a.x, second ? b.y : a.y);
}
template <int N, typename Raw>
__device__ __forceinline__ void unswizzle(Raw (&r)[N], int swz) {
#pragma unroll
  for (int bit = 1; bit < N; bit *= 2) {
    const bool flip = swz & bit;
    Raw t[N];
#pragma unroll
    for (int j = 0; j < N; ++j) t[j] = pick(flip, r[j], r[j ^ bit]);
#pragma unroll
    for (int j = 0; j < N; ++j) r[j] = t[j];
  }
}

}  // namespace cuda
}  // namespace cpidx
