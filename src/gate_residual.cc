// Public gate_residual entry points: validate every argument
// (include/detdit/gate_residual.h, docs/ops.md), then dispatch on the tensors'
// device: the forward to the backend, the backward through one device-generic
// composition of the backend's halves (as src/rowwise/backward.h describes).
// Nothing is written on error.
#include "detdit/gate_residual.h"

#include <memory>

#include "common/backends.h"
#include "common/scratch.h"
#include "common/validate.h"
#include "detdit/modulation.h"
#include "rowwise/backward.h"
#include "rowwise/checks.h"

namespace detdit {
namespace rowwise {
namespace {

// The gate of rows (residual in the forward, y in the backward; named
// rows_name). Indexed only: a plan and an (R, H) gate of the rows' dtype,
// upcast = false, no k (the fused ops' and the SP region's rule); every
// form: resolve_modulation (modulation.h), gate optional. *hidden receives H,
// *resolved the form.
Status check_gate(const GateResidualInputs& in, const TensorView& rows, const char* rows_name, Forms forms,
                  int64_t* hidden, ResolvedModulation* resolved) {
  if (forms == Forms::kIndexedOnly) {
    DETDIT_RETURN_IF_ERROR(check::plan_on(in.plan, "plan", rows, rows_name));
    DETDIT_RETURN_IF_ERROR(check_rows(rows, rows_name, &in.plan, hidden));
    DETDIT_RETURN_IF_ERROR(check_table(in.gate, "gate", in.plan.num_rows(), *hidden, rows, rows_name, {rows.dtype}));
    if (in.upcast)
      return Status::value_error("upcast must be false: this op takes the indexed gate in its rows' dtype only");
    if (in.has_k)
      return Status::value_error("has_k must be false: this op takes the indexed gate without a constant only");
  } else {
    if (in.plan.valid()) DETDIT_RETURN_IF_ERROR(check::plan_on(in.plan, "plan", rows, rows_name));
    DETDIT_RETURN_IF_ERROR(check_rows(rows, rows_name, &in.plan, hidden));
  }
  return resolve_modulation(rows, rows_name, {{&in.gate, "gate"}}, in.plan, resolved);
}

}  // namespace

Status check_gate_residual_forward_arguments(const GateResidualParams& p, Forms forms) {
  int64_t hidden = 0;
  ResolvedModulation mod;
  DETDIT_RETURN_IF_ERROR(check_gate(p.in, p.in.residual, "residual", forms, &hidden, &mod));
  DETDIT_RETURN_IF_ERROR(check_like(p.in.y, "y", p.in.residual, "residual"));
  return check_modulated_out(p.out, "out", p.in.residual, "residual", mod, p.in.upcast, "gate");
}

Status validate_gate_residual_forward(const GateResidualParams& p, Forms forms) {
  DETDIT_RETURN_IF_ERROR(check_gate_residual_forward_arguments(p, forms));
  return check_outputs_disjoint({{&p.in.residual, "residual"}, {&p.in.y, "y"}, {&p.in.gate, "gate"}}, {{&p.out, "out"}});
}

Status check_gate_residual_backward_arguments(const GateResidualBackwardParams& p, Forms forms) {
  int64_t hidden = 0;
  ResolvedModulation mod;
  if (forms == Forms::kIndexedOnly) {
    // grad carries the rows, y and gate follow it (the checks' order before the forms).
    DETDIT_RETURN_IF_ERROR(check_gate(p.in, p.grad, "grad", forms, &hidden, &mod));
    DETDIT_RETURN_IF_ERROR(check_like(p.in.y, "y", p.grad, "grad"));
  } else {
    // grad first (as above), then y: grad's dtype too, but where an fp32
    // gate promotes grad to fp32 (upcast = false), any float dtype.
    if (p.in.plan.valid()) DETDIT_RETURN_IF_ERROR(check::plan_on(p.in.plan, "plan", p.grad, "grad"));
    DETDIT_RETURN_IF_ERROR(check_rows(p.grad, "grad", &p.in.plan, &hidden));
    const bool promoted = p.grad.dtype == DType::kF32 && !p.in.upcast && p.in.gate.present() &&
                          p.in.gate.dtype == DType::kF32;
    if (promoted) {
      DETDIT_RETURN_IF_ERROR(check_rows(p.in.y, "y", &p.in.plan, &hidden));
      DETDIT_RETURN_IF_ERROR(check_like_as(p.in.y, "y", p.grad, "grad", p.in.y.dtype, "y's own"));
    } else {
      DETDIT_RETURN_IF_ERROR(check_like(p.in.y, "y", p.grad, "grad"));
    }
    DETDIT_RETURN_IF_ERROR(check_gate(p.in, p.in.y, "y", forms, &hidden, &mod));
    DETDIT_RETURN_IF_ERROR(check_modulated_out(p.grad, "grad", p.in.y, "y", mod, p.in.upcast, "gate"));
  }
  if (p.d_residual.present()) DETDIT_RETURN_IF_ERROR(check_like(p.d_residual, "d_residual", p.in.y, "y"));
  if (p.d_y.present()) DETDIT_RETURN_IF_ERROR(check_like(p.d_y, "d_y", p.in.y, "y"));
  if (!p.d_gate.present()) return Status();
  if (!p.in.gate.present())
    return Status::value_error("d_gate needs a gate, got an absent gate (the plain residual add)");
  if (mod.form == ModulationForm::kIndexed)
    return check_table_grad(p.d_gate, "d_gate", p.in.plan.num_rows(), hidden, mod.dtype, p.in.y, "y");
  return check_modulation_grad(p.d_gate, "d_gate", p.in.gate, "gate", mod);
}

Status validate_gate_residual_backward(const GateResidualBackwardParams& p, Forms forms) {
  DETDIT_RETURN_IF_ERROR(check_gate_residual_backward_arguments(p, forms));
  return check_outputs_disjoint({{&p.grad, "grad"}, {&p.in.y, "y"}, {&p.in.gate, "gate"}},
                                {{&p.d_residual, "d_residual"}, {&p.d_y, "d_y"}, {&p.d_gate, "d_gate"}});
}

ResolvedModulation gate_modulation(const GateResidualInputs& in) {
  ResolvedModulation mod;
  mod.dtype = in.y.dtype;
  // Validated inputs: this is the validation's own resolution again, and succeeds.
  (void)resolve_modulation(in.y, "y", {{&in.gate, "gate"}}, in.plan, &mod);
  return mod;
}

}  // namespace rowwise


Status gate_residual_forward(const GateResidualParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(rowwise::validate_gate_residual_forward(params, rowwise::Forms::kAll));
  return backend::gate_residual_forward(params.in.residual.device, params, stream);
}

Status gate_residual_backward(const GateResidualBackwardParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(rowwise::validate_gate_residual_backward(params, rowwise::Forms::kAll));
  return rowwise::run_gate_residual_backward(params, stream);
}

}  // namespace detdit
