// gate_residual_rmsnorm on the CPU: every output and gradient of the fused op
// equals the two separate ops composed as autograd composes them (gate_residual
// forward, rmsnorm forward; rmsnorm backward of d_out, dx + d_h rounded once,
// gate_residual backward of that sum), bitwise, for every test case; and bad
// input is refused with the separate ops' messages, writing nothing.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "cases/op_case.h"
#include "support/cases.h"
#include "support/rowwise_fixture.h"
#include "detdit/adaln.h"
#include "detdit/gate_residual_rmsnorm.h"

namespace detdit {
namespace testing {
namespace {

TensorView chunk(const TensorView& table, int64_t hidden, int c) {
  TensorView v;
  EXPECT_TRUE(adaln_table_chunk(table, hidden, c, &v).ok());
  return v;
}

// The composition is the case's equivalent route (cases/rowwise_cases.cc), the
// one detdit verify also runs.
TEST(GateResidualRmsnorm, EqualsTheSeparateOpsComposedAsAutogradDoes) {
  int checked = 0;
  for (const OpCase& c : op_cases("gate_residual_rmsnorm", Suite::kTest, CaseContext{})) {
    if (c.positions * c.spec("residual").shape[1] > (1 << 22)) continue;  // the H3 cases run on the GPU
    SCOPED_TRACE(c.full_name());
    ASSERT_TRUE(static_cast<bool>(c.equivalent.compute));
    Instance fused;
    DETDIT_ASSERT_OK(instantiate(c, Device::cpu(), nullptr, &fused));
    DETDIT_ASSERT_OK(run(c, Phase::kForward, fused));
    DETDIT_ASSERT_OK(run(c, Phase::kBackward, fused));
    std::map<std::string, HostTensor> got, separate;
    DETDIT_ASSERT_OK(download(c, fused, &got));
    DETDIT_ASSERT_OK(c.equivalent.compute(got, &separate));
    for (Phase phase : {Phase::kForward, Phase::kBackward})
      for (const OutputReport& r : compare_outputs(c, phase, separate, got)) {
        EXPECT_FALSE(r.still_canary) << r.output << ": the separate ops wrote nothing";
        EXPECT_TRUE(r.mismatch.equal()) << r.output << ": " << r.mismatch.describe();
      }
    ++checked;
  }
  EXPECT_GT(checked, 50);
}

// The fused op's arguments broken one at a time: the halves' errors, and no
// output written (forward and backward).
TEST(GateResidualRmsnorm, BadInputIsRefusedAndWritesNothing) {
  const IndexCase index = make_index_case(Packing::kInterleaved, 257, 3, 2);
  const int64_t rows = index.positions(), hidden = 68;
  const IndexPlan plan = adaln_plan(index);
  HostTensor residual = random_tensor(DType::kBF16, {rows, hidden}, 1), y = random_tensor(DType::kBF16, {rows, hidden}, 2);
  HostTensor table = random_tensor(DType::kBF16, {index.num_rows(), 6 * hidden}, 3, 0.0, 0.5);
  HostTensor weight = random_tensor(DType::kBF16, {hidden}, 4, 1.0, 0.5), d_out = random_tensor(DType::kBF16, {rows, hidden}, 5);
  HostTensor h(DType::kBF16, {rows, hidden}), out(DType::kBF16, {rows, hidden}), rstd(DType::kF32, {rows});
  HostTensor d_residual(DType::kBF16, {rows, hidden}), d_y(DType::kBF16, {rows, hidden});
  HostTensor d_gate(DType::kF32, {index.num_rows(), hidden}), d_weight(DType::kF32, {hidden});
  const TensorView t = table.view();
  const GateResidualRmsnormInputs in{residual.view(), y.view(), chunk(t, hidden, 2), weight.view(),
                                     chunk(t, hidden, 3), chunk(t, hidden, 4), plan};
  struct Bad {
    const char* what;
    ErrorKind kind;
    const char* message;
    std::function<void(GateResidualRmsnormParams*, GateResidualRmsnormBackwardParams*)> mutate;
  };
  const std::vector<Bad> cases = {
      {"no plan", ErrorKind::kValue, "plan", [](auto* f, auto* b) { f->in.plan = b->in.plan = IndexPlan(); }},
      {"weight dtype", ErrorKind::kType, "weight",
       [&](auto* f, auto* b) { f->in.weight.dtype = b->in.weight.dtype = DType::kF32; }},
      {"shift without scale", ErrorKind::kValue, "shift",
       [](auto* f, auto* b) { f->in.scale = b->in.scale = TensorView(); }},
      {"y shape", ErrorKind::kValue, "y", [](auto* f, auto* b) { f->in.y.shape[0] = b->in.y.shape[0] = 3; }},
      {"no rstd", ErrorKind::kValue, "rstd", [](auto* f, auto* b) { f->rstd = b->rstd = TensorView(); }},
      {"h or d_h shape", ErrorKind::kValue, "h must",
       [&](auto* f, auto* b) {
         f->h.shape[0] = 5;  // the forward's h of the wrong shape
         b->d_h = b->d_out;
         b->d_h.shape[0] = 5;
       }},
      {"out over y", ErrorKind::kValue, "overlap", [&](auto* f, auto* b) { f->out = f->in.y; b->d_y = b->in.y; }},
      {"eps", ErrorKind::kValue, "eps", [](auto* f, auto* b) { f->in.eps = b->in.eps = -1.0f; }},
  };
  for (const Bad& bad : cases) {
    SCOPED_TRACE(bad.what);
    for (HostTensor* o : {&h, &out, &rstd, &d_residual, &d_y, &d_gate, &d_weight}) o->fill_bytes(kCanary);
    GateResidualRmsnormParams f{in, h.view(), out.view(), rstd.view()};
    GateResidualRmsnormBackwardParams b{in, h.view(), rstd.view(), d_out.view(), TensorView(), d_residual.view(),
                                        d_y.view(), d_gate.view(), d_weight.view(), TensorView(), TensorView()};
    bad.mutate(&f, &b);
    EXPECT_TRUE(refused(gate_residual_rmsnorm_forward(f), bad.kind, bad.message)) << "forward";
    EXPECT_TRUE(refused(gate_residual_rmsnorm_backward(b), bad.kind, bad.message)) << "backward";
    EXPECT_TRUE(still_canary({&h, &out, &rstd, &d_residual, &d_y, &d_gate, &d_weight}));
  }
}

}  // namespace
}  // namespace testing
}  // namespace detdit
