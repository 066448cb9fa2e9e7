// verify cases of the fused AdaLN ops on the weights' shapes, each on its own:
//   final_adaln_out:  norm_out (projection (T, 2H) of temb, shift first, then
//                     the modulated rmsnorm indexed by the timestep), fwd+bwd;
//   adaln_modulation: block 0's projection (T, 18H) + the six-chunk row
//                     gather, fwd+bwd.
// Inputs: T timesteps in contiguous runs over S positions (tags 1 at s % 7 == 0,
// 2 at s % 5 == 0, else 0), B batch items, N(0, 1) x, temb and gradients.
// Checks: forward+backward repeatability of every output and gradient (saved
// tensors included); dW and db correctly rounded against an FP64 chain (the
// table gradient summed over positions in FP64, with the model's bf16 storage
// points: act = bf16(silu(temb)), the normalised value n = bf16(w x rstd));
// on CUDA every output and gradient equal to the CPU's, bitwise.
//
// Bound of the correctly-rounded fraction: the op's table gradient is an FP32
// sum over up to B*S positions (relative error up to ~(B*S) 2^-24 of the sum
// of magnitudes), and dW is one more FP32 chain over T, rounded once to bf16;
// an element rounds differently from the FP64 value only when that value lies
// within the FP32 error of a bf16 rounding boundary. tests/cpu/chain_test.cc
// measures 99.8-100 % for the same gradients; the bar is 99.5 %.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "cases/oracle.h"
#include "cases/parallel_for.h"
#include "detdit/adaln.h"
#include "detdit/plan.h"
#include "verify.h"

namespace detdit {
namespace cli {
namespace {

constexpr double kMinCorrectlyRounded = 0.995;
constexpr float kEps = 1e-5f;

// T timesteps in contiguous runs over S positions; B batch items.
struct FusedSequence {
  int64_t seq_len = 0, batch = 1, timesteps = 0, hidden = 0, embed = 0;
  HostTensor ti, tags;  // (S,) int32
  int64_t positions() const { return batch * seq_len; }
};

FusedSequence make_fused_sequence(const VerifyContext& ctx) {
  FusedSequence s;
  s.seq_len = ctx.quick ? 257 : 2048;
  s.batch = ctx.quick ? 1 : 2;
  s.timesteps = ctx.quick ? 2 : 3;
  s.hidden = ctx.weights->config.hidden;
  s.embed = ctx.weights->config.time_embed_dim;
  s.ti = HostTensor(DType::kI32, {s.seq_len});
  s.tags = HostTensor(DType::kI32, {s.seq_len});
  for (int64_t p = 0; p < s.seq_len; ++p) {
    s.ti.ptr<int32_t>()[p] = static_cast<int32_t>(p * s.timesteps / s.seq_len);
    s.tags.ptr<int32_t>()[p] = static_cast<int32_t>(p % 7 == 0 ? 1 : p % 5 == 0 ? 2 : 0);
  }
  return s;
}

Status copy_named_weight(const Weights& weights, const std::string& name, HostTensor* out) {
  TensorView v;
  DETDIT_RETURN_IF_ERROR(weights.view(name, &v));
  *out = HostTensor(v.dtype, std::vector<int64_t>(v.shape, v.shape + v.rank));
  std::memcpy(out->data(), v.data, out->nbytes());
  return Status::ok_status();
}

// Named host copies of every output of one run.
struct FusedRun {
  std::vector<std::string> names;
  std::vector<HostTensor> outputs;
};

Status collect(const std::vector<std::pair<std::string, const DeviceTensor*>>& tensors, FusedRun* run) {
  run->names.clear();
  run->outputs.assign(tensors.size(), HostTensor());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    run->names.push_back(tensors[i].first);
    DETDIT_RETURN_IF_ERROR(tensors[i].second->to_host(&run->outputs[i]));
  }
  return Status::ok_status();
}

void compare_fused_runs(const FusedRun& expected, const FusedRun& actual, CheckRow* row) {
  for (std::size_t i = 0; i < expected.outputs.size() && i < actual.outputs.size(); ++i) {
    const HostTensor& e = expected.outputs[i];
    compare_bytes(e.data(), actual.outputs[i].data(), e.nbytes(), e.dtype(), expected.names[i], row);
  }
}

// The correctly rounded bits of a finite double in a bf16 or fp32 tensor
// (cases::correctly_rounded_bits: fp32 by the host's double-to-float
// conversion, RNE), and the bits of element i of one.
uint32_t nearest_bits(double x, DType dtype) {
  return static_cast<uint32_t>(cases::correctly_rounded_bits(x, dtype == DType::kF32 ? DType::kF32 : DType::kBF16));
}

uint32_t bits_at(const HostTensor& b, int64_t i) {
  return b.dtype() == DType::kF32 ? b.ptr<uint32_t>()[i] : b.ptr<uint16_t>()[i];
}

// The value of the correctly rounded x in a bf16 or fp32 tensor.
double nearest(double x, DType dtype) {
  return cases::correctly_rounded(x, dtype == DType::kF32 ? DType::kF32 : DType::kBF16);
}


// act = bf16(silu(temb)) in FP64 then one rounding to the weight's dtype (T, D).
std::vector<double> act64(const HostTensor& temb, DType dtype) {
  std::vector<double> act(static_cast<std::size_t>(temb.numel()));
  for (int64_t i = 0; i < temb.numel(); ++i) {
    act[i] = nearest(cases::silu64(temb.get(i)), dtype);
  }
  return act;
}

// Rows "dW ... correctly rounded" and "db ...": the FP64 dW[n, k] =
// sum_t d_table[t, n] act[t, k] and db[n] = sum_t d_table[t, n] against the
// op's d_weight (N, D) and d_bias (N,). dW rows n = 0, stride, 2*stride, ...
// (--quick: every 7th row, which still samples every chunk and modality).
void weight_grad_rows(const std::vector<double>& d_table, const std::vector<double>& act, int64_t timesteps,
                      int64_t outputs, int64_t embed, const HostTensor& d_weight, const HostTensor& d_bias,
                      int64_t stride, std::vector<CheckRow>* rows) {
  rows->push_back(timed_check("dW >= 99.5 % correctly rounded vs fp64", [&](CheckRow* row) {
    const int64_t sampled = (outputs + stride - 1) / stride;
    std::vector<int64_t> wrong_per_row(static_cast<std::size_t>(sampled), 0);
    cases::parallel_for(0, sampled, [&](int64_t j) {
      const int64_t n = j * stride;
      for (int64_t k = 0; k < embed; ++k) {
        double exact = 0;
        for (int64_t t = 0; t < timesteps; ++t) exact += d_table[t * outputs + n] * act[t * embed + k];
        wrong_per_row[j] += bits_at(d_weight, n * embed + k) != nearest_bits(exact, d_weight.dtype());
      }
    });
    int64_t wrong = 0;
    for (int64_t w : wrong_per_row) wrong += w;
    row->max_error = static_cast<double>(wrong) / static_cast<double>(sampled * embed);
    row->bound = 1.0 - kMinCorrectlyRounded;
    row->error_unit = "fraction not RN";
    return Status::ok_status();
  }));
  rows->push_back(timed_check("db >= 99.5 % correctly rounded vs fp64", [&](CheckRow* row) {
    int64_t wrong = 0;
    for (int64_t n = 0; n < outputs; ++n) {
      double exact = 0;
      for (int64_t t = 0; t < timesteps; ++t) exact += d_table[t * outputs + n];
      wrong += bits_at(d_bias, n) != nearest_bits(exact, d_bias.dtype());
    }
    row->max_error = static_cast<double>(wrong) / static_cast<double>(outputs);
    row->bound = 1.0 - kMinCorrectlyRounded;
    row->error_unit = "fraction not RN";
    return Status::ok_status();
  }));
}

// ---- final_adaln_out ---------------------------------------------------------

struct FinalInputs {
  HostTensor x, norm_weight, temb, weight, bias, grad;
};

Status run_final(const Device& device, const FusedSequence& seq, const FinalInputs& in, FusedRun* run) {
  DeviceTensor ti, x, norm_weight, temb, weight, bias, grad;
  for (const auto& [host, tensor] : {std::make_pair(&seq.ti, &ti), std::make_pair(&in.x, &x),
                                     std::make_pair(&in.norm_weight, &norm_weight), std::make_pair(&in.temb, &temb),
                                     std::make_pair(&in.weight, &weight), std::make_pair(&in.bias, &bias),
                                     std::make_pair(&in.grad, &grad)})
    DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(*host, device, tensor));
  IndexPlan plan;
  DETDIT_RETURN_IF_ERROR(IndexPlan::from_row_index(ti.view(), seq.timesteps, seq.batch, &plan));
  const int64_t M = seq.positions(), H = seq.hidden, T = seq.timesteps, D = seq.embed;
  const DType w_dtype = in.weight.dtype();
  DeviceTensor out, table, act, rstd, dx, d_norm_weight, d_temb, d_weight, d_bias;
  DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(in.x.dtype(), {M, H}, device, &out));
  DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(w_dtype, {T, 2 * H}, device, &table));
  DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(w_dtype, {T, D}, device, &act));
  DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(DType::kF32, {M}, device, &rstd));
  DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(in.x.dtype(), {M, H}, device, &dx));
  DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(DType::kF32, {H}, device, &d_norm_weight));
  DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(DType::kF32, {T, D}, device, &d_temb));
  DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(w_dtype, {2 * H, D}, device, &d_weight));
  DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(w_dtype, {2 * H}, device, &d_bias));
  FinalAdalnOutParams f{{x.view(), norm_weight.view(), temb.view(), weight.view(), bias.view(), plan, kEps},
                        out.view(),
                        table.view(),
                        act.view(),
                        rstd.view()};
  DETDIT_RETURN_IF_ERROR(final_adaln_out_forward(f));
  FinalAdalnOutBackwardParams b{f.in,      f.table,   f.act,     f.rstd,    grad.view(),
                                dx.view(), d_norm_weight.view(), d_temb.view(), d_weight.view(), d_bias.view()};
  DETDIT_RETURN_IF_ERROR(final_adaln_out_backward(b));
  return collect({{"out", &out}, {"table", &table}, {"act", &act}, {"rstd", &rstd}, {"dx", &dx},
                  {"d_norm_weight", &d_norm_weight}, {"d_temb", &d_temb}, {"d_weight", &d_weight}, {"d_bias", &d_bias}},
                 run);
}

// FP64 d_table (T, 2H) = [d_shift | d_scale]: d_shift[t, i] = sum of g[p, i],
// d_scale[t, i] = sum of g[p, i] n[p, i] over the positions p of timestep t,
// n = R(w x rstd) with rstd = 1 / sqrt(mean(x^2) + eps), all in FP64.
std::vector<double> final_table_grad64(const FusedSequence& seq, const FinalInputs& in) {
  const int64_t H = seq.hidden, M = seq.positions();
  std::vector<double> d_table(static_cast<std::size_t>(seq.timesteps * 2 * H), 0.0);
  const DType dtype = in.x.dtype();
  for (int64_t p = 0; p < M; ++p) {
    double ss = 0;
    for (int64_t i = 0; i < H; ++i) ss += in.x.get(p * H + i) * in.x.get(p * H + i);
    const double rstd = 1.0 / std::sqrt(ss / static_cast<double>(H) + kEps);
    double* row = d_table.data() + seq.ti.ptr<int32_t>()[p % seq.seq_len] * 2 * H;
    for (int64_t i = 0; i < H; ++i) {
      const double n64 = in.norm_weight.get(i) * in.x.get(p * H + i) * rstd;
      const double n = nearest(n64, dtype);
      const double g = in.grad.get(p * H + i);
      row[i] += g;
      row[H + i] += g * n;
    }
  }
  return d_table;
}

Status verify_final(const VerifyContext& ctx, std::vector<CheckRow>* rows) {
  const FusedSequence seq = make_fused_sequence(ctx);
  const int64_t M = seq.positions(), H = seq.hidden;
  FinalInputs in;
  DETDIT_RETURN_IF_ERROR(copy_named_weight(*ctx.weights, "norm_out.norm.weight", &in.norm_weight));
  DETDIT_RETURN_IF_ERROR(copy_named_weight(*ctx.weights, "norm_out.linear.weight", &in.weight));
  DETDIT_RETURN_IF_ERROR(copy_named_weight(*ctx.weights, "norm_out.linear.bias", &in.bias));
  in.x = HostTensor(in.norm_weight.dtype(), {M, H});
  fill_verify_normal(&in.x, ctx.seed + 61);
  in.grad = HostTensor(in.norm_weight.dtype(), {M, H});
  fill_verify_normal(&in.grad, ctx.seed + 62);
  in.temb = HostTensor(DType::kF32, {seq.timesteps, seq.embed});
  fill_verify_normal(&in.temb, ctx.seed + 63);
  FusedRun first;
  rows->push_back(timed_check("fwd+bwd repeatability (out, saved, dx, every grad)", [&](CheckRow* row) {
    FusedRun second;
    DETDIT_RETURN_IF_ERROR(run_final(ctx.device, seq, in, &first));
    DETDIT_RETURN_IF_ERROR(run_final(ctx.device, seq, in, &second));
    compare_fused_runs(first, second, row);
    return Status::ok_status();
  }));
  if (first.outputs.empty()) return Status::ok_status();
  weight_grad_rows(final_table_grad64(seq, in), act64(in.temb, in.weight.dtype()), seq.timesteps, 2 * H, seq.embed,
                   first.outputs[7], first.outputs[8], ctx.quick ? 7 : 1, rows);
  if (ctx.device.is_cuda()) {
    rows->push_back(timed_check("cuda = cpu reference (every output)", [&](CheckRow* row) {
      FusedRun reference;
      DETDIT_RETURN_IF_ERROR(run_final(Device::cpu(), seq, in, &reference));
      compare_fused_runs(reference, first, row);
      return Status::ok_status();
    }));
  }
  return Status::ok_status();
}
DETDIT_VERIFY_CASE("final_adaln_out", "norm_out, fwd+bwd", true, true, verify_final);

// ---- adaln_modulation --------------------------------------------------------

struct ModulationInputs {
  HostTensor temb, weight, bias, grad;
};

Status run_modulation(const Device& device, const FusedSequence& seq, const ModulationInputs& in, FusedRun* run) {
  DeviceTensor ti, tags, temb, weight, bias, grad;
  for (const auto& [host, tensor] : {std::make_pair(&seq.ti, &ti), std::make_pair(&seq.tags, &tags),
                                     std::make_pair(&in.temb, &temb), std::make_pair(&in.weight, &weight),
                                     std::make_pair(&in.bias, &bias), std::make_pair(&in.grad, &grad)})
    DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(*host, device, tensor));
  IndexPlan plan;
  DETDIT_RETURN_IF_ERROR(IndexPlan::from_timesteps_and_tags(ti.view(), tags.view(), seq.timesteps, seq.batch, &plan));
  const int64_t H = seq.hidden, T = seq.timesteps, D = seq.embed, N = in.weight.shape()[0];
  const DType w_dtype = in.weight.dtype();
  DeviceTensor table, act, out, d_temb, d_weight, d_bias;
  DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(w_dtype, {T, N}, device, &table));
  DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(w_dtype, {T, D}, device, &act));
  DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(w_dtype, {kAdalnChunks, seq.seq_len, H}, device, &out));
  DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(DType::kF32, {T, D}, device, &d_temb));
  DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(w_dtype, {N, D}, device, &d_weight));
  DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(w_dtype, {N}, device, &d_bias));
  AdalnModulationParams f{{temb.view(), weight.view(), bias.view(), plan}, table.view(), act.view(), out.view()};
  DETDIT_RETURN_IF_ERROR(adaln_modulation_forward(f));
  AdalnModulationBackwardParams b{f.in, f.act, grad.view(), d_temb.view(), d_weight.view(), d_bias.view()};
  DETDIT_RETURN_IF_ERROR(adaln_modulation_backward(b));
  return collect({{"table", &table}, {"act", &act}, {"out", &out}, {"d_temb", &d_temb}, {"d_weight", &d_weight},
                  {"d_bias", &d_bias}},
                 run);
}

// FP64 d_table (T, 18H): column m*6H + c*H + h of timestep t sums
// grad[c, p, h] over the positions p with timestep t and modality m.
std::vector<double> modulation_table_grad64(const FusedSequence& seq, const ModulationInputs& in) {
  const int64_t H = seq.hidden, M = seq.positions();
  std::vector<double> d_table(static_cast<std::size_t>(seq.timesteps * 18 * H), 0.0);
  for (int64_t p = 0; p < M; ++p) {
    const int64_t s = p % seq.seq_len;
    const int64_t t = seq.ti.ptr<int32_t>()[s], m = seq.tags.ptr<int32_t>()[s];
    for (int64_t c = 0; c < kAdalnChunks; ++c) {
      double* column = d_table.data() + t * 18 * H + m * 6 * H + c * H;
      for (int64_t h = 0; h < H; ++h) column[h] += in.grad.get((c * M + p) * H + h);
    }
  }
  return d_table;
}

Status verify_modulation(const VerifyContext& ctx, std::vector<CheckRow>* rows) {
  const FusedSequence seq = make_fused_sequence(ctx);
  ModulationInputs in;
  DETDIT_RETURN_IF_ERROR(copy_named_weight(*ctx.weights, "transformer_blocks.0.adaln_proj.linear.weight", &in.weight));
  DETDIT_RETURN_IF_ERROR(copy_named_weight(*ctx.weights, "transformer_blocks.0.adaln_proj.linear.bias", &in.bias));
  in.temb = HostTensor(DType::kF32, {seq.timesteps, seq.embed});
  fill_verify_normal(&in.temb, ctx.seed + 71);
  in.grad = HostTensor(in.weight.dtype(), {kAdalnChunks, seq.positions(), seq.hidden});
  fill_verify_normal(&in.grad, ctx.seed + 72);
  FusedRun first;
  rows->push_back(timed_check("fwd+bwd repeatability (table, act, out, every grad)", [&](CheckRow* row) {
    FusedRun second;
    DETDIT_RETURN_IF_ERROR(run_modulation(ctx.device, seq, in, &first));
    DETDIT_RETURN_IF_ERROR(run_modulation(ctx.device, seq, in, &second));
    compare_fused_runs(first, second, row);
    return Status::ok_status();
  }));
  if (first.outputs.empty()) return Status::ok_status();
  weight_grad_rows(modulation_table_grad64(seq, in), act64(in.temb, in.weight.dtype()), seq.timesteps,
                   in.weight.shape()[0], seq.embed, first.outputs[4], first.outputs[5], ctx.quick ? 7 : 1, rows);
  if (ctx.device.is_cuda()) {
    rows->push_back(timed_check("cuda = cpu reference (every output)", [&](CheckRow* row) {
      FusedRun reference;
      DETDIT_RETURN_IF_ERROR(run_modulation(Device::cpu(), seq, in, &reference));
      compare_fused_runs(reference, first, row);
      return Status::ok_status();
    }));
  }
  return Status::ok_status();
}
DETDIT_VERIFY_CASE("adaln_modulation", "block 0, fwd+bwd", true, true, verify_modulation);

}  // namespace
}  // namespace cli
}  // namespace detdit
