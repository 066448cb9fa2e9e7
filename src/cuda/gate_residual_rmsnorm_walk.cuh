// The fused region's backward walks (gate_residual_rmsnorm, modulated norm) on
// CUDA: their arguments and their per-position dx step, shared by the walk of
// src/cuda/gate_residual_rmsnorm.cu (the row coefficients first, then a block per chunk and
// column block) and the row walk of src/cuda/gate_residual_rmsnorm_row_walk.cu
// (a block per chunk over whole rows, the coefficients inside it). Private to
// src/cuda/.
#pragma once

#include <cstdint>

#include "common/rowwise_math.h"
#include "common/scalar_math.h"
#include "common/storage.h"
#include "cuda/cuda_util.cuh"
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

// One position's row-local step of both walks (numerics 6.10 with 7), for
// the N columns [column, column + N) of position p, whose segment's table row
// is r: from the widened h (x), d_out (grad) and weight values and the
// position's rstd and dx coefficient, d_n = modulated_grad(grad, scale) and
// g = R_T(dx), then g = R_T(rn(g + d_h)) where d_h is given (load_d_h fills
// its N values; called only then), g to d_residual and R_T(rn(g * gate)) to
// d_y where they are asked for. d_n and g stay with the caller for the chains.
template <typename T, int N, typename LoadDh>
__device__ __forceinline__ void region_dx_step(const RegionWalkArgs& a, int64_t p, int64_t r, int64_t column,
                                               float rstd, float coef, const float (&xv)[N], const float (&gv)[N],
                                               const float (&wv)[N], LoadDh load_d_h, float (&d_n)[N],
                                               float (&g)[N]) {
  float sc[N];
  load_readonly<T, N, true>(static_cast<const T*>(a.scale) + r * a.scale_stride + column, sc);
#pragma unroll
  for (int e = 0; e < N; ++e) {
    d_n[e] = rowwise::modulated_grad<T>(gv[e], sc[e]);
    g[e] = round_to<T>(rowwise::dx_value(rstd, wv[e], d_n[e], xv[e], coef));  // the norm's dx
  }
  if (a.d_h) {
    float dh[N];
    load_d_h(dh);
#pragma unroll
    for (int e = 0; e < N; ++e) g[e] = round_to<T>(num::add32(g[e], dh[e]));  // g = R_T(rn(dx + d_h))
  }
  const int64_t offset = p * a.hidden + column;  // (P, H)
  if (a.d_residual) store_elems<T, N, true>(static_cast<T*>(a.d_residual) + offset, g);
  if (a.d_y) {
    float gate[N], d_y[N];
    load_readonly<T, N, true>(static_cast<const T*>(a.gate) + r * a.gate_stride + column, gate);
#pragma unroll
    for (int e = 0; e < N; ++e) d_y[e] = rowwise::gated_grad(g[e], gate[e]);
    store_elems<T, N, true>(static_cast<T*>(a.d_y) + offset, d_y);
  }
}

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
