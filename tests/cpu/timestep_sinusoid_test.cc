// timestep_sinusoid (docs/numerics.md 5.1, 6.1) on the CPU reference:
// accuracy vs an FP64 oracle (diffusers' formula in double), input dtypes,
// row invariance, repeatability, and fail-closed validation.
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
      {"odd channels", ErrorKind::kValue, "positive even number, got 7", [&](auto* p) { p->features = features.view_as({4, 7}); }},
      {"zero channels", ErrorKind::kValue, "positive even number, got 0", [&](auto* p) { p->features = features.view_as({4, 0}); }},
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
  p.grad_features = grad.view_as({4, 7});
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

}  // namespace
}  // namespace testing
}  // namespace detdit
