// The shift and scale of a modulated norm (rmsnorm, layernorm) as the CPU
// kernels address them: position p's row of each at modulation_offset
// (common/modulation_math.h), and the gradient of the normalised value that
// both norms' backwards read (docs/numerics.md 6.11).
#pragma once

#include <cstdint>

#include "common/modulation_math.h"
#include "common/rowwise_math.h"
#include "common/scalar_math.h"
#include "cpu/unaligned.h"
#include "detdit/modulation.h"
#include "detdit/plan.h"
#include "detdit/tensor.h"

namespace detdit {
namespace cpu {

struct ShiftScale {
  ResolvedModulation mod;
  ModulationOperand shift, scale;
  const int32_t* row_of_seq = nullptr;  // the plan's (indexed form)

  // mod is the call's resolved form (resolve_modulation accepted shift and scale).
  ShiftScale(const ResolvedModulation& resolved, const TensorView& shift_view, const TensorView& scale_view,
             const IndexPlan& plan)
      : mod(resolved),
        shift(modulation_operand(shift_view, resolved)),
        scale(modulation_operand(scale_view, resolved)),
        row_of_seq(resolved.form == ModulationForm::kIndexed ? plan.host_tables().row_of_seq : nullptr) {}

  bool on() const { return mod.form != ModulationForm::kNone; }
  // Element offset of position p's row in shift / scale.
  int64_t shift_at(int64_t p) const {
    return modulation_offset(shift, mod.form, mod.seq_len, mod.frame_len, row_of_seq, p);
  }
  int64_t scale_at(int64_t p) const {
    return modulation_offset(scale, mod.form, mod.seq_len, mod.frame_len, row_of_seq, p);
  }

  // d_n_i = g_i (plain) or rn(g_i * t1_i) (modulated; t1 = R_Factor(1 + scale)
  // from the scale row at element offset `at`).
  template <typename Factor, typename M>
  float grad_normalised(int64_t at, int64_t i, float g) const {
    if (!on()) return g;
    return rowwise::modulated_grad<Factor>(g, to_float(load<M>(scale.data, at + i)));
  }
};

}  // namespace cpu
}  // namespace detdit
