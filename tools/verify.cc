// detdit verify: runs every registered verify case for one device, prints a
// table and a one-line verdict, and writes a JSON report (and an SVG figure).
// Exit code 0 when every check passes, 1 when one fails, 2 on usage or input
// errors (bad options, unreadable weights).
#include "verify.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <cstdlib>
#include <set>

#include "args.h"
#include "cli.h"
#include "environment.h"
#include "io/files.h"
#include "io/manifest.h"
#include "parallel_common.h"
#include "progress.h"

namespace detdit {
namespace cli {
namespace {

using Json = nlohmann::ordered_json;

// The dimensions of `detdit verify`'s synthetic default without --full: the
// H3 tensors and ratios (Ht = H, D = H / 2, F = 256) at H = 1536 (Wan 2.1
// 1.3B's and SD3 Medium's hidden size), so that the default run fits three
// minutes on 2 CPU cores. --full, `detdit bench` and `detdit weights synth`
// use H3's dimensions (ManifestConfig's defaults).
io::ManifestConfig verify_dimensions(int64_t blocks) {
  io::ManifestConfig c;
  c.blocks = blocks;
  c.hidden = 1536;
  c.time_embed_hidden = 1536;
  c.time_embed_dim = 768;
  c.freq_dim = 256;
  return c;
}

// Report order: the conditioning path from the timestep to the output.
const char* const kOpOrder[] = {"weights",         "timestep_sinusoid", "linear",          "timestep_mlp",
                                "adaln_projection", "adaln_row_gather", "rmsnorm",         "gate_residual",
                                "final_adaln_out",  "adaln_modulation", "chain",           "sp_region",
                                "tp_adaln_projection"};

int op_rank(const std::string& op) {
  int i = 0;
  for (const char* name : kOpOrder) {
    if (op == name) return i;
    ++i;
  }
  return i;
}

Json number_or_null(double v) { return std::isnan(v) ? Json(nullptr) : Json(v); }

std::string format_error(double v) {
  if (std::isnan(v)) return "-";
  char text[32];
  std::snprintf(text, sizeof text, v == 0 ? "0" : "%.2e", v);
  return text;
}

struct CaseResult {
  std::string op, name;
  std::vector<CheckRow> rows;
  double seconds = 0;
};

// The table fits kTableWidth columns: a line per case (op / case, its time
// and the unit of its errors), then a line per check; informational and
// failure details after the table, wrapped. Check names longer than their
// column are cut with "..." (the JSON report keeps every name whole).
constexpr std::size_t kTableWidth = 120;

std::string cut(const std::string& text, std::size_t width) {
  return text.size() <= width ? text : text.substr(0, width - 3) + "...";
}

// `head` then `text` in lines of at most kTableWidth, continuation lines indented.
void print_wrapped(const std::string& head, const std::string& text) {
  std::string line = head;
  std::size_t at = 0;
  while (at < text.size()) {
    const std::size_t room = kTableWidth > line.size() ? kTableWidth - line.size() : 1;
    std::size_t take = std::min(room, text.size() - at);
    if (at + take < text.size()) {
      const std::size_t space = text.rfind(' ', at + take);
      if (space != std::string::npos && space > at) take = space - at;
    }
    line += text.substr(at, take);
    std::printf("%s\n", line.c_str());
    at += take;
    while (at < text.size() && text[at] == ' ') ++at;
    line = "      ";
  }
  if (text.empty()) std::printf("%s\n", line.c_str());
}

void print_table(const std::vector<CaseResult>& results) {
  struct Line {
    std::string check, bitwise, error, bound, seconds, result;
  };
  const Line header{"check", "bitwise", "max err", "bound", "s", "result"};
  std::vector<std::vector<Line>> lines(results.size());
  std::size_t w[6] = {0};
  auto widen = [&w](const Line& l) {
    const std::string* f[6] = {&l.check, &l.bitwise, &l.error, &l.bound, &l.seconds, &l.result};
    for (int i = 0; i < 6; ++i) w[i] = std::max(w[i], f[i]->size());
  };
  widen(header);
  for (std::size_t i = 0; i < results.size(); ++i) {
    for (const CheckRow& row : results[i].rows) {
      char seconds[32];
      std::snprintf(seconds, sizeof seconds, "%.2f", row.seconds);
      lines[i].push_back({row.check,
                          row.bitwise_run ? std::to_string(row.bitwise_passed) + "/" + std::to_string(row.bitwise_run)
                                          : "-",
                          format_error(row.max_error), format_error(row.bound), seconds,
                          row.skipped ? "skip" : !row.pass ? "FAIL" : row.informational ? "info" : "ok"});
      widen(lines[i].back());
    }
  }
  // Indent 2, five gaps of 2 between the six columns.
  const std::size_t others = 2 + w[1] + w[2] + w[3] + w[4] + w[5] + 5 * 2;
  w[0] = std::min(w[0], kTableWidth > others + 16 ? kTableWidth - others : std::size_t{16});
  auto print_line = [&w](const Line& l) {
    std::printf("  %-*s  %*s  %*s  %*s  %*s  %s\n", int(w[0]), cut(l.check, w[0]).c_str(), int(w[1]),
                l.bitwise.c_str(), int(w[2]), l.error.c_str(), int(w[3]), l.bound.c_str(), int(w[4]),
                l.seconds.c_str(), l.result.c_str());
  };
  print_line(header);
  for (std::size_t i = 0; i < results.size(); ++i) {
    const CaseResult& r = results[i];
    std::vector<std::string> units;
    for (const CheckRow& row : r.rows) {
      if (!row.error_unit.empty() && std::find(units.begin(), units.end(), row.error_unit) == units.end())
        units.push_back(row.error_unit);
    }
    std::string head = r.op + " / " + r.name;
    char seconds[32];
    std::snprintf(seconds, sizeof seconds, " (%.2f s", r.seconds);
    head += seconds;
    for (std::size_t u = 0; u < units.size(); ++u) head += (u == 0 ? "; max err unit: " : ", ") + units[u];
    std::printf("%s\n", cut(head + ")", kTableWidth).c_str());
    for (const Line& l : lines[i]) print_line(l);
  }
  for (const CaseResult& r : results) {
    for (const CheckRow& row : r.rows) {
      if (row.pass && row.informational && !row.detail.empty()) {
        print_wrapped("info " + r.op + " / " + r.name + " / " + row.check + ": ", row.detail);
      }
    }
  }
  // Skipped cells (verify --matrix): one line per case, its rows and their reason.
  for (const CaseResult& r : results) {
    std::string checks, reason;
    for (const CheckRow& row : r.rows) {
      if (!row.skipped) continue;
      checks += (checks.empty() ? "" : ", ") + row.check;
      reason = row.detail;
    }
    if (!checks.empty()) print_wrapped("skip " + r.op + " / " + r.name + " (" + checks + "): ", reason);
  }
  for (const CaseResult& r : results) {
    for (const CheckRow& row : r.rows) {
      if (!row.pass && !row.skipped && !row.detail.empty()) {
        print_wrapped("FAIL " + r.op + " / " + r.name + " / " + row.check + ": ", row.detail);
      }
    }
  }
}

// The matrix's cells: every row of every group at its coordinates, with its
// result ("pass", "fail", "skipped" or "info"), and what it does not enumerate.
Json matrix_json(const std::vector<MatrixGroup>& groups, const Device& device, const MatrixOptions& options) {
  auto coordinate = [](int64_t v) { return v < 0 ? Json(nullptr) : Json(v); };
  Json cells = Json::array();
  int64_t counts[4] = {0, 0, 0, 0};  // pass, fail, skipped, info
  for (const MatrixGroup& g : groups) {
    for (std::size_t i = 0; i < g.rows.size(); ++i) {
      const CheckRow& row = g.rows[i];
      const int result = row.skipped ? 2 : !row.pass ? 1 : row.informational ? 3 : 0;
      ++counts[result];
      cells.push_back({{"op", g.op},
                       {"case", g.name},
                       {"check", row.check},
                       {"device", device.to_string()},
                       {"profile", g.profile},
                       {"world", i < g.worlds.size() && g.worlds[i] > 0 ? Json(g.worlds[i]) : Json(nullptr)},
                       {"packing", g.packing.empty() ? Json(nullptr) : Json(g.packing)},
                       {"batch", coordinate(g.batch)},
                       {"seq_len", coordinate(g.seq_len)},
                       {"timesteps", coordinate(g.timesteps)},
                       {"result", result == 0 ? "pass" : result == 1 ? "fail" : result == 2 ? "skipped" : "info"},
                       {"bitwise_run", row.bitwise_run},
                       {"bitwise_passed", row.bitwise_passed},
                       {"seconds", row.seconds},
                       {"detail", row.detail}});
    }
  }
  Json notes = Json::array();
  for (const cases::MatrixNote& note : cases::matrix_not_enumerated(device)) notes.push_back({{"what", note.what}, {"reason", note.reason}});
  Json out = {{"coordinates", {"op", "device", "profile", "world", "packing", "batch", "seq_len", "timesteps"}},
              {"counts", {{"pass", counts[0]}, {"fail", counts[1]}, {"skipped", counts[2]}, {"info", counts[3]}}},
              {"budget_elements", options.budget},
              {"cells", cells},
              {"not_enumerated", notes}};
  if (!options.corrupt.empty()) out["test_corrupted_op"] = options.corrupt;
  return out;
}

}  // namespace

int run_verify(int argc, char** argv) {
  Args args("detdit verify [--quick | --full] [--device cpu|cuda] [--weights DIR] [--out REPORT.json] [--matrix]",
            "Runs the conditioning ops on the weights (default: cached synthetic weights of the H3 tensors\n"
            "at H = 1536, or at H3's own dimensions with --full; docs/weights.md) and checks every bitwise claim (repeatability, row invariance, CPU = CUDA)\n"
            "and accuracy bar against an FP64 oracle. Prints a table and a verdict.\n"
            "Exit 0: every check passes; 1: a check fails; 2: usage or input error.");
  args.flag("--quick", "smaller sweeps (under a minute on 2 CPU cores)");
  args.flag("--full",
            "the synthetic default at H3's dimensions (H = 5376) and the sp_region at S = 32768 too\n"
            "(about 3 minutes on 2 CPU cores)");
  args.option("--device", "cpu|cuda", "where the ops run", "cuda when a GPU is present, else cpu");
  args.option("--weights", "DIR", "weights directory or file", "synthetic, cached");
  args.option("--blocks", "N", "blocks of the synthetic default", "1");
  args.option("--seed", "N", "seed of the synthetic default and of the inputs", "0");
  args.option("--ops", "LIST", "comma-separated ops to run (e.g. rmsnorm,gate_residual)", "all");
  args.option("--comm", "inprocess|mpi",
              "parallel ranks as threads of this process, or one per process under mpirun (then only the\n"
              "sp_region and tp_adaln_projection cases run; NCCL on --device cuda)",
              "inprocess");
  args.option("--out", "FILE", "write the JSON report here");
  args.option("--figure", "FILE", "write the SVG figure here (as detdit report does)");
  args.flag("--list", "list the registered cases and exit");
  args.flag("--matrix",
            "instead of the cases: the byte-equality matrix (every op case, the sp_region's ops x both\n"
            "packings x B = 1, 2 x --seq x --worlds, tp_adaln_projection x --worlds; docs/cli.md)");
  args.option("--seq", "LIST", "--matrix: the sp_region's sequence lengths", "4097,32768,131072; --quick: 4097");
  args.option("--worlds", "LIST", "--matrix: the world sizes", "1,2,...,8; --quick: 1,2,3,8");
  args.option("--matrix-budget", "N",
              "--matrix: list as skipped the cells whose largest tensor exceeds N elements (0: none)",
              "CPU 44048384, CUDA 0");
  int code = parse_or_exit_code(&args, argc, argv, 1);
  if (code >= 0) return code;
  int64_t blocks = 1;
  uint64_t seed = 0;
  if (!args.get_int("--blocks", 1, 1, 1000, &blocks) || !args.get_uint64("--seed", 0, &seed)) {
    std::fprintf(stderr, "detdit: %s\n", args.error().c_str());
    return 2;
  }
  if (args.has("--quick") && args.has("--full")) {
    std::fprintf(stderr, "detdit: --quick and --full exclude each other\n");
    return 2;
  }
  const bool full = args.has("--full");
  io::ManifestConfig dimensions = full ? io::ManifestConfig() : verify_dimensions(blocks);
  dimensions.blocks = blocks;

  std::vector<VerifyCase> cases = verify_registry();
  // Within an op, registration order (a file registers its sizes ascending).
  std::stable_sort(cases.begin(), cases.end(), [](const VerifyCase& a, const VerifyCase& b) {
    if (op_rank(a.op) != op_rank(b.op)) return op_rank(a.op) < op_rank(b.op);
    return std::string(a.op) < b.op;
  });
  if (args.has("--list")) {
    for (const VerifyCase& c : cases) {
      std::printf("%-20s %-32s %s%s%s\n", c.op, c.name, c.cpu ? "cpu " : "", c.cuda ? "cuda " : "",
                  c.comm ? "mpi" : "");
    }
    return 0;
  }
  const std::string comm_name = args.get("--comm", "inprocess");
  if (comm_name != "inprocess" && comm_name != "mpi") {
    std::fprintf(stderr, "detdit: --comm must be inprocess or mpi, got '%s'\n", comm_name.c_str());
    return 2;
  }
  const bool matrix = args.has("--matrix");
  MatrixOptions matrix_options;
  if (matrix && comm_name != "inprocess") {
    std::fprintf(stderr, "detdit: --matrix runs its ranks in-process (without --comm mpi)\n");
    return 2;
  }
  for (const char* option : {"--seq", "--worlds", "--matrix-budget"}) {
    if (!matrix && args.has(option)) {
      std::fprintf(stderr, "detdit: %s applies to --matrix only\n", option);
      return 2;
    }
  }
  if (matrix) {
    const bool quick = args.has("--quick");
    std::vector<int64_t> worlds;
    int64_t budget = 0;
    if (!args.get_int_list("--seq", quick ? "4097" : "4097,32768,131072", 1, int64_t{1} << 24, "sequence length",
                           &matrix_options.seq_lens) ||
        !args.get_int_list("--worlds", quick ? "1,2,3,8" : "1,2,3,4,5,6,7,8", 1, 64, "world size", &worlds) ||
        !args.get_int("--matrix-budget", -1, 0, int64_t{1} << 50, &budget)) {
      if (!args.error().empty()) std::fprintf(stderr, "detdit: %s\n", args.error().c_str());
      return 2;
    }
    for (int64_t w : worlds) matrix_options.worlds.push_back(static_cast<int>(w));
    matrix_options.budget = static_cast<double>(budget);
    if (const char* corrupt = std::getenv("DETDIT_TEST_CORRUPT_CELLS")) matrix_options.corrupt = corrupt;
  }

  Device device;
  std::string error;
  if (!parse_device(args.get("--device"), &device, &error)) {
    std::fprintf(stderr, "detdit: %s\n", error.c_str());
    return 2;
  }
  // --comm mpi: this process is one rank; its device is GPU local rank % count.
  std::unique_ptr<Communicator> world;
  if (comm_name == "mpi") {
    Status opened = open_mpi_world(device.is_cuda(), &world, &device);
    if (!opened.ok()) {
      std::fprintf(stderr, "detdit: --comm mpi: %s\n", opened.to_string().c_str());
      return 2;
    }
  }
  const bool leader = world == nullptr || world->rank() == 0;

  std::set<std::string> wanted_ops;
  if (!args.get_set("--ops", &wanted_ops)) {
    std::fprintf(stderr, "detdit: %s\n", args.error().c_str());
    return 2;
  }
  for (const std::string& op : matrix ? std::set<std::string>() : wanted_ops) {
    bool known = false;
    for (const VerifyCase& c : cases) known = known || op == c.op;
    if (!known) {
      std::fprintf(stderr, "detdit: --ops: no verify case for op '%s' (detdit verify --list shows them)\n",
                   op.c_str());
      return 2;
    }
  }

  Weights weights;
  std::vector<std::string> destinations;
  for (const char* option : {"--out", "--figure"})
    if (args.has(option)) destinations.push_back(args.get(option));
  const Status status = resolve_run_weights(world.get(), destinations, args.get("--weights"), dimensions, seed, &weights);
  if (!status.ok()) {
    if (leader) std::fprintf(stderr, "detdit: %s\n", status.to_string().c_str());
    return 2;
  }

  VerifyContext context;
  context.quick = args.has("--quick");
  context.full = full;
  context.device = device;
  context.weights = &weights;
  context.seed = seed;
  context.comm = world.get();
  if (matrix && matrix_options.budget < 0) matrix_options.budget = device.is_cuda() ? 0 : 2.0 * 4097 * 5376;
  std::vector<const VerifyCase*> selected;
  for (const VerifyCase& c : cases) {
    if (matrix) break;
    const bool on_device = device.is_cuda() ? c.cuda : c.cpu;
    const bool applies = (world == nullptr || c.comm) && (c.enabled == nullptr || c.enabled(context, c.name));
    if (on_device && applies && (wanted_ops.empty() || wanted_ops.count(c.op))) selected.push_back(&c);
  }
  std::vector<CaseResult> results;
  const double start = now_seconds();
  Progress progress("detdit verify", selected.size(), leader);
  for (const VerifyCase* c : selected) {
    const std::string name = std::string(c->op) + " / " + c->name;
    progress.started(name);
    CaseResult r;
    r.op = c->op;
    r.name = c->name;
    const double t0 = now_seconds();
    Status s = c->run ? c->run(context, c->name, &r.rows) : verify_op_cases(context, c->op, &r.rows);
    r.seconds = now_seconds() - t0;
    if (!s.ok()) {
      CheckRow row;
      row.check = "case ran";
      row.seconds = r.seconds;
      row.detail = s.to_string();
      row.pass = false;
      r.rows.push_back(row);
    }
    if (r.rows.empty()) {
      CheckRow row;
      row.check = "case ran";
      row.detail = "the case returned no checks";
      r.rows.push_back(row);
    }
    // An informational row whose measurement failed is a failed check.
    for (CheckRow& row : r.rows) row.informational = row.informational && row.pass;
    if (world != nullptr) {
      Status merged = cases::merge_rank_rows(*world, &r.rows);
      if (!merged.ok()) {
        if (leader) std::fprintf(stderr, "detdit: gathering the ranks' results: %s\n", merged.to_string().c_str());
        return 1;
      }
      r.seconds = r.rows.empty() ? r.seconds : std::max(r.seconds, r.rows.front().seconds);
    }
    int64_t case_checks = 0, case_passed = 0;
    for (const CheckRow& row : r.rows) {
      case_checks += row.informational ? 0 : 1;
      case_passed += !row.informational && row.pass ? 1 : 0;
    }
    progress.finished(name, std::to_string(case_passed) + "/" + std::to_string(case_checks) + " checks " +
                                (case_passed == case_checks ? "ok" : "FAIL"));
    results.push_back(std::move(r));
  }
  progress.clear();
  std::vector<MatrixGroup> groups;
  if (matrix) {
    Status s = run_matrix(context, matrix_options, wanted_ops, leader, &groups);
    if (!s.ok()) {
      std::fprintf(stderr, "detdit: %s\n", s.to_string().c_str());
      return 2;
    }
    for (const MatrixGroup& g : groups) results.push_back({g.op, g.name, g.rows, g.seconds});
  }
  const double total_seconds = now_seconds() - start;

  int64_t checks = 0, passed = 0, skipped = 0;
  for (const CaseResult& r : results) {
    for (const CheckRow& row : r.rows) {
      skipped += row.skipped ? 1 : 0;
      if (row.informational || row.skipped) continue;
      ++checks;
      passed += row.pass ? 1 : 0;
    }
  }
  const bool pass = checks > 0 && passed == checks;
  if (!leader) return pass ? 0 : 1;  // rank 0 reports for every rank
  print_table(results);

  const Environment env = collect_environment(device);
  Json report;
  report["kind"] = "detdit_verify_report";
  // 2: "git" is the commit built (no run-time "build_commit"), "detdit_version" added.
  report["format_version"] = 2;
  report["verdict"] = pass ? "PASS" : "FAIL";
  report["checks_total"] = checks;
  report["checks_passed"] = passed;
  report["seconds"] = total_seconds;
  record_environment(env, &report);
  report["options"] = {{"quick", context.quick},
                       {"full", context.full},
                       {"device", device.to_string()},
                       {"weights", args.get("--weights", "synthetic default")},
                       {"blocks", blocks},
                       {"seed", seed},
                       {"ops", args.get("--ops", "all")},
                       {"comm", world != nullptr ? world->backend_id() : "in_process"},
                       {"world_size", world != nullptr ? world->world_size() : 1}};
  report["weights"] = {{"path", weights.path},
                       {"synthetic", weights.synthetic},
                       {"manifest", io::kManifestVersion},
                       {"blocks", weights.config.blocks},
                       {"hidden", weights.config.hidden},
                       {"time_embed_hidden", weights.config.time_embed_hidden},
                       {"time_embed_dim", weights.config.time_embed_dim},
                       {"freq_dim", weights.config.freq_dim}};
  Json json_cases = Json::array();
  for (const CaseResult& r : results) {
    Json rows = Json::array();
    for (const CheckRow& row : r.rows) {
      rows.push_back({{"check", row.check},
                      {"bitwise_run", row.bitwise_run},
                      {"bitwise_passed", row.bitwise_passed},
                      {"max_error_vs_fp64", number_or_null(row.max_error)},
                      {"bound", number_or_null(row.bound)},
                      {"error_unit", row.error_unit},
                      {"seconds", row.seconds},
                      {"pass", row.pass},
                      {"detail", row.detail}});
      if (row.informational) rows.back()["informational"] = true;
      if (row.skipped) rows.back()["skipped"] = true;
      if (!row.metrics.empty()) {
        Json metrics = Json::object();
        for (const auto& [name, values] : row.metrics) {
          metrics[name] = values.size() == 1 ? Json(values[0]) : Json(values);
        }
        rows.back()["metrics"] = metrics;
      }
    }
    json_cases.push_back({{"op", r.op},
                          {"case", r.name},
                          {"device", device.to_string()},
                          {"seconds", r.seconds},
                          {"checks", rows}});
  }
  report["cases"] = json_cases;
  if (matrix) {
    report["mode"] = "matrix";
    report["options"]["seq"] = matrix_options.seq_lens;
    report["options"]["worlds"] = matrix_options.worlds;
    report["options"]["matrix_budget"] = matrix_options.budget;
    report["matrix"] = matrix_json(groups, device, matrix_options);
  }

  if (args.has("--out")) {
    // A temporary renamed into place: a failed write leaves the previous report or none.
    Status s = io::write_file_atomically(args.get("--out"), report.dump(2) + "\n");
    if (!s.ok()) {
      std::fprintf(stderr, "detdit: %s\n", s.to_string().c_str());
      return 2;
    }
  }
  if (args.has("--figure")) {
    Status s = write_report_svg(nlohmann::json::parse(report.dump()), args.get("--figure"));
    if (!s.ok()) {
      std::fprintf(stderr, "detdit: %s\n", s.to_string().c_str());
      return 2;
    }
  }
  if (matrix) {
    for (const cases::MatrixNote& note : cases::matrix_not_enumerated(device))
      print_wrapped("not in this matrix: " + note.what + ": ", note.reason);
    std::printf("detdit verify --matrix: %s, %lld/%lld cells passed (%s, %.1f s); %lld cells skipped%s\n",
                pass ? "PASS" : "FAIL", static_cast<long long>(passed), static_cast<long long>(checks),
                device.to_string().c_str(), total_seconds, static_cast<long long>(skipped),
                matrix_options.corrupt.empty() ? "" : "; DETDIT_TEST_CORRUPT_CELLS was set");
    return pass ? 0 : 1;
  }
  if (checks == 0) {
    std::printf("detdit verify: FAIL, no checks ran (no case is registered for %s%s)\n", device.to_string().c_str(),
                wanted_ops.empty() ? "" : " and --ops");
    return 1;
  }
  const std::string where = world == nullptr ? device.to_string()
                                            : device.to_string() + " x " + std::to_string(world->world_size()) +
                                                  " ranks over " + world->backend_id();
  std::printf("detdit verify: %s, %lld/%lld checks (%s, %.1f s)\n", pass ? "PASS" : "FAIL",
              static_cast<long long>(passed), static_cast<long long>(checks), where.c_str(), total_seconds);
  return pass ? 0 : 1;
}

}  // namespace cli
}  // namespace detdit
