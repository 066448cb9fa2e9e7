// detdit_export_cases: writes op cases (cases/) as safetensors, for the tests
// and scripts outside C++ (tests/python/test_cases.py, scripts/torch_compare.py)
// that take their inputs from the same cases as the C++ suites.
//
//   detdit_export_cases --out DIR [--suite test|verify|bench] [--op NAME]...
//                       [--case "OP NAME"]... [--max-elements N] [--quick]
//                       [--small] [--forward-only] [--list] [--hidden N]
//                       [--time-embed-dim N] [--time-embed-hidden N] [--freq-dim N]
//
// For each case of the suite (the named ops' cases, or every op's) whose
// tensors hold at most --max-elements elements together (0: no limit; default
// 16384: 3.5 MB for the test suite) and each op's smallest case whatever its
// size, or with --case the cases named (full name, op and name; a name no case
// has is an error) and no others whatever their size, DIR/<op>/<k>.safetensors
// holds the case's inputs (made by the case's own fills), its plans' index
// tensors ("<plan>.timestep_indices", "<plan>.token_tags", int64) and every
// output as the case computes it on the CPU (the reference backend; forward,
// then backward where the case has one, the backward reading what the forward
// wrote), each under the case's name for it. DIR/index.json lists every case:
// op, name, file, profile, its arguments (OpCase::arguments), its tensors
// (name, input or output, phase, dtype, shape, the position dimension) and its
// plans (name, rows "adaln" = ti*3 + tag or "timestep" = ti, packing, seq_len,
// num_timesteps, batch).
//
// --forward-only: the cases are not run, only their inputs written (the
// benchmark's sizes, where the CPU would take minutes). --list: no case is
// made and index.json alone lists them (file null, the tensors --forward-only
// would write), for a caller that then exports them one at a time by name
// (scripts/torch_compare.py: its cases are gigabytes each). --quick, --small
// and the sizes set the CaseContext the verify and bench suites' generators
// read (the sizes default to H3's, as with no weights). Exit status 1 with a
// message on any failure, 2 on a bad argument.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cases/op_case.h"
#include "io/files.h"
#include "io/safetensors.h"

namespace {

using detdit::DType;
using detdit::Status;
using namespace detdit::cases;

struct Options {
  std::string out;
  Suite suite = Suite::kTest;
  std::vector<std::string> ops, named;
  int64_t max_elements = 16384;
  bool quick = false, small = false, forward_only = false, list = false;
  CaseContext context;
};

int usage(const char* message) {
  std::fprintf(stderr,
               "detdit_export_cases: %s\nusage: detdit_export_cases --out DIR [--suite test|verify|bench] "
               "[--op NAME]... [--case \"OP NAME\"]... [--max-elements N] [--quick] [--small] [--forward-only]\n"
               "       [--list] [--hidden N] [--time-embed-dim N] [--time-embed-hidden N] [--freq-dim N]\n",
               message);
  return 2;
}

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t case_elements(const OpCase& c) {
  int64_t n = 0;
  for (const TensorSpec& t : c.tensors) n += numel(t.shape);
  for (const PlanSpec& p : c.plans) n += 2 * p.index.seq_len;
  return n;
}

// An owned host tensor written by copying its bytes.
detdit::io::TensorToWrite tensor_to_write(const std::string& name, const HostTensor& t) {
  return {name, t.dtype(), t.shape(), [t](uint8_t* out, uint64_t bytes) {
            std::memcpy(out, t.data(), bytes);
            return Status();
          }};
}

HostTensor int64_tensor(const std::vector<int64_t>& values) {
  HostTensor t(DType::kI64, {static_cast<int64_t>(values.size())});
  if (!values.empty()) std::memcpy(t.data(), values.data(), values.size() * sizeof(int64_t));
  return t;
}

// The case's inputs and index tensors, and (unless forward_only) its outputs
// after a CPU run, into `file`; its description into `entry`.
Status export_case(const OpCase& c, const std::string& file, bool forward_only, bool list, nlohmann::json* entry) {
  std::map<std::string, HostTensor> inputs, outputs;
  if (!list) make_inputs(c, &inputs);
  if (!forward_only && !list) {
    Instance cpu;
    DETDIT_RETURN_IF_ERROR(instantiate(c, detdit::Device::cpu(), nullptr, &cpu, &inputs));
    for (Phase phase : {Phase::kForward, Phase::kBackward})
      if (c.has(phase)) DETDIT_RETURN_IF_ERROR(run(c, phase, cpu));
    DETDIT_RETURN_IF_ERROR(download_outputs(c, cpu, &outputs));
  }
  std::vector<detdit::io::TensorToWrite> tensors;
  nlohmann::json specs = nlohmann::json::array(), plans = nlohmann::json::array();
  for (const TensorSpec& spec : c.tensors) {
    if (spec.output && (forward_only || list)) continue;
    if (!list)
      tensors.push_back(tensor_to_write(spec.name, spec.output ? outputs.at(spec.name) : inputs.at(spec.name)));
    specs.push_back({{"name", spec.name},
                     {"output", spec.output},
                     {"phase", phase_name(spec.phase)},
                     {"dtype", detdit::io::safetensors_dtype_string(spec.dtype)},
                     {"shape", spec.shape},
                     {"position_dim", spec.position_dim}});
  }
  for (const PlanSpec& plan : c.plans) {
    tensors.push_back(tensor_to_write(plan.name + ".timestep_indices", int64_tensor(plan.index.timestep_indices)));
    tensors.push_back(tensor_to_write(plan.name + ".token_tags", int64_tensor(plan.index.tags)));
    plans.push_back({{"name", plan.name},
                     {"rows", plan.rows == PlanSpec::Rows::kAdaln ? "adaln" : "timestep"},
                     {"packing", packing_name(plan.index.packing)},
                     {"seq_len", plan.index.seq_len},
                     {"num_timesteps", plan.index.num_timesteps},
                     {"batch", plan.index.batch}});
  }
  if (!list) DETDIT_RETURN_IF_ERROR(detdit::io::write_safetensors(file, tensors, {{"op", c.op}, {"name", c.name}}));
  *entry = {{"op", c.op},
            {"name", c.name},
            {"numerics", c.takes_profile ? nlohmann::json(numerics_name(c.numerics)) : nlohmann::json()},
            {"arguments", c.arguments},
            {"has_backward", c.has(Phase::kBackward)},
            {"outputs_written", !forward_only && !list},
            {"tensors", specs},
            {"plans", plans}};
  return Status();
}

int export_cases(const Options& o) {
  CaseContext context = o.context;
  context.quick = o.quick;
  context.small = o.small;
  std::vector<std::string> ops = o.ops;
  if (ops.empty() || !o.named.empty()) ops = {""};  // every op (a named case may be any op's)
  std::vector<OpCase> cases;
  for (const std::string& op : ops) {
    if (!op.empty() && case_ops().end() == std::find(case_ops().begin(), case_ops().end(), op)) {
      std::fprintf(stderr, "detdit_export_cases: no op case family '%s'\n", op.c_str());
      return 1;
    }
    for (OpCase& c : op_cases(op, o.suite, context)) cases.push_back(std::move(c));
  }
  // Each op's smallest case is written whatever its size, so every op with
  // cases has one (the timestep_sinusoid cases are all T = 8192).
  std::map<std::string, int64_t> smallest;
  for (const OpCase& c : cases) {
    const auto it = smallest.find(c.op);
    if (it == smallest.end() || case_elements(c) < it->second) smallest[c.op] = case_elements(c);
  }
  nlohmann::json index = nlohmann::json::array();
  std::map<std::string, int> per_op;
  std::vector<std::string> unmatched = o.named;
  for (const OpCase& c : cases) {
    const int64_t elements = case_elements(c);
    const auto named = std::find(unmatched.begin(), unmatched.end(), c.full_name());
    const bool chosen = named != unmatched.end();
    if (chosen) unmatched.erase(named);
    const bool listed = o.ops.empty() || std::find(o.ops.begin(), o.ops.end(), c.op) != o.ops.end();
    if (!o.named.empty() ? !chosen
                         : !listed || (o.max_elements > 0 && elements > o.max_elements && elements != smallest[c.op]))
      continue;
    if (elements == smallest[c.op]) smallest[c.op] = -1;  // one case at most past the limit
    const std::string dir = o.out + "/" + c.op;
    Status s = detdit::io::make_directories(o.list ? o.out : dir);
    const std::string file = c.op + "/" + std::to_string(per_op[c.op]++) + ".safetensors";
    nlohmann::json entry;
    if (s.ok()) s = export_case(c, o.out + "/" + file, o.forward_only, o.list, &entry);
    if (!s.ok()) {
      std::fprintf(stderr, "detdit_export_cases: %s: %s\n", c.full_name().c_str(), s.to_string().c_str());
      return 1;
    }
    entry["file"] = o.list ? nlohmann::json() : nlohmann::json(file);
    index.push_back(std::move(entry));
  }
  if (!unmatched.empty()) {
    std::fprintf(stderr, "detdit_export_cases: no case named '%s' in the suite\n", unmatched[0].c_str());
    return 1;
  }
  const char* suite = o.suite == Suite::kTest ? "test" : o.suite == Suite::kVerify ? "verify" : "bench";
  const nlohmann::json document = {{"suite", suite}, {"max_elements", o.max_elements}, {"cases", index}};
  const Status s = detdit::io::write_file_atomically(o.out + "/index.json", document.dump(1) + "\n");
  if (!s.ok()) {
    std::fprintf(stderr, "detdit_export_cases: %s\n", s.to_string().c_str());
    return 1;
  }
  std::printf("detdit_export_cases: %zu cases (%s suite) in %s\n", index.size(), suite, o.out.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--out" && has_value) {
      o.out = argv[++i];
    } else if (arg == "--op" && has_value) {
      o.ops.push_back(argv[++i]);
    } else if (arg == "--case" && has_value) {
      o.named.push_back(argv[++i]);
    } else if (arg == "--suite" && has_value) {
      const std::string suite = argv[++i];
      if (suite == "test") o.suite = Suite::kTest;
      else if (suite == "verify") o.suite = Suite::kVerify;
      else if (suite == "bench") o.suite = Suite::kBench;
      else return usage("--suite takes test, verify or bench");
    } else if (arg == "--max-elements" && has_value) {
      char* end = nullptr;
      o.max_elements = std::strtoll(argv[++i], &end, 10);
      if (*end != '\0' || o.max_elements < 0) return usage("--max-elements takes a count >= 0");
    } else if ((arg == "--hidden" || arg == "--time-embed-dim" || arg == "--time-embed-hidden" ||
                arg == "--freq-dim") &&
               has_value) {
      char* end = nullptr;
      const int64_t size = std::strtoll(argv[++i], &end, 10);
      if (*end != '\0' || size < 1) return usage((arg + " takes a size >= 1").c_str());
      (arg == "--hidden" ? o.context.hidden
       : arg == "--time-embed-dim" ? o.context.time_embed_dim
       : arg == "--time-embed-hidden" ? o.context.time_embed_hidden
                                      : o.context.freq_dim) = size;
    } else if (arg == "--quick") {
      o.quick = true;
    } else if (arg == "--small") {
      o.small = true;
    } else if (arg == "--forward-only") {
      o.forward_only = true;
    } else if (arg == "--list") {
      o.list = true;
    } else {
      return usage(("unknown argument " + arg).c_str());
    }
  }
  if (o.out.empty()) return usage("--out DIR is required");
  return export_cases(o);
}
