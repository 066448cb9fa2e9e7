// timestep_sinusoid on CUDA (numerics 5.1 forward, 6.1 backward):
//   freq[k]  = exp_P(rn(rn(c * k) * inv_denom)),  c = fp32(-ln(max_period)),
//              inv_denom = fp32(1 / fp32(half - downscale_freq_shift))
//   arg[t,k] = rn(scale * rn(t * freq[k]));  out[t] = cos_P(arg) at the cos columns, sin_P(arg) at the
//              sin columns ([cos | sin] when flip_sin_to_cos, else [sin | cos]), + one +0.0 column for odd C
//   d_t[t]   = R(rn(scale * acc)), acc = ascending-k chain of rn(b - a),
//              a = rn(rn(g_cos*sin_P)*freq), b = rn(rn(g_sin*cos_P)*freq)
// The constants and the layout are computed once on the host (sinusoid_constants,
// sinusoid_layout, shared with the CPU) and passed to the kernels by value.
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

// k = half (one thread per row past the frequencies) writes the +0.0 column of an odd C.
template <typename T>
__global__ void timestep_sinusoid_forward_kernel(const T* timesteps, float* features, int64_t count,
                                                 SinusoidLayout l, SinusoidConstants c, bool torch) {
  const int64_t per_row = l.half + l.channels % 2;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // (t, k) of (T, per_row)
  if (i >= count * per_row) return;
  const int64_t t = i / per_row, k = i % per_row;
  float* row = features + t * l.channels;
  if (k == l.half) {
    row[2 * l.half] = 0.0f;  // diffusers' zero pad
    return;
  }
  const float arg = sinusoid_argument(c, to_float(timesteps[t]), frequency(k, c, torch));
  row[l.cos_column + k] = cos_p(arg, torch);
  row[l.sin_column + k] = sin_p(arg, torch);
}

template <typename T>
__global__ void timestep_sinusoid_backward_kernel(const T* timesteps, const float* grad, T* d_timesteps,
                                                  int64_t count, SinusoidLayout l, SinusoidConstants c, bool torch) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= count) return;
  const float ts = to_float(timesteps[t]);
  const float* g = grad + t * l.channels;  // (C,)
  float acc = 0.0f;
  for (int64_t k = 0; k < l.half; ++k) {
    const float freq = frequency(k, c, torch);
    const float arg = sinusoid_argument(c, ts, freq);
    const float a = num::mul32(num::mul32(g[l.cos_column + k], sin_p(arg, torch)), freq);
    const float b = num::mul32(num::mul32(g[l.sin_column + k], cos_p(arg, torch)), freq);
    acc = num::add32(acc, num::sub32(b, a));
  }
  d_timesteps[t] = from_float<T>(num::mul32(c.scale, acc));
}

SinusoidConstants constants_of(const TimestepSinusoidInputs& in, int64_t half) {
  return sinusoid_constants(half, in.max_period, in.downscale_freq_shift, in.scale);
}

}  // namespace

Status timestep_sinusoid_forward(const TimestepSinusoidParams& p, Stream stream) {
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.in.timesteps.device));
  const int64_t count = p.in.timesteps.shape[0];
  const SinusoidLayout l = sinusoid_layout(p.features.shape[1], p.in.flip_sin_to_cos);
  const int64_t threads_total = count * (l.half + l.channels % 2);
  if (threads_total == 0) return Status();
  const SinusoidConstants c = constants_of(p.in, l.half);
  const int threads = launch_tuning().elementwise_threads;
  return dispatch_float_dtype(p.in.timesteps.dtype, [&](auto tag) {
    using T = decltype(tag);
    timestep_sinusoid_forward_kernel<T><<<blocks_for(threads_total, threads), threads, 0, as_cuda_stream(stream)>>>(
        p.in.timesteps.ptr<const T>(), p.features.ptr<float>(), count, l, c, p.in.numerics == Numerics::kTorch);
    return launch_status("timestep_sinusoid_forward_kernel");
  });
}

Status timestep_sinusoid_backward(const TimestepSinusoidBackwardParams& p, Stream stream) {
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.in.timesteps.device));
  const int64_t count = p.in.timesteps.shape[0];
  if (count == 0) return Status();
  const SinusoidLayout l = sinusoid_layout(p.grad_features.shape[1], p.in.flip_sin_to_cos);
  const SinusoidConstants c = constants_of(p.in, l.half);
  constexpr int kThreads = 128;
  return dispatch_float_dtype(p.in.timesteps.dtype, [&](auto tag) {
    using T = decltype(tag);
    timestep_sinusoid_backward_kernel<T><<<blocks_for(count, kThreads), kThreads, 0, as_cuda_stream(stream)>>>(
        p.in.timesteps.ptr<const T>(), p.grad_features.ptr<const float>(), p.d_timesteps.ptr<T>(), count, l, c,
        p.in.numerics == Numerics::kTorch);
    return launch_status("timestep_sinusoid_backward_kernel");
  });
}

}  // namespace cuda
}  // namespace detdit
