// The modulated layernorm (out = layernorm(x) * (1 + scale) + shift) on the
// CPU reference: the exact properties of the forms (the plain norm's bytes in
// both recipes and with a plan, a sample's outputs and gradients the same
// bytes alone and in a batch of 3, per-token gradients row-local) and the
// refusals (naming the argument, before anything is written). The bytes of
// every form and recipe against docs/numerics.md 9.1-9.6 written out step by
// step are layernorm's op cases (cases/layernorm_cases.cc), which
// op_cases_test compares with their equivalent route.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "cases/forms_cases.h"
#include "detdit/layernorm.h"
#include "detdit/modulation.h"
#include "support/cases.h"
#include "support/rowwise_fixture.h"
#include "support/test_util.h"

namespace detdit {
namespace testing {
namespace {

constexpr float kEps = 1e-6f;

enum class Affine { kNone, kWeight, kWeightBias };

// The modulation: grouped (frames F: 1 per sample, S per token; `with_unit`
// views (B, 1, H) / (B, F, 1, H)), indexed (a plan over an (R, H) table), or none.
enum class Kind { kNone, kGrouped, kIndexed };

struct Problem {
  int64_t batch, seq, hidden;
  Kind kind;
  int64_t frames;  // grouped only
  bool with_unit;  // grouped only: the (B, 1, H) / (B, F, 1, H) views
  DType x_dtype, mod_dtype;
  bool upcast;
  Affine affine;
};

DType out_dtype(const Problem& p) {
  return p.kind == Kind::kNone || p.upcast || p.mod_dtype != DType::kF32 ? p.x_dtype : DType::kF32;
}

std::string describe(const Problem& p) {
  const char* kind = p.kind == Kind::kNone ? "none" : p.kind == Kind::kIndexed ? "indexed" : "grouped";
  const char* affine = p.affine == Affine::kNone ? "no affine" : p.affine == Affine::kWeight ? "weight" : "weight+bias";
  return std::string(kind) + " F=" + std::to_string(p.frames) + (p.with_unit ? " (unit dim)" : "") + " B=" +
         std::to_string(p.batch) + " S=" + std::to_string(p.seq) + " H=" + std::to_string(p.hidden) + " x " +
         dtype_name(p.x_dtype) + " modulation " + dtype_name(p.mod_dtype) + (p.upcast ? " upcast" : " each-op") + " " +
         affine;
}

// One call's tensors. The modulation is chunks 0 (shift) and 1 (scale) of a
// (G, 6, H) parent: G = B*F groups (grouped) or R table rows (indexed).
struct LnRun {
  Problem p;
  IndexCase index;
  IndexPlan plan;
  int64_t mod_rows;
  HostTensor parent, x, w, b, out, mean, rstd, grad, dx, d_weight, d_bias, d_shift, d_scale;
  LnRun(const Problem& problem, uint64_t seed)
      : p(problem),
        index(make_index_case(Packing::kInterleaved, problem.seq, 3, problem.batch)),
        plan(problem.kind == Kind::kIndexed ? adaln_plan(index) : IndexPlan()),
        mod_rows(problem.kind == Kind::kIndexed ? index.num_rows() : problem.batch * problem.frames),
        parent(random_tensor(problem.mod_dtype, {mod_rows, 6, problem.hidden}, seed + 1, 0.0, 0.5)),
        x(random_tensor(problem.x_dtype, {problem.batch, problem.seq, problem.hidden}, seed)),
        w(random_tensor(problem.x_dtype, {problem.hidden}, seed + 2, 1.0, 0.1)),
        b(random_tensor(problem.x_dtype, {problem.hidden}, seed + 4, 0.0, 0.1)),
        out(out_dtype(problem), {problem.batch, problem.seq, problem.hidden}),
        mean(DType::kF32, {problem.batch * problem.seq}),
        rstd(DType::kF32, {problem.batch * problem.seq}),
        grad(random_tensor(out_dtype(problem), {problem.batch, problem.seq, problem.hidden}, seed + 3)),
        dx(problem.x_dtype, {problem.batch, problem.seq, problem.hidden}),
        d_weight(DType::kF32, {problem.hidden}),
        d_bias(problem.x_dtype, {problem.hidden}),
        d_shift(grad_shape(DType::kF32)),
        d_scale(grad_shape(problem.mod_dtype)) {}

  // The modulation's layout as the op cases make it (cases/forms_cases.h).
  cases::FormGeometry geometry() const {
    ModulationForm form = ModulationForm::kIndexed;
    if (p.kind == Kind::kNone) form = ModulationForm::kNone;
    if (p.kind == Kind::kGrouped)
      form = p.frames == 1 ? ModulationForm::kPerSample : p.frames == p.seq ? ModulationForm::kPerToken
                                                                           : ModulationForm::kPerFrame;
    return cases::form_geometry({p.x_dtype, p.mod_dtype, p.hidden, p.batch, p.seq, form, p.frames, p.with_unit});
  }
  HostTensor grad_shape(DType dtype) const { return HostTensor(dtype, geometry().view_shape()); }
  // Chunk c of the parent as the models' `.chunk(6, dim=-2)` view.
  TensorView chunk(int64_t c) const { return geometry().chunk(parent.view(), static_cast<int>(c)); }
  LayernormInputs inputs() const {
    LayernormInputs in;
    in.x = x.view();
    if (p.affine != Affine::kNone) in.weight = w.view();
    if (p.affine == Affine::kWeightBias) in.bias = b.view();
    if (p.kind != Kind::kNone) {
      in.shift = chunk(0);
      in.scale = chunk(1);
    }
    in.plan = plan;
    in.eps = kEps;
    in.upcast = p.upcast;
    return in;
  }
  LayernormParams forward_params() const { return {inputs(), out.view(), mean.view(), rstd.view()}; }
  LayernormBackwardParams backward_params() const {
    LayernormBackwardParams bp{inputs(), mean.view(), rstd.view(), grad.view(), dx.view(), TensorView(), TensorView()};
    if (p.affine != Affine::kNone) bp.d_weight = d_weight.view();
    if (p.affine == Affine::kWeightBias) bp.d_bias = d_bias.view();
    if (p.kind != Kind::kNone) {
      bp.d_shift = d_shift.view();
      bp.d_scale = d_scale.view();
    }
    return bp;
  }
  Status forward() { return layernorm_forward(forward_params()); }
  Status backward() { return layernorm_backward(backward_params()); }
};

struct RecipeCase {
  DType x, mod;
  bool upcast;
};
const RecipeCase kRecipes[] = {
    {DType::kBF16, DType::kBF16, false}, {DType::kBF16, DType::kF32, false}, {DType::kBF16, DType::kF32, true},
    {DType::kBF16, DType::kBF16, true},  {DType::kF16, DType::kF32, false},  {DType::kF32, DType::kF32, false},
    {DType::kF16, DType::kF16, true},
};

// No shift and scale: the plain norm's bytes in both recipes, with or
// without a plan that describes x's rows (the bytes themselves are numerics
// 9.2-9.4: layernorm's op cases of the form none, op_cases_test).
TEST(LayernormForms, ThePlainNormIsTheSameInBothRecipesAndWithAPlan) {
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    const Problem p{2, 300, 16, Kind::kNone, 1, false, dtype, dtype, false, Affine::kWeightBias};
    SCOPED_TRACE(describe(p));
    LnRun base(p, 23);
    DETDIT_ASSERT_OK(base.forward());
    DETDIT_ASSERT_OK(base.backward());
    for (int variant = 0; variant < 2; ++variant) {
      LnRun other(p, 23);
      LayernormParams f = other.forward_params();
      LayernormBackwardParams b = other.backward_params();
      if (variant == 0) f.in.upcast = b.in.upcast = true;
      if (variant == 1) f.in.plan = b.in.plan = adaln_plan(other.index);
      DETDIT_ASSERT_OK(layernorm_forward(f));
      DETDIT_ASSERT_OK(layernorm_backward(b));
      for (auto [a, c] : {std::pair<HostTensor*, HostTensor*>{&base.out, &other.out}, {&base.mean, &other.mean},
                          {&base.rstd, &other.rstd}, {&base.dx, &other.dx}, {&base.d_weight, &other.d_weight},
                          {&base.d_bias, &other.d_bias}})
        EXPECT_BITWISE_EQ(*a, *c) << (variant == 0 ? "upcast" : "plan");
    }
  }
}

// ---- batch invariance and row locality ---------------------------------------------

// Rows [b*rows, (b+1)*rows) of `batched` hold the bytes of `alone` (all of it).
::testing::AssertionResult item_equal(const HostTensor& alone, const HostTensor& batched, int64_t b) {
  return bitwise_equal_bytes(alone.data(), static_cast<const char*>(batched.data()) + b * alone.nbytes(),
                             static_cast<std::size_t>(alone.numel()), alone.dtype());
}
// Copy item b of `from` (B items) into the single-item `to`.
void take_item(const HostTensor& from, int64_t b, HostTensor* to) {
  std::memcpy(to->data(), static_cast<const char*>(from.data()) + b * to->nbytes(), to->nbytes());
}

// Sample 1 of a batch of 3 gives the same bytes as that sample alone: out,
// mean, rstd, dx and its rows of d_shift and d_scale (S = 300: flattened
// chunks would straddle the samples). The other samples' data differ.
TEST(LayernormForms, PerSampleFrameAndTokenResultsAreBatchInvariantBitwise) {
  for (int64_t frames : {int64_t{1}, int64_t{3}, int64_t{300}})
    for (const RecipeCase& recipe : kRecipes) {
      const Problem batched{3, 300, 16, Kind::kGrouped, frames, false, recipe.x, recipe.mod, recipe.upcast,
                            Affine::kWeightBias};
      Problem single = batched;
      single.batch = 1;
      SCOPED_TRACE(describe(batched));
      LnRun rb(batched, 41), rs(single, 99);
      take_item(rb.x, 1, &rs.x);
      take_item(rb.grad, 1, &rs.grad);
      take_item(rb.parent, 1, &rs.parent);
      copy_bytes(rb.w, &rs.w);
      copy_bytes(rb.b, &rs.b);
      DETDIT_ASSERT_OK(rb.forward());
      DETDIT_ASSERT_OK(rb.backward());
      DETDIT_ASSERT_OK(rs.forward());
      DETDIT_ASSERT_OK(rs.backward());
      EXPECT_TRUE(item_equal(rs.out, rb.out, 1));
      EXPECT_TRUE(item_equal(rs.mean, rb.mean, 1));
      EXPECT_TRUE(item_equal(rs.rstd, rb.rstd, 1));
      EXPECT_TRUE(item_equal(rs.dx, rb.dx, 1));
      EXPECT_TRUE(item_equal(rs.d_shift, rb.d_shift, 1));
      EXPECT_TRUE(item_equal(rs.d_scale, rb.d_scale, 1));
    }
}

// Per token: d_shift / d_scale of a position are its own row's terms alone:
// changing one position's grad changes that position's rows and no other.
TEST(LayernormForms, PerTokenGradientsAreRowLocal) {
  const Problem p{2, 64, 16, Kind::kGrouped, 64, false, DType::kBF16, DType::kF32, false, Affine::kNone};
  LnRun a(p, 61), b(p, 61);
  b.grad.set(37 * 16 + 3, 1000.0);  // position 37, element 3
  for (LnRun* r : {&a, &b}) {
    DETDIT_ASSERT_OK(r->forward());
    DETDIT_ASSERT_OK(r->backward());
  }
  for (const auto& [ta, tb] : {std::pair<const HostTensor*, const HostTensor*>{&a.d_shift, &b.d_shift},
                               {&a.d_scale, &b.d_scale}}) {
    const std::size_t row = 16 * dtype_size(ta->dtype());
    for (int64_t pos = 0; pos < 128; ++pos) {
      const bool same = std::memcmp(static_cast<const char*>(ta->data()) + pos * row,
                                    static_cast<const char*>(tb->data()) + pos * row, row) == 0;
      EXPECT_EQ(same, pos != 37) << pos;
    }
  }
}

// ---- refusals ------------------------------------------------------------------------

TEST(LayernormForms, FormAndShapeErrorsAreRefusedBeforeAnyWrite) {
  const Problem p{2, 600, 32, Kind::kGrouped, 2, false, DType::kBF16, DType::kF32, false, Affine::kWeightBias};
  HostTensor frames7 = random_tensor(DType::kF32, {2, 7, 32}, 5);
  HostTensor per_sample = random_tensor(DType::kF32, {2, 32}, 6);
  HostTensor bf16_frames = random_tensor(DType::kBF16, {2, 2, 32}, 7);
  HostTensor f16_frames = random_tensor(DType::kF16, {2, 2, 32}, 8);
  HostTensor wrong_b = random_tensor(DType::kF32, {3, 2, 32}, 9);
  HostTensor wrong_grad(DType::kF32, {2, 3, 32});
  struct Bad {
    const char* what;
    ErrorKind kind;
    const char* message;
    bool forward_too;
    std::function<void(LayernormParams*, LayernormBackwardParams*)> mutate;
  };
  const std::vector<Bad> cases = {
      {"S % F", ErrorKind::kValue, "shift has F = 7 frames, which must divide S = 600", true,
       [&](LayernormParams* f, LayernormBackwardParams* b) { f->in.shift = b->in.shift = frames7.view(); }},
      {"two forms", ErrorKind::kValue, "scale must have shift's form per_frame", true,
       [&](LayernormParams* f, LayernormBackwardParams* b) { f->in.scale = b->in.scale = per_sample.view(); }},
      {"two dtypes", ErrorKind::kType, "scale must have shift's dtype float32", true,
       [&](LayernormParams* f, LayernormBackwardParams* b) { f->in.scale = b->in.scale = bf16_frames.view(); }},
      {"dtype", ErrorKind::kType, "shift must be bfloat16, got float16", true,
       [&](LayernormParams* f, LayernormBackwardParams* b) { f->in.shift = b->in.shift = f16_frames.view(); }},
      {"batch", ErrorKind::kValue, "shift without a plan must be per sample", true,
       [&](LayernormParams* f, LayernormBackwardParams* b) { f->in.shift = b->in.shift = wrong_b.view(); }},
      {"scale alone", ErrorKind::kValue, "modulation needs both shift and scale, got scale without shift", true,
       [&](LayernormParams* f, LayernormBackwardParams* b) { f->in.shift = b->in.shift = TensorView(); }},
      {"x (M, H)", ErrorKind::kValue, "plan is required: shift", true,
       [&](LayernormParams* f, LayernormBackwardParams* b) {
         f->in.x = b->in.x = f->in.x.reshaped({1200, 32});
         f->out = f->out.reshaped({1200, 32});
         b->grad = b->grad.reshaped({1200, 32});
         b->dx = b->dx.reshaped({1200, 32});
       }},
      {"out dtype", ErrorKind::kType, "shift must be bfloat16, got float32 (", true,
       [&](LayernormParams* f, LayernormBackwardParams* b) {
         f->out.dtype = DType::kBF16;
         b->grad.dtype = DType::kBF16;
       }},
      {"upcast out dtype", ErrorKind::kType, "must be bfloat16 (the promoted dtype", true,
       [&](LayernormParams* f, LayernormBackwardParams* b) { f->in.upcast = b->in.upcast = true; }},
      {"d_shift shape", ErrorKind::kValue, "d_shift must have shift's shape (2, 2, 32)", false,
       [&](LayernormParams*, LayernormBackwardParams* b) { b->d_shift = wrong_grad.view(); }},
      {"d_scale of a plain norm", ErrorKind::kValue, "d_scale needs a modulated norm", false,
       [&](LayernormParams*, LayernormBackwardParams* b) {
         b->in.shift = b->in.scale = TensorView();
         b->d_shift = TensorView();
         b->grad.dtype = DType::kBF16;
       }},
  };
  for (const Bad& bad : cases) {
    SCOPED_TRACE(bad.what);
    LnRun run(p, 71);
    const std::vector<HostTensor*> outputs = {&run.out,      &run.mean,   &run.rstd,    &run.dx,
                                              &run.d_weight, &run.d_bias, &run.d_shift, &run.d_scale};
    for (HostTensor* t : outputs) t->fill_bytes(kCanary);
    LayernormParams f = run.forward_params();
    LayernormBackwardParams b = run.backward_params();
    bad.mutate(&f, &b);
    if (bad.forward_too) {
      EXPECT_TRUE(refused(layernorm_forward(f), bad.kind, bad.message));
    }
    EXPECT_TRUE(refused(layernorm_backward(b), bad.kind, bad.message));
    for (HostTensor* t : outputs) EXPECT_TRUE(all_bytes_are(*t, kCanary));
  }
}

}  // namespace
}  // namespace testing
}  // namespace detdit
