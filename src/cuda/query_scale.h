// src/cuda/query_scale.h: the power of two that puts a query column into fp16's range for the
// fp8 pages' fp16 MMAs (score_topk.cu, v29), on host and device so that CI can check what the
// kernel relies on (tests/gpu/test_query_scale.cc).
#pragma once

#include "cpidx/contract.h"

namespace cpidx {
namespace cuda {

// 2^k as a float, k in [-126, 127] (a normal float).
CPIDX_HD float pow2(int k) { return bits_float(static_cast<uint32_t>(127 + k) << 23); }

// The exponent e by which a query column is scaled, from m, its largest finite |q| (>= 0):
// for a normal m, m * 2^e lies in [2^15, 2^16), so every bf16 value from m down to m * 2^-32
// is exactly an fp16 value once scaled (and none overflows: a bf16 value below 2^16 is at most
// 65280, fp16's largest is 65504). e is clamped to [-126, 126], so that 2^e and 2^-e are normal
// floats and scaling back is exact; a zero or subnormal m gets 126: every bf16 subnormal is a
// multiple of 2^-133, so scaled it is a multiple of 2^-7 below 2^-6, exact in fp16.
CPIDX_HD int query_scale_exponent(float m) {
  const int e = 15 - ((static_cast<int32_t>(float_bits(m)) >> 23) - 127);
  const int at_least = e < -126 ? -126 : e;
  return at_least > 126 ? 126 : at_least;
}

}  // namespace cuda
}  // namespace cpidx
