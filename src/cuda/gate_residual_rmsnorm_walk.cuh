// The fused region's backward walks (gate_residual_rmsnorm, modulated norm) on
// CUDA: their arguments, shared by the walk of src/cuda/rmsnorm.cu (the row
// coefficients first, then a block per chunk and column block) and the row
// walk of src/cuda/gate_residual_rmsnorm_row_walk.cu (a block per chunk over
// whole rows, the coefficients inside it). Private to src/cuda/.
#pragma once

#include <cstdint>

#include "detdit/plan.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {
namespace cuda {

struct RegionWalkArgs {
  const void* h;         // (P, H)
  const void* d_out;     // (P, H)
  const void* d_h;       // (P, H), or nullptr
  const void* y;         // (P, H), or nullptr (neither d_gate nor its partials wanted)
  const float* rstd;     // (P,)
  const float* coef;     // (P,) the coefficient kernel's (the column-block walk only)
  const void* weight;    // (H,)
  const void* scale;     // (R, H) row stride scale_stride
  const void* gate;      // (R, H) row stride gate_stride
  int64_t scale_stride, gate_stride;
  PlanTables tables;
  int64_t positions, hidden, seq_len;
  void* d_residual;      // (P, H), or nullptr
  void* d_y;             // (P, H), or nullptr
  float* weight_partials;  // (C, H) row stride weight_partial_stride, or nullptr
  float* table_partials;   // (G, 2H) [shift | scale] row stride table_partial_stride, or nullptr
  float* gate_partials;    // (G, H) row stride gate_partial_stride, or nullptr
  int64_t weight_partial_stride, table_partial_stride, gate_partial_stride;
};

// Runs the row walk where it applies: an sm_90 GPU, a 2-byte dtype, H a
// multiple of 8 and at most 5632, every pointer 16-byte aligned, and as few
// segments per chunk and as many chunks as the tunables ask
// (src/cuda/tuning.h); *launched says whether it ran. The caller has entered
// the device.
Status launch_gate_residual_rmsnorm_backward_row_walk(const RegionWalkArgs& a, DType dtype, int64_t chunks,
                                                      int64_t max_chunk_segments, int device, Stream stream,
                                                      bool* launched);

}  // namespace cuda
}  // namespace detdit
