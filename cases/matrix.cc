// The matrix's plan (matrix.h).
#include "cases/matrix.h"

#include <algorithm>
#include <cmath>
#include <iterator>

namespace detdit {
namespace cases {
namespace {

std::string with_commas(double v) {
  std::string digits = std::to_string(static_cast<long long>(v)), out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

bool matrix_wants(const std::set<std::string>& ops, const std::string& op) {
  if (ops.empty() || ops.count(op)) return true;
  if (op != "sp_region") return false;
  for (const char* sp : kSpOps)
    if (ops.count(sp)) return true;
  return false;
}

double largest_tensor(const OpCase& c) {
  double most = 0;
  for (const TensorSpec& t : c.tensors) {
    double n = 1;
    for (int64_t d : t.shape) n *= static_cast<double>(d);
    most = std::max(most, n);
  }
  return most;
}

void set_index(const IndexCase& index, MatrixGroup* g) {
  g->packing = packing_name(index.packing);
  g->batch = index.batch;
  g->seq_len = index.seq_len;
}

// The profiles a matrix on `device` runs: the torch profile runs on CUDA only.
std::vector<Numerics> profiles_on(const Device& device) {
  if (device.is_cuda()) return {Numerics::kPortable, Numerics::kTorch};
  return {Numerics::kPortable};
}

// An empty plan of `op`'s group `name` in the profile of `numerics`; the
// torch profile's groups say so in their name too.
MatrixPlan group_plan(const std::string& op, const std::string& name, Numerics numerics) {
  MatrixPlan p;
  p.head.op = op;
  p.head.name = name;
  if (numerics != Numerics::kPortable) {
    p.head.profile = "torch";
    p.head.name += " torch";
  }
  return p;
}

// The rows a plan lists when skipped: `check` at `world`, or one
// `prefix`N`suffix` per world N of `worlds`.
void add_row(const std::string& check, int world, MatrixPlan* p) {
  p->row_checks.push_back(check);
  p->row_worlds.push_back(world);
}
void add_world_rows(const std::string& prefix, const std::vector<int>& worlds, const std::string& suffix,
                    MatrixPlan* p) {
  for (int w : worlds) add_row(prefix + std::to_string(w) + suffix, w, p);
}

// The op-case library's groups: one per verify or bench case (world 1).
void plan_op_cases(const CaseContext& context, const Device& device, std::vector<MatrixPlan>* plan) {
  CaseContext cc = context;
  cc.small = context.quick;
  for (const std::string& op : case_ops()) {
    std::vector<OpCase> all = op_cases(op, Suite::kVerify, cc);
    for (OpCase& c : op_cases(op, Suite::kBench, cc)) all.push_back(std::move(c));
    const bool test_suite = all.empty();
    if (test_suite) all = op_cases(op, Suite::kTest, cc);
    if (all.empty()) continue;
    auto add_group = [&](std::vector<OpCase> group, const std::string& name, Numerics numerics) {
      MatrixPlan p = group_plan(op, name, numerics);
      if (group.size() == 1 && !group[0].plans.empty()) set_index(group[0].plans[0].index, &p.head);
      for (const OpCase& c : group) p.cost = std::max(p.cost, largest_tensor(c));
      add_row("op case checks", 1, &p);
      p.run = [device, group, head = p.head](std::vector<MatrixGroup>* out) {
        MatrixGroup g = head;
        if (group.size() == 1) {
          DETDIT_RETURN_IF_ERROR(check_op_case(group[0], device, &g.rows));
        } else {
          // Many small cases: one row per check name, the comparisons summed,
          // the first failing case's detail.
          for (const OpCase& c : group) {
            std::vector<CheckRow> rows;
            DETDIT_RETURN_IF_ERROR(check_op_case(c, device, &rows));
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
    auto add = [&](const std::vector<OpCase>& cases_of_group,
                   const std::function<std::string(std::size_t)>& name_of) {
      for (Numerics numerics : profiles_on(device)) {
        std::vector<OpCase> group;
        for (const OpCase& c : cases_of_group) {
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
    for (OpCase& c : all) add({c}, [&c](std::size_t) { return c.name; });
    if (op == "rmsnorm") {
      // The verify and bench cases are modulated; the plain norm alone from the test suite.
      std::vector<OpCase> plain;
      for (OpCase& c : op_cases(op, Suite::kTest, cc))
        if (c.name.rfind("plain ", 0) == 0) plain.push_back(std::move(c));
      if (!plain.empty()) add(plain, [](std::size_t n) { return "plain, test suite, " + std::to_string(n) + " cases"; });
    }
  }
}

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

void plan_sp(const CaseContext& context, const Device& device, const std::vector<int64_t>& seq_lens,
             const std::vector<int>& worlds_of_run, const std::string& corrupt, std::vector<MatrixPlan>* plan) {
  const std::vector<SpRegionCase> problems = sp_region_matrix_cases(context, seq_lens, worlds_of_run);
  for (Numerics numerics : profiles_on(device)) {
    for (const SpRegionCase& c : problems) {
      // The naive contrast once, in the portable profile (informational; the profile changes no order).
      const std::vector<int> naive = numerics == Numerics::kPortable ? c.naive_worlds : std::vector<int>{};
      SpShape shape = c.shape;
      shape.numerics = numerics;
      MatrixPlan p = group_plan("sp_region", c.name, numerics);
      p.head.packing = packing_name(shape.packing);
      p.head.batch = shape.batch;
      p.head.seq_len = shape.seq_len;
      p.cost = static_cast<double>(shape.batch * shape.seq_len * shape.hidden);
      add_world_rows("ws=", c.worlds, "", &p);
      add_world_rows("naive ws=", naive, " (info)", &p);
      if (device.is_cuda() && numerics == Numerics::kPortable) add_row("ws1 = cpu ws1", 1, &p);
      p.run = [context, device, shape, worlds = c.worlds, naive, corrupt, head = p.head](std::vector<MatrixGroup>* out) {
        std::vector<SpVariantRows> rows;
        // The hook names an op of the matrix; the SP runs know their variants.
        DETDIT_RETURN_IF_ERROR(check_sp_matrix(context, device, shape, worlds, naive, sp_variant_of(corrupt), &rows));
        for (SpVariantRows& r : rows) {
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

void plan_tp(const CaseContext& context, const Device& device, const std::vector<int>& worlds_of_run,
             std::vector<MatrixPlan>* plan) {
  const std::vector<TpCase> problems = tp_adaln_projection_matrix_cases(context, worlds_of_run);
  for (Numerics numerics : profiles_on(device)) {
    for (const TpCase& c : problems) {
      TpShape shape = c.shape;
      shape.numerics = numerics;
      MatrixPlan p = group_plan("tp_adaln_projection", c.name, numerics);
      p.head.timesteps = shape.timesteps;
      p.cost = static_cast<double>(shape.out_features) * static_cast<double>(shape.in_features);
      add_world_rows("tp=", c.worlds, "", &p);
      const bool cpu_check = device.is_cuda() && numerics == Numerics::kPortable;
      if (cpu_check) add_row("ws1 = cpu ws1", 1, &p);
      p.run = [context, device, worlds = c.worlds, shape, cpu_check, head = p.head](std::vector<MatrixGroup>* out) {
        MatrixGroup g = head;
        DETDIT_RETURN_IF_ERROR(check_tp_worlds(context, device, nullptr, shape, worlds, cpu_check, &g.rows));
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

std::vector<MatrixPlan> plan_matrix(const CaseContext& context, const Device& device,
                                    const std::vector<int64_t>& seq_lens, const std::vector<int>& worlds,
                                    const std::string& corrupt) {
  std::vector<MatrixPlan> plan;
  plan_op_cases(context, device, &plan);
  plan_sp(context, device, seq_lens, worlds, corrupt, &plan);
  plan_tp(context, device, worlds, &plan);
  return plan;
}

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

Status select_matrix(const std::vector<MatrixPlan>& plan, const std::set<std::string>& ops, const std::string& corrupt,
                     std::vector<const MatrixPlan*>* selected) {
  std::set<std::string> known;
  for (const MatrixPlan& p : plan) {
    known.insert(p.head.op);
    if (p.head.op == "sp_region") known.insert(std::begin(kSpOps), std::end(kSpOps));
  }
  for (const std::string& op : ops)
    if (!known.count(op)) return Status::value_error("--ops: no matrix cells for op '" + op + "'");
  if (!corrupt.empty() && !known.count(corrupt))
    return Status::value_error("DETDIT_TEST_CORRUPT_CELLS: no matrix cells for op '" + corrupt + "'");
  for (const MatrixPlan& p : plan)
    if (matrix_wants(ops, p.head.op)) selected->push_back(&p);
  return Status::ok_status();
}

void run_matrix_group(const MatrixPlan& p, const std::set<std::string>& ops, double budget,
                      std::vector<MatrixGroup>* groups) {
  const std::size_t first = groups->size();
  const double start = now_seconds();
  if (budget > 0 && p.cost > budget) {
    const std::string reason = "skipped: its largest tensor has " + with_commas(p.cost) +
                               " elements, over this run's budget of " + with_commas(budget) +
                               " (--matrix-budget; 0: no budget)";
    const bool sp = p.head.op == "sp_region";
    for (std::size_t v = 0; v < (sp ? std::size(kSpOps) : 1); ++v) {
      const std::string op = sp ? kSpOps[v] : p.head.op;
      if (!matrix_wants(ops, op)) continue;
      if (sp && p.head.profile != "portable" && !sp_variant_takes_profile(kSpVariants[v])) continue;
      MatrixGroup g = p.head;
      g.op = op;
      for (std::size_t i = 0; i < p.row_checks.size(); ++i) {
        if (sp && !sp_variant_has_naive_contrast(kSpVariants[v]) && p.row_checks[i].rfind("naive", 0) == 0) continue;
        CheckRow row;
        row.check = p.row_checks[i];
        row.skipped = true;
        row.detail = reason;
        g.rows.push_back(row);
        g.worlds.push_back(p.row_worlds[i]);
      }
      groups->push_back(std::move(g));
    }
  } else {
    Status s = p.run(groups);
    if (!s.ok()) {
      MatrixGroup g = p.head;
      CheckRow row;
      row.check = "cells ran";
      row.detail = s.to_string();
      g.rows.push_back(row);
      g.worlds.push_back(0);
      groups->push_back(std::move(g));
    }
  }
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
  const double seconds = now_seconds() - start;
  const double made = static_cast<double>(groups->size() - first);
  groups->erase(std::remove_if(groups->begin() + static_cast<std::ptrdiff_t>(first), groups->end(),
                               [&](const MatrixGroup& g) { return !matrix_wants(ops, g.op); }),
                groups->end());
  for (std::size_t i = first; i < groups->size(); ++i) {
    (*groups)[i].seconds = seconds / made;
    for (CheckRow& row : (*groups)[i].rows) row.informational = row.informational && row.pass;
  }
}

}  // namespace cases
}  // namespace detdit
