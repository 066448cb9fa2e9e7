// Device memory of the CUDA backend:
//   copy_to_host / upload_tables: plan building (reads a CUDA index once and
//     uploads the tables, synchronising the stream; this happens before any op
//     runs, so op regions stay graph capturable);
//   allocate_scratch / upcast_to_f32 (src/common/scratch.h): stream-ordered
//     temporaries of composite ops and an exact widening copy; no host sync.
//     Scratch comes from one detdit memory pool per device that keeps what it
//     has mapped: the device's default pool returns freed memory to the driver
//     at every synchronisation (its release threshold is 0), so an op called
//     between host syncs, as a trainer's step or a timing loop does, would map
//     its scratch again each call (on an H200 6-19 % of a backward timed on
//     its own: docs/benchmarking.md). The pool holds the largest scratch
//     footprint reached, for detdit's use only, until release_scratch_memory
//     (include/detdit/memory.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
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

constexpr int kMaxDevices = 64;
std::mutex scratch_pools_mutex;
cudaMemPool_t scratch_pools[kMaxDevices] = {};  // made on first use, then kept for the process

// The scratch pool of device `ordinal`, made on first use and never destroyed
// (the runtime may be gone at exit).
Status scratch_pool(int ordinal, cudaMemPool_t* pool) {
  if (ordinal < 0 || ordinal >= kMaxDevices)
    return Status::runtime_error("CUDA device " + std::to_string(ordinal) + ": detdit's scratch pools cover devices 0.." +
                                 std::to_string(kMaxDevices - 1));
  std::lock_guard<std::mutex> lock(scratch_pools_mutex);
  if (scratch_pools[ordinal] == nullptr) {
    cudaMemPoolProps props = {};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = ordinal;
    cudaMemPool_t made = nullptr;
    DETDIT_RETURN_IF_ERROR(cuda_status(cudaMemPoolCreate(&made, &props), "cudaMemPoolCreate for scratch"));
    // Keep every mapped byte across synchronisations (the reason for the pool).
    uint64_t keep_all = UINT64_MAX;
    const cudaError_t set = cudaMemPoolSetAttribute(made, cudaMemPoolAttrReleaseThreshold, &keep_all);
    if (set != cudaSuccess) {
      cudaMemPoolDestroy(made);
      return cuda_status(set, "cudaMemPoolSetAttribute(release threshold) of the scratch pool");
    }
    scratch_pools[ordinal] = made;
  }
  *pool = scratch_pools[ordinal];
  return Status();
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
  cudaMemPool_t pool = nullptr;
  DETDIT_RETURN_IF_ERROR(scratch_pool(device.index, &pool));
  void* memory = nullptr;
  DETDIT_RETURN_IF_ERROR(cuda_status(cudaMallocFromPoolAsync(&memory, bytes > 0 ? bytes : 256, pool, s),
                                     "cudaMallocFromPoolAsync of " + std::to_string(bytes) + " bytes of scratch"));
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

Status release_scratch_memory(const Device& device) {
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(device));
  std::lock_guard<std::mutex> lock(scratch_pools_mutex);
  if (device.index < 0 || device.index >= kMaxDevices || scratch_pools[device.index] == nullptr) return Status();
  return cuda_status(cudaMemPoolTrimTo(scratch_pools[device.index], 0), "cudaMemPoolTrimTo of the scratch pool");
}

Status scratch_reserved_bytes(const Device& device, uint64_t* bytes) {
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(device));
  std::lock_guard<std::mutex> lock(scratch_pools_mutex);
  *bytes = 0;
  if (device.index < 0 || device.index >= kMaxDevices || scratch_pools[device.index] == nullptr) return Status();
  return cuda_status(cudaMemPoolGetAttribute(scratch_pools[device.index], cudaMemPoolAttrReservedMemCurrent, bytes),
                     "cudaMemPoolGetAttribute(reserved memory) of the scratch pool");
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
