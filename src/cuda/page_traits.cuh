// src/cuda/page_traits.cuh: how the scoring consumers read a 128-token key page from shared
// memory, per cache dtype (bf16; fp8 e4m3 widened to fp16): the page's size and row pitch, the
// MMA's input type, and the bank swizzle of their 16- or 8-byte loads, undone in registers so
// the MMAs see the operands of a straight load.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include <type_traits>

#include "cpidx/contract.h"
#include "kernels.h"

namespace cpidx {
namespace cuda {

// A page is read by the consumers in 4 column chunks j (32 dims each); lane (g, c4) of a warp
// holds 8 dims of chunk j of its rows, from dim(j, c4) on, and a load brings kChunksPerLoad of
// them (the query fragments take the same dims). bf16 rows lie 256 B apart, a whole number of
// bank rows, so the two rows of one shared-memory phase of a 16-byte load would hit the same
// banks. Each lane instead loads chunk j ^ swz in its j-th load, with swz = g & kSwizzleMask:
// the phase's rows read different bank groups (conflict-free), and unswizzle() puts every chunk
// back in its slot, so the MMAs see exactly the operands (and do exactly the arithmetic) of a
// straight load. kSwizzleMask 0: loaded straight (fp8; and every dtype above 16 columns,
// score_topk.cu).
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
  __host__ __device__ static constexpr int dim(int j, int c4) { return j * 32 + c4 * 8; }
  // 8 bf16 of token `tok`: chunk l's dims [dim(l, c4), +8) (2 dim(l, c4) bytes in, written out).
  __device__ static Raw load(const uint8_t* page, int tok, int l, int c4) {
    return *reinterpret_cast<const uint4*>(page + tok * kRowBytes + l * 64 + c4 * 16);
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
  __host__ __device__ static constexpr int dim(int j, int c4) {
    return kChunksPerLoad == 2 ? (j / 2) * 64 + c4 * 16 + (j % 2) * 8 : j * 32 + c4 * 8;
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
  // kChunksPerLoad x 8 e4m3 of token `tok`: load l's chunks' dims (dim(l * kChunksPerLoad, c4),
  // written out: the compiler's operand order, so the 8-byte instances' PTX, stays as before).
  __device__ static Raw load(const uint8_t* page, int tok, int l, int c4) {
    if constexpr (kChunksPerLoad == 1)
      return *reinterpret_cast<const Raw*>(page + tok * kRowBytes + l * 32 + c4 * 8);
    return *reinterpret_cast<const Raw*>(page + tok * kRowBytes + l * 64 + c4 * 16);
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
