// rmsnorm (plain and modulated), CPU reference through the public API:
// accuracy against the FP64 reference of cases/oracle.h (straight-through
// rounding where the model stores values), bitwise row invariance (a row
// alone, inside a batch, with permuted neighbours), repeatability, exact zeros
// for unreferenced table rows, and fail-closed validation (clear errors,
// canary-filled outputs untouched).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "support/cases.h"
#include "common/row_tree.h"
#include "support/rowwise_fixture.h"
#include "common/scalar_math.h"
#include "support/test_util.h"
#include "detdit/adaln.h"
#include "detdit/rmsnorm.h"

namespace detdit {
namespace testing {
namespace {

// The library's rmsnorm case at this shape: shift and scale are chunks 0 and
// 1 of its (R, 6H) AdaLN table (modulated), d_weight FP32, the table
// gradients in `table_grad_dtype`.
OpCase norm_case(const IndexCase& c, int64_t h, DType dtype, DType table_grad_dtype, bool modulated = true) {
  return rmsnorm_case({dtype, h, c, modulated, table_grad_dtype}, 1);
}

// Chunk `chunk` of a host (R, 6H) table as a (R, H) tensor.
HostTensor table_chunk(const HostTensor& table, int64_t h, int chunk) {
  const int64_t rows = table.shape()[0];
  HostTensor out(table.dtype(), {rows, h});
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < h; ++i) out.set(r * h + i, table.get(r * 6 * h + chunk * h + i));
  return out;
}

struct Tolerance {
  double atol, rtol;
};
// The accuracy bars of a row reduction: forward fp32 1e-4/1e-4, bf16 5e-2/2e-2; grads fp32 1e-4/1e-4, bf16 1e-1/2e-2.
Tolerance forward_tolerance(DType d) { return d == DType::kF32 ? Tolerance{1e-4, 1e-4} : Tolerance{5e-2, 2e-2}; }
Tolerance grad_tolerance(DType d) { return d == DType::kF32 ? Tolerance{1e-4, 1e-4} : Tolerance{1e-1, 2e-2}; }

// A run case's named outputs (out, dx, d_weight, d_shift, d_scale) within
// their tolerance of the FP64 reference (eps 1e-5, stored values rounded to
// the case's dtype); every output outside named.
::testing::AssertionResult near_reference(const CpuCase& k, const IndexCase& c,
                                          const std::vector<std::pair<std::string, Tolerance>>& outputs) {
  const int64_t h = k["weight"].numel();
  const bool modulated = k.tensors().count("table") > 0;
  const HostTensor shift = modulated ? table_chunk(k["table"], h, 0) : HostTensor();
  const HostTensor scale = modulated ? table_chunk(k["table"], h, 1) : HostTensor();
  const RmsnormReference ref =
      rmsnorm_reference(k["x"], k["weight"], modulated ? &shift : nullptr, modulated ? &scale : nullptr,
                        adaln_rows_of_positions(c), c.num_rows(), k["grad"], 1e-5, k["x"].dtype());
  const std::map<std::string, const std::vector<double>*> exact = {
      {"out", &ref.out}, {"dx", &ref.dx}, {"d_weight", &ref.d_weight}, {"d_shift", &ref.d_shift}, {"d_scale", &ref.d_scale}};
  ::testing::AssertionResult result = ::testing::AssertionSuccess();
  for (const auto& [name, t] : outputs) {
    const ::testing::AssertionResult r = within_tolerance(k[name], *exact.at(name), t.atol, t.rtol);
    if (!r) result = ::testing::AssertionFailure() << (result ? "" : result.message()) << name << ": " << r.message() << "; ";
  }
  return result;
}

// The fail-closed fixture: a modulated case's params, from its views.
struct Norm : CpuCase {
  int64_t hidden;
  Norm(const IndexCase& c, int64_t h, DType dtype, DType table_grad_dtype)
      : CpuCase(norm_case(c, h, dtype, table_grad_dtype)), hidden(h) {}
  RmsnormInputs inputs() const {
    RmsnormInputs in;
    in.x = view("x");
    in.weight = view("weight");
    EXPECT_TRUE(adaln_table_chunk(view("table"), hidden, 0, &in.shift).ok());
    EXPECT_TRUE(adaln_table_chunk(view("table"), hidden, 1, &in.scale).ok());
    in.plan = plan();
    return in;
  }
  RmsnormParams forward_params() const { return {inputs(), view("out"), view("rstd")}; }
  RmsnormBackwardParams backward_params() const {
    return {inputs(), view("rstd"), view("grad"), view("dx"), view("d_weight"), view("d_shift"), view("d_scale")};
  }
};

TEST(Rmsnorm, MatchesTheFp64ReferenceWithinTheReductionContract) {
  const std::vector<IndexCase> cases = {make_index_case(Packing::kBlock, 257, 3, 2),
                                        make_index_case(Packing::kInterleaved, 257, 3, 2),
                                        make_index_case(Packing::kBlock, 4097, 1, 1)};
  for (const IndexCase& c : cases)
    for (DType dtype : {DType::kBF16, DType::kF32})
      for (bool modulated : {true, false}) {
        SCOPED_TRACE(c.name() + " " + dtype_name(dtype) + (modulated ? " modulated" : " plain"));
        const int64_t h = c.seq_len > 1000 ? 64 : 256;
        CpuCase k(norm_case(c, h, dtype, DType::kF32, modulated));
        DETDIT_ASSERT_OK(k.run());
        // The table gradients sum bf16-stored values (n, 1 + scale): their contract is the activation
        // dtype's, even when they are returned in FP32.
        const Tolerance f = forward_tolerance(dtype), g = grad_tolerance(dtype);
        std::vector<std::pair<std::string, Tolerance>> checks = {{"out", f}, {"dx", g}, {"d_weight", g}};
        if (modulated) checks.insert(checks.end(), {{"d_shift", g}, {"d_scale", g}});
        EXPECT_TRUE(near_reference(k, c, checks));
      }
}

TEST(Rmsnorm, Bf16TableGradientsMeetTheBf16Contract) {
  IndexCase c = make_index_case(Packing::kInterleaved, 4097, 3, 1);
  CpuCase k(norm_case(c, 64, DType::kBF16, DType::kBF16));
  DETDIT_ASSERT_OK(k.run());
  const Tolerance g = grad_tolerance(DType::kBF16);
  EXPECT_TRUE(near_reference(k, c, {{"d_weight", g}, {"d_shift", g}, {"d_scale", g}, {"dx", g}}));
}

TEST(Rmsnorm, H3WidthMatchesTheReference) {
  IndexCase c = make_index_case(Packing::kBlock, 257, 3, 1);
  CpuCase k(norm_case(c, 5376, DType::kBF16, DType::kF32));
  DETDIT_ASSERT_OK(k.run());
  EXPECT_TRUE(near_reference(k, c, {{"out", {5e-2, 2e-2}}, {"dx", {1e-1, 2e-2}}, {"d_scale", {1e-1, 2e-2}}}));
}

// Row p of the batch computed alone (a one-position plan with the same table)
// gives the same bytes for out, rstd and dx.
TEST(Rmsnorm, RowLocalOutputsAreInvariantToBatchAndNeighbours) {
  for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
    SCOPED_TRACE(dtype_name(dtype));
    IndexCase c = make_index_case(Packing::kInterleaved, 257, 3, 3);
    EXPECT_TRUE(positions_alone_match(norm_case(c, 20, dtype, DType::kF32),
                                      {0, 255, 256, 400, c.positions() - 1}));
  }
}

// Reversing the sequence (index and rows together) permutes out and dx the same way.
TEST(Rmsnorm, PermutingNeighboursPermutesRowLocalOutputs) {
  IndexCase c = make_index_case(Packing::kBlock, 300, 4, 1);
  CpuCase a(norm_case(c, 12, DType::kBF16, DType::kF32));
  DETDIT_ASSERT_OK(a.run());
  IndexCase reversed = c;
  std::reverse(reversed.timestep_indices.begin(), reversed.timestep_indices.end());
  std::reverse(reversed.tags.begin(), reversed.tags.end());
  std::map<std::string, HostTensor> inputs = a.tensors();  // weight and table as they are
  for (int64_t s = 0; s < 300; ++s) {
    copy_row(a["x"], s, &inputs["x"], 299 - s);
    copy_row(a["grad"], s, &inputs["grad"], 299 - s);
  }
  CpuCase b(norm_case(reversed, 12, DType::kBF16, DType::kF32), &inputs);
  DETDIT_ASSERT_OK(b.run());
  for (int64_t s = 0; s < 300; ++s) {
    ASSERT_TRUE(rows_bitwise_equal(a["out"], s, b["out"], 299 - s)) << s;
    ASSERT_TRUE(rows_bitwise_equal(a["dx"], s, b["dx"], 299 - s)) << s;
  }
}

TEST(Rmsnorm, EveryOutputIsRepeatableAndUnreferencedRowsAreExactZeros) {
  // S = 3 with T = 4: at most 3 of the 12 table rows are referenced.
  IndexCase c = make_index_case(Packing::kInterleaved, 3, 4, 2);
  for (DType grad_dtype : {DType::kF32, DType::kBF16}) {
    std::map<std::string, HostTensor> a;
    ASSERT_TRUE(repeats_bitwise(norm_case(c, 12, DType::kBF16, grad_dtype), &a));
    const std::vector<int64_t> unreferenced = unreferenced_rows(c);
    EXPECT_TRUE(rows_are_zero(a["d_shift"], unreferenced));
    EXPECT_TRUE(rows_are_zero(a["d_scale"], unreferenced));
    EXPECT_GE(unreferenced.size(), 9u);
  }
}

TEST(Rmsnorm, LargeRowSegmentsStayAccurate) {
  // T = 1, block packing: row 0 (video) holds ~80 % of 2 x 4097 positions (> 256 per row).
  IndexCase c = make_index_case(Packing::kBlock, 4097, 1, 2);
  CpuCase k(norm_case(c, 12, DType::kBF16, DType::kBF16));
  DETDIT_ASSERT_OK(k.run());
  const Tolerance g{1e-1, 2e-2};
  EXPECT_TRUE(near_reference(k, c, {{"d_shift", g}, {"d_scale", g}, {"d_weight", g}}));
}

// out, rstd and dx written out from docs/numerics.md 5.6 / 6.7 (row tree of
// section 7), compared bitwise: the row-local half of the contract.
TEST(Rmsnorm, RowLocalResultsFollowTheContractBitwise) {
  IndexCase c = make_index_case(Packing::kInterleaved, 40, 3, 2);
  for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
    SCOPED_TRACE(dtype_name(dtype));
    const int64_t h = 1028;  // more than 128 vectors: lanes take several
    CpuCase k(norm_case(c, h, dtype, DType::kF32));
    DETDIT_ASSERT_OK(k.run());
    const HostTensor &kx = k["x"], &kw = k["weight"], &table = k["table"], &grad = k["grad"];
    auto R = [&](float v) { return round_as(v, dtype); };
    HostTensor out(dtype, {c.positions(), h}), dx(dtype, {c.positions(), h}), rstd(DType::kF32, {c.positions()});
    for (int64_t p = 0; p < c.positions(); ++p) {
      auto x = [&](int64_t i) { return static_cast<float>(kx.get(p * h + i)); };
      auto w = [&](int64_t i) { return static_cast<float>(kw.get(i)); };
      const int64_t r = c.row(p % c.seq_len);
      auto shift = [&](int64_t i) { return static_cast<float>(table.get(r * 6 * h + i)); };
      auto t1 = [&](int64_t i) { return R(num::add32(1.0f, static_cast<float>(table.get(r * 6 * h + h + i)))); };
      const float ss = row_tree_sum(h, [&](int64_t i, float* a, float* b) { *a = *b = x(i); });
      const float rs = num::portable_rsqrt(num::add32(num::div32(ss, static_cast<float>(h)), 1e-5f));
      rstd.ptr<float>()[p] = rs;
      for (int64_t i = 0; i < h; ++i) {
        const float n = R(num::mul32(w(i), num::mul32(rs, x(i))));
        out.set(p * h + i, num::add32(R(num::mul32(n, t1(i))), shift(i)));
      }
      auto d_n = [&](int64_t i) { return num::mul32(static_cast<float>(grad.get(p * h + i)), t1(i)); };
      const float dot = row_tree_sum(h, [&](int64_t i, float* a, float* b) {
        *a = num::mul32(w(i), d_n(i));
        *b = x(i);
      });
      const float coef = num::div32(num::mul32(num::mul32(num::mul32(rs, rs), rs), dot), static_cast<float>(h));
      for (int64_t i = 0; i < h; ++i)
        dx.set(p * h + i, num::sub32(num::mul32(num::mul32(rs, w(i)), d_n(i)), num::mul32(x(i), coef)));
    }
    EXPECT_BITWISE_EQ(rstd, k["rstd"]);
    EXPECT_BITWISE_EQ(out, k["out"]);
    EXPECT_BITWISE_EQ(dx, k["dx"]);
  }
}

// ---- fail closed ------------------------------------------------------------

TEST(Rmsnorm, BadInputsGetClearErrorsAndWriteNothing) {
  IndexCase c = testing::make_index_case(Packing::kBlock, 16, 2, 2);
  IndexCase shorter = testing::make_index_case(Packing::kBlock, 8, 2, 2);  // a "sharded" index
  IndexPlan sharded = testing::adaln_plan(shorter);
  const std::vector<testing::BadParams<RmsnormParams, RmsnormBackwardParams>> cases = {
      {"x dtype int", ErrorKind::kType, "x must be float32, bfloat16 or float16, got int32",
       [](RmsnormParams* f, RmsnormBackwardParams* b) { f->in.x.dtype = b->in.x.dtype = DType::kI32; }},
      {"weight dtype", ErrorKind::kType, "weight must have x's dtype bfloat16, got float32",
       [](RmsnormParams* f, RmsnormBackwardParams* b) { f->in.weight.dtype = b->in.weight.dtype = DType::kF32; }},
      {"shift dtype", ErrorKind::kType, "shift must be bfloat16, got float16",
       [](RmsnormParams* f, RmsnormBackwardParams* b) { f->in.shift.dtype = b->in.shift.dtype = DType::kF16; }},
      {"H % 4", ErrorKind::kValue, "H=14 must be a multiple of 4 (PyTorch's vectorized RMSNorm path)",
       [](RmsnormParams* f, RmsnormBackwardParams* b) {
         // a plain norm (no plan), so the row count is free
         f->in.x = f->in.x.reshaped({16 * 2 * 16 / 14, 14});
         b->in.x = f->in.x;
         f->in.shift = f->in.scale = b->in.shift = b->in.scale = b->d_shift = b->d_scale = TensorView();
         f->in.plan = b->in.plan = IndexPlan();
       }},
      {"misaligned x", ErrorKind::kValue, "x must be 8-byte aligned",
       [](RmsnormParams* f, RmsnormBackwardParams* b) {
         f->in.x.data = static_cast<char*>(f->in.x.data) + 2;
         b->in.x = f->in.x;
       }},
      {"sharded index", ErrorKind::kValue, "x must be (B*S, H) rows with S = plan.seq_len() = 8, B = plan.batch() = 2, got (32, 16)",
       [&](RmsnormParams* f, RmsnormBackwardParams* b) { f->in.plan = b->in.plan = sharded; }},
      {"3-D x with wrong S", ErrorKind::kValue, "x must be (B*S, H) rows with S = plan.seq_len() = 16",
       [](RmsnormParams* f, RmsnormBackwardParams* b) { f->in.x = b->in.x = f->in.x.reshaped({4, 8, 16}); }},
      {"shift rows", ErrorKind::kValue, "shift must be (R, H) = (6, 16)",
       [](RmsnormParams* f, RmsnormBackwardParams* b) { f->in.shift.shape[0] = b->in.shift.shape[0] = 5; }},
      {"shift column stride", ErrorKind::kValue, "scale must have unit column stride",
       [](RmsnormParams* f, RmsnormBackwardParams* b) { f->in.scale.strides[1] = b->in.scale.strides[1] = 2; }},
      {"shift without scale", ErrorKind::kValue, "modulation needs both shift and scale",
       [](RmsnormParams* f, RmsnormBackwardParams* b) { f->in.scale = b->in.scale = TensorView(); }},
      {"no plan", ErrorKind::kValue, "plan is required",
       [](RmsnormParams* f, RmsnormBackwardParams* b) { f->in.plan = b->in.plan = IndexPlan(); }},
      {"eps", ErrorKind::kValue, "eps must be finite and > 0",
       [](RmsnormParams* f, RmsnormBackwardParams* b) { f->in.eps = b->in.eps = 0.0f; }},
      {"empty x", ErrorKind::kValue, "x must be non-empty",
       [](RmsnormParams* f, RmsnormBackwardParams* b) { f->in.x.shape[0] = b->in.x.shape[0] = 0; }},
      {"weight on cuda", ErrorKind::kValue, "weight is on cuda:0, x is on cpu",
       [](RmsnormParams* f, RmsnormBackwardParams* b) { f->in.weight.device = b->in.weight.device = Device::cuda(0); }},
      {"torch profile on cpu", ErrorKind::kValue, "numerics=torch exists on CUDA only",
       [](RmsnormParams* f, RmsnormBackwardParams* b) { f->in.numerics = b->in.numerics = Numerics::kTorch; }},
  };
  testing::expect_bad_params_refused<Norm>(cases, rmsnorm_forward, rmsnorm_backward, c, int64_t{16}, DType::kBF16,
                                          DType::kF32);
}

TEST(Rmsnorm, BackwardOnlyErrorsWriteNothing) {
  IndexCase c = make_index_case(Packing::kBlock, 16, 2, 2);
  Norm k(c, 16, DType::kBF16, DType::kF32);
  DETDIT_ASSERT_OK(k.run(Phase::kForward));
  struct Case {
    ErrorKind kind;
    const char* message;
    void (*mutate)(RmsnormBackwardParams*);
  };
  const Case cases[] = {
      {ErrorKind::kValue, "rstd is required", [](RmsnormBackwardParams* b) { b->rstd = TensorView(); }},
      {ErrorKind::kValue, "grad must have x's shape", [](RmsnormBackwardParams* b) { b->grad.shape[1] = 8; }},
      {ErrorKind::kType, "d_shift must be float32 or bfloat16, got float16", [](RmsnormBackwardParams* b) { b->d_shift.dtype = DType::kF16; }},
      {ErrorKind::kValue, "d_weight must be (H,) = (16,)", [](RmsnormBackwardParams* b) { b->d_weight.shape[0] = 15; }},
      {ErrorKind::kValue, "dx must not overlap grad", [](RmsnormBackwardParams* b) { b->dx.data = b->grad.data; }},
      {ErrorKind::kValue, "d_shift/d_scale need a modulated norm", [](RmsnormBackwardParams* b) {
         b->in.shift = b->in.scale = TensorView();
       }},
  };
  for (const Case& bad : cases) {
    SCOPED_TRACE(bad.message);
    RmsnormBackwardParams b = k.backward_params();
    bad.mutate(&b);
    EXPECT_TRUE(refused(rmsnorm_backward(b), bad.kind, bad.message));
    HostTensor dx = k.current("dx"), d_weight = k.current("d_weight"), d_shift = k.current("d_shift"),
               d_scale = k.current("d_scale");
    EXPECT_TRUE(still_canary({&dx, &d_weight, &d_shift, &d_scale}));
    EXPECT_BITWISE_EQ(k["grad"], k.current("grad"));
  }
}

// d_shift / d_scale whose rows share memory (row stride 0 or 1 < H) would
// be written over each other: refused, nothing written (they were accepted).
TEST(Rmsnorm, TableGradientsWithOverlappingRowsAreRefused) {
  Norm k(testing::make_index_case(Packing::kBlock, 16, 2, 2), 16, DType::kF32, DType::kF32);
  for (TensorView RmsnormBackwardParams::*table : {&RmsnormBackwardParams::d_shift, &RmsnormBackwardParams::d_scale}) {
    RmsnormBackwardParams b = k.backward_params();
    testing::expect_overlapping_rows_refused(
        b.*table, table == &RmsnormBackwardParams::d_shift ? "d_shift" : "d_scale",
        [&](const TensorView& t) {
          b.*table = t;
          return rmsnorm_backward(b);
        },
        [&] { return testing::still_canary(k.outputs()); });
  }
}

}  // namespace
}  // namespace testing
}  // namespace detdit
