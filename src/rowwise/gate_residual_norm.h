// The composition "gate_residual, then a norm of its output h" that
// gate_residual_layernorm and gate_residual_rmsnorm (outside the H3 rule) run,
// written once (docs/numerics.md 9.7, 6.10): the checks of h and of the one
// modulation form, and the backward's sequence. Each op keeps its own
// argument list (its norm half, its overlap check); what both do is here.
//
// Forward: gate_residual's backend into h, then the norm's backend on h (the
//   callers write those two calls). Backward, after validation:
//     g  = d_residual when d_residual has h's dtype (R(g) = g), else scratch,
//          when the gate half has an output (d_residual, d_y, d_gate);
//     the norm's backward of d_out with dx into g (the norm allocates its own
//          partials before it writes);
//     g  = R(rn(g + d_h)) in h's dtype when d_h is present (autograd's sum);
//     gate_residual's backward of g (rows, d_gate partials, fold).
//   Every scratch of the gate half (g, the d_gate partials) is allocated
//   before the norm writes, so a failed allocation writes nothing.
//
// Params must be the callers' validated ones; nothing else is checked here.
#pragma once

#include <functional>

#include "detdit/gate_residual.h"
#include "detdit/modulation.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {
namespace rowwise {

// h, checked under its own name before the halves read it as their out / x /
// grad stand-in: the rows (residual in the forward, y in the backward; named
// rows_name) and the gate resolved first, then h present, the rows' shape,
// contiguous, gate_residual's output dtype (modulated_out_dtype of the rows'
// dtype and the gate), aligned to 4 elements for the norm.
Status check_region_h(const TensorView& h, const TensorView& rows, const char* rows_name,
                      const GateResidualInputs& gate);

// Every present modulation tensor of one call in one form: the gate's (as
// gate_residual resolves it) and the norm's (`norm`, resolved by the norm from
// shift and scale). A call mixing forms is no model's and is refused.
Status check_one_form(const GateResidualInputs& gate, const ResolvedModulation& norm, const TensorView& shift);

// The backward's sequence above. `gate` is the gate half's params with the
// caller's d_residual, d_y and d_gate (grad is set here to g); `norm_backward`
// runs the norm's validated backward of d_out with dx = its argument (absent
// when the gate half has no output).
using NormBackward = std::function<Status(const TensorView& dx)>;
Status run_region_backward(GateResidualBackwardParams gate, const TensorView& h, const TensorView& d_h,
                           const NormBackward& norm_backward, Stream stream);

}  // namespace rowwise
}  // namespace detdit
