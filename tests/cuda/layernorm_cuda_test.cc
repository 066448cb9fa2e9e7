// layernorm on CUDA. Portable profile: every case of cases/layernorm_cases.cc
// (every affine variant and dtype, H from one vector to unequal thread
// shares, M around a reduction chunk, large-mean rows, grad / dx off the
// vector boundary) byte-equal to the CPU reference, forward and every
// gradient. Torch profile: its only difference is the hardware rsqrtf, so the
// CPU's formulas given the device's rstd are its bytes: mean equals the
// CPU's, rstd is within 3 ulp of the portable one (rsqrtf errs by up to 2 ulp,
// the portable rsqrt by up to 1, docs/numerics.md 4), out is the CPU
// formula of the device's (mean, rstd), and the backward (which reads the
// saved mean and rstd and calls no profile function) equals the CPU backward
// run on the device's saved statistics.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "cases/layernorm_cases.h"
#include "common/layernorm_math.h"
#include "cuda/cuda_test_util.h"
#include "support/rowwise_fixture.h"
#include "detdit/layernorm.h"

namespace detdit {
namespace testing {
namespace {

DETDIT_CUDA_OP_CASES(LayernormCaseCuda, "layernorm");

using cases::LayernormAffine;

// The distance in FP32 ulps of two positive finite floats.
int64_t ulps_apart(float a, float b) {
  return std::llabs(static_cast<int64_t>(num::float_bits(a)) - static_cast<int64_t>(num::float_bits(b)));
}

TEST(LayernormCuda, TorchProfileIsTheCpuFormulasWithTheDevicesRsqrt) {
  DETDIT_SKIP_WITHOUT_CUDA();
  const cases::LayernormShape shapes[] = {
      {DType::kBF16, 3072, 300, LayernormAffine::kNone},
      {DType::kF32, 2432, 257, LayernormAffine::kWeightBias},
      {DType::kF16, 1536, 40, LayernormAffine::kWeight, DType::kF16, 100.0},
      {DType::kBF16, 4, 3, LayernormAffine::kWeightBias, DType::kBF16},
  };
  for (const cases::LayernormShape& s : shapes) {
    OpCase c = cases::layernorm_case(s, 11);
    SCOPED_TRACE(c.full_name());
    c.numerics = Numerics::kTorch;
    Instance gpu;
    DETDIT_ASSERT_OK(instantiate(c, Device::cuda(0), nullptr, &gpu));
    DETDIT_ASSERT_OK(run(c, Phase::kForward, gpu));
    DETDIT_ASSERT_OK(run(c, Phase::kBackward, gpu));
    std::map<std::string, HostTensor> got;
    DETDIT_ASSERT_OK(download(c, gpu, &got));

    // The portable CPU run on the same inputs.
    OpCase portable = c;
    portable.numerics = Numerics::kPortable;
    CpuCase cpu(portable);
    DETDIT_ASSERT_OK(cpu.run(Phase::kForward));
    EXPECT_BITWISE_EQ(cpu["mean"], got.at("mean"));
    const int64_t h = s.hidden;
    const bool weight = s.affine != LayernormAffine::kNone, bias = s.affine == LayernormAffine::kWeightBias;
    int64_t out_diff = 0;
    for (int64_t m = 0; m < s.rows; ++m) {
      const float mean = static_cast<float>(got.at("mean").get(m)), rstd = static_cast<float>(got.at("rstd").get(m));
      EXPECT_LE(ulps_apart(rstd, static_cast<float>(cpu["rstd"].get(m))), 3) << "rstd row " << m;
      for (int64_t i = 0; i < h; ++i) {
        const float y = layernorm::normalised(static_cast<float>(got.at("x").get(m * h + i)), mean, rstd, weight,
                                              weight ? static_cast<float>(got.at("weight").get(i)) : 1.0f, bias,
                                              bias ? static_cast<float>(got.at("bias").get(i)) : 0.0f);
        out_diff += num::float_bits(round_as(y, s.dtype)) !=
                    num::float_bits(static_cast<float>(got.at("out").get(m * h + i)));
      }
    }
    EXPECT_EQ(out_diff, 0) << "out elements that differ from the CPU formula of the device's statistics";

    // The CPU backward on the device's saved mean and rstd.
    LayernormBackwardParams b;
    b.in.x = cpu.view("x");
    if (weight) b.in.weight = cpu.view("weight");
    if (bias) b.in.bias = cpu.view("bias");
    b.in.eps = 1e-6f;
    HostTensor mean = got.at("mean"), rstd = got.at("rstd"), dx(s.dtype, {s.rows, h});
    HostTensor d_weight(s.grad_dtype, {h}), d_bias(s.grad_dtype, {h});
    b.mean = mean.view();
    b.rstd = rstd.view();
    b.grad = cpu.view("grad");
    b.dx = dx.view();
    if (weight) b.d_weight = d_weight.view();
    if (bias) b.d_bias = d_bias.view();
    DETDIT_ASSERT_OK(layernorm_backward(b));
    EXPECT_BITWISE_EQ(dx, got.at("dx"));
    if (weight) {
      EXPECT_BITWISE_EQ(d_weight, got.at("d_weight"));
    }
    if (bias) {
      EXPECT_BITWISE_EQ(d_bias, got.at("d_bias"));
    }
  }
}

}  // namespace
}  // namespace testing
}  // namespace detdit
