// The elementwise helpers on CUDA (src/common/backends.h), bitwise equal to
// src/cpu/elementwise.cc:
//   add:         out[i] = R_T(rn(a[i] + b[i])) (numerics 5.10); 16-byte vectors
//                when a, b and out are 16-byte aligned, the last numel % (16 /
//                sizeof(T)) elements (or all of them, unaligned) one per thread;
//                element-local, so any geometry gives the same bytes;
//   copy_tensor: cudaMemcpyAsync device to device; fill_zero: cudaMemsetAsync.
// Everything is queued on the caller's stream; nothing synchronises the host.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/backends.h"
#include "common/scalar_math.h"
#include "common/storage.h"
#include "cuda/cuda_util.cuh"
#include "cuda/tuning.h"

namespace detdit {
namespace cuda {
namespace {

// Thread v adds the 16-byte vector v: elements [v*kElems, (v+1)*kElems).
// No __ldg / __restrict__: out may be a or b (in-place accumulation).
template <typename T>
__global__ void add_vectors_kernel(const T* a, const T* b, T* out, int64_t vectors) {
  constexpr int kElems = Vec16<T>::kElems;
  const int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (v >= vectors) return;
  float lhs[kElems], rhs[kElems], sum[kElems];
  load_vec<T, kElems>(a + v * kElems, lhs);
  load_vec<T, kElems>(b + v * kElems, rhs);
#pragma unroll
  for (int e = 0; e < kElems; ++e) sum[e] = num::add32(lhs[e], rhs[e]);
  store_vec<T, kElems>(out + v * kElems, sum);
}

// Thread i adds element begin + i, for i < count.
template <typename T>
__global__ void add_elements_kernel(const T* a, const T* b, T* out, int64_t begin, int64_t count) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  out[begin + i] = from_float<T>(num::add32(to_float(a[begin + i]), to_float(b[begin + i])));
}

}  // namespace

Status add(const TensorView& a, const TensorView& b, const TensorView& out, Stream stream) {
  const int64_t elements = out.numel();
  if (elements == 0) return Status();
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(out.device));
  const int threads = launch_tuning().elementwise_threads;
  cudaStream_t s = as_cuda_stream(stream);
  return dispatch_float_dtype(out.dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kElems = Vec16<T>::kElems;
    const bool vector = address_aligned(a.data, 16) && address_aligned(b.data, 16) && address_aligned(out.data, 16);
    const int64_t vectors = vector ? elements / kElems : 0, tail = vectors * kElems;
    if (vectors > 0) {
      add_vectors_kernel<T><<<blocks_for(vectors, threads), threads, 0, s>>>(a.ptr<const T>(), b.ptr<const T>(),
                                                                               out.ptr<T>(), vectors);
      DETDIT_RETURN_IF_ERROR(launch_status("add_vectors_kernel"));
    }
    if (tail == elements) return Status();
    add_elements_kernel<T><<<blocks_for(elements - tail, threads), threads, 0, s>>>(
        a.ptr<const T>(), b.ptr<const T>(), out.ptr<T>(), tail, elements - tail);
    return launch_status("add_elements_kernel");
  });
}

Status copy_tensor(const TensorView& src, const TensorView& dst, Stream stream) {
  const std::size_t bytes = dst.nbytes();
  if (bytes == 0) return Status();
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(dst.device));
  return cuda_status(cudaMemcpyAsync(dst.data, src.data, bytes, cudaMemcpyDeviceToDevice, as_cuda_stream(stream)),
                     "cudaMemcpyAsync of " + std::to_string(bytes) + " bytes device to device");
}

Status fill_zero(const TensorView& t, Stream stream) {
  const std::size_t bytes = t.nbytes();
  if (bytes == 0) return Status();
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(t.device));
  return cuda_status(cudaMemsetAsync(t.data, 0, bytes, as_cuda_stream(stream)),
                     "cudaMemsetAsync of " + std::to_string(bytes) + " bytes");
}

}  // namespace cuda
}  // namespace detdit
