// CPU reference of timestep_sinusoid (docs/numerics.md 5.1 and 6.1), portable
// profile. Row t holds cos(arg[t, :]) at the layout's cos columns and
// sin(arg[t, :]) at its sin columns, arg[t, k] = rn(scale * rn(t32 * freq[k])),
// then one +0.0 column when C is odd; the backward chains the 2*half terms of
// d_t in ascending k, pairing the cos-half and sin-half terms of the same k,
// and scales the sum once.
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

SinusoidConstants constants_of(const TimestepSinusoidInputs& in, int64_t half) {
  return sinusoid_constants(half, in.max_period, in.downscale_freq_shift, in.scale);
}

// freq[k], k in [0, half): computed once per call from the host constants.
std::vector<float> frequencies(int64_t half, SinusoidConstants constants) {
  std::vector<float> freq(static_cast<std::size_t>(half));
  for (int64_t k = 0; k < half; ++k) freq[k] = sinusoid_frequency(constants, k, PortableExp{});
  return freq;
}

}  // namespace

Status timestep_sinusoid_forward(const TimestepSinusoidParams& p, Stream) {
  const int64_t num_timesteps = p.features.shape[0];
  const SinusoidLayout l = sinusoid_layout(p.features.shape[1], p.in.flip_sin_to_cos);
  const SinusoidConstants c = constants_of(p.in, l.half);
  const std::vector<float> freq = frequencies(l.half, c);
  void* features = p.features.data;  // (T, C) fp32
  dispatch_float_dtype(p.in.timesteps.dtype, [&](auto tag) {
    using T = decltype(tag);
    parallel_for(0, num_timesteps, [&](int64_t t) {
      const float time = to_float(load<T>(p.in.timesteps.data, t));  // (T,)
      const int64_t row = t * l.channels;
      for (int64_t k = 0; k < l.half; ++k) {
        const float arg = sinusoid_argument(c, time, freq[k]);
        store(features, row + l.cos_column + k, num::portable_cos(arg));
        store(features, row + l.sin_column + k, num::portable_sin(arg));
      }
      if (l.channels % 2 != 0) store(features, row + 2 * l.half, 0.0f);  // diffusers' zero pad
    });
  });
  return Status();
}

Status timestep_sinusoid_backward(const TimestepSinusoidBackwardParams& p, Stream) {
  const int64_t num_timesteps = p.grad_features.shape[0];
  const SinusoidLayout l = sinusoid_layout(p.grad_features.shape[1], p.in.flip_sin_to_cos);
  const SinusoidConstants c = constants_of(p.in, l.half);
  const std::vector<float> freq = frequencies(l.half, c);
  const void* grad = p.grad_features.data;  // (T, C) fp32
  dispatch_float_dtype(p.in.timesteps.dtype, [&](auto tag) {
    using T = decltype(tag);
    parallel_for(0, num_timesteps, [&](int64_t t) {
      const float time = to_float(load<T>(p.in.timesteps.data, t));  // (T,)
      const int64_t row = t * l.channels;
      float acc = 0.0f;
      for (int64_t k = 0; k < l.half; ++k) {
        const float arg = sinusoid_argument(c, time, freq[k]);
        // d cos(arg)/dt = -sin(arg) scale freq; d sin(arg)/dt = cos(arg) scale freq (scale once, below)
        const float g_cos = load<float>(grad, row + l.cos_column + k);
        const float g_sin = load<float>(grad, row + l.sin_column + k);
        const float from_cos = num::mul32(num::mul32(g_cos, num::portable_sin(arg)), freq[k]);
        const float from_sin = num::mul32(num::mul32(g_sin, num::portable_cos(arg)), freq[k]);
        acc = num::add32(acc, num::sub32(from_sin, from_cos));
      }
      store(p.d_timesteps.data, t, from_float<T>(num::mul32(c.scale, acc)));  // (T,), timesteps' dtype
    });
  });
  return Status();
}

}  // namespace cpu
}  // namespace detdit
