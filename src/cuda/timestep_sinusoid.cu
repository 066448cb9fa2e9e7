// timestep_sinusoid on CUDA (numerics 5.1 forward, 6.1 backward):
//   freq[k]  = exp_P(rn(rn(c * k) * inv_half)),  c = fp32(-ln(max_period)), inv_half = fp32(1/half)
//   arg[t,k] = rn(t * freq[k]);  out[t] = [cos_P(arg) | sin_P(arg)]
//   d_t[t]   = R(ascending-k chain of rn(b - a)), a = rn(rn(g_cos*sin_P)*freq), b = rn(rn(g_sin*cos_P)*freq)
// c and inv_half are rounded once on the host (sinusoid_constants, shared with the CPU).
// Forward: one thread per (t, k); backward: one thread per t (the k chain is serial).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "common/backends.h"
#include "common/pointwise_math.h"
#include "common/scalar_math.h"
#include "common/storage.h"
#include "cuda/cuda_util.cuh"
#include "cuda/profile_math.cuh"
#include "cuda/tuning.h"

namespace detdit {
namespace cuda {
namespace {

__device__ __forceinline__ float frequency(int64_t k, SinusoidConstants c, bool torch) {
  return sinusoid_frequency(c, k, ProfileExp{torch});
}

template <typename T>
__global__ void timestep_sinusoid_forward_kernel(const T* timesteps, float* features, int64_t count, int64_t half,
                                                 SinusoidConstants c, bool torch) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // (t, k) of (T, half)
  if (i >= count * half) return;
  const int64_t t = i / half, k = i % half;
  const float arg = num::mul32(to_float(timesteps[t]), frequency(k, c, torch));
  features[t * 2 * half + k] = cos_p(arg, torch);
  features[t * 2 * half + half + k] = sin_p(arg, torch);
}

template <typename T>
__global__ void timestep_sinusoid_backward_kernel(const T* timesteps, const float* grad, T* d_timesteps,
                                                  int64_t count, int64_t half, SinusoidConstants c, bool torch) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= count) return;
  const float ts = to_float(timesteps[t]);
  const float* g = grad + t * 2 * half;  // (2*half,) [d cos | d sin]
  float acc = 0.0f;
  for (int64_t k = 0; k < half; ++k) {
    const float freq = frequency(k, c, torch);
    const float arg = num::mul32(ts, freq);
    const float a = num::mul32(num::mul32(g[k], sin_p(arg, torch)), freq);
    const float b = num::mul32(num::mul32(g[half + k], cos_p(arg, torch)), freq);
    acc = num::add32(acc, num::sub32(b, a));
  }
  d_timesteps[t] = from_float<T>(acc);
}

}  // namespace

Status timestep_sinusoid_forward(const TimestepSinusoidParams& p, Stream stream) {
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.in.timesteps.device));
  const int64_t count = p.in.timesteps.shape[0], half = p.features.shape[1] / 2;
  if (count * half == 0) return Status();
  const SinusoidConstants c = sinusoid_constants(half, p.in.max_period);
  const int threads = launch_tuning().elementwise_threads;
  return dispatch_float_dtype(p.in.timesteps.dtype, [&](auto tag) {
    using T = decltype(tag);
    timestep_sinusoid_forward_kernel<T><<<blocks_for(count * half, threads), threads, 0, as_cuda_stream(stream)>>>(
        p.in.timesteps.ptr<const T>(), p.features.ptr<float>(), count, half, c, p.in.numerics == Numerics::kTorch);
    return launch_status("timestep_sinusoid_forward_kernel");
  });
}

Status timestep_sinusoid_backward(const TimestepSinusoidBackwardParams& p, Stream stream) {
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.in.timesteps.device));
  const int64_t count = p.in.timesteps.shape[0], half = p.grad_features.shape[1] / 2;
  if (count == 0) return Status();
  const SinusoidConstants c = sinusoid_constants(half > 0 ? half : 1, p.in.max_period);
  constexpr int kThreads = 128;
  return dispatch_float_dtype(p.in.timesteps.dtype, [&](auto tag) {
    using T = decltype(tag);
    timestep_sinusoid_backward_kernel<T><<<blocks_for(count, kThreads), kThreads, 0, as_cuda_stream(stream)>>>(
        p.in.timesteps.ptr<const T>(), p.grad_features.ptr<const float>(), p.d_timesteps.ptr<T>(), count, half, c,
        p.in.numerics == Numerics::kTorch);
    return launch_status("timestep_sinusoid_backward_kernel");
  });
}

}  // namespace cuda
}  // namespace detdit
