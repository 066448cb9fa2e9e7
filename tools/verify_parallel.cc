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
// The problems, their sizes and world sizes, WS1, one rank's run and its
// comparison with WS1 are the op-case library's (cases/parallel_cases.h).
// Informational rows (the naive-SP contrast, world sizes 2, 4, 8): each rank
// runs the WS1 backward on its own rows, then d_weight, d_scale and d_gate are
// summed in rank order (FP32) and compared with WS1's bits: the fraction of
// elements that differ is what the sp_region's plan prevents.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "cases/parallel_cases.h"
#include "parallel_common.h"
#include "verify.h"

namespace detdit {
namespace cli {
namespace {

using cases::OutputReport;
using cases::SpVariant;

// A world's row: the comparisons of every rank, plus errors (a rank that
// failed fails the row with its message).
struct WorldRow {
  CheckRow row;
  bool error = false;
};

void record_error(const Status& status, WorldRow* world) {
  if (status.ok()) return;
  world->error = true;
  world->row.detail = status.to_string() + (world->row.detail.empty() ? "" : "; " + world->row.detail);
}

// Runs rank(comm, &reports) on every rank of `world` (cases::run_world: this
// process's rank of ctx.comm, or in-process threads on ctx.device) and
// merges the ranks' comparisons into the world's row.
template <typename Fn>
void run_ranks(const VerifyContext& ctx, int world, Fn&& rank, WorldRow* out) {
  const double start = now_seconds();
  const int ranks = ctx.comm != nullptr ? ctx.comm->world_size() : world;
  std::vector<std::vector<OutputReport>> reports(static_cast<std::size_t>(ranks));
  record_error(cases::run_world(world, ctx.device, ctx.comm,
                                [&](Communicator& comm) {
                                  return rank(comm, &reports[static_cast<std::size_t>(comm.rank())]);
                                }),
               out);
  for (std::size_t r = 0; r < reports.size(); ++r) {
    if (reports[r].empty()) continue;
    CheckRow mine;
    add_output_reports(reports[r], &mine);
    out->row.bitwise_run += mine.bitwise_run;
    out->row.bitwise_passed += mine.bitwise_passed;
    if (out->row.detail.empty() && !mine.detail.empty()) out->row.detail = "rank " + std::to_string(r) + ": " + mine.detail;
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

cases::ParallelSetting setting_of(const VerifyContext& ctx) {
  cases::ParallelSetting s;
  s.cuda = ctx.device.is_cuda();
  s.quick = ctx.quick;
  s.full = ctx.full;
  s.mpi_world = ctx.comm != nullptr ? ctx.comm->world_size() : 0;
  return s;
}

cases::CaseContext case_context_of(const VerifyContext& ctx) { return case_context(*ctx.weights, ctx.quick, ctx.seed); }

// ---- sp_region -----------------------------------------------------------------

// What the plan of `world` ranks moves (every rank's plan knows every rank's numbers).
Status sp_world_metrics(const cases::SpIndex& index, int world, int64_t hidden, CheckRow* row) {
  SpPlan sp;
  DETDIT_RETURN_IF_ERROR(SpPlan::create(index.plan, world, 0, &sp));
  const std::vector<double> send_rows = cases::sp_send_rows_per_rank(sp);
  double moved = 0;
  for (double rows : send_rows) moved += rows;
  row->metrics.push_back({"send_rows_per_rank", send_rows});
  row->metrics.push_back({"rows_moved_all_ranks", {moved}});
  row->metrics.push_back({"max_send_rows", {static_cast<double>(sp.max_send())}});
  for (SpVariant v : cases::kSpVariants) {
    std::string name = cases::sp_variant_name(v);  // "modulated rmsnorm" -> bytes_sent_per_rank_modulated_rmsnorm_bwd
    std::replace(name.begin(), name.end(), ' ', '_');
    row->metrics.push_back(
        {"bytes_sent_per_rank_" + name + "_bwd", {cases::sp_backward_bytes_per_rank(sp, v, hidden)}});
  }
  return Status::ok_status();
}

// Row "ws1 = cpu ws1": the device's WS1 (host copies `ws1`) against the same
// problem's WS1 on the CPU (`cpu_ws1` computes it): one comparison per output.
WorldRow compare_with_cpu_ws1(const std::vector<HostTensor>& ws1, const std::vector<std::string>& names,
                              const std::function<Status(std::vector<HostTensor>*)>& cpu_ws1) {
  WorldRow cpu;
  cpu.row.check = "ws1 = cpu ws1";
  const double start = now_seconds();
  std::vector<HostTensor> reference;
  Status s = cpu_ws1(&reference);
  if (s.ok() && reference.size() != ws1.size()) s = Status::runtime_error("the CPU's WS1 has other outputs");
  record_error(s, &cpu);
  for (std::size_t i = 0; s.ok() && i < reference.size(); ++i) {
    if (reference[i].nbytes() != ws1[i].nbytes()) {
      record_error(Status::runtime_error(names[i] + ": the CPU's WS1 has another size"), &cpu);
      continue;
    }
    compare_bytes(reference[i].data(), ws1[i].data(), ws1[i].nbytes(), ws1[i].dtype(), names[i], &cpu.row);
  }
  cpu.row.seconds = now_seconds() - start;
  finish(&cpu);
  return cpu;
}

// The output names of a run (prefixed), for the CPU comparison's details.
std::vector<std::string> output_names(const cases::ParallelRun& run, const std::string& prefix) {
  std::vector<std::string> names;
  for (const cases::RunOutput& o : run.outputs) names.push_back(prefix + o.name);
  return names;
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
Status run_sp_problem(const VerifyContext& ctx, const cases::SpProblem& pr, const cases::SpIndex& index,
                      const std::vector<int>& worlds, const std::vector<int>& naive_worlds, bool cpu_check,
                      const std::string& corrupt_variant, std::vector<SpVariantResult>* results) {
  const Device device = ctx.device;
  cases::SpIndex cpu_index;
  if (cpu_check) DETDIT_RETURN_IF_ERROR(cases::make_sp_index(pr, Device::cpu(), &cpu_index));
  for (SpVariant variant : cases::kSpVariants) {
    if (pr.shape.numerics != Numerics::kPortable && !cases::sp_variant_takes_profile(variant)) continue;
    SpVariantResult r;
    r.variant = variant;
    r.worlds.resize(worlds.size());
    // WS1 on this device (the default stream), brought to the host.
    std::vector<HostTensor> ws1;
    DETDIT_RETURN_IF_ERROR(cases::sp_ws1(pr, index, variant, device, &ws1));
    if (!ws1.empty() && corrupt_variant == cases::sp_variant_name(variant))
      static_cast<unsigned char*>(ws1[0].data())[0] ^= 1;
    const std::string prefix = std::string(cases::sp_variant_name(variant)) + " ";
    if (cpu_check) {
      cases::ParallelRun names_of;
      DETDIT_RETURN_IF_ERROR(
          cases::prepare_sp_run(pr, cpu_index, variant, Device::cpu(), nullptr, nullptr, nullptr, &names_of));
      r.cpu = compare_with_cpu_ws1(ws1, output_names(names_of, prefix), [&](std::vector<HostTensor>* reference) {
        return cases::run_and_download(names_of, nullptr, reference);
      });
    }
    for (std::size_t i = 0; i < worlds.size(); ++i) {
      r.worlds[i].row.check = "ws=" + std::to_string(worlds[i]);
      run_ranks(
          ctx, worlds[i],
          [&](Communicator& comm, std::vector<OutputReport>* reports) {
            return cases::sp_rank_against_ws1(pr, index, variant, device, comm, ws1, reports);
          },
          &r.worlds[i]);
    }
    if (cases::sp_variant_has_naive_contrast(variant)) {
      r.naive.resize(naive_worlds.size());
      r.naive_fraction.resize(naive_worlds.size());
      for (std::size_t i = 0; i < naive_worlds.size(); ++i) {
        const double start = now_seconds();
        record_error(cases::sp_naive_fractions(pr, index, device, variant, naive_worlds[i], ws1, &r.naive_fraction[i]),
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

const cases::SpRegionCase* find_sp_case(const VerifyContext& ctx, const std::string& name,
                                        std::vector<cases::SpRegionCase>* all) {
  *all = cases::sp_region_cases(case_context_of(ctx), setting_of(ctx));
  for (const cases::SpRegionCase& c : *all)
    if (c.name == name) return &c;
  return nullptr;
}

// The default verify's sp_region case `name`: one row per world for all four
// variants, one naive row per naive world for both contrasts.
Status verify_sp(const VerifyContext& ctx, const std::string& name, std::vector<CheckRow>* rows) {
  std::vector<cases::SpRegionCase> all;
  const cases::SpRegionCase* c = find_sp_case(ctx, name, &all);
  if (c == nullptr) return Status::value_error("no sp_region case " + name);
  cases::SpProblem pr;
  DETDIT_RETURN_IF_ERROR(cases::make_sp_problem(case_context_of(ctx), c->shape, &pr));
  cases::SpIndex index;
  DETDIT_RETURN_IF_ERROR(cases::make_sp_index(pr, ctx.device, &index));
  const std::vector<int>& worlds = c->worlds;
  const std::vector<int>& naive_worlds = c->naive_worlds;
  std::vector<WorldRow> checks(worlds.size());
  for (std::size_t i = 0; i < worlds.size(); ++i) {
    checks[i].row.check = "ws=" + std::to_string(worlds[i]);
    DETDIT_RETURN_IF_ERROR(sp_world_metrics(index, worlds[i], pr.shape.hidden, &checks[i].row));
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

bool sp_enabled(const VerifyContext& ctx, const std::string& name) {
  std::vector<cases::SpRegionCase> all;
  const cases::SpRegionCase* c = find_sp_case(ctx, name, &all);
  return c != nullptr && c->enabled;
}

// The cases of sp_region_cases, by name (S = 131072 on CUDA only: mpirun, one GPU per rank).
DETDIT_VERIFY_PARALLEL_CASE("sp_region", "S=4097 block", true, true, verify_sp, sp_enabled);
DETDIT_VERIFY_PARALLEL_CASE("sp_region", "S=4097 interleaved", true, true, verify_sp, sp_enabled);
DETDIT_VERIFY_PARALLEL_CASE("sp_region", "S=32768 block", true, true, verify_sp, sp_enabled);
DETDIT_VERIFY_PARALLEL_CASE("sp_region", "S=32768 interleaved", true, true, verify_sp, sp_enabled);
DETDIT_VERIFY_PARALLEL_CASE("sp_region", "S=131072 block", false, true, verify_sp, sp_enabled);
DETDIT_VERIFY_PARALLEL_CASE("sp_region", "S=131072 interleaved", false, true, verify_sp, sp_enabled);

// ---- tp_adaln_projection -----------------------------------------------------------

const cases::TpCase* find_tp_case(const VerifyContext& ctx, const std::string& name, std::vector<cases::TpCase>* all) {
  *all = cases::tp_adaln_projection_cases(case_context_of(ctx), setting_of(ctx));
  for (const cases::TpCase& c : *all)
    if (c.name == name) return &c;
  return nullptr;
}

Status verify_tp(const VerifyContext& ctx, const std::string& name, std::vector<CheckRow>* rows) {
  std::vector<cases::TpCase> all;
  const cases::TpCase* c = find_tp_case(ctx, name, &all);
  if (c == nullptr) return Status::value_error("no tp_adaln_projection case " + name);
  return verify_tp_worlds(ctx, c->shape, c->worlds, false, rows);
}

}  // namespace

Status verify_tp_worlds(const VerifyContext& ctx, const cases::TpShape& shape, const std::vector<int>& worlds,
                        bool cpu_check, std::vector<CheckRow>* rows) {
  const Device device = ctx.device;
  if (cpu_check && shape.numerics != Numerics::kPortable)
    return Status::value_error("tp: the CPU comparison needs the portable profile (the CPU has no torch profile)");
  cases::TpProblem pr;
  DETDIT_RETURN_IF_ERROR(cases::make_tp_problem(case_context_of(ctx), shape, &pr));
  cases::TpWeights weights;
  DETDIT_RETURN_IF_ERROR(cases::upload_tp_weights(pr, device, &weights));
  std::vector<HostTensor> ws1;
  DETDIT_RETURN_IF_ERROR(cases::tp_ws1(pr, weights, device, &ws1));
  for (int world : worlds) {
    double forward = 0, backward = 0;
    const Status split = cases::tp_bytes_sent_per_rank(shape, world, &forward, &backward);
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
    check.row.metrics.push_back({"bytes_sent_per_rank_forward", {forward}});
    check.row.metrics.push_back({"bytes_sent_per_rank_backward", {backward}});
    run_ranks(
        ctx, world,
        [&](Communicator& comm, std::vector<OutputReport>* reports) {
          return cases::tp_rank_against_ws1(pr, weights, device, comm, ws1, reports);
        },
        &check);
    finish(&check);
    rows->push_back(check.row);
  }
  if (cpu_check) {
    cases::TpWeights cpu_weights;
    DETDIT_RETURN_IF_ERROR(cases::upload_tp_weights(pr, Device::cpu(), &cpu_weights));
    cases::ParallelRun names_of;
    DETDIT_RETURN_IF_ERROR(cases::prepare_tp_run(pr, cpu_weights, Device::cpu(), nullptr, nullptr, &names_of));
    rows->push_back(compare_with_cpu_ws1(ws1, output_names(names_of, ""), [&](std::vector<HostTensor>* reference) {
                      return cases::run_and_download(names_of, nullptr, reference);
                    }).row);
  }
  return Status::ok_status();
}

namespace {

bool tp_enabled(const VerifyContext& ctx, const std::string& name) {
  std::vector<cases::TpCase> all;
  const cases::TpCase* c = find_tp_case(ctx, name, &all);
  return c != nullptr && c->enabled;
}
// The cases of tp_adaln_projection_cases, by name.
DETDIT_VERIFY_PARALLEL_CASE("tp_adaln_projection", "T=1", true, true, verify_tp, tp_enabled);
DETDIT_VERIFY_PARALLEL_CASE("tp_adaln_projection", "T=2", true, true, verify_tp, tp_enabled);
DETDIT_VERIFY_PARALLEL_CASE("tp_adaln_projection", "T=3", true, true, verify_tp, tp_enabled);
DETDIT_VERIFY_PARALLEL_CASE("tp_adaln_projection", "T=4", true, true, verify_tp, tp_enabled);

}  // namespace

Status verify_sp_matrix(const VerifyContext& ctx, const cases::SpShape& shape, const std::vector<int>& worlds,
                        const std::vector<int>& naive_worlds, const std::string& corrupt_variant,
                        std::vector<SpMatrixRows>* out) {
  cases::SpProblem pr;
  DETDIT_RETURN_IF_ERROR(cases::make_sp_problem(case_context_of(ctx), shape, &pr));
  cases::SpIndex index;
  DETDIT_RETURN_IF_ERROR(cases::make_sp_index(pr, ctx.device, &index));
  std::vector<SpVariantResult> results;
  // The CPU comparison of a GPU run needs the portable profile: the CPU has no torch profile.
  const bool cpu_check = ctx.device.is_cuda() && shape.numerics == Numerics::kPortable;
  DETDIT_RETURN_IF_ERROR(run_sp_problem(ctx, pr, index, worlds, naive_worlds, cpu_check, corrupt_variant, &results));
  // What each world's plan moves, once for every variant's row of that world.
  std::vector<CheckRow> world_metrics(worlds.size());
  for (std::size_t i = 0; i < worlds.size(); ++i)
    DETDIT_RETURN_IF_ERROR(sp_world_metrics(index, worlds[i], shape.hidden, &world_metrics[i]));
  for (SpVariantResult& r : results) {
    SpMatrixRows m;
    m.variant = cases::sp_variant_name(r.variant);
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
