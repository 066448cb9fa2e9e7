// The canonical cross-row reduction (docs/numerics.md 6.5) checked against a
// direct implementation of its definition written here: dense per-row
// partials, chunk by chunk (every chunk of 256 positions, +0.0 where the row
// is absent), folded ascending, rounded once. Bitwise, for rmsnorm d_weight /
// d_shift / d_scale, gate_residual d_gate and the row gather d_rows.
//
// Also: the split halves compose. A simulated sequence-parallel split (each
// "rank" owns positions [r*S/n, (r+1)*S/n) of every batch item and the chunks
// whose first position it owns, stores its own rows in a permuted order and
// receives every other position as ExtraRows) computes partials of its chunk
// subset; the partials, put in global order and folded, equal the full
// backward bitwise.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

#include "common/backends.h"
#include "support/cases.h"
#include "support/rowwise_fixture.h"
#include "common/scalar_math.h"
#include "support/test_util.h"
#include "detdit/adaln.h"
#include "detdit/gate_residual.h"
#include "detdit/rmsnorm.h"

namespace detdit {
namespace testing {
namespace {

// The definition: out[r, j] = R(fold over every chunk c of partial(c, r, j)),
// partial = chain from +0.0 over the positions of c with row r.
using Term = std::function<float(float acc, int64_t p, int64_t j)>;
HostTensor reduce_by_definition(const IndexCase& c, int64_t rows, int64_t width, bool single_row, DType dtype,
                                const Term& term) {
  HostTensor out(dtype, {rows, width});
  const int64_t positions = c.positions(), chunks = (positions + 255) / 256;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < width; ++j) {
      float acc = 0.0f;
      for (int64_t chunk = 0; chunk < chunks; ++chunk) {
        float partial = 0.0f;
        for (int64_t p = chunk * 256; p < std::min(positions, chunk * 256 + 256); ++p)
          if (single_row || c.row(p % c.seq_len) == r) partial = term(partial, p, j);
        acc = num::add32(acc, partial);
      }
      out.set(r * width + j, round_as(acc, dtype));
    }
  return out;
}

// The library's modulated rmsnorm case at this shape (shift and scale:
// chunks 0 and 1 of its AdaLN table), its forward run; backward() gives the
// op's params with the test's own gradient outputs.
struct NormCase : CpuCase {
  IndexCase index;
  int64_t hidden;
  DType dtype;
  NormCase(const IndexCase& c, int64_t h, DType d) : CpuCase(rmsnorm_case({d, h, c}, 1)), index(c), hidden(h), dtype(d) {
    const Status s = run(Phase::kForward);
    EXPECT_TRUE(s.ok()) << s.to_string();
  }
  RmsnormBackwardParams backward(HostTensor* d_weight, HostTensor* d_shift, HostTensor* d_scale) const {
    RmsnormBackwardParams p;
    p.in.x = view("x");
    p.in.weight = view("weight");
    EXPECT_TRUE(adaln_table_chunk(view("table"), hidden, 0, &p.in.shift).ok());
    EXPECT_TRUE(adaln_table_chunk(view("table"), hidden, 1, &p.in.scale).ok());
    p.in.plan = plan();
    p.rstd = view("rstd");
    p.grad = view("grad");
    if (d_weight) p.d_weight = d_weight->view();
    if (d_shift) p.d_shift = d_shift->view();
    if (d_scale) p.d_scale = d_scale->view();
    return p;
  }
  float t1(int64_t p, int64_t i) const {
    const int64_t row = index.row(p % index.seq_len);
    return round_as(num::add32(1.0f, static_cast<float>((*this)["table"].get(row * 6 * hidden + hidden + i))), dtype);
  }
  float n(int64_t p, int64_t i) const {
    const float r = (*this)["rstd"].ptr<float>()[p];
    return round_as(num::mul32(static_cast<float>((*this)["weight"].get(i)),
                               num::mul32(r, static_cast<float>((*this)["x"].get(p * hidden + i)))),
                    dtype);
  }
};

// gate_residual_backward for d_gate alone (no d_residual, no d_y).
GateResidualBackwardParams gate_gradient_params(const HostTensor& grad, const HostTensor& y, const HostTensor& gate,
                                                const IndexPlan& plan, const HostTensor& d_gate) {
  return {{TensorView(), y.view(), gate.view(), plan}, grad.view(), TensorView(), TensorView(), d_gate.view()};
}

// d_gate by the definition: the partial of a chunk chains fma(grad, y, acc)
// over its positions of the row; grad and y are (B*S, H).
HostTensor gate_gradient_by_definition(const IndexCase& c, const HostTensor& grad, const HostTensor& y, DType dtype) {
  const int64_t h = grad.shape()[1];
  return reduce_by_definition(c, c.num_rows(), h, false, dtype, [&](float acc, int64_t pos, int64_t i) {
    return num::fma32(static_cast<float>(grad.get(pos * h + i)), static_cast<float>(y.get(pos * h + i)), acc);
  });
}

std::vector<IndexCase> small_cases() {
  return {testing::make_index_case(Packing::kBlock, 300, 3, 2), testing::make_index_case(Packing::kInterleaved, 300, 3, 2),
          testing::make_index_case(Packing::kInterleaved, 257, 4, 3), testing::make_index_case(Packing::kBlock, 3, 1, 3)};
}

TEST(CanonicalReduction, RmsnormTableAndWeightGradientsEqualTheDefinition) {
  for (const IndexCase& c : small_cases())
    for (DType dtype : {DType::kBF16, DType::kF32})
      for (DType out_dtype : {DType::kF32, dtype}) {
        SCOPED_TRACE(c.name() + " " + dtype_name(dtype) + " -> " + dtype_name(out_dtype));
        NormCase k(c, 12, dtype);
        const int64_t h = k.hidden;
        HostTensor d_weight(out_dtype, {h}), d_shift(out_dtype, {c.num_rows(), h}), d_scale(out_dtype, {c.num_rows(), h});
        DETDIT_ASSERT_OK(rmsnorm_backward(k.backward(&d_weight, &d_shift, &d_scale)));
        auto g = [&](int64_t p, int64_t i) { return static_cast<float>(k["grad"].get(p * h + i)); };
        HostTensor want_weight = reduce_by_definition(c, 1, h, true, out_dtype, [&](float acc, int64_t p, int64_t i) {
          const float xr = num::mul32(static_cast<float>(k["x"].get(p * h + i)), k["rstd"].ptr<float>()[p]);
          return num::fma32(num::mul32(g(p, i), k.t1(p, i)), xr, acc);
        });
        HostTensor want_shift = reduce_by_definition(c, c.num_rows(), h, false, out_dtype,
                                                     [&](float acc, int64_t p, int64_t i) { return num::add32(acc, g(p, i)); });
        HostTensor want_scale = reduce_by_definition(
            c, c.num_rows(), h, false, out_dtype, [&](float acc, int64_t p, int64_t i) { return num::fma32(g(p, i), k.n(p, i), acc); });
        EXPECT_BITWISE_EQ(want_weight, d_weight);
        EXPECT_BITWISE_EQ(want_shift, d_shift);
        EXPECT_BITWISE_EQ(want_scale, d_scale);
      }
}

TEST(CanonicalReduction, PlainRmsnormWeightGradientEqualsTheDefinition) {
  IndexCase c = testing::make_index_case(Packing::kBlock, 700, 1, 2);
  NormCase k(c, 20, DType::kBF16);
  RmsnormBackwardParams p = k.backward(nullptr, nullptr, nullptr);
  p.in.shift = p.in.scale = TensorView();
  p.in.plan = IndexPlan();
  // the plain forward's rstd equals the modulated one's (same x, same tree)
  HostTensor d_weight(DType::kF32, {20});
  p.d_weight = d_weight.view();
  DETDIT_ASSERT_OK(rmsnorm_backward(p));
  HostTensor want = reduce_by_definition(c, 1, 20, true, DType::kF32, [&](float acc, int64_t pos, int64_t i) {
    const float xr = num::mul32(static_cast<float>(k["x"].get(pos * 20 + i)), k["rstd"].ptr<float>()[pos]);
    return num::fma32(static_cast<float>(k["grad"].get(pos * 20 + i)), xr, acc);
  });
  EXPECT_BITWISE_EQ(want, d_weight);
}

TEST(CanonicalReduction, GateGradientEqualsTheDefinition) {
  for (const IndexCase& c : small_cases())
    for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
      SCOPED_TRACE(c.name() + " " + dtype_name(dtype));
      const int64_t h = 20;
      IndexPlan plan = testing::adaln_plan(c);
      HostTensor grad = random_tensor(dtype, {c.positions(), h}, 11), y = random_tensor(dtype, {c.positions(), h}, 12, 0, 3);
      HostTensor gate = random_tensor(dtype, {c.num_rows(), h}, 13), d_gate(dtype, {c.num_rows(), h});
      DETDIT_ASSERT_OK(gate_residual_backward(gate_gradient_params(grad, y, gate, plan, d_gate)));
      EXPECT_BITWISE_EQ(gate_gradient_by_definition(c, grad, y, dtype), d_gate);
    }
}

TEST(CanonicalReduction, RowGatherGradientEqualsTheDefinition) {
  for (const IndexCase& c : small_cases())
    for (DType out_dtype : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE(c.name());
      const int64_t h = 8;
      IndexPlan plan = testing::adaln_plan(c);
      HostTensor grad = random_tensor(DType::kBF16, {6, c.positions(), h}, 21), d_rows(out_dtype, {c.num_rows(), 6 * h});
      DETDIT_ASSERT_OK(adaln_row_gather_backward({grad.view(), plan, d_rows.view()}));
      HostTensor want = reduce_by_definition(c, c.num_rows(), 6 * h, false, out_dtype, [&](float acc, int64_t pos, int64_t j) {
        return num::add32(acc, static_cast<float>(grad.get(((j / h) * c.positions() + pos) * h + j % h)));
      });
      EXPECT_BITWISE_EQ(want, d_rows);
    }
}

// The task's matrix (S in {1, 3, 257, 4097}, B in {1, 2, 3}, T in {1, 3, 4},
// both packings) and odd lengths around the chunk size.
TEST(CanonicalReduction, CaseMatrixAndOddLengthsEqualTheDefinition) {
  std::vector<IndexCase> cases = testing::standard_cases(3 * 4097);
  for (Packing packing : {Packing::kBlock, Packing::kInterleaved})
    for (int64_t seq_len : {255, 256, 257, 511, 513})
      for (int64_t batch : {1, 2, 3}) cases.push_back(testing::make_index_case(packing, seq_len, 3, batch));
  for (const IndexCase& c : cases) {
    SCOPED_TRACE(c.name());
    const int64_t h = 4;
    IndexPlan plan = testing::adaln_plan(c);
    HostTensor grad = random_tensor(DType::kBF16, {c.positions(), h}, 41), y = random_tensor(DType::kBF16, {c.positions(), h}, 42);
    HostTensor gate = random_tensor(DType::kBF16, {c.num_rows(), h}, 43), d_gate(DType::kF32, {c.num_rows(), h});
    DETDIT_ASSERT_OK(gate_residual_backward(gate_gradient_params(grad, y, gate, plan, d_gate)));
    EXPECT_BITWISE_EQ(gate_gradient_by_definition(c, grad, y, DType::kF32), d_gate);
  }
}

// ---- the split halves -------------------------------------------------------

// One simulated rank: its own rows (a permutation of the positions it owns),
// the chunks it computes, and the position_row map (others' rows as extras).
struct Rank {
  std::vector<int64_t> own_positions;   // own row k holds position own_positions[k]
  std::vector<int64_t> extra_positions;  // extra row k holds position extra_positions[k]
  std::vector<int32_t> chunks, position_row;
};

std::vector<Rank> split(const IndexCase& c, int world) {
  std::vector<Rank> ranks(world);
  auto owner = [&](int64_t p) {
    const int64_t s = p % c.seq_len;
    for (int r = world - 1; r >= 0; --r)
      if (s >= r * c.seq_len / world) return r;
    return 0;
  };
  const int64_t positions = c.positions();
  for (int64_t p = 0; p < positions; ++p) ranks[owner(p)].own_positions.push_back(p);
  for (int r = 0; r < world; ++r) {
    Rank& rank = ranks[r];
    std::reverse(rank.own_positions.begin(), rank.own_positions.end());  // a layout unlike position order
    rank.position_row.assign(positions, 0);
    for (std::size_t k = 0; k < rank.own_positions.size(); ++k) rank.position_row[rank.own_positions[k]] = static_cast<int32_t>(k);
    for (int64_t p = 0; p < positions; ++p)
      if (owner(p) != r) {
        rank.position_row[p] = -1 - static_cast<int32_t>(rank.extra_positions.size());
        rank.extra_positions.push_back(p);
      }
    for (int64_t chunk = 0; chunk * 256 < positions; ++chunk)
      if (owner(chunk * 256) == r) rank.chunks.push_back(static_cast<int32_t>(chunk));
  }
  return ranks;
}

// The rank's ChunkSelection. A rank may own no chunk: its chunk list must
// then still be a non-null pointer, since chunks == nullptr means "every chunk".
ChunkSelection selection(const Rank& rank) {
  static const int32_t kNoChunk = -1;
  return ChunkSelection{rank.chunks.empty() ? &kNoChunk : rank.chunks.data(), static_cast<int64_t>(rank.chunks.size()),
                        rank.position_row.data()};
}

// Rows `positions` of a (P, W) tensor, gathered into a new tensor.
HostTensor take_rows(const HostTensor& t, const std::vector<int64_t>& positions) {
  const int64_t width = t.numel() / t.shape()[0];
  const std::size_t row_bytes = static_cast<std::size_t>(width) * dtype_size(t.dtype());
  std::vector<int64_t> shape = t.shape();
  shape[0] = std::max<int64_t>(1, static_cast<int64_t>(positions.size()));
  HostTensor out(t.dtype(), shape);
  for (std::size_t k = 0; k < positions.size(); ++k)
    std::copy_n(static_cast<const char*>(t.data()) + positions[k] * row_bytes, row_bytes, static_cast<char*>(out.data()) + k * row_bytes);
  return out;
}

TEST(CanonicalReduction, SplitHalvesOfRmsnormComposeToTheFullBackward) {
  for (const IndexCase& c : small_cases())
    for (int world : {2, 3}) {
      SCOPED_TRACE(c.name() + " world " + std::to_string(world));
      NormCase k(c, 12, DType::kBF16);
      const int64_t h = 12, rows = c.num_rows();
      HostTensor d_weight(DType::kBF16, {h}), d_shift(DType::kF32, {rows, h}), d_scale(DType::kBF16, {rows, h});
      DETDIT_ASSERT_OK(rmsnorm_backward(k.backward(&d_weight, &d_shift, &d_scale)));

      HostTensor weight_partials(DType::kF32, {k.plan().num_chunks(), h});
      HostTensor table_partials(DType::kF32, {k.plan().num_segments(), 2 * h});
      const PlanTables& tables = k.plan().host_tables();
      for (const Rank& rank : split(c, world)) {
        HostTensor x = take_rows(k["x"], rank.own_positions), grad = take_rows(k["grad"], rank.own_positions);
        HostTensor rstd = take_rows(k["rstd"], rank.own_positions);
        HostTensor extra_x = take_rows(k["x"], rank.extra_positions), extra_grad = take_rows(k["grad"], rank.extra_positions);
        HostTensor extra_rstd = take_rows(k["rstd"], rank.extra_positions);
        int64_t segments = 0;
        for (int32_t chunk : rank.chunks) segments += tables.chunk_segment_begin[chunk + 1] - tables.chunk_segment_begin[chunk];
        HostTensor w_part(DType::kF32, {std::max<int64_t>(1, static_cast<int64_t>(rank.chunks.size())), h});
        HostTensor t_part(DType::kF32, {std::max<int64_t>(1, segments), 2 * h});
        RmsnormBackwardParams p = k.backward(nullptr, nullptr, nullptr);
        p.in.x = x.view();
        p.grad = grad.view();
        p.rstd = rstd.view();
        ChunkSelection sel = selection(rank);
        ExtraRows extra{extra_x.view(), extra_grad.view(), TensorView(), extra_rstd.view()};
        DETDIT_ASSERT_OK(cpu::rmsnorm_backward_partials(p, sel, extra, w_part.view(), t_part.view(), nullptr));
        // put this rank's partials in global chunk / segment order
        int64_t row = 0;
        for (std::size_t i = 0; i < rank.chunks.size(); ++i) {
          const int32_t chunk = rank.chunks[i];
          std::copy_n(w_part.ptr<float>() + i * h, h, weight_partials.ptr<float>() + chunk * h);
          for (int32_t g = tables.chunk_segment_begin[chunk]; g < tables.chunk_segment_begin[chunk + 1]; ++g, ++row)
            std::copy_n(t_part.ptr<float>() + row * 2 * h, 2 * h, table_partials.ptr<float>() + g * 2 * h);
        }
      }
      HostTensor folded_weight(DType::kBF16, {h}), folded_shift(DType::kF32, {rows, h}), folded_scale(DType::kBF16, {rows, h});
      DETDIT_ASSERT_OK(cpu::fold_chunk_partials(weight_partials.view(), folded_weight.view(), nullptr));
      const TensorView all = table_partials.view();
      DETDIT_ASSERT_OK(cpu::fold_segment_partials(k.plan(), all.narrow(1, 0, h), folded_shift.view(), nullptr));
      DETDIT_ASSERT_OK(cpu::fold_segment_partials(k.plan(), all.narrow(1, h, h), folded_scale.view(), nullptr));
      EXPECT_BITWISE_EQ(d_weight, folded_weight);
      EXPECT_BITWISE_EQ(d_shift, folded_shift);
      EXPECT_BITWISE_EQ(d_scale, folded_scale);
    }
}

TEST(CanonicalReduction, SplitHalvesOfGateResidualComposeToTheFullBackward) {
  for (const IndexCase& c : small_cases())
    for (int world : {2, 3}) {
      SCOPED_TRACE(c.name() + " world " + std::to_string(world));
      const int64_t h = 20, rows = c.num_rows();
      IndexPlan plan = testing::adaln_plan(c);
      HostTensor grad = random_tensor(DType::kBF16, {c.positions(), h}, 31), y = random_tensor(DType::kBF16, {c.positions(), h}, 32);
      HostTensor gate = random_tensor(DType::kBF16, {rows, h}, 33), d_gate(DType::kBF16, {rows, h});
      const GateResidualBackwardParams p = gate_gradient_params(grad, y, gate, plan, d_gate);
      DETDIT_ASSERT_OK(gate_residual_backward(p));

      HostTensor partials(DType::kF32, {plan.num_segments(), h});
      const PlanTables& tables = plan.host_tables();
      for (const Rank& rank : split(c, world)) {
        HostTensor own_grad = take_rows(grad, rank.own_positions), own_y = take_rows(y, rank.own_positions);
        HostTensor extra_grad = take_rows(grad, rank.extra_positions), extra_y = take_rows(y, rank.extra_positions);
        int64_t segments = 0;
        for (int32_t chunk : rank.chunks) segments += tables.chunk_segment_begin[chunk + 1] - tables.chunk_segment_begin[chunk];
        HostTensor part(DType::kF32, {std::max<int64_t>(1, segments), h});
        GateResidualBackwardParams local = p;
        local.grad = own_grad.view();
        local.in.y = own_y.view();
        ChunkSelection sel = selection(rank);
        ExtraRows extra{TensorView(), extra_grad.view(), extra_y.view(), TensorView()};
        DETDIT_ASSERT_OK(cpu::gate_residual_backward_partials(local, sel, extra, part.view(), nullptr));
        int64_t row = 0;
        for (int32_t chunk : rank.chunks)
          for (int32_t g = tables.chunk_segment_begin[chunk]; g < tables.chunk_segment_begin[chunk + 1]; ++g, ++row)
            std::copy_n(part.ptr<float>() + row * h, h, partials.ptr<float>() + g * h);
      }
      HostTensor folded(DType::kBF16, {rows, h});
      DETDIT_ASSERT_OK(cpu::fold_segment_partials(plan, partials.view(), folded.view(), nullptr));
      EXPECT_BITWISE_EQ(d_gate, folded);
    }
}

}  // namespace
}  // namespace testing
}  // namespace detdit
