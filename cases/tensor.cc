// cases/tensor.h: owned tensors, deterministic values, the bitwise comparison.
#include "cases/tensor.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <new>
#include <random>
#include <sstream>

#include "common/scalar_math.h"
#include "cpu/parallel.h"
#include "io/synth.h"

#if defined(DETDIT_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace detdit {
namespace cases {
namespace {

std::shared_ptr<void> aligned_host_memory(std::size_t bytes) {
  constexpr std::align_val_t kAlignment{64};
  void* memory = ::operator new(bytes > 0 ? bytes : 1, kAlignment);
  return std::shared_ptr<void>(memory, [kAlignment](void* m) { ::operator delete(m, kAlignment); });
}

// memset and memcpy over the host's cores: at the H3 shapes the cases touch
// tens of GB of freshly allocated memory, bound by page faults on one core.
// Blocks of 32 MiB: a smaller tensor is one block, done by the calling thread.
// The out-of-memory tests (tests/cpu/out_of_memory_test.cc) rely on that: they
// build inputs of 8-24 MB before limiting the address space, and a thread
// started there left a cached stack that changed what the limit allowed.
constexpr std::size_t kByteBlock = std::size_t(32) << 20;

void parallel_bytes(std::size_t bytes, const std::function<void(std::size_t offset, std::size_t size)>& fn) {
  const int64_t blocks = static_cast<int64_t>((bytes + kByteBlock - 1) / kByteBlock);
  cpu::parallel_for(0, blocks, [&](int64_t b) {
    const std::size_t offset = static_cast<std::size_t>(b) * kByteBlock;
    fn(offset, std::min(kByteBlock, bytes - offset));
  });
}

void fill_host_bytes(void* data, uint8_t value, std::size_t bytes) {
  parallel_bytes(bytes, [&](std::size_t offset, std::size_t size) {
    std::memset(static_cast<char*>(data) + offset, value, size);
  });
}

void copy_host_bytes(void* dst, const void* src, std::size_t bytes) {
  parallel_bytes(bytes, [&](std::size_t offset, std::size_t size) {
    std::memcpy(static_cast<char*>(dst) + offset, static_cast<const char*>(src) + offset, size);
  });
}

// A contiguous view of `shape` (any rank) on the host.
TensorView contiguous_view(void* data, DType dtype, const std::vector<int64_t>& shape) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.rank = static_cast<int>(shape.size());
  int64_t stride = 1;
  for (int d = v.rank - 1; d >= 0; --d) {
    v.shape[d] = shape[d];
    v.strides[d] = stride;
    stride *= shape[d];
  }
  return v;
}

int64_t element_count(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

#if defined(DETDIT_WITH_CUDA)
Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status();
  return Status::runtime_error(std::string(what) + " failed: " + cudaGetErrorString(e));
}

// `bytes` (at least 1) on CUDA `device`, freed with its last owner.
Status device_memory(const Device& device, std::size_t bytes, std::shared_ptr<void>* memory) {
  void* raw = nullptr;
  DETDIT_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device.index), "cudaSetDevice"));
  DETDIT_RETURN_IF_ERROR(cuda_status(cudaMalloc(&raw, std::max<std::size_t>(bytes, 1)), "cudaMalloc"));
  *memory = std::shared_ptr<void>(raw, [](void* p) { cudaFree(p); });
  return Status();
}
#endif

}  // namespace

HostTensor::HostTensor(DType dtype, std::vector<int64_t> shape) : dtype_(dtype), shape_(std::move(shape)) {
  nbytes_ = static_cast<std::size_t>(element_count(shape_)) * dtype_size(dtype_);
  memory_ = aligned_host_memory(nbytes_);
  data_ = memory_.get();
  fill_host_bytes(data_, 0, nbytes_);
}

HostTensor::HostTensor(const HostTensor& other) : dtype_(other.dtype_), shape_(other.shape_), nbytes_(other.nbytes_) {
  if (other.memory_ == nullptr) return;  // a default (empty) tensor stays empty
  memory_ = aligned_host_memory(nbytes_);
  data_ = memory_.get();
  copy_host_bytes(data_, other.data_, nbytes_);
}

HostTensor& HostTensor::operator=(const HostTensor& other) {
  if (this != &other) *this = HostTensor(other);
  return *this;
}

int64_t HostTensor::numel() const { return element_count(shape_); }

TensorView HostTensor::view() const { return contiguous_view(data_, dtype_, shape_); }

TensorView HostTensor::view_as(std::initializer_list<int64_t> shape) const {
  return TensorView::contiguous(data_, dtype_, shape);
}

void HostTensor::fill_bytes(uint8_t value) { fill_host_bytes(data_, value, nbytes_); }

double HostTensor::get(int64_t i) const {
  switch (dtype_) {
    case DType::kF32: return ptr<float>()[i];
    case DType::kBF16: return num::bf16_to_float(ptr<uint16_t>()[i]);
    case DType::kF16: return num::f16_to_float(ptr<uint16_t>()[i]);
    case DType::kI32: return ptr<int32_t>()[i];
    case DType::kI64: return static_cast<double>(ptr<int64_t>()[i]);
  }
  return 0;
}

void HostTensor::set(int64_t i, double v) {
  switch (dtype_) {
    case DType::kF32: ptr<float>()[i] = static_cast<float>(v); break;
    case DType::kBF16: ptr<uint16_t>()[i] = num::float_to_bf16(static_cast<float>(v)); break;
    case DType::kF16: ptr<uint16_t>()[i] = num::float_to_f16(static_cast<float>(v)); break;
    case DType::kI32: ptr<int32_t>()[i] = static_cast<int32_t>(v); break;
    case DType::kI64: ptr<int64_t>()[i] = static_cast<int64_t>(v); break;
  }
}

void fill_normal(HostTensor* t, uint64_t seed, double mean, double std) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> dist(mean, std);
  for (int64_t i = 0; i < t->numel(); ++i) t->set(i, dist(rng));
}

void fill_uniform(HostTensor* t, uint64_t seed, double lo, double hi) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  for (int64_t i = 0; i < t->numel(); ++i) t->set(i, dist(rng));
}

void fill_counter_uniform(HostTensor* t, uint64_t seed, double mean, double std, int64_t first) {
  const double half_width = std * 1.7320508075688772;  // uniform on [-sqrt(3), sqrt(3)) has unit variance
  cpu::parallel_for(0, t->numel(), [&](int64_t i) {
    uint64_t z = (seed * 0x9E3779B97F4A7C15ull) + static_cast<uint64_t>(first + i) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const double unit = static_cast<double>(z >> 11) * 0x1.0p-53;  // [0, 1)
    t->set(i, mean + (2.0 * unit - 1.0) * half_width);
  });
}

void fill_stream_normal(HostTensor* t, uint64_t seed, const char* stream, double mean, double std) {
  io::fill_normal(t->dtype(), t->numel(), seed, stream, mean, std, static_cast<uint8_t*>(t->data()));
}

void fill_approx_normal(HostTensor* t, uint64_t seed, double mean, double std) {
  constexpr int64_t kBlock = 65536;
  const int64_t count = t->numel();
  const bool bf16 = t->dtype() == DType::kBF16;
  cpu::parallel_for(0, (count + kBlock - 1) / kBlock, [&](int64_t block) {
    uint64_t state = seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(block) * 0xD1B54A32D192ED03ull;
    const int64_t end = std::min(count, (block + 1) * kBlock);
    for (int64_t i = block * kBlock; i < end; ++i) {
      state += 0x9E3779B97F4A7C15ull;
      uint64_t z = state;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      z ^= z >> 31;
      double sum = 0.0;
      for (int part = 0; part < 4; ++part) sum += static_cast<double>((z >> (16 * part)) & 0xFFFFu) / 65536.0;
      const float v = static_cast<float>(mean + std * (sum - 2.0) * std::sqrt(3.0));
      if (bf16)
        t->ptr<uint16_t>()[i] = num::float_to_bf16(v);
      else
        t->ptr<float>()[i] = v;
    }
  });
}

HostTensor random_tensor(DType dtype, std::vector<int64_t> shape, uint64_t seed, double mean, double std) {
  HostTensor t(dtype, std::move(shape));
  fill_normal(&t, seed, mean, std);
  return t;
}

DeviceTensor DeviceTensor::on_host(HostTensor host) {
  DeviceTensor t;
  t.shape_ = host.shape();
  auto owned = std::make_shared<HostTensor>(std::move(host));
  t.view_ = owned->view();
  t.memory_ = owned;
  return t;
}

Status DeviceTensor::from_host(const HostTensor& host, const Device& device, DeviceTensor* tensor, Stream stream) {
  if (!device.is_cuda()) {
    *tensor = on_host(host);  // a copy
    return Status();
  }
#if defined(DETDIT_WITH_CUDA)
  DeviceTensor t;
  t.shape_ = host.shape();
  t.view_ = host.view();
  t.view_.device = device;
  DETDIT_RETURN_IF_ERROR(device_memory(device, host.nbytes(), &t.memory_));
  t.view_.data = t.memory_.get();
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  DETDIT_RETURN_IF_ERROR(cuda_status(cudaMemcpyAsync(t.view_.data, host.data(), host.nbytes(), cudaMemcpyHostToDevice, s),
                                     "cudaMemcpyAsync to the device"));
  DETDIT_RETURN_IF_ERROR(cuda_status(cudaStreamSynchronize(s), "cudaStreamSynchronize"));
  *tensor = std::move(t);
  return Status();
#else
  (void)stream;
  return Status::runtime_error("a CUDA tensor needs a CUDA build of detdit");
#endif
}

Status DeviceTensor::empty(DType dtype, std::vector<int64_t> shape, const Device& device, DeviceTensor* tensor,
                           Stream stream) {
  if (!device.is_cuda()) {
    HostTensor canary(dtype, std::move(shape));
    canary.fill_bytes(kCanary);
    *tensor = on_host(std::move(canary));
    return Status();
  }
#if defined(DETDIT_WITH_CUDA)
  // the canary written on the device: no host buffer, no transfer
  if (shape.size() > static_cast<std::size_t>(kMaxRank))
    return Status::value_error("a tensor has at most " + std::to_string(kMaxRank) + " dims, got " +
                               std::to_string(shape.size()));
  DeviceTensor t;
  t.shape_ = std::move(shape);
  t.view_ = contiguous_view(nullptr, dtype, t.shape_);
  t.view_.device = device;
  DETDIT_RETURN_IF_ERROR(device_memory(device, t.view_.nbytes(), &t.memory_));
  t.view_.data = t.memory_.get();
  DETDIT_RETURN_IF_ERROR(t.fill_bytes(kCanary, stream));
  *tensor = std::move(t);
  return Status();
#else
  (void)stream;
  return Status::runtime_error("a CUDA tensor needs a CUDA build of detdit");
#endif
}

Status DeviceTensor::to_host(HostTensor* host, Stream stream) const {
  HostTensor copy(view_.dtype, shape_);
  if (!view_.device.is_cuda()) {
    copy_host_bytes(copy.data(), view_.data, copy.nbytes());
    *host = std::move(copy);
    return Status();
  }
#if defined(DETDIT_WITH_CUDA)
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  DETDIT_RETURN_IF_ERROR(cuda_status(cudaSetDevice(view_.device.index), "cudaSetDevice"));
  // No stream named: the work may be on any stream (non-blocking ones too).
  if (stream == nullptr) DETDIT_RETURN_IF_ERROR(cuda_status(cudaDeviceSynchronize(), "cudaDeviceSynchronize"));
  DETDIT_RETURN_IF_ERROR(cuda_status(
      cudaMemcpyAsync(copy.data(), view_.data, copy.nbytes(), cudaMemcpyDeviceToHost, s), "copy to the host"));
  DETDIT_RETURN_IF_ERROR(cuda_status(cudaStreamSynchronize(s), "cudaStreamSynchronize"));
  *host = std::move(copy);
  return Status();
#else
  (void)stream;
  return Status::runtime_error("a CUDA tensor needs a CUDA build of detdit");
#endif
}

Status DeviceTensor::fill_bytes(uint8_t value, Stream stream) {
  const std::size_t bytes = view_.nbytes();
  if (!view_.device.is_cuda()) {
    fill_host_bytes(view_.data, value, bytes);
    return Status();
  }
#if defined(DETDIT_WITH_CUDA)
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  DETDIT_RETURN_IF_ERROR(cuda_status(cudaMemsetAsync(view_.data, value, bytes, s), "cudaMemsetAsync"));
  return cuda_status(cudaStreamSynchronize(s), "cudaStreamSynchronize");
#else
  (void)stream;
  return Status::runtime_error("a CUDA tensor needs a CUDA build of detdit");
#endif
}

RankStream::RankStream(const Device& device) {
#if defined(DETDIT_WITH_CUDA)
  if (device.is_cuda()) {
    cudaSetDevice(device.index);
    cudaStream_t stream = nullptr;
    if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess) stream_ = stream;
  }
#else
  (void)device;
#endif
}

RankStream::~RankStream() {
#if defined(DETDIT_WITH_CUDA)
  if (stream_ != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
#endif
}

Status RankStream::synchronize() const {
#if defined(DETDIT_WITH_CUDA)
  if (stream_ != nullptr) {
    return cuda_status(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)), "cudaStreamSynchronize");
  }
#endif
  return Status();
}

namespace {

uint64_t element_bits(const void* base, int64_t i, std::size_t width) {
  uint64_t bits = 0;
  std::memcpy(&bits, static_cast<const char*>(base) + static_cast<std::size_t>(i) * width, width);
  return bits;
}

double bits_value(uint64_t bits, DType dtype) {
  switch (dtype) {
    case DType::kF32: return num::bits_float(static_cast<uint32_t>(bits));
    case DType::kBF16: return num::bf16_to_float(static_cast<uint16_t>(bits));
    case DType::kF16: return num::f16_to_float(static_cast<uint16_t>(bits));
    case DType::kI32: return static_cast<int32_t>(bits);
    case DType::kI64: return static_cast<double>(static_cast<int64_t>(bits));
  }
  return 0;
}

}  // namespace

uint64_t ulp_distance(uint64_t a, uint64_t b, DType dtype) {
  if (!dtype_is_float(dtype)) return a > b ? a - b : b - a;
  const uint64_t sign = 1ull << (dtype_size(dtype) * 8 - 1);
  // sign-magnitude onto a monotonic line
  auto key = [&](uint64_t v) -> int64_t {
    const int64_t magnitude = static_cast<int64_t>(v & (sign - 1));
    return (v & sign) ? -magnitude : magnitude;
  };
  const int64_t d = key(a) - key(b);
  return static_cast<uint64_t>(d < 0 ? -d : d);
}

Mismatch compare_bytes(const void* expected, const void* actual, int64_t count, DType dtype) {
  Mismatch m;
  m.dtype = dtype;
  m.compared = count;
  const std::size_t width = dtype_size(dtype);
  if (std::memcmp(expected, actual, static_cast<std::size_t>(count) * width) == 0) return m;
  for (int64_t i = 0; i < count; ++i) {
    const uint64_t a = element_bits(expected, i, width), b = element_bits(actual, i, width);
    if (a == b) continue;
    const uint64_t ulp = ulp_distance(a, b, dtype);
    if (m.count++ == 0) {
      m.first = i;
      m.expected_bits = a;
      m.actual_bits = b;
      m.first_ulp = ulp;
    }
    m.max_ulp = std::max(m.max_ulp, ulp);
  }
  return m;
}

Mismatch compare(const HostTensor& expected, const HostTensor& actual) {
  if (expected.dtype() != actual.dtype() || expected.numel() != actual.numel()) {
    Mismatch m;
    std::ostringstream os;
    os << "tensors differ in dtype or size: " << dtype_name(expected.dtype()) << "[" << expected.numel() << "] vs "
       << dtype_name(actual.dtype()) << "[" << actual.numel() << "]";
    m.shape_error = os.str();
    return m;
  }
  return compare_bytes(expected.data(), actual.data(), expected.numel(), expected.dtype());
}

std::string Mismatch::describe() const {
  if (!shape_error.empty()) return shape_error;
  std::ostringstream os;
  if (count == 0) {
    os << "all " << compared << " " << dtype_name(dtype) << " elements equal";
    return os.str();
  }
  os << count << " of " << compared << " " << dtype_name(dtype) << " elements differ; first at index " << first
     << ": expected 0x" << std::hex << expected_bits << " (" << std::dec << bits_value(expected_bits, dtype)
     << "), got 0x" << std::hex << actual_bits << " (" << std::dec << bits_value(actual_bits, dtype) << "), "
     << first_ulp << " ulp; max " << max_ulp << " ulp";
  return os.str();
}

bool all_bytes_are(const HostTensor& t, uint8_t value) {
  const auto* bytes = static_cast<const uint8_t*>(t.data());
  return std::all_of(bytes, bytes + t.nbytes(), [value](uint8_t b) { return b == value; });
}

}  // namespace cases
}  // namespace detdit
