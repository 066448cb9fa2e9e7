// Shared case generators and oracle helpers of the row-wise op tests.
//
// Packings of a (S,) sequence over T timesteps and 3 modalities (0 video,
// 1 text, 2 audio), row = ti*3 + tag:
//   block:       T contiguous runs (run t = [t*S/T, (t+1)*S/T)); in each run
//                the first 5 % of positions are text, the last 15 % audio, the
//                rest video;
//   interleaved: position s has timestep s % T and the tag kInterleavedTags[s % 10].
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/test_util.h"
#include "detdit/plan.h"

namespace detdit {
namespace testing {

enum class Packing { kBlock, kInterleaved };

struct IndexCase {
  Packing packing = Packing::kBlock;
  int64_t seq_len = 0, num_timesteps = 0, batch = 0;
  std::vector<int64_t> timestep_indices, tags;  // (S,) each

  int64_t num_rows() const { return 3 * num_timesteps; }
  int64_t positions() const { return seq_len * batch; }
  int64_t row(int64_t s) const { return timestep_indices[s] * 3 + tags[s]; }  // AdaLN row of position s
  std::string name() const;  // "block_S257_T3_B2"
};

IndexCase make_index_case(Packing packing, int64_t seq_len, int64_t num_timesteps, int64_t batch);

// The plan of the AdaLN rows (R = 3T), built through from_timesteps_and_tags
// with int64 tensors; or of the timestep index alone (R = T, final_adaln_out).
IndexPlan adaln_plan(const IndexCase& c);
IndexPlan timestep_plan(const IndexCase& c);
// A plan from an explicit (S,) row index.
IndexPlan plan_from_rows(const std::vector<int64_t>& rows, int64_t num_rows, int64_t batch);

// The case of position p alone (S = B = 1, the timestep and tag of p): a row
// computed by itself, for the invariance tests.
IndexCase single_position_case(const IndexCase& c, int64_t p);
// The AdaLN rows (of 3T) that no position of the case refers to.
std::vector<int64_t> unreferenced_rows(const IndexCase& c);

// The matrix of the task: S in {1, 3, 257, 4097}, B in {1, 2, 3}, T in {1, 3, 4},
// both packings; `max_positions` drops the larger combinations (keeps tests fast).
std::vector<IndexCase> standard_cases(int64_t max_positions);

// Oracle helpers. The correctly rounded value of an exact (FP64) result in
// dtype (RNE, as bits) and its value.
uint64_t correctly_rounded_bits(double exact, DType dtype);
double correctly_rounded(double exact, DType dtype);
// Fraction of elements of `got` equal to the correctly rounded `exact`.
double fraction_correctly_rounded(const HostTensor& got, const std::vector<double>& exact);
// |got - ref| <= atol + rtol*|ref| for every element (reports the worst one).
::testing::AssertionResult within_tolerance(const HostTensor& got, const std::vector<double>& ref, double atol,
                                            double rtol);
// Every byte of t equals `value` (the canary of an output that must stay unwritten).
bool all_bytes_are(const HostTensor& t, uint8_t value);
// The byte every output starts as; an output still all kCanary was not written.
constexpr uint8_t kCanary = 0xA5;
// Every byte of every tensor is still kCanary (names the first one written).
::testing::AssertionResult still_canary(const std::vector<HostTensor*>& outputs);

// FP64 reference of the (modulated) RMSNorm forward and backward, rounding
// to `dtype` exactly where the model stores values (n = norm(x), 1 + scale,
// the product, the sum) and straight-through for the gradient. Inputs are
// read as exact values; shift/scale null for the plain norm; row_of[p] is the
// table row of flattened position p.
struct RmsnormReference {
  std::vector<double> out, dx, d_weight, d_shift, d_scale;
};
RmsnormReference rmsnorm_reference(const HostTensor& x, const HostTensor& weight, const HostTensor* shift,
                                   const HostTensor* scale, const std::vector<int64_t>& row_of, int64_t num_rows,
                                   const HostTensor& grad, double eps, DType dtype);
// row_of[p] = c.row(p % S) (AdaLN rows) or c.timestep_indices[p % S].
std::vector<int64_t> adaln_rows_of_positions(const IndexCase& c);
std::vector<int64_t> timestep_rows_of_positions(const IndexCase& c);

// FP64 reference of the adaln_row_gather backward: the exact (3T, 6H) table
// gradient d_rows[r, chunk*H + i] = sum of grad[chunk, p, i] over the
// positions p of row r; grad is (6, B*S, H).
std::vector<double> row_gather_grad_exact(const IndexCase& c, const HostTensor& grad, int64_t hidden);

// FP64 reference of the projection (numerics 5.4 / 6.4), straight-through:
// act = R_W(silu(temb)), table = R_W(act W^T + b) (W = `dtype`); backward from
// an exact table gradient d_table (T, N): dW = d_table^T act, db = sum_t
// d_table, d_temb = silu'(temb) * (d_table W).
struct ProjectionReference {
  std::vector<double> act, table, d_weight, d_bias, d_temb;
};
ProjectionReference projection_reference(const HostTensor& temb, const HostTensor& weight, const HostTensor& bias,
                                         const std::vector<double>* d_table, DType dtype);

// A tensor of normal(mean, std) values rounded to dtype.
HostTensor random_tensor(DType dtype, std::vector<int64_t> shape, uint64_t seed, double mean = 0.0, double std = 1.0);

// A copy of the tensor's bytes (for repeatability / invariance comparisons).
HostTensor clone(const HostTensor& t);

}  // namespace testing
}  // namespace detdit
