// tests/gpu/test_query_scale.cc: what the fp8 pages' fp16 MMAs rely on (src/cuda/query_scale.h,
// score_topk.cu v29), checked on the host over every bf16 value (no GPU needed, so it runs in
// CI): a query column scaled by 2^e, e from its largest finite |q|, holds every bf16 value from
// that one down to 2^-32 of it exactly as an fp16 value, and 2^-e scales the dots back exactly.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>

#include "cpidx/contract.h"
#include "cpidx/reference.h"
#include "cuda/query_scale.h"

namespace {

using cpidx::float_bits;
using cpidx::cuda::pow2;
using cpidx::cuda::query_scale_exponent;

float bf16_value(uint32_t bits) { return cpidx::ref::bf16_to_float(static_cast<uint16_t>(bits)); }

// Whether x (finite, >= 0) is an fp16 value: at most 65504, and a multiple of 2^-24 below
// 2^-14 (subnormals), else 11 significant bits (the float's 13 low mantissa bits clear).
bool exact_in_fp16(float x) {
  if (!(x <= 65504.0f)) return false;
  if (x < std::ldexp(1.0f, -14)) {
    const double scaled = std::ldexp(static_cast<double>(x), 24);
    return scaled == std::floor(scaled);
  }
  return (float_bits(x) & 0x1FFFu) == 0;
}

TEST(QueryScale, PowersOfTwoScaleBackExactly) {
  for (int k = -126; k <= 126; ++k) {
    EXPECT_EQ(pow2(k), std::ldexp(1.0f, k)) << k;
    EXPECT_EQ(pow2(k) * pow2(-k), 1.0f) << k;
  }
  EXPECT_EQ(pow2(127), std::ldexp(1.0f, 127));
}

TEST(QueryScale, LargestValueLandsBelowFp16sLargest) {
  for (uint32_t b = 0; b < 0x7F80u; ++b) {  // every finite non-negative bf16 value
    const float m = bf16_value(b);
    const int e = query_scale_exponent(m);
    ASSERT_GE(e, -126);
    ASSERT_LE(e, 126);
    const float scaled = m * pow2(e);
    if (m >= std::ldexp(1.0f, -111)) {  // e not clamped: m * 2^e in [2^15, 2^16)
      ASSERT_GE(scaled, 32768.0f) << std::hex << b;
      ASSERT_LT(scaled, 65536.0f) << std::hex << b;
    }
    ASSERT_TRUE(exact_in_fp16(scaled)) << std::hex << b;
  }
  EXPECT_EQ(query_scale_exponent(0.0f), 126);
  EXPECT_EQ(query_scale_exponent(1.0f), 15);
  EXPECT_EQ(query_scale_exponent(65280.0f), 0);
  EXPECT_EQ(query_scale_exponent(std::ldexp(1.0f, 127)), -112);
}

// Every bf16 value v in [m * 2^-32, m] (or all of [0, m] when e is clamped at 126) is exact in
// fp16 once scaled, for every finite bf16 m: the products v * k with an fp8 key k (also exact
// in fp16) are then the bf16 products times 2^e, exactly.
TEST(QueryScale, EveryValueWithin2To32OfTheLargestIsExact) {
  int64_t checked = 0;
  for (uint32_t b = 0; b < 0x7F80u; ++b) {
    const float m = bf16_value(b);
    const int e = query_scale_exponent(m);
    const float up = pow2(e);
    const float floor_v = e == 126 ? 0.0f : std::ldexp(m, -32);
    for (uint32_t v = b + 1; v-- > 0;) {  // from m down
      const float x = bf16_value(v);
      if (x < floor_v) break;
      if (!exact_in_fp16(x * up)) {
        FAIL() << "m = " << m << " (bf16 0x" << std::hex << b << "), v = " << x << " (0x" << v
               << ")";
      }
      ++checked;
    }
  }
  EXPECT_GT(checked, int64_t{100} * 1000 * 1000);  // ~32 binades of 128 values per m
}

}  // namespace
