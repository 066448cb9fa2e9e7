// The verify driver over the op-case library (cases/): the checks every op
// case gets (verify.h declares verify_op_case), and the case context of a
// verify or bench run (the weights' dimensions and tensors).
//   accuracy vs fp64          each of the case's FP64-oracle checks;
//   forward repeatability     a second run on fresh outputs (forward, then backward)
//                             gives the forward's bytes again;
//   backward repeatability    and the backward's (the same second run: each run
//                             makes every input and output anew, a few seconds at
//                             the H3 sizes);
//   <the equivalent route>    where the case has one (cases::EquivalentRoute):
//                             every output (the forward's, where the route is
//                             forward_only) recomputed by it on the CPU, equal;
//   row invariance            probe positions alone (OpCase::alone_probes of
//                             them) equal the same positions of the first run
//                             (cases::compare_positions_alone);
//   cuda = cpu reference      on CUDA: every output equal to the CPU's.
// An op with several verify cases (e.g. sizes) names each row's case after its check.
// A case in the torch profile (CUDA only) gets the repeatability and row
// invariance checks alone: the CPU reference, the FP64 oracle's bounds and
// the equivalent routes (computed on the CPU) define the portable profile.
#include <map>
#include <string>
#include <vector>

#include "verify.h"

namespace detdit {
namespace cli {
namespace {

// `count` positions from the first to the last, evenly spread; every
// position when there are no more.
std::vector<int64_t> probe_positions(int64_t positions, int64_t count) {
  std::vector<int64_t> probes;
  if (positions <= count || count < 2) {
    for (int64_t p = 0; p < positions; ++p) probes.push_back(p);
    return probes;
  }
  for (int64_t i = 0; i < count; ++i) probes.push_back(i * (positions - 1) / (count - 1));
  return probes;
}

// The case on `device` through `phases`; host copies of every tensor.
Status run_phases(const cases::OpCase& c, const Device& device, int phases, std::map<std::string, HostTensor>* host) {
  cases::Instance t;
  DETDIT_RETURN_IF_ERROR(cases::instantiate(c, device, nullptr, &t));
  for (int phase = 0; phase < phases; ++phase) DETDIT_RETURN_IF_ERROR(cases::run(c, static_cast<cases::Phase>(phase), t));
  return cases::download(c, t, host);
}

}  // namespace

cases::CaseContext case_context(const Weights& weights, bool quick, uint64_t seed) {
  cases::CaseContext ctx;
  ctx.hidden = weights.config.hidden;
  ctx.time_embed_dim = weights.config.time_embed_dim;
  ctx.time_embed_hidden = weights.config.time_embed_hidden;
  ctx.freq_dim = weights.config.freq_dim;
  const Weights* w = &weights;
  ctx.weight = [w](const std::string& name, TensorView* view) { return w->view(name, view); };
  ctx.quick = quick;
  ctx.seed = seed;
  return ctx;
}

Status verify_op_case(const VerifyContext& ctx, const cases::OpCase& c, std::vector<CheckRow>* rows) {
  const int phases = c.has(cases::Phase::kBackward) ? 2 : 1;
  const bool portable = c.numerics == Numerics::kPortable;
  const std::vector<cases::AccuracyCheck> no_checks;
  const std::vector<cases::AccuracyCheck>& accuracy = portable ? c.accuracy : no_checks;
  std::map<std::string, HostTensor> first;
  Status ran;
  rows->push_back(timed_check(accuracy.empty() ? "run" : accuracy.front().name, [&](CheckRow* row) {
    ran = run_phases(c, ctx.device, phases, &first);
    DETDIT_RETURN_IF_ERROR(ran);
    if (accuracy.empty()) return Status::ok_status();
    const cases::AccuracyCheck& a = accuracy.front();
    row->max_error = a.error(first);
    row->bound = a.bound;
    row->error_unit = a.unit;
    return Status::ok_status();
  }));
  if (!ran.ok()) return Status::ok_status();
  for (std::size_t i = 1; i < accuracy.size(); ++i) {
    const cases::AccuracyCheck& a = accuracy[i];
    rows->push_back(timed_check(a.name, [&](CheckRow* row) {
      row->max_error = a.error(first);
      row->bound = a.bound;
      row->error_unit = a.unit;
      return Status::ok_status();
    }));
  }
  std::map<std::string, HostTensor> again;
  Status ran_again;
  for (int phase = 0; phase < phases; ++phase) {
    const cases::Phase p = static_cast<cases::Phase>(phase);
    rows->push_back(timed_check(std::string(phase == 0 ? "forward" : "backward") + " repeatability", [&](CheckRow* row) {
      if (phase == 0) ran_again = run_phases(c, ctx.device, phases, &again);
      DETDIT_RETURN_IF_ERROR(ran_again);
      add_output_reports(cases::compare_outputs(c, p, first, again), row);
      return Status::ok_status();
    }));
  }
  again.clear();
  if (c.equivalent.compute && portable) {  // the same outputs by a second route (e.g. the fused op's separate ops)
    rows->push_back(timed_check(c.equivalent.name, [&](CheckRow* row) {
      std::map<std::string, HostTensor> expected;
      DETDIT_RETURN_IF_ERROR(c.equivalent.compute(first, &expected));
      for (int phase = 0; phase < (c.equivalent.forward_only ? 1 : phases); ++phase)
        add_output_reports(cases::compare_outputs(c, static_cast<cases::Phase>(phase), expected, first), row);
      return Status::ok_status();
    }));
  }
  if (c.alone && c.positions > 1) {
    rows->push_back(timed_check("row invariance (position alone)", [&](CheckRow* row) {
      std::vector<cases::OutputReport> reports;
      const std::vector<int64_t> probes = probe_positions(c.positions, c.alone_probes);
      DETDIT_RETURN_IF_ERROR(cases::compare_positions_alone(c, ctx.device, probes, &reports, &first));
      add_output_reports(reports, row);
      return Status::ok_status();
    }));
  }
  if (ctx.device.is_cuda() && portable) {
    rows->push_back(timed_check("cuda = cpu reference", [&](CheckRow* row) {
      std::map<std::string, HostTensor> reference;
      DETDIT_RETURN_IF_ERROR(run_phases(c, Device::cpu(), phases, &reference));
      for (int phase = 0; phase < phases; ++phase)
        add_output_reports(cases::compare_outputs(c, static_cast<cases::Phase>(phase), reference, first), row);
      return Status::ok_status();
    }));
  }
  return Status::ok_status();
}

Status verify_op_cases(const VerifyContext& ctx, const std::string& op, std::vector<CheckRow>* rows) {
  const std::vector<cases::OpCase> all =
      cases::op_cases(op, cases::Suite::kVerify, case_context(*ctx.weights, ctx.quick, ctx.seed));
  if (all.empty()) return Status::value_error("no verify cases registered for " + op);
  for (const cases::OpCase& c : all) {
    const std::size_t first = rows->size();
    DETDIT_RETURN_IF_ERROR(verify_op_case(ctx, c, rows));
    // Several cases of one op (e.g. sizes) share check names: each row names its case.
    if (all.size() > 1)
      for (std::size_t i = first; i < rows->size(); ++i) (*rows)[i].check += " " + c.name;
  }
  return Status::ok_status();
}

// The verify cases that are the op-case library's verify suite (run: nullptr),
// named by the situation the report shows.
DETDIT_VERIFY_CASE("timestep_sinusoid", "F from weights", true, true, nullptr);
DETDIT_VERIFY_CASE("timestep_mlp", "weights T=4", true, true, nullptr);
DETDIT_VERIFY_CASE("adaln_projection", "block 0, weights' shape", true, true, nullptr);
DETDIT_VERIFY_CASE("adaln_modulation", "block 0, fwd+bwd", true, true, nullptr);
DETDIT_VERIFY_CASE("final_adaln_out", "norm_out, fwd+bwd", true, true, nullptr);
DETDIT_VERIFY_CASE("rmsnorm", "modulated, norm1 of block 0", true, true, nullptr);
DETDIT_VERIFY_CASE("adaln_row_gather", "six chunks", true, true, nullptr);
DETDIT_VERIFY_CASE("gate_residual", "gate_msa, 3 randn sublayer", true, true, nullptr);
DETDIT_VERIFY_CASE("gate_residual_rmsnorm", "gate_msa then norm2, d_h", true, true, nullptr);
DETDIT_VERIFY_CASE("chain", "blocks 0..1, fwd+bwd, T=2", true, true, nullptr);

}  // namespace cli
}  // namespace detdit
