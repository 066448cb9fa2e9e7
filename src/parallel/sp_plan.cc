// SpPlan: who computes which chunk of the canonical reduction under sequence
// parallelism, which rows move, and where every partial goes (contract in
// include/detdit/parallel.h). Built on every rank from replicated metadata
// only, so every rank derives the same tables; O(B*S) host work, once per
// index.
#include <algorithm>
#include <string>

#include "common/backends.h"
#include "common/out_of_memory.h"
#include "parallel/sp_plan_impl.h"

namespace detdit {
namespace {

// Appends (rank, src, dst, 1) to runs, merging with the last run when both
// src and dst continue it.
void append_run(std::vector<SpRun>* runs, int32_t rank, int64_t src, int64_t dst) {
  if (!runs->empty()) {
    SpRun& last = runs->back();
    if (last.rank == rank && last.src + last.count == src && last.dst + last.count == dst) {
      ++last.count;
      return;
    }
  }
  runs->push_back(SpRun{rank, src, dst, 1});
}

// Appends chunk c (owner q, `segments` segments from global segment
// `segment_begin`) to the chain: it extends the last link when q owns that
// one too, else starts a link at q's next chunk and segment partial rows.
void append_link(std::vector<SpLink>* links, int32_t q, int64_t c, int64_t segment_begin, int64_t segments,
                 int64_t chunk_src, int64_t segment_src) {
  if (!links->empty() && links->back().rank == q) {
    ++links->back().chunks;
    links->back().segments += segments;
    return;
  }
  links->push_back(SpLink{q, c, 1, chunk_src, segment_begin, segments, segment_src});
}

// The tables of `impl` (contract in parallel.h, steps in docs/parallel.md 3).
// Without a plan (the grouped forms' SpPlan) only the positions: S, B, lo, hi.
Status build(const IndexPlan& plan, int64_t seq_len, int64_t batch, int world, int rank, SpPlan::Impl* impl,
             Stream stream) {
  if (world < 1 || rank < 0 || rank >= world)
    return Status::value_error("need 0 <= rank < world, got rank=" + std::to_string(rank) +
                               ", world=" + std::to_string(world));
  if (seq_len < world)
    return Status::value_error("every rank needs a row: seq_len=" + std::to_string(seq_len) +
                               ", world=" + std::to_string(world) + ", batch=" + std::to_string(batch));

  impl->world = world;
  impl->rank = rank;
  impl->seq_len = seq_len;
  impl->batch = batch;
  // bound[q] = q*S/world: rank q holds sequence positions [bound[q], bound[q+1]).
  std::vector<int64_t> bound(static_cast<std::size_t>(world + 1));
  for (int q = 0; q <= world; ++q) bound[q] = q * seq_len / world;
  impl->lo = bound[rank];
  impl->hi = bound[rank + 1];
  if (!plan.valid()) return Status();  // the grouped forms' plan: positions only
  impl->global = plan;
  std::vector<int32_t> owner_of_seq(static_cast<std::size_t>(seq_len));  // (S,)
  for (int q = 0; q < world; ++q)
    std::fill(owner_of_seq.begin() + bound[q], owner_of_seq.begin() + bound[q + 1], q);

  const int64_t positions = plan.positions(), num_chunks = plan.num_chunks();
  const PlanTables& tables = plan.host_tables();
  // Chunk c belongs to the owner of its first position p = 256c.
  std::vector<int32_t> chunk_owner(static_cast<std::size_t>(num_chunks));
  for (int64_t c = 0; c < num_chunks; ++c) chunk_owner[c] = owner_of_seq[(c * kReductionChunk) % seq_len];

  impl->traffic.assign(static_cast<std::size_t>(world), SpPlan::RankTraffic{});
  // Partials of every rank in its own order (its chunks ascending), cut into the chain's links.
  std::vector<int64_t> next_chunk(static_cast<std::size_t>(world), 0), next_segment(static_cast<std::size_t>(world), 0);
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int32_t q = chunk_owner[c];
    const int64_t segment_begin = tables.chunk_segment_begin[c], segments = tables.chunk_segment_begin[c + 1] - segment_begin;
    append_link(&impl->links, q, c, segment_begin, segments, next_chunk[q], next_segment[q]);
    ++next_chunk[q];
    next_segment[q] += segments;
    if (q == rank) impl->owned_chunks.push_back(static_cast<int32_t>(c));
  }
  // Rows that move: position p of a chunk owned by another rank. Its owner
  // sends it in slot = its ordinal among that owner's sent rows (ascending p).
  const int64_t local_seq_len = impl->hi - impl->lo;
  std::vector<int64_t> slot(static_cast<std::size_t>(positions), -1);
  for (int64_t p = 0; p < positions; ++p) {
    const int64_t b = p / seq_len, s = p % seq_len;
    const int32_t q = owner_of_seq[s], chunk_q = chunk_owner[p / kReductionChunk];
    if (q == chunk_q) continue;
    slot[p] = impl->traffic[q].send_rows++;
    ++impl->traffic[chunk_q].receive_rows;
    if (q == rank) append_run(&impl->send_runs, rank, b * local_seq_len + (s - impl->lo), slot[p]);
  }
  for (int q = 0; q < world; ++q) {
    impl->traffic[q].chunks = next_chunk[q];
    impl->traffic[q].segments = next_segment[q];
    impl->max_send = std::max(impl->max_send, impl->traffic[q].send_rows);
    impl->max_chunks = std::max(impl->max_chunks, next_chunk[q]);
    impl->max_segments = std::max(impl->max_segments, next_segment[q]);
  }
  // position_row: own rows -> local row; rows received for own chunks ->
  // -1 - (owner*max_send + slot); positions of other ranks' chunks are never
  // read (0).
  impl->position_row.assign(static_cast<std::size_t>(positions), 0);
  for (int64_t p = 0; p < positions; ++p) {
    const int64_t b = p / seq_len, s = p % seq_len;
    const int32_t q = owner_of_seq[s];
    if (q == rank)
      impl->position_row[p] = static_cast<int32_t>(b * local_seq_len + (s - impl->lo));
    else if (chunk_owner[p / kReductionChunk] == rank)
      impl->position_row[p] = static_cast<int32_t>(-1 - (q * impl->max_send + slot[p]));
  }

  // The local index index[lo:hi) as a plan on the global plan's device (one
  // host read of the slice for a CUDA plan, here at plan time).
  const Device device = plan.device();
  const int32_t* row_of_seq = device.is_cuda() ? plan.device_tables().row_of_seq : tables.row_of_seq;
  const TensorView local_index = TensorView::contiguous(const_cast<int32_t*>(row_of_seq + impl->lo), DType::kI32,
                                                        {local_seq_len}, device);
  DETDIT_RETURN_IF_ERROR(IndexPlan::from_row_index(local_index, plan.num_rows(), batch, &impl->local, stream));

  // The owned chunks' plan (sp_plan_impl.h): their rows' table rows in order.
  for (int32_t c : impl->owned_chunks) {
    const int64_t end = std::min(positions, (c + 1) * kReductionChunk);
    for (int64_t p = c * kReductionChunk; p < end; ++p) impl->owned_index.push_back(tables.row_of_seq[p % seq_len]);
  }
  if (!impl->owned_index.empty()) {
    const int64_t rows = static_cast<int64_t>(impl->owned_index.size());
    const int32_t* index = impl->owned_index.data();
    if (device.is_cuda()) {
      std::vector<const int32_t*> copies;
      DETDIT_RETURN_IF_ERROR(
          cuda::upload_tables(device, {&impl->owned_index}, &copies, &impl->owned_memory, stream));
      index = copies[0];
    }
    const TensorView owned = TensorView::contiguous(const_cast<int32_t*>(index), DType::kI32, {rows}, device);
    DETDIT_RETURN_IF_ERROR(IndexPlan::from_row_index(owned, plan.num_rows(), 1, &impl->owned, stream));
  }

  // The chunk list is never null (a null list means "every chunk" to the
  // backends): a rank that owns no chunk keeps one unused entry, count 0.
  std::vector<int32_t> chunk_list = impl->owned_chunks;
  if (chunk_list.empty()) chunk_list.push_back(0);
  impl->chunk_list = chunk_list;
  impl->owned_chunks_on_device = impl->chunk_list.data();
  impl->position_row_on_device = impl->position_row.data();
  if (device.is_cuda()) {
    std::vector<const int32_t*> copies;
    DETDIT_RETURN_IF_ERROR(cuda::upload_tables(device, {&impl->chunk_list, &impl->position_row}, &copies,
                                               &impl->device_memory, stream));
    impl->owned_chunks_on_device = copies[0];
    impl->position_row_on_device = copies[1];
  }
  return Status();
}

}  // namespace

// The tables are O(B*S) host vectors: running out of memory is a RuntimeError.
Status SpPlan::create(const IndexPlan& plan, int world, int rank, SpPlan* sp, Stream stream) {
  if (!plan.valid()) return Status::value_error("plan is required, got an empty IndexPlan");
  return out_of_memory_is_an_error(
      [&] {
        return "out of memory building the SpPlan (S = " + std::to_string(plan.seq_len()) +
               ", B = " + std::to_string(plan.batch()) + ", world = " + std::to_string(world) +
               "): its host tables take about 24 bytes per position, plus an index plan of the rank's own "
               "chunks' positions";
      },
      [&]() -> Status {
        auto impl = std::make_shared<Impl>();
        DETDIT_RETURN_IF_ERROR(build(plan, plan.seq_len(), plan.batch(), world, rank, impl.get(), stream));
        sp->impl_ = std::move(impl);
        return Status();
      });
}

Status SpPlan::create(int64_t seq_len, int64_t batch, int world, int rank, SpPlan* sp) {
  if (seq_len < 1 || batch < 1)
    return Status::value_error("need seq_len >= 1 and batch >= 1, got seq_len=" + std::to_string(seq_len) +
                               ", batch=" + std::to_string(batch));
  auto impl = std::make_shared<Impl>();
  DETDIT_RETURN_IF_ERROR(build(IndexPlan(), seq_len, batch, world, rank, impl.get(), nullptr));
  sp->impl_ = std::move(impl);
  return Status();
}

int SpPlan::world() const { return impl_ ? impl_->world : 0; }
int SpPlan::rank() const { return impl_ ? impl_->rank : 0; }
int64_t SpPlan::seq_len() const { return impl_ ? impl_->seq_len : 0; }
int64_t SpPlan::batch() const { return impl_ ? impl_->batch : 0; }
int64_t SpPlan::local_begin() const { return impl_ ? impl_->lo : 0; }
int64_t SpPlan::local_end() const { return impl_ ? impl_->hi : 0; }
int64_t SpPlan::local_seq_len() const { return impl_ ? impl_->hi - impl_->lo : 0; }
const IndexPlan& SpPlan::global_plan() const { return impl_->global; }
const IndexPlan& SpPlan::local_plan() const { return impl_->local; }
const std::vector<SpPlan::RankTraffic>& SpPlan::traffic() const { return impl_->traffic; }
int64_t SpPlan::max_send() const { return impl_ ? impl_->max_send : 0; }
int64_t SpPlan::max_chunks() const { return impl_ ? impl_->max_chunks : 0; }
int64_t SpPlan::max_segments() const { return impl_ ? impl_->max_segments : 0; }
int64_t SpPlan::chain_links() const { return impl_ ? static_cast<int64_t>(impl_->links.size()) : 0; }

}  // namespace detdit
