// CPU reference of timestep_sinusoid (docs/numerics.md 5.1 and 6.1), portable
// profile. features[t] = [cos(arg[t, :]) | sin(arg[t, :])] with
// arg[t, k] = rn(t32 * freq[k]); the backward chains the 2*half terms of d_t
// in ascending k, pairing the cos-half and sin-half terms of the same k.
// Row-local: each timestep's row reads only that timestep.
// The op asks no alignment of its tensors (docs/ops.md): elements are read
// and written with cpu/unaligned.h.
#include <vector>

#include "common/backends.h"
#include "common/pointwise_math.h"
#include "common/storage.h"
#include "cpu/parallel.h"
#include "cpu/unaligned.h"

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
  void* features = p.features.data;  // (T, C) fp32
  dispatch_float_dtype(p.in.timesteps.dtype, [&](auto tag) {
    using T = decltype(tag);
    parallel_for(0, num_timesteps, [&](int64_t t) {
      const float time = to_float(load<T>(p.in.timesteps.data, t));  // (T,)
      for (int64_t k = 0; k < half; ++k) {
        const float arg = num::mul32(time, freq[k]);
        store(features, t * channels + k, num::portable_cos(arg));
        store(features, t * channels + half + k, num::portable_sin(arg));
      }
    });
  });
  return Status();
}

Status timestep_sinusoid_backward(const TimestepSinusoidBackwardParams& p, Stream) {
  const int64_t num_timesteps = p.grad_features.shape[0], channels = p.grad_features.shape[1];
  const int64_t half = channels / 2;
  const std::vector<float> freq = frequencies(half, p.in.max_period);
  const void* grad = p.grad_features.data;  // (T, C) fp32
  dispatch_float_dtype(p.in.timesteps.dtype, [&](auto tag) {
    using T = decltype(tag);
    parallel_for(0, num_timesteps, [&](int64_t t) {
      const float time = to_float(load<T>(p.in.timesteps.data, t));  // (T,)
      float acc = 0.0f;
      for (int64_t k = 0; k < half; ++k) {
        const float arg = num::mul32(time, freq[k]);
        // d cos(arg)/dt = -sin(arg) freq; d sin(arg)/dt = cos(arg) freq
        const float g_cos = load<float>(grad, t * channels + k), g_sin = load<float>(grad, t * channels + half + k);
        const float from_cos = num::mul32(num::mul32(g_cos, num::portable_sin(arg)), freq[k]);
        const float from_sin = num::mul32(num::mul32(g_sin, num::portable_cos(arg)), freq[k]);
        acc = num::add32(acc, num::sub32(from_sin, from_cos));
      }
      store(p.d_timesteps.data, t, from_float<T>(acc));  // (T,), timesteps' dtype
    });
  });
  return Status();
}

}  // namespace cpu
}  // namespace detdit
