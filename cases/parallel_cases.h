// The parallel problems of the op-case library: the sp_region (plain and
// modulated rmsnorm, gate_residual and the fused gate_residual_rmsnorm over
// a sequence split between ranks) and tp_adaln_projection (the projection's
// output columns split between ranks), described once for `detdit verify`
// (in-process and --comm mpi), `verify --matrix`, `detdit bench` and the
// parallel tests.
//
// A problem is its replicated inputs (every rank builds the same bytes from
// the op-case library's input generator, uniform_values, and the context's
// weights where it has them), WS1 (the public single-device ops on the whole
// problem) and one rank's run given its communicator. The check is the same
// everywhere: every output of every rank byte-equal to WS1's on the same
// device (its rows or columns for a sharded output, the whole tensor for a
// replicated one); compare_with_ws1 makes one OutputReport per output.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "cases/index_case.h"
#include "cases/op_case.h"
#include "cases/tensor.h"
#include "detdit/comm.h"
#include "detdit/parallel.h"

namespace detdit {
namespace cases {

// Where a driver runs the parallel cases: the device kind, its options, and
// the world of a multi-process run (0: in-process worlds of threads).
struct ParallelSetting {
  bool cuda = false;
  bool quick = false;
  bool full = false;
  int mpi_world = 0;
};

// Rows [lo, hi) of every batch item of a (B, S, W) tensor as (B, hi - lo, W),
// or of a (B*S,) tensor as (B*(hi - lo),).
HostTensor local_rows(const HostTensor& full, int64_t batch, int64_t seq_len, int64_t lo, int64_t hi);

// One output of a run. A per-position (sharded) output holds rows [lo, hi) of
// each of `batch` items of `length` of WS1's; a replicated one the whole tensor.
struct RunOutput {
  std::string name;
  bool per_position = false;
  DeviceTensor tensor;
};

// One rank's (or WS1's) prepared run: inputs and outputs on its device, the
// work on its stream.
struct ParallelRun {
  int64_t batch = 1, length = 0, lo = 0, hi = 0;  // the part of WS1 a sharded output holds
  std::vector<DeviceTensor> inputs;
  std::vector<RunOutput> outputs;
  std::function<Status()> forward, backward;
};

// Forward then backward, then host copies of the outputs (after `stream`).
Status run_and_download(const ParallelRun& run, Stream stream, std::vector<HostTensor>* outputs);
// Each output of `run` against WS1's host copies (its part of a sharded one):
// one report per output, named `prefix` + its name. CPU outputs are compared
// in place (no copies of H3-sized tensors unless they differ).
Status compare_with_ws1(const ParallelRun& run, const std::vector<HostTensor>& ws1, Stream stream,
                        const std::string& prefix, std::vector<OutputReport>* reports);

// Runs rank(comm) on every rank of `world`: this process's rank of `comm` when
// given (its world is the world), else `world` in-process threads on `device`.
Status run_world(int world, const Device& device, Communicator* comm,
                 const std::function<Status(Communicator& comm)>& rank);

// Rank-ordered all-gather of `bytes` host bytes per rank (staged through
// device memory on a CUDA communicator): all gets world * bytes.
Status gather_host_bytes(Communicator& comm, const void* record, std::size_t bytes, std::vector<char>* all);

// ---- sp_region -------------------------------------------------------------

// The three sp ops and the fused region (gate_residual_rmsnorm: h = residual +
// gate * y, out = the modulated norm of h, with gradients reaching out and h).
enum class SpVariant { kPlainRmsnorm, kModulatedRmsnorm, kGateResidual, kGateResidualRmsnorm };
const char* sp_variant_name(SpVariant variant);
constexpr SpVariant kSpVariants[] = {SpVariant::kPlainRmsnorm, SpVariant::kModulatedRmsnorm,
                                     SpVariant::kGateResidual, SpVariant::kGateResidualRmsnorm};
// Whether verify contrasts the variant with the naive rank-order sum: the
// modulated norm and the gate do; the plain norm's d_weight and the fused
// region's tables are the same sums as theirs.
constexpr bool sp_variant_has_naive_contrast(SpVariant variant) {
  return variant == SpVariant::kModulatedRmsnorm || variant == SpVariant::kGateResidual;
}
// Whether the variant's ops take a numerics profile (gate_residual has no
// profile function: its torch-profile run would repeat the portable one).
constexpr bool sp_variant_takes_profile(SpVariant variant) { return variant != SpVariant::kGateResidual; }

// An sp_region problem: T timesteps (3T AdaLN rows) packed over S positions,
// B items, H channels; activations in `dtype`; the gradients of the
// replicated tensors in their own dtypes (FP32 in verify: no final cast can
// hide a difference).
struct SpShape {
  Packing packing = Packing::kBlock;
  int64_t seq_len = 4097, batch = 2, hidden = 0, timesteps = 3;
  DType dtype = DType::kBF16;
  DType weight_grad_dtype = DType::kF32;  // d_weight
  DType table_grad_dtype = DType::kF32;   // d_shift, d_scale, d_gate
  Numerics numerics = Numerics::kPortable;  // of the norms (the torch profile: CUDA only)
  std::string name() const;  // "S=4097 B=2 block"
};

// The replicated inputs (host). The gate reuses the big tensors to halve the
// memory of H3 shapes: residual = x, y = grad and its incoming gradient = x;
// the fused region likewise, with the gradients of out and h = x and grad.
// The weight is the context's norm1 of block 0 when it has one of the shape.
// Element i of x and grad depends on i alone, so the B = 1 problem is batch
// item 0 of the B = 2 one.
struct SpProblem {
  SpShape shape;
  HostTensor rows;                // (S,) int32 AdaLN rows of the packing
  HostTensor x, grad;             // (B, S, H)
  HostTensor weight;              // (H,)
  HostTensor shift, scale, gate;  // (3T, H)
};
Status make_sp_problem(const CaseContext& context, const SpShape& shape, SpProblem* problem);

// The (S,) index on `device` and its plan.
struct SpIndex {
  DeviceTensor index;
  IndexPlan plan;
};
Status make_sp_index(const SpProblem& problem, const Device& device, SpIndex* index);

// One variant's forward and backward on one rank (sp != nullptr: the sp ops
// on the rank's rows through comm) or WS1 (sp == nullptr: the public ops on
// the full sequence), inputs and outputs on `device`, work on `stream`.
Status prepare_sp_run(const SpProblem& problem, const SpIndex& index, SpVariant variant, const Device& device,
                      Stream stream, const SpPlan* sp, Communicator* comm, ParallelRun* run);
// WS1 of the variant on `device` (its default stream), as host copies.
Status sp_ws1(const SpProblem& problem, const SpIndex& index, SpVariant variant, const Device& device,
              std::vector<HostTensor>* ws1);
// One rank of comm's world: its plan and run on a stream of its own, each
// output compared with WS1's (compare_with_ws1, prefix "<variant> ").
Status sp_rank_against_ws1(const SpProblem& problem, const SpIndex& index, SpVariant variant, const Device& device,
                           Communicator& comm, const std::vector<HostTensor>& ws1, std::vector<OutputReport>* reports);

// The naive alternative of the modulated norm or the gate at `world` ranks on
// `device`: each rank's WS1 backward on its own rows (the local plan), the
// replicated gradients summed in rank order in FP32. The fractions of the
// (d_weight, d_scale) or (d_gate) elements that differ from WS1's (host
// copies; FP32 table gradients) are what the sp_region's plan prevents.
Status sp_naive_fractions(const SpProblem& problem, const SpIndex& index, const Device& device, SpVariant variant,
                          int world, const std::vector<HostTensor>& ws1,
                          std::vector<std::pair<std::string, double>>* fractions);

// Bytes each rank moves in the variant's backward: the padded row block
// (max_send rows of x, grad, rstd or grad, y) it sends, plus one payload of
// the fold chain's FP32 running sums per link (each rank receives every
// broadcast; a link's owner sends it).
double sp_backward_bytes_per_rank(const SpPlan& sp, SpVariant variant, int64_t hidden);
// The rows each rank of the plan sends (its send_rows, rank order).
std::vector<double> sp_send_rows_per_rank(const SpPlan& sp);

// verify's sp_region cases (B = 2, T = 3, H of the context): S = 4097 always
// (world sizes 1..8; in-process on the CPU with --quick 1, 2, 3, 8); S =
// 32768 with --full or in a multi-process run (in-process on the CPU only
// world size 3, where rows move, without the naive contrast: each H3 world at
// this S costs tens of seconds and 8 GB on 2 cores); S = 131072 in a
// multi-process CUDA run without --quick. Both packings. The naive contrast
// at worlds 2, 4, 8 (every world > 1 of a multi-process run). `enabled`:
// whether the setting runs it.
struct SpRegionCase {
  std::string name;  // "S=4097 block"
  SpShape shape;
  std::vector<int> worlds, naive_worlds;
  bool enabled = true;
};
std::vector<SpRegionCase> sp_region_cases(const CaseContext& context, const ParallelSetting& setting);
// verify --matrix's sp_region problems: each S of `seq_lens` x B in {1, 2} x
// both packings (named by SpShape::name), T = 3 at the context's H, the
// worlds `worlds`, the naive contrast at those of them that are 2, 4 or 8.
std::vector<SpRegionCase> sp_region_matrix_cases(const CaseContext& context, const std::vector<int64_t>& seq_lens,
                                                 const std::vector<int>& worlds);
// bench's sp_region cases (the fused gate_residual_rmsnorm region, forward and
// backward; B = 2, T = 3, H of the context), both packings: on CUDA S = 32768
// and 131072 (--quick 32768); on the CPU S = 4097 (a smoke test of the timing
// path). Worlds: in-process 2, 4, 8; a multi-process run its world. No naive worlds.
std::vector<SpRegionCase> sp_region_bench_cases(const CaseContext& context, const ParallelSetting& setting);

// ---- tp_adaln_projection -----------------------------------------------------

// temb (T, D) fp32, the projection weight (N, D) and bias (N,) in `dtype`,
// grad_table (T, N) fp32. The weight and bias are views of the context's
// block-0 projection when it has one of the shape (no copy of an H3 weight),
// else generated.
struct TpShape {
  int64_t timesteps = 1, out_features = 0, in_features = 0;
  DType dtype = DType::kBF16;
  Numerics numerics = Numerics::kPortable;  // of the SiLU (the torch profile: CUDA only)
  int chunks = 0;  // 0: H3's projection (FP32 temb); > 0: a family's (adaln.h), temb in the weight's dtype
  // The context's projection ("<weight>.weight", ".bias") when it has this shape, else generated values.
  std::string weight = "transformer_blocks.0.adaln_proj.linear";
};
struct TpProblem {
  TpShape shape;
  HostTensor temb, grad_table;
  TensorView weight, bias;                 // on the CPU
  HostTensor owned_weight, owned_bias;     // their memory when generated
};
Status make_tp_problem(const CaseContext& context, const TpShape& shape, TpProblem* problem);
// The shape of the context's block-0 projection (N = 18H, D = its time
// embedding's width, in its dtype; without weights bf16) at T = timesteps.
TpShape tp_adaln_projection_shape(const CaseContext& context, int64_t timesteps);

// The full weight and bias on `device` (shared by every in-process rank).
struct TpWeights {
  DeviceTensor weight, bias;
  TensorView weight_view, bias_view;  // the problem's views on the CPU (no copy)
};
Status upload_tp_weights(const TpProblem& problem, const Device& device, TpWeights* weights);

// Forward and backward of one rank of tp = comm->world_size() (comm != nullptr)
// or of WS1 (comm == nullptr). Outputs: table, act, d_temb (replicated) and
// d_weight, d_bias of the rank's columns [lo, hi) (sharded, batch 1).
Status prepare_tp_run(const TpProblem& problem, const TpWeights& weights, const Device& device, Stream stream,
                      Communicator* comm, ParallelRun* run);
Status tp_ws1(const TpProblem& problem, const TpWeights& weights, const Device& device, std::vector<HostTensor>* ws1);
Status tp_rank_against_ws1(const TpProblem& problem, const TpWeights& weights, const Device& device,
                           Communicator& comm, const std::vector<HostTensor>& ws1, std::vector<OutputReport>* reports);

// verify's tp_adaln_projection cases: T = 1..4 at the context's N = 18H and D
// (on the CPU with --quick T = 1 and 4, each TP world costing a full H3
// projection); every world size 1..8 (on the CPU with --quick 1, 3 and 8; a
// multi-process run its world).
struct TpCase {
  std::string name;  // "T=1"
  TpShape shape;
  std::vector<int> worlds;
  bool enabled = true;
};
std::vector<TpCase> tp_adaln_projection_cases(const CaseContext& context, const ParallelSetting& setting);
// verify --matrix's tp_adaln_projection problems: T = 1..4 (--quick 1 and 4) at
// the context's N and D, the worlds `worlds`.
std::vector<TpCase> tp_adaln_projection_matrix_cases(const CaseContext& context, const std::vector<int>& worlds);
// bench's tp_adaln_projection cases: T = 1 and 4 on CUDA without --quick, else
// T = 4; worlds in-process 2, 4, 8, a multi-process run its world.
std::vector<TpCase> tp_adaln_projection_bench_cases(const CaseContext& context, const ParallelSetting& setting);
// The bytes each rank of a `world`-rank tp_adaln_projection sends: every rank
// sends a block of rank 0's size (the most columns and 64-column chunks any
// rank owns), T x columns weight-dtype values in the forward, and in the
// backward one FP32 (T, D) partial per chunk. An error: `world` cannot split
// N (more ranks than 64-column chunks; what the op says).
Status tp_bytes_sent_per_rank(const TpShape& shape, int world, double* forward, double* backward);

// ---- predicting a world ------------------------------------------------------

// A communicator of rank `rank` of `world` that moves nothing and logs each
// collective: a rank of a predicted world (detdit bench --predict-world) runs
// its share alone on the device, its real rows, straddling rows and chunk
// partials, whatever values it would have received.
class PredictionComm final : public Communicator {
 public:
  struct Call {
    bool all_gather;    // else a broadcast
    std::size_t bytes;  // per rank
  };
  PredictionComm(int world, int rank, Device device) : world_(world), rank_(rank), device_(device) {}
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  Device device() const override { return device_; }
  const char* backend_id() const override { return "prediction"; }
  Status all_gather(const void*, std::size_t bytes, void*, DType, Stream) override;
  Status broadcast(void*, std::size_t bytes, int, DType, Stream) override;
  Status agree(const Status& local, const std::string&) override { return local; }

  // The link model's time for the logged calls, one after another: each costs
  // `latency_seconds` plus its bus bytes over `bus_bytes_per_second`
  // (nccl-tests' bus-bandwidth convention: (world - 1) * bytes for an
  // all-gather, bytes for a broadcast, whichever rank is the root); *bus_bytes:
  // their sum.
  double link_seconds(double bus_bytes_per_second, double latency_seconds, double* bus_bytes) const;

  std::vector<Call> calls;

 private:
  int world_, rank_;
  Device device_;
};

}  // namespace cases
}  // namespace detdit
