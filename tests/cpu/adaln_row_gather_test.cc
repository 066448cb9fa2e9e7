// adaln_row_gather through the public API: the forward is a byte copy equal
// to six index_selects (also from a strided rows view), d_rows is >= 99.99 %
// correctly rounded from the FP64 sum (bf16 output), rows with no positions
// get exact zeros, a row with thousands of positions stays correctly
// rounded, gradients repeat bitwise, and bad inputs fail closed.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "support/cases.h"
#include "support/rowwise_fixture.h"
#include "support/test_util.h"
#include "detdit/adaln.h"

namespace detdit {
namespace testing {
namespace {

TEST(AdalnRowGather, ForwardEqualsSixIndexSelects) {
  for (const IndexCase& c : {testing::make_index_case(Packing::kBlock, 257, 3, 1),
                             testing::make_index_case(Packing::kInterleaved, 513, 4, 1),
                             testing::make_index_case(Packing::kBlock, 1, 1, 1)})
    for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
      SCOPED_TRACE(c.name() + " " + dtype_name(dtype));
      const int64_t h = 20, rows = c.num_rows();
      // rows as every other row of a (2R, 6H) buffer: row stride 12H, as table[::2]
      HostTensor buffer = random_tensor(dtype, {2 * rows, 6 * h}, 3);
      TensorView strided = TensorView::strided(buffer.data(), dtype, {rows, 6 * h}, {12 * h, 1});
      HostTensor out(dtype, {6, c.seq_len, h});
      AdalnRowGatherParams p{strided, testing::adaln_plan(c), out.view()};
      DETDIT_ASSERT_OK(adaln_row_gather_forward(p));
      const std::size_t esize = dtype_size(dtype);
      for (int chunk = 0; chunk < 6; ++chunk)
        for (int64_t s = 0; s < c.seq_len; ++s) {
          const char* want = static_cast<const char*>(buffer.data()) + (2 * c.row(s) * 6 * h + chunk * h) * esize;
          const char* got = static_cast<const char*>(out.data()) + (chunk * c.seq_len + s) * h * esize;
          ASSERT_TRUE(testing::bitwise_equal_bytes(want, got, h, dtype)) << "chunk " << chunk << " s " << s;
        }
    }
}

struct GatherBackward {
  IndexCase c;
  int64_t hidden;
  HostTensor grad, d_rows;
  GatherBackward(const IndexCase& index, int64_t h, DType out_dtype, uint64_t seed = 5)
      : c(index), hidden(h), grad(random_tensor(DType::kBF16, {6, index.positions(), h}, seed)),
        d_rows(out_dtype, {index.num_rows(), 6 * h}) {
    d_rows.fill_bytes(kCanary);
  }
  AdalnRowGatherBackwardParams params() const { return {grad.view(), testing::adaln_plan(c), d_rows.view()}; }
  std::vector<double> exact() const { return testing::row_gather_grad_exact(c, grad, hidden); }
};

TEST(AdalnRowGather, TableGradientIsCorrectlyRounded) {
  for (const IndexCase& c : {testing::make_index_case(Packing::kBlock, 4097, 3, 2),
                             testing::make_index_case(Packing::kInterleaved, 4097, 3, 1),
                             testing::make_index_case(Packing::kBlock, 4097, 1, 3)}) {
    SCOPED_TRACE(c.name());
    GatherBackward k(c, 256, DType::kBF16);
    DETDIT_ASSERT_OK(adaln_row_gather_backward(k.params()));
    const double rate = testing::fraction_correctly_rounded(k.d_rows, k.exact());
    EXPECT_GE(rate, 0.9999) << "correctly rounded fraction " << rate;
    std::printf("%s: d_rows %.5f %% correctly rounded\n", c.name().c_str(), 100 * rate);
  }
}

TEST(AdalnRowGather, H3ShapeTableGradientIsCorrectlyRounded) {
  IndexCase c = testing::make_index_case(Packing::kBlock, 1025, 3, 1);
  GatherBackward k(c, 5376, DType::kBF16);
  DETDIT_ASSERT_OK(adaln_row_gather_backward(k.params()));
  const double rate = testing::fraction_correctly_rounded(k.d_rows, k.exact());
  EXPECT_GE(rate, 0.9999) << "correctly rounded fraction " << rate;
  std::printf("H3 width (T=3, S=1025, H=5376): d_rows %.5f %% correctly rounded\n", 100 * rate);
}

TEST(AdalnRowGather, UnreferencedRowsAreExactZerosAndGradientsRepeat) {
  IndexCase c = testing::make_index_case(Packing::kInterleaved, 3, 4, 2);
  GatherBackward a(c, 8, DType::kBF16), b(c, 8, DType::kBF16);
  DETDIT_ASSERT_OK(adaln_row_gather_backward(a.params()));
  DETDIT_ASSERT_OK(adaln_row_gather_backward(b.params()));
  EXPECT_BITWISE_EQ(a.d_rows, b.d_rows);
  EXPECT_TRUE(testing::rows_are_zero(a.d_rows, testing::unreferenced_rows(c)));
}

TEST(AdalnRowGather, FourDimensionalGradGivesTheSameRows) {
  IndexCase c = testing::make_index_case(Packing::kBlock, 300, 3, 2);
  GatherBackward flat(c, 8, DType::kF32), split(c, 8, DType::kF32);
  DETDIT_ASSERT_OK(adaln_row_gather_backward(flat.params()));
  AdalnRowGatherBackwardParams p = split.params();
  p.grad = split.grad.view_as({6, 2, 300, 8});  // (6, B, S, H)
  DETDIT_ASSERT_OK(adaln_row_gather_backward(p));
  EXPECT_BITWISE_EQ(flat.d_rows, split.d_rows);
  p.grad = split.grad.view_as({6, 300, 2, 8});  // B and S swapped: refused
  EXPECT_EQ(adaln_row_gather_backward(p).kind(), ErrorKind::kValue);
}

// A row's gradient does not depend on other rows' positions: moving the
// positions of rows other than r (here: changing their rows) leaves d_rows[r] bitwise unchanged.
TEST(AdalnRowGather, RowGradientIgnoresOtherRowsPositions) {
  IndexCase c = testing::make_index_case(Packing::kInterleaved, 700, 3, 1);
  GatherBackward a(c, 8, DType::kF32);
  DETDIT_ASSERT_OK(adaln_row_gather_backward(a.params()));
  const int64_t kept = c.row(0);
  IndexCase moved = c;
  for (int64_t s = 0; s < c.seq_len; ++s)
    if (c.row(s) != kept) moved.timestep_indices[s] = (c.timestep_indices[s] + 1) % 3, moved.tags[s] = (c.row(s) + 1) % 3 == kept % 3 ? (c.tags[s] + 2) % 3 : (c.tags[s] + 1) % 3;
  for (int64_t s = 0; s < c.seq_len; ++s) ASSERT_EQ(moved.row(s) == kept, c.row(s) == kept);
  GatherBackward b(moved, 8, DType::kF32);
  testing::copy_bytes(a.grad, &b.grad);
  DETDIT_ASSERT_OK(adaln_row_gather_backward(b.params()));
  EXPECT_TRUE(testing::rows_bitwise_equal(a.d_rows, kept, b.d_rows, kept));
}

TEST(AdalnRowGather, BadInputsGetClearErrorsAndWriteNothing) {
  IndexCase c = testing::make_index_case(Packing::kBlock, 16, 2, 2);
  IndexPlan plan = testing::adaln_plan(c), sharded = testing::adaln_plan(testing::make_index_case(Packing::kBlock, 8, 2, 2));
  HostTensor rows = random_tensor(DType::kBF16, {6, 48}, 1), out(DType::kBF16, {6, 16, 8});
  HostTensor grad = random_tensor(DType::kBF16, {6, 32, 8}, 2), d_rows(DType::kF32, {6, 48});
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
    out.fill_bytes(kCanary);
    d_rows.fill_bytes(kCanary);
    AdalnRowGatherParams f{rows.view(), plan, out.view()};
    AdalnRowGatherBackwardParams b{grad.view(), plan, d_rows.view()};
    bad.mutate(&f, &b);
    EXPECT_TRUE(testing::refused(adaln_row_gather_forward(f), bad.kind, bad.message)) << "forward";
    EXPECT_TRUE(testing::refused(adaln_row_gather_backward(b), bad.kind, bad.message)) << "backward";
    EXPECT_TRUE(testing::still_canary({&out, &d_rows}));
  }
}

}  // namespace
}  // namespace testing
}  // namespace detdit
