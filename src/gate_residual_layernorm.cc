// Public gate_residual_layernorm entry points (include/detdit/gate_residual_layernorm.h,
// docs/numerics.md 9.7): validate both halves and the outputs against every
// input, allocate the scratch, then run the two ops' own halves on the
// tensors' device. Nothing is written on error.
//
// The op is the composition, written once for both devices: the forward is
// the gate_residual backend into h, then the layernorm backend on h (on
// CUDA one kernel per row, src/cuda/gate_residual_layernorm.cu, same bytes);
// the backward is the layernorm backward of d_out with dx into g (the
// gradient of h), g = R(rn(g + d_h)), then the gate_residual backward of g
// (rows, partials, fold). Every bit is the separate ops', so the CPU and CUDA
// agree wherever the two ops do. The checks of h and of the one form, and the
// backward's sequence, are shared with gate_residual_rmsnorm
// (src/rowwise/gate_residual_norm.h).
#include "detdit/gate_residual_layernorm.h"

#include "common/backends.h"
#include "common/validate.h"
#include "detdit/gate_residual.h"
#include "detdit/layernorm.h"
#include "rowwise/backward.h"
#include "rowwise/checks.h"
#include "rowwise/gate_residual_norm.h"

namespace detdit {
namespace {

GateResidualInputs gate_inputs(const GateResidualLayernormInputs& in) {
  return GateResidualInputs{in.residual, in.y, in.gate, in.plan, in.has_k, in.k, in.upcast};
}

LayernormInputs norm_inputs(const GateResidualLayernormInputs& in, const TensorView& h) {
  return LayernormInputs{h, in.weight, in.bias, in.shift, in.scale, in.plan, in.eps, in.numerics, in.upcast};
}

// Every present modulation tensor of one call in one form.
Status check_one_form(const GateResidualLayernormInputs& in, const TensorView& h) {
  return rowwise::check_one_form(gate_inputs(in), rowwise::layernorm_modulation(norm_inputs(in, h)), in.shift);
}

Status validate_forward(const GateResidualLayernormParams& p) {
  const GateResidualLayernormInputs& in = p.in;
  DETDIT_RETURN_IF_ERROR(rowwise::check_region_h(p.h, in.residual, "residual", gate_inputs(in)));
  DETDIT_RETURN_IF_ERROR(rowwise::check_gate_residual_forward_arguments({gate_inputs(in), p.h}, rowwise::Forms::kAll));
  DETDIT_RETURN_IF_ERROR(
      rowwise::check_layernorm_forward_arguments({norm_inputs(in, p.h), p.out, p.mean, p.rstd}, "h"));
  DETDIT_RETURN_IF_ERROR(check_one_form(in, p.h));
  return rowwise::check_outputs_disjoint({{&in.residual, "residual"}, {&in.y, "y"}, {&in.gate, "gate"},
                                          {&in.weight, "weight"}, {&in.bias, "bias"}, {&in.shift, "shift"},
                                          {&in.scale, "scale"}},
                                         {{&p.h, "h"}, {&p.out, "out"}, {&p.mean, "mean"}, {&p.rstd, "rstd"}});
}

// The halves' backward params, g standing for the gradient of h.
LayernormBackwardParams norm_backward(const GateResidualLayernormBackwardParams& p, const TensorView& g) {
  return LayernormBackwardParams{norm_inputs(p.in, p.h), p.mean,     p.rstd,    p.d_out, g,
                                 p.d_weight,              p.d_bias,   p.d_shift, p.d_scale};
}
GateResidualBackwardParams gate_backward(const GateResidualLayernormBackwardParams& p, const TensorView& g) {
  return GateResidualBackwardParams{gate_inputs(p.in), g, p.d_residual, p.d_y, p.d_gate};
}

Status validate_backward(const GateResidualLayernormBackwardParams& p) {
  const GateResidualLayernormInputs& in = p.in;
  DETDIT_RETURN_IF_ERROR(rowwise::check_region_h(p.h, in.y, "y", gate_inputs(in)));
  DETDIT_RETURN_IF_ERROR(check::present(p.d_out, "d_out"));
  if (p.d_h.present()) DETDIT_RETURN_IF_ERROR(rowwise::check_like(p.d_h, "d_h", p.h, "h"));
  // The norm half without dx (g is internal), the gate half with h standing
  // for g (same shape and dtype), d_residual checked there.
  DETDIT_RETURN_IF_ERROR(rowwise::check_layernorm_backward_arguments(norm_backward(p, TensorView()), "h"));
  DETDIT_RETURN_IF_ERROR(rowwise::check_gate_residual_backward_arguments(gate_backward(p, p.h), rowwise::Forms::kAll));
  DETDIT_RETURN_IF_ERROR(check_one_form(in, p.h));
  return rowwise::check_outputs_disjoint(
      {{&in.y, "y"}, {&in.gate, "gate"}, {&in.weight, "weight"}, {&in.bias, "bias"}, {&in.shift, "shift"},
       {&in.scale, "scale"}, {&p.h, "h"}, {&p.mean, "mean"}, {&p.rstd, "rstd"}, {&p.d_out, "d_out"},
       {&p.d_h, "d_h"}},
      {{&p.d_residual, "d_residual"}, {&p.d_y, "d_y"}, {&p.d_gate, "d_gate"}, {&p.d_weight, "d_weight"},
       {&p.d_bias, "d_bias"}, {&p.d_shift, "d_shift"}, {&p.d_scale, "d_scale"}});
}

}  // namespace

Status gate_residual_layernorm_forward(const GateResidualLayernormParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(validate_forward(params));
  const Device device = params.h.device;
  // CUDA: one kernel, the composition's bytes (numerics 9.7); the CPU, the reference, composes.
  if (device.is_cuda()) return cuda::gate_residual_layernorm_forward(params, stream);
  const GateResidualParams gate{gate_inputs(params.in), params.h};
  const LayernormParams norm{norm_inputs(params.in, params.h), params.out, params.mean, params.rstd};
  DETDIT_RETURN_IF_ERROR(backend::gate_residual_forward(device, gate, stream));
  return backend::layernorm_forward(device, norm, stream);
}

Status gate_residual_layernorm_backward(const GateResidualLayernormBackwardParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(validate_backward(params));
  const GateResidualLayernormBackwardParams& p = params;
  return rowwise::run_region_backward(
      gate_backward(p, TensorView()), p.h, p.d_h,
      [&](const TensorView& g) { return rowwise::run_layernorm_backward(norm_backward(p, g), stream); }, stream);
}

}  // namespace detdit
