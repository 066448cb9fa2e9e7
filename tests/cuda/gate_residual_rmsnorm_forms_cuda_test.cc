// gate_residual_rmsnorm's modulation forms and recipes on CUDA: the op on the
// GPU byte-equal to the CPU reference (which
// tests/cpu/gate_residual_rmsnorm_forms_test.cc checks against the two ops
// composed), forward (h, out, rstd) and every gradient, over every form x
// recipe x which modulation tensors are present, with and without k and d_h,
// with g in d_residual, in scratch, and the norm's gradients alone; the
// indexed form in x's dtype with a gate and no k runs the H3 rule's fused
// kernels, every other problem the two ops' CUDA backends. Portable profile.
#include <gtest/gtest.h>

#include <string>

#include "cuda/cuda_test_util.h"
#include "support/gate_residual_layernorm_fixture.h"

namespace detdit {
namespace testing {
namespace {

TEST(GateResidualRmsnormFormsCuda, EqualsTheCpu) {
  DETDIT_SKIP_WITHOUT_CUDA();
  const int checked = for_each_grln_forms_problem(kGrlnForms, kGrlnRecipes, GrlnNorm::kRmsnorm,
                                                  [&](const GrlnForm& f, const GrlnProblem& p, int index) {
    SCOPED_TRACE(std::string(f.name) + ": " + p.describe());
    expect_grln_cuda_equals_cpu(GrlnInputs(p, 4000 + index));
  });
  EXPECT_GT(checked, 300);
}

}  // namespace
}  // namespace testing
}  // namespace detdit
