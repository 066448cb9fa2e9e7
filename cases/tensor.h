// Owned tensors, deterministic values and the one bitwise comparison of the
// op-case library (cases/), used by the tests, `detdit verify` and `detdit
// bench` alike.
//
// HostTensor owns contiguous, 64-byte aligned host memory (copies are deep and
// keep the alignment). DeviceTensor owns the memory of one tensor on a device:
// host memory for Device::cpu(), cudaMalloc memory for a CUDA device (CUDA
// builds). Every fallible call returns a Status; nothing aborts.
//
// Outputs start as the canary: every byte kCanary (0xA5, about -2.9e-16 as
// bf16 or fp32), so an element an op did not write keeps it and shows.
// A Mismatch reports what differs between two tensors' bytes: the count, the
// first index, both values in hex and decimal, and the ulp distance.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "detdit/numerics.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {
namespace cases {

constexpr uint8_t kCanary = 0xA5;

class HostTensor {
 public:
  HostTensor() = default;
  // Zero bytes of `shape`.
  HostTensor(DType dtype, std::vector<int64_t> shape);
  HostTensor(const HostTensor& other);
  HostTensor& operator=(const HostTensor& other);
  HostTensor(HostTensor&&) = default;
  HostTensor& operator=(HostTensor&&) = default;

  TensorView view() const;
  // The same bytes under another shape with the same element count.
  TensorView view_as(std::initializer_list<int64_t> shape) const;
  void* data() const { return data_; }
  template <typename T>
  T* ptr() const {
    return static_cast<T*>(data_);
  }
  std::size_t nbytes() const { return nbytes_; }
  int64_t numel() const;
  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  void fill_bytes(uint8_t value);
  // Element i as a double (float dtypes exactly; integers converted).
  double get(int64_t i) const;
  // Element i = v rounded to the dtype (RNE for floats, truncation for integers).
  void set(int64_t i, double v);

 private:
  DType dtype_ = DType::kF32;
  std::vector<int64_t> shape_;
  std::size_t nbytes_ = 0;
  std::shared_ptr<void> memory_;
  void* data_ = nullptr;
};

// ---- deterministic values, each rounded once to the tensor's dtype ----------

// N(mean, std) from std::mt19937_64(seed): the tests' inputs.
void fill_normal(HostTensor* t, uint64_t seed, double mean = 0.0, double std = 1.0);
// U[lo, hi) from std::mt19937_64(seed).
void fill_uniform(HostTensor* t, uint64_t seed, double lo, double hi);
// mean + std * u * sqrt(3), u uniform on [-1, 1) from a splitmix64 hash of
// (seed, first + i): fast for H3-sized tensors (about 1e8 elements a second),
// and element i of a tensor filled with `first` = k equals element k + i of one
// filled from 0, so a slice of rows can be regenerated on its own.
void fill_counter_uniform(HostTensor* t, uint64_t seed, double mean, double std, int64_t first = 0);
// The synthetic-weights generator (io/synth.h) on the stream `stream`:
// detdit verify and bench draw their inputs from it.
void fill_stream_normal(HostTensor* t, uint64_t seed, const char* stream, double mean = 0.0, double std = 1.0);
// mean + std * (sum of 4 uniforms on [0, 1) - 2) * sqrt(3): an approximately
// normal (Irwin-Hall) variate from a splitmix64 stream per block of 65536
// elements, deterministic for any thread count; fast for H3-sized weights.
void fill_approx_normal(HostTensor* t, uint64_t seed, double mean, double std);
// A tensor of `shape` filled by fill_normal.
HostTensor random_tensor(DType dtype, std::vector<int64_t> shape, uint64_t seed, double mean = 0.0, double std = 1.0);

class DeviceTensor {
 public:
  DeviceTensor() = default;
  // A copy of `host` on `device` (for a CUDA device: ordered on `stream`, then
  // the stream is synchronised, so the host tensor may go away).
  static Status from_host(const HostTensor& host, const Device& device, DeviceTensor* tensor,
                          Stream stream = nullptr);
  // `shape` on `device`, every byte kCanary.
  static Status empty(DType dtype, std::vector<int64_t> shape, const Device& device, DeviceTensor* tensor,
                      Stream stream = nullptr);
  const TensorView& view() const { return view_; }
  const Device& device() const { return view_.device; }
  const std::vector<int64_t>& shape() const { return shape_; }
  // A host copy after the work queued on `stream` (CUDA: synchronises that
  // stream only; nullptr: the whole device, whatever stream the work is on).
  Status to_host(HostTensor* host, Stream stream = nullptr) const;
  // Every byte = value (CUDA: ordered on `stream`, which is then synchronised).
  Status fill_bytes(uint8_t value, Stream stream = nullptr);

 private:
  static DeviceTensor on_host(HostTensor host);  // a CPU tensor owning `host`'s memory
  std::shared_ptr<void> memory_;
  TensorView view_;
  std::vector<int64_t> shape_;
};

// A rank's own stream: a non-blocking CUDA stream on a CUDA device (nullptr
// on the CPU, or when CUDA could not create one: then the rank's work goes to
// the legacy stream); destroyed with the object.
class RankStream {
 public:
  explicit RankStream(const Device& device);
  ~RankStream();
  RankStream(const RankStream&) = delete;
  RankStream& operator=(const RankStream&) = delete;
  Stream get() const { return stream_; }
  Status synchronize() const;

 private:
  Stream stream_ = nullptr;
};

// ---- the one bitwise comparison ------------------------------------------

struct Mismatch {
  DType dtype = DType::kF32;
  int64_t compared = 0;  // elements compared
  int64_t count = 0;     // elements whose bytes differ
  int64_t first = -1;    // index of the first one
  uint64_t expected_bits = 0, actual_bits = 0;  // at `first`
  uint64_t first_ulp = 0, max_ulp = 0;
  std::string shape_error;  // set when the tensors differ in dtype or size (nothing compared)

  bool equal() const { return shape_error.empty() && count == 0; }
  // "3 of 1024 bfloat16 elements differ; first at index 17: expected 0x3f80 (1),
  // got 0x3f81 (1.0078125), 1 ulp; max 2 ulp"
  std::string describe() const;
};
Mismatch compare_bytes(const void* expected, const void* actual, int64_t count, DType dtype);
Mismatch compare(const HostTensor& expected, const HostTensor& actual);
// Distance in units in the last place of two values given as raw bits (for an
// integer dtype, the difference of the integers).
uint64_t ulp_distance(uint64_t a_bits, uint64_t b_bits, DType dtype);
// Every byte of t equals `value`.
bool all_bytes_are(const HostTensor& t, uint8_t value);

}  // namespace cases
}  // namespace detdit
