// Helpers shared by the verify and bench cases (verify.h).
#include <chrono>
#include <cmath>
#include <cstdio>
#include <algorithm>
#include <cstring>
#include <memory>

#include "common/scalar_math.h"
#include "common/storage.h"
#include "io/synth.h"
#include "verify.h"

#ifdef DETDIT_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace detdit {
namespace cli {

// The bf16 nearest to a double (ties to even), for finite x: the nearest of
// the three bf16 magnitudes around float(|x|). Each |x - v| is exact (Sterbenz:
// v and x are within a factor of 2), so the choice is exact too.
uint16_t bf16_nearest(double x) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double magnitude = std::fabs(x);
  const uint16_t middle = static_cast<uint16_t>(num::float_bits(static_cast<float>(magnitude)) >> 16);
  uint16_t best = middle;
  double best_distance = std::fabs(magnitude - num::bf16_to_float(middle));
  for (int delta : {-1, 1}) {
    if (middle == 0 && delta < 0) continue;
    const uint16_t candidate = static_cast<uint16_t>(middle + delta);
    const double distance = std::fabs(magnitude - num::bf16_to_float(candidate));
    if (distance < best_distance || (distance == best_distance && (candidate & 1) == 0)) {
      best = candidate;
      best_distance = distance;
    }
  }
  return static_cast<uint16_t>(best | sign);
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void compare_bytes(const void* expected, const void* actual, std::size_t bytes, DType dtype, const std::string& what,
                   CheckRow* row) {
  ++row->bitwise_run;
  if (std::memcmp(expected, actual, bytes) == 0) {
    ++row->bitwise_passed;
    return;
  }
  const std::size_t width = dtype_size(dtype);
  const auto* e = static_cast<const unsigned char*>(expected);
  const auto* a = static_cast<const unsigned char*>(actual);
  std::size_t differing = 0, first = 0;
  for (std::size_t i = 0; i < bytes / width; ++i) {
    if (std::memcmp(e + i * width, a + i * width, width) != 0) {
      if (differing++ == 0) first = i;
    }
  }
  auto hex = [&](const unsigned char* p) {
    uint64_t v = 0;
    std::memcpy(&v, p + first * width, width);  // little-endian host
    char text[32];
    std::snprintf(text, sizeof text, "0x%0*llx", static_cast<int>(2 * width), static_cast<unsigned long long>(v));
    return std::string(text);
  };
  if (row->detail.empty()) {
    row->detail = what + ": " + std::to_string(differing) + " of " + std::to_string(bytes / width) +
                  " elements differ, first at " + std::to_string(first) + " (" + hex(e) + " vs " + hex(a) + ")";
  }
}

void finish_row(CheckRow* row) {
  const bool bitwise_ok = row->bitwise_passed == row->bitwise_run;
  // A check with a bound measured an error: NaN or above the bound fails it.
  const bool error_ok = std::isnan(row->bound) || row->max_error <= row->bound;
  row->pass = bitwise_ok && error_ok;
  if (!error_ok && row->detail.empty()) {
    char text[128];
    std::snprintf(text, sizeof text, "max error %.3g %s exceeds the bound %.3g", row->max_error,
                  row->error_unit.c_str(), row->bound);
    row->detail = text;
  }
}

HostBuffer::HostBuffer(DType dtype, std::vector<int64_t> shape) : dtype_(dtype), shape_(std::move(shape)) {
  nbytes_ = static_cast<std::size_t>(numel()) * dtype_size(dtype);
  bytes_.assign(nbytes_ + 64, 0);
  offset_ = (64 - reinterpret_cast<uintptr_t>(bytes_.data()) % 64) % 64;
}

int64_t HostBuffer::numel() const {
  int64_t n = 1;
  for (int64_t d : shape_) n *= d;
  return n;
}

TensorView HostBuffer::view() const {
  TensorView v;
  v.data = data();
  v.dtype = dtype_;
  v.rank = static_cast<int>(shape_.size());
  int64_t stride = 1;
  for (int d = v.rank - 1; d >= 0; --d) {
    v.shape[d] = shape_[d];
    v.strides[d] = stride;
    stride *= shape_[d];
  }
  return v;
}

void HostBuffer::fill_normal(uint64_t seed, double mean, double std) {
  io::fill_normal(dtype_, numel(), seed, "verify", mean, std, static_cast<uint8_t*>(data()));
}

double HostBuffer::get(int64_t i) const {
  switch (dtype_) {
    case DType::kF32: return ptr<float>()[i];
    case DType::kBF16: return to_float(ptr<Bf16>()[i]);
    case DType::kF16: return to_float(ptr<F16>()[i]);
    case DType::kI32: return ptr<int32_t>()[i];
    case DType::kI64: return static_cast<double>(ptr<int64_t>()[i]);
  }
  return 0;
}

Status DeviceTensor::empty(DType dtype, std::vector<int64_t> shape, const Device& device, DeviceTensor* tensor) {
#ifdef DETDIT_WITH_CUDA
  if (device.is_cuda()) {
    // The canary is written on the device (cudaMemset on the default stream,
    // ordered before the default stream's later work): no host buffer.
    DeviceTensor t;
    t.shape_ = shape;
    t.view_ = TensorView();
    t.view_.dtype = dtype;
    t.view_.rank = static_cast<int>(shape.size());
    int64_t stride = 1;
    for (int d = t.view_.rank - 1; d >= 0; --d) {
      t.view_.shape[d] = shape[d];
      t.view_.strides[d] = stride;
      stride *= shape[d];
    }
    t.view_.device = device;
    const std::size_t bytes = static_cast<std::size_t>(stride) * dtype_size(dtype);
    void* memory = nullptr;
    if (cudaSetDevice(device.index) != cudaSuccess || cudaMalloc(&memory, std::max<std::size_t>(bytes, 1)) != cudaSuccess) {
      return Status::runtime_error("cudaMalloc of " + std::to_string(bytes) + " bytes failed: " +
                                   cudaGetErrorString(cudaGetLastError()));
    }
    t.memory_ = std::shared_ptr<void>(memory, [](void* p) { cudaFree(p); });
    if (cudaMemset(memory, 0xA5, bytes) != cudaSuccess) {
      return Status::runtime_error(std::string("cudaMemset failed: ") + cudaGetErrorString(cudaGetLastError()));
    }
    t.view_.data = memory;
    *tensor = std::move(t);
    return Status::ok_status();
  }
#endif
  HostBuffer host(dtype, shape);
  std::memset(host.data(), 0xA5, host.nbytes());
  return from_host(std::move(host), device, tensor);
}

Status DeviceTensor::from_host(HostBuffer&& host, const Device& device, DeviceTensor* tensor) {
  if (device.is_cuda()) return from_host(static_cast<const HostBuffer&>(host), device, tensor);
  // A CPU tensor takes the buffer over: no copy of (possibly large) bytes.
  auto owned = std::make_shared<HostBuffer>(std::move(host));
  DeviceTensor t;
  t.shape_ = owned->shape();
  t.view_ = owned->view();
  t.memory_ = owned;
  *tensor = std::move(t);
  return Status::ok_status();
}

Status DeviceTensor::from_host(const HostBuffer& host, const Device& device, DeviceTensor* tensor) {
  DeviceTensor t;
  t.shape_ = host.shape();
  t.view_ = host.view();
  t.view_.device = device;
  if (!device.is_cuda()) {
    auto copy = std::make_shared<HostBuffer>(host.dtype(), host.shape());
    std::memcpy(copy->data(), host.data(), host.nbytes());
    t.view_.data = copy->data();
    t.memory_ = copy;
    *tensor = std::move(t);
    return Status::ok_status();
  }
#ifdef DETDIT_WITH_CUDA
  void* memory = nullptr;
  if (cudaSetDevice(device.index) != cudaSuccess || cudaMalloc(&memory, std::max<std::size_t>(host.nbytes(), 1)) != cudaSuccess) {
    return Status::runtime_error("cudaMalloc of " + std::to_string(host.nbytes()) + " bytes failed: " +
                                 cudaGetErrorString(cudaGetLastError()));
  }
  t.memory_ = std::shared_ptr<void>(memory, [](void* p) { cudaFree(p); });
  if (cudaMemcpy(memory, host.data(), host.nbytes(), cudaMemcpyHostToDevice) != cudaSuccess) {
    return Status::runtime_error(std::string("cudaMemcpy to the device failed: ") +
                                 cudaGetErrorString(cudaGetLastError()));
  }
  t.view_.data = memory;
  *tensor = std::move(t);
  return Status::ok_status();
#else
  return Status::runtime_error("a CUDA tensor needs a CUDA build of detdit");
#endif
}

Status DeviceTensor::to_host(HostBuffer* host) const {
  *host = HostBuffer(view_.dtype, shape_);
  if (!view_.device.is_cuda()) {
    std::memcpy(host->data(), view_.data, host->nbytes());
    return Status::ok_status();
  }
#ifdef DETDIT_WITH_CUDA
  if (cudaDeviceSynchronize() != cudaSuccess ||
      cudaMemcpy(host->data(), view_.data, host->nbytes(), cudaMemcpyDeviceToHost) != cudaSuccess) {
    return Status::runtime_error(std::string("copy to the host failed: ") + cudaGetErrorString(cudaGetLastError()));
  }
  return Status::ok_status();
#else
  return Status::runtime_error("a CUDA tensor needs a CUDA build of detdit");
#endif
}

Status DeviceTensor::to_host(HostBuffer* host, Stream stream) const {
  if (!view_.device.is_cuda()) return to_host(host);
  *host = HostBuffer(view_.dtype, shape_);
#ifdef DETDIT_WITH_CUDA
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (cudaMemcpyAsync(host->data(), view_.data, host->nbytes(), cudaMemcpyDeviceToHost, s) != cudaSuccess ||
      cudaStreamSynchronize(s) != cudaSuccess) {
    return Status::runtime_error(std::string("copy to the host failed: ") + cudaGetErrorString(cudaGetLastError()));
  }
  return Status::ok_status();
#else
  (void)stream;
  return Status::runtime_error("a CUDA tensor needs a CUDA build of detdit");
#endif
}

}  // namespace cli
}  // namespace detdit
