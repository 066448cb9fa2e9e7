// The `detdit verify` case registry. A case is one op in one situation (e.g.
// adaln_projection at the H3 shape); it runs its checks and returns one
// CheckRow per check. Each area registers its cases in its own file,
// tools/verify_<area>.cc, with DETDIT_VERIFY_CASE, so adding cases never
// touches this framework.
//
// A check passes when every bitwise comparison it ran matched and, where it
// measured an error against an FP64 oracle, the error is within its bound.
// A case that returns an error Status fails as one check carrying the message.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "cases/op_case.h"
#include "cases/parallel_cases.h"
#include "cases/tensor.h"
#include "detdit/comm.h"
#include "detdit/numerics.h"
#include "detdit/status.h"
#include "detdit/tensor.h"
#include "registry.h"
#include "weights_source.h"

namespace detdit {
namespace cli {

struct CheckRow {
  std::string check;            // "repeatability", "row invariance T=1..4", "accuracy vs fp64"
  int64_t bitwise_run = 0;      // bitwise comparisons made (whole tensors)
  int64_t bitwise_passed = 0;   // of those, byte-equal
  double max_error = std::numeric_limits<double>::quiet_NaN();  // vs the FP64 oracle
  double bound = std::numeric_limits<double>::quiet_NaN();      // the bar max_error must meet; NaN: no error measured
  std::string error_unit;       // what max_error measures, e.g. "abs", "ulp(bf16)", "rel"
  double seconds = 0;
  bool pass = false;
  std::string detail;           // first mismatch, or why it failed
  // Informational rows (e.g. the naive-SP contrast) show a measurement; they
  // are not counted as checks unless their computation failed.
  bool informational = false;
  // verify --matrix: a cell that was not run (detail says why); neither a
  // check nor a pass.
  bool skipped = false;
  // Named measurements recorded in the JSON report (e.g. rows and bytes each
  // rank moves): one value, or one per rank.
  std::vector<std::pair<std::string, std::vector<double>>> metrics;
};

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

// Helpers for cases.

// A row that compares two byte ranges; fills bitwise_run/passed and detail
// (first differing element index and both values in hex).
void compare_bytes(const void* expected, const void* actual, std::size_t bytes, DType dtype, const std::string& what,
                   CheckRow* row);
// One bitwise comparison per report (an op case's or a rank's outputs), the
// first difference (or an expected output never written) as the detail.
void add_output_reports(const std::vector<cases::OutputReport>& reports, CheckRow* row);
// pass = all bitwise comparisons matched and (no bound, or max_error <= bound;
// a NaN max_error fails).
void finish_row(CheckRow* row);

// The op-case library's tensors (cases/tensor.h); verify and bench draw their
// inputs from the synthetic-weights generator on the "verify" stream.
using cases::DeviceTensor;
using cases::HostTensor;
inline void fill_verify_normal(HostTensor* t, uint64_t seed, double mean = 0.0, double std = 1.0) {
  cases::fill_stream_normal(t, seed, "verify", mean, std);
}


// ---- the op-case library (verify_cases.cc) ------------------------------------

// The case context of a run on `weights` (their dimensions and tensors).
cases::CaseContext case_context(const Weights& weights, bool quick, uint64_t seed);
// The checks of one op case: accuracy vs its FP64 oracles, forward and
// backward repeatability, row invariance (probe positions alone), and on CUDA
// every output equal to the CPU reference.
Status verify_op_case(const VerifyContext& ctx, const cases::OpCase& c, std::vector<CheckRow>* rows);
// verify_op_case for every verify-suite case of `op`.
Status verify_op_cases(const VerifyContext& ctx, const std::string& op, std::vector<CheckRow>* rows);

// ---- the exactness matrix (verify_matrix.cc; verify_parallel.cc) ------------------

// One sp_region problem of the matrix (cases::sp_region_matrix_cases' shape,
// in the norms' profile shape.numerics), in-process on ctx.device: per variant
// ("rmsnorm", "modulated rmsnorm", "gate_residual", "gate_residual_rmsnorm";
// in the torch profile not gate_residual, which takes none) a row "ws=N" per world (every rank equal to WS1 on the device), "naive ws=N
// (info)" per naive world (the modulated norm and the gate only) and, on CUDA
// in the portable profile, "ws1 = cpu ws1" (the device's WS1 equal to the
// CPU's; the CPU has no torch profile).
// corrupt_variant (a test hook): flips one bit of that variant's WS1 output,
// so its comparisons must fail.
struct SpMatrixRows {
  std::string variant;
  std::vector<CheckRow> rows;
  std::vector<int> worlds;  // each row's world size (1: the CPU comparison)
};
Status verify_sp_matrix(const VerifyContext& ctx, const cases::SpShape& shape, const std::vector<int>& worlds,
                        const std::vector<int>& naive_worlds, const std::string& corrupt_variant,
                        std::vector<SpMatrixRows>* out);
// tp_adaln_projection of `shape` (in the SiLU's profile shape.numerics) for
// each of `worlds`: rows "tp=N"; with cpu_check (portable only) then "ws1 =
// cpu ws1" (the device's WS1 equal to the CPU's).
Status verify_tp_worlds(const VerifyContext& ctx, const cases::TpShape& shape, const std::vector<int>& worlds,
                        bool cpu_check, std::vector<CheckRow>* rows);

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
// A row of the matrix's table and figure: cells at shared coordinates
// ("" / -1: the coordinate does not apply), one world size per row.
struct MatrixGroup {
  std::string op, name;
  std::string profile = "portable", packing;
  int64_t batch = -1, seq_len = -1, timesteps = -1;
  std::vector<CheckRow> rows;
  std::vector<int> worlds;  // per row
  double seconds = 0;
};
// What the byte-equality matrix has that this run does not enumerate, and why.
struct MatrixNote {
  std::string what, reason;
};
std::vector<MatrixNote> matrix_not_enumerated(const Device& device);
// Plans every group, keeps those of `ops` (empty: all), runs each that fits
// the budget and lists the others as skipped rows. An error: a bad --ops or hook.
Status run_matrix(const VerifyContext& ctx, const MatrixOptions& options, const std::set<std::string>& ops,
                  bool show_progress, std::vector<MatrixGroup>* groups);

// Seconds since an arbitrary origin (steady clock).
double now_seconds();

// Runs fn(&row) and times it; an error Status fails the row with its message.
template <typename Fn>
CheckRow timed_check(const std::string& name, Fn&& fn) {
  CheckRow row;
  row.check = name;
  const double start = now_seconds();
  Status status = fn(&row);
  row.seconds = now_seconds() - start;
  if (!status.ok()) {
    row.detail = status.to_string();
    row.pass = false;
    return row;
  }
  finish_row(&row);
  return row;
}


}  // namespace cli
}  // namespace detdit
