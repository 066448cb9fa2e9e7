// Shared pieces of the CPU canonical reduction (docs/numerics.md 6.5): which
// chunks a call computes, where each chunk's partials go, and where the data
// row of a global position lives (own tensors or rows received from other
// ranks, backends.h ChunkSelection / ExtraRows).
#pragma once

#include <cstdint>
#include <vector>

#include "common/backends.h"
#include "detdit/plan.h"
#include "detdit/tensor.h"

namespace detdit {
namespace cpu {

// Row r of a 2-D view with unit column stride (any row stride).
template <typename T>
inline T* row_ptr(const TensorView& view, int64_t r) {
  return static_cast<T*>(view.data) + r * view.strides[0];
}

// The chunks of one partials call, in selection order, with the first output
// row of each: segment partials of chunk k start at segment_offset[k], chunk
// partials at row k.
struct SelectedChunks {
  std::vector<int64_t> chunk;           // (K,) chunk ids, ascending
  std::vector<int64_t> segment_offset;  // (K+1,) prefix sum of the chunks' segment counts
};

inline SelectedChunks select_chunks(const IndexPlan& plan, int64_t num_chunks, const ChunkSelection& sel) {
  SelectedChunks out;
  const int64_t count = sel.chunks ? sel.num_chunks : num_chunks;
  out.chunk.resize(static_cast<std::size_t>(count));
  out.segment_offset.assign(static_cast<std::size_t>(count + 1), 0);
  for (int64_t k = 0; k < count; ++k) {
    const int64_t c = sel.chunks ? sel.chunks[k] : k;
    out.chunk[k] = c;
    const int64_t segments =
        plan.valid() ? plan.host_tables().chunk_segment_begin[c + 1] - plan.host_tables().chunk_segment_begin[c] : 1;
    out.segment_offset[k + 1] = out.segment_offset[k] + segments;
  }
  return out;
}

// Where the data of global position p lives: row `row` of the own tensors
// (extra == false) or of the ExtraRows tensors (extra == true).
struct DataRow {
  bool extra;
  int64_t row;
};
inline DataRow data_row(const ChunkSelection& sel, int64_t p) {
  if (!sel.position_row) return DataRow{false, p};
  const int32_t r = sel.position_row[p];
  return r >= 0 ? DataRow{false, r} : DataRow{true, -1 - static_cast<int64_t>(r)};
}

}  // namespace cpu
}  // namespace detdit
