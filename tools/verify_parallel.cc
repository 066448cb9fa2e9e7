// verify cases of the parallel regions: tp_adaln_projection and the sp_region
// (plain rmsnorm, modulated rmsnorm, gate_residual and the fused
// gate_residual_rmsnorm; forward and backward).
// Every rank's outputs and gradients must be byte-equal to WS1 (the public
// single-device ops on the whole problem) computed on the same device.
//
// One check row per world size: its bitwise count is tensors x ranks (an SP
// row: 23 tensors per rank = 4 plain rmsnorm + 6 modulated + 4 gate_residual
// + 9 gate_residual_rmsnorm;
// a TP row: 5 per rank = table, act, d_temb and the rank's d_weight, d_bias
// rows). Rows record what the plan moves (metrics in the JSON report).
//
// Runs:
//   in-process (default): world sizes 1..8 as threads of this process, on the
//     CPU or sharing one GPU; WS1 on the same device.
//   --comm mpi: one rank per process (mpirun -np N), world size N; each rank
//     compares with WS1 computed on its own device, the framework merges the
//     ranks' rows on rank 0.
// Sizes (B = 2, T = 3 timesteps for SP; H, N = 18H and D from the weights):
//   SP S = 4097 always (world sizes 1..8; in-process on the CPU with --quick
//   1, 2, 3, 8); S = 32768 with --full or --comm mpi (in-process on
//   the CPU only world size 3, where rows move, without the naive contrast:
//   each H3 world at this S costs tens of seconds and 8 GB on 2 cores);
//   S = 131072 with --comm mpi on CUDA without --quick. Both packings.
//   TP T = 1..4; every world size up to the number of 64-column chunks of N
//   (an informational row quotes the refusal of a larger one); on the CPU
//   with --quick T = 1 and 4 at world sizes 1, 3 and 8.
// Informational rows (the naive-SP contrast, world sizes 2, 4, 8): each rank
// runs the WS1 backward on its own rows, then d_weight, d_scale and d_gate are
// summed in rank order (FP32) and compared with WS1's bits: the fraction of
// elements that differ is what the sp_region's plan prevents.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "detdit/gate_residual.h"
#include "detdit/rmsnorm.h"
#include "parallel_common.h"
#include "verify.h"

namespace detdit {
namespace cli {
namespace {

// A run's rows [lo, hi) of each of `batch` items of `length` positions: the
// part of a per-position WS1 output the run must equal.
struct Slice {
  int64_t batch, length, lo, hi;
};

// Compares each output of a run with WS1's bytes (its slice for per-position
// outputs, the whole tensor for replicated ones): one comparison per tensor.
// CPU outputs are compared in place, slices run by run (no copies of
// H3-sized tensors unless they differ and the report needs the details).
Status compare_outputs(const std::vector<SpOutput>& outputs, const std::vector<HostTensor>& ws1, const Slice& slice,
                       Stream stream, const std::string& prefix, CheckRow* row) {
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    const TensorView& view = outputs[i].tensor.view();
    HostTensor copy;
    const char* got = static_cast<const char*>(view.data);
    if (view.device.is_cuda()) {
      DETDIT_RETURN_IF_ERROR(outputs[i].tensor.to_host(&copy, stream));
      got = static_cast<const char*>(copy.data());
    }
    const std::string what = prefix + outputs[i].name;
    const std::size_t bytes = view.nbytes();
    const std::size_t expected_bytes =
        outputs[i].per_position ? ws1[i].nbytes() / static_cast<std::size_t>(slice.length) *
                                      static_cast<std::size_t>(slice.hi - slice.lo)
                                : ws1[i].nbytes();
    if (bytes != expected_bytes) {
      return Status::runtime_error(what + ": " + std::to_string(bytes) + " bytes, WS1's part has " +
                                   std::to_string(expected_bytes));
    }
    if (!outputs[i].per_position) {
      compare_bytes(ws1[i].data(), got, bytes, view.dtype, what, row);
      continue;
    }
    // (batch, lo..hi, ...) of WS1's (batch, length, ...): one run per batch item.
    const std::size_t run = bytes / static_cast<std::size_t>(slice.batch);
    const std::size_t item = ws1[i].nbytes() / static_cast<std::size_t>(slice.batch);
    const std::size_t offset = item / static_cast<std::size_t>(slice.length) * static_cast<std::size_t>(slice.lo);
    bool equal = true;
    for (int64_t b = 0; b < slice.batch && equal; ++b) {
      equal = std::memcmp(static_cast<const char*>(ws1[i].data()) + b * item + offset, got + b * run, run) == 0;
    }
    if (equal) {
      ++row->bitwise_run;
      ++row->bitwise_passed;
      continue;
    }
    const HostTensor expected = local_rows(ws1[i], slice.batch, slice.length, slice.lo, slice.hi);
    compare_bytes(expected.data(), got, bytes, view.dtype, what, row);
  }
  return Status::ok_status();
}

Status download(const std::vector<SpOutput>& outputs, std::vector<HostTensor>* hosts) {
  hosts->resize(outputs.size());
  for (std::size_t i = 0; i < outputs.size(); ++i) DETDIT_RETURN_IF_ERROR(outputs[i].tensor.to_host(&(*hosts)[i]));
  return Status::ok_status();
}

// A world's row: the comparisons of every rank, plus errors (a rank that
// failed fails the row with its message).
struct WorldRow {
  CheckRow row;
  bool error = false;
};

void merge(const CheckRow& rank_row, int rank, WorldRow* world) {
  world->row.bitwise_run += rank_row.bitwise_run;
  world->row.bitwise_passed += rank_row.bitwise_passed;
  if (world->row.detail.empty() && !rank_row.detail.empty()) {
    world->row.detail = "rank " + std::to_string(rank) + ": " + rank_row.detail;
  }
}

void record_error(const Status& status, WorldRow* world) {
  if (status.ok()) return;
  world->error = true;
  world->row.detail = status.to_string() + (world->row.detail.empty() ? "" : "; " + world->row.detail);
}

// Runs fn(comm, &rank_row) on every rank of `world`: in-process threads on
// context.device, or this process's rank of context.comm. Merges the rows.
template <typename Fn>
void run_ranks(const VerifyContext& ctx, int world, Fn&& fn, WorldRow* out) {
  const double start = now_seconds();
  if (ctx.comm != nullptr) {
    CheckRow mine;
    record_error(fn(*ctx.comm, &mine), out);
    merge(mine, ctx.comm->rank(), out);
  } else {
    std::vector<CheckRow> ranks(static_cast<std::size_t>(world));
    Status status = InProcessGroup::run(
        world, [&](Communicator& comm) { return fn(comm, &ranks[static_cast<std::size_t>(comm.rank())]); },
        ctx.device);
    record_error(status, out);
    for (int r = 0; r < world; ++r) merge(ranks[static_cast<std::size_t>(r)], r, out);
  }
  out->row.seconds += now_seconds() - start;
}

void finish(WorldRow* world) {
  finish_row(&world->row);
  if (world->error) world->row.pass = false;
}

std::string percent(double fraction) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f %%", 100.0 * fraction);
  return text;
}

// ---- sp_region -----------------------------------------------------------------

std::vector<int> sp_world_sizes(const VerifyContext& ctx, int64_t seq_len) {
  if (ctx.comm != nullptr) return {ctx.comm->world_size()};
  if (!ctx.device.is_cuda() && seq_len > 4097) return {3};
  if (!ctx.device.is_cuda() && ctx.quick) return {1, 2, 3, 8};
  return {1, 2, 3, 4, 5, 6, 7, 8};
}

// Fraction of elements of a (FP32) rank-order sum that differ from WS1's bits.
double fraction_differing(const std::vector<float>& sum, const HostTensor& ws1) {
  const int64_t count = static_cast<int64_t>(sum.size());
  return static_cast<double>(cases::compare_bytes(ws1.data(), sum.data(), count, DType::kF32).count) /
         static_cast<double>(count);
}

// The naive alternative for one variant at `world` ranks, simulated on the
// device: each rank's WS1 backward on its own rows (the local plan) with FP32
// replicated gradients, summed in rank order. Returns the fractions of
// (d_weight, d_scale) or (d_gate) elements that differ from WS1.
Status naive_fractions(const SpProblem& pr, const SpIndex& index, const Device& device, SpVariant variant, int world,
                       const std::vector<HostTensor>& ws1, std::vector<std::pair<std::string, double>>* fractions) {
  const bool gate = variant == SpVariant::kGateResidual;
  const int64_t hidden = pr.hidden, rows = pr.shift.shape()[0];
  std::vector<float> first(gate ? rows * hidden : hidden, 0.0f), second(gate ? 0 : rows * hidden, 0.0f);
  for (int rank = 0; rank < world; ++rank) {
    SpPlan sp;
    DETDIT_RETURN_IF_ERROR(SpPlan::create(index.plan, world, rank, &sp));
    const int64_t lo = sp.local_begin(), hi = sp.local_end();
    DeviceTensor x, grad, rstd, weight, table_a, table_b, part_a, part_b;
    DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(local_rows(pr.x, pr.batch, pr.seq_len, lo, hi), device, &x));
    DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(local_rows(pr.grad, pr.batch, pr.seq_len, lo, hi), device, &grad));
    if (gate) {
      DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(pr.gate, device, &table_a));
      DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(DType::kF32, {rows, hidden}, device, &part_a));
      // As in prepare_sp_run: y = grad, the incoming gradient is x.
      GateResidualBackwardParams b;
      b.grad = x.view();
      b.in.y = grad.view();
      b.in.gate = table_a.view();
      b.in.plan = sp.local_plan();
      b.d_gate = part_a.view();
      DETDIT_RETURN_IF_ERROR(gate_residual_backward(b));
    } else {
      DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(local_rows(ws1[1], pr.batch, pr.seq_len, lo, hi), device, &rstd));
      DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(pr.weight, device, &weight));
      DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(pr.shift, device, &table_a));
      DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(pr.scale, device, &table_b));
      DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(DType::kF32, {hidden}, device, &part_a));
      DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(DType::kF32, {rows, hidden}, device, &part_b));
      RmsnormBackwardParams b;
      b.in.x = x.view();
      b.in.weight = weight.view();
      b.in.shift = table_a.view();
      b.in.scale = table_b.view();
      b.in.plan = sp.local_plan();
      b.rstd = rstd.view();
      b.grad = grad.view();
      b.d_weight = part_a.view();
      b.d_scale = part_b.view();
      DETDIT_RETURN_IF_ERROR(rmsnorm_backward(b));
    }
    HostTensor a, b;
    DETDIT_RETURN_IF_ERROR(part_a.to_host(&a));
    for (std::size_t i = 0; i < first.size(); ++i) first[i] += a.ptr<float>()[i];
    if (!gate) {
      DETDIT_RETURN_IF_ERROR(part_b.to_host(&b));
      for (std::size_t i = 0; i < second.size(); ++i) second[i] += b.ptr<float>()[i];
    }
  }
  if (gate) {
    fractions->push_back({"d_gate", fraction_differing(first, ws1[3])});
  } else {
    fractions->push_back({"d_weight", fraction_differing(first, ws1[3])});
    fractions->push_back({"d_scale", fraction_differing(second, ws1[5])});
  }
  return Status::ok_status();
}

// What the plan of `world` ranks moves (every rank's plan knows every rank's numbers).
Status sp_world_metrics(const SpIndex& index, int world, int64_t hidden, CheckRow* row) {
  SpPlan sp;
  DETDIT_RETURN_IF_ERROR(SpPlan::create(index.plan, world, 0, &sp));
  std::vector<double> send_rows;
  double moved = 0;
  for (const SpPlan::RankTraffic& t : sp.traffic()) {
    send_rows.push_back(static_cast<double>(t.send_rows));
    moved += static_cast<double>(t.send_rows);
  }
  row->metrics.push_back({"send_rows_per_rank", send_rows});
  row->metrics.push_back({"rows_moved_all_ranks", {moved}});
  row->metrics.push_back({"max_send_rows", {static_cast<double>(sp.max_send())}});
  for (SpVariant v : kSpVariants) {
    std::string name = sp_variant_name(v);  // "modulated rmsnorm" -> bytes_sent_per_rank_modulated_rmsnorm_bwd
    std::replace(name.begin(), name.end(), ' ', '_');
    row->metrics.push_back({"bytes_sent_per_rank_" + name + "_bwd", {sp_backward_bytes_per_rank(sp, v, hidden)}});
  }
  return Status::ok_status();
}

// Row "ws1 = cpu ws1": the device's WS1 (host copies `ws1`) against the same
// problem's WS1 on the CPU, which prepare(&run) sets up: one comparison per output.
template <typename Run, typename Prepare>
WorldRow compare_with_cpu_ws1(const std::vector<HostTensor>& ws1, const std::string& prefix, Prepare&& prepare) {
  WorldRow cpu;
  cpu.row.check = "ws1 = cpu ws1";
  const double start = now_seconds();
  Run run;
  std::vector<HostTensor> reference;
  Status s = prepare(&run);
  if (s.ok()) s = run.forward();
  if (s.ok()) s = run.backward();
  if (s.ok()) s = download(run.outputs, &reference);
  if (s.ok() && reference.size() != ws1.size()) s = Status::runtime_error("the CPU's WS1 has other outputs");
  record_error(s, &cpu);
  for (std::size_t i = 0; s.ok() && i < reference.size(); ++i) {
    const std::string what = prefix + run.outputs[i].name;
    if (reference[i].nbytes() != ws1[i].nbytes()) {
      record_error(Status::runtime_error(what + ": the CPU's WS1 has another size"), &cpu);
      continue;
    }
    compare_bytes(reference[i].data(), ws1[i].data(), ws1[i].nbytes(), ws1[i].dtype(), what, &cpu.row);
  }
  cpu.row.seconds = now_seconds() - start;
  finish(&cpu);
  return cpu;
}

// One variant's results on one sp problem: a row per world (every rank equal
// to WS1 on the device), the naive contrast per naive world (none for the
// plain norm and the fused region: their table gradients' contrasts come with
// the modulated norm's and the gate's), and with
// cpu_check the device's WS1 against the CPU's.
struct SpVariantResult {
  SpVariant variant = SpVariant::kPlainRmsnorm;
  std::vector<WorldRow> worlds, naive;
  std::vector<std::vector<std::pair<std::string, double>>> naive_fraction;
  WorldRow cpu;
};

// `corrupt_variant`: a test hook (verify --matrix under DETDIT_TEST_CORRUPT_CELLS):
// one bit of that variant's WS1 output is flipped after the run, so every
// comparison with it must fail.
Status run_sp_problem(const VerifyContext& ctx, const SpProblem& pr, const SpIndex& index, const std::vector<int>& worlds,
                      const std::vector<int>& naive_worlds, bool cpu_check, const std::string& corrupt_variant,
                      std::vector<SpVariantResult>* results) {
  const Device device = ctx.device;
  SpIndex cpu_index;
  if (cpu_check) DETDIT_RETURN_IF_ERROR(make_sp_index(pr, Device::cpu(), &cpu_index));
  for (SpVariant variant : kSpVariants) {
    if (pr.numerics != Numerics::kPortable && !sp_variant_takes_profile(variant)) continue;
    SpVariantResult r;
    r.variant = variant;
    r.worlds.resize(worlds.size());
    // WS1 on this device (the default stream), brought to the host.
    std::vector<HostTensor> ws1;
    {
      SpRun run;
      DETDIT_RETURN_IF_ERROR(prepare_sp_run(pr, index, variant, device, nullptr, nullptr, nullptr, &run));
      DETDIT_RETURN_IF_ERROR(run.forward());
      DETDIT_RETURN_IF_ERROR(run.backward());
      DETDIT_RETURN_IF_ERROR(download(run.outputs, &ws1));
    }
    if (!ws1.empty() && corrupt_variant == sp_variant_name(variant)) static_cast<unsigned char*>(ws1[0].data())[0] ^= 1;
    const std::string prefix = std::string(sp_variant_name(variant)) + " ";
    if (cpu_check) {
      r.cpu = compare_with_cpu_ws1<SpRun>(ws1, prefix, [&](SpRun* run) {
        return prepare_sp_run(pr, cpu_index, variant, Device::cpu(), nullptr, nullptr, nullptr, run);
      });
    }
    for (std::size_t i = 0; i < worlds.size(); ++i) {
      r.worlds[i].row.check = "ws=" + std::to_string(worlds[i]);
      run_ranks(
          ctx, worlds[i],
          [&](Communicator& comm, CheckRow* rank_row) -> Status {
            RankStream stream(device);
            SpPlan sp;
            DETDIT_RETURN_IF_ERROR(SpPlan::create(index.plan, comm.world_size(), comm.rank(), &sp, stream.get()));
            SpRun run;
            DETDIT_RETURN_IF_ERROR(prepare_sp_run(pr, index, variant, device, stream.get(), &sp, &comm, &run));
            DETDIT_RETURN_IF_ERROR(run.forward());
            DETDIT_RETURN_IF_ERROR(run.backward());
            return compare_outputs(run.outputs, ws1, Slice{pr.batch, pr.seq_len, sp.local_begin(), sp.local_end()},
                                   stream.get(), prefix, rank_row);
          },
          &r.worlds[i]);
    }
    if (sp_variant_has_naive_contrast(variant)) {
      r.naive.resize(naive_worlds.size());
      r.naive_fraction.resize(naive_worlds.size());
      for (std::size_t i = 0; i < naive_worlds.size(); ++i) {
        const double start = now_seconds();
        record_error(naive_fractions(pr, index, device, variant, naive_worlds[i], ws1, &r.naive_fraction[i]),
                     &r.naive[i]);
        r.naive[i].row.seconds += now_seconds() - start;
      }
    }
    results->push_back(std::move(r));
  }
  return Status::ok_status();
}

// The naive row of `world` from its fractions (informational).
void finish_naive(int world, const std::vector<std::pair<std::string, double>>& fractions, WorldRow* naive) {
  CheckRow& row = naive->row;
  row.check = "naive ws=" + std::to_string(world) + " (info)";
  row.informational = true;
  std::string text;
  for (const auto& [name, fraction] : fractions) {
    row.metrics.push_back({name + "_fraction_differing_naive", {fraction}});
    text += (text.empty() ? "" : ", ") + name + " " + percent(fraction);
  }
  if (!naive->error) row.detail = "naive rank-order sum differs from WS1 in " + text + " of the elements (the sp_region: 0)";
  finish(naive);
}

// Adds `part`'s comparisons, time, error and first detail to `into`.
void absorb(const WorldRow& part, WorldRow* into) {
  into->row.bitwise_run += part.row.bitwise_run;
  into->row.bitwise_passed += part.row.bitwise_passed;
  into->row.seconds += part.row.seconds;
  into->error = into->error || part.error;
  if (into->row.detail.empty()) into->row.detail = part.row.detail;
}

// The default verify's sp_region case: one row per world for all four
// variants, one naive row per naive world for both contrasts.
Status verify_sp(const VerifyContext& ctx, Packing packing, int64_t seq_len, std::vector<CheckRow>* rows) {
  SpProblem pr;
  DETDIT_RETURN_IF_ERROR(make_sp_problem(*ctx.weights, packing, seq_len, ctx.seed, &pr));
  SpIndex index;
  DETDIT_RETURN_IF_ERROR(make_sp_index(pr, ctx.device, &index));
  const std::vector<int> worlds = sp_world_sizes(ctx, seq_len);
  std::vector<int> naive_worlds;
  for (int w : worlds) {
    // The contrast on the CPU only at S = 4097 (at 32768 it costs a whole backward per world).
    if (!ctx.device.is_cuda() && ctx.comm == nullptr && seq_len > 4097) continue;
    if (w == 2 || w == 4 || w == 8 || (ctx.comm != nullptr && w > 1)) naive_worlds.push_back(w);
  }
  std::vector<WorldRow> checks(worlds.size());
  for (std::size_t i = 0; i < worlds.size(); ++i) {
    checks[i].row.check = "ws=" + std::to_string(worlds[i]);
    DETDIT_RETURN_IF_ERROR(sp_world_metrics(index, worlds[i], pr.hidden, &checks[i].row));
  }
  std::vector<SpVariantResult> results;
  DETDIT_RETURN_IF_ERROR(run_sp_problem(ctx, pr, index, worlds, naive_worlds, false, "", &results));
  std::vector<WorldRow> naive(naive_worlds.size());
  std::vector<std::vector<std::pair<std::string, double>>> fractions(naive_worlds.size());
  for (const SpVariantResult& r : results) {
    for (std::size_t i = 0; i < worlds.size(); ++i) absorb(r.worlds[i], &checks[i]);
    for (std::size_t i = 0; i < r.naive.size(); ++i) {
      absorb(r.naive[i], &naive[i]);
      fractions[i].insert(fractions[i].end(), r.naive_fraction[i].begin(), r.naive_fraction[i].end());
    }
  }
  for (WorldRow& w : checks) {
    finish(&w);
    rows->push_back(w.row);
  }
  for (std::size_t i = 0; i < naive_worlds.size(); ++i) {
    finish_naive(naive_worlds[i], fractions[i], &naive[i]);
    rows->push_back(naive[i].row);
  }
  return Status::ok_status();
}

bool always(const VerifyContext&) { return true; }
bool mpi_cuda_full_run(const VerifyContext& ctx) { return !ctx.quick && ctx.comm != nullptr && ctx.device.is_cuda(); }
// In-process runs do 32768 with --full; MPI runs always (every rank then holds
// a share of it).
bool sp_32768(const VerifyContext& ctx) { return ctx.full || ctx.comm != nullptr; }

Status sp_4097_block(const VerifyContext& c, std::vector<CheckRow>* r) { return verify_sp(c, Packing::kBlock, 4097, r); }
Status sp_4097_interleaved(const VerifyContext& c, std::vector<CheckRow>* r) {
  return verify_sp(c, Packing::kInterleaved, 4097, r);
}
Status sp_32768_block(const VerifyContext& c, std::vector<CheckRow>* r) { return verify_sp(c, Packing::kBlock, 32768, r); }
Status sp_32768_interleaved(const VerifyContext& c, std::vector<CheckRow>* r) {
  return verify_sp(c, Packing::kInterleaved, 32768, r);
}
Status sp_131072_block(const VerifyContext& c, std::vector<CheckRow>* r) {
  return verify_sp(c, Packing::kBlock, 131072, r);
}
Status sp_131072_interleaved(const VerifyContext& c, std::vector<CheckRow>* r) {
  return verify_sp(c, Packing::kInterleaved, 131072, r);
}
DETDIT_VERIFY_PARALLEL_CASE("sp_region", "S=4097 block", true, true, sp_4097_block, always);
DETDIT_VERIFY_PARALLEL_CASE("sp_region", "S=4097 interleaved", true, true, sp_4097_interleaved, always);
DETDIT_VERIFY_PARALLEL_CASE("sp_region", "S=32768 block", true, true, sp_32768_block, sp_32768);
DETDIT_VERIFY_PARALLEL_CASE("sp_region", "S=32768 interleaved", true, true, sp_32768_interleaved, sp_32768);
DETDIT_VERIFY_PARALLEL_CASE("sp_region", "S=131072 block", false, true, sp_131072_block, mpi_cuda_full_run);
DETDIT_VERIFY_PARALLEL_CASE("sp_region", "S=131072 interleaved", false, true, sp_131072_interleaved,
                            mpi_cuda_full_run);

// ---- tp_adaln_projection -----------------------------------------------------------

std::vector<int> tp_world_sizes(const VerifyContext& ctx) {
  if (ctx.comm != nullptr) return {ctx.comm->world_size()};
  if (ctx.quick && !ctx.device.is_cuda()) return {1, 3, 8};
  return {1, 2, 3, 4, 5, 6, 7, 8};
}

Status verify_tp(const VerifyContext& ctx, int64_t timesteps, std::vector<CheckRow>* rows) {
  return verify_tp_worlds(ctx, timesteps, Numerics::kPortable, tp_world_sizes(ctx), false, rows);
}

}  // namespace

Status verify_tp_worlds(const VerifyContext& ctx, int64_t timesteps, Numerics numerics, const std::vector<int>& worlds,
                        bool cpu_check, std::vector<CheckRow>* rows) {
  const Device device = ctx.device;
  if (cpu_check && numerics != Numerics::kPortable)
    return Status::value_error("tp: the CPU comparison needs the portable profile (the CPU has no torch profile)");
  TpProblem pr;
  DETDIT_RETURN_IF_ERROR(make_tp_problem(*ctx.weights, timesteps, ctx.seed, &pr));
  pr.numerics = numerics;
  TpWeights weights;
  DETDIT_RETURN_IF_ERROR(upload_tp_weights(pr, device, &weights));
  std::vector<HostTensor> ws1;
  {
    TpRun run;
    DETDIT_RETURN_IF_ERROR(prepare_tp_run(pr, weights, device, nullptr, nullptr, &run));
    DETDIT_RETURN_IF_ERROR(run.forward());
    DETDIT_RETURN_IF_ERROR(run.backward());
    DETDIT_RETURN_IF_ERROR(download(run.outputs, &ws1));
  }
  const double element = static_cast<double>(dtype_size(weights.weight_view.dtype));
  for (int world : worlds) {
    int64_t begin = 0, end = 0;
    Status split = tp_column_shard(pr.out_features, world, 0, &begin, &end);
    WorldRow check;
    check.row.check = "tp=" + std::to_string(world);
    if (!split.ok()) {
      // More ranks than N has 64-column chunks: what the op says (it refuses before any work).
      check.row.check += " (info)";
      check.row.informational = true;
      check.row.detail = split.message();
      finish(&check);
      rows->push_back(check.row);
      continue;
    }
    // Every rank sends a block of rank 0's size (the most columns and chunks any rank owns).
    const double columns = static_cast<double>(end - begin);
    check.row.metrics.push_back({"bytes_sent_per_rank_forward", {static_cast<double>(timesteps) * columns * element}});
    check.row.metrics.push_back(
        {"bytes_sent_per_rank_backward",
         {std::ceil(columns / 64) * static_cast<double>(timesteps) * static_cast<double>(pr.in_features) * 4}});
    run_ranks(
        ctx, world,
        [&](Communicator& comm, CheckRow* rank_row) -> Status {
          RankStream stream(device);
          TpRun run;
          DETDIT_RETURN_IF_ERROR(prepare_tp_run(pr, weights, device, stream.get(), &comm, &run));
          DETDIT_RETURN_IF_ERROR(run.forward());
          DETDIT_RETURN_IF_ERROR(run.backward());
          return compare_outputs(run.outputs, ws1, Slice{1, pr.out_features, run.begin, run.end}, stream.get(), "",
                                 rank_row);
        },
        &check);
    finish(&check);
    rows->push_back(check.row);
  }
  if (cpu_check) {
    TpWeights cpu_weights;
    DETDIT_RETURN_IF_ERROR(upload_tp_weights(pr, Device::cpu(), &cpu_weights));
    rows->push_back(compare_with_cpu_ws1<TpRun>(ws1, "", [&](TpRun* run) {
                      return prepare_tp_run(pr, cpu_weights, Device::cpu(), nullptr, nullptr, run);
                    }).row);
  }
  return Status::ok_status();
}

namespace {

// On the CPU --quick keeps T = 1 and 4 (each TP world costs a full H3 projection).
bool tp_middle(const VerifyContext& ctx) { return !ctx.quick || ctx.device.is_cuda() || ctx.comm != nullptr; }

Status tp_1(const VerifyContext& c, std::vector<CheckRow>* r) { return verify_tp(c, 1, r); }
Status tp_2(const VerifyContext& c, std::vector<CheckRow>* r) { return verify_tp(c, 2, r); }
Status tp_3(const VerifyContext& c, std::vector<CheckRow>* r) { return verify_tp(c, 3, r); }
Status tp_4(const VerifyContext& c, std::vector<CheckRow>* r) { return verify_tp(c, 4, r); }
DETDIT_VERIFY_PARALLEL_CASE("tp_adaln_projection", "T=1", true, true, tp_1, always);
DETDIT_VERIFY_PARALLEL_CASE("tp_adaln_projection", "T=2", true, true, tp_2, tp_middle);
DETDIT_VERIFY_PARALLEL_CASE("tp_adaln_projection", "T=3", true, true, tp_3, tp_middle);
DETDIT_VERIFY_PARALLEL_CASE("tp_adaln_projection", "T=4", true, true, tp_4, always);

}  // namespace

Status verify_sp_matrix(const VerifyContext& ctx, Packing packing, int64_t batch, int64_t seq_len,
                        Numerics numerics, const std::vector<int>& worlds, const std::vector<int>& naive_worlds,
                        const std::string& corrupt_variant, std::vector<SpMatrixRows>* out) {
  if (batch != 1 && batch != kSpBatch) return Status::value_error("the sp_region problems have B = 1 or 2");
  SpProblem pr;
  DETDIT_RETURN_IF_ERROR(make_sp_problem(*ctx.weights, packing, seq_len, ctx.seed, &pr));
  pr.numerics = numerics;
  if (batch == 1) {
    // B = 1 is batch item 0 of the B = 2 problem.
    for (HostTensor* t : {&pr.x, &pr.grad}) {
      HostTensor first(t->dtype(), {1, seq_len, pr.hidden});
      std::memcpy(first.data(), t->data(), first.nbytes());
      *t = std::move(first);
    }
    pr.batch = 1;
  }
  SpIndex index;
  DETDIT_RETURN_IF_ERROR(make_sp_index(pr, ctx.device, &index));
  std::vector<SpVariantResult> results;
  // The CPU comparison of a GPU run needs the portable profile: the CPU has no torch profile.
  const bool cpu_check = ctx.device.is_cuda() && numerics == Numerics::kPortable;
  DETDIT_RETURN_IF_ERROR(run_sp_problem(ctx, pr, index, worlds, naive_worlds, cpu_check, corrupt_variant, &results));
  // What each world's plan moves, once for every variant's row of that world.
  std::vector<CheckRow> world_metrics(worlds.size());
  for (std::size_t i = 0; i < worlds.size(); ++i)
    DETDIT_RETURN_IF_ERROR(sp_world_metrics(index, worlds[i], pr.hidden, &world_metrics[i]));
  for (SpVariantResult& r : results) {
    SpMatrixRows m;
    m.variant = sp_variant_name(r.variant);
    for (std::size_t i = 0; i < worlds.size(); ++i) {
      std::vector<std::pair<std::string, std::vector<double>>>& metrics = r.worlds[i].row.metrics;
      metrics.insert(metrics.end(), world_metrics[i].metrics.begin(), world_metrics[i].metrics.end());
      finish(&r.worlds[i]);
      m.rows.push_back(r.worlds[i].row);
      m.worlds.push_back(worlds[i]);
    }
    for (std::size_t i = 0; i < r.naive.size(); ++i) {
      finish_naive(naive_worlds[i], r.naive_fraction[i], &r.naive[i]);
      m.rows.push_back(r.naive[i].row);
      m.worlds.push_back(naive_worlds[i]);
    }
    if (!r.cpu.row.check.empty()) {
      finish(&r.cpu);
      m.rows.push_back(r.cpu.row);
      m.worlds.push_back(1);
    }
    out->push_back(std::move(m));
  }
  return Status::ok_status();
}

}  // namespace cli
}  // namespace detdit
