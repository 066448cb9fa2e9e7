// verify cases of the row-wise path on the weights' hidden size: the AdaLN
// row gather, the modulated rmsnorm (norm1 weight of block 0) and the gated
// residual, with T = 3 timesteps, block packing (per timestep a contiguous
// run: first 5 % text, last 15 % audio, the rest video) and a random bf16
// AdaLN table. Checks: accuracy vs FP64 (the gather is a byte copy, checked
// bitwise against a direct gather), repeatability of forward and backward, and
// row invariance (a position computed alone, with a one-position plan, equals
// the same position inside the sequence, bitwise).
#include <cmath>
#include <cstring>

#include "common/storage.h"
#include "detdit/adaln.h"
#include "detdit/gate_residual.h"
#include "detdit/plan.h"
#include "detdit/rmsnorm.h"
#include "verify.h"

namespace detdit {
namespace cli {
namespace {

constexpr int64_t kTimesteps = 3;
constexpr double kBf16Roundoff = 0x1p-8;  // u: one bf16 rounding errs by at most u relative

// |got - exact| / (|product| + |exact|): the error in units of the magnitudes
// the roundings act on (0/0 counts as 0, x/0 as infinite).
double scaled_error(double got, double exact, double product) {
  const double err = std::fabs(got - exact), scale = std::fabs(product) + std::fabs(exact);
  if (err == 0) return 0;
  return scale == 0 ? INFINITY : err / scale;
}

struct Sequence {
  int64_t seq_len = 0, batch = 1, hidden = 0;
  HostBuffer rows;  // (S,) int32 AdaLN row ti*3 + tag
  HostBuffer table; // (T, 18H) bf16
};

Sequence make_sequence(const VerifyContext& ctx) {
  Sequence s;
  s.seq_len = ctx.quick ? 257 : 4097;
  s.batch = ctx.quick ? 1 : 2;
  s.hidden = ctx.weights->config.hidden;
  s.rows = HostBuffer(DType::kI32, {s.seq_len});
  for (int64_t p = 0; p < s.seq_len; ++p) {
    const int64_t ti = p * kTimesteps / s.seq_len;
    const int64_t run_begin = (ti * s.seq_len + kTimesteps - 1) / kTimesteps;
    const int64_t run_end = ((ti + 1) * s.seq_len + kTimesteps - 1) / kTimesteps;
    const double at = static_cast<double>(p - run_begin) / static_cast<double>(run_end - run_begin);
    const int64_t tag = at < 0.05 ? 1 : at >= 0.85 ? 2 : 0;
    s.rows.ptr<int32_t>()[p] = static_cast<int32_t>(ti * 3 + tag);
  }
  s.table = HostBuffer(DType::kBF16, {kTimesteps, 18 * s.hidden});
  s.table.fill_normal(ctx.seed + 21, 0.0, 0.5);
  return s;
}

Status build_plan(const HostBuffer& rows, const Device& device, int64_t batch, DeviceTensor* index, IndexPlan* plan) {
  DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(rows, device, index));
  return IndexPlan::from_row_index(index->view(), 3 * kTimesteps, batch, plan);
}

// (3T, 6H) rows view of the table and its chunk c.
TensorView rows_view(const TensorView& table, int64_t hidden) {
  TensorView v = table;
  v.shape[0] = table.shape[0] * 3;
  v.shape[1] = 6 * hidden;
  v.strides[0] = 6 * hidden;
  return v;
}

HostBuffer one_position(const HostBuffer& b, int64_t position, int64_t width) {
  HostBuffer out(b.dtype(), {1, width});
  const std::size_t row_bytes = static_cast<std::size_t>(width) * dtype_size(b.dtype());
  std::memcpy(out.data(), static_cast<const char*>(b.data()) + position * row_bytes, row_bytes);
  return out;
}

// Positions probed alone: both ends, every tag boundary region, a spread.
std::vector<int64_t> probe_positions(int64_t positions) {
  std::vector<int64_t> probes;
  for (int64_t i = 0; i < 8; ++i) probes.push_back(i * (positions - 1) / 7);
  return probes;
}

// ---- rmsnorm (modulated) -----------------------------------------------------

struct NormInputs {
  HostBuffer x, weight, table, rows;
  int64_t batch = 1, hidden = 0;
};

Status run_norm(const Device& device, const NormInputs& in, HostBuffer* out, HostBuffer* rstd_out = nullptr) {
  DeviceTensor x, weight, table, index, out_t, rstd;
  IndexPlan plan;
  DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(in.x, device, &x));
  DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(in.weight, device, &weight));
  DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(in.table, device, &table));
  DETDIT_RETURN_IF_ERROR(build_plan(in.rows, device, in.batch, &index, &plan));
  DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(in.x.dtype(), in.x.shape(), device, &out_t));
  DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(DType::kF32, {in.x.shape()[0]}, device, &rstd));
  RmsnormParams p;
  p.in.x = x.view();
  p.in.weight = weight.view();
  const TensorView rows = rows_view(table.view(), in.hidden);
  DETDIT_RETURN_IF_ERROR(adaln_table_chunk(rows, in.hidden, 0, &p.in.shift));  // shift_msa
  DETDIT_RETURN_IF_ERROR(adaln_table_chunk(rows, in.hidden, 1, &p.in.scale));  // scale_msa
  p.in.plan = plan;
  p.out = out_t.view();
  p.rstd = rstd.view();
  DETDIT_RETURN_IF_ERROR(rmsnorm_forward(p));
  if (rstd_out != nullptr) DETDIT_RETURN_IF_ERROR(rstd.to_host(rstd_out));
  return out_t.to_host(out);
}

Status verify_rmsnorm(const VerifyContext& ctx, std::vector<CheckRow>* rows) {
  const Sequence seq = make_sequence(ctx);
  const int64_t H = seq.hidden, M = seq.batch * seq.seq_len;
  NormInputs in;
  in.x = HostBuffer(DType::kBF16, {M, H});
  in.x.fill_normal(ctx.seed + 31);
  TensorView w;
  DETDIT_RETURN_IF_ERROR(ctx.weights->view("transformer_blocks.0.norm1.weight", &w));
  in.weight = HostBuffer(DType::kBF16, {H});
  std::memcpy(in.weight.data(), w.data, in.weight.nbytes());
  in.table = seq.table;
  in.rows = seq.rows;
  in.batch = seq.batch;
  in.hidden = H;
  HostBuffer out;
  rows->push_back(timed_check("accuracy vs fp64", [&](CheckRow* row) {
    DETDIT_RETURN_IF_ERROR(run_norm(ctx.device, in, &out));
    row->max_error = 0;
    for (int64_t m = 0; m < M; ++m) {
      double ss = 0;
      for (int64_t h = 0; h < H; ++h) ss += in.x.get(m * H + h) * in.x.get(m * H + h);
      const double rstd = 1.0 / std::sqrt(ss / static_cast<double>(H) + 1e-5);
      const int64_t r = seq.rows.ptr<int32_t>()[m % seq.seq_len];
      for (int64_t h = 0; h < H; ++h) {
        const double shift = seq.table.get(r * 6 * H + h), scale = seq.table.get(r * 6 * H + H + h);
        const double product = in.x.get(m * H + h) * rstd * in.weight.get(h) * (1.0 + scale);
        row->max_error = std::max(row->max_error, scaled_error(out.get(m * H + h), product + shift, product));
      }
    }
    // Roundings to bf16 of n, 1 + scale and the product each err by u|product|
    // (first order), the sum by u|out|; FP32 statistics add ~1e-6 relative.
    row->max_error /= kBf16Roundoff;
    row->bound = 3.1;
    row->error_unit = "u=2^-8 of |n(1+s)|+|out|";
    return Status::ok_status();
  }));
  if (out.nbytes() == 0) return Status::ok_status();
  rows->push_back(timed_check("forward repeatability", [&](CheckRow* row) {
    HostBuffer again;
    DETDIT_RETURN_IF_ERROR(run_norm(ctx.device, in, &again));
    compare_bytes(out.data(), again.data(), out.nbytes(), out.dtype(), "second run", row);
    return Status::ok_status();
  }));
  rows->push_back(timed_check("row invariance (position alone)", [&](CheckRow* row) {
    for (int64_t p : probe_positions(M)) {
      NormInputs alone = in;
      alone.x = one_position(in.x, p, H);
      alone.rows = HostBuffer(DType::kI32, {1});
      alone.rows.ptr<int32_t>()[0] = seq.rows.ptr<int32_t>()[p % seq.seq_len];
      alone.batch = 1;
      HostBuffer got;
      DETDIT_RETURN_IF_ERROR(run_norm(ctx.device, alone, &got));
      HostBuffer expected = one_position(out, p, H);
      compare_bytes(expected.data(), got.data(), got.nbytes(), got.dtype(), "position " + std::to_string(p), row);
    }
    return Status::ok_status();
  }));
  if (ctx.device.is_cuda()) {
    rows->push_back(timed_check("cuda = cpu reference", [&](CheckRow* row) {
      HostBuffer reference;
      DETDIT_RETURN_IF_ERROR(run_norm(Device::cpu(), in, &reference));
      compare_bytes(reference.data(), out.data(), out.nbytes(), out.dtype(), "cpu vs cuda", row);
      return Status::ok_status();
    }));
  }
  return Status::ok_status();
}
DETDIT_VERIFY_CASE("rmsnorm", "modulated, norm1 of block 0", true, true, verify_rmsnorm);

// ---- adaln_row_gather -------------------------------------------------------

Status verify_gather(const VerifyContext& ctx, std::vector<CheckRow>* rows) {
  const Sequence seq = make_sequence(ctx);
  const int64_t H = seq.hidden, S = seq.seq_len;
  rows->push_back(timed_check("byte copy = direct gather", [&](CheckRow* row) {
    DeviceTensor table, index, out;
    IndexPlan plan;
    DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(seq.table, ctx.device, &table));
    DETDIT_RETURN_IF_ERROR(build_plan(seq.rows, ctx.device, 1, &index, &plan));
    DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(DType::kBF16, {6, S, H}, ctx.device, &out));
    AdalnRowGatherParams p;
    p.rows = rows_view(table.view(), H);
    p.plan = plan;
    p.out = out.view();
    DETDIT_RETURN_IF_ERROR(adaln_row_gather_forward(p));
    HostBuffer got;
    DETDIT_RETURN_IF_ERROR(out.to_host(&got));
    HostBuffer expected(DType::kBF16, {6, S, H});
    for (int64_t c = 0; c < 6; ++c) {
      for (int64_t s = 0; s < S; ++s) {
        const int64_t r = seq.rows.ptr<int32_t>()[s];
        std::memcpy(expected.ptr<Bf16>() + (c * S + s) * H, seq.table.ptr<Bf16>() + r * 6 * H + c * H, H * 2);
      }
    }
    compare_bytes(expected.data(), got.data(), got.nbytes(), DType::kBF16, "gathered rows", row);
    return Status::ok_status();
  }));
  return Status::ok_status();
}
DETDIT_VERIFY_CASE("adaln_row_gather", "six chunks", true, true, verify_gather);

// ---- gate_residual ------------------------------------------------------------

Status run_gate(const Device& device, const HostBuffer& residual, const HostBuffer& y, const HostBuffer& table,
                const HostBuffer& index_rows, int64_t batch, int64_t hidden, HostBuffer* out) {
  DeviceTensor r, yt, t, index, o;
  IndexPlan plan;
  DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(residual, device, &r));
  DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(y, device, &yt));
  DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(table, device, &t));
  DETDIT_RETURN_IF_ERROR(build_plan(index_rows, device, batch, &index, &plan));
  DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(residual.dtype(), residual.shape(), device, &o));
  GateResidualParams p;
  p.in.residual = r.view();
  p.in.y = yt.view();
  DETDIT_RETURN_IF_ERROR(adaln_table_chunk(rows_view(t.view(), hidden), hidden, 2, &p.in.gate));  // gate_msa
  p.in.plan = plan;
  p.out = o.view();
  DETDIT_RETURN_IF_ERROR(gate_residual_forward(p));
  return o.to_host(out);
}

Status verify_gate(const VerifyContext& ctx, std::vector<CheckRow>* rows) {
  const Sequence seq = make_sequence(ctx);
  const int64_t H = seq.hidden, M = seq.batch * seq.seq_len;
  HostBuffer residual(DType::kBF16, {M, H}), y(DType::kBF16, {M, H}), out;
  residual.fill_normal(ctx.seed + 41);
  y.fill_normal(ctx.seed + 42, 0.0, 3.0);  // the reference's stand-in sublayer output: 3 randn
  rows->push_back(timed_check("accuracy vs fp64", [&](CheckRow* row) {
    DETDIT_RETURN_IF_ERROR(run_gate(ctx.device, residual, y, seq.table, seq.rows, seq.batch, H, &out));
    row->max_error = 0;
    for (int64_t m = 0; m < M; ++m) {
      const int64_t r = seq.rows.ptr<int32_t>()[m % seq.seq_len];
      for (int64_t h = 0; h < H; ++h) {
        const double product = seq.table.get(r * 6 * H + 2 * H + h) * y.get(m * H + h);
        row->max_error = std::max(row->max_error, scaled_error(out.get(m * H + h), residual.get(m * H + h) + product, product));
      }
    }
    // The product's rounding errs by u|g y|, the sum's by u|out| (first order).
    row->max_error /= kBf16Roundoff;
    row->bound = 1.01;
    row->error_unit = "u=2^-8 of |g y|+|out|";
    return Status::ok_status();
  }));
  if (out.nbytes() == 0) return Status::ok_status();
  rows->push_back(timed_check("row invariance (position alone)", [&](CheckRow* row) {
    for (int64_t p : probe_positions(M)) {
      HostBuffer index(DType::kI32, {1}), got;
      index.ptr<int32_t>()[0] = seq.rows.ptr<int32_t>()[p % seq.seq_len];
      DETDIT_RETURN_IF_ERROR(run_gate(ctx.device, one_position(residual, p, H), one_position(y, p, H), seq.table,
                                      index, 1, H, &got));
      HostBuffer expected = one_position(out, p, H);
      compare_bytes(expected.data(), got.data(), got.nbytes(), got.dtype(), "position " + std::to_string(p), row);
    }
    return Status::ok_status();
  }));
  if (ctx.device.is_cuda()) {
    rows->push_back(timed_check("cuda = cpu reference", [&](CheckRow* row) {
      HostBuffer reference;
      DETDIT_RETURN_IF_ERROR(run_gate(Device::cpu(), residual, y, seq.table, seq.rows, seq.batch, H, &reference));
      compare_bytes(reference.data(), out.data(), out.nbytes(), out.dtype(), "cpu vs cuda", row);
      return Status::ok_status();
    }));
  }
  return Status::ok_status();
}
DETDIT_VERIFY_CASE("gate_residual", "gate_msa, 3 randn sublayer", true, true, verify_gate);

}  // namespace
}  // namespace cli
}  // namespace detdit
