// detdit/parallel.h: tensor parallelism (tp_adaln_projection) and sequence
// parallelism (the sp_region: rmsnorm, modulation in every form, gate_residual), byte-equal
// to one device (WS1) for every world size. The only collectives are the
// Communicator's rank-ordered all-gather and broadcast (detdit/comm.h),
// byte copies; no reduction ever happens inside a collective. docs/parallel.md explains the plan with a
// worked example and the rows and bytes each rank moves.
//
// Errors are collective: each op validates its arguments and allocates its
// scratch, then every rank learns (Communicator::agree) whether any rank
// failed and whether every rank makes the same call (the index plan's
// fingerprint, the shapes and profile, the gathered outputs), before the
// first data collective. A failing call fails on every rank and writes no
// output.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "detdit/adaln.h"
#include "detdit/comm.h"
#include "detdit/gate_residual.h"
#include "detdit/gate_residual_layernorm.h"
#include "detdit/gate_residual_rmsnorm.h"
#include "detdit/layernorm.h"
#include "detdit/plan.h"
#include "detdit/rmsnorm.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {

// ---------------------------------------------------------------------------
// tp_adaln_projection: the N output columns of the (T, N) table are cut into
// C = ceil(N / 64) chunks of kLinearChunkRows (64) columns (the WS1 d_x chunks;
// the last one is short when 64 does not divide N). Rank r of tp owns the
// contiguous chunks [c_r, c_r + n_r) with n_r = C/tp + (r < C%tp ? 1 : 0) and
// c_r = r*(C/tp) + min(r, C%tp): the counts differ by at most one, the first
// C%tp ranks own one more. Its columns [64*c_r, min(64*(c_r + n_r), N)) are
// those rows of the projection weight and bias. Any tp from 1 to C works;
// tp > C (a rank without a chunk) is refused.
//
// Forward:  act = R_W(silu(temb)) (replicated), local = linear(act, W_shard,
//   b_shard) (exactly the WS1 columns), all-gather (each rank's block padded
//   to rank 0's size), copy every rank's columns into the (T, N) WS1 table on
//   every rank.
// Backward: g = fp32(grad_table[:, shard]); dW, db of the shard locally (the
//   WS1 rows); d_x chunk partials of the shard (exactly WS1 chunks
//   [c_r, c_r + n_r)), all-gathered (padded blocks), put in global chunk order
//   and folded the WS1 way on every rank; d_temb = SiLU VJP. grad_table must
//   be the same on every rank.
//
// The Params are the WS1 ones (adaln.h) with weight, bias, d_weight and d_bias
// being this rank's (end - begin, D) / (end - begin,) shard (tp_column_shard)
// and table / grad_table the full (T, N). N = table.shape[1]
// (grad_table.shape[1]) is a multiple of 18 (H3's projection, in.chunks = 0),
// or of in.chunks (a DiT family's, adaln.h: temb in the weight's dtype). Every
// rank must pass the same chunks (a different one fails every rank).

// [*begin, *end): the columns of `rank` in a `world`-way split of `columns`
// (above). ValueError "tp=9 is more ranks than the 5 64-column chunks of N=288:
// every rank needs a chunk; valid tp: 1 to 5" when world > C.
Status tp_column_shard(int64_t columns, int world, int rank, int64_t* begin, int64_t* end);

Status tp_adaln_projection_forward(Communicator& comm, const AdalnProjectionParams& params,
                                   Stream stream = nullptr);
Status tp_adaln_projection_backward(Communicator& comm, const AdalnProjectionBackwardParams& params,
                                    Stream stream = nullptr);

// ---------------------------------------------------------------------------
// sp_region: rank r holds positions [r*S/sp, (r+1)*S/sp) (floor division) of
// every batch item: its activations are the local rows (B, S_local, H) (or
// (B*S_local, H)), local row b*S_local + (s - lo). The (S,) row index (its
// IndexPlan), the tables (shift, scale, gate) and the norm weight are
// replicated.
//
// An SpPlan is derived on every rank from replicated metadata (the IndexPlan,
// world, rank), once per index, and reused by every op and block. With
// positions p = b*S + s and the canonical 256-position chunks (plan.h):
//   - the owner of a chunk is the owner of its first position;
//   - rows that move: positions of a chunk owned by another rank; rank q sends
//     its such rows in ascending p (slot = ordinal), in a send block of
//     max_send rows (max over ranks, known to all from the replicated plan);
//   - position_row: own rows -> local row (>= 0), received rows ->
//     -1 - (owner*max_send + slot) (backends.h ChunkSelection).
//
// Forward: the WS1 op on the local rows with the local index index[lo:hi)
// (no communication). Backward: the agreement (above); ONE all-gather of the
// straddling rows (skipped when no rank sends any); each chunk's partials
// computed by its owner; the folds as a chain along the global chunk order:
// each link (a run of consecutive chunks of one owner) continues the running
// sums of the link before it on its owner, which broadcasts them (one
// broadcast of the R x width sums per link, the last one gives every rank the
// result); then the outputs: the row-local gradients (dx, d_y, d_residual)
// and the replicated ones, rounded from the final sums.
// Every output and gradient is byte-equal to WS1,
// and the replicated gradients (d_weight, d_shift, d_scale, d_gate) are
// identical on every rank. On CUDA the plan's tables live on the device and
// no op synchronises the host.
class SpPlan {
 public:
  SpPlan() = default;

  // plan: the replicated (S,) index plan (batch B). Errors: ValueError "need
  // 0 <= rank < world, got rank=..., world=..." and "every rank needs a row:
  // seq_len=..., world=..., batch=...".
  static Status create(const IndexPlan& plan, int world, int rank, SpPlan* sp, Stream stream = nullptr);
  // The SpPlan of a region without an index (the grouped forms, plain ops):
  // positions only, global_plan() and local_plan() empty. Errors as above,
  // and ValueError "need seq_len >= 1 and batch >= 1, ...".
  static Status create(int64_t seq_len, int64_t batch, int world, int rank, SpPlan* sp);

  bool valid() const { return impl_ != nullptr; }
  int world() const;
  int rank() const;
  int64_t seq_len() const;        // S
  int64_t batch() const;          // B
  int64_t local_begin() const;    // lo = rank*S/world
  int64_t local_end() const;      // hi = (rank+1)*S/world
  int64_t local_seq_len() const;  // hi - lo
  const IndexPlan& global_plan() const;  // the (S,) plan it was built from
  const IndexPlan& local_plan() const;   // index[lo:hi), batch B

  // What the plan moves (every rank knows every rank's numbers).
  struct RankTraffic {
    int64_t send_rows = 0;      // own rows another rank's chunks need
    int64_t receive_rows = 0;   // other ranks' rows this rank's chunks need
    int64_t chunks = 0;         // chunks this rank owns
    int64_t segments = 0;       // segments of those chunks
  };
  const std::vector<RankTraffic>& traffic() const;  // (world,)
  int64_t max_send() const;      // rows per send block (max send_rows)
  int64_t max_chunks() const;    // max chunks per rank
  int64_t max_segments() const;  // max segments per rank
  // Links of the folds' chain (runs of consecutive chunks with one owner;
  // about B * world): the backward's broadcasts per replicated family.
  int64_t chain_links() const;

  struct Impl;
  const Impl& impl() const { return *impl_; }

 private:
  std::shared_ptr<const Impl> impl_;
};

// The grouped modulation forms (modulation.h), every recipe: a call without
// a plan (on an SpPlan of an index or of the positions alone). Per sample
// (B, H) / (B, 1, H) and per frame (B, F, H) / (B, F, 1, H) are replicated
// and mean the global positions (frame s / (S/F)); per token is this rank's
// rows (B, S_local, H), like the activations and its gradients. Forward:
// row-local (per frame, one WS1 call per piece of the local rows within
// whole frames). Backward: the row-local gradients by the same pieces; each
// summed gradient is a list of chunks (d_weight: the canonical 256-position
// chunks; per-sample / per-frame d_shift, d_scale, d_gate: chunks of 256
// from each group's first position), each computed by the holder of its
// first position on its rows (one all-gather of the rows that straddle),
// then one all-gather of every chunk partial and the WS1 fold on every rank
// (docs/parallel.md 3). The indexed form beyond the H3 rule (an fp32 table,
// upcast, k) takes the same steps on the SpPlan's chunks, with the WS1
// partials on the plan of each rank's own chunks (built with the SpPlan);
// the H3 rule keeps the chain fold above.
//
// The Params are the WS1 ones with the local rows; params.plan is the SpPlan's
// global plan (required when modulated, may be absent for a plain norm; a plan
// of the local slice is rejected: the full (S,) index is required).
Status sp_rmsnorm_forward(const SpPlan& sp, const RmsnormParams& params, Stream stream = nullptr);
Status sp_rmsnorm_backward(Communicator& comm, const SpPlan& sp, const RmsnormBackwardParams& params,
                           Stream stream = nullptr);
Status sp_gate_residual_forward(const SpPlan& sp, const GateResidualParams& params, Stream stream = nullptr);
Status sp_gate_residual_backward(Communicator& comm, const SpPlan& sp, const GateResidualBackwardParams& params,
                                 Stream stream = nullptr);
// layernorm (layernorm.h) on the local rows: the plain norm (no affine,
// weight, weight and bias), the grouped forms above and the indexed form
// (params.plan the SpPlan's global plan), every recipe. d_weight and d_bias
// are the canonical chunks' folds as WS1's, computed as rmsnorm's d_weight;
// the indexed d_shift / d_scale are the WS1 segment partials of each rank's
// chunks (the plan of its own chunks' rows, built with the SpPlan), gathered
// and folded by the WS1 segment fold.
Status sp_layernorm_forward(const SpPlan& sp, const LayernormParams& params, Stream stream = nullptr);
Status sp_layernorm_backward(Communicator& comm, const SpPlan& sp, const LayernormBackwardParams& params,
                             Stream stream = nullptr);
// gate_residual_layernorm (gate_residual_layernorm.h) on the local rows, the
// grouped forms of its halves above (a plan is a ValueError): the forward is the sp_gate_residual
// forward into h, then the sp_layernorm forward of h; the backward the
// sp_layernorm backward of d_out, the sum with d_h, then the sp_gate_residual
// backward of that sum, so every output equals WS1's byte for byte. Both
// halves are validated, allocated and agreed as one call.
Status sp_gate_residual_layernorm_forward(const SpPlan& sp, const GateResidualLayernormParams& params,
                                          Stream stream = nullptr);
Status sp_gate_residual_layernorm_backward(Communicator& comm, const SpPlan& sp,
                                           const GateResidualLayernormBackwardParams& params, Stream stream = nullptr);
// The fused region (gate_residual_rmsnorm.h) on the local rows, every form
// and recipe, the WS1 op's two routes: the H3 rule (the indexed gate, tables
// in the rows' dtype, upcast = false, no k) runs the WS1 fused op with the
// local index forward, and backward the sp_rmsnorm backward of d_out, the sum
// with d_h, then the sp_gate_residual backward of that sum (the chain fold);
// every other call is the same composition of the halves above: the grouped
// forms without a plan (per frame by pieces), the indexed recipes with one
// (on the SpPlan's chunks). Every output equals WS1's byte for byte. Both
// halves are validated, allocated and agreed as one call before either
// exchanges anything; forward and backward accept the same calls.
Status sp_gate_residual_rmsnorm_forward(const SpPlan& sp, const GateResidualRmsnormParams& params,
                                        Stream stream = nullptr);
Status sp_gate_residual_rmsnorm_backward(Communicator& comm, const SpPlan& sp,
                                         const GateResidualRmsnormBackwardParams& params, Stream stream = nullptr);

}  // namespace detdit
