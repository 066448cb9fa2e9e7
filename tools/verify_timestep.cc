// verify case of adaln_projection on the weights' shape: accuracy against
// an FP64 oracle written here from the math, repeatability (two runs, same
// bytes), row invariance (each timestep alone = the same row inside the
// batch, bitwise) and, on CUDA, equality with the CPU reference.
// (timestep_sinusoid and timestep_mlp are op cases: cases/timestep_cases.cc.)
#include <cmath>
#include <cstring>
#include <functional>

#include "common/storage.h"
#include "cpu/parallel.h"
#include "detdit/adaln.h"
#include "detdit/timestep.h"
#include "cases/oracle.h"
#include "verify.h"

namespace detdit {
namespace cli {
namespace {

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

Status copy_weight(const Weights& weights, const std::string& name, HostTensor* out) {
  TensorView v;
  DETDIT_RETURN_IF_ERROR(weights.view(name, &v));
  std::vector<int64_t> shape(v.shape, v.shape + v.rank);
  *out = HostTensor(v.dtype, shape);
  std::memcpy(out->data(), v.data, out->nbytes());
  return Status::ok_status();
}

// The projection in double, one pass: exact[t, n] = sum_k a[t, k] w[n, k] + b[n]
// and magnitude[t, n] = sum_k |a[t, k] w[n, k]| + |b[n]|.
void projection64(const std::vector<double>& act, const HostTensor& w, const HostTensor& b, int64_t rows,
                  std::vector<double>* exact, std::vector<double>* magnitude) {
  const int64_t n_out = w.shape()[0], k_in = w.shape()[1];
  exact->assign(static_cast<std::size_t>(rows * n_out), 0.0);
  magnitude->assign(exact->size(), 0.0);
  dispatch_float_dtype(w.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* wp = w.ptr<T>();
    const T* bp = b.ptr<T>();
    cpu::parallel_for(0, n_out, [&](int64_t n) {
      for (int64_t t = 0; t < rows; ++t) {
        double acc = to_float(bp[n]), mag = std::fabs(acc);
        for (int64_t k = 0; k < k_in; ++k) {
          const double p = act[t * k_in + k] * static_cast<double>(to_float(wp[n * k_in + k]));
          acc += p;
          mag += std::fabs(p);
        }
        (*exact)[t * n_out + n] = acc;
        (*magnitude)[t * n_out + n] = mag;
      }
    });
  });
}

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
    // Oracle: silu in double, rounded to bf16 (the model's declared cast),
    // projection in double.
    std::vector<double> act(static_cast<std::size_t>(count * dim));
    for (std::size_t i = 0; i < act.size(); ++i) {
      act[i] = num::bf16_to_float(num::float_to_bf16(static_cast<float>(cases::silu64(inputs[0].get(int64_t(i))))));
    }
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
      for (std::size_t i = 0; i < exact.size(); ++i) wrong += table.ptr<Bf16>()[i].bits != cases::correctly_rounded_bits(exact[i], DType::kBF16);
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
