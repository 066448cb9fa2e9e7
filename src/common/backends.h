// The backend entry points behind the public API. The public functions
// (src/*.cc) validate every argument, then call the backend of the tensors'
// device with the same Params. Backends assume validated params.
//
// cpu:: is the reference: the executable form of docs/numerics.md.
// cuda:: reproduces it byte for byte (portable) or replays PyTorch (torch).
// Without a CUDA build, cuda:: entry points return a RuntimeError.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "detdit/adaln.h"
#include "detdit/gate_residual.h"
#include "detdit/linear.h"
#include "detdit/numerics.h"
#include "detdit/rmsnorm.h"
#include "detdit/status.h"
#include "detdit/timestep.h"

namespace detdit {

// The canonical reduction (docs/numerics.md 6.5) split into its two halves,
// so the sequence-parallel region can compute the partials of the chunks a
// rank owns, all-gather them, and fold exactly as one device does.
//
// A ChunkSelection names the chunks whose partials to compute and where each
// global position's row lives. Partials are written in selection order: for
// each selected chunk (ascending), its segments in plan order (segment
// partials), or one partial per chunk (chunk partials, e.g. rmsnorm d_weight).
// All pointers live where the backend computes (host for cpu::, device for
// cuda::).
struct ChunkSelection {
  const int32_t* chunks = nullptr;  // (num_chunks,) ascending chunk ids; nullptr: every chunk of the plan
  int64_t num_chunks = 0;
  // (P,) for each global position p: r >= 0 is row r of the op's own row
  // tensors; r < 0 is row (-1 - r) of the `extra` row tensors (rows received
  // from other ranks). nullptr: position p is row p of the own tensors.
  const int32_t* position_row = nullptr;
};

// Row tensors received from other ranks, (rows, H) each, same dtypes as the
// op's own: rmsnorm uses x, grad, rstd; gate_residual uses grad, y.
struct ExtraRows {
  TensorView x, grad, y, rstd;
};

#define DETDIT_BACKEND_OPS(ns)                                                                   \
  namespace ns {                                                                                 \
  Status timestep_sinusoid_forward(const TimestepSinusoidParams& p, Stream stream);              \
  Status timestep_sinusoid_backward(const TimestepSinusoidBackwardParams& p, Stream stream);     \
  Status linear_forward(const LinearParams& p, Stream stream);                                   \
  Status linear_backward_input_partials(const LinearBackwardInputParams& p, Stream stream);      \
  Status linear_backward_weight(const LinearBackwardWeightParams& p, Stream stream);            \
  Status silu_backward(const SiluBackwardParams& p, Stream stream);                             \
  /* act = R_T(silu(temb)), T = act's dtype: the cast before every projection */                \
  Status silu_cast(const TensorView& temb, const TensorView& act, Numerics numerics, Stream stream); \
  Status adaln_row_gather_forward(const AdalnRowGatherParams& p, Stream stream);                 \
  /* partials (segments, 6H) fp32 contiguous: d_rows' segment partials; the public layer folds */ \
  Status adaln_row_gather_backward_partials(const AdalnRowGatherBackwardParams& p, const TensorView& partials, \
                                            Stream stream);                                      \
  Status rmsnorm_forward(const RmsnormParams& p, Stream stream);                                 \
  Status gate_residual_forward(const GateResidualParams& p, Stream stream);                      \
  /* the halves of the rmsnorm and gate_residual backwards: rows, partials, folds; the public */  \
  /* layer composes them (src/rowwise_backward.h), the SP region runs them on a ChunkSelection */  \
  Status rmsnorm_backward_rows(const RmsnormBackwardParams& p, Stream stream); /* dx only */     \
  /* weight_partials (chunks, H) fp32 or absent; table_partials (segments, 2H) fp32 [shift|scale] or absent */ \
  Status rmsnorm_backward_partials(const RmsnormBackwardParams& p, const ChunkSelection& sel,    \
                                   const ExtraRows& extra, const TensorView& weight_partials,    \
                                   const TensorView& table_partials, Stream stream);             \
  Status gate_residual_backward_rows(const GateResidualBackwardParams& p, Stream stream);       \
  /* partials (segments, H) fp32 */                                                              \
  Status gate_residual_backward_partials(const GateResidualBackwardParams& p, const ChunkSelection& sel, \
                                         const ExtraRows& extra, const TensorView& partials, Stream stream); \
  /* out[r, :] = rounded ascending fold of row r's segment partials (G, W) fp32; out (R, W), unit column stride */ \
  Status fold_segment_partials(const IndexPlan& plan, const TensorView& partials, const TensorView& out, \
                               Stream stream);                                                   \
  /* out[:] = rounded ascending fold over chunks of partials (C, W) fp32; out (W,) */           \
  Status fold_chunk_partials(const TensorView& partials, const TensorView& out, Stream stream);  \
  }

DETDIT_BACKEND_OPS(cpu)
DETDIT_BACKEND_OPS(cuda)

namespace cuda {
// Copy bytes from device memory to the host, synchronising `stream` (plan
// building reads a CUDA index once on the host).
Status copy_to_host(const void* device_src, void* host_dst, std::size_t bytes, const Device& device,
                    Stream stream);
// Copy the int32 host arrays into one device allocation on `device`;
// (*device_ptrs)[i] is array i's copy; *owner frees the allocation.
Status upload_tables(const Device& device, const std::vector<const std::vector<int32_t>*>& arrays,
                     std::vector<const int32_t*>* device_ptrs, std::shared_ptr<void>* owner, Stream stream);
}  // namespace cuda

#undef DETDIT_BACKEND_OPS

}  // namespace detdit
