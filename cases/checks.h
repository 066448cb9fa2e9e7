// The checks of the op-case library, one runner for `detdit verify`, `verify
// --matrix` and the tests. A check is one CheckRow: the bitwise comparisons it
// made (whole tensors) and, where it measured an error against an FP64
// oracle, that error and its bound. A row passes when every comparison
// matched and the error (if any) is within its bound; a check whose
// computation failed carries the error's message.
//
// An op case (check_op_case) gets:
//   accuracy vs fp64          each of the case's FP64-oracle checks;
//   forward repeatability     a second run on fresh outputs gives the forward's
//   backward repeatability    and the backward's bytes again;
//   <the equivalent route>    where the case has one (EquivalentRoute): every
//                             output recomputed by it on the CPU, equal;
//   row invariance            probe positions alone equal the same positions
//                             of the first run (compare_positions_alone);
//   cuda = cpu reference      on CUDA: every output equal to the CPU's.
// A case in the torch profile (CUDA only) gets repeatability and row
// invariance alone: the CPU reference, the oracle's bounds and the
// equivalent routes define the portable profile.
//
// A parallel problem (check_sp_region, check_sp_matrix, check_tp_worlds)
// gets one row per world size: every output of every rank byte-equal to WS1
// (the public single-device ops on the whole problem) on the same device,
// with what the world's plan moves as metrics; the sp_region also the naive
// contrast (informational: the fraction of elements a rank-order sum of
// per-rank gradients changes), and on CUDA in the portable profile WS1
// equal to the CPU's.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "cases/op_case.h"
#include "cases/parallel_cases.h"
#include "detdit/comm.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {
namespace cases {

struct CheckRow {
  std::string check;            // "forward repeatability", "ws=3", "accuracy vs fp64"
  int64_t bitwise_run = 0;      // bitwise comparisons made (whole tensors)
  int64_t bitwise_passed = 0;   // of those, byte-equal
  double max_error = std::numeric_limits<double>::quiet_NaN();  // vs the FP64 oracle
  double bound = std::numeric_limits<double>::quiet_NaN();      // the bar max_error must meet; NaN: no error measured
  std::string error_unit;       // what max_error measures, e.g. "abs", "ulp(bf16)", "rel"
  double seconds = 0;
  bool pass = false;
  std::string detail;           // first mismatch, or why it failed
  // Informational rows (the naive-SP contrast) show a measurement; they are
  // not counted as checks unless their computation failed.
  bool informational = false;
  // verify --matrix: a cell that was not run (detail says why); neither a
  // check nor a pass.
  bool skipped = false;
  // Named measurements (e.g. rows and bytes each rank moves): one value, or one per rank.
  std::vector<std::pair<std::string, std::vector<double>>> metrics;
};

// Seconds since an arbitrary origin (steady clock).
double now_seconds();
// One bitwise comparison of two byte ranges; the first difference (index and
// both values in hex) as the row's detail.
void compare_bytes(const void* expected, const void* actual, std::size_t bytes, DType dtype, const std::string& what,
                   CheckRow* row);
// One bitwise comparison per report, the first difference (or an expected
// output never written) as the detail.
void add_output_reports(const std::vector<OutputReport>& reports, CheckRow* row);
// pass = all bitwise comparisons matched and (no bound, or max_error <= bound;
// a NaN max_error fails).
void finish_row(CheckRow* row);

// Runs fn(&row) and times it; an error Status fails the row with its message.
template <typename Fn>
CheckRow timed_check(const std::string& name, Fn&& fn) {
  CheckRow row;
  row.check = name;
  const double start = now_seconds();
  const Status status = fn(&row);
  row.seconds = now_seconds() - start;
  if (status.ok()) {
    finish_row(&row);
  } else {
    row.detail = status.to_string();
  }
  return row;
}

// The rows of one case on every rank of `comm` (a multi-process run: each rank
// ran the same checks on its share), merged on every rank: bitwise counts
// summed, pass only if every rank passed, the first failing rank's detail
// ("rank r: ..."), the largest error and time; check names, bounds and
// metrics are rank 0's (metrics come from plans every rank knows). A rank
// with fewer rows fails the rows it lacks.
Status merge_rank_rows(Communicator& comm, std::vector<CheckRow>* rows);

// The checks of one op case on `device` (see the top of the file); an error
// Status only when the checks could not be made at all.
Status check_op_case(const OpCase& c, const Device& device, std::vector<CheckRow>* rows);
// check_op_case of each case; with several cases each row's check names its case.
Status check_op_cases(const std::vector<OpCase>& all, const Device& device, std::vector<CheckRow>* rows);

// The sp_region case `c` on `device`: a row "ws=N" per world of c.worlds for
// all four variants together, then "naive ws=N (info)" per naive world.
// comm: this process's rank of a multi-process world (then every world is
// that world), or nullptr: each world in-process, as threads on `device`.
Status check_sp_region(const CaseContext& context, const Device& device, Communicator* comm, const SpRegionCase& c,
                       std::vector<CheckRow>* rows);

// One sp_region problem, in-process, a group of rows per variant (in the
// torch profile not gate_residual, which takes none): "ws=N" per world,
// "naive ws=N (info)" per naive world (the modulated norm and the gate only)
// and, on CUDA in the portable profile, "ws1 = cpu ws1".
// corrupt_variant (a test hook): flips one bit of that variant's WS1 output,
// so its comparisons must fail.
struct SpVariantRows {
  std::string variant;      // sp_variant_name
  std::vector<CheckRow> rows;
  std::vector<int> worlds;  // each row's world size (1: the CPU comparison)
};
Status check_sp_matrix(const CaseContext& context, const Device& device, const SpShape& shape,
                       const std::vector<int>& worlds, const std::vector<int>& naive_worlds,
                       const std::string& corrupt_variant, std::vector<SpVariantRows>* out);

// tp_adaln_projection of `shape` for each of `worlds` (comm as for
// check_sp_region): rows "tp=N" (a world that cannot split N: an
// informational row with the op's refusal); with cpu_check (portable only)
// then "ws1 = cpu ws1".
Status check_tp_worlds(const CaseContext& context, const Device& device, Communicator* comm, const TpShape& shape,
                       const std::vector<int>& worlds, bool cpu_check, std::vector<CheckRow>* rows);

}  // namespace cases
}  // namespace detdit
