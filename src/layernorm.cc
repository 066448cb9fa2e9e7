// Public layernorm entry points: validate every argument
// (include/detdit/layernorm.h, docs/ops.md), then dispatch on the tensors'
// device. The backward is the backend's halves composed here: the partials'
// scratch first (a failed allocation writes nothing), the row-local dx, the
// d_weight / d_bias chunk partials of every chunk, then the ascending folds
// (docs/numerics.md 6.5, 9.4). Nothing is written on error.
#include "detdit/layernorm.h"

#include <string>

#include "common/backends.h"
#include "common/scratch.h"
#include "common/validate.h"
#include "detdit/plan.h"
#include "rowwise/checks.h"

namespace detdit {
namespace {

// PyTorch's float count of the row (its Welford counts are FP32, exact up to 2^24).
constexpr int64_t kMaxHidden = int64_t{1} << 24;

Status check_aligned(const TensorView& t, const char* name) {
  return check::aligned(t, name, 4 * dtype_size(t.dtype), "PyTorch's vectorized LayerNorm path");
}

// An affine parameter: (H,) contiguous, x's dtype and device, aligned.
Status check_parameter(const TensorView& t, const char* name, const TensorView& x, int64_t hidden) {
  DETDIT_RETURN_IF_ERROR(check::same_dtype(t, name, x, "x"));
  DETDIT_RETURN_IF_ERROR(check::same_device(t, name, x, "x"));
  DETDIT_RETURN_IF_ERROR(check::shape(t, name, {hidden}, "(H,)"));
  DETDIT_RETURN_IF_ERROR(check::contiguous(t, name));
  return check_aligned(t, name);
}

Status check_inputs(const LayernormInputs& in, int64_t* hidden) {
  DETDIT_RETURN_IF_ERROR(rowwise::check_rows(in.x, "x", nullptr, hidden));
  if (*hidden % 4 != 0 || *hidden > kMaxHidden)
    return Status::value_error("H=" + std::to_string(*hidden) +
                               " must be a multiple of 4 and at most 2^24 (PyTorch's vectorized LayerNorm path), "
                               "got x " + in.x.describe());
  DETDIT_RETURN_IF_ERROR(check_aligned(in.x, "x"));
  if (in.weight.present()) DETDIT_RETURN_IF_ERROR(check_parameter(in.weight, "weight", in.x, *hidden));
  if (in.bias.present()) {
    if (!in.weight.present())
      return Status::value_error("bias needs weight (LayerNorm with weight, or with weight and bias), got bias " +
                                 in.bias.describe() + " without weight");
    DETDIT_RETURN_IF_ERROR(check_parameter(in.bias, "bias", in.x, *hidden));
  }
  DETDIT_RETURN_IF_ERROR(rowwise::check_eps(in.eps));
  return check::numerics_on(in.numerics, in.x.device);
}

// mean / rstd: (M,) fp32 contiguous on x's device.
Status check_stat(const TensorView& t, const char* name, const TensorView& x, int64_t hidden) {
  DETDIT_RETURN_IF_ERROR(check::dtype(t, name, {DType::kF32}));
  DETDIT_RETURN_IF_ERROR(check::same_device(t, name, x, "x"));
  DETDIT_RETURN_IF_ERROR(check::shape(t, name, {x.numel() / hidden}, "(M,)"));
  return check::contiguous(t, name);
}

// d_weight / d_bias: (H,) fp32 or x's dtype, contiguous, on x's device.
Status check_parameter_grad(const TensorView& t, const char* name, const TensorView& x, int64_t hidden) {
  DETDIT_RETURN_IF_ERROR(check::dtype(t, name, {DType::kF32, x.dtype}));
  DETDIT_RETURN_IF_ERROR(check::same_device(t, name, x, "x"));
  DETDIT_RETURN_IF_ERROR(check::shape(t, name, {hidden}, "(H,)"));
  return check::contiguous(t, name);
}

Status validate_forward(const LayernormParams& p) {
  int64_t hidden = 0;
  DETDIT_RETURN_IF_ERROR(check_inputs(p.in, &hidden));
  DETDIT_RETURN_IF_ERROR(rowwise::check_like(p.out, "out", p.in.x, "x"));
  DETDIT_RETURN_IF_ERROR(check_aligned(p.out, "out"));
  if (p.mean.present()) DETDIT_RETURN_IF_ERROR(check_stat(p.mean, "mean", p.in.x, hidden));
  if (p.rstd.present()) DETDIT_RETURN_IF_ERROR(check_stat(p.rstd, "rstd", p.in.x, hidden));
  return rowwise::check_outputs_disjoint({{&p.in.x, "x"}, {&p.in.weight, "weight"}, {&p.in.bias, "bias"}},
                                         {{&p.out, "out"}, {&p.mean, "mean"}, {&p.rstd, "rstd"}});
}

Status validate_backward(const LayernormBackwardParams& p) {
  int64_t hidden = 0;
  DETDIT_RETURN_IF_ERROR(check_inputs(p.in, &hidden));
  DETDIT_RETURN_IF_ERROR(check::present(p.mean, "mean"));
  DETDIT_RETURN_IF_ERROR(check_stat(p.mean, "mean", p.in.x, hidden));
  DETDIT_RETURN_IF_ERROR(check::present(p.rstd, "rstd"));
  DETDIT_RETURN_IF_ERROR(check_stat(p.rstd, "rstd", p.in.x, hidden));
  DETDIT_RETURN_IF_ERROR(rowwise::check_like(p.grad, "grad", p.in.x, "x"));
  if (p.dx.present()) DETDIT_RETURN_IF_ERROR(rowwise::check_like(p.dx, "dx", p.in.x, "x"));
  if (p.d_weight.present()) {
    if (!p.in.weight.present()) return Status::value_error("d_weight needs weight, got a norm without weight");
    DETDIT_RETURN_IF_ERROR(check_parameter_grad(p.d_weight, "d_weight", p.in.x, hidden));
  }
  if (p.d_bias.present()) {
    if (!p.in.bias.present()) return Status::value_error("d_bias needs bias, got a norm without bias");
    DETDIT_RETURN_IF_ERROR(check_parameter_grad(p.d_bias, "d_bias", p.in.x, hidden));
  }
  return rowwise::check_outputs_disjoint({{&p.in.x, "x"}, {&p.in.weight, "weight"}, {&p.in.bias, "bias"},
                                          {&p.mean, "mean"}, {&p.rstd, "rstd"}, {&p.grad, "grad"}},
                                         {{&p.dx, "dx"}, {&p.d_weight, "d_weight"}, {&p.d_bias, "d_bias"}});
}

}  // namespace

Status layernorm_forward(const LayernormParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(validate_forward(params));
  return backend::layernorm_forward(params.in.x.device, params, stream);
}

Status layernorm_backward(const LayernormBackwardParams& p, Stream stream) {
  DETDIT_RETURN_IF_ERROR(validate_backward(p));
  const Device device = p.in.x.device;
  const int64_t hidden = p.in.x.shape[p.in.x.rank - 1];
  const int64_t chunks = (p.in.x.numel() / hidden + kReductionChunk - 1) / kReductionChunk;
  const int64_t weight_floats = p.d_weight.present() ? chunks * hidden : 0;
  const int64_t bias_floats = p.d_bias.present() ? chunks * hidden : 0;
  std::shared_ptr<void> owner;
  TensorView weight_partials, bias_partials;
  if (weight_floats + bias_floats > 0) {
    TensorView scratch;
    DETDIT_RETURN_IF_ERROR(scratch_tensor(device, DType::kF32, {weight_floats + bias_floats}, stream, &owner, &scratch));
    if (p.d_weight.present())
      weight_partials = TensorView::contiguous(scratch.ptr<float>(), DType::kF32, {chunks, hidden}, device);
    if (p.d_bias.present())
      bias_partials =
          TensorView::contiguous(scratch.ptr<float>() + weight_floats, DType::kF32, {chunks, hidden}, device);
  }
  DETDIT_RETURN_IF_ERROR(backend::layernorm_backward_rows(device, p, stream));
  if (weight_floats + bias_floats == 0) return Status();
  DETDIT_RETURN_IF_ERROR(backend::layernorm_backward_partials(device, p, weight_partials, bias_partials, stream));
  if (p.d_weight.present())
    DETDIT_RETURN_IF_ERROR(backend::fold_chunk_partials(device, weight_partials, p.d_weight, stream));
  if (p.d_bias.present())
    DETDIT_RETURN_IF_ERROR(backend::fold_chunk_partials(device, bias_partials, p.d_bias, stream));
  return Status();
}

}  // namespace detdit
