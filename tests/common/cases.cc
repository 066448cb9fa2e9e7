#include "common/cases.h"

#include <cmath>
#include <cstring>
#include <sstream>

#include "common/scalar_math.h"

namespace detdit {
namespace testing {

namespace {
constexpr int64_t kInterleavedTags[10] = {0, 1, 0, 2, 0, 0, 1, 0, 2, 0};

IndexPlan must_plan(Status s, IndexPlan plan) {
  EXPECT_TRUE(s.ok()) << s.to_string();
  return plan;
}
}  // namespace

std::string IndexCase::name() const {
  std::ostringstream os;
  os << (packing == Packing::kBlock ? "block" : "interleaved") << "_S" << seq_len << "_T" << num_timesteps << "_B"
     << batch;
  return os.str();
}

IndexCase make_index_case(Packing packing, int64_t seq_len, int64_t num_timesteps, int64_t batch) {
  IndexCase c;
  c.packing = packing;
  c.seq_len = seq_len;
  c.num_timesteps = num_timesteps;
  c.batch = batch;
  c.timestep_indices.resize(seq_len);
  c.tags.resize(seq_len);
  if (packing == Packing::kInterleaved) {
    for (int64_t s = 0; s < seq_len; ++s) {
      c.timestep_indices[s] = s % num_timesteps;
      c.tags[s] = kInterleavedTags[s % 10];
    }
    return c;
  }
  for (int64_t t = 0; t < num_timesteps; ++t) {
    const int64_t begin = t * seq_len / num_timesteps, end = (t + 1) * seq_len / num_timesteps;
    const int64_t length = end - begin;
    const int64_t text = length * 5 / 100, audio = length * 15 / 100;
    for (int64_t s = begin; s < end; ++s) {
      c.timestep_indices[s] = t;
      c.tags[s] = s - begin < text ? 1 : (end - s <= audio ? 2 : 0);
    }
  }
  return c;
}

IndexPlan adaln_plan(const IndexCase& c) {
  IndexPlan plan;
  Status s = IndexPlan::from_timesteps_and_tags(
      TensorView::contiguous(const_cast<int64_t*>(c.timestep_indices.data()), DType::kI64, {c.seq_len}),
      TensorView::contiguous(const_cast<int64_t*>(c.tags.data()), DType::kI64, {c.seq_len}), c.num_timesteps,
      c.batch, &plan);
  return must_plan(s, plan);
}

IndexPlan timestep_plan(const IndexCase& c) { return plan_from_rows(c.timestep_indices, c.num_timesteps, c.batch); }

IndexPlan plan_from_rows(const std::vector<int64_t>& rows, int64_t num_rows, int64_t batch) {
  IndexPlan plan;
  Status s = IndexPlan::from_row_index(
      TensorView::contiguous(const_cast<int64_t*>(rows.data()), DType::kI64, {static_cast<int64_t>(rows.size())}),
      num_rows, batch, &plan);
  return must_plan(s, plan);
}

IndexCase single_position_case(const IndexCase& c, int64_t p) {
  IndexCase alone = c;
  alone.seq_len = 1;
  alone.batch = 1;
  alone.timestep_indices = {c.timestep_indices[p % c.seq_len]};
  alone.tags = {c.tags[p % c.seq_len]};
  return alone;
}

std::vector<int64_t> unreferenced_rows(const IndexCase& c) {
  std::vector<bool> used(c.num_rows(), false);
  for (int64_t s = 0; s < c.seq_len; ++s) used[c.row(s)] = true;
  std::vector<int64_t> rows;
  for (int64_t r = 0; r < c.num_rows(); ++r)
    if (!used[r]) rows.push_back(r);
  return rows;
}

std::vector<IndexCase> standard_cases(int64_t max_positions) {
  std::vector<IndexCase> cases;
  for (Packing packing : {Packing::kBlock, Packing::kInterleaved})
    for (int64_t seq_len : {1, 3, 257, 4097})
      for (int64_t batch : {1, 2, 3})
        for (int64_t num_timesteps : {1, 3, 4})
          if (seq_len * batch <= max_positions) cases.push_back(make_index_case(packing, seq_len, num_timesteps, batch));
  return cases;
}

uint64_t correctly_rounded_bits(double exact, DType dtype) {
  const float nearest_float = static_cast<float>(exact);  // correctly rounded to fp32 (RNE)
  if (dtype == DType::kF32) return num::float_bits(nearest_float);
  // 16-bit: pick the nearest of the candidate and its neighbours in FP64 (exact), ties to even.
  auto encode = [&](float v) -> uint16_t { return dtype == DType::kBF16 ? num::float_to_bf16(v) : num::float_to_f16(v); };
  auto decode = [&](uint16_t h) -> double {
    return dtype == DType::kBF16 ? num::bf16_to_float(h) : num::f16_to_float(h);
  };
  if (std::isnan(exact)) return num::kCanonicalNan16;
  const uint16_t guess = encode(nearest_float);
  uint16_t best = guess;
  double best_err = std::fabs(decode(guess) - exact);
  for (int delta : {-1, 1}) {
    const uint16_t cand = static_cast<uint16_t>(guess + delta);
    const double v = decode(cand);
    if (std::isnan(v) || ((cand ^ guess) & 0x8000u)) continue;
    const double err = std::fabs(v - exact);
    if (err < best_err || (err == best_err && (cand & 1u) == 0)) {
      best = cand;
      best_err = err;
    }
  }
  return best;
}

double correctly_rounded(double exact, DType dtype) {
  const uint64_t bits = correctly_rounded_bits(exact, dtype);
  if (dtype == DType::kF32) return num::bits_float(static_cast<uint32_t>(bits));
  return dtype == DType::kBF16 ? num::bf16_to_float(static_cast<uint16_t>(bits))
                               : num::f16_to_float(static_cast<uint16_t>(bits));
}

double fraction_correctly_rounded(const HostTensor& got, const std::vector<double>& exact) {
  int64_t hits = 0;
  const std::size_t width = dtype_size(got.dtype());
  for (int64_t i = 0; i < got.numel(); ++i) {
    uint64_t bits = 0;
    std::memcpy(&bits, static_cast<const char*>(got.data()) + i * width, width);
    hits += bits == correctly_rounded_bits(exact[i], got.dtype()) ? 1 : 0;
  }
  return got.numel() ? static_cast<double>(hits) / static_cast<double>(got.numel()) : 1.0;
}

::testing::AssertionResult within_tolerance(const HostTensor& got, const std::vector<double>& ref, double atol,
                                            double rtol) {
  int64_t bad = 0, worst = -1;
  double worst_excess = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double err = std::fabs(got.get(i) - ref[i]), bound = atol + rtol * std::fabs(ref[i]);
    if (!(err <= bound)) {
      ++bad;
      if (worst < 0 || err - bound > worst_excess) {
        worst = i;
        worst_excess = err - bound;
      }
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << got.numel() << " elements outside atol " << atol
                                       << " / rtol " << rtol << "; worst at " << worst << ": got " << got.get(worst)
                                       << ", reference " << ref[worst];
}

::testing::AssertionResult still_canary(const std::vector<HostTensor*>& outputs) {
  for (std::size_t i = 0; i < outputs.size(); ++i)
    if (!all_bytes_are(*outputs[i], kCanary))
      return ::testing::AssertionFailure() << "output " << i << " of " << outputs.size() << " was written";
  return ::testing::AssertionSuccess();
}

bool all_bytes_are(const HostTensor& t, uint8_t value) {
  const auto* bytes = static_cast<const uint8_t*>(t.data());
  for (std::size_t i = 0; i < t.nbytes(); ++i)
    if (bytes[i] != value) return false;
  return true;
}

RmsnormReference rmsnorm_reference(const HostTensor& x, const HostTensor& weight, const HostTensor* shift,
                                   const HostTensor* scale, const std::vector<int64_t>& row_of, int64_t num_rows,
                                   const HostTensor& grad, double eps, DType dtype) {
  const int64_t hidden = weight.numel(), positions = x.numel() / hidden;
  auto stored = [&](double v) { return correctly_rounded(v, dtype); };  // the model stores this value
  RmsnormReference ref;
  ref.out.resize(x.numel());
  ref.dx.resize(x.numel());
  ref.d_weight.assign(hidden, 0.0);
  ref.d_shift.assign(num_rows * hidden, 0.0);
  ref.d_scale.assign(num_rows * hidden, 0.0);
  std::vector<double> d_n(hidden);
  for (int64_t p = 0; p < positions; ++p) {
    const int64_t base = p * hidden, table = row_of.empty() ? 0 : row_of[p] * hidden;
    double ss = 0;
    for (int64_t i = 0; i < hidden; ++i) ss += x.get(base + i) * x.get(base + i);
    const double rstd = 1.0 / std::sqrt(ss / hidden + eps);
    double dot = 0;
    for (int64_t i = 0; i < hidden; ++i) {
      const double xi = x.get(base + i), wi = weight.get(i), g = grad.get(base + i);
      const double n = stored(wi * xi * rstd);
      const double t1 = shift ? stored(1.0 + scale->get(table + i)) : 1.0;
      ref.out[base + i] = shift ? stored(stored(n * t1) + shift->get(table + i)) : n;
      d_n[i] = g * t1;
      dot += wi * d_n[i] * xi;
      ref.d_weight[i] += d_n[i] * xi * rstd;
      if (shift) {
        ref.d_shift[table + i] += g;
        ref.d_scale[table + i] += g * n;
      }
    }
    for (int64_t i = 0; i < hidden; ++i) {
      const double xi = x.get(base + i);
      ref.dx[base + i] = rstd * weight.get(i) * d_n[i] - xi * rstd * rstd * rstd * dot / hidden;
    }
  }
  return ref;
}

std::vector<int64_t> adaln_rows_of_positions(const IndexCase& c) {
  std::vector<int64_t> rows(c.positions());
  for (int64_t p = 0; p < c.positions(); ++p) rows[p] = c.row(p % c.seq_len);
  return rows;
}

std::vector<int64_t> timestep_rows_of_positions(const IndexCase& c) {
  std::vector<int64_t> rows(c.positions());
  for (int64_t p = 0; p < c.positions(); ++p) rows[p] = c.timestep_indices[p % c.seq_len];
  return rows;
}

std::vector<double> row_gather_grad_exact(const IndexCase& c, const HostTensor& grad, int64_t hidden) {
  std::vector<double> sum(c.num_rows() * 6 * hidden, 0.0);
  for (int chunk = 0; chunk < 6; ++chunk)
    for (int64_t p = 0; p < c.positions(); ++p)
      for (int64_t i = 0; i < hidden; ++i)
        sum[c.row(p % c.seq_len) * 6 * hidden + chunk * hidden + i] += grad.get((chunk * c.positions() + p) * hidden + i);
  return sum;
}

ProjectionReference projection_reference(const HostTensor& temb, const HostTensor& weight, const HostTensor& bias,
                                         const std::vector<double>* d_table, DType dtype) {
  const int64_t rows = temb.shape()[0], in = temb.shape()[1], out = weight.shape()[0];
  ProjectionReference ref;
  ref.act.resize(rows * in);
  ref.table.resize(rows * out);
  for (int64_t i = 0; i < rows * in; ++i) {
    const double z = temb.get(i);
    ref.act[i] = correctly_rounded(z / (1.0 + std::exp(-z)), dtype);
  }
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t n = 0; n < out; ++n) {
      double acc = bias.get(n);
      for (int64_t k = 0; k < in; ++k) acc += ref.act[t * in + k] * weight.get(n * in + k);
      ref.table[t * out + n] = correctly_rounded(acc, dtype);
    }
  if (!d_table) return ref;
  ref.d_weight.assign(out * in, 0.0);
  ref.d_bias.assign(out, 0.0);
  ref.d_temb.assign(rows * in, 0.0);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t n = 0; n < out; ++n) {
      const double g = (*d_table)[t * out + n];
      ref.d_bias[n] += g;
      for (int64_t k = 0; k < in; ++k) {
        ref.d_weight[n * in + k] += g * ref.act[t * in + k];
        ref.d_temb[t * in + k] += g * weight.get(n * in + k);
      }
    }
  for (int64_t i = 0; i < rows * in; ++i) {
    const double z = temb.get(i), sig = 1.0 / (1.0 + std::exp(-z));
    ref.d_temb[i] *= sig * (1.0 + z * (1.0 - sig));
  }
  return ref;
}

HostTensor random_tensor(DType dtype, std::vector<int64_t> shape, uint64_t seed, double mean, double std) {
  HostTensor t(dtype, std::move(shape));
  fill_normal(&t, seed, mean, std);
  return t;
}

HostTensor clone(const HostTensor& t) {
  HostTensor copy(t.dtype(), t.shape());
  std::memcpy(copy.data(), t.data(), t.nbytes());
  return copy;
}

}  // namespace testing
}  // namespace detdit
