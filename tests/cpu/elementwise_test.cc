// The internal elementwise helpers (src/common/elementwise.h) on the CPU:
// add is R_T(rn(a + b)) (docs/numerics.md 5.10) bitwise, for every float dtype,
// against an independent computation (the host's native FP32 addition, then a
// round-to-nearest-even to the 16-bit format written here from the format's
// parameters, with overflow to inf and the canonical NaN), on random values
// over a wide exponent range and on the special values; in place (out = a or
// out = b); copy_tensor copies bytes; fill_zero writes +0.0.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "support/cases.h"
#include "common/backends.h"
#include "common/scalar_math.h"
#include "support/test_util.h"

namespace detdit {
namespace {

using testing::HostTensor;

// Round-to-nearest-even of a finite or infinite FP32 value to a binary format
// with `digits` significand bits, minimum normal exponent emin and maximum
// exponent emax, by scaling with the spacing of v's binade (exact in FP64) and
// nearbyint (the host's RNE): subnormals keep the spacing of emin, and a
// rounded magnitude of 2^(emax+1) or more is an overflow to inf.
double round_to_format(float v, int digits, int emin, int emax) {
  if (std::isinf(v) || v == 0.0f) return v;
  const int exponent = std::max(std::ilogb(v), emin);
  const double spacing = std::ldexp(1.0, exponent - digits + 1);
  const double rounded = std::nearbyint(static_cast<double>(v) / spacing) * spacing;
  if (std::fabs(rounded) >= std::ldexp(1.0, emax + 1)) return std::copysign(std::numeric_limits<double>::infinity(), v);
  return std::copysign(rounded, v);
}

// The expected bytes of R_T(rn(a + b)) for element i.
void set_expected(HostTensor* expected, int64_t i, float a, float b) {
  const float sum = a + b;  // the host's IEEE FP32 addition (-ffp-contract=off)
  switch (expected->dtype()) {
    case DType::kF32: expected->ptr<float>()[i] = sum; return;
    case DType::kBF16:
    case DType::kF16: {
      if (std::isnan(sum)) {
        expected->ptr<uint16_t>()[i] = num::kCanonicalNan16;
        return;
      }
      const bool bf16 = expected->dtype() == DType::kBF16;
      // exactly representable in the format, so set()'s encoding decides nothing
      expected->set(i, bf16 ? round_to_format(sum, 8, -126, 127) : round_to_format(sum, 11, -14, 15));
      return;
    }
    default: FAIL() << "not a float dtype";
  }
}

struct Format {
  double max_finite, min_subnormal;
  int min_exponent, max_exponent;  // of the random values
};
Format format_of(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return {3.3895313892515355e38, 0x1.0p-133, -130, 126};
    case DType::kF16: return {65504.0, 0x1.0p-24, -24, 15};
    default: return {std::numeric_limits<float>::max(), 0x1.0p-149, -149, 127};
  }
}

// a and b: special pairs first, then random values whose exponents are near
// each other (rounding, ties, cancellation) or far apart, over the format's range.
void fill_inputs(HostTensor* a, HostTensor* b, uint64_t seed) {
  const Format f = format_of(a->dtype());
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<std::pair<double, double>> specials = {
      {0.0, 0.0}, {-0.0, -0.0}, {-0.0, 0.0}, {0.0, -0.0}, {inf, -inf}, {inf, inf}, {-inf, 1.0}, {nan, 1.0},
      {1.0, nan}, {f.max_finite, f.max_finite}, {-f.max_finite, -f.max_finite}, {f.max_finite, -f.max_finite},
      {f.min_subnormal, f.min_subnormal}, {f.min_subnormal, -f.min_subnormal}, {1.0, f.min_subnormal},
      {1.0, 0x1.0p-8}, {1.0, 0x1.8p-8}, {1.0, 0x1.0p-11}, {1.0, 0x1.8p-11}, {1.0, 0x1.0p-24}, {1.0, 0x1.8p-24}};
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> mantissa(1.0, 2.0);
  std::uniform_int_distribution<int> exponent(f.min_exponent, f.max_exponent), near(-12, 12), coin(0, 1);
  for (int64_t i = 0; i < a->numel(); ++i) {
    if (i < static_cast<int64_t>(specials.size())) {
      a->set(i, specials[i].first);
      b->set(i, specials[i].second);
      continue;
    }
    const int ea = exponent(rng);
    const int eb = coin(rng) ? std::clamp(ea + near(rng), f.min_exponent, f.max_exponent) : exponent(rng);
    a->set(i, (coin(rng) ? -1 : 1) * std::ldexp(mantissa(rng), ea));
    b->set(i, (coin(rng) ? -1 : 1) * std::ldexp(mantissa(rng), eb));
  }
}

constexpr int64_t kElements = 20011;  // odd: no dtype's vector width divides it

TEST(Elementwise, AddIsTheRoundedFp32SumInEveryDtype) {
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    HostTensor a(dtype, {kElements}), b(dtype, {kElements}), out(dtype, {kElements}), expected(dtype, {kElements});
    fill_inputs(&a, &b, 7);
    for (int64_t i = 0; i < kElements; ++i) set_expected(&expected, i, static_cast<float>(a.get(i)), static_cast<float>(b.get(i)));
    out.fill_bytes(0xA5);
    DETDIT_ASSERT_OK(cpu::add(a.view(), b.view(), out.view(), nullptr));
    EXPECT_BITWISE_EQ(expected, out);
    // the inputs reach every outcome class: some sums overflow, some are NaN, some are exact zeros
    int64_t infinities = 0, nans = 0, zeros = 0;
    for (int64_t i = 0; i < kElements; ++i) {
      const double v = expected.get(i);
      infinities += std::isinf(v) ? 1 : 0;
      nans += std::isnan(v) ? 1 : 0;
      zeros += v == 0.0 ? 1 : 0;
    }
    EXPECT_GT(infinities, 0);
    EXPECT_GT(nans, 0);
    EXPECT_GT(zeros, 0);
  }
}

// The chain accumulates in place: out = a and out = b give the same bytes.
TEST(Elementwise, AddInPlaceEqualsOutOfPlace) {
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    HostTensor a(dtype, {kElements}), b(dtype, {kElements}), out(dtype, {kElements});
    fill_inputs(&a, &b, 8);
    DETDIT_ASSERT_OK(cpu::add(a.view(), b.view(), out.view(), nullptr));
    HostTensor in_a = testing::clone(a), in_b = testing::clone(b);
    DETDIT_ASSERT_OK(cpu::add(in_a.view(), b.view(), in_a.view(), nullptr));
    DETDIT_ASSERT_OK(cpu::add(a.view(), in_b.view(), in_b.view(), nullptr));
    EXPECT_BITWISE_EQ(out, in_a);
    EXPECT_BITWISE_EQ(out, in_b);
  }
}

TEST(Elementwise, CopyTensorCopiesBytesAndFillZeroWritesPositiveZeros) {
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    HostTensor a(dtype, {kElements}), b(dtype, {kElements}), copy(dtype, {kElements});
    fill_inputs(&a, &b, 9);
    copy.fill_bytes(0xA5);
    DETDIT_ASSERT_OK(cpu::copy_tensor(a.view(), copy.view(), nullptr));
    EXPECT_BITWISE_EQ(a, copy);
    DETDIT_ASSERT_OK(cpu::fill_zero(copy.view(), nullptr));
    EXPECT_TRUE(testing::all_bytes_are(copy, 0));
    for (int64_t i = 0; i < kElements; ++i) ASSERT_FALSE(std::signbit(copy.get(i))) << i;
  }
}

}  // namespace
}  // namespace detdit
