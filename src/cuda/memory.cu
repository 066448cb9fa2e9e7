// Device memory of the CUDA backend:
//   copy_to_host / upload_tables: plan building (reads a CUDA index once and
//     uploads the tables, synchronising the stream; this happens before any op
//     runs, so op regions stay graph capturable);
//   allocate_scratch / upcast_to_f32 (src/common/scratch.h): stream-ordered
//     temporaries of composite ops and an exact widening copy; no host sync.
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "common/backends.h"
#include "common/scratch.h"
#include "common/storage.h"
#include "cuda/tuning.h"
#include "cuda/cuda_util.cuh"

namespace detdit {
namespace cuda {
namespace {

template <typename In>
__global__ void upcast_to_f32_kernel(const In* src, float* dst, int64_t elements) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= elements) return;
  dst[i] = to_float(src[i]);
}

}  // namespace

Status copy_to_host(const void* device_src, void* host_dst, std::size_t bytes, const Device& device, Stream stream) {
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(device));
  cudaStream_t s = as_cuda_stream(stream);
  DETDIT_RETURN_IF_ERROR(cuda_status(cudaMemcpyAsync(host_dst, device_src, bytes, cudaMemcpyDeviceToHost, s),
                                     "cudaMemcpyAsync of " + std::to_string(bytes) + " bytes to the host"));
  return cuda_status(cudaStreamSynchronize(s), "cudaStreamSynchronize after the copy to the host");
}

Status upload_tables(const Device& device, const std::vector<const std::vector<int32_t>*>& arrays,
                     std::vector<const int32_t*>* device_ptrs, std::shared_ptr<void>* owner, Stream stream) {
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(device));
  // One allocation; each array starts on a 16-byte boundary.
  std::vector<std::size_t> offsets;
  std::size_t total = 0;
  for (const std::vector<int32_t>* a : arrays) {
    offsets.push_back(total);
    total += (a->size() * sizeof(int32_t) + 15) / 16 * 16;
  }
  std::vector<char> staging(total == 0 ? 16 : total, 0);
  for (std::size_t i = 0; i < arrays.size(); ++i)
    if (!arrays[i]->empty())
      std::copy_n(reinterpret_cast<const char*>(arrays[i]->data()), arrays[i]->size() * sizeof(int32_t),
                  staging.data() + offsets[i]);
  void* memory = nullptr;
  DETDIT_RETURN_IF_ERROR(cuda_status(cudaMalloc(&memory, staging.size()),
                                     "cudaMalloc of " + std::to_string(staging.size()) + " bytes for plan tables"));
  const int ordinal = device.index;
  std::shared_ptr<void> holder(memory, [ordinal](void* p) {
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(ordinal);
    cudaFree(p);
    cudaSetDevice(previous);
  });
  cudaStream_t s = as_cuda_stream(stream);
  DETDIT_RETURN_IF_ERROR(
      cuda_status(cudaMemcpyAsync(memory, staging.data(), staging.size(), cudaMemcpyHostToDevice, s),
                  "cudaMemcpyAsync of the plan tables"));
  // staging is pageable host memory that dies on return: wait for the copy.
  DETDIT_RETURN_IF_ERROR(cuda_status(cudaStreamSynchronize(s), "cudaStreamSynchronize after the plan upload"));
  device_ptrs->clear();
  for (std::size_t i = 0; i < arrays.size(); ++i)
    device_ptrs->push_back(reinterpret_cast<const int32_t*>(static_cast<char*>(memory) + offsets[i]));
  *owner = std::move(holder);
  return Status();
}

Status allocate_scratch(const Device& device, std::size_t bytes, Stream stream, std::shared_ptr<void>* owner) {
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(device));
  cudaStream_t s = as_cuda_stream(stream);
  void* memory = nullptr;
  DETDIT_RETURN_IF_ERROR(cuda_status(cudaMallocAsync(&memory, bytes > 0 ? bytes : 256, s),
                                     "cudaMallocAsync of " + std::to_string(bytes) + " bytes of scratch"));
  const int ordinal = device.index;
  // Freed on the same stream, after every launch queued before the release.
  *owner = std::shared_ptr<void>(memory, [ordinal, s](void* p) {
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(ordinal);
    cudaFreeAsync(p, s);
    cudaSetDevice(previous);
  });
  return Status();
}

Status upcast_to_f32(const TensorView& src, const TensorView& dst, Stream stream) {
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(src.device));
  const int64_t elements = src.numel();
  if (elements == 0) return Status();
  const int threads = launch_tuning().elementwise_threads;
  return dispatch_float_dtype(src.dtype, [&](auto tag) {
    using In = decltype(tag);
    upcast_to_f32_kernel<In><<<blocks_for(elements, threads), threads, 0, as_cuda_stream(stream)>>>(
        src.ptr<const In>(), dst.ptr<float>(), elements);
    return launch_status("upcast_to_f32_kernel");
  });
}

}  // namespace cuda
}  // namespace detdit
