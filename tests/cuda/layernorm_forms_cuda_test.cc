// The modulated layernorm on CUDA in the torch profile: only rsqrt differs
// from the portable profile, so out is numerics 9.5 written out on the
// device's (mean, rstd), and the backward (no profile function) is the CPU
// backward on them (per sample, fp32 modulation, each op and upcast, H = 1032
// with weight and bias). The portable profile's forms (every form x recipe x
// affine variant, byte-equal to the CPU, forward and every gradient) are
// layernorm's op cases (cases/layernorm_cases.cc), which
// tests/cuda/layernorm_cuda_test.cc runs on the GPU against the CPU and
// tests/cpu/op_cases_test.cc against docs/numerics.md 9 written out.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cases/forms_cases.h"
#include "common/layernorm_math.h"
#include "common/scalar_math.h"
#include "cuda/cuda_test_util.h"
#include "detdit/layernorm.h"
#include "support/rowwise_fixture.h"

namespace detdit {
namespace testing {
namespace {

struct Recipe {
  DType x, mod;
  bool upcast;
};
constexpr int64_t kB = 2, kS = 300;

// Per sample (B = 2, S = 300, H = 1032, weight and bias), the each-op and the
// upcast recipes, torch profile on the device against the CPU.
TEST(LayernormFormsCuda, TorchProfileIsNumerics95OnTheDevicesStatistics) {
  DETDIT_SKIP_WITHOUT_CUDA();
  constexpr int64_t h = 1032;
  for (const Recipe& r : {Recipe{DType::kBF16, DType::kF32, false}, Recipe{DType::kBF16, DType::kF32, true}}) {
    SCOPED_TRACE(std::string("x ") + dtype_name(r.x) + " mod " + dtype_name(r.mod) + (r.upcast ? " upcast" : ""));
    // The (B, H) chunks of a (B, 6, H) parent, as the op cases view them.
    cases::FormShape shape{r.x, r.mod, h, kB, kS, ModulationForm::kPerSample};
    shape.upcast = r.upcast;
    const cases::FormGeometry geometry = cases::form_geometry(shape);
    const DType out = cases::form_out_dtype(shape), promoted = r.mod == DType::kF32 ? DType::kF32 : r.x;
    Pair x = random_pair(r.x, {kB, kS, h}, 1), w = random_pair(r.x, {h}, 2, 1.0, 0.1);
    Pair b = random_pair(r.x, {h}, 5, 0.0, 0.1), parent = random_pair(r.mod, geometry.parent_shape(), 3, 0.0, 0.5);
    Pair grad = random_pair(out, {kB, kS, h}, 4), y = output_pair(out, {kB, kS, h});
    Pair mean = output_pair(DType::kF32, {kB * kS}), rstd = output_pair(DType::kF32, {kB * kS});
    Pair dx = output_pair(r.x, {kB, kS, h}), d_weight = output_pair(DType::kF32, {h});
    Pair d_bias = output_pair(DType::kF32, {h}), d_shift = output_pair(DType::kF32, {kB, h});
    Pair d_scale = output_pair(DType::kF32, {kB, h});
    auto inputs = [&](bool gpu) {
      auto v = [&](const Pair& p) { return gpu ? p.d() : p.h(); };
      LayernormInputs in;
      in.x = v(x);
      in.weight = v(w);
      in.bias = v(b);
      in.shift = geometry.chunk(v(parent), 0);
      in.scale = geometry.chunk(v(parent), 1);
      in.eps = 1e-6f;
      in.upcast = r.upcast;
      in.numerics = gpu ? Numerics::kTorch : Numerics::kPortable;
      return in;
    };
    const LayernormInputs dev = inputs(true);
    DETDIT_ASSERT_OK(layernorm_forward({dev, y.d(), mean.d(), rstd.d()}));
    DETDIT_ASSERT_OK(layernorm_backward(
        {dev, mean.d(), rstd.d(), grad.d(), dx.d(), d_weight.d(), d_bias.d(), d_shift.d(), d_scale.d()}));
    const HostTensor got_mean = mean.result(), got_rstd = rstd.result(), got_out = y.result();
    int64_t out_diff = 0;
    for (int64_t p = 0; p < kB * kS; ++p) {
      const float mu = got_mean.ptr<float>()[p], rs = got_rstd.ptr<float>()[p];
      for (int64_t i = 0; i < h; ++i) {
        const float v = layernorm::normalised(static_cast<float>(x.host.get(p * h + i)), mu, rs, true,
                                              static_cast<float>(w.host.get(i)), true,
                                              static_cast<float>(b.host.get(i)));
        const int64_t row = (p / kS) * 6 * h;  // sample p / S of the (B, 6, H) parent
        const float scale = static_cast<float>(parent.host.get(row + h + i));
        const float shift = static_cast<float>(parent.host.get(row + i));
        const float n = r.upcast ? v : round_as(v, r.x);
        const float t1 = r.upcast ? num::add32(1.0f, scale) : round_as(num::add32(1.0f, scale), r.mod);
        const float u = r.upcast ? num::mul32(n, t1) : round_as(num::mul32(n, t1), promoted);
        out_diff += num::float_bits(round_as(num::add32(u, shift), out)) !=
                    num::float_bits(static_cast<float>(got_out.get(p * h + i)));
      }
    }
    EXPECT_EQ(out_diff, 0) << "out elements that differ from numerics 9.5 on the device's statistics";
    // The CPU backward (portable; the backward calls no profile function) on the device's statistics.
    HostTensor cpu_mean = got_mean, cpu_rstd = got_rstd;
    DETDIT_ASSERT_OK(layernorm_backward({inputs(false), cpu_mean.view(), cpu_rstd.view(), grad.h(), dx.h(),
                                         d_weight.h(), d_bias.h(), d_shift.h(), d_scale.h()}));
    EXPECT_GPU_EQ_CPU(dx);
    EXPECT_GPU_EQ_CPU(d_weight);
    EXPECT_GPU_EQ_CPU(d_bias);
    EXPECT_GPU_EQ_CPU(d_shift);
    EXPECT_GPU_EQ_CPU(d_scale);
  }
}

}  // namespace
}  // namespace testing
}  // namespace detdit
