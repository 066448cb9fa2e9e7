// The single-pass backward of rmsnorm and of the fused region
// gate_residual_rmsnorm on CUDA (numerics 6.5, 6.7, 6.10, 7): x (the fused
// op's h), the incoming gradient (and the fused op's y, d_h) are read once,
// and every row-local gradient and every chain of the canonical reduction
// comes out of that one read, bitwise equal to the two-pass kernels of
// rmsnorm.cu (and so to the CPU reference).
//
// Layout: a cluster of kCluster = 16 thread blocks owns one 256-position
// chunk; block b of the cluster owns the row tree's virtual threads
// t in [8b, 8b + 8) and so the 4-element vectors j = t + 128k of every row
// (numerics 7: thread t's chain runs over exactly those vectors). The cluster
// walks the chunk's positions in ascending order, kTile at a time:
//   1. the tile's rows of the block's columns arrive in shared memory
//      (cp.async, the next tile prefetched while this one is computed);
//   2. 64 threads (tile row, virtual thread) run their tree chain
//      fma(rn(w * d_n), x, s) and write s into every block of the cluster
//      (distributed shared memory); one cluster barrier;
//   3. each warp finishes two rows' trees (the shuffle-down warp tree, then
//      (W0 + W2) + (W1 + W3)), so every block holds every row's dot;
//   4. each thread owns columns of the block and walks the tile's rows in
//      order: dx (the fused op: g = R_T(rn(d_h + R_T(dx))), d_residual = g,
//      d_y = R_T(rn(g * gate))), the d_weight chain (registers) and the chains
//      of the position's segment (shared memory: d_shift, d_scale, d_gate).
// Every chain still runs over its positions in ascending order, so the bits
// are those of the chunk partials of the two-pass kernels; the folds follow.
// Needs sm_90 (clusters); the launcher answers "not applicable" elsewhere, and
// the caller runs the two-pass kernels (the same bits).
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/row_tree.h"
#include "common/rowwise_math.h"
#include "common/scalar_math.h"
#include "common/storage.h"
#include "cuda/cuda_util.cuh"
#include "cuda/profile_math.cuh"
#include "cuda/reduction.cuh"
#include "cuda/rmsnorm_single_pass.cuh"

namespace detdit {
namespace cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kCluster = 16;                     // blocks per chunk
constexpr int kThreads = 128;                    // per block
constexpr int kTile = 8;                         // positions per step
constexpr int kVirtualPerBlock = kRowTreeThreads / kCluster;  // 8 tree threads per block
constexpr int kVec = kRowTreeVector;             // 4 elements per tree vector
static_assert(kTile * kVirtualPerBlock == 64, "the tree phase maps 64 threads to (row, virtual thread)");
static_assert(kThreads / kWarpSize * 2 == kTile, "each warp finishes two rows' trees");

constexpr int kMaxColumns = 8;                   // columns per thread: a block's columns <= 1024 (H <= 16384)

// Shared memory of one block (one layout for the launcher's size and the
// kernel's carving): row data, the weight slice, the segment chains, then the
// tile (16-byte aligned for cp.async).
struct SinglePassLayout {
  int64_t columns = 0;   // the block's columns: slices * 32 (valid or not)
  int tensors = 0;       // 2 (x, grad) or 4 (h, d_out, y, d_h -> g)
  int accumulators = 0;  // chains per segment and column: d_shift, d_scale, d_gate
  int64_t segments = 0;  // the most segments of any chunk
  __host__ __device__ std::size_t head_floats() const {
    return 2 * kTile * kRowTreeThreads          // tree partials, 2 buffers
           + 4 * kTile                          // rstd, coef, table row, segment per row
           + kReductionChunk                    // chunk position -> its segment
           + static_cast<std::size_t>(columns)  // weight slice
           + static_cast<std::size_t>(segments * accumulators * columns);  // segment chains
  }
  __host__ __device__ std::size_t tile_offset() const { return (head_floats() * sizeof(float) + 15) / 16 * 16; }
  __host__ __device__ std::size_t bytes(std::size_t element) const {
    return tile_offset() + element * 2 * tensors * kTile * static_cast<std::size_t>(columns);
  }
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900  // cp.async and clusters: the kernel body only
__device__ __forceinline__ void cp_async_8(void* shared, const void* global) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(address), "l"(global));
}
__device__ __forceinline__ void cp_async_16(void* shared, const void* global) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16;\n" ::"r"(address), "l"(global));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// One 4-element vector (8 bytes bf16/fp16, 16 bytes fp32), global to shared,
// asynchronously (validated rows are aligned to one vector).
template <typename T>
__device__ __forceinline__ void copy_vector(T* shared, const T* global) {
  if constexpr (sizeof(T) == 2)
    cp_async_8(shared, global);
  else
    cp_async_16(shared, global);
}
#endif

// grid: kCluster blocks per chunk (the cluster rank is the block of the chunk).
// Tile tensors: 0 x (h), 1 grad (d_out); gate: 2 y, 3 d_h (g replaces it).
template <typename T, bool kGate>
__global__ void __launch_bounds__(kThreads) rmsnorm_backward_single_pass_kernel(SinglePassArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int64_t chunk = blockIdx.x / kCluster;
  const int64_t begin = chunk * kReductionChunk;
  const int64_t end = begin + kReductionChunk < a.positions ? begin + kReductionChunk : a.positions;
  const int64_t vectors = a.hidden / kVec;
  SinglePassLayout layout;
  layout.columns = static_cast<int64_t>(a.slices) * kVirtualPerBlock * kVec;
  layout.tensors = kGate ? 4 : 2;
  layout.accumulators = (a.table_partials ? 2 : 0) + (kGate && a.gate_partials ? 1 : 0);
  layout.segments = a.max_segments;
  const int64_t columns = layout.columns;
  const int accumulators = layout.accumulators;
  const bool modulated = a.scale != nullptr;

  extern __shared__ __align__(16) float shared[];
  float* tree = shared;                                          // [2][kTile][128]
  float* row_rstd = tree + 2 * kTile * kRowTreeThreads;          // [kTile]
  float* row_coef = row_rstd + kTile;                            // [kTile]
  int32_t* row_table = reinterpret_cast<int32_t*>(row_coef + kTile);  // [kTile] the position's table row
  int32_t* row_segment = row_table + kTile;                      // [kTile] its segment within the chunk
  int32_t* local_segment = row_segment + kTile;                  // [256]
  float* w_slice = reinterpret_cast<float*>(local_segment + kReductionChunk);  // [columns]
  float* chains = w_slice + columns;                             // [segment][accumulator][columns]
  T* tile = reinterpret_cast<T*>(reinterpret_cast<char*>(shared) + layout.tile_offset());  // [2][tensors][kTile][columns]

  // Local column lc = (k*8 + v)*4 + e is element e of vector j = 128k + 8*rank + v.
  auto vector_of = [&](int64_t lc) {
    return 128 * (lc / 32) + kVirtualPerBlock * rank + (lc / kVec) % kVirtualPerBlock;
  };
  auto tile_at = [&](int buffer, int tensor, int row) {
    return tile + ((static_cast<int64_t>(buffer) * layout.tensors + tensor) * kTile + row) * columns;
  };

  // The chunk's segments (one per table row present, in plan order) and each position's.
  const int32_t first_segment = a.tables.chunk_segment_begin ? a.tables.chunk_segment_begin[chunk] : 0;
  const int32_t last_segment = a.tables.chunk_segment_begin ? a.tables.chunk_segment_begin[chunk + 1] : 0;
  if (a.tables.row_of_seq) {
    chunk_local_segments(a.tables, chunk, begin, end, a.seq_len, local_segment);
  } else {
    for (int64_t q = threadIdx.x; q < end - begin; q += kThreads) local_segment[q] = 0;  // no plan: one chain
  }
  for (int64_t lc = threadIdx.x; lc < columns; lc += kThreads) {
    const int64_t j = vector_of(lc);
    w_slice[lc] = j < vectors ? to_float(static_cast<const T*>(a.weight)[j * kVec + lc % kVec]) : 0.0f;
  }
  for (int64_t i = threadIdx.x; i < (last_segment - first_segment) * accumulators * columns; i += kThreads)
    chains[i] = 0.0f;

  // Loads the tile of `step` (positions begin + step*kTile, ...) into `buffer`.
  const int steps = static_cast<int>((end - begin + kTile - 1) / kTile);
  const int64_t per_row = columns / kVec;  // the block's vectors per row
  auto load_tile = [&](int step, int buffer) {
    const int64_t first = begin + static_cast<int64_t>(step) * kTile;
    const int rows = static_cast<int>(end - first < kTile ? end - first : kTile);
    const void* sources[4] = {a.x, a.grad, a.y, a.d_h};
    for (int64_t i = threadIdx.x; i < layout.tensors * rows * per_row; i += kThreads) {
      const int tensor = static_cast<int>(i / (rows * per_row));
      const int row = static_cast<int>((i / per_row) % rows);
      const int64_t lv = i % per_row;  // local vector
      const int64_t j = vector_of(lv * kVec);
      if (j >= vectors || sources[tensor] == nullptr) continue;
      copy_vector<T>(tile_at(buffer, tensor, row) + lv * kVec,
                     static_cast<const T*>(sources[tensor]) + (first + row) * a.hidden + j * kVec);
    }
    cp_async_commit();
  };
  __syncthreads();
  load_tile(0, 0);
  cluster.sync();  // every block of the cluster runs before the first remote write

  float d_weight_acc[kMaxColumns];
#pragma unroll
  for (int m = 0; m < kMaxColumns; ++m) d_weight_acc[m] = 0.0f;

  for (int step = 0; step < steps; ++step) {
    const int buffer = step % 2;
    const int64_t first = begin + static_cast<int64_t>(step) * kTile;
    const int rows = static_cast<int>(end - first < kTile ? end - first : kTile);
    if (step + 1 < steps) {
      load_tile(step + 1, 1 - buffer);
      cp_async_wait<1>();  // this step's tile has landed (the next may still fly)
    } else {
      cp_async_wait<0>();
    }
    if (threadIdx.x < rows) {
      const int64_t p = first + threadIdx.x;
      row_rstd[threadIdx.x] = a.rstd[p];
      row_segment[threadIdx.x] = local_segment[p - begin];
      row_table[threadIdx.x] = a.tables.row_of_seq ? rowwise::table_row(a.tables.row_of_seq, p, a.seq_len) : 0;
    }
    __syncthreads();

    // 2. the tree chain of (row, virtual thread t), written into every block
    if (threadIdx.x < kTile * kVirtualPerBlock) {
      const int row = threadIdx.x / kVirtualPerBlock, v = threadIdx.x % kVirtualPerBlock;
      float s = 0.0f;
      if (row < rows) {
        const T* x = tile_at(buffer, 0, row);
        const T* g = tile_at(buffer, 1, row);
        const T* scale = modulated ? static_cast<const T*>(a.scale) + row_table[row] * a.scale_stride : nullptr;
        for (int k = 0; k < a.slices; ++k) {
          const int64_t j = 128 * k + kVirtualPerBlock * rank + v;
          if (j >= vectors) break;
          const int64_t lc = (k * kVirtualPerBlock + v) * kVec;
          float xv[kVec], d_n[kVec];
          load_elems<T, kVec, true>(x + lc, xv);
          load_elems<T, kVec, true>(g + lc, d_n);
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            if (modulated) d_n[e] = rowwise::modulated_grad<T>(d_n[e], to_float(scale[j * kVec + e]));
            s = num::fma32(rowwise::dot_term(w_slice[lc + e], d_n[e]), xv[e], s);
          }
        }
      }
      const int t = kVirtualPerBlock * rank + v;
      for (int q = 0; q < kCluster; ++q) cluster.map_shared_rank(tree, q)[(buffer * kTile + row) * kRowTreeThreads + t] = s;
    }
    cluster.sync();

    // 3. two rows per warp: PyTorch's warp trees (shuffle down), then (W0 + W2) + (W1 + W3)
    {
      const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = warp * 2 + r;
        const float* sums = tree + (buffer * kTile + row) * kRowTreeThreads;
        float w[kRowTreeWarps];
#pragma unroll
        for (int q = 0; q < kRowTreeWarps; ++q) {
          w[q] = sums[q * kWarpSize + lane];
          for (int offset = 16; offset >= 1; offset /= 2)
            w[q] = num::add32(w[q], __shfl_down_sync(kFullMask, w[q], offset));
        }
        if (lane == 0 && row < rows) {
          const float dot = num::add32(num::add32(w[0], w[2]), num::add32(w[1], w[3]));
          row_coef[row] = rowwise::dx_coefficient(row_rstd[row], dot, a.hidden);
        }
      }
    }
    __syncthreads();

    // 4. this thread's columns through the tile's rows, in ascending order
#pragma unroll
    for (int m = 0; m < kMaxColumns; ++m) {
      const int64_t lc = threadIdx.x + static_cast<int64_t>(m) * kThreads;
      const int64_t j = vector_of(lc);
      if (lc >= columns || j >= vectors) continue;
      const int64_t column = j * kVec + lc % kVec;
      const float w = w_slice[lc];
      for (int row = 0; row < rows; ++row) {
        const int64_t p = first + row;
        const float rstd = row_rstd[row];
        const float x = to_float(tile_at(buffer, 0, row)[lc]);
        const float g = to_float(tile_at(buffer, 1, row)[lc]);
        const int64_t r = row_table[row];
        const float d_n =
            modulated ? rowwise::modulated_grad<T>(g, to_float(static_cast<const T*>(a.scale)[r * a.scale_stride + column]))
                      : g;
        const float dx = rowwise::dx_value(rstd, w, d_n, x, row_coef[row]);
        float* chain = chains + (row_segment[row] * accumulators) * columns + lc;
        if constexpr (kGate) {
          const float norm_dx = round_to<T>(dx);
          const float total = a.d_h ? round_to<T>(num::add32(to_float(tile_at(buffer, 3, row)[lc]), norm_dx)) : norm_dx;
          if (a.d_residual) static_cast<T*>(a.d_residual)[p * a.hidden + column] = from_float<T>(total);
          if (a.d_y) {
            const float gate = to_float(static_cast<const T*>(a.gate)[r * a.gate_stride + column]);
            static_cast<T*>(a.d_y)[p * a.hidden + column] = from_float<T>(rowwise::gated_grad(total, gate));
          }
          if (a.gate_partials) {
            float* acc = chain + (accumulators - 1) * columns;
            *acc = rowwise::gate_grad_step(total, to_float(tile_at(buffer, 2, row)[lc]), *acc);
          }
        } else {
          if (a.dx) static_cast<T*>(a.dx)[p * a.hidden + column] = from_float<T>(dx);
        }
        if (a.weight_partials) d_weight_acc[m] = rowwise::weight_grad_step(d_n, x, rstd, d_weight_acc[m]);
        if (a.table_partials) {
          chain[0] = num::add32(chain[0], g);
          chain[columns] = rowwise::scale_grad_step(g, rowwise::normalised<T>(w, rstd, x), chain[columns]);
        }
      }
    }
    __syncthreads();  // the buffer is refilled at the next step
  }

  // The chunk's partials of this block's columns.
#pragma unroll
  for (int m = 0; m < kMaxColumns; ++m) {
    const int64_t lc = threadIdx.x + static_cast<int64_t>(m) * kThreads;
    const int64_t j = vector_of(lc);
    if (lc >= columns || j >= vectors) continue;
    const int64_t column = j * kVec + lc % kVec;
    if (a.weight_partials) a.weight_partials[chunk * a.hidden + column] = d_weight_acc[m];
    for (int32_t g = 0; g < last_segment - first_segment; ++g) {
      const float* chain = chains + (g * accumulators) * columns + lc;
      const int64_t segment = first_segment + g;
      if (a.table_partials) {
        a.table_partials[segment * 2 * a.hidden + column] = chain[0];  // [d_shift | d_scale]
        a.table_partials[segment * 2 * a.hidden + a.hidden + column] = chain[columns];
      }
      if (kGate && a.gate_partials) a.gate_partials[segment * a.hidden + column] = chain[(accumulators - 1) * columns];
    }
  }
  cluster.sync();  // no block leaves while another may still write into its shared memory
#endif
}

template <typename T, bool kGate>
Status launch(const SinglePassArgs& a, const SinglePassLayout& layout, int64_t chunks, cudaStream_t stream,
              bool* launched) {
  auto kernel = rmsnorm_backward_single_pass_kernel<T, kGate>;
  const std::size_t bytes = layout.bytes(sizeof(T));
  DETDIT_RETURN_IF_ERROR(cuda_status(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
      "cudaFuncSetAttribute(max dynamic shared memory)"));
  DETDIT_RETURN_IF_ERROR(cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1),
                                     "cudaFuncSetAttribute(non-portable cluster size)"));
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(chunks * kCluster));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = kCluster;
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  // A cluster of 16 blocks of this size must fit the GPU; else the caller
  // runs the two-pass kernels.
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess || clusters < 1) {
    cudaGetLastError();  // the query's error is an answer, not a failure of the op
    *launched = false;
    return Status();
  }
  DETDIT_RETURN_IF_ERROR(cuda_status(cudaLaunchKernelEx(&config, kernel, a), "cudaLaunchKernelEx"));
  *launched = true;
  return launch_status(kGate ? "rmsnorm_backward_single_pass_kernel<gate>" : "rmsnorm_backward_single_pass_kernel");
}

}  // namespace

Status launch_rmsnorm_backward_single_pass(SinglePassArgs a, DType dtype, bool gate, int64_t max_segments,
                                           Stream stream, bool* launched) {
  *launched = false;
  int device = 0, major = 0;
  DETDIT_RETURN_IF_ERROR(cuda_status(cudaGetDevice(&device), "cudaGetDevice"));
  DETDIT_RETURN_IF_ERROR(
      cuda_status(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute"));
  if (major < 9 || a.positions == 0) return Status();  // clusters need sm_90
  SinglePassLayout layout;
  layout.columns = static_cast<int64_t>(a.slices) * kVirtualPerBlock * kVec;
  if (layout.columns > static_cast<int64_t>(kThreads) * kMaxColumns) return Status();  // H > 16384: two-pass kernels
  layout.tensors = gate ? 4 : 2;
  layout.accumulators = (a.table_partials ? 2 : 0) + (gate && a.gate_partials ? 1 : 0);
  layout.segments = a.max_segments = max_segments;
  int limit = 0;
  DETDIT_RETURN_IF_ERROR(cuda_status(
      cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "cudaDeviceGetAttribute"));
  const std::size_t element = dtype_size(dtype);
  if (layout.bytes(element) > static_cast<std::size_t>(limit)) return Status();
  const int64_t chunks = (a.positions + kReductionChunk - 1) / kReductionChunk;
  const cudaStream_t s = as_cuda_stream(stream);
  return dispatch_float_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    return gate ? launch<T, true>(a, layout, chunks, s, launched) : launch<T, false>(a, layout, chunks, s, launched);
  });
}

}  // namespace cuda
}  // namespace detdit
