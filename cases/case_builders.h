// One problem of an op at a chosen shape, as the op's case generator builds
// it (cases/rowwise_cases.cc, projection_cases.cc, timestep_cases.cc): the
// same tensors, plans, run functions and input generator as the registered
// cases, for a test that needs a shape of its own (a row with thousands of
// positions, table rows no position references, a hand-made index).
#pragma once

#include <cstdint>

#include <map>
#include <string>
#include <vector>

#include "cases/index_case.h"
#include "cases/op_case.h"
#include "cases/oracle.h"

namespace detdit {
namespace cases {

// ---- the row-wise ops: values counter-uniform from `seed` -------------------

struct NormShape {
  DType dtype = DType::kBF16;
  int64_t hidden = 0;
  IndexCase index{};
  bool modulated = true;
  DType table_grad_dtype = DType::kF32;
  // shift and scale as (R, H) views at column 1 of (R, H + 1) tensors: rows
  // that are not vector-aligned (the kernels' scalar path).
  bool offset_table = false;
  Fill weight{};  // absent: values around 1 (spread 0.5)
};
OpCase rmsnorm_case(const NormShape& s, uint64_t seed);

struct GateShape {
  DType dtype = DType::kBF16;
  int64_t hidden = 0;
  IndexCase index{};
  bool strided_gate = true;  // chunk 2 of the (R, 6H) rows, or a contiguous (R, H) gate
  DType gate_grad_dtype = DType::kF32;
};
OpCase gate_residual_case(const GateShape& s, uint64_t seed);

struct GatherShape {
  DType dtype = DType::kBF16;
  int64_t hidden = 0;
  IndexCase index{};
  bool strided_rows = false;  // rows (R, 6H) with row stride 6H + 3
  DType rows_grad_dtype = DType::kF32;
  Fill rows{};  // absent: values N(0, 1) (spread 1)
};
OpCase adaln_row_gather_case(const GatherShape& s, uint64_t seed);

// ---- the fused AdaLN ops ------------------------------------------------------

struct ModulationShape {
  int64_t hidden = 20, dim = 24;
  IndexCase index{};
  uint64_t seed = 1600;
  Fill weight{}, bias{}, temb{}, grad{};  // absent: counter-uniform
  DType dtype = DType::kBF16;             // the weight's, the table's and the gradients'
};
OpCase adaln_modulation_case(const ModulationShape& s);

struct FinalShape {
  DType dtype = DType::kBF16;
  int64_t hidden = 20, dim = 24;
  IndexCase index{};
  uint64_t seed = 1700;
  Fill norm_weight{}, weight{}, bias{}, x{}, temb{}, grad{};  // absent: counter-uniform
};
OpCase final_adaln_out_case(const FinalShape& s);

// ---- linear, adaln_projection, adaln_table_add (cases/projection_cases.cc) ----------

struct LinearShape {
  DType dtype = DType::kF32;
  int64_t rows = 1, in_features = 8, out_features = 64;
  bool bias = true, silu = false;
  DType out_dtype = DType::kF32;
  bool partials = true;  // the chunk partials as an output (else internal scratch)
  uint64_t seed = 1000;
};
OpCase linear_case(const LinearShape& s);

struct ProjectionShape {
  DType dtype = DType::kBF16;
  int64_t rows = 1, dim = 8, out_features = 18 * 4;
  uint64_t seed = 1500;
  Fill weight{}, bias{}, temb{};  // absent: counter-uniform
  int chunks = 0;                 // 0: H3's projection; > 0: a family's chunk count
  DType temb_dtype = DType::kF32; // a family's may be the weight's
};
OpCase adaln_projection_case(const ProjectionShape& s);
// verify's FP64 checks of a projection's table: within the FP32-accumulation
// rounding bound, and (tables of 100000 outputs or more) >= 99.98 % correctly rounded.
std::vector<AccuracyCheck> projection_forward_accuracy(int64_t outputs);

struct TableAddShape {
  DType table_dtype = DType::kF32, proj_dtype = DType::kBF16;
  int64_t rows = 1, chunks = 6, hidden = 8;
  bool broadcast = false;  // proj (T, 1, H): the final layers' time embedding
  uint64_t seed = 1800;
};
OpCase adaln_table_add_case(const TableAddShape& s);

// ---- timestep_sinusoid (cases/timestep_cases.cc) ------------------------------------

// A family's convention: the op's scalar arguments (TimestepSinusoidInputs'
// defaults are H3's) and how its timesteps are drawn.
struct SinusoidConvention {
  std::string name;  // "" for H3's (the case names stay as they were)
  bool flip_sin_to_cos = true;
  float downscale_freq_shift = 0.0f, scale = 1.0f, t_max = 1.0f;
  bool integer_timesteps = false;  // integers in [0, t_max - 1] (Wan, CogVideoX schedulers)
};
// count timesteps of `dtype` (uniform in the convention's range, led by its
// edges) and `channels` features, with the FP64 oracle of the features and,
// bitwise, numerics 5.1 and 6.1 in scalar FP32.
OpCase family_sinusoid_case(const SinusoidConvention& conv, DType dtype, int64_t count, int64_t channels,
                            uint64_t seed);

// ---- timestep_mlp ----------------------------------------------------------------

struct MlpShape {
  int64_t rows = 3, in_features = 24, hidden = 72, dim = 64;
  uint64_t seed = 1400;
  Fill w1{}, b1{}, w2{}, b2{}, features{};  // absent: counter-uniform
  DType dtype = DType::kF32;                // every tensor's; bf16: the activation-dtype MLP
};

OpCase timestep_mlp_case(const MlpShape& s);

// ---- the families' embeddings in the activation dtype (cases/embedding_cases.cc) ----

// combined_timestep_embedding (sinusoid features (rows, channels), guided or
// not, and the pooled text (rows, pooled), every MLP -> hidden).
struct EmbeddingShape {
  DType dtype = DType::kBF16;
  int64_t rows = 3, channels = 32, pooled = 24, hidden = 48;
  bool guided = false;
  uint64_t seed = 3000;
};
OpCase combined_timestep_embedding_case(const EmbeddingShape& s);
// timestep_mlp's bf16 cases of `suite` (timestep_mlp_cases adds them to its own).
std::vector<OpCase> bf16_timestep_mlp_cases(Suite suite, const CaseContext& ctx);

// One MLP's tensor names in a case: x, out; prefix + w1, b1, w2, b2, pre,
// hidden; grad_<out>; d_<each input>.
struct MlpCaseNames {
  std::string x, out, w1, b1, w2, b2, pre, hidden, grad, d_x, d_w1, d_b1, d_w2, d_b2;
};
MlpCaseNames mlp_case_names(const std::string& x, const std::string& out, const std::string& prefix);
// The FP64 oracle (cases/oracle.h) of a case's MLP from host copies of its
// tensors (the backward's too when `backward`).
MlpReference mlp_case_reference(const std::map<std::string, HostTensor>& t, const MlpCaseNames& n, bool backward);
// The forward's stages each against FP64 from the run's own input to it: pre,
// hidden, and with check_out the MLP's out and the whole chain from x.
std::vector<AccuracyCheck> mlp_forward_stage_accuracy(const MlpCaseNames& n, bool check_out);

}  // namespace cases
}  // namespace detdit
