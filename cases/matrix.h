// The byte-equality matrix of `detdit verify --matrix`: every problem of the
// op-case library on one device, in-process, each check one cell at
// coordinates (op, device, profile, world, packing, B, S; T for
// tp_adaln_projection):
//   op cases      every op's verify and bench cases (--quick: their small
//                 sizes; an op with neither, linear, and the plain rmsnorm
//                 its test suite as one group): world 1, check_op_case's
//                 rows;
//   sp_region     plain and modulated rmsnorm, gate_residual and the fused
//                 gate_residual_rmsnorm (the ops sp_*) x both packings x B in
//                 {1, 2} x S x worlds: check_sp_matrix's rows;
//   tp            tp_adaln_projection T = 1..4 (--quick 1, 4) x worlds:
//                 check_tp_worlds' rows, on CUDA with its WS1 against the CPU's.
// On CUDA every problem that takes a profile runs again in the torch profile.
// The plan is made before anything runs, so a driver can skip a group that
// is too large and still list its cells.
#pragma once

#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "cases/checks.h"

namespace detdit {
namespace cases {

// A group of cells at shared coordinates ("" / -1: the coordinate does not
// apply), one world size per row.
struct MatrixGroup {
  std::string op, name;
  std::string profile = "portable", packing;
  int64_t batch = -1, seq_len = -1, timesteps = -1;
  std::vector<CheckRow> rows;
  std::vector<int> worlds;  // per row
  double seconds = 0;
};

// A group planned before it runs: its coordinates, the rows it would make
// (for a skipped group's listing), its cost (elements of its largest tensor)
// and how to run it (into the groups it makes: an sp_region problem makes one
// per variant, op sp_*).
struct MatrixPlan {
  MatrixGroup head;
  std::vector<std::string> row_checks;
  std::vector<int> row_worlds;
  double cost = 0;
  std::function<Status(std::vector<MatrixGroup>*)> run;
};

// The matrix's op of each sp_region variant, in kSpVariants' order.
constexpr const char* kSpOps[] = {"sp_rmsnorm_plain", "sp_rmsnorm_modulated", "sp_gate_residual",
                                  "sp_gate_residual_rmsnorm"};

// Every group of the matrix. corrupt (a test hook): an sp_* op whose WS1
// output gets one bit flipped, so its cells must fail.
std::vector<MatrixPlan> plan_matrix(const CaseContext& context, const Device& device,
                                    const std::vector<int64_t>& seq_lens, const std::vector<int>& worlds,
                                    const std::string& corrupt);

// The groups of `ops` (empty: all; an sp_* op or sp_region keeps the
// sp_region's groups). An error: an op of `ops`, or the test hook `corrupt`,
// that has no cells.
Status select_matrix(const std::vector<MatrixPlan>& plan, const std::set<std::string>& ops, const std::string& corrupt,
                     std::vector<const MatrixPlan*>* selected);
// Runs one planned group into *groups (only the groups of `ops`' ops), or,
// when its cost is over `budget` (> 0; 0: no budget), lists every row it would
// have as skipped with the reason, never as passing. A group that could not
// run is one failed row "cells ran". Rows that compared no bytes and measured
// no error (an op case's "run") are no cells and are dropped unless they
// failed; an informational row that failed counts as a failed check; the
// groups of one problem share its time.
void run_matrix_group(const MatrixPlan& plan, const std::set<std::string>& ops, double budget,
                      std::vector<MatrixGroup>* groups);

// What the byte-equality matrix has that a run on `device` does not enumerate, and why.
struct MatrixNote {
  std::string what, reason;
};
std::vector<MatrixNote> matrix_not_enumerated(const Device& device);

}  // namespace cases
}  // namespace detdit
