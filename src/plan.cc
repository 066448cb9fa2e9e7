// IndexPlan: validation of the index and the chunk tables of the canonical
// cross-row reduction (contract in include/detdit/plan.h and docs/numerics.md).
#include "detdit/plan.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "common/backends.h"
#include "common/validate.h"

namespace detdit {

struct IndexPlan::Impl {
  int64_t seq_len = 0, batch = 0, num_rows = 0, positions = 0, num_chunks = 0, num_segments = 0;
  int64_t max_chunk_segments = 0;
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

// The index as int64 on the host (one copy for a CUDA index).
Status read_index(const TensorView& t, Stream stream, std::vector<int64_t>* values) {
  int64_t count = t.shape[0];
  values->resize(static_cast<std::size_t>(count));
  std::vector<char> raw(t.nbytes());
  if (t.device.is_cuda()) {
    DETDIT_RETURN_IF_ERROR(cuda::copy_to_host(t.data, raw.data(), raw.size(), t.device, stream));
  } else {
    std::copy_n(static_cast<const char*>(t.data), raw.size(), raw.data());
  }
  for (int64_t i = 0; i < count; ++i) {
    if (t.dtype == DType::kI64)
      (*values)[i] = reinterpret_cast<const int64_t*>(raw.data())[i];
    else
      (*values)[i] = reinterpret_cast<const int32_t*>(raw.data())[i];
  }
  return Status();
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

  impl->chunk_segment_begin.reserve(static_cast<std::size_t>(num_chunks + 1));
  impl->segment_positions.resize(static_cast<std::size_t>(positions));
  impl->segment_pos_begin.push_back(0);
  // Per chunk, a counting sort by row (O(chunk) plus sorting its few distinct
  // rows): segments ascending by row, positions ascending within a segment.
  std::vector<int32_t> count(static_cast<std::size_t>(num_rows), 0), next_slot(static_cast<std::size_t>(num_rows), 0);
  std::vector<int32_t> present;  // distinct rows of the chunk
  present.reserve(kReductionChunk);
  int64_t s = 0;  // sequence position of p = c*256 (p % seq_len, advanced incrementally)
  for (int64_t c = 0; c < num_chunks; ++c) {
    impl->chunk_segment_begin.push_back(static_cast<int32_t>(impl->segment_row.size()));
    const int64_t begin = c * kReductionChunk, end = std::min(positions, begin + kReductionChunk);
    present.clear();
    for (int64_t p = begin, q = s; p < end; ++p, q = (q + 1 == seq_len ? 0 : q + 1)) {
      const int32_t r = row_of_seq[static_cast<std::size_t>(q)];
      if (count[r]++ == 0) present.push_back(r);
    }
    std::sort(present.begin(), present.end());
    int32_t offset = static_cast<int32_t>(begin);
    for (int32_t r : present) {
      impl->segment_row.push_back(r);
      next_slot[r] = offset;
      offset += count[r];
      impl->segment_pos_begin.push_back(offset);
      count[r] = 0;
    }
    for (int64_t p = begin; p < end; ++p, s = (s + 1 == seq_len ? 0 : s + 1))
      impl->segment_positions[static_cast<std::size_t>(next_slot[row_of_seq[static_cast<std::size_t>(s)]]++)] =
          static_cast<int32_t>(p);
  }
  impl->chunk_segment_begin.push_back(static_cast<int32_t>(impl->segment_row.size()));
  const int64_t num_segments = static_cast<int64_t>(impl->segment_row.size());
  impl->num_segments = num_segments;
  for (std::size_t c = 0; c + 1 < impl->chunk_segment_begin.size(); ++c)
    impl->max_chunk_segments = std::max<int64_t>(
        impl->max_chunk_segments, impl->chunk_segment_begin[c + 1] - impl->chunk_segment_begin[c]);

  // Segments of each row in ascending chunk order (counting sort by row).
  impl->row_segment_begin.assign(static_cast<std::size_t>(num_rows + 1), 0);
  for (int32_t r : impl->segment_row) ++impl->row_segment_begin[static_cast<std::size_t>(r) + 1];
  for (int64_t r = 0; r < num_rows; ++r) impl->row_segment_begin[r + 1] += impl->row_segment_begin[r];
  impl->row_segments.resize(static_cast<std::size_t>(num_segments));
  std::vector<int32_t> cursor(impl->row_segment_begin.begin(), impl->row_segment_begin.end() - 1);
  for (int64_t g = 0; g < num_segments; ++g)
    impl->row_segments[static_cast<std::size_t>(cursor[impl->segment_row[g]]++)] = static_cast<int32_t>(g);

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

}  // namespace

Status IndexPlan::from_row_index(const TensorView& row_index, int64_t num_rows, int64_t batch, IndexPlan* plan,
                                 Stream stream) {
  DETDIT_RETURN_IF_ERROR(check_index_tensor(row_index, "row_index"));
  DETDIT_RETURN_IF_ERROR(check_sizes(row_index.shape[0], num_rows, batch));
  std::vector<int64_t> values;
  DETDIT_RETURN_IF_ERROR(read_index(row_index, stream, &values));
  std::vector<int32_t> rows(values.size());
  for (std::size_t s = 0; s < values.size(); ++s) {
    if (values[s] < 0 || values[s] >= num_rows)
      return Status::index_error("row_index[" + std::to_string(s) + "] = " + std::to_string(values[s]) +
                                 " is outside [0, " + std::to_string(num_rows) + ") (num_rows = " +
                                 std::to_string(num_rows) + ")");
    rows[s] = static_cast<int32_t>(values[s]);
  }
  return build(std::move(rows), num_rows, batch, row_index.device, stream, plan);
}

Status IndexPlan::from_timesteps_and_tags(const TensorView& timestep_indices, const TensorView& token_tags,
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
  std::vector<int64_t> ti, tags;
  DETDIT_RETURN_IF_ERROR(read_index(timestep_indices, stream, &ti));
  DETDIT_RETURN_IF_ERROR(read_index(token_tags, stream, &tags));
  std::vector<int32_t> rows(ti.size());
  // Both ranges are checked before the multiply, so ti*3 + tag cannot overflow.
  for (std::size_t s = 0; s < ti.size(); ++s) {
    if (ti[s] < 0 || ti[s] >= num_timesteps)
      return Status::index_error("timestep_indices[" + std::to_string(s) + "] = " + std::to_string(ti[s]) +
                                 " is outside [0, " + std::to_string(num_timesteps) + ") (num_timesteps)");
    if (tags[s] < 0 || tags[s] >= kNumModalities)
      return Status::index_error("token_tags[" + std::to_string(s) + "] = " + std::to_string(tags[s]) +
                                 " is outside [0, 3) (0 video, 1 text, 2 audio)");
    rows[s] = static_cast<int32_t>(ti[s] * kNumModalities + tags[s]);
  }
  return build(std::move(rows), num_rows, batch, timestep_indices.device, stream, plan);
}

int64_t IndexPlan::seq_len() const { return impl_ ? impl_->seq_len : 0; }
int64_t IndexPlan::batch() const { return impl_ ? impl_->batch : 0; }
int64_t IndexPlan::num_rows() const { return impl_ ? impl_->num_rows : 0; }
int64_t IndexPlan::positions() const { return impl_ ? impl_->positions : 0; }
int64_t IndexPlan::num_chunks() const { return impl_ ? impl_->num_chunks : 0; }
int64_t IndexPlan::num_segments() const { return impl_ ? impl_->num_segments : 0; }
int64_t IndexPlan::max_chunk_segments() const { return impl_ ? impl_->max_chunk_segments : 0; }
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
