// Public rmsnorm entry points: validate every argument (include/detdit/rmsnorm.h,
// spec 3.7), then dispatch on the tensors' device. Nothing is written on error.
#include "detdit/rmsnorm.h"

#include <string>

#include "common/backends.h"
#include "common/validate.h"
#include "rowwise_checks.h"

namespace detdit {
namespace rowwise {
namespace {

// x and weight as PyTorch's vectorized RMSNorm path needs them (numerics.md 7).
Status check_norm_input(const TensorView& x, const TensorView& weight, const IndexPlan& plan, int64_t* hidden) {
  DETDIT_RETURN_IF_ERROR(check_rows(x, "x", &plan, hidden));
  if (*hidden % 4 != 0)
    return Status::value_error("H=" + std::to_string(*hidden) +
                               " must be a multiple of 4 (PyTorch's vectorized RMSNorm path), got x " + x.describe());
  const std::size_t vector_bytes = 4 * dtype_size(x.dtype);
  DETDIT_RETURN_IF_ERROR(check::aligned(x, "x", vector_bytes, "PyTorch's vectorized RMSNorm path"));
  DETDIT_RETURN_IF_ERROR(check::present(weight, "weight"));
  DETDIT_RETURN_IF_ERROR(check::same_dtype(weight, "weight", x, "x"));
  DETDIT_RETURN_IF_ERROR(check::same_device(weight, "weight", x, "x"));
  DETDIT_RETURN_IF_ERROR(check::shape(weight, "weight", {*hidden}, "(H,)"));
  DETDIT_RETURN_IF_ERROR(check::contiguous(weight, "weight"));
  return check::aligned(weight, "weight", vector_bytes, "PyTorch's vectorized RMSNorm path");
}

// shift/scale: both or neither; with them a plan on x's device and (R, H) views.
Status check_modulation(const TensorView& x, const TensorView& shift, const TensorView& scale, const IndexPlan& plan,
                        int64_t hidden) {
  if (shift.present() != scale.present())
    return Status::value_error(std::string("modulation needs both shift and scale, got ") +
                               (shift.present() ? "shift without scale" : "scale without shift"));
  if (!shift.present()) {
    if (plan.valid()) DETDIT_RETURN_IF_ERROR(check::plan_on(plan, "plan", x, "x"));
    return Status();
  }
  DETDIT_RETURN_IF_ERROR(check::plan_on(plan, "plan", x, "x"));
  DETDIT_RETURN_IF_ERROR(check_table(shift, "shift", plan.num_rows(), hidden, x, "x", {x.dtype}));
  return check_table(scale, "scale", plan.num_rows(), hidden, x, "x", {x.dtype});
}

Status check_rstd(const TensorView& rstd, const TensorView& x, int64_t hidden) {
  DETDIT_RETURN_IF_ERROR(check::dtype(rstd, "rstd", {DType::kF32}));
  DETDIT_RETURN_IF_ERROR(check::same_device(rstd, "rstd", x, "x"));
  DETDIT_RETURN_IF_ERROR(check::shape(rstd, "rstd", {x.numel() / hidden}, "(M,)"));
  return check::contiguous(rstd, "rstd");
}

}  // namespace

Status validate_rmsnorm_forward(const RmsnormParams& p) {
  int64_t hidden = 0;
  DETDIT_RETURN_IF_ERROR(check_norm_input(p.x, p.weight, p.plan, &hidden));
  DETDIT_RETURN_IF_ERROR(check_modulation(p.x, p.shift, p.scale, p.plan, hidden));
  DETDIT_RETURN_IF_ERROR(check_eps(p.eps));
  DETDIT_RETURN_IF_ERROR(check::numerics_on(p.numerics, p.x.device));
  DETDIT_RETURN_IF_ERROR(check_like(p.out, "out", p.x, "x"));
  DETDIT_RETURN_IF_ERROR(check::aligned(p.out, "out", 4 * dtype_size(p.x.dtype), "PyTorch's vectorized RMSNorm path"));
  if (p.rstd.present()) DETDIT_RETURN_IF_ERROR(check_rstd(p.rstd, p.x, hidden));
  return check_outputs_disjoint({{&p.x, "x"}, {&p.weight, "weight"}, {&p.shift, "shift"}, {&p.scale, "scale"}},
                                {{&p.out, "out"}, {&p.rstd, "rstd"}});
}

Status validate_rmsnorm_backward(const RmsnormBackwardParams& p) {
  int64_t hidden = 0;
  const bool modulated = p.shift.present() || p.scale.present();
  DETDIT_RETURN_IF_ERROR(check_norm_input(p.x, p.weight, p.plan, &hidden));
  DETDIT_RETURN_IF_ERROR(check_modulation(p.x, p.shift, p.scale, p.plan, hidden));
  DETDIT_RETURN_IF_ERROR(check_eps(p.eps));
  DETDIT_RETURN_IF_ERROR(check::numerics_on(p.numerics, p.x.device));
  DETDIT_RETURN_IF_ERROR(check::present(p.rstd, "rstd"));
  DETDIT_RETURN_IF_ERROR(check_rstd(p.rstd, p.x, hidden));
  DETDIT_RETURN_IF_ERROR(check_like(p.grad, "grad", p.x, "x"));
  if (p.dx.present()) DETDIT_RETURN_IF_ERROR(check_like(p.dx, "dx", p.x, "x"));
  if (p.d_weight.present()) {
    DETDIT_RETURN_IF_ERROR(check::dtype(p.d_weight, "d_weight", {DType::kF32, p.x.dtype}));
    DETDIT_RETURN_IF_ERROR(check::same_device(p.d_weight, "d_weight", p.x, "x"));
    DETDIT_RETURN_IF_ERROR(check::shape(p.d_weight, "d_weight", {hidden}, "(H,)"));
    DETDIT_RETURN_IF_ERROR(check::contiguous(p.d_weight, "d_weight"));
  }
  if ((p.d_shift.present() || p.d_scale.present()) && !modulated)
    return Status::value_error("d_shift/d_scale need a modulated norm (shift and scale), got a plain norm");
  if (p.d_shift.present())
    DETDIT_RETURN_IF_ERROR(check_table_grad(p.d_shift, "d_shift", p.plan.num_rows(), hidden, p.x.dtype, p.x, "x"));
  if (p.d_scale.present())
    DETDIT_RETURN_IF_ERROR(check_table_grad(p.d_scale, "d_scale", p.plan.num_rows(), hidden, p.x.dtype, p.x, "x"));
  return check_outputs_disjoint({{&p.x, "x"}, {&p.weight, "weight"}, {&p.shift, "shift"}, {&p.scale, "scale"},
                                 {&p.rstd, "rstd"}, {&p.grad, "grad"}},
                                {{&p.dx, "dx"}, {&p.d_weight, "d_weight"}, {&p.d_shift, "d_shift"}, {&p.d_scale, "d_scale"}});
}

}  // namespace rowwise

Status rmsnorm_forward(const RmsnormParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(rowwise::validate_rmsnorm_forward(params));
  return params.x.device.is_cuda() ? cuda::rmsnorm_forward(params, stream) : cpu::rmsnorm_forward(params, stream);
}

Status rmsnorm_backward(const RmsnormBackwardParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(rowwise::validate_rmsnorm_backward(params));
  return params.x.device.is_cuda() ? cuda::rmsnorm_backward(params, stream) : cpu::rmsnorm_backward(params, stream);
}

}  // namespace detdit
