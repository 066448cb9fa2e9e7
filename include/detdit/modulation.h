// detdit/modulation.h: the modulation forms of the row-wise ops, resolved from
// the tensors' shapes as broadcasting resolves them in the models.
//
// x is (B, S, H) (or (M, H), read as (1, M, H), for the indexed form and
// none). A modulation tensor m (shift, scale or gate) is
//   absent                               -> kNone
//   (R, H) with an IndexPlan             -> kIndexed   (row plan.row_of_seq[s])
//   (B, H) or (B, 1, H), (B, 1, 1, H)    -> kPerSample (one row per batch item)
//   (B, F, H) or (B, F, 1, H), 1 < F < S -> kPerFrame  (position s of item b
//                                           uses frame s / (S / F); S % F != 0
//                                           is a ValueError)
//   (B, S, H) or (B, S, 1, H)            -> kPerToken  (row-local)
// Any outer strides, innermost stride 1 (views of a (B, 6, H) or (B, S, 6, H)
// tensor). Every modulation tensor of one call has one form (one F) and one
// dtype, fp32 or x's. resolve_modulation validates all of them once, before an
// op writes anything; kernels then address element i of position p = b*S + s
// through a ModulationOperand (docs/numerics.md 5.12):
//   kIndexed:             data + plan.row_of_seq[p % S] * stride_b + i
//   kPerSample/Frame/Token: data + (p / S) * stride_b + ((p % S) / L) * stride_f + i
// with L = frame_len = S / F (per sample F = 1, L = S; per token F = S, L = 1).
// The group of position p (per sample, frame or token) is g = p / L, the
// groups of item b are [b*F, (b+1)*F); a group is a contiguous run of L
// positions, which is what the batch-invariant gradient reduction uses.
// "The H3 rule" in the sources: the indexed form (or none) with the
// modulation in x's dtype, upcast = false and no k, i.e. numerics 5.6 / 5.7
// exactly; the fused kernels and the sequence-parallel backwards take only that.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "detdit/plan.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {

enum class ModulationForm { kNone = 0, kIndexed, kPerSample, kPerFrame, kPerToken };

// "none", "indexed", "per_sample", "per_frame", "per_token".
const char* modulation_form_name(ModulationForm form);

// The form shared by every modulation tensor of a call, with the sizes the
// kernels need. For kNone and kIndexed, frames = frame_len = 0.
struct ResolvedModulation {
  ModulationForm form = ModulationForm::kNone;
  DType dtype = DType::kF32;  // the modulation tensors' dtype (x's dtype for kNone)
  int64_t batch = 1;          // B (1 for x of (M, H))
  int64_t seq_len = 1;        // S (M for x of (M, H))
  int64_t frames = 0;         // F: groups per batch item (1 per sample, S per token)
  int64_t frame_len = 0;      // L = S / F: positions per group
  // G = B*F, the number of groups (0 for kNone and kIndexed).
  int64_t groups() const { return batch * frames; }
  // Per sample, per frame or per token: one group per contiguous run of L positions.
  bool grouped() const {
    return form == ModulationForm::kPerSample || form == ModulationForm::kPerFrame ||
           form == ModulationForm::kPerToken;
  }
};

// One resolved modulation tensor as the kernels address it (strides in
// elements; kIndexed: stride_b is the table's row stride, stride_f = 0).
struct ModulationOperand {
  const void* data = nullptr;  // null: absent
  int64_t stride_b = 0;
  int64_t stride_f = 0;
};

// A modulation tensor of a call and the name its errors use ("shift").
struct NamedModulation {
  const TensorView* tensor;
  const char* name;
};

// Resolves the form of `tensors` (absent ones are skipped) against x (named
// x_name): with a valid plan every present tensor must be an (R, H) table
// (kIndexed); without one, x must be (B, S, H) and the tensors one of the
// grouped forms above. Checks for each tensor: present views well formed,
// fp32 or x's dtype (all one dtype), x's device, innermost dimension H with
// stride 1, the form's leading dimensions, one form and one F for all.
// Errors are ValueError (TypeError for a dtype) naming the argument, what was
// expected and what was got. x itself must already be validated.
Status resolve_modulation(const TensorView& x, const char* x_name, std::initializer_list<NamedModulation> tensors,
                          const IndexPlan& plan, ResolvedModulation* resolved);

// The operand of a tensor resolve_modulation accepted (absent: data null).
ModulationOperand modulation_operand(const TensorView& m, const ResolvedModulation& resolved);

// The output dtype of a modulated op on activations of dtype x: x's dtype
// with upcast = true or no modulation; else PyTorch's promotion of x's dtype
// and the modulation's (fp32 when the modulation is fp32, else x's dtype).
DType modulated_out_dtype(DType x, const ResolvedModulation& resolved, bool upcast);

// A gradient output of a grouped modulation tensor m (d_shift of shift): m's
// shape, fp32 or m's dtype, on m's device, innermost stride 1, and groups that
// do not overlap (non-negative strides: stride_f >= H when F > 1, stride_b >=
// (F - 1) * stride_f + H when B > 1). ValueError/TypeError naming `name`.
Status check_modulation_grad(const TensorView& grad, const char* name, const TensorView& m, const char* m_name,
                             const ResolvedModulation& resolved);

}  // namespace detdit
