// The row kernels and host helpers the rmsnorm family of src/cuda/ shares:
// rmsnorm.cu (rmsnorm) and gate_residual_rmsnorm.cu (the fused region) both
// run the backward rows kernel (one 128-thread block per row, the row tree of
// row_tree.cuh; kGated: the fused region's rows, kCoefOnly: the column-block
// walk's row coefficients) and share the row arguments and their set-up.
// Private to those two files: each includes it once (anonymous namespace, so
// each compiles the kernels it launches).
#pragma once

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
#include "cuda/row_tree.cuh"

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

// kGated: the fused region's rows (numerics 6.10): dx is not stored but summed
// with d_h into g, stored in a.dx, and d_y = g * gate is stored beside it; one
// read of h, d_out and d_h instead of the halves' three kernels.
// kCoefOnly: the row tree's dot and the row's dx coefficient, stored to
// a.coef[m]; the output pass is left to a later kernel (the column-block walk of
// src/cuda/gate_residual_rmsnorm.cu).
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

bool is_modulated(const TensorView& shift) { return shift.present(); }
int64_t hidden_of(const TensorView& x) { return x.shape[x.rank - 1]; }

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
}  // namespace cuda
}  // namespace detdit
