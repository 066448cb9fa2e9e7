// The composition gate_residual then a norm (src/rowwise/gate_residual_norm.h),
// shared by gate_residual_layernorm and gate_residual_rmsnorm.
#include "rowwise/gate_residual_norm.h"

#include <memory>
#include <string>

#include "common/backends.h"
#include "common/scratch.h"
#include "common/validate.h"
#include "rowwise/backward.h"
#include "rowwise/checks.h"

namespace detdit {
namespace rowwise {

Status check_region_h(const TensorView& h, const TensorView& rows, const char* rows_name,
                      const GateResidualInputs& gate) {
  DETDIT_RETURN_IF_ERROR(check::present(h, "h"));
  int64_t hidden = 0;
  DETDIT_RETURN_IF_ERROR(check_rows(rows, rows_name, &gate.plan, &hidden));
  // h's dtype follows the gate (an fp32 gate promotes it when each op
  // rounds), so the gate is resolved first: its own errors name it.
  ResolvedModulation mod;
  DETDIT_RETURN_IF_ERROR(resolve_modulation(rows, rows_name, {{&gate.gate, "gate"}}, gate.plan, &mod));
  const DType dtype = modulated_out_dtype(rows.dtype, mod, gate.upcast);
  // h in the rows' dtype where an fp32 gate promotes it: reported as the
  // gate's error, the way gate_residual reports its out (and the H3 rule's
  // callers, who pass h in the rows' dtype, read it).
  if (h.dtype == rows.dtype && dtype != rows.dtype)
    return check_modulated_out(h, "h", rows, rows_name, mod, gate.upcast, "gate");
  DETDIT_RETURN_IF_ERROR(check_like_as(h, "h", rows, rows_name, dtype, "gate_residual's output dtype"));
  return check_norm_aligned(h, "h");
}

Status check_one_form(const GateResidualInputs& gate, const ResolvedModulation& norm, const TensorView& shift) {
  if (!gate.gate.present() || !shift.present()) return Status();
  const ResolvedModulation g = gate_modulation(gate);
  if (g.form == norm.form && g.frames == norm.frames) return Status();
  return Status::value_error(std::string("gate, shift and scale must have one modulation form, got gate ") +
                             gate.gate.describe() + " (" + modulation_form_name(g.form) + ") and shift " +
                             shift.describe() + " (" + modulation_form_name(norm.form) + ")");
}

Status run_region_backward(GateResidualBackwardParams gate, const TensorView& h, const TensorView& d_h,
                           const NormBackward& norm_backward, Stream stream) {
  const Device device = h.device;
  // Scratch first, so a failed allocation writes nothing: g when the gate
  // half needs it and d_residual cannot hold it, and the d_gate partials.
  const bool gate_half = gate.d_residual.present() || gate.d_y.present() || gate.d_gate.present();
  TensorView g;
  std::shared_ptr<void> owner;
  if (gate.d_residual.present() && gate.d_residual.dtype == h.dtype) {
    // d_residual = R(g) = g: g lives there, and the gate half skips the copy.
    g = gate.d_residual;
    gate.d_residual = TensorView();
  } else if (gate_half) {
    g = h;
    DETDIT_RETURN_IF_ERROR(allocate_scratch(device, h.nbytes(), stream, &owner));
    g.data = owner.get();
  }
  gate.grad = g;
  GatePartials partials;
  if (gate_half) DETDIT_RETURN_IF_ERROR(allocate_gate_partials(gate, stream, &partials));
  DETDIT_RETURN_IF_ERROR(norm_backward(g));
  if (!gate_half) return Status();
  if (d_h.present()) DETDIT_RETURN_IF_ERROR(backend::add(device, g, d_h, g, stream));
  DETDIT_RETURN_IF_ERROR(gate_rows_and_partials(gate, partials, stream));
  return fold_gate_partials(gate, partials, stream);
}

}  // namespace rowwise
}  // namespace detdit
