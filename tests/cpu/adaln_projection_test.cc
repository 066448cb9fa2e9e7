// adaln_projection (docs/numerics.md 5.4, 6.4) and adaln_table_chunk on the
// CPU reference: accuracy at the real H3 shape vs an FP64 oracle, gradients,
// row invariance, repeatability, the bf16 grad_table path, validation.
#include <cstring>
#include <gtest/gtest.h>

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "support/cases.h"
#include "support/test_util.h"
#include "support/test_util.h"
#include "detdit/adaln.h"

namespace detdit {
namespace testing {
namespace {

struct Projection {
  int64_t rows, in_features, out_features;
  DType dtype;
  HostTensor temb, weight, bias, table, act;
  Projection(int64_t t, int64_t d, int64_t n, DType w_dtype, uint64_t seed)
      : rows(t), in_features(d), out_features(n), dtype(w_dtype), temb(DType::kF32, {t, d}),
        weight(w_dtype, {n, d}), bias(w_dtype, {n}), table(w_dtype, {t, n}), act(w_dtype, {t, d}) {
    fill_approx_normal(&temb, seed, 0.0, 1.0);
    fill_approx_normal(&weight, seed + 1, 0.0, 0.02);
    fill_approx_normal(&bias, seed + 2, 0.0, 0.02);
  }
  AdalnProjectionParams forward() const {
    AdalnProjectionParams p;
    p.in.temb = temb.view();
    p.in.weight = weight.view();
    p.in.bias = bias.view();
    p.table = table.view();
    p.act = act.view();
    return p;
  }
};

struct ProjectionGrads {
  HostTensor grad, d_temb, d_weight, d_bias;
  ProjectionGrads(const Projection& p, DType grad_dtype, uint64_t seed)
      : grad(grad_dtype, {p.rows, p.out_features}), d_temb(DType::kF32, {p.rows, p.in_features}),
        d_weight(p.dtype, {p.out_features, p.in_features}), d_bias(p.dtype, {p.out_features}) {
    fill_approx_normal(&grad, seed, 0.0, 1.0);
  }
  AdalnProjectionBackwardParams params(const Projection& p) const {
    AdalnProjectionBackwardParams b;
    b.in.temb = p.temb.view();
    b.in.weight = p.weight.view();
    b.act = p.act.view();
    b.grad_table = grad.view();
    b.d_temb = d_temb.view();
    b.d_weight = d_weight.view();
    b.d_bias = d_bias.view();
    return b;
  }
};

// The oracle's act: SiLU in FP64, rounded once to bf16 (straight-through: the
// backward treats the rounding as the identity).
std::vector<double> oracle_act(const HostTensor& temb, DType dtype) {
  std::vector<double> act(static_cast<std::size_t>(temb.numel()));
  for (int64_t i = 0; i < temb.numel(); ++i) act[i] = correctly_rounded(silu64(temb.get(i)), dtype);
  return act;
}

// H3: N = 18 * 5376 = 96768, D = 2688, T = 4; weights ~ N(0, 0.02) in bf16,
// temb ~ N(0, 1) (approximately normal, cases/tensor.h).
TEST(AdalnProjectionAccuracy, H3ShapeIsCorrectlyRoundedAtLeast99_98Percent) {
  Projection p(4, 2688, 18 * 5376, DType::kBF16, 77);
  DETDIT_ASSERT_OK(adaln_projection_forward(p.forward()));
  const std::vector<double> act = oracle_act(p.temb, DType::kBF16);
  const double act_fraction = fraction_correctly_rounded(p.act, [&] {
    std::vector<double> exact(act.size());
    for (int64_t i = 0; i < p.temb.numel(); ++i) exact[i] = silu64(p.temb.get(i));
    return exact;
  }());
  const std::vector<double> table =
      linear64(act, p.weight, to_doubles(p.bias), p.rows, p.in_features, p.out_features);
  const double table_fraction = fraction_correctly_rounded(p.table, table);
  std::printf("[ measured ] act correctly rounded: %.6f %%, table correctly rounded: %.6f %%\n", 100 * act_fraction,
              100 * table_fraction);
  EXPECT_GE(table_fraction, 0.9998);
  // silu_P is a few FP32 roundings from exact; its bf16 cast is almost always
  // the correctly rounded one.
  EXPECT_GE(act_fraction, 0.999);
}

TEST(AdalnProjectionAccuracy, GradientsMatchFp64) {
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    SCOPED_TRACE(dtype_name(dtype));
    Projection p(3, 256, 18 * 64, dtype, 88);
    DETDIT_ASSERT_OK(adaln_projection_forward(p.forward()));
    ProjectionGrads g(p, DType::kF32, 89);
    DETDIT_ASSERT_OK(adaln_projection_backward(g.params(p)));
    // The oracle differentiates the forward at the saved act (straight-through cast).
    const std::vector<double> grad = to_doubles(g.grad), act = to_doubles(p.act), w = to_doubles(p.weight);
    std::vector<double> d_temb = linear_d_x64(grad, w, p.rows, p.in_features, p.out_features);
    for (int64_t i = 0; i < p.temb.numel(); ++i) d_temb[i] *= silu_derivative64(p.temb.get(i));
    const std::vector<double> d_w = linear_d_w64(grad, act, p.rows, p.in_features, p.out_features);
    const std::vector<double> d_b = linear_d_b64(grad, p.rows, p.out_features);
    EXPECT_LE(relative_max_error(g.d_temb, d_temb), 1e-4);
    if (dtype == DType::kF32) {
      EXPECT_LE(relative_max_error(g.d_weight, d_w), 1e-4);
      EXPECT_LE(relative_max_error(g.d_bias, d_b), 1e-4);
    } else {
      // T = 3 FP32 terms, then one bf16 rounding: a flip needs the FP32 chain
      // error (~2^-24 relative) to straddle a bf16 rounding boundary.
      const double w_fraction = fraction_correctly_rounded(g.d_weight, d_w);
      const double b_fraction = fraction_correctly_rounded(g.d_bias, d_b);
      std::printf("[ measured ] d_weight correctly rounded: %.6f %%, d_bias: %.6f %%\n", 100 * w_fraction,
                  100 * b_fraction);
      EXPECT_GE(w_fraction, 0.999);
      EXPECT_GE(b_fraction, 0.999);
    }
  }
}

// A bf16 grad_table is upcast exactly: the same bytes as its fp32 copy.
TEST(AdalnProjectionBackward, Bf16GradTableEqualsItsFp32Upcast) {
  Projection p(2, 64, 18 * 8, DType::kBF16, 99);
  DETDIT_ASSERT_OK(adaln_projection_forward(p.forward()));
  ProjectionGrads low(p, DType::kBF16, 100), high(p, DType::kF32, 0);
  for (int64_t i = 0; i < low.grad.numel(); ++i) high.grad.set(i, low.grad.get(i));
  DETDIT_ASSERT_OK(adaln_projection_backward(low.params(p)));
  DETDIT_ASSERT_OK(adaln_projection_backward(high.params(p)));
  EXPECT_BITWISE_EQ(high.d_temb, low.d_temb);
  EXPECT_BITWISE_EQ(high.d_weight, low.d_weight);
  EXPECT_BITWISE_EQ(high.d_bias, low.d_bias);
}

TEST(AdalnProjectionInvariance, RowsAreBitwiseIndependentOfTheBatch) {
  const int64_t pool = 9, in_features = 64, out_features = 18 * 8;
  Projection reference(pool, in_features, out_features, DType::kBF16, 111);
  ProjectionGrads reference_grads(reference, DType::kF32, 112);
  auto run = [&](const std::vector<int64_t>& members, HostTensor* table, HostTensor* d_temb) {
    const int64_t count = static_cast<int64_t>(members.size());
    Projection p(count, in_features, out_features, DType::kBF16, 111);  // same weights
    ProjectionGrads g(p, DType::kF32, 112);
    for (int64_t j = 0; j < count; ++j) {
      std::memcpy(p.temb.ptr<float>() + j * in_features, reference.temb.ptr<float>() + members[j] * in_features,
                  in_features * 4);
      std::memcpy(g.grad.ptr<float>() + j * out_features,
                  reference_grads.grad.ptr<float>() + members[j] * out_features, out_features * 4);
    }
    DETDIT_ASSERT_OK(adaln_projection_forward(p.forward()));
    DETDIT_ASSERT_OK(adaln_projection_backward(g.params(p)));
    *table = clone(p.table);
    *d_temb = clone(g.d_temb);
  };
  std::vector<HostTensor> alone_table(pool), alone_d(pool);
  for (int64_t r = 0; r < pool; ++r) run({r}, &alone_table[r], &alone_d[r]);
  for (int64_t batch = 1; batch <= pool; ++batch)
    for (int64_t rotation = 0; rotation < pool; ++rotation)
      for (bool reversed : {false, true}) {
        std::vector<int64_t> members;
        for (int64_t j = 0; j < batch; ++j) members.push_back((rotation + (reversed ? pool - j : j)) % pool);
        HostTensor table, d_temb;
        run(members, &table, &d_temb);
        for (int64_t j = 0; j < batch; ++j) {
          SCOPED_TRACE("batch " + std::to_string(batch) + " position " + std::to_string(j));
          ASSERT_TRUE(bitwise_equal_bytes(alone_table[members[j]].data(),
                                          table.ptr<uint16_t>() + j * out_features, out_features, DType::kBF16));
          ASSERT_TRUE(bitwise_equal_bytes(alone_d[members[j]].data(), d_temb.ptr<float>() + j * in_features,
                                          in_features, DType::kF32));
        }
      }
}

TEST(AdalnProjectionRepeatability, TwoRunsGiveTheSameBytes) {
  Projection a(4, 128, 18 * 16, DType::kBF16, 121), b(4, 128, 18 * 16, DType::kBF16, 121);
  ProjectionGrads ga(a, DType::kF32, 122), gb(b, DType::kF32, 122);
  for (auto [p, g] : {std::pair<Projection*, ProjectionGrads*>{&a, &ga}, {&b, &gb}}) {
    DETDIT_ASSERT_OK(adaln_projection_forward(p->forward()));
    DETDIT_ASSERT_OK(adaln_projection_backward(g->params(*p)));
  }
  EXPECT_BITWISE_EQ(a.table, b.table);
  EXPECT_BITWISE_EQ(a.act, b.act);
  EXPECT_BITWISE_EQ(ga.d_temb, gb.d_temb);
  EXPECT_BITWISE_EQ(ga.d_weight, gb.d_weight);
  EXPECT_BITWISE_EQ(ga.d_bias, gb.d_bias);
}

TEST(AdalnProjectionForward, AbsentActGivesTheSameTable) {
  Projection p(3, 64, 18 * 4, DType::kBF16, 131);
  DETDIT_ASSERT_OK(adaln_projection_forward(p.forward()));
  HostTensor table(DType::kBF16, {3, 18 * 4});
  AdalnProjectionParams q = p.forward();
  q.table = table.view();
  q.act = TensorView();
  DETDIT_ASSERT_OK(adaln_projection_forward(q));
  EXPECT_BITWISE_EQ(p.table, table);
}

// table (T, 18H): chunk c of the (3T, 6H) rows view; row ti*3 + m, column
// c*H + h of that view is table column m*6H + c*H + h of timestep ti.
TEST(AdalnTableChunk, ViewsTheDocumentedColumns) {
  const int64_t rows = 2, hidden = 4;
  HostTensor table(DType::kF32, {rows, 18 * hidden});
  for (int64_t i = 0; i < table.numel(); ++i) table.set(i, static_cast<double>(i));
  for (int chunk = 0; chunk < kAdalnChunks; ++chunk) {
    TensorView view;
    DETDIT_ASSERT_OK(adaln_table_chunk(table.view(), hidden, chunk, &view));
    ASSERT_EQ(view.rank, 2);
    ASSERT_EQ(view.shape[0], 3 * rows);
    ASSERT_EQ(view.shape[1], hidden);
    for (int64_t ti = 0; ti < rows; ++ti)
      for (int64_t m = 0; m < 3; ++m)
        for (int64_t h = 0; h < hidden; ++h) {
          const float got = view.ptr<float>()[(ti * 3 + m) * view.strides[0] + h * view.strides[1]];
          EXPECT_EQ(got, static_cast<float>(ti * 18 * hidden + m * 6 * hidden + chunk * hidden + h));
        }
  }
  TensorView view;
  Status s = adaln_table_chunk(table.view(), hidden, 6, &view);
  EXPECT_EQ(s.kind(), ErrorKind::kIndex) << s.to_string();
  s = adaln_table_chunk(table.view(), hidden + 1, 0, &view);
  EXPECT_EQ(s.kind(), ErrorKind::kValue) << s.to_string();
  s = adaln_table_chunk(TensorView::strided(table.data(), DType::kF32, {2, 36}, {72, 1}), 2, 0, &view);
  EXPECT_EQ(s.kind(), ErrorKind::kValue) << s.to_string();
}

TEST(AdalnProjectionValidation, ForwardRejectsBadArgumentsAndWritesNothing) {
  Projection p(3, 64, 18 * 8, DType::kBF16, 141);
  HostTensor temb_bf16(DType::kBF16, {3, 64}), bias_f32(DType::kF32, {18 * 8}), wide(DType::kBF16, {18 * 8 * 64 + 16});
  HostTensor odd_temb(DType::kF32, {3, 60}), odd_weight(DType::kBF16, {18 * 8, 60});
  HostTensor not18(DType::kBF16, {100, 64}), not18_bias(DType::kBF16, {100}), not18_table(DType::kBF16, {3, 100});
  struct Case {
    std::string name;
    ErrorKind kind;
    std::string part;
    std::function<void(AdalnProjectionParams*)> edit;
  };
  const std::vector<Case> cases = {
      {"bf16 temb", ErrorKind::kType, "temb must be float32 (the SiLU runs before the cast), got bfloat16",
       [&](auto* q) { q->in.temb = temb_bf16.view(); }},
      {"weight/bias dtypes", ErrorKind::kType, "weight/bias must share a dtype", [&](auto* q) { q->in.bias = bias_f32.view(); }},
      {"N not a multiple of 18", ErrorKind::kValue, "AdaLN weight must be (6 * H * 3, D)", [&](auto* q) {
         q->in.weight = not18.view();
         q->in.bias = not18_bias.view();
         q->table = not18_table.view();
       }},
      {"D not a multiple of 8", ErrorKind::kValue, "16-byte vector load", [&](auto* q) {
         q->in.temb = odd_temb.view();
         q->in.weight = odd_weight.view();
         q->act = p.act.view_as({3, 60});
       }},
      {"temb 3-D", ErrorKind::kValue, "temb must be a non-empty (T, D) matrix", [&](auto* q) { q->in.temb = p.temb.view_as({3, 1, 64}); }},
      {"zero rows", ErrorKind::kValue, "temb must be a non-empty (T, D) matrix", [&](auto* q) {
         q->in.temb = p.temb.view_as({0, 64});
         q->table = p.table.view_as({0, 18 * 8});
         q->act = p.act.view_as({0, 64});
       }},
      {"weight D mismatch", ErrorKind::kValue, "weight must be (N, D)", [&](auto* q) { q->in.weight = p.weight.view_as({18 * 16, 32}); }},
      {"table shape", ErrorKind::kValue, "table must be (T, N)", [&](auto* q) { q->table = p.table.view_as({18 * 8, 3}); }},
      {"table float32", ErrorKind::kType, "table must have weight's dtype", [&](auto* q) { q->table.dtype = DType::kF32; }},
      {"misaligned weight", ErrorKind::kValue, "16-byte aligned", [&](auto* q) {
         q->in.weight = TensorView::contiguous(wide.ptr<uint16_t>() + 2, DType::kBF16, {18 * 8, 64});
       }},
      {"non-contiguous temb", ErrorKind::kValue, "temb must be contiguous", [&](auto* q) {
         q->in.temb = TensorView::strided(p.temb.data(), DType::kF32, {3, 32}, {64, 1});
       }},
      {"bias missing", ErrorKind::kValue, "bias is required", [&](auto* q) { q->in.bias = TensorView(); }},
      {"act on another device", ErrorKind::kValue, "act is on cuda:0", [&](auto* q) { q->act.device = Device::cuda(0); }},
      {"table aliases act", ErrorKind::kValue, "must not overlap", [&](auto* q) {
         q->table = TensorView::contiguous(p.act.data(), DType::kBF16, {3, 18 * 8});
       }},
      {"torch numerics on the CPU", ErrorKind::kValue, "CUDA only", [&](auto* q) { q->in.numerics = Numerics::kTorch; }},
  };
  for (const Case& bad : cases) {
    SCOPED_TRACE(bad.name);
    for (HostTensor* t : {&p.table, &p.act, &not18_table}) t->fill_bytes(kCanary);
    AdalnProjectionParams q = p.forward();
    bad.edit(&q);
    Status s = adaln_projection_forward(q);
    EXPECT_EQ(s.kind(), bad.kind) << s.to_string();
    EXPECT_NE(s.message().find(bad.part), std::string::npos) << s.to_string();
    EXPECT_TRUE(still_canary({&p.table, &p.act, &not18_table}));
  }
  DETDIT_EXPECT_OK(adaln_projection_forward(p.forward()));
}

TEST(AdalnProjectionValidation, BackwardRejectsBadArgumentsAndWritesNothing) {
  Projection p(3, 64, 18 * 8, DType::kBF16, 151);
  DETDIT_ASSERT_OK(adaln_projection_forward(p.forward()));
  ProjectionGrads g(p, DType::kF32, 152);
  HostTensor grad_f16(DType::kF16, {3, 18 * 8});
  struct Case {
    std::string name;
    ErrorKind kind;
    std::string part;
    std::function<void(AdalnProjectionBackwardParams*)> edit;
  };
  const std::vector<Case> cases = {
      {"grad float16", ErrorKind::kType, "grad_table must have weight's dtype", [&](auto* b) { b->grad_table = grad_f16.view(); }},
      {"act missing", ErrorKind::kValue, "act is required", [&](auto* b) { b->act = TensorView(); }},
      {"act float32", ErrorKind::kType, "act must have weight's dtype", [&](auto* b) { b->act.dtype = DType::kF32; }},
      {"d_temb bfloat16", ErrorKind::kType, "d_temb must be float32", [&](auto* b) { b->d_temb.dtype = DType::kBF16; }},
      {"d_weight shape", ErrorKind::kValue, "d_weight must be (N, D)", [&](auto* b) { b->d_weight = g.d_weight.view_as({64, 18 * 8}); }},
      {"d_bias float32", ErrorKind::kType, "d_bias must have weight's dtype", [&](auto* b) { b->d_bias.dtype = DType::kF32; }},
      {"bf16 temb", ErrorKind::kType, "temb must be float32", [&](auto* b) { b->in.temb.dtype = DType::kBF16; }},
      {"torch numerics on the CPU", ErrorKind::kValue, "CUDA only", [&](auto* b) { b->in.numerics = Numerics::kTorch; }},
  };
  for (const Case& bad : cases) {
    SCOPED_TRACE(bad.name);
    for (HostTensor* t : {&g.d_temb, &g.d_weight, &g.d_bias}) t->fill_bytes(kCanary);
    AdalnProjectionBackwardParams b = g.params(p);
    bad.edit(&b);
    Status s = adaln_projection_backward(b);
    EXPECT_EQ(s.kind(), bad.kind) << s.to_string();
    EXPECT_NE(s.message().find(bad.part), std::string::npos) << s.to_string();
    EXPECT_TRUE(still_canary({&g.d_temb, &g.d_weight, &g.d_bias}));
  }
  DETDIT_EXPECT_OK(adaln_projection_backward(g.params(p)));
}

}  // namespace
}  // namespace testing
}  // namespace detdit
