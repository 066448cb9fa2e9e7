// Public entry points of linear (include/detdit/linear.h): validate every
// argument (identically for CPU and CUDA tensors, never reading device
// memory), then dispatch on the tensors' device. Nothing is written on error.
#include "detdit/linear.h"

#include <initializer_list>
#include <memory>
#include <string>
#include <utility>

#include "common/backends.h"
#include "common/scratch.h"
#include "common/validate.h"

namespace detdit {
namespace {

using Named = std::pair<TensorView, const char*>;
using NamedList = std::initializer_list<Named>;

// 16-byte vectors: 4 fp32 or 8 bf16 elements (numerics 5.2).
int64_t vector_width(DType dtype) { return 16 / static_cast<int64_t>(dtype_size(dtype)); }

Status check_matrix(const TensorView& t, const char* name, const char* layout, std::initializer_list<DType> dtypes) {
  DETDIT_RETURN_IF_ERROR(check::present(t, name));
  DETDIT_RETURN_IF_ERROR(check::rank(t, name, 2, layout));
  DETDIT_RETURN_IF_ERROR(check::dtype(t, name, dtypes));
  return check::contiguous(t, name);
}

// x (T, K) and weight (N, K) are read as 16-byte vectors (on CUDA).
Status check_vector_loads(const TensorView& t, const char* name) {
  return check::aligned(t, name, 16, "its rows are read as 16-byte vectors");
}

Status check_in_features(const TensorView& x, int64_t in_features) {
  const int64_t width = vector_width(x.dtype);
  if (in_features % width == 0) return Status();
  return Status::value_error("K = " + std::to_string(in_features) + " must be a multiple of " +
                             std::to_string(width) + " (" + dtype_name(x.dtype) +
                             " elements per 16-byte vector load)");
}

Status check_rows(const TensorView& t, const char* name) {
  if (t.shape[0] >= 1) return Status();
  return Status::value_error(std::string(name) + " must have at least one row (T >= 1), got " + t.describe());
}

Status check_same_device(const TensorView& t, const char* name, const TensorView& ref, const char* ref_name) {
  if (!t.present()) return Status();
  return check::same_device(t, name, ref, ref_name);
}

Status validate_forward(const LinearParams& p) {
  DETDIT_RETURN_IF_ERROR(check_matrix(p.x, "x", "(T, K)", {DType::kF32, DType::kBF16}));
  DETDIT_RETURN_IF_ERROR(check_matrix(p.weight, "weight", "(N, K)", {DType::kF32, DType::kBF16}));
  if (p.weight.dtype != p.x.dtype)
    return Status::type_error(std::string("x and weight must share a dtype (cast at the declared boundary first), got x ") +
                              dtype_name(p.x.dtype) + " and weight " + dtype_name(p.weight.dtype));
  DETDIT_RETURN_IF_ERROR(check::present(p.out, "out"));
  for (auto [t, name] : NamedList{{p.weight, "weight"}, {p.bias, "bias"}, {p.out, "out"},
                         {p.pre_activation, "pre_activation"}})
    DETDIT_RETURN_IF_ERROR(check_same_device(t, name, p.x, "x"));
  DETDIT_RETURN_IF_ERROR(check::numerics_on(p.numerics, p.x.device));
  if (p.activation != Activation::kNone && p.activation != Activation::kSilu)
    return Status::value_error("activation must be Activation::kNone or Activation::kSilu, got " +
                               std::to_string(static_cast<int>(p.activation)));
  DETDIT_RETURN_IF_ERROR(check_rows(p.x, "x"));
  const int64_t rows = p.x.shape[0], in_features = p.x.shape[1], out_features = p.weight.shape[0];
  DETDIT_RETURN_IF_ERROR(check::shape(p.weight, "weight", {-1, in_features}, "(N, K)"));
  DETDIT_RETURN_IF_ERROR(check_in_features(p.x, in_features));
  DETDIT_RETURN_IF_ERROR(check_vector_loads(p.x, "x"));
  DETDIT_RETURN_IF_ERROR(check_vector_loads(p.weight, "weight"));
  if (p.bias.present()) {
    DETDIT_RETURN_IF_ERROR(check::shape(p.bias, "bias", {out_features}, "(N,)"));
    DETDIT_RETURN_IF_ERROR(check::same_dtype(p.bias, "bias", p.weight, "weight"));
    DETDIT_RETURN_IF_ERROR(check::contiguous(p.bias, "bias"));
  }
  DETDIT_RETURN_IF_ERROR(check::shape(p.out, "out", {rows, out_features}, "(T, N)"));
  if (p.out.dtype != DType::kF32) DETDIT_RETURN_IF_ERROR(check::same_dtype(p.out, "out", p.x, "x"));
  DETDIT_RETURN_IF_ERROR(check::contiguous(p.out, "out"));
  if (p.pre_activation.present()) {
    DETDIT_RETURN_IF_ERROR(check::shape(p.pre_activation, "pre_activation", {rows, out_features}, "(T, N)"));
    DETDIT_RETURN_IF_ERROR(check::dtype(p.pre_activation, "pre_activation", {DType::kF32}));
    DETDIT_RETURN_IF_ERROR(check::contiguous(p.pre_activation, "pre_activation"));
    DETDIT_RETURN_IF_ERROR(check::no_alias(p.pre_activation, "pre_activation", p.out, "out"));
  }
  for (auto [t, name] : NamedList{{p.x, "x"}, {p.weight, "weight"}, {p.bias, "bias"}}) {
    DETDIT_RETURN_IF_ERROR(check::no_alias(p.out, "out", t, name));
    DETDIT_RETURN_IF_ERROR(check::no_alias(p.pre_activation, "pre_activation", t, name));
  }
  return Status();
}

// grad (T, N) fp32 and weight (N, K) fp32/bf16; zero N or K is allowed.
Status validate_grad_weight(const LinearBackwardInputParams& p) {
  DETDIT_RETURN_IF_ERROR(check_matrix(p.grad, "grad", "(T, N)", {DType::kF32}));
  DETDIT_RETURN_IF_ERROR(check_matrix(p.weight, "weight", "(N, K)", {DType::kF32, DType::kBF16}));
  DETDIT_RETURN_IF_ERROR(check::same_device(p.weight, "weight", p.grad, "grad"));
  DETDIT_RETURN_IF_ERROR(check_rows(p.grad, "grad"));
  DETDIT_RETURN_IF_ERROR(check::shape(p.weight, "weight", {p.grad.shape[1], -1}, "(N, K) with grad's N"));
  DETDIT_RETURN_IF_ERROR(check_in_features(p.weight, p.weight.shape[1]));
  return check_vector_loads(p.weight, "weight");
}

// partials (ceil(N/64), T, K) fp32.
Status validate_partials(const LinearBackwardInputParams& p, int64_t chunks, int64_t rows, int64_t in_features,
                         const TensorView& ref, const char* ref_name) {
  DETDIT_RETURN_IF_ERROR(check::present(p.partials, "partials"));
  DETDIT_RETURN_IF_ERROR(check::same_device(p.partials, "partials", ref, ref_name));
  DETDIT_RETURN_IF_ERROR(check::dtype(p.partials, "partials", {DType::kF32}));
  DETDIT_RETURN_IF_ERROR(
      check::shape(p.partials, "partials", {chunks, rows, in_features}, "(ceil(N/64), T, K)"));
  DETDIT_RETURN_IF_ERROR(check::contiguous(p.partials, "partials"));
  // On every backend, so that a program the CPU accepts runs on a GPU.
  return check::aligned(p.partials, "partials", 16, "the CUDA kernels write its rows as 16-byte vectors");
}

// d_x (T, K) fp32/bf16.
Status validate_d_x(const LinearBackwardInputParams& p, int64_t rows, int64_t in_features, const TensorView& ref,
                    const char* ref_name) {
  DETDIT_RETURN_IF_ERROR(check::present(p.d_x, "d_x"));
  DETDIT_RETURN_IF_ERROR(check::same_device(p.d_x, "d_x", ref, ref_name));
  DETDIT_RETURN_IF_ERROR(check::dtype(p.d_x, "d_x", {DType::kF32, DType::kBF16}));
  DETDIT_RETURN_IF_ERROR(check::shape(p.d_x, "d_x", {rows, in_features}, "(T, K)"));
  DETDIT_RETURN_IF_ERROR(check::contiguous(p.d_x, "d_x"));
  return check::no_alias(p.d_x, "d_x", p.partials, "partials");
}

int64_t chunk_count(int64_t out_features) { return (out_features + kLinearChunkRows - 1) / kLinearChunkRows; }

Status validate_partials_call(const LinearBackwardInputParams& p) {
  DETDIT_RETURN_IF_ERROR(validate_grad_weight(p));
  DETDIT_RETURN_IF_ERROR(validate_partials(p, chunk_count(p.grad.shape[1]), p.grad.shape[0], p.weight.shape[1],
                                           p.grad, "grad"));
  DETDIT_RETURN_IF_ERROR(check::no_alias(p.partials, "partials", p.grad, "grad"));
  return check::no_alias(p.partials, "partials", p.weight, "weight");
}

Status validate_fold_call(const LinearBackwardInputParams& p) {
  DETDIT_RETURN_IF_ERROR(check::present(p.partials, "partials"));
  DETDIT_RETURN_IF_ERROR(check::rank(p.partials, "partials", 3, "(ceil(N/64), T, K)"));
  const int64_t chunks = p.partials.shape[0], rows = p.partials.shape[1], in_features = p.partials.shape[2];
  if (rows < 1)
    return Status::value_error("partials must have at least one row (T = partials.shape[1] >= 1), got " +
                               p.partials.describe());
  DETDIT_RETURN_IF_ERROR(validate_partials(p, chunks, rows, in_features, p.partials, "partials"));
  return validate_d_x(p, rows, in_features, p.partials, "partials");
}

Status validate_silu_backward(const SiluBackwardParams& p) {
  for (auto [t, name] : NamedList{{p.grad, "grad"}, {p.pre, "pre"}, {p.d_pre, "d_pre"}}) {
    DETDIT_RETURN_IF_ERROR(check::present(t, name));
    DETDIT_RETURN_IF_ERROR(check::dtype(t, name, {DType::kF32}));
    DETDIT_RETURN_IF_ERROR(check::contiguous(t, name));
    DETDIT_RETURN_IF_ERROR(check::same_device(t, name, p.grad, "grad"));
  }
  DETDIT_RETURN_IF_ERROR(check::numerics_on(p.numerics, p.grad.device));
  for (auto [t, name] : NamedList{{p.pre, "pre"}, {p.d_pre, "d_pre"}}) {
    bool same = t.rank == p.grad.rank;
    for (int d = 0; same && d < t.rank; ++d) same = t.shape[d] == p.grad.shape[d];
    if (!same)
      return Status::value_error(std::string(name) + " must have grad's shape " + p.grad.shape_string() + ", got " +
                                 t.describe());
  }
  DETDIT_RETURN_IF_ERROR(check::no_alias(p.d_pre, "d_pre", p.grad, "grad"));
  return check::no_alias(p.d_pre, "d_pre", p.pre, "pre");
}

// d_x = the ascending fold over chunks of the (C, T, K) partials, cast once
// (numerics 6.2): the canonical chunk fold on the contiguous (C, T*K) and
// (T*K,) views of validated partials and d_x.
Status fold_d_x(const LinearBackwardInputParams& p, Stream stream) {
  const int64_t elements = p.d_x.numel();
  const TensorView partials = p.partials.reshaped({p.partials.shape[0], elements});
  const TensorView d_x = p.d_x.reshaped({elements});
  return backend::fold_chunk_partials(p.d_x.device, partials, d_x, stream);
}

}  // namespace

Status linear_forward(const LinearParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(validate_forward(params));
  return backend::linear_forward(params.x.device, params, stream);
}

Status linear_backward_input_partials(const LinearBackwardInputParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(validate_partials_call(params));
  return backend::linear_backward_input_partials(params.grad.device, params, stream);
}

Status linear_fold_partials(const LinearBackwardInputParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(validate_fold_call(params));
  return fold_d_x(params, stream);
}

Status linear_backward_input(const LinearBackwardInputParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(validate_grad_weight(params));
  const int64_t rows = params.grad.shape[0], in_features = params.weight.shape[1];
  const int64_t chunks = chunk_count(params.grad.shape[1]);
  DETDIT_RETURN_IF_ERROR(validate_d_x(params, rows, in_features, params.grad, "grad"));
  DETDIT_RETURN_IF_ERROR(check::no_alias(params.d_x, "d_x", params.grad, "grad"));
  DETDIT_RETURN_IF_ERROR(check::no_alias(params.d_x, "d_x", params.weight, "weight"));
  LinearBackwardInputParams run = params;
  std::shared_ptr<void> scratch;
  if (params.partials.present()) {
    DETDIT_RETURN_IF_ERROR(validate_partials_call(params));
  } else {
    DETDIT_RETURN_IF_ERROR(scratch_tensor(params.grad.device, DType::kF32, {chunks, rows, in_features}, stream,
                                          &scratch, &run.partials));
  }
  DETDIT_RETURN_IF_ERROR(backend::linear_backward_input_partials(run.grad.device, run, stream));
  return fold_d_x(run, stream);
}

namespace {
// grad (T, N) fp32, x (T, K), d_weight (N, K) and d_bias (N,) each present or not.
Status validate_weight_grads(const LinearBackwardWeightParams& p) {
  DETDIT_RETURN_IF_ERROR(check_matrix(p.grad, "grad", "(T, N)", {DType::kF32}));
  DETDIT_RETURN_IF_ERROR(check_matrix(p.x, "x", "(T, K)", {DType::kF32, DType::kBF16}));
  DETDIT_RETURN_IF_ERROR(check::same_device(p.x, "x", p.grad, "grad"));
  DETDIT_RETURN_IF_ERROR(check_rows(p.grad, "grad"));
  DETDIT_RETURN_IF_ERROR(check::shape(p.x, "x", {p.grad.shape[0], -1}, "(T, K) with grad's T"));
  const int64_t out_features = p.grad.shape[1], in_features = p.x.shape[1];
  if (p.d_weight.present()) {
    DETDIT_RETURN_IF_ERROR(check::same_device(p.d_weight, "d_weight", p.grad, "grad"));
    DETDIT_RETURN_IF_ERROR(check::dtype(p.d_weight, "d_weight", {DType::kF32, DType::kBF16}));
    DETDIT_RETURN_IF_ERROR(check::shape(p.d_weight, "d_weight", {out_features, in_features}, "(N, K)"));
    DETDIT_RETURN_IF_ERROR(check::contiguous(p.d_weight, "d_weight"));
  }
  if (p.d_bias.present()) {
    DETDIT_RETURN_IF_ERROR(check::same_device(p.d_bias, "d_bias", p.grad, "grad"));
    DETDIT_RETURN_IF_ERROR(check::dtype(p.d_bias, "d_bias", {DType::kF32, DType::kBF16}));
    DETDIT_RETURN_IF_ERROR(check::shape(p.d_bias, "d_bias", {out_features}, "(N,)"));
    DETDIT_RETURN_IF_ERROR(check::contiguous(p.d_bias, "d_bias"));
  }
  for (auto [t, name] : NamedList{{p.grad, "grad"}, {p.x, "x"}}) {
    DETDIT_RETURN_IF_ERROR(check::no_alias(p.d_weight, "d_weight", t, name));
    DETDIT_RETURN_IF_ERROR(check::no_alias(p.d_bias, "d_bias", t, name));
  }
  return check::no_alias(p.d_bias, "d_bias", p.d_weight, "d_weight");
}
}  // namespace

Status linear_backward_weight(const LinearBackwardWeightParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(validate_weight_grads(params));
  if (!params.d_weight.present() && !params.d_bias.present()) return Status();
  return backend::linear_backward_weight(params.grad.device, params, stream);
}

Status linear_backward_weight_and_input(const LinearBackwardWeightParams& weight_grads,
                                        const LinearBackwardInputParams& input_grad, Stream stream) {
  DETDIT_RETURN_IF_ERROR(validate_weight_grads(weight_grads));
  DETDIT_RETURN_IF_ERROR(validate_partials_call(input_grad));
  DETDIT_RETURN_IF_ERROR(validate_fold_call(input_grad));
  // One linear: the fused kernel reads both gradients' grad and sizes from input_grad, so
  // the two sets must describe the same (T, N) grad and the same K.
  const TensorView& grad = input_grad.grad;
  bool same_grad = weight_grads.grad.data == grad.data && weight_grads.grad.device == grad.device &&
                   weight_grads.grad.dtype == grad.dtype && weight_grads.grad.rank == grad.rank;
  for (int d = 0; same_grad && d < grad.rank; ++d)
    same_grad = weight_grads.grad.shape[d] == grad.shape[d] && weight_grads.grad.strides[d] == grad.strides[d];
  if (!same_grad)
    return Status::value_error("weight_grads.grad must be input_grad.grad (both gradients of one linear), got " +
                               weight_grads.grad.describe() + " and " + grad.describe());
  DETDIT_RETURN_IF_ERROR(check::shape(weight_grads.x, "x", {grad.shape[0], input_grad.weight.shape[1]},
                                      "(T, K) with weight's K"));
  // The overlaps the two validations above leave open (each set checked its own outputs
  // against its own inputs, partials against grad and weight; the grad is one tensor now).
  DETDIT_RETURN_IF_ERROR(check::no_alias(input_grad.d_x, "d_x", grad, "grad"));
  DETDIT_RETURN_IF_ERROR(check::no_alias(input_grad.d_x, "d_x", input_grad.weight, "weight"));
  for (auto [out, name] : NamedList{{input_grad.partials, "partials"}, {input_grad.d_x, "d_x"}})
    DETDIT_RETURN_IF_ERROR(check::no_alias(out, name, weight_grads.x, "x"));
  for (auto [out, name] : NamedList{{weight_grads.d_weight, "d_weight"}, {weight_grads.d_bias, "d_bias"}}) {
    DETDIT_RETURN_IF_ERROR(check::no_alias(out, name, input_grad.partials, "partials"));
    DETDIT_RETURN_IF_ERROR(check::no_alias(out, name, input_grad.d_x, "d_x"));
    DETDIT_RETURN_IF_ERROR(check::no_alias(out, name, input_grad.weight, "weight"));
  }
  const Device device = input_grad.grad.device;
  // On CUDA d_W and the partials from one read of W where the kernel takes the
  // shapes (the same bits); otherwise, and for d_b, the separate kernels.
  bool fused = false;
  if (device.is_cuda() && weight_grads.d_weight.present()) {
    LinearBackwardWeightParams weight_only = weight_grads;
    weight_only.d_bias = TensorView();
    DETDIT_RETURN_IF_ERROR(cuda::linear_backward_fused(input_grad, weight_only, stream, &fused));
  }
  LinearBackwardWeightParams rest = weight_grads;
  if (fused) rest.d_weight = TensorView();
  if (rest.d_weight.present() || rest.d_bias.present())
    DETDIT_RETURN_IF_ERROR(backend::linear_backward_weight(device, rest, stream));
  if (!fused) DETDIT_RETURN_IF_ERROR(backend::linear_backward_input_partials(device, input_grad, stream));
  return fold_d_x(input_grad, stream);
}

Status silu_backward(const SiluBackwardParams& params, Stream stream) {
  DETDIT_RETURN_IF_ERROR(validate_silu_backward(params));
  return backend::silu_backward(params.grad.device, params, stream);
}

}  // namespace detdit
