// gate_residual_rmsnorm on CUDA (numerics 6.10 with 5.6, 5.7, 6.5 and 7),
// bitwise equal to src/cpu/gate_residual_rmsnorm.cc; kernels, then their
// launchers, then the backend entry points:
//   forward: one 128-thread block per row computes h = R_T(rn(residual +
//            R_T(rn(gate[r] * y)))), stores it and normalises it (the row
//            tree of row_tree.cuh, as rmsnorm's forward);
//   backward rows (the halves): rmsnorm's backward rows kernel in its gated
//            form (src/cuda/rmsnorm_rows.cuh): g and d_y from one read of h,
//            d_out and d_h;
//   backward walk: the row walk (src/cuda/gate_residual_rmsnorm_row_walk.cu),
//            else the column-block walk below, where each applies; the rule
//            that picks the backward's path is at the top of
//            src/gate_residual_rmsnorm.cc.
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <memory>

#include "common/backends.h"
#include "common/row_tree.h"
#include "common/rowwise_math.h"
#include "common/scalar_math.h"
#include "common/storage.h"
#include "cuda/cuda_util.cuh"
#include "cuda/gate_residual_rmsnorm_walk.cuh"
#include "cuda/reduction.cuh"
#include "cuda/rmsnorm_rows.cuh"
#include "cuda/row_tree.cuh"
#include "cuda/tuning.h"

namespace detdit {
namespace cuda {
namespace {

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

// One 128-thread block per row; vector accesses when every row the kernel
// touches is aligned to a 4-element vector (else scalar ones, the same values).
template <typename T>
Status launch_gate_residual_rmsnorm_forward(const RmsnormRowArgs& a, int64_t rows,
                                            std::initializer_list<const void*> pointers, cudaStream_t stream,
                                            bool also_aligned) {
  const unsigned blocks = static_cast<unsigned>(rows);
  const bool vector = rows_vectorizable<T>(a, pointers) && also_aligned;
  if (vector)
    gate_residual_rmsnorm_forward_kernel<T, true><<<blocks, kRowTreeThreads, 0, stream>>>(a);
  else
    gate_residual_rmsnorm_forward_kernel<T, false><<<blocks, kRowTreeThreads, 0, stream>>>(a);
  return launch_status("gate_residual_rmsnorm_forward_kernel");
}

}  // namespace

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
    return launch_gate_residual_rmsnorm_forward<T>(
        a, rows, {a.residual, a.y, a.h, a.weight, a.out, gate_aligned ? a.gate : nullptr}, as_cuda_stream(stream),
        gate_aligned);
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
