// Public rmsnorm entry points: validate every argument (include/detdit/rmsnorm.h,
// docs/ops.md), then dispatch on the tensors' device: the forward to the backend,
// the backward through the device-generic composition of the backend's halves
// (src/rowwise/backward.h). Nothing is written on error.
#include "detdit/rmsnorm.h"

#include <memory>
#include <string>
#include <utility>

#include "common/backends.h"
#include "common/scratch.h"
#include "common/validate.h"
#include "detdit/modulation.h"
#include "rowwise/backward.h"
#include "rowwise/checks.h"

namespace detdit {
namespace rowwise {
namespace {

// x and weight as PyTorch's vectorized RMSNorm path needs them (numerics.md 7).
Status check_norm_input(const TensorView& x, const char* x_name, const TensorView& weight, const IndexPlan& plan,
                        int64_t* hidden) {
  DETDIT_RETURN_IF_ERROR(check_rows(x, x_name, &plan, hidden));
  if (*hidden % 4 != 0)
    return Status::value_error("H=" + std::to_string(*hidden) +
                               " must be a multiple of 4 (PyTorch's vectorized RMSNorm path), got " + x_name + " " +
                               x.describe());
  DETDIT_RETURN_IF_ERROR(check_norm_aligned(x, x_name));
  DETDIT_RETURN_IF_ERROR(check::present(weight, "weight"));
  DETDIT_RETURN_IF_ERROR(check::same_dtype(weight, "weight", x, x_name));
  DETDIT_RETURN_IF_ERROR(check::same_device(weight, "weight", x, x_name));
  DETDIT_RETURN_IF_ERROR(check::shape(weight, "weight", {*hidden}, "(H,)"));
  DETDIT_RETURN_IF_ERROR(check::contiguous(weight, "weight"));
  return check_norm_aligned(weight, "weight");
}

// shift/scale: both or neither. Indexed only: with them a plan on x's device
// and (R, H) views of x's dtype (the fused ops' and the SP region's rule);
// every form: resolve_modulation (modulation.h). *resolved receives the form.
Status check_modulation(const RmsnormInputs& in, const char* x_name, int64_t hidden, Forms forms,
                        ResolvedModulation* resolved) {
  const TensorView &x = in.x, &shift = in.shift, &scale = in.scale;
  const IndexPlan& plan = in.plan;
  if (shift.present() != scale.present())
    return Status::value_error(std::string("modulation needs both shift and scale, got ") +
                               (shift.present() ? "shift without scale" : "scale without shift"));
  if (forms == Forms::kIndexedOnly && in.upcast)
    return Status::value_error("upcast must be false: this op takes the indexed form in x's dtype only, got true");
  if (!shift.present()) {
    if (plan.valid()) DETDIT_RETURN_IF_ERROR(check::plan_on(plan, "plan", x, x_name));
  } else if (forms == Forms::kIndexedOnly) {
    DETDIT_RETURN_IF_ERROR(check::plan_on(plan, "plan", x, x_name));
    DETDIT_RETURN_IF_ERROR(check_table(shift, "shift", plan.num_rows(), hidden, x, x_name, {x.dtype}));
    DETDIT_RETURN_IF_ERROR(check_table(scale, "scale", plan.num_rows(), hidden, x, x_name, {x.dtype}));
  }
  return resolve_modulation(x, x_name, {{&shift, "shift"}, {&scale, "scale"}}, plan, resolved);
}

Status check_rstd(const TensorView& rstd, const TensorView& x, const char* x_name, int64_t hidden) {
  DETDIT_RETURN_IF_ERROR(check::dtype(rstd, "rstd", {DType::kF32}));
  DETDIT_RETURN_IF_ERROR(check::same_device(rstd, "rstd", x, x_name));
  DETDIT_RETURN_IF_ERROR(check::shape(rstd, "rstd", {x.numel() / hidden}, "(M,)"));
  return check::contiguous(rstd, "rstd");
}

}  // namespace

Status check_rmsnorm_forward_arguments(const RmsnormParams& p, Forms forms, const char* x_name) {
  int64_t hidden = 0;
  ResolvedModulation mod;
  DETDIT_RETURN_IF_ERROR(check_norm_input(p.in.x, x_name, p.in.weight, p.in.plan, &hidden));
  DETDIT_RETURN_IF_ERROR(check_modulation(p.in, x_name, hidden, forms, &mod));
  DETDIT_RETURN_IF_ERROR(check_eps(p.in.eps));
  DETDIT_RETURN_IF_ERROR(check::numerics_on(p.in.numerics, p.in.x.device));
  DETDIT_RETURN_IF_ERROR(check_modulated_out(p.out, "out", p.in.x, x_name, mod, p.in.upcast, "shift"));
  DETDIT_RETURN_IF_ERROR(check_norm_aligned(p.out, "out"));
  if (p.rstd.present()) DETDIT_RETURN_IF_ERROR(check_rstd(p.rstd, p.in.x, x_name, hidden));
  return Status();
}

Status validate_rmsnorm_forward(const RmsnormParams& p, Forms forms) {
  DETDIT_RETURN_IF_ERROR(check_rmsnorm_forward_arguments(p, forms));
  return check_outputs_disjoint({{&p.in.x, "x"}, {&p.in.weight, "weight"}, {&p.in.shift, "shift"}, {&p.in.scale, "scale"}},
                                {{&p.out, "out"}, {&p.rstd, "rstd"}});
}

namespace {

// d_shift / d_scale of a modulated norm: (R, H) table gradients (indexed) or
// the modulation tensor's shape (grouped).
Status check_modulation_grad_of(const TensorView& grad, const char* name, const TensorView& m, const char* m_name,
                                const RmsnormInputs& in, const char* x_name, const ResolvedModulation& mod,
                                int64_t hidden) {
  if (mod.form == ModulationForm::kIndexed)
    return check_table_grad(grad, name, in.plan.num_rows(), hidden, mod.dtype, in.x, x_name);
  return check_modulation_grad(grad, name, m, m_name, mod);
}

}  // namespace

Status check_rmsnorm_backward_arguments(const RmsnormBackwardParams& p, Forms forms, const char* x_name) {
  int64_t hidden = 0;
  ResolvedModulation mod;
  const bool modulated = p.in.shift.present() || p.in.scale.present();
  DETDIT_RETURN_IF_ERROR(check_norm_input(p.in.x, x_name, p.in.weight, p.in.plan, &hidden));
  DETDIT_RETURN_IF_ERROR(check_modulation(p.in, x_name, hidden, forms, &mod));
  DETDIT_RETURN_IF_ERROR(check_eps(p.in.eps));
  DETDIT_RETURN_IF_ERROR(check::numerics_on(p.in.numerics, p.in.x.device));
  DETDIT_RETURN_IF_ERROR(check::present(p.rstd, "rstd"));
  DETDIT_RETURN_IF_ERROR(check_rstd(p.rstd, p.in.x, x_name, hidden));
  DETDIT_RETURN_IF_ERROR(check_modulated_out(p.grad, "grad", p.in.x, x_name, mod, p.in.upcast, "shift"));
  if (p.dx.present()) DETDIT_RETURN_IF_ERROR(check_like(p.dx, "dx", p.in.x, x_name));
  if (p.d_weight.present()) {
    DETDIT_RETURN_IF_ERROR(check::dtype(p.d_weight, "d_weight", {DType::kF32, p.in.x.dtype}));
    DETDIT_RETURN_IF_ERROR(check::same_device(p.d_weight, "d_weight", p.in.x, x_name));
    DETDIT_RETURN_IF_ERROR(check::shape(p.d_weight, "d_weight", {hidden}, "(H,)"));
    DETDIT_RETURN_IF_ERROR(check::contiguous(p.d_weight, "d_weight"));
  }
  if ((p.d_shift.present() || p.d_scale.present()) && !modulated)
    return Status::value_error("d_shift/d_scale need a modulated norm (shift and scale), got a plain norm");
  if (p.d_shift.present())
    DETDIT_RETURN_IF_ERROR(
        check_modulation_grad_of(p.d_shift, "d_shift", p.in.shift, "shift", p.in, x_name, mod, hidden));
  if (p.d_scale.present())
    DETDIT_RETURN_IF_ERROR(
        check_modulation_grad_of(p.d_scale, "d_scale", p.in.scale, "scale", p.in, x_name, mod, hidden));
  return Status();
}

Status validate_rmsnorm_backward(const RmsnormBackwardParams& p, Forms forms) {
  DETDIT_RETURN_IF_ERROR(check_rmsnorm_backward_arguments(p, forms));
  return check_outputs_disjoint({{&p.in.x, "x"}, {&p.in.weight, "weight"}, {&p.in.shift, "shift"}, {&p.in.scale, "scale"},
                                 {&p.rstd, "rstd"}, {&p.grad, "grad"}},
                                {{&p.dx, "dx"}, {&p.d_weight, "d_weight"}, {&p.d_shift, "d_shift"}, {&p.d_scale, "d_scale"}});
}

ResolvedModulation rmsnorm_modulation(const RmsnormInputs& in) {
  ResolvedModulation mod;
  mod.dtype = in.x.dtype;
  // Validated inputs: this is the validation's own resolution again, and succeeds.
  (void)resolve_modulation(in.x, "x", {{&in.shift, "shift"}, {&in.scale, "scale"}}, in.plan, &mod);
  return mod;
}

}  // namespace rowwise

Status rmsnorm_forward(const RmsnormParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(rowwise::validate_rmsnorm_forward(params, rowwise::Forms::kAll));
  return backend::rmsnorm_forward(params.in.x.device, params, stream);
}

Status rmsnorm_backward(const RmsnormBackwardParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(rowwise::validate_rmsnorm_backward(params, rowwise::Forms::kAll));
  return rowwise::run_rmsnorm_backward(params, stream);
}

}  // namespace detdit
