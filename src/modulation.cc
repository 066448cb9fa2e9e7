// The modulation forms' one resolution and validation (include/detdit/modulation.h),
// shared by every op that takes shift, scale or gate tensors.
#include "detdit/modulation.h"

#include <string>

#include "common/validate.h"
#include "rowwise/checks.h"

namespace detdit {
namespace {

std::string dims(int64_t b, int64_t s, int64_t h) {
  return "B = " + std::to_string(b) + ", S = " + std::to_string(s) + ", H = " + std::to_string(h);
}

// The grouped form of one tensor m against x (B, S, H); *frames receives F.
Status grouped_form(const TensorView& m, const char* name, int64_t batch, int64_t seq_len, int64_t hidden,
                    ModulationForm* form, int64_t* frames) {
  const std::string expected = std::string(name) +
                               " without a plan must be per sample (B, H) or (B, 1, H), per frame (B, F, H) or "
                               "(B, F, 1, H), or per token (B, S, H), with " +
                               dims(batch, seq_len, hidden) + ", got " + m.describe();
  if (m.rank < 2 || m.rank > 4 || m.shape[0] != batch || m.shape[m.rank - 1] != hidden)
    return Status::value_error(expected);
  if (m.rank == 4 && m.shape[2] != 1) return Status::value_error(expected);
  const int64_t f = m.rank == 2 ? 1 : m.shape[1];
  if (f < 1) return Status::value_error(expected);
  if (seq_len % f != 0)
    return Status::value_error(std::string(name) + " has F = " + std::to_string(f) +
                               " frames, which must divide S = " + std::to_string(seq_len) +
                               " (position s uses frame s / (S / F)), got " + m.describe());
  *frames = f;
  *form = f == 1 ? ModulationForm::kPerSample : f == seq_len ? ModulationForm::kPerToken : ModulationForm::kPerFrame;
  return Status();
}

}  // namespace

const char* modulation_form_name(ModulationForm form) {
  switch (form) {
    case ModulationForm::kNone: return "none";
    case ModulationForm::kIndexed: return "indexed";
    case ModulationForm::kPerSample: return "per_sample";
    case ModulationForm::kPerFrame: return "per_frame";
    case ModulationForm::kPerToken: return "per_token";
  }
  return "unknown";
}

Status resolve_modulation(const TensorView& x, const char* x_name, std::initializer_list<NamedModulation> tensors,
                          const IndexPlan& plan, ResolvedModulation* resolved) {
  const int64_t hidden = x.shape[x.rank - 1];
  ResolvedModulation r;
  r.dtype = x.dtype;
  // B and S: the plan's when there is one (x (M, H) is then B*S rows), else x's.
  r.batch = plan.valid() ? plan.batch() : x.rank == 3 ? x.shape[0] : 1;
  r.seq_len = plan.valid() ? plan.seq_len() : x.numel() / hidden / r.batch;
  const NamedModulation* first = nullptr;  // the tensor that fixed the form
  for (const NamedModulation& t : tensors) {
    const TensorView& m = *t.tensor;
    if (!m.present()) continue;
    DETDIT_RETURN_IF_ERROR(check::well_formed(m, t.name));
    if (m.dtype != x.dtype && m.dtype != DType::kF32)
      return Status::type_error(std::string(t.name) + " must be " + dtype_name(x.dtype) + ", got " +
                                dtype_name(m.dtype) + " (a modulation tensor has " + x_name +
                                "'s dtype or float32)");
    ModulationForm form;
    int64_t frames = 0;
    if (plan.valid()) {
      // The indexed form: the same checks and messages as every indexed op.
      DETDIT_RETURN_IF_ERROR(check::plan_on(plan, "plan", x, x_name));
      DETDIT_RETURN_IF_ERROR(
          rowwise::check_table(m, t.name, plan.num_rows(), hidden, x, x_name, {x.dtype, DType::kF32}));
      form = ModulationForm::kIndexed;
    } else {
      DETDIT_RETURN_IF_ERROR(check::same_device(m, t.name, x, x_name));
      if (x.rank != 3)
        return Status::value_error("plan is required: " + std::string(t.name) + " " + m.describe() +
                                   " without a plan is per-sample, per-frame or per-token modulation, which needs " +
                                   x_name + " as (B, S, H), got " + x_name + " " + x.describe());
      const Status grouped = grouped_form(m, t.name, r.batch, r.seq_len, hidden, &form, &frames);
      // An (R, H) table whose plan is missing reads as a per-sample tensor of the wrong B.
      if (!grouped.ok() && m.rank == 2)
        return Status(grouped.kind(), "plan is required for an (R, H) table; without one, " + grouped.message());
      DETDIT_RETURN_IF_ERROR(grouped);
      if (m.strides[m.rank - 1] != 1)
        return Status::value_error(std::string(t.name) + " must have unit innermost stride, got strides of " +
                                   m.describe());
    }
    if (first == nullptr) {
      first = &t;
      r.form = form;
      r.dtype = m.dtype;
      r.frames = frames;
      r.frame_len = frames > 0 ? r.seq_len / frames : 0;
      continue;
    }
    if (m.dtype != r.dtype)
      return Status::type_error(std::string(t.name) + " must have " + first->name + "'s dtype " +
                                dtype_name(r.dtype) + " (one modulation dtype per call), got " + dtype_name(m.dtype));
    if (form != r.form || frames != r.frames)
      return Status::value_error(std::string(t.name) + " must have " + first->name + "'s form " +
                                 modulation_form_name(r.form) + " (F = " + std::to_string(r.frames) +
                                 "; one modulation form per call), got " + modulation_form_name(form) + " " +
                                 m.describe());
  }
  *resolved = r;
  return Status();
}

DType modulated_out_dtype(DType x, const ResolvedModulation& resolved, bool upcast) {
  if (upcast || resolved.form == ModulationForm::kNone) return x;
  return resolved.dtype == DType::kF32 ? DType::kF32 : x;
}

ModulationOperand modulation_operand(const TensorView& m, const ResolvedModulation& resolved) {
  ModulationOperand op;
  if (!m.present()) return op;
  op.data = m.data;
  op.stride_b = m.strides[0];
  // (B, H) and (B, 1, H): one row per item; (B, F, H), (B, F, 1, H): frame stride.
  op.stride_f = resolved.grouped() && m.rank >= 3 ? m.strides[1] : 0;
  return op;
}

Status check_modulation_grad(const TensorView& grad, const char* name, const TensorView& m, const char* m_name,
                             const ResolvedModulation& resolved) {
  DETDIT_RETURN_IF_ERROR(check::dtype(grad, name, {DType::kF32, m.dtype}));
  DETDIT_RETURN_IF_ERROR(check::same_device(grad, name, m, m_name));
  bool same = grad.rank == m.rank;
  for (int d = 0; same && d < m.rank; ++d) same = grad.shape[d] == m.shape[d];
  if (!same)
    return Status::value_error(std::string(name) + " must have " + m_name + "'s shape " + m.shape_string() +
                               ", got " + grad.describe());
  const int64_t hidden = m.shape[m.rank - 1];
  if (grad.strides[grad.rank - 1] != 1)
    return Status::value_error(std::string(name) + " must have unit innermost stride, got " + grad.describe());
  const ModulationOperand op = modulation_operand(grad, resolved);
  const bool frames_apart = resolved.frames <= 1 || op.stride_f >= hidden;
  const bool items_apart = resolved.batch <= 1 || op.stride_b >= (resolved.frames - 1) * op.stride_f + hidden;
  if (op.stride_f < 0 || op.stride_b < 0 || !frames_apart || !items_apart)
    return Status::value_error(std::string(name) +
                               " must not overlap itself: its rows need non-negative strides with stride_f >= H and "
                               "stride_b >= (F - 1) * stride_f + H (H = " +
                               std::to_string(hidden) + ", F = " + std::to_string(resolved.frames) + "), got strides " +
                               std::to_string(op.stride_b) + ", " + std::to_string(op.stride_f) + " of " +
                               grad.describe());
  return Status();
}

}  // namespace detdit
