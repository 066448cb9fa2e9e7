// The cases of the GEMV family: linear (forward with bias / SiLU /
// pre-activation / fp32 output; backward d_x through the 64-row chunk partials
// and d_W, d_b), adaln_projection, adaln_modulation and final_adaln_out.
//
// Suites: kTest sweeps awkward shapes (N = 1, 64, 72, 128, 200; K = 8, 24, 264;
// T = 1, 3, 5, 9) and a few H3 shapes; kBench the H3 shapes with the weights'
// tensors (the AdaLN projection at T = 1, 3, 4, 8, 16, 32; adaln_modulation and
// final_adaln_out at S = 32768, B = 2, T = 3); kVerify the AdaLN projection on
// block 0's weights with its FP64 oracles, and adaln_modulation (block 0's
// projection) and final_adaln_out (norm_out) forward and backward on verify's
// fused sequence (S = 2048, B = 2, T = 3) with their weight gradients correctly
// rounded against FP64. Inputs are pure functions of the
// case's seeds (counter-uniform values, cases/tensor.h; verify's temb from
// the synthetic-weights stream).
#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "cases/case_builders.h"
#include "cases/op_case.h"
#include "cases/oracle.h"
#include "detdit/adaln.h"
#include "detdit/linear.h"

namespace detdit {
namespace cases {
namespace {


int64_t chunks_of(int64_t n) { return (n + kLinearChunkRows - 1) / kLinearChunkRows; }

}  // namespace

// ---- linear ----------------------------------------------------------------


OpCase linear_case(const LinearShape& s) {
  OpCase c;
  c.op = "linear";
  c.name = std::string(dtype_name(s.dtype)) + " T=" + std::to_string(s.rows) + " K=" + std::to_string(s.in_features) +
           " N=" + std::to_string(s.out_features) + (s.bias ? " bias" : "") + (s.silu ? " silu" : "") + " out " +
           dtype_name(s.out_dtype) + (s.partials ? "" : " scratch partials");
  const int64_t T = s.rows, K = s.in_features, N = s.out_features;
  c.input("x", Phase::kForward, s.dtype, {T, K}, uniform_values(s.seed, 0.0, 1.0), 0);
  c.input("weight", Phase::kForward, s.dtype, {N, K}, uniform_values(s.seed + 1, 0.0, 0.05));
  if (s.bias) c.input("bias", Phase::kForward, s.dtype, {N}, uniform_values(s.seed + 2, 0.0, 1.0));
  c.output("out", Phase::kForward, s.out_dtype, {T, N}, 0);
  c.output("pre", Phase::kForward, DType::kF32, {T, N}, 0);
  c.input("grad", Phase::kBackward, DType::kF32, {T, N}, uniform_values(s.seed + 3, 0.0, 1.0), 0);
  if (s.partials) c.output("partials", Phase::kBackward, DType::kF32, {chunks_of(N), T, K}, 1);
  c.output("d_x", Phase::kBackward, s.dtype, {T, K}, 0);
  c.output("d_weight", Phase::kBackward, s.dtype, {N, K});
  c.output("d_bias", Phase::kBackward, s.dtype, {N});
  const bool bias = s.bias, silu = s.silu, partials = s.partials;
  c.takes_profile = silu;  // the SiLU's exp
  c.arguments["activation"] = silu ? "silu" : "none";
  c.forward = [bias, silu](const Instance& t, Stream stream) {
    return linear_forward({t["x"], t["weight"], bias ? t["bias"] : TensorView(), t["out"], t["pre"],
                           silu ? Activation::kSilu : Activation::kNone, t.numerics},
                          stream);
  };
  c.backward = [partials](const Instance& t, Stream stream) {
    DETDIT_RETURN_IF_ERROR(linear_backward_input(
        {t["grad"], t["weight"], partials ? t["partials"] : TensorView(), t["d_x"]}, stream));
    return linear_backward_weight({t["grad"], t["x"], t["d_weight"], t["d_bias"]}, stream);
  };
  std::vector<std::string> forward = {"x", "weight", "out", "pre"};
  if (s.bias) forward.push_back("bias");
  c.set_bytes(Phase::kForward, forward);
  // d_x and d_W each read W or x once; the partials are scratch traffic.
  c.set_bytes(Phase::kBackward, {"grad", "weight", "x", "d_x", "d_weight", "d_bias"});
  c.positions = T;
  c.alone = [s](int64_t) {
    LinearShape one = s;
    one.rows = 1;
    return linear_case(one);
  };
  return c;
}

// ---- adaln_projection -------------------------------------------------------------


OpCase adaln_projection_case(const ProjectionShape& s) {
  OpCase c;
  c.op = "adaln_projection";
  c.name = std::string(dtype_name(s.dtype)) + " T=" + std::to_string(s.rows) + " D=" + std::to_string(s.dim) +
           " N=" + std::to_string(s.out_features);
  if (s.chunks > 0)
    c.name += " chunks=" + std::to_string(s.chunks) + " temb " + dtype_name(s.temb_dtype);
  const int64_t T = s.rows, D = s.dim, N = s.out_features;
  c.input("temb", Phase::kForward, s.temb_dtype, {T, D}, s.temb ? s.temb : uniform_values(s.seed, 0.0, 3.0), 0);
  c.input("weight", Phase::kForward, s.dtype, {N, D}, s.weight ? s.weight : uniform_values(s.seed + 1, 0.0, 0.02));
  c.input("bias", Phase::kForward, s.dtype, {N}, s.bias ? s.bias : uniform_values(s.seed + 2, 0.0, 1.0));
  c.output("table", Phase::kForward, s.dtype, {T, N}, 0);
  c.output("act", Phase::kForward, s.dtype, {T, D}, 0);
  c.input("grad_table", Phase::kBackward, DType::kF32, {T, N}, uniform_values(s.seed + 3, 0.0, 1.0), 0);
  c.output("d_temb", Phase::kBackward, DType::kF32, {T, D}, 0);
  c.output("d_weight", Phase::kBackward, s.dtype, {N, D});
  c.output("d_bias", Phase::kBackward, s.dtype, {N});
  c.takes_profile = true;  // the SiLU's exp
  const int chunks = s.chunks;
  if (chunks > 0) c.arguments["chunks"] = std::to_string(chunks);
  auto inputs = [chunks](const Instance& t) {
    return AdalnProjectionInputs{t["temb"], t["weight"], t["bias"], t.numerics, chunks};
  };
  c.forward = [inputs](const Instance& t, Stream stream) {
    return adaln_projection_forward({inputs(t), t["table"], t["act"]}, stream);
  };
  c.backward = [inputs](const Instance& t, Stream stream) {
    return adaln_projection_backward(
        {inputs(t), t["act"], t["grad_table"], t["d_temb"], t["d_weight"], t["d_bias"]}, stream);
  };
  c.set_bytes(Phase::kForward, {"temb", "weight", "bias", "table", "act"});
  c.set_bytes(Phase::kBackward, {"temb", "weight", "act", "grad_table", "d_temb", "d_weight", "d_bias"});
  c.positions = T;
  c.alone = [s](int64_t) {
    ProjectionShape one = s;
    one.rows = 1;
    return adaln_projection_case(one);
  };
  return c;
}

// ---- adaln_table_add ---------------------------------------------------------------


OpCase adaln_table_add_case(const TableAddShape& s) {
  OpCase c;
  c.op = "adaln_table_add";
  c.name = std::string("table ") + dtype_name(s.table_dtype) + " proj " + dtype_name(s.proj_dtype) +
           " T=" + std::to_string(s.rows) + " K=" + std::to_string(s.chunks) + " H=" + std::to_string(s.hidden) +
           (s.broadcast ? " proj (T, 1, H)" : "");
  const int64_t T = s.rows, K = s.chunks, H = s.hidden, P = s.broadcast ? 1 : K;
  const DType out = s.table_dtype == s.proj_dtype ? s.table_dtype : DType::kF32;
  c.input("table", Phase::kForward, s.table_dtype, {K, H}, uniform_values(s.seed, 0.0, 0.5));
  c.input("proj", Phase::kForward, s.proj_dtype, {T, P, H}, uniform_values(s.seed + 1, 0.0, 1.0), 0);
  c.output("out", Phase::kForward, out, {T, K, H}, 0);
  c.input("grad", Phase::kBackward, out, {T, K, H}, uniform_values(s.seed + 2, 0.0, 1.0), 0);
  c.output("d_table", Phase::kBackward, s.table_dtype, {K, H});
  c.output("d_proj", Phase::kBackward, s.proj_dtype, {T, P, H}, 0);
  c.forward = [](const Instance& t, Stream stream) {
    return adaln_table_add_forward({t["table"], t["proj"], t["out"]}, stream);
  };
  c.backward = [](const Instance& t, Stream stream) {
    return adaln_table_add_backward({t["grad"], t["d_table"], t["d_proj"]}, stream);
  };
  c.set_bytes(Phase::kForward, {"table", "proj", "out"});
  c.set_bytes(Phase::kBackward, {"grad", "d_table", "d_proj"});
  c.positions = T;
  c.alone = [s](int64_t) {
    TableAddShape one = s;
    one.rows = 1;
    return adaln_table_add_case(one);
  };
  return c;
}

// verify's oracles of the forward's table (cases/oracle.h, projection_exact64):
// its error against the FP32-accumulation rounding bound, and, where the
// table is large enough for the fraction to mean something (the H3 table has
// 96768 outputs per timestep), how many outputs are not correctly rounded.
std::vector<AccuracyCheck> projection_forward_accuracy(int64_t outputs) {
  std::vector<AccuracyCheck> checks(1);
  checks[0].name = "error within the fp32-accumulation bound";
  // An FP32 chain of D products and the bias errs by at most
  // (D + 1) 2^-24 sum|a_k w_k| + |b| (first order), the final 16-bit rounding
  // by 2^-8 |out|: the scaled error must stay <= 1.
  checks[0].bound = 1.0;
  checks[0].unit = "of the rounding bound";
  checks[0].error = [](const std::map<std::string, HostTensor>& t) {
    const HostTensor& table = t.at("table");
    const ProjectionExact p = projection_exact64(t.at("temb"), t.at("weight"), t.at("bias"));
    const double chain = static_cast<double>(t.at("temb").shape()[1] + 1) * 0x1p-24;
    double worst = 0;
    for (std::size_t i = 0; i < p.exact.size(); ++i) {
      const double err = std::fabs(table.get(static_cast<int64_t>(i)) - p.exact[i]);
      const double allowed = 0x1p-8 * std::fabs(p.exact[i]) + chain * p.magnitude[i];
      worst = std::max(worst, err == 0 ? 0.0 : err / allowed);
    }
    return worst;
  };
  if (outputs < 100000) return checks;
  checks.emplace_back();
  checks[1].name = ">= 99.98 % correctly rounded";
  checks[1].bound = 2e-4;
  checks[1].unit = "fraction not RN";
  checks[1].error = [](const std::map<std::string, HostTensor>& t) {
    const HostTensor& table = t.at("table");
    const ProjectionExact p = projection_exact64(t.at("temb"), t.at("weight"), t.at("bias"));
    return static_cast<double>(table.numel() - count_correctly_rounded(table, p.exact)) /
           static_cast<double>(table.numel());
  };
  return checks;
}

// ---- adaln_modulation -----------------------------------------------------------------


OpCase adaln_modulation_case(const ModulationShape& s) {
  OpCase c;
  c.op = "adaln_modulation";
  c.name = std::string(dtype_name(s.dtype)) + " H=" + std::to_string(s.hidden) + " D=" + std::to_string(s.dim) + " " +
           s.index.name();
  const DType dtype = s.dtype;
  const int64_t T = s.index.num_timesteps, D = s.dim, N = 18 * s.hidden, H = s.hidden;
  c.plans.push_back({"plan", s.index, PlanSpec::Rows::kAdaln});
  c.input("temb", Phase::kForward, DType::kF32, {T, D}, s.temb ? s.temb : uniform_values(s.seed, 0.0, 3.0));
  c.input("weight", Phase::kForward, dtype, {N, D}, s.weight ? s.weight : uniform_values(s.seed + 1, 0.0, 0.02));
  c.input("bias", Phase::kForward, dtype, {N}, s.bias ? s.bias : uniform_values(s.seed + 2, 0.0, 1.0));
  c.output("table", Phase::kForward, dtype, {T, N});
  c.output("act", Phase::kForward, dtype, {T, D});
  c.output("out", Phase::kForward, dtype, {6, s.index.seq_len, H});
  c.input("grad", Phase::kBackward, dtype, {6, s.index.positions(), H},
          s.grad ? s.grad : uniform_values(s.seed + 3, 0.0, 1.0));
  c.output("d_temb", Phase::kBackward, DType::kF32, {T, D});
  c.output("d_weight", Phase::kBackward, dtype, {N, D});
  c.output("d_bias", Phase::kBackward, dtype, {N});
  c.takes_profile = true;  // the SiLU's exp
  auto inputs = [](const Instance& t) {
    AdalnModulationInputs in{t["temb"], t["weight"], t["bias"], t.plan("plan")};
    in.numerics = t.numerics;
    return in;
  };
  c.forward = [inputs](const Instance& t, Stream stream) {
    return adaln_modulation_forward({inputs(t), t["table"], t["act"], t["out"]}, stream);
  };
  c.backward = [inputs](const Instance& t, Stream stream) {
    return adaln_modulation_backward({inputs(t), t["act"], t["grad"], t["d_temb"], t["d_weight"], t["d_bias"]},
                                     stream);
  };
  c.set_bytes(Phase::kForward, {"temb", "weight", "bias", "table", "act", "out"});
  c.set_bytes(Phase::kBackward, {"temb", "weight", "act", "grad", "d_temb", "d_weight", "d_bias"});
  return c;
}

// ---- final_adaln_out --------------------------------------------------------------------

OpCase final_adaln_out_case(const FinalShape& s) {
  OpCase c;
  c.op = "final_adaln_out";
  c.name = std::string(dtype_name(s.dtype)) + " H=" + std::to_string(s.hidden) + " D=" + std::to_string(s.dim) + " " +
           s.index.name();
  const int64_t T = s.index.num_timesteps, D = s.dim, H = s.hidden, M = s.index.positions();
  c.positions = M;
  c.plans.push_back({"plan", s.index, PlanSpec::Rows::kTimestep});
  c.input("x", Phase::kForward, s.dtype, {M, H}, s.x ? s.x : uniform_values(s.seed, 0.0, 3.0), 0);
  c.input("norm_weight", Phase::kForward, s.dtype, {H},
          s.norm_weight ? s.norm_weight : uniform_values(s.seed + 1, 1.0, 0.3));
  c.input("temb", Phase::kForward, DType::kF32, {T, D}, s.temb ? s.temb : uniform_values(s.seed + 2, 0.0, 3.0));
  c.input("weight", Phase::kForward, s.dtype, {2 * H, D}, s.weight ? s.weight : uniform_values(s.seed + 3, 0.0, 0.02));
  c.input("bias", Phase::kForward, s.dtype, {2 * H}, s.bias ? s.bias : uniform_values(s.seed + 4, 0.0, 1.0));
  c.output("out", Phase::kForward, s.dtype, {M, H}, 0);
  c.output("table", Phase::kForward, s.dtype, {T, 2 * H});
  c.output("act", Phase::kForward, s.dtype, {T, D});
  c.output("rstd", Phase::kForward, DType::kF32, {M}, 0);
  c.input("grad", Phase::kBackward, s.dtype, {M, H}, s.grad ? s.grad : uniform_values(s.seed + 5, 0.0, 1.0), 0);
  c.output("dx", Phase::kBackward, s.dtype, {M, H}, 0);
  c.output("d_norm_weight", Phase::kBackward, DType::kF32, {H});
  c.output("d_temb", Phase::kBackward, DType::kF32, {T, D});
  c.output("d_weight", Phase::kBackward, s.dtype, {2 * H, D});
  c.output("d_bias", Phase::kBackward, s.dtype, {2 * H});
  c.takes_profile = true;  // the SiLU's exp and the norm's rsqrt
  c.arguments["eps"] = argument_text(FinalAdalnOutInputs{}.eps);
  auto inputs = [](const Instance& t) {
    FinalAdalnOutInputs in{t["x"], t["norm_weight"], t["temb"], t["weight"], t["bias"], t.plan("plan")};
    in.numerics = t.numerics;
    return in;
  };
  c.forward = [inputs](const Instance& t, Stream stream) {
    return final_adaln_out_forward({inputs(t), t["out"], t["table"], t["act"], t["rstd"]}, stream);
  };
  c.backward = [inputs](const Instance& t, Stream stream) {
    return final_adaln_out_backward({inputs(t), t["table"], t["act"], t["rstd"], t["grad"], t["dx"],
                                     t["d_norm_weight"], t["d_temb"], t["d_weight"], t["d_bias"]},
                                    stream);
  };
  c.set_bytes(Phase::kForward, {"x", "norm_weight", "temb", "weight", "bias", "out", "table", "act", "rstd"});
  c.set_bytes(Phase::kBackward, {"x", "norm_weight", "temb", "weight", "table", "act", "rstd", "grad", "dx",
                                 "d_norm_weight", "d_temb", "d_weight", "d_bias"});
  c.alone = [s](int64_t p) {
    FinalShape one = s;
    one.index = single_position_case(s.index, p);
    return final_adaln_out_case(one);
  };
  return c;
}

namespace {

// ---- verify's fused cases ---------------------------------------------------------------

// verify's values: N(0, 1) from the synthetic-weights stream.
Fill verify_normal(uint64_t seed) {
  return [seed](HostTensor* t) { fill_stream_normal(t, seed, "verify", 0.0, 1.0); };
}

// verify's sequence of the fused ops, S = 2048, B = 2, T = 3 (--quick: 257, 1,
// 2): the timesteps in contiguous runs (position s has timestep s T / S), the
// modality changing every few positions (tag 1 at s % 7 == 0, 2 at s % 5 == 0,
// else 0), so every chunk and modality of the table gradient is summed.
IndexCase fused_verify_index(const CaseContext& ctx) {
  const int64_t seq_len = ctx.quick ? 257 : 2048, timesteps = ctx.quick ? 2 : 3;
  IndexCase c = make_index_case(Packing::kBlock, seq_len, timesteps, ctx.quick ? 1 : 2);
  for (int64_t p = 0; p < seq_len; ++p) {
    c.timestep_indices[p] = p * timesteps / seq_len;
    c.tags[p] = p % 7 == 0 ? 1 : p % 5 == 0 ? 2 : 0;
  }
  return c;
}

// The dtype of the named weight (bf16 without weights).
DType weight_dtype(const CaseContext& ctx, const std::string& name) {
  TensorView w;
  return ctx.weight && ctx.weight(name, &w).ok() ? w.dtype : DType::kBF16;
}

// verify's oracles of a fused op's weight gradients (cases/oracle.h): dW (rows
// n = 0, stride, 2 stride, ...; --quick samples every 7th row, which still
// covers every chunk and modality) and db, correctly rounded against FP64 sums
// of the exact table gradient d_table(tensors) (T, N) with act = R_W(silu(temb)).
//
// The bound: the op's table gradient is an FP32 sum over up to B*S positions
// (relative error up to ~(B*S) 2^-24 of the sum of magnitudes), and dW is one
// more FP32 chain over T, rounded once to the weight's dtype; an element rounds
// differently from the FP64 value only when that value lies within the FP32
// error of a rounding boundary. tests/cpu/chain_test.cc measures 99.8-100 %
// for the same gradients; the bar is 99.5 %.
using TableGrad = std::function<std::vector<double>(const std::map<std::string, HostTensor>& tensors)>;
std::vector<AccuracyCheck> weight_grad_accuracy(TableGrad d_table, int64_t stride) {
  constexpr double kMinCorrectlyRounded = 0.995;
  std::vector<AccuracyCheck> checks(2);
  checks[0].name = "dW >= 99.5 % correctly rounded vs fp64";
  checks[0].error = [d_table, stride](const std::map<std::string, HostTensor>& t) {
    return weight_grad_fraction_not_rn(d_table(t), adaln_act64(t.at("temb"), t.at("weight").dtype()),
                                       t.at("d_weight"), stride);
  };
  checks[1].name = "db >= 99.5 % correctly rounded vs fp64";
  checks[1].error = [d_table](const std::map<std::string, HostTensor>& t) {
    return bias_grad_fraction_not_rn(d_table(t), t.at("d_bias"));
  };
  for (AccuracyCheck& check : checks) {
    check.bound = 1.0 - kMinCorrectlyRounded;
    check.unit = "fraction not RN";
  }
  return checks;
}

// ---- the suites -------------------------------------------------------------------------

constexpr int64_t kH3Hidden = 5376, kH3TimeDim = 2688;

std::vector<OpCase> linear_cases(Suite suite, const CaseContext&) {
  std::vector<OpCase> cases;
  if (suite != Suite::kTest) return cases;  // benchmarked as adaln_projection and timestep_mlp
  uint64_t seed = 1000;
  for (DType dtype : {DType::kF32, DType::kBF16})
    for (int64_t rows : {1, 3, 9})
      for (int64_t k : {8, 24, 264})
        for (int64_t n : {64, 72, 128, 1})
          cases.push_back(linear_case(
              {dtype, rows, k, n, n != 72, rows == 3, rows == 9 ? DType::kF32 : dtype, n != 128, seed++}));
  cases.push_back(linear_case({DType::kBF16, 9, 264, 200, true, true, DType::kBF16, true, 1100}));
  cases.push_back(linear_case({DType::kF32, 5, 24, 72, true, false, DType::kF32, true, 1101}));
  // The CUDA forward's x in shared memory past the 48 KB opt-in (8 widened rows of
  // K = 2688: 84 KB), and x too wide for it (4 rows of K = 8192: 128 KB).
  cases.push_back(linear_case({DType::kBF16, 8, 2688, 72, true, false, DType::kBF16, true, 1102}));
  cases.push_back(linear_case({DType::kF32, 4, 8192, 64, true, true, DType::kF32, false, 1103}));
  return cases;
}

std::vector<OpCase> adaln_projection_cases(Suite suite, const CaseContext& ctx) {
  std::vector<OpCase> cases;
  if (suite == Suite::kTest) {
    cases.push_back(adaln_projection_case({DType::kBF16, 3, 24, 18 * 4, 1500}));
    cases.push_back(adaln_projection_case({DType::kF32, 1, 8, 18 * 7, 1501}));
    cases.push_back(adaln_projection_case({DType::kBF16, 4, kH3TimeDim, 18 * kH3Hidden, 1510}));
    cases.push_back(adaln_projection_case({DType::kBF16, 1, kH3TimeDim, 18 * kH3Hidden, 1511}));
    // The families' projections: their chunk counts, bf16 and fp32 temb, per
    // sample (T = B) and per token (T = B*S).
    auto family = [](DType dtype, DType temb, int64_t rows, int64_t dim, int chunks, int64_t hidden, uint64_t seed) {
      ProjectionShape s{dtype, rows, dim, chunks * hidden, seed};
      s.chunks = chunks;
      s.temb_dtype = temb;
      return adaln_projection_case(s);
    };
    cases.push_back(family(DType::kBF16, DType::kBF16, 2, 24, 6, 8, 1540));   // AdaLayerNormZero
    cases.push_back(family(DType::kBF16, DType::kBF16, 3, 16, 9, 8, 1541));   // SD35AdaLayerNormZeroX
    cases.push_back(family(DType::kBF16, DType::kF32, 2, 16, 3, 12, 1542));   // AdaLayerNormZeroSingle
    cases.push_back(family(DType::kBF16, DType::kBF16, 2, 8, 2, 20, 1543));   // AdaLayerNormContinuous
    cases.push_back(family(DType::kF32, DType::kF32, 37, 8, 6, 4, 1544));     // Wan TI2V per token
    cases.push_back(family(DType::kBF16, DType::kBF16, 300, 8, 6, 4, 1545));  // LTX per token, T past one chunk
    return cases;
  }
  // Block 0's projection: kBench at its sizes in bf16; kVerify at T = 4
  // (--quick: 2) in the weight's dtype, on 1 randn temb (verify's stream).
  const std::string weight = "transformer_blocks.0.adaln_proj.linear.weight";
  auto block0_shape = [&](DType dtype, int64_t rows, uint64_t seed) {
    ProjectionShape s{dtype, rows, ctx.time_embed_dim, 18 * ctx.hidden, seed};
    s.weight = weight_or(ctx, weight, uniform_values(seed + 1, 0.0, 0.02));
    s.bias = weight_or(ctx, "transformer_blocks.0.adaln_proj.linear.bias", uniform_values(seed + 2, 0.0, 1.0));
    return s;
  };
  if (suite == Suite::kBench) {
    for (int64_t rows : ctx.small ? std::vector<int64_t>{1, 4} : std::vector<int64_t>{1, 3, 4, 8, 16, 32})
      cases.push_back(adaln_projection_case(block0_shape(DType::kBF16, rows, ctx.seed + 1520)));
    return cases;
  }
  ProjectionShape s = block0_shape(weight_dtype(ctx, weight), ctx.quick ? 2 : 4, ctx.seed + 1530);
  s.temb = verify_normal(ctx.seed + 11);
  OpCase c = adaln_projection_case(s);
  c.name = "block 0, weights' shape";
  c.accuracy = projection_forward_accuracy(s.rows * s.out_features);
  cases.push_back(std::move(c));
  return cases;
}

// The sequence of the fused ops' kBench (block packing, S = 32768, small:
// 4097, B = 2, T = 3) or kVerify (fused_verify_index) case.
IndexCase fused_index(const CaseContext& ctx, bool bench) {
  return bench ? make_index_case(Packing::kBlock, ctx.small ? 4097 : 32768, 3, 2) : fused_verify_index(ctx);
}

std::vector<OpCase> adaln_modulation_cases(Suite suite, const CaseContext& ctx) {
  std::vector<OpCase> cases;
  if (suite == Suite::kTest) {
    cases.push_back(adaln_modulation_case({20, 24, make_index_case(Packing::kInterleaved, 257, 3, 2), 1600}));
    cases.push_back(adaln_modulation_case({12, 8, make_index_case(Packing::kBlock, 1, 1, 1), 1601}));
    cases.push_back(
        adaln_modulation_case({kH3Hidden, kH3TimeDim, make_index_case(Packing::kBlock, 4097, 4, 2), 1602}));
    return cases;
  }
  // Block 0's projection: kBench at S = 32768 (small: 4097), B = 2, T = 3 in
  // bf16; kVerify on verify's fused sequence in the weight's dtype, on 1 randn
  // temb and gradient (verify's stream), with its weight-gradient oracles.
  const std::string weight = "transformer_blocks.0.adaln_proj.linear.weight";
  const bool bench = suite == Suite::kBench;
  const uint64_t seed = ctx.seed + (bench ? 1610 : 1620);
  ModulationShape s{ctx.hidden, ctx.time_embed_dim, fused_index(ctx, bench), seed};
  if (!bench) s.dtype = weight_dtype(ctx, weight);
  s.weight = weight_or(ctx, weight, uniform_values(seed + 1, 0.0, 0.02));
  s.bias = weight_or(ctx, "transformer_blocks.0.adaln_proj.linear.bias", uniform_values(seed + 2, 0.0, 1.0));
  if (bench) {
    cases.push_back(adaln_modulation_case(s));
    return cases;
  }
  s.temb = verify_normal(ctx.seed + 71);
  s.grad = verify_normal(ctx.seed + 72);
  OpCase c = adaln_modulation_case(s);
  c.name = "block 0, fwd+bwd";
  const IndexCase index = s.index;
  const int64_t hidden = s.hidden;
  c.accuracy = weight_grad_accuracy(  // the table gradient: the six chunks' rows summed, as the gather's
      [index, hidden](const std::map<std::string, HostTensor>& t) {
        return row_gather_grad_exact(index, t.at("grad"), hidden);
      },
      ctx.quick ? 7 : 1);
  cases.push_back(std::move(c));
  return cases;
}

std::vector<OpCase> adaln_table_add_cases(Suite suite, const CaseContext&) {
  std::vector<OpCase> cases;
  if (suite != Suite::kTest) return cases;
  // Wan (fp32 table + bf16 projection -> fp32), LTX-Video (bf16 + bf16), the
  // final layers' (T, 1, H) time embedding, fp16, and T past one 256-row chunk
  // (d_table folds several partials).
  cases.push_back(adaln_table_add_case({DType::kF32, DType::kBF16, 3, 6, 8, false, 1800}));
  cases.push_back(adaln_table_add_case({DType::kBF16, DType::kBF16, 5, 6, 12, false, 1801}));
  cases.push_back(adaln_table_add_case({DType::kF32, DType::kF32, 4, 2, 16, true, 1802}));
  cases.push_back(adaln_table_add_case({DType::kBF16, DType::kBF16, 7, 2, 8, true, 1803}));
  cases.push_back(adaln_table_add_case({DType::kF16, DType::kF32, 2, 3, 5, false, 1804}));
  cases.push_back(adaln_table_add_case({DType::kF32, DType::kBF16, 600, 6, 4, false, 1805}));
  cases.push_back(adaln_table_add_case({DType::kBF16, DType::kBF16, 513, 2, 8, true, 1806}));
  return cases;
}

std::vector<OpCase> final_adaln_out_cases(Suite suite, const CaseContext& ctx) {
  std::vector<OpCase> cases;
  if (suite == Suite::kTest) {
    cases.push_back(final_adaln_out_case({DType::kBF16, 20, 24, make_index_case(Packing::kInterleaved, 257, 3, 2), 1700}));
    cases.push_back(final_adaln_out_case({DType::kF32, 12, 8, make_index_case(Packing::kBlock, 255, 1, 1), 1701}));
    cases.push_back(final_adaln_out_case(
        {DType::kBF16, kH3Hidden, kH3TimeDim, make_index_case(Packing::kBlock, 4097, 4, 1), 1702}));
    return cases;
  }
  // norm_out's weights: kBench at S = 32768 (small: 4097), B = 2, T = 3 in
  // bf16; kVerify on verify's fused sequence in the norm weight's dtype, on 1
  // randn x, temb and gradient (verify's stream), with its weight-gradient oracles.
  const std::string norm_weight = "norm_out.norm.weight";
  const bool bench = suite == Suite::kBench;
  const uint64_t seed = ctx.seed + (bench ? 1710 : 1720);
  FinalShape s{bench ? DType::kBF16 : weight_dtype(ctx, norm_weight), ctx.hidden, ctx.time_embed_dim,
               fused_index(ctx, bench), seed};
  s.norm_weight = weight_or(ctx, norm_weight, uniform_values(seed + 1, 1.0, 0.3));
  s.weight = weight_or(ctx, "norm_out.linear.weight", uniform_values(seed + 2, 0.0, 0.02));
  s.bias = weight_or(ctx, "norm_out.linear.bias", uniform_values(seed + 3, 0.0, 1.0));
  if (bench) {
    cases.push_back(final_adaln_out_case(s));
    return cases;
  }
  s.x = verify_normal(ctx.seed + 61);
  s.grad = verify_normal(ctx.seed + 62);
  s.temb = verify_normal(ctx.seed + 63);
  OpCase c = final_adaln_out_case(s);
  c.name = "norm_out, fwd+bwd";
  const IndexCase index = s.index;
  c.accuracy = weight_grad_accuracy(
      [index](const std::map<std::string, HostTensor>& t) {
        return final_table_grad64(t.at("x"), t.at("norm_weight"), t.at("grad"), index, FinalAdalnOutInputs{}.eps);
      },
      ctx.quick ? 7 : 1);
  cases.push_back(std::move(c));
  return cases;
}

DETDIT_OP_CASES("linear", linear_cases);
DETDIT_OP_CASES("adaln_projection", adaln_projection_cases);
DETDIT_OP_CASES("adaln_modulation", adaln_modulation_cases);
DETDIT_OP_CASES("final_adaln_out", final_adaln_out_cases);
DETDIT_OP_CASES("adaln_table_add", adaln_table_add_cases);

}  // namespace
}  // namespace cases
}  // namespace detdit
