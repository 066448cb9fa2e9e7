// The scalar numerics of src/common/scalar_math.h on the host: conversions
// against exhaustive or independent oracles, and the portable functions'
// accuracy against correctly rounded results (long double).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>

#include "common/scalar_math.h"

namespace detdit {
namespace {

using num::bits_float;
using num::float_bits;

TEST(Numerics, Bf16RoundTripIsExactForEveryBf16) {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    float v = num::bf16_to_float(static_cast<uint16_t>(h));
    uint16_t back = num::float_to_bf16(v);
    if (std::isnan(v))
      ASSERT_EQ(back, num::kCanonicalNan16) << std::hex << h;
    else
      ASSERT_EQ(back, h) << std::hex << h;
  }
}

TEST(Numerics, F16RoundTripIsExactForEveryF16) {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    float v = num::f16_to_float(static_cast<uint16_t>(h));
    uint16_t back = num::float_to_f16(v);
    if (std::isnan(v))
      ASSERT_EQ(back, num::kCanonicalNan16) << std::hex << h;
    else
      ASSERT_EQ(back, h) << std::hex << h;
  }
}

// Oracle: the nearest representable neighbour by exhaustive comparison of
// the two candidates around v (ties to the even mantissa).
TEST(Numerics, F16RoundsToNearestEvenOnRandomFloats) {
  std::mt19937 rng(7);
  for (int i = 0; i < 2000000; ++i) {
    float v = bits_float(rng());
    if (std::isnan(v)) continue;
    uint16_t got = num::float_to_f16(v);
    double x = v;
    // candidates: got and its neighbours; got must be at least as close as both
    float g = num::f16_to_float(got);
    for (int delta : {-1, 1}) {
      uint16_t n = static_cast<uint16_t>(got + delta);
      if ((n & 0x7C00u) == 0x7C00u && (n & 0x3FFu)) continue;  // NaN neighbour
      if ((got & 0x7FFFu) == 0 && delta == -1) continue;
      float nv = num::f16_to_float(n);
      if (std::isinf(g)) continue;
      double dg = std::fabs(x - g), dn = std::fabs(x - nv);
      ASSERT_LE(dg, dn) << "v=" << v << std::hex << " got=0x" << got;
      if (dg == dn) {
        ASSERT_EQ(got & 1u, 0u) << "tie not to even, v=" << v;
      }
    }
    if (std::isinf(g)) {
      ASSERT_GE(std::fabs(x), 65520.0) << v;
    }
  }
}

TEST(Numerics, Bf16RoundsToNearestEvenAndCanonicalNan) {
  EXPECT_EQ(num::float_to_bf16(bits_float(0x3F808000u)), 0x3F80);  // tie, even stays
  EXPECT_EQ(num::float_to_bf16(bits_float(0x3F818000u)), 0x3F82);  // tie, odd rounds up
  EXPECT_EQ(num::float_to_bf16(bits_float(0x3F808001u)), 0x3F81);
  EXPECT_EQ(num::float_to_bf16(bits_float(0x7F7F8000u)), 0x7F80);  // overflow to inf by RNE
  EXPECT_EQ(num::float_to_bf16(bits_float(0xFFC00001u)), 0x7FFF);  // every NaN -> 0x7FFF
  EXPECT_EQ(num::float_to_bf16(bits_float(0x7F800001u)), 0x7FFF);
  EXPECT_EQ(num::float_to_bf16(bits_float(0x00000001u)), 0x0000);  // subnormal rounds to 0
  EXPECT_EQ(num::float_to_bf16(bits_float(0x80008000u)), 0x8000);
}

// Correctly rounded reference via long double (64-bit mantissa on x86-64).
float cr_exp(float x) { return static_cast<float>(std::exp(static_cast<long double>(x))); }
float cr_sin(float x) { return static_cast<float>(std::sin(static_cast<long double>(x))); }
float cr_cos(float x) { return static_cast<float>(std::cos(static_cast<long double>(x))); }
float cr_rsqrt(float x) { return static_cast<float>(1.0L / std::sqrt(static_cast<long double>(x))); }

template <typename Fn, typename Ref>
void expect_correctly_rounded(Fn fn, Ref ref, float lo, float hi, int count, uint32_t seed, double min_fraction) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  int exact = 0, within_one_ulp = 0;
  for (int i = 0; i < count; ++i) {
    float x = dist(rng);
    float got = fn(x), want = ref(x);
    uint32_t a = float_bits(got), b = float_bits(want);
    if (a == b) ++exact;
    if ((a > b ? a - b : b - a) <= 1) ++within_one_ulp;
  }
  EXPECT_EQ(within_one_ulp, count) << "results more than 1 ulp from correctly rounded";
  EXPECT_GE(static_cast<double>(exact) / count, min_fraction);
}

TEST(Numerics, PortableExpIsCorrectlyRounded) {
  expect_correctly_rounded(num::portable_exp, cr_exp, -103.0f, 88.0f, 1000000, 1, 0.99999);
  expect_correctly_rounded(num::portable_exp, cr_exp, -1.0f, 1.0f, 1000000, 2, 0.99999);
  EXPECT_EQ(num::portable_exp(0.0f), 1.0f);
  EXPECT_TRUE(std::isinf(num::portable_exp(89.0f)));
  EXPECT_EQ(num::portable_exp(-105.0f), 0.0f);
  EXPECT_TRUE(std::isnan(num::portable_exp(std::nanf(""))));
}

TEST(Numerics, PortableSinCosAreCorrectlyRounded) {
  expect_correctly_rounded(num::portable_sin, cr_sin, -1.0f, 1.0f, 1000000, 3, 0.99999);
  expect_correctly_rounded(num::portable_cos, cr_cos, -1.0f, 1.0f, 1000000, 4, 0.99999);
  expect_correctly_rounded(num::portable_sin, cr_sin, -1000.0f, 1000.0f, 1000000, 5, 0.99999);
  expect_correctly_rounded(num::portable_cos, cr_cos, -1000.0f, 1000.0f, 1000000, 6, 0.99999);
  EXPECT_EQ(num::portable_sin(0.0f), 0.0f);
  EXPECT_EQ(num::portable_cos(0.0f), 1.0f);
  EXPECT_TRUE(std::isnan(num::portable_sin(2.0e6f)));
}

TEST(Numerics, PortableRsqrtIsCorrectlyRounded) {
  expect_correctly_rounded(num::portable_rsqrt, cr_rsqrt, 1e-6f, 1e6f, 1000000, 7, 0.99999);
  EXPECT_EQ(num::portable_rsqrt(4.0f), 0.5f);
  EXPECT_TRUE(std::isinf(num::portable_rsqrt(0.0f)));
}

}  // namespace
}  // namespace detdit
