// Tensors the ops accept at any byte address: every timestep_sinusoid,
// gate_residual, adaln_row_gather and silu_backward tensor (docs/ops.md asks
// no alignment), the linear and adaln_projection tensors validation does not
// require to be 16-byte aligned (all but x, weight, act and the d_x partials;
// x of the weight backward) and the rmsnorm tensors other than x, weight and out (shift,
// scale, rstd, grad, dx and the gradients). Placed one byte off
// alignment, each must give the bytes of the aligned call. Under UBSan
// (scripts/test.sh's sanitizer job) a typed access to such an address is a
// fatal "misaligned address" finding, which the CPU backend used to make.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "support/cases.h"
#include "support/test_util.h"
#include "detdit/adaln.h"
#include "detdit/gate_residual.h"
#include "detdit/gate_residual_rmsnorm.h"
#include "detdit/linear.h"
#include "detdit/rmsnorm.h"
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
    HostTensor partials_again(DType::kF32, {2, rows, in_features});  // partials must be 16-byte aligned
    Misaligned m_x(x), m_bias(bias), m_out(out), m_pre(pre), m_grad(grad), m_d_weight(d_weight), m_d_bias(d_bias);
    run({m_x.view(), m_bias.view(), m_out.view(), m_pre.view(), m_grad.view(), partials_again.view(),
         m_d_weight.view(), m_d_bias.view()});
    EXPECT_BITWISE_EQ(out, m_out.aligned());
    EXPECT_BITWISE_EQ(pre, m_pre.aligned());
    EXPECT_BITWISE_EQ(partials, partials_again);
    EXPECT_BITWISE_EQ(d_weight, m_d_weight.aligned());
    EXPECT_BITWISE_EQ(d_bias, m_d_bias.aligned());
  }
}

TEST(Unaligned, AdalnProjectionRowGatherAndSiluTensorsWithoutAnAlignmentRule) {
  const testing::IndexCase c = testing::make_index_case(testing::Packing::kBlock, 40, 2, 2);
  const IndexPlan plan = testing::adaln_plan(c);
  const int64_t t = 2, d = 8, h = 4, n = 18 * h, rows = c.num_rows();
  for (DType grad_dtype : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(dtype_name(grad_dtype));
    // weight and act: the 16-byte aligned tensors.
    HostTensor temb = testing::random_tensor(DType::kF32, {t, d}, 1), weight = testing::random_tensor(DType::kBF16, {n, d}, 2),
               bias = testing::random_tensor(DType::kBF16, {n}, 3), grad_table = testing::random_tensor(grad_dtype, {t, n}, 4),
               grad = testing::random_tensor(DType::kBF16, {6, c.positions(), h}, 5),
               silu_grad = testing::random_tensor(DType::kF32, {t, d}, 6), act(DType::kBF16, {t, d}),
               table(DType::kBF16, {t, n}), d_temb(DType::kF32, {t, d}), d_weight(DType::kBF16, {n, d}),
               d_bias(DType::kBF16, {n}), out(DType::kBF16, {6, c.seq_len, h}), d_rows(DType::kF32, {rows, 6 * h}),
               d_pre(DType::kF32, {t, d});
    struct Views {
      TensorView temb, bias, grad_table, grad, silu_grad, table, d_temb, d_weight, d_bias, out, d_rows, d_pre;
    };
    auto run = [&](const Views& v) {
      const AdalnProjectionInputs in{v.temb, weight.view(), v.bias};
      DETDIT_EXPECT_OK(adaln_projection_forward({in, v.table, act.view()}));
      DETDIT_EXPECT_OK(adaln_projection_backward({in, act.view(), v.grad_table, v.d_temb, v.d_weight, v.d_bias}));
      // the rows of the (3T, 6H) view of table, at its (any) address
      const TensorView table_rows = TensorView::contiguous(v.table.data, DType::kBF16, {rows, 6 * h});
      DETDIT_EXPECT_OK(adaln_row_gather_forward({table_rows, plan, v.out}));
      DETDIT_EXPECT_OK(adaln_row_gather_backward({v.grad, plan, v.d_rows}));
      SiluBackwardParams silu;
      silu.grad = v.silu_grad;
      silu.pre = v.temb;
      silu.d_pre = v.d_pre;
      DETDIT_EXPECT_OK(silu_backward(silu));
    };
    run({temb.view(), bias.view(), grad_table.view(), grad.view(), silu_grad.view(), table.view(), d_temb.view(),
         d_weight.view(), d_bias.view(), out.view(), d_rows.view(), d_pre.view()});
    Misaligned m_temb(temb), m_bias(bias), m_grad_table(grad_table), m_grad(grad), m_silu_grad(silu_grad), m_table(table),
        m_d_temb(d_temb), m_d_weight(d_weight), m_d_bias(d_bias), m_out(out), m_d_rows(d_rows), m_d_pre(d_pre);
    run({m_temb.view(), m_bias.view(), m_grad_table.view(), m_grad.view(), m_silu_grad.view(), m_table.view(),
         m_d_temb.view(), m_d_weight.view(), m_d_bias.view(), m_out.view(), m_d_rows.view(), m_d_pre.view()});
    EXPECT_BITWISE_EQ(table, m_table.aligned());
    EXPECT_BITWISE_EQ(d_temb, m_d_temb.aligned());
    EXPECT_BITWISE_EQ(d_weight, m_d_weight.aligned());
    EXPECT_BITWISE_EQ(d_bias, m_d_bias.aligned());
    EXPECT_BITWISE_EQ(out, m_out.aligned());
    EXPECT_BITWISE_EQ(d_rows, m_d_rows.aligned());
    EXPECT_BITWISE_EQ(d_pre, m_d_pre.aligned());
  }
}

TEST(Unaligned, RmsnormGateResidualAndTheFusedRegionTensorsWithoutAnAlignmentRule) {
  const testing::IndexCase c = testing::make_index_case(testing::Packing::kInterleaved, 300, 2, 2);
  const IndexPlan plan = testing::adaln_plan(c);
  const int64_t positions = c.positions(), rows = c.num_rows(), h = 16;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    // x, weight, out, h of the fused region: the aligned tensors.
    HostTensor x = testing::random_tensor(dtype, {positions, h}, 1), weight = testing::random_tensor(dtype, {h}, 2, 1, 0.2),
               out(dtype, {positions, h}), fused_h(dtype, {positions, h});
    HostTensor shift = testing::random_tensor(dtype, {rows, h}, 3), scale = testing::random_tensor(dtype, {rows, h}, 4),
               gate = testing::random_tensor(dtype, {rows, h}, 5), grad = testing::random_tensor(dtype, {positions, h}, 6),
               residual = testing::random_tensor(dtype, {positions, h}, 7), y = testing::random_tensor(dtype, {positions, h}, 8),
               d_h = testing::random_tensor(dtype, {positions, h}, 9), rstd(DType::kF32, {positions}),
               dx(dtype, {positions, h}), d_weight(dtype, {h}), d_shift(dtype, {rows, h}), d_scale(dtype, {rows, h}),
               gate_out(dtype, {positions, h}), d_residual(dtype, {positions, h}), d_y(dtype, {positions, h}),
               d_gate(dtype, {rows, h});
    // The views of every tensor without an alignment rule.
    struct Views {
      TensorView shift, scale, gate, grad, residual, y, d_h, rstd, dx, d_weight, d_shift, d_scale, gate_out, d_residual, d_y,
          d_gate;
    };
    // rmsnorm (modulated) forward and backward, gate_residual forward and
    // backward, then the fused region's both (its outputs over the same views).
    auto run = [&](const Views& v) {
      const RmsnormInputs in{x.view(), weight.view(), v.shift, v.scale, plan};
      DETDIT_EXPECT_OK(rmsnorm_forward({in, out.view(), v.rstd}));
      DETDIT_EXPECT_OK(rmsnorm_backward({in, v.rstd, v.grad, v.dx, v.d_weight, v.d_shift, v.d_scale}));
      const GateResidualInputs gate_in{v.residual, v.y, v.gate, plan};
      DETDIT_EXPECT_OK(gate_residual_forward({gate_in, v.gate_out}));
      DETDIT_EXPECT_OK(gate_residual_backward({gate_in, v.grad, v.d_residual, v.d_y, v.d_gate}));
      const GateResidualRmsnormInputs fused{v.residual, v.y, v.gate, weight.view(), v.shift, v.scale, plan};
      DETDIT_EXPECT_OK(gate_residual_rmsnorm_forward({fused, fused_h.view(), out.view(), v.rstd}));
      GateResidualRmsnormBackwardParams back;
      back.in = fused;
      back.h = fused_h.view();
      back.rstd = v.rstd;
      back.d_out = v.grad;
      back.d_h = v.d_h;
      back.d_residual = v.d_residual;
      back.d_y = v.d_y;
      back.d_gate = v.d_gate;
      back.d_weight = v.d_weight;
      back.d_shift = v.d_shift;
      back.d_scale = v.d_scale;
      DETDIT_EXPECT_OK(gate_residual_rmsnorm_backward(back));
    };
    run({shift.view(), scale.view(), gate.view(), grad.view(), residual.view(), y.view(), d_h.view(), rstd.view(),
         dx.view(), d_weight.view(), d_shift.view(), d_scale.view(), gate_out.view(), d_residual.view(), d_y.view(),
         d_gate.view()});
    Misaligned m_shift(shift), m_scale(scale), m_gate(gate), m_grad(grad), m_residual(residual), m_y(y), m_d_h(d_h),
        m_rstd(rstd), m_dx(dx), m_d_weight(d_weight), m_d_shift(d_shift), m_d_scale(d_scale), m_gate_out(gate_out),
        m_d_residual(d_residual), m_d_y(d_y), m_d_gate(d_gate);
    const HostTensor aligned_out = out, aligned_h = fused_h;
    run({m_shift.view(), m_scale.view(), m_gate.view(), m_grad.view(), m_residual.view(), m_y.view(), m_d_h.view(),
         m_rstd.view(), m_dx.view(), m_d_weight.view(), m_d_shift.view(), m_d_scale.view(), m_gate_out.view(),
         m_d_residual.view(), m_d_y.view(), m_d_gate.view()});
    EXPECT_BITWISE_EQ(aligned_out, out);
    EXPECT_BITWISE_EQ(aligned_h, fused_h);
    EXPECT_BITWISE_EQ(rstd, m_rstd.aligned());
    EXPECT_BITWISE_EQ(dx, m_dx.aligned());
    EXPECT_BITWISE_EQ(d_weight, m_d_weight.aligned());
    EXPECT_BITWISE_EQ(d_shift, m_d_shift.aligned());
    EXPECT_BITWISE_EQ(d_scale, m_d_scale.aligned());
    EXPECT_BITWISE_EQ(gate_out, m_gate_out.aligned());
    EXPECT_BITWISE_EQ(d_residual, m_d_residual.aligned());
    EXPECT_BITWISE_EQ(d_y, m_d_y.aligned());
    EXPECT_BITWISE_EQ(d_gate, m_d_gate.aligned());
  }
}

}  // namespace
}  // namespace detdit
