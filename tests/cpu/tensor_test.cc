// TensorView helpers on views no tensor can have (src/common/tensor.cc): a
// shape of more than 2^63 elements, a rank past kMaxRank, negative
// dimensions. They must not overflow (UBSan) or read past shape[kMaxRank]
// (ASan), and the validators must refuse such views by name, before any op
// multiplies their dimensions or reads their data.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "support/rowwise_fixture.h"
#include "support/test_util.h"
#include "common/validate.h"
#include "detdit/linear.h"
#include "detdit/rmsnorm.h"
#include "detdit/timestep.h"

namespace detdit {
namespace {

using testing::HostTensor;
using testing::kCanary;
using testing::refused;

constexpr int64_t k2e32 = int64_t{1} << 32;

TEST(TensorView, NumelOfAnOverflowingShapeIsMinusOne) {
  float x = 0;
  // 2^64 elements: the product used to wrap (to 0 here, a signed overflow).
  TensorView v = TensorView::strided(&x, DType::kF32, {k2e32, k2e32}, {k2e32, 1});
  EXPECT_EQ(v.numel(), -1);
  EXPECT_FALSE(v.is_contiguous());
  // 2^63 exactly does not fit int64 either; 2^62 does.
  EXPECT_EQ(TensorView::strided(&x, DType::kF32, {k2e32, int64_t{1} << 31}, {int64_t{1} << 31, 1}).numel(), -1);
  EXPECT_EQ(TensorView::strided(&x, DType::kF32, {k2e32, int64_t{1} << 30}, {int64_t{1} << 30, 1}).numel(),
            int64_t{1} << 62);
  // A negative dimension has no element count either.
  EXPECT_EQ(TensorView::strided(&x, DType::kF32, {-2, 3}, {3, 1}).numel(), -1);
}

TEST(TensorView, ContiguousOfAnOverflowingShapeIsNotContiguous) {
  float x = 0;
  // The strides of (2^32, 2^32, 2) overflow from the first dimension on.
  TensorView v = TensorView::contiguous(&x, DType::kF32, {k2e32, k2e32, 2});
  EXPECT_EQ(v.rank, 3);
  EXPECT_EQ(v.numel(), -1);
  EXPECT_FALSE(v.is_contiguous());
  TensorView fine = TensorView::contiguous(&x, DType::kF32, {2, 3, 4});
  EXPECT_EQ(fine.strides[0], 12);
  EXPECT_TRUE(fine.is_contiguous());
}

TEST(TensorView, RankPastTheMaximumIsNeverRead) {
  float x = 0;
  TensorView v = TensorView::contiguous(&x, DType::kF32, {1, 1, 1, 1});
  v.rank = kMaxRank + 3;  // a caller's view: shape[4..6] do not exist
  EXPECT_EQ(v.numel(), -1);
  EXPECT_FALSE(v.is_contiguous());
  EXPECT_EQ(v.shape_string(), "(rank 7)");
}

TEST(TensorView, ValidationRefusesWhatNoTensorCanBe) {
  float x[4] = {};
  const TensorView good = TensorView::contiguous(x, DType::kF32, {4});
  EXPECT_TRUE(check::present(good, "x").ok());
  TensorView empty = TensorView::contiguous(nullptr, DType::kF32, {0, 3});
  EXPECT_TRUE(check::present(empty, "x").ok()) << "an empty tensor needs no data";

  EXPECT_TRUE(refused(check::present(TensorView{}, "x"), ErrorKind::kValue, "x is required"));
  TensorView deep = good;
  deep.rank = 5;
  EXPECT_TRUE(refused(check::present(deep, "x"), ErrorKind::kValue, "x has rank 5; a TensorView holds ranks 1..4"));
  EXPECT_TRUE(refused(check::present(TensorView::strided(x, DType::kF32, {2, -3}, {1, 1}), "x"), ErrorKind::kValue,
                      "x has a negative dimension: shape (2, -3)"));
  EXPECT_TRUE(refused(check::present(TensorView::strided(x, DType::kF32, {k2e32, k2e32}, {0, 0}), "x"),
                      ErrorKind::kValue, "x has shape (4294967296, 4294967296), more bytes than a 64-bit"));
  // 2^62 elements fit int64, their 2^64 bytes do not.
  EXPECT_TRUE(refused(check::present(TensorView::strided(x, DType::kF32, {k2e32, int64_t{1} << 30}, {0, 0}), "x"),
                      ErrorKind::kValue, "more bytes than a 64-bit address space holds"));
  EXPECT_TRUE(refused(check::present(TensorView::contiguous(nullptr, DType::kF32, {4}), "x"), ErrorKind::kValue,
                      "x is (4,) float32 on cpu with a null data pointer"));
}

// An op refuses a null timesteps pointer instead of reading through it (the
// range check used to pass it to memcpy).
TEST(TensorView, OpsRefuseANullDataPointer) {
  std::vector<float> features(4 * 8, 0.0f);
  TimestepSinusoidParams p;
  p.in.timesteps = TensorView::contiguous(nullptr, DType::kF32, {4});
  p.features = TensorView::contiguous(features.data(), DType::kF32, {4, 8});
  EXPECT_TRUE(refused(timestep_sinusoid_forward(p), ErrorKind::kValue, "timesteps is (4,) float32 on cpu with a null"));
  EXPECT_TRUE(std::all_of(features.begin(), features.end(), [](float v) { return v == 0.0f; })) << "features written";
}

// A negative dimension is no wildcard: the shape checks derive the expected
// dims from other arguments (out must be (T, N) with N = weight.shape[0]), so
// a (-1, K) weight used to make out's check match anything; linear returned
// OK and wrote nothing, timestep_mlp_backward wrote d_w2, then failed. The
// presence check (check::present) refuses the negative dimension first.
TEST(TensorView, NegativeDimensionsAreNoWildcard) {
  HostTensor x(DType::kF32, {2, 8}), weight(DType::kF32, {4, 8}), out(DType::kF32, {2, 4});
  out.fill_bytes(kCanary);
  LinearParams linear;
  linear.x = x.view();
  linear.weight = TensorView::strided(weight.data(), DType::kF32, {-1, 8}, {8, 1});
  linear.out = out.view();
  EXPECT_TRUE(refused(linear_forward(linear), ErrorKind::kValue, "weight has a negative dimension: shape (-1, 8)"));
  EXPECT_TRUE(testing::still_canary({&out}));

  const int64_t t = 2, k = 8, h = 8, d = 4;
  HostTensor features(DType::kF32, {t, k}), w1(DType::kF32, {h, k}), w2(DType::kF32, {d, h}), pre(DType::kF32, {t, h}),
      hidden(DType::kF32, {t, h}), grad(DType::kF32, {t, d}), d_w2(DType::kF32, {d, h}), d_b2(DType::kF32, {d}),
      d_w1(DType::kF32, {h, k});
  for (HostTensor* o : {&d_w2, &d_b2, &d_w1}) o->fill_bytes(kCanary);
  TimestepMlpBackwardParams mlp;
  mlp.in.features = features.view();
  mlp.in.w1 = w1.view();
  mlp.in.w2 = TensorView::strided(w2.data(), DType::kF32, {-1, h}, {h, 1});
  mlp.pre = pre.view();
  mlp.hidden = hidden.view();
  mlp.grad_temb = grad.view();
  mlp.d_w2 = d_w2.view();
  mlp.d_b2 = d_b2.view();
  mlp.d_w1 = d_w1.view();
  EXPECT_TRUE(refused(timestep_mlp_backward(mlp), ErrorKind::kValue, "w2 has a negative dimension: shape (-1, 8)"));
  EXPECT_TRUE(testing::still_canary({&d_w2, &d_b2, &d_w1}));
}

// A Numerics value outside the enum (a cast from an int) is refused by name,
// on every op that takes one, before anything is written.
TEST(TensorView, AProfileOutsideTheEnumIsRefused) {
  const Numerics bad = static_cast<Numerics>(7);
  const char* const message = "numerics must be Numerics::kPortable or Numerics::kTorch, got Numerics(7)";
  HostTensor x(DType::kF32, {2, 8}), weight(DType::kF32, {4, 8}), out(DType::kF32, {2, 4});
  out.fill_bytes(kCanary);
  LinearParams linear;
  linear.x = x.view();
  linear.weight = weight.view();
  linear.out = out.view();
  linear.numerics = bad;
  EXPECT_TRUE(refused(linear_forward(linear), ErrorKind::kValue, message));
  HostTensor rows(DType::kF32, {3, 8}), norm_weight(DType::kF32, {8}), normed(DType::kF32, {3, 8});
  normed.fill_bytes(kCanary);
  RmsnormParams norm;
  norm.in.x = rows.view();
  norm.in.weight = norm_weight.view();
  norm.in.numerics = bad;
  norm.out = normed.view();
  EXPECT_TRUE(refused(rmsnorm_forward(norm), ErrorKind::kValue, message));
  HostTensor timesteps(DType::kF32, {2}), features(DType::kF32, {2, 8});
  features.fill_bytes(kCanary);
  TimestepSinusoidParams sinusoid;
  sinusoid.in.timesteps = timesteps.view();
  sinusoid.in.numerics = bad;
  sinusoid.features = features.view();
  EXPECT_TRUE(refused(timestep_sinusoid_forward(sinusoid), ErrorKind::kValue, message));
  EXPECT_TRUE(testing::still_canary({&out, &normed, &features}));
}

}  // namespace
}  // namespace detdit
