// IndexPlan: validation of the index and the chunk tables of the canonical
// cross-row reduction (contract in include/detdit/plan.h and docs/numerics.md).
#include "detdit/plan.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <mutex>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "common/backends.h"
#include "common/fnv1a.h"
#include "common/out_of_memory.h"
#include "common/validate.h"

namespace detdit {

struct IndexPlan::Impl {
  int64_t seq_len = 0, batch = 0, num_rows = 0, positions = 0, num_chunks = 0, num_segments = 0;
  int64_t max_chunk_segments = 0;
  // Computed on first use (fingerprint()): only the parallel ops need it,
  // and hashing every row is a fifth of a block-packed build.
  mutable std::once_flag fingerprint_once;
  mutable uint64_t fingerprint = 0;
  Device device;
  std::vector<int32_t> row_of_seq, chunk_segment_begin, segment_row, segment_pos_begin, segment_positions,
      row_segment_begin, row_segments;
  PlanTables host, device_tables;
  std::shared_ptr<void> device_memory;  // owns the device copies of the tables
};

struct PlanBuilder {
  static void set(IndexPlan* plan, std::shared_ptr<const IndexPlan::Impl> impl) { plan->impl_ = std::move(impl); }
};

namespace {

Status check_index_tensor(const TensorView& t, const char* name) {
  DETDIT_RETURN_IF_ERROR(check::present(t, name));
  DETDIT_RETURN_IF_ERROR(check::dtype(t, name, {DType::kI64, DType::kI32}));
  DETDIT_RETURN_IF_ERROR(check::rank(t, name, 1, "(S,)"));
  DETDIT_RETURN_IF_ERROR(check::contiguous(t, name));
  if (t.shape[0] < 1) return Status::value_error(std::string(name) + " must hold at least one position (S >= 1), got S = 0");
  return Status();
}

// The entries of an index on the host: a CPU index is read in place, a CUDA
// index is copied once into `staging`.
Status host_entries(const TensorView& t, Stream stream, std::vector<char>* staging, const void** entries) {
  if (!t.device.is_cuda()) {
    *entries = t.data;
    return Status();
  }
  staging->resize(t.nbytes());
  DETDIT_RETURN_IF_ERROR(cuda::copy_to_host(t.data, staging->data(), staging->size(), t.device, stream));
  *entries = staging->data();
  return Status();
}

// An entry is in [0, bound) iff it is below bound as an unsigned 64-bit value
// (a negative entry converts to 2^64 + entry >= 2^63).
template <typename Int>
bool outside(Int entry, int64_t bound) {
  return static_cast<uint64_t>(static_cast<int64_t>(entry)) >= static_cast<uint64_t>(bound);
}

// The fast form of the same test, for a bound below 2^31, in two parts that
// vectorise without 64-bit compares (SSE2 has none): the entry is in
// [0, 2^31), i.e. wide(entry) == 0, and as an int32 it is below bound.
template <typename Int>
uint64_t wide(Int entry) {
  return static_cast<uint64_t>(static_cast<int64_t>(entry)) >> 31;
}

// rows[s] = row_index[s] for s in [0, seq_len), in one branch-free pass that
// also gathers the range test of every entry; only when some entry is out of
// range does a second pass find the first. Returns its position, or -1.
template <typename Int>
int64_t rows_from_row_index(const Int* row_index, int64_t seq_len, int64_t num_rows, int32_t* rows) {
  const int32_t bound = static_cast<int32_t>(num_rows);
  uint64_t any_wide = 0;
  int32_t any_high = 0;
  for (int64_t s = 0; s < seq_len; ++s) {
    const int32_t row = static_cast<int32_t>(row_index[s]);  // exact when wide(row_index[s]) == 0
    any_wide |= wide(row_index[s]);
    any_high |= row >= bound;
    rows[s] = row;
  }
  if (any_wide == 0 && any_high == 0) return -1;
  int64_t s = 0;
  while (!outside(row_index[s], num_rows)) ++s;
  return s;
}

// rows[s] = ti[s]*3 + tag[s], the same way. The row is computed in uint32
// (wrapping is defined) and is only kept when every entry is in range, where
// it is below 2^31.
template <typename Int>
int64_t rows_from_timesteps_and_tags(const Int* ti, const Int* tags, int64_t seq_len, int64_t num_timesteps,
                                     int32_t* rows) {
  const int32_t bound = static_cast<int32_t>(num_timesteps);
  uint64_t any_wide = 0;
  int32_t any_high = 0;
  for (int64_t s = 0; s < seq_len; ++s) {
    const int32_t timestep = static_cast<int32_t>(ti[s]), tag = static_cast<int32_t>(tags[s]);
    any_wide |= wide(ti[s]) | wide(tags[s]);
    any_high |= (timestep >= bound) | (tag >= kNumModalities);
    rows[s] = static_cast<int32_t>(static_cast<uint32_t>(timestep) * kNumModalities + static_cast<uint32_t>(tag));
  }
  if (any_wide == 0 && any_high == 0) return -1;
  int64_t s = 0;
  while (!outside(ti[s], num_timesteps) && !outside(tags[s], kNumModalities)) ++s;
  return s;
}

Status check_sizes(int64_t seq_len, int64_t num_rows, int64_t batch) {
  if (batch < 1) return Status::value_error("batch must be >= 1, got " + std::to_string(batch));
  if (num_rows < 1) return Status::value_error("num_rows must be >= 1, got " + std::to_string(num_rows));
  if (num_rows > std::numeric_limits<int32_t>::max())
    return Status::value_error("num_rows must be < 2^31, got " + std::to_string(num_rows));
  if (seq_len > std::numeric_limits<int32_t>::max() / batch)
    return Status::value_error("batch * seq_len must be < 2^31 positions, got " + std::to_string(batch) + " * " +
                               std::to_string(seq_len));
  return Status();
}

// The per-chunk step of the table build: a stable counting sort of one
// chunk's positions by row. by_row_ is an (R,) scratch of zeros between
// chunks (the plan's row_segment_begin table, lent for the build: the one
// allocation of R entries, so a plan's memory is O(B*S) + 4(R+1) bytes).
// Within a chunk by_row_[r] first counts row r's positions, then, once the
// row's segment is placed, holds the next output slot of that segment.
class ChunkSorter {
 public:
  explicit ChunkSorter(int32_t* by_row) : by_row_(by_row) {}

  // Appends the segments of the chunk whose positions are [first, first + n)
  // (n <= 256, rows[i] the row of position first + i) to impl's segment
  // tables and writes its positions to segment_positions[first, first + n).
  void add_chunk(const int32_t* rows, int32_t n, int32_t first, IndexPlan::Impl* impl) {
    // Where runs of equal rows start, in one branch-free (vectorised) pass.
    int32_t runs = 1;
    for (int32_t i = 1; i < n; ++i) {
      run_starts_[i] = rows[i] != rows[i - 1];
      runs += run_starts_[i];
    }
    run_starts_[n] = 1;  // the end of the last run
    // Long runs (block packings) are counted and scattered a run at a time:
    // a loop over positions would chain its updates of one row's counter
    // through memory. Short runs (interleaved packings) go position by position.
    // Both note the chunk's row span [lo, hi].
    const bool by_runs = runs * 8 <= n;
    int32_t num_runs = 0, lo = rows[0], hi = rows[0];
    if (by_runs) {
      for (int32_t i = 0; i < n; ++num_runs) {
        const int32_t end = next_run_start(i + 1);
        run_begin_[num_runs] = i;
        run_end_[num_runs] = end;
        by_row_[rows[i]] += end - i;
        lo = std::min(lo, rows[i]);
        hi = std::max(hi, rows[i]);
        i = end;
      }
    } else {
      for (int32_t i = 0; i < n; ++i) ++by_row_[rows[i]];
      for (int32_t i = 1; i < n; ++i) {
        lo = std::min(lo, rows[i]);
        hi = std::max(hi, rows[i]);
      }
    }
    // Segments ascending by row: walk the span when it is narrow (no sort),
    // else the chunk's distinct rows sorted.
    int32_t offset = first;  // the chunk's positions fill segment_positions[first, first + n)
    const std::size_t chunk_segments_begin = impl->segment_row.size();
    auto add_segment = [&](int32_t row) {
      impl->segment_row.push_back(row);
      const int32_t count = by_row_[row];
      by_row_[row] = offset;  // from now on the segment's next slot
      offset += count;
      impl->segment_pos_begin.push_back(offset);
    };
    if (hi - lo < kReductionChunk) {
      // Each row of the span is tested once, before add_segment turns its
      // count into a slot.
      for (int32_t row = lo; row <= hi; ++row)
        if (by_row_[row] != 0) add_segment(row);
    } else {
      std::copy_n(rows, n, distinct_);
      std::sort(distinct_, distinct_ + n);
      std::for_each(distinct_, std::unique(distinct_, distinct_ + n), add_segment);
    }
    const int64_t segments = static_cast<int64_t>(impl->segment_row.size() - chunk_segments_begin);
    impl->max_chunk_segments = std::max(impl->max_chunk_segments, segments);
    // Positions ascending within each segment.
    int32_t* positions = impl->segment_positions.data();
    if (by_runs) {
      for (int32_t k = 0; k < num_runs; ++k) {
        const int32_t begin = run_begin_[k], length = run_end_[k] - begin, row = rows[begin];
        int32_t* out = positions + by_row_[row];
        for (int32_t i = 0; i < length; ++i) out[i] = first + begin + i;
        by_row_[row] += length;
      }
    } else {
      for (int32_t i = 0; i < n; ++i) positions[by_row_[rows[i]]++] = first + i;
    }
    // Zeros again for the next chunk: only this chunk's rows were touched.
    for (std::size_t g = chunk_segments_begin; g < impl->segment_row.size(); ++g) by_row_[impl->segment_row[g]] = 0;
  }

 private:
  // The first run start at or after i (run_starts_[n] = 1 ends the search),
  // eight flags per step.
  int32_t next_run_start(int32_t i) const {
    for (;; i += 8) {
      uint64_t flags;
      std::memcpy(&flags, run_starts_ + i, sizeof(flags));
      if (flags != 0) return i + __builtin_ctzll(flags) / 8;  // little-endian: byte k holds flag i + k
    }
  }

  int32_t* by_row_;  // (R,)
  int32_t run_begin_[kReductionChunk], run_end_[kReductionChunk], distinct_[kReductionChunk];
  uint8_t run_starts_[kReductionChunk + 8] = {};  // run_starts_[i]: a run of equal rows starts at i (i >= 1)
};
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "ChunkSorter::next_run_start reads its flags little-endian");

// Chunk tables from the validated rows of the S sequence positions.
Status build(std::vector<int32_t> row_of_seq, int64_t num_rows, int64_t batch, const Device& device, Stream stream,
             IndexPlan* plan) {
  auto impl = std::make_shared<IndexPlan::Impl>();
  const int64_t seq_len = static_cast<int64_t>(row_of_seq.size());
  const int64_t positions = seq_len * batch;
  const int64_t num_chunks = (positions + kReductionChunk - 1) / kReductionChunk;
  impl->seq_len = seq_len;
  impl->batch = batch;
  impl->num_rows = num_rows;
  impl->positions = positions;
  impl->num_chunks = num_chunks;
  impl->device = device;

  // When 256 divides S, no chunk straddles two batch items and batch item b's
  // chunks are item 0's with positions + b*S and segments + b*G0: the chunks
  // of [0, S) are sorted once and copied. Otherwise all B*S positions are.
  const bool replicate = seq_len % kReductionChunk == 0;
  const int64_t sorted_positions = replicate ? seq_len : positions;
  impl->chunk_segment_begin.reserve(static_cast<std::size_t>(num_chunks + 1));
  impl->segment_positions.resize(static_cast<std::size_t>(positions));
  impl->segment_pos_begin.push_back(0);
  impl->row_segment_begin.assign(static_cast<std::size_t>(num_rows + 1), 0);
  ChunkSorter sorter(impl->row_segment_begin.data());
  int32_t straddling_rows[kReductionChunk];  // rows of a chunk that wraps past s = S - 1
  int64_t s = 0;  // sequence position of the chunk's first position p (p % S, advanced incrementally)
  for (int64_t first = 0; first < sorted_positions; first += kReductionChunk) {
    impl->chunk_segment_begin.push_back(static_cast<int32_t>(impl->segment_row.size()));
    const int64_t n = std::min(kReductionChunk, sorted_positions - first);
    const int32_t* rows = row_of_seq.data() + s;
    if (s + n <= seq_len) {
      s += n;
    } else {
      for (int64_t i = 0; i < n; ++i, s = (s + 1 == seq_len ? 0 : s + 1)) straddling_rows[i] = row_of_seq[s];
      rows = straddling_rows;
    }
    if (s == seq_len) s = 0;
    sorter.add_chunk(rows, static_cast<int32_t>(n), static_cast<int32_t>(first), impl.get());
  }
  if (replicate) {
    const int64_t chunks0 = static_cast<int64_t>(impl->chunk_segment_begin.size());
    const int32_t segments0 = static_cast<int32_t>(impl->segment_row.size());
    impl->segment_row.reserve(static_cast<std::size_t>(segments0 * batch));
    impl->segment_pos_begin.reserve(static_cast<std::size_t>(segments0 * batch + 1));
    for (int64_t b = 1; b < batch; ++b) {
      const int32_t segment_shift = static_cast<int32_t>(b) * segments0;
      const int32_t position_shift = static_cast<int32_t>(b * seq_len);
      for (int64_t c = 0; c < chunks0; ++c)
        impl->chunk_segment_begin.push_back(impl->chunk_segment_begin[c] + segment_shift);
      // Item b's segments follow item b-1's: b*G0 rows and 1 + b*G0 segment ends so far.
      impl->segment_row.resize(impl->segment_row.size() + segments0);
      std::copy_n(impl->segment_row.data(), segments0, impl->segment_row.data() + b * segments0);
      impl->segment_pos_begin.resize(impl->segment_pos_begin.size() + segments0);
      int32_t* pos_begin = impl->segment_pos_begin.data();
      int32_t* item_pos_begin = pos_begin + 1 + b * segments0;
      for (int32_t g = 0; g < segments0; ++g) item_pos_begin[g] = pos_begin[g + 1] + position_shift;
      const int32_t* item0 = impl->segment_positions.data();
      int32_t* item = impl->segment_positions.data() + position_shift;
      for (int64_t i = 0; i < seq_len; ++i) item[i] = item0[i] + position_shift;
    }
  }
  impl->chunk_segment_begin.push_back(static_cast<int32_t>(impl->segment_row.size()));
  const int64_t num_segments = static_cast<int64_t>(impl->segment_row.size());
  impl->num_segments = num_segments;

  // Segments of each row in ascending chunk order: a counting sort by row in
  // place (the sorter left row_segment_begin all zeros). begin[r] is used as
  // row r's cursor, which leaves it at begin[r + 1]; one shift restores it.
  int32_t* begin = impl->row_segment_begin.data();
  for (int32_t r : impl->segment_row) ++begin[r + 1];
  for (int64_t r = 0; r < num_rows; ++r) begin[r + 1] += begin[r];
  impl->row_segments.resize(static_cast<std::size_t>(num_segments));
  for (int64_t g = 0; g < num_segments; ++g)
    impl->row_segments[static_cast<std::size_t>(begin[impl->segment_row[g]]++)] = static_cast<int32_t>(g);
  std::copy_backward(begin, begin + num_rows, begin + num_rows + 1);
  begin[0] = 0;

  impl->row_of_seq = std::move(row_of_seq);
  PlanTables& h = impl->host;
  h.row_of_seq = impl->row_of_seq.data();
  h.chunk_segment_begin = impl->chunk_segment_begin.data();
  h.segment_row = impl->segment_row.data();
  h.segment_pos_begin = impl->segment_pos_begin.data();
  h.segment_positions = impl->segment_positions.data();
  h.row_segment_begin = impl->row_segment_begin.data();
  h.row_segments = impl->row_segments.data();
  impl->device_tables = h;
  if (device.is_cuda()) {
    std::vector<const int32_t*> d;
    DETDIT_RETURN_IF_ERROR(cuda::upload_tables(
        device,
        {&impl->row_of_seq, &impl->chunk_segment_begin, &impl->segment_row, &impl->segment_pos_begin,
         &impl->segment_positions, &impl->row_segment_begin, &impl->row_segments},
        &d, &impl->device_memory, stream));
    PlanTables& t = impl->device_tables;
    t.row_of_seq = d[0];
    t.chunk_segment_begin = d[1];
    t.segment_row = d[2];
    t.segment_pos_begin = d[3];
    t.segment_positions = d[4];
    t.row_segment_begin = d[5];
    t.row_segments = d[6];
  }
  PlanBuilder::set(plan, std::move(impl));
  return Status();
}

Status build_from_row_index(const TensorView& row_index, int64_t num_rows, int64_t batch, IndexPlan* plan,
                            Stream stream) {
  DETDIT_RETURN_IF_ERROR(check_index_tensor(row_index, "row_index"));
  DETDIT_RETURN_IF_ERROR(check_sizes(row_index.shape[0], num_rows, batch));
  std::vector<char> staging;
  const void* entries = nullptr;
  DETDIT_RETURN_IF_ERROR(host_entries(row_index, stream, &staging, &entries));
  std::vector<int32_t> rows(static_cast<std::size_t>(row_index.shape[0]));
  const bool is_i64 = row_index.dtype == DType::kI64;
  const int64_t bad = is_i64 ? rows_from_row_index(static_cast<const int64_t*>(entries), row_index.shape[0],
                                                   num_rows, rows.data())
                             : rows_from_row_index(static_cast<const int32_t*>(entries), row_index.shape[0],
                                                   num_rows, rows.data());
  if (bad >= 0) {
    const int64_t value =
        is_i64 ? static_cast<const int64_t*>(entries)[bad] : static_cast<const int32_t*>(entries)[bad];
    return Status::index_error("row_index[" + std::to_string(bad) + "] = " + std::to_string(value) +
                               " is outside [0, " + std::to_string(num_rows) + ") (num_rows = " +
                               std::to_string(num_rows) + ")");
  }
  return build(std::move(rows), num_rows, batch, row_index.device, stream, plan);
}

Status build_from_timesteps_and_tags(const TensorView& timestep_indices, const TensorView& token_tags,
                                     int64_t num_timesteps, int64_t batch, IndexPlan* plan, Stream stream) {
  DETDIT_RETURN_IF_ERROR(check_index_tensor(timestep_indices, "timestep_indices"));
  DETDIT_RETURN_IF_ERROR(check_index_tensor(token_tags, "token_tags"));
  if (token_tags.dtype != timestep_indices.dtype)
    return Status::type_error(std::string("timestep_indices and token_tags must share an integer dtype, got ") +
                              dtype_name(timestep_indices.dtype) + " and " + dtype_name(token_tags.dtype));
  DETDIT_RETURN_IF_ERROR(check::same_device(token_tags, "token_tags", timestep_indices, "timestep_indices"));
  if (token_tags.shape[0] != timestep_indices.shape[0])
    return Status::value_error("timestep_indices (" + std::to_string(timestep_indices.shape[0]) +
                               ") and token_tags (" + std::to_string(token_tags.shape[0]) +
                               ") must have the same length");
  if (num_timesteps < 1) return Status::value_error("num_timesteps must be >= 1, got " + std::to_string(num_timesteps));
  if (num_timesteps > std::numeric_limits<int32_t>::max() / kNumModalities)
    return Status::value_error("num_timesteps must be < 2^31 / 3, got " + std::to_string(num_timesteps));
  const int64_t num_rows = num_timesteps * kNumModalities;
  DETDIT_RETURN_IF_ERROR(check_sizes(timestep_indices.shape[0], num_rows, batch));
  std::vector<char> ti_staging, tag_staging;
  const void* ti_entries = nullptr;
  const void* tag_entries = nullptr;
  DETDIT_RETURN_IF_ERROR(host_entries(timestep_indices, stream, &ti_staging, &ti_entries));
  DETDIT_RETURN_IF_ERROR(host_entries(token_tags, stream, &tag_staging, &tag_entries));
  const int64_t seq_len = timestep_indices.shape[0];
  std::vector<int32_t> rows(static_cast<std::size_t>(seq_len));
  const bool is_i64 = timestep_indices.dtype == DType::kI64;
  const int64_t bad =
      is_i64 ? rows_from_timesteps_and_tags(static_cast<const int64_t*>(ti_entries),
                                            static_cast<const int64_t*>(tag_entries), seq_len, num_timesteps,
                                            rows.data())
             : rows_from_timesteps_and_tags(static_cast<const int32_t*>(ti_entries),
                                            static_cast<const int32_t*>(tag_entries), seq_len, num_timesteps,
                                            rows.data());
  if (bad >= 0) {
    auto entry = [is_i64, bad](const void* entries) {
      return is_i64 ? static_cast<const int64_t*>(entries)[bad] : int64_t{static_cast<const int32_t*>(entries)[bad]};
    };
    const int64_t ti = entry(ti_entries), tag = entry(tag_entries);
    if (outside(ti, num_timesteps))
      return Status::index_error("timestep_indices[" + std::to_string(bad) + "] = " + std::to_string(ti) +
                                 " is outside [0, " + std::to_string(num_timesteps) + ") (num_timesteps)");
    return Status::index_error("token_tags[" + std::to_string(bad) + "] = " + std::to_string(tag) +
                               " is outside [0, 3) (0 video, 1 text, 2 audio)");
  }
  return build(std::move(rows), num_rows, batch, timestep_indices.device, stream, plan);
}

// The RuntimeError of a builder that ran out of memory (out_of_memory_is_an_error):
// the tables take at most 4 * (S + 4*B*S + R + C + 3) bytes (S rows, B*S
// positions, at most B*S segments in three tables, R + 1 row starts, C + 1
// chunk starts). The sizes are doubles: they may be unvalidated arguments (no
// overflow in the message).
std::string out_of_memory_message(double seq_len, double num_rows, double batch) {
  const double positions = seq_len * batch;
  const double bytes = 4.0 * (seq_len + 4.0 * positions + num_rows + positions / kReductionChunk + 3.0);
  char message[256];
  std::snprintf(message, sizeof message,
                "out of memory building the index plan (S = %.0f, B = %.0f, R = %.0f): its tables take up to "
                "%.0f MB, 4 bytes per table row among them",
                seq_len, batch, num_rows, bytes / 1e6);
  return message;
}

}  // namespace

Status IndexPlan::from_row_index(const TensorView& row_index, int64_t num_rows, int64_t batch, IndexPlan* plan,
                                 Stream stream) {
  return out_of_memory_is_an_error(
      [&] {
        return out_of_memory_message(static_cast<double>(row_index.shape[0]), static_cast<double>(num_rows),
                                     static_cast<double>(batch));
      },
      [&] { return build_from_row_index(row_index, num_rows, batch, plan, stream); });
}

Status IndexPlan::from_timesteps_and_tags(const TensorView& timestep_indices, const TensorView& token_tags,
                                          int64_t num_timesteps, int64_t batch, IndexPlan* plan, Stream stream) {
  return out_of_memory_is_an_error(
      [&] {
        return out_of_memory_message(static_cast<double>(timestep_indices.shape[0]),
                                     static_cast<double>(num_timesteps) * kNumModalities, static_cast<double>(batch));
      },
      [&] { return build_from_timesteps_and_tags(timestep_indices, token_tags, num_timesteps, batch, plan, stream); });
}

int64_t IndexPlan::seq_len() const { return impl_ ? impl_->seq_len : 0; }
int64_t IndexPlan::batch() const { return impl_ ? impl_->batch : 0; }
int64_t IndexPlan::num_rows() const { return impl_ ? impl_->num_rows : 0; }
int64_t IndexPlan::positions() const { return impl_ ? impl_->positions : 0; }
int64_t IndexPlan::num_chunks() const { return impl_ ? impl_->num_chunks : 0; }
int64_t IndexPlan::num_segments() const { return impl_ ? impl_->num_segments : 0; }
int64_t IndexPlan::max_chunk_segments() const { return impl_ ? impl_->max_chunk_segments : 0; }
uint64_t IndexPlan::fingerprint() const {
  if (!impl_) return 0;
  const Impl& impl = *impl_;
  std::call_once(impl.fingerprint_once, [&impl] {
    const int64_t sizes[] = {impl.seq_len, impl.batch, impl.num_rows};
    impl.fingerprint = fnv1a_lanes(impl.row_of_seq.data(), impl.row_of_seq.size() * sizeof(int32_t),
                                   fnv1a(sizes, sizeof sizes));
  });
  return impl.fingerprint;
}
Device IndexPlan::device() const { return impl_ ? impl_->device : Device::cpu(); }
// An empty plan has empty tables (all null) rather than a null dereference.
const PlanTables& IndexPlan::host_tables() const {
  static const PlanTables kEmpty;
  return impl_ ? impl_->host : kEmpty;
}
const PlanTables& IndexPlan::device_tables() const {
  static const PlanTables kEmpty;
  return impl_ ? impl_->device_tables : kEmpty;
}

}  // namespace detdit
