// LayerNorm on CUDA (docs/numerics.md 9), bitwise equal to src/cpu/layernorm.cc
// in the portable profile; in the torch profile rsqrt is the hardware rsqrtf,
// which with PyTorch's tree makes the forward and dx PyTorch eager's.
//
// Forward: the row kernel of src/cuda/layernorm_rows.cuh with x read from
// memory (StoredRows), the kernel gate_residual_layernorm's forward runs with
// h computed instead.
// dx: one 128-thread block per row as the forward (thread t = lane + 32*warp,
// PyTorch's (32, 4) block flattened). Thread t owns the 4-element vectors t,
// t+128, ... in element order: the (s1, s2) dx sums; the warps reduce with
// shuffle-down trees and the 4 warp results meet in shared memory
// (src/common/layernorm_math.h holds each step).
// d_weight / d_bias (canonical reduction 6.5): one thread per (chunk, column)
// walks the chunk's positions ascending; src/layernorm.cc folds the partials
// with fold.cu.
// The modulation (numerics 9.5, 9.6): every kernel is a template over the
// recipe <T, M, upcast> (common/modulation_math.h; the plain norm runs with
// M = T, whose steps are the plain ones), reading position p's shift and
// scale row at modulation_offset. [d_shift | d_scale] partials: one thread
// per (group chunk, column) for the grouped forms (chunks counted from the
// group's first position), per (chunk, column) over the chunk's segments in
// plan order for the indexed form, as src/cuda/rmsnorm_forms.cu does.
// Bitwise equal to src/cpu/layernorm.cc in the portable profile.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/backends.h"
#include "common/layernorm_math.h"
#include "common/modulation_math.h"
#include "common/row_tree.h"
#include "common/rowwise_math.h"
#include "common/scalar_math.h"
#include "common/storage.h"
#include "cuda/cuda_util.cuh"
#include "cuda/layernorm_rows.cuh"
#include "cuda/profile_math.cuh"
#include "detdit/plan.h"
#include "rowwise/checks.h"

namespace detdit {
namespace cuda {
namespace {

// d_n of element i of position p from its gradient g: g (plain) or
// rn(g * R_Factor(1 + scale_i)).
template <typename M, typename Factor>
__device__ __forceinline__ float d_n_of(const LayernormArgs& a, int64_t p, int64_t i, float g) {
  if (a.scale.data == nullptr) return g;
  const M* scale = static_cast<const M*>(a.scale.data) + offset_of(a, a.scale, p);
  return rowwise::modulated_grad<Factor>(g, to_float(scale[i]));
}

// kVector: grad and dx rows aligned to a 4-element vector (x and weight always are).
template <typename T, typename M, bool kUpcast, bool kVector>
__global__ void __launch_bounds__(kRowTreeThreads) layernorm_backward_rows_kernel(LayernormArgs a) {
  using R = Recipe<T, M, kUpcast>;
  using Out = typename R::Out;
  __shared__ float warp_sums[2][kRowTreeWarps];
  const int64_t m = blockIdx.x;
  const int64_t vectors = a.hidden / kVec;
  const T* x = static_cast<const T*>(a.x) + m * a.hidden;  // (H,) row m
  const Out* g = static_cast<const Out*>(a.grad) + m * a.hidden;
  const float mean = a.mean[m], rstd = a.rstd[m];
  layernorm::DxSums s{0.0f, 0.0f};
  for (int64_t j = threadIdx.x; j < vectors; j += kRowTreeThreads) {
    float xv[kVec], gv[kVec], wv[kVec];
    load_elems<T, kVec, true>(x + j * kVec, xv);
    load_elems<Out, kVec, kVector>(g + j * kVec, gv);
    parameter_vec<T>(a.weight, j, 1.0f, wv);
#pragma unroll
    for (int e = 0; e < kVec; ++e)
      s = layernorm::dx_sums_step(s, d_n_of<M, typename R::Factor>(a, m, j * kVec + e, gv[e]), wv[e], xv[e], mean,
                                  rstd);
  }
  float s1 = s.s1, s2 = s.s2;
  for (int offset = 16; offset >= 1; offset /= 2) {
    s1 = num::add32(s1, __shfl_down_sync(kFullMask, s1, offset));
    s2 = num::add32(s2, __shfl_down_sync(kFullMask, s2, offset));
  }
  if (threadIdx.x % kWarpSize == 0) {
    warp_sums[0][threadIdx.x / kWarpSize] = s1;
    warp_sums[1][threadIdx.x / kWarpSize] = s2;
  }
  __syncthreads();
  const float sum1 = layernorm::block_sum_of_warps(warp_sums[0]);
  const float sum2 = layernorm::block_sum_of_warps(warp_sums[1]);
  const float term1 = layernorm::dx_term1(rstd, a.hidden);
  T* dx = static_cast<T*>(a.dx) + m * a.hidden;
  for (int64_t j = threadIdx.x; j < vectors; j += kRowTreeThreads) {
    float xv[kVec], gv[kVec], wv[kVec], o[kVec];
    load_elems<T, kVec, true>(x + j * kVec, xv);
    load_elems<Out, kVec, kVector>(g + j * kVec, gv);
    parameter_vec<T>(a.weight, j, 1.0f, wv);
#pragma unroll
    for (int e = 0; e < kVec; ++e)
      o[e] = layernorm::dx_value(d_n_of<M, typename R::Factor>(a, m, j * kVec + e, gv[e]), wv[e], xv[e], mean, rstd,
                                 sum1, sum2, term1, a.hidden);
    store_elems<T, kVec, kVector>(dx + j * kVec, o);
  }
}

constexpr int kPartialThreads = 128;

// Block b: chunk b / column_blocks, columns of block b % column_blocks; one
// thread per column, the chunk's positions ascending.
template <typename T, typename M, bool kUpcast>
__global__ void layernorm_backward_partials_kernel(LayernormArgs a, int64_t column_blocks) {
  using R = Recipe<T, M, kUpcast>;
  const int64_t chunk = blockIdx.x / column_blocks;
  const int64_t i = (blockIdx.x % column_blocks) * kPartialThreads + threadIdx.x;
  if (i >= a.hidden) return;
  const T* x = static_cast<const T*>(a.x);
  const typename R::Out* g = static_cast<const typename R::Out*>(a.grad);
  const int64_t begin = chunk * kReductionChunk;
  const int64_t end = begin + kReductionChunk < a.positions ? begin + kReductionChunk : a.positions;
  float wacc = 0.0f, bacc = 0.0f;
  for (int64_t p = begin; p < end; ++p) {
    const float d_n = d_n_of<M, typename R::Factor>(a, p, i, to_float(g[p * a.hidden + i]));
    if (a.weight_partials) wacc = layernorm::weight_grad_step(d_n, to_float(x[p * a.hidden + i]), a.mean[p], a.rstd[p], wacc);
    if (a.bias_partials) bacc = num::add32(bacc, d_n);
  }
  if (a.weight_partials) a.weight_partials[chunk * a.hidden + i] = wacc;
  if (a.bias_partials) a.bias_partials[chunk * a.hidden + i] = bacc;
}

// One position's [d_shift | d_scale] steps at column i: rn(acc + g) and
// fma(g, n, acc), n = R_Norm of the normalised value (the forward's n).
template <typename T, typename M, bool kUpcast>
__device__ __forceinline__ void table_step(const LayernormArgs& a, int64_t p, int64_t i, float& d_shift,
                                           float& d_scale) {
  using R = Recipe<T, M, kUpcast>;
  const int64_t h = a.hidden;
  const float g = to_float(static_cast<const typename R::Out*>(a.grad)[p * h + i]);
  const float w = a.weight ? to_float(static_cast<const T*>(a.weight)[i]) : 1.0f;
  const float b = a.bias ? to_float(static_cast<const T*>(a.bias)[i]) : 0.0f;
  const float v = layernorm::normalised(to_float(static_cast<const T*>(a.x)[p * h + i]), a.mean[p], a.rstd[p],
                                        a.weight != nullptr, w, a.bias != nullptr, b);
  d_shift = num::add32(d_shift, g);
  d_scale = rowwise::scale_grad_step(g, layernorm::modulation_input<typename R::Norm>(v), d_scale);
}

// Grouped forms: block (group chunk row = g*per_group + c, column block).
template <typename T, typename M, bool kUpcast>
__global__ void layernorm_group_partials_kernel(LayernormArgs a, int64_t column_blocks) {
  const int64_t row = blockIdx.x / column_blocks, h = a.hidden;
  const int64_t i = (blockIdx.x % column_blocks) * kPartialThreads + threadIdx.x;
  if (i >= h) return;
  const int64_t g = row / a.per_group, c = row % a.per_group;
  const int64_t begin = g * a.frame_len + c * kReductionChunk;
  const int64_t group_end = (g + 1) * a.frame_len;
  const int64_t end = begin + kReductionChunk < group_end ? begin + kReductionChunk : group_end;
  float d_shift = 0.0f, d_scale = 0.0f;
  for (int64_t p = begin; p < end; ++p) table_step<T, M, kUpcast>(a, p, i, d_shift, d_scale);
  a.table_partials[row * 2 * h + i] = d_shift;
  a.table_partials[row * 2 * h + h + i] = d_scale;
}

// The indexed form: block (chunk, column block), the chunk's segments in plan
// order (partial row = segment id), each segment's positions ascending.
template <typename T, typename M, bool kUpcast>
__global__ void layernorm_segment_partials_kernel(LayernormArgs a, int64_t column_blocks) {
  const int64_t c = blockIdx.x / column_blocks, h = a.hidden;
  const int64_t i = (blockIdx.x % column_blocks) * kPartialThreads + threadIdx.x;
  if (i >= h) return;
  for (int32_t seg = a.tables.chunk_segment_begin[c]; seg < a.tables.chunk_segment_begin[c + 1]; ++seg) {
    float d_shift = 0.0f, d_scale = 0.0f;
    for (int32_t q = a.tables.segment_pos_begin[seg]; q < a.tables.segment_pos_begin[seg + 1]; ++q)
      table_step<T, M, kUpcast>(a, a.tables.segment_positions[q], i, d_shift, d_scale);
    a.table_partials[seg * 2 * h + i] = d_shift;
    a.table_partials[seg * 2 * h + h + i] = d_scale;
  }
}

}  // namespace

Status layernorm_forward(const LayernormParams& p, Stream stream) {
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.in.x.device));
  LayernormArgs a = args_of(p.in);
  set_forward_outputs(p, &a);
  return dispatch_recipe(p.in.x.dtype, modulation_dtype(p.in), p.in.upcast, [&](auto t, auto m, auto up) {
    using T = decltype(t);
    using M = decltype(m);
    return dispatch_bool(modulation_vectorizable<M>(a), [&](auto vector) {
      return launch_layernorm_forward<StoredRows<T>, M, decltype(up)::value, decltype(vector)::value>(
          a, StoredRows<T>{static_cast<const T*>(a.x)}, as_cuda_stream(stream));
    });
  });
}

Status layernorm_backward_rows(const LayernormBackwardParams& p, Stream stream) {
  if (!p.dx.present()) return Status();
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.in.x.device));
  LayernormArgs a = args_of(p.in);
  a.mean = const_cast<float*>(p.mean.ptr<const float>());
  a.rstd = const_cast<float*>(p.rstd.ptr<const float>());
  a.grad = p.grad.data;
  a.dx = p.dx.data;
  if (a.positions == 0) return Status();
  return dispatch_recipe(p.in.x.dtype, modulation_dtype(p.in), p.in.upcast, [&](auto t, auto m, auto up) {
    using T = decltype(t);
    using M = decltype(m);
    constexpr bool kUp = decltype(up)::value;
    using Out = typename Recipe<T, M, kUp>::Out;
    const unsigned blocks = static_cast<unsigned>(a.positions);
    // H % 4 == 0, so every row of an aligned grad / dx is aligned too.
    if (address_aligned(a.grad, kVec * sizeof(Out)) && address_aligned(a.dx, kVec * sizeof(T)))
      layernorm_backward_rows_kernel<T, M, kUp, true><<<blocks, kRowTreeThreads, 0, as_cuda_stream(stream)>>>(a);
    else
      layernorm_backward_rows_kernel<T, M, kUp, false><<<blocks, kRowTreeThreads, 0, as_cuda_stream(stream)>>>(a);
    return launch_status("layernorm_backward_rows_kernel");
  });
}

Status layernorm_backward_partials(const LayernormBackwardParams& p, const LayernormPartials& partials,
                                   Stream stream) {
  const bool params = partials.weight.present() || partials.bias.present();
  const bool tables = partials.table.present() && p.in.shift.present();
  if (!params && !tables) return Status();
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.in.x.device));
  LayernormArgs a = args_of(p.in);
  a.mean = const_cast<float*>(p.mean.ptr<const float>());
  a.rstd = const_cast<float*>(p.rstd.ptr<const float>());
  a.grad = p.grad.data;
  a.weight_partials = partials.weight.present() ? partials.weight.ptr<float>() : nullptr;
  a.bias_partials = partials.bias.present() ? partials.bias.ptr<float>() : nullptr;
  a.table_partials = tables ? partials.table.ptr<float>() : nullptr;
  const int64_t chunks = (a.positions + kReductionChunk - 1) / kReductionChunk;
  const int64_t column_blocks = blocks_for(a.hidden, kPartialThreads);
  if (chunks == 0) return Status();
  const cudaStream_t s = as_cuda_stream(stream);
  // tables: a grouped form (G*Cg partial rows) or the indexed form.
  const bool grouped = a.form != ModulationForm::kIndexed;
  const int64_t group_rows = grouped ? rowwise::layernorm_modulation(p.in).groups() * a.per_group : 0;
  dispatch_recipe(p.in.x.dtype, modulation_dtype(p.in), p.in.upcast, [&](auto t, auto m, auto up) {
    using T = decltype(t);
    using M = decltype(m);
    constexpr bool kUp = decltype(up)::value;
    if (params)
      layernorm_backward_partials_kernel<T, M, kUp>
          <<<static_cast<unsigned>(chunks * column_blocks), kPartialThreads, 0, s>>>(a, column_blocks);
    if (tables && grouped && group_rows > 0)
      layernorm_group_partials_kernel<T, M, kUp>
          <<<static_cast<unsigned>(group_rows * column_blocks), kPartialThreads, 0, s>>>(a, column_blocks);
    else if (tables && !grouped)
      layernorm_segment_partials_kernel<T, M, kUp>
          <<<static_cast<unsigned>(chunks * column_blocks), kPartialThreads, 0, s>>>(a, column_blocks);
  });
  return launch_status("layernorm partials kernels");
}

}  // namespace cuda
}  // namespace detdit
