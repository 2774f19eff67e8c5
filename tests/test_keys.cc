// Key order of CONTRACT.md section 4.2 on edge values (NaN, signed zeros, infinities, forced
// scores, denormals), the key round trip, and the exact bf16 / fp8-e4m3 conversions.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpidx/contract.h"
#include "cpidx/reference.h"

namespace {

using cpidx::bits_float;
using cpidx::float_bits;
using cpidx::Key;
using cpidx::make_key;

float nan_bits(uint32_t bits) { return bits_float(bits); }

TEST(KeyOrder, EdgeValuesAscending) {
  const float inf = std::numeric_limits<float>::infinity();
  const float denorm = std::numeric_limits<float>::denorm_min();
  // Strictly ascending in the contract's order.
  const std::vector<float> ascending = {nan_bits(0x7FC00000u),
                                        -inf,
                                        -FLT_MAX,
                                        -1e30f,
                                        -1.0f,
                                        -FLT_MIN,
                                        -denorm,
                                        0.0f,
                                        denorm,
                                        FLT_MIN,
                                        1.0f,
                                        1.0000001f,
                                        1e29f,
                                        1e30f,
                                        FLT_MAX,
                                        inf};
  for (int64_t block : {int64_t{0}, int64_t{7}, int64_t{INT32_MAX}}) {
    for (size_t i = 1; i < ascending.size(); ++i) {
      EXPECT_LT(make_key(ascending[i - 1], block), make_key(ascending[i], block))
          << ascending[i - 1] << " vs " << ascending[i] << " block " << block;
    }
  }
  // Padding sits below every real key, NaN at block 0 included.
  EXPECT_LT(cpidx::kPadKey, make_key(nan_bits(0x7FC00000u), 0));
  EXPECT_LT(cpidx::kPadKey, make_key(-inf, 0));
  EXPECT_TRUE(cpidx::key_is_pad(cpidx::kPadKey));
  EXPECT_FALSE(cpidx::key_is_pad(make_key(nan_bits(0xFFFFFFFFu), 0)));
}

TEST(KeyOrder, NaNsAreEqualAndSignedZerosAreEqual) {
  const std::vector<uint32_t> nans = {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFF800001u,
                                      0x7FFFFFFFu, 0xFFFFFFFFu, 0x7FA12345u};
  for (uint32_t bits : nans) {
    ASSERT_TRUE(std::isnan(nan_bits(bits)));
    EXPECT_EQ(make_key(nan_bits(bits), 3), make_key(nan_bits(0x7FC00000u), 3)) << std::hex << bits;
    EXPECT_TRUE(std::isnan(cpidx::key_score(make_key(nan_bits(bits), 3))));
  }
  EXPECT_EQ(make_key(0.0f, 5), make_key(-0.0f, 5));
  EXPECT_EQ(cpidx::ordered32(-0.0f), 0x80000000u);
}

TEST(KeyOrder, TiesGoToTheHigherBlockId) {
  for (float s : {0.0f, -0.0f, 1.0f, -3.5f, 1e29f, 1e30f, -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN()}) {
    EXPECT_GT(make_key(s, 5), make_key(s, 4));
    EXPECT_GT(make_key(s, INT32_MAX), make_key(s, 65535));
    EXPECT_GT(make_key(s, 65536), make_key(s, 65535));  // no 16-bit id field
  }
  EXPECT_GT(make_key(0.0f, 9), make_key(-0.0f, 8));
  EXPECT_GT(make_key(-0.0f, 9), make_key(0.0f, 8));
  // A higher score always beats a higher id.
  EXPECT_GT(make_key(2.0f, 0), make_key(1.0f, INT32_MAX));
  EXPECT_GT(make_key(1e30f, 0), make_key(1e29f, INT32_MAX));
}

TEST(KeyOrder, ReferenceCodes) {
  // REFERENCE_NOTES.md section 6.2 (this library sends NaN to 1, above the padding key 0).
  EXPECT_EQ(cpidx::ordered32(std::numeric_limits<float>::infinity()), 0xFF800000u);
  EXPECT_EQ(cpidx::ordered32(1e30f), 0xF149F2CAu);
  EXPECT_EQ(cpidx::ordered32(1e29f), 0xEFA18F08u);
  EXPECT_EQ(cpidx::ordered32(0.0f), 0x80000000u);
  EXPECT_EQ(cpidx::ordered32(-1e30f), 0x0EB60D35u);
  EXPECT_EQ(cpidx::ordered32(-std::numeric_limits<float>::infinity()), 0x007FFFFFu);
  EXPECT_EQ(cpidx::ordered32(std::numeric_limits<float>::quiet_NaN()), 1u);
}

TEST(KeyOrder, RoundTrip) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> scores = {-inf,
                                     -FLT_MAX,
                                     -1.5f,
                                     -FLT_MIN,
                                     -std::numeric_limits<float>::denorm_min(),
                                     0.0f,
                                     std::numeric_limits<float>::denorm_min(),
                                     0.1f,
                                     1e29f,
                                     1e30f,
                                     FLT_MAX,
                                     inf};
  const std::vector<int64_t> blocks = {0, 1, 127, 65534, 65535, 65536, 1 << 24, INT32_MAX};
  for (float s : scores) {
    for (int64_t b : blocks) {
      const Key k = make_key(s, b);
      EXPECT_EQ(float_bits(cpidx::key_score(k)), float_bits(s)) << s << " " << b;
      EXPECT_EQ(cpidx::key_block(k), b);
    }
  }
  EXPECT_EQ(float_bits(cpidx::key_score(make_key(-0.0f, 2))), 0u);  // -0 comes back as +0
}

TEST(Conversions, Bf16) {
  using cpidx::ref::bf16_to_float;
  using cpidx::ref::float_to_bf16;
  EXPECT_EQ(bf16_to_float(0x3F80), 1.0f);
  EXPECT_EQ(bf16_to_float(0xC000), -2.0f);
  EXPECT_EQ(float_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(float_to_bf16(bits_float(0x3F808000u)), 0x3F80);  // tie -> even
  EXPECT_EQ(float_to_bf16(bits_float(0x3F818000u)), 0x3F82);  // tie -> even (up)
  EXPECT_EQ(float_to_bf16(bits_float(0x3F808001u)), 0x3F81);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(bits_float(0x7F800001u)))));
  for (uint32_t bits = 0; bits < 0x10000u; ++bits) {
    const float f = bf16_to_float(static_cast<uint16_t>(bits));
    if (!std::isnan(f)) {
      EXPECT_EQ(float_to_bf16(f), bits);
    }
  }
}

TEST(Conversions, Fp8E4M3AllCodes) {
  using cpidx::ref::fp8e4m3_to_float;
  EXPECT_EQ(fp8e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(fp8e4m3_to_float(0xB8), -1.0f);
  EXPECT_EQ(fp8e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(fp8e4m3_to_float(0xFE), -448.0f);
  EXPECT_EQ(fp8e4m3_to_float(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(fp8e4m3_to_float(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(fp8e4m3_to_float(0x07), 7 * std::ldexp(1.0f, -9));
  EXPECT_EQ(fp8e4m3_to_float(0x40), 2.0f);
  EXPECT_EQ(fp8e4m3_to_float(0x3C), 1.5f);
  EXPECT_EQ(float_bits(fp8e4m3_to_float(0x80)), 0x80000000u);  // -0
  EXPECT_TRUE(std::isnan(fp8e4m3_to_float(0x7F)));
  EXPECT_TRUE(std::isnan(fp8e4m3_to_float(0xFF)));
  // Positive codes 0x00..0x7E are strictly increasing, negatives mirror them.
  for (int code = 1; code < 0x7F; ++code) {
    EXPECT_LT(fp8e4m3_to_float(static_cast<uint8_t>(code - 1)),
              fp8e4m3_to_float(static_cast<uint8_t>(code)));
    EXPECT_EQ(fp8e4m3_to_float(static_cast<uint8_t>(code | 0x80)),
              -fp8e4m3_to_float(static_cast<uint8_t>(code)));
  }
}

}  // namespace
