// detdit/plan.h: IndexPlan, the validated index of every indexed op.
//
// An IndexPlan is built once from the replicated (S,) row index of a packed
// sequence (or from timestep indices and modality tags: row = ti*3 + tag), the
// number of table rows R and the batch size B. Building validates every entry
// and fails with an IndexError naming the first bad position and its value;
// nothing is ever clamped. Ops that take an index take a plan, so no public
// entry point can read a table out of bounds.
//
// The plan also holds the chunk tables of detdit's canonical cross-row
// reduction (docs/numerics.md, "Canonical cross-row reduction"):
//   positions are flattened b-major, p = b*S + s, for p in [0, B*S);
//   p is cut into chunks of kReductionChunk = 256 consecutive positions;
//   within chunk c, each table row r present forms one *segment*: the
//   positions of chunk c whose row is r, in ascending p;
//   segments are numbered chunk by chunk, and within a chunk by ascending row.
// A segment's partial is an ascending FP32 chain from +0.0 over its positions;
// a row's result is an ascending fold from +0.0 over its segments (ascending
// chunk), cast once. Rows with no positions are exactly zero.
//
// Building is O(B*S + R) time, deterministic, and reads the index once on the
// host (a CUDA index is copied to the host once, synchronising the given
// stream). Memory: O(B*S) for every table but row_segment_begin, whose R + 1
// entries (4 bytes per table row, present or not) are the only per-row
// storage, during the build too; running out of memory is a RuntimeError.
// A plan for a CUDA device also holds device copies of its tables; after the
// plan exists no op synchronises the host. Plans are immutable and cheap to
// copy (shared ownership); build one per step and reuse it in every block.
#pragma once

#include <cstdint>
#include <memory>

#include "detdit/numerics.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {

constexpr int64_t kReductionChunk = 256;  // positions per chunk of the canonical reduction
constexpr int kNumModalities = 3;         // 0 video, 1 text, 2 audio

// Flat tables of a plan, all int32, on one device (host or CUDA).
struct PlanTables {
  const int32_t* row_of_seq = nullptr;       // (S,)   table row of sequence position s
  const int32_t* chunk_segment_begin = nullptr;  // (C+1) segments of chunk c: [begin[c], begin[c+1])
  const int32_t* segment_row = nullptr;      // (G,)   table row of segment g
  const int32_t* segment_pos_begin = nullptr;    // (G+1) positions of segment g: [begin[g], begin[g+1])
  const int32_t* segment_positions = nullptr;    // (P,)   flattened positions p, grouped by segment
  const int32_t* row_segment_begin = nullptr;    // (R+1) segments of row r: [begin[r], begin[r+1])
  const int32_t* row_segments = nullptr;     // (G,)   segment ids of each row, ascending chunk
};

class IndexPlan {
 public:
  IndexPlan() = default;

  // row_index: (S,) int32 or int64, contiguous, CPU or CUDA; every entry in
  // [0, num_rows). The plan lives on row_index's device.
  static Status from_row_index(const TensorView& row_index, int64_t num_rows, int64_t batch,
                               IndexPlan* plan, Stream stream = nullptr);
  // timestep_indices, token_tags: (S,), same integer dtype and device; row =
  // ti*3 + tag with ti in [0, num_timesteps) and tag in [0, 3). R = 3*num_timesteps.
  static Status from_timesteps_and_tags(const TensorView& timestep_indices,
                                        const TensorView& token_tags, int64_t num_timesteps,
                                        int64_t batch, IndexPlan* plan, Stream stream = nullptr);

  bool valid() const { return impl_ != nullptr; }
  int64_t seq_len() const;       // S
  int64_t batch() const;         // B
  int64_t num_rows() const;      // R
  int64_t positions() const;     // P = B*S
  int64_t num_chunks() const;    // C = ceil(P / 256)
  int64_t num_segments() const;  // G
  int64_t max_chunk_segments() const;  // the most segments of any one chunk
  // A 64-bit FNV-1a hash (four chains over the rows' 8-byte words, then their
  // states) of S, B, R and the table row of every position, computed on first
  // use, once per plan (thread-safe; the parallel ops ask for it): plans of one index, R and B have one fingerprint in every
  // process, plans that differ in any of them (almost surely) differ. The
  // parallel ops agree on it across ranks (parallel.h), so ranks holding
  // different indexes fail instead of computing different "replicated" results.
  uint64_t fingerprint() const;
  Device device() const;
  // Host tables (always present) and device tables (the plan's device; equal
  // to host_tables() for a CPU plan).
  const PlanTables& host_tables() const;
  const PlanTables& device_tables() const;

  struct Impl;

 private:
  std::shared_ptr<const Impl> impl_;
  friend struct PlanBuilder;
};

}  // namespace detdit
