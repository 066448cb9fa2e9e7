// gate_residual_layernorm on CUDA (docs/numerics.md 9.7): the forward as one
// kernel, the backward as one walk per chunk where its rule allows (the
// backend entry point gate_residual_layernorm_backward_walk, at the end), each
// bitwise equal to the two ops composed (gate_residual into h, then layernorm
// of h; their backwards), so to the CPU in the portable profile and to the
// composed kernels in the torch profile.
//
// Forward: row source, then launcher, then the backend entry point; the kernel is layernorm's forward (src/cuda/layernorm_rows.cuh)
// with x computed here: h = gate_residual's out (numerics 5.7, 5.12: the
// gate absent, indexed or grouped, k, both recipes) from its own scalar
// functions (rowwise_math.h) over the recipe of y's dtype and the gate's
// (modulation_math.h), rounded to h's dtype and stored to h; the norm's
// statistics and output read exactly that rounded h: the statistics pass
// the value just stored, the output pass registers (a thread's first batch
// of vectors) or the h the thread stored (L2). So the norm sees the bytes
// of h the composition's second kernel reads.
//
// Bytes per row of H elements from and to DRAM (e = residual's and y's
// dtype size, e_h = h's, e_o = out's, e_m = the modulation's): residual and
// y read once (2 H e), h written once (H e_h), out written once (H e_o),
// mean and rstd (8 B when asked for); the gate, shift and scale rows and
// weight and bias are shared by many rows and stay in L2, except per token,
// where each present one adds H e_m. bf16 everywhere, not per token:
// 8 H + 8 bytes, 43016 B at H = 5376, 24584 B at H = 3072 (the two-kernel
// composition moves 10 H + 8: h written by one and read back by the other).
// h read again in the output pass past a thread's first batch (H > 4096)
// is the h this thread has just written: L2, not DRAM.
//
// Backward walk (its kernel's comment says how): per row, h, d_out, d_h and
// y read once from DRAM, d_residual and d_y written once, mean and rstd 8 B;
// the chains' partial rows are written once per chunk and row of the form.
// Predicted, bf16, d_residual holding g: 12 H + 8 bytes a row with d_h
// (36872 B at H = 3072), 10 H + 8 without; the composition moves 28 H + 24
// (86040 B) and 22 H + 24: dx (h, d_out in, g out), the d_weight / d_bias
// partials (h, d_out), the [d_shift | d_scale] partials (h, d_out), the d_h
// add (g, d_h in, g out), gate_residual's rows (g in, d_y out) and its d_gate
// partials (g, y).
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "common/backends.h"
#include "common/modulation_math.h"
#include "common/rowwise_math.h"
#include "common/scalar_math.h"
#include "common/scratch.h"
#include "common/storage.h"
#include "cuda/cuda_util.cuh"
#include "cuda/layernorm_rows.cuh"
#include "cuda/reduction.cuh"
#include "cuda/tuning.h"
#include "detdit/gate_residual_layernorm.h"
#include "detdit/layernorm.h"
#include "rowwise/backward.h"
#include "rowwise/checks.h"

namespace detdit {
namespace cuda {
namespace {

// The row source that computes h (layernorm_rows.cuh's contract): T is
// residual's and y's storage type, G the gate's, h's storage type the
// recipe's Out. kVector: residual, y and the gate rows aligned to a vector
// (else scalar loads, the same values); h is validated aligned. Both passes
// in whole batches, as gate_residual_rmsnorm's forward (its comment: 79-82 %
// of the copy bandwidth batched against 77-81 % one vector at a time, bf16,
// H = 5376, S >= 32768, one H200).
template <typename T, typename G, bool kUpcast, bool kVector>
struct GatedRows {
  using R = Recipe<T, G, kUpcast>;
  using Stored = typename R::Out;
  static constexpr int kStatisticsBatch = kForwardBatch;
  static constexpr int kOutputBatch = kForwardBatch;
  struct Loads {
    ElemVec<T, kVec> residual, y;
    ElemVec<G, kVec> gate;
  };
  struct Row {
    const T *residual, *y;  // (H,) row m
    const G* gate;          // (H,) position m's gate row, or nullptr (absent)
    Stored* h;              // (H,) row m
    bool has_k;
    float k;
    __device__ __forceinline__ void load(int64_t j, Loads& in) const {
      load_stored<T, kVec, kVector>(residual + j * kVec, in.residual);
      load_stored<T, kVec, kVector>(y + j * kVec, in.y);
      if (gate) load_stored<G, kVec, kVector>(gate + j * kVec, in.gate);
    }
    // gate_residual's h (its forward kernels' functions), stored, returned
    // as stored.
    __device__ __forceinline__ ElemVec<Stored, kVec> finish(int64_t j, const Loads& in) const {
      float r[kVec], yv[kVec], h_vec[kVec];
      widen(in.residual, r);
      widen(in.y, yv);
      if (gate) {
        float g[kVec];
        widen(in.gate, g);
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          const float term = has_k ? rowwise::gate_with_constant<typename R::Factor>(k, g[e]) : g[e];
          h_vec[e] = rowwise::gated_sum<typename R::Mid>(r[e], term, yv[e]);
        }
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) h_vec[e] = num::add32(r[e], yv[e]);
      }
      ElemVec<Stored, kVec> out;
#pragma unroll
      for (int e = 0; e < kVec; ++e) out.elems[e] = from_float<Stored>(h_vec[e]);
      store_elems<Stored, kVec, true>(h + j * kVec, h_vec);
      return out;
    }
    // A plain load, not the read-only path: this thread wrote h in this kernel.
    __device__ __forceinline__ void reload(int64_t j, ElemVec<Stored, kVec>& out) const {
      load_stored<Stored, kVec, true>(h + j * kVec, out);
    }
  };
  const T *residual, *y;  // (M, H)
  ModulationOperand gate;  // data null: absent
  ModulationForm form;
  const int32_t* row_of_seq;  // indexed form (device)
  int64_t seq_len, frame_len;
  bool has_k;
  float k;
  Stored* h;  // (M, H)
  __device__ __forceinline__ Row row(int64_t m, int64_t hidden) const {
    const G* gate_row =
        gate.data ? static_cast<const G*>(gate.data) + modulation_offset(gate, form, seq_len, frame_len, row_of_seq, m)
                  : nullptr;
    return Row{residual + m * hidden, y + m * hidden, gate_row, h + m * hidden, has_k, k};
  }
};

// The norm's modulation type N (shift's storage type: fp32 or h's) given h's.
template <typename H, typename Fn>
Status dispatch_norm_modulation(DType dtype, Fn&& fn) {
  return dtype == DType::kF32 ? fn(float{}) : fn(H{});
}

// The recipe over <y's type, the gate's, upcast>, the norm's modulation type
// over h's, and the alignment: one instantiation of the kernel per case.
Status launch_gate_residual_layernorm_forward(const GateResidualLayernormParams& p, const LayernormArgs& norm,
                                              DType norm_modulation, cudaStream_t stream) {
  const GateResidualLayernormInputs& in = p.in;
  const GateResidualInputs gate_in{in.residual, in.y, in.gate, in.plan, in.has_k, in.k, in.upcast};
  const ResolvedModulation mod = rowwise::gate_modulation(gate_in);
  return dispatch_recipe(in.y.dtype, mod.dtype, in.upcast, [&](auto t, auto g, auto up) {
    using T = decltype(t);
    using G = decltype(g);
    constexpr bool kUp = decltype(up)::value;
    using Stored = typename Recipe<T, G, kUp>::Out;
    const ModulationOperand gate = modulation_operand(in.gate, mod);
    const bool rows_vector = address_aligned(in.residual.data, kVec * sizeof(T)) &&
                             address_aligned(in.y.data, kVec * sizeof(T)) && operand_vectorizable(gate, sizeof(G));
    return dispatch_norm_modulation<Stored>(norm_modulation, [&](auto n) {
      using N = decltype(n);
      return dispatch_bool(rows_vector && modulation_vectorizable<N>(norm), [&](auto vector) {
        constexpr bool kVector = decltype(vector)::value;
        using Source = GatedRows<T, G, kUp, kVector>;
        Source source{};
        source.residual = in.residual.ptr<const T>();
        source.y = in.y.ptr<const T>();
        source.gate = gate;
        source.form = mod.form;
        source.row_of_seq = mod.form == ModulationForm::kIndexed ? in.plan.device_tables().row_of_seq : nullptr;
        source.seq_len = mod.seq_len;
        source.frame_len = mod.frame_len;
        source.has_k = in.has_k;
        source.k = in.k;
        source.h = static_cast<Stored*>(p.h.data);
        return launch_layernorm_forward<Source, N, kUp, kVector>(norm, source, stream);
      });
    });
  });
}


// ---- the backward walk (numerics 9.7) -------------------------------------------

// What the walk reads and writes beside the norm half's LayernormArgs (x = h,
// grad = d_out, mean, rstd, weight, bias, shift, scale; the d_weight, d_bias
// and [d_shift | d_scale] partials): the gate half's tensors, and the rows
// of the modulation chains (the form of every present modulation tensor).
struct RegionWalk {
  const void* d_h;          // (P, H) h's dtype, or nullptr
  const void* y;            // (P, H), or nullptr (no d_gate)
  ModulationOperand gate;   // data null: absent
  ModulationForm gate_form;
  const int32_t* row_of_seq;  // the gate's, indexed form
  int64_t gate_seq_len, gate_frame_len;
  bool has_k;
  float k;
  void* d_residual;         // (P, H) y's dtype, or nullptr
  void* d_y;                // (P, H) y's dtype, or nullptr
  float* gate_partials;     // (rows, H), or nullptr
  // the chains' rows: grouped, row g*per_group + c of group g's chunk c
  // (frame_len positions per group); indexed, the plan's segment
  ModulationForm chain_form;
  int64_t chain_seq_len, chain_frame_len, chain_per_group;
  PlanTables tables;
};

constexpr int kWalkTreeThreads = kRowTreeThreads;  // the dx tree's 128 threads (warps 0..3)
constexpr int kWalkElementThreads = 256;           // the element warps (4..11)
constexpr int kWalkThreads = kWalkTreeThreads + kWalkElementThreads;
constexpr int kWalkChains = 5;                     // d_weight, d_bias, d_shift, d_scale, d_gate
constexpr int64_t kWalkSegmentLimit = 32;          // the visited mask's bits (indexed form)

// The backward of one 256-position chunk per block, over whole rows, every
// value the composition's: the tree warps run the dx kernel's first half
// (dx_warp_sums: the same thread map, vectors and trees) for position q
// while the element warps, one position behind, finish position q - 1: d_n,
// dx = R_H(dx_value) with the sums of the same block_sum_of_warps, g =
// R_H(rn(dx + d_h)), d_residual = R_T(g), d_y = R_T(rn(g * gate term)), and
// the five chains of their columns, each a step of the partials kernels
// (layernorm.cu, gate_residual.cu) in ascending position order. Element
// thread k owns the vectors k, k + 256, ...; its chains live in shared
// memory (float4 per vector, chain c of vector j at c * V + j), so no other
// thread touches them. d_weight and d_bias chain over the chunk; the
// modulation chains over the position's chain row: when it changes, the old
// row's chains go to its partial rows and the new one's come back (indexed:
// a segment seen before in this chunk, a chain resumed from its stored FP32
// value is the same chain) or start at +0.0. One __syncthreads per position
// hands the warp sums over (double buffered).
// T: y's and residual's storage type; G: the gate's; N: the norm's
// modulation (shift's); H = Recipe<T, G>::Out, h's; the norm's recipe is
// <H, N>. Every row and modulation row is aligned to a vector (the launcher
// checks).
template <typename T, typename G, bool kUpcast, typename N>
__global__ void __launch_bounds__(kWalkThreads)
    gate_residual_layernorm_backward_walk_kernel(LayernormArgs a, RegionWalk w) {
  using RG = Recipe<T, G, kUpcast>;
  using H = typename RG::Out;
  using RN = Recipe<H, N, kUpcast>;
  using Out = typename RN::Out;
  extern __shared__ float4 chains[];                    // (kWalkChains, V)
  __shared__ float warp_sums[2][2][kRowTreeWarps];      // [position parity][s1 | s2][warp]
  __shared__ int32_t local_segment[kReductionChunk];    // indexed: chunk position q -> its segment in the chunk
  const int64_t chunk = blockIdx.x;
  const int64_t begin = chunk * kReductionChunk;
  const int64_t end = begin + kReductionChunk < a.positions ? begin + kReductionChunk : a.positions;
  const int count = static_cast<int>(end - begin);
  const int64_t hidden = a.hidden, vectors = hidden / kVec;
  const bool indexed = w.chain_form == ModulationForm::kIndexed;
  const int32_t first_segment = indexed ? w.tables.chunk_segment_begin[chunk] : 0;
  if (indexed) chunk_local_segments(w.tables, chunk, begin, end, w.chain_seq_len, local_segment);
  const int tid = static_cast<int>(threadIdx.x);
  const int k = tid - kWalkTreeThreads;  // element thread k (k >= 0)
  float4* const weight_chain = chains;
  float4* const bias_chain = chains + vectors;
  float4* const shift_chain = chains + 2 * vectors;
  float4* const scale_chain = chains + 3 * vectors;
  float4* const gate_chain = chains + 4 * vectors;
  const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (k >= 0)
    for (int64_t j = k; j < vectors; j += kWalkElementThreads)
      weight_chain[j] = bias_chain[j] = shift_chain[j] = scale_chain[j] = gate_chain[j] = zero;
  // This thread's modulation chains of partial row `row` to it (store), from
  // it (load), or +0.0.
  enum class Chains { kStore, kLoad, kZero };
  auto row_chains = [&](int64_t row, Chains what) {
    for (int64_t j = k; j < vectors; j += kWalkElementThreads) {
      float* const shift = a.table_partials ? a.table_partials + row * 2 * hidden + j * kVec : nullptr;
      float* const rows[3] = {shift, shift ? shift + hidden : nullptr,
                              w.gate_partials ? w.gate_partials + row * hidden + j * kVec : nullptr};
      float4* const sums[3] = {shift_chain + j, scale_chain + j, gate_chain + j};
#pragma unroll
      for (int c = 0; c < 3; ++c) {
        float* const r = rows[c];
        if (what == Chains::kStore) {
          if (r) r[0] = sums[c]->x, r[1] = sums[c]->y, r[2] = sums[c]->z, r[3] = sums[c]->w;
        } else {
          *sums[c] = what == Chains::kLoad && r ? make_float4(r[0], r[1], r[2], r[3]) : zero;
        }
      }
    }
  };
  const bool chained = a.table_partials != nullptr || w.gate_partials != nullptr;
  int64_t current = -1;  // the partial row whose chains are in shared memory
  uint32_t visited = 0;  // indexed: local segments whose chains are in their partial rows
  __syncthreads();       // local_segment
  const H* const x_rows = static_cast<const H*>(a.x);
  const Out* const grad_rows = static_cast<const Out*>(a.grad);
  for (int q = 0; q <= count; ++q) {
    if (k < 0) {  // the tree warps: position q's sums
      if (q < count) dx_warp_sums<H, N, kUpcast, true>(a, begin + q, tid, warp_sums[q & 1]);
    } else if (q > 0) {  // the element warps: position q - 1
      const int qe = q - 1;
      const int64_t p = begin + qe;
      const float sum1 = layernorm::block_sum_of_warps(warp_sums[qe & 1][0]);
      const float sum2 = layernorm::block_sum_of_warps(warp_sums[qe & 1][1]);
      const float mean = a.mean[p], rstd = a.rstd[p];
      const float term1 = layernorm::dx_term1(rstd, hidden);
      if (chained) {
        int64_t row;
        int local = 0;
        if (indexed) {
          local = local_segment[qe];
          row = first_segment + local;
        } else {
          const int64_t g = p / w.chain_frame_len;
          row = g * w.chain_per_group + (p - g * w.chain_frame_len) / kReductionChunk;
        }
        if (row != current) {
          if (current >= 0) row_chains(current, Chains::kStore);
          row_chains(row, indexed && (visited >> local & 1u) ? Chains::kLoad : Chains::kZero);
          if (indexed) visited |= 1u << local;
          current = row;
        }
      }
      const bool modulated = a.shift.data != nullptr;
      const N* scale = modulated ? static_cast<const N*>(a.scale.data) + offset_of(a, a.scale, p) : nullptr;
      const G* gate = w.gate.data ? static_cast<const G*>(w.gate.data) +
                                        modulation_offset(w.gate, w.gate_form, w.gate_seq_len, w.gate_frame_len,
                                                          w.row_of_seq, p)
                                  : nullptr;
      const int64_t row_offset = p * hidden;
      for (int64_t j = k; j < vectors; j += kWalkElementThreads) {
        const int64_t column = j * kVec;
        float xv[kVec], gv[kVec], wv[kVec], bv[kVec], sc[kVec], dh[kVec], yv[kVec], gt[kVec];
        load_elems<H, kVec, true>(x_rows + row_offset + column, xv);
        load_elems<Out, kVec, true>(grad_rows + row_offset + column, gv);
        parameter_vec<H>(a.weight, j, 1.0f, wv);
        parameter_vec<H>(a.bias, j, 0.0f, bv);
        if (modulated) load_elems<N, kVec, true>(scale + column, sc);
        if (w.d_h) load_elems<H, kVec, true>(static_cast<const H*>(w.d_h) + row_offset + column, dh);
        if (gate) load_elems<G, kVec, true>(gate + column, gt);
        if (w.y) load_elems<T, kVec, true>(static_cast<const T*>(w.y) + row_offset + column, yv);
        float d_residual[kVec], d_y[kVec], d_n[kVec], g[kVec];
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          d_n[e] = modulated ? rowwise::modulated_grad<typename RN::Factor>(gv[e], sc[e]) : gv[e];
          // the norm's dx in h's dtype, then autograd's sum with d_h (numerics 9.7)
          g[e] = round_to<H>(
              layernorm::dx_value(d_n[e], wv[e], xv[e], mean, rstd, sum1, sum2, term1, hidden));
          if (w.d_h) g[e] = round_to<H>(num::add32(g[e], dh[e]));
          d_residual[e] = g[e];  // stored as R_T(g)
          const float term =
              gate ? (w.has_k ? rowwise::gate_with_constant<typename RG::Factor>(w.k, gt[e]) : gt[e]) : 0.0f;
          d_y[e] = gate ? rowwise::gated_grad(g[e], term) : g[e];
        }
        if (w.d_residual) store_elems<T, kVec, true>(static_cast<T*>(w.d_residual) + row_offset + column, d_residual);
        if (w.d_y) store_elems<T, kVec, true>(static_cast<T*>(w.d_y) + row_offset + column, d_y);
        float wc[kVec], bc[kVec], shc[kVec], scc[kVec], gc[kVec];
        const float4 w4 = weight_chain[j], b4 = bias_chain[j], sh4 = shift_chain[j], sc4 = scale_chain[j],
                     g4 = gate_chain[j];
        wc[0] = w4.x, wc[1] = w4.y, wc[2] = w4.z, wc[3] = w4.w;
        bc[0] = b4.x, bc[1] = b4.y, bc[2] = b4.z, bc[3] = b4.w;
        shc[0] = sh4.x, shc[1] = sh4.y, shc[2] = sh4.z, shc[3] = sh4.w;
        scc[0] = sc4.x, scc[1] = sc4.y, scc[2] = sc4.z, scc[3] = sc4.w;
        gc[0] = g4.x, gc[1] = g4.y, gc[2] = g4.z, gc[3] = g4.w;
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          // layernorm_backward_partials_kernel's steps
          wc[e] = layernorm::weight_grad_step(d_n[e], xv[e], mean, rstd, wc[e]);
          bc[e] = num::add32(bc[e], d_n[e]);
          if (a.table_partials) {  // table_step's
            const float v = layernorm::normalised(xv[e], mean, rstd, a.weight != nullptr, wv[e], a.bias != nullptr,
                                                  bv[e]);
            shc[e] = num::add32(shc[e], gv[e]);
            scc[e] = rowwise::scale_grad_step(gv[e], layernorm::modulation_input<typename RN::Norm>(v), scc[e]);
          }
          if (w.gate_partials) gc[e] = rowwise::gate_grad_step(g[e], yv[e], gc[e]);  // gate_residual's
        }
        weight_chain[j] = make_float4(wc[0], wc[1], wc[2], wc[3]);
        bias_chain[j] = make_float4(bc[0], bc[1], bc[2], bc[3]);
        shift_chain[j] = make_float4(shc[0], shc[1], shc[2], shc[3]);
        scale_chain[j] = make_float4(scc[0], scc[1], scc[2], scc[3]);
        gate_chain[j] = make_float4(gc[0], gc[1], gc[2], gc[3]);
      }
    }
    __syncthreads();  // position q's warp sums to the element warps; q - 1's slot free again
  }
  if (k < 0) return;
  if (current >= 0) row_chains(current, Chains::kStore);
  for (int64_t j = k; j < vectors; j += kWalkElementThreads) {
    const float4 w4 = weight_chain[j], b4 = bias_chain[j];
    if (a.weight_partials) {
      float* dst = a.weight_partials + chunk * hidden + j * kVec;
      dst[0] = w4.x, dst[1] = w4.y, dst[2] = w4.z, dst[3] = w4.w;
    }
    if (a.bias_partials) {
      float* dst = a.bias_partials + chunk * hidden + j * kVec;
      dst[0] = b4.x, dst[1] = b4.y, dst[2] = b4.z, dst[3] = b4.w;
    }
  }
}


// The walk where it applies (gate_residual_layernorm_backward_walk's rule,
// below), every pointer vector-aligned: one block per chunk.
template <typename T, typename G, bool kUpcast, typename N>
Status launch_walk(const LayernormArgs& a, const RegionWalk& w, int64_t chunks, int device, cudaStream_t stream,
                   bool* launched) {
  using H = typename Recipe<T, G, kUpcast>::Out;
  using Out = typename Recipe<H, N, kUpcast>::Out;
  const auto aligned = [](const void* q, std::size_t element) { return !q || address_aligned(q, kVec * element); };
  if (!aligned(a.x, sizeof(H)) || !aligned(a.grad, sizeof(Out)) || !aligned(a.weight, sizeof(H)) ||
      !aligned(a.bias, sizeof(H)) || !aligned(w.d_h, sizeof(H)) || !aligned(w.y, sizeof(T)) ||
      !aligned(w.d_residual, sizeof(T)) || !aligned(w.d_y, sizeof(T)) || !operand_vectorizable(w.gate, sizeof(G)) ||
      !modulation_vectorizable<N>(a))
    return Status();
  int shared_optin = 0;
  DETDIT_RETURN_IF_ERROR(cuda_status(
      cudaDeviceGetAttribute(&shared_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "cudaDeviceGetAttribute"));
  const std::size_t shared_bytes = kWalkChains * sizeof(float) * static_cast<std::size_t>(a.hidden);
  constexpr std::size_t kStaticShared = 2048;  // warp sums and the segment map, rounded up
  if (shared_bytes + kStaticShared > static_cast<std::size_t>(shared_optin)) return Status();
  const auto kernel = gate_residual_layernorm_backward_walk_kernel<T, G, kUpcast, N>;
  DETDIT_RETURN_IF_ERROR(cuda_status(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared_bytes)),
      "cudaFuncSetAttribute"));
  kernel<<<static_cast<unsigned>(chunks), kWalkThreads, shared_bytes, stream>>>(a, w);
  DETDIT_RETURN_IF_ERROR(launch_status("gate_residual_layernorm_backward_walk_kernel"));
  *launched = true;
  return Status();
}

}  // namespace

Status gate_residual_layernorm_forward(const GateResidualLayernormParams& p, Stream stream) {
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.h.device));
  const GateResidualLayernormInputs& in = p.in;
  // The norm half's arguments, x = h (the composition's second op).
  const LayernormParams norm{
      LayernormInputs{p.h, in.weight, in.bias, in.shift, in.scale, in.plan, in.eps, in.numerics, in.upcast}, p.out,
      p.mean, p.rstd};
  LayernormArgs a = args_of(norm.in);
  set_forward_outputs(norm, &a);
  return launch_gate_residual_layernorm_forward(p, a, modulation_dtype(norm.in), as_cuda_stream(stream));
}

// The walk's rule: the launch tunable region_layernorm_walk on (tests turn
// it off), some output of the gate half asked for (else there is no dx to
// fuse: the composition runs the norm's partials alone), every row and
// modulation row in whole 4-element vectors, the chains' shared memory (20 H
// bytes) within the block's limit, and chains that nest in the chunks:
//   - indexed: at most 32 segments per chunk (the visited mask);
//   - grouped: every group chunk inside one 256-position chunk, i.e. each
//     chunk boundary 256c is a group chunk boundary ((256c mod L) mod 256 ==
//     0): per token, L dividing 256 or a multiple of it, or one group.
//     Otherwise a group chunk straddles two chunks, and its FP32 chain (one
//     ascending chain from +0.0) would have to pass from one block to the
//     next, or one block walk whole groups: the composition runs instead,
//     the same bytes.
// Else nothing is written and *launched stays false.
Status gate_residual_layernorm_backward_walk(const GateResidualLayernormBackwardParams& p, Stream stream,
                                             bool* launched) {
  *launched = false;
  const GateResidualLayernormInputs& in = p.in;
  if (!launch_tuning().region_layernorm_walk) return Status();
  if (!p.d_residual.present() && !p.d_y.present() && !p.d_gate.present()) return Status();
  const LayernormInputs norm_in{p.h, in.weight, in.bias, in.shift, in.scale, in.plan, in.eps, in.numerics, in.upcast};
  const GateResidualInputs gate_in{in.residual, in.y, in.gate, in.plan, in.has_k, in.k, in.upcast};
  LayernormArgs a = args_of(norm_in);
  if (a.positions == 0) return Status();
  const ResolvedModulation norm_mod = rowwise::layernorm_modulation(norm_in);
  const ResolvedModulation gate_mod = rowwise::gate_modulation(gate_in);
  // The chains' rows: the gate's form, or the norm's without a gate (one form, validated).
  const ResolvedModulation& chain = in.gate.present() ? gate_mod : norm_mod;
  const int64_t chunks = (a.positions + kReductionChunk - 1) / kReductionChunk;
  if (chain.grouped()) {
    for (int64_t c = 1; c < chunks; ++c)
      if ((c * kReductionChunk) % chain.frame_len % kReductionChunk != 0) return Status();
  } else if (chain.form == ModulationForm::kIndexed && in.plan.max_chunk_segments() > kWalkSegmentLimit) {
    return Status();
  }
  const int64_t hidden = a.hidden;
  a.mean = const_cast<float*>(p.mean.ptr<const float>());
  a.rstd = const_cast<float*>(p.rstd.ptr<const float>());
  a.grad = p.d_out.data;
  RegionWalk w{};
  w.d_h = p.d_h.present() ? p.d_h.data : nullptr;
  w.y = p.d_gate.present() ? in.y.data : nullptr;
  w.gate = modulation_operand(in.gate, gate_mod);
  w.gate_form = gate_mod.form;
  w.row_of_seq = gate_mod.form == ModulationForm::kIndexed ? in.plan.device_tables().row_of_seq : nullptr;
  w.gate_seq_len = gate_mod.seq_len;
  w.gate_frame_len = gate_mod.frame_len;
  w.has_k = in.has_k;
  w.k = in.k;
  w.d_residual = p.d_residual.present() ? p.d_residual.data : nullptr;
  w.d_y = p.d_y.present() ? p.d_y.data : nullptr;
  w.chain_form = chain.form;
  w.chain_seq_len = chain.seq_len;  // the plan's S in the indexed form
  w.chain_frame_len = chain.frame_len;
  w.chain_per_group = chain.grouped() ? rowwise::chunks_per_group(chain) : 0;
  if (chain.form == ModulationForm::kIndexed) w.tables = in.plan.device_tables();
  // The partials' scratch, laid out as the composition's (the folds read it).
  const bool tables = p.d_shift.present() || p.d_scale.present();
  const int64_t table_rows = tables ? rowwise::table_partial_rows(in.plan, norm_mod) : 0;
  const int64_t gate_rows = p.d_gate.present() ? rowwise::table_partial_rows(in.plan, gate_mod) : 0;
  const int64_t weight_floats = p.d_weight.present() ? chunks * hidden : 0;
  const int64_t bias_floats = p.d_bias.present() ? chunks * hidden : 0;
  const int64_t table_floats = table_rows * 2 * hidden, gate_floats = gate_rows * hidden;
  const int64_t floats = weight_floats + bias_floats + table_floats + gate_floats;
  const Device device = p.h.device;
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(device));
  std::shared_ptr<void> owner;  // stream-ordered: freed after the folds have read it
  TensorView scratch;
  if (floats > 0) DETDIT_RETURN_IF_ERROR(scratch_tensor(device, DType::kF32, {floats}, stream, &owner, &scratch));
  float* base = floats > 0 ? scratch.ptr<float>() : nullptr;
  TensorView weight_partials, bias_partials, table_partials, gate_partials;
  if (weight_floats) weight_partials = TensorView::contiguous(base, DType::kF32, {chunks, hidden}, device);
  if (bias_floats)
    bias_partials = TensorView::contiguous(base + weight_floats, DType::kF32, {chunks, hidden}, device);
  if (table_floats)
    table_partials = TensorView::contiguous(base + weight_floats + bias_floats, DType::kF32,
                                            {table_rows, 2 * hidden}, device);
  if (gate_floats)
    gate_partials = TensorView::contiguous(base + weight_floats + bias_floats + table_floats, DType::kF32,
                                           {gate_rows, hidden}, device);
  a.weight_partials = weight_floats ? weight_partials.ptr<float>() : nullptr;
  a.bias_partials = bias_floats ? bias_partials.ptr<float>() : nullptr;
  a.table_partials = table_floats ? table_partials.ptr<float>() : nullptr;
  w.gate_partials = gate_floats ? gate_partials.ptr<float>() : nullptr;
  const cudaStream_t s = as_cuda_stream(stream);
  DETDIT_RETURN_IF_ERROR(dispatch_recipe(in.y.dtype, gate_mod.dtype, in.upcast, [&](auto t, auto g, auto up) {
    using T = decltype(t);
    using G = decltype(g);
    constexpr bool kUp = decltype(up)::value;
    return dispatch_norm_modulation<typename Recipe<T, G, kUp>::Out>(modulation_dtype(norm_in), [&](auto n) {
      return launch_walk<T, G, kUp, decltype(n)>(a, w, chunks, device.index, s, launched);
    });
  }));
  if (!*launched) return Status();
  // The composition's folds of the same partials.
  if (weight_floats) DETDIT_RETURN_IF_ERROR(fold_chunk_partials(weight_partials, p.d_weight, stream));
  if (bias_floats) DETDIT_RETURN_IF_ERROR(fold_chunk_partials(bias_partials, p.d_bias, stream));
  if (table_floats)
    DETDIT_RETURN_IF_ERROR(
        rowwise::fold_modulation_partials(in.plan, norm_mod, table_partials, p.d_shift, p.d_scale, stream));
  if (gate_floats) {
    rowwise::GatePartials partials;
    partials.gate = gate_partials;
    DETDIT_RETURN_IF_ERROR(
        rowwise::fold_gate_partials(GateResidualBackwardParams{gate_in, p.h, {}, {}, p.d_gate}, partials, stream));
  }
  return Status();
}

}  // namespace cuda
}  // namespace detdit
