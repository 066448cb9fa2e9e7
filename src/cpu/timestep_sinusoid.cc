// CPU reference of timestep_sinusoid (docs/numerics.md 5.1 and 6.1), portable
// profile. features[t] = [cos(arg[t, :]) | sin(arg[t, :])] with
// arg[t, k] = rn(t32 * freq[k]); the backward chains the 2*half terms of d_t
// in ascending k, pairing the cos-half and sin-half terms of the same k.
// Row-local: each timestep's row reads only that timestep.
#include <vector>

#include "common/backends.h"
#include "common/pointwise_math.h"
#include "common/storage.h"
#include "cpu/parallel.h"

namespace detdit {
namespace cpu {
namespace {

// freq[k], k in [0, half): computed once per call from the host constants.
std::vector<float> frequencies(int64_t half, float max_period) {
  const SinusoidConstants constants = sinusoid_constants(half, max_period);
  std::vector<float> freq(static_cast<std::size_t>(half));
  for (int64_t k = 0; k < half; ++k) freq[k] = sinusoid_frequency(constants, k, PortableExp{});
  return freq;
}

}  // namespace

Status timestep_sinusoid_forward(const TimestepSinusoidParams& p, Stream) {
  const int64_t num_timesteps = p.features.shape[0], channels = p.features.shape[1], half = channels / 2;
  const std::vector<float> freq = frequencies(half, p.in.max_period);
  float* features = p.features.ptr<float>();  // (T, C)
  dispatch_float_dtype(p.in.timesteps.dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* timesteps = p.in.timesteps.ptr<T>();  // (T,)
    parallel_for(0, num_timesteps, [&](int64_t t) {
      const float time = to_float(timesteps[t]);
      float* row = features + t * channels;
      for (int64_t k = 0; k < half; ++k) {
        const float arg = num::mul32(time, freq[k]);
        row[k] = num::portable_cos(arg);
        row[half + k] = num::portable_sin(arg);
      }
    });
  });
  return Status();
}

Status timestep_sinusoid_backward(const TimestepSinusoidBackwardParams& p, Stream) {
  const int64_t num_timesteps = p.grad_features.shape[0], channels = p.grad_features.shape[1];
  const int64_t half = channels / 2;
  const std::vector<float> freq = frequencies(half, p.in.max_period);
  const float* grad = p.grad_features.ptr<float>();  // (T, C)
  dispatch_float_dtype(p.in.timesteps.dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* timesteps = p.in.timesteps.ptr<T>();  // (T,)
    T* d_timesteps = p.d_timesteps.ptr<T>();    // (T,), timesteps' dtype
    parallel_for(0, num_timesteps, [&](int64_t t) {
      const float time = to_float(timesteps[t]);
      const float* g = grad + t * channels;
      float acc = 0.0f;
      for (int64_t k = 0; k < half; ++k) {
        const float arg = num::mul32(time, freq[k]);
        // d cos(arg)/dt = -sin(arg) freq; d sin(arg)/dt = cos(arg) freq
        const float from_cos = num::mul32(num::mul32(g[k], num::portable_sin(arg)), freq[k]);
        const float from_sin = num::mul32(num::mul32(g[half + k], num::portable_cos(arg)), freq[k]);
        acc = num::add32(acc, num::sub32(from_sin, from_cos));
      }
      d_timesteps[t] = from_float<T>(acc);
    });
  });
  return Status();
}

}  // namespace cpu
}  // namespace detdit
