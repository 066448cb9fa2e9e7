// What the parallel verify and bench cases share (verify_parallel.cc,
// bench_parallel.cc): the sp_region and tp_adaln_projection problems at the
// weights' shapes, one rank's run of them on any device (WS1 = the public
// single-device ops on the full problem), the world of a `--comm mpi` run and
// an all-gather of small host records through any communicator.
// The packings are the op-case library's (cases/index_case.h).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cases/index_case.h"
#include "cases/tensor.h"
#include "detdit/comm.h"
#include "detdit/parallel.h"
#include "verify.h"

namespace detdit {
namespace cli {

using cases::Packing;
using cases::packing_name;
using cases::RankStream;

// (S,) int32 AdaLN rows of the packing (cases::IndexCase::row).
HostTensor packed_rows(Packing packing, int64_t seq_len, int64_t num_timesteps);

// Deterministic values for large bf16/fp32 tensors, fast (a counter hash,
// not a normal sample, so H3-sized inputs take milliseconds): sign and
// mantissa from the hash of (seed, i), magnitude in [0.25, 2).
void fill_hashed(HostTensor* buffer, uint64_t seed);

// Rows [lo, hi) of every batch item of a (B, S, W) buffer as (B, hi - lo, W),
// or of a (B*S,) buffer as (B*(hi - lo),).
HostTensor local_rows(const HostTensor& full, int64_t batch, int64_t seq_len, int64_t lo, int64_t hi);

// ---- sp_region -------------------------------------------------------------

constexpr int64_t kSpTimesteps = 3;  // T: 3T = 9 AdaLN rows
constexpr int64_t kSpBatch = 2;      // B

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

// The replicated inputs (host; every rank builds the same bytes). The gate
// reuses the big tensors to halve the memory of H3 shapes: residual = x,
// y = grad and its incoming gradient = x; the fused region likewise, with
// the gradients of out and h = x and grad.
struct SpProblem {
  Packing packing = Packing::kBlock;
  int64_t seq_len = 0, batch = kSpBatch, hidden = 0;
  HostTensor rows;                // (S,) int32
  HostTensor x, grad;             // (B, S, H) bf16
  HostTensor weight;              // (H,) bf16: norm1 of block 0 of the weights
  HostTensor shift, scale, gate;  // (3T, H) bf16
  Numerics numerics = Numerics::kPortable;  // of the norms (the torch profile: CUDA only)
};
Status make_sp_problem(const Weights& weights, Packing packing, int64_t seq_len, uint64_t seed, SpProblem* problem);

// The (S,) index on `device` and its plan.
struct SpIndex {
  DeviceTensor index;
  IndexPlan plan;
};
Status make_sp_index(const SpProblem& problem, const Device& device, SpIndex* index);

// One output of a run: per-position tensors hold the run's rows (compare with
// the WS1 rows [lo, hi) of each batch item), replicated ones the whole tensor.
struct SpOutput {
  const char* name;
  bool per_position;
  DeviceTensor tensor;
};

// One variant's forward and backward on one rank (sp != nullptr: the sp ops
// on the rank's rows through comm) or WS1 (sp == nullptr: the public ops on
// the full sequence), inputs and outputs on `device`, work on `stream`.
// Gradients of replicated tensors are FP32 (d_weight included: no final cast
// can hide a difference); activation gradients bf16.
struct SpRun {
  std::vector<DeviceTensor> inputs;
  std::vector<SpOutput> outputs;
  std::function<Status()> forward, backward;
};
Status prepare_sp_run(const SpProblem& problem, const SpIndex& index, SpVariant variant, const Device& device,
                      Stream stream, const SpPlan* sp, Communicator* comm, SpRun* run);

// Bytes each rank moves in the variant's backward: the padded row block
// (max_send rows of x, grad, rstd or grad, y) it sends, plus one payload of
// the fold chain's FP32 running sums per link (each rank receives every
// broadcast; a link's owner sends it).
double sp_backward_bytes_per_rank(const SpPlan& sp, SpVariant variant, int64_t hidden);

// ---- tp_adaln_projection -----------------------------------------------------

// temb (T, D) fp32, the block-0 projection weight (N, D) and bias (N,) of the
// weights (a CPU view of the file), grad_table (T, N) fp32.
struct TpProblem {
  int64_t timesteps = 0, out_features = 0, in_features = 0;
  HostTensor temb, grad_table;
  TensorView weight, bias;
  Numerics numerics = Numerics::kPortable;  // of the SiLU (the torch profile: CUDA only)
};
Status make_tp_problem(const Weights& weights, int64_t timesteps, uint64_t seed, TpProblem* problem);

// The full weight and bias on `device` (shared by every in-process rank).
struct TpWeights {
  DeviceTensor weight, bias;
  TensorView weight_view, bias_view;  // the weights' views on the CPU (no copy)
};
Status upload_tp_weights(const TpProblem& problem, const Device& device, TpWeights* weights);

// Forward and backward of one rank of tp = comm->world_size() (comm != nullptr)
// or of WS1 (comm == nullptr). Outputs: table, act, d_temb (replicated) and
// d_weight, d_bias of the rank's columns [begin, end).
struct TpRun {
  int64_t begin = 0, end = 0;
  std::vector<DeviceTensor> inputs;
  std::vector<SpOutput> outputs;  // per_position = true: a shard of rows [begin, end)
  std::function<Status()> forward, backward;
};
Status prepare_tp_run(const TpProblem& problem, const TpWeights& weights, const Device& device, Stream stream,
                      Communicator* comm, TpRun* run);

// ---- --comm mpi ---------------------------------------------------------------

// The communicator of a process launched by mpirun: MPI on the CPU; on CUDA,
// NCCL on GPU (rank on this host % device count; more ranks on a host than
// GPUs is a ValueError on every rank) from a unique id broadcast over MPI,
// with NCCL_NVLS_ENABLE=0 set first unless the user set it (NVLink
// multicast stays off). *device is where this rank's tensors live.
Status open_mpi_world(bool cuda, std::unique_ptr<Communicator>* comm, Device* device, NcclOptions options = {});

// Under mpirun (launched_by_mpi()) every process must run the same command
// line: the collectives of a command follow from its options, so ranks
// started differently (another --ops or --repeats, --help or --list on one,
// verify on one and bench on another) would wait forever in a collective
// their peers never enter. Called first, before any command can exit, on
// every rank: the ranks exchange argv[1..argc) over MPI. Returns
// -1 (go on) when they are equal or this is no multi-process MPI run (or
// detdit has no MPI); else 2 (a usage error, on every rank, each saying so).
int agree_on_command_line(int argc, char** argv);

// A barrier that also agrees on success: every rank learns whether any rank's
// `local` failed (that rank's own error, else a RuntimeError naming the first
// failing rank). Unlike Communicator::agree it always communicates (a NCCL
// communicator without its call check skips agree's exchange).
Status all_ranks_ok(Communicator& comm, const Status& local);

// Rank-ordered all-gather of `bytes` host bytes per rank (staged through
// device memory on a CUDA communicator): all gets world * bytes.
Status gather_host_bytes(Communicator& comm, const void* record, std::size_t bytes, std::vector<char>* all);

}  // namespace cli
}  // namespace detdit
