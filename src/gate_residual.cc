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
#include "rowwise/backward.h"
#include "rowwise/checks.h"

namespace detdit {
namespace rowwise {
Status check_gate_residual_forward_arguments(const GateResidualParams& p) {
  int64_t hidden = 0;
  DETDIT_RETURN_IF_ERROR(check::plan_on(p.in.plan, "plan", p.in.residual, "residual"));
  DETDIT_RETURN_IF_ERROR(check_rows(p.in.residual, "residual", &p.in.plan, &hidden));
  DETDIT_RETURN_IF_ERROR(check_like(p.in.y, "y", p.in.residual, "residual"));
  DETDIT_RETURN_IF_ERROR(
      check_table(p.in.gate, "gate", p.in.plan.num_rows(), hidden, p.in.residual, "residual", {p.in.residual.dtype}));
  return check_like(p.out, "out", p.in.residual, "residual");
}

Status validate_gate_residual_forward(const GateResidualParams& p) {
  DETDIT_RETURN_IF_ERROR(check_gate_residual_forward_arguments(p));
  return check_outputs_disjoint({{&p.in.residual, "residual"}, {&p.in.y, "y"}, {&p.in.gate, "gate"}}, {{&p.out, "out"}});
}

Status check_gate_residual_backward_arguments(const GateResidualBackwardParams& p) {
  int64_t hidden = 0;
  DETDIT_RETURN_IF_ERROR(check::plan_on(p.in.plan, "plan", p.grad, "grad"));
  DETDIT_RETURN_IF_ERROR(check_rows(p.grad, "grad", &p.in.plan, &hidden));
  DETDIT_RETURN_IF_ERROR(check_like(p.in.y, "y", p.grad, "grad"));
  DETDIT_RETURN_IF_ERROR(check_table(p.in.gate, "gate", p.in.plan.num_rows(), hidden, p.grad, "grad", {p.grad.dtype}));
  if (p.d_residual.present()) DETDIT_RETURN_IF_ERROR(check_like(p.d_residual, "d_residual", p.grad, "grad"));
  if (p.d_y.present()) DETDIT_RETURN_IF_ERROR(check_like(p.d_y, "d_y", p.grad, "grad"));
  if (p.d_gate.present())
    DETDIT_RETURN_IF_ERROR(
        check_table_grad(p.d_gate, "d_gate", p.in.plan.num_rows(), hidden, p.grad.dtype, p.grad, "grad"));
  return Status();
}

Status validate_gate_residual_backward(const GateResidualBackwardParams& p) {
  DETDIT_RETURN_IF_ERROR(check_gate_residual_backward_arguments(p));
  return check_outputs_disjoint({{&p.grad, "grad"}, {&p.in.y, "y"}, {&p.in.gate, "gate"}},
                                {{&p.d_residual, "d_residual"}, {&p.d_y, "d_y"}, {&p.d_gate, "d_gate"}});
}

}  // namespace rowwise

Status gate_residual_forward(const GateResidualParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(rowwise::validate_gate_residual_forward(params));
  return backend::gate_residual_forward(params.in.residual.device, params, stream);
}

Status gate_residual_backward(const GateResidualBackwardParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(rowwise::validate_gate_residual_backward(params));
  return rowwise::run_gate_residual_backward(params, stream);
}

}  // namespace detdit
