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

struct Form {
  const char* name;
  GrlnKind kind;
  int64_t frames;
  bool with_unit;
};
constexpr int64_t kS = 300;
const Form kForms[] = {{"none", GrlnKind::kNone, 0, false},
                       {"per_sample (B, H)", GrlnKind::kGrouped, 1, false},
                       {"per_sample (B, 1, H)", GrlnKind::kGrouped, 1, true},
                       {"per_frame (B, F, H)", GrlnKind::kGrouped, 3, false},
                       {"per_frame (B, F, 1, H)", GrlnKind::kGrouped, 3, true},
                       {"per_token", GrlnKind::kGrouped, kS, false},
                       {"indexed", GrlnKind::kIndexed, 0, false}};
struct Recipe {
  DType x, mod;
  bool upcast;
};
const Recipe kRecipes[] = {{DType::kBF16, DType::kBF16, false}, {DType::kBF16, DType::kF32, false},
                           {DType::kBF16, DType::kF32, true},   {DType::kF16, DType::kF16, true},
                           {DType::kF16, DType::kF32, false},   {DType::kF32, DType::kF32, false}};

TEST(GateResidualRmsnormFormsCuda, EqualsTheCpu) {
  DETDIT_SKIP_WITHOUT_CUDA();
  int checked = 0;
  for (const Form& f : kForms)
    for (const Recipe& r : kRecipes)
      for (int presence = 0; presence < (f.kind == GrlnKind::kNone ? 1 : 3); ++presence)
        for (int variant = 0; variant < 4; ++variant) {
          const bool k = variant & 1, d_h = variant & 2;
          if (k && (f.kind == GrlnKind::kNone || presence == 2)) continue;
          const GrlnProblem p{2,   kS,  72,           f.kind,        f.frames,      f.with_unit, r.x,
                              r.mod, r.upcast, GrlnAffine::kWeight, presence != 2, presence != 1, k,
                              d_h, GrlnNorm::kRmsnorm};
          SCOPED_TRACE(std::string(f.name) + ": " + p.describe());
          const GrlnInputs in(p, 4000 + checked);
          for (GrlnGrads grads : {GrlnGrads::kAll, GrlnGrads::kNoResidual, GrlnGrads::kNormOnly}) {
            SCOPED_TRACE(grads == GrlnGrads::kAll ? "every gradient" : grads == GrlnGrads::kNoResidual
                                                                          ? "g in scratch" : "the norm's gradients");
            GrlnOutputs cpu, gpu;
            DETDIT_ASSERT_OK(run_fused(in, Device::cpu(), grads, &cpu));
            DETDIT_ASSERT_OK(run_fused(in, Device::cuda(0), grads, &gpu));
            for (const auto& [name, expected] : cpu) {
              SCOPED_TRACE(name);
              ASSERT_TRUE(gpu.count(name));
              EXPECT_BITWISE_EQ(expected, gpu.at(name));
            }
          }
          ++checked;
        }
  EXPECT_GT(checked, 300);
}

}  // namespace
}  // namespace testing
}  // namespace detdit
