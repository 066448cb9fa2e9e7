// The modulation forms and recipes of rmsnorm and gate_residual on CUDA
// (src/cuda/rmsnorm_forms.cu, src/cuda/gate_residual.cu, fold_group_partials):
// every form (per sample, per frame, per token, indexed with an fp32 table,
// none) x recipe (modulation in x's dtype or fp32, upcast false / true, k)
// byte-equal to the CPU reference (tests/cpu/modulation_forms_test.cc checks
// the CPU against numerics 5.12 / 6.11), forward and every gradient. The
// modulation tensors are chunk views of a (B, F, 6, H) tensor, as the models
// make them.
#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cases/forms_cases.h"
#include "cuda/cuda_test_util.h"
#include "detdit/gate_residual.h"
#include "detdit/rmsnorm.h"

namespace detdit {
namespace testing {
namespace {

struct Form {
  const char* name;
  int64_t frames;  // F (0: none; -1: indexed through a plan)
};
struct Recipe {
  DType x, mod;
  bool upcast;
};

const Form kForms[] = {{"per_sample", 1}, {"per_frame F=3", 3}, {"per_token", 300}, {"indexed", -1}};
const Recipe kRecipes[] = {{DType::kBF16, DType::kBF16, false}, {DType::kBF16, DType::kF32, false},
                           {DType::kBF16, DType::kF32, true},   {DType::kF16, DType::kF16, true},
                           {DType::kF32, DType::kF32, false}};
constexpr int64_t kB = 2, kS = 300, kH = 64;

DType out_dtype(const Recipe& r) { return r.upcast || r.mod != DType::kF32 ? r.x : DType::kF32; }

// Chunk c of the parent (B, F, 6, H) as a (B, F, H) view (per sample (B, H));
// indexed: the parent is (R, 6, H) and the chunk an (R, H) view: the op
// cases' views (cases/forms_cases.h).
TensorView chunk(const TensorView& parent, int64_t c, const Form& f) {
  const ModulationForm form = f.frames < 0      ? ModulationForm::kIndexed
                              : f.frames == 1   ? ModulationForm::kPerSample
                              : f.frames == kS  ? ModulationForm::kPerToken
                                                : ModulationForm::kPerFrame;
  const cases::FormShape shape{DType::kBF16, parent.dtype, kH, kB, kS, form, f.frames};
  return cases::form_geometry(shape).chunk(parent, static_cast<int>(c));
}

TEST(ModulationFormsCuda, RmsnormEqualsTheCpu) {
  DETDIT_SKIP_WITHOUT_CUDA();
  const IndexCase c = make_index_case(Packing::kInterleaved, kS, 3, kB);
  const PlanPair plans = adaln_plan_pair(c);
  for (const Form& f : kForms)
    for (const Recipe& r : kRecipes) {
      SCOPED_TRACE(std::string(f.name) + " x " + dtype_name(r.x) + " mod " + dtype_name(r.mod) +
                   (r.upcast ? " upcast" : ""));
      const bool indexed = f.frames < 0;
      const std::vector<int64_t> parent_shape =
          indexed ? std::vector<int64_t>{c.num_rows(), 6, kH} : std::vector<int64_t>{kB, f.frames, 6, kH};
      Pair x = random_pair(r.x, {kB, kS, kH}, 1), w = random_pair(r.x, {kH}, 2, 1.0, 0.1);
      Pair parent = random_pair(r.mod, parent_shape, 3, 0.0, 0.5);
      Pair grad = random_pair(out_dtype(r), {kB, kS, kH}, 4);
      Pair out = output_pair(out_dtype(r), {kB, kS, kH}), rstd = output_pair(DType::kF32, {kB * kS});
      Pair dx = output_pair(r.x, {kB, kS, kH}), d_weight = output_pair(DType::kF32, {kH});
      const std::vector<int64_t> grad_shape =
          indexed ? std::vector<int64_t>{c.num_rows(), kH}
                  : (f.frames == 1 ? std::vector<int64_t>{kB, kH} : std::vector<int64_t>{kB, f.frames, kH});
      Pair d_shift = output_pair(DType::kF32, grad_shape), d_scale = output_pair(r.mod, grad_shape);
      for (bool gpu : {false, true}) {
        auto v = [&](const Pair& p) { return gpu ? p.d() : p.h(); };
        RmsnormInputs in{v(x), v(w), chunk(v(parent), 0, f), chunk(v(parent), 1, f),
                         indexed ? (gpu ? plans.dev : plans.host) : IndexPlan()};
        in.upcast = r.upcast;
        DETDIT_ASSERT_OK(rmsnorm_forward({in, v(out), v(rstd)}));
        DETDIT_ASSERT_OK(
            rmsnorm_backward({in, v(rstd), v(grad), v(dx), v(d_weight), v(d_shift), v(d_scale)}));
      }
      EXPECT_GPU_EQ_CPU(out);
      EXPECT_GPU_EQ_CPU(rstd);
      EXPECT_GPU_EQ_CPU(dx);
      EXPECT_GPU_EQ_CPU(d_weight);
      EXPECT_GPU_EQ_CPU(d_shift);
      EXPECT_GPU_EQ_CPU(d_scale);
    }
}

TEST(ModulationFormsCuda, GateResidualEqualsTheCpu) {
  DETDIT_SKIP_WITHOUT_CUDA();
  const IndexCase c = make_index_case(Packing::kInterleaved, kS, 3, kB);
  const PlanPair plans = adaln_plan_pair(c);
  for (const Form& f : kForms)
    for (const Recipe& r : kRecipes)
      for (std::optional<float> k : {std::optional<float>(), std::optional<float>(1.0f)}) {
        SCOPED_TRACE(std::string(f.name) + " x " + dtype_name(r.x) + " mod " + dtype_name(r.mod) +
                     (r.upcast ? " upcast" : "") + (k ? " k" : ""));
        const bool indexed = f.frames < 0;
        const std::vector<int64_t> parent_shape =
            indexed ? std::vector<int64_t>{c.num_rows(), 6, kH} : std::vector<int64_t>{kB, f.frames, 6, kH};
        Pair residual = random_pair(r.x, {kB, kS, kH}, 1), y = random_pair(r.x, {kB, kS, kH}, 2);
        Pair parent = random_pair(r.mod, parent_shape, 3, 0.0, 0.5);
        Pair grad = random_pair(out_dtype(r), {kB, kS, kH}, 4);
        Pair out = output_pair(out_dtype(r), {kB, kS, kH});
        Pair d_residual = output_pair(r.x, {kB, kS, kH}), d_y = output_pair(r.x, {kB, kS, kH});
        const std::vector<int64_t> grad_shape =
            indexed ? std::vector<int64_t>{c.num_rows(), kH}
                    : (f.frames == 1 ? std::vector<int64_t>{kB, kH} : std::vector<int64_t>{kB, f.frames, kH});
        Pair d_gate = output_pair(DType::kF32, grad_shape);
        for (bool gpu : {false, true}) {
          auto v = [&](const Pair& p) { return gpu ? p.d() : p.h(); };
          GateResidualInputs in{v(residual), v(y), chunk(v(parent), 2, f),
                                indexed ? (gpu ? plans.dev : plans.host) : IndexPlan()};
          in.has_k = k.has_value();
          in.k = k.value_or(0.0f);
          in.upcast = r.upcast;
          DETDIT_ASSERT_OK(gate_residual_forward({in, v(out)}));
          DETDIT_ASSERT_OK(gate_residual_backward({in, v(grad), v(d_residual), v(d_y), v(d_gate)}));
        }
        EXPECT_GPU_EQ_CPU(out);
        EXPECT_GPU_EQ_CPU(d_residual);
        EXPECT_GPU_EQ_CPU(d_y);
        EXPECT_GPU_EQ_CPU(d_gate);
      }
}

// No gate: the plain residual add on both devices.
TEST(ModulationFormsCuda, GateResidualWithoutAGateEqualsTheCpu) {
  DETDIT_SKIP_WITHOUT_CUDA();
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    Pair residual = random_pair(dtype, {kB, kS, kH}, 1), y = random_pair(dtype, {kB, kS, kH}, 2);
    Pair grad = random_pair(dtype, {kB, kS, kH}, 4);
    Pair out = output_pair(dtype, {kB, kS, kH}), d_residual = output_pair(dtype, {kB, kS, kH}),
         d_y = output_pair(dtype, {kB, kS, kH});
    for (bool gpu : {false, true}) {
      auto v = [&](const Pair& p) { return gpu ? p.d() : p.h(); };
      GateResidualInputs in{v(residual), v(y), TensorView(), IndexPlan()};
      DETDIT_ASSERT_OK(gate_residual_forward({in, v(out)}));
      DETDIT_ASSERT_OK(gate_residual_backward({in, v(grad), v(d_residual), v(d_y), TensorView()}));
    }
    EXPECT_GPU_EQ_CPU(out);
    EXPECT_GPU_EQ_CPU(d_residual);
    EXPECT_GPU_EQ_CPU(d_y);
  }
}

}  // namespace
}  // namespace testing
}  // namespace detdit
