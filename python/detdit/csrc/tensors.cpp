// Tensor views, output allocation, argument parsing and Status -> Python
// exception mapping (the contract is in tensors.h).
#include "tensors.h"

#include <limits>
#include <string>

namespace detdit_torch {
namespace {

DType dtype_of(const Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kF32;
    case at::kBFloat16: return DType::kBF16;
    case at::kHalf: return DType::kF16;
    case at::kInt: return DType::kI32;
    case at::kLong: return DType::kI64;
    default:
      C10_THROW_ERROR(TypeError, std::string(name) + " must be float32, bfloat16, float16, int32 or int64 "
                                                     "(the dtypes detdit takes), got " +
                                     std::string(t.dtype().name()));
  }
}

detdit::Device device_of(const Tensor& t, const char* name) {
  if (t.is_cpu()) return detdit::Device::cpu();
  if (t.is_cuda()) return detdit::Device::cuda(t.get_device());
  C10_THROW_ERROR(ValueError, std::string(name) + " must be a CPU or CUDA tensor, got one on " + t.device().str());
}

}  // namespace

[[noreturn]] void raise(const Status& status) {
  const std::string& message = status.message();
  switch (status.kind()) {
    case ErrorKind::kType:
      C10_THROW_ERROR(TypeError, message);
    case ErrorKind::kValue:
      C10_THROW_ERROR(ValueError, message);
    case ErrorKind::kIndex:
      C10_THROW_ERROR(IndexError, message);
    default:
      C10_THROW_ERROR(Error, message);
  }
}

void check_ok(const Status& status) {
  if (!status.ok()) raise(status);
}

TensorView view(const Tensor& t, const char* name) {
  TensorView v;
  if (!t.defined()) return v;
  if (t.dim() < 1 || t.dim() > detdit::kMaxRank)
    C10_THROW_ERROR(ValueError, std::string(name) + " must have 1 to " + std::to_string(detdit::kMaxRank) +
                                    " dimensions, got a " + std::to_string(t.dim()) + "-D tensor");
  v.dtype = dtype_of(t, name);
  v.device = device_of(t, name);
  v.data = t.data_ptr();
  v.rank = static_cast<int>(t.dim());
  for (int i = 0; i < v.rank; ++i) {
    v.shape[i] = t.size(i);
    v.strides[i] = t.stride(i);
  }
  return v;
}

TensorView view(const OptTensor& t, const char* name) { return t.has_value() ? view(*t, name) : TensorView(); }

Numerics parse_numerics(const std::string& numerics) {
  if (numerics == "portable") return Numerics::kPortable;
  if (numerics == "torch") return Numerics::kTorch;
  C10_THROW_ERROR(ValueError, "numerics must be 'portable' or 'torch', got '" + numerics + "'");
}

detdit::Activation parse_activation(const std::string& activation) {
  if (activation == "none") return detdit::Activation::kNone;
  if (activation == "silu") return detdit::Activation::kSilu;
  C10_THROW_ERROR(ValueError, "activation must be 'none' or 'silu', got '" + activation + "'");
}

void require_contiguous(const Tensor& t, const char* name) {
  if (!t.defined()) return;
  const TensorView v = view(t, name);
  if (!v.is_contiguous())
    C10_THROW_ERROR(ValueError, std::string(name) + " must be contiguous, got a strided view " + v.describe());
}

void require_unit_column_stride(const Tensor& t, const char* name) {
  if (!t.defined()) return;
  const TensorView v = view(t, name);
  if (v.strides[v.rank - 1] != 1 && v.shape[v.rank - 1] > 1)
    C10_THROW_ERROR(ValueError, std::string(name) + " must have unit column stride, got stride " +
                                    std::to_string(v.strides[v.rank - 1]));
}

void require_dims(const Tensor& t, const char* name, std::initializer_list<int64_t> dims, const char* layout) {
  if (!t.defined()) return;
  const TensorView v = view(t, name);
  bool ok = v.rank == static_cast<int>(dims.size());
  std::string expected;
  int i = 0;
  for (int64_t d : dims) {
    if (ok && d >= 0 && v.shape[i] != d) ok = false;
    expected += (i++ ? ", " : "") + (d < 0 ? std::string("*") : std::to_string(d));
  }
  if (ok) return;
  if (dims.size() == 1) expected += ",";
  C10_THROW_ERROR(ValueError, std::string(name) + " must be " + layout + " = (" + expected + "), got " + v.describe());
}

int to_int(int64_t value, const char* name) {
  if (value < std::numeric_limits<int>::min() || value > std::numeric_limits<int>::max())
    C10_THROW_ERROR(ValueError, std::string(name) + " must fit in a 32-bit int, got " + std::to_string(value));
  return static_cast<int>(value);
}

int64_t dim_or_zero(const Tensor& t, int64_t i) {
  if (!t.defined()) return 0;
  if (i < 0) i += t.dim();
  return (i >= 0 && i < t.dim()) ? t.size(i) : 0;
}

int64_t leading_rows(const Tensor& t) {
  if (!t.defined() || t.dim() < 2) return 0;
  int64_t rows = 1;
  for (int64_t i = 0; i + 1 < t.dim(); ++i) rows *= t.size(i);
  return rows;
}

std::array<int64_t, 2> matrix_shape(const Tensor& t) { return {dim_or_zero(t, 0), dim_or_zero(t, 1)}; }

Tensor empty_like_shape(const Tensor& like, at::IntArrayRef shape, at::ScalarType dtype) {
  return at::empty(shape, at::TensorOptions().dtype(dtype).device(like.defined() ? like.device() : at::Device(at::kCPU)));
}

Tensor maybe_empty(bool wanted, const Tensor& like, at::IntArrayRef shape, at::ScalarType dtype) {
  return wanted ? empty_like_shape(like, shape, dtype) : Tensor();
}

Tensor output_like(const Tensor& t, bool wanted) {
  return wanted && t.defined() ? at::empty(t.sizes(), t.options()) : Tensor();
}

}  // namespace detdit_torch
