// Storage types and exact conversions, shared by host and device code.
// Every activation dtype is computed in FP32 and rounded once to its storage
// type with round_to<T> (R_T in docs/numerics.md).
#pragma once

#include <cstdint>

#include "common/scalar_math.h"
#include "detdit/tensor.h"

namespace detdit {

struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

DETDIT_HD float to_float(float v) { return v; }
DETDIT_HD float to_float(Bf16 v) { return num::bf16_to_float(v.bits); }
DETDIT_HD float to_float(F16 v) { return num::f16_to_float(v.bits); }

template <typename T>
struct StorageTraits;
template <>
struct StorageTraits<float> {
  static constexpr DType kDType = DType::kF32;
  DETDIT_HD static float from_float(float v) { return v; }
};
template <>
struct StorageTraits<Bf16> {
  static constexpr DType kDType = DType::kBF16;
  DETDIT_HD static Bf16 from_float(float v) { return Bf16{num::float_to_bf16(v)}; }
};
template <>
struct StorageTraits<F16> {
  static constexpr DType kDType = DType::kF16;
  DETDIT_HD static F16 from_float(float v) { return F16{num::float_to_f16(v)}; }
};

// Round an FP32 value to storage type T (RNE, canonical NaN).
template <typename T>
DETDIT_HD T from_float(float v) {
  return StorageTraits<T>::from_float(v);
}
// R_T(v): round to T and back to FP32.
template <typename T>
DETDIT_HD float round_to(float v) {
  return to_float(from_float<T>(v));
}

// Host-side dispatch over the float storage dtypes: calls fn(T{}) with T the
// storage type of dtype. The caller has validated that dtype is a float dtype.
template <typename Fn>
auto dispatch_float_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kBF16: return fn(Bf16{});
    case DType::kF16: return fn(F16{});
    default: return fn(float{});
  }
}

}  // namespace detdit
