// AdaLN row gather, CPU reference: docs/numerics.md 5.5 (forward, a byte
// copy) and 6.6 (backward, the canonical reduction of the six chunk
// gradients). rows (R, 6H) with unit column stride; out and grad (6, B*S, H)
// contiguous; d_rows (R, 6H) unit column stride. The backward's half here is
// the segment partials of every chunk (width 6H, j = c*H + h); the public
// adaln_row_gather_backward adds fold_segment_partials (src/adaln.cc).
#include <cstdint>
#include <cstring>

#include "common/backends.h"
#include "common/scalar_math.h"
#include "common/storage.h"
#include "cpu/parallel.h"
#include "cpu/reduction.h"
#include "cpu/unaligned.h"

namespace detdit {
namespace cpu {
namespace {

// partials (G, 6H): for segment g and column j = c*H + h, the ascending chain
// rn(acc + grad[c, p, h]) over the segment's positions p.
template <typename T>
void gather_backward_partials(const AdalnRowGatherBackwardParams& p, const TensorView& partials) {
  const int64_t hidden = p.grad.shape[p.grad.rank - 1];
  const int64_t positions = p.plan.positions();
  const PlanTables& tables = p.plan.host_tables();
  parallel_for(0, p.plan.num_segments(), [&](int64_t g) {
    float* acc = row_ptr<float>(partials, g);  // (6H,)
    for (int64_t j = 0; j < kAdalnChunks * hidden; ++j) acc[j] = 0.0f;
    for (int32_t q = tables.segment_pos_begin[g]; q < tables.segment_pos_begin[g + 1]; ++q) {
      const int64_t pos = tables.segment_positions[q];
      for (int c = 0; c < kAdalnChunks; ++c) {
        const int64_t src = (c * positions + pos) * hidden;  // grad[c, pos, :], at any byte address
        float* dst = acc + c * hidden;
        for (int64_t h = 0; h < hidden; ++h) dst[h] = num::add32(dst[h], to_float(load<T>(p.grad.data, src + h)));
      }
    }
  });
}

}  // namespace

Status adaln_row_gather_forward(const AdalnRowGatherParams& p, Stream) {
  const int64_t hidden = p.rows.shape[1] / kAdalnChunks;
  const int64_t seq_len = p.plan.seq_len();
  const std::size_t row_bytes = static_cast<std::size_t>(hidden) * dtype_size(p.rows.dtype);
  const int32_t* row_of_seq = p.plan.host_tables().row_of_seq;
  char* out = static_cast<char*>(p.out.data);
  const char* rows = static_cast<const char*>(p.rows.data);
  const std::size_t row_stride_bytes = static_cast<std::size_t>(p.rows.strides[0]) * dtype_size(p.rows.dtype);
  parallel_for(0, seq_len, [&](int64_t s) {
    const char* src = rows + row_of_seq[s] * row_stride_bytes;  // rows[row(s), :]
    for (int c = 0; c < kAdalnChunks; ++c)
      std::memcpy(out + (c * seq_len + s) * row_bytes, src + c * row_bytes, row_bytes);  // out[c, s, :]
  });
  return Status();
}

Status adaln_row_gather_backward_partials(const AdalnRowGatherBackwardParams& p, const TensorView& partials, Stream) {
  dispatch_float_dtype(p.grad.dtype, [&](auto tag) { gather_backward_partials<decltype(tag)>(p, partials); });
  return Status();
}

}  // namespace cpu
}  // namespace detdit
