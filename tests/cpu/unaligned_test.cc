// Tensors the ops accept at any byte address: every timestep_sinusoid tensor
// (docs/ops.md asks no alignment) and the linear tensors validation does not
// require to be 16-byte aligned (all but x and weight; x of the weight
// backward). Placed one byte off alignment, each must give the bytes of the
// aligned call. Under UBSan (scripts/test.sh's sanitizer job) a typed access
// to such an address is a fatal "misaligned address" finding, which the CPU
// backend used to make.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "common/test_util.h"
#include "detdit/linear.h"
#include "detdit/timestep.h"

namespace detdit {
namespace {

using testing::HostTensor;

// The bytes of a tensor one byte past a 64-byte boundary.
class Misaligned {
 public:
  explicit Misaligned(const HostTensor& like) : shape_(like.shape()), dtype_(like.dtype()), bytes_(like.nbytes() + 65) {
    const auto address = reinterpret_cast<std::uintptr_t>(bytes_.data());
    data_ = bytes_.data() + (64 - address % 64) % 64 + 1;
    std::memcpy(data_, like.data(), like.nbytes());
    view_ = like.view();
    view_.data = data_;
  }
  TensorView view() const { return view_; }
  // The bytes now held, as an aligned tensor (for the bitwise comparison).
  HostTensor aligned() const {
    HostTensor t(dtype_, shape_);
    std::memcpy(t.data(), data_, t.nbytes());
    return t;
  }

 private:
  std::vector<int64_t> shape_;
  DType dtype_;
  std::vector<char> bytes_;
  char* data_ = nullptr;
  TensorView view_;  // like's shape at data_
};

TEST(Unaligned, TimestepSinusoidAnyByteAddress) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    HostTensor timesteps(dtype, {5}), features(DType::kF32, {5, 16}), grad(DType::kF32, {5, 16}),
        d_timesteps(dtype, {5});
    testing::fill_uniform(&timesteps, 1, 0.0, 1.0);
    testing::fill_normal(&grad, 2);
    // The forward and the backward on these views of (timesteps, features, grad, d_timesteps).
    auto run = [](const TensorView& t, const TensorView& f, const TensorView& g, const TensorView& d_t) {
      TimestepSinusoidParams forward;
      forward.in.timesteps = t;
      forward.features = f;
      DETDIT_EXPECT_OK(timestep_sinusoid_forward(forward));
      TimestepSinusoidBackwardParams backward;
      backward.in.timesteps = t;
      backward.grad_features = g;
      backward.d_timesteps = d_t;
      DETDIT_EXPECT_OK(timestep_sinusoid_backward(backward));
    };
    run(timesteps.view(), features.view(), grad.view(), d_timesteps.view());
    Misaligned m_timesteps(timesteps), m_features(features), m_grad(grad), m_d_timesteps(d_timesteps);
    run(m_timesteps.view(), m_features.view(), m_grad.view(), m_d_timesteps.view());
    EXPECT_BITWISE_EQ(features, m_features.aligned());
    EXPECT_BITWISE_EQ(d_timesteps, m_d_timesteps.aligned());
  }
}

TEST(Unaligned, LinearTensorsWithoutAnAlignmentRule) {
  const int64_t rows = 3, in_features = 8, out_features = 70;  // two chunks of N
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    HostTensor x(dtype, {rows, in_features}), weight(dtype, {out_features, in_features}), bias(dtype, {out_features}),
        out(dtype, {rows, out_features}), pre(DType::kF32, {rows, out_features}),
        grad(DType::kF32, {rows, out_features}), partials(DType::kF32, {2, rows, in_features}),
        d_weight(dtype, {out_features, in_features}), d_bias(dtype, {out_features});
    testing::fill_normal(&x, 3);
    testing::fill_normal(&weight, 4);
    testing::fill_normal(&bias, 5);
    testing::fill_normal(&grad, 6);
    // The forward, the input-gradient partials and the weight backward on
    // these views; x_any is the weight backward's x (no alignment rule there).
    struct Views {
      TensorView x_any, bias, out, pre, grad, partials, d_weight, d_bias;
    };
    auto run = [&](const Views& v) {
      LinearParams forward;
      forward.x = x.view();
      forward.weight = weight.view();
      forward.bias = v.bias;
      forward.out = v.out;
      forward.pre_activation = v.pre;
      forward.activation = Activation::kSilu;
      DETDIT_EXPECT_OK(linear_forward(forward));
      LinearBackwardInputParams input;
      input.grad = v.grad;
      input.weight = weight.view();
      input.partials = v.partials;
      DETDIT_EXPECT_OK(linear_backward_input_partials(input));
      LinearBackwardWeightParams backward;
      backward.grad = v.grad;
      backward.x = v.x_any;
      backward.d_weight = v.d_weight;
      backward.d_bias = v.d_bias;
      DETDIT_EXPECT_OK(linear_backward_weight(backward));
    };
    run({x.view(), bias.view(), out.view(), pre.view(), grad.view(), partials.view(), d_weight.view(), d_bias.view()});
    Misaligned m_x(x), m_bias(bias), m_out(out), m_pre(pre), m_grad(grad), m_partials(partials), m_d_weight(d_weight),
        m_d_bias(d_bias);
    run({m_x.view(), m_bias.view(), m_out.view(), m_pre.view(), m_grad.view(), m_partials.view(), m_d_weight.view(),
         m_d_bias.view()});
    EXPECT_BITWISE_EQ(out, m_out.aligned());
    EXPECT_BITWISE_EQ(pre, m_pre.aligned());
    EXPECT_BITWISE_EQ(partials, m_partials.aligned());
    EXPECT_BITWISE_EQ(d_weight, m_d_weight.aligned());
    EXPECT_BITWISE_EQ(d_bias, m_d_bias.aligned());
  }
}

}  // namespace
}  // namespace detdit
