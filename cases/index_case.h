// Index cases: the packed sequences every row-wise case runs on, one
// definition for the whole tree (tests, verify, bench, the parallel regions).
//
// A (S,) sequence over T timesteps and 3 modalities (0 video, 1 text, 2 audio),
// AdaLN row ti*3 + tag, shared by B batch items:
//   block:       T contiguous runs (run t = [t*S/T, (t+1)*S/T)); in each run the
//                first 5 % of positions (floor) are text, the last 15 % (floor)
//                audio, the rest video;
//   interleaved: position s has timestep s % T and the tag kInterleavedTags[s % 10].
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "detdit/numerics.h"
#include "detdit/plan.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {
namespace cases {

enum class Packing { kBlock, kInterleaved };
const char* packing_name(Packing packing);  // "block" / "interleaved"
constexpr int64_t kInterleavedTags[10] = {0, 1, 0, 2, 0, 0, 1, 0, 2, 0};

struct IndexCase {
  Packing packing = Packing::kBlock;
  int64_t seq_len = 0, num_timesteps = 0, batch = 0;
  std::vector<int64_t> timestep_indices, tags;  // (S,) each

  int64_t num_rows() const { return 3 * num_timesteps; }  // R of the AdaLN table
  int64_t positions() const { return seq_len * batch; }
  int64_t row(int64_t s) const { return timestep_indices[s] * 3 + tags[s]; }  // AdaLN row of position s
  std::string name() const;  // "block_S257_T3_B2"
};

IndexCase make_index_case(Packing packing, int64_t seq_len, int64_t num_timesteps, int64_t batch);
// The case of flattened position p alone (S = B = 1, the timestep and tag of p).
IndexCase single_position_case(const IndexCase& c, int64_t p);
// The AdaLN rows (of 3T) that no position of the case refers to.
std::vector<int64_t> unreferenced_rows(const IndexCase& c);
// S in {1, 3, 257, 4097}, B in {1, 2, 3}, T in {1, 3, 4}, both packings, with
// at most max_positions positions.
std::vector<IndexCase> standard_cases(int64_t max_positions);
// row_of[p] for every flattened position p = b*S + s: the AdaLN row c.row(s),
// or the timestep index (final_adaln_out's plan).
std::vector<int64_t> adaln_rows_of_positions(const IndexCase& c);
std::vector<int64_t> timestep_rows_of_positions(const IndexCase& c);

// Plans of the case on `device`, built from device copies of its int64 index
// tensors (a CUDA device exercises the CUDA path of plan building): the AdaLN
// rows (R = 3T), the timestep index (R = T), or an explicit (S,) row index.
Status adaln_plan(const IndexCase& c, const Device& device, IndexPlan* plan, Stream stream = nullptr);
Status timestep_plan(const IndexCase& c, const Device& device, IndexPlan* plan, Stream stream = nullptr);
Status row_plan(const std::vector<int64_t>& rows, int64_t num_rows, int64_t batch, const Device& device,
                IndexPlan* plan, Stream stream = nullptr);

}  // namespace cases
}  // namespace detdit
