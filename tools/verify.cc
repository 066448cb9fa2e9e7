// detdit verify: runs the verify cases of the op-case library for one device
// (each op's Suite::kVerify cases, the sp_region and tp_adaln_projection
// problems; their problems, sizes, world sizes and every check are cases/'s),
// or the byte-equality matrix (--matrix, cases/matrix.h), prints a table and a
// one-line verdict, and writes a JSON report (and an SVG figure). Exit code 0
// when every check passes, 1 when one fails, 2 on usage or input errors (bad
// options, unreadable weights).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>

#include "cases/checks.h"
#include "cases/matrix.h"
#include "cases/model_cases.h"
#include "cli.h"
#include "io/files.h"
#include "io/manifest.h"

namespace detdit {
namespace cli {
namespace {

using Json = nlohmann::ordered_json;
using cases::CheckRow;
using cases::MatrixGroup;

// verify --matrix: what the matrix runs.
struct MatrixOptions {
  std::vector<int64_t> seq_lens;  // S of the sp_region problems
  std::vector<int> worlds;        // world sizes (sp_region, tp_adaln_projection)
  // A cell whose largest tensor has more elements is listed as skipped; 0: none.
  double budget = 0;
  // Test hook (DETDIT_TEST_CORRUPT_CELLS): an sp_* op whose WS1 output gets one
  // bit flipped, so its cells must fail.
  std::string corrupt;
};

// One case of the report: an op's verify op cases together, named by their
// situation, or one parallel problem, which also runs under --comm mpi (each
// rank its share); `enabled`: whether it applies to this run.
struct VerifyCase {
  std::string op, name;
  bool parallel = false, enabled = true;
  std::function<Status(std::vector<CheckRow>*)> run;
};

// The cases in report order. comm: this process's rank of a --comm mpi run.
std::vector<VerifyCase> verify_cases(const cases::CaseContext& context, const cases::ParallelSetting& setting,
                                     const Device& device, Communicator* comm) {
  std::vector<VerifyCase> all;
  auto op_cases = [&](const char* op, const char* name) {
    all.push_back({op, name, false, true, [=](std::vector<CheckRow>* rows) {
                     const auto cases = cases::op_cases(op, cases::Suite::kVerify, context);
                     if (cases.empty()) return Status::value_error(std::string("no verify cases registered for ") + op);
                     return cases::check_op_cases(cases, device, rows);
                   }});
  };
  for (const auto& [op, name] : {std::make_pair("timestep_sinusoid", "F from weights"),
                                 {"timestep_mlp", "weights T=4"},
                                 {"adaln_projection", "block 0, weights' shape"},
                                 {"adaln_row_gather", "six chunks"},
                                 {"rmsnorm", "indexed norm1 of block 0; per sample, per frame"},
                                 {"layernorm", "no affine; per sample, per frame"},
                                 {"gate_residual", "indexed gate_msa; per sample, per frame"},
                                 {"gate_residual_layernorm", "gate into norm2; per frame"},
                                 {"final_adaln_out", "norm_out, fwd+bwd"},
                                 {"adaln_modulation", "block 0, fwd+bwd"},
                                 {"chain", "blocks 0..1, fwd+bwd, T=2"}})
    op_cases(op, name);
  // The parallel problems: every rank byte-equal to WS1 on the same device.
  for (const cases::SpRegionCase& c : cases::sp_region_cases(context, setting))
    all.push_back({"sp_region", c.name, true, c.enabled, [=](std::vector<CheckRow>* rows) {
                     return cases::check_sp_region(context, device, comm, c, rows);
                   }});
  for (const cases::TpCase& c : cases::tp_adaln_projection_cases(context, setting))
    all.push_back({"tp_adaln_projection", c.name, true, c.enabled, [=](std::vector<CheckRow>* rows) {
                     return cases::check_tp_worlds(context, device, comm, c.shape, c.worlds, false, rows);
                   }});
  op_cases("gate_residual_rmsnorm", "gate_msa then norm2, d_h");  // last, where every earlier report lists it
  return all;
}

Json number_or_null(double v) { return std::isnan(v) ? Json(nullptr) : Json(v); }

std::string format_error(double v) {
  if (std::isnan(v)) return "-";
  char text[32];
  std::snprintf(text, sizeof text, v == 0 ? "0" : "%.2e", v);
  return text;
}

// The checks of rows: a skipped or informational row is none.
struct Tally {
  int64_t checks = 0, passed = 0, skipped = 0;
  void add(const std::vector<CheckRow>& rows) {
    for (const CheckRow& row : rows) {
      skipped += row.skipped ? 1 : 0;
      checks += row.skipped || row.informational ? 0 : 1;
      passed += !row.skipped && !row.informational && row.pass ? 1 : 0;
    }
  }
  std::string outcome(const std::string& what) const {  // "3/3 checks ok", "2/3 cells FAIL, 1 skipped"
    return std::to_string(passed) + "/" + std::to_string(checks) + " " + what + (passed == checks ? " ok" : " FAIL") +
           (skipped > 0 ? ", " + std::to_string(skipped) + " skipped" : "");
  }
};

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
  Args args("detdit verify [--quick | --full] [--model NAME] [--device cpu|cuda] [--weights DIR] [--out REPORT.json] [--matrix]",
            "Runs the conditioning ops on the weights (default: cached synthetic weights of the H3 tensors\n"
            "at H = 1536, or at H3's own dimensions with --full; docs/weights.md) and checks every bitwise claim (repeatability, row invariance, CPU = CUDA)\n"
            "and accuracy bar against an FP64 oracle. Prints a table and a verdict. --model NAME runs a\n"
            "DiT family's conditioning path instead (docs/models.md), on synthetic weights of its real shapes.\n"
            "Exit 0: every check passes; 1: a check fails; 2: usage or input error.");
  args.flag("--quick", "smaller sweeps (under a minute on 2 CPU cores)");
  args.flag("--full",
            "the synthetic default at H3's dimensions (H = 5376) and the sp_region at S = 32768 too\n"
            "(about 3 minutes on 2 CPU cores)");
  args.option("--device", "cpu|cuda", "where the ops run", "cuda when a GPU is present, else cpu");
  args.option("--model", "NAME",
              "h3 (the ops' verify cases), or a DiT family whose conditioning path runs: sd35, flux, wan21,\n"
              "wan22_a14b, wan22_ti2v, hunyuan_video, qwen_image, cogvideox, ltx_video",
              "h3");
  args.option("--weights", "DIR", "weights directory or file (the model's)", "synthetic, cached");
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
  if (!args.get_int("--blocks", 1, 1, 1000, &blocks) || !args.get_uint64("--seed", 0, &seed)) return fail(args.error());
  if (args.has("--quick") && args.has("--full")) return fail("--quick and --full exclude each other");
  const bool full = args.has("--full");
  const io::ModelManifest* model = nullptr;
  if (Status s = io::find_model_manifest(args.get("--model", "h3"), &model); !s.ok()) return fail("--model: " + s.message());
  const bool family = std::string(model->name) != "h3";
  if (family) {
    for (const char* option : {"--full", "--matrix", "--list"})
      if (args.has(option)) return fail(std::string(option) + " applies to MiniMax-H3's verify (no --model)");
    if (args.get("--comm", "inprocess") != "inprocess") return fail("--model runs its path in one process (no --comm mpi)");
  }
  // The synthetic default: H3's dimensions with --full (as bench and weights
  // synth use them), else the H3 tensors and ratios (Ht = H, D = H / 2,
  // F = 256) at H = 1536 (Wan 2.1 1.3B's and SD3 Medium's hidden size), so
  // that the default run fits three minutes on 2 CPU cores.
  io::ManifestConfig dimensions = model->dims;  // a family's: its released dimensions
  dimensions.blocks = blocks;
  if (!full && !family) {
    dimensions.hidden = dimensions.time_embed_hidden = 1536;
    dimensions.time_embed_dim = 768;
  }

  if (args.has("--list")) {
    // Where each case runs: under --comm mpi, or in-process with --full (the H3 shape names them).
    const auto cpu = verify_cases({}, cases::ParallelSetting{false, false, true, 2}, Device::cpu(), nullptr);
    const auto cuda = verify_cases({}, cases::ParallelSetting{true, false, true, 2}, Device::cpu(), nullptr);
    for (std::size_t i = 0; i < cpu.size(); ++i) {
      std::printf("%-20s %-32s %s%s%s\n", cpu[i].op.c_str(), cpu[i].name.c_str(), cpu[i].enabled ? "cpu " : "",
                  cuda[i].enabled ? "cuda " : "", cpu[i].parallel ? "mpi" : "");
    }
    return 0;
  }
  const bool matrix = args.has("--matrix");
  MatrixOptions matrix_options;
  if (matrix && args.get("--comm") == "mpi") return fail("--matrix runs its ranks in-process (without --comm mpi)");
  for (const char* option : {"--seq", "--worlds", "--matrix-budget"}) {
    if (!matrix && args.has(option)) return fail(std::string(option) + " applies to --matrix only");
  }
  if (matrix) {
    const bool quick = args.has("--quick");
    std::vector<int64_t> worlds;
    int64_t budget = 0;
    if (!args.get_int_list("--seq", quick ? "4097" : "4097,32768,131072", 1, int64_t{1} << 24, "sequence length",
                           &matrix_options.seq_lens) ||
        !args.get_int_list("--worlds", quick ? "1,2,3,8" : "1,2,3,4,5,6,7,8", 1, 64, "world size", &worlds) ||
        !args.get_int("--matrix-budget", -1, 0, int64_t{1} << 50, &budget))
      return fail(args.error());
    for (int64_t w : worlds) matrix_options.worlds.push_back(static_cast<int>(w));
    matrix_options.budget = static_cast<double>(budget);
    if (const char* corrupt = std::getenv("DETDIT_TEST_CORRUPT_CELLS")) matrix_options.corrupt = corrupt;
  }

  Device device;
  std::unique_ptr<Communicator> world;
  code = open_run(args, NcclOptions(), &device, &world);
  if (code >= 0) return code;
  const bool leader = world == nullptr || world->rank() == 0;

  std::set<std::string> wanted_ops;
  if (!args.get_set("--ops", &wanted_ops)) return fail(args.error());
  const bool quick = args.has("--quick");
  for (const std::string& op : matrix || family ? std::set<std::string>() : wanted_ops) {
    bool known = false;
    for (const VerifyCase& c : verify_cases({}, {}, device, nullptr)) known = known || op == c.op;
    if (!known) return fail("--ops: no verify case for op '" + op + "' (detdit verify --list shows them)");
  }

  io::Weights weights;
  std::vector<std::string> destinations;
  for (const char* option : {"--out", "--figure"})
    if (args.has(option)) destinations.push_back(args.get(option));
  const Status status = resolve_run_weights(world.get(), destinations, args.get("--weights"), dimensions, seed, &weights);
  if (!status.ok()) return fail(status.to_string(), leader);

  const cases::CaseContext context = case_context(weights, quick, seed);
  if (matrix && matrix_options.budget < 0) matrix_options.budget = device.is_cuda() ? 0 : 2.0 * 4097 * 5376;
  std::vector<VerifyCase> selected;
  const cases::ParallelSetting setting{device.is_cuda(), quick, full, world ? world->world_size() : 0};
  std::vector<VerifyCase> candidates;
  if (family) {
    std::vector<cases::ModelSite> sites;
    if (Status s = cases::model_sites(context, &sites); !s.ok()) return fail(s.to_string());
    for (cases::ModelSite& site : sites)
      candidates.push_back({site.c.op, site.site, false, true, [c = std::move(site.c), device](std::vector<CheckRow>* rows) {
                              return cases::check_op_case(c, device, rows);
                            }});
    std::string tp_site;
    cases::TpShape tp;
    if (Status s = cases::model_tp_shape(context, &tp_site, &tp); !s.ok()) return fail(s.to_string());
    candidates.push_back({"tp_adaln_projection", tp_site, false, true, [context, tp, device](std::vector<CheckRow>* rows) {
                            return cases::check_tp_worlds(context, device, nullptr, tp, {1, 2, 3, 4, 8}, false, rows);
                          }});
    for (const std::string& op : wanted_ops) {
      bool known = false;
      for (const VerifyCase& c : candidates) known = known || op == c.op;
      if (!known) return fail("--ops: the " + std::string(model->title) + " path has no site of op '" + op + "'");
    }
  } else {
    candidates = verify_cases(context, setting, device, world.get());
  }
  for (VerifyCase& c : candidates) {
    if (!matrix && c.enabled && (world == nullptr || c.parallel) && (wanted_ops.empty() || wanted_ops.count(c.op)))
      selected.push_back(std::move(c));
  }
  std::vector<CaseResult> results;
  const double start = cases::now_seconds();
  Progress progress("detdit verify", selected.size(), leader);
  for (const VerifyCase& c : selected) {
    const std::string name = c.op + " / " + c.name;
    progress.started(name);
    CaseResult r;
    r.op = c.op;
    r.name = c.name;
    const double t0 = cases::now_seconds();
    Status s = c.run(&r.rows);
    r.seconds = cases::now_seconds() - t0;
    if (!s.ok() || r.rows.empty()) {  // a failed check
      CheckRow row;
      row.check = "case ran";
      row.seconds = s.ok() ? 0 : r.seconds;
      row.detail = s.ok() ? "the case returned no checks" : s.to_string();
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
    Tally tally;
    tally.add(r.rows);
    progress.finished(name, tally.outcome("checks"));
    results.push_back(std::move(r));
  }
  progress.clear();
  std::vector<MatrixGroup> groups;
  if (matrix) {
    // Each group that fits the budget, each other one listed as skipped cells.
    const std::vector<cases::MatrixPlan> plan =
        cases::plan_matrix(context, device, matrix_options.seq_lens, matrix_options.worlds, matrix_options.corrupt);
    std::vector<const cases::MatrixPlan*> planned;
    Status s = cases::select_matrix(plan, wanted_ops, matrix_options.corrupt, &planned);
    if (!s.ok()) return fail(s.to_string());
    Progress cells("detdit verify --matrix", planned.size(), leader);
    for (const cases::MatrixPlan* p : planned) {
      const std::string name = p->head.op + " / " + p->head.name;
      cells.started(name);
      const std::size_t first = groups.size();
      cases::run_matrix_group(*p, wanted_ops, matrix_options.budget, &groups);
      Tally tally;
      for (std::size_t i = first; i < groups.size(); ++i) tally.add(groups[i].rows);
      cells.finished(name, tally.outcome("cells"));
    }
    cells.clear();
    for (const MatrixGroup& g : groups) results.push_back({g.op, g.name, g.rows, g.seconds});
  }
  const double total_seconds = cases::now_seconds() - start;

  Tally total;
  for (const CaseResult& r : results) total.add(r.rows);
  const int64_t checks = total.checks, passed = total.passed, skipped = total.skipped;
  const bool pass = checks > 0 && passed == checks;
  if (!leader) return pass ? 0 : 1;  // rank 0 reports for every rank
  print_table(results);

  Json report;
  report["kind"] = "detdit_verify_report";
  // 2: "git" is the commit built (no run-time "build_commit"), "detdit_version" added.
  report["format_version"] = 2;
  report["verdict"] = pass ? "PASS" : "FAIL";
  report["checks_total"] = checks;
  report["checks_passed"] = passed;
  report["seconds"] = total_seconds;
  record_environment(device, &report);
  report["options"] = {{"model", model->name},
                       {"quick", quick},
                       {"full", full},
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
  if (family) {
    report["weights"]["pooled_dim"] = weights.config.pooled_dim;
    report["weights"]["out_dim"] = weights.config.out_dim;
  }
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
    if (!s.ok()) return fail(s.to_string());
  }
  if (args.has("--figure")) {
    Status s = write_report_svg(nlohmann::json::parse(report.dump()), args.get("--figure"));
    if (!s.ok()) return fail(s.to_string());
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
