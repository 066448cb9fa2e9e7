#include "detdit/tensor.h"

#include <cstdint>
#include <sstream>

namespace detdit {

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF32: return 4;
    case DType::kBF16: return 2;
    case DType::kF16: return 2;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "float32";
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
    case DType::kI32: return "int32";
    case DType::kI64: return "int64";
  }
  return "unknown";
}

bool dtype_is_float(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16;
}

std::string Device::to_string() const {
  if (kind == DeviceKind::kCpu) return "cpu";
  return "cuda:" + std::to_string(index);
}

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                                  Device device) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.device = device;
  v.rank = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t s : shape) v.shape[i++] = s;
  int64_t stride = 1;
  for (int d = v.rank - 1; d >= 0; --d) {
    v.strides[d] = stride;
    stride *= v.shape[d];
  }
  return v;
}

TensorView TensorView::strided(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               std::initializer_list<int64_t> strides, Device device) {
  TensorView v = contiguous(data, dtype, shape, device);
  int i = 0;
  for (int64_t s : strides) {
    if (i < kMaxRank) v.strides[i] = s;
    ++i;
  }
  return v;
}

int64_t TensorView::numel() const {
  if (rank == 0) return 0;
  int64_t n = 1;
  for (int d = 0; d < rank; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t expected = 1;
  for (int d = rank - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

bool TensorView::aligned_to(std::size_t bytes) const {
  return reinterpret_cast<std::uintptr_t>(data) % bytes == 0;
}

std::string TensorView::shape_string() const {
  std::ostringstream os;
  os << "(";
  for (int d = 0; d < rank; ++d) os << (d ? ", " : "") << shape[d];
  if (rank == 1) os << ",";
  os << ")";
  return os.str();
}

std::string TensorView::describe() const {
  if (!present()) return "an absent tensor";
  return shape_string() + " " + dtype_name(dtype) + " on " + device.to_string();
}

TensorView TensorView::narrow(int dim, int64_t start, int64_t length) const {
  TensorView v = *this;
  v.shape[dim] = length;
  v.data = static_cast<char*>(data) + start * strides[dim] * static_cast<int64_t>(dtype_size(dtype));
  return v;
}

TensorView TensorView::reshaped(std::initializer_list<int64_t> new_shape) const {
  return contiguous(data, dtype, new_shape, device);
}

}  // namespace detdit
