// The `detdit verify` case registry. A case is one op in one situation (e.g.
// adaln_projection at the weights' shape); it runs the op-case library's
// checks (cases/checks.h) and returns one CheckRow per check. The cases are
// registered in tools/verify_cases.cc with DETDIT_VERIFY_CASE; the checks,
// problems and sizes are the op-case library's, so a new op adds cases in
// cases/ and one registration line here.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "cases/checks.h"
#include "cases/matrix.h"
#include "detdit/comm.h"
#include "detdit/status.h"
#include "detdit/tensor.h"
#include "registry.h"
#include "io/weights.h"

namespace detdit {
namespace cli {

// The check rows and runner are the op-case library's (cases/checks.h).
using cases::CheckRow;
using cases::now_seconds;
using cases::DeviceTensor;
using cases::HostTensor;
using io::Weights;

struct VerifyContext {
  bool quick = false;
  // --full: the weights at H3's dimensions (or --weights') and the sp_region
  // at S = 32768 in-process too.
  bool full = false;
  Device device;
  const Weights* weights = nullptr;
  uint64_t seed = 0;
  // --comm mpi: this process's rank of the world (NCCL on CUDA, MPI on the
  // CPU); only the cases registered with DETDIT_VERIFY_PARALLEL_CASE run, each
  // on every rank, and the framework merges the ranks' rows. nullptr: the
  // default in-process run.
  Communicator* comm = nullptr;
};

// `name`: the registered case's name (one function may serve several cases).
using VerifyFn = Status (*)(const VerifyContext& context, const std::string& name, std::vector<CheckRow>* rows);

struct VerifyCase {
  const char* op;    // the op's snake_case name, or "weights" / "chain"
  const char* name;  // the situation, e.g. "h3 T=4"
  bool cpu;          // runs with --device cpu
  bool cuda;         // runs with --device cuda
  VerifyFn run;  // nullptr: the op's verify cases of the op-case library (verify_op_cases)
  bool comm = false;  // runs under --comm mpi too (uses context.comm)
  // Whether the case applies to this run (e.g. a size only without --quick);
  // nullptr: always.
  bool (*enabled)(const VerifyContext& context, const std::string& name) = nullptr;
};

inline std::vector<VerifyCase>& verify_registry() { return registry<VerifyCase>(); }

// DETDIT_VERIFY_CASE("rmsnorm", "modulated S=4097", /*cpu=*/true, /*cuda=*/true, run_fn);
#define DETDIT_VERIFY_CASE(op, name, cpu, cuda, fn) \
  DETDIT_CLI_REGISTER(::detdit::cli::VerifyCase, detdit_verify_case_, op, name, cpu, cuda, fn)
// A case that also runs under --comm mpi (one rank per process), and only
// where enabled(context, name) says so.
#define DETDIT_VERIFY_PARALLEL_CASE(op, name, cpu, cuda, fn, enabled) \
  DETDIT_CLI_REGISTER(::detdit::cli::VerifyCase, detdit_verify_case_, op, name, cpu, cuda, fn, true, enabled)

// The op-case library's context of a run on `weights`: their dimensions and
// tensors, --quick and the seed of the inputs.
cases::CaseContext case_context(const Weights& weights, bool quick, uint64_t seed);
// verify_op_cases: cases::check_op_cases of every verify-suite case of `op`.
Status verify_op_cases(const VerifyContext& ctx, const std::string& op, std::vector<CheckRow>* rows);

// ---- the exactness matrix (verify_matrix.cc) ----------------------------------

// verify --matrix: what the matrix runs (verify_matrix.cc).
struct MatrixOptions {
  std::vector<int64_t> seq_lens;  // S of the sp_region problems
  std::vector<int> worlds;        // world sizes (sp_region, tp_adaln_projection)
  // A cell whose largest tensor has more elements is listed as skipped; 0: none.
  double budget = 0;
  // Test hook (DETDIT_TEST_CORRUPT_CELLS): an sp_* op whose WS1 output gets one
  // bit flipped, so its cells must fail.
  std::string corrupt;
};
using cases::MatrixGroup;
// Plans every group, keeps those of `ops` (empty: all), runs each that fits
// the budget and lists the others as skipped rows. An error: a bad --ops or hook.
Status run_matrix(const VerifyContext& ctx, const MatrixOptions& options, const std::set<std::string>& ops,
                  bool show_progress, std::vector<MatrixGroup>* groups);


}  // namespace cli
}  // namespace detdit
