// rmsnorm on CUDA for the modulation forms and recipes (numerics 5.12, 6.11;
// contract in src/cuda/rmsnorm_forms.h), bitwise equal to src/cpu/rmsnorm.cc:
// templates over the recipe <T, M, upcast> (common/modulation_math.h), each
// position's shift and scale row from modulation_offset.
//   forward, dx: one 128-thread block per row; thread t sums its 4-element
//     vectors t, t+128, ... with fma from +0.0 in element order, then the row
//     tree of row_tree.cuh (numerics 7), as src/cuda/rmsnorm.cu does; the
//     output pass is elementwise.
//   partials: one thread per (chunk, column) for d_weight (chunks of the
//     flattened positions); per (segment chunk, column) for [d_shift |
//     d_scale] of the indexed form (segments in plan order) and per (group
//     chunk, column) for the grouped forms (chunks counted from the group's
//     first position); each chain ascending. The folds are fold.cu's.
#include "cuda/rmsnorm_forms.h"

#include <cuda_runtime.h>

#include <cstdint>

#include "common/backends.h"
#include "common/modulation_math.h"
#include "common/rowwise_math.h"
#include "common/scalar_math.h"
#include "common/storage.h"
#include "cuda/cuda_util.cuh"
#include "cuda/rmsnorm_rows.cuh"
#include "cuda/row_tree.cuh"
#include "cuda/tuning.h"
#include "rowwise/checks.h"

namespace detdit {
namespace cuda {
namespace {

struct FormArgs {
  RmsnormRowArgs row;  // x, weight, hidden, eps, torch, rstd, out, grad, dx (no table)
  ModulationOperand shift, scale;  // data null: plain
  ModulationForm form;
  const int32_t* row_of_seq;  // indexed form
  int64_t seq_len, frame_len;
  // partials
  PlanTables tables;
  int64_t positions, per_group;
  float* weight_partials;
  int64_t weight_partial_stride;
  float* table_partials;  // [d_shift | d_scale], row stride table_partial_stride
  int64_t table_partial_stride;
};

__device__ __forceinline__ int64_t offset_of(const FormArgs& a, const ModulationOperand& m, int64_t p) {
  return modulation_offset(m, a.form, a.seq_len, a.frame_len, a.row_of_seq, p);
}

// d_n_i of position p: g_i, or rn(g_i * R_Factor(1 + scale_i)).
template <typename T, typename M, bool kUpcast>
__device__ __forceinline__ float d_n_at(const FormArgs& a, int64_t p, int64_t i) {
  using R = Recipe<T, M, kUpcast>;
  const float g = to_float(static_cast<const typename R::Out*>(a.row.grad)[p * a.row.hidden + i]);
  if (a.scale.data == nullptr) return g;
  const float sc = to_float(static_cast<const M*>(a.scale.data)[offset_of(a, a.scale, p) + i]);
  return rowwise::modulated_grad<typename R::Factor>(g, sc);
}

template <typename T, typename M, bool kUpcast>
__global__ void __launch_bounds__(kRowTreeThreads) rmsnorm_forward_form_kernel(FormArgs a) {
  using R = Recipe<T, M, kUpcast>;
  __shared__ float warp_sums[kRowTreeWarps];
  const int64_t m = blockIdx.x, h = a.row.hidden;
  const T* x = static_cast<const T*>(a.row.x) + m * h;
  const T* w = static_cast<const T*>(a.row.weight);
  float s = 0.0f;
  for (int64_t j = threadIdx.x; j < h / kVec; j += kRowTreeThreads) {
    float v[kVec];
    load_elems<T, kVec, false>(x + j * kVec, v);
#pragma unroll
    for (int e = 0; e < kVec; ++e) s = num::fma32(v[e], v[e], s);
  }
  const float rstd = row_rstd(a.row, m, s, warp_sums);
  const bool modulated = a.shift.data != nullptr;
  const M* shift = modulated ? static_cast<const M*>(a.shift.data) + offset_of(a, a.shift, m) : nullptr;
  const M* scale = modulated ? static_cast<const M*>(a.scale.data) + offset_of(a, a.scale, m) : nullptr;
  typename R::Out* out = static_cast<typename R::Out*>(a.row.out) + m * h;
  for (int64_t i = threadIdx.x; i < h; i += kRowTreeThreads) {
    const float n = rowwise::normalised<typename R::Norm>(to_float(w[i]), rstd, to_float(x[i]));
    const float o = modulated ? rowwise::modulated<typename R::Mid, typename R::Factor>(n, to_float(scale[i]),
                                                                                        to_float(shift[i]))
                              : n;
    out[i] = from_float<typename R::Out>(o);
  }
}

template <typename T, typename M, bool kUpcast>
__global__ void __launch_bounds__(kRowTreeThreads) rmsnorm_backward_rows_form_kernel(FormArgs a) {
  __shared__ float warp_sums[kRowTreeWarps];
  const int64_t m = blockIdx.x, h = a.row.hidden;
  const T* x = static_cast<const T*>(a.row.x) + m * h;
  const T* w = static_cast<const T*>(a.row.weight);
  const float rstd = a.row.rstd[m];
  float s = 0.0f;
  for (int64_t j = threadIdx.x; j < h / kVec; j += kRowTreeThreads) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const int64_t i = j * kVec + e;
      s = num::fma32(rowwise::dot_term(to_float(w[i]), d_n_at<T, M, kUpcast>(a, m, i)), to_float(x[i]), s);
    }
  }
  const float dot = row_tree_block_sum(s, warp_sums);
  const float coef = rowwise::dx_coefficient(rstd, dot, h);
  T* dx = static_cast<T*>(a.row.dx) + m * h;
  for (int64_t i = threadIdx.x; i < h; i += kRowTreeThreads)
    dx[i] = from_float<T>(
        rowwise::dx_value(rstd, to_float(w[i]), d_n_at<T, M, kUpcast>(a, m, i), to_float(x[i]), coef));
}

// d_weight: grid (chunk, column block), the chunk's positions ascending.
template <typename T, typename M, bool kUpcast>
__global__ void rmsnorm_weight_partials_form_kernel(FormArgs a) {
  const int64_t c = blockIdx.x, h = a.row.hidden;
  const int64_t col = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (col >= h) return;
  const int64_t end = (c + 1) * kReductionChunk < a.positions ? (c + 1) * kReductionChunk : a.positions;
  float acc = 0.0f;
  for (int64_t p = c * kReductionChunk; p < end; ++p)
    acc = rowwise::weight_grad_step(d_n_at<T, M, kUpcast>(a, p, col),
                                    to_float(static_cast<const T*>(a.row.x)[p * h + col]), a.row.rstd[p], acc);
  a.weight_partials[c * a.weight_partial_stride + col] = acc;
}

// One position's [d_shift | d_scale] steps at column col.
template <typename T, typename M, bool kUpcast>
__device__ __forceinline__ void table_step(const FormArgs& a, int64_t p, int64_t col, float& d_shift,
                                           float& d_scale) {
  using R = Recipe<T, M, kUpcast>;
  const int64_t h = a.row.hidden;
  const float g = to_float(static_cast<const typename R::Out*>(a.row.grad)[p * h + col]);
  const float n = rowwise::normalised<typename R::Norm>(to_float(static_cast<const T*>(a.row.weight)[col]),
                                                        a.row.rstd[p], to_float(static_cast<const T*>(a.row.x)[p * h + col]));
  d_shift = num::add32(d_shift, g);
  d_scale = rowwise::scale_grad_step(g, n, d_scale);
}

// Grouped forms: grid (group chunk row = g*per_group + c, column block).
template <typename T, typename M, bool kUpcast>
__global__ void rmsnorm_group_partials_form_kernel(FormArgs a) {
  const int64_t row = blockIdx.x, h = a.row.hidden;
  const int64_t col = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (col >= h) return;
  const int64_t g = row / a.per_group, c = row % a.per_group;
  const int64_t begin = g * a.frame_len + c * kReductionChunk;
  const int64_t group_end = (g + 1) * a.frame_len;
  const int64_t end = begin + kReductionChunk < group_end ? begin + kReductionChunk : group_end;
  float d_shift = 0.0f, d_scale = 0.0f;
  for (int64_t p = begin; p < end; ++p) table_step<T, M, kUpcast>(a, p, col, d_shift, d_scale);
  a.table_partials[row * a.table_partial_stride + col] = d_shift;
  a.table_partials[row * a.table_partial_stride + h + col] = d_scale;
}

// The indexed form: grid (chunk, column block), the chunk's segments in plan
// order (partial row = segment id), each segment's positions ascending.
template <typename T, typename M, bool kUpcast>
__global__ void rmsnorm_segment_partials_form_kernel(FormArgs a) {
  const int64_t c = blockIdx.x, h = a.row.hidden;
  const int64_t col = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (col >= h) return;
  for (int32_t seg = a.tables.chunk_segment_begin[c]; seg < a.tables.chunk_segment_begin[c + 1]; ++seg) {
    float d_shift = 0.0f, d_scale = 0.0f;
    for (int32_t q = a.tables.segment_pos_begin[seg]; q < a.tables.segment_pos_begin[seg + 1]; ++q)
      table_step<T, M, kUpcast>(a, a.tables.segment_positions[q], col, d_shift, d_scale);
    a.table_partials[seg * a.table_partial_stride + col] = d_shift;
    a.table_partials[seg * a.table_partial_stride + h + col] = d_scale;
  }
}

FormArgs form_args(const RmsnormInputs& in, const ResolvedModulation& mod) {
  FormArgs a{};
  a.row = row_args(in.x, in.weight, TensorView(), TensorView(), in.plan, in.eps, in.numerics);
  a.shift = modulation_operand(in.shift, mod);
  a.scale = modulation_operand(in.scale, mod);
  a.form = mod.form;
  a.row_of_seq = mod.form == ModulationForm::kIndexed ? in.plan.device_tables().row_of_seq : nullptr;
  a.seq_len = mod.seq_len;
  a.frame_len = mod.frame_len;
  return a;
}

}  // namespace

bool rmsnorm_h3_rule(const RmsnormInputs& in, const ResolvedModulation& mod) {
  return (mod.form == ModulationForm::kNone || mod.form == ModulationForm::kIndexed) && mod.dtype == in.x.dtype &&
         !in.upcast;
}

Status rmsnorm_forms_forward(const RmsnormParams& p, Stream stream) {
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.in.x.device));
  FormArgs a = form_args(p.in, rowwise::rmsnorm_modulation(p.in));
  a.row.out = p.out.data;
  a.row.rstd = p.rstd.present() ? p.rstd.ptr<float>() : nullptr;
  const int64_t rows = p.in.x.numel() / a.row.hidden;
  if (rows == 0) return Status();
  const cudaStream_t s = as_cuda_stream(stream);
  dispatch_recipe(p.in.x.dtype, modulation_dtype(p.in), p.in.upcast, [&](auto t, auto m, auto up) {
    rmsnorm_forward_form_kernel<decltype(t), decltype(m), decltype(up)::value>
        <<<static_cast<unsigned>(rows), kRowTreeThreads, 0, s>>>(a);
  });
  return launch_status("rmsnorm_forward_form_kernel");
}

Status rmsnorm_forms_backward_rows(const RmsnormBackwardParams& p, Stream stream) {
  if (!p.dx.present()) return Status();
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.in.x.device));
  FormArgs a = form_args(p.in, rowwise::rmsnorm_modulation(p.in));
  a.row.rstd = const_cast<float*>(p.rstd.ptr<const float>());
  a.row.grad = p.grad.data;
  a.row.dx = p.dx.data;
  const int64_t rows = p.in.x.numel() / a.row.hidden;
  if (rows == 0) return Status();
  const cudaStream_t s = as_cuda_stream(stream);
  dispatch_recipe(p.in.x.dtype, modulation_dtype(p.in), p.in.upcast, [&](auto t, auto m, auto up) {
    rmsnorm_backward_rows_form_kernel<decltype(t), decltype(m), decltype(up)::value>
        <<<static_cast<unsigned>(rows), kRowTreeThreads, 0, s>>>(a);
  });
  return launch_status("rmsnorm_backward_rows_form_kernel");
}

Status rmsnorm_forms_backward_partials(const RmsnormBackwardParams& p, const TensorView& weight_partials,
                                       const TensorView& table_partials, Stream stream) {
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.in.x.device));
  const ResolvedModulation mod = rowwise::rmsnorm_modulation(p.in);
  FormArgs a = form_args(p.in, mod);
  a.row.rstd = const_cast<float*>(p.rstd.ptr<const float>());
  a.row.grad = p.grad.data;
  const int64_t h = a.row.hidden;
  a.positions = p.in.plan.valid() ? p.in.plan.positions() : p.in.x.numel() / h;
  if (p.in.plan.valid()) a.tables = p.in.plan.device_tables();
  a.per_group = mod.grouped() ? (mod.frame_len + kReductionChunk - 1) / kReductionChunk : 0;
  constexpr int kThreads = 128;
  const unsigned column_blocks = blocks_for(h, kThreads);
  const cudaStream_t s = as_cuda_stream(stream);
  const bool tables = a.shift.data != nullptr && table_partials.present();
  if (weight_partials.present()) {
    a.weight_partials = weight_partials.ptr<float>();
    a.weight_partial_stride = weight_partials.strides[0];
  }
  if (tables) {
    a.table_partials = table_partials.ptr<float>();
    a.table_partial_stride = table_partials.strides[0];
  }
  const int64_t chunks = (a.positions + kReductionChunk - 1) / kReductionChunk;
  if (h == 0 || chunks == 0) return Status();
  dispatch_recipe(p.in.x.dtype, modulation_dtype(p.in), p.in.upcast, [&](auto t, auto m, auto up) {
    using T = decltype(t);
    using M = decltype(m);
    constexpr bool kUp = decltype(up)::value;
    if (weight_partials.present())
      rmsnorm_weight_partials_form_kernel<T, M, kUp><<<dim3(static_cast<unsigned>(chunks), column_blocks), kThreads, 0, s>>>(a);
    if (tables && mod.grouped())
      rmsnorm_group_partials_form_kernel<T, M, kUp>
          <<<dim3(static_cast<unsigned>(mod.groups() * a.per_group), column_blocks), kThreads, 0, s>>>(a);
    else if (tables)
      rmsnorm_segment_partials_form_kernel<T, M, kUp>
          <<<dim3(static_cast<unsigned>(chunks), column_blocks), kThreads, 0, s>>>(a);
  });
  return launch_status("rmsnorm partials form kernels");
}

}  // namespace cuda
}  // namespace detdit
