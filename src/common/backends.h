// The backend entry points behind the public API. The public functions
// (src/*.cc) validate every argument, then call the backend of the tensors'
// device with the same Params. Backends assume validated params.
//
// cpu:: is the reference: the executable form of docs/numerics.md.
// cuda:: reproduces it byte for byte (portable) or replays PyTorch (torch).
// Without a CUDA build, cuda:: entry points return a RuntimeError.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/out_of_memory.h"

#include "detdit/adaln.h"
#include "detdit/gate_residual.h"
#include "detdit/gate_residual_layernorm.h"
#include "detdit/gate_residual_rmsnorm.h"
#include "detdit/layernorm.h"
#include "detdit/linear.h"
#include "detdit/modulation.h"
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

// layernorm's cross-row partials, fp32, each absent when its outputs are:
// d_weight's and d_bias's chunk partials (C, H), and the [d_shift | d_scale]
// partials (rows, 2H): the plan's segments (indexed form) or each group's
// chunks, group g at rows [g*Cg, (g+1)*Cg) (grouped forms, numerics 6.11).
struct LayernormPartials {
  TensorView weight, bias, table;
};

// Every backend entry point, once: X(name, parameter types...). The list
// declares cpu::name and cuda::name, and generates the dispatch backend::name
// (below) and the stubs of a build without CUDA (src/no_cuda/), so an entry
// point cannot exist in one of these places and be missing from another.
#define DETDIT_BACKEND_OPS(X)                                                                            \
  X(timestep_sinusoid_forward, const TimestepSinusoidParams&, Stream)                                    \
  X(timestep_sinusoid_backward, const TimestepSinusoidBackwardParams&, Stream)                           \
  X(linear_forward, const LinearParams&, Stream)                                                         \
  X(linear_backward_input_partials, const LinearBackwardInputParams&, Stream)                            \
  X(linear_backward_weight, const LinearBackwardWeightParams&, Stream)                                   \
  X(silu_backward, const SiluBackwardParams&, Stream)                                                    \
  /* silu_cast(temb, act, numerics): act = R_T(silu(temb)), T = act's dtype: the cast before every */    \
  /* projection */                                                                                       \
  X(silu_cast, const TensorView&, const TensorView&, Numerics, Stream)                                   \
  X(adaln_row_gather_forward, const AdalnRowGatherParams&, Stream)                                       \
  /* (p, partials): partials (segments, 6H) fp32 contiguous, d_rows' segment partials; the public */     \
  /* layer folds */                                                                                      \
  X(adaln_row_gather_backward_partials, const AdalnRowGatherBackwardParams&, const TensorView&, Stream)  \
  X(rmsnorm_forward, const RmsnormParams&, Stream)                                                       \
  X(gate_residual_forward, const GateResidualParams&, Stream)                                            \
  /* the fused region's forward: h = gate_residual, then (out, rstd) = rmsnorm of h */                  \
  X(gate_residual_rmsnorm_forward, const GateResidualRmsnormParams&, Stream)                             \
  /* The halves of the rmsnorm and gate_residual backwards: rows, partials, folds. The public layer */   \
  /* composes them (src/rowwise/backward.h); the SP region runs them on a ChunkSelection. */            \
  X(rmsnorm_backward_rows, const RmsnormBackwardParams&, Stream) /* dx only */                           \
  /* (p, sel, extra, weight_partials, table_partials): weight_partials (chunks, H) fp32 or absent, */    \
  /* table_partials (segments, 2H) fp32 [shift | scale] or absent */                                     \
  X(rmsnorm_backward_partials, const RmsnormBackwardParams&, const ChunkSelection&, const ExtraRows&,     \
    const TensorView&, const TensorView&, Stream)                                                        \
  X(gate_residual_backward_rows, const GateResidualBackwardParams&, Stream)                              \
  /* the fused region's row-local backward (p, g): g = R_T(rn(d_h + R_T(dx))) (R_T(dx) without d_h), */  \
  /* dx the rmsnorm backward of d_out; d_y = R_T(rn(g * gate)) when p.d_y is present. g (M, H) like h */  \
  X(gate_residual_rmsnorm_backward_rows, const GateResidualRmsnormBackwardParams&, const TensorView&, Stream) \
  /* (p, sel, extra, partials): partials (segments, H) fp32 */                                           \
  X(gate_residual_backward_partials, const GateResidualBackwardParams&, const ChunkSelection&,           \
    const ExtraRows&, const TensorView&, Stream)                                                         \
  /* (plan, partials, out): out[r, :] = rounded ascending fold of row r's segment partials (G, W) */     \
  /* fp32; out (R, W), unit column stride */                                                             \
  X(fold_segment_partials, const IndexPlan&, const TensorView&, const TensorView&, Stream)               \
  /* (partials, out): out[:] = rounded ascending fold over chunks of partials (C, W) fp32; out (W,) */   \
  X(fold_chunk_partials, const TensorView&, const TensorView&, Stream)                                   \
  /* (partials, per_group, mod, out): the grouped modulation forms' fold (numerics 6.11): out's row of */ \
  /* group g = rounded ascending fold of partial rows [g*per_group, (g+1)*per_group) of (G*per_group, */ \
  /* W) fp32; out a grouped modulation view (modulation.h) of W columns */                               \
  X(fold_group_partials, const TensorView&, int64_t, const ResolvedModulation&, const TensorView&, Stream) \
  /* The folds continued from running sums (the SP region's chain over the ranks, one link of */         \
  /* consecutive chunks at a time): the same ascending chains, starting from running instead of +0.0. */ \
  /* (plan, partials, first, running, out): out[r, j] = R(chain from running[r, j] over row r's */        \
  /* segments g in [first, first + partials rows), ascending, partial row g - first); running (R, W) */   \
  /* fp32 or absent (+0.0, then this is fold_segment_partials of those segments); out (R, W) may be */    \
  /* running (in place) */                                                                               \
  X(continue_segment_fold, const IndexPlan&, const TensorView&, int64_t, const TensorView&,              \
    const TensorView&, Stream)                                                                           \
  /* (partials, running, out): out[j] = R(chain from running[j] over the rows of partials (C, W)); */    \
  /* running (W,) fp32 or absent (+0.0); out (W,) may be running */                                      \
  X(continue_chunk_fold, const TensorView&, const TensorView&, const TensorView&, Stream)               \
  /* The composite ops' residual-stream arithmetic (docs/numerics.md 5.10) and device-local copies, */   \
  /* on validated contiguous tensors of one device, never synchronising the host: */                    \
  /* add(a, b, out): out[i] = R_T(rn(a[i] + b[i])), T = the tensors' dtype; out may be a or b */         \
  X(add, const TensorView&, const TensorView&, const TensorView&, Stream)                                \
  /* copy_tensor(src, dst): dst = src, a byte copy of dst.nbytes() bytes */                             \
  X(copy_tensor, const TensorView&, const TensorView&, Stream)                                           \
  /* fill_zero(t): every byte of t = 0 (+0.0 in every float dtype) */                                    \
  X(fill_zero, const TensorView&, Stream)                                                                \
  /* upcast_to_f32(src, dst): dst = fp32(src), exact */                                                  \
  X(upcast_to_f32, const TensorView&, const TensorView&, Stream)                                         \
  /* allocate_scratch(device, bytes, stream, owner): `bytes` of memory, freed with *owner */             \
  /* (stream-ordered on CUDA) */                                                                         \
  X(allocate_scratch, const Device&, std::size_t, Stream, std::shared_ptr<void>*)                       \
  /* layernorm (src/layernorm.cc composes the backward): forward (out, mean, rstd); backward rows (dx */  \
  /* only); partials of every chunk (LayernormPartials above) */                                        \
  X(layernorm_forward, const LayernormParams&, Stream)                                                   \
  X(layernorm_backward_rows, const LayernormBackwardParams&, Stream)                                     \
  X(layernorm_backward_partials, const LayernormBackwardParams&, const LayernormPartials&, Stream)        \
  /* adaln_table_add (src/adaln_table_add.cc composes the backward): forward; d_proj (the cast, summed */ \
  /* over K when proj is broadcast); column_chunk_partials(src, partials): partials (C, W) fp32 = the */  \
  /* ascending chain over each chunk of 256 rows of src (M, W) (numerics 6.5 without an index) */         \
  X(adaln_table_add_forward, const AdalnTableAddParams&, Stream)                                         \
  X(adaln_table_add_backward_proj, const AdalnTableAddBackwardParams&, Stream)                           \
  X(column_chunk_partials, const TensorView&, const TensorView&, Stream)

// CUDA-only entry points (no CPU twin), stubbed without CUDA too.
#define DETDIT_CUDA_ONLY_OPS(X)                                                                          \
  /* gate_residual_layernorm's forward as one kernel per row (src/cuda/gate_residual_layernorm.cu): */ \
  /* h computed, stored and normalised, bitwise equal to gate_residual_forward then layernorm_forward */ \
  /* of h (the CPU runs that composition) */                                                           \
  X(gate_residual_layernorm_forward, const GateResidualLayernormParams&, Stream)                         \
  /* The region backward's walk (src/cuda/gate_residual_rmsnorm.cu): each row's dx coefficient, then one walk over */ \
  /* each chunk giving d_residual, d_y and every partial, bitwise equal to the halves; *launched = */  \
  /* false where it does not apply (plain norm, unaligned rows, too many segments per chunk). */        \
  /* (p, weight_partials, table_partials, gate_partials, stream, launched) */                         \
  X(gate_residual_rmsnorm_backward_walk, const GateResidualRmsnormBackwardParams&, const TensorView&,  \
    const TensorView&, const TensorView&, Stream, bool*)                                                \
  /* linear_backward_fused(input, weight_grads, stream, launched): input.partials (the d_x chunk */     \
  /* partials) and weight_grads.d_weight from one read of W, bitwise equal to */                        \
  /* linear_backward_input_partials and linear_backward_weight (d_bias not computed); */                \
  /* *launched = false where the shapes or dtypes do not fit it (the caller runs the two) */            \
  X(linear_backward_fused, const LinearBackwardInputParams&, const LinearBackwardWeightParams&, Stream, bool*) \
  /* copy_to_host(device_src, host_dst, bytes, device): synchronises `stream` (plan building reads a */  \
  /* CUDA index once on the host) */                                                                    \
  X(copy_to_host, const void*, void*, std::size_t, const Device&, Stream)                                \
  /* upload_tables(device, arrays, device_ptrs, owner): the int32 host arrays into one device */         \
  /* allocation; (*device_ptrs)[i] is array i's copy; *owner frees it */                                 \
  X(upload_tables, const Device&, const std::vector<const std::vector<int32_t>*>&,                       \
    std::vector<const int32_t*>*, std::shared_ptr<void>*, Stream)                                        \
  /* release_scratch_memory(device): the scratch pool's unused memory back to the driver */             \
  X(release_scratch_memory, const Device&)                                                               \
  /* scratch_reserved_bytes(device, bytes): what the scratch pool has mapped (0 before its first use) */ \
  X(scratch_reserved_bytes, const Device&, uint64_t*)

#define DETDIT_DECLARE_BACKEND_OP(name, ...) Status name(__VA_ARGS__);
namespace cpu {
DETDIT_BACKEND_OPS(DETDIT_DECLARE_BACKEND_OP)
}  // namespace cpu
namespace cuda {
DETDIT_BACKEND_OPS(DETDIT_DECLARE_BACKEND_OP)
DETDIT_CUDA_ONLY_OPS(DETDIT_DECLARE_BACKEND_OP)
}  // namespace cuda
#undef DETDIT_DECLARE_BACKEND_OP

// backend::name(device, args...): cuda::name(args...) on a CUDA device, else
// cpu::name(args...). The one place where an op picks its backend, and so the
// narrowest one that covers every host allocation of the backends (their
// std::vector working memory, also inside cpu::parallel_for's workers, which
// hand exceptions to the caller): std::bad_alloc becomes a RuntimeError.
#define DETDIT_DISPATCH_BACKEND_OP(name, ...)                                                          \
  template <typename... Args>                                                                          \
  Status name(const Device& device, Args&&... args) {                                                  \
    return out_of_memory_is_an_error(                                                                  \
        [&] {                                                                                          \
          return std::string("out of memory: the ") + (device.is_cuda() ? "CUDA" : "CPU") +             \
                 " backend of " #name " could not allocate its host working memory";                   \
        },                                                                                             \
        [&] {                                                                                          \
          if (device.is_cuda()) return cuda::name(std::forward<Args>(args)...);                        \
          return cpu::name(std::forward<Args>(args)...);                                               \
        });                                                                                            \
  }
namespace backend {
DETDIT_BACKEND_OPS(DETDIT_DISPATCH_BACKEND_OP)
}  // namespace backend
#undef DETDIT_DISPATCH_BACKEND_OP

}  // namespace detdit
