// Public layernorm entry points: validate every argument
// (include/detdit/layernorm.h, docs/ops.md), then dispatch on the tensors'
// device. The modulation (shift, scale, plan, upcast) is resolved once, by
// resolve_modulation, before anything is written. The backward is the
// backend's halves composed here: the partials' scratch first (a failed
// allocation writes nothing), the row-local dx, the d_weight / d_bias chunk
// partials and the [d_shift | d_scale] partials (per segment or per group
// chunk), then the ascending folds (docs/numerics.md 6.5, 6.11, 9.4, 9.6).
// Nothing is written on error.
#include "detdit/layernorm.h"

#include <memory>
#include <string>

#include "common/backends.h"
#include "common/scratch.h"
#include "common/validate.h"
#include "detdit/modulation.h"
#include "detdit/plan.h"
#include "rowwise/backward.h"
#include "rowwise/checks.h"

namespace detdit {
namespace {

// PyTorch's float count of the row (its Welford counts are FP32, exact up to 2^24).
constexpr int64_t kMaxHidden = int64_t{1} << 24;

Status check_aligned(const TensorView& t, const char* name) {
  return check::aligned(t, name, 4 * dtype_size(t.dtype), "PyTorch's vectorized LayerNorm path");
}

// An affine parameter: (H,) contiguous, x's dtype and device, aligned.
Status check_parameter(const TensorView& t, const char* name, const TensorView& x, const char* x_name,
                       int64_t hidden) {
  DETDIT_RETURN_IF_ERROR(check::same_dtype(t, name, x, x_name));
  DETDIT_RETURN_IF_ERROR(check::same_device(t, name, x, x_name));
  DETDIT_RETURN_IF_ERROR(check::shape(t, name, {hidden}, "(H,)"));
  DETDIT_RETURN_IF_ERROR(check::contiguous(t, name));
  return check_aligned(t, name);
}

// shift/scale: both or neither; their form and dtype by resolve_modulation
// (detdit/modulation.h), which *mod receives. A plan without modulation must
// describe x's rows (it changes no bit).
Status check_modulation(const LayernormInputs& in, const char* x_name, ResolvedModulation* mod) {
  if (in.shift.present() != in.scale.present())
    return Status::value_error(std::string("modulation needs both shift and scale, got ") +
                               (in.shift.present() ? "shift without scale" : "scale without shift"));
  if (!in.shift.present() && in.plan.valid()) DETDIT_RETURN_IF_ERROR(check::plan_on(in.plan, "plan", in.x, x_name));
  return resolve_modulation(in.x, x_name, {{&in.shift, "shift"}, {&in.scale, "scale"}}, in.plan, mod);
}

Status check_inputs(const LayernormInputs& in, const char* x_name, int64_t* hidden, ResolvedModulation* mod) {
  DETDIT_RETURN_IF_ERROR(rowwise::check_rows(in.x, x_name, &in.plan, hidden));
  if (*hidden % 4 != 0 || *hidden > kMaxHidden)
    return Status::value_error("H=" + std::to_string(*hidden) +
                               " must be a multiple of 4 and at most 2^24 (PyTorch's vectorized LayerNorm path), "
                               "got " + x_name + " " + in.x.describe());
  DETDIT_RETURN_IF_ERROR(check_aligned(in.x, x_name));
  if (in.weight.present()) DETDIT_RETURN_IF_ERROR(check_parameter(in.weight, "weight", in.x, x_name, *hidden));
  if (in.bias.present()) {
    if (!in.weight.present())
      return Status::value_error("bias needs weight (LayerNorm with weight, or with weight and bias), got bias " +
                                 in.bias.describe() + " without weight");
    DETDIT_RETURN_IF_ERROR(check_parameter(in.bias, "bias", in.x, x_name, *hidden));
  }
  DETDIT_RETURN_IF_ERROR(check_modulation(in, x_name, mod));
  DETDIT_RETURN_IF_ERROR(rowwise::check_eps(in.eps));
  return check::numerics_on(in.numerics, in.x.device);
}

// mean / rstd: (M,) fp32 contiguous on x's device.
Status check_stat(const TensorView& t, const char* name, const TensorView& x, const char* x_name, int64_t hidden) {
  DETDIT_RETURN_IF_ERROR(check::dtype(t, name, {DType::kF32}));
  DETDIT_RETURN_IF_ERROR(check::same_device(t, name, x, x_name));
  DETDIT_RETURN_IF_ERROR(check::shape(t, name, {x.numel() / hidden}, "(M,)"));
  return check::contiguous(t, name);
}

// d_weight / d_bias: (H,) fp32 or x's dtype, contiguous, on x's device.
Status check_parameter_grad(const TensorView& t, const char* name, const TensorView& x, const char* x_name,
                            int64_t hidden) {
  DETDIT_RETURN_IF_ERROR(check::dtype(t, name, {DType::kF32, x.dtype}));
  DETDIT_RETURN_IF_ERROR(check::same_device(t, name, x, x_name));
  DETDIT_RETURN_IF_ERROR(check::shape(t, name, {hidden}, "(H,)"));
  return check::contiguous(t, name);
}

// out (forward) or grad (backward): like x for the plain norm; the modulated
// norm's output dtype (modulation.h modulated_out_dtype) otherwise.
Status check_out(const TensorView& t, const char* name, const LayernormInputs& in, const char* x_name,
                 const ResolvedModulation& mod) {
  if (mod.form == ModulationForm::kNone) return rowwise::check_like(t, name, in.x, x_name);
  return rowwise::check_modulated_out(t, name, in.x, x_name, mod, in.upcast, "shift");
}

// d_shift / d_scale: (R, H) table gradients (indexed) or the modulation
// tensor's shape (grouped).
Status check_modulation_grad_of(const TensorView& grad, const char* name, const TensorView& m, const char* m_name,
                                const LayernormInputs& in, const char* x_name, const ResolvedModulation& mod,
                                int64_t hidden) {
  if (mod.form == ModulationForm::kNone)
    return Status::value_error(std::string(name) + " needs a modulated norm (shift and scale), got a plain norm");
  if (mod.form == ModulationForm::kIndexed)
    return rowwise::check_table_grad(grad, name, in.plan.num_rows(), hidden, mod.dtype, in.x, x_name);
  return check_modulation_grad(grad, name, m, m_name, mod);
}

}  // namespace

namespace rowwise {

Status check_layernorm_forward_arguments(const LayernormParams& p, const char* x_name) {
  int64_t hidden = 0;
  ResolvedModulation mod;
  DETDIT_RETURN_IF_ERROR(check_inputs(p.in, x_name, &hidden, &mod));
  DETDIT_RETURN_IF_ERROR(check_out(p.out, "out", p.in, x_name, mod));
  DETDIT_RETURN_IF_ERROR(check_aligned(p.out, "out"));
  if (p.mean.present()) DETDIT_RETURN_IF_ERROR(check_stat(p.mean, "mean", p.in.x, x_name, hidden));
  if (p.rstd.present()) DETDIT_RETURN_IF_ERROR(check_stat(p.rstd, "rstd", p.in.x, x_name, hidden));
  return Status();
}

Status validate_layernorm_forward(const LayernormParams& p) {
  DETDIT_RETURN_IF_ERROR(check_layernorm_forward_arguments(p));
  return rowwise::check_outputs_disjoint(
      {{&p.in.x, "x"}, {&p.in.weight, "weight"}, {&p.in.bias, "bias"}, {&p.in.shift, "shift"}, {&p.in.scale, "scale"}},
      {{&p.out, "out"}, {&p.mean, "mean"}, {&p.rstd, "rstd"}});
}

Status check_layernorm_backward_arguments(const LayernormBackwardParams& p, const char* x_name) {
  int64_t hidden = 0;
  ResolvedModulation mod;
  DETDIT_RETURN_IF_ERROR(check_inputs(p.in, x_name, &hidden, &mod));
  DETDIT_RETURN_IF_ERROR(check::present(p.mean, "mean"));
  DETDIT_RETURN_IF_ERROR(check_stat(p.mean, "mean", p.in.x, x_name, hidden));
  DETDIT_RETURN_IF_ERROR(check::present(p.rstd, "rstd"));
  DETDIT_RETURN_IF_ERROR(check_stat(p.rstd, "rstd", p.in.x, x_name, hidden));
  DETDIT_RETURN_IF_ERROR(check_out(p.grad, "grad", p.in, x_name, mod));
  if (p.dx.present()) DETDIT_RETURN_IF_ERROR(rowwise::check_like(p.dx, "dx", p.in.x, x_name));
  if (p.d_weight.present()) {
    if (!p.in.weight.present()) return Status::value_error("d_weight needs weight, got a norm without weight");
    DETDIT_RETURN_IF_ERROR(check_parameter_grad(p.d_weight, "d_weight", p.in.x, x_name, hidden));
  }
  if (p.d_bias.present()) {
    if (!p.in.bias.present()) return Status::value_error("d_bias needs bias, got a norm without bias");
    DETDIT_RETURN_IF_ERROR(check_parameter_grad(p.d_bias, "d_bias", p.in.x, x_name, hidden));
  }
  if (p.d_shift.present())
    DETDIT_RETURN_IF_ERROR(
        check_modulation_grad_of(p.d_shift, "d_shift", p.in.shift, "shift", p.in, x_name, mod, hidden));
  if (p.d_scale.present())
    DETDIT_RETURN_IF_ERROR(
        check_modulation_grad_of(p.d_scale, "d_scale", p.in.scale, "scale", p.in, x_name, mod, hidden));
  return Status();
}

Status validate_layernorm_backward(const LayernormBackwardParams& p) {
  DETDIT_RETURN_IF_ERROR(check_layernorm_backward_arguments(p));
  return rowwise::check_outputs_disjoint(
      {{&p.in.x, "x"}, {&p.in.weight, "weight"}, {&p.in.bias, "bias"}, {&p.in.shift, "shift"},
       {&p.in.scale, "scale"}, {&p.mean, "mean"}, {&p.rstd, "rstd"}, {&p.grad, "grad"}},
      {{&p.dx, "dx"}, {&p.d_weight, "d_weight"}, {&p.d_bias, "d_bias"}, {&p.d_shift, "d_shift"},
       {&p.d_scale, "d_scale"}});
}

Status run_layernorm_backward(const LayernormBackwardParams& p, Stream stream) {
  const Device device = p.in.x.device;
  const int64_t hidden = p.in.x.shape[p.in.x.rank - 1];
  const int64_t chunks = (p.in.x.numel() / hidden + kReductionChunk - 1) / kReductionChunk;
  const ResolvedModulation mod = rowwise::layernorm_modulation(p.in);
  const bool tables = p.d_shift.present() || p.d_scale.present();
  const int64_t table_rows = tables ? rowwise::table_partial_rows(p.in.plan, mod) : 0;
  const int64_t weight_floats = p.d_weight.present() ? chunks * hidden : 0;
  const int64_t bias_floats = p.d_bias.present() ? chunks * hidden : 0;
  const int64_t table_floats = table_rows * 2 * hidden;
  std::shared_ptr<void> owner;
  LayernormPartials partials;
  if (weight_floats + bias_floats + table_floats > 0) {
    TensorView scratch;
    DETDIT_RETURN_IF_ERROR(scratch_tensor(device, DType::kF32, {weight_floats + bias_floats + table_floats}, stream,
                                          &owner, &scratch));
    float* base = scratch.ptr<float>();
    if (p.d_weight.present()) partials.weight = TensorView::contiguous(base, DType::kF32, {chunks, hidden}, device);
    if (p.d_bias.present())
      partials.bias = TensorView::contiguous(base + weight_floats, DType::kF32, {chunks, hidden}, device);
    if (tables)
      partials.table = TensorView::contiguous(base + weight_floats + bias_floats, DType::kF32,
                                              {table_rows, 2 * hidden}, device);
  }
  DETDIT_RETURN_IF_ERROR(backend::layernorm_backward_rows(device, p, stream));
  if (weight_floats + bias_floats + table_floats == 0) return Status();
  DETDIT_RETURN_IF_ERROR(backend::layernorm_backward_partials(device, p, partials, stream));
  if (p.d_weight.present())
    DETDIT_RETURN_IF_ERROR(backend::fold_chunk_partials(device, partials.weight, p.d_weight, stream));
  if (p.d_bias.present())
    DETDIT_RETURN_IF_ERROR(backend::fold_chunk_partials(device, partials.bias, p.d_bias, stream));
  if (!tables) return Status();
  return rowwise::fold_modulation_partials(p.in.plan, mod, partials.table, p.d_shift, p.d_scale, stream);
}

ResolvedModulation layernorm_modulation(const LayernormInputs& in) {
  ResolvedModulation mod;
  mod.dtype = in.x.dtype;
  // Validated inputs: this is the validation's own resolution again, and succeeds.
  (void)resolve_modulation(in.x, "x", {{&in.shift, "shift"}, {&in.scale, "scale"}}, in.plan, &mod);
  return mod;
}

}  // namespace rowwise

Status layernorm_forward(const LayernormParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(rowwise::validate_layernorm_forward(params));
  return backend::layernorm_forward(params.in.x.device, params, stream);
}

Status layernorm_backward(const LayernormBackwardParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(rowwise::validate_layernorm_backward(params));
  return rowwise::run_layernorm_backward(params, stream);
}

}  // namespace detdit
