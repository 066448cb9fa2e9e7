// The profile's transcendental functions on the device (docs/numerics.md 4):
// portable = detdit's own num:: functions (bitwise equal to the CPU); torch =
// the functions PyTorch's CUDA kernels call (precise libdevice expf / sinf /
// cosf, hardware rsqrtf). The profile changes these four functions only.
#pragma once

#include "common/pointwise_math.h"
#include "common/scalar_math.h"

namespace detdit {
namespace cuda {

__device__ __forceinline__ float exp_p(float x, bool torch) { return torch ? expf(x) : num::portable_exp(x); }
__device__ __forceinline__ float sin_p(float x, bool torch) { return torch ? sinf(x) : num::portable_sin(x); }
__device__ __forceinline__ float cos_p(float x, bool torch) { return torch ? cosf(x) : num::portable_cos(x); }
__device__ __forceinline__ float rsqrt_p(float x, bool torch) { return torch ? rsqrtf(x) : num::portable_rsqrt(x); }

// exp_P as the ExpFn of src/common/pointwise_math.h.
struct ProfileExp {
  bool torch;
  __device__ __forceinline__ float operator()(float x) const { return exp_p(x, torch); }
};

// silu_P(z) = rn(z / rn(1 + exp_P(-z))) (numerics 5.4; torch's F.silu).
__device__ __forceinline__ float silu_p(float z, bool torch) { return silu_value(z, ProfileExp{torch}); }

}  // namespace cuda
}  // namespace detdit
