// final_adaln_out (H3 norm_out) through the public API: bitwise equal to the
// composition adaln_projection -> modulated rmsnorm (forward) and rmsnorm
// backward with FP32 table gradients -> adaln_projection backward (backward);
// accuracy against the FP64 straight-through reference; repeatability; and
// fail-closed validation (canary outputs untouched).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "support/cases.h"
#include "support/rowwise_fixture.h"
#include "support/test_util.h"
#include "detdit/adaln.h"
#include "detdit/rmsnorm.h"

namespace detdit {
namespace testing {
namespace {

// H = 36 makes N = 2H = 72 a multiple of 18, so adaln_projection can run the
// same table for the composition check.
constexpr int64_t kHidden = 36, kEmbed = 64;

// The library's final_adaln_out case (bf16) at H = 36, D = 64.
OpCase final_case(const IndexCase& c) { return final_adaln_out_case({DType::kBF16, kHidden, kEmbed, c}); }

// The fail-closed fixture: the case's params, from its views.
struct Final : CpuCase {
  explicit Final(const IndexCase& c) : CpuCase(final_case(c)) {}
  FinalAdalnOutInputs inputs() const {
    return {view("x"), view("norm_weight"), view("temb"), view("weight"), view("bias"), plan()};
  }
  FinalAdalnOutParams forward_params() const {
    return {inputs(), view("out"), view("table"), view("act"), view("rstd")};
  }
  FinalAdalnOutBackwardParams backward_params() const {
    return {inputs(),   view("table"), view("act"), view("rstd"), view("grad"), view("dx"), view("d_norm_weight"),
            view("d_temb"), view("d_weight"), view("d_bias")};
  }
};

TEST(FinalAdalnOut, EqualsProjectionThenModulatedRmsnormBitwise) {
  for (const IndexCase& c : {make_index_case(Packing::kBlock, 257, 3, 2), make_index_case(Packing::kInterleaved, 300, 4, 1)}) {
    SCOPED_TRACE(c.name());
    CpuCase k(final_case(c));
    DETDIT_ASSERT_OK(k.run());
    // the same sequence through the separate public ops
    EXPECT_TRUE(projection_forward_matches(k));
    const TensorView table = k["table"].view();
    const RmsnormInputs norm{k["x"].view(), k["norm_weight"].view(), table.narrow(1, 0, kHidden),
                             table.narrow(1, kHidden, kHidden), timestep_plan(c)};
    HostTensor out(DType::kBF16, {c.positions(), kHidden}), rstd(DType::kF32, {c.positions()});
    DETDIT_ASSERT_OK(rmsnorm_forward({norm, out.view(), rstd.view()}));
    EXPECT_BITWISE_EQ(out, k["out"]);
    EXPECT_BITWISE_EQ(rstd, k["rstd"]);
    HostTensor d_table(DType::kF32, {c.num_timesteps, 2 * kHidden}), dx(DType::kBF16, {c.positions(), kHidden});
    HostTensor d_norm_weight(DType::kF32, {kHidden});
    DETDIT_ASSERT_OK(rmsnorm_backward({norm, rstd.view(), k["grad"].view(), dx.view(), d_norm_weight.view(),
                                       d_table.view().narrow(1, 0, kHidden), d_table.view().narrow(1, kHidden, kHidden)}));
    EXPECT_BITWISE_EQ(dx, k["dx"]);
    EXPECT_BITWISE_EQ(d_norm_weight, k["d_norm_weight"]);
    EXPECT_TRUE(projection_backward_matches(k, d_table));  // d_table is FP32: never rounded to bf16 in between
  }
}

TEST(FinalAdalnOut, MatchesTheFp64ReferenceAndRepeats) {
  IndexCase c = make_index_case(Packing::kBlock, 4097, 3, 1);
  std::map<std::string, HostTensor> k;
  ASSERT_TRUE(repeats_bitwise(final_case(c), &k));

  ProjectionReference proj = projection_reference(k["temb"], k["weight"], k["bias"], nullptr, DType::kBF16);
  HostTensor shift(DType::kBF16, {c.num_timesteps, kHidden}), scale(DType::kBF16, {c.num_timesteps, kHidden});
  for (int64_t t = 0; t < c.num_timesteps; ++t)
    for (int64_t i = 0; i < kHidden; ++i) {
      shift.set(t * kHidden + i, proj.table[t * 2 * kHidden + i]);
      scale.set(t * kHidden + i, proj.table[t * 2 * kHidden + kHidden + i]);
    }
  const RmsnormReference norm = rmsnorm_reference(k["x"], k["norm_weight"], &shift, &scale,
                                                  timestep_rows_of_positions(c), c.num_timesteps, k["grad"], 1e-5,
                                                  DType::kBF16);
  std::vector<double> d_table(c.num_timesteps * 2 * kHidden);
  for (int64_t t = 0; t < c.num_timesteps; ++t)
    for (int64_t i = 0; i < kHidden; ++i) {
      d_table[t * 2 * kHidden + i] = norm.d_shift[t * kHidden + i];
      d_table[t * 2 * kHidden + kHidden + i] = norm.d_scale[t * kHidden + i];
    }
  proj = projection_reference(k["temb"], k["weight"], k["bias"], &d_table, DType::kBF16);
  EXPECT_GE(fraction_correctly_rounded(k["table"], proj.table), 0.999);
  EXPECT_TRUE(within_tolerance(k["out"], norm.out, 5e-2, 2e-2));
  EXPECT_TRUE(within_tolerance(k["dx"], norm.dx, 1e-1, 2e-2));
  EXPECT_TRUE(within_tolerance(k["d_norm_weight"], norm.d_weight, 1e-1, 2e-2));
  EXPECT_TRUE(within_tolerance(k["d_weight"], proj.d_weight, 1e-1, 2e-2));
  EXPECT_TRUE(within_tolerance(k["d_bias"], proj.d_bias, 1e-1, 2e-2));
  EXPECT_TRUE(within_tolerance(k["d_temb"], proj.d_temb, 1e-1, 2e-2));
  const double dw_rate = fraction_correctly_rounded(k["d_weight"], proj.d_weight);
  const double db_rate = fraction_correctly_rounded(k["d_bias"], proj.d_bias);
  EXPECT_GE(dw_rate, 0.995);
  EXPECT_GE(db_rate, 0.995);
  std::printf("final_adaln_out S=4097 T=3: dW %.3f %%, db %.3f %% correctly rounded\n", 100 * dw_rate, 100 * db_rate);
}

TEST(FinalAdalnOut, BadInputsGetClearErrorsAndWriteNothing) {
  IndexCase c = testing::make_index_case(Packing::kBlock, 16, 2, 2);
  IndexPlan adaln_rows = testing::adaln_plan(c);  // R = 3T: the wrong index for norm_out
  HostTensor temb_bf16 = random_tensor(DType::kBF16, {2, kEmbed}, 9);
  const std::vector<testing::BadParams<FinalAdalnOutParams, FinalAdalnOutBackwardParams>> cases = {
      {"adaln plan", ErrorKind::kValue, "plan must have R = T (temb rows) = 2 table rows, got R = 6",
       [&](FinalAdalnOutParams* f, FinalAdalnOutBackwardParams* b) { f->in.plan = b->in.plan = adaln_rows; }},
      {"temb bf16", ErrorKind::kType, "temb must be float32 (the SiLU runs before the cast), got bfloat16",
       [&](FinalAdalnOutParams* f, FinalAdalnOutBackwardParams* b) { f->in.temb = b->in.temb = temb_bf16.view(); }},
      {"weight rows", ErrorKind::kValue, "weight must be (2H, D) = (72, *)",
       [](FinalAdalnOutParams* f, FinalAdalnOutBackwardParams* b) { f->in.weight.shape[0] = b->in.weight.shape[0] = 70; }},
      {"weight dtype", ErrorKind::kType, "weight must have x's dtype bfloat16, got float32",
       [](FinalAdalnOutParams* f, FinalAdalnOutBackwardParams* b) { f->in.weight.dtype = b->in.weight.dtype = DType::kF32; }},
      {"x rows", ErrorKind::kValue, "x must be (B*S, H) rows with S = plan.seq_len() = 16, B = plan.batch() = 2",
       [](FinalAdalnOutParams* f, FinalAdalnOutBackwardParams* b) { f->in.x = b->in.x = f->in.x.reshaped({4, 8, kHidden}); }},
      {"table shape", ErrorKind::kValue, "table must be (T, ",
       [](FinalAdalnOutParams* f, FinalAdalnOutBackwardParams* b) { f->table.shape[1] = b->table.shape[1] = 70; }},
      {"eps", ErrorKind::kValue, "eps must be finite and > 0",
       [](FinalAdalnOutParams* f, FinalAdalnOutBackwardParams* b) { f->in.eps = b->in.eps = -1.0f; }},
      {"norm_weight dtype", ErrorKind::kType, "weight must have x's dtype bfloat16, got float16",
       [](FinalAdalnOutParams* f, FinalAdalnOutBackwardParams* b) { f->in.norm_weight.dtype = b->in.norm_weight.dtype = DType::kF16; }},
  };
  testing::expect_bad_params_refused<Final>(cases, final_adaln_out_forward, final_adaln_out_backward, c);
}

// The projection's bias is required (adaln_projection refused an absent one,
// final_adaln_out took it as zero).
TEST(FinalAdalnOut, ForwardRefusesAnAbsentBias) {
  Final k(testing::make_index_case(Packing::kBlock, 16, 2, 2));
  FinalAdalnOutParams f = k.forward_params();
  f.in.bias = TensorView();
  EXPECT_TRUE(testing::refused(final_adaln_out_forward(f), ErrorKind::kValue, "bias is required"));
  EXPECT_TRUE(testing::still_canary(k.outputs()));
}

// An output placed over an input of the other half is refused before
// anything is written: table and act over x (forward), d_weight over x,
// d_bias over grad, d_temb over rstd (backward) used to be accepted. The
// input is copied into an arena that holds the output too, so even an op that
// wrote would stay inside the arena; the arena must come back unchanged.
TEST(FinalAdalnOut, OutputsOverlappingInputsAreRefused) {
  const IndexCase c = testing::make_index_case(Packing::kBlock, 16, 2, 2);
  struct Case {
    const char* message;
    std::function<std::pair<TensorView*, TensorView*>(FinalAdalnOutParams*, FinalAdalnOutBackwardParams*)> pick;
    bool forward;
  };
  const Case cases[] = {
      {"table must not overlap x", [](FinalAdalnOutParams* f, FinalAdalnOutBackwardParams*) {
         return std::make_pair(&f->in.x, &f->table); }, true},
      {"act must not overlap x", [](FinalAdalnOutParams* f, FinalAdalnOutBackwardParams*) {
         return std::make_pair(&f->in.x, &f->act); }, true},
      {"table must not overlap norm_weight", [](FinalAdalnOutParams* f, FinalAdalnOutBackwardParams*) {
         return std::make_pair(&f->in.norm_weight, &f->table); }, true},
      {"d_weight must not overlap x", [](FinalAdalnOutParams*, FinalAdalnOutBackwardParams* b) {
         return std::make_pair(&b->in.x, &b->d_weight); }, false},
      {"d_bias must not overlap grad", [](FinalAdalnOutParams*, FinalAdalnOutBackwardParams* b) {
         return std::make_pair(&b->grad, &b->d_bias); }, false},
      {"d_temb must not overlap rstd", [](FinalAdalnOutParams*, FinalAdalnOutBackwardParams* b) {
         return std::make_pair(&b->rstd, &b->d_temb); }, false},
  };
  for (const Case& overlap : cases) {
    SCOPED_TRACE(overlap.message);
    Final k(c);
    FinalAdalnOutParams f = k.forward_params();
    FinalAdalnOutBackwardParams b = k.backward_params();
    const auto [input, output] = overlap.pick(&f, &b);
    HostTensor arena(DType::kF32, {int64_t{1} << 14});  // 64 KB: more than any of these tensors
    std::memcpy(arena.data(), input->data, input->nbytes());
    input->data = output->data = arena.data();
    const HostTensor before = arena;
    const Status s = overlap.forward ? final_adaln_out_forward(f) : final_adaln_out_backward(b);
    EXPECT_TRUE(testing::refused(s, ErrorKind::kValue, overlap.message));
    EXPECT_BITWISE_EQ(before, arena);
    EXPECT_TRUE(testing::still_canary(k.outputs()));
  }
}

}  // namespace
}  // namespace testing
}  // namespace detdit
