// The cases `detdit verify` runs: the op-case library's verify suite of each
// op and its parallel problems, named by the situation the report shows. The
// problems, their sizes and world sizes and every check are cases/'s
// (cases/op_case.h, cases/parallel_cases.h, cases/checks.h).
#include <string>
#include <vector>

#include "verify.h"

namespace detdit {
namespace cli {

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

Status verify_op_cases(const VerifyContext& ctx, const std::string& op, std::vector<CheckRow>* rows) {
  const std::vector<cases::OpCase> all =
      cases::op_cases(op, cases::Suite::kVerify, case_context(*ctx.weights, ctx.quick, ctx.seed));
  if (all.empty()) return Status::value_error("no verify cases registered for " + op);
  return cases::check_op_cases(all, ctx.device, rows);
}

namespace {

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

// ---- the parallel problems: every rank byte-equal to WS1 on the same device ----

cases::ParallelSetting setting_of(const VerifyContext& ctx) {
  cases::ParallelSetting s;
  s.cuda = ctx.device.is_cuda();
  s.quick = ctx.quick;
  s.full = ctx.full;
  s.mpi_world = ctx.comm != nullptr ? ctx.comm->world_size() : 0;
  return s;
}

// The case named `name` of a family's list (nullptr: none).
template <typename Case>
const Case* find_case(const std::vector<Case>& all, const std::string& name) {
  for (const Case& c : all)
    if (c.name == name) return &c;
  return nullptr;
}

std::vector<cases::SpRegionCase> sp_cases(const VerifyContext& ctx) {
  return cases::sp_region_cases(case_context(*ctx.weights, ctx.quick, ctx.seed), setting_of(ctx));
}
std::vector<cases::TpCase> tp_cases(const VerifyContext& ctx) {
  return cases::tp_adaln_projection_cases(case_context(*ctx.weights, ctx.quick, ctx.seed), setting_of(ctx));
}

Status verify_sp(const VerifyContext& ctx, const std::string& name, std::vector<CheckRow>* rows) {
  const std::vector<cases::SpRegionCase> all = sp_cases(ctx);
  const cases::SpRegionCase* c = find_case(all, name);
  if (c == nullptr) return Status::value_error("no sp_region case " + name);
  return cases::check_sp_region(case_context(*ctx.weights, ctx.quick, ctx.seed), ctx.device, ctx.comm, *c, rows);
}
bool sp_enabled(const VerifyContext& ctx, const std::string& name) {
  const std::vector<cases::SpRegionCase> all = sp_cases(ctx);
  const cases::SpRegionCase* c = find_case(all, name);
  return c != nullptr && c->enabled;
}

Status verify_tp(const VerifyContext& ctx, const std::string& name, std::vector<CheckRow>* rows) {
  const std::vector<cases::TpCase> all = tp_cases(ctx);
  const cases::TpCase* c = find_case(all, name);
  if (c == nullptr) return Status::value_error("no tp_adaln_projection case " + name);
  return cases::check_tp_worlds(case_context(*ctx.weights, ctx.quick, ctx.seed), ctx.device, ctx.comm, c->shape,
                                c->worlds, false, rows);
}
bool tp_enabled(const VerifyContext& ctx, const std::string& name) {
  const std::vector<cases::TpCase> all = tp_cases(ctx);
  const cases::TpCase* c = find_case(all, name);
  return c != nullptr && c->enabled;
}

// S = 131072 on CUDA only (mpirun, one GPU per rank).
DETDIT_VERIFY_PARALLEL_CASE("sp_region", "S=4097 block", true, true, verify_sp, sp_enabled);
DETDIT_VERIFY_PARALLEL_CASE("sp_region", "S=4097 interleaved", true, true, verify_sp, sp_enabled);
DETDIT_VERIFY_PARALLEL_CASE("sp_region", "S=32768 block", true, true, verify_sp, sp_enabled);
DETDIT_VERIFY_PARALLEL_CASE("sp_region", "S=32768 interleaved", true, true, verify_sp, sp_enabled);
DETDIT_VERIFY_PARALLEL_CASE("sp_region", "S=131072 block", false, true, verify_sp, sp_enabled);
DETDIT_VERIFY_PARALLEL_CASE("sp_region", "S=131072 interleaved", false, true, verify_sp, sp_enabled);
DETDIT_VERIFY_PARALLEL_CASE("tp_adaln_projection", "T=1", true, true, verify_tp, tp_enabled);
DETDIT_VERIFY_PARALLEL_CASE("tp_adaln_projection", "T=2", true, true, verify_tp, tp_enabled);
DETDIT_VERIFY_PARALLEL_CASE("tp_adaln_projection", "T=3", true, true, verify_tp, tp_enabled);
DETDIT_VERIFY_PARALLEL_CASE("tp_adaln_projection", "T=4", true, true, verify_tp, tp_enabled);

}  // namespace
}  // namespace cli
}  // namespace detdit
