// Public gate_residual entry points: validate every argument
// (include/detdit/gate_residual.h, spec 3.8), then dispatch on the tensors'
// device. Nothing is written on error.
#include "detdit/gate_residual.h"

#include "common/backends.h"
#include "common/validate.h"
#include "rowwise_checks.h"

namespace detdit {
namespace {

Status validate_forward(const GateResidualParams& p) {
  int64_t hidden = 0;
  DETDIT_RETURN_IF_ERROR(check::plan_on(p.plan, "plan", p.residual, "residual"));
  DETDIT_RETURN_IF_ERROR(rowwise::check_rows(p.residual, "residual", &p.plan, &hidden));
  DETDIT_RETURN_IF_ERROR(rowwise::check_like(p.y, "y", p.residual, "residual"));
  DETDIT_RETURN_IF_ERROR(
      rowwise::check_table(p.gate, "gate", p.plan.num_rows(), hidden, p.residual, "residual", {p.residual.dtype}));
  DETDIT_RETURN_IF_ERROR(rowwise::check_like(p.out, "out", p.residual, "residual"));
  return rowwise::check_outputs_disjoint({{&p.residual, "residual"}, {&p.y, "y"}, {&p.gate, "gate"}},
                                         {{&p.out, "out"}});
}

Status validate_backward(const GateResidualBackwardParams& p) {
  int64_t hidden = 0;
  DETDIT_RETURN_IF_ERROR(check::plan_on(p.plan, "plan", p.grad, "grad"));
  DETDIT_RETURN_IF_ERROR(rowwise::check_rows(p.grad, "grad", &p.plan, &hidden));
  DETDIT_RETURN_IF_ERROR(rowwise::check_like(p.y, "y", p.grad, "grad"));
  DETDIT_RETURN_IF_ERROR(
      rowwise::check_table(p.gate, "gate", p.plan.num_rows(), hidden, p.grad, "grad", {p.grad.dtype}));
  if (p.d_residual.present()) DETDIT_RETURN_IF_ERROR(rowwise::check_like(p.d_residual, "d_residual", p.grad, "grad"));
  if (p.d_y.present()) DETDIT_RETURN_IF_ERROR(rowwise::check_like(p.d_y, "d_y", p.grad, "grad"));
  if (p.d_gate.present())
    DETDIT_RETURN_IF_ERROR(
        rowwise::check_table_grad(p.d_gate, "d_gate", p.plan.num_rows(), hidden, p.grad.dtype, p.grad, "grad"));
  return rowwise::check_outputs_disjoint({{&p.grad, "grad"}, {&p.y, "y"}, {&p.gate, "gate"}},
                                         {{&p.d_residual, "d_residual"}, {&p.d_y, "d_y"}, {&p.d_gate, "d_gate"}});
}

}  // namespace

Status gate_residual_forward(const GateResidualParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(validate_forward(params));
  return params.residual.device.is_cuda() ? cuda::gate_residual_forward(params, stream)
                                          : cpu::gate_residual_forward(params, stream);
}

Status gate_residual_backward(const GateResidualBackwardParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(validate_backward(params));
  return params.grad.device.is_cuda() ? cuda::gate_residual_backward(params, stream)
                                      : cpu::gate_residual_backward(params, stream);
}

}  // namespace detdit
