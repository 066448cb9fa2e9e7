// libFuzzer harness of the IndexPlan builder (src/plan.cc) on CPU index
// tensors made of the input bytes. Every input must either build a plan whose
// tables mean what plan.h says, or fail with the Status the entries call for:
//   - an entry outside [0, R) (or, with tags, ti outside [0, T) or a tag
//     outside [0, 3)) is an IndexError naming the first bad position;
//   - a bad count (R, T, B) is a ValueError; nothing else is an error.
// The built tables are checked against their definition: rows in range,
// segments of each chunk ascending by row, positions ascending within a
// segment and covering [0, B*S) once, and the per-row table agreeing with
// the segment rows. A violated check traps (the fuzzer reports it).
// Build and run: tests/fuzz/run_fuzzer.sh SECONDS plan (docs/ops.md).
//
// Input: byte 0 picks the builder (bit 0), the index dtype (bit 1) and
// whether the count is a small one or a boundary value (bit 2); bytes 1-2 the
// count, byte 3 the batch; the rest are the entries (int32 or int64, little
// endian; with tags, the first half are timestep indices, the second tags).
// Counts and batches are kept small enough that a valid plan fits in memory
// (R + 1 table entries, B * S positions); the boundary counts are refused
// before anything is allocated.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "detdit/plan.h"

namespace {

using detdit::DType;
using detdit::ErrorKind;
using detdit::IndexPlan;
using detdit::Status;
using detdit::TensorView;

void require(bool condition) {
  if (!condition) __builtin_trap();
}

// Counts at the edges of what both builders refuse: 0, negative, 2^31 and
// values whose product num_timesteps * 3 wraps int64 ((2^64 + 2) / 3 wraps to
// 2). The builder with tags also gets the first T with 3T >= 2^31, which the
// row builder would accept (and allocate 2.9 GB for).
constexpr int64_t kBoundaryCounts[] = {0,
                                       -1,
                                       std::numeric_limits<int64_t>::min(),
                                       std::numeric_limits<int64_t>::max(),
                                       int64_t{1} << 31,
                                       (std::numeric_limits<int64_t>::max() / 3) + 1,
                                       int64_t{6148914691236517206}};
constexpr int64_t kFirstRefusedTimesteps = std::numeric_limits<int32_t>::max() / 3 + 1;

int64_t entry_at(const std::vector<uint8_t>& bytes, bool is_i64, int64_t i) {
  if (is_i64) {
    int64_t v;
    std::memcpy(&v, bytes.data() + 8 * i, 8);
    return v;
  }
  int32_t v;
  std::memcpy(&v, bytes.data() + 4 * i, 4);
  return v;
}

bool outside(int64_t v, int64_t bound) { return v < 0 || v >= bound; }

void check_tables(const IndexPlan& plan, const std::vector<int64_t>& rows, int64_t num_rows, int64_t batch) {
  const int64_t seq_len = static_cast<int64_t>(rows.size()), positions = seq_len * batch;
  require(plan.valid() && plan.seq_len() == seq_len && plan.batch() == batch && plan.num_rows() == num_rows);
  require(plan.positions() == positions && plan.num_chunks() == (positions + 255) / 256);
  const detdit::PlanTables& t = plan.host_tables();
  const int64_t chunks = plan.num_chunks(), segments = plan.num_segments();
  for (int64_t s = 0; s < seq_len; ++s) require(t.row_of_seq[s] == rows[s]);
  require(t.chunk_segment_begin[0] == 0 && t.chunk_segment_begin[chunks] == segments);
  require(t.segment_pos_begin[0] == 0 && t.segment_pos_begin[segments] == positions);
  std::vector<bool> seen(static_cast<std::size_t>(positions), false);
  int64_t most = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int32_t first = t.chunk_segment_begin[c], last = t.chunk_segment_begin[c + 1];
    require(first < last);
    most = std::max<int64_t>(most, last - first);
    for (int32_t g = first; g < last; ++g) {
      require(g == first || t.segment_row[g - 1] < t.segment_row[g]);  // ascending rows in a chunk
      require(t.segment_pos_begin[g] < t.segment_pos_begin[g + 1]);
      for (int32_t k = t.segment_pos_begin[g]; k < t.segment_pos_begin[g + 1]; ++k) {
        const int32_t p = t.segment_positions[k];
        require(p / 256 == c && (k == t.segment_pos_begin[g] || t.segment_positions[k - 1] < p));
        require(!seen[p] && rows[p % seq_len] == t.segment_row[g]);
        seen[p] = true;
      }
    }
  }
  require(most == plan.max_chunk_segments());
  require(t.row_segment_begin[0] == 0 && t.row_segment_begin[num_rows] == segments);
  for (int64_t r = 0; r < num_rows; ++r) {
    for (int32_t k = t.row_segment_begin[r]; k < t.row_segment_begin[r + 1]; ++k) {
      require(t.segment_row[t.row_segments[k]] == r);
      require(k == t.row_segment_begin[r] || t.row_segments[k - 1] < t.row_segments[k]);
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  const bool with_tags = data[0] & 1, is_i64 = data[0] & 2, boundary = data[0] & 4;
  const uint16_t count_bits = static_cast<uint16_t>(data[1] | (data[2] << 8));
  constexpr int kBoundaries = sizeof kBoundaryCounts / sizeof kBoundaryCounts[0];
  int64_t count = static_cast<int64_t>(count_bits % 4096) - 2;
  if (boundary) {
    const int pick = count_bits % (kBoundaries + (with_tags ? 1 : 0));
    count = pick < kBoundaries ? kBoundaryCounts[pick] : kFirstRefusedTimesteps;
  }
  const int64_t batch = static_cast<int64_t>(data[3] % 12) - 2;
  const std::size_t width = is_i64 ? 8 : 4;
  const int64_t entries = static_cast<int64_t>((size - 4) / width);
  std::vector<uint8_t> bytes(data + 4, data + 4 + entries * width);  // aligned copies of the entries
  const DType dtype = is_i64 ? DType::kI64 : DType::kI32;

  IndexPlan plan;
  if (!with_tags) {
    const TensorView index = TensorView::contiguous(bytes.data(), dtype, {entries});
    const Status s = IndexPlan::from_row_index(index, count, batch, &plan);
    if (entries < 1 || batch < 1 || count < 1 || count > std::numeric_limits<int32_t>::max()) {
      require(!s.ok() && s.kind() == ErrorKind::kValue);
      return 0;
    }
    int64_t bad = -1;
    std::vector<int64_t> rows;
    for (int64_t i = 0; i < entries && bad < 0; ++i) {
      const int64_t v = entry_at(bytes, is_i64, i);
      if (outside(v, count)) bad = i;
      rows.push_back(v);
    }
    if (bad >= 0) {
      require(s.kind() == ErrorKind::kIndex);
      require(s.message().rfind("row_index[" + std::to_string(bad) + "] = ", 0) == 0);
      return 0;
    }
    require(s.ok());
    check_tables(plan, rows, count, batch);
    return 0;
  }
  const int64_t seq_len = entries / 2;
  const TensorView ti = TensorView::contiguous(bytes.data(), dtype, {seq_len});
  const TensorView tags = TensorView::contiguous(bytes.data() + seq_len * width, dtype, {seq_len});
  const Status s = IndexPlan::from_timesteps_and_tags(ti, tags, count, batch, &plan);
  if (seq_len < 1 || batch < 1 || count < 1 || count > std::numeric_limits<int32_t>::max() / 3) {
    require(!s.ok() && s.kind() == ErrorKind::kValue);
    return 0;
  }
  int64_t bad = -1;
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < seq_len && bad < 0; ++i) {
    const int64_t t = entry_at(bytes, is_i64, i), tag = entry_at(bytes, is_i64, seq_len + i);
    if (outside(t, count) || outside(tag, 3)) {
      bad = i;
    } else {
      rows.push_back(t * 3 + tag);
    }
  }
  if (bad >= 0) {
    require(s.kind() == ErrorKind::kIndex);
    const bool timestep_bad = outside(entry_at(bytes, is_i64, bad), count);
    require(s.message().rfind(std::string(timestep_bad ? "timestep_indices[" : "token_tags[") + std::to_string(bad) +
                                  "] = ",
                              0) == 0);
    return 0;
  }
  require(s.ok());
  check_tables(plan, rows, count * 3, batch);
  return 0;
}
