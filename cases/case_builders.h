// One problem of an op at a chosen shape, as the op's case generator builds
// it (cases/rowwise_cases.cc, projection_cases.cc, timestep_cases.cc): the
// same tensors, plans, run functions and input generator as the registered
// cases, for a test that needs a shape of its own (a row with thousands of
// positions, table rows no position references, a hand-made index).
#pragma once

#include <cstdint>

#include "cases/index_case.h"
#include "cases/op_case.h"

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

// ---- timestep_mlp ----------------------------------------------------------------

struct MlpShape {
  int64_t rows = 3, in_features = 24, hidden = 72, dim = 64;
  uint64_t seed = 1400;
  Fill w1{}, b1{}, w2{}, b2{}, features{};  // absent: counter-uniform
};

OpCase timestep_mlp_case(const MlpShape& s);

}  // namespace cases
}  // namespace detdit
