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
//     its own). The pool keeps what its scratch mapped,
//     for detdit's use only, until release_scratch_memory
//     (include/detdit/memory.h) or an allocation that finds the device full
//     (which trims the pool and tries once more).
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

// RuntimeError unless detdit's pools cover `ordinal`.
Status check_pool_slot(int ordinal) {
  if (ordinal >= 0 && ordinal < kMaxDevices) return Status();
  return Status::runtime_error("CUDA device " + std::to_string(ordinal) + ": detdit's scratch pools cover devices 0.." +
                               std::to_string(kMaxDevices - 1));
}

// RuntimeError unless `ordinal` names a CUDA device of this process that the
// pools cover (asks the runtime only: no context is made).
Status check_ordinal(int ordinal) {
  int count = 0;
  DETDIT_RETURN_IF_ERROR(cuda_status(cudaGetDeviceCount(&count), "cudaGetDeviceCount"));
  if (ordinal < 0 || ordinal >= count)
    return Status::runtime_error("no CUDA device " + std::to_string(ordinal) + " (this process sees " +
                                 std::to_string(count) + ")");
  return check_pool_slot(ordinal);
}

// The scratch pool of device `ordinal` (a device the caller entered), made on
// first use and never destroyed (the runtime may be gone at exit). Made in
// relaxed capture mode: the first op may run inside a stream capture, whose
// global mode refuses the pool's creation.
Status scratch_pool(int ordinal, cudaMemPool_t* pool) {
  DETDIT_RETURN_IF_ERROR(check_pool_slot(ordinal));
  std::lock_guard<std::mutex> lock(scratch_pools_mutex);
  if (scratch_pools[ordinal] == nullptr) {
    cudaMemPoolProps props = {};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = ordinal;
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    DETDIT_RETURN_IF_ERROR(cuda_status(cudaThreadExchangeStreamCaptureMode(&mode), "cudaThreadExchangeStreamCaptureMode"));
    cudaMemPool_t made = nullptr;
    cudaError_t err = cudaMemPoolCreate(&made, &props);
    const char* what = "cudaMemPoolCreate for scratch";
    if (err == cudaSuccess) {
      // Keep every mapped byte across synchronisations (the reason for the pool).
      uint64_t keep_all = UINT64_MAX;
      err = cudaMemPoolSetAttribute(made, cudaMemPoolAttrReleaseThreshold, &keep_all);
      what = "cudaMemPoolSetAttribute(release threshold) of the scratch pool";
      if (err != cudaSuccess) cudaMemPoolDestroy(made);
    }
    cudaThreadExchangeStreamCaptureMode(&mode);
    DETDIT_RETURN_IF_ERROR(cuda_status(err, what));
    scratch_pools[ordinal] = made;
  }
  *pool = scratch_pools[ordinal];
  return Status();
}

// The pool of `ordinal` if one was made, else nullptr (the ordinal checked).
Status existing_scratch_pool(int ordinal, cudaMemPool_t* pool) {
  DETDIT_RETURN_IF_ERROR(check_ordinal(ordinal));
  std::lock_guard<std::mutex> lock(scratch_pools_mutex);
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
  const std::size_t request = bytes > 0 ? bytes : 256;
  void* memory = nullptr;
  cudaError_t err = cudaMallocFromPoolAsync(&memory, request, pool, s);
  if (err == cudaErrorMemoryAllocation) {
    // The pool keeps what earlier scratch mapped, which other allocators cannot take:
    // hand back what no allocation holds, then try once more.
    cudaGetLastError();
    cudaMemPoolTrimTo(pool, 0);
    err = cudaMallocFromPoolAsync(&memory, request, pool, s);
  }
  if (err != cudaSuccess) cudaGetLastError();
  DETDIT_RETURN_IF_ERROR(cuda_status(err, "cudaMallocFromPoolAsync of " + std::to_string(bytes) + " bytes of scratch"));
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
  cudaMemPool_t pool = nullptr;
  DETDIT_RETURN_IF_ERROR(existing_scratch_pool(device.index, &pool));
  if (pool == nullptr) return Status();  // nothing was ever taken on this device
  return cuda_status(cudaMemPoolTrimTo(pool, 0), "cudaMemPoolTrimTo of the scratch pool");
}

Status scratch_reserved_bytes(const Device& device, uint64_t* bytes) {
  *bytes = 0;
  cudaMemPool_t pool = nullptr;
  DETDIT_RETURN_IF_ERROR(existing_scratch_pool(device.index, &pool));
  if (pool == nullptr) return Status();
  return cuda_status(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, bytes),
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
