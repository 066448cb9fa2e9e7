// The modulation forms (per sample, per frame, per token, none) and the two
// recipes (upcast = false / true) of rmsnorm and gate_residual on the CPU
// reference, against an emulation written here from docs/numerics.md 5.12,
// 6.11 (every step one rn(...) of scalar_math, the row tree of
// section 7, the group reductions as plain loops), compared bitwise; plus the
// exact properties: a sample's outputs and gradients are the same bytes alone
// and in a batch of 3 with other samples; per-token gradients are row-local;
// form and shape errors are refused before anything is written.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "cases/forms_cases.h"
#include "common/row_tree.h"
#include "common/scalar_math.h"
#include "detdit/gate_residual.h"
#include "detdit/modulation.h"
#include "detdit/rmsnorm.h"
#include "support/rowwise_fixture.h"
#include "support/test_util.h"

namespace detdit {
namespace testing {
namespace {

constexpr int kChunk = 256;  // positions per chunk (numerics 6.5)

// How the modulation tensors are laid out: chunk c of a (B, F, 6, H) parent,
// viewed as (B, H) / (B, 1, H) / (B, F, H) / (B, F, 1, H) (the models'
// `.chunk(6, dim=-2)` views: outer strides, innermost stride 1).
enum class Shape { kBH, kB1H, kBFH, kBF1H };

struct Form {
  const char* name;
  int64_t frames;  // F: 1 per sample, S per token
  Shape shape;
};

struct Problem {
  int64_t batch, seq, hidden;
  Form form;
  DType x_dtype, mod_dtype;
  bool upcast;
  std::optional<float> k;  // gate_residual only
};

DType out_dtype(const Problem& p) {
  return p.upcast || p.mod_dtype != DType::kF32 ? p.x_dtype : DType::kF32;
}

float get(const HostTensor& t, int64_t i) { return static_cast<float>(t.get(i)); }

// The op cases' layout of a problem's form: per sample (F = 1), per token
// (F = S) or per frame, the chunk dimension kept for the (B, 1, H) and
// (B, F, 1, H) views.
cases::FormGeometry geometry_of(const Problem& p) {
  const ModulationForm form = p.form.frames == 1       ? ModulationForm::kPerSample
                              : p.form.frames == p.seq ? ModulationForm::kPerToken
                                                       : ModulationForm::kPerFrame;
  const bool keep = p.form.shape == Shape::kB1H || p.form.shape == Shape::kBF1H;
  return cases::form_geometry({p.x_dtype, p.mod_dtype, p.hidden, p.batch, p.seq, form, p.form.frames, keep});
}

// The (B, F, 6, H) parent of the modulation chunks and its views.
struct Parent {
  HostTensor t;
  int64_t batch, frames, hidden;
  Parent(const Problem& p, uint64_t seed)
      : t(random_tensor(p.mod_dtype, {p.batch, p.form.frames, 6, p.hidden}, seed, 0.0, 0.5)),
        batch(p.batch),
        frames(p.form.frames),
        hidden(p.hidden),
        geometry(geometry_of(p)) {}
  // Element i of chunk c for group g = b*F + f.
  float at(int64_t c, int64_t g, int64_t i) const { return get(t, (g * 6 + c) * hidden + i); }
  TensorView chunk(int64_t c) const { return geometry.chunk(t.view(), static_cast<int>(c)); }
  // The views as the op cases make them (cases/forms_cases.h).
  cases::FormGeometry geometry;
};

// A contiguous gradient of chunk-view shape (its groups in order b*F + f).
HostTensor grad_like(const Problem& p, DType dtype) { return HostTensor(dtype, geometry_of(p).view_shape()); }

// The group of position pos: b*F + (s / L).
int64_t group_of(const Problem& p, int64_t pos) {
  const int64_t len = p.seq / p.form.frames;
  return pos / p.seq * p.form.frames + (pos % p.seq) / len;
}

// The group reduction of numerics 6.11, written out: chunks of 256 from the
// group's first position, each an ascending chain from +0.0 of step(acc, pos),
// then the ascending fold of the group's chunk partials from +0.0.
template <typename Step>
float group_sum(const Problem& p, int64_t g, Step step) {
  const int64_t len = p.seq / p.form.frames;
  float fold = 0.0f;
  for (int64_t begin = g * len; begin < (g + 1) * len; begin += kChunk) {
    float acc = 0.0f;
    for (int64_t pos = begin; pos < std::min(begin + kChunk, (g + 1) * len); ++pos) acc = step(acc, pos);
    fold = num::add32(fold, acc);
  }
  return fold;
}

// ---- rmsnorm -------------------------------------------------------------------------

struct NormRun {
  Problem p;
  Parent mod;
  HostTensor x, w, out, rstd, grad, dx, d_weight, d_shift, d_scale;
  NormRun(const Problem& problem, uint64_t seed)
      : p(problem),
        mod(problem, seed + 1),
        x(random_tensor(problem.x_dtype, {problem.batch, problem.seq, problem.hidden}, seed)),
        w(random_tensor(problem.x_dtype, {problem.hidden}, seed + 2, 1.0, 0.1)),
        out(out_dtype(problem), {problem.batch, problem.seq, problem.hidden}),
        rstd(DType::kF32, {problem.batch * problem.seq}),
        grad(random_tensor(out_dtype(problem), {problem.batch, problem.seq, problem.hidden}, seed + 3)),
        dx(problem.x_dtype, {problem.batch, problem.seq, problem.hidden}),
        d_weight(DType::kF32, {problem.hidden}),
        d_shift(grad_like(problem, DType::kF32)),
        d_scale(grad_like(problem, problem.mod_dtype)) {}
  RmsnormInputs inputs() const {
    RmsnormInputs in{x.view(), w.view(), mod.chunk(0), mod.chunk(1), IndexPlan()};
    in.upcast = p.upcast;
    return in;
  }
  Status forward() { return rmsnorm_forward({inputs(), out.view(), rstd.view()}); }
  Status backward() {
    return rmsnorm_backward(
        {inputs(), rstd.view(), grad.view(), dx.view(), d_weight.view(), d_shift.view(), d_scale.view()});
  }
};

// Every result of a NormRun written out from docs/numerics.md 5.12 / 6.11.
struct NormOracle {
  HostTensor out, rstd, dx, d_weight, d_shift, d_scale;
  explicit NormOracle(const NormRun& r) {
    const Problem& p = r.p;
    const int64_t h = p.hidden, positions = p.batch * p.seq, groups = p.batch * p.form.frames;
    const DType t = p.x_dtype, m = p.mod_dtype, promoted = m == DType::kF32 ? DType::kF32 : t;
    // Where each step rounds (5.12): eager's promoted dtypes, or FP32 and one rounding.
    auto norm_r = [&](float v) { return p.upcast ? v : round_as(v, t); };
    auto factor_r = [&](float v) { return p.upcast ? v : round_as(v, m); };
    auto mid_r = [&](float v) { return p.upcast ? v : round_as(v, promoted); };
    out = HostTensor(out_dtype(p), {p.batch, p.seq, h});
    rstd = HostTensor(DType::kF32, {positions});
    dx = HostTensor(t, {p.batch, p.seq, h});
    std::vector<float> rs(positions), n(positions * h), d_n(positions * h);
    auto x = [&](int64_t pos, int64_t i) { return get(r.x, pos * h + i); };
    auto w = [&](int64_t i) { return get(r.w, i); };
    auto g = [&](int64_t pos, int64_t i) { return get(r.grad, pos * h + i); };
    auto t1 = [&](int64_t pos, int64_t i) {
      return factor_r(num::add32(1.0f, r.mod.at(1, group_of(p, pos), i)));
    };
    for (int64_t pos = 0; pos < positions; ++pos) {
      const float ss = row_tree_sum(h, [&](int64_t i, float* a, float* b) { *a = *b = x(pos, i); });
      rs[pos] = num::portable_rsqrt(num::add32(num::div32(ss, static_cast<float>(h)), 1e-5f));
      rstd.ptr<float>()[pos] = rs[pos];
      for (int64_t i = 0; i < h; ++i) {
        n[pos * h + i] = norm_r(num::mul32(w(i), num::mul32(rs[pos], x(pos, i))));
        const float v = mid_r(num::mul32(n[pos * h + i], t1(pos, i)));
        out.set(pos * h + i, num::add32(v, r.mod.at(0, group_of(p, pos), i)));  // set() rounds to out's dtype
        d_n[pos * h + i] = num::mul32(g(pos, i), t1(pos, i));
      }
      const float dot = row_tree_sum(h, [&](int64_t i, float* a, float* b) {
        *a = num::mul32(w(i), d_n[pos * h + i]);
        *b = x(pos, i);
      });
      const float coef = num::div32(num::mul32(num::mul32(num::mul32(rs[pos], rs[pos]), rs[pos]), dot),
                                    static_cast<float>(h));
      for (int64_t i = 0; i < h; ++i)
        dx.set(pos * h + i, num::sub32(num::mul32(num::mul32(rs[pos], w(i)), d_n[pos * h + i]),
                                       num::mul32(x(pos, i), coef)));
    }
    // d_weight: chunks of the flattened positions (6.5), then the fold.
    d_weight = HostTensor(DType::kF32, {h});
    for (int64_t i = 0; i < h; ++i) {
      float fold = 0.0f;
      for (int64_t begin = 0; begin < positions; begin += kChunk) {
        float acc = 0.0f;
        for (int64_t pos = begin; pos < std::min(begin + kChunk, positions); ++pos)
          acc = num::fma32(d_n[pos * h + i], num::mul32(x(pos, i), rs[pos]), acc);
        fold = num::add32(fold, acc);
      }
      d_weight.set(i, fold);
    }
    d_shift = grad_like(p, r.d_shift.dtype());
    d_scale = grad_like(p, r.d_scale.dtype());
    for (int64_t grp = 0; grp < groups; ++grp)
      for (int64_t i = 0; i < h; ++i) {
        d_shift.set(grp * h + i, group_sum(p, grp, [&](float acc, int64_t pos) { return num::add32(acc, g(pos, i)); }));
        d_scale.set(grp * h + i, group_sum(p, grp, [&](float acc, int64_t pos) {
                      return num::fma32(g(pos, i), n[pos * h + i], acc);
                    }));
      }
  }
};

const Form kForms[] = {
    {"per_sample (B, H)", 1, Shape::kBH},          {"per_sample (B, 1, H)", 1, Shape::kB1H},
    {"per_frame (B, F, H) F=2", 2, Shape::kBFH},   {"per_frame (B, F, 1, H) F=3", 3, Shape::kBF1H},
    {"per_frame (B, F, H) F=100", 100, Shape::kBFH}, {"per_token (B, S, H)", 600, Shape::kBFH},
};

struct Recipe {
  DType x, mod;
  bool upcast;
};
const Recipe kRecipes[] = {
    {DType::kBF16, DType::kBF16, false}, {DType::kBF16, DType::kF32, false}, {DType::kBF16, DType::kF32, true},
    {DType::kBF16, DType::kBF16, true},  {DType::kF16, DType::kF32, false},  {DType::kF32, DType::kF32, false},
};

std::string describe(const Problem& p) {
  return std::string(p.form.name) + " x " + dtype_name(p.x_dtype) + " modulation " + dtype_name(p.mod_dtype) +
         (p.upcast ? " upcast" : " each-op") + (p.k ? " k=" + std::to_string(*p.k) : "");
}

// S = 600: groups of 600, 300, 200, 6 and 1 positions, so chunks of 256
// counted from a group's start differ from chunks of the flattened batch.
TEST(ModulationForms, RmsnormFollowsTheContractBitwise) {
  for (const Form& form : kForms)
    for (const Recipe& recipe : kRecipes) {
      const Problem p{2, 600, 32, form, recipe.x, recipe.mod, recipe.upcast, std::nullopt};
      SCOPED_TRACE(describe(p));
      NormRun run(p, 11);
      DETDIT_ASSERT_OK(run.forward());
      DETDIT_ASSERT_OK(run.backward());
      const NormOracle ref(run);
      EXPECT_BITWISE_EQ(ref.rstd, run.rstd);
      EXPECT_BITWISE_EQ(ref.out, run.out);
      EXPECT_BITWISE_EQ(ref.dx, run.dx);
      EXPECT_BITWISE_EQ(ref.d_weight, run.d_weight);
      EXPECT_BITWISE_EQ(ref.d_shift, run.d_shift);
      EXPECT_BITWISE_EQ(ref.d_scale, run.d_scale);
    }
}

// ---- gate_residual -------------------------------------------------------------------

struct GateRun {
  Problem p;
  Parent mod;
  bool gated;
  HostTensor residual, y, out, grad, d_residual, d_y, d_gate;
  GateRun(const Problem& problem, uint64_t seed, bool with_gate = true)
      : p(problem),
        mod(problem, seed + 1),
        gated(with_gate),
        residual(random_tensor(problem.x_dtype, {problem.batch, problem.seq, problem.hidden}, seed)),
        y(random_tensor(problem.x_dtype, {problem.batch, problem.seq, problem.hidden}, seed + 2)),
        out(with_gate ? out_dtype(problem) : problem.x_dtype, {problem.batch, problem.seq, problem.hidden}),
        grad(random_tensor(with_gate ? out_dtype(problem) : problem.x_dtype,
                           {problem.batch, problem.seq, problem.hidden}, seed + 3)),
        d_residual(problem.x_dtype, {problem.batch, problem.seq, problem.hidden}),
        d_y(problem.x_dtype, {problem.batch, problem.seq, problem.hidden}),
        d_gate(grad_like(problem, problem.mod_dtype)) {}
  GateResidualInputs inputs() const {
    GateResidualInputs in{residual.view(), y.view(), gated ? mod.chunk(2) : TensorView(), IndexPlan()};
    in.has_k = p.k.has_value();
    in.k = p.k.value_or(0.0f);
    in.upcast = p.upcast;
    return in;
  }
  Status forward() { return gate_residual_forward({inputs(), out.view()}); }
  Status backward() {
    return gate_residual_backward(
        {inputs(), grad.view(), d_residual.view(), d_y.view(), gated ? d_gate.view() : TensorView()});
  }
};

// Every result of a GateRun written out from docs/numerics.md 5.12 / 6.11.
struct GateOracle {
  HostTensor out, d_residual, d_y, d_gate;
  explicit GateOracle(const GateRun& r) {
    const Problem& p = r.p;
    const int64_t h = p.hidden, positions = p.batch * p.seq, groups = p.batch * p.form.frames;
    const DType t = p.x_dtype, m = p.mod_dtype, promoted = m == DType::kF32 ? DType::kF32 : t;
    auto factor_r = [&](float v) { return p.upcast ? v : round_as(v, m); };
    auto mid_r = [&](float v) { return p.upcast ? v : round_as(v, promoted); };
    auto term = [&](int64_t pos, int64_t i) {
      const float gate = r.mod.at(2, group_of(p, pos), i);
      return p.k ? factor_r(num::add32(*p.k, gate)) : gate;
    };
    out = HostTensor(r.out.dtype(), {p.batch, p.seq, h});
    d_residual = HostTensor(t, {p.batch, p.seq, h});
    d_y = HostTensor(t, {p.batch, p.seq, h});
    for (int64_t pos = 0; pos < positions; ++pos)
      for (int64_t i = 0; i < h; ++i) {
        const int64_t e = pos * h + i;
        const float res = get(r.residual, e), yv = get(r.y, e), g = get(r.grad, e);
        out.set(e, r.gated ? num::add32(res, mid_r(num::mul32(term(pos, i), yv))) : num::add32(res, yv));
        d_residual.set(e, g);
        d_y.set(e, r.gated ? num::mul32(g, term(pos, i)) : g);
      }
    d_gate = grad_like(p, r.d_gate.dtype());
    for (int64_t grp = 0; grp < groups; ++grp)
      for (int64_t i = 0; i < h; ++i)
        d_gate.set(grp * h + i, group_sum(p, grp, [&](float acc, int64_t pos) {
                     return num::fma32(get(r.grad, pos * h + i), get(r.y, pos * h + i), acc);
                   }));
  }
};

TEST(ModulationForms, GateResidualFollowsTheContractBitwise) {
  for (const Form& form : kForms)
    for (const Recipe& recipe : kRecipes)
      for (std::optional<float> k : {std::optional<float>(), std::optional<float>(1.0f)}) {
        const Problem p{2, 600, 32, form, recipe.x, recipe.mod, recipe.upcast, k};
        SCOPED_TRACE(describe(p));
        GateRun run(p, 21);
        DETDIT_ASSERT_OK(run.forward());
        DETDIT_ASSERT_OK(run.backward());
        const GateOracle ref(run);
        EXPECT_BITWISE_EQ(ref.out, run.out);
        EXPECT_BITWISE_EQ(ref.d_residual, run.d_residual);
        EXPECT_BITWISE_EQ(ref.d_y, run.d_y);
        EXPECT_BITWISE_EQ(ref.d_gate, run.d_gate);
      }
}

// No gate: out = R_T(rn(res + y)), d_y = d_residual = grad; a d_gate is refused.
TEST(ModulationForms, GateResidualWithoutAGateIsThePlainResidualAdd) {
  for (DType dtype : {DType::kBF16, DType::kF32})
    for (bool upcast : {false, true}) {
      const Problem p{2, 40, 16, kForms[0], dtype, dtype, upcast, std::nullopt};
      SCOPED_TRACE(describe(p));
      GateRun run(p, 31, false);
      DETDIT_ASSERT_OK(run.forward());
      DETDIT_ASSERT_OK(run.backward());
      const GateOracle ref(run);
      EXPECT_BITWISE_EQ(ref.out, run.out);
      EXPECT_BITWISE_EQ(ref.d_residual, run.d_residual);
      EXPECT_BITWISE_EQ(ref.d_y, run.d_y);
      GateResidualBackwardParams b{run.inputs(), run.grad.view(), {}, {}, run.d_gate.view()};
      EXPECT_TRUE(refused(gate_residual_backward(b), ErrorKind::kValue, "d_gate needs a gate"));
    }
}

// ---- batch invariance -------------------------------------------------------------------

// Rows [b*rows, (b+1)*rows) of `batched` hold the bytes of `alone` (all of it).
::testing::AssertionResult item_equal(const HostTensor& alone, const HostTensor& batched, int64_t b) {
  const std::size_t bytes = alone.nbytes();
  return bitwise_equal_bytes(alone.data(), static_cast<const char*>(batched.data()) + b * bytes,
                             static_cast<std::size_t>(alone.numel()), alone.dtype());
}

// Copy item b of `from` (B items) into the single-item `to`.
void take_item(const HostTensor& from, int64_t b, HostTensor* to) {
  std::memcpy(to->data(), static_cast<const char*>(from.data()) + b * to->nbytes(), to->nbytes());
}

// Sample 1 of a batch of 3 gives the same bytes as that sample alone: out,
// dx and its rows of d_shift, d_scale, d_gate (S = 300: flattened chunks would
// straddle the samples). The other samples' data differ.
TEST(ModulationForms, PerSampleAndPerFrameGradientsAreBatchInvariantBitwise) {
  const Form forms[] = {{"per_sample", 1, Shape::kBH}, {"per_frame F=3", 3, Shape::kBFH},
                        {"per_token", 300, Shape::kBFH}};
  for (const Form& form : forms)
    for (const Recipe& recipe : kRecipes) {
      const Problem batched{3, 300, 16, form, recipe.x, recipe.mod, recipe.upcast, std::optional<float>(0.5f)};
      Problem single = batched;
      single.batch = 1;
      SCOPED_TRACE(describe(batched));
      NormRun nb(batched, 41), ns(single, 99);
      take_item(nb.x, 1, &ns.x);
      take_item(nb.grad, 1, &ns.grad);
      take_item(nb.mod.t, 1, &ns.mod.t);
      copy_bytes(nb.w, &ns.w);
      DETDIT_ASSERT_OK(nb.forward());
      DETDIT_ASSERT_OK(nb.backward());
      DETDIT_ASSERT_OK(ns.forward());
      DETDIT_ASSERT_OK(ns.backward());
      EXPECT_TRUE(item_equal(ns.out, nb.out, 1));
      EXPECT_TRUE(item_equal(ns.dx, nb.dx, 1));
      EXPECT_TRUE(item_equal(ns.d_shift, nb.d_shift, 1));
      EXPECT_TRUE(item_equal(ns.d_scale, nb.d_scale, 1));

      GateRun gb(batched, 51), gs(single, 98);
      take_item(gb.residual, 1, &gs.residual);
      take_item(gb.y, 1, &gs.y);
      take_item(gb.grad, 1, &gs.grad);
      take_item(gb.mod.t, 1, &gs.mod.t);
      DETDIT_ASSERT_OK(gb.forward());
      DETDIT_ASSERT_OK(gb.backward());
      DETDIT_ASSERT_OK(gs.forward());
      DETDIT_ASSERT_OK(gs.backward());
      EXPECT_TRUE(item_equal(gs.out, gb.out, 1));
      EXPECT_TRUE(item_equal(gs.d_y, gb.d_y, 1));
      EXPECT_TRUE(item_equal(gs.d_gate, gb.d_gate, 1));
    }
}

// Per token: d_shift / d_scale / d_gate of a position are its own row's
// terms alone (rn(+0.0 + g), fma(g, n, +0.0) then the one-partial fold):
// changing another position's grad changes no other row's gradient.
TEST(ModulationForms, PerTokenGradientsAreRowLocal) {
  const Problem p{2, 64, 16, {"per_token", 64, Shape::kBFH}, DType::kBF16, DType::kF32, false, std::nullopt};
  NormRun a(p, 61), b(p, 61);
  b.grad.set(37 * 16 + 3, 1000.0);  // position 37, element 3
  DETDIT_ASSERT_OK(a.forward());
  DETDIT_ASSERT_OK(a.backward());
  DETDIT_ASSERT_OK(b.forward());
  DETDIT_ASSERT_OK(b.backward());
  for (int64_t pos = 0; pos < 128; ++pos) {
    const bool same = std::memcmp(static_cast<const char*>(a.d_shift.data()) + pos * 16 * 4,
                                  static_cast<const char*>(b.d_shift.data()) + pos * 16 * 4, 16 * 4) == 0;
    EXPECT_EQ(same, pos != 37) << pos;
  }
}

// ---- the indexed form is unchanged ------------------------------------------------------

// An fp32 table on bf16 x through a plan: the indexed form follows the
// upcast = false promotion (out fp32) with the plan's rows.
TEST(ModulationForms, IndexedFormTakesAnFp32TableWithPromotion) {
  IndexCase c = make_index_case(Packing::kInterleaved, 40, 3, 2);
  const IndexPlan plan = adaln_plan(c);
  const int64_t h = 16, positions = c.positions();
  HostTensor x = random_tensor(DType::kBF16, {positions, h}, 1), w = random_tensor(DType::kBF16, {h}, 2, 1.0, 0.1);
  HostTensor table = random_tensor(DType::kF32, {c.num_rows(), 2 * h}, 3, 0.0, 0.5);
  HostTensor out(DType::kF32, {positions, h}), rstd(DType::kF32, {positions});
  const TensorView shift = TensorView::strided(table.data(), DType::kF32, {c.num_rows(), h}, {2 * h, 1});
  const TensorView scale =
      TensorView::strided(table.ptr<float>() + h, DType::kF32, {c.num_rows(), h}, {2 * h, 1});
  RmsnormParams params;
  params.in.x = x.view();
  params.in.weight = w.view();
  params.in.shift = shift;
  params.in.scale = scale;
  params.in.plan = plan;
  params.out = out.view();
  params.rstd = rstd.view();
  DETDIT_ASSERT_OK(rmsnorm_forward(params));
  for (int64_t pos = 0; pos < positions; ++pos) {
    const int64_t r = c.row(pos % c.seq_len);
    for (int64_t i = 0; i < h; ++i) {
      const float n = round_as(num::mul32(get(w, i), num::mul32(rstd.ptr<float>()[pos], get(x, pos * h + i))),
                               DType::kBF16);
      const float v = num::mul32(n, num::add32(1.0f, get(table, r * 2 * h + h + i)));
      ASSERT_EQ(num::add32(v, get(table, r * 2 * h + i)), out.ptr<float>()[pos * h + i]) << pos << " " << i;
    }
  }
}

// ---- refusals -----------------------------------------------------------------------

TEST(ModulationForms, FormAndShapeErrorsAreRefusedBeforeAnyWrite) {
  const Problem p{2, 600, 32, {"per_frame", 2, Shape::kBFH}, DType::kBF16, DType::kF32, false, std::nullopt};
  struct Bad {
    const char* what;
    ErrorKind kind;
    const char* message;
    std::function<void(RmsnormParams*, RmsnormBackwardParams*)> mutate;
  };
  HostTensor frames7 = random_tensor(DType::kF32, {2, 7, 32}, 5);
  HostTensor per_sample = random_tensor(DType::kF32, {2, 32}, 6);
  HostTensor bf16_frames = random_tensor(DType::kBF16, {2, 2, 32}, 7);
  HostTensor f16_frames = random_tensor(DType::kF16, {2, 2, 32}, 8);
  HostTensor wrong_b = random_tensor(DType::kF32, {3, 2, 32}, 9);
  HostTensor wrong_grad = HostTensor(DType::kF32, {2, 3, 32});
  const std::vector<Bad> cases = {
      {"S % F", ErrorKind::kValue, "shift has F = 7 frames, which must divide S = 600",
       [&](RmsnormParams* f, RmsnormBackwardParams* b) { f->in.shift = b->in.shift = frames7.view(); }},
      {"two forms", ErrorKind::kValue, "scale must have shift's form per_frame",
       [&](RmsnormParams* f, RmsnormBackwardParams* b) { f->in.scale = b->in.scale = per_sample.view(); }},
      {"two dtypes", ErrorKind::kType, "scale must have shift's dtype float32",
       [&](RmsnormParams* f, RmsnormBackwardParams* b) { f->in.scale = b->in.scale = bf16_frames.view(); }},
      {"dtype", ErrorKind::kType, "shift must be bfloat16, got float16",
       [&](RmsnormParams* f, RmsnormBackwardParams* b) { f->in.shift = b->in.shift = f16_frames.view(); }},
      {"batch", ErrorKind::kValue, "shift without a plan must be per sample",
       [&](RmsnormParams* f, RmsnormBackwardParams* b) { f->in.shift = b->in.shift = wrong_b.view(); }},
      {"x (M, H)", ErrorKind::kValue, "plan is required: shift",
       [&](RmsnormParams* f, RmsnormBackwardParams* b) {
         f->in.x = b->in.x = f->in.x.reshaped({1200, 32});
         f->out = f->out.reshaped({1200, 32});
         b->grad = b->grad.reshaped({1200, 32});
         b->dx = b->dx.reshaped({1200, 32});
       }},
      {"out dtype", ErrorKind::kType, "shift must be bfloat16, got float32 (",
       [&](RmsnormParams* f, RmsnormBackwardParams* b) {
         f->out.dtype = DType::kBF16;
         b->grad.dtype = DType::kBF16;
       }},
      {"upcast out dtype", ErrorKind::kType, "must be bfloat16 (the promoted dtype",
       [&](RmsnormParams* f, RmsnormBackwardParams* b) { f->in.upcast = b->in.upcast = true; }},
      {"d_shift shape", ErrorKind::kValue, "d_shift must have shift's shape (2, 2, 32)",
       [&](RmsnormParams*, RmsnormBackwardParams* b) { b->d_shift = wrong_grad.view(); }},
  };
  for (const Bad& bad : cases) {
    SCOPED_TRACE(bad.what);
    NormRun run(p, 71);
    for (HostTensor* t : {&run.out, &run.rstd, &run.dx, &run.d_weight, &run.d_shift, &run.d_scale})
      t->fill_bytes(kCanary);
    RmsnormParams f{run.inputs(), run.out.view(), run.rstd.view()};
    RmsnormBackwardParams b{run.inputs(),      run.rstd.view(),    run.grad.view(), run.dx.view(),
                            run.d_weight.view(), run.d_shift.view(), run.d_scale.view()};
    bad.mutate(&f, &b);
    if (std::string(bad.what) != "d_shift shape") {
      EXPECT_TRUE(refused(rmsnorm_forward(f), bad.kind, bad.message));
    }
    EXPECT_TRUE(refused(rmsnorm_backward(b), bad.kind, bad.message));
    for (HostTensor* t : {&run.out, &run.rstd, &run.dx, &run.d_weight, &run.d_shift, &run.d_scale})
      EXPECT_TRUE(all_bytes_are(*t, kCanary));
  }
}

TEST(ModulationForms, GateErrorsAreRefusedBeforeAnyWrite) {
  const Problem p{2, 600, 32, {"per_sample", 1, Shape::kBH}, DType::kBF16, DType::kBF16, false, std::nullopt};
  GateRun run(p, 81);
  HostTensor frames7 = random_tensor(DType::kBF16, {2, 7, 32}, 5);
  HostTensor d_gate_wrong(DType::kF32, {2, 1, 32});
  for (HostTensor* t : {&run.out, &run.d_residual, &run.d_y, &run.d_gate}) t->fill_bytes(kCanary);
  GateResidualParams f{run.inputs(), run.out.view()};
  f.in.gate = frames7.view();
  EXPECT_TRUE(refused(gate_residual_forward(f), ErrorKind::kValue, "gate has F = 7 frames, which must divide S = 600"));
  GateResidualBackwardParams b{run.inputs(), run.grad.view(), run.d_residual.view(), run.d_y.view(),
                               d_gate_wrong.view()};
  EXPECT_TRUE(refused(gate_residual_backward(b), ErrorKind::kValue, "d_gate must have gate's shape (2, 32)"));
  for (HostTensor* t : {&run.out, &run.d_residual, &run.d_y, &run.d_gate}) EXPECT_TRUE(all_bytes_are(*t, kCanary));
}

}  // namespace
}  // namespace testing
}  // namespace detdit
