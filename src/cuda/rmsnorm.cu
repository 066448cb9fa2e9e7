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
// (src/rowwise/backward.h).
#include <cuda_runtime.h>

#include <cstdint>

#include "common/backends.h"
#include "common/row_tree.h"
#include "common/rowwise_math.h"
#include "common/scalar_math.h"
#include "common/storage.h"
#include "cuda/cuda_util.cuh"
#include "cuda/gate_residual_rmsnorm_walk.cuh"
#include "cuda/profile_math.cuh"
#include "cuda/reduction.cuh"
#include "cuda/row_tree.cuh"
#include "cuda/tuning.h"

namespace detdit {
namespace cuda {
namespace {

constexpr int kVec = kRowTreeVector;  // 4 elements per tree vector
// Tree vectors per thread kept in registers between the statistics pass and
// the output pass; vectors past them are read again.
// The backward rows kernel caches x and grad, twice the registers: 8 vectors
// (H <= 4096 cached) keep it at 64 registers, 8 blocks (rows) per SM instead
// of 6; the rest of a row is read again in the output pass (from L2: the
// block read it a moment before).
constexpr int kCachedBackward = 8;
// The forward kernels cache 8 vectors (H <= 4096); the rest of a row is read
// again in the output pass (x, or the h this thread wrote: L2). The fused
// forward also takes its vectors in batches of this many (its comment).
constexpr int kCachedForward = 8;

struct RmsnormRowArgs {
  const void* x;       // (M, H); the fused region's forward computes it as h instead
  const void* weight;  // (H,)
  const void* shift;   // (R, H) row stride shift_stride, or nullptr (plain)
  const void* scale;   // (R, H) row stride scale_stride
  int64_t shift_stride, scale_stride;
  const int32_t* row_of_seq;  // (S,) or nullptr (plain)
  int64_t seq_len, hidden;
  float eps;
  bool torch;
  void* out;          // forward (M, H)
  float* rstd;        // (M,) forward output or backward input
  const void* grad;   // backward (M, H)
  void* dx;           // backward (M, H)
  // gate_residual_rmsnorm forward: x = h = R_T(rn(residual + R_T(rn(gate[r] * y)))), written to h
  const void* residual;  // (M, H)
  const void* y;         // (M, H)
  const void* gate;      // (R, H) row stride gate_stride
  int64_t gate_stride;
  void* h;               // (M, H)
  // gate_residual_rmsnorm backward rows: dx holds g = R_T(rn(d_h + R_T(dx))), and
  // d_y = R_T(rn(g * gate[r])) (gate and gate_stride as above)
  const void* d_h;       // (M, H), or nullptr (g = R_T(dx))
  void* d_y;             // (M, H), or nullptr
  // backward rows, kCoefOnly: (M,) each row's dx coefficient, nothing else written
  float* coef;
};

// The end of a row's statistics pass: the block sums the threads' sums of
// squares s, and thread 0 stores rstd where it is asked for.
__device__ __forceinline__ float row_rstd(const RmsnormRowArgs& a, int64_t m, float s, float* warp_sums) {
  const float total = row_tree_block_sum(s, warp_sums);
  const float rstd = rsqrt_p(num::add32(num::div32(total, static_cast<float>(a.hidden)), a.eps), a.torch);
  if (a.rstd && threadIdx.x == 0) a.rstd[m] = rstd;
  return rstd;
}

// Row m's shift and scale table rows (modulated), or nullptr (plain).
template <typename T>
__device__ __forceinline__ void table_rows(const RmsnormRowArgs& a, int64_t m, const T*& shift, const T*& scale) {
  shift = nullptr;
  scale = nullptr;
  if (a.shift) {
    const int64_t r = rowwise::table_row(a.row_of_seq, m, a.seq_len);
    shift = static_cast<const T*>(a.shift) + r * a.shift_stride;
    scale = static_cast<const T*>(a.scale) + r * a.scale_stride;
  }
}

// Plain and modulated forward. Thread t's vectors j = t + 128*i, ascending i:
// the tree's order. Its first pass stores nothing, so the compiler issues the
// cached vectors' loads together, and it goes one vector at a time: the fused
// forward's batches (below) made it slower (bf16, H = 5376, one H200; both
// passes batched: 90 registers instead of 40, 51-53 % of the copy bandwidth
// instead of 74-82 % at S >= 32768; the first pass alone: 48 registers, 0-4 %
// slower there).
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

// The loads behind h vector j of row m: the residual, y and gate vectors.
template <typename T>
struct RowInput {
  ElemVec<T, kVec> residual, y, gate;
};

template <typename T, bool kVector>
__device__ __forceinline__ void load_row_input(const RmsnormRowArgs& a, const T* gate_row, int64_t m, int64_t j,
                                               RowInput<T>& in) {
  const int64_t offset = m * a.hidden + j * kVec;
  load_stored<T, kVec, kVector>(static_cast<const T*>(a.residual) + offset, in.residual);
  load_stored<T, kVec, kVector>(static_cast<const T*>(a.y) + offset, in.y);
  load_stored<T, kVec, kVector>(gate_row + j * kVec, in.gate);
}

// h vector j from its loads (gate_residual's formula, numerics 5.7), stored
// to h on the way, so the norm reads exactly the h it returns.
template <typename T, bool kVector>
__device__ __forceinline__ void finish_row_input(const RmsnormRowArgs& a, int64_t m, int64_t j, const RowInput<T>& in,
                                                 ElemVec<T, kVec>& out) {
  float r[kVec], y[kVec], g[kVec], h[kVec];
  widen(in.residual, r);
  widen(in.y, y);
  widen(in.gate, g);
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    h[e] = rowwise::gated_sum<T>(r[e], g[e], y[e]);
    out.elems[e] = from_float<T>(h[e]);
  }
  store_elems<T, kVec, kVector>(static_cast<T*>(a.h) + m * a.hidden + j * kVec, h);
}

// The fused region's forward (numerics 6.10): h, then the norm of h, one row
// per block as above. Thread t's vectors j = t + 128*i, ascending i, go in
// batches of kCachedForward, every load of a batch before its first store:
// the compiler cannot tell that a store does not alias a later vector's
// input, so one vector at a time each h or out store made the next vector's
// loads wait, one memory latency per vector (16 B from DRAM in flight per
// thread: 77-81 % of the copy bandwidth at S >= 32768, 63-65 % at S = 4097,
// against 79-82 % and 70 % batched; bf16, H = 5376, one H200). The batches
// take 90 registers (bf16) instead of 64: 5 rows per SM, 80 KB from DRAM in
// flight per SM. Batches in the source rather than read-only loads
// (load_readonly), which would allow the compiler to move loads up but not
// make it: here the order is fixed whatever the scheduler does, and the
// batch is the cache's size, so the first batch is the cached vectors.
template <typename T, bool kVector>
__global__ void __launch_bounds__(kRowTreeThreads) gate_residual_rmsnorm_forward_kernel(RmsnormRowArgs a) {
  __shared__ float warp_sums[kRowTreeWarps];
  const int64_t m = blockIdx.x;
  const int64_t vectors = a.hidden / kVec;
  constexpr int64_t kBatchStride = static_cast<int64_t>(kCachedForward) * kRowTreeThreads;
  const T* gate_row = static_cast<const T*>(a.gate) + rowwise::table_row(a.row_of_seq, m, a.seq_len) * a.gate_stride;
  // The first batch stays in registers between the passes, in h's storage
  // type; later batches are read back in the output pass (the h this thread
  // wrote: L2).
  ElemVec<T, kVec> cached[kCachedForward];
  float s = 0.0f;
  // kept: the batch also goes into cached.
  auto statistics_batch = [&](int64_t first, bool kept) {
    RowInput<T> in[kCachedForward];
#pragma unroll
    for (int i = 0; i < kCachedForward; ++i) {
      const int64_t j = first + static_cast<int64_t>(i) * kRowTreeThreads;
      if (j < vectors) load_row_input<T, kVector>(a, gate_row, m, j, in[i]);
    }
#pragma unroll
    for (int i = 0; i < kCachedForward; ++i) {
      const int64_t j = first + static_cast<int64_t>(i) * kRowTreeThreads;
      if (j < vectors) {
        ElemVec<T, kVec> xv;
        finish_row_input<T, kVector>(a, m, j, in[i], xv);
        if (kept) cached[i] = xv;
        float v[kVec];
        widen(xv, v);
#pragma unroll
        for (int e = 0; e < kVec; ++e) s = num::fma32(v[e], v[e], s);
      }
    }
  };
  statistics_batch(threadIdx.x, true);
  for (int64_t first = threadIdx.x + kBatchStride; first < vectors; first += kBatchStride)
    statistics_batch(first, false);
  const float rstd = row_rstd(a, m, s, warp_sums);
  const T* w = static_cast<const T*>(a.weight);
  T* out = static_cast<T*>(a.out) + m * a.hidden;
  const T* x = static_cast<const T*>(a.h) + m * a.hidden;  // (H,) row m of h
  const T *shift, *scale;
  table_rows(a, m, shift, scale);
  // Vectors j = first + 128*i, i < kCachedForward; kept: x is cached[i].
  auto output_batch = [&](int64_t first, bool kept) {
    ElemVec<T, kVec> xs[kCachedForward], ws[kCachedForward], shs[kCachedForward], scs[kCachedForward];
#pragma unroll
    for (int i = 0; i < kCachedForward; ++i) {
      const int64_t j = first + static_cast<int64_t>(i) * kRowTreeThreads;
      if (j < vectors) {
        if (kept)
          xs[i] = cached[i];
        else
          load_stored<T, kVec, kVector>(x + j * kVec, xs[i]);
        load_stored<T, kVec, kVector>(w + j * kVec, ws[i]);
        if (shift) {
          load_stored<T, kVec, kVector>(shift + j * kVec, shs[i]);
          load_stored<T, kVec, kVector>(scale + j * kVec, scs[i]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kCachedForward; ++i) {
      const int64_t j = first + static_cast<int64_t>(i) * kRowTreeThreads;
      if (j < vectors) {
        float xv[kVec], wv[kVec], o[kVec];
        widen(xs[i], xv);
        widen(ws[i], wv);
#pragma unroll
        for (int e = 0; e < kVec; ++e) o[e] = rowwise::normalised<T>(wv[e], rstd, xv[e]);
        if (shift) {
          float sh[kVec], sc[kVec];
          widen(shs[i], sh);
          widen(scs[i], sc);
#pragma unroll
          for (int e = 0; e < kVec; ++e) o[e] = rowwise::modulated<T>(o[e], sc[e], sh[e]);
        }
        store_elems<T, kVec, kVector>(out + j * kVec, o);
      }
    }
  };
  output_batch(threadIdx.x, true);
  for (int64_t first = threadIdx.x + kBatchStride; first < vectors; first += kBatchStride) output_batch(first, false);
}

// kGated: the fused region's rows (numerics 6.10): dx is not stored but summed
// with d_h into g, stored in a.dx, and d_y = g * gate is stored beside it; one
// read of h, d_out and d_h instead of the halves' three kernels.
// kCoefOnly: the row tree's dot and the row's dx coefficient, stored to
// a.coef[m]; the output pass is left to a later kernel (the region walk below).
template <typename T, bool kVector, bool kGated, bool kCoefOnly = false>
__global__ void __launch_bounds__(kRowTreeThreads) rmsnorm_backward_rows_block_per_row_kernel(RmsnormRowArgs a) {
  __shared__ float warp_sums[kRowTreeWarps];
  const int64_t m = blockIdx.x;
  const int64_t vectors = a.hidden / kVec;
  const T* x = static_cast<const T*>(a.x) + m * a.hidden;  // (H,) row m
  const T* g = static_cast<const T*>(a.grad) + m * a.hidden;
  const T* w = static_cast<const T*>(a.weight);
  const T* scale =
      a.scale ? static_cast<const T*>(a.scale) + rowwise::table_row(a.row_of_seq, m, a.seq_len) * a.scale_stride
                   : nullptr;
  const float rstd = a.rstd[m];
  // d_n of vector j from its grad (d_n = g, or rn(g * t1) when modulated).
  auto d_n_of = [&](int64_t j, float (&d_n)[kVec]) {
    if (scale) {
      float sc[kVec];
      load_elems<T, kVec, kVector>(scale + j * kVec, sc);
#pragma unroll
      for (int e = 0; e < kVec; ++e) d_n[e] = rowwise::modulated_grad<T>(d_n[e], sc[e]);
    }
  };
  auto load = [&](int64_t j, float (&xv)[kVec], float (&d_n)[kVec]) {
    load_elems<T, kVec, kVector>(x + j * kVec, xv);
    load_elems<T, kVec, kVector>(g + j * kVec, d_n);
    d_n_of(j, d_n);
  };
  // A cached vector: x and grad kept in their storage type (32 registers for
  // bf16 instead of 64 for FP32 x and d_n); d_n is recomputed from them.
  auto unpack = [&](int64_t j, const ElemVec<T, kVec>& xs, const ElemVec<T, kVec>& gs, float (&xv)[kVec],
                    float (&d_n)[kVec]) {
    widen(xs, xv);
    widen(gs, d_n);
    d_n_of(j, d_n);
  };
  auto accumulate = [&](int64_t j, const float (&xv)[kVec], const float (&d_n)[kVec], float acc) {
    float wv[kVec];
    load_elems<T, kVec, kVector>(w + j * kVec, wv);
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc = num::fma32(rowwise::dot_term(wv[e], d_n[e]), xv[e], acc);
    return acc;
  };
  // Thread t's vectors j = t + 128*i, ascending i: the tree's order.
  ElemVec<T, kVec> cached_x[kCachedBackward], cached_g[kCachedBackward];
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < kCachedBackward; ++i) {
    const int64_t j = threadIdx.x + static_cast<int64_t>(i) * kRowTreeThreads;
    if (j < vectors) {
      load_stored<T, kVec, kVector>(x + j * kVec, cached_x[i]);
      load_stored<T, kVec, kVector>(g + j * kVec, cached_g[i]);
      float xv[kVec], d_n[kVec];
      unpack(j, cached_x[i], cached_g[i], xv, d_n);
      s = accumulate(j, xv, d_n, s);
    }
  }
  for (int64_t j = threadIdx.x + static_cast<int64_t>(kCachedBackward) * kRowTreeThreads; j < vectors;
       j += kRowTreeThreads) {
    float xv[kVec], d_n[kVec];
    load(j, xv, d_n);
    s = accumulate(j, xv, d_n, s);
  }
  const float dot = row_tree_block_sum(s, warp_sums);
  const float coef = rowwise::dx_coefficient(rstd, dot, a.hidden);
  if constexpr (kCoefOnly) {
    if (threadIdx.x == 0) a.coef[m] = coef;
    return;
  }
  T* dx = static_cast<T*>(a.dx) + m * a.hidden;
  const T* gate_row = kGated && a.d_y ? static_cast<const T*>(a.gate) +
                                            rowwise::table_row(a.row_of_seq, m, a.seq_len) * a.gate_stride
                                      : nullptr;
  auto write = [&](int64_t j, const float (&xv)[kVec], const float (&d_n)[kVec]) {
    float wv[kVec], o[kVec];
    load_elems<T, kVec, kVector>(w + j * kVec, wv);
#pragma unroll
    for (int e = 0; e < kVec; ++e)
      o[e] = rowwise::dx_value(rstd, wv[e], d_n[e], xv[e], coef);
    if constexpr (kGated) {
      float dh[kVec];
      if (a.d_h) load_elems<T, kVec, kVector>(static_cast<const T*>(a.d_h) + m * a.hidden + j * kVec, dh);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        o[e] = round_to<T>(o[e]);                                     // the norm's dx, as the halves store it
        if (a.d_h) o[e] = round_to<T>(num::add32(o[e], dh[e]));       // g = R_T(rn(dx + d_h))
      }
      if (gate_row) {
        float gv[kVec], dy[kVec];
        load_elems<T, kVec, kVector>(gate_row + j * kVec, gv);
#pragma unroll
        for (int e = 0; e < kVec; ++e) dy[e] = rowwise::gated_grad(o[e], gv[e]);
        store_elems<T, kVec, kVector>(static_cast<T*>(a.d_y) + m * a.hidden + j * kVec, dy);
      }
    }
    store_elems<T, kVec, kVector>(dx + j * kVec, o);
  };
#pragma unroll
  for (int i = 0; i < kCachedBackward; ++i) {
    const int64_t j = threadIdx.x + static_cast<int64_t>(i) * kRowTreeThreads;
    if (j < vectors) {
      float xv[kVec], d_n[kVec];
      unpack(j, cached_x[i], cached_g[i], xv, d_n);
      write(j, xv, d_n);
    }
  }
  for (int64_t j = threadIdx.x + static_cast<int64_t>(kCachedBackward) * kRowTreeThreads; j < vectors;
       j += kRowTreeThreads) {
    float xv[kVec], d_n[kVec];
    load(j, xv, d_n);
    write(j, xv, d_n);
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

// The region backward as a walk (gate_residual_rmsnorm, modulated, every chunk
// at world size 1): the coefficient kernel (the rows kernel with kCoefOnly)
// has stored each row's dx coefficient, so dx is elementwise; a block then
// owns one chunk and kWalkThreads * kCols columns and walks the chunk's
// positions in ascending order, each position's h, d_out, d_h and y read once:
// g = R_T(rn(R_T(dx) + d_h)) to d_residual, d_y = R_T(rn(g * gate)), the
// d_weight chain (registers) and the d_shift, d_scale, d_gate chains of the
// position's segment (shared memory, this thread's columns only). Each value
// and chain is the halves' (the rows kernel's dx, g and d_y; the partials
// kernels' chains over each chunk's and segment's positions ascending), so the
// bytes are theirs, with h and d_out read twice instead of three times and g
// and y once instead of twice. grid (chunk, column block); dynamic shared
// memory: (chunk's segments, 3, kCols, kWalkThreads) floats.
constexpr int kWalkThreads = 128;
constexpr int kWalkColumns = 4;  // columns per thread, one vector
constexpr int kWalkAhead = 4;    // positions whose loads are in flight before the first is used
// The segment sums' budget: 6 KB per segment of a chunk, so up to 10 (the
// interleaved H3 packing has 9); more take the halves.
constexpr std::size_t kWalkSharedBytes = 64 * 1024;

template <typename T, int kCols>
__global__ void __launch_bounds__(kWalkThreads) gate_residual_rmsnorm_backward_walk_kernel(RegionWalkArgs a) {
  extern __shared__ float segment_sums[];  // [local segment][d_shift | d_scale | d_gate][column e][thread]
  __shared__ int32_t local_segment[kReductionChunk];  // chunk position q -> its segment, 0-based in the chunk
  constexpr int kChains = 3;
  const int64_t chunk = blockIdx.x;
  const int32_t first = a.tables.chunk_segment_begin[chunk], last = a.tables.chunk_segment_begin[chunk + 1];
  const int64_t begin = chunk * kReductionChunk;
  const int64_t end = begin + kReductionChunk < a.positions ? begin + kReductionChunk : a.positions;
  chunk_local_segments(a.tables, chunk, begin, end, a.seq_len, local_segment);
  for (int i = threadIdx.x; i < (last - first) * kChains * kCols * kWalkThreads; i += kWalkThreads)
    segment_sums[i] = 0.0f;
  __syncthreads();
  const int64_t i0 = (static_cast<int64_t>(blockIdx.y) * kWalkThreads + threadIdx.x) * kCols;
  if (i0 >= a.hidden) return;
  float wv[kCols], d_weight[kCols];
  load_elems<T, kCols, true>(static_cast<const T*>(a.weight) + i0, wv);
#pragma unroll
  for (int e = 0; e < kCols; ++e) d_weight[e] = 0.0f;
  for (int64_t p0 = begin; p0 < end; p0 += kWalkAhead) {  // ascending positions of the chunk
    ElemVec<T, kCols> hs[kWalkAhead], gs[kWalkAhead], dhs[kWalkAhead], ys[kWalkAhead];
    float rstd[kWalkAhead], coef[kWalkAhead];
#pragma unroll
    for (int u = 0; u < kWalkAhead; ++u) {
      const int64_t p = p0 + u;
      if (p >= end) break;
      const int64_t offset = p * a.hidden + i0;
      load_stored<T, kCols, true>(static_cast<const T*>(a.h) + offset, hs[u]);
      load_stored<T, kCols, true>(static_cast<const T*>(a.d_out) + offset, gs[u]);
      if (a.d_h) load_stored<T, kCols, true>(static_cast<const T*>(a.d_h) + offset, dhs[u]);
      if (a.y) load_stored<T, kCols, true>(static_cast<const T*>(a.y) + offset, ys[u]);
      rstd[u] = a.rstd[p];
      coef[u] = a.coef[p];
    }
#pragma unroll
    for (int u = 0; u < kWalkAhead; ++u) {
      const int64_t p = p0 + u;
      if (p >= end) break;
      const int32_t local = local_segment[p - begin];
      const int64_t r = a.tables.segment_row[first + local];  // the position's row is its segment's
      float xv[kCols], gv[kCols], d_n[kCols], g[kCols];
      widen(hs[u], xv);
      widen(gs[u], gv);
      region_dx_step<T>(
          a, p, r, i0, rstd[u], coef[u], xv, gv, wv, [&](float(&dh)[kCols]) { widen(dhs[u], dh); }, d_n, g);
      // this thread's chain slots of the position's segment, column e of chain c at [(c * kCols + e) * threads]
      float* sums = segment_sums + local * kChains * kCols * kWalkThreads + threadIdx.x;
      float yv[kCols];
      if (a.y) widen(ys[u], yv);
#pragma unroll
      for (int e = 0; e < kCols; ++e) {
        d_weight[e] = rowwise::weight_grad_step(d_n[e], xv[e], rstd[u], d_weight[e]);
        float& d_shift = sums[e * kWalkThreads];
        float& d_scale = sums[(kCols + e) * kWalkThreads];
        d_shift = num::add32(d_shift, gv[e]);
        d_scale = rowwise::scale_grad_step(gv[e], rowwise::normalised<T>(wv[e], rstd[u], xv[e]), d_scale);
        if (a.y) {
          float& d_gate = sums[(2 * kCols + e) * kWalkThreads];
          d_gate = rowwise::gate_grad_step(g[e], yv[e], d_gate);
        }
      }
    }
  }
  if (a.weight_partials) {
    float* dst = a.weight_partials + chunk * a.weight_partial_stride + i0;
#pragma unroll
    for (int e = 0; e < kCols; ++e) dst[e] = d_weight[e];
  }
  for (int32_t s = 0; s < last - first; ++s) {
    const float* sums = segment_sums + s * kChains * kCols * kWalkThreads + threadIdx.x;
#pragma unroll
    for (int e = 0; e < kCols; ++e) {
      if (a.table_partials) {
        float* dst = a.table_partials + (first + s) * a.table_partial_stride;  // (2H,) [shift | scale]
        dst[i0 + e] = sums[e * kWalkThreads];
        dst[a.hidden + i0 + e] = sums[(kCols + e) * kWalkThreads];
      }
      if (a.gate_partials)
        a.gate_partials[(first + s) * a.gate_partial_stride + i0 + e] = sums[(2 * kCols + e) * kWalkThreads];
    }
  }
}

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

bool is_modulated(const TensorView& shift) { return shift.present(); }
int64_t hidden_of(const TensorView& x) { return x.shape[x.rank - 1]; }

// The positions a backward reduces: the plan's B*S, or x's rows for a plain
// norm without a plan (as the CPU reference).
int64_t reduced_positions(const RmsnormBackwardParams& p) {
  return p.in.plan.valid() ? p.in.plan.positions() : p.in.x.numel() / hidden_of(p.in.x);
}

// Vector accesses when every row the row kernels touch is aligned to one
// 4-element vector (always true for validated x, weight, out; grad, dx and
// the shift/scale rows are checked here, so an unaligned view still computes
// the same bits through scalar accesses).
template <typename T>
bool rows_vectorizable(const RmsnormRowArgs& a, std::initializer_list<const void*> pointers) {
  for (const void* q : pointers)
    if (q && !address_aligned(q, kVec * sizeof(T))) return false;
  if (a.shift) {
    if (!address_aligned(a.shift, kVec * sizeof(T)) || !address_aligned(a.scale, kVec * sizeof(T))) return false;
    if (a.shift_stride % kVec != 0 || a.scale_stride % kVec != 0) return false;
  }
  return true;
}

// One 128-thread block per row; vector accesses when every row the kernel
// touches is aligned to a 4-element vector (else scalar ones, the same values).
template <typename T, bool kGated>
Status launch_rmsnorm_forward(const RmsnormRowArgs& a, int64_t rows, std::initializer_list<const void*> pointers,
                              cudaStream_t stream, bool also_aligned = true) {
  const unsigned blocks = static_cast<unsigned>(rows);
  const bool vector = rows_vectorizable<T>(a, pointers) && also_aligned;
  if constexpr (kGated) {
    if (vector)
      gate_residual_rmsnorm_forward_kernel<T, true><<<blocks, kRowTreeThreads, 0, stream>>>(a);
    else
      gate_residual_rmsnorm_forward_kernel<T, false><<<blocks, kRowTreeThreads, 0, stream>>>(a);
    return launch_status("gate_residual_rmsnorm_forward_kernel");
  } else {
    if (vector)
      rmsnorm_forward_block_per_row_kernel<T, true><<<blocks, kRowTreeThreads, 0, stream>>>(a);
    else
      rmsnorm_forward_block_per_row_kernel<T, false><<<blocks, kRowTreeThreads, 0, stream>>>(a);
    return launch_status("rmsnorm_forward_block_per_row_kernel");
  }
}

template <typename T, bool kGated>
Status launch_rmsnorm_backward_rows(const RmsnormRowArgs& a, int64_t rows, std::initializer_list<const void*> pointers,
                                    cudaStream_t stream, bool also_aligned = true) {
  if (rows_vectorizable<T>(a, pointers) && also_aligned)
    rmsnorm_backward_rows_block_per_row_kernel<T, true, kGated>
        <<<static_cast<unsigned>(rows), kRowTreeThreads, 0, stream>>>(a);
  else
    rmsnorm_backward_rows_block_per_row_kernel<T, false, kGated>
        <<<static_cast<unsigned>(rows), kRowTreeThreads, 0, stream>>>(a);
  return launch_status(kGated ? "rmsnorm_backward_rows_block_per_row_kernel<gated>"
                              : "rmsnorm_backward_rows_block_per_row_kernel");
}

RmsnormRowArgs row_args(const TensorView& x, const TensorView& weight, const TensorView& shift,
                        const TensorView& scale, const IndexPlan& plan, float eps, Numerics numerics) {
  RmsnormRowArgs a{};
  a.x = x.data;
  a.weight = weight.data;
  a.hidden = hidden_of(x);
  a.eps = eps;
  a.torch = numerics == Numerics::kTorch;
  if (is_modulated(shift)) {
    a.shift = shift.data;
    a.scale = scale.data;
    a.shift_stride = shift.strides[0];
    a.scale_stride = scale.strides[0];
    a.row_of_seq = plan.device_tables().row_of_seq;
    a.seq_len = plan.seq_len();
  }
  return a;
}

}  // namespace

Status rmsnorm_forward(const RmsnormParams& p, Stream stream) {
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.in.x.device));
  RmsnormRowArgs a = row_args(p.in.x, p.in.weight, p.in.shift, p.in.scale, p.in.plan, p.in.eps, p.in.numerics);
  a.out = p.out.data;
  a.rstd = p.rstd.present() ? p.rstd.ptr<float>() : nullptr;
  const int64_t rows = p.in.x.numel() / a.hidden;
  if (rows == 0) return Status();
  cudaStream_t s = as_cuda_stream(stream);
  return dispatch_float_dtype(p.in.x.dtype, [&](auto tag) {
    return launch_rmsnorm_forward<decltype(tag), false>(a, rows, {a.x, a.weight, a.out}, s);
  });
}

Status gate_residual_rmsnorm_forward(const GateResidualRmsnormParams& p, Stream stream) {
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.h.device));
  const GateResidualRmsnormInputs& in = p.in;
  RmsnormRowArgs a = row_args(p.h, in.weight, in.shift, in.scale, in.plan, in.eps, in.numerics);
  a.x = nullptr;  // the kernel computes h
  a.residual = in.residual.data;
  a.y = in.y.data;
  a.gate = in.gate.data;
  a.gate_stride = in.gate.strides[0];
  a.row_of_seq = in.plan.device_tables().row_of_seq;
  a.seq_len = in.plan.seq_len();
  a.h = p.h.data;
  a.out = p.out.data;
  a.rstd = p.rstd.ptr<float>();
  const int64_t rows = p.h.numel() / a.hidden;
  if (rows == 0) return Status();
  return dispatch_float_dtype(p.h.dtype, [&](auto tag) {
    using T = decltype(tag);
    // the gate rows must allow vector loads too
    const bool gate_aligned = a.gate_stride % kVec == 0 && address_aligned(a.gate, kVec * sizeof(T));
    return launch_rmsnorm_forward<T, true>(a, rows, {a.residual, a.y, a.h, a.weight, a.out, gate_aligned ? a.gate : nullptr},
                                           as_cuda_stream(stream), gate_aligned);
  });
}

Status rmsnorm_backward_rows(const RmsnormBackwardParams& p, Stream stream) {
  if (!p.dx.present()) return Status();
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

Status gate_residual_rmsnorm_backward_rows(const GateResidualRmsnormBackwardParams& p, const TensorView& g,
                                           Stream stream) {
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.h.device));
  const GateResidualRmsnormInputs& in = p.in;
  RmsnormRowArgs a = row_args(p.h, in.weight, in.shift, in.scale, in.plan, in.eps, in.numerics);
  a.rstd = const_cast<float*>(p.rstd.ptr<const float>());
  a.grad = p.d_out.data;
  a.dx = g.data;
  a.d_h = p.d_h.present() ? p.d_h.data : nullptr;
  a.d_y = p.d_y.present() ? p.d_y.data : nullptr;
  a.gate = in.gate.data;
  a.gate_stride = in.gate.strides[0];
  a.row_of_seq = in.plan.device_tables().row_of_seq;
  a.seq_len = in.plan.seq_len();
  const int64_t rows = p.h.numel() / a.hidden;
  if (rows == 0) return Status();
  return dispatch_float_dtype(p.h.dtype, [&](auto tag) {
    using T = decltype(tag);
    // the gate rows must allow vector loads too
    const bool gate_aligned = !a.d_y || (a.gate_stride % kVec == 0 && address_aligned(a.gate, kVec * sizeof(T)));
    return launch_rmsnorm_backward_rows<T, true>(a, rows, {a.x, a.weight, a.grad, a.dx, a.d_h, a.d_y},
                                                 as_cuda_stream(stream), gate_aligned);
  });
}

Status rmsnorm_backward_partials(const RmsnormBackwardParams& p, const ChunkSelection& sel, const ExtraRows& extra,
                                 const TensorView& weight_partials, const TensorView& table_partials,
                                 Stream stream) {
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

Status gate_residual_rmsnorm_backward_walk(const GateResidualRmsnormBackwardParams& p, const TensorView& weight_partials,
                                           const TensorView& table_partials, const TensorView& gate_partials,
                                           Stream stream, bool* launched) {
  *launched = false;
  const GateResidualRmsnormInputs& in = p.in;
  if (!launch_tuning().region_backward_walk || !is_modulated(in.shift) || !in.plan.valid()) return Status();
  const int64_t hidden = hidden_of(p.h), positions = in.plan.positions();
  if (positions == 0 || hidden % kWalkColumns != 0) return Status();
  constexpr int kChains = 3;
  const std::size_t shared_bytes =
      static_cast<std::size_t>(in.plan.max_chunk_segments()) * kChains * kWalkColumns * kWalkThreads * sizeof(float);
  if (shared_bytes > kWalkSharedBytes) return Status();
  RegionWalkArgs a{};
  a.h = p.h.data;
  a.d_out = p.d_out.data;
  a.d_h = p.d_h.present() ? p.d_h.data : nullptr;
  a.y = gate_partials.present() ? in.y.data : nullptr;
  a.rstd = p.rstd.ptr<const float>();
  a.weight = in.weight.data;
  a.scale = in.scale.data;
  a.scale_stride = in.scale.strides[0];
  a.gate = in.gate.data;
  a.gate_stride = in.gate.strides[0];
  a.tables = in.plan.device_tables();
  a.positions = positions;
  a.hidden = hidden;
  a.seq_len = in.plan.seq_len();
  a.d_residual = p.d_residual.present() ? p.d_residual.data : nullptr;
  a.d_y = p.d_y.present() ? p.d_y.data : nullptr;
  if (weight_partials.present()) {
    a.weight_partials = weight_partials.ptr<float>();
    a.weight_partial_stride = weight_partials.strides[0];
  }
  if (table_partials.present()) {
    a.table_partials = table_partials.ptr<float>();
    a.table_partial_stride = table_partials.strides[0];
  }
  if (gate_partials.present()) {
    a.gate_partials = gate_partials.ptr<float>();
    a.gate_partial_stride = gate_partials.strides[0];
  }
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.h.device));
  DETDIT_RETURN_IF_ERROR(launch_gate_residual_rmsnorm_backward_row_walk(
      a, p.h.dtype, in.plan.num_chunks(), in.plan.max_chunk_segments(), p.h.device.index, stream, launched));
  if (*launched) return Status();
  return dispatch_float_dtype(p.h.dtype, [&](auto tag) -> Status {
    using T = decltype(tag);
    // Every row the kernels touch in whole vectors (the coefficient kernel's
    // tree vectors are the walk's column vectors), else the halves.
    static_assert(kWalkColumns == kVec, "one vector width for both kernels");
    const std::size_t bytes = kVec * sizeof(T);
    if (a.scale_stride % kVec != 0 || a.gate_stride % kVec != 0) return Status();
    for (const void* q : {a.h, a.d_out, a.d_h, a.y, a.weight, a.scale, a.gate, const_cast<const void*>(a.d_residual),
                          const_cast<const void*>(a.d_y)})
      if (q && !address_aligned(q, bytes)) return Status();
    std::shared_ptr<void> coef_owner;  // (P,) floats, stream-ordered: freed after the walk has read them
    DETDIT_RETURN_IF_ERROR(allocate_scratch(p.h.device, positions * sizeof(float), stream, &coef_owner));
    float* coef = static_cast<float*>(coef_owner.get());
    const cudaStream_t s = as_cuda_stream(stream);
    RmsnormRowArgs rows = row_args(p.h, in.weight, in.shift, in.scale, in.plan, in.eps, in.numerics);
    rows.rstd = const_cast<float*>(a.rstd);
    rows.grad = a.d_out;
    rows.coef = coef;
    rmsnorm_backward_rows_block_per_row_kernel<T, true, false, true>
        <<<static_cast<unsigned>(positions), kRowTreeThreads, 0, s>>>(rows);
    DETDIT_RETURN_IF_ERROR(launch_status("rmsnorm_backward_rows_block_per_row_kernel<coefficients>"));
    a.coef = coef;
    const auto kernel = gate_residual_rmsnorm_backward_walk_kernel<T, kWalkColumns>;
    if (shared_bytes + sizeof(int32_t) * kReductionChunk > 48 * 1024)  // above 48 KB a kernel must opt in
      DETDIT_RETURN_IF_ERROR(cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                              static_cast<int>(shared_bytes)),
                                         "cudaFuncSetAttribute"));
    const dim3 grid(static_cast<unsigned>(in.plan.num_chunks()), blocks_for(hidden, kWalkThreads * kWalkColumns));
    kernel<<<grid, kWalkThreads, shared_bytes, s>>>(a);
    DETDIT_RETURN_IF_ERROR(launch_status("gate_residual_rmsnorm_backward_walk_kernel"));
    *launched = true;
    return Status();
  });
}

}  // namespace cuda
}  // namespace detdit
