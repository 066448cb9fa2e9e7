// detdit verify --matrix: runs the byte-equality matrix's plan (cases/matrix.h)
// on one device, in-process: each group that fits the budget, each other one
// listed as skipped cells with the reason, never as passing; --ops keeps the
// groups of those ops (sp_* or sp_region for the sp_region's).
#include <algorithm>
#include <cmath>
#include <iterator>
#include <set>
#include <string>
#include <vector>

#include "parallel_common.h"
#include "progress.h"
#include "verify.h"

namespace detdit {
namespace cli {
namespace {

std::string with_commas(double v) {
  std::string digits = std::to_string(static_cast<long long>(v)), out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

}  // namespace

Status run_matrix(const VerifyContext& ctx, const MatrixOptions& options, const std::set<std::string>& ops,
                  bool show_progress, std::vector<MatrixGroup>* groups) {
  const std::vector<cases::MatrixPlan> plan = cases::plan_matrix(case_context(*ctx.weights, ctx.quick, ctx.seed),
                                                                 ctx.device, options.seq_lens, options.worlds,
                                                                 options.corrupt);
  std::set<std::string> known;
  for (const cases::MatrixPlan& p : plan) {
    known.insert(p.head.op);
    if (p.head.op == "sp_region") known.insert(std::begin(cases::kSpOps), std::end(cases::kSpOps));
  }
  for (const std::string& op : ops)
    if (!known.count(op)) return Status::value_error("--ops: no matrix cells for op '" + op + "'");
  if (!options.corrupt.empty() && !known.count(options.corrupt))
    return Status::value_error("DETDIT_TEST_CORRUPT_CELLS: no matrix cells for op '" + options.corrupt + "'");
  auto wanted = [&ops](const std::string& op) {
    if (ops.empty() || ops.count(op)) return true;
    if (op != "sp_region") return false;
    for (const char* sp : cases::kSpOps)
      if (ops.count(sp)) return true;
    return false;
  };
  std::vector<const cases::MatrixPlan*> selected;
  for (const cases::MatrixPlan& p : plan)
    if (wanted(p.head.op)) selected.push_back(&p);
  Progress progress("detdit verify --matrix", selected.size(), show_progress);
  for (const cases::MatrixPlan* p : selected) {
    const std::string name = p->head.op + " / " + p->head.name;
    progress.started(name);
    const std::size_t first = groups->size();
    const double start = now_seconds();
    if (options.budget > 0 && p->cost > options.budget) {
      // Skipped: every row it would have, each saying why.
      const std::string reason = "skipped: its largest tensor has " + with_commas(p->cost) +
                                 " elements, over this run's budget of " + with_commas(options.budget) +
                                 " (--matrix-budget; 0: no budget)";
      const bool sp = p->head.op == "sp_region";
      for (std::size_t v = 0; v < (sp ? std::size(cases::kSpOps) : 1); ++v) {
        const std::string op = sp ? cases::kSpOps[v] : p->head.op;
        if (!wanted(op)) continue;
        if (sp && p->head.profile != "portable" && !sp_variant_takes_profile(kSpVariants[v])) continue;
        MatrixGroup g = p->head;
        g.op = op;
        for (std::size_t i = 0; i < p->row_checks.size(); ++i) {
          if (sp && !sp_variant_has_naive_contrast(kSpVariants[v]) && p->row_checks[i].rfind("naive", 0) == 0)
            continue;
          CheckRow row;
          row.check = p->row_checks[i];
          row.skipped = true;
          row.detail = reason;
          g.rows.push_back(row);
          g.worlds.push_back(p->row_worlds[i]);
        }
        groups->push_back(std::move(g));
      }
    } else {
      Status s = p->run(groups);
      if (!s.ok()) {
        MatrixGroup g = p->head;
        CheckRow row;
        row.check = "cells ran";
        row.detail = s.to_string();
        g.rows.push_back(row);
        g.worlds.push_back(0);
        groups->push_back(std::move(g));
      }
    }
    // A row that compared no bytes and measured no error (an op case's "run")
    // is no cell, unless it failed.
    for (std::size_t i = first; i < groups->size(); ++i) {
      MatrixGroup& g = (*groups)[i];
      for (std::size_t r = g.rows.size(); r-- > 0;) {
        const CheckRow& row = g.rows[r];
        if (row.pass && !row.skipped && !row.informational && row.bitwise_run == 0 && std::isnan(row.bound)) {
          g.rows.erase(g.rows.begin() + static_cast<std::ptrdiff_t>(r));
          if (r < g.worlds.size()) g.worlds.erase(g.worlds.begin() + static_cast<std::ptrdiff_t>(r));
        }
      }
    }
    // The groups an SP problem made share its time; --ops keeps the ones asked for.
    const double seconds = now_seconds() - start;
    const double made = static_cast<double>(groups->size() - first);
    groups->erase(std::remove_if(groups->begin() + static_cast<std::ptrdiff_t>(first), groups->end(),
                                 [&](const MatrixGroup& g) { return !wanted(g.op); }),
                  groups->end());
    int64_t checks = 0, passed = 0, skipped = 0;
    for (std::size_t i = first; i < groups->size(); ++i) {
      MatrixGroup& g = (*groups)[i];
      g.seconds = seconds / made;
      for (CheckRow& row : g.rows) {
        row.informational = row.informational && row.pass;
        if (row.skipped) {
          ++skipped;
        } else if (!row.informational) {
          ++checks;
          passed += row.pass ? 1 : 0;
        }
      }
    }
    std::string outcome = std::to_string(passed) + "/" + std::to_string(checks) + " cells " +
                          (passed == checks ? "ok" : "FAIL");
    if (skipped > 0) outcome += ", " + std::to_string(skipped) + " skipped";
    progress.finished(name, outcome);
  }
  progress.clear();
  return Status::ok_status();
}

}  // namespace cli
}  // namespace detdit
