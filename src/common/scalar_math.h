// detdit's scalar numerics, identical on the host and on CUDA devices.
//
// Contract (docs/numerics.md): only correctly rounded IEEE operations (+ - *
// /, sqrt, fma, round-to-nearest-even conversions) are used, every fused
// multiply-add is written as an explicit fma, and the build forbids
// contraction (-ffp-contract=off on the host, --fmad=false on the device). So
// each function below returns the same bits on the CPU and on every CUDA GPU.
//
//  * bf16 / fp16 conversions: round to nearest even, subnormals kept,
//    overflow to +-inf, every NaN becomes the canonical quiet NaN 0x7FFF (the
//    same as CUDA's cvt.rn.bf16.f32). Defined by the integer operations of
//    float_to_bf16_integer / float_to_f16_integer, which the host runs; on
//    sm_80+ devices the cvt.rn instructions compute the same function in one
//    instruction instead of ~8 (the numerics canary checks all 2^32 inputs).
//  * portable_exp / portable_sin / portable_cos / portable_rsqrt: evaluated in
//    FP64 from correctly rounded operations, then rounded once to FP32. They
//    are correctly rounded except in the rare case where the FP64 result lies
//    within ~2^-50 relative of an FP32 rounding boundary (measured rate in
//    docs/numerics.md).
#pragma once

#include <cstdint>
#include <cstring>

#include "common/host_device.h"

#if !defined(__CUDACC__)
#include <cmath>
#endif

namespace detdit {
namespace num {

DETDIT_HD uint32_t float_bits(float v) {
  uint32_t u;
  memcpy(&u, &v, sizeof(u));
  return u;
}
DETDIT_HD float bits_float(uint32_t u) {
  float v;
  memcpy(&v, &u, sizeof(v));
  return v;
}
DETDIT_HD double bits_double(uint64_t u) {
  double v;
  memcpy(&v, &u, sizeof(v));
  return v;
}

// ---- correctly rounded primitives, spelled the same on both sides ----------
#if defined(__CUDA_ARCH__)
DETDIT_HD float fma32(float a, float b, float c) { return __fmaf_rn(a, b, c); }
DETDIT_HD float mul32(float a, float b) { return __fmul_rn(a, b); }
DETDIT_HD float add32(float a, float b) { return __fadd_rn(a, b); }
DETDIT_HD float sub32(float a, float b) { return __fsub_rn(a, b); }
DETDIT_HD float div32(float a, float b) { return __fdiv_rn(a, b); }
DETDIT_HD double fma64(double a, double b, double c) { return __fma_rn(a, b, c); }
DETDIT_HD double mul64(double a, double b) { return __dmul_rn(a, b); }
DETDIT_HD double add64(double a, double b) { return __dadd_rn(a, b); }
DETDIT_HD double div64(double a, double b) { return __ddiv_rn(a, b); }
DETDIT_HD double sqrt64(double a) { return __dsqrt_rn(a); }
DETDIT_HD double rint64(double a) { return rint(a); }
DETDIT_HD float to_f32(double a) { return __double2float_rn(a); }
#else
inline float fma32(float a, float b, float c) { return std::fmaf(a, b, c); }
inline float mul32(float a, float b) { return a * b; }
inline float add32(float a, float b) { return a + b; }
inline float sub32(float a, float b) { return a - b; }
inline float div32(float a, float b) { return a / b; }
inline double fma64(double a, double b, double c) { return std::fma(a, b, c); }
inline double mul64(double a, double b) { return a * b; }
inline double add64(double a, double b) { return a + b; }
inline double div64(double a, double b) { return a / b; }
inline double sqrt64(double a) { return std::sqrt(a); }
inline double rint64(double a) { return std::nearbyint(a); }  // round half even (default mode)
inline float to_f32(double a) { return static_cast<float>(a); }
#endif

DETDIT_HD bool is_nan32(float v) { return (float_bits(v) & 0x7FFFFFFFu) > 0x7F800000u; }
DETDIT_HD bool is_finite32(float v) { return (float_bits(v) & 0x7F800000u) != 0x7F800000u; }

// ---- bf16 / fp16 --------------------------------------------------------------
constexpr uint16_t kCanonicalNan16 = 0x7FFF;

DETDIT_HD float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

DETDIT_HD uint16_t float_to_bf16_integer(float v) {
  uint32_t u = float_bits(v);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return kCanonicalNan16;
  uint32_t rounding = 0x7FFFu + ((u >> 16) & 1u);  // round half to even
  return static_cast<uint16_t>((u + rounding) >> 16);
}

DETDIT_HD float f16_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1Fu;
  uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1Fu) return bits_float(sign | 0x7F800000u | (mantissa << 13));
  if (exponent == 0) {
    if (mantissa == 0) return bits_float(sign);
    // subnormal: mantissa * 2^-24, exact in fp32
    float magnitude = mul32(static_cast<float>(mantissa), 5.9604644775390625e-8f);
    return bits_float(sign | float_bits(magnitude));
  }
  return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

DETDIT_HD uint16_t float_to_f16_integer(float v) {
  uint32_t u = float_bits(v);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t magnitude = u & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return kCanonicalNan16;
  if (magnitude >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520: inf
  if (magnitude < 0x38800000u) {
    // result is subnormal or zero: value = m * 2^-24 with m rounded to nearest even
    if (magnitude < 0x33000000u) return sign;  // < 2^-25: rounds to zero (2^-25 itself ties to 0)
    uint32_t exponent = magnitude >> 23;       // 102..112
    uint32_t mantissa = (magnitude & 0x7FFFFFu) | 0x800000u;
    uint32_t shift = 126u - exponent;          // 14..24
    uint32_t kept = mantissa >> shift;
    uint32_t remainder = mantissa & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (remainder > half || (remainder == half && (kept & 1u))) kept += 1u;
    return static_cast<uint16_t>(sign | kept);
  }
  uint32_t rebased = magnitude - 0x38000000u;  // exponent rebias 127 -> 15
  uint32_t rounding = 0xFFFu + ((rebased >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rebased + rounding) >> 13));
}

// The conversions every kernel uses. Row-wise kernels round up to four times
// per element, so on the device the integer form (~8 instructions with a
// branch) made them instruction bound; cvt.rn.{bf16,f16}.f32 (no .ftz) round
// to nearest even, keep subnormals, overflow to inf and return 0x7FFF for
// every NaN: the integer form's function, checked for all 2^32 inputs.
DETDIT_HD uint16_t float_to_bf16(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint16_t h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
  return h;
#else
  return float_to_bf16_integer(v);
#endif
}

DETDIT_HD uint16_t float_to_f16(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint16_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
  return h;
#else
  return float_to_f16_integer(v);
#endif
}

// ---- portable transcendental functions (FP64 inside, one rounding) ----------
// exp: x = k*ln2 + r, |r| <= ln2/2 (Cody-Waite, two-part ln2), Taylor to r^13,
// scaled by 2^k built from its bit pattern.
DETDIT_HD double exp64_core(double x) {
  const double kLog2e = 1.4426950408889634;
  const double kLn2Hi = 6.93147180369123816490e-01;  // 33 significant bits: k*kLn2Hi exact
  const double kLn2Lo = 1.90821492927058770002e-10;
  double k = rint64(mul64(x, kLog2e));
  double r = fma64(-k, kLn2Hi, x);
  r = fma64(-k, kLn2Lo, r);
  // Taylor coefficients 1/n!, n = 13..0, Horner with explicit fma.
  double p = 1.6059043836821613e-10;             // 1/13!
  p = fma64(p, r, 2.08767569878680990e-09);      // 1/12!
  p = fma64(p, r, 2.50521083854417188e-08);      // 1/11!
  p = fma64(p, r, 2.75573192239858907e-07);      // 1/10!
  p = fma64(p, r, 2.75573192239858907e-06);      // 1/9!
  p = fma64(p, r, 2.48015873015873016e-05);      // 1/8!
  p = fma64(p, r, 1.98412698412698413e-04);      // 1/7!
  p = fma64(p, r, 1.38888888888888889e-03);      // 1/6!
  p = fma64(p, r, 8.33333333333333333e-03);      // 1/5!
  p = fma64(p, r, 4.16666666666666667e-02);      // 1/4!
  p = fma64(p, r, 1.66666666666666667e-01);      // 1/3!
  p = fma64(p, r, 0.5);
  p = fma64(p, r, 1.0);
  p = fma64(p, r, 1.0);
  int64_t e = static_cast<int64_t>(k) + 1023;  // callers keep |k| <= 200
  return mul64(p, bits_double(static_cast<uint64_t>(e) << 52));
}

DETDIT_HD float portable_exp(float x) {
  if (is_nan32(x)) return x;
  if (x > 89.0f) return bits_float(0x7F800000u);  // exp(89) > FLT_MAX
  if (x < -104.0f) return 0.0f;                   // exp(-104) < 2^-150: rounds to +0
  return to_f32(exp64_core(static_cast<double>(x)));
}

// sin / cos on |r| <= pi/4 (Taylor to r^17 and r^16), FP64.
DETDIT_HD double sin64_kernel(double r) {
  double r2 = mul64(r, r);
  double p = 2.81145725434552076e-15;            // 1/17!
  p = fma64(p, r2, -7.64716373181981648e-13);    // -1/15!
  p = fma64(p, r2, 1.60590438368216146e-10);     // 1/13!
  p = fma64(p, r2, -2.50521083854417188e-08);    // -1/11!
  p = fma64(p, r2, 2.75573192239858907e-06);     // 1/9!
  p = fma64(p, r2, -1.98412698412698413e-04);    // -1/7!
  p = fma64(p, r2, 8.33333333333333333e-03);     // 1/5!
  p = fma64(p, r2, -1.66666666666666667e-01);    // -1/3!
  return fma64(mul64(p, r2), r, r);
}
DETDIT_HD double cos64_kernel(double r) {
  double r2 = mul64(r, r);
  double p = 4.77947733238738530e-14;            // 1/16!
  p = fma64(p, r2, -1.14707455977297247e-11);    // -1/14!
  p = fma64(p, r2, 2.08767569878680990e-09);     // 1/12!
  p = fma64(p, r2, -2.75573192239858907e-07);    // -1/10!
  p = fma64(p, r2, 2.48015873015873016e-05);     // 1/8!
  p = fma64(p, r2, -1.38888888888888889e-03);    // -1/6!
  p = fma64(p, r2, 4.16666666666666667e-02);     // 1/4!
  p = fma64(p, r2, -0.5);                        // -1/2!
  return fma64(p, r2, 1.0);
}

// Largest |x| the sin/cos reduction handles exactly: k = rint(x*2/pi) < 2^20,
// so k*kPio2_1 (33 significant bits) is exact. detdit only evaluates sin/cos
// at timestep_sinusoid's arguments, which its validation keeps within
// |scale| * t_max <= 1e6; larger arguments return NaN.
constexpr float kPortableTrigMaxArg = 1.0e6f;

// quadrant q = k mod 4 and reduced r = x - k*pi/2 (three-part pi/2).
DETDIT_HD double reduce_pio2(double x, int* quadrant) {
  const double kTwoOverPi = 6.36619772367581382433e-01;
  const double kPio2_1 = 1.57079632673412561417e+00;
  const double kPio2_2 = 6.07710050630396597660e-11;
  const double kPio2_3 = 2.02226624871116645580e-21;
  double k = rint64(mul64(x, kTwoOverPi));
  double r = fma64(-k, kPio2_1, x);
  r = fma64(-k, kPio2_2, r);
  r = fma64(-k, kPio2_3, r);
  *quadrant = static_cast<int>(static_cast<int64_t>(k) & 3);
  return r;
}

DETDIT_HD float portable_sin(float x) {
  if (!is_finite32(x) || x > kPortableTrigMaxArg || x < -kPortableTrigMaxArg)
    return bits_float(0x7FC00000u);
  int q;
  double r = reduce_pio2(static_cast<double>(x), &q);
  double v = (q & 1) ? cos64_kernel(r) : sin64_kernel(r);
  return to_f32((q & 2) ? -v : v);
}

DETDIT_HD float portable_cos(float x) {
  if (!is_finite32(x) || x > kPortableTrigMaxArg || x < -kPortableTrigMaxArg)
    return bits_float(0x7FC00000u);
  int q;
  double r = reduce_pio2(static_cast<double>(x), &q);
  double v = (q & 1) ? sin64_kernel(r) : cos64_kernel(r);
  return to_f32((q == 1 || q == 2) ? -v : v);
}

// 1/sqrt(x): FP64 sqrt and divide (each correctly rounded), one rounding to FP32.
DETDIT_HD float portable_rsqrt(float x) {
  return to_f32(div64(1.0, sqrt64(static_cast<double>(x))));
}

}  // namespace num
}  // namespace detdit
