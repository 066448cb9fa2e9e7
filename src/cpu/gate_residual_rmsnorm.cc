// gate_residual_rmsnorm, CPU reference (docs/numerics.md 6.10): the
// composition of the two ops' CPU kernels (src/cpu/gate_residual.cc,
// src/cpu/rmsnorm.cc), which the fused CUDA kernels equal bit for bit.
// The forward is gate_residual into h, then rmsnorm of h; the backward's
// rows half is rmsnorm's rows half with dx into g, g = R_T(rn(g + d_h)), then
// gate_residual's rows half of g (d_y). Its partials are the two ops'
// (src/gate_residual_rmsnorm.cc composes them).
#include "common/backends.h"

namespace detdit {
namespace cpu {

Status gate_residual_rmsnorm_forward(const GateResidualRmsnormParams& p, Stream stream) {
  DETDIT_RETURN_IF_ERROR(gate_residual_forward({{p.in.residual, p.in.y, p.in.gate, p.in.plan}, p.h}, stream));
  return rmsnorm_forward(
      {{p.h, p.in.weight, p.in.shift, p.in.scale, p.in.plan, p.in.eps, p.in.numerics}, p.out, p.rstd}, stream);
}

// The reference composes the halves (numerics 6.10): dx into g, g = R_T(rn(g + d_h)), d_y = R_T(rn(g * gate)).
Status gate_residual_rmsnorm_backward_rows(const GateResidualRmsnormBackwardParams& p, const TensorView& g,
                                           Stream stream) {
  const GateResidualRmsnormInputs& in = p.in;
  DETDIT_RETURN_IF_ERROR(rmsnorm_backward_rows(
      {{p.h, in.weight, in.shift, in.scale, in.plan, in.eps, in.numerics}, p.rstd, p.d_out, g, {}, {}, {}}, stream));
  if (p.d_h.present()) DETDIT_RETURN_IF_ERROR(add(g, p.d_h, g, stream));
  if (!p.d_y.present()) return Status();
  return gate_residual_backward_rows({{in.residual, in.y, in.gate, in.plan}, g, {}, p.d_y, {}}, stream);
}

}  // namespace cpu
}  // namespace detdit
