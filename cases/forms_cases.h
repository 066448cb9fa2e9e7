// The modulation forms' cases of rmsnorm, gate_residual and gate_residual_rmsnorm
// (cases/forms_cases.cc):
// per sample, per frame, per token and none, fp32 or x's dtype modulation,
// both recipes (upcast), and for gate_residual an absent gate and the
// constant k. The three ops' generators (cases/rowwise_cases.cc) append these
// to their indexed cases, so every driver of those ops runs them.
#pragma once

#include <cstdint>
#include <vector>

#include "cases/op_case.h"
#include "detdit/modulation.h"
#include "detdit/tensor.h"

namespace detdit {
namespace cases {

// One grouped-form problem. The modulation tensors are chunks of one parent,
// as the models make them: per sample a (B, 6, H) tensor, per frame
// (B, F, 6, H), per token (B, S, 6, H); chunk c is viewed as parent[:, c]
// ((B, H), (B, F, H), (B, S, H)) or, with keep_chunk_dim, parent[:, c:c+1]
// / parent[:, :, c:c+1] ((B, 1, H), (B, F, 1, H), (B, S, 1, H)). rmsnorm reads
// shift = chunk 0 and scale = chunk 1, gate_residual the gate = chunk 2.
struct FormShape {
  DType dtype = DType::kBF16;      // x's (residual's)
  DType mod_dtype = DType::kBF16;  // the modulation's: fp32 or x's
  int64_t hidden = 0, batch = 2, seq_len = 300;
  ModulationForm form = ModulationForm::kPerSample;  // kNone: gate_residual without a gate
  int64_t frames = 1;  // F for kPerFrame (1 < F < S, S % F == 0); set from the form otherwise
  bool keep_chunk_dim = false;
  bool upcast = false;
  bool has_k = false;  // gate_residual: the gate term k + gate
  float k = 0.0f;
  DType grad_dtype = DType::kF32;  // d_shift, d_scale, d_gate
};

OpCase rmsnorm_form_case(const FormShape& s, uint64_t seed, bool verify_values = false);
OpCase gate_residual_form_case(const FormShape& s, uint64_t seed, bool verify_values = false);
// gate_residual_rmsnorm: gate = chunk 2, shift = chunk 3, scale = chunk 4 of
// the parent (the H3 block's gate_msa, shift_mlp, scale_mlp); kNone: no gate
// and a plain norm. d_h always present. Its equivalent route is the two ops'
// CPU results composed (gate_residual, then rmsnorm; autograd's backward).
OpCase gate_residual_rmsnorm_form_case(const FormShape& s, uint64_t seed, bool verify_values = false);

// The form cases of each suite (rmsnorm_cases / gate_residual_cases append them).
std::vector<OpCase> rmsnorm_form_cases(Suite suite, const CaseContext& context);
std::vector<OpCase> gate_residual_form_cases(Suite suite, const CaseContext& context);
std::vector<OpCase> gate_residual_rmsnorm_form_cases(Suite suite, const CaseContext& context);

}  // namespace cases
}  // namespace detdit
