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

// The two FP32 constants of timestep_sinusoid (numerics 5.1), computed once on
// the host and passed to kernels by value:
//   log_scale = fp32(-ln(max_period)), inv_half = fp32(1.0 / half).
struct SinusoidConstants {
  float log_scale;
  float inv_half;
};
inline SinusoidConstants sinusoid_constants(int64_t half, float max_period) {  // host only
  return SinusoidConstants{static_cast<float>(-std::log(static_cast<double>(max_period))),
                           static_cast<float>(1.0 / static_cast<double>(half))};
}

// freq[k] = exp_P( rn( rn(log_scale * fp32(k)) * inv_half ) ); k < 2^24, so fp32(k) is exact.
template <typename ExpFn>
DETDIT_HD float sinusoid_frequency(SinusoidConstants constants, int64_t k, ExpFn exp_fn) {
  return exp_fn(num::mul32(num::mul32(constants.log_scale, static_cast<float>(k)), constants.inv_half));
}

}  // namespace detdit
