// RMSNorm on CUDA, plain and AdaLN-modulated (numerics 5.6 forward, 6.7
// backward, 7 the row tree), bitwise equal to src/cpu/rmsnorm.cc.
//
// Forward and dx: one 128-thread block per row. Thread t owns the 4-element
// vectors t, t+128, ... (fma from +0.0 in element order), then the shuffle
// tree of row_tree.cuh: PyTorch's vectorized RMSNorm tree, so the torch
// profile (hardware rsqrtf) equals F.rms_norm. Position m uses table row
// row_of_seq[m % S].
// Cross-row gradients (canonical reduction 6.5): a partials kernel, grid
// (selected chunk, column block), each thread owns `cols` adjacent columns and
// walks the chunk's positions ascending (d_weight chunk partial) and each
// segment's positions ascending ([d_shift | d_scale] segment partials); then
// the folds of fold.cu. When every chunk's segment sums fit in shared memory
// (the plan's max_chunk_segments(): at most 10 at 4 columns) the modulated
// partials run fused, one walk over each chunk feeding every chain (x and
// grad read once, not twice); otherwise the whole launch takes two walks.
// The public rmsnorm_backward composes rows + partials(all) + folds
// (src/rowwise/backward.h). The rows kernels and the row arguments are shared
// with gate_residual_rmsnorm (src/cuda/rmsnorm_rows.cuh), whose kernels are
// in src/cuda/gate_residual_rmsnorm.cu. Calls outside the H3 rule (a
// grouped modulation form, fp32 modulation on bf16/fp16 x, upcast = true)
// run the kernels of src/cuda/rmsnorm_forms.cu instead.
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

#include "common/backends.h"
#include "common/row_tree.h"
#include "common/rowwise_math.h"
#include "common/scalar_math.h"
#include "common/storage.h"
#include "cuda/cuda_util.cuh"
#include "cuda/profile_math.cuh"
#include "cuda/reduction.cuh"
#include "cuda/rmsnorm_forms.h"
#include "cuda/rmsnorm_rows.cuh"
#include "cuda/row_tree.cuh"
#include "cuda/tuning.h"
#include "rowwise/checks.h"

namespace detdit {
namespace cuda {
namespace {

// Plain and modulated forward. Thread t's vectors j = t + 128*i, ascending i:
// the tree's order. Its first pass stores nothing, so the compiler issues the
// cached vectors' loads together, and it goes one vector at a time: the fused
// forward's batches of 8 vectors raise its registers (90 instead of 40) and
// made it slower on an H200 (dev/README.md).
template <typename T, bool kVector>
__global__ void __launch_bounds__(kRowTreeThreads) rmsnorm_forward_block_per_row_kernel(RmsnormRowArgs a) {
  __shared__ float warp_sums[kRowTreeWarps];
  const int64_t m = blockIdx.x;
  const int64_t vectors = a.hidden / kVec;
  // The cached vectors stay in x's storage type (16 registers for bf16, not 32).
  ElemVec<T, kVec> cached[kCachedForward];
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < kCachedForward; ++i) {
    const int64_t j = threadIdx.x + static_cast<int64_t>(i) * kRowTreeThreads;
    if (j < vectors) {
      const int64_t offset = m * a.hidden + j * kVec;
      load_stored<T, kVec, kVector>(static_cast<const T*>(a.x) + offset, cached[i]);
      float v[kVec];
      widen(cached[i], v);
#pragma unroll
      for (int e = 0; e < kVec; ++e) s = num::fma32(v[e], v[e], s);
    }
  }
  // Vectors past the cache: read again in the output pass.
  for (int64_t j = threadIdx.x + static_cast<int64_t>(kCachedForward) * kRowTreeThreads; j < vectors;
       j += kRowTreeThreads) {
    const int64_t offset = m * a.hidden + j * kVec;
    ElemVec<T, kVec> stored;
    load_stored<T, kVec, kVector>(static_cast<const T*>(a.x) + offset, stored);
    float v[kVec];
    widen(stored, v);
#pragma unroll
    for (int e = 0; e < kVec; ++e) s = num::fma32(v[e], v[e], s);
  }
  const float rstd = row_rstd(a, m, s, warp_sums);
  const T* w = static_cast<const T*>(a.weight);
  T* out = static_cast<T*>(a.out) + m * a.hidden;
  const T* x = static_cast<const T*>(a.x) + m * a.hidden;  // (H,) row m
  const T *shift, *scale;
  table_rows(a, m, shift, scale);
  // out_j for the x vector xv of vector j.
  auto write = [&](int64_t j, const float (&xv)[kVec]) {
    float wv[kVec], o[kVec];
    load_elems<T, kVec, kVector>(w + j * kVec, wv);
#pragma unroll
    for (int e = 0; e < kVec; ++e) o[e] = rowwise::normalised<T>(wv[e], rstd, xv[e]);
    if (shift) {
      float sh[kVec], sc[kVec];
      load_elems<T, kVec, kVector>(shift + j * kVec, sh);
      load_elems<T, kVec, kVector>(scale + j * kVec, sc);
#pragma unroll
      for (int e = 0; e < kVec; ++e) o[e] = rowwise::modulated<T>(o[e], sc[e], sh[e]);
    }
    store_elems<T, kVec, kVector>(out + j * kVec, o);
  };
#pragma unroll
  for (int i = 0; i < kCachedForward; ++i) {
    const int64_t j = threadIdx.x + static_cast<int64_t>(i) * kRowTreeThreads;
    if (j < vectors) {
      float xv[kVec];
      widen(cached[i], xv);
      write(j, xv);
    }
  }
  for (int64_t j = threadIdx.x + static_cast<int64_t>(kCachedForward) * kRowTreeThreads; j < vectors;
       j += kRowTreeThreads) {
    float xv[kVec];
    load_elems<T, kVec, kVector>(x + j * kVec, xv);
    write(j, xv);
  }
}

struct RmsnormPartialArgs {
  const void* x;            // own rows (rows, H), row stride x_stride
  const void* grad;         // own rows, row stride grad_stride
  const float* rstd;        // own rows (rows,)
  const void* extra_x;      // received rows (ExtraRows), or nullptr
  const void* extra_grad;
  const float* extra_rstd;
  int64_t x_stride, grad_stride, extra_x_stride, extra_grad_stride;
  const void* weight;       // (H,)
  const void* scale;        // (R, H) or nullptr (plain)
  int64_t scale_stride;
  PlanTables tables;        // device tables (row_of_seq nullptr without a plan)
  int64_t seq_len, positions, hidden;
  const int32_t* chunks;    // (selected,) ascending, or nullptr: every chunk
  const int32_t* position_row;  // (P,) or nullptr
  float* weight_partials;   // (selected, H), row stride, or nullptr
  int64_t weight_partial_stride;
  float* table_partials;    // (segments of the selection, 2H), row stride, or nullptr
  int64_t table_partial_stride;
};

// The x / grad rows and rstd of global position p (own or received).
template <typename T>
struct PositionRows {
  const T* x;
  const T* grad;
  float rstd;
};
template <typename T>
__device__ __forceinline__ PositionRows<T> position_rows(const RmsnormPartialArgs& a, int64_t p) {
  const int64_t r = data_row(a.position_row, p);
  if (r >= 0)
    return {static_cast<const T*>(a.x) + r * a.x_stride, static_cast<const T*>(a.grad) + r * a.grad_stride,
            a.rstd[r]};
  const int64_t e = -1 - r;
  return {static_cast<const T*>(a.extra_x) + e * a.extra_x_stride,
          static_cast<const T*>(a.extra_grad) + e * a.extra_grad_stride, a.extra_rstd[e]};
}

// grid (selected chunk k, column block); thread owns columns [i0, i0 + kCols).
template <typename T, int kCols>
__global__ void rmsnorm_backward_two_pass_partials_kernel(RmsnormPartialArgs a) {
  __shared__ int warp_counts[32];
  const int64_t k = blockIdx.x;
  const int64_t chunk = a.chunks ? a.chunks[k] : k;
  const int64_t segment_out = a.table_partials ? selected_segment_offset(a.tables, a.chunks, k, chunk, warp_counts) : 0;
  const int64_t i0 = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * kCols;
  if (i0 >= a.hidden) return;
  const T* w = static_cast<const T*>(a.weight);
  float wv[kCols];
  load_elems<T, kCols, false>(w + i0, wv);
  if (a.weight_partials) {
    float acc[kCols];
#pragma unroll
    for (int e = 0; e < kCols; ++e) acc[e] = 0.0f;
    const int64_t begin = chunk * kReductionChunk;
    const int64_t end = begin + kReductionChunk < a.positions ? begin + kReductionChunk : a.positions;
    for (int64_t p = begin; p < end; ++p) {  // ascending positions of the chunk
      const PositionRows<T> in = position_rows<T>(a, p);
      float xv[kCols], d_n[kCols];
      load_elems<T, kCols, false>(in.x + i0, xv);
      load_elems<T, kCols, false>(in.grad + i0, d_n);
      if (a.scale) {
        const T* scale =
            static_cast<const T*>(a.scale) + rowwise::table_row(a.tables.row_of_seq, p, a.seq_len) * a.scale_stride;
        float sc[kCols];
        load_elems<T, kCols, false>(scale + i0, sc);
#pragma unroll
        for (int e = 0; e < kCols; ++e) d_n[e] = rowwise::modulated_grad<T>(d_n[e], sc[e]);
      }
#pragma unroll
      for (int e = 0; e < kCols; ++e) acc[e] = rowwise::weight_grad_step(d_n[e], xv[e], in.rstd, acc[e]);
    }
    float* dst = a.weight_partials + k * a.weight_partial_stride + i0;
#pragma unroll
    for (int e = 0; e < kCols; ++e) dst[e] = acc[e];
  }
  if (a.table_partials) {
    const int32_t first = a.tables.chunk_segment_begin[chunk], last = a.tables.chunk_segment_begin[chunk + 1];
    for (int32_t g = first; g < last; ++g) {  // the chunk's segments in plan order
      float d_shift[kCols], d_scale[kCols];
#pragma unroll
      for (int e = 0; e < kCols; ++e) d_shift[e] = d_scale[e] = 0.0f;
      for (int32_t q = a.tables.segment_pos_begin[g]; q < a.tables.segment_pos_begin[g + 1]; ++q) {
        const PositionRows<T> in = position_rows<T>(a, a.tables.segment_positions[q]);
        float xv[kCols], gv[kCols];
        load_elems<T, kCols, false>(in.x + i0, xv);
        load_elems<T, kCols, false>(in.grad + i0, gv);
#pragma unroll
        for (int e = 0; e < kCols; ++e) {
          d_shift[e] = num::add32(d_shift[e], gv[e]);
          d_scale[e] = rowwise::scale_grad_step(gv[e], rowwise::normalised<T>(wv[e], in.rstd, xv[e]), d_scale[e]);
        }
      }
      float* dst = a.table_partials + (segment_out + (g - first)) * a.table_partial_stride;  // (2H,) [shift|scale]
#pragma unroll
      for (int e = 0; e < kCols; ++e) {
        dst[i0 + e] = d_shift[e];
        dst[a.hidden + i0 + e] = d_scale[e];
      }
    }
  }
}

// The same partials in one walk over the chunk's positions (modulated norm):
// each position's x and grad are read once and feed the d_weight chunk chain
// (registers) and the chain of the position's segment (shared memory, this
// thread's columns only, so no barrier after set-up). Each chain still runs
// over its positions in ascending order: the bits of the kernel above, with
// x and grad read once instead of twice. grid and columns as above; dynamic
// shared memory: (chunk's segments, 2, kCols, blockDim.x) floats.
template <typename T, int kCols, bool kVector>
__global__ void rmsnorm_backward_fused_partials_kernel(RmsnormPartialArgs a) {
  extern __shared__ float segment_sums[];  // [local segment][d_shift | d_scale][column e][thread]
  __shared__ int warp_counts[32];
  __shared__ int32_t local_segment[kReductionChunk];  // chunk position q -> its segment, 0-based in the chunk
  const int64_t k = blockIdx.x;
  const int64_t chunk = a.chunks ? a.chunks[k] : k;
  const int64_t segment_out = selected_segment_offset(a.tables, a.chunks, k, chunk, warp_counts);
  const int32_t first = a.tables.chunk_segment_begin[chunk], last = a.tables.chunk_segment_begin[chunk + 1];
  const int64_t begin = chunk * kReductionChunk;
  const int64_t end = begin + kReductionChunk < a.positions ? begin + kReductionChunk : a.positions;
  chunk_local_segments(a.tables, chunk, begin, end, a.seq_len, local_segment);
  const int threads = static_cast<int>(blockDim.x);
  for (int i = threadIdx.x; i < (last - first) * 2 * kCols * threads; i += threads) segment_sums[i] = 0.0f;
  __syncthreads();
  const int64_t i0 = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * kCols;
  if (i0 >= a.hidden) return;
  const T* w = static_cast<const T*>(a.weight);
  float wv[kCols], acc[kCols];
  load_elems<T, kCols, kVector>(w + i0, wv);
#pragma unroll
  for (int e = 0; e < kCols; ++e) acc[e] = 0.0f;
  for (int64_t p0 = begin; p0 < end; p0 += kPartialsAhead) {  // ascending positions of the chunk
    // kPartialsAhead positions' loads in flight before the first is used
    ElemVec<T, kCols> xs[kPartialsAhead], gs[kPartialsAhead];
    float rstd[kPartialsAhead];
#pragma unroll
    for (int u = 0; u < kPartialsAhead; ++u) {
      if (p0 + u < end) {
        const PositionRows<T> in = position_rows<T>(a, p0 + u);
        load_stored<T, kCols, kVector>(in.x + i0, xs[u]);
        load_stored<T, kCols, kVector>(in.grad + i0, gs[u]);
        rstd[u] = in.rstd;
      }
    }
#pragma unroll
    for (int u = 0; u < kPartialsAhead; ++u) {
      if (p0 + u >= end) break;
      float xv[kCols], gv[kCols];
      widen(xs[u], xv);
      widen(gs[u], gv);
      const int32_t local = local_segment[p0 + u - begin];
      // this thread's (d_shift, d_scale) slots of the position's segment, column e at [e * threads]
      float* sums = segment_sums + local * 2 * kCols * threads + threadIdx.x;
#pragma unroll
      for (int e = 0; e < kCols; ++e) {
        sums[e * threads] = num::add32(sums[e * threads], gv[e]);
        sums[(kCols + e) * threads] = rowwise::scale_grad_step(gv[e], rowwise::normalised<T>(wv[e], rstd[u], xv[e]),
                                                               sums[(kCols + e) * threads]);
      }
      if (a.weight_partials) {
        // the position's row is its segment's (no p % S in the loop)
        const T* scale = static_cast<const T*>(a.scale) + a.tables.segment_row[first + local] * a.scale_stride;
        float sc[kCols];
        load_readonly<T, kCols, kVector>(scale + i0, sc);
#pragma unroll
        for (int e = 0; e < kCols; ++e)
          acc[e] = rowwise::weight_grad_step(rowwise::modulated_grad<T>(gv[e], sc[e]), xv[e], rstd[u], acc[e]);
      }
    }
  }
  if (a.weight_partials) {
    float* dst = a.weight_partials + k * a.weight_partial_stride + i0;
#pragma unroll
    for (int e = 0; e < kCols; ++e) dst[e] = acc[e];
  }
  for (int32_t g = 0; g < last - first; ++g) {
    const float* sums = segment_sums + g * 2 * kCols * threads + threadIdx.x;
    float* dst = a.table_partials + (segment_out + g) * a.table_partial_stride;  // (2H,) [shift|scale]
#pragma unroll
    for (int e = 0; e < kCols; ++e) {
      dst[i0 + e] = sums[e * threads];
      dst[a.hidden + i0 + e] = sums[(kCols + e) * threads];
    }
  }
}

// Shared memory the fused kernel may take for its segment sums: below the
// 48 KB a block gets without opting in, with the static arrays beside it.
constexpr std::size_t kFusedPartialsSharedBytes = 40 * 1024;

template <typename T, int kCols>
Status launch_partials_with_columns(const RmsnormPartialArgs& a, int64_t selected, int64_t max_chunk_segments,
                                    bool vector, cudaStream_t stream) {
  constexpr int kThreads = 128;
  const dim3 grid(static_cast<unsigned>(selected), blocks_for(a.hidden, kThreads * kCols));
  const std::size_t shared_bytes =
      static_cast<std::size_t>(max_chunk_segments) * 2 * kCols * kThreads * sizeof(float);
  if (a.table_partials && a.scale && launch_tuning().rmsnorm_fused_partials &&
      shared_bytes <= kFusedPartialsSharedBytes) {
    if (vector)
      rmsnorm_backward_fused_partials_kernel<T, kCols, true><<<grid, kThreads, shared_bytes, stream>>>(a);
    else
      rmsnorm_backward_fused_partials_kernel<T, kCols, false><<<grid, kThreads, shared_bytes, stream>>>(a);
    return launch_status("rmsnorm_backward_fused_partials_kernel");
  }
  rmsnorm_backward_two_pass_partials_kernel<T, kCols><<<grid, kThreads, 0, stream>>>(a);
  return launch_status("rmsnorm_backward_two_pass_partials_kernel");
}

template <typename T>
Status launch_rmsnorm_backward_partials(const RmsnormPartialArgs& a, int64_t selected, int64_t max_chunk_segments,
                                        cudaStream_t stream) {
  if (selected == 0 || a.hidden == 0) return Status();
  const int cols = launch_tuning().partial_columns_per_thread;
  // Column vectors of cols elements: every row start and the table rows aligned to them.
  const std::size_t bytes = cols * sizeof(T);
  bool vector = a.hidden % cols == 0 && a.x_stride % cols == 0 && a.grad_stride % cols == 0 &&
                address_aligned(a.x, bytes) && address_aligned(a.grad, bytes) && address_aligned(a.weight, bytes);
  if (a.extra_x)
    vector = vector && a.extra_x_stride % cols == 0 && a.extra_grad_stride % cols == 0 &&
             address_aligned(a.extra_x, bytes) && address_aligned(a.extra_grad, bytes);
  if (a.scale) vector = vector && a.scale_stride % cols == 0 && address_aligned(a.scale, bytes);
  switch (cols) {
    case 1: return launch_partials_with_columns<T, 1>(a, selected, max_chunk_segments, vector, stream);
    case 2: return launch_partials_with_columns<T, 2>(a, selected, max_chunk_segments, vector, stream);
    default: return launch_partials_with_columns<T, 4>(a, selected, max_chunk_segments, vector, stream);
  }
}

// The positions a backward reduces: the plan's B*S, or x's rows for a plain
// norm without a plan (as the CPU reference).
int64_t reduced_positions(const RmsnormBackwardParams& p) {
  return p.in.plan.valid() ? p.in.plan.positions() : p.in.x.numel() / hidden_of(p.in.x);
}

// One 128-thread block per row; vector accesses when every row the kernel
// touches is aligned to a 4-element vector (else scalar ones, the same values).
template <typename T>
Status launch_rmsnorm_forward(const RmsnormRowArgs& a, int64_t rows, std::initializer_list<const void*> pointers,
                              cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>(rows);
  const bool vector = rows_vectorizable<T>(a, pointers);
  if (vector)
    rmsnorm_forward_block_per_row_kernel<T, true><<<blocks, kRowTreeThreads, 0, stream>>>(a);
  else
    rmsnorm_forward_block_per_row_kernel<T, false><<<blocks, kRowTreeThreads, 0, stream>>>(a);
  return launch_status("rmsnorm_forward_block_per_row_kernel");
}

}  // namespace

Status rmsnorm_forward(const RmsnormParams& p, Stream stream) {
  if (!rmsnorm_h3_rule(p.in, rowwise::rmsnorm_modulation(p.in))) return rmsnorm_forms_forward(p, stream);
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.in.x.device));
  RmsnormRowArgs a = row_args(p.in.x, p.in.weight, p.in.shift, p.in.scale, p.in.plan, p.in.eps, p.in.numerics);
  a.out = p.out.data;
  a.rstd = p.rstd.present() ? p.rstd.ptr<float>() : nullptr;
  const int64_t rows = p.in.x.numel() / a.hidden;
  if (rows == 0) return Status();
  cudaStream_t s = as_cuda_stream(stream);
  return dispatch_float_dtype(p.in.x.dtype, [&](auto tag) {
    return launch_rmsnorm_forward<decltype(tag)>(a, rows, {a.x, a.weight, a.out}, s);
  });
}

Status rmsnorm_backward_rows(const RmsnormBackwardParams& p, Stream stream) {
  if (!p.dx.present()) return Status();
  if (!rmsnorm_h3_rule(p.in, rowwise::rmsnorm_modulation(p.in))) return rmsnorm_forms_backward_rows(p, stream);
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.in.x.device));
  RmsnormRowArgs a = row_args(p.in.x, p.in.weight, p.in.shift, p.in.scale, p.in.plan, p.in.eps, p.in.numerics);
  a.rstd = const_cast<float*>(p.rstd.ptr<const float>());
  a.grad = p.grad.data;
  a.dx = p.dx.data;
  const int64_t rows = p.in.x.numel() / a.hidden;
  if (rows == 0) return Status();
  cudaStream_t s = as_cuda_stream(stream);
  return dispatch_float_dtype(p.in.x.dtype, [&](auto tag) {
    using T = decltype(tag);
    return launch_rmsnorm_backward_rows<T, false>(a, rows, {a.x, a.weight, a.grad, a.dx}, s);
  });
}

Status rmsnorm_backward_partials(const RmsnormBackwardParams& p, const ChunkSelection& sel, const ExtraRows& extra,
                                 const TensorView& weight_partials, const TensorView& table_partials,
                                 Stream stream) {
  if (!rmsnorm_h3_rule(p.in, rowwise::rmsnorm_modulation(p.in))) {
    // The SP region (a chunk selection, received rows) runs the H3 rule only (its validation).
    if (sel.chunks != nullptr || sel.position_row != nullptr)
      return Status::runtime_error("rmsnorm_backward_partials: a chunk selection takes the H3 rule only");
    return rmsnorm_forms_backward_partials(p, weight_partials, table_partials, stream);
  }
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.in.x.device));
  const bool tables = is_modulated(p.in.shift) && table_partials.present();
  if (!weight_partials.present() && !tables) return Status();
  RmsnormPartialArgs a{};
  a.x = p.in.x.data;
  a.grad = p.grad.data;
  a.rstd = p.rstd.ptr<const float>();
  a.hidden = hidden_of(p.in.x);
  a.x_stride = a.grad_stride = a.hidden;
  if (extra.x.present()) {
    a.extra_x = extra.x.data;
    a.extra_x_stride = extra.x.strides[0];
  }
  if (extra.grad.present()) {
    a.extra_grad = extra.grad.data;
    a.extra_grad_stride = extra.grad.strides[0];
  }
  if (extra.rstd.present()) a.extra_rstd = extra.rstd.ptr<const float>();
  a.weight = p.in.weight.data;
  if (is_modulated(p.in.shift)) {
    a.scale = p.in.scale.data;
    a.scale_stride = p.in.scale.strides[0];
  }
  if (p.in.plan.valid()) {
    a.tables = p.in.plan.device_tables();
    a.seq_len = p.in.plan.seq_len();
  }
  a.positions = reduced_positions(p);
  a.chunks = sel.chunks;
  a.position_row = sel.position_row;
  if (weight_partials.present()) {
    a.weight_partials = weight_partials.ptr<float>();
    a.weight_partial_stride = weight_partials.strides[0];
  }
  if (tables) {
    a.table_partials = table_partials.ptr<float>();
    a.table_partial_stride = table_partials.strides[0];
  }
  const int64_t selected = sel.chunks ? sel.num_chunks : (a.positions + kReductionChunk - 1) / kReductionChunk;
  return dispatch_float_dtype(p.in.x.dtype, [&](auto tag) {
    return launch_rmsnorm_backward_partials<decltype(tag)>(a, selected, p.in.plan.max_chunk_segments(),
                                                           as_cuda_stream(stream));
  });
}

}  // namespace cuda
}  // namespace detdit
