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
// agree wherever the two ops do.
#include "detdit/gate_residual_layernorm.h"

#include <memory>
#include <string>

#include "common/backends.h"
#include "common/scratch.h"
#include "common/validate.h"
#include "detdit/gate_residual.h"
#include "detdit/layernorm.h"
#include "detdit/modulation.h"
#include "rowwise/backward.h"
#include "rowwise/checks.h"

namespace detdit {
namespace {

GateResidualInputs gate_inputs(const GateResidualLayernormInputs& in) {
  return GateResidualInputs{in.residual, in.y, in.gate, in.plan, in.has_k, in.k, in.upcast};
}

LayernormInputs norm_inputs(const GateResidualLayernormInputs& in, const TensorView& h) {
  return LayernormInputs{h, in.weight, in.bias, in.shift, in.scale, in.plan, in.eps, in.numerics, in.upcast};
}

// h's dtype: gate_residual's output, promoted to fp32 by an fp32 gate when
// each op rounds (eager's type promotion), else residual's (which y shares).
DType h_dtype(const GateResidualLayernormInputs& in) {
  const bool promoted = in.gate.present() && in.gate.dtype == DType::kF32 && !in.upcast;
  return promoted ? DType::kF32 : in.y.dtype;
}

// h, checked under its own name before the halves read it as their out / x /
// grad stand-in: present, rows' shape, contiguous, its dtype, aligned for the
// norm.
Status check_h(const TensorView& h, const TensorView& rows, const char* rows_name, const GateResidualLayernormInputs& in) {
  DETDIT_RETURN_IF_ERROR(check::present(h, "h"));
  DETDIT_RETURN_IF_ERROR(check::present(rows, rows_name));
  DETDIT_RETURN_IF_ERROR(
      rowwise::check_like_as(h, "h", rows, rows_name, h_dtype(in), "gate_residual's output dtype"));
  return rowwise::check_norm_aligned(h, "h");
}

// Every present modulation tensor of one call in one form (the halves
// resolved each; a call mixing forms is no model's and is refused).
Status check_one_form(const GateResidualLayernormInputs& in, const TensorView& h) {
  if (!in.gate.present() || !in.shift.present()) return Status();
  const ResolvedModulation gate = rowwise::gate_modulation(gate_inputs(in));
  const ResolvedModulation norm = rowwise::layernorm_modulation(norm_inputs(in, h));
  if (gate.form == norm.form) return Status();
  return Status::value_error(std::string("gate, shift and scale must have one modulation form, got gate ") +
                             in.gate.describe() + " (" + modulation_form_name(gate.form) + ") and shift " +
                             in.shift.describe() + " (" + modulation_form_name(norm.form) + ")");
}

Status validate_forward(const GateResidualLayernormParams& p) {
  const GateResidualLayernormInputs& in = p.in;
  DETDIT_RETURN_IF_ERROR(check_h(p.h, in.residual, "residual", in));
  DETDIT_RETURN_IF_ERROR(rowwise::check_gate_residual_forward_arguments({gate_inputs(in), p.h}, rowwise::Forms::kAll));
  DETDIT_RETURN_IF_ERROR(
      rowwise::check_layernorm_forward_arguments({norm_inputs(in, p.h), p.out, p.mean, p.rstd}));
  DETDIT_RETURN_IF_ERROR(check_one_form(in, p.h));
  return rowwise::check_outputs_disjoint({{&in.residual, "residual"}, {&in.y, "y"}, {&in.gate, "gate"},
                                          {&in.weight, "weight"}, {&in.bias, "bias"}, {&in.shift, "shift"},
                                          {&in.scale, "scale"}},
                                         {{&p.h, "h"}, {&p.out, "out"}, {&p.mean, "mean"}, {&p.rstd, "rstd"}});
}

// The backward's g (the gradient of h) lives in d_residual when d_residual
// has h's dtype (d_residual = R(g) = g then), else in scratch.
bool g_in_d_residual(const GateResidualLayernormBackwardParams& p) {
  return p.d_residual.present() && p.d_residual.dtype == p.h.dtype;
}

// The halves' backward params, g standing for the gradient of h.
LayernormBackwardParams norm_backward(const GateResidualLayernormBackwardParams& p, const TensorView& g) {
  return LayernormBackwardParams{norm_inputs(p.in, p.h), p.mean,     p.rstd,    p.d_out, g,
                                 p.d_weight,              p.d_bias,   p.d_shift, p.d_scale};
}
GateResidualBackwardParams gate_backward(const GateResidualLayernormBackwardParams& p, const TensorView& g) {
  return GateResidualBackwardParams{gate_inputs(p.in), g, g_in_d_residual(p) ? TensorView() : p.d_residual, p.d_y,
                                    p.d_gate};
}

Status validate_backward(const GateResidualLayernormBackwardParams& p) {
  const GateResidualLayernormInputs& in = p.in;
  DETDIT_RETURN_IF_ERROR(check_h(p.h, in.y, "y", in));
  DETDIT_RETURN_IF_ERROR(check::present(p.d_out, "d_out"));
  if (p.d_h.present()) DETDIT_RETURN_IF_ERROR(rowwise::check_like(p.d_h, "d_h", p.h, "h"));
  // The norm half without dx (g is internal), the gate half with h standing
  // for g (same shape and dtype), d_residual checked there.
  DETDIT_RETURN_IF_ERROR(rowwise::check_layernorm_backward_arguments(norm_backward(p, TensorView())));
  GateResidualBackwardParams gate = gate_backward(p, p.h);
  gate.d_residual = p.d_residual;
  DETDIT_RETURN_IF_ERROR(rowwise::check_gate_residual_backward_arguments(gate, rowwise::Forms::kAll));
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
  const Device device = p.h.device;
  // Scratch first, so a failed allocation writes nothing: g when the gate
  // half needs it and d_residual cannot hold it, and the d_gate partials;
  // the norm half allocates its own before it writes (run_layernorm_backward).
  const bool gate_half = p.d_residual.present() || p.d_y.present() || p.d_gate.present();
  TensorView g;
  std::shared_ptr<void> owner;
  if (g_in_d_residual(p)) {
    g = p.d_residual;
  } else if (gate_half) {
    g = p.h;
    DETDIT_RETURN_IF_ERROR(allocate_scratch(device, p.h.nbytes(), stream, &owner));
    g.data = owner.get();
  }
  const GateResidualBackwardParams gate = gate_backward(p, g);
  rowwise::GatePartials gate_partials;
  if (gate_half) DETDIT_RETURN_IF_ERROR(rowwise::allocate_gate_partials(gate, stream, &gate_partials));
  DETDIT_RETURN_IF_ERROR(rowwise::run_layernorm_backward(norm_backward(p, g), stream));
  if (!gate_half) return Status();
  if (p.d_h.present()) DETDIT_RETURN_IF_ERROR(backend::add(device, g, p.d_h, g, stream));
  DETDIT_RETURN_IF_ERROR(rowwise::gate_rows_and_partials(gate, gate_partials, stream));
  return rowwise::fold_gate_partials(gate, gate_partials, stream);
}

}  // namespace detdit
