// detdit/tensor.h: non-owning tensor views, the currency of every op.
//
// A TensorView is a pointer, a dtype, a shape and strides (in elements, not
// bytes), and the device that holds the memory. detdit never allocates the
// tensors a caller passes in or receives: outputs are views the caller owns,
// and an op either writes all of them or (on any validation error) none.
// Ranks up to 4 are supported. A default-constructed view is "absent"
// (data == nullptr, rank 0): optional arguments are absent views.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace detdit {

enum class DType { kF32, kBF16, kF16, kI32, kI64 };

// Bytes per element.
std::size_t dtype_size(DType dtype);
// "float32", "bfloat16", "float16", "int32", "int64".
const char* dtype_name(DType dtype);
bool dtype_is_float(DType dtype);

enum class DeviceKind { kCpu, kCuda };

struct Device {
  DeviceKind kind = DeviceKind::kCpu;
  int index = 0;  // CUDA ordinal; 0 for the CPU

  static Device cpu() { return Device{}; }
  static Device cuda(int ordinal = 0) { return Device{DeviceKind::kCuda, ordinal}; }
  bool is_cuda() const { return kind == DeviceKind::kCuda; }
  bool operator==(const Device& o) const { return kind == o.kind && (kind == DeviceKind::kCpu || index == o.index); }
  bool operator!=(const Device& o) const { return !(*this == o); }
  std::string to_string() const;  // "cpu" or "cuda:0"
};

constexpr int kMaxRank = 4;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  int rank = 0;
  int64_t shape[kMaxRank] = {0, 0, 0, 0};
  int64_t strides[kMaxRank] = {0, 0, 0, 0};  // in elements
  Device device;

  // A contiguous (row-major) view.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               Device device = Device::cpu());
  // A view with explicit strides (elements).
  static TensorView strided(void* data, DType dtype, std::initializer_list<int64_t> shape,
                            std::initializer_list<int64_t> strides, Device device = Device::cpu());

  // Optional arguments are absent views (rank 0).
  bool present() const { return rank > 0; }
  int64_t numel() const;
  int64_t dim(int i) const { return shape[i]; }
  bool is_contiguous() const;
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype); }
  // True when the base pointer is a multiple of `bytes`.
  bool aligned_to(std::size_t bytes) const;
  template <typename T>
  T* ptr() const { return static_cast<T*>(data); }
  // "(2, 4097, 5376) bfloat16 on cuda:0"
  std::string describe() const;
  std::string shape_string() const;  // "(2, 4097, 5376)"

  // Sub-views (no copies). row(i) drops the first dim; narrow keeps the rank.
  TensorView narrow(int dim, int64_t start, int64_t length) const;
  TensorView reshaped(std::initializer_list<int64_t> shape) const;  // contiguous views only
};

}  // namespace detdit
