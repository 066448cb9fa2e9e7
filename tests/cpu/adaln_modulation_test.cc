// adaln_modulation (projection + gather, fused) through the public API:
// forward bitwise equal to adaln_projection then adaln_row_gather; backward
// bitwise equal to the gather backward with an FP32 d_rows fed straight into
// adaln_projection_backward (the table gradient is never rounded to bf16);
// dW / db correctly rounded against FP64; repeatable; fail-closed.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "support/cases.h"
#include "support/rowwise_fixture.h"
#include "support/test_util.h"
#include "detdit/adaln.h"

namespace detdit {
namespace testing {
namespace {

constexpr int64_t kHidden = 12, kEmbed = 64, kWidth = 18 * kHidden;

// The library's adaln_modulation case (bf16 weight, FP32 temb) at H = 12, D = 64.
OpCase modulation_case(const IndexCase& c) { return adaln_modulation_case({kHidden, kEmbed, c}); }

// The fail-closed fixture: the case's params, from its views.
struct Modulation : CpuCase {
  explicit Modulation(const IndexCase& c) : CpuCase(modulation_case(c)) {}
  AdalnModulationInputs inputs() const { return {view("temb"), view("weight"), view("bias"), plan()}; }
  AdalnModulationParams forward_params() const { return {inputs(), view("table"), view("act"), view("out")}; }
  AdalnModulationBackwardParams backward_params() const {
    return {inputs(), view("act"), view("grad"), view("d_temb"), view("d_weight"), view("d_bias")};
  }
};

TEST(AdalnModulation, EqualsProjectionThenGatherWithFp32TableGradients) {
  for (const IndexCase& c : {make_index_case(Packing::kBlock, 257, 3, 2), make_index_case(Packing::kInterleaved, 513, 4, 1)}) {
    SCOPED_TRACE(c.name());
    CpuCase k(modulation_case(c));
    DETDIT_ASSERT_OK(k.run());
    EXPECT_TRUE(projection_forward_matches(k));
    const IndexPlan plan = adaln_plan(c);
    HostTensor out(DType::kBF16, {6, c.seq_len, kHidden});
    DETDIT_ASSERT_OK(adaln_row_gather_forward({k["table"].view_as({3 * c.num_timesteps, 6 * kHidden}), plan, out.view()}));
    EXPECT_BITWISE_EQ(out, k["out"]);
    HostTensor d_table(DType::kF32, {c.num_timesteps, kWidth});
    DETDIT_ASSERT_OK(adaln_row_gather_backward({k["grad"].view(), plan, d_table.view_as({3 * c.num_timesteps, 6 * kHidden})}));
    EXPECT_TRUE(projection_backward_matches(k, d_table));
  }
}

TEST(AdalnModulation, WeightGradientsAreCorrectlyRoundedAndRepeat) {
  IndexCase c = make_index_case(Packing::kBlock, 4097, 3, 2);
  std::map<std::string, HostTensor> k;
  ASSERT_TRUE(repeats_bitwise(modulation_case(c), &k));
  // exact d_table (T, 18H) = the gather's (3T, 6H) d_rows: row ti*3 + m, column c*H + h  <->  channel m*6H + c*H + h
  // of timestep ti
  const std::vector<double> d_table = row_gather_grad_exact(c, k["grad"], kHidden);
  const ProjectionReference ref = projection_reference(k["temb"], k["weight"], k["bias"], &d_table, DType::kBF16);
  const double dw = fraction_correctly_rounded(k["d_weight"], ref.d_weight);
  const double db = fraction_correctly_rounded(k["d_bias"], ref.d_bias);
  std::printf("adaln_modulation S=4097 B=2 T=3: dW %.3f %%, db %.3f %% correctly rounded\n", 100 * dw, 100 * db);
  EXPECT_GE(dw, 0.995);
  EXPECT_GE(db, 0.995);
  EXPECT_TRUE(within_tolerance(k["d_temb"], ref.d_temb, 1e-4, 1e-4));
}

TEST(AdalnModulation, BadInputsGetClearErrorsAndWriteNothing) {
  IndexCase c = testing::make_index_case(Packing::kBlock, 16, 2, 2);
  IndexPlan timestep_only = testing::timestep_plan(c);  // R = T, not 3T
  HostTensor wide_grad = random_tensor(DType::kBF16, {6, 32, 2 * kHidden}, 3);
  const std::vector<testing::BadParams<AdalnModulationParams, AdalnModulationBackwardParams>> cases = {
      {"plan rows", ErrorKind::kValue, "plan must have R = 3T = 6 table rows, got R = 2",
       [&](AdalnModulationParams* f, AdalnModulationBackwardParams* b) { f->in.plan = b->in.plan = timestep_only; }},
      {"no plan", ErrorKind::kValue, "plan is required",
       [](AdalnModulationParams* f, AdalnModulationBackwardParams* b) { f->in.plan = b->in.plan = IndexPlan(); }},
      {"weight rows not 18H", ErrorKind::kValue, "200",
       [](AdalnModulationParams* f, AdalnModulationBackwardParams* b) { f->in.weight.shape[0] = b->in.weight.shape[0] = 200; }},
      {"temb bf16", ErrorKind::kType, "temb must be float32",
       [](AdalnModulationParams* f, AdalnModulationBackwardParams* b) { f->in.temb.dtype = b->in.temb.dtype = DType::kBF16; }},
      {"torch on cpu", ErrorKind::kValue, "numerics=torch exists on CUDA only",
       [](AdalnModulationParams* f, AdalnModulationBackwardParams* b) { f->in.numerics = b->in.numerics = Numerics::kTorch; }},
  };
  expect_bad_params_refused<Modulation>(cases, adaln_modulation_forward, adaln_modulation_backward, c);
  // backward-only: grad of the wrong width / length / dtype
  Modulation k(c);
  const std::pair<const char*, std::function<void(AdalnModulationBackwardParams*)>> backward_cases[] = {
      {"grad must be (6, B*S, H) with H = weight rows / 18 = 12", [&](AdalnModulationBackwardParams* b) { b->grad = wide_grad.view(); }},
      {"S = plan.seq_len() = 16", [](AdalnModulationBackwardParams* b) { b->grad = b->grad.reshaped({6, 16, 12}); }},
      {"grad must have weight's dtype bfloat16, got float16", [](AdalnModulationBackwardParams* b) { b->grad.dtype = DType::kF16; }},
  };
  for (const auto& [message, mutate] : backward_cases) {
    AdalnModulationBackwardParams b = k.backward_params();
    mutate(&b);
    Status s = adaln_modulation_backward(b);
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find(message), std::string::npos) << s.to_string();
    EXPECT_TRUE(still_canary(k.outputs()));
  }
}

// The projection's bias is required (adaln_projection refused an absent one,
// adaln_modulation took it as zero).
TEST(AdalnModulation, ForwardRefusesAnAbsentBias) {
  Modulation k(testing::make_index_case(Packing::kBlock, 16, 2, 2));
  AdalnModulationParams f = k.forward_params();
  f.in.bias = TensorView();
  EXPECT_TRUE(testing::refused(adaln_modulation_forward(f), ErrorKind::kValue, "bias is required"));
  EXPECT_TRUE(testing::still_canary(k.outputs()));
}

// A broadcast temb (rows of stride 0: a shape its memory does not back) is
// refused before the (T, 18H) FP32 table-gradient scratch is sized from it,
// with the layout error, not an out-of-memory RuntimeError.
TEST(AdalnModulation, BackwardRefusesABroadcastTembBeforeSizingItsScratch) {
  Modulation k(testing::make_index_case(Packing::kBlock, 16, 2, 2));
  AdalnModulationBackwardParams b = k.backward_params();
  b.in.temb = TensorView::strided(b.in.temb.data, DType::kF32, {int64_t{1} << 36, kEmbed}, {0, 1});
  EXPECT_TRUE(testing::refused(adaln_modulation_backward(b), ErrorKind::kValue, "temb must be contiguous"));
  EXPECT_TRUE(testing::still_canary(k.outputs()));
}

}  // namespace
}  // namespace testing
}  // namespace detdit
