// The region backward as one walk per chunk over whole rows (gate_residual_rmsnorm,
// modulated norm, numerics 6.10 with 6.5 and 7): every value and chain is the
// column-block walk's of src/cuda/gate_residual_rmsnorm.cu, so the bytes are its bytes and
// the halves', but h and d_out are read once instead of twice, because the
// block that walks a chunk holds whole rows and computes their dx
// coefficients itself.
//
// One block of 16 warps per 256-position chunk, three roles:
//   - the loader (the last warp, one lane): copies position q's rows of h,
//     d_out, d_h and y (when present) into stage q % kStages of shared memory
//     with one bulk copy each (cp.async.bulk, completion on the stage's `full`
//     barrier), up to kStages positions ahead of the walk;
//   - the coefficient warps (4 warps, the row tree's 128 threads): thread t
//     sums fma(rn(w * d_n), h, acc) over its 4-element vectors t, t + 128, ...
//     of the staged row, then the tree of row_tree.cuh (a named barrier among
//     these warps alone): the rows kernel's coefficient, bit for bit. They run
//     ahead of the walk by up to kStages - 1 positions;
//   - the walk warps (11 warps): lane k owns the 8-element vectors k and
//     k + 352 (H <= 5632) and walks the chunk's positions ascending: dx, g =
//     R_T(rn(R_T(dx) + d_h)) to d_residual, d_y = R_T(rn(g * gate)), the
//     d_weight chain and the chains of the position's segment, all in
//     registers. When the segment changes, the chains of the old one go to its
//     partial rows and those of the new one come back from its rows (or start
//     at +0.0): a chain resumed from its stored FP32 value is the same chain,
//     so segments that come back cost two copies, not a different order.
// A stage is refilled once every thread of the 15 reading warps (480) has
// arrived on its `empty` barrier, each arrival releasing that thread's own
// reads. With one arrival per warp after __syncwarp, the other lanes' reads
// reached the loader only through the warp barrier's ordering, which
// compute-sanitizer's racecheck does not follow: it reported WAR hazards
// between those reads and the loader's next copy into the stage. The
// per-thread arrivals cost nothing measurable on an H200. Needs sm_90 (bulk copies, mbarrier transactions);
// the launcher answers "not launched" elsewhere and the column-block walk
// runs instead.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/backends.h"
#include "common/row_tree.h"
#include "common/rowwise_math.h"
#include "common/scalar_math.h"
#include "common/storage.h"
#include "cuda/cuda_util.cuh"
#include "cuda/gate_residual_rmsnorm_walk.cuh"
#include "cuda/reduction.cuh"
#include "cuda/row_tree.cuh"
#include "cuda/tuning.h"

namespace detdit {
namespace cuda {
namespace {

constexpr int kStages = 3;                           // positions staged at once
constexpr int kWalkWarps = 11;
constexpr int kWalkLanes = kWalkWarps * kWarpSize;   // 352
constexpr int kCoefWarps = kRowTreeWarps;            // the row tree's 4 warps
constexpr int kLoaderWarp = kWalkWarps + kCoefWarps;
constexpr int kRowWalkThreads = (kLoaderWarp + 1) * kWarpSize;  // 512
constexpr int kWalkVector = 8;                       // elements of a walk lane's 16-byte vector
constexpr int kWalkVectorsPerLane = 2;
constexpr int64_t kRowWalkMaxHidden = static_cast<int64_t>(kWalkLanes) * kWalkVectorsPerLane * kWalkVector;
constexpr int kTreeBarrier = 1;                      // named barrier of the coefficient warps (0 is __syncthreads)
// The most segments of a chunk the visited mask holds (the tunable's limit).
constexpr int64_t kRowWalkSegmentLimit = 32;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900  // bulk copies and mbarrier transactions: the kernel body only
__device__ __forceinline__ unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void barrier_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(bar)), "r"(count));
}
__device__ __forceinline__ void barrier_arrive(uint64_t* bar) {  // release: the arriving thread's writes first
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(shared_address(bar)) : "memory");
}
__device__ __forceinline__ void barrier_arrive_expect_bytes(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_address(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void barrier_wait(uint64_t* bar, unsigned parity) {  // acquire
  asm volatile(
      "{\n"
      ".reg .pred ready;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 ready, [%0], %1;\n"
      "@!ready bra WAIT;\n"
      "}\n" ::"r"(shared_address(bar)),
      "r"(parity)
      : "memory");
}
// bytes (a multiple of 16) from global to shared memory, both 16-byte aligned;
// completes on bar's transaction count.
__device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   shared_address(dst)),
               "l"(src), "r"(bytes), "r"(shared_address(bar))
               : "memory");
}
#endif

// grid (chunk); dynamic shared memory: kStages stages of [h | d_out | d_h | y]
// rows of H elements of T (d_h and y only when present), then the current
// segment's d_shift, d_scale and d_gate chains (3 x H FP32).
template <typename T>
__global__ void __launch_bounds__(kRowWalkThreads, 1) gate_residual_rmsnorm_backward_row_walk_kernel(RegionWalkArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char stage_bytes[];
  __shared__ uint64_t full[kStages], coef_ready[kStages], empty[kStages];
  __shared__ float coef_slot[kStages];                  // position's dx coefficient, by stage
  __shared__ float warp_sums[kRowTreeWarps];
  __shared__ int32_t local_segment[kReductionChunk];   // chunk position q -> its segment, 0-based in the chunk
  const int64_t chunk = blockIdx.x;
  const int32_t first = a.tables.chunk_segment_begin[chunk];
  const int64_t begin = chunk * kReductionChunk;
  const int64_t end = begin + kReductionChunk < a.positions ? begin + kReductionChunk : a.positions;
  const int count = static_cast<int>(end - begin);
  const int64_t hidden = a.hidden;
  chunk_local_segments(a.tables, chunk, begin, end, a.seq_len, local_segment);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      barrier_init(&full[s], 1);
      barrier_init(&coef_ready[s], 1);
      barrier_init(&empty[s], (kWalkWarps + kCoefWarps) * kWarpSize);  // every reading thread
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  // stage s: rows [h | d_out | d_h | y] of H elements each
  const int64_t stage_elems = (2 + (a.d_h != nullptr) + (a.y != nullptr)) * hidden;
  T* const stages = reinterpret_cast<T*>(stage_bytes);
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize, lane = static_cast<int>(threadIdx.x) % kWarpSize;

  if (warp == kLoaderWarp) {
    if (lane != 0) return;
    const unsigned row_bytes = static_cast<unsigned>(hidden * sizeof(T));
    for (int q = 0; q < count; ++q) {
      const int s = q % kStages;
      if (q >= kStages) barrier_wait(&empty[s], (q / kStages - 1) & 1);  // every reader is done with q - kStages
      barrier_arrive_expect_bytes(&full[s], static_cast<unsigned>(stage_elems * sizeof(T)));
      const int64_t offset = (begin + q) * hidden;
      T* dst = stages + s * stage_elems;
      const void* const rows[] = {a.h, a.d_out, a.d_h, a.y};
      for (const void* src : rows) {
        if (!src) continue;
        bulk_copy_to_shared(dst, static_cast<const T*>(src) + offset, row_bytes, &full[s]);
        dst += hidden;
      }
    }
    return;
  }

  const T* weight = static_cast<const T*>(a.weight);
  if (warp >= kWalkWarps) {  // the coefficient warps: the rows kernel's tree over the staged row
    const int t = static_cast<int>(threadIdx.x) - kWalkLanes;
    const int64_t vectors = hidden / kRowTreeVector;
    for (int q = 0; q < count; ++q) {
      const int s = q % kStages;
      barrier_wait(&full[s], (q / kStages) & 1);
      const T* x = stages + s * stage_elems;  // (H,) h
      const T* g = x + hidden;                // (H,) d_out
      const T* scale = static_cast<const T*>(a.scale) + a.tables.segment_row[first + local_segment[q]] * a.scale_stride;
      float acc = 0.0f;
      for (int64_t j = t; j < vectors; j += kRowTreeThreads) {  // thread t's vectors, ascending: the tree's order
        float xv[kRowTreeVector], d_n[kRowTreeVector], sc[kRowTreeVector], wv[kRowTreeVector];
        load_elems<T, kRowTreeVector, true>(x + j * kRowTreeVector, xv);
        load_elems<T, kRowTreeVector, true>(g + j * kRowTreeVector, d_n);
        load_readonly<T, kRowTreeVector, true>(scale + j * kRowTreeVector, sc);
        load_readonly<T, kRowTreeVector, true>(weight + j * kRowTreeVector, wv);
#pragma unroll
        for (int e = 0; e < kRowTreeVector; ++e) {
          d_n[e] = rowwise::modulated_grad<T>(d_n[e], sc[e]);
          acc = num::fma32(rowwise::dot_term(wv[e], d_n[e]), xv[e], acc);
        }
      }
      barrier_arrive(&empty[s]);
      const float dot = row_tree_sum(acc, warp_sums, warp - kWalkWarps, [] {
        asm volatile("bar.sync %0, %1;\n" ::"n"(kTreeBarrier), "n"(kRowTreeThreads) : "memory");
      });
      if (t == 0) {
        coef_slot[s] = rowwise::dx_coefficient(a.rstd[begin + q], dot, hidden);
        barrier_arrive(&coef_ready[s]);
      }
    }
    return;
  }

  // The walk warps. Lane k's vectors k + 352 v of 8 elements, v < 2; the
  // current segment's chains are in shared memory beside the stages, as
  // float4 halves: chain c's half h of vector j at chains[(2 c + h) * vectors + j],
  // so a warp's accesses are consecutive 16-byte words.
  const int64_t vectors = hidden / kWalkVector;
  float4* const chains = reinterpret_cast<float4*>(stages + kStages * stage_elems);  // (3, 2, vectors)
  const int k = static_cast<int>(threadIdx.x);
  ElemVec<T, kWalkVector> w[kWalkVectorsPerLane];
  float d_weight[kWalkVectorsPerLane][kWalkVector];
#pragma unroll
  for (int v = 0; v < kWalkVectorsPerLane; ++v) {
    const int64_t j = k + static_cast<int64_t>(v) * kWalkLanes;
    if (j < vectors) load_stored<T, kWalkVector, true>(weight + j * kWalkVector, w[v]);
#pragma unroll
    for (int e = 0; e < kWalkVector; ++e) d_weight[v][e] = 0.0f;
  }
  // This lane's chains of local segment `local` to its partial rows (store),
  // or from them (load), or +0.0 (a segment not seen before).
  enum class Chains { kStore, kLoad, kZero };
  auto segment_chains = [&](int local, Chains what) {
    const int64_t segment = first + local;
#pragma unroll
    for (int v = 0; v < kWalkVectorsPerLane; ++v) {
      const int64_t j = k + static_cast<int64_t>(v) * kWalkLanes;
      if (j >= vectors) continue;
      float* table = a.table_partials ? a.table_partials + segment * a.table_partial_stride + j * kWalkVector : nullptr;
      float* gate = a.gate_partials ? a.gate_partials + segment * a.gate_partial_stride + j * kWalkVector : nullptr;
      float* const rows[3] = {table, table ? table + hidden : nullptr, gate};  // d_shift, d_scale, d_gate
#pragma unroll
      for (int c = 0; c < 3; ++c) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float4& sum = chains[(2 * c + half) * vectors + j];
          float* row = rows[c] ? rows[c] + 4 * half : nullptr;
          if (what == Chains::kStore) {
            if (row) row[0] = sum.x, row[1] = sum.y, row[2] = sum.z, row[3] = sum.w;
          } else {
            sum = what == Chains::kLoad && row ? make_float4(row[0], row[1], row[2], row[3])
                                               : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
          }
        }
      }
    }
  };
  int current = -1;       // the local segment whose chains are in shared memory
  uint32_t visited = 0;   // local segments whose chains are in their partial rows
  for (int q = 0; q < count; ++q) {  // ascending positions of the chunk
    const int s = q % kStages;
    const unsigned parity = (q / kStages) & 1;
    const int64_t p = begin + q;
    const float rstd = a.rstd[p];
    const int local = local_segment[q];
    if (local != current) {
      if (current >= 0) segment_chains(current, Chains::kStore);
      segment_chains(local, visited >> local & 1u ? Chains::kLoad : Chains::kZero);
      visited |= 1u << local;
      current = local;
    }
    const int64_t r = a.tables.segment_row[first + local];  // the position's row is its segment's
    barrier_wait(&full[s], parity);
    barrier_wait(&coef_ready[s], parity);
    const float coef = coef_slot[s];
    const T* x = stages + s * stage_elems;  // (H,) h, then d_out, d_h, y
    const T* grad = x + hidden;
    const T* d_h = a.d_h ? grad + hidden : nullptr;
    const T* y = a.y ? (d_h ? d_h : grad) + hidden : nullptr;
#pragma unroll
    for (int v = 0; v < kWalkVectorsPerLane; ++v) {
      const int64_t j = k + static_cast<int64_t>(v) * kWalkLanes;
      if (j >= vectors) continue;
      const int64_t column = j * kWalkVector;
      float xv[kWalkVector], gv[kWalkVector], wv[kWalkVector], d_n[kWalkVector], g[kWalkVector];
      load_elems<T, kWalkVector, true>(x + column, xv);
      load_elems<T, kWalkVector, true>(grad + column, gv);
      widen(w[v], wv);
      region_dx_step<T>(
          a, p, r, column, rstd, coef, xv, gv, wv,
          [&](float(&dh)[kWalkVector]) { load_elems<T, kWalkVector, true>(d_h + column, dh); }, d_n, g);
#pragma unroll
      for (int e = 0; e < kWalkVector; ++e)
        d_weight[v][e] = rowwise::weight_grad_step(d_n[e], xv[e], rstd, d_weight[v][e]);
      float yv[kWalkVector];
      if (y) load_elems<T, kWalkVector, true>(y + column, yv);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float4& shift = chains[half * vectors + j];
        float4& scale = chains[(2 + half) * vectors + j];
        float4& gate = chains[(4 + half) * vectors + j];
        float d_shift[4] = {shift.x, shift.y, shift.z, shift.w}, d_scale[4] = {scale.x, scale.y, scale.z, scale.w},
              d_gate[4] = {gate.x, gate.y, gate.z, gate.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int e = 4 * half + i;
          d_shift[i] = num::add32(d_shift[i], gv[e]);
          d_scale[i] = rowwise::scale_grad_step(gv[e], rowwise::normalised<T>(wv[e], rstd, xv[e]), d_scale[i]);
          if (y) d_gate[i] = rowwise::gate_grad_step(g[e], yv[e], d_gate[i]);
        }
        shift = make_float4(d_shift[0], d_shift[1], d_shift[2], d_shift[3]);
        scale = make_float4(d_scale[0], d_scale[1], d_scale[2], d_scale[3]);
        if (y) gate = make_float4(d_gate[0], d_gate[1], d_gate[2], d_gate[3]);
      }
    }
    barrier_arrive(&empty[s]);
  }
  if (current >= 0) segment_chains(current, Chains::kStore);
  if (a.weight_partials) {
#pragma unroll
    for (int v = 0; v < kWalkVectorsPerLane; ++v) {
      const int64_t j = k + static_cast<int64_t>(v) * kWalkLanes;
      if (j >= vectors) continue;
      float* dst = a.weight_partials + chunk * a.weight_partial_stride + j * kWalkVector;
#pragma unroll
      for (int e = 0; e < kWalkVector; ++e) dst[e] = d_weight[v][e];
    }
  }
#endif
}

}  // namespace

Status launch_gate_residual_rmsnorm_backward_row_walk(const RegionWalkArgs& a, DType dtype, int64_t chunks,
                                                      int64_t max_chunk_segments, int device, Stream stream,
                                                      bool* launched) {
  *launched = false;
  const LaunchTuning& tuning = launch_tuning();
  if (!tuning.region_row_walk || (dtype != DType::kBF16 && dtype != DType::kF16)) return Status();
  if (a.hidden % kWalkVector != 0 || a.hidden > kRowWalkMaxHidden || a.positions == 0) return Status();
  // A segment change costs each lane 48 stores and loads of its chains, so the
  // row walk takes chunks of few segments (block packing: 1 or 2); interleaved
  // chunks, whose segments alternate position by position, take the
  // column-block walk.
  if (max_chunk_segments > std::min<int64_t>(tuning.region_row_walk_max_segments, kRowWalkSegmentLimit)) return Status();
  if (a.scale_stride % kWalkVector != 0 || a.gate_stride % kWalkVector != 0) return Status();
  for (const void* q : {a.h, a.d_out, a.d_h, a.y, a.weight, a.scale, a.gate, const_cast<const void*>(a.d_residual),
                        const_cast<const void*>(a.d_y)})
    if (q && !address_aligned(q, 16)) return Status();  // bulk copies and 16-byte accesses
  int major = 0, sms = 0, shared_optin = 0;
  DETDIT_RETURN_IF_ERROR(
      cuda_status(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute"));
  DETDIT_RETURN_IF_ERROR(
      cuda_status(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute"));
  DETDIT_RETURN_IF_ERROR(cuda_status(
      cudaDeviceGetAttribute(&shared_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "cudaDeviceGetAttribute"));
  if (major < 9) return Status();
  // One block per chunk and one per SM: fewer chunks than SMs leave SMs idle,
  // where the column-block walk (11 blocks per chunk) keeps them busy.
  if (chunks < (tuning.region_row_walk_min_chunks > 0 ? tuning.region_row_walk_min_chunks : sms)) return Status();
  const std::size_t tensors = 2 + (a.d_h != nullptr) + (a.y != nullptr);
  // the stages, then the current segment's 3 chains (FP32)
  const std::size_t shared_bytes = (kStages * tensors * 2 + 3 * 4) * static_cast<std::size_t>(a.hidden);
  constexpr std::size_t kStaticShared = 4096;  // barriers, coefficients, tree sums and segment map, rounded up
  if (shared_bytes + kStaticShared > static_cast<std::size_t>(shared_optin)) return Status();
  const cudaStream_t s = as_cuda_stream(stream);
  return dispatch_float_dtype(dtype, [&](auto tag) -> Status {
    using T = decltype(tag);
    if constexpr (sizeof(T) != 2) {
      return Status();  // excluded above
    } else {
      const auto kernel = gate_residual_rmsnorm_backward_row_walk_kernel<T>;
      // The kernel's body exists in code built for sm_90 and later: a build
      // that reaches this GPU through older PTX has an empty kernel here.
      cudaFuncAttributes attributes{};
      DETDIT_RETURN_IF_ERROR(cuda_status(cudaFuncGetAttributes(&attributes, kernel), "cudaFuncGetAttributes"));
      if (attributes.ptxVersion < 90) return Status();
      DETDIT_RETURN_IF_ERROR(cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                              static_cast<int>(shared_bytes)),
                                         "cudaFuncSetAttribute"));
      kernel<<<static_cast<unsigned>(chunks), kRowWalkThreads, shared_bytes, s>>>(a);
      DETDIT_RETURN_IF_ERROR(launch_status("gate_residual_rmsnorm_backward_row_walk_kernel"));
      *launched = true;
      return Status();
    }
  });
}

}  // namespace cuda
}  // namespace detdit
