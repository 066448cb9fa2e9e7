// detdit bench: every benchmark case of the op-case library (cases/,
// Suite::kBench) on one device, forward, backward and both: the median time of
// repeated calls (wall clock on the CPU, CUDA events on a GPU), the bytes floor
// of the case (each input read once, each output written once), GB/s, the % of
// a copy bandwidth measured in the same run, and #wrong: the outputs of the
// timed calls compared bitwise with a CPU reference run of the same case.
// Then the parallel regions (bench_parallel.cc). Output as a table, CSV or
// JSON (docs/cli.md gives the schema). Exit 0 when no output is wrong, 1 when
// one is, 2 on usage or input errors.
#include "bench.h"

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <cstdio>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "args.h"
#include "cli.h"
#include "environment.h"
#include "io/files.h"
#include "parallel_common.h"
#include "progress.h"

namespace detdit {
namespace cli {
namespace {

// One timed phase of one case.
struct BenchResult {
  std::string op, name, phase;  // phase: "fwd", "bwd" or "fwd+bwd"
  double median_seconds = 0, bytes = 0;
  std::string byte_model;
  int64_t wrong = 0, compared = 0;
  std::string error;
};

void count_wrong(const std::vector<cases::OutputReport>& reports, BenchResult* r) {
  for (const cases::OutputReport& o : reports) {
    r->compared += o.mismatch.compared;
    r->wrong += o.mismatch.shape_error.empty() ? o.mismatch.count : o.mismatch.compared;
    if (o.still_canary && r->error.empty()) r->error = o.output + ": the CPU reference never wrote it";
  }
}

// Times the case's phases on the context's device, then compares the outputs
// of the timed calls with a CPU run of the same case.
Status bench_op_case(const cases::OpCase& c, const BenchContext& context, int warmup, int repeats,
                     std::vector<BenchResult>* results) {
  // At the H3 shapes a case is tens of GB on the host: the inputs are filled
  // once for both runs, the device's outputs downloaded and its tensors freed
  // before the CPU reference runs.
  std::map<std::string, HostTensor> inputs, got, expected;
  cases::make_inputs(c, &inputs);
  auto t = std::make_unique<cases::Instance>();
  DETDIT_RETURN_IF_ERROR(cases::instantiate(c, context.device, context.stream, t.get(), &inputs));
  const bool backward = c.has(cases::Phase::kBackward);
  BenchResult fwd{c.op, c.name, "fwd", 0, c.bytes[0], c.byte_model[0], 0, 0, ""};
  DETDIT_RETURN_IF_ERROR(time_calls(context, warmup, repeats, [&] { return cases::run(c, cases::Phase::kForward, *t); },
                                    &fwd.median_seconds));
  std::vector<BenchResult> timed = {fwd};
  if (backward) {
    BenchResult bwd{c.op, c.name, "bwd", 0, c.bytes[1], c.byte_model[1], 0, 0, ""};
    DETDIT_RETURN_IF_ERROR(time_calls(context, warmup, repeats,
                                      [&] { return cases::run(c, cases::Phase::kBackward, *t); }, &bwd.median_seconds));
    BenchResult both{c.op, c.name, "fwd+bwd", 0, c.bytes[0] + c.bytes[1], "fwd + bwd floors", 0, 0, ""};
    DETDIT_RETURN_IF_ERROR(time_calls(context, warmup, repeats, [&] {
      DETDIT_RETURN_IF_ERROR(cases::run(c, cases::Phase::kForward, *t));
      return cases::run(c, cases::Phase::kBackward, *t);
    }, &both.median_seconds));
    timed.push_back(bwd);
    timed.push_back(both);
  }
  DETDIT_RETURN_IF_ERROR(cases::download_outputs(c, *t, &got));
  t.reset();
  auto reference = std::make_unique<cases::Instance>();
  DETDIT_RETURN_IF_ERROR(cases::instantiate(c, Device::cpu(), nullptr, reference.get(), &inputs));
  inputs.clear();
  DETDIT_RETURN_IF_ERROR(cases::run(c, cases::Phase::kForward, *reference));
  if (backward) DETDIT_RETURN_IF_ERROR(cases::run(c, cases::Phase::kBackward, *reference));
  DETDIT_RETURN_IF_ERROR(cases::download_outputs(c, *reference, &expected));
  reference.reset();
  const std::vector<cases::OutputReport> forward_reports = cases::compare_outputs(c, cases::Phase::kForward, expected, got);
  count_wrong(forward_reports, &timed[0]);
  if (backward) {
    const std::vector<cases::OutputReport> backward_reports =
        cases::compare_outputs(c, cases::Phase::kBackward, expected, got);
    count_wrong(backward_reports, &timed[1]);
    count_wrong(forward_reports, &timed[2]);
    count_wrong(backward_reports, &timed[2]);
  }
  results->insert(results->end(), timed.begin(), timed.end());
  return Status::ok_status();
}

double metric(const ParallelBenchResult& r, const std::string& name) {
  for (const auto& [key, values] : r.metrics) {
    if (key == name && values.size() == 1) return values[0];
  }
  return std::nan("");
}

void print_parallel(const std::vector<ParallelBenchResult>& results, const std::vector<ParallelTarget>& targets,
                    const std::string& how, bool predicted, const Device& device, bool csv) {
  if (!csv) {
    std::printf("\nparallel regions (%s); time = slowest rank's median%s\n", how.c_str(),
                predicted ? "; a world 'N p' is predicted: the slowest rank alone + the link model's time, not "
                            "checked (#wrong n/a); #wrong of the others vs WS1 on the same device"
                          : "; #wrong vs WS1 on the same device");
    std::printf("%-20s %-22s %-8s %-5s %12s %9s %14s %10s\n", "op", "case", "phase", "world", "median us",
                "vs WS1", "bytes/rank", "#wrong");
  }
  for (const ParallelBenchResult& r : results) {
    const std::string world = r.ws1 ? "WS1" : std::to_string(r.world) + (r.predicted ? " p" : "");
    const std::string name = r.name + " " + r.phase + " " + (r.ws1 ? "WS1" : "ws=" + world);
    if (!r.error.empty()) {
      if (csv) {
        std::printf("%s,%s,%s,,,,,,,\"%s\"\n", r.op.c_str(), name.c_str(), device.to_string().c_str(), r.error.c_str());
      } else {
        std::printf("%-20s %-22s %-8s %-5s ERROR %s\n", r.op.c_str(), r.name.c_str(), r.phase.c_str(), world.c_str(),
                    r.error.c_str());
      }
      continue;
    }
    const double bytes = metric(r, "bytes_sent_per_rank");
    // A prediction's #wrong is n/a: its ranks never received their peers' values.
    const std::string wrong = r.predicted ? "n/a" : std::to_string(static_cast<long long>(r.wrong));
    const std::string compared = r.predicted ? "n/a" : std::to_string(static_cast<long long>(r.compared));
    if (csv) {
      std::printf("%s,%s,%s,%.3f,%s,,,%s,%s,\n", r.op.c_str(), (name + (r.predicted ? " predicted" : "")).c_str(),
                  device.to_string().c_str(), r.median_seconds * 1e6,
                  std::isnan(bytes) ? "" : std::to_string(static_cast<long long>(bytes)).c_str(), wrong.c_str(),
                  compared.c_str());
    } else {
      std::printf("%-20s %-22s %-8s %-5s %12.1f %8.2fx %14.0f %10s\n", r.op.c_str(), r.name.c_str(),
                  r.phase.c_str(), world.c_str(), r.median_seconds * 1e6, r.ws1_median_seconds / r.median_seconds,
                  std::isnan(bytes) ? 0.0 : bytes, wrong.c_str());
    }
  }
  if (csv) return;
  for (const ParallelBenchResult& r : results) {  // a prediction of a measured world, against it
    const double measured = metric(r, "measured_us"), error = metric(r, "prediction_error_percent");
    if (r.predicted && !std::isnan(measured))
      std::printf("prediction of %s %s %s at world %d: %.1f us, measured %.1f us (%+.1f %%)\n", r.op.c_str(),
                  r.name.c_str(), r.phase.c_str(), r.world, r.median_seconds * 1e6, measured, error);
  }
  for (const ParallelTarget& t : targets) {
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

Status time_calls(const BenchContext& context, int warmup, int repeats, const std::function<Status()>& call,
                  double* median_seconds) {
  std::unique_ptr<BenchTimer> timer;
  DETDIT_RETURN_IF_ERROR(make_bench_timer(context, &timer));
  std::vector<double> times;
  for (int i = 0; i < warmup + repeats; ++i) {
    double seconds = 0;
    DETDIT_RETURN_IF_ERROR(timer->start());
    DETDIT_RETURN_IF_ERROR(call());
    DETDIT_RETURN_IF_ERROR(timer->stop(&seconds));
    if (i >= warmup) times.push_back(seconds);
  }
  std::sort(times.begin(), times.end());
  *median_seconds = times[times.size() / 2];
  return Status::ok_status();
}

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
  const bool quick = args.has("--quick");
  int64_t repeats = 0, warmup = 0;
  uint64_t seed = 0;
  if (!args.get_int("--repeats", quick ? 5 : 20, 1, 100000, &repeats) ||
      !args.get_int("--warmup", quick ? 1 : 3, 0, 100000, &warmup) || !args.get_uint64("--seed", 0, &seed)) {
    std::fprintf(stderr, "detdit: %s\n", args.error().c_str());
    return 2;
  }
  const std::string format = args.get("--format", "table");
  if (format != "table" && format != "csv" && format != "json") {
    std::fprintf(stderr, "detdit: --format must be table, csv or json, got '%s'\n", format.c_str());
    return 2;
  }
  const std::string out_path = args.get("--out", "");
  if (args.has("--out") && out_path.empty()) {
    std::fprintf(stderr, "detdit: --out needs a file name, got an empty one\n");
    return 2;
  }
  if (args.has("--list")) {
    // The cases at the H3 shape (the weights' dimensions name them at run time).
    cases::CaseContext h3;
    for (const cases::OpCase& c : cases::op_cases("", cases::Suite::kBench, h3))
      std::printf("%-20s %-36s %s\n", c.op.c_str(), c.name.c_str(), c.has(cases::Phase::kBackward) ? "fwd bwd fwd+bwd" : "fwd");
    std::printf("%-20s %-24s %s\n", "sp_region", "S=32768|131072 block|interleaved", "cuda mpi (cpu: S=4097 with --ops)");
    std::printf("%-20s %-24s %s\n", "tp_adaln_projection", "T=1|4", "cuda mpi (cpu: T=4 with --ops)");
    return 0;
  }
  const std::string comm_name = args.get("--comm", "inprocess");
  if (comm_name != "inprocess" && comm_name != "mpi") {
    std::fprintf(stderr, "detdit: --comm must be inprocess or mpi, got '%s'\n", comm_name.c_str());
    return 2;
  }
  LinkModel link;
  double link_gbps = 0, link_latency_us = 0;
  if (!args.get_positive("--link-gbps", 360, &link_gbps) || !args.get_positive("--link-latency-us", 10, &link_latency_us)) {
    std::fprintf(stderr, "detdit: %s\n", args.error().c_str());
    return 2;
  }
  if (!args.has("--predict-world") && (args.has("--link-gbps") || args.has("--link-latency-us"))) {
    std::fprintf(stderr, "detdit: --link-gbps and --link-latency-us are the model of --predict-world, which is not given\n");
    return 2;
  }
  if (args.has("--predict-world")) {
    std::vector<int64_t> worlds;
    if (!args.get_int_list("--predict-world", "", 2, 1024, "world size", &worlds)) {
      std::fprintf(stderr, "detdit: %s\n", args.error().c_str());
      return 2;
    }
    for (int64_t world : worlds) link.worlds.push_back(static_cast<int>(world));
    std::sort(link.worlds.begin(), link.worlds.end());
    link.bus_bytes_per_second = link_gbps * 1e9;
    link.latency_seconds = link_latency_us * 1e-6;
    // Under --comm mpi the figures not given are measured on the MPI world (below).
    const bool measured = comm_name == "mpi";
    link.source = std::string(args.has("--link-gbps") ? "bandwidth given (--link-gbps)"
                              : measured ? "bandwidth measured"
                                         : "bandwidth assumed (the order of NCCL all-gather bus bandwidth "
                                           "on 8 x H100 over NVLink4)") +
                  (args.has("--link-latency-us") ? ", latency given (--link-latency-us)"
                   : measured                     ? ", latency measured"
                                                  : ", latency assumed");
    if (!measured) link.source += "; neither measured on this machine";
  }
  const int gpus = cuda_device_count();
  const std::string device_name = args.get("--device", gpus > 0 ? "cuda" : "cpu");
  if (device_name != "cpu" && device_name != "cuda") {
    std::fprintf(stderr, "detdit: --device must be cpu or cuda, got '%s'\n", device_name.c_str());
    return 2;
  }
  if (device_name == "cuda" && gpus == 0) {
    std::fprintf(stderr, "detdit: --device cuda: no usable CUDA device (or a CPU-only build)\n");
    return 2;
  }
  BenchContext context;
  context.device = device_name == "cuda" ? Device::cuda(0) : Device::cpu();
  context.quick = quick;
  context.seed = seed;
  if (!link.worlds.empty()) context.predict = &link;
  // --comm mpi: one rank per process on GPU local rank % count. The NCCL call check
  // (a host synchronisation per collective) is off for timing: every rank
  // runs the same calls.
  std::unique_ptr<Communicator> world;
  if (comm_name == "mpi") {
    NcclOptions nccl;
    nccl.check_calls = false;
    Status opened = open_mpi_world(context.device.is_cuda(), &world, &context.device, nccl);
    if (!opened.ok()) {
      std::fprintf(stderr, "detdit: --comm mpi: %s\n", opened.to_string().c_str());
      return 2;
    }
    if (context.predict != nullptr && (!args.has("--link-gbps") || !args.has("--link-latency-us"))) {
      LinkModel measured;
      const Status s = measure_link(context, *world, 2, 5, &measured);
      if (!s.ok()) {
        std::fprintf(stderr, "detdit: measuring the link of --comm mpi: %s\n", s.to_string().c_str());
        return 2;
      }
      if (!args.has("--link-gbps")) link.bus_bytes_per_second = measured.bus_bytes_per_second;
      if (!args.has("--link-latency-us")) link.latency_seconds = measured.latency_seconds;
      link.source += " over " + std::string(world->backend_id()) + " between " + std::to_string(world->world_size()) +
                     " ranks";
    }
  }
  const bool leader = world == nullptr || world->rank() == 0;
  std::set<std::string> ops, names;
  if (!args.get_set("--ops", &ops) || !args.get_set("--cases", &names)) {
    std::fprintf(stderr, "detdit: %s\n", args.error().c_str());
    return 2;
  }
  const std::vector<std::string> case_ops = cases::case_ops();
  bool any_op_case = false;
  for (const std::string& op : case_ops) any_op_case = any_op_case || ops.empty() || ops.count(op) > 0;
  if (world != nullptr) any_op_case = false;  // under mpirun only the parallel regions run
  // The parallel ops: by default on a GPU; on the CPU only when --ops names one.
  std::set<std::string> parallel_ops;
  for (const std::string& op : ops) {
    if (is_parallel_op(op)) parallel_ops.insert(op);
  }
  const bool parallel = world != nullptr || !parallel_ops.empty() || (ops.empty() && context.device.is_cuda());
  if (context.predict != nullptr && !parallel) {
    std::fprintf(stderr, "detdit: --predict-world predicts the parallel regions, and none runs here (on --device cpu "
                         "name them with --ops sp_region,tp_adaln_projection)\n");
    return 2;
  }
  if (!any_op_case && !parallel) {
    std::fprintf(stderr, "detdit: no bench case matches --device %s%s%s (detdit bench --list shows them)\n",
                 device_name.c_str(), ops.empty() ? "" : " --ops", names.empty() ? "" : " --cases");
    return 2;
  }
  Weights weights;
  // The report's destination first (one that cannot be replaced is refused
  // before the run, not after it); then under MPI rank 0 resolves (and on
  // first use generates) the cache first.
  Status status = leader && !out_path.empty() ? io::check_replaceable(out_path) : Status::ok_status();
  if (leader && status.ok())
    status = io::resolve_weights(args.get("--weights"), io::ManifestConfig(), 0, /*announce=*/true, &weights);
  if (world != nullptr) {
    status = all_ranks_ok(*world, status);
    if (status.ok() && !leader) {
      status = io::resolve_weights(args.get("--weights"), io::ManifestConfig(), 0, false, &weights);
      // A rank whose own resolve failed says why; rank 0 reports the rest.
      if (!status.ok()) std::fprintf(stderr, "detdit: rank %d: %s\n", world->rank(), status.to_string().c_str());
    }
    status = all_ranks_ok(*world, status);
  }
  if (!status.ok()) {
    if (leader) std::fprintf(stderr, "detdit: %s\n", status.to_string().c_str());
    return 2;
  }
  context.weights = &weights;

  double copy_bandwidth = 0;
  status = measure_copy_bandwidth(context, std::size_t(quick ? 64 : 256) << 20, quick ? 3 : 7, &copy_bandwidth);
  if (!status.ok()) {
    std::fprintf(stderr, "detdit: copy baseline: %s\n", status.to_string().c_str());
    return 2;
  }
  // The benchmark sizes: the smallest only with --quick or on the CPU.
  cases::CaseContext case_context_of_run = case_context(weights, quick, seed);
  case_context_of_run.small = quick || !context.device.is_cuda();
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
    if (leader)
      std::fprintf(stderr, "detdit: --cases: no case named '%s' on --device %s%s (detdit bench --list shows them)\n",
                   unmatched.begin()->c_str(), device_name.c_str(), ops.empty() ? "" : " for --ops");
    return 2;
  }
  std::vector<BenchResult> results;
  // Progress on stderr (the report waits for the last case): a large case
  // takes seconds, most of it the CPU reference.
  Progress progress("detdit bench", selected.size() + (parallel ? parallel_bench_count(context, parallel_ops, names) : 0),
                    leader);
  for (const cases::OpCase& c : selected) {
    const std::size_t before = results.size();
    progress.started(c.full_name());
    Status s = bench_op_case(c, context, static_cast<int>(warmup), static_cast<int>(repeats), &results);
    if (!s.ok()) {
      results.resize(before);
      results.push_back(BenchResult{c.op, c.name, "", 0, 0, "", 0, 0, s.to_string()});
    }
    progress.finished(c.full_name(), s.ok() ? "" : "error");
  }
  std::vector<ParallelBenchResult> parallel_results;
  if (parallel) {
    Status s = run_parallel_bench(context, world.get(), static_cast<int>(warmup), static_cast<int>(repeats),
                                  parallel_ops, names, &progress, &parallel_results);
    if (!s.ok()) {
      ParallelBenchResult failed;
      failed.op = "parallel";
      failed.error = s.to_string();
      parallel_results.push_back(failed);
    }
  }
  progress.clear();

  bool all_right = true;
  for (const BenchResult& r : results) all_right = all_right && r.error.empty() && r.wrong == 0 && r.compared > 0;
  for (const ParallelBenchResult& r : parallel_results) {
    all_right = all_right && r.error.empty() && r.wrong == 0 && (r.ws1 || r.predicted || r.compared > 0);
  }
  if (!leader) return all_right ? 0 : 1;  // rank 0 reports for every rank
  char link_text[96];
  std::snprintf(link_text, sizeof link_text, "%g GB/s bus bandwidth, %g us per collective",
                link.bus_bytes_per_second / 1e9, link.latency_seconds * 1e6);
  const std::string prediction_how =
      "PREDICTION, not a measurement: each rank's share timed alone on " + context.device.to_string() +
      ", plus a link model (" + link_text + "; " + link.source + "); not checked against WS1";
  const std::string parallel_how =
      world != nullptr ? std::to_string(world->world_size()) + " processes, one " + context.device.to_string() +
                             " each, over " + world->backend_id() +
                             (context.predict != nullptr ? "; the other world sizes a " + prediction_how : "")
      : context.predict != nullptr ? prediction_how
                                   : "SIMULATION: in-process ranks sharing " + context.device.to_string() +
                                         " (they compete for it; not a multi-GPU measurement)";
  std::vector<ParallelTarget> targets = parallel_targets(parallel_results);
  for (ParallelTarget& t : targets) {  // a target this run did not reach still says what kind of run it was
    if (!std::isnan(t.measured_speedup)) continue;
    t.simulated = world == nullptr && context.predict == nullptr;
    t.predicted = world == nullptr && context.predict != nullptr;
  }
  const Environment env = collect_environment(context.device);
  auto gbps = [](const BenchResult& r) { return r.bytes / r.median_seconds / 1e9; };
  if (format == "json" || !out_path.empty()) {
    nlohmann::ordered_json out;
    out["kind"] = "detdit_bench_report";
    out["format_version"] = 2;
    record_environment(env, &out);
    out["options"] = {{"repeats", repeats}, {"warmup", warmup}, {"quick", quick}, {"seed", seed}};
    out["copy_gbps"] = copy_bandwidth / 1e9;
    out["cases"] = nlohmann::ordered_json::array();
    for (const BenchResult& r : results) {
      nlohmann::ordered_json j = {
          {"op", r.op}, {"case", r.name}, {"phase", r.phase}, {"device", context.device.to_string()}};
      if (!r.error.empty()) {
        j["error"] = r.error;
      } else {
        j["median_us"] = r.median_seconds * 1e6;
        j["bytes"] = r.bytes;
        j["byte_model"] = r.byte_model;
        j["gbps"] = gbps(r);
        j["percent_of_copy"] = 100.0 * r.bytes / r.median_seconds / copy_bandwidth;
        j["wrong"] = r.wrong;
        j["compared"] = r.compared;
      }
      out["cases"].push_back(j);
    }
    if (parallel) {
      nlohmann::ordered_json p;
      p["how"] = parallel_how;
      p["comm"] = world != nullptr ? world->backend_id() : context.predict != nullptr ? "prediction" : "in_process";
      p["world_size"] = world != nullptr ? world->world_size() : 1;
      p["simulated"] = world == nullptr && context.predict == nullptr;
      p["predicted"] = context.predict != nullptr;
      if (context.predict != nullptr)
        p["link_model"] = {{"bus_gbps", link.bus_bytes_per_second / 1e9},
                           {"latency_us", link.latency_seconds * 1e6},
                           {"source", link.source}};
      p["nccl_check_calls"] = false;
      p["wrong_vs"] = context.predict != nullptr && world == nullptr ? nlohmann::ordered_json(nullptr)
                                                                      : "WS1 on the same device";
      p["results"] = nlohmann::ordered_json::array();
      for (const ParallelBenchResult& r : parallel_results) {
        nlohmann::ordered_json j = {{"op", r.op}, {"case", r.name}, {"phase", r.phase}, {"world", r.world},
                                    {"ws1", r.ws1}, {"predicted", r.predicted}};
        if (!r.error.empty()) {
          j["error"] = r.error;
        } else {
          j["median_us"] = r.median_seconds * 1e6;
          j["rank_median_us"] = nlohmann::ordered_json::array();
          for (double m : r.rank_medians) j["rank_median_us"].push_back(m * 1e6);
          j["ws1_median_us"] = r.ws1_median_seconds * 1e6;
          j["speedup_vs_ws1"] = r.ws1_median_seconds / r.median_seconds;
          for (const auto& [name, values] : r.metrics) {
            j[name] = values.size() == 1 ? nlohmann::ordered_json(values[0]) : nlohmann::ordered_json(values);
          }
          // a prediction is not checked: null, not zero
          j["wrong"] = r.predicted ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(r.wrong);
          j["compared"] = r.predicted ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(r.compared);
        }
        p["results"].push_back(j);
      }
      p["targets"] = nlohmann::ordered_json::array();
      for (const ParallelTarget& t : targets) {
        const bool measured = !std::isnan(t.measured_speedup);
        p["targets"].push_back({{"target", t.target},
                                {"required_speedup", t.required_speedup},
                                {"measured_speedup", measured ? nlohmann::ordered_json(t.measured_speedup) : nullptr},
                                {"met", measured ? nlohmann::ordered_json(t.measured_speedup >= t.required_speedup)
                                                 : nullptr},
                                {"simulated", t.simulated},
                                {"predicted", t.predicted}});
      }
      out["parallel"] = p;
    }
    if (format == "json") std::printf("%s\n", out.dump(2).c_str());
    if (!out_path.empty()) {
      const Status written = io::write_file_atomically(out_path, out.dump(2) + "\n");
      if (!written.ok()) {
        std::fprintf(stderr, "detdit: %s\n", written.to_string().c_str());
        return 2;
      }
    }
  }
  if (format != "json") {
    const bool csv = format == "csv";
    if (csv) {
      std::printf("op,case,phase,device,median_us,bytes,gbps,percent_of_copy,wrong,compared,error\n");
    } else {
      std::printf("copy bandwidth %.1f GB/s (%s, measured now); commit %.12s%s\n", copy_bandwidth / 1e9,
                  env.device_name.c_str(), env.commit.c_str(), env.dirty ? " (dirty)" : "");
      if (!results.empty()) {
        std::printf("%-18s %-36s %-7s %11s %13s %8s %8s %8s\n", "op", "case", "phase", "median us", "bytes floor",
                    "GB/s", "% copy", "#wrong");
      }
    }
    for (const BenchResult& r : results) {
      if (!r.error.empty()) {
        if (csv) {
          std::printf("%s,%s,%s,%s,,,,,,,\"%s\"\n", r.op.c_str(), r.name.c_str(), r.phase.c_str(),
                      context.device.to_string().c_str(), r.error.c_str());
        } else {
          std::printf("%-18s %-36s %-7s ERROR %s\n", r.op.c_str(), r.name.c_str(), r.phase.c_str(), r.error.c_str());
        }
        continue;
      }
      const double percent = 100.0 * r.bytes / r.median_seconds / copy_bandwidth;
      if (csv) {
        std::printf("%s,%s,%s,%s,%.3f,%.0f,%.3f,%.2f,%lld,%lld,\n", r.op.c_str(), r.name.c_str(), r.phase.c_str(),
                    context.device.to_string().c_str(), r.median_seconds * 1e6, r.bytes, gbps(r), percent,
                    static_cast<long long>(r.wrong), static_cast<long long>(r.compared));
      } else {
        std::printf("%-18s %-36s %-7s %11.1f %13.0f %8.1f %7.1f%% %8lld\n", r.op.c_str(), r.name.c_str(),
                    r.phase.c_str(), r.median_seconds * 1e6, r.bytes, gbps(r), percent,
                    static_cast<long long>(r.wrong));
      }
    }
    if (parallel) print_parallel(parallel_results, targets, parallel_how, context.predict != nullptr, context.device, csv);
  }
  return all_right ? 0 : 1;
}

}  // namespace cli
}  // namespace detdit
