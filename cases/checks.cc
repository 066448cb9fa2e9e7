// The check runner (checks.h): op cases and the parallel problems.
#include "cases/checks.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>

namespace detdit {
namespace cases {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void compare_bytes(const void* expected, const void* actual, std::size_t bytes, DType dtype, const std::string& what,
                   CheckRow* row) {
  ++row->bitwise_run;
  const Mismatch m = compare_bytes(expected, actual, static_cast<int64_t>(bytes / dtype_size(dtype)), dtype);
  if (m.equal()) {
    ++row->bitwise_passed;
  } else if (row->detail.empty()) {
    row->detail = what + ": " + m.describe();
  }
}

void add_output_reports(const std::vector<OutputReport>& reports, CheckRow* row) {
  for (const OutputReport& r : reports) {
    ++row->bitwise_run;
    if (r.mismatch.equal() && !r.still_canary) {
      ++row->bitwise_passed;
    } else if (row->detail.empty()) {
      row->detail = r.output + ": " + (r.still_canary ? "the reference output was never written" : r.mismatch.describe());
    }
  }
}

void finish_row(CheckRow* row) {
  const bool bitwise_ok = row->bitwise_passed == row->bitwise_run;
  // A check with a bound measured an error: NaN or above the bound fails it.
  const bool error_ok = std::isnan(row->bound) || row->max_error <= row->bound;
  row->pass = bitwise_ok && error_ok;
  if (!error_ok && row->detail.empty()) {
    char text[128];
    std::snprintf(text, sizeof text, "max error %.3g %s exceeds the bound %.3g", row->max_error,
                  row->error_unit.c_str(), row->bound);
    row->detail = text;
  }
}

namespace {

// A row crosses ranks as this fixed-size record (an all-gather of the
// communicator; the detail truncated).
struct RowRecord {
  int64_t present, bitwise_run, bitwise_passed;
  double max_error, seconds;
  int32_t pass, informational;
  char detail[440];
};
static_assert(sizeof(RowRecord) % 8 == 0, "RowRecord is gathered as whole words");

}  // namespace

Status merge_rank_rows(Communicator& comm, std::vector<CheckRow>* rows) {
  const int world = comm.world_size();
  int64_t count[2] = {static_cast<int64_t>(rows->size()), 0};
  std::vector<char> gathered;
  DETDIT_RETURN_IF_ERROR(gather_host_bytes(comm, count, sizeof count, &gathered));
  int64_t most = 0;
  for (int r = 0; r < world; ++r) most = std::max(most, reinterpret_cast<const int64_t*>(gathered.data())[2 * r]);
  std::vector<CheckRow> merged;
  for (int64_t i = 0; i < most; ++i) {
    RowRecord mine{};
    if (i < static_cast<int64_t>(rows->size())) {
      const CheckRow& row = (*rows)[static_cast<std::size_t>(i)];
      mine = RowRecord{1, row.bitwise_run, row.bitwise_passed, row.max_error, row.seconds, row.pass ? 1 : 0,
                       row.informational ? 1 : 0, {}};
      std::snprintf(mine.detail, sizeof mine.detail, "%s", row.detail.c_str());
    }
    DETDIT_RETURN_IF_ERROR(gather_host_bytes(comm, &mine, sizeof mine, &gathered));
    const RowRecord* all = reinterpret_cast<const RowRecord*>(gathered.data());
    CheckRow row = i < static_cast<int64_t>(rows->size()) ? (*rows)[static_cast<std::size_t>(i)] : CheckRow();
    row.bitwise_run = row.bitwise_passed = 0;
    row.pass = true;
    row.informational = all[0].present && all[0].informational;
    row.detail = all[0].present ? all[0].detail : "";
    bool failed_detail = false;
    for (int r = 0; r < world; ++r) {
      const RowRecord& rec = all[r];
      if (!rec.present) {
        row.pass = false;
        if (!failed_detail) row.detail = "rank " + std::to_string(r) + " ran fewer checks of this case";
        failed_detail = true;
        continue;
      }
      row.bitwise_run += rec.bitwise_run;
      row.bitwise_passed += rec.bitwise_passed;
      row.seconds = std::max(row.seconds, rec.seconds);
      if (!std::isnan(rec.max_error) && !(rec.max_error <= row.max_error)) row.max_error = rec.max_error;
      if (!rec.pass) {
        row.pass = false;
        if (!failed_detail) {
          const std::string detail = rec.detail;
          row.detail = detail.rfind("rank ", 0) == 0 ? detail : "rank " + std::to_string(r) + ": " + detail;
          failed_detail = true;
        }
      }
    }
    if (!row.pass) row.informational = false;
    merged.push_back(std::move(row));
  }
  *rows = std::move(merged);
  return Status::ok_status();
}


// ---- op cases ------------------------------------------------------------------

namespace {

// `count` positions from the first to the last, evenly spread; every
// position when there are no more.
std::vector<int64_t> probe_positions(int64_t positions, int64_t count) {
  std::vector<int64_t> probes;
  if (positions <= count || count < 2) {
    for (int64_t p = 0; p < positions; ++p) probes.push_back(p);
    return probes;
  }
  for (int64_t i = 0; i < count; ++i) probes.push_back(i * (positions - 1) / (count - 1));
  return probes;
}

// The case on `device` through `phases`; host copies of every tensor.
Status run_phases(const OpCase& c, const Device& device, int phases, std::map<std::string, HostTensor>* host) {
  Instance t;
  DETDIT_RETURN_IF_ERROR(instantiate(c, device, nullptr, &t));
  for (int phase = 0; phase < phases; ++phase) DETDIT_RETURN_IF_ERROR(run(c, static_cast<Phase>(phase), t));
  return download(c, t, host);
}

void measure(const AccuracyCheck& a, const std::map<std::string, HostTensor>& outputs, CheckRow* row) {
  row->max_error = a.error(outputs);
  row->bound = a.bound;
  row->error_unit = a.unit;
}

}  // namespace

Status check_op_case(const OpCase& c, const Device& device, std::vector<CheckRow>* rows) {
  const int phases = c.has(Phase::kBackward) ? 2 : 1;
  const bool portable = c.numerics == Numerics::kPortable;
  const std::vector<AccuracyCheck> no_checks;
  const std::vector<AccuracyCheck>& accuracy = portable ? c.accuracy : no_checks;
  // Both phases' outputs of each phase's comparison with `expected`.
  auto compare_phases = [&](const std::map<std::string, HostTensor>& expected,
                            const std::map<std::string, HostTensor>& actual, int count, CheckRow* row) {
    for (int phase = 0; phase < count; ++phase)
      add_output_reports(compare_outputs(c, static_cast<Phase>(phase), expected, actual), row);
  };
  std::map<std::string, HostTensor> first;
  Status ran;
  rows->push_back(timed_check(accuracy.empty() ? "run" : accuracy.front().name, [&](CheckRow* row) {
    ran = run_phases(c, device, phases, &first);
    if (ran.ok() && !accuracy.empty()) measure(accuracy.front(), first, row);
    return ran;
  }));
  if (!ran.ok()) return Status::ok_status();
  for (std::size_t i = 1; i < accuracy.size(); ++i) {
    rows->push_back(timed_check(accuracy[i].name, [&](CheckRow* row) {
      measure(accuracy[i], first, row);
      return Status::ok_status();
    }));
  }
  std::map<std::string, HostTensor> again;
  Status ran_again;
  for (int phase = 0; phase < phases; ++phase) {
    rows->push_back(timed_check(std::string(phase == 0 ? "forward" : "backward") + " repeatability", [&](CheckRow* row) {
      if (phase == 0) ran_again = run_phases(c, device, phases, &again);
      DETDIT_RETURN_IF_ERROR(ran_again);
      add_output_reports(compare_outputs(c, static_cast<Phase>(phase), first, again), row);
      return Status::ok_status();
    }));
  }
  again.clear();
  if (c.equivalent.compute && portable) {  // the same outputs by a second route (e.g. the fused op's separate ops)
    rows->push_back(timed_check(c.equivalent.name, [&](CheckRow* row) {
      std::map<std::string, HostTensor> expected;
      DETDIT_RETURN_IF_ERROR(c.equivalent.compute(first, &expected));
      compare_phases(expected, first, c.equivalent.forward_only ? 1 : phases, row);
      return Status::ok_status();
    }));
  }
  if (c.alone && c.positions > 1) {
    rows->push_back(timed_check("row invariance (position alone)", [&](CheckRow* row) {
      std::vector<OutputReport> reports;
      DETDIT_RETURN_IF_ERROR(
          compare_positions_alone(c, device, probe_positions(c.positions, c.alone_probes), &reports, &first));
      add_output_reports(reports, row);
      return Status::ok_status();
    }));
  }
  if (device.is_cuda() && portable) {
    rows->push_back(timed_check("cuda = cpu reference", [&](CheckRow* row) {
      std::map<std::string, HostTensor> reference;
      DETDIT_RETURN_IF_ERROR(run_phases(c, Device::cpu(), phases, &reference));
      compare_phases(reference, first, phases, row);
      return Status::ok_status();
    }));
  }
  return Status::ok_status();
}

Status check_op_cases(const std::vector<OpCase>& all, const Device& device, std::vector<CheckRow>* rows) {
  for (const OpCase& c : all) {
    const std::size_t first = rows->size();
    DETDIT_RETURN_IF_ERROR(check_op_case(c, device, rows));
    // Several cases of one op (e.g. sizes) share check names: each row names its case.
    if (all.size() > 1)
      for (std::size_t i = first; i < rows->size(); ++i) (*rows)[i].check += " " + c.name;
  }
  return Status::ok_status();
}

// ---- parallel problems ------------------------------------------------------------

namespace {

// A world's row under construction: the comparisons of every rank, and
// whether a computation failed (then the row fails with its message).
struct WorldRow {
  CheckRow row;
  bool error = false;
};

void record_error(const Status& status, WorldRow* world) {
  if (status.ok()) return;
  world->error = true;
  world->row.detail = status.to_string() + (world->row.detail.empty() ? "" : "; " + world->row.detail);
}

void finish(WorldRow* world) {
  finish_row(&world->row);
  if (world->error) world->row.pass = false;
}

// Adds `part`'s comparisons, time, error and first detail to `into`.
void absorb(const WorldRow& part, WorldRow* into) {
  into->row.bitwise_run += part.row.bitwise_run;
  into->row.bitwise_passed += part.row.bitwise_passed;
  into->row.seconds += part.row.seconds;
  into->error = into->error || part.error;
  if (into->row.detail.empty()) into->row.detail = part.row.detail;
}

// Runs rank(comm, &reports) on every rank of `world` (run_world: this
// process's rank of `comm`, or in-process threads on `device`) and adds the
// ranks' comparisons to the world's row.
template <typename Fn>
void run_ranks(const Device& device, Communicator* comm, int world, Fn&& rank, WorldRow* out) {
  const double start = now_seconds();
  std::vector<std::vector<OutputReport>> reports(static_cast<std::size_t>(comm != nullptr ? comm->world_size() : world));
  record_error(run_world(world, device, comm,
                         [&](Communicator& c) { return rank(c, &reports[static_cast<std::size_t>(c.rank())]); }),
               out);
  for (std::size_t r = 0; r < reports.size(); ++r) {
    CheckRow mine;
    add_output_reports(reports[r], &mine);
    out->row.bitwise_run += mine.bitwise_run;
    out->row.bitwise_passed += mine.bitwise_passed;
    if (out->row.detail.empty() && !mine.detail.empty()) out->row.detail = "rank " + std::to_string(r) + ": " + mine.detail;
  }
  out->row.seconds += now_seconds() - start;
}

// Row "ws1 = cpu ws1": the device's WS1 (host copies `ws1`) against the same
// run prepared on the CPU (`cpu_run`): one comparison per output.
WorldRow compare_with_cpu_ws1(const std::vector<HostTensor>& ws1, const ParallelRun& cpu_run, const std::string& prefix) {
  WorldRow cpu;
  cpu.row.check = "ws1 = cpu ws1";
  const double start = now_seconds();
  std::vector<HostTensor> reference;
  Status s = run_and_download(cpu_run, nullptr, &reference);
  if (s.ok() && reference.size() != ws1.size()) s = Status::runtime_error("the CPU's WS1 has other outputs");
  record_error(s, &cpu);
  for (std::size_t i = 0; s.ok() && i < reference.size(); ++i) {
    const std::string name = prefix + cpu_run.outputs[i].name;
    if (reference[i].nbytes() != ws1[i].nbytes()) {
      record_error(Status::runtime_error(name + ": the CPU's WS1 has another size"), &cpu);
    } else {
      compare_bytes(reference[i].data(), ws1[i].data(), ws1[i].nbytes(), ws1[i].dtype(), name, &cpu.row);
    }
  }
  cpu.row.seconds = now_seconds() - start;
  finish(&cpu);
  return cpu;
}

// What the plan of `world` ranks moves (every rank's plan knows every rank's numbers).
Status sp_world_metrics(const SpIndex& index, int world, int64_t hidden, CheckRow* row) {
  SpPlan sp;
  DETDIT_RETURN_IF_ERROR(SpPlan::create(index.plan, world, 0, &sp));
  const std::vector<double> send_rows = sp_send_rows_per_rank(sp);
  double moved = 0;
  for (double rows : send_rows) moved += rows;
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

// One variant's results on one sp problem: a row per world, the naive
// contrast's fractions per naive world, and (cpu_check) the CPU comparison.
struct SpVariantResult {
  SpVariant variant = SpVariant::kPlainRmsnorm;
  std::vector<WorldRow> worlds, naive;
  std::vector<std::vector<std::pair<std::string, double>>> naive_fraction;
  WorldRow cpu;
};

Status run_sp_problem(const Device& device, Communicator* comm, const SpProblem& pr, const SpIndex& index,
                      const std::vector<int>& worlds, const std::vector<int>& naive_worlds, bool cpu_check,
                      const std::string& corrupt_variant, std::vector<SpVariantResult>* results) {
  SpIndex cpu_index;
  if (cpu_check) DETDIT_RETURN_IF_ERROR(make_sp_index(pr, Device::cpu(), &cpu_index));
  for (SpVariant variant : kSpVariants) {
    if (pr.shape.numerics != Numerics::kPortable && !sp_variant_takes_profile(variant)) continue;
    SpVariantResult r;
    r.variant = variant;
    r.worlds.resize(worlds.size());
    std::vector<HostTensor> ws1;
    DETDIT_RETURN_IF_ERROR(sp_ws1(pr, index, variant, device, &ws1));
    if (!ws1.empty() && corrupt_variant == sp_variant_name(variant)) static_cast<unsigned char*>(ws1[0].data())[0] ^= 1;
    if (cpu_check) {
      ParallelRun cpu_run;
      DETDIT_RETURN_IF_ERROR(prepare_sp_run(pr, cpu_index, variant, Device::cpu(), nullptr, nullptr, nullptr, &cpu_run));
      r.cpu = compare_with_cpu_ws1(ws1, cpu_run, std::string(sp_variant_name(variant)) + " ");
    }
    for (std::size_t i = 0; i < worlds.size(); ++i) {
      r.worlds[i].row.check = "ws=" + std::to_string(worlds[i]);
      run_ranks(device, comm, worlds[i],
                [&](Communicator& c, std::vector<OutputReport>* reports) {
                  return sp_rank_against_ws1(pr, index, variant, device, c, ws1, reports);
                },
                &r.worlds[i]);
    }
    if (sp_variant_has_naive_contrast(variant)) {
      r.naive.resize(naive_worlds.size());
      r.naive_fraction.resize(naive_worlds.size());
      for (std::size_t i = 0; i < naive_worlds.size(); ++i) {
        const double start = now_seconds();
        record_error(sp_naive_fractions(pr, index, device, variant, naive_worlds[i], ws1, &r.naive_fraction[i]),
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
    char percent[32];
    std::snprintf(percent, sizeof percent, "%.1f %%", 100.0 * fraction);
    text += (text.empty() ? "" : ", ") + name + " " + percent;
  }
  if (!naive->error) row.detail = "naive rank-order sum differs from WS1 in " + text + " of the elements (the sp_region: 0)";
  finish(naive);
}

}  // namespace

Status check_sp_region(const CaseContext& context, const Device& device, Communicator* comm, const SpRegionCase& c,
                       std::vector<CheckRow>* rows) {
  SpProblem pr;
  DETDIT_RETURN_IF_ERROR(make_sp_problem(context, c.shape, &pr));
  SpIndex index;
  DETDIT_RETURN_IF_ERROR(make_sp_index(pr, device, &index));
  std::vector<WorldRow> checks(c.worlds.size()), naive(c.naive_worlds.size());
  for (std::size_t i = 0; i < c.worlds.size(); ++i) {
    checks[i].row.check = "ws=" + std::to_string(c.worlds[i]);
    DETDIT_RETURN_IF_ERROR(sp_world_metrics(index, c.worlds[i], pr.shape.hidden, &checks[i].row));
  }
  std::vector<SpVariantResult> results;
  DETDIT_RETURN_IF_ERROR(run_sp_problem(device, comm, pr, index, c.worlds, c.naive_worlds, false, "", &results));
  // Every variant's comparisons in its world's row; both contrasts in the naive row.
  std::vector<std::vector<std::pair<std::string, double>>> fractions(c.naive_worlds.size());
  for (const SpVariantResult& r : results) {
    for (std::size_t i = 0; i < c.worlds.size(); ++i) absorb(r.worlds[i], &checks[i]);
    for (std::size_t i = 0; i < r.naive.size(); ++i) {
      absorb(r.naive[i], &naive[i]);
      fractions[i].insert(fractions[i].end(), r.naive_fraction[i].begin(), r.naive_fraction[i].end());
    }
  }
  for (WorldRow& w : checks) {
    finish(&w);
    rows->push_back(w.row);
  }
  for (std::size_t i = 0; i < naive.size(); ++i) {
    finish_naive(c.naive_worlds[i], fractions[i], &naive[i]);
    rows->push_back(naive[i].row);
  }
  return Status::ok_status();
}

Status check_sp_matrix(const CaseContext& context, const Device& device, const SpShape& shape,
                       const std::vector<int>& worlds, const std::vector<int>& naive_worlds,
                       const std::string& corrupt_variant, std::vector<SpVariantRows>* out) {
  SpProblem pr;
  DETDIT_RETURN_IF_ERROR(make_sp_problem(context, shape, &pr));
  SpIndex index;
  DETDIT_RETURN_IF_ERROR(make_sp_index(pr, device, &index));
  // The CPU comparison of a GPU run needs the portable profile: the CPU has no torch profile.
  const bool cpu_check = device.is_cuda() && shape.numerics == Numerics::kPortable;
  std::vector<SpVariantResult> results;
  DETDIT_RETURN_IF_ERROR(
      run_sp_problem(device, nullptr, pr, index, worlds, naive_worlds, cpu_check, corrupt_variant, &results));
  std::vector<CheckRow> world_metrics(worlds.size());
  for (std::size_t i = 0; i < worlds.size(); ++i)
    DETDIT_RETURN_IF_ERROR(sp_world_metrics(index, worlds[i], shape.hidden, &world_metrics[i]));
  for (SpVariantResult& r : results) {
    SpVariantRows v;
    v.variant = sp_variant_name(r.variant);
    auto add = [&v](WorldRow* w, int world) {
      finish(w);
      v.rows.push_back(w->row);
      v.worlds.push_back(world);
    };
    for (std::size_t i = 0; i < worlds.size(); ++i) {
      auto& metrics = r.worlds[i].row.metrics;
      metrics.insert(metrics.end(), world_metrics[i].metrics.begin(), world_metrics[i].metrics.end());
      add(&r.worlds[i], worlds[i]);
    }
    for (std::size_t i = 0; i < r.naive.size(); ++i) {
      finish_naive(naive_worlds[i], r.naive_fraction[i], &r.naive[i]);
      v.rows.push_back(r.naive[i].row);
      v.worlds.push_back(naive_worlds[i]);
    }
    if (cpu_check) add(&r.cpu, 1);
    out->push_back(std::move(v));
  }
  return Status::ok_status();
}

Status check_tp_worlds(const CaseContext& context, const Device& device, Communicator* comm, const TpShape& shape,
                       const std::vector<int>& worlds, bool cpu_check, std::vector<CheckRow>* rows) {
  if (cpu_check && shape.numerics != Numerics::kPortable)
    return Status::value_error("tp: the CPU comparison needs the portable profile (the CPU has no torch profile)");
  TpProblem pr;
  DETDIT_RETURN_IF_ERROR(make_tp_problem(context, shape, &pr));
  TpWeights weights;
  DETDIT_RETURN_IF_ERROR(upload_tp_weights(pr, device, &weights));
  std::vector<HostTensor> ws1;
  DETDIT_RETURN_IF_ERROR(tp_ws1(pr, weights, device, &ws1));
  for (int world : worlds) {
    double forward = 0, backward = 0;
    const Status split = tp_bytes_sent_per_rank(shape, world, &forward, &backward);
    WorldRow check;
    check.row.check = "tp=" + std::to_string(world);
    if (!split.ok()) {
      // More ranks than N has 64-column chunks: what the op says (it refuses before any work).
      check.row.check += " (info)";
      check.row.informational = true;
      check.row.detail = split.message();
    } else {
      check.row.metrics.push_back({"bytes_sent_per_rank_forward", {forward}});
      check.row.metrics.push_back({"bytes_sent_per_rank_backward", {backward}});
      run_ranks(device, comm, world,
                [&](Communicator& c, std::vector<OutputReport>* reports) {
                  return tp_rank_against_ws1(pr, weights, device, c, ws1, reports);
                },
                &check);
    }
    finish(&check);
    rows->push_back(check.row);
  }
  if (cpu_check) {
    TpWeights cpu_weights;
    DETDIT_RETURN_IF_ERROR(upload_tp_weights(pr, Device::cpu(), &cpu_weights));
    ParallelRun cpu_run;
    DETDIT_RETURN_IF_ERROR(prepare_tp_run(pr, cpu_weights, Device::cpu(), nullptr, nullptr, &cpu_run));
    rows->push_back(compare_with_cpu_ws1(ws1, cpu_run, "").row);
  }
  return Status::ok_status();
}

}  // namespace cases
}  // namespace detdit
