// gate_residual through the public API: the forward and the row-local
// gradients follow the contract bitwise (numerics 5.7 / 6.8 written out here),
// d_gate meets the BF16 reduction contract against FP64, rows are invariant to
// batch and neighbours, everything repeats bitwise, unreferenced gate rows get
// exact zeros, and bad inputs fail closed (canary outputs untouched).
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "support/cases.h"
#include "support/rowwise_fixture.h"
#include "common/scalar_math.h"
#include "support/test_util.h"
#include "detdit/gate_residual.h"

namespace detdit {
namespace testing {
namespace {

// The library's gate_residual case at this shape, with a contiguous (R, H)
// gate and d_gate in `gate_grad_dtype`.
OpCase gate_case(const IndexCase& c, int64_t h, DType dtype, DType gate_grad_dtype) {
  return gate_residual_case({dtype, h, c, false, gate_grad_dtype}, 7);
}

// The fail-closed fixture: the case's params, from its views.
struct Gate : CpuCase {
  Gate(const IndexCase& c, int64_t h, DType dtype, DType gate_grad_dtype)
      : CpuCase(gate_case(c, h, dtype, gate_grad_dtype)) {}
  GateResidualInputs inputs() const { return {view("residual"), view("y"), view("table"), plan()}; }
  GateResidualParams forward_params() const { return {inputs(), view("out")}; }
  GateResidualBackwardParams backward_params() const {
    GateResidualBackwardParams p{inputs(), view("grad"), view("d_residual"), view("d_y"), view("d_gate")};
    p.in.residual = TensorView();  // the backward does not read it
    return p;
  }
};

TEST(GateResidual, RowLocalResultsFollowTheContractBitwise) {
  IndexCase c = make_index_case(Packing::kInterleaved, 257, 4, 2);
  for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
    SCOPED_TRACE(dtype_name(dtype));
    CpuCase k(gate_case(c, 20, dtype, DType::kF32));
    DETDIT_ASSERT_OK(k.run());
    const HostTensor &gates = k["table"], &residual = k["residual"], &y = k["y"], &grad = k["grad"];
    auto R = [&](float v) { return round_as(v, dtype); };
    HostTensor out(dtype, {c.positions(), 20}), d_y(dtype, {c.positions(), 20});
    for (int64_t p = 0; p < c.positions(); ++p)
      for (int64_t i = 0; i < 20; ++i) {
        const float gate = static_cast<float>(gates.get(c.row(p % c.seq_len) * 20 + i));
        const int64_t e = p * 20 + i;
        out.set(e, num::add32(static_cast<float>(residual.get(e)), R(num::mul32(gate, static_cast<float>(y.get(e))))));
        d_y.set(e, num::mul32(static_cast<float>(grad.get(e)), gate));
      }
    EXPECT_BITWISE_EQ(out, k["out"]);
    EXPECT_BITWISE_EQ(d_y, k["d_y"]);
    EXPECT_BITWISE_EQ(k["grad"], k["d_residual"]);
  }
}

TEST(GateResidual, GateGradientMeetsTheReductionContract) {
  for (const IndexCase& c : {make_index_case(Packing::kBlock, 4097, 3, 2),
                             make_index_case(Packing::kInterleaved, 4097, 4, 1),
                             make_index_case(Packing::kBlock, 4097, 1, 1)})
    for (DType dtype : {DType::kBF16, DType::kF32}) {
      SCOPED_TRACE(c.name() + " " + dtype_name(dtype));
      CpuCase k(gate_case(c, 64, dtype, dtype));
      DETDIT_ASSERT_OK(k.run());
      const HostTensor &grad = k["grad"], &y = k["y"];
      std::vector<double> ref(c.num_rows() * 64, 0.0);
      for (int64_t p = 0; p < c.positions(); ++p)
        for (int64_t i = 0; i < 64; ++i) ref[c.row(p % c.seq_len) * 64 + i] += grad.get(p * 64 + i) * y.get(p * 64 + i);
      if (dtype == DType::kF32)
        EXPECT_TRUE(within_tolerance(k["d_gate"], ref, 1e-4, 1e-4));
      else
        EXPECT_TRUE(within_tolerance(k["d_gate"], ref, 1e-1, 2e-2));
    }
}

// Row p of the batch computed alone (a one-position plan with the same gate)
// gives the same bytes for out, d_y and d_residual.
TEST(GateResidual, RowLocalOutputsAreInvariantToBatchAndNeighbours) {
  IndexCase c = make_index_case(Packing::kBlock, 300, 3, 3);
  EXPECT_TRUE(positions_alone_match(gate_case(c, 12, DType::kBF16, DType::kF32), {0, 299, 300, 555, c.positions() - 1}));
}

TEST(GateResidual, RepeatableWithExactZerosForUnreferencedRows) {
  IndexCase c = make_index_case(Packing::kBlock, 3, 4, 3);
  std::map<std::string, HostTensor> a;
  ASSERT_TRUE(repeats_bitwise(gate_case(c, 12, DType::kBF16, DType::kBF16), &a));
  const std::vector<int64_t> unreferenced = unreferenced_rows(c);
  EXPECT_TRUE(rows_are_zero(a["d_gate"], unreferenced));
  EXPECT_GE(unreferenced.size(), 9u);
}

TEST(GateResidual, BadInputsGetClearErrorsAndWriteNothing) {
  IndexCase c = testing::make_index_case(Packing::kBlock, 16, 2, 2);
  IndexPlan sharded = testing::adaln_plan(testing::make_index_case(Packing::kBlock, 8, 2, 2));
  IndexPlan other_rows = testing::adaln_plan(testing::make_index_case(Packing::kBlock, 16, 3, 2));
  const std::vector<testing::BadParams<GateResidualParams, GateResidualBackwardParams>> cases = {
      {"residual dtype", ErrorKind::kType, "must be float32, bfloat16 or float16, got int64",
       [](GateResidualParams* f, GateResidualBackwardParams* b) { f->in.residual.dtype = b->grad.dtype = DType::kI64; }},
      {"y dtype", ErrorKind::kType, "y must have", [](GateResidualParams* f, GateResidualBackwardParams* b) {
         f->in.y.dtype = b->in.y.dtype = DType::kF16;
       }},
      {"gate dtype", ErrorKind::kType, "gate must be bfloat16, got float32",
       [](GateResidualParams* f, GateResidualBackwardParams* b) { f->in.gate.dtype = b->in.gate.dtype = DType::kF32; }},
      {"y shape", ErrorKind::kValue, "y must have", [](GateResidualParams* f, GateResidualBackwardParams* b) {
         f->in.y.shape[1] = b->in.y.shape[1] = 8;
       }},
      {"gate rows vs plan", ErrorKind::kValue, "gate must be (R, H) = (9, 16)",
       [&](GateResidualParams* f, GateResidualBackwardParams* b) { f->in.plan = b->in.plan = other_rows; }},
      {"gate column stride", ErrorKind::kValue, "gate must have unit column stride",
       [](GateResidualParams* f, GateResidualBackwardParams* b) { f->in.gate.strides[1] = b->in.gate.strides[1] = 3; }},
      {"sharded index", ErrorKind::kValue, "rows with S = plan.seq_len() = 8, B = plan.batch() = 2, got (32, 16)",
       [&](GateResidualParams* f, GateResidualBackwardParams* b) { f->in.plan = b->in.plan = sharded; }},
      {"no plan", ErrorKind::kValue, "plan is required",
       [](GateResidualParams* f, GateResidualBackwardParams* b) { f->in.plan = b->in.plan = IndexPlan(); }},
      {"empty", ErrorKind::kValue, "must be non-empty",
       [](GateResidualParams* f, GateResidualBackwardParams* b) { f->in.residual.shape[1] = b->grad.shape[1] = 0; }},
      {"device", ErrorKind::kValue, "is on cuda:0", [](GateResidualParams* f, GateResidualBackwardParams* b) {
         f->in.y.device = b->in.y.device = Device::cuda(0);
       }},
      {"absent", ErrorKind::kValue, "y is required", [](GateResidualParams* f, GateResidualBackwardParams* b) {
         f->in.y = b->in.y = TensorView();
       }},
  };
  testing::expect_bad_params_refused<Gate>(cases, gate_residual_forward, gate_residual_backward, c, int64_t{16},
                                          DType::kBF16, DType::kF32);
  // An output overlapping an input is refused too (the backward reads y while writing d_y).
  Gate k(c, 16, DType::kBF16, DType::kF32);
  GateResidualBackwardParams b = k.backward_params();
  b.d_y = k.view("y");
  EXPECT_TRUE(testing::refused(gate_residual_backward(b), ErrorKind::kValue, "d_y must not overlap y"));
  EXPECT_TRUE(testing::all_bytes_are(k.current("d_gate"), kCanary));
}

// A d_gate whose rows share memory (row stride 0 or 1 < H) is refused,
// nothing written (it was accepted).
TEST(GateResidual, GateGradientWithOverlappingRowsIsRefused) {
  Gate k(testing::make_index_case(Packing::kBlock, 16, 2, 2), 16, DType::kF32, DType::kF32);
  GateResidualBackwardParams b = k.backward_params();
  testing::expect_overlapping_rows_refused(
      b.d_gate, "d_gate",
      [&](const TensorView& t) {
        b.d_gate = t;
        return gate_residual_backward(b);
      },
      [&] { return testing::still_canary(k.outputs()); });
}

}  // namespace
}  // namespace testing
}  // namespace detdit
