// Device buffers for the CUDA tests: upload a HostTensor, download into one,
// fill with a canary, and the pairs of host / device tensors that a
// CPU-vs-GPU comparison runs on. Every CUDA call is checked (ASSERT/ADD_FAILURE).
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/cases.h"
#include "common/test_util.h"
#include "detdit/plan.h"
#include "detdit/tensor.h"

namespace detdit {
namespace testing {

#define DETDIT_CUDA_CHECK(expr)                                                   \
  do {                                                                            \
    cudaError_t e_ = (expr);                                                      \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(e_);        \
  } while (0)

// Owned device memory with the dtype and shape of a HostTensor (contiguous).
class DeviceTensor {
 public:
  DeviceTensor() = default;
  DeviceTensor(DType dtype, std::vector<int64_t> shape) : dtype_(dtype), shape_(std::move(shape)) {
    int64_t n = 1;
    for (int64_t s : shape_) n *= s;
    bytes_ = static_cast<std::size_t>(n) * dtype_size(dtype_);
    void* p = nullptr;
    if (cudaMalloc(&p, bytes_ > 0 ? bytes_ : 16) != cudaSuccess) {
      ADD_FAILURE() << "cudaMalloc of " << bytes_ << " bytes failed";
      p = nullptr;
    }
    data_ = std::shared_ptr<void>(p, [](void* q) { cudaFree(q); });
  }
  // A device copy of a host tensor.
  static DeviceTensor upload(const HostTensor& host) {
    DeviceTensor d(host.dtype(), host.shape());
    if (cudaMemcpy(d.data(), host.data(), host.nbytes(), cudaMemcpyHostToDevice) != cudaSuccess)
      ADD_FAILURE() << "upload failed";
    return d;
  }
  HostTensor download() const {
    HostTensor h(dtype_, shape_);
    if (cudaDeviceSynchronize() != cudaSuccess || cudaMemcpy(h.data(), data(), bytes_, cudaMemcpyDeviceToHost) != cudaSuccess)
      ADD_FAILURE() << "download failed: " << cudaGetErrorString(cudaGetLastError());
    return h;
  }
  // Synchronous: cudaMemset runs on the legacy default stream, which is not
  // ordered with non-blocking streams, so without the synchronize a canary
  // could land after (or during) the kernels of a test's own stream.
  void fill_bytes(uint8_t value) {
    if (cudaMemset(data(), value, bytes_) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess)
      ADD_FAILURE() << "cudaMemset failed";
  }
  void* data() const { return data_.get(); }
  std::size_t nbytes() const { return bytes_; }
  TensorView view() const {
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
    v.device = Device::cuda(0);
    return v;
  }

 private:
  DType dtype_ = DType::kF32;
  std::vector<int64_t> shape_;
  std::size_t bytes_ = 0;
  std::shared_ptr<void> data_;
};

// The same tensor on the host (CPU run) and on the device (GPU run). Inputs
// hold equal bytes on both sides; outputs start as the canary on both sides.
struct Pair {
  HostTensor host;
  DeviceTensor dev;
  TensorView h() const { return host.view(); }
  TensorView d() const { return dev.view(); }
  HostTensor result() const { return dev.download(); }
};
// (HostTensor copies would lose the 64-byte alignment: always clone.)
inline Pair input_pair(const HostTensor& t) { return Pair{clone(t), DeviceTensor::upload(t)}; }
inline Pair output_pair(DType dtype, std::vector<int64_t> shape) {
  HostTensor host(dtype, shape);
  host.fill_bytes(kCanary);
  DeviceTensor dev(dtype, shape);
  dev.fill_bytes(kCanary);
  return Pair{std::move(host), std::move(dev)};
}
// Deterministic inputs, uniform with the given mean and standard deviation,
// rounded to dtype. A counter hash (splitmix64) instead of fill_normal, so the
// H3-sized inputs (hundreds of millions of elements) take about a second.
inline HostTensor fast_random(DType dtype, std::vector<int64_t> shape, uint64_t seed, double mean, double std) {
  HostTensor t(dtype, std::move(shape));
  const double half_width = std * 1.7320508075688772;  // uniform on [-sqrt(3), sqrt(3)) has unit variance
  for (int64_t i = 0; i < t.numel(); ++i) {
    uint64_t z = (seed * 0x9E3779B97F4A7C15ull) + static_cast<uint64_t>(i) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const double unit = static_cast<double>(z >> 11) * 0x1.0p-53;  // [0, 1)
    t.set(i, mean + (2.0 * unit - 1.0) * half_width);
  }
  return t;
}
inline Pair random_pair(DType dtype, std::vector<int64_t> shape, uint64_t seed, double mean = 0.0, double std = 1.0) {
  return input_pair(fast_random(dtype, std::move(shape), seed, mean, std));
}

// GPU bytes equal CPU bytes, and the CPU output is not the canary (the
// comparison is not vacuous: the op wrote something).
inline ::testing::AssertionResult gpu_equals_cpu(const Pair& p) {
  if (p.host.nbytes() > 0 && all_bytes_are(p.host, kCanary))
    return ::testing::AssertionFailure() << "the CPU output is still the canary (nothing was written)";
  return bitwise_equal(p.host, p.result());
}
#define EXPECT_GPU_EQ_CPU(pair) EXPECT_TRUE(::detdit::testing::gpu_equals_cpu(pair)) << #pair

// A plan on the device built from device copies of the case's int64 index
// tensors (exercises the CUDA path of plan building), and its host twin.
struct PlanPair {
  IndexPlan host, dev;
};
inline PlanPair adaln_plan_pair(const IndexCase& c) {
  PlanPair plans;
  plans.host = adaln_plan(c);
  HostTensor ti(DType::kI64, {c.seq_len}), tags(DType::kI64, {c.seq_len});
  for (int64_t s = 0; s < c.seq_len; ++s) {
    ti.ptr<int64_t>()[s] = c.timestep_indices[s];
    tags.ptr<int64_t>()[s] = c.tags[s];
  }
  DeviceTensor dti = DeviceTensor::upload(ti), dtags = DeviceTensor::upload(tags);
  Status s = IndexPlan::from_timesteps_and_tags(dti.view(), dtags.view(), c.num_timesteps, c.batch, &plans.dev);
  if (!s.ok()) ADD_FAILURE() << s.to_string();
  return plans;
}
inline PlanPair row_plan_pair(const std::vector<int64_t>& rows, int64_t num_rows, int64_t batch) {
  PlanPair plans;
  plans.host = plan_from_rows(rows, num_rows, batch);
  HostTensor index(DType::kI64, {static_cast<int64_t>(rows.size())});
  for (std::size_t s = 0; s < rows.size(); ++s) index.ptr<int64_t>()[s] = rows[s];
  DeviceTensor d = DeviceTensor::upload(index);
  Status s = IndexPlan::from_row_index(d.view(), num_rows, batch, &plans.dev);
  if (!s.ok()) ADD_FAILURE() << s.to_string();
  return plans;
}
inline PlanPair timestep_plan_pair(const IndexCase& c) { return row_plan_pair(c.timestep_indices, c.num_timesteps, c.batch); }

}  // namespace testing
}  // namespace detdit
