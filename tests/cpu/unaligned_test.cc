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
  }
  TensorView view() const { return testing::contiguous_view(data_, dtype_, shape_); }
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
};

TEST(Unaligned, TimestepSinusoidAnyByteAddress) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    HostTensor timesteps(dtype, {5}), features(DType::kF32, {5, 16}), grad(DType::kF32, {5, 16}),
        d_timesteps(dtype, {5});
    testing::fill_uniform(&timesteps, 1, 0.0, 1.0);
    testing::fill_normal(&grad, 2);
    TimestepSinusoidParams f;
    f.timesteps = timesteps.view();
    f.features = features.view();
    DETDIT_ASSERT_OK(timestep_sinusoid_forward(f));
    TimestepSinusoidBackwardParams b;
    b.timesteps = timesteps.view();
    b.grad_features = grad.view();
    b.d_timesteps = d_timesteps.view();
    DETDIT_ASSERT_OK(timestep_sinusoid_backward(b));

    Misaligned m_timesteps(timesteps), m_features(features), m_grad(grad), m_d_timesteps(d_timesteps);
    f.timesteps = m_timesteps.view();
    f.features = m_features.view();
    DETDIT_ASSERT_OK(timestep_sinusoid_forward(f));
    b.timesteps = m_timesteps.view();
    b.grad_features = m_grad.view();
    b.d_timesteps = m_d_timesteps.view();
    DETDIT_ASSERT_OK(timestep_sinusoid_backward(b));
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
    LinearParams f;
    f.x = x.view();
    f.weight = weight.view();
    f.bias = bias.view();
    f.out = out.view();
    f.pre_activation = pre.view();
    f.activation = Activation::kSilu;
    DETDIT_ASSERT_OK(linear_forward(f));
    LinearBackwardInputParams bi;
    bi.grad = grad.view();
    bi.weight = weight.view();
    bi.partials = partials.view();
    DETDIT_ASSERT_OK(linear_backward_input_partials(bi));
    LinearBackwardWeightParams bw;
    bw.grad = grad.view();
    bw.x = x.view();
    bw.d_weight = d_weight.view();
    bw.d_bias = d_bias.view();
    DETDIT_ASSERT_OK(linear_backward_weight(bw));

    Misaligned m_x(x), m_bias(bias), m_out(out), m_pre(pre), m_grad(grad), m_partials(partials), m_d_weight(d_weight),
        m_d_bias(d_bias);
    f.bias = m_bias.view();
    f.out = m_out.view();
    f.pre_activation = m_pre.view();
    DETDIT_ASSERT_OK(linear_forward(f));
    bi.grad = m_grad.view();
    bi.partials = m_partials.view();
    DETDIT_ASSERT_OK(linear_backward_input_partials(bi));
    bw.grad = m_grad.view();
    bw.x = m_x.view();
    bw.d_weight = m_d_weight.view();
    bw.d_bias = m_d_bias.view();
    DETDIT_ASSERT_OK(linear_backward_weight(bw));
    EXPECT_BITWISE_EQ(out, m_out.aligned());
    EXPECT_BITWISE_EQ(pre, m_pre.aligned());
    EXPECT_BITWISE_EQ(partials, m_partials.aligned());
    EXPECT_BITWISE_EQ(d_weight, m_d_weight.aligned());
    EXPECT_BITWISE_EQ(d_bias, m_d_bias.aligned());
  }
}

}  // namespace
}  // namespace detdit
