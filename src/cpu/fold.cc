// The fold half of the canonical cross-row reduction (docs/numerics.md 6.5),
// CPU reference. Partials are FP32; every output element is an ascending
// chain from +0.0 over its partials (row r: its segments in ascending chunk
// order; chunk partials: ascending chunk), rounded once to the output dtype.
// Rows of a segment fold that have no segment are exactly +0.0. The partials
// are the ops' own FP32 scratch (aligned); the outputs are the caller's
// gradients, which may sit at any byte address (cpu::store).
#include <algorithm>
#include <cstdint>

#include "common/backends.h"
#include "common/scalar_math.h"
#include "common/storage.h"
#include "cpu/parallel.h"
#include "cpu/reduction.h"
#include "cpu/unaligned.h"

namespace detdit {
namespace cpu {

// partials (G, W) fp32 in global segment order; out (R, W) fp32/bf16/fp16.
Status fold_segment_partials(const IndexPlan& plan, const TensorView& partials, const TensorView& out, Stream) {
  const PlanTables& tables = plan.host_tables();
  const int64_t width = out.shape[1];
  dispatch_float_dtype(out.dtype, [&](auto tag) {
    using T = decltype(tag);
    parallel_for(0, plan.num_rows(), [&](int64_t r) {
      // bounds and bases in locals (unaligned.h)
      const int64_t w = width;
      const int32_t first = tables.row_segment_begin[r], last = tables.row_segment_begin[r + 1];
      const int32_t* segments = tables.row_segments;
      void* dst = row_address(out, r);
      for (int64_t j = 0; j < w; ++j) {
        float acc = 0.0f;
        for (int32_t k = first; k < last; ++k) acc = num::add32(acc, row_ptr<float>(partials, segments[k])[j]);
        store(dst, j, from_float<T>(acc));
      }
    });
  });
  return Status();
}

// partials (C, W) fp32 in chunk order; out (W,) fp32/bf16/fp16.
Status fold_chunk_partials(const TensorView& partials, const TensorView& out, Stream) {
  const int64_t chunks = partials.shape[0], width = partials.shape[1];
  constexpr int64_t kColumnsPerTask = 256;  // independent columns: any split gives the same bits
  dispatch_float_dtype(out.dtype, [&](auto tag) {
    using T = decltype(tag);
    const int64_t stride = out.rank >= 1 ? out.strides[out.rank - 1] : 1;
    parallel_for(0, (width + kColumnsPerTask - 1) / kColumnsPerTask, [&](int64_t task) {
      // bounds and bases in locals (unaligned.h)
      const int64_t end = std::min(width, (task + 1) * kColumnsPerTask), n = chunks, step = stride;
      const float* first = partials.ptr<const float>();
      const int64_t row = partials.strides[0];
      void* dst = out.data;
      for (int64_t j = task * kColumnsPerTask; j < end; ++j) {
        float acc = 0.0f;
        for (int64_t c = 0; c < n; ++c) acc = num::add32(acc, first[c * row + j]);
        store(dst, j * step, from_float<T>(acc));
      }
    });
  });
  return Status();
}

}  // namespace cpu
}  // namespace detdit
