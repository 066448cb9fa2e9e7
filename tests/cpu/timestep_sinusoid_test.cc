// timestep_sinusoid (docs/numerics.md 5.1, 6.1) on the CPU reference:
// accuracy vs an FP64 oracle (diffusers' formula in double), input dtypes,
// row invariance, repeatability, the conventions of the DiT families (flip,
// shift, scale, odd C, t_max) and fail-closed validation.
#include <cstring>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "support/cases.h"
#include "support/test_util.h"
#include "detdit/timestep.h"

namespace detdit {
namespace testing {
namespace {

// T timesteps in [0, 1]: 0 and 1 first, then uniform.
HostTensor timesteps_of(DType dtype, int64_t count, uint64_t seed) {
  HostTensor t(dtype, {count});
  fill_uniform(&t, seed, 0.0, 1.0);
  t.set(0, 0.0);
  if (count > 1) t.set(1, 1.0);
  return t;
}

Status run_forward(const HostTensor& timesteps, HostTensor* features, float max_period = 10000.0f) {
  TimestepSinusoidParams p;
  p.in.timesteps = timesteps.view();
  p.features = features->view();
  p.in.max_period = max_period;
  return timestep_sinusoid_forward(p);
}

Status run_backward(const HostTensor& timesteps, const HostTensor& grad, HostTensor* d_t) {
  TimestepSinusoidBackwardParams p;
  p.in.timesteps = timesteps.view();
  p.grad_features = grad.view();
  p.d_timesteps = d_t->view();
  return timestep_sinusoid_backward(p);
}

TEST(TimestepSinusoidAccuracy, WithinTwoToTheMinus23OfFp64) {
  double worst = 0.0;
  for (int64_t count : {1, 2, 3, 7, 64, 1000})
    for (int64_t channels : {2, 8, 96, 256, 320}) {
      SCOPED_TRACE("T " + std::to_string(count) + " C " + std::to_string(channels));
      HostTensor timesteps = timesteps_of(DType::kF32, count, 100 + count);
      HostTensor features(DType::kF32, {count, channels});
      DETDIT_ASSERT_OK(run_forward(timesteps, &features));
      const std::vector<double> ref = sinusoid64(to_doubles(timesteps), channels, 10000.0);
      worst = std::max(worst, max_abs_error(features, ref));
      EXPECT_LE(max_abs_error(features, ref), std::ldexp(1.0, -23));
    }
  std::printf("[ measured ] features max abs error vs FP64: %.3g (2^-23 = %.3g)\n", worst, std::ldexp(1.0, -23));
}

TEST(TimestepSinusoidAccuracy, OtherMaxPeriods) {
  HostTensor timesteps = timesteps_of(DType::kF32, 16, 7);
  for (float max_period : {1.0f, 2.5f, 10000.0f, 1.0e6f}) {
    SCOPED_TRACE(max_period);
    HostTensor features(DType::kF32, {16, 64});
    DETDIT_ASSERT_OK(run_forward(timesteps, &features, max_period));
    EXPECT_LE(max_abs_error(features, sinusoid64(to_doubles(timesteps), 64, max_period)), std::ldexp(1.0, -23));
  }
}

TEST(TimestepSinusoidAccuracy, GradientWithinAtol1em4) {
  for (int64_t channels : {8, 256}) {
    SCOPED_TRACE(channels);
    const int64_t count = 7;
    HostTensor timesteps = timesteps_of(DType::kF32, count, 3);
    HostTensor grad = random_tensor(DType::kF32, {count, channels}, 4);
    HostTensor d_t(DType::kF32, {count});
    DETDIT_ASSERT_OK(run_backward(timesteps, grad, &d_t));
    const std::vector<double> ref = sinusoid_d_t64(to_doubles(timesteps), to_doubles(grad), channels, 10000.0);
    EXPECT_LE(max_abs_error(d_t, ref), 1e-4);
  }
}

// bf16 / fp16 timesteps are upcast exactly first: the features equal those of
// the same values given as fp32, and d_t is the fp32 d_t rounded once.
TEST(TimestepSinusoidDtypes, HalfTimestepsEqualTheirFp32Upcast) {
  const int64_t count = 9, channels = 256;
  HostTensor grad = random_tensor(DType::kF32, {count, channels}, 5);
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    HostTensor half = timesteps_of(dtype, count, 6), as_f32(DType::kF32, {count});
    for (int64_t i = 0; i < count; ++i) as_f32.set(i, half.get(i));
    HostTensor features_half(DType::kF32, {count, channels}), features_f32(DType::kF32, {count, channels});
    DETDIT_ASSERT_OK(run_forward(half, &features_half));
    DETDIT_ASSERT_OK(run_forward(as_f32, &features_f32));
    EXPECT_BITWISE_EQ(features_f32, features_half);
    HostTensor d_half(dtype, {count}), d_f32(DType::kF32, {count}), d_rounded(dtype, {count});
    DETDIT_ASSERT_OK(run_backward(half, grad, &d_half));
    DETDIT_ASSERT_OK(run_backward(as_f32, grad, &d_f32));
    for (int64_t i = 0; i < count; ++i) d_rounded.set(i, d_f32.get(i));
    EXPECT_BITWISE_EQ(d_rounded, d_half);
  }
}

TEST(TimestepSinusoidInvariance, RowsAreBitwiseIndependentOfTheBatch) {
  const int64_t pool = 9, channels = 96;
  HostTensor pool_t = timesteps_of(DType::kF32, pool, 8);
  HostTensor pool_g = random_tensor(DType::kF32, {pool, channels}, 9);
  auto run = [&](const std::vector<int64_t>& members, HostTensor* features, HostTensor* d_t) {
    const int64_t count = static_cast<int64_t>(members.size());
    HostTensor t(DType::kF32, {count}), g(DType::kF32, {count, channels});
    for (int64_t j = 0; j < count; ++j) {
      t.ptr<float>()[j] = pool_t.ptr<float>()[members[j]];
      std::memcpy(g.ptr<float>() + j * channels, pool_g.ptr<float>() + members[j] * channels, channels * sizeof(float));
    }
    *features = HostTensor(DType::kF32, {count, channels});
    *d_t = HostTensor(DType::kF32, {count});
    DETDIT_ASSERT_OK(run_forward(t, features));
    DETDIT_ASSERT_OK(run_backward(t, g, d_t));
  };
  std::vector<HostTensor> alone_features(pool), alone_d_t(pool);
  for (int64_t r = 0; r < pool; ++r) run({r}, &alone_features[r], &alone_d_t[r]);
  for (int64_t batch = 1; batch <= pool; ++batch)
    for (int64_t rotation = 0; rotation < pool; ++rotation)
      for (bool reversed : {false, true}) {
        std::vector<int64_t> members;
        for (int64_t j = 0; j < batch; ++j) members.push_back((rotation + (reversed ? pool - j : j)) % pool);
        HostTensor features, d_t;
        run(members, &features, &d_t);
        for (int64_t j = 0; j < batch; ++j) {
          SCOPED_TRACE("batch " + std::to_string(batch) + " position " + std::to_string(j));
          ASSERT_TRUE(bitwise_equal_bytes(alone_features[members[j]].data(), features.ptr<float>() + j * channels,
                                          channels, DType::kF32));
          ASSERT_TRUE(bitwise_equal_bytes(alone_d_t[members[j]].data(), d_t.ptr<float>() + j, 1, DType::kF32));
        }
      }
}

TEST(TimestepSinusoidRepeatability, TwoRunsGiveTheSameBytes) {
  HostTensor timesteps = timesteps_of(DType::kF32, 64, 10);
  HostTensor grad = random_tensor(DType::kF32, {64, 256}, 11);
  HostTensor features[2] = {HostTensor(DType::kF32, {64, 256}), HostTensor(DType::kF32, {64, 256})};
  HostTensor d_t[2] = {HostTensor(DType::kF32, {64}), HostTensor(DType::kF32, {64})};
  for (int i = 0; i < 2; ++i) {
    DETDIT_ASSERT_OK(run_forward(timesteps, &features[i]));
    DETDIT_ASSERT_OK(run_backward(timesteps, grad, &d_t[i]));
  }
  EXPECT_BITWISE_EQ(features[0], features[1]);
  EXPECT_BITWISE_EQ(d_t[0], d_t[1]);
}

TEST(TimestepSinusoidValidation, BadTimestepValuesAreValueErrors) {
  const float kNan = std::numeric_limits<float>::quiet_NaN(), kInf = std::numeric_limits<float>::infinity();
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16})
    for (float bad : {kNan, kInf, -kInf, -0.1f, 1.5f, 1000.0f}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " " + std::to_string(bad));
      HostTensor timesteps = timesteps_of(dtype, 5, 12);
      timesteps.set(3, bad);
      HostTensor features(DType::kF32, {5, 8}), grad = random_tensor(DType::kF32, {5, 8}, 13), d_t(dtype, {5});
      features.fill_bytes(kCanary);
      d_t.fill_bytes(kCanary);
      Status s = run_forward(timesteps, &features);
      EXPECT_EQ(s.kind(), ErrorKind::kValue) << s.to_string();
      EXPECT_NE(s.message().find("timestep must be finite and lie in [0, 1]: detdit consumes t = 1 - sigma unscaled"),
                std::string::npos)
          << s.to_string();
      EXPECT_NE(s.message().find("timesteps[3] = "), std::string::npos) << s.to_string();
      s = run_backward(timesteps, grad, &d_t);
      EXPECT_EQ(s.kind(), ErrorKind::kValue) << s.to_string();
      EXPECT_TRUE(all_bytes_are(features, kCanary));
      EXPECT_TRUE(all_bytes_are(d_t, kCanary));
    }
}

// check_range = false is the explicit opt-out for pre-validated timesteps (no
// host read, so a CUDA graph can capture the op): it skips the value check and
// changes nothing else.
TEST(TimestepSinusoidValidation, CheckRangeFalseSkipsOnlyTheValueCheck) {
  HostTensor timesteps = timesteps_of(DType::kF32, 5, 12);
  HostTensor checked(DType::kF32, {5, 8}), unchecked(DType::kF32, {5, 8});
  DETDIT_ASSERT_OK(run_forward(timesteps, &checked));
  TimestepSinusoidParams p;
  p.in.timesteps = timesteps.view();
  p.features = unchecked.view();
  p.in.check_range = false;
  DETDIT_ASSERT_OK(timestep_sinusoid_forward(p));
  EXPECT_BITWISE_EQ(checked, unchecked);
  timesteps.set(3, 1.5);
  EXPECT_EQ(run_forward(timesteps, &checked).kind(), ErrorKind::kValue);
  DETDIT_EXPECT_OK(timestep_sinusoid_forward(p));
  p.features.dtype = DType::kBF16;  // every other check still runs
  EXPECT_EQ(timestep_sinusoid_forward(p).kind(), ErrorKind::kType);
}

TEST(TimestepSinusoidValidation, BadArgumentsAreErrorsAndWriteNothing) {
  HostTensor timesteps = timesteps_of(DType::kF32, 4, 14), ints(DType::kI32, {4});
  HostTensor features(DType::kF32, {4, 8}), wide(DType::kF32, {4, 16});
  struct Case {
    std::string name;
    ErrorKind kind;
    std::string part;
    std::function<void(TimestepSinusoidParams*)> edit;
  };
  const std::vector<Case> cases = {
      {"timesteps 2-D", ErrorKind::kValue, "timesteps must be 1-D (num_timesteps,)",
       [&](auto* p) { p->in.timesteps = timesteps.view_as({2, 2}); }},
      {"no timesteps", ErrorKind::kValue, "at least one timestep", [&](auto* p) {
         p->in.timesteps = timesteps.view_as({0});
         p->features = features.view_as({0, 8});
       }},
      {"int32 timesteps", ErrorKind::kType, "timesteps must be float32, bfloat16 or float16",
       [&](auto* p) { p->in.timesteps = ints.view(); }},
      {"non-contiguous timesteps", ErrorKind::kValue, "timesteps must be contiguous", [&](auto* p) {
         p->in.timesteps = TensorView::strided(timesteps.data(), DType::kF32, {2}, {2});
         p->features = features.view_as({2, 16});
       }},
      {"zero channels", ErrorKind::kValue, "(num_channels) must be positive, got 0", [&](auto* p) { p->features = features.view_as({4, 0}); }},
      {"features bfloat16", ErrorKind::kType, "features must be float32", [&](auto* p) { p->features.dtype = DType::kBF16; }},
      {"features rows", ErrorKind::kValue, "features must be (T, C)", [&](auto* p) { p->features = features.view_as({2, 16}); }},
      {"non-contiguous features", ErrorKind::kValue, "features must be contiguous", [&](auto* p) {
         p->features = TensorView::strided(wide.data(), DType::kF32, {4, 8}, {16, 1});
       }},
      {"max_period below 1", ErrorKind::kValue, "max_period must be finite and >= 1", [&](auto* p) { p->in.max_period = 0.5f; }},
      {"max_period inf", ErrorKind::kValue, "max_period must be finite",
       [&](auto* p) { p->in.max_period = std::numeric_limits<float>::infinity(); }},
      {"features on cuda", ErrorKind::kValue, "features is on cuda:0", [&](auto* p) { p->features.device = Device::cuda(0); }},
      {"torch numerics on the CPU", ErrorKind::kValue, "CUDA only", [&](auto* p) { p->in.numerics = Numerics::kTorch; }},
  };
  for (const Case& bad : cases) {
    SCOPED_TRACE(bad.name);
    features.fill_bytes(kCanary);
    wide.fill_bytes(kCanary);
    TimestepSinusoidParams p;
    p.in.timesteps = timesteps.view();
    p.features = features.view();
    bad.edit(&p);
    Status s = timestep_sinusoid_forward(p);
    EXPECT_EQ(s.kind(), bad.kind) << s.to_string();
    EXPECT_NE(s.message().find(bad.part), std::string::npos) << s.to_string();
    EXPECT_TRUE(all_bytes_are(features, kCanary));
    EXPECT_TRUE(all_bytes_are(wide, kCanary));
  }
  // backward-specific arguments
  HostTensor grad = random_tensor(DType::kF32, {4, 8}, 15), d_t(DType::kF32, {4}), d_t_bf16(DType::kBF16, {4});
  d_t.fill_bytes(kCanary);
  d_t_bf16.fill_bytes(kCanary);
  TimestepSinusoidBackwardParams p;
  p.in.timesteps = timesteps.view();
  p.grad_features = grad.view();
  p.d_timesteps = d_t_bf16.view();
  Status s = timestep_sinusoid_backward(p);
  EXPECT_EQ(s.kind(), ErrorKind::kType) << s.to_string();
  EXPECT_NE(s.message().find("d_timesteps must have timesteps's dtype"), std::string::npos) << s.to_string();
  p.d_timesteps = d_t.view();
  p.grad_features = grad.view_as({4, 0});
  s = timestep_sinusoid_backward(p);
  EXPECT_EQ(s.kind(), ErrorKind::kValue) << s.to_string();
  p.grad_features = grad.view();
  p.in.numerics = Numerics::kTorch;
  s = timestep_sinusoid_backward(p);
  EXPECT_NE(s.message().find("CUDA only"), std::string::npos) << s.to_string();
  EXPECT_TRUE(all_bytes_are(d_t, kCanary));
  EXPECT_TRUE(all_bytes_are(d_t_bf16, kCanary));
  p.in.numerics = Numerics::kPortable;
  DETDIT_EXPECT_OK(timestep_sinusoid_backward(p));
}

// ---- the conventions of the DiT families -----------------------------------------

// H3's inputs with one convention's arguments.
struct Convention {
  bool flip = true;
  float shift = 0.0f, scale = 1.0f, t_max = 1.0f;
  void apply(TimestepSinusoidInputs* in) const {
    in->flip_sin_to_cos = flip;
    in->downscale_freq_shift = shift;
    in->scale = scale;
    in->t_max = t_max;
  }
};

Status run_forward(const HostTensor& timesteps, HostTensor* features, const Convention& conv) {
  TimestepSinusoidParams p;
  p.in.timesteps = timesteps.view();
  conv.apply(&p.in);
  p.features = features->view();
  return timestep_sinusoid_forward(p);
}

Status run_backward(const HostTensor& timesteps, const HostTensor& grad, HostTensor* d_t, const Convention& conv) {
  TimestepSinusoidBackwardParams p;
  p.in.timesteps = timesteps.view();
  conv.apply(&p.in);
  p.grad_features = grad.view();
  p.d_timesteps = d_t->view();
  return timestep_sinusoid_backward(p);
}

HostTensor timesteps_up_to(double t_max, int64_t count, uint64_t seed) {
  HostTensor t(DType::kF32, {count});
  fill_uniform(&t, seed, 0.0, t_max);
  t.set(0, 0.0);
  if (count > 1) t.set(1, t_max);
  return t;
}

// The defaults are H3's: spelling them out changes no bit.
TEST(TimestepSinusoidConventions, ExplicitDefaultsEqualH3Bitwise) {
  HostTensor timesteps = timesteps_of(DType::kF32, 33, 20), grad = random_tensor(DType::kF32, {33, 256}, 21);
  HostTensor h3(DType::kF32, {33, 256}), spelled(DType::kF32, {33, 256}), d_h3(DType::kF32, {33}),
      d_spelled(DType::kF32, {33});
  DETDIT_ASSERT_OK(run_forward(timesteps, &h3));
  DETDIT_ASSERT_OK(run_backward(timesteps, grad, &d_h3));
  const Convention defaults{true, 0.0f, 1.0f, 1.0f};
  DETDIT_ASSERT_OK(run_forward(timesteps, &spelled, defaults));
  DETDIT_ASSERT_OK(run_backward(timesteps, grad, &d_spelled, defaults));
  EXPECT_BITWISE_EQ(h3, spelled);
  EXPECT_BITWISE_EQ(d_h3, d_spelled);
  // t_max only bounds the check: a larger bound gives the same bits for the same t
  DETDIT_ASSERT_OK(run_forward(timesteps, &spelled, Convention{true, 0.0f, 1.0f, 1000.0f}));
  EXPECT_BITWISE_EQ(h3, spelled);
}

// flip_sin_to_cos = false is the same row with its halves swapped, forward
// and backward (the gradient's halves swapped alike).
TEST(TimestepSinusoidConventions, SinFirstIsTheRowWithItsHalvesSwapped) {
  const int64_t count = 17, channels = 96, half = 48;
  HostTensor timesteps = timesteps_up_to(1000.0, count, 22), grad = random_tensor(DType::kF32, {count, channels}, 23);
  HostTensor swapped_grad(DType::kF32, {count, channels});
  for (int64_t r = 0; r < count; ++r)
    for (int64_t j = 0; j < channels; ++j) swapped_grad.set(r * channels + (j + half) % channels, grad.get(r * channels + j));
  const Convention cos_first{true, 0.0f, 1.0f, 1000.0f}, sin_first{false, 0.0f, 1.0f, 1000.0f};
  HostTensor a(DType::kF32, {count, channels}), b(DType::kF32, {count, channels}), d_a(DType::kF32, {count}),
      d_b(DType::kF32, {count});
  DETDIT_ASSERT_OK(run_forward(timesteps, &a, cos_first));
  DETDIT_ASSERT_OK(run_forward(timesteps, &b, sin_first));
  DETDIT_ASSERT_OK(run_backward(timesteps, grad, &d_a, cos_first));
  DETDIT_ASSERT_OK(run_backward(timesteps, swapped_grad, &d_b, sin_first));
  for (int64_t r = 0; r < count; ++r)
    ASSERT_TRUE(bitwise_equal_bytes(a.ptr<float>() + r * channels, b.ptr<float>() + r * channels + half, half,
                                    DType::kF32) &&
                bitwise_equal_bytes(a.ptr<float>() + r * channels + half, b.ptr<float>() + r * channels, half,
                                    DType::kF32))
        << "row " << r;
  EXPECT_BITWISE_EQ(d_a, d_b);
}

// An odd C is the even C - 1 row plus one +0.0 column whose gradient is never read.
TEST(TimestepSinusoidConventions, OddChannelsPadOneZeroColumn) {
  const int64_t count = 9;
  for (int64_t channels : {1, 7, 255}) {
    SCOPED_TRACE(channels);
    HostTensor timesteps = timesteps_up_to(1000.0, count, 24);
    HostTensor odd(DType::kF32, {count, channels}), even(DType::kF32, {count, channels - 1});
    const Convention conv{true, 0.0f, 1.0f, 1000.0f};
    DETDIT_ASSERT_OK(run_forward(timesteps, &odd, conv));
    if (channels > 1) DETDIT_ASSERT_OK(run_forward(timesteps, &even, conv));
    HostTensor grad = random_tensor(DType::kF32, {count, channels}, 25), grad_even(DType::kF32, {count, channels - 1});
    for (int64_t r = 0; r < count; ++r) {
      EXPECT_EQ(std::signbit(odd.get(r * channels + channels - 1)), false);
      EXPECT_EQ(odd.get(r * channels + channels - 1), 0.0);
      for (int64_t j = 0; j + 1 < channels; ++j) {
        EXPECT_EQ(std::memcmp(odd.ptr<float>() + r * channels + j, even.ptr<float>() + r * (channels - 1) + j, 4), 0);
        grad_even.set(r * (channels - 1) + j, grad.get(r * channels + j));
      }
      grad.set(r * channels + channels - 1, std::numeric_limits<double>::quiet_NaN());  // never read
    }
    HostTensor d_odd(DType::kF32, {count}), d_even(DType::kF32, {count});
    DETDIT_ASSERT_OK(run_backward(timesteps, grad, &d_odd, conv));
    if (channels == 1) {
      for (int64_t r = 0; r < count; ++r) EXPECT_EQ(d_odd.get(r), 0.0);  // no frequency
      continue;
    }
    DETDIT_ASSERT_OK(run_backward(timesteps, grad_even, &d_even, conv));
    EXPECT_BITWISE_EQ(d_even, d_odd);
  }
}

// The conventions against diffusers' formula in FP64: the features within
// 2^-23 + |scale| t_max 2^-21 (cases/timestep_cases.cc says why), d_t within
// the same relative argument error carried through every term.
TEST(TimestepSinusoidConventions, WithinTheirBoundOfFp64) {
  struct Named {
    const char* name;
    Convention conv;
    int64_t channels;
  };
  const Named conventions[] = {{"sigma*1000", {true, 0.0f, 1.0f, 1000.0f}, 256},
                               {"scale=1000", {true, 0.0f, 1000.0f, 1.0f}, 256},
                               {"C=1920", {true, 0.0f, 1.0f, 1000.0f}, 1920},
                               {"sin|cos shift=1 odd", {false, 1.0f, 1.0f, 1000.0f}, 65},
                               {"shift=0.5", {true, 0.5f, 1.0f, 1.0f}, 64}};
  for (const Named& n : conventions) {
    SCOPED_TRACE(n.name);
    const int64_t count = 32, channels = n.channels, half = channels / 2;
    HostTensor timesteps = timesteps_up_to(n.conv.t_max, count, 26);
    HostTensor features(DType::kF32, {count, channels}), grad = random_tensor(DType::kF32, {count, channels}, 27);
    HostTensor d_t(DType::kF32, {count});
    DETDIT_ASSERT_OK(run_forward(timesteps, &features, n.conv));
    DETDIT_ASSERT_OK(run_backward(timesteps, grad, &d_t, n.conv));
    SinusoidOracle64 o;
    o.flip_sin_to_cos = n.conv.flip;
    o.downscale_freq_shift = n.conv.shift;
    o.scale = n.conv.scale;
    const double reach = std::fabs(static_cast<double>(n.conv.scale) * n.conv.t_max);  // max |arg|
    const double arg_error = std::ldexp(1.0, -23) + reach * std::ldexp(1.0, -21);
    EXPECT_LE(max_abs_error(features, sinusoid64(to_doubles(timesteps), channels, o)), arg_error);
    // d_t: each term scale freq g trig(arg) moves by at most |scale freq g| (arg_error + 2^-22),
    // plus the chain's roundings (one 2^-24 relative per step of a sum of |terms|)
    const std::vector<double> ref = sinusoid_d_t64(to_doubles(timesteps), to_doubles(grad), channels, o);
    const std::vector<double> freq = sinusoid_frequencies64(half, 10000.0, n.conv.shift);
    for (int64_t r = 0; r < count; ++r) {
      double weight = 0.0;
      for (int64_t k = 0; k < half; ++k)
        weight += std::fabs(n.conv.scale * freq[k]) *
                  (std::fabs(grad.get(r * channels + k)) + std::fabs(grad.get(r * channels + half + k)));
      const double bound = weight * (arg_error + std::ldexp(1.0, -22) + half * std::ldexp(1.0, -23));
      EXPECT_LE(std::fabs(d_t.get(r) - ref[r]), bound) << "row " << r;
    }
  }
}

TEST(TimestepSinusoidValidation, EachConventionRefusesValuesOutsideItsBound) {
  const float kNan = std::numeric_limits<float>::quiet_NaN(), kInf = std::numeric_limits<float>::infinity();
  for (DType dtype : {DType::kF32, DType::kBF16})
    for (float bad : {kNan, kInf, -kInf, -0.5f, 1008.0f, 5000.0f}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " " + std::to_string(bad));
      HostTensor timesteps(dtype, {5});
      for (int64_t i = 0; i < 5; ++i) timesteps.set(i, 200.0 * i);  // 0 .. 800, then 1000 at index 4
      timesteps.set(4, 1000.0);
      HostTensor features(DType::kF32, {5, 8}), grad = random_tensor(DType::kF32, {5, 8}, 28), d_t(dtype, {5});
      const Convention conv{true, 0.0f, 1.0f, 1000.0f};
      DETDIT_ASSERT_OK(run_forward(timesteps, &features, conv));  // 1000 itself lies inside
      timesteps.set(2, bad);
      features.fill_bytes(kCanary);
      d_t.fill_bytes(kCanary);
      Status s = run_forward(timesteps, &features, conv);
      EXPECT_EQ(s.kind(), ErrorKind::kValue) << s.to_string();
      EXPECT_NE(s.message().find("timestep must be finite and lie in [0, t_max] = [0, 1000] (got timesteps[2] = "),
                std::string::npos)
          << s.to_string();
      s = run_backward(timesteps, grad, &d_t, conv);
      EXPECT_EQ(s.kind(), ErrorKind::kValue) << s.to_string();
      EXPECT_TRUE(all_bytes_are(features, kCanary));
      EXPECT_TRUE(all_bytes_are(d_t, kCanary));
    }
}

TEST(TimestepSinusoidValidation, BadConventionScalarsAreValueErrors) {
  HostTensor timesteps = timesteps_of(DType::kF32, 4, 29), features(DType::kF32, {4, 9});
  const float kNan = std::numeric_limits<float>::quiet_NaN(), kInf = std::numeric_limits<float>::infinity();
  struct Case {
    const char* name;
    Convention conv;
    std::string part;
  };
  const std::vector<Case> cases = {
      {"shift = half", {true, 4.0f, 1.0f, 1.0f}, "downscale_freq_shift must be finite and less than half = "
                                                 "num_channels // 2 = 4, got 4"},
      {"shift above half", {true, 7.5f, 1.0f, 1.0f}, "less than half = num_channels // 2 = 4, got 7.5"},
      {"shift NaN", {true, kNan, 1.0f, 1.0f}, "downscale_freq_shift must be finite"},
      {"scale inf", {true, 0.0f, kInf, 1.0f}, "scale must be finite, got inf"},
      {"t_max zero", {true, 0.0f, 1.0f, 0.0f}, "t_max (the timesteps' upper bound) must be finite and positive, got 0"},
      {"t_max NaN", {true, 0.0f, 1.0f, kNan}, "t_max (the timesteps' upper bound) must be finite and positive"},
      {"t_max inf", {true, 0.0f, 1.0f, kInf}, "t_max (the timesteps' upper bound) must be finite and positive"},
      {"argument beyond 1e6", {true, 0.0f, 1000.0f, 1001.0f},
       "|scale| * t_max = 1001000 exceeds 1e6, the largest sinusoid argument the portable sin/cos evaluate exactly "
       "(scale = 1000, t_max = 1001)"},
      {"negative scale beyond 1e6", {true, 0.0f, -2.0f, 600000.0f}, "|scale| * t_max = 1200000 exceeds 1e6"},
  };
  for (const Case& bad : cases) {
    SCOPED_TRACE(bad.name);
    for (bool check_range : {true, false}) {  // the scalars are checked without the host read too
      features.fill_bytes(kCanary);
      TimestepSinusoidParams p;
      p.in.timesteps = timesteps.view();
      p.in.check_range = check_range;
      bad.conv.apply(&p.in);
      p.features = features.view();
      const Status s = timestep_sinusoid_forward(p);
      EXPECT_EQ(s.kind(), ErrorKind::kValue) << s.to_string();
      EXPECT_NE(s.message().find(bad.part), std::string::npos) << s.to_string();
      EXPECT_TRUE(all_bytes_are(features, kCanary));
    }
  }
  // the edges that pass: |scale| t_max = 1e6 exactly, a shift just below half, C = 1 with any finite shift
  HostTensor zeros(DType::kF32, {4});
  DETDIT_EXPECT_OK(run_forward(zeros, &features, Convention{true, 0.0f, -1000.0f, 1000.0f}));
  DETDIT_EXPECT_OK(run_forward(timesteps, &features, Convention{true, 3.5f, 1.0f, 1.0f}));
  HostTensor one(DType::kF32, {4, 1});
  DETDIT_EXPECT_OK(run_forward(timesteps, &one, Convention{true, 5.0f, 1.0f, 1.0f}));
}

}  // namespace
}  // namespace testing
}  // namespace detdit
