// detdit bench: every benchmark case of the op-case library (cases/,
// Suite::kBench) on one device, forward, backward and both: the median time of
// repeated calls (wall clock on the CPU, CUDA events on a GPU), the bytes floor
// of the case (each input read once, each output written once), GB/s, the % of
// a copy bandwidth measured in the same run, and #wrong: the outputs of the
// timed calls compared bitwise with a CPU reference run of the same case.
// Then the parallel regions (sp_region, tp_adaln_projection; their problems,
// sizes and world sizes are cases/parallel_cases.h's), per world size next to
// WS1 on the same device: simulated in-process, measured under --comm mpi, or
// predicted (--predict-world). On the CPU they run only when --ops names them,
// a smoke test of the timing path, not a performance claim. The timing and
// the checks of both are cases/timing.h's. Output as a table, CSV or JSON
// (docs/cli.md gives the schema). Exit 0 when no output is wrong, 1 when one
// is, 2 on usage or input errors.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iterator>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "cases/timing.h"
#include "cli.h"
#include "io/files.h"

namespace detdit {
namespace cli {
namespace {

using Json = nlohmann::ordered_json;
using cases::BenchRow;

// What every timed call of a run shares. The op cases run on the device's
// default stream; each rank of a parallel region on a stream of its own.
struct BenchContext {
  Device device;
  int warmup = 0, repeats = 1;
  bool quick = false;
  cases::CaseContext cases;  // the weights' dimensions and tensors, --quick and the seed
  const cases::LinkModel* predict = nullptr;  // set: the parallel regions are predicted, not simulated
};

bool wanted(const std::set<std::string>& filter, const std::string& item) { return filter.empty() || filter.count(item); }
bool is_parallel_op(const std::string& op) { return op == "sp_region" || op == "tp_adaln_projection"; }

// Each region of the cases of `ops` and `names` (empty: all) timed (time_region),
// or with `count` only counted. Each (op, case, phase) timed is reported to `progress`.
Status run_parallel_bench(const BenchContext& ctx, Communicator* mpi, const std::set<std::string>& ops,
                          const std::set<std::string>& names, Progress* progress, std::vector<BenchRow>* rows,
                          std::size_t* count = nullptr) {
  // The parallel bench cases of this run's device (counting: those of an in-process run).
  const int mpi_world = mpi != nullptr && count == nullptr ? mpi->world_size() : 0;
  const cases::ParallelSetting setting{ctx.device.is_cuda(), ctx.quick, false, mpi_world};
  auto time_cases = [&](const auto& all, const auto& make_regions, std::size_t phases) -> Status {
    for (const auto& c : all) {
      if (!wanted(names, c.name)) continue;
      if (count != nullptr) {
        *count += phases;
        continue;
      }
      std::vector<cases::TimedRegion> regions;
      DETDIT_RETURN_IF_ERROR(make_regions(ctx.cases, c, ctx.device, &regions));
      for (const cases::TimedRegion& region : regions) {
        const std::string label = region.op + " " + region.name + " " + region.phase;
        progress->started(label);
        cases::time_region({ctx.device, ctx.warmup, ctx.repeats, ctx.predict}, mpi, region, c.worlds, rows);
        progress->finished(label);
      }
    }
    return Status::ok_status();
  };
  if (wanted(ops, "sp_region"))
    DETDIT_RETURN_IF_ERROR(time_cases(cases::sp_region_bench_cases(ctx.cases, setting), cases::sp_region_bench_regions, 1));
  if (wanted(ops, "tp_adaln_projection"))
    DETDIT_RETURN_IF_ERROR(time_cases(cases::tp_adaln_projection_bench_cases(ctx.cases, setting),
                                      cases::tp_adaln_projection_bench_regions, 2));  // fwd and fwd+bwd
  return Status::ok_status();
}

std::size_t parallel_bench_count(const BenchContext& ctx, const std::set<std::string>& ops,
                                 const std::set<std::string>& names) {
  std::size_t count = 0;  // counting makes no problem, so it cannot fail
  return run_parallel_bench(ctx, nullptr, ops, names, nullptr, nullptr, &count).ok() ? count : 0;
}

// A row passes when it has no error and no wrong element, and compared some
// (WS1 is the reference and a prediction is not checked).
bool passed(const BenchRow& r) {
  return r.error.empty() && r.wrong == 0 && (r.compared > 0 || r.ws1 || r.predicted);
}

double metric(const BenchRow& r, const std::string& name) {
  for (const auto& [key, values] : r.metrics) {
    if (key == name && values.size() == 1) return values[0];
  }
  return std::nan("");
}

// ---- the report: one JSON object, table line and CSV line per row -------------

// A target of docs/design.md (SP8 >= 6x faster than WS1 at S = 131072; never
// slower than WS1 at S = 32768, every world size, both packings):
// measured_speedup = WS1 time / world time (NaN when this run did not measure it).
struct ParallelTarget {
  std::string target;
  double required_speedup = 0;
  double measured_speedup = std::numeric_limits<double>::quiet_NaN();
  bool simulated = true;
  bool predicted = false;
};

// The targets; one this run did not measure says the run's kind (`simulated`, `predicted`).
std::vector<ParallelTarget> parallel_targets(const std::vector<BenchRow>& rows, bool simulated, bool predicted) {
  std::vector<ParallelTarget> targets;
  auto add = [&](const std::string& target, double required, const BenchRow* r) {
    ParallelTarget t{target, required, std::nan(""), simulated, predicted};
    if (r != nullptr) {
      t.measured_speedup = r->ws1_median_seconds / r->median_seconds;
      t.simulated = r->simulated;
      t.predicted = r->predicted;
    }
    targets.push_back(t);
  };
  auto timed = [](const BenchRow& r, const std::string& name) {
    return r.op == "sp_region" && r.name == name && !r.ws1 && r.error.empty();
  };
  for (const std::string packing : {"block", "interleaved"}) {
    const BenchRow* sp8 = nullptr;  // a measurement wins over a prediction
    for (const BenchRow& r : rows)
      if (timed(r, "S=131072 " + packing) && r.world == 8 && (!r.predicted || sp8 == nullptr || sp8->predicted)) sp8 = &r;
    add("sp_region fwd+bwd S=131072 " + packing + ": SP8 >= 6x faster than WS1", 6.0, sp8);
  }
  for (const std::string packing : {"block", "interleaved"})
    for (const BenchRow& r : rows)
      if (timed(r, "S=32768 " + packing))
        add("sp_region fwd+bwd S=32768 " + packing + " SP" + std::to_string(r.world) + ": never slower than WS1", 1.0, &r);
  return targets;
}

// What the report shows, in every format.
struct Report {
  std::string device;  // "cpu", "cuda:0"
  Json recorded;  // record_environment's keys
  Json options;
  double copy_bandwidth = 0;
  std::vector<BenchRow> rows, parallel_rows;
  // The parallel regions, when they ran: how, in words and as the JSON's
  // "parallel" object (without its results and targets), and the targets.
  bool parallel = false, predicted = false;
  std::string how;
  Json parallel_run;
  std::vector<ParallelTarget> targets;
};

double gbps(const BenchRow& r) { return r.bytes / r.median_seconds / 1e9; }
double percent_of_copy(const Report& report, const BenchRow& r) {
  return 100.0 * r.bytes / r.median_seconds / report.copy_bandwidth;
}
// #wrong or compared as text; "n/a" for a prediction, whose ranks never received their peers' values.
std::string checked(const BenchRow& r, int64_t count) { return r.predicted ? "n/a" : std::to_string(count); }

Json row_json(const Report& report, const BenchRow& r) {
  Json j = {{"op", r.op}, {"case", r.name}, {"phase", r.phase}};
  if (r.parallel) {
    j["world"] = r.world;
    j["ws1"] = r.ws1;
    j["predicted"] = r.predicted;
  } else {
    j["device"] = report.device;
  }
  if (!r.error.empty()) {
    j["error"] = r.error;
    return j;
  }
  j["median_us"] = r.median_seconds * 1e6;
  if (r.parallel) {
    j["rank_median_us"] = Json::array();
    for (double m : r.rank_medians) j["rank_median_us"].push_back(m * 1e6);
    j["ws1_median_us"] = r.ws1_median_seconds * 1e6;
    j["speedup_vs_ws1"] = r.ws1_median_seconds / r.median_seconds;
    for (const auto& [name, values] : r.metrics) j[name] = values.size() == 1 ? Json(values[0]) : Json(values);
  } else {
    j["bytes"] = r.bytes;
    j["byte_model"] = r.byte_model;
    j["gbps"] = gbps(r);
    j["percent_of_copy"] = percent_of_copy(report, r);
  }
  // a prediction is not checked: null, not zero
  j["wrong"] = r.predicted ? Json(nullptr) : Json(r.wrong);
  j["compared"] = r.predicted ? Json(nullptr) : Json(r.compared);
  return j;
}

// CSV: op,case,phase,device,median_us,bytes,gbps,percent_of_copy,wrong,compared,error.
// A region's case names its world; its bytes are those each rank sends.
void print_csv_row(const Report& report, const BenchRow& r) {
  const std::string world = r.ws1 ? " WS1" : " ws=" + std::to_string(r.world) + (r.predicted ? " predicted" : "");
  std::printf("%s,%s,%s,%s,", r.op.c_str(), (r.name + (r.parallel ? world : "")).c_str(), r.phase.c_str(),
              report.device.c_str());
  if (!r.error.empty()) {
    std::printf(",,,,,,\"%s\"\n", r.error.c_str());
  } else if (r.parallel) {
    const double bytes = metric(r, "bytes_sent_per_rank");
    std::printf("%.3f,%s,,,%s,%s,\n", r.median_seconds * 1e6,
                std::isnan(bytes) ? "" : std::to_string(static_cast<long long>(bytes)).c_str(),
                checked(r, r.wrong).c_str(), checked(r, r.compared).c_str());
  } else {
    std::printf("%.3f,%.0f,%.3f,%.2f,%lld,%lld,\n", r.median_seconds * 1e6, r.bytes, gbps(r), percent_of_copy(report, r),
                static_cast<long long>(r.wrong), static_cast<long long>(r.compared));
  }
}

void print_table_row(const Report& report, const BenchRow& r) {
  const std::string world = r.ws1 ? "WS1" : std::to_string(r.world) + (r.predicted ? " p" : "");
  if (!r.error.empty() && !r.parallel) {
    std::printf("%-18s %-36s %-7s ERROR %s\n", r.op.c_str(), r.name.c_str(), r.phase.c_str(), r.error.c_str());
  } else if (!r.error.empty()) {
    std::printf("%-20s %-22s %-8s %-5s ERROR %s\n", r.op.c_str(), r.name.c_str(), r.phase.c_str(), world.c_str(),
                r.error.c_str());
  } else if (!r.parallel) {
    std::printf("%-18s %-36s %-7s %11.1f %13.0f %8.1f %7.1f%% %8lld\n", r.op.c_str(), r.name.c_str(), r.phase.c_str(),
                r.median_seconds * 1e6, r.bytes, gbps(r), percent_of_copy(report, r), static_cast<long long>(r.wrong));
  } else {
    const double bytes = metric(r, "bytes_sent_per_rank");
    std::printf("%-20s %-22s %-8s %-5s %12.1f %8.2fx %14.0f %10s\n", r.op.c_str(), r.name.c_str(), r.phase.c_str(),
                world.c_str(), r.median_seconds * 1e6, r.ws1_median_seconds / r.median_seconds,
                std::isnan(bytes) ? 0.0 : bytes, checked(r, r.wrong).c_str());
  }
}

Json report_json(const Report& report) {
  Json out;
  out["kind"] = "detdit_bench_report";
  out["format_version"] = 2;
  out.update(report.recorded);
  out["options"] = report.options;
  out["copy_gbps"] = report.copy_bandwidth / 1e9;
  out["cases"] = Json::array();
  for (const BenchRow& r : report.rows) out["cases"].push_back(row_json(report, r));
  if (!report.parallel) return out;
  Json& p = out["parallel"] = report.parallel_run;
  p["results"] = Json::array();
  for (const BenchRow& r : report.parallel_rows) p["results"].push_back(row_json(report, r));
  p["targets"] = Json::array();
  for (const ParallelTarget& t : report.targets) {
    const bool measured = !std::isnan(t.measured_speedup);
    p["targets"].push_back({{"target", t.target},
                            {"required_speedup", t.required_speedup},
                            {"measured_speedup", measured ? Json(t.measured_speedup) : nullptr},
                            {"met", measured ? Json(t.measured_speedup >= t.required_speedup) : nullptr},
                            {"simulated", t.simulated},
                            {"predicted", t.predicted}});
  }
  return out;
}

void print_csv(const Report& report) {
  std::printf("op,case,phase,device,median_us,bytes,gbps,percent_of_copy,wrong,compared,error\n");
  for (const auto* rows : {&report.rows, &report.parallel_rows})
    for (const BenchRow& r : *rows) print_csv_row(report, r);
}

void print_table(const Report& report) {
  std::printf("copy bandwidth %.1f GB/s (%s, measured now); commit %.12s%s\n", report.copy_bandwidth / 1e9,
              report.recorded["environment"]["device"].get<std::string>().c_str(),
              report.recorded["git"]["commit"].get<std::string>().c_str(), report.recorded["git"]["dirty"] ? " (dirty)" : "");
  if (!report.rows.empty()) {
    std::printf("%-18s %-36s %-7s %11s %13s %8s %8s %8s\n", "op", "case", "phase", "median us", "bytes floor", "GB/s",
                "% copy", "#wrong");
  }
  for (const BenchRow& r : report.rows) print_table_row(report, r);
  if (!report.parallel) return;
  std::printf("\nparallel regions (%s); time = slowest rank's median%s\n", report.how.c_str(),
              report.predicted ? "; a world 'N p' is predicted: the slowest rank alone + the link model's time, not "
                                 "checked (#wrong n/a); #wrong of the others vs WS1 on the same device"
                               : "; #wrong vs WS1 on the same device");
  std::printf("%-20s %-22s %-8s %-5s %12s %9s %14s %10s\n", "op", "case", "phase", "world", "median us", "vs WS1",
              "bytes/rank", "#wrong");
  for (const BenchRow& r : report.parallel_rows) print_table_row(report, r);
  for (const BenchRow& r : report.parallel_rows) {  // a prediction of a measured world, against it
    const double measured = metric(r, "measured_us"), error = metric(r, "prediction_error_percent");
    if (r.predicted && !std::isnan(measured))
      std::printf("prediction of %s %s %s at world %d: %.1f us, measured %.1f us (%+.1f %%)\n", r.op.c_str(),
                  r.name.c_str(), r.phase.c_str(), r.world, r.median_seconds * 1e6, measured, error);
  }
  for (const ParallelTarget& t : report.targets) {
    if (std::isnan(t.measured_speedup)) {
      std::printf("target %s: not measured in this run\n", t.target.c_str());
    } else {
      std::printf("target %s: %.2fx (%s)%s\n", t.target.c_str(), t.measured_speedup,
                  t.measured_speedup >= t.required_speedup ? "met" : "NOT met",
                  t.predicted ? " [prediction]" : t.simulated ? " [simulation]" : "");
    }
  }
}

}  // namespace

int run_bench(int argc, char** argv) {
  Args args("detdit bench [--ops LIST] [--cases LIST] [--device cpu|cuda] [--format table|csv|json]",
            "Times each op case: median over repeated calls, bytes moved (byte model), GB/s, % of the copy\n"
            "bandwidth measured in the same run, and #wrong (elements of the timed outputs that differ\n"
            "bitwise from the CPU reference). Exit 0: no wrong element; 1: some; 2: usage/input error.");
  args.option("--ops", "LIST", "comma-separated ops", "all");
  args.option("--cases", "LIST", "comma-separated case names", "all");
  args.option("--device", "cpu|cuda", "where the ops run", "cuda when a GPU is present, else cpu");
  args.option("--format", "FMT", "table, csv or json", "table");
  args.option("--out", "FILE", "also write the JSON report here", "none");
  args.option("--repeats", "N", "timed calls per case", "20 (5 with --quick)");
  args.option("--warmup", "N", "untimed calls first", "3 (1 with --quick)");
  args.option("--weights", "DIR", "weights directory or file", "synthetic, cached");
  args.option("--seed", "N", "seed of the inputs", "0");
  args.flag("--quick", "fewer repeats, smaller copy baseline");
  args.option("--comm", "inprocess|mpi",
              "parallel ops (sp_region, tp_adaln_projection): in-process ranks on one device (a simulation),\n"
              "or one process per GPU under mpirun (NCCL; then only the parallel ops run)",
              "inprocess");
  args.option("--predict-world", "LIST",
              "predict the parallel regions at these world sizes (e.g. 2,4,8) instead of simulating\n"
              "them: each rank's share timed alone on the device, plus a link model",
              "none");
  args.option("--link-gbps", "X", "the link model's bus bandwidth, GB/s (docs/cli.md)",
              "360, assumed, not measured");
  args.option("--link-latency-us", "X", "cost of one collective beside its bytes, us", "10, assumed");
  args.flag("--list", "list the registered cases and exit");
  int code = parse_or_exit_code(&args, argc, argv, 1);
  if (code >= 0) return code;
  BenchContext context;
  context.quick = args.has("--quick");
  int64_t repeats = 0, warmup = 0;
  uint64_t seed = 0;
  double link_gbps = 0, link_latency_us = 0;
  if (!args.get_int("--repeats", context.quick ? 5 : 20, 1, 100000, &repeats) ||
      !args.get_int("--warmup", context.quick ? 1 : 3, 0, 100000, &warmup) ||
      !args.get_uint64("--seed", 0, &seed))
    return fail(args.error());
  context.repeats = static_cast<int>(repeats);
  context.warmup = static_cast<int>(warmup);
  const std::string format = args.get("--format", "table");
  if (format != "table" && format != "csv" && format != "json")
    return fail("--format must be table, csv or json, got '" + format + "'");
  const std::string out_path = args.get("--out", "");
  if (args.has("--list")) {
    // The cases at the H3 shape (the weights' dimensions name them at run time).
    cases::CaseContext h3;
    for (const cases::OpCase& c : cases::op_cases("", cases::Suite::kBench, h3))
      std::printf("%-20s %-36s %s\n", c.op.c_str(), c.name.c_str(), c.has(cases::Phase::kBackward) ? "fwd bwd fwd+bwd" : "fwd");
    std::printf("%-20s %-24s %s\n", "sp_region", "S=32768|131072 block|interleaved", "cuda mpi (cpu: S=4097 with --ops)");
    std::printf("%-20s %-24s %s\n", "tp_adaln_projection", "T=1|4", "cuda mpi (cpu: T=4 with --ops)");
    return 0;
  }
  if (!args.get_positive("--link-gbps", 360, &link_gbps) || !args.get_positive("--link-latency-us", 10, &link_latency_us))
    return fail(args.error());
  if (!args.has("--predict-world") && (args.has("--link-gbps") || args.has("--link-latency-us")))
    return fail("--link-gbps and --link-latency-us are the model of --predict-world, which is not given");
  cases::LinkModel link;
  if (args.has("--predict-world")) {
    std::vector<int64_t> worlds;
    if (!args.get_int_list("--predict-world", "", 2, 1024, "world size", &worlds)) return fail(args.error());
    for (int64_t world : worlds) link.worlds.push_back(static_cast<int>(world));
    std::sort(link.worlds.begin(), link.worlds.end());
    link.bus_bytes_per_second = link_gbps * 1e9;
    link.latency_seconds = link_latency_us * 1e-6;
    // Under --comm mpi the figures not given are measured on the MPI world (below).
    const bool measured = args.get("--comm") == "mpi";
    link.source = std::string(args.has("--link-gbps") ? "bandwidth given (--link-gbps)"
                              : measured ? "bandwidth measured"
                                         : "bandwidth assumed (the order of NCCL all-gather bus bandwidth "
                                           "on 8 x H100 over NVLink4)") +
                  (args.has("--link-latency-us") ? ", latency given (--link-latency-us)"
                   : measured                     ? ", latency measured"
                                                  : ", latency assumed");
    if (!measured) link.source += "; neither measured on this machine";
    context.predict = &link;
  }
  // The NCCL call check (a host synchronisation per collective) is off for
  // timing: every rank runs the same calls.
  NcclOptions nccl;
  nccl.check_calls = false;
  std::unique_ptr<Communicator> world;
  code = open_run(args, nccl, &context.device, &world);
  if (code >= 0) return code;
  if (world != nullptr) {
    if (context.predict != nullptr && (!args.has("--link-gbps") || !args.has("--link-latency-us"))) {
      cases::LinkModel measured;
      const Status s = cases::measure_link(context.device, *world, 2, 5, &measured);
      if (!s.ok()) return fail("measuring the link of --comm mpi: " + s.to_string());
      if (!args.has("--link-gbps")) link.bus_bytes_per_second = measured.bus_bytes_per_second;
      if (!args.has("--link-latency-us")) link.latency_seconds = measured.latency_seconds;
      link.source += " over " + std::string(world->backend_id()) + " between " + std::to_string(world->world_size()) +
                     " ranks";
    }
  }
  const bool leader = world == nullptr || world->rank() == 0;
  std::set<std::string> ops, names;
  if (!args.get_set("--ops", &ops) || !args.get_set("--cases", &names)) return fail(args.error());
  bool any_op_case = false;
  for (const std::string& op : cases::case_ops()) any_op_case = any_op_case || ops.empty() || ops.count(op) > 0;
  if (world != nullptr) any_op_case = false;  // under mpirun only the parallel regions run
  // The parallel ops: by default on a GPU; on the CPU only when --ops names one.
  std::set<std::string> parallel_ops;
  for (const std::string& op : ops) {
    if (is_parallel_op(op)) parallel_ops.insert(op);
  }
  const bool parallel = world != nullptr || !parallel_ops.empty() || (ops.empty() && context.device.is_cuda());
  if (context.predict != nullptr && !parallel)
    return fail("--predict-world predicts the parallel regions, and none runs here (on --device cpu "
                       "name them with --ops sp_region,tp_adaln_projection)");
  if (!any_op_case && !parallel)
    return fail("no bench case matches --device " + std::string(context.device.is_cuda() ? "cuda" : "cpu") +
                       (ops.empty() ? "" : " --ops") + (names.empty() ? "" : " --cases") +
                       " (detdit bench --list shows them)");
  io::Weights weights;
  std::vector<std::string> destinations;
  if (!out_path.empty()) destinations.push_back(out_path);
  Status status = resolve_run_weights(world.get(), destinations, args.get("--weights"), io::ManifestConfig(), 0, &weights);
  if (!status.ok()) return fail(status.to_string(), leader);
  context.cases = case_context(weights, context.quick, seed);

  Report report;
  report.device = context.device.to_string();
  status = cases::measure_copy_bandwidth(context.device, nullptr, std::size_t(context.quick ? 64 : 256) << 20,
                                         context.quick ? 3 : 7, &report.copy_bandwidth);
  if (!status.ok()) {
    status = Status(status.kind(), "copy baseline: " + status.message());
    if (!leader) std::fprintf(stderr, "detdit: rank %d: %s\n", world->rank(), status.to_string().c_str());
  }
  // Every rank agrees before any returns: a peer must not wait in its next collective.
  if (world != nullptr) status = all_ranks_ok(*world, status);
  if (!status.ok()) return fail(status.to_string(), leader);
  // The benchmark sizes: the smallest only with --quick or on the CPU.
  cases::CaseContext case_context_of_run = context.cases;
  case_context_of_run.small = context.quick || !context.device.is_cuda();
  std::vector<cases::OpCase> selected;
  std::set<std::string> unmatched = names;  // --cases names that no case of this run has
  if (any_op_case) {
    for (cases::OpCase& c : cases::op_cases("", cases::Suite::kBench, case_context_of_run)) {
      if (!ops.empty() && !ops.count(c.op)) continue;
      unmatched.erase(c.name);
      if (names.empty() || names.count(c.name)) selected.push_back(std::move(c));
    }
  }
  for (auto it = unmatched.begin(); it != unmatched.end();)
    it = parallel && parallel_bench_count(context, parallel_ops.empty() ? ops : parallel_ops, {*it}) > 0
             ? unmatched.erase(it)
             : std::next(it);
  if (!unmatched.empty()) {
    return fail("--cases: no case named '" + *unmatched.begin() + "' on --device " +
                    (context.device.is_cuda() ? "cuda" : "cpu") + (ops.empty() ? "" : " for --ops") +
                    " (detdit bench --list shows them)", leader);
  }
  // Progress on stderr (the report waits for the last case): a large case
  // takes seconds, most of it the CPU reference.
  Progress progress("detdit bench", selected.size() + (parallel ? parallel_bench_count(context, parallel_ops, names) : 0),
                    leader);
  for (const cases::OpCase& c : selected) {
    const std::size_t before = report.rows.size();
    progress.started(c.full_name());
    Status s = cases::bench_op_case(c, context.device, context.warmup, context.repeats, &report.rows);
    if (!s.ok()) {
      report.rows.resize(before);
      report.rows.push_back(BenchRow(c.op, c.name, "", false));
      report.rows.back().error = s.to_string();
    }
    progress.finished(c.full_name(), s.ok() ? "" : "error");
  }
  if (parallel) {
    Status s = run_parallel_bench(context, world.get(), parallel_ops, names, &progress, &report.parallel_rows);
    if (!s.ok()) {
      report.parallel_rows.push_back(BenchRow("parallel", "", "", true));
      report.parallel_rows.back().error = s.to_string();
    }
  }
  progress.clear();

  bool all_right = true;
  for (const auto* rows : {&report.rows, &report.parallel_rows})
    for (const BenchRow& r : *rows) all_right = all_right && passed(r);
  if (!leader) return all_right ? 0 : 1;  // rank 0 reports for every rank
  record_environment(context.device, &report.recorded);
  report.options = {{"repeats", repeats}, {"warmup", warmup}, {"quick", context.quick}, {"seed", seed}};
  report.parallel = parallel;
  report.predicted = context.predict != nullptr;
  const bool simulated = world == nullptr && context.predict == nullptr;
  const bool predicted_only = world == nullptr && context.predict != nullptr;
  char link_text[96];
  std::snprintf(link_text, sizeof link_text, "%g GB/s bus bandwidth, %g us per collective",
                link.bus_bytes_per_second / 1e9, link.latency_seconds * 1e6);
  const std::string prediction_how = "PREDICTION, not a measurement: each rank's share timed alone on " + report.device +
                                     ", plus a link model (" + link_text + "; " + link.source +
                                     "); not checked against WS1";
  report.how = world != nullptr ? std::to_string(world->world_size()) + " processes, one " + report.device +
                                      " each, over " + world->backend_id() +
                                      (report.predicted ? "; the other world sizes a " + prediction_how : "")
               : predicted_only ? prediction_how
                                : "SIMULATION: in-process ranks sharing " + report.device +
                                      " (they compete for it; not a multi-GPU measurement)";
  Json& p = report.parallel_run;
  p["how"] = report.how;
  p["comm"] = world != nullptr ? world->backend_id() : report.predicted ? "prediction" : "in_process";
  p["world_size"] = world != nullptr ? world->world_size() : 1;
  p["simulated"] = simulated;
  p["predicted"] = report.predicted;
  if (report.predicted)
    p["link_model"] = {{"bus_gbps", link.bus_bytes_per_second / 1e9},
                       {"latency_us", link.latency_seconds * 1e6},
                       {"source", link.source}};
  p["nccl_check_calls"] = false;
  p["wrong_vs"] = predicted_only ? Json(nullptr) : Json("WS1 on the same device");
  report.targets = parallel_targets(report.parallel_rows, simulated, predicted_only);
  if (format == "json" || !out_path.empty()) {
    const std::string json = report_json(report).dump(2);
    if (format == "json") std::printf("%s\n", json.c_str());
    if (!out_path.empty()) {
      const Status written = io::write_file_atomically(out_path, json + "\n");
      if (!written.ok()) return fail(written.to_string());
    }
  }
  if (format == "csv") print_csv(report);
  if (format == "table") print_table(report);
  return all_right ? 0 : 1;
}

}  // namespace cli
}  // namespace detdit
