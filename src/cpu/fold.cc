// The fold half of the canonical cross-row reduction (docs/numerics.md 6.5),
// CPU reference. Partials are FP32; every output element is an ascending
// chain over its partials (row r: its segments in ascending chunk order;
// chunk partials: ascending chunk), rounded once to the output dtype. The
// chain starts from +0.0, or, for the continued folds of the SP region, from
// a given FP32 running sum (then over a range of segments or chunks only).
// Rows of a segment fold that have no segment are exactly +0.0. The group
// fold (the grouped modulation forms, numerics 6.11) is the chunk fold of
// each group's own chunks. The partials
// and running sums are the ops' own FP32 scratch (aligned); the outputs are
// the caller's gradients, which may sit at any byte address (cpu::store).
#include <algorithm>
#include <cstdint>

#include "common/backends.h"
#include "common/modulation_math.h"
#include "common/scalar_math.h"
#include "common/storage.h"
#include "cpu/parallel.h"
#include "cpu/reduction.h"
#include "cpu/unaligned.h"

namespace detdit {
namespace cpu {
namespace {

// out[r, j] = R(chain from running[r, j] (+0.0 when absent) over row r's
// segments g in [first, first + partials rows), partial row g - first).
void segment_fold(const IndexPlan& plan, const TensorView& partials, int64_t first, const TensorView& running,
                  const TensorView& out) {
  const PlanTables& tables = plan.host_tables();
  const int64_t width = out.shape[1];
  const int64_t end = first + partials.shape[0];
  dispatch_float_dtype(out.dtype, [&](auto tag) {
    using T = decltype(tag);
    parallel_for(0, plan.num_rows(), [&](int64_t r) {
      // bounds and bases in locals (unaligned.h)
      const int64_t w = width, lo = first, hi = end;
      const int32_t* segments = tables.row_segments;
      // Row r's segment ids ascend: its segments in [lo, hi) are one run.
      const int32_t* row_begin = segments + tables.row_segment_begin[r];
      const int32_t* row_end = segments + tables.row_segment_begin[r + 1];
      const int32_t* from = std::lower_bound(row_begin, row_end, lo);
      const int32_t* to = std::lower_bound(from, row_end, hi);
      const float* start = running.present() ? row_ptr<const float>(running, r) : nullptr;
      void* dst = row_address(out, r);
      for (int64_t j = 0; j < w; ++j) {
        float acc = start != nullptr ? start[j] : 0.0f;
        for (const int32_t* k = from; k < to; ++k) acc = num::add32(acc, row_ptr<float>(partials, *k - lo)[j]);
        store(dst, j, from_float<T>(acc));
      }
    });
  });
}

// out[j] = R(chain from running[j] (+0.0 when absent) over the rows of partials).
void chunk_fold(const TensorView& partials, const TensorView& running, const TensorView& out) {
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
      const float* start = running.present() ? running.ptr<const float>() : nullptr;
      const int64_t start_step = running.present() ? running.strides[running.rank - 1] : 0;
      void* dst = out.data;
      for (int64_t j = task * kColumnsPerTask; j < end; ++j) {
        float acc = start != nullptr ? start[j * start_step] : 0.0f;
        for (int64_t c = 0; c < n; ++c) acc = num::add32(acc, first[c * row + j]);
        store(dst, j * step, from_float<T>(acc));
      }
    });
  });
}

}  // namespace

// partials (G, W) fp32 in global segment order; out (R, W) fp32/bf16/fp16.
Status fold_segment_partials(const IndexPlan& plan, const TensorView& partials, const TensorView& out, Stream) {
  segment_fold(plan, partials, 0, TensorView(), out);
  return Status();
}

// partials (C, W) fp32 in chunk order; out (W,) fp32/bf16/fp16.
Status fold_chunk_partials(const TensorView& partials, const TensorView& out, Stream) {
  chunk_fold(partials, TensorView(), out);
  return Status();
}

// partials (G*per_group, W) fp32, group g's chunks at rows [g*per_group, (g+1)*per_group);
// out: a grouped modulation view, group g's row at group_offset.
Status fold_group_partials(const TensorView& partials, int64_t per_group, const ResolvedModulation& mod,
                           const TensorView& out, Stream) {
  const int64_t width = partials.shape[1];
  const ModulationOperand dst = modulation_operand(out, mod);
  dispatch_float_dtype(out.dtype, [&](auto tag) {
    using T = decltype(tag);
    parallel_for(0, mod.groups(), [&](int64_t g) {
      // bounds and bases in locals (unaligned.h)
      const int64_t w = width, n = per_group, row = partials.strides[0];
      const float* first = partials.ptr<const float>() + g * n * row;
      void* base = static_cast<char*>(out.data) +
                   group_offset(dst, mod.frames, g) * static_cast<int64_t>(sizeof(T));
      for (int64_t j = 0; j < w; ++j) {
        float acc = 0.0f;
        for (int64_t c = 0; c < n; ++c) acc = num::add32(acc, first[c * row + j]);
        store(base, j, from_float<T>(acc));
      }
    });
  });
  return Status();
}

Status continue_segment_fold(const IndexPlan& plan, const TensorView& partials, int64_t first,
                             const TensorView& running, const TensorView& out, Stream) {
  segment_fold(plan, partials, first, running, out);
  return Status();
}

Status continue_chunk_fold(const TensorView& partials, const TensorView& running, const TensorView& out, Stream) {
  chunk_fold(partials, running, out);
  return Status();
}

}  // namespace cpu
}  // namespace detdit
