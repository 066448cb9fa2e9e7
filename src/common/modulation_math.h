// The modulation forms' element addresses and the recipes' rounding types
// (include/detdit/modulation.h, docs/numerics.md 5.12), shared by the
// CPU reference and the CUDA kernels.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/host_device.h"
#include "common/storage.h"
#include "detdit/modulation.h"

namespace detdit {

// The offset (elements) of position p's row in a resolved modulation tensor:
// indexed, row_of_seq[p % S] * stride_b; grouped, (p / S) * stride_b +
// ((p % S) / L) * stride_f. `form` is kIndexed or a grouped form.
DETDIT_HD int64_t modulation_offset(const ModulationOperand& m, ModulationForm form, int64_t seq_len,
                                    int64_t frame_len, const int32_t* row_of_seq, int64_t p) {
  if (form == ModulationForm::kIndexed) return row_of_seq[p % seq_len] * m.stride_b;
  return (p / seq_len) * m.stride_b + ((p % seq_len) / frame_len) * m.stride_f;
}

// The offset of group g's row (grouped forms): item g / F, frame g % F.
DETDIT_HD int64_t group_offset(const ModulationOperand& m, int64_t frames, int64_t g) {
  return (g / frames) * m.stride_b + (g % frames) * m.stride_f;
}

// PyTorch's promotion of two float storage types as detdit meets them: the
// modulation M is x's type T or fp32, so promote(T, M) is M when M is fp32,
// else T.
template <typename T, typename M>
struct Promoted {
  using type = T;
};
template <typename T>
struct Promoted<T, float> {
  using type = float;
};

// Where each step of a modulated op rounds, for activations T and modulation
// M: upcast = false rounds every op to the promoted dtype of its operands (as
// eager PyTorch does), upcast = true keeps FP32 until the one rounding to T.
//   Norm:   the normalised value n (rmsnorm's R_T(w * (rstd * x)))
//   Factor: 1 + scale and k + gate (the modulation's own dtype)
//   Mid:    n * t1, gate * y and the final sum before the store
//   Out:    the stored output (and the gradient's dtype)
// With M = T and upcast = false every one of them is T: the H3 rule.
template <typename T, typename M, bool kUpcast>
struct Recipe {
  using Norm = std::conditional_t<kUpcast, float, T>;
  using Factor = std::conditional_t<kUpcast, float, M>;
  using Mid = std::conditional_t<kUpcast, float, typename Promoted<T, M>::type>;
  using Out = std::conditional_t<kUpcast, T, typename Promoted<T, M>::type>;
};

// Host-side dispatch: fn(T{}, M{}, std::bool_constant<upcast>{}) with T the
// storage type of x_dtype and M that of m_dtype (fp32 or x_dtype, validated);
// returns fn's result (one type for every instantiation).
template <typename Fn>
auto dispatch_recipe(DType x_dtype, DType m_dtype, bool upcast, Fn&& fn) {
  return dispatch_float_dtype(x_dtype, [&](auto t) {
    using T = decltype(t);
    auto with_m = [&](auto m) { return upcast ? fn(T{}, m, std::true_type{}) : fn(T{}, m, std::false_type{}); };
    return m_dtype == DType::kF32 ? with_m(float{}) : with_m(T{});
  });
}

// The modulation dtype of a norm's inputs (RmsnormInputs, LayernormInputs):
// shift's (scale shares it, validated), or x's without modulation.
template <typename NormInputs>
DType modulation_dtype(const NormInputs& in) {
  return in.shift.present() ? in.shift.dtype : in.x.dtype;
}

}  // namespace detdit
