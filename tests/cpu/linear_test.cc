// linear (docs/numerics.md 5.2, 6.2) on the CPU reference:
//  - exact-input tier: x, W, b, g are small multiples of 1/8, so every
//    product and partial sum is exact in FP32 and the expected values are
//    computed independently (double loops); this proves the indexing of the
//    forward, the chunk partials, the fold, d_W and d_b;
//  - accuracy vs an FP64 oracle on random inputs;
//  - row invariance (bitwise), repeatability, empty N / K in the backwards;
//  - validation: every bad argument is an error of the right kind and leaves
//    the outputs untouched (canary bytes).
#include <cstring>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "support/cases.h"
#include "support/test_util.h"
#include "support/test_util.h"
#include "detdit/linear.h"

namespace detdit {
namespace testing {
namespace {

// Small multiples of 1/8 in [-0.5, 0.5]: products are multiples of 1/64, and
// sums of a few hundred of them stay far below 2^24 / 64, so FP32 is exact.
void fill_eighths(HostTensor* t, int salt) {
  for (int64_t i = 0; i < t->numel(); ++i) t->set(i, static_cast<double>((i * 7 + salt * 13) % 9 - 4) / 8.0);
}

int64_t chunks_of(int64_t out_features) { return (out_features + kLinearChunkRows - 1) / kLinearChunkRows; }

struct LinearCase {
  HostTensor x, weight, bias, out, pre;
  LinearParams params() const {
    LinearParams p;
    p.x = x.view();
    p.weight = weight.view();
    p.bias = bias.view();
    p.out = out.view();
    if (pre.numel() > 0 && !pre.shape().empty()) p.pre_activation = pre.view();
    return p;
  }
};

LinearCase make_case(DType dtype, DType out_dtype, int64_t rows, int64_t in_features, int64_t out_features) {
  LinearCase c{HostTensor(dtype, {rows, in_features}), HostTensor(dtype, {out_features, in_features}),
               HostTensor(dtype, {out_features}), HostTensor(out_dtype, {rows, out_features}),
               HostTensor(DType::kF32, {rows, out_features})};
  return c;
}

TEST(LinearExact, ForwardAndBackwardOfExactInputs) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    const int64_t rows = 5, in_features = 96, out_features = 150;  // 3 chunks, the last one partial
    LinearCase c = make_case(dtype, DType::kF32, rows, in_features, out_features);
    fill_eighths(&c.x, 1);
    fill_eighths(&c.weight, 2);
    fill_eighths(&c.bias, 3);
    DETDIT_ASSERT_OK(linear_forward(c.params()));
    const std::vector<double> x = to_doubles(c.x), w = to_doubles(c.weight), b = to_doubles(c.bias);
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t n = 0; n < out_features; ++n) {
        double exact = b[n];
        for (int64_t k = 0; k < in_features; ++k) exact += x[t * in_features + k] * w[n * in_features + k];
        ASSERT_EQ(c.out.get(t * out_features + n), exact) << "out[" << t << ", " << n << "]";
        ASSERT_EQ(c.pre.get(t * out_features + n), exact) << "pre[" << t << ", " << n << "]";
      }

    HostTensor grad(DType::kF32, {rows, out_features});
    fill_eighths(&grad, 4);
    const std::vector<double> g = to_doubles(grad);
    HostTensor partials(DType::kF32, {chunks_of(out_features), rows, in_features});
    HostTensor d_x_folded(dtype, {rows, in_features}), d_x_single(dtype, {rows, in_features});
    LinearBackwardInputParams input;
    input.grad = grad.view();
    input.weight = c.weight.view();
    input.partials = partials.view();
    input.d_x = d_x_folded.view();
    DETDIT_ASSERT_OK(linear_backward_input_partials(input));
    DETDIT_ASSERT_OK(linear_fold_partials(input));
    for (int64_t chunk = 0; chunk < chunks_of(out_features); ++chunk)
      for (int64_t t = 0; t < rows; ++t)
        for (int64_t k = 0; k < in_features; ++k) {
          double exact = 0.0;
          for (int64_t n = chunk * 64; n < std::min<int64_t>(chunk * 64 + 64, out_features); ++n)
            exact += g[t * out_features + n] * w[n * in_features + k];
          ASSERT_EQ(partials.get((chunk * rows + t) * in_features + k), exact)
              << "partial[" << chunk << ", " << t << ", " << k << "]";
        }
    const std::vector<double> d_x = linear_d_x64(g, w, rows, in_features, out_features);
    for (int64_t i = 0; i < d_x_folded.numel(); ++i)
      ASSERT_EQ(d_x_folded.get(i), correctly_rounded(d_x[i], dtype)) << "d_x[" << i << "]";
    // linear_backward_input with internal scratch = partials + fold.
    input.partials = TensorView();
    input.d_x = d_x_single.view();
    DETDIT_ASSERT_OK(linear_backward_input(input));
    EXPECT_BITWISE_EQ(d_x_folded, d_x_single);

    HostTensor d_weight(dtype, {out_features, in_features}), d_bias(dtype, {out_features});
    LinearBackwardWeightParams weight_grads;
    weight_grads.grad = grad.view();
    weight_grads.x = c.x.view();
    weight_grads.d_weight = d_weight.view();
    weight_grads.d_bias = d_bias.view();
    DETDIT_ASSERT_OK(linear_backward_weight(weight_grads));
    const std::vector<double> d_w = linear_d_w64(g, x, rows, in_features, out_features);
    const std::vector<double> d_b = linear_d_b64(g, rows, out_features);
    for (int64_t i = 0; i < d_weight.numel(); ++i)
      ASSERT_EQ(d_weight.get(i), correctly_rounded(d_w[i], dtype)) << "d_weight[" << i << "]";
    for (int64_t i = 0; i < d_bias.numel(); ++i)
      ASSERT_EQ(d_bias.get(i), correctly_rounded(d_b[i], dtype)) << "d_bias[" << i << "]";
  }
}

TEST(LinearExact, SiluEpilogueAppliesToThePreActivation) {
  LinearCase c = make_case(DType::kF32, DType::kF32, 3, 32, 70);
  fill_eighths(&c.x, 5);
  fill_eighths(&c.weight, 6);
  fill_eighths(&c.bias, 7);
  LinearParams p = c.params();
  p.activation = Activation::kSilu;
  DETDIT_ASSERT_OK(linear_forward(p));
  // out = silu(pre) to within 2 FP32 ulp of the FP64 SiLU of the saved pre-activation
  for (int64_t i = 0; i < c.out.numel(); ++i) {
    const double exact = silu64(c.pre.get(i));
    EXPECT_LE(std::fabs(c.out.get(i) - exact), 2.0 * std::ldexp(1.0, -23) * std::max(std::fabs(exact), 1e-30) + 1e-45)
        << "out[" << i << "] pre " << c.pre.get(i);
  }
}

TEST(LinearAccuracy, MatchesFp64Oracle) {
  const int64_t rows = 4, in_features = 256, out_features = 300;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    LinearCase c = make_case(dtype, dtype, rows, in_features, out_features);
    fill_normal(&c.x, 11);
    fill_normal(&c.weight, 12, 0.0, 0.05);
    fill_normal(&c.bias, 13, 0.0, 0.05);
    DETDIT_ASSERT_OK(linear_forward(c.params()));
    const std::vector<double> x = to_doubles(c.x), w = to_doubles(c.weight), b = to_doubles(c.bias);
    const std::vector<double> y = linear64(x, w, b, rows, in_features, out_features);
    if (dtype == DType::kF32) {
      EXPECT_LE(relative_max_error(c.out, y), 1e-6);
    } else {
      // One bf16 rounding of an FP32 result with ~1e-7 relative error.
      EXPECT_GE(fraction_correctly_rounded(c.out, y), 0.999);
    }
    HostTensor grad = random_tensor(DType::kF32, {rows, out_features}, 14);
    const std::vector<double> g = to_doubles(grad);
    HostTensor d_x(DType::kF32, {rows, in_features}), d_weight(DType::kF32, {out_features, in_features}),
        d_bias(DType::kF32, {out_features});
    LinearBackwardInputParams input;
    input.grad = grad.view();
    input.weight = c.weight.view();
    input.d_x = d_x.view();
    DETDIT_ASSERT_OK(linear_backward_input(input));
    LinearBackwardWeightParams weight_grads;
    weight_grads.grad = grad.view();
    weight_grads.x = c.x.view();
    weight_grads.d_weight = d_weight.view();
    weight_grads.d_bias = d_bias.view();
    DETDIT_ASSERT_OK(linear_backward_weight(weight_grads));
    EXPECT_LE(relative_max_error(d_x, linear_d_x64(g, w, rows, in_features, out_features)), 1e-4);
    EXPECT_LE(relative_max_error(d_weight, linear_d_w64(g, x, rows, in_features, out_features)), 1e-4);
    EXPECT_LE(relative_max_error(d_bias, linear_d_b64(g, rows, out_features)), 1e-4);
  }
}

// Each row computed alone equals the same row inside batches of 1..9 at every
// position (rotations of a pool of 9 rows), forward and d_x.
TEST(LinearInvariance, RowsAreBitwiseIndependentOfTheBatch) {
  const int64_t pool_rows = 9, in_features = 64, out_features = 130;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    HostTensor pool = random_tensor(dtype, {pool_rows, in_features}, 21);
    HostTensor grad_pool = random_tensor(DType::kF32, {pool_rows, out_features}, 22);
    HostTensor weight = random_tensor(dtype, {out_features, in_features}, 23, 0.0, 0.1);
    HostTensor bias = random_tensor(dtype, {out_features}, 24, 0.0, 0.1);
    auto run = [&](const std::vector<int64_t>& members, HostTensor* out, HostTensor* d_x) {
      const int64_t rows = static_cast<int64_t>(members.size());
      HostTensor x(dtype, {rows, in_features}), grad(DType::kF32, {rows, out_features});
      for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(static_cast<char*>(x.data()) + r * in_features * dtype_size(dtype),
                    static_cast<char*>(pool.data()) + members[r] * in_features * dtype_size(dtype),
                    in_features * dtype_size(dtype));
        std::memcpy(grad.ptr<float>() + r * out_features, grad_pool.ptr<float>() + members[r] * out_features,
                    out_features * sizeof(float));
      }
      *out = HostTensor(dtype, {rows, out_features});
      *d_x = HostTensor(DType::kF32, {rows, in_features});
      LinearParams p;
      p.x = x.view();
      p.weight = weight.view();
      p.bias = bias.view();
      p.out = out->view();
      p.activation = Activation::kSilu;
      DETDIT_ASSERT_OK(linear_forward(p));
      LinearBackwardInputParams input;
      input.grad = grad.view();
      input.weight = weight.view();
      input.d_x = d_x->view();
      DETDIT_ASSERT_OK(linear_backward_input(input));
    };
    std::vector<HostTensor> alone_out(pool_rows), alone_d_x(pool_rows);
    for (int64_t r = 0; r < pool_rows; ++r) run({r}, &alone_out[r], &alone_d_x[r]);
    for (int64_t batch = 1; batch <= pool_rows; ++batch)
      for (int64_t rotation = 0; rotation < pool_rows; ++rotation)
        for (bool reversed : {false, true}) {
          std::vector<int64_t> members;
          for (int64_t j = 0; j < batch; ++j)
            members.push_back((rotation + (reversed ? pool_rows - j : j)) % pool_rows);
          HostTensor out, d_x;
          run(members, &out, &d_x);
          for (int64_t j = 0; j < batch; ++j) {
            SCOPED_TRACE("batch " + std::to_string(batch) + " position " + std::to_string(j) + " row " +
                         std::to_string(members[j]));
            ASSERT_TRUE(bitwise_equal_bytes(alone_out[members[j]].data(),
                                            static_cast<char*>(out.data()) + j * out_features * dtype_size(dtype),
                                            out_features, dtype));
            ASSERT_TRUE(bitwise_equal_bytes(alone_d_x[members[j]].data(), d_x.ptr<float>() + j * in_features,
                                            in_features, DType::kF32));
          }
        }
  }
}

TEST(LinearRepeatability, TwoRunsGiveTheSameBytes) {
  const int64_t rows = 7, in_features = 128, out_features = 200;
  HostTensor x = random_tensor(DType::kBF16, {rows, in_features}, 31);
  HostTensor weight = random_tensor(DType::kBF16, {out_features, in_features}, 32, 0.0, 0.1);
  HostTensor bias = random_tensor(DType::kBF16, {out_features}, 33);
  HostTensor grad = random_tensor(DType::kF32, {rows, out_features}, 34);
  std::vector<HostTensor> results[2];
  for (auto& r : results) {
    r.emplace_back(DType::kBF16, std::vector<int64_t>{rows, out_features});
    r.emplace_back(DType::kF32, std::vector<int64_t>{rows, out_features});
    r.emplace_back(DType::kBF16, std::vector<int64_t>{rows, in_features});
    r.emplace_back(DType::kBF16, std::vector<int64_t>{out_features, in_features});
    r.emplace_back(DType::kF32, std::vector<int64_t>{out_features});
    LinearParams p;
    p.x = x.view();
    p.weight = weight.view();
    p.bias = bias.view();
    p.out = r[0].view();
    p.pre_activation = r[1].view();
    p.activation = Activation::kSilu;
    DETDIT_ASSERT_OK(linear_forward(p));
    LinearBackwardInputParams input;
    input.grad = grad.view();
    input.weight = weight.view();
    input.d_x = r[2].view();
    DETDIT_ASSERT_OK(linear_backward_input(input));
    LinearBackwardWeightParams weight_grads;
    weight_grads.grad = grad.view();
    weight_grads.x = x.view();
    weight_grads.d_weight = r[3].view();
    weight_grads.d_bias = r[4].view();
    DETDIT_ASSERT_OK(linear_backward_weight(weight_grads));
  }
  for (std::size_t i = 0; i < results[0].size(); ++i) EXPECT_BITWISE_EQ(results[0][i], results[1][i]);
}

TEST(LinearEmpty, ZeroOutFeaturesGiveZeroInputGradient) {
  const int64_t rows = 3, in_features = 8;
  HostTensor grad(DType::kF32, {rows, 0}), weight(DType::kF32, {0, in_features});
  HostTensor d_x(DType::kF32, {rows, in_features});
  d_x.fill_bytes(kCanary);
  LinearBackwardInputParams input;
  input.grad = grad.view();
  input.weight = weight.view();
  input.d_x = d_x.view();
  DETDIT_ASSERT_OK(linear_backward_input(input));
  EXPECT_TRUE(all_bytes_are(d_x, 0x00)) << "d_x of N = 0 must be +0.0 everywhere";
  HostTensor d_bias(DType::kF32, {0});
  LinearBackwardWeightParams weight_grads;
  weight_grads.grad = grad.view();
  weight_grads.x = HostTensor(DType::kF32, {rows, in_features}).view();
  DETDIT_EXPECT_OK(linear_backward_weight(weight_grads));
}

TEST(LinearEmpty, ZeroInFeaturesGiveOnlyTheBiasGradient) {
  const int64_t rows = 3, out_features = 5;
  HostTensor grad = random_tensor(DType::kF32, {rows, out_features}, 41);
  HostTensor x(DType::kF32, {rows, 0}), d_weight(DType::kF32, {out_features, 0}), d_bias(DType::kF32, {out_features});
  LinearBackwardWeightParams weight_grads;
  weight_grads.grad = grad.view();
  weight_grads.x = x.view();
  weight_grads.d_weight = d_weight.view();
  weight_grads.d_bias = d_bias.view();
  DETDIT_ASSERT_OK(linear_backward_weight(weight_grads));
  for (int64_t n = 0; n < out_features; ++n) {
    float acc = 0.0f;
    for (int64_t t = 0; t < rows; ++t) acc += grad.ptr<float>()[t * out_features + n];
    EXPECT_EQ(d_bias.ptr<float>()[n], acc);
  }
}

// Order witnesses: inputs where FP32 rounding makes the result depend on the
// order of operations, with the expected value derived by hand from
// docs/numerics.md (not from the implementation).
TEST(LinearOrder, ButterflyPairsLaneLWithLaneLXor16First) {
  // fp32, K = 128: lane l owns exactly the 4 elements [4l, 4l+4); x = 1, so a
  // lane's sum is the sum of its 4 weights. Lane sums: s0 = 2^25, s1 = 2,
  // s17 = 2, all others 0.
  //   XOR butterfly: level 16 pairs (1, 17) -> 4; (0, 16) -> 2^25; later levels
  //   add zeros until level 1 adds lanes 0 and 1: 2^25 + 4, exact.
  //   An ascending sum over lanes would give rn(2^25 + 2) = 2^25 (tie to even),
  //   then rn(2^25 + 2) = 2^25 again.
  HostTensor x(DType::kF32, {1, 128}), weight(DType::kF32, {1, 128}), out(DType::kF32, {1, 1});
  for (int64_t k = 0; k < 128; ++k) x.ptr<float>()[k] = 1.0f;
  weight.ptr<float>()[0] = 33554432.0f;  // lane 0
  weight.ptr<float>()[4] = 2.0f;         // lane 1
  weight.ptr<float>()[17 * 4] = 2.0f;    // lane 17
  LinearParams p;
  p.x = x.view();
  p.weight = weight.view();
  p.out = out.view();
  DETDIT_ASSERT_OK(linear_forward(p));
  EXPECT_EQ(out.ptr<float>()[0], 33554436.0f);
}

TEST(LinearOrder, InputGradientFoldsChunksOf64Rows) {
  // N = 128, K = 4, T = 1, W = 1: g[0] = 2^25 and g[n] = 1 otherwise.
  //   chunk 0 = rn(2^25 + 1) ... = 2^25 (every +1 is lost: ulp(2^25) = 4);
  //   chunk 1 = 64; fold = 2^25 + 64, exact.
  //   One chain over all n gives 2^25; chunks of 32 give 2^25 + 96.
  HostTensor grad(DType::kF32, {1, 128}), weight(DType::kF32, {128, 4}), d_x(DType::kF32, {1, 4});
  for (int64_t n = 0; n < 128; ++n) grad.ptr<float>()[n] = n == 0 ? 33554432.0f : 1.0f;
  for (int64_t i = 0; i < weight.numel(); ++i) weight.ptr<float>()[i] = 1.0f;
  LinearBackwardInputParams p;
  p.grad = grad.view();
  p.weight = weight.view();
  p.d_x = d_x.view();
  DETDIT_ASSERT_OK(linear_backward_input(p));
  for (int64_t k = 0; k < 4; ++k) EXPECT_EQ(d_x.ptr<float>()[k], 33554496.0f) << k;
}

TEST(LinearOrder, WeightAndBiasGradientsChainAscendingT) {
  // T = 5, N = 1, K = 4, x = 1: g[0] = 2^25, g[1..4] = 1.
  //   Ascending t: rn(2^25 + 1) = 2^25 four times -> 2^25 (ulp(2^25) = 4).
  //   Descending t would give 1 + 1 + 1 + 1 = 4, then 2^25 + 4.
  HostTensor grad(DType::kF32, {5, 1}), x(DType::kF32, {5, 4}), d_weight(DType::kF32, {1, 4}), d_bias(DType::kF32, {1});
  for (int64_t t = 0; t < 5; ++t) grad.ptr<float>()[t] = t == 0 ? 33554432.0f : 1.0f;
  for (int64_t i = 0; i < x.numel(); ++i) x.ptr<float>()[i] = 1.0f;
  LinearBackwardWeightParams p;
  p.grad = grad.view();
  p.x = x.view();
  p.d_weight = d_weight.view();
  p.d_bias = d_bias.view();
  DETDIT_ASSERT_OK(linear_backward_weight(p));
  for (int64_t k = 0; k < 4; ++k) EXPECT_EQ(d_weight.ptr<float>()[k], 33554432.0f) << k;
  EXPECT_EQ(d_bias.ptr<float>()[0], 33554432.0f);
}

// ---- validation ------------------------------------------------------------

struct BadCase {
  std::string name;
  ErrorKind kind;
  std::string message_part;
  std::function<void(LinearParams*)> edit;
};

TEST(LinearValidation, ForwardRejectsBadArgumentsAndWritesNothing) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    LinearCase c = make_case(dtype, DType::kF32, 4, 64, 40);
    fill_normal(&c.x, 51);
    fill_normal(&c.weight, 52);
    fill_normal(&c.bias, 53);
    HostTensor wide(dtype, {4 * 64 + 16});  // room for a misaligned view
    HostTensor other(DType::kBF16, {40, 64}), half(DType::kF16, {4, 64});
    const int64_t width = dtype == DType::kF32 ? 4 : 8;
    HostTensor odd_x(dtype, {4, 60 + (width == 8 ? 2 : 2)}), odd_w(dtype, {40, 62});
    HostTensor strided_w(dtype, {40, 128});
    const std::vector<BadCase> cases = {
        {"x rank 3", ErrorKind::kValue, "x must be a 2-D", [&](LinearParams* p) { p->x = c.x.view_as({2, 2, 64}); }},
        {"x float16", ErrorKind::kType, "x must be float32 or bfloat16", [&](LinearParams* p) { p->x = half.view(); }},
        {"x/weight dtypes", ErrorKind::kType, "x and weight must share a dtype (cast at the declared boundary first)",
         [&](LinearParams* p) {
           if (dtype == DType::kBF16) p->weight = TensorView::contiguous(c.out.data(), DType::kF32, {40, 64});
           else p->weight = other.view();
         }},
        {"zero rows", ErrorKind::kValue, "at least one row",
         [&](LinearParams* p) { p->x = c.x.view_as({0, 64}); p->out = c.out.view_as({0, 40}); p->pre_activation = c.pre.view_as({0, 40}); }},
        {"K not a multiple of the vector width", ErrorKind::kValue, "16-byte vector load",
         [&](LinearParams* p) { p->x = odd_x.view(); p->weight = odd_w.view(); }},
        {"weight K mismatch", ErrorKind::kValue, "weight must be (N, K)",
         [&](LinearParams* p) { p->weight = c.weight.view_as({80, 32}); }},
        {"misaligned x", ErrorKind::kValue, "16-byte aligned", [&](LinearParams* p) {
           p->x = TensorView::contiguous(static_cast<char*>(wide.data()) + 4, dtype, {4, 64});
         }},
        {"non-contiguous weight", ErrorKind::kValue, "contiguous", [&](LinearParams* p) {
           p->weight = TensorView::strided(strided_w.data(), dtype, {40, 64}, {128, 1});
         }},
        {"bias shape", ErrorKind::kValue, "bias must be (N,)", [&](LinearParams* p) { p->bias = c.bias.view_as({20}); }},
        {"bias dtype", ErrorKind::kType, "bias", [&](LinearParams* p) { p->bias.dtype = dtype == DType::kF32 ? DType::kBF16 : DType::kF32; }},
        {"out shape", ErrorKind::kValue, "out must be (T, N)", [&](LinearParams* p) { p->out = c.out.view_as({40, 4}); }},
        {"out float16", ErrorKind::kType, "out", [&](LinearParams* p) { p->out.dtype = DType::kF16; }},
        {"pre_activation dtype", ErrorKind::kType, "pre_activation must be float32",
         [&](LinearParams* p) { p->pre_activation.dtype = DType::kBF16; }},
        {"unknown activation", ErrorKind::kValue, "activation", [&](LinearParams* p) { p->activation = static_cast<Activation>(7); }},
        {"out on another device", ErrorKind::kValue, "out is on cuda:0", [&](LinearParams* p) { p->out.device = Device::cuda(0); }},
        {"out aliases x", ErrorKind::kValue, "must not overlap", [&](LinearParams* p) {
           p->out = TensorView::contiguous(c.x.data(), DType::kF32, {4, 40});
         }},
        {"torch numerics on the CPU", ErrorKind::kValue, "CUDA only", [&](LinearParams* p) { p->numerics = Numerics::kTorch; }},
    };
    for (const BadCase& bad : cases) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + ": " + bad.name);
      c.out.fill_bytes(kCanary);
      c.pre.fill_bytes(kCanary);
      LinearParams p = c.params();
      bad.edit(&p);
      Status s = linear_forward(p);
      EXPECT_EQ(s.kind(), bad.kind) << s.to_string();
      EXPECT_NE(s.message().find(bad.message_part), std::string::npos) << s.to_string();
      EXPECT_TRUE(all_bytes_are(c.out, kCanary));
      EXPECT_TRUE(all_bytes_are(c.pre, kCanary));
    }
    // The unedited call works (so the cases above fail for their own reason).
    DETDIT_EXPECT_OK(linear_forward(c.params()));
  }
}

TEST(LinearValidation, BackwardRejectsBadArgumentsAndWritesNothing) {
  const int64_t rows = 3, in_features = 32, out_features = 100;
  HostTensor grad = random_tensor(DType::kF32, {rows, out_features}, 61);
  HostTensor grad_bf16 = random_tensor(DType::kBF16, {rows, out_features}, 62);
  HostTensor weight = random_tensor(DType::kBF16, {out_features, in_features}, 63);
  HostTensor x = random_tensor(DType::kBF16, {rows, in_features}, 64);
  HostTensor partials(DType::kF32, {chunks_of(out_features), rows, in_features});
  HostTensor partials_wide(DType::kF32, {chunks_of(out_features) * rows * in_features + 4});  // a view 4 bytes in
  HostTensor d_x(DType::kBF16, {rows, in_features}), d_weight(DType::kF32, {out_features, in_features}),
      d_bias(DType::kBF16, {out_features});
  auto canary = [&] {
    for (HostTensor* t : {&partials, &partials_wide, &d_x, &d_weight, &d_bias}) t->fill_bytes(kCanary);
  };
  auto untouched = [&] { return still_canary({&partials, &partials_wide, &d_x, &d_weight, &d_bias}); };
  auto input = [&] {
    LinearBackwardInputParams p;
    p.grad = grad.view();
    p.weight = weight.view();
    p.partials = partials.view();
    p.d_x = d_x.view();
    return p;
  };
  auto weights = [&] {
    LinearBackwardWeightParams p;
    p.grad = grad.view();
    p.x = x.view();
    p.d_weight = d_weight.view();
    p.d_bias = d_bias.view();
    return p;
  };
  struct InputCase {
    std::string name;
    ErrorKind kind;
    std::string part;
    std::function<void(LinearBackwardInputParams*)> edit;
  };
  const std::vector<InputCase> input_cases = {
      {"grad bfloat16", ErrorKind::kType, "grad must be float32", [&](auto* p) { p->grad = grad_bf16.view(); }},
      {"grad N mismatch", ErrorKind::kValue, "weight must be (N, K)", [&](auto* p) { p->grad = grad.view_as({5, 60}); }},
      {"zero rows", ErrorKind::kValue, "at least one row", [&](auto* p) { p->grad = grad.view_as({0, out_features}); }},
      {"partials shape", ErrorKind::kValue, "partials must be (ceil(N/64), T, K)",
       [&](auto* p) { p->partials = partials.view_as({1, 2 * rows, in_features}); }},
      {"partials dtype", ErrorKind::kType, "partials must be float32", [&](auto* p) { p->partials.dtype = DType::kBF16; }},
      {"misaligned partials", ErrorKind::kValue, "partials must be 16-byte aligned", [&](auto* p) {
         p->partials = TensorView::contiguous(static_cast<char*>(partials_wide.data()) + 4, DType::kF32,
                                              {chunks_of(out_features), rows, in_features});
       }},
      {"d_x float16", ErrorKind::kType, "d_x must be float32 or bfloat16", [&](auto* p) { p->d_x.dtype = DType::kF16; }},
      {"d_x shape", ErrorKind::kValue, "d_x must be (T, K)", [&](auto* p) { p->d_x = d_x.view_as({in_features, rows}); }},
      {"misaligned weight", ErrorKind::kValue, "16-byte aligned", [&](auto* p) {
         p->weight = TensorView::contiguous(static_cast<char*>(weight.data()) + 4, DType::kBF16, {out_features - 1, in_features});
         p->grad = grad.view_as({rows, out_features - 1});
       }},
  };
  for (const InputCase& bad : input_cases) {
    SCOPED_TRACE(bad.name);
    canary();
    LinearBackwardInputParams p = input();
    bad.edit(&p);
    Status s = linear_backward_input(p);
    EXPECT_EQ(s.kind(), bad.kind) << s.to_string();
    EXPECT_NE(s.message().find(bad.part), std::string::npos) << s.to_string();
    EXPECT_TRUE(untouched());
  }
  struct WeightCase {
    std::string name;
    ErrorKind kind;
    std::string part;
    std::function<void(LinearBackwardWeightParams*)> edit;
  };
  const std::vector<WeightCase> weight_cases = {
      {"x rows mismatch", ErrorKind::kValue, "x must be (T, K)", [&](auto* p) { p->x = x.view_as({1, 3 * in_features}); }},
      {"d_weight shape", ErrorKind::kValue, "d_weight must be (N, K)", [&](auto* p) { p->d_weight = d_weight.view_as({in_features, out_features}); }},
      {"d_bias float16", ErrorKind::kType, "d_bias must be float32 or bfloat16", [&](auto* p) { p->d_bias.dtype = DType::kF16; }},
      {"non-contiguous grad", ErrorKind::kValue, "grad must be contiguous", [&](auto* p) {
         p->grad = TensorView::strided(grad.data(), DType::kF32, {rows, out_features / 2}, {out_features, 2});
       }},
      {"zero rows", ErrorKind::kValue, "at least one row", [&](auto* p) {
         p->grad = grad.view_as({0, out_features});
         p->x = x.view_as({0, in_features});
       }},
  };
  for (const WeightCase& bad : weight_cases) {
    SCOPED_TRACE(bad.name);
    canary();
    LinearBackwardWeightParams p = weights();
    bad.edit(&p);
    Status s = linear_backward_weight(p);
    EXPECT_EQ(s.kind(), bad.kind) << s.to_string();
    EXPECT_NE(s.message().find(bad.part), std::string::npos) << s.to_string();
    EXPECT_TRUE(untouched());
  }
  DETDIT_EXPECT_OK(linear_backward_input(input()));
  DETDIT_EXPECT_OK(linear_backward_weight(weights()));
}

// linear_backward_weight_and_input: the bytes of linear_backward_input then
// linear_backward_weight, and a bad argument of either half, or an output that
// overlaps the other half's tensors, is refused before anything is written.
TEST(LinearBoth, EqualsTheTwoCallsAndRefusesBeforeWriting) {
  const int64_t rows = 5, in_features = 64, out_features = 200;
  HostTensor x = random_tensor(DType::kBF16, {rows, in_features}, 71);
  HostTensor weight = random_tensor(DType::kBF16, {out_features, in_features}, 72, 0.0, 0.1);
  HostTensor grad = random_tensor(DType::kF32, {rows, out_features}, 73);
  HostTensor partials(DType::kF32, {chunks_of(out_features), rows, in_features});
  HostTensor d_x[2] = {HostTensor(DType::kBF16, {rows, in_features}), HostTensor(DType::kBF16, {rows, in_features})};
  HostTensor d_weight[2] = {HostTensor(DType::kBF16, {out_features, in_features}),
                            HostTensor(DType::kBF16, {out_features, in_features})};
  HostTensor d_bias[2] = {HostTensor(DType::kF32, {out_features}), HostTensor(DType::kF32, {out_features})};
  // Arguments each set alone accepts, which do not describe one linear together.
  HostTensor other_grad = random_tensor(DType::kF32, {rows, out_features}, 74);
  HostTensor wide_x = random_tensor(DType::kBF16, {rows, 2 * in_features}, 75);
  HostTensor wide_d_weight(DType::kBF16, {out_features, 2 * in_features});
  auto input = [&](int i) {
    LinearBackwardInputParams p;
    p.grad = grad.view();
    p.weight = weight.view();
    p.partials = partials.view();
    p.d_x = d_x[i].view();
    return p;
  };
  auto weights = [&](int i) {
    LinearBackwardWeightParams p;
    p.grad = grad.view();
    p.x = x.view();
    p.d_weight = d_weight[i].view();
    p.d_bias = d_bias[i].view();
    return p;
  };
  DETDIT_ASSERT_OK(linear_backward_input(input(0)));
  DETDIT_ASSERT_OK(linear_backward_weight(weights(0)));
  DETDIT_ASSERT_OK(linear_backward_weight_and_input(weights(1), input(1)));
  EXPECT_BITWISE_EQ(d_x[0], d_x[1]);
  EXPECT_BITWISE_EQ(d_weight[0], d_weight[1]);
  EXPECT_BITWISE_EQ(d_bias[0], d_bias[1]);

  struct Case {
    std::string name;
    ErrorKind kind;
    std::string part;
    std::function<void(LinearBackwardWeightParams*, LinearBackwardInputParams*)> edit;
  };
  const std::vector<Case> cases = {
      {"d_weight dtype", ErrorKind::kType, "d_weight must be",
       [&](auto* w, auto*) { w->d_weight.dtype = DType::kF16; }},
      {"partials shape", ErrorKind::kValue, "partials must be (ceil(N/64), T, K)",
       [&](auto*, auto* in) { in->partials = partials.view_as({1, 2 * rows, 2 * in_features}); }},
      {"d_x absent", ErrorKind::kValue, "d_x", [&](auto*, auto* in) { in->d_x = TensorView(); }},
      {"d_bias over d_x", ErrorKind::kValue, "overlap",
       [&](auto* w, auto*) { w->d_bias = d_x[1].view_as({out_features}); }},
      {"two grads", ErrorKind::kValue, "weight_grads.grad must be input_grad.grad",
       [&](auto* w, auto*) { w->grad = other_grad.view(); }},
      {"x of another K", ErrorKind::kValue, "x must be (T, K) with weight's K",
       [&](auto* w, auto*) {
         w->x = wide_x.view();
         w->d_weight = wide_d_weight.view();
       }},
      {"d_x over grad", ErrorKind::kValue, "overlap",
       [&](auto*, auto* in) { in->d_x = grad.view_as({rows, in_features}); }},
  };
  for (const Case& bad : cases) {
    SCOPED_TRACE(bad.name);
    for (HostTensor* t : {&partials, &d_x[1], &d_weight[1], &d_bias[1]}) t->fill_bytes(kCanary);
    LinearBackwardWeightParams w = weights(1);
    LinearBackwardInputParams in = input(1);
    bad.edit(&w, &in);
    const Status s = linear_backward_weight_and_input(w, in);
    EXPECT_EQ(s.kind(), bad.kind) << s.to_string();
    EXPECT_NE(s.message().find(bad.part), std::string::npos) << s.to_string();
    EXPECT_TRUE(still_canary({&partials, &d_x[1], &d_weight[1], &d_bias[1]}));
  }
}

TEST(LinearValidation, SiluBackwardRejectsBadArguments) {
  HostTensor grad = random_tensor(DType::kF32, {4, 8}, 71), pre = random_tensor(DType::kF32, {4, 8}, 72);
  HostTensor d_pre(DType::kF32, {4, 8});
  d_pre.fill_bytes(kCanary);
  SiluBackwardParams p;
  p.grad = grad.view();
  p.pre = pre.view_as({8, 4});
  p.d_pre = d_pre.view();
  Status s = silu_backward(p);
  EXPECT_EQ(s.kind(), ErrorKind::kValue) << s.to_string();
  EXPECT_NE(s.message().find("pre must have grad's shape"), std::string::npos) << s.to_string();
  p.pre = pre.view();
  p.numerics = Numerics::kTorch;
  s = silu_backward(p);
  EXPECT_EQ(s.kind(), ErrorKind::kValue);
  EXPECT_NE(s.message().find("CUDA only"), std::string::npos) << s.to_string();
  p.numerics = Numerics::kPortable;
  p.d_pre.dtype = DType::kBF16;
  s = silu_backward(p);
  EXPECT_EQ(s.kind(), ErrorKind::kType) << s.to_string();
  EXPECT_TRUE(all_bytes_are(d_pre, kCanary));
  p.d_pre.dtype = DType::kF32;
  DETDIT_ASSERT_OK(silu_backward(p));
  // SiLU VJP vs FP64: d = g * s * (1 + z (1 - s)), a handful of FP32 roundings.
  for (int64_t i = 0; i < d_pre.numel(); ++i) {
    const double exact = grad.get(i) * silu_derivative64(pre.get(i));
    EXPECT_NEAR(d_pre.get(i), exact, 1e-6 * std::max(1.0, std::fabs(exact))) << i;
  }
}

}  // namespace
}  // namespace testing
}  // namespace detdit
