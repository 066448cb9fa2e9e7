// The modulation forms' cases of rmsnorm, gate_residual and gate_residual_rmsnorm
// (cases/forms_cases.cc):
// per sample, per frame, per token and none, fp32 or x's dtype modulation,
// both recipes (upcast), and for gate_residual an absent gate and the
// constant k. The three ops' generators (cases/rowwise_cases.cc) append these
// to their indexed cases, so every driver of those ops runs them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cases/index_case.h"
#include "cases/op_case.h"
#include "cases/oracle.h"
#include "detdit/modulation.h"
#include "detdit/tensor.h"

namespace detdit {
namespace cases {

// One grouped-form problem. The modulation tensors are chunks of one parent,
// as the models make them: per sample a (B, 6, H) tensor, per frame
// (B, F, 6, H), per token (B, S, 6, H); chunk c is viewed as parent[:, c]
// ((B, H), (B, F, H), (B, S, H)) or, with keep_chunk_dim, parent[:, c:c+1]
// / parent[:, :, c:c+1] ((B, 1, H), (B, F, 1, H), (B, S, 1, H)). rmsnorm reads
// shift = chunk 0 and scale = chunk 1, gate_residual the gate = chunk 2
// (layernorm and gate_residual_layernorm likewise, cases/layernorm_cases.cc).
// kIndexed (the generators of those two ops): an (R, 6, H) parent, R = 3T of
// the interleaved index case of B x S with T = 3, chunk c viewed as (R, H)
// with a plan over the rows.
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

// A FormShape's modulation layout: the parent (B, F, 6, H) (per sample
// (B, 6, H); indexed (R, 6, H)), group g = b*F + f (indexed: table row r) at
// element g*6H, chunk c at +c*H.
struct FormGeometry {
  int64_t batch, seq_len, hidden, frames;  // frames: F (1 per sample, S per token, R indexed)
  bool keep_chunk_dim;
  ModulationForm form;
  IndexCase index;  // kIndexed: the rows of the positions (else empty)

  std::vector<int64_t> parent_shape() const;
  // The shape of one chunk's view (and of its gradient).
  std::vector<int64_t> view_shape() const;
  // parent[:, c] or parent[:, c:c+1] (per sample); parent[:, :, c] or
  // parent[:, :, c:c+1]; indexed parent[:, c].
  TensorView chunk(const TensorView& parent, int c) const;
  // The modulation row (group, or table row) of each flattened position p = b*S + s.
  std::vector<int64_t> group_of() const;
  // Chunk c of the host parent as the FP64 oracles read it (cases/oracle.h).
  ModulationRows rows(const HostTensor& parent, int c) const { return {&parent, 6 * hidden, c * hidden}; }
  double elements() const { return static_cast<double>(batch * frames * hidden); }
};
FormGeometry form_geometry(const FormShape& s);

// out's (and grad's) dtype: fp32 for fp32 modulation with upcast = false, else x's (5.12).
DType form_out_dtype(const FormShape& s);
// The case name of a form: "<form> [F=..] [<view dims>] <M> modulation <T> x H= B= S= <recipe> [k=] [grads <dtype>]".
std::string form_case_name(const FormShape& s);
// Values: counter-uniform (tests, bench) or verify's synthetic-weights stream.
Fill form_values(bool verify_values, uint64_t seed, double mean, double std);

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
