// Scalar formulas of the pointwise steps of the timestep path, shared by the
// CPU reference and the CUDA kernels (docs/numerics.md 5.1, 5.2, 6.1, 6.2).
// Each is a fixed sequence of separately rounded FP32 operations; the profile
// only decides the exp (ExpFn: num::portable_exp in the portable profile,
// libdevice expf in the torch profile on CUDA).
#pragma once

#include <cmath>

#include "common/scalar_math.h"

namespace detdit {

// silu_P(z) = rn(z / rn(1 + exp_P(-z)))  (numerics 5.2 epilogue, 5.4).
template <typename ExpFn>
DETDIT_HD float silu_value(float z, ExpFn exp_fn) {
  return num::div32(z, num::add32(1.0f, exp_fn(-z)));
}

// SiLU VJP (numerics 6.2):
//   s = rn(1 / rn(1 + exp_P(-z)));  d = rn(g * rn(s * rn(1 + rn(z * rn(1 - s)))))
template <typename ExpFn>
DETDIT_HD float silu_vjp(float grad, float z, ExpFn exp_fn) {
  float s = num::div32(1.0f, num::add32(1.0f, exp_fn(-z)));
  float inner = num::add32(1.0f, num::mul32(z, num::sub32(1.0f, s)));
  return num::mul32(grad, num::mul32(s, inner));
}

struct PortableExp {
  DETDIT_HD float operator()(float x) const { return num::portable_exp(x); }
};

// The FP32 constants of timestep_sinusoid (numerics 5.1), computed once on the
// host and passed to kernels by value:
//   log_scale = fp32(-ln(max_period)),
//   inv_denom = fp32(1 / fp32(half - downscale_freq_shift)) (half - shift in FP64),
//   scale     = the argument's scale (1: H3 and most families).
// inv_denom divides in FP64 and rounds once: for FP32 operands that equals the
// FP32 division 1.0f / denom (FP64 has more than 2 * 24 + 2 bits, so the
// double rounding is innocuous), PyTorch's reciprocal of a scalar divisor.
// With shift = 0 it is fp32(1 / half), H3's constant. half = 0 (C = 1) has no
// frequency: inv_denom is then never read.
struct SinusoidConstants {
  float log_scale;
  float inv_denom;
  float scale;
};
inline SinusoidConstants sinusoid_constants(int64_t half, float max_period, float downscale_freq_shift,
                                            float scale) {  // host only
  const float denom = static_cast<float>(static_cast<double>(half) - static_cast<double>(downscale_freq_shift));
  return SinusoidConstants{static_cast<float>(-std::log(static_cast<double>(max_period))),
                           static_cast<float>(1.0 / static_cast<double>(denom)), scale};
}

// freq[k] = exp_P( rn( rn(log_scale * fp32(k)) * inv_denom ) ); k < 2^24, so fp32(k) is exact.
template <typename ExpFn>
DETDIT_HD float sinusoid_frequency(SinusoidConstants constants, int64_t k, ExpFn exp_fn) {
  return exp_fn(num::mul32(num::mul32(constants.log_scale, static_cast<float>(k)), constants.inv_denom));
}

// arg[t, k] = rn( scale * rn(t * freq[k]) ); scale = 1 returns rn(t * freq[k]) exactly.
DETDIT_HD float sinusoid_argument(SinusoidConstants constants, float time, float freq) {
  return num::mul32(constants.scale, num::mul32(time, freq));
}

// Where the halves go in a row of C = 2 * half (+ 1) features: the cos half at
// cos_column + k, the sin half at sin_column + k; an odd C ends in one +0.0
// column (2 * half), which no gradient reads.
struct SinusoidLayout {
  int64_t half, channels, cos_column, sin_column;
};
inline SinusoidLayout sinusoid_layout(int64_t channels, bool flip_sin_to_cos) {  // host only
  const int64_t half = channels / 2;
  return SinusoidLayout{half, channels, flip_sin_to_cos ? 0 : half, flip_sin_to_cos ? half : 0};
}

}  // namespace detdit
