// Private helpers of the CUDA backend: streams, error Status, the device
// guard, stream-ordered scratch memory and 16-byte vector access.
//
// Every launcher returns launch_status("<kernel>") right after its launch, so
// a failed launch becomes a RuntimeError naming the kernel. Nothing here
// synchronises the host, so a region of ops stays CUDA-graph capturable.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/storage.h"
#include "detdit/numerics.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {
namespace cuda {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xFFFFFFFFu;

inline cudaStream_t as_cuda_stream(Stream stream) { return static_cast<cudaStream_t>(stream); }

// RuntimeError "<what> failed: cudaErrorX (text)" for a failed CUDA call.
inline Status cuda_status(cudaError_t err, const std::string& what) {
  if (err == cudaSuccess) return Status();
  return Status::runtime_error(what + " failed: " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

// The status of the launch just made (checked right after every <<<>>>).
inline Status launch_status(const char* kernel) {
  return cuda_status(cudaGetLastError(), std::string("CUDA kernel ") + kernel);
}

// Blocks of `threads` covering `count` items (count > 0).
inline unsigned blocks_for(int64_t count, int threads) {
  return static_cast<unsigned>((count + threads - 1) / threads);
}

// Makes the tensors' device current for the duration of an op (launches go to
// the current device) and restores the caller's device afterwards.
class DeviceGuard {
 public:
  DeviceGuard() = default;
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  Status enter(const Device& device) {
    DETDIT_RETURN_IF_ERROR(cuda_status(cudaGetDevice(&previous_), "cudaGetDevice"));
    if (previous_ != device.index) {
      const cudaError_t set = cudaSetDevice(device.index);
      if (set != cudaSuccess) {
        // The failed call is also the thread's last error: clear it, or the next launch
        // check (ours or the caller's) would report it.
        cudaGetLastError();
        return cuda_status(set, "cudaSetDevice(" + std::to_string(device.index) + ")");
      }
      restore_ = true;
    }
    return Status();
  }
  ~DeviceGuard() {
    if (restore_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool restore_ = false;
};

// 16 bytes of storage type T unpacked to FP32: kElems = 16 / sizeof(T).
template <typename T>
struct Vec16 {
  static constexpr int kElems = static_cast<int>(16 / sizeof(T));
};

__device__ __forceinline__ uint4 load16(const void* p) { return __ldg(static_cast<const uint4*>(p)); }

// Exact widening of the lanes of a 16-byte vector, in element order.
__device__ __forceinline__ void unpack16(const uint4& v, float (&out)[4]) {
  out[0] = num::bits_float(v.x);
  out[1] = num::bits_float(v.y);
  out[2] = num::bits_float(v.z);
  out[3] = num::bits_float(v.w);
}
__device__ __forceinline__ void unpack16(const uint4& v, float (&out)[8]) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // little endian: the low half is the earlier bf16
    out[2 * i] = num::bits_float(words[i] << 16);
    out[2 * i + 1] = num::bits_float(words[i] & 0xFFFF0000u);
  }
}

// Raw storage of kBytes bytes (2, 4, 8 or 16): one load or store instruction.
template <int kBytes>
struct RawVec;
template <>
struct RawVec<2> { using Type = uint16_t; };
template <>
struct RawVec<4> { using Type = uint32_t; };
template <>
struct RawVec<8> { using Type = uint2; };
template <>
struct RawVec<16> { using Type = uint4; };

// kElems consecutive elements of storage type T, as one access of
// kElems * sizeof(T) bytes; p must be aligned to that many bytes.
template <typename T, int kElems>
union ElemVec {
  typename RawVec<kElems * static_cast<int>(sizeof(T))>::Type raw;
  T elems[kElems];
};

// kElems elements kept in their storage type, widened where they are used:
// bf16/fp16 take half the registers of the widened FP32 values (the row
// kernels cache a thread's whole share of a row between two passes).
template <typename T, int kElems, bool kVector>
__device__ __forceinline__ void load_stored(const T* p, ElemVec<T, kElems>& out) {
  if constexpr (kVector) {
    out.raw = *reinterpret_cast<const decltype(out.raw)*>(p);
  } else {
#pragma unroll
    for (int e = 0; e < kElems; ++e) out.elems[e] = p[e];
  }
}
template <typename T, int kElems>
__device__ __forceinline__ void widen(const ElemVec<T, kElems>& in, float (&out)[kElems]) {
#pragma unroll
  for (int e = 0; e < kElems; ++e) out[e] = to_float(in.elems[e]);
}

template <typename T, int kElems>
__device__ __forceinline__ void load_vec(const T* p, float (&out)[kElems]) {
  ElemVec<T, kElems> v;
  load_stored<T, kElems, true>(p, v);
  widen(v, out);
}

template <typename T, int kElems>
__device__ __forceinline__ void store_vec(T* p, const float (&in)[kElems]) {
  ElemVec<T, kElems> v;
#pragma unroll
  for (int e = 0; e < kElems; ++e) v.elems[e] = from_float<T>(in[e]);
  *reinterpret_cast<decltype(v.raw)*>(p) = v.raw;
}

// kElems consecutive elements as one vector access (kVector) or as kElems
// scalar accesses (any alignment). The values are the same either way.
template <typename T, int kElems, bool kVector>
__device__ __forceinline__ void load_elems(const T* p, float (&out)[kElems]) {
  ElemVec<T, kElems> v;
  load_stored<T, kElems, kVector>(p, v);
  widen(v, out);
}
template <typename T, int kElems, bool kVector>
__device__ __forceinline__ void store_elems(T* p, const float (&in)[kElems]) {
  if constexpr (kVector) {
    store_vec<T, kElems>(p, in);
  } else {
#pragma unroll
    for (int e = 0; e < kElems; ++e) p[e] = from_float<T>(in[e]);
  }
}

// kElems elements of data no thread of the kernel writes (weights, tables,
// inputs: every op's validation keeps its outputs disjoint from its inputs),
// through the read-only path (ld.global.nc): the compiler may issue such
// loads ahead of the thread's earlier stores, which an ordinary load of a
// possibly aliased pointer may not pass.
template <typename T, int kElems, bool kVector>
__device__ __forceinline__ void load_readonly(const T* p, float (&out)[kElems]) {
  ElemVec<T, kElems> v;
  if constexpr (kVector) {
    v.raw = __ldg(reinterpret_cast<const decltype(v.raw)*>(p));
  } else {
#pragma unroll
    for (int e = 0; e < kElems; ++e) {
      ElemVec<T, 1> one;
      one.raw = __ldg(reinterpret_cast<const decltype(one.raw)*>(p + e));
      v.elems[e] = one.elems[0];
    }
  }
  widen(v, out);
}

// True when the address is a multiple of `bytes`.
inline bool address_aligned(const void* p, std::size_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

}  // namespace cuda
}  // namespace detdit
