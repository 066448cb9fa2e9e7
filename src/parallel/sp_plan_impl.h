// The tables of an SpPlan (include/detdit/parallel.h), shared by the plan
// builder (sp_plan.cc) and the sp_region ops (sp_region.cc). Internal.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "detdit/parallel.h"

namespace detdit {

// A run of `count` consecutive rows copied from row `src` to row `dst` of the
// send block of rank `rank`.
struct SpRun {
  int32_t rank = 0;
  int64_t src = 0, dst = 0, count = 0;
};

// Chunks [chunk_begin, chunk_begin + chunks) of the global order, owned by
// `rank`: their chunk partials are rows [chunk_src, chunk_src + chunks) of the
// owner's, their segments [segment_begin, segment_begin + segments) are rows
// [segment_src, segment_src + segments) of the owner's segment partials.
struct SpLink {
  int32_t rank = 0;
  int64_t chunk_begin = 0, chunks = 0, chunk_src = 0;
  int64_t segment_begin = 0, segments = 0, segment_src = 0;
};

struct SpPlan::Impl {
  int world = 0, rank = 0;
  int64_t seq_len = 0, batch = 0, lo = 0, hi = 0;
  IndexPlan global, local;
  std::vector<RankTraffic> traffic;  // (world,)
  int64_t max_send = 0, max_chunks = 0, max_segments = 0;

  // This rank's own rows into its send block: src = local row, dst = slot.
  std::vector<SpRun> send_runs;
  // The links of the folds' chain, in global chunk order: each a run of
  // consecutive chunks of one owner, with where its partials sit in the
  // owner's partials (its chunks and their segments, ascending).
  std::vector<SpLink> links;

  // Host tables, and their copies where the backend computes (device for a
  // CUDA plan, the same pointers for a CPU plan).
  std::vector<int32_t> owned_chunks;  // (chunks of this rank,) ascending
  std::vector<int32_t> chunk_list;    // owned_chunks, or {0} when empty (never null)
  std::vector<int32_t> position_row;  // (B*S,) backends.h ChunkSelection
  const int32_t* owned_chunks_on_device = nullptr;
  const int32_t* position_row_on_device = nullptr;
  std::shared_ptr<void> device_memory;

  // The plan of this rank's own chunks' positions, concatenated (batch 1):
  // its chunk k is this rank's k-th chunk, with that chunk's segments in the
  // same order (segments depend only on a chunk's rows). The ops without a
  // chunk selection (layernorm) run their WS1 partials on it. Empty when the
  // rank owns no chunk.
  IndexPlan owned;
  std::vector<int32_t> owned_index;
  std::shared_ptr<void> owned_memory;
};

}  // namespace detdit
