// gate_residual on CUDA (numerics 5.7, 6.8), bitwise equal to src/cpu/gate_residual.cc:
//   forward:  out = R_T(rn(res + R_T(rn(gate[r] * y)))), r = row_of_seq[m % S];
//             elementwise in the widest vector (16, 8, 4 or 2 bytes) that H,
//             gate's row stride and every pointer allow;
//   backward: d_residual = grad (a copy); d_y = R_T(rn(grad * gate[r]));
//             d_gate = canonical reduction of fma(grad, y, acc): segment
//             partials (grid (selected chunk, column block), each segment's
//             positions ascending) then fold_segment_partials.
// The modulation forms and recipes (numerics 5.12, 6.11): the H3 rule (the
// indexed gate in the rows' dtype, upcast = false, no k) runs the vector
// kernels above; every other call runs the generic rows kernels (one element
// per thread, templates over the recipe <T, M, upcast>, the form's row from
// modulation_offset), and the grouped forms' d_gate partials run one thread
// per (group chunk, column), chunks counted from the group's first position,
// then fold_group_partials.
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "common/backends.h"
#include "common/modulation_math.h"
#include "common/rowwise_math.h"
#include "common/scalar_math.h"
#include "common/storage.h"
#include "cuda/cuda_util.cuh"
#include "cuda/reduction.cuh"
#include "cuda/tuning.h"
#include "rowwise/checks.h"

namespace detdit {
namespace cuda {
namespace {

struct GateRowArgs {
  const void* a;         // forward: residual; backward: grad   (M, H)
  const void* b;         // forward: y                          (M, H)
  const void* gate;      // (R, H), row stride gate_stride
  int64_t gate_stride;
  const int32_t* row_of_seq;  // (S,)
  int64_t seq_len, hidden, elements;
  void* out;             // forward: out; backward: d_y          (M, H)
  void* copy;            // backward: d_residual or nullptr      (M, H)
};

template <typename T, int kElems>
__global__ void gate_residual_forward_kernel(GateRowArgs a) {
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kElems;  // flat (m, h)
  if (i >= a.elements) return;
  const int64_t m = i / a.hidden, h = i % a.hidden;
  const T* gate = static_cast<const T*>(a.gate) + rowwise::table_row(a.row_of_seq, m, a.seq_len) * a.gate_stride + h;
  float res[kElems], y[kElems], g[kElems], o[kElems];
  load_vec<T, kElems>(static_cast<const T*>(a.a) + i, res);
  load_vec<T, kElems>(static_cast<const T*>(a.b) + i, y);
  load_vec<T, kElems>(gate, g);
#pragma unroll
  for (int e = 0; e < kElems; ++e) o[e] = rowwise::gated_sum<T>(res[e], g[e], y[e]);
  store_vec<T, kElems>(static_cast<T*>(a.out) + i, o);
}

template <typename T, int kElems>
__global__ void gate_residual_backward_rows_kernel(GateRowArgs a) {
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kElems;  // flat (m, h)
  if (i >= a.elements) return;
  const int64_t m = i / a.hidden, h = i % a.hidden;
  float grad[kElems];
  load_vec<T, kElems>(static_cast<const T*>(a.a) + i, grad);
  if (a.copy) store_vec<T, kElems>(static_cast<T*>(a.copy) + i, grad);  // exact: grad is already T
  if (a.out) {
    const T* gate =
        static_cast<const T*>(a.gate) + rowwise::table_row(a.row_of_seq, m, a.seq_len) * a.gate_stride + h;
    float g[kElems], d_y[kElems];
    load_vec<T, kElems>(gate, g);
#pragma unroll
    for (int e = 0; e < kElems; ++e) d_y[e] = rowwise::gated_grad(grad[e], g[e]);
    store_vec<T, kElems>(static_cast<T*>(a.out) + i, d_y);
  }
}

// Elements per access: the widest (<= the tunable) that divides H and gate's
// row stride and to which every pointer is aligned.
template <typename T>
int elements_per_access(const GateRowArgs& a) {
  for (int bytes = launch_tuning().vector_bytes; bytes > static_cast<int>(sizeof(T)); bytes /= 2) {
    const int elems = bytes / static_cast<int>(sizeof(T));
    bool ok = a.hidden % elems == 0 && a.gate_stride % elems == 0;
    for (const void* q : std::initializer_list<const void*>{a.a, a.b, a.gate, a.out, a.copy})
      if (q && !address_aligned(q, bytes)) ok = false;
    if (ok) return elems;
  }
  return 1;
}

template <typename T, bool kForward>
Status launch_gate_residual_rows(const GateRowArgs& a, cudaStream_t stream) {
  if (a.elements == 0) return Status();
  const int threads = launch_tuning().elementwise_threads;
  const int elems = elements_per_access<T>(a);
  const unsigned blocks = blocks_for(a.elements / elems, threads);
  auto launch = [&](auto width) {
    constexpr int kElems = decltype(width)::value;
    if constexpr (kElems * sizeof(T) <= 16) {  // wider is never chosen
      if (kForward)
        gate_residual_forward_kernel<T, kElems><<<blocks, threads, 0, stream>>>(a);
      else
        gate_residual_backward_rows_kernel<T, kElems><<<blocks, threads, 0, stream>>>(a);
    }
  };
  switch (elems) {
    case 8: launch(std::integral_constant<int, 8>{}); break;
    case 4: launch(std::integral_constant<int, 4>{}); break;
    case 2: launch(std::integral_constant<int, 2>{}); break;
    default: launch(std::integral_constant<int, 1>{}); break;
  }
  return launch_status(kForward ? "gate_residual_forward_kernel" : "gate_residual_backward_rows_kernel");
}

struct GatePartialArgs {
  const void* grad;        // own rows (rows, H), row stride grad_stride
  const void* y;           // own rows, row stride y_stride
  const void* extra_grad;  // received rows (ExtraRows), or nullptr
  const void* extra_y;
  int64_t grad_stride, y_stride, extra_grad_stride, extra_y_stride, hidden;
  PlanTables tables;
  const int32_t* chunks;        // (selected,) or nullptr: every chunk
  const int32_t* position_row;  // (P,) or nullptr
  float* partials;              // (segments of the selection, H), row stride partial_stride
  int64_t partial_stride;
};

// grid (selected chunk k, column block); thread owns columns [i0, i0 + kCols).
// G: grad's storage type (the recipe's Out; T for the H3 rule).
template <typename T, typename G, int kCols>
__global__ void gate_residual_backward_partials_kernel(GatePartialArgs a) {
  __shared__ int warp_counts[32];
  const int64_t k = blockIdx.x;
  const int64_t chunk = a.chunks ? a.chunks[k] : k;
  const int64_t segment_out = selected_segment_offset(a.tables, a.chunks, k, chunk, warp_counts);
  const int64_t i0 = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * kCols;
  if (i0 >= a.hidden) return;
  const int32_t first = a.tables.chunk_segment_begin[chunk], last = a.tables.chunk_segment_begin[chunk + 1];
  for (int32_t g = first; g < last; ++g) {
    float acc[kCols];
#pragma unroll
    for (int e = 0; e < kCols; ++e) acc[e] = 0.0f;
    for (int32_t q = a.tables.segment_pos_begin[g]; q < a.tables.segment_pos_begin[g + 1]; ++q) {
      const int64_t r = data_row(a.position_row, a.tables.segment_positions[q]);
      const G* grad = r >= 0 ? static_cast<const G*>(a.grad) + r * a.grad_stride
                             : static_cast<const G*>(a.extra_grad) + (-1 - r) * a.extra_grad_stride;
      const T* y = r >= 0 ? static_cast<const T*>(a.y) + r * a.y_stride
                          : static_cast<const T*>(a.extra_y) + (-1 - r) * a.extra_y_stride;
      float gv[kCols], yv[kCols];
      load_elems<G, kCols, false>(grad + i0, gv);
      load_elems<T, kCols, false>(y + i0, yv);
#pragma unroll
      for (int e = 0; e < kCols; ++e) acc[e] = rowwise::gate_grad_step(gv[e], yv[e], acc[e]);
    }
    float* dst = a.partials + (segment_out + (g - first)) * a.partial_stride + i0;  // (H,)
#pragma unroll
    for (int e = 0; e < kCols; ++e) dst[e] = acc[e];
  }
}

template <typename T, typename G>
Status launch_gate_residual_partials(const GatePartialArgs& a, int64_t selected, cudaStream_t stream) {
  constexpr int kThreads = 128;
  if (selected == 0 || a.hidden == 0) return Status();
  // kCols must divide H (rows are not padded): fall back to fewer columns.
  int cols = launch_tuning().partial_columns_per_thread;
  while (cols > 1 && a.hidden % cols != 0) cols /= 2;
  const dim3 grid(static_cast<unsigned>(selected), blocks_for(a.hidden, kThreads * cols));
  switch (cols) {
    case 4: gate_residual_backward_partials_kernel<T, G, 4><<<grid, kThreads, 0, stream>>>(a); break;
    case 2: gate_residual_backward_partials_kernel<T, G, 2><<<grid, kThreads, 0, stream>>>(a); break;
    default: gate_residual_backward_partials_kernel<T, G, 1><<<grid, kThreads, 0, stream>>>(a); break;
  }
  return launch_status("gate_residual_backward_partials_kernel");
}

int64_t hidden_of(const TensorView& t) { return t.shape[t.rank - 1]; }

// ---- the modulation forms and recipes (numerics 5.12, 6.11) ----------------------

// The H3 rule: the vector kernels above.
bool h3_rule(const GateResidualInputs& in, const ResolvedModulation& mod) {
  return mod.form == ModulationForm::kIndexed && mod.dtype == in.y.dtype && !in.upcast && !in.has_k;
}

struct GateFormArgs {
  const void* a;  // forward: residual; backward: grad (the recipe's Out type)   (M, H)
  const void* b;  // forward: y                                                   (M, H)
  ModulationOperand gate;  // data null: no gate
  ModulationForm form;
  const int32_t* row_of_seq;  // indexed form
  int64_t seq_len, frame_len, hidden, elements;
  bool has_k;
  float k;
  void* out;   // forward: out (Out); backward: d_y (T) or nullptr
  void* copy;  // backward: d_residual (T) or nullptr
};

// The gate term of element h of position m: gate, or R_Factor(rn(k + gate)).
template <typename Factor, typename M>
__device__ __forceinline__ float gate_term_at(const GateFormArgs& a, int64_t m, int64_t h) {
  const int64_t row = modulation_offset(a.gate, a.form, a.seq_len, a.frame_len, a.row_of_seq, m);
  const float g = to_float(static_cast<const M*>(a.gate.data)[row + h]);
  return a.has_k ? rowwise::gate_with_constant<Factor>(a.k, g) : g;
}

template <typename T, typename M, bool kUpcast>
__global__ void gate_residual_forward_form_kernel(GateFormArgs a) {
  using R = Recipe<T, M, kUpcast>;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // flat (m, h)
  if (i >= a.elements) return;
  const int64_t m = i / a.hidden, h = i % a.hidden;
  const float res = to_float(static_cast<const T*>(a.a)[i]), y = to_float(static_cast<const T*>(a.b)[i]);
  const float o = a.gate.data != nullptr
                      ? rowwise::gated_sum<typename R::Mid>(res, gate_term_at<typename R::Factor, M>(a, m, h), y)
                      : num::add32(res, y);
  static_cast<typename R::Out*>(a.out)[i] = from_float<typename R::Out>(o);
}

template <typename T, typename M, bool kUpcast>
__global__ void gate_residual_backward_rows_form_kernel(GateFormArgs a) {
  using R = Recipe<T, M, kUpcast>;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // flat (m, h)
  if (i >= a.elements) return;
  const int64_t m = i / a.hidden, h = i % a.hidden;
  const float g = to_float(static_cast<const typename R::Out*>(a.a)[i]);
  if (a.copy) static_cast<T*>(a.copy)[i] = from_float<T>(g);  // d_residual = R_T(grad)
  if (a.out) {
    const float d_y =
        a.gate.data != nullptr ? rowwise::gated_grad(g, gate_term_at<typename R::Factor, M>(a, m, h)) : g;
    static_cast<T*>(a.out)[i] = from_float<T>(d_y);
  }
}

GateFormArgs form_args(const GateResidualInputs& in, const ResolvedModulation& mod, const void* a, const void* b,
                       int64_t elements, void* out, void* copy) {
  GateFormArgs f{};
  f.a = a;
  f.b = b;
  f.gate = modulation_operand(in.gate, mod);
  f.form = mod.form;
  f.row_of_seq = mod.form == ModulationForm::kIndexed ? in.plan.device_tables().row_of_seq : nullptr;
  f.seq_len = mod.seq_len;
  f.frame_len = mod.frame_len;
  f.hidden = hidden_of(in.y);
  f.elements = elements;
  f.has_k = in.has_k;
  f.k = in.k;
  f.out = out;
  f.copy = copy;
  return f;
}

template <bool kForward>
Status launch_form_rows(const GateResidualInputs& in, const ResolvedModulation& mod, const GateFormArgs& f,
                        cudaStream_t stream) {
  if (f.elements == 0) return Status();
  const int threads = launch_tuning().elementwise_threads;
  const unsigned blocks = blocks_for(f.elements, threads);
  dispatch_recipe(in.y.dtype, mod.dtype, in.upcast, [&](auto t, auto m, auto up) {
    using T = decltype(t);
    using M = decltype(m);
    if (kForward)
      gate_residual_forward_form_kernel<T, M, decltype(up)::value><<<blocks, threads, 0, stream>>>(f);
    else
      gate_residual_backward_rows_form_kernel<T, M, decltype(up)::value><<<blocks, threads, 0, stream>>>(f);
  });
  return launch_status(kForward ? "gate_residual_forward_form_kernel" : "gate_residual_backward_rows_form_kernel");
}

// d_gate partials of a grouped form: grid (group chunk row = g*per_group + c,
// column block); positions [g*L + 256c, min(g*L + 256(c + 1), (g + 1)*L)) ascending.
template <typename T, typename G>
__global__ void gate_residual_group_partials_kernel(const G* grad, const T* y, int64_t hidden, int64_t len,
                                                    int64_t per_group, float* partials, int64_t partial_stride) {
  const int64_t row = blockIdx.x;
  const int64_t col = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (col >= hidden) return;
  const int64_t g = row / per_group, c = row % per_group;
  const int64_t begin = g * len + c * kReductionChunk;
  const int64_t end = begin + kReductionChunk < (g + 1) * len ? begin + kReductionChunk : (g + 1) * len;
  float acc = 0.0f;
  for (int64_t pos = begin; pos < end; ++pos)
    acc = rowwise::gate_grad_step(to_float(grad[pos * hidden + col]), to_float(y[pos * hidden + col]), acc);
  partials[row * partial_stride + col] = acc;
}

}  // namespace

Status gate_residual_forward(const GateResidualParams& p, Stream stream) {
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.in.residual.device));
  const ResolvedModulation mod = rowwise::gate_modulation(p.in);
  if (!h3_rule(p.in, mod))
    return launch_form_rows<true>(
        p.in, mod, form_args(p.in, mod, p.in.residual.data, p.in.y.data, p.in.residual.numel(), p.out.data, nullptr),
        as_cuda_stream(stream));
  GateRowArgs a{p.in.residual.data, p.in.y.data, p.in.gate.data, p.in.gate.strides[0], p.in.plan.device_tables().row_of_seq,
                p.in.plan.seq_len(), hidden_of(p.in.residual), p.in.residual.numel(), p.out.data, nullptr};
  return dispatch_float_dtype(p.in.residual.dtype, [&](auto tag) {
    return launch_gate_residual_rows<decltype(tag), true>(a, as_cuda_stream(stream));
  });
}

Status gate_residual_backward_rows(const GateResidualBackwardParams& p, Stream stream) {
  if (!p.d_residual.present() && !p.d_y.present()) return Status();
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.grad.device));
  const ResolvedModulation mod = rowwise::gate_modulation(p.in);
  if (!h3_rule(p.in, mod))
    return launch_form_rows<false>(p.in, mod,
                                   form_args(p.in, mod, p.grad.data, nullptr, p.grad.numel(),
                                             p.d_y.present() ? p.d_y.data : nullptr,
                                             p.d_residual.present() ? p.d_residual.data : nullptr),
                                   as_cuda_stream(stream));
  GateRowArgs a{p.grad.data, nullptr, p.in.gate.data, p.in.gate.strides[0], p.in.plan.device_tables().row_of_seq,
                p.in.plan.seq_len(), hidden_of(p.grad), p.grad.numel(),
                p.d_y.present() ? p.d_y.data : nullptr, p.d_residual.present() ? p.d_residual.data : nullptr};
  return dispatch_float_dtype(p.grad.dtype, [&](auto tag) {
    return launch_gate_residual_rows<decltype(tag), false>(a, as_cuda_stream(stream));
  });
}

Status gate_residual_backward_partials(const GateResidualBackwardParams& p, const ChunkSelection& sel,
                                       const ExtraRows& extra, const TensorView& partials, Stream stream) {
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.grad.device));
  const ResolvedModulation mod = rowwise::gate_modulation(p.in);
  const int64_t hidden = hidden_of(p.grad);
  if (mod.grouped()) {
    const int64_t per_group = (mod.frame_len + kReductionChunk - 1) / kReductionChunk;
    constexpr int kThreads = 128;
    const dim3 grid(static_cast<unsigned>(mod.groups() * per_group), blocks_for(hidden, kThreads));
    if (mod.groups() == 0 || hidden == 0) return Status();
    dispatch_recipe(p.in.y.dtype, mod.dtype, p.in.upcast, [&](auto t, auto m, auto up) {
      using T = decltype(t);
      using G = typename Recipe<T, decltype(m), decltype(up)::value>::Out;
      gate_residual_group_partials_kernel<T, G><<<grid, kThreads, 0, as_cuda_stream(stream)>>>(
          p.grad.ptr<const G>(), p.in.y.ptr<const T>(), hidden, mod.frame_len, per_group, partials.ptr<float>(),
          partials.strides[0]);
    });
    return launch_status("gate_residual_group_partials_kernel");
  }
  GatePartialArgs a{};
  a.grad = p.grad.data;
  a.y = p.in.y.data;
  a.hidden = hidden;
  a.grad_stride = a.y_stride = a.hidden;
  if (extra.grad.present()) {
    a.extra_grad = extra.grad.data;
    a.extra_grad_stride = extra.grad.strides[0];
  }
  if (extra.y.present()) {
    a.extra_y = extra.y.data;
    a.extra_y_stride = extra.y.strides[0];
  }
  a.tables = p.in.plan.device_tables();
  a.chunks = sel.chunks;
  a.position_row = sel.position_row;
  a.partials = partials.ptr<float>();
  a.partial_stride = partials.strides[0];
  const int64_t selected = sel.chunks ? sel.num_chunks : p.in.plan.num_chunks();
  return dispatch_recipe(p.in.y.dtype, mod.dtype, p.in.upcast, [&](auto t, auto m, auto up) {
    using T = decltype(t);
    using G = typename Recipe<T, decltype(m), decltype(up)::value>::Out;
    return launch_gate_residual_partials<T, G>(a, selected, as_cuda_stream(stream));
  });
}

}  // namespace cuda
}  // namespace detdit
