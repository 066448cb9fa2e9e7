// detdit verify --matrix: the byte-equality matrix on one device,
// in-process. Every cell is one check at coordinates (op, device, profile,
// world, packing, B, S; T for tp_adaln_projection) that can fail; a cell too
// large for the budget is listed as skipped with its reason, never as passing.
//   op cases      every op of the op-case library (cases/), its verify and
//                 bench suites (--quick: their small sizes; an op with
//                 neither, linear, its test suite as one group): world 1,
//                 verify_op_case's checks (repeatability, row invariance, on
//                 CUDA every output equal to the CPU's);
//   sp_region     plain and modulated rmsnorm, gate_residual and the fused
//                 gate_residual_rmsnorm (their sp_* forms) x both packings x
//                 B in {1, 2} x --seq x --worlds: every rank equal to WS1 on
//                 the device; the naive-SP contrast at worlds 2, 4, 8
//                 (informational); on CUDA WS1 equal to the CPU's, and every
//                 problem again in the torch profile (no CPU comparison: the
//                 CPU has none);
//   tp            tp_adaln_projection T = 1..4 (--quick 1, 4) x --worlds, on
//                 CUDA its WS1 against the CPU's, and again in the torch
//                 profile.
// On CUDA the op cases that take a profile run again in the torch profile
// (repeatability and row invariance; verify_op_case). What the matrix does
// not enumerate it names, with the reason, in the report's
// "matrix.not_enumerated".
#include <algorithm>
#include <cstdlib>
#include <functional>
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

// A group planned before it runs: its coordinates, its cost (elements of its
// largest tensor) and how to run it (into the groups it makes).
struct Planned {
  MatrixGroup head;                      // op, name, coordinates; rows empty
  std::vector<std::string> row_checks;   // the rows a skipped group lists
  std::vector<int> row_worlds;
  double cost = 0;
  std::function<Status(std::vector<MatrixGroup>*)> run;
};

double largest_tensor(const cases::OpCase& c) {
  double most = 0;
  for (const cases::TensorSpec& t : c.tensors) {
    double n = 1;
    for (int64_t d : t.shape) n *= static_cast<double>(d);
    most = std::max(most, n);
  }
  return most;
}

std::string with_commas(double v) {
  std::string digits = std::to_string(static_cast<long long>(v)), out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

void set_index(const cases::IndexCase& index, MatrixGroup* g) {
  g->packing = cases::packing_name(index.packing);
  g->batch = index.batch;
  g->seq_len = index.seq_len;
}

// The profiles a matrix on `device` runs: the torch profile runs on CUDA only.
std::vector<Numerics> profiles_on(const Device& device) {
  if (device.is_cuda()) return {Numerics::kPortable, Numerics::kTorch};
  return {Numerics::kPortable};
}

// A group's name and profile coordinate; the torch profile's groups say so in their name too.
void set_profile(Numerics numerics, MatrixGroup* g) {
  if (numerics == Numerics::kPortable) return;
  g->profile = "torch";
  g->name += " torch";
}

// The op-case library's groups: one per verify or bench case (world 1).
void plan_op_cases(const VerifyContext& ctx, std::vector<Planned>* plan) {
  cases::CaseContext cc = case_context(*ctx.weights, ctx.quick, ctx.seed);
  cc.small = ctx.quick;
  for (const std::string& op : cases::case_ops()) {
    std::vector<cases::OpCase> all = cases::op_cases(op, cases::Suite::kVerify, cc);
    for (cases::OpCase& c : cases::op_cases(op, cases::Suite::kBench, cc)) all.push_back(std::move(c));
    const bool test_suite = all.empty();
    if (test_suite) all = cases::op_cases(op, cases::Suite::kTest, cc);
    if (all.empty()) continue;
    auto add_group = [&](std::vector<cases::OpCase> group, const std::string& name, Numerics numerics) {
      Planned p;
      p.head.op = op;
      p.head.name = name;
      set_profile(numerics, &p.head);
      if (group.size() == 1 && !group[0].plans.empty()) set_index(group[0].plans[0].index, &p.head);
      for (const cases::OpCase& c : group) p.cost = std::max(p.cost, largest_tensor(c));
      p.row_checks = {"op case checks"};
      p.row_worlds = {1};
      const VerifyContext* context = &ctx;
      p.run = [context, group, head = p.head](std::vector<MatrixGroup>* out) {
        MatrixGroup g = head;
        if (group.size() == 1) {
          DETDIT_RETURN_IF_ERROR(verify_op_case(*context, group[0], &g.rows));
        } else {
          // Many small cases: one row per check name, the comparisons summed,
          // the first failing case's detail.
          for (const cases::OpCase& c : group) {
            std::vector<CheckRow> rows;
            DETDIT_RETURN_IF_ERROR(verify_op_case(*context, c, &rows));
            for (CheckRow& r : rows) {
              if (!r.pass) r.detail = c.name + ": " + r.detail;
              auto it = std::find_if(g.rows.begin(), g.rows.end(), [&](const CheckRow& x) { return x.check == r.check; });
              if (it == g.rows.end()) {
                g.rows.push_back(std::move(r));
                continue;
              }
              it->bitwise_run += r.bitwise_run;
              it->bitwise_passed += r.bitwise_passed;
              it->seconds += r.seconds;
              if (!std::isnan(r.max_error) && !(r.max_error <= it->max_error)) it->max_error = r.max_error;
              if (!r.pass && it->pass) it->detail = r.detail;
              it->pass = it->pass && r.pass;
            }
          }
        }
        g.worlds.assign(g.rows.size(), 1);
        out->push_back(std::move(g));
        return Status::ok_status();
      };
      plan->push_back(std::move(p));
    };
    // A group per profile: on CUDA the cases that take a profile run again in
    // the torch profile. name_of(n): the group's name when it holds n cases.
    auto add = [&](const std::vector<cases::OpCase>& cases_of_group,
                   const std::function<std::string(std::size_t)>& name_of) {
      for (Numerics numerics : profiles_on(ctx.device)) {
        std::vector<cases::OpCase> group;
        for (const cases::OpCase& c : cases_of_group) {
          if (numerics != Numerics::kPortable && !c.takes_profile) continue;
          group.push_back(c);
          group.back().numerics = numerics;
        }
        if (group.empty()) continue;
        const std::string name = name_of(group.size());
        add_group(std::move(group), name, numerics);
      }
    };
    if (test_suite) {
      add(all, [](std::size_t n) { return "test suite, " + std::to_string(n) + " cases (no verify or bench cases)"; });
      continue;
    }
    for (cases::OpCase& c : all) add({c}, [&c](std::size_t) { return c.name; });
    if (op == "rmsnorm") {
      // The verify and bench cases are modulated; the plain norm alone from the test suite.
      std::vector<cases::OpCase> plain;
      for (cases::OpCase& c : cases::op_cases(op, cases::Suite::kTest, cc))
        if (c.name.rfind("plain ", 0) == 0) plain.push_back(std::move(c));
      if (!plain.empty()) add(plain, [](std::size_t n) { return "plain, test suite, " + std::to_string(n) + " cases"; });
    }
  }
}

// The matrix's op of each sp_region variant, in kSpVariants' order.
const char* const kSpOps[] = {"sp_rmsnorm_plain", "sp_rmsnorm_modulated", "sp_gate_residual",
                              "sp_gate_residual_rmsnorm"};
static_assert(std::size(kSpOps) == std::size(kSpVariants), "an op name per sp_region variant");

// The op of a variant (by its sp_variant_name), and the variant of an op ("" for none).
std::string sp_op(const std::string& variant) {
  for (std::size_t i = 0; i < std::size(kSpOps); ++i)
    if (variant == sp_variant_name(kSpVariants[i])) return kSpOps[i];
  return variant;
}
std::string sp_variant_of(const std::string& op) {
  for (std::size_t i = 0; i < std::size(kSpOps); ++i)
    if (op == kSpOps[i]) return sp_variant_name(kSpVariants[i]);
  return "";
}

void plan_sp(const VerifyContext& ctx, const MatrixOptions& options, std::vector<Planned>* plan) {
  const std::vector<cases::SpRegionCase> problems =
      cases::sp_region_matrix_cases(case_context(*ctx.weights, ctx.quick, ctx.seed), options.seq_lens, options.worlds);
  for (Numerics numerics : profiles_on(ctx.device)) {
    for (const cases::SpRegionCase& c : problems) {
      // The naive contrast once, in the portable profile (informational; the profile changes no order).
      const std::vector<int> naive = numerics == Numerics::kPortable ? c.naive_worlds : std::vector<int>{};
      cases::SpShape shape = c.shape;
      shape.numerics = numerics;
      Planned p;
      p.head.op = "sp_region";
      p.head.name = c.name;
      set_profile(numerics, &p.head);
      p.head.packing = cases::packing_name(shape.packing);
      p.head.batch = shape.batch;
      p.head.seq_len = shape.seq_len;
      p.cost = static_cast<double>(shape.batch * shape.seq_len * shape.hidden);
      for (int w : c.worlds) {
        p.row_checks.push_back("ws=" + std::to_string(w));
        p.row_worlds.push_back(w);
      }
      for (int w : naive) {
        p.row_checks.push_back("naive ws=" + std::to_string(w) + " (info)");
        p.row_worlds.push_back(w);
      }
      if (ctx.device.is_cuda() && numerics == Numerics::kPortable) {
        p.row_checks.push_back("ws1 = cpu ws1");
        p.row_worlds.push_back(1);
      }
      const VerifyContext* context = &ctx;
      const std::vector<int> worlds = c.worlds;
      const std::string corrupt = options.corrupt;
      p.run = [context, shape, worlds, naive, corrupt, head = p.head](std::vector<MatrixGroup>* out) {
        std::vector<SpMatrixRows> rows;
        // The hook names an op of the matrix; the SP runs know their variants.
        DETDIT_RETURN_IF_ERROR(verify_sp_matrix(*context, shape, worlds, naive, sp_variant_of(corrupt), &rows));
        for (SpMatrixRows& r : rows) {
          MatrixGroup g = head;
          g.op = sp_op(r.variant);
          g.rows = std::move(r.rows);
          g.worlds = std::move(r.worlds);
          out->push_back(std::move(g));
        }
        return Status::ok_status();
      };
      plan->push_back(std::move(p));
    }
  }
}

void plan_tp(const VerifyContext& ctx, const MatrixOptions& options, std::vector<Planned>* plan) {
  const std::vector<cases::TpCase> problems =
      cases::tp_adaln_projection_matrix_cases(case_context(*ctx.weights, ctx.quick, ctx.seed), options.worlds);
  for (Numerics numerics : profiles_on(ctx.device)) {
    for (const cases::TpCase& c : problems) {
      cases::TpShape shape = c.shape;
      shape.numerics = numerics;
      Planned p;
      p.head.op = "tp_adaln_projection";
      p.head.name = c.name;
      set_profile(numerics, &p.head);
      p.head.timesteps = shape.timesteps;
      p.cost = static_cast<double>(shape.out_features) * static_cast<double>(shape.in_features);
      for (int w : c.worlds) {
        p.row_checks.push_back("tp=" + std::to_string(w));
        p.row_worlds.push_back(w);
      }
      const bool cpu_check = ctx.device.is_cuda() && numerics == Numerics::kPortable;
      if (cpu_check) {
        p.row_checks.push_back("ws1 = cpu ws1");
        p.row_worlds.push_back(1);
      }
      const VerifyContext* context = &ctx;
      const std::vector<int> worlds = c.worlds;
      p.run = [context, worlds, shape, cpu_check, head = p.head](std::vector<MatrixGroup>* out) {
        MatrixGroup g = head;
        DETDIT_RETURN_IF_ERROR(verify_tp_worlds(*context, shape, worlds, cpu_check, &g.rows));
        g.worlds = worlds;
        if (cpu_check) g.worlds.push_back(1);
        if (g.rows.size() != g.worlds.size()) return Status::runtime_error("tp: a row per world size expected");
        out->push_back(std::move(g));
        return Status::ok_status();
      };
      plan->push_back(std::move(p));
    }
  }
}

}  // namespace

std::vector<MatrixNote> matrix_not_enumerated(const Device& device) {
  std::vector<MatrixNote> notes;
  if (device.is_cuda()) {
    notes.push_back({"the torch profile against PyTorch eager, and its accuracy",
                     "the torch-profile cells check repeatability, row invariance and SP/TP = WS1 on this GPU; "
                     "the CPU reference, the FP64 oracle's bounds and the equivalent routes define the portable "
                     "profile only; scripts/torch_parity.py and scripts/torch_compare.py compare the torch profile "
                     "with PyTorch eager, outside this report"});
  } else {
    notes.push_back({"profile torch", "CUDA only (the torch profile on the CPU is a ValueError)"});
    notes.push_back({"device cuda and the CPU comparison of each GPU result",
                     "this run is on the CPU; run detdit verify --matrix --device cuda on a GPU"});
  }
  notes.push_back({"world sizes over a real communicator",
                   "the matrix runs its ranks in-process (threads sharing one device); detdit verify --comm mpi "
                   "writes its own report, which nothing merges into the matrix"});
  return notes;
}

Status run_matrix(const VerifyContext& ctx, const MatrixOptions& options, const std::set<std::string>& ops,
                  bool show_progress, std::vector<MatrixGroup>* groups) {
  std::vector<Planned> plan;
  plan_op_cases(ctx, &plan);
  plan_sp(ctx, options, &plan);
  plan_tp(ctx, options, &plan);
  std::set<std::string> known;
  for (const Planned& p : plan) {
    known.insert(p.head.op);
    if (p.head.op == "sp_region") known.insert(std::begin(kSpOps), std::end(kSpOps));
  }
  for (const std::string& op : ops)
    if (!known.count(op)) return Status::value_error("--ops: no matrix cells for op '" + op + "'");
  if (!options.corrupt.empty() && !known.count(options.corrupt))
    return Status::value_error("DETDIT_TEST_CORRUPT_CELLS: no matrix cells for op '" + options.corrupt + "'");
  auto wanted = [&ops](const std::string& op) {
    if (ops.empty() || ops.count(op)) return true;
    if (op != "sp_region") return false;
    for (const char* sp : kSpOps)
      if (ops.count(sp)) return true;
    return false;
  };
  std::vector<const Planned*> selected;
  for (const Planned& p : plan)
    if (wanted(p.head.op)) selected.push_back(&p);
  Progress progress("detdit verify --matrix", selected.size(), show_progress);
  for (const Planned* p : selected) {
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
      for (std::size_t v = 0; v < (sp ? std::size(kSpOps) : 1); ++v) {
        const std::string op = sp ? kSpOps[v] : p->head.op;
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
