// The single-pass backward of rmsnorm and of gate_residual_rmsnorm on CUDA
// (src/cuda/rmsnorm_single_pass.cu): its arguments and its launcher. Private
// to the rmsnorm family of src/cuda/.
#pragma once

#include <cstdint>

#include "detdit/plan.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {
namespace cuda {

struct SinglePassArgs {
  // (M, H) rows, row stride H, of the storage type T
  const void* x;        // rmsnorm's x, the fused op's h
  const void* grad;     // rmsnorm's grad, the fused op's d_out
  const float* rstd;    // (M,) saved by the forward
  const void* weight;   // (H,)
  const void* scale;    // (R, H) row stride scale_stride, or nullptr (plain norm)
  int64_t scale_stride;
  void* dx;             // rmsnorm: (M, H), or nullptr
  // the fused op (gate = true)
  const void* y;        // (M, H)
  const void* d_h;      // (M, H), or nullptr
  const void* gate;     // (R, H) row stride gate_stride
  int64_t gate_stride;
  void* d_residual;     // (M, H), or nullptr
  void* d_y;            // (M, H), or nullptr
  PlanTables tables;    // device tables; row_of_seq nullptr for a plain norm without a plan
  int64_t seq_len, positions, hidden;
  int slices;           // ceil(H / 4 / 128): the most vectors of one row-tree thread
  int64_t max_segments; // the most segments of a chunk (set by the launcher)
  // contiguous FP32 partials of every chunk, or nullptr
  float* weight_partials;  // (C, H)
  float* table_partials;   // (G, 2H) [d_shift | d_scale]
  float* gate_partials;    // (G, H) d_gate (the fused op)
};

// Launches the single-pass kernel when the device can run it (sm_90
// clusters, the shared memory of the shape fits); *launched says whether it
// did. gate: the fused op (y, d_h, gate, d_residual, d_y, gate_partials).
Status launch_rmsnorm_backward_single_pass(SinglePassArgs a, DType dtype, bool gate, int64_t max_segments,
                                           Stream stream, bool* launched);

}  // namespace cuda
}  // namespace detdit
