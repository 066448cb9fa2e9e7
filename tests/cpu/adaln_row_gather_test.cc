// adaln_row_gather through the public API: the forward is a byte copy equal
// to six index_selects (also from a strided rows view), d_rows is >= 99.99 %
// correctly rounded from the FP64 sum (bf16 output), rows with no positions
// get exact zeros, a row with thousands of positions stays correctly
// rounded, gradients repeat bitwise, and bad inputs fail closed.
#include <gtest/gtest.h>

#include <cstdint>
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

// The library's adaln_row_gather case: rows (R, 6H) in `dtype` (a view with
// row stride 6H + 3 where `strided`), grad (6, B*S, H) in `dtype`, d_rows in `rows_grad_dtype`.
OpCase gather_case(const IndexCase& c, int64_t h, DType dtype, DType rows_grad_dtype, bool strided = false) {
  return adaln_row_gather_case({dtype, h, c, strided, rows_grad_dtype}, 5);
}

TEST(AdalnRowGather, ForwardEqualsSixIndexSelects) {
  for (const IndexCase& c : {make_index_case(Packing::kBlock, 257, 3, 1), make_index_case(Packing::kInterleaved, 513, 4, 1),
                             make_index_case(Packing::kBlock, 1, 1, 1)})
    for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
      SCOPED_TRACE(c.name() + " " + dtype_name(dtype));
      const int64_t h = 20, stride = 6 * h + 3;  // the case's rows: a view with row stride 6H + 3
      CpuCase k(gather_case(c, h, dtype, DType::kF32, true));
      DETDIT_ASSERT_OK(k.run(Phase::kForward));
      const std::size_t esize = dtype_size(dtype);
      for (int chunk = 0; chunk < 6; ++chunk)
        for (int64_t s = 0; s < c.seq_len; ++s) {
          const char* want = static_cast<const char*>(k["rows_storage"].data()) + (c.row(s) * stride + chunk * h) * esize;
          const char* got = static_cast<const char*>(k["out"].data()) + (chunk * c.seq_len + s) * h * esize;
          ASSERT_TRUE(bitwise_equal_bytes(want, got, h, dtype)) << "chunk " << chunk << " s " << s;
        }
    }
}

TEST(AdalnRowGather, TableGradientIsCorrectlyRounded) {
  for (const IndexCase& c : {make_index_case(Packing::kBlock, 4097, 3, 2), make_index_case(Packing::kInterleaved, 4097, 3, 1),
                             make_index_case(Packing::kBlock, 4097, 1, 3)}) {
    SCOPED_TRACE(c.name());
    CpuCase k(gather_case(c, 256, DType::kBF16, DType::kBF16));
    DETDIT_ASSERT_OK(k.run(Phase::kBackward));
    const double rate = fraction_correctly_rounded(k["d_rows"], row_gather_grad_exact(c, k["grad"], 256));
    EXPECT_GE(rate, 0.9999) << "correctly rounded fraction " << rate;
    std::printf("%s: d_rows %.5f %% correctly rounded\n", c.name().c_str(), 100 * rate);
  }
}

TEST(AdalnRowGather, H3ShapeTableGradientIsCorrectlyRounded) {
  IndexCase c = make_index_case(Packing::kBlock, 1025, 3, 1);
  CpuCase k(gather_case(c, 5376, DType::kBF16, DType::kBF16));
  DETDIT_ASSERT_OK(k.run(Phase::kBackward));
  const double rate = fraction_correctly_rounded(k["d_rows"], row_gather_grad_exact(c, k["grad"], 5376));
  EXPECT_GE(rate, 0.9999) << "correctly rounded fraction " << rate;
  std::printf("H3 width (T=3, S=1025, H=5376): d_rows %.5f %% correctly rounded\n", 100 * rate);
}

TEST(AdalnRowGather, UnreferencedRowsAreExactZerosAndGradientsRepeat) {
  IndexCase c = make_index_case(Packing::kInterleaved, 3, 4, 2);
  std::map<std::string, HostTensor> a;
  ASSERT_TRUE(repeats_bitwise(gather_case(c, 8, DType::kBF16, DType::kBF16), &a));
  EXPECT_TRUE(rows_are_zero(a["d_rows"], unreferenced_rows(c)));
}

TEST(AdalnRowGather, FourDimensionalGradGivesTheSameRows) {
  IndexCase c = make_index_case(Packing::kBlock, 300, 3, 2);
  CpuCase flat(gather_case(c, 8, DType::kBF16, DType::kF32)), split(gather_case(c, 8, DType::kBF16, DType::kF32));
  DETDIT_ASSERT_OK(flat.run(Phase::kBackward));
  AdalnRowGatherBackwardParams p{split.view("grad").reshaped({6, 2, 300, 8}), split.plan(), split.view("d_rows")};  // (6, B, S, H)
  DETDIT_ASSERT_OK(adaln_row_gather_backward(p));
  EXPECT_BITWISE_EQ(flat["d_rows"], split.current("d_rows"));
  p.grad = split.view("grad").reshaped({6, 300, 2, 8});  // B and S swapped: refused
  EXPECT_EQ(adaln_row_gather_backward(p).kind(), ErrorKind::kValue);
}

// A row's gradient does not depend on other rows' positions: moving the
// positions of rows other than r (here: changing their rows) leaves d_rows[r] bitwise unchanged.
TEST(AdalnRowGather, RowGradientIgnoresOtherRowsPositions) {
  IndexCase c = make_index_case(Packing::kInterleaved, 700, 3, 1);
  CpuCase a(gather_case(c, 8, DType::kBF16, DType::kF32));
  DETDIT_ASSERT_OK(a.run(Phase::kBackward));
  const int64_t kept = c.row(0);
  IndexCase moved = c;
  for (int64_t s = 0; s < c.seq_len; ++s)
    if (c.row(s) != kept) moved.timestep_indices[s] = (c.timestep_indices[s] + 1) % 3, moved.tags[s] = (c.row(s) + 1) % 3 == kept % 3 ? (c.tags[s] + 2) % 3 : (c.tags[s] + 1) % 3;
  for (int64_t s = 0; s < c.seq_len; ++s) ASSERT_EQ(moved.row(s) == kept, c.row(s) == kept);
  CpuCase b(gather_case(moved, 8, DType::kBF16, DType::kF32), &a.tensors());  // the same grad
  DETDIT_ASSERT_OK(b.run(Phase::kBackward));
  EXPECT_TRUE(rows_bitwise_equal(a["d_rows"], kept, b["d_rows"], kept));
}

TEST(AdalnRowGather, BadInputsGetClearErrorsAndWriteNothing) {
  IndexCase c = make_index_case(Packing::kBlock, 16, 2, 2);
  IndexPlan sharded = adaln_plan(make_index_case(Packing::kBlock, 8, 2, 2));
  // rows (6, 48) and grad (6, 32, 8) bf16, out (6, 16, 8), d_rows (6, 48) fp32
  CpuCase k(gather_case(c, 8, DType::kBF16, DType::kF32));
  const std::vector<testing::BadParams<AdalnRowGatherParams, AdalnRowGatherBackwardParams>> cases = {
      {"rows dtype", ErrorKind::kType, "must be float32, bfloat16 or float16, got int32",
       [](AdalnRowGatherParams* f, AdalnRowGatherBackwardParams* b) { f->rows.dtype = b->grad.dtype = DType::kI32; }},
      {"out / d_rows dtype", ErrorKind::kType, "float16", [](AdalnRowGatherParams* f, AdalnRowGatherBackwardParams* b) {
         f->out.dtype = DType::kF16;
         b->d_rows.dtype = DType::kF16;
       }},
      {"width not 6H", ErrorKind::kValue, "(6, 47)", [](AdalnRowGatherParams* f, AdalnRowGatherBackwardParams* b) {
         f->rows.shape[1] = 47;
         b->d_rows.shape[1] = 47;
       }},
      {"rows count vs plan", ErrorKind::kValue, "(5, 48)", [](AdalnRowGatherParams* f, AdalnRowGatherBackwardParams* b) {
         f->rows.shape[0] = 5;
         b->d_rows.shape[0] = 5;
       }},
      {"sharded index", ErrorKind::kValue, "S = plan.seq_len() = 8", [&](AdalnRowGatherParams* f, AdalnRowGatherBackwardParams* b) {
         f->plan = sharded;
         b->plan = sharded;
       }},
      {"no plan", ErrorKind::kValue, "plan is required", [](AdalnRowGatherParams* f, AdalnRowGatherBackwardParams* b) {
         f->plan = IndexPlan();
         b->plan = IndexPlan();
       }},
      {"column stride", ErrorKind::kValue, "must", [](AdalnRowGatherParams* f, AdalnRowGatherBackwardParams* b) {
         f->rows.strides[1] = 2;
         b->d_rows.strides[1] = 2;
       }},
      {"device", ErrorKind::kValue, "is on cuda:0", [](AdalnRowGatherParams* f, AdalnRowGatherBackwardParams* b) {
         f->out.device = Device::cuda(0);
         b->d_rows.device = Device::cuda(0);
       }},
      {"absent", ErrorKind::kValue, "is required", [](AdalnRowGatherParams* f, AdalnRowGatherBackwardParams* b) {
         f->out = TensorView();
         b->d_rows = TensorView();
       }},
  };
  for (const auto& bad : cases) {
    SCOPED_TRACE(bad.what);
    AdalnRowGatherParams f{k.view("rows_storage"), k.plan(), k.view("out")};
    AdalnRowGatherBackwardParams b{k.view("grad"), k.plan(), k.view("d_rows")};
    bad.mutate(&f, &b);
    EXPECT_TRUE(testing::refused(adaln_row_gather_forward(f), bad.kind, bad.message)) << "forward";
    EXPECT_TRUE(testing::refused(adaln_row_gather_backward(b), bad.kind, bad.message)) << "backward";
    EXPECT_TRUE(still_canary(k.outputs()));
  }
}

}  // namespace
}  // namespace testing
}  // namespace detdit
