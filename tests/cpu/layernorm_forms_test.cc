// The modulated layernorm (out = layernorm(x) * (1 + scale) + shift) in every
// modulation form (indexed, per sample, per frame, per token, none) and both
// recipes on the CPU reference, against an emulation written here from
// docs/numerics.md 9.1-9.6 (every step one rn(...) of scalar_math, the
// Welford tree and BlockReduceSum as plain loops, the reductions as plain
// loops), compared bitwise; plus the exact properties: the plain norm's bytes
// in both recipes and with a plan, a sample's outputs and gradients the same
// bytes alone and in a batch of 3, per-token gradients row-local; and the
// refusals (naming the argument, before anything is written).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "common/scalar_math.h"
#include "detdit/layernorm.h"
#include "detdit/modulation.h"
#include "support/cases.h"
#include "support/rowwise_fixture.h"
#include "support/test_util.h"

namespace detdit {
namespace testing {
namespace {

constexpr int kChunk = 256;  // positions per chunk (numerics 6.5)
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

float get(const HostTensor& t, int64_t i) { return static_cast<float>(t.get(i)); }

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

  HostTensor grad_shape(DType dtype) const {
    if (p.kind == Kind::kIndexed) return HostTensor(dtype, {mod_rows, p.hidden});
    if (p.frames == 1)
      return p.with_unit ? HostTensor(dtype, {p.batch, 1, p.hidden}) : HostTensor(dtype, {p.batch, p.hidden});
    return p.with_unit ? HostTensor(dtype, {p.batch, p.frames, 1, p.hidden})
                       : HostTensor(dtype, {p.batch, p.frames, p.hidden});
  }
  // Chunk c of the parent as the models' `.chunk(6, dim=-2)` view.
  TensorView chunk(int64_t c) const {
    char* base = static_cast<char*>(parent.data()) + c * p.hidden * static_cast<int64_t>(dtype_size(parent.dtype()));
    const int64_t h = p.hidden, sf = 6 * h, sb = p.kind == Kind::kIndexed ? sf : p.frames * sf;
    const DType d = parent.dtype();
    if (p.kind == Kind::kIndexed) return TensorView::strided(base, d, {mod_rows, h}, {sf, 1});
    if (p.frames == 1)
      return p.with_unit ? TensorView::strided(base, d, {p.batch, 1, h}, {sb, sf, 1})
                         : TensorView::strided(base, d, {p.batch, h}, {sb, 1});
    return p.with_unit ? TensorView::strided(base, d, {p.batch, p.frames, 1, h}, {sb, sf, h, 1})
                       : TensorView::strided(base, d, {p.batch, p.frames, h}, {sb, sf, 1});
  }
  // The parent row of position pos: its table row (indexed) or group b*F + s / L.
  int64_t row_of(int64_t pos) const {
    if (p.kind == Kind::kIndexed) return index.row(pos % p.seq);
    return pos / p.seq * p.frames + (pos % p.seq) / (p.seq / p.frames);
  }
  float mod_at(int64_t c, int64_t row, int64_t i) const { return get(parent, (row * 6 + c) * p.hidden + i); }

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

// ---- the emulation, from docs/numerics.md 9 ----------------------------------------------

struct Welford {
  float mean, m2, count;
};
Welford step(Welford s, float v) {  // 9.1 step
  const float delta = num::sub32(v, s.mean);
  const float count = num::add32(s.count, 1.0f);
  const float r = num::div32(1.0f, count);
  const float mean = num::fma32(delta, r, s.mean);
  return {mean, num::fma32(delta, num::sub32(v, mean), s.m2), count};
}
Welford combine(Welford own, Welford other) {  // 9.1 combine
  const float delta = num::sub32(own.mean, other.mean);
  const float count = num::add32(other.count, own.count);
  if (!(count > 0.0f)) return {0.0f, 0.0f, count};
  const float coef = num::div32(1.0f, count);
  const float n_oth = num::mul32(other.count, coef), n_own = num::mul32(own.count, coef);
  return {num::fma32(n_oth, other.mean, num::mul32(n_own, own.mean)),
          num::fma32(num::mul32(num::mul32(delta, delta), other.count), n_own, num::add32(other.m2, own.m2)), count};
}
// 9.1 row_stats: (mean, var).
std::pair<float, float> row_stats(const std::vector<float>& x) {
  const int64_t h = static_cast<int64_t>(x.size());
  std::vector<Welford> s(128, Welford{0.0f, 0.0f, 0.0f});
  for (int t = 0; t < 128; ++t)
    for (int64_t j = t; j < h / 4; j += 128)
      for (int e = 0; e < 4; ++e) s[t] = step(s[t], x[4 * j + e]);
  Welford wr[4];
  for (int w = 0; w < 4; ++w) {
    std::vector<Welford> v(s.begin() + 32 * w, s.begin() + 32 * w + 32);
    for (int off = 16; off >= 1; off /= 2)
      for (int l = 0; l < off; ++l) v[l] = combine(v[l], v[l + off]);
    wr[w] = v[0];
  }
  const Welford total = combine(combine(wr[0], wr[2]), combine(wr[1], wr[3]));
  return {total.mean, num::div32(total.m2, static_cast<float>(h))};
}
// 9.3 block_sum.
float block_sum(const std::vector<float>& v) {
  float wr[4];
  for (int w = 0; w < 4; ++w) {
    std::vector<float> u(v.begin() + 32 * w, v.begin() + 32 * w + 32);
    for (int off = 16; off >= 1; off /= 2)
      for (int l = 0; l < off; ++l) u[l] = num::add32(u[l], u[l + off]);
    wr[w] = u[0];
  }
  return num::add32(num::add32(num::add32(wr[0], 0.0f), num::add32(wr[2], 0.0f)),
                    num::add32(num::add32(wr[1], 0.0f), num::add32(wr[3], 0.0f)));
}

// Every result of a LnRun written out from docs/numerics.md 9.
struct Oracle {
  HostTensor out, mean, rstd, dx, d_weight, d_bias, d_shift, d_scale;
  explicit Oracle(const LnRun& r) {
    const Problem& p = r.p;
    const int64_t h = p.hidden, positions = p.batch * p.seq;
    const bool on = p.kind != Kind::kNone;
    const DType t = p.x_dtype, m = p.mod_dtype, promoted = m == DType::kF32 ? DType::kF32 : t;
    // Where each step rounds (9.5 / 5.12): eager's promoted dtypes, or FP32 and one rounding.
    auto norm_r = [&](float v) { return p.upcast ? v : round_as(v, t); };
    auto factor_r = [&](float v) { return p.upcast ? v : round_as(v, m); };
    auto mid_r = [&](float v) { return p.upcast ? v : round_as(v, promoted); };
    const bool has_w = p.affine != Affine::kNone, has_b = p.affine == Affine::kWeightBias;
    auto w = [&](int64_t i) { return has_w ? get(r.w, i) : 1.0f; };
    auto x = [&](int64_t pos, int64_t i) { return get(r.x, pos * h + i); };
    auto g = [&](int64_t pos, int64_t i) { return get(r.grad, pos * h + i); };
    auto t1 = [&](int64_t pos, int64_t i) { return factor_r(num::add32(1.0f, r.mod_at(1, r.row_of(pos), i))); };
    out = HostTensor(r.out.dtype(), {p.batch, p.seq, h});
    mean = HostTensor(DType::kF32, {positions});
    rstd = HostTensor(DType::kF32, {positions});
    dx = HostTensor(t, {p.batch, p.seq, h});
    std::vector<float> n(positions * h), d_n(positions * h), xhat(positions * h);
    for (int64_t pos = 0; pos < positions; ++pos) {
      std::vector<float> row(h);
      for (int64_t i = 0; i < h; ++i) row[i] = x(pos, i);
      const auto [mu, var] = row_stats(row);
      const float rs = num::portable_rsqrt(num::add32(var, kEps));
      mean.ptr<float>()[pos] = mu;
      rstd.ptr<float>()[pos] = rs;
      for (int64_t i = 0; i < h; ++i) {
        const float pi = num::mul32(rs, num::sub32(x(pos, i), mu));
        const float v = !has_w ? pi : has_b ? num::fma32(w(i), pi, get(r.b, i)) : num::mul32(w(i), pi);
        const int64_t e = pos * h + i;
        xhat[e] = num::mul32(num::sub32(x(pos, i), mu), rs);
        if (!on) {
          out.set(e, v);  // set() rounds to out's dtype
          d_n[e] = g(pos, i);
          continue;
        }
        n[e] = norm_r(v);
        out.set(e, num::add32(mid_r(num::mul32(n[e], t1(pos, i))), r.mod_at(0, r.row_of(pos), i)));
        d_n[e] = num::mul32(g(pos, i), t1(pos, i));
      }
      // 9.3 with d_n for g.
      std::vector<float> s1(128, 0.0f), s2(128, 0.0f);
      for (int tt = 0; tt < 128; ++tt)
        for (int64_t j = tt; j < h / 4; j += 128)
          for (int e = 0; e < 4; ++e) {
            const int64_t i = 4 * j + e;
            const float gw = num::mul32(d_n[pos * h + i], w(i));
            s1[tt] = num::add32(s1[tt], gw);
            s2[tt] = num::fma32(num::mul32(gw, num::sub32(x(pos, i), mu)), rs, s2[tt]);
          }
      const float S1 = block_sum(s1), S2 = block_sum(s2), fh = static_cast<float>(h);
      const float term1 = num::mul32(num::div32(1.0f, fh), rs);
      for (int64_t i = 0; i < h; ++i) {
        const float a = num::mul32(num::mul32(num::sub32(x(pos, i), mu), rs), S2);
        const float f = num::fma32(num::mul32(fh, w(i)), d_n[pos * h + i], -a);
        dx.set(pos * h + i, num::mul32(num::sub32(f, S1), term1));
      }
    }
    // 9.4 / 9.6: d_weight and d_bias over chunks of the flattened positions.
    d_weight = HostTensor(r.d_weight.dtype(), {h});
    d_bias = HostTensor(r.d_bias.dtype(), {h});
    for (int64_t i = 0; i < h; ++i) {
      float fw = 0.0f, fb = 0.0f;
      for (int64_t begin = 0; begin < positions; begin += kChunk) {
        float aw = 0.0f, ab = 0.0f;
        for (int64_t pos = begin; pos < std::min(begin + kChunk, positions); ++pos) {
          aw = num::fma32(d_n[pos * h + i], xhat[pos * h + i], aw);
          ab = num::add32(ab, d_n[pos * h + i]);
        }
        fw = num::add32(fw, aw);
        fb = num::add32(fb, ab);
      }
      d_weight.set(i, fw);
      d_bias.set(i, fb);
    }
    if (!on) return;
    // d_shift, d_scale: per group, chunks from the group's first position
    // (6.11); indexed, the canonical reduction over the plan's rows (6.5).
    d_shift = r.grad_shape(r.d_shift.dtype());
    d_scale = r.grad_shape(r.d_scale.dtype());
    const int64_t len = p.kind == Kind::kGrouped ? p.seq / p.frames : 0;
    auto reduce = [&](int64_t row, int64_t i, bool scale) {
      auto step_at = [&](float acc, int64_t pos) {
        return scale ? num::fma32(g(pos, i), n[pos * h + i], acc) : num::add32(acc, g(pos, i));
      };
      float fold = 0.0f;
      if (p.kind == Kind::kGrouped) {
        for (int64_t begin = row * len; begin < (row + 1) * len; begin += kChunk) {
          float acc = 0.0f;
          for (int64_t pos = begin; pos < std::min(begin + kChunk, (row + 1) * len); ++pos) acc = step_at(acc, pos);
          fold = num::add32(fold, acc);
        }
        return fold;
      }
      for (int64_t begin = 0; begin < positions; begin += kChunk) {
        float acc = 0.0f;
        bool any = false;
        for (int64_t pos = begin; pos < std::min(begin + kChunk, positions); ++pos)
          if (r.row_of(pos) == row) {
            acc = step_at(acc, pos);
            any = true;
          }
        if (any) fold = num::add32(fold, acc);
      }
      return fold;
    };
    for (int64_t row = 0; row < r.mod_rows; ++row)
      for (int64_t i = 0; i < h; ++i) {
        d_shift.set(row * h + i, reduce(row, i, false));
        d_scale.set(row * h + i, reduce(row, i, true));
      }
  }
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

void expect_matches_oracle(LnRun& run) {
  DETDIT_ASSERT_OK(run.forward());
  DETDIT_ASSERT_OK(run.backward());
  const Oracle ref(run);
  EXPECT_BITWISE_EQ(ref.mean, run.mean);
  EXPECT_BITWISE_EQ(ref.rstd, run.rstd);
  EXPECT_BITWISE_EQ(ref.out, run.out);
  EXPECT_BITWISE_EQ(ref.dx, run.dx);
  if (run.p.affine != Affine::kNone) {
    EXPECT_BITWISE_EQ(ref.d_weight, run.d_weight);
  }
  if (run.p.affine == Affine::kWeightBias) {
    EXPECT_BITWISE_EQ(ref.d_bias, run.d_bias);
  }
  if (run.p.kind != Kind::kNone) {
    EXPECT_BITWISE_EQ(ref.d_shift, run.d_shift);
    EXPECT_BITWISE_EQ(ref.d_scale, run.d_scale);
  }
}

// S = 600: groups of 600, 300, 200, 6 and 1 positions, so chunks of 256
// counted from a group's start differ from chunks of the flattened batch; the
// affine variants rotate over the recipes.
TEST(LayernormForms, GroupedFormsFollowTheContractBitwise) {
  struct FormCase {
    int64_t frames;
    bool with_unit;
  };
  const FormCase forms[] = {{1, false}, {1, true}, {2, false}, {3, true}, {100, false}, {600, false}};
  const Affine affines[] = {Affine::kNone, Affine::kWeight, Affine::kWeightBias};
  int k = 0;
  for (const FormCase& form : forms)
    for (const RecipeCase& recipe : kRecipes) {
      const Problem p{2, 600, 32, Kind::kGrouped, form.frames, form.with_unit, recipe.x, recipe.mod, recipe.upcast,
                      affines[k++ % 3]};
      SCOPED_TRACE(describe(p));
      LnRun run(p, 11);
      expect_matches_oracle(run);
    }
}

// The indexed form: (R, H) tables through a plan, x's dtype or fp32, both
// recipes (B = 2, S = 300: flattened chunks straddle the items).
TEST(LayernormForms, IndexedFormFollowsTheContractBitwise) {
  for (const RecipeCase& recipe : kRecipes)
    for (Affine affine : {Affine::kNone, Affine::kWeightBias}) {
      const Problem p{2, 300, 16, Kind::kIndexed, 0, false, recipe.x, recipe.mod, recipe.upcast, affine};
      SCOPED_TRACE(describe(p));
      LnRun run(p, 17);
      expect_matches_oracle(run);
    }
}

// Rows of H = 1032 (258 vectors: threads 0 and 1 hold three, the others two)
// and H = 4 (one thread holds the row; empty partners in every combine).
TEST(LayernormForms, WideAndNarrowRowsFollowTheContractBitwise) {
  for (int64_t hidden : {4, 1032})
    for (const RecipeCase& recipe : {kRecipes[1], kRecipes[2]}) {
      const Problem p{2, 20, hidden, Kind::kGrouped, 4, false, recipe.x, recipe.mod, recipe.upcast,
                      Affine::kWeightBias};
      SCOPED_TRACE(describe(p));
      LnRun run(p, 19);
      expect_matches_oracle(run);
    }
}

// No shift and scale: the plain norm's bytes (numerics 9.2-9.4) in both
// recipes, with or without a plan that describes x's rows.
TEST(LayernormForms, ThePlainNormIsTheSameInBothRecipesAndWithAPlan) {
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    const Problem p{2, 300, 16, Kind::kNone, 1, false, dtype, dtype, false, Affine::kWeightBias};
    SCOPED_TRACE(describe(p));
    LnRun base(p, 23);
    expect_matches_oracle(base);
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
