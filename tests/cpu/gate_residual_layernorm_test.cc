// gate_residual_layernorm on the CPU: every output and gradient of the fused
// op equals gate_residual then layernorm composed as autograd composes them
// (tests/support/gate_residual_layernorm_fixture.h run_composed), bitwise,
// over every modulation form (none, per sample, per frame, per token, with
// and without the unit dimension, indexed) x recipe (modulation in x's dtype
// or fp32, upcast false / true) x affine variant x which modulation tensors
// are present, with and without k and d_h, with g in d_residual, in
// scratch, and the norm's gradients alone; a sample's outputs and gradients the same bytes alone and in a
// batch of 3; and bad input refused naming the argument, nothing written.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "support/gate_residual_layernorm_fixture.h"
#include "support/rowwise_fixture.h"

namespace detdit {
namespace testing {
namespace {

TEST(GateResidualLayernorm, EqualsTheSeparateOpsComposedAsAutogradDoes) {
  const int checked = for_each_grln_forms_problem(kGrlnForms, kGrlnRecipes, GrlnNorm::kLayernorm,
                                                  [&](const GrlnForm& f, const GrlnProblem& p, int index) {
    SCOPED_TRACE(std::string(f.name) + ": " + p.describe());
    expect_grln_fused_equals_composed(GrlnInputs(p, 1000 + index));
  });
  EXPECT_GT(checked, 300);
}

// Sample 1 of a batch of 3 and the same sample alone: the same bytes in every
// row-local output and in its per-sample / per-frame gradients.
TEST(GateResidualLayernorm, ASampleIsTheSameAloneAndInABatch) {
  for (const GrlnForm& f : kGrlnForms) {
    if (f.kind != GrlnKind::kGrouped) continue;
    for (const GrlnRecipe& r : kGrlnRecipes) {
      expect_grln_sample_alone_as_in_batch(f, r, GrlnAffine::kWeightBias, GrlnNorm::kLayernorm);
    }
  }
}

// The fused op's arguments broken one at a time (per-sample bf16 with fp32
// modulation, weight and bias): refused, forward and backward, with the
// argument's name, and no output written.
TEST(GateResidualLayernorm, BadInputIsRefusedAndWritesNothing) {
  const GrlnProblem p{2, 12, 8, GrlnKind::kGrouped, 1, false, DType::kBF16, DType::kBF16, false,
                      GrlnAffine::kWeightBias, true, true, false, true};
  const GrlnInputs in(p, 3);
  HostTensor token_parent = random_tensor(DType::kBF16, {2, 12, 6, 8}, 9);
  GrlnOutputs o = grln_host_outputs(in);
  GateResidualLayernormInputs args = grln_cpu_args<GateResidualLayernormInputs>(in);
  args.bias = in.b.view();
  using Params = GateResidualLayernormParams;
  using BackwardParams = GateResidualLayernormBackwardParams;
  std::vector<GrlnBad<Params, BackwardParams>> cases =
      grln_common_bad_inputs<Params, BackwardParams>(&token_parent, "F = 5 frames, which must divide S = 12");
  const std::vector<GrlnBad<Params, BackwardParams>> own = {
      {"h of fp32", ErrorKind::kType, "h must be bfloat16 (gate_residual's output dtype)", [](auto* f, auto* b) { f->h.dtype = b->h.dtype = DType::kF32; }},
      {"h shape", ErrorKind::kValue, "h must have", [](auto* f, auto* b) { f->h.shape[1] = b->h.shape[1] = 6; }},
      {"bias without weight", ErrorKind::kValue, "bias needs weight",
       [](auto* f, auto* b) { f->in.weight = b->in.weight = TensorView(); }},
      {"y shape", ErrorKind::kValue, "y", [](auto* f, auto* b) { f->in.y.shape[1] = b->in.y.shape[1] = 6; }},
      {"eps", ErrorKind::kValue, "eps", [](auto* f, auto* b) { f->in.eps = b->in.eps = -1.0f; }},
      {"h over residual / d_gate over gate", ErrorKind::kValue, "overlap",
       [](auto* f, auto* b) {
         f->h = f->in.residual;
         b->d_gate = b->in.gate;
       }},
  };
  cases.insert(cases.end(), own.begin(), own.end());
  expect_grln_bad_inputs_refused(
      cases, &o, {},
      [&](Params* f, BackwardParams* b) {
        *f = Params{args, o["h"].view(), o["out"].view(), o["mean"].view(), o["rstd"].view()};
        *b = BackwardParams{args, o["h"].view(), o["mean"].view(), o["rstd"].view(), in.d_out.view()};
        b->d_h = in.d_h.view();
        b->d_residual = o["d_residual"].view();
        b->d_y = o["d_y"].view();
        b->d_gate = o["d_gate"].view();
        b->d_weight = o["d_weight"].view();
        b->d_bias = o["d_bias"].view();
        b->d_shift = o["d_shift"].view();
        b->d_scale = o["d_scale"].view();
      },
      [](const Params& f) { return gate_residual_layernorm_forward(f); },
      [](const BackwardParams& b) { return gate_residual_layernorm_backward(b); });
}

// Where each error names its argument: d_h of the wrong shape, rstd of the
// wrong shape, d_gate without a gate, d_bias without bias.
TEST(GateResidualLayernorm, BackwardOnlyArgumentsAreNamed) {
  const GrlnProblem p{2, 12, 8, GrlnKind::kGrouped, 1, false, DType::kBF16, DType::kF32, true,
                      GrlnAffine::kWeight, true, true, false, true};
  const GrlnInputs in(p, 5);
  GrlnOutputs o = grln_host_outputs(in);
  HostTensor d_bias(DType::kF32, {8});
  GateResidualLayernormInputs args = grln_cpu_args<GateResidualLayernormInputs>(in);
  args.upcast = true;
  auto backward = [&](const std::function<void(GateResidualLayernormBackwardParams*)>& mutate) {
    for (auto& [name, t] : o) t.fill_bytes(kCanary);
    GateResidualLayernormBackwardParams b{args, o["h"].view(), o["mean"].view(), o["rstd"].view(), in.d_out.view()};
    b.d_h = in.d_h.view();
    b.d_y = o["d_y"].view();
    b.d_gate = o["d_gate"].view();
    mutate(&b);
    return gate_residual_layernorm_backward(b);
  };
  EXPECT_TRUE(refused(backward([](auto* b) { b->d_h.shape[2] = 4; }), ErrorKind::kValue, "d_h must have h's shape"));
  EXPECT_TRUE(refused(backward([](auto* b) { b->rstd.shape[0] = 3; }), ErrorKind::kValue, "rstd"));
  EXPECT_TRUE(refused(backward([](auto* b) { b->in.gate = TensorView(); }), ErrorKind::kValue, "d_gate needs a gate"));
  EXPECT_TRUE(refused(backward([&](auto* b) { b->d_bias = d_bias.view(); }), ErrorKind::kValue, "d_bias needs bias"));
  EXPECT_TRUE(refused(backward([](auto* b) { b->mean = TensorView(); }), ErrorKind::kValue, "mean is required"));
  std::vector<HostTensor*> outputs;
  for (auto& [name, t] : o) outputs.push_back(&t);
  EXPECT_TRUE(still_canary(outputs));
}

}  // namespace
}  // namespace testing
}  // namespace detdit
