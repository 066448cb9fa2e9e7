// The rmsnorm and gate_residual_rmsnorm single-pass backwards' entry points
// (the CUDA-only ops rmsnorm_backward_single_pass and
// gate_residual_rmsnorm_backward_single_pass): not built. They lived in
// src/cuda/rmsnorm.cu, whose helpers (kVec, hidden_of, is_modulated) they use,
// and were called first by src/rmsnorm.cc's rmsnorm_rows_and_partials and by
// gate_residual_rmsnorm_backward in src/gate_residual_rmsnorm.cc, behind the
// launch tunable single_pass (off by default); *launched = false sent the
// caller to the halves. The kernel: rmsnorm_single_pass.cu beside this file.
// dev/README.md gives the measured result.
#include "common/backends.h"
#include "cuda/cuda_util.cuh"
#include "cuda/rmsnorm_single_pass.cuh"

namespace detdit {
namespace cuda {

namespace {

// The arguments both single-pass backwards share: the norm of x (h) with the
// gradient `grad` (d_out) and the plan's tables.
SinglePassArgs single_pass_args(const RmsnormInputs& in, const TensorView& rstd, const TensorView& grad,
                                const TensorView& weight_partials, const TensorView& table_partials) {
  SinglePassArgs a{};
  a.x = in.x.data;
  a.grad = grad.data;
  a.rstd = rstd.ptr<const float>();
  a.weight = in.weight.data;
  if (is_modulated(in.shift)) {
    a.scale = in.scale.data;
    a.scale_stride = in.scale.strides[0];
  }
  if (in.plan.valid()) {
    a.tables = in.plan.device_tables();
    a.seq_len = in.plan.seq_len();
  }
  a.hidden = hidden_of(in.x);
  a.positions = in.plan.valid() ? in.plan.positions() : in.x.numel() / a.hidden;
  a.slices = static_cast<int>((a.hidden / kVec + kRowTreeThreads - 1) / kRowTreeThreads);
  a.weight_partials = weight_partials.present() ? weight_partials.ptr<float>() : nullptr;
  a.table_partials = table_partials.present() && is_modulated(in.shift) ? table_partials.ptr<float>() : nullptr;
  return a;
}

}  // namespace

Status rmsnorm_backward_single_pass(const RmsnormBackwardParams& p, const TensorView& weight_partials,
                                    const TensorView& table_partials, Stream stream, bool* launched) {
  *launched = false;
  if (!launch_tuning().single_pass) return Status();
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.in.x.device));
  SinglePassArgs a = single_pass_args(p.in, p.rstd, p.grad, weight_partials, table_partials);
  a.dx = p.dx.present() ? p.dx.data : nullptr;
  return launch_rmsnorm_backward_single_pass(a, p.in.x.dtype, false, p.in.plan.valid() ? p.in.plan.max_chunk_segments() : 1,
                                             stream, launched);
}

Status gate_residual_rmsnorm_backward_single_pass(const GateResidualRmsnormBackwardParams& p,
                                                  const TensorView& weight_partials, const TensorView& table_partials,
                                                  const TensorView& gate_partials, Stream stream, bool* launched) {
  *launched = false;
  if (!launch_tuning().single_pass) return Status();
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.h.device));
  const GateResidualRmsnormInputs& in = p.in;
  const RmsnormInputs norm{p.h, in.weight, in.shift, in.scale, in.plan, in.eps, in.numerics};
  SinglePassArgs a = single_pass_args(norm, p.rstd, p.d_out, weight_partials, table_partials);
  a.y = in.y.data;
  a.d_h = p.d_h.present() ? p.d_h.data : nullptr;
  a.gate = in.gate.data;
  a.gate_stride = in.gate.strides[0];
  a.d_residual = p.d_residual.present() ? p.d_residual.data : nullptr;
  a.d_y = p.d_y.present() ? p.d_y.data : nullptr;
  a.gate_partials = gate_partials.present() ? gate_partials.ptr<float>() : nullptr;
  return launch_rmsnorm_backward_single_pass(a, p.h.dtype, true, in.plan.max_chunk_segments(), stream, launched);
}

}  // namespace cuda
}  // namespace detdit
