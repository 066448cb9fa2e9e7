// verify cases of the timestep path: timestep_sinusoid, timestep_mlp and
// adaln_projection on the weights' shapes. Every case checks accuracy against
// an FP64 oracle written here from the math, repeatability (two runs, same
// bytes), row invariance (each timestep alone = the same row inside the
// batch, bitwise) and, on CUDA, equality with the CPU reference.
#include <cmath>
#include <cstring>
#include <functional>

#include "cases/oracle.h"
#include "cases/parallel_for.h"
#include "detdit/adaln.h"
#include "detdit/timestep.h"
#include "verify.h"

namespace detdit {
namespace cli {
namespace {

// Timesteps t_i = frac(0.25 + i * golden ratio) in [0, 1), a spread that does not repeat.
HostTensor make_timesteps(int64_t count) {
  HostTensor t(DType::kF32, {count});
  for (int64_t i = 0; i < count; ++i) {
    double v = 0.25 + 0.6180339887498949 * static_cast<double>(i);
    t.ptr<float>()[i] = static_cast<float>(v - std::floor(v));
  }
  return t;
}

// Rows [row, row + 1) of a (T, ...) buffer.
HostTensor take_row(const HostTensor& b, int64_t row) {
  std::vector<int64_t> shape = b.shape();
  const std::size_t row_bytes = b.nbytes() / static_cast<std::size_t>(shape[0]);
  shape[0] = 1;
  HostTensor out(b.dtype(), shape);
  std::memcpy(out.data(), static_cast<const char*>(b.data()) + row * row_bytes, row_bytes);
  return out;
}

// One call of an op: inputs (host) -> output (host), on `device`.
using RunFn = std::function<Status(const Device& device, const std::vector<HostTensor>& inputs, HostTensor* out)>;

// The checks every row-local timestep op shares. inputs[batched_input] is the
// (T, ...) input whose rows are the timesteps; the others are shared.
void standard_checks(const VerifyContext& ctx, const RunFn& run, const std::vector<HostTensor>& inputs,
                     std::size_t batched_input, const HostTensor& first, std::vector<CheckRow>* rows) {
  const int64_t count = inputs[batched_input].shape()[0];
  rows->push_back(timed_check("repeatability", [&](CheckRow* row) {
    HostTensor again;
    DETDIT_RETURN_IF_ERROR(run(ctx.device, inputs, &again));
    compare_bytes(first.data(), again.data(), first.nbytes(), first.dtype(), "second run", row);
    return Status::ok_status();
  }));
  rows->push_back(timed_check("row invariance T=1 vs T=" + std::to_string(count), [&](CheckRow* row) {
    for (int64_t t = 0; t < count; ++t) {
      std::vector<HostTensor> alone = inputs;
      alone[batched_input] = take_row(inputs[batched_input], t);
      HostTensor out;
      DETDIT_RETURN_IF_ERROR(run(ctx.device, alone, &out));
      HostTensor expected = take_row(first, t);
      compare_bytes(expected.data(), out.data(), out.nbytes(), out.dtype(), "row " + std::to_string(t), row);
    }
    return Status::ok_status();
  }));
  if (ctx.device.is_cuda()) {
    rows->push_back(timed_check("cuda = cpu reference", [&](CheckRow* row) {
      HostTensor reference;
      DETDIT_RETURN_IF_ERROR(run(Device::cpu(), inputs, &reference));
      compare_bytes(reference.data(), first.data(), first.nbytes(), first.dtype(), "cpu vs cuda", row);
      return Status::ok_status();
    }));
  }
}

// ---- timestep_sinusoid -------------------------------------------------------

Status run_sinusoid(const Device& device, const std::vector<HostTensor>& in, HostTensor* out, int64_t channels) {
  DeviceTensor timesteps, features;
  DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(in[0], device, &timesteps));
  DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(DType::kF32, {in[0].shape()[0], channels}, device, &features));
  TimestepSinusoidParams p;
  p.in.timesteps = timesteps.view();
  p.features = features.view();
  DETDIT_RETURN_IF_ERROR(timestep_sinusoid_forward(p));
  return features.to_host(out);
}

// diffusers' Timesteps(C, flip_sin_to_cos=True): [cos(t f_k) | sin(t f_k)],
// f_k = exp(-ln(10000) k / half), in double.
double sinusoid64(double t, int64_t channel, int64_t channels) {
  const int64_t half = channels / 2, k = channel % half;
  const double arg = t * std::exp(-std::log(10000.0) * static_cast<double>(k) / static_cast<double>(half));
  return channel < half ? std::cos(arg) : std::sin(arg);
}

Status verify_sinusoid(const VerifyContext& ctx, std::vector<CheckRow>* rows) {
  const int64_t channels = ctx.weights->config.freq_dim;
  const RunFn run = [channels](const Device& d, const std::vector<HostTensor>& in, HostTensor* out) {
    return run_sinusoid(d, in, out, channels);
  };
  for (int64_t count : ctx.quick ? std::vector<int64_t>{1, 7} : std::vector<int64_t>{1, 3, 7, 64, 1000}) {
    std::vector<HostTensor> inputs = {make_timesteps(count)};
    HostTensor features;
    CheckRow accuracy = timed_check("accuracy vs fp64 T=" + std::to_string(count), [&](CheckRow* row) {
      DETDIT_RETURN_IF_ERROR(run(ctx.device, inputs, &features));
      row->max_error = 0;
      for (int64_t t = 0; t < count; ++t) {
        for (int64_t c = 0; c < channels; ++c) {
          const double exact = sinusoid64(inputs[0].ptr<float>()[t], c, channels);
          row->max_error = std::max(row->max_error, std::fabs(features.get(t * channels + c) - exact));
        }
      }
      row->bound = std::ldexp(1.0, -23);  // the FP32 argument t*f_k is rounded once: |error| <= 2^-24 + the result's rounding
      row->error_unit = "abs";
      return Status::ok_status();
    });
    rows->push_back(accuracy);
    if (!accuracy.detail.empty() && features.nbytes() == 0) continue;
    if (count > 1) standard_checks(ctx, run, inputs, 0, features, rows);
  }
  return Status::ok_status();
}
DETDIT_VERIFY_CASE("timestep_sinusoid", "F from weights", true, true, verify_sinusoid);

// ---- timestep_mlp ------------------------------------------------------------

struct MlpWeights {
  HostTensor w1, b1, w2, b2;
};

Status copy_weight(const Weights& weights, const std::string& name, HostTensor* out) {
  TensorView v;
  DETDIT_RETURN_IF_ERROR(weights.view(name, &v));
  std::vector<int64_t> shape(v.shape, v.shape + v.rank);
  *out = HostTensor(v.dtype, shape);
  std::memcpy(out->data(), v.data, out->nbytes());
  return Status::ok_status();
}

Status run_mlp(const Device& device, const std::vector<HostTensor>& in, HostTensor* out) {
  // in: features, w1, b1, w2, b2
  DeviceTensor t[5], temb;
  for (int i = 0; i < 5; ++i) DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(in[i], device, &t[i]));
  DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(DType::kF32, {in[0].shape()[0], in[3].shape()[0]}, device, &temb));
  TimestepMlpParams p;
  p.in.features = t[0].view();
  p.in.w1 = t[1].view();
  p.in.b1 = t[2].view();
  p.in.w2 = t[3].view();
  p.in.b2 = t[4].view();
  p.temb = temb.view();
  DETDIT_RETURN_IF_ERROR(timestep_mlp_forward(p));
  return temb.to_host(out);
}

// y = W x + b in double for every row of x (T, K), W (N, K).
std::vector<double> linear64(const std::vector<double>& x, const HostTensor& w, const HostTensor* b, int64_t rows) {
  const int64_t n_out = w.shape()[0], k_in = w.shape()[1];
  std::vector<double> y(static_cast<std::size_t>(rows * n_out));
  cases::parallel_for(0, n_out, [&](int64_t n) {
    for (int64_t t = 0; t < rows; ++t) {
      double acc = b ? b->get(n) : 0.0;
      for (int64_t k = 0; k < k_in; ++k) acc += x[t * k_in + k] * w.get(n * k_in + k);
      y[t * n_out + n] = acc;
    }
  });
  return y;
}


// The projection in double, one pass: exact[t, n] = sum_k a[t, k] w[n, k] + b[n]
// and magnitude[t, n] = sum_k |a[t, k] w[n, k]| + |b[n]|.
void projection64(const std::vector<double>& act, const HostTensor& w, const HostTensor& b, int64_t rows,
                  std::vector<double>* exact, std::vector<double>* magnitude) {
  const int64_t n_out = w.shape()[0], k_in = w.shape()[1];
  exact->assign(static_cast<std::size_t>(rows * n_out), 0.0);
  magnitude->assign(exact->size(), 0.0);
  cases::parallel_for(0, n_out, [&](int64_t n) {
    std::vector<double> wn(static_cast<std::size_t>(k_in));  // row n of w, exact
    for (int64_t k = 0; k < k_in; ++k) wn[k] = w.get(n * k_in + k);
    for (int64_t t = 0; t < rows; ++t) {
      double acc = b.get(n), mag = std::fabs(acc);
      for (int64_t k = 0; k < k_in; ++k) {
        const double p = act[t * k_in + k] * wn[k];
        acc += p;
        mag += std::fabs(p);
      }
      (*exact)[t * n_out + n] = acc;
      (*magnitude)[t * n_out + n] = mag;
    }
  });
}

Status verify_mlp(const VerifyContext& ctx, std::vector<CheckRow>* rows) {
  const int64_t count = 4;
  std::vector<HostTensor> inputs(5);
  HostTensor features;
  DETDIT_RETURN_IF_ERROR(run_sinusoid(Device::cpu(), {make_timesteps(count)}, &features, ctx.weights->config.freq_dim));
  inputs[0] = features;
  const char* names[] = {"time_embedder.linear_1.weight", "time_embedder.linear_1.bias",
                         "time_embedder.linear_2.weight", "time_embedder.linear_2.bias"};
  for (int i = 0; i < 4; ++i) DETDIT_RETURN_IF_ERROR(copy_weight(*ctx.weights, names[i], &inputs[i + 1]));
  HostTensor temb;
  rows->push_back(timed_check("accuracy vs fp64 T=4", [&](CheckRow* row) {
    DETDIT_RETURN_IF_ERROR(run_mlp(ctx.device, inputs, &temb));
    std::vector<double> x(static_cast<std::size_t>(features.numel()));
    for (int64_t i = 0; i < features.numel(); ++i) x[i] = features.get(i);
    std::vector<double> hidden = linear64(x, inputs[1], &inputs[2], count);
    for (double& h : hidden) h = cases::silu64(h);
    std::vector<double> exact = linear64(hidden, inputs[3], &inputs[4], count);
    double max_abs = 0, max_ref = 0;
    for (std::size_t i = 0; i < exact.size(); ++i) {
      max_abs = std::max(max_abs, std::fabs(temb.get(static_cast<int64_t>(i)) - exact[i]));
      max_ref = std::max(max_ref, std::fabs(exact[i]));
    }
    row->max_error = max_abs / max_ref;
    row->bound = 1e-4;  // FP32 chains of 256 and 5376 terms
    row->error_unit = "max|err|/max|ref|";
    return Status::ok_status();
  }));
  if (temb.nbytes() > 0) standard_checks(ctx, run_mlp, inputs, 0, temb, rows);
  return Status::ok_status();
}
DETDIT_VERIFY_CASE("timestep_mlp", "weights T=4", true, true, verify_mlp);

// ---- adaln_projection -------------------------------------------------------

Status run_projection(const Device& device, const std::vector<HostTensor>& in, HostTensor* out) {
  // in: temb, weight, bias
  DeviceTensor temb, weight, bias, table;
  DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(in[0], device, &temb));
  DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(in[1], device, &weight));
  DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(in[2], device, &bias));
  DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(in[1].dtype(), {in[0].shape()[0], in[1].shape()[0]}, device, &table));
  AdalnProjectionParams p;
  p.in.temb = temb.view();
  p.in.weight = weight.view();
  p.in.bias = bias.view();
  p.table = table.view();
  DETDIT_RETURN_IF_ERROR(adaln_projection_forward(p));
  return table.to_host(out);
}

Status verify_projection(const VerifyContext& ctx, std::vector<CheckRow>* rows) {
  const int64_t count = ctx.quick ? 2 : 4, dim = ctx.weights->config.time_embed_dim;
  std::vector<HostTensor> inputs(3);
  inputs[0] = HostTensor(DType::kF32, {count, dim});
  fill_verify_normal(&inputs[0], ctx.seed + 11);
  DETDIT_RETURN_IF_ERROR(copy_weight(*ctx.weights, "transformer_blocks.0.adaln_proj.linear.weight", &inputs[1]));
  DETDIT_RETURN_IF_ERROR(copy_weight(*ctx.weights, "transformer_blocks.0.adaln_proj.linear.bias", &inputs[2]));
  HostTensor table;
  std::vector<double> exact, magnitude;  // the FP64 result and sum |a_k w_k| + |b| per output
  rows->push_back(timed_check("error within the fp32-accumulation bound", [&](CheckRow* row) {
    DETDIT_RETURN_IF_ERROR(run_projection(ctx.device, inputs, &table));
    // Oracle: silu in double, rounded to bf16 (the model's declared cast;
    // HostTensor::set rounds to fp32, then to bf16), projection in double.
    HostTensor act_bf16(DType::kBF16, {count, dim});
    for (int64_t i = 0; i < act_bf16.numel(); ++i) act_bf16.set(i, cases::silu64(inputs[0].get(i)));
    const std::vector<double> act = cases::to_doubles(act_bf16);
    projection64(act, inputs[1], inputs[2], count, &exact, &magnitude);
    // An FP32 chain of D products and the bias errs by at most
    // (D + 1) 2^-24 sum|a_k w_k| + |b| (first order), the final bf16 rounding
    // by 2^-8 |out|: the scaled error must stay <= 1.
    const double chain = static_cast<double>(dim + 1) * 0x1p-24;
    row->max_error = 0;
    for (std::size_t i = 0; i < exact.size(); ++i) {
      const double err = std::fabs(table.get(int64_t(i)) - exact[i]);
      const double allowed = 0x1p-8 * std::fabs(exact[i]) + chain * magnitude[i];
      row->max_error = std::max(row->max_error, err == 0 ? 0.0 : err / allowed);
    }
    row->bound = 1.0;
    row->error_unit = "of the rounding bound";
    return Status::ok_status();
  }));
  // Statistically meaningful only on many outputs (the H3 table has 96768 per timestep).
  if (!exact.empty() && exact.size() >= 100000) {
    rows->push_back(timed_check(">= 99.98 % correctly rounded", [&](CheckRow* row) {
      int64_t wrong = 0;
      for (std::size_t i = 0; i < exact.size(); ++i) wrong += table.ptr<uint16_t>()[i] != cases::correctly_rounded_bits(exact[i], DType::kBF16);
      row->max_error = static_cast<double>(wrong) / static_cast<double>(exact.size());
      row->bound = 2e-4;
      row->error_unit = "fraction not RN";
      return Status::ok_status();
    }));
  }
  if (table.nbytes() > 0) standard_checks(ctx, run_projection, inputs, 0, table, rows);
  return Status::ok_status();
}
DETDIT_VERIFY_CASE("adaln_projection", "block 0, weights' shape", true, true, verify_projection);

}  // namespace
}  // namespace cli
}  // namespace detdit
