// src/cuda/page_traits.cuh: how the scoring consumers read a 128-token key page from shared
// memory, per cache dtype (bf16; fp8 e4m3 widened to fp16): the page's size and row pitch, the
// MMA's input type, and the bank swizzle of their 16- or 8-byte loads, undone in registers so
// the MMAs see the operands of a straight load.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "cpidx/contract.h"
#include "kernels.h"

namespace cpidx {
namespace cuda {

// A page is read by the consumers in 4 column chunks j (32 dims each); lane (g, c4) of a warp
// reads 8 dims of chunk j of its rows. bf16 rows lie 256 B apart, a whole number of bank rows,
// so the two rows of one shared-memory phase of a 16-byte load would hit the same banks. Each
// lane instead loads chunk j ^ swz in its j-th load, with swz = g & kSwizzleMask: the phase's
// rows read different bank groups (conflict-free), and unswizzle() puts every chunk back in its
// slot, so the MMAs see exactly the operands (and do exactly the arithmetic) of a straight
// load. kSwizzleMask 0: loaded straight (fp8; and every dtype above 16 columns, score_topk.cu).
template <DType kDType>
struct PageTraits;
template <>
struct PageTraits<DType::kBF16> {
  static constexpr int kBytes = kBlockSize * kHeadDim * 2;
  static constexpr int kRowBytes = kHeadDim * 2;
  static constexpr int kSwizzleMask = 1;
  static constexpr bool kHalf = false;  // bf16 MMAs on the queries as given
  using Raw = uint4;
  // 8 bf16 of token `tok`, dims [32 j + 8 c4, +8).
  __device__ static Raw load(const uint8_t* page, int tok, int j, int c4) {
    return *reinterpret_cast<const uint4*>(page + tok * kRowBytes + j * 64 + c4 * 16);
  }
  __device__ static uint4 widen(Raw r) { return r; }
};
// fp8 keys are widened to fp16, one instruction per pair and exact (every e4m3 value, NaN
// included, is an fp16 value); the MMAs are fp16, so the queries are scaled into fp16's range
// (scale_query_chunk in score_topk.cu) and the dots scaled back. Widening to bf16 instead
// takes e4m3 -> fp16 -> fp32 -> bf16: four instructions a pair, most of the consumers' issue.
template <>
struct PageTraits<DType::kFP8E4M3> {
  static constexpr int kBytes = kBlockSize * kHeadDim;
  static constexpr int kRowBytes = kHeadDim;
  // Straight loads: the consumers are issue-bound, and the 4-chunk groups and selects of a
  // swizzle (g & 3) cost them more than the 8-byte loads' bank conflicts (-7 to -9.5% without
  // them from 8 x 256K up: docs/perf/README.md, v28c).
  static constexpr int kSwizzleMask = 0;
  static constexpr bool kHalf = true;
  using Raw = uint2;
  // Four e4m3 bytes (little-endian) -> two registers of two fp16 each, order kept.
  __device__ static uint2 cvt4(uint32_t four) {
    uint2 h;
    asm("{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %2;\n\t"
        "cvt.rn.f16x2.e4m3x2 %0, lo;\n\tcvt.rn.f16x2.e4m3x2 %1, hi;\n\t}"
        : "=r"(h.x), "=r"(h.y)
        : "r"(four));
    return h;
  }
  __device__ static Raw load(const uint8_t* page, int tok, int j, int c4) {
    return *reinterpret_cast<const uint2*>(page + tok * kRowBytes + j * 32 + c4 * 8);
  }
  __device__ static uint4 widen(Raw raw) {
    const uint2 a = cvt4(raw.x), b = cvt4(raw.y);
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
