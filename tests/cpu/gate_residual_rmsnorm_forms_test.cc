// gate_residual_rmsnorm's modulation forms and recipes on the CPU: every
// output and gradient of the fused op equals gate_residual then rmsnorm
// composed as autograd composes them (tests/support/gate_residual_layernorm_fixture.h
// run_composed), bitwise, over every form (none, per sample, per frame, per
// token, with and without the unit dimension, indexed) x recipe (modulation in
// x's dtype or fp32, upcast false / true) x which modulation tensors are
// present, with and without k and d_h, with g in d_residual, in scratch, and
// the norm's gradients alone (the indexed form in x's dtype with a gate and
// no k is the H3 rule's fused route, every other problem the composed
// route); a sample's outputs and gradients the same bytes alone and in a
// batch of 3; and bad input refused naming the argument, nothing written.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "support/gate_residual_layernorm_fixture.h"
#include "support/rowwise_fixture.h"

namespace detdit {
namespace testing {
namespace {

TEST(GateResidualRmsnormForms, EqualsTheSeparateOpsComposedAsAutogradDoes) {
  int h3_rule = 0;
  const int checked = for_each_grln_forms_problem(kGrlnForms, kGrlnRecipes, GrlnNorm::kRmsnorm,
                                                  [&](const GrlnForm& f, const GrlnProblem& p, int index) {
    SCOPED_TRACE(std::string(f.name) + ": " + p.describe());
    if (f.kind == GrlnKind::kIndexed && p.gate && p.mod_dtype == p.x_dtype && !p.upcast && !p.has_k) ++h3_rule;
    expect_grln_fused_equals_composed(GrlnInputs(p, 3000 + index));
  });
  EXPECT_GT(checked, 300);
  EXPECT_GT(h3_rule, 0);  // the fused route is among them
}

// Sample 1 of a batch of 3 and the same sample alone: the same bytes in every
// row-local output and in its per-sample / per-frame gradients.
TEST(GateResidualRmsnormForms, ASampleIsTheSameAloneAndInABatch) {
  int checked = 0;
  for (const GrlnForm& f : kGrlnForms) {
    if (f.kind != GrlnKind::kGrouped) continue;
    for (const GrlnRecipe& r : kGrlnRecipes) {
      expect_grln_sample_alone_as_in_batch(f, r, GrlnAffine::kWeight, GrlnNorm::kRmsnorm);
      ++checked;
    }
  }
  EXPECT_EQ(checked, 5 * 6);
}

// The op's arguments broken one at a time (per-sample bf16): refused, forward
// and backward, naming the argument, and no output written.
TEST(GateResidualRmsnormForms, BadInputIsRefusedAndWritesNothing) {
  const GrlnProblem p{2,     12,    8,    GrlnKind::kGrouped, 1,    false, DType::kBF16, DType::kBF16, false,
                      GrlnAffine::kWeight, true, true, false, true, GrlnNorm::kRmsnorm};
  const GrlnInputs in(p, 3);
  HostTensor token_parent = random_tensor(DType::kBF16, {2, 12, 6, 8}, 9);
  HostTensor f32_parent = random_tensor(DType::kF32, {2, 6, 8}, 10);
  HostTensor f32_h(DType::kF32, {2, 12, 8}), f32_weight = random_tensor(DType::kF32, {8}, 11);
  GrlnOutputs o = grln_host_outputs(in);
  const GateResidualRmsnormInputs args = grln_cpu_args<GateResidualRmsnormInputs>(in);
  using Params = GateResidualRmsnormParams;
  using BackwardParams = GateResidualRmsnormBackwardParams;
  std::vector<GrlnBad<Params, BackwardParams>> cases =
      grln_common_bad_inputs<Params, BackwardParams>(&token_parent, "gate has F = 5 frames, which must divide S = 12");
  const std::vector<GrlnBad<Params, BackwardParams>> own = {
      {"an fp32 gate with upcast: h has x's dtype, not fp32", ErrorKind::kType,
       "h must be bfloat16 (gate_residual's output dtype)",
       [&](auto* f, auto* b) {
         f->in.gate = b->in.gate = TensorView::strided(static_cast<char*>(f32_parent.data()) + 2 * 8 * 4,
                                                       DType::kF32, {2, 8}, {48, 1});
         f->in.upcast = b->in.upcast = true;
         f->h = b->h = f32_h.view();
         f->in.weight = b->in.weight = f32_weight.view();
         b->d_gate = TensorView();
       }},
      {"an fp32 gate each op with h in x's dtype: the gate is named", ErrorKind::kType,
       "gate must be bfloat16, got float32",
       [&](auto* f, auto* b) {
         f->in.gate = b->in.gate = TensorView::strided(static_cast<char*>(f32_parent.data()) + 2 * 8 * 4,
                                                       DType::kF32, {2, 8}, {48, 1});
         b->d_gate = TensorView();
       }},
      {"weight not in h's dtype", ErrorKind::kType, "weight must have h's dtype bfloat16",
       [&](auto* f, auto* b) { f->in.weight = b->in.weight = f32_weight.view(); }},
      {"h of fp32", ErrorKind::kType, "h must be bfloat16",
       [](auto* f, auto* b) { f->h.dtype = b->h.dtype = DType::kF32; }},
  };
  cases.insert(cases.end(), own.begin(), own.end());
  expect_grln_bad_inputs_refused(
      cases, &o, {&f32_h},
      [&](Params* f, BackwardParams* b) {
        *f = Params{args, o["h"].view(), o["out"].view(), o["rstd"].view()};
        b->in = args;
        b->h = o["h"].view();
        b->rstd = o["rstd"].view();
        b->d_out = in.d_out.view();
        b->d_h = in.d_h.view();
        b->d_residual = o["d_residual"].view();
        b->d_y = o["d_y"].view();
        b->d_gate = o["d_gate"].view();
        b->d_weight = o["d_weight"].view();
        b->d_shift = o["d_shift"].view();
        b->d_scale = o["d_scale"].view();
      },
      [](const Params& f) { return gate_residual_rmsnorm_forward(f); },
      [](const BackwardParams& b) { return gate_residual_rmsnorm_backward(b); });
}

}  // namespace
}  // namespace testing
}  // namespace detdit
