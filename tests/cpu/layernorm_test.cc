// layernorm, CPU reference through the public API: accuracy against the FP64
// oracle of cases/oracle.h within stated tolerances; a second, independent
// emulation of PyTorch's vectorized kernels written here from their source
// (32-lane arrays with __shfl_down_sync's out-of-range rule, the shared-memory
// halving steps, the dx kernel's BlockReduceSum), bitwise against mean, rstd,
// out and dx; the d_weight / d_bias canonical reduction by hand, bitwise;
// exact properties (constant rows, row invariance, repeatability); and
// fail-closed validation (clear errors, canary-filled outputs untouched).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "cases/layernorm_cases.h"
#include "cases/oracle.h"
#include "support/cases.h"
#include "support/rowwise_fixture.h"
#include "support/test_util.h"
#include "detdit/layernorm.h"

namespace detdit {
namespace testing {
namespace {

using cases::LayernormAffine;
using cases::LayernormShape;

OpCase ln_case(DType dtype, int64_t hidden, int64_t rows, LayernormAffine affine, double x_mean = 0.0) {
  return cases::layernorm_case(LayernormShape{dtype, hidden, rows, affine, DType::kF32, x_mean}, 7);
}

bool has_weight(LayernormAffine a) { return a != LayernormAffine::kNone; }
bool has_bias(LayernormAffine a) { return a == LayernormAffine::kWeightBias; }

// ---- accuracy against FP64 -------------------------------------------------------

// out within the rounding to T of the exact value plus the FP32 statistics;
// mean / rstd FP32 within 1e-5 relative; dx and the parameter gradients (FP32
// sums of FP32 terms, dx stored in T) within these (atol, rtol).
TEST(Layernorm, MatchesTheFp64ReferenceWithinTolerance) {
  for (DType dtype : {DType::kF32, DType::kBF16})
    for (LayernormAffine affine : {LayernormAffine::kNone, LayernormAffine::kWeight, LayernormAffine::kWeightBias})
      for (const auto& [hidden, rows] : {std::pair<int64_t, int64_t>{68, 300}, {3072, 4}}) {
        SCOPED_TRACE(std::string(dtype_name(dtype)) + " " + cases::affine_name(affine) + " H=" + std::to_string(hidden));
        CpuCase k(ln_case(dtype, hidden, rows, affine));
        DETDIT_ASSERT_OK(k.run());
        const cases::LayernormReference ref =
            cases::layernorm_reference(k["x"], has_weight(affine) ? &k["weight"] : nullptr,
                                       has_bias(affine) ? &k["bias"] : nullptr, k["grad"], 1e-6, dtype);
        const bool f32 = dtype == DType::kF32;
        EXPECT_TRUE(within_tolerance(k["out"], ref.out, f32 ? 1e-5 : 2e-2, f32 ? 1e-5 : 8e-3)) << "out";
        EXPECT_TRUE(within_tolerance(k["mean"], ref.mean, 1e-6, 1e-5)) << "mean";
        EXPECT_TRUE(within_tolerance(k["rstd"], ref.rstd, 0, 1e-5)) << "rstd";
        EXPECT_TRUE(within_tolerance(k["dx"], ref.dx, f32 ? 1e-5 : 2e-2, f32 ? 1e-4 : 8e-3)) << "dx";
        if (has_weight(affine)) {
          EXPECT_TRUE(within_tolerance(k["d_weight"], ref.d_weight, 1e-3, 1e-4)) << "d_weight";
        }
        if (has_bias(affine)) {
          EXPECT_TRUE(within_tolerance(k["d_bias"], ref.d_bias, 1e-3, 1e-4)) << "d_bias";
        }
      }
}

// Rows with mean 1000 and spread 3 (bf16 x): Welford's statistics keep the
// variance (a sum-of-squares formula would cancel it away).
TEST(Layernorm, LargeMeanRowsKeepTheirVariance) {
  CpuCase k(ln_case(DType::kF32, 1536, 6, LayernormAffine::kNone, 1000.0));
  DETDIT_ASSERT_OK(k.run());
  const cases::LayernormReference ref = cases::layernorm_reference(k["x"], nullptr, nullptr, k["grad"], 1e-6, DType::kF32);
  EXPECT_TRUE(within_tolerance(k["rstd"], ref.rstd, 0, 1e-4));
  EXPECT_TRUE(within_tolerance(k["out"], ref.out, 1e-3, 1e-3));
}

// ---- a second emulation of PyTorch's kernels, bitwise --------------------------------
// Written from PyTorch's source (layer_norm_kernel.cu, block_reduce.cuh) with
// every lane of every warp simulated: __shfl_down_sync gives a lane whose
// source is past lane 31 its own value; the shared-memory steps run as the
// source's loop over offsets 2, 1. Plain float arithmetic (this file is built
// with -ffp-contract=off); std::fmaf where nvcc contracts the source's a*b + c.

struct W {
  float mean, m2, count;
};
// cuWelfordOnlineSum.
W online(W c, float v) {
  const float delta = v - c.mean;
  const float new_count = c.count + 1.f;
  const float new_mean = std::fmaf(delta, 1.f / new_count, c.mean);
  return {new_mean, std::fmaf(delta, v - new_mean, c.m2), new_count};
}
// cuWelfordCombine(dataB, dataA).
W combine(W b, W a) {
  const float delta = b.mean - a.mean;
  const float count = a.count + b.count;
  if (!(count > 0.f)) return {0.f, 0.f, count};
  const float coef = 1.f / count;
  const float na = a.count * coef, nb = b.count * coef;
  return {std::fmaf(na, a.mean, nb * b.mean), std::fmaf(delta * delta * a.count, nb, a.m2 + b.m2), count};
}
// One warp's WarpReduce with every lane: lane l <- op(lane l, lane l + off or itself).
template <typename V, typename Op>
V warp_reduce(std::vector<V> lane, Op op) {
  for (int off = 16; off > 0; off /= 2) {
    std::vector<V> next(32);
    for (int l = 0; l < 32; ++l) next[l] = op(lane[l], l + off < 32 ? lane[l + off] : lane[l]);
    lane = next;
  }
  return lane[0];
}

struct Stats {
  float mean, rstd;
};
// vectorized_layer_norm_kernel's compute_stats with block (32, 4), then the
// portable rsqrt (1 / sqrt in FP64, one rounding).
Stats pytorch_stats(const std::vector<float>& x, float eps) {
  const int n = static_cast<int>(x.size()), n_vec = n / 4;
  W warp_result[4];
  for (int y = 0; y < 4; ++y) {
    std::vector<W> lanes(32);
    for (int lx = 0; lx < 32; ++lx) {
      W wd{0.f, 0.f, 0.f};
      for (int i = lx + 32 * y; i < n_vec; i += 128)
        for (int ii = 0; ii < 4; ++ii) wd = online(wd, x[4 * i + ii]);
      lanes[lx] = wd;
    }
    warp_result[y] = warp_reduce(lanes, combine);
  }
  for (int offset = 2; offset > 0; offset /= 2) {
    W buf[2];
    for (int y = offset; y < 2 * offset; ++y) buf[y - offset] = warp_result[y];
    for (int y = 0; y < offset; ++y) warp_result[y] = combine(warp_result[y], buf[y]);
  }
  const float var = warp_result[0].m2 / static_cast<float>(n);
  return {warp_result[0].mean, static_cast<float>(1.0 / std::sqrt(static_cast<double>(var + eps)))};
}
// cuda_utils::BlockReduceSum over 128 threads (4 warps).
float block_reduce_sum(const std::vector<float>& val) {
  auto add = [](float a, float b) { return a + b; };
  std::vector<float> shared(4);
  for (int w = 0; w < 4; ++w) shared[w] = warp_reduce(std::vector<float>(val.begin() + 32 * w, val.begin() + 32 * w + 32), add);
  std::vector<float> lane(32, 0.f);
  for (int l = 0; l < 4; ++l) lane[l] = shared[l];
  return warp_reduce(lane, add);
}
// layer_norm_grad_input_kernel_vectorized's dX row (gamma 1 when absent).
std::vector<float> pytorch_dx(const std::vector<float>& x, const std::vector<float>& dy, const std::vector<float>& gamma,
                              float mean, float rstd) {
  const int n = static_cast<int>(x.size());
  std::vector<float> s1(128), s2(128);
  for (int t = 0; t < 128; ++t) {
    float x1 = 0.f, x2 = 0.f;
    for (int l = 4 * t; l + 3 < n; l += 128 * 4)
      for (int k = 0; k < 4; ++k) {
        const float g = gamma[l + k], c_h = x[l + k], c_loss = dy[l + k];
        const float loss_gamma = c_loss * g;  // one rounded product feeds both sums
        x1 += loss_gamma;
        x2 = std::fmaf(loss_gamma * (c_h - mean), rstd, x2);
      }
    s1[t] = x1;
    s2[t] = x2;
  }
  const float stats_x1 = block_reduce_sum(s1), stats_x2 = block_reduce_sum(s2);
  const float fH = static_cast<float>(n), term1 = (1.f / fH) * rstd;
  std::vector<float> dx(n);
  for (int l = 0; l < n; ++l) {
    float f = std::fmaf(fH * gamma[l], dy[l], -((x[l] - mean) * rstd * stats_x2));
    f -= stats_x1;
    f *= term1;
    dx[l] = f;
  }
  return dx;
}

std::vector<float> row_values(const HostTensor& t, int64_t row, int64_t hidden) {
  std::vector<float> v(hidden);
  for (int64_t i = 0; i < hidden; ++i) v[i] = static_cast<float>(t.get(row * hidden + i));
  return v;
}

TEST(Layernorm, EqualsAnIndependentEmulationOfPyTorchsKernelsBitwise) {
  struct Shape {
    DType dtype;
    int64_t hidden, rows;
    LayernormAffine affine;
    double x_mean;
  };
  // H = 4: one thread holds the row, the others are empty (the combine runs
  // literally); 2432: threads with 5 and 4 vectors; 3072 / 5120: equal shares.
  const Shape shapes[] = {{DType::kBF16, 4, 3, LayernormAffine::kNone, 0.0},
                          {DType::kF32, 2432, 3, LayernormAffine::kWeightBias, 0.0},
                          {DType::kBF16, 3072, 2, LayernormAffine::kWeight, 100.0},
                          {DType::kF16, 5120, 2, LayernormAffine::kWeightBias, 0.0},
                          {DType::kF32, 68, 5, LayernormAffine::kNone, 1000.0}};
  for (const Shape& s : shapes) {
    SCOPED_TRACE(std::string(dtype_name(s.dtype)) + " H=" + std::to_string(s.hidden) + " " +
                 cases::affine_name(s.affine));
    CpuCase k(ln_case(s.dtype, s.hidden, s.rows, s.affine, s.x_mean));
    DETDIT_ASSERT_OK(k.run());
    const int64_t h = s.hidden;
    std::vector<float> gamma(h, 1.f), beta(h, 0.f);
    if (has_weight(s.affine)) gamma = row_values(k["weight"], 0, h);
    if (has_bias(s.affine)) beta = row_values(k["bias"], 0, h);
    for (int64_t m = 0; m < s.rows; ++m) {
      const std::vector<float> x = row_values(k["x"], m, h), dy = row_values(k["grad"], m, h);
      const Stats st = pytorch_stats(x, 1e-6f);
      EXPECT_EQ(num::float_bits(st.mean), num::float_bits(static_cast<float>(k["mean"].get(m)))) << "mean row " << m;
      EXPECT_EQ(num::float_bits(st.rstd), num::float_bits(static_cast<float>(k["rstd"].get(m)))) << "rstd row " << m;
      const std::vector<float> dx = pytorch_dx(x, dy, gamma, st.mean, st.rstd);
      int out_diff = 0, dx_diff = 0;
      for (int64_t i = 0; i < h; ++i) {
        const float p = st.rstd * (x[i] - st.mean);
        const float y = !has_weight(s.affine) ? p : has_bias(s.affine) ? std::fmaf(gamma[i], p, beta[i]) : gamma[i] * p;
        out_diff += num::float_bits(round_as(y, s.dtype)) != num::float_bits(static_cast<float>(k["out"].get(m * h + i)));
        dx_diff += num::float_bits(round_as(dx[i], s.dtype)) != num::float_bits(static_cast<float>(k["dx"].get(m * h + i)));
      }
      EXPECT_EQ(out_diff, 0) << "out elements that differ, row " << m;
      EXPECT_EQ(dx_diff, 0) << "dx elements that differ, row " << m;
    }
  }
}

// d_weight and d_bias: chunks of 256 positions, each an ascending chain from
// +0.0 (fma(g, rn(rn(x - mean) * rstd), acc) and rn(acc + g)), folded
// ascending from +0.0 and rounded once to the output dtype; by hand, bitwise.
TEST(Layernorm, ParameterGradientsAreTheCanonicalChunkedReduction) {
  for (DType grad_dtype : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(dtype_name(grad_dtype));
    CpuCase k(cases::layernorm_case({DType::kBF16, 20, 600, LayernormAffine::kWeightBias, grad_dtype}, 3));
    DETDIT_ASSERT_OK(k.run());
    const int64_t h = 20, rows = 600;
    for (int64_t i = 0; i < h; ++i) {
      float fold_w = 0.f, fold_b = 0.f;
      for (int64_t c = 0; c * 256 < rows; ++c) {
        float acc_w = 0.f, acc_b = 0.f;
        for (int64_t p = 256 * c; p < std::min<int64_t>(rows, 256 * c + 256); ++p) {
          const float g = static_cast<float>(k["grad"].get(p * h + i)), x = static_cast<float>(k["x"].get(p * h + i));
          const float mean = static_cast<float>(k["mean"].get(p)), rstd = static_cast<float>(k["rstd"].get(p));
          acc_w = std::fmaf(g, (x - mean) * rstd, acc_w);
          acc_b = acc_b + g;
        }
        fold_w += acc_w;
        fold_b += acc_b;
      }
      EXPECT_EQ(num::float_bits(round_as(fold_w, grad_dtype)), num::float_bits(static_cast<float>(k["d_weight"].get(i))))
          << "d_weight " << i;
      EXPECT_EQ(num::float_bits(round_as(fold_b, grad_dtype)), num::float_bits(static_cast<float>(k["d_bias"].get(i))))
          << "d_bias " << i;
    }
  }
}

// ---- exact properties ------------------------------------------------------------------

// A constant row c (H = 4: one thread; H = 1024: every count a power of two, so
// every reciprocal is exact): mean = c, var = 0, rstd = rsqrt_P(eps), out = +0.0.
TEST(Layernorm, ConstantRowsNormaliseToZero) {
  for (int64_t hidden : {4, 1024}) {
    SCOPED_TRACE("H=" + std::to_string(hidden));
    const OpCase c = ln_case(DType::kF32, hidden, 2, LayernormAffine::kNone);
    std::map<std::string, HostTensor> inputs;
    make_inputs(c, &inputs);
    for (int64_t i = 0; i < inputs.at("x").numel(); ++i) inputs.at("x").set(i, i < hidden ? 2.75 : -0.1);
    CpuCase k(c, &inputs);
    DETDIT_ASSERT_OK(k.run(Phase::kForward));
    EXPECT_EQ(num::float_bits(static_cast<float>(k["mean"].get(0))), num::float_bits(2.75f));
    EXPECT_EQ(num::float_bits(static_cast<float>(k["mean"].get(1))), num::float_bits(-0.1f));
    for (int64_t m = 0; m < 2; ++m)
      EXPECT_EQ(num::float_bits(static_cast<float>(k["rstd"].get(m))),
                num::float_bits(static_cast<float>(1.0 / std::sqrt(static_cast<double>(1e-6f)))));
    for (int64_t i = 0; i < 2 * hidden; ++i) EXPECT_EQ(num::float_bits(static_cast<float>(k["out"].get(i))), 0u) << i;
  }
}

// Row p computed alone gives the bytes it has inside a batch (out, mean, rstd, dx).
TEST(Layernorm, RowLocalOutputsAreInvariantToTheBatch) {
  for (LayernormAffine affine : {LayernormAffine::kNone, LayernormAffine::kWeightBias}) {
    SCOPED_TRACE(cases::affine_name(affine));
    EXPECT_TRUE(positions_alone_match(ln_case(DType::kBF16, 68, 300, affine), {0, 255, 256, 299}));
  }
}

TEST(Layernorm, RepeatsBitwise) {
  EXPECT_TRUE(repeats_bitwise(ln_case(DType::kBF16, 2432, 260, LayernormAffine::kWeightBias)));
}

// ---- fail-closed validation --------------------------------------------------------------

struct Ln : CpuCase {
  Ln() : CpuCase(ln_case(DType::kBF16, 16, 32, LayernormAffine::kWeightBias)) {}
  LayernormInputs inputs() const {
    LayernormInputs in;
    in.x = view("x");
    in.weight = view("weight");
    in.bias = view("bias");
    in.eps = 1e-6f;
    return in;
  }
  LayernormParams forward_params() const { return {inputs(), view("out"), view("mean"), view("rstd")}; }
  LayernormBackwardParams backward_params() const {
    return {inputs(), view("mean"), view("rstd"), view("grad"), view("dx"), view("d_weight"), view("d_bias")};
  }
};

TEST(Layernorm, BadArgumentsAreRefusedAndWriteNothing) {
  using Bad = BadParams<LayernormParams, LayernormBackwardParams>;
  const std::vector<Bad> cases = {
      {"x dtype", ErrorKind::kType, "x must be float32, bfloat16 or float16, got int32",
       [](LayernormParams* f, LayernormBackwardParams* b) { f->in.x.dtype = b->in.x.dtype = DType::kI32; }},
      {"H % 4", ErrorKind::kValue, "H=14 must be a multiple of 4 and at most 2^24 (PyTorch's vectorized LayerNorm path)",
       [](LayernormParams* f, LayernormBackwardParams* b) { f->in.x = b->in.x = f->in.x.reshaped({36, 14}); }},
      {"misaligned x", ErrorKind::kValue, "x must be 8-byte aligned (PyTorch's vectorized LayerNorm path)",
       [](LayernormParams* f, LayernormBackwardParams* b) {
         f->in.x.data = static_cast<char*>(f->in.x.data) + 2;
         b->in.x = f->in.x;
       }},
      {"weight dtype", ErrorKind::kType, "weight must have x's dtype bfloat16, got float32",
       [](LayernormParams* f, LayernormBackwardParams* b) { f->in.weight.dtype = b->in.weight.dtype = DType::kF32; }},
      {"weight shape", ErrorKind::kValue, "weight must be (H,) = (16,)",
       [](LayernormParams* f, LayernormBackwardParams* b) { f->in.weight.shape[0] = b->in.weight.shape[0] = 12; }},
      {"misaligned bias", ErrorKind::kValue, "bias must be 8-byte aligned",
       [](LayernormParams* f, LayernormBackwardParams* b) {
         f->in.bias.data = static_cast<char*>(f->in.bias.data) + 2;
         b->in.bias = f->in.bias;
       }},
      {"bias without weight", ErrorKind::kValue, "bias needs weight",
       [](LayernormParams* f, LayernormBackwardParams* b) {
         f->in.weight = b->in.weight = b->d_weight = TensorView();
       }},
      {"eps", ErrorKind::kValue, "eps must be finite and > 0",
       [](LayernormParams* f, LayernormBackwardParams* b) { f->in.eps = b->in.eps = -1.0f; }},
      {"empty x", ErrorKind::kValue, "x must be non-empty",
       [](LayernormParams* f, LayernormBackwardParams* b) { f->in.x.shape[0] = b->in.x.shape[0] = 0; }},
      {"weight on cuda", ErrorKind::kValue, "weight is on cuda:0, x is on cpu",
       [](LayernormParams* f, LayernormBackwardParams* b) { f->in.weight.device = b->in.weight.device = Device::cuda(0); }},
      {"torch profile on cpu", ErrorKind::kValue, "numerics=torch exists on CUDA only",
       [](LayernormParams* f, LayernormBackwardParams* b) { f->in.numerics = b->in.numerics = Numerics::kTorch; }},
      {"rstd shape", ErrorKind::kValue, "rstd must be (M,) = (32,)",
       [](LayernormParams* f, LayernormBackwardParams* b) { f->rstd.shape[0] = b->rstd.shape[0] = 31; }},
      {"mean dtype", ErrorKind::kType, "mean must be float32, got bfloat16",
       [](LayernormParams* f, LayernormBackwardParams* b) { f->mean.dtype = b->mean.dtype = DType::kBF16; }},
  };
  expect_bad_params_refused<Ln>(cases, layernorm_forward, layernorm_backward);
}

TEST(Layernorm, ForwardOnlyErrorsWriteNothing) {
  Ln k;
  LayernormParams f = k.forward_params();
  f.out.data = static_cast<char*>(f.out.data) + 2;
  EXPECT_TRUE(refused(layernorm_forward(f), ErrorKind::kValue, "out must be 8-byte aligned"));
  f = k.forward_params();
  f.out.shape[1] = 8;
  EXPECT_TRUE(refused(layernorm_forward(f), ErrorKind::kValue, "out must have x's shape (32, 16)"));
  EXPECT_TRUE(still_canary(k.outputs()));
}

TEST(Layernorm, BackwardOnlyErrorsWriteNothing) {
  Ln k;
  DETDIT_ASSERT_OK(k.run(Phase::kForward));
  struct Case {
    ErrorKind kind;
    const char* message;
    void (*mutate)(LayernormBackwardParams*);
  };
  const Case cases[] = {
      {ErrorKind::kValue, "mean is required", [](LayernormBackwardParams* b) { b->mean = TensorView(); }},
      {ErrorKind::kValue, "rstd is required", [](LayernormBackwardParams* b) { b->rstd = TensorView(); }},
      {ErrorKind::kValue, "grad must have x's shape", [](LayernormBackwardParams* b) { b->grad.shape[1] = 8; }},
      {ErrorKind::kType, "d_weight must be float32 or bfloat16, got float16",
       [](LayernormBackwardParams* b) { b->d_weight.dtype = DType::kF16; }},
      {ErrorKind::kValue, "d_bias must be (H,) = (16,)", [](LayernormBackwardParams* b) { b->d_bias.shape[0] = 15; }},
      {ErrorKind::kValue, "dx must not overlap grad", [](LayernormBackwardParams* b) { b->dx.data = b->grad.data; }},
      {ErrorKind::kValue, "d_bias needs bias", [](LayernormBackwardParams* b) { b->in.bias = TensorView(); }},
  };
  for (const Case& bad : cases) {
    SCOPED_TRACE(bad.message);
    LayernormBackwardParams b = k.backward_params();
    bad.mutate(&b);
    EXPECT_TRUE(refused(layernorm_backward(b), bad.kind, bad.message));
    HostTensor dx = k.current("dx"), d_weight = k.current("d_weight"), d_bias = k.current("d_bias");
    EXPECT_TRUE(still_canary({&dx, &d_weight, &d_bias}));
  }
}

}  // namespace
}  // namespace testing
}  // namespace detdit
