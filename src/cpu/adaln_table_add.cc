// CPU reference of adaln_table_add (docs/numerics.md 5.13, 6.12) and of the
// plain column sums of the canonical reduction (6.5, no index):
//   adaln_table_add_forward:        out[t, k, h] = R_out(rn(table[k, h] + proj[t, k', h]))
//   adaln_table_add_backward_proj:  d_proj[t, k', h] = R_proj(g), g = grad[t, k, h] or,
//                                   broadcast, the ascending chain from +0.0 over k
//   column_chunk_partials:          partials[c, j] = ascending chain from +0.0 over rows
//                                   [256c, min(256c + 256, M)) of src[p, j]
// Each output element (each chunk partial) is computed by one loop on its
// own, so the split over threads changes no bit; any byte address is read
// and written (cpu::load / cpu::store).
#include <algorithm>

#include "common/backends.h"
#include "common/scalar_math.h"
#include "common/storage.h"
#include "cpu/parallel.h"
#include "cpu/unaligned.h"
#include "detdit/plan.h"

namespace detdit {
namespace cpu {
namespace {

// Element i of a float tensor of any storage dtype, widened exactly.
float load_widened(const void* base, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kBF16: return to_float(load<Bf16>(base, i));
    case DType::kF16: return to_float(load<F16>(base, i));
    default: return load<float>(base, i);
  }
}

void store_rounded(void* base, DType dtype, int64_t i, float v) {
  switch (dtype) {
    case DType::kBF16: store(base, i, from_float<Bf16>(v)); break;
    case DType::kF16: store(base, i, from_float<F16>(v)); break;
    default: store(base, i, v); break;
  }
}

}  // namespace

Status adaln_table_add_forward(const AdalnTableAddParams& p, Stream) {
  const int64_t rows = p.out.shape[0], k = p.out.shape[1], hidden = p.out.shape[2];
  const bool broadcast = p.proj.shape[1] == 1 && k != 1;
  const void *table = p.table.data, *proj = p.proj.data;
  void* out = p.out.data;
  const DType td = p.table.dtype, pd = p.proj.dtype, od = p.out.dtype;
  parallel_for(0, rows, [=](int64_t t) {
    for (int64_t c = 0; c < k; ++c)
      for (int64_t h = 0; h < hidden; ++h) {
        const int64_t j = c * hidden + h, i = (t * k + c) * hidden + h;
        const int64_t pi = broadcast ? t * hidden + h : i;
        store_rounded(out, od, i, num::add32(load_widened(table, td, j), load_widened(proj, pd, pi)));
      }
  });
  return Status();
}

Status adaln_table_add_backward_proj(const AdalnTableAddBackwardParams& p, Stream) {
  const int64_t rows = p.grad.shape[0], k = p.grad.shape[1], hidden = p.grad.shape[2];
  const bool broadcast = p.d_proj.shape[1] == 1 && k != 1;
  const void* grad = p.grad.data;
  void* d_proj = p.d_proj.data;
  const DType gd = p.grad.dtype, dd = p.d_proj.dtype;
  parallel_for(0, rows, [=](int64_t t) {
    if (!broadcast) {
      for (int64_t i = t * k * hidden; i < (t + 1) * k * hidden; ++i)
        store_rounded(d_proj, dd, i, load_widened(grad, gd, i));
      return;
    }
    for (int64_t h = 0; h < hidden; ++h) {
      float acc = 0.0f;
      for (int64_t c = 0; c < k; ++c) acc = num::add32(acc, load_widened(grad, gd, (t * k + c) * hidden + h));
      store_rounded(d_proj, dd, t * hidden + h, acc);
    }
  });
  return Status();
}

Status column_chunk_partials(const TensorView& src, const TensorView& partials, Stream) {
  const int64_t rows = src.shape[0], chunks = partials.shape[0], width = partials.shape[1];
  const void* in = src.data;
  float* out = partials.ptr<float>();
  const DType sd = src.dtype;
  parallel_for(0, chunks, [=](int64_t c) {
    const int64_t begin = c * kReductionChunk, end = std::min(rows, begin + kReductionChunk);
    float* acc = out + c * width;
    for (int64_t j = 0; j < width; ++j) acc[j] = 0.0f;
    for (int64_t r = begin; r < end; ++r)
      for (int64_t j = 0; j < width; ++j) acc[j] = num::add32(acc[j], load_widened(in, sd, r * width + j));
  });
  return Status();
}

}  // namespace cpu
}  // namespace detdit
