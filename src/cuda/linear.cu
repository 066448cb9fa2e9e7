// linear on CUDA: y = x W^T + b with an optional SiLU epilogue (numerics 5.2)
// and its backward (6.2): d_x chunk partials (folded by src/linear.cc with
// fold_chunk_partials), d_W, d_b.
//
// Forward: each warp owns `columns` output columns and keeps one accumulator
// per (column, row) for up to 8 rows of x (widened once into shared memory), so
// a weight row streams once per pass. Lane l walks the 16-byte vectors l, l+32,
// ... of the row (fma in element order), then an XOR butterfly 16..1 sums the
// lanes: exactly the order of numerics 5.2 for any columns-per-warp and grid.
// Backward: d_x partials[c, t, k] = ascending-n fma chain from +0.0 over the
// 64 rows n of chunk c of g[t, n] * W[n, k]; d_W[n, k] and d_b[n] are
// ascending-t chains. The partials kernels run on grid (chunks, K blocks), one
// thread per column vector of a chunk: 16 bytes, or in the fused kernel (d_W
// and the partials from one read of W, T <= 8) 16 bytes for T <= 4 and 8 bytes
// for T > 4, with the chunk's g staged in shared memory. Which thread computes
// an element, and how loads are issued, never changes its chain.
#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/backends.h"
#include "common/scalar_math.h"
#include "common/storage.h"
#include "cuda/cuda_util.cuh"
#include "cuda/profile_math.cuh"
#include "cuda/tuning.h"

namespace detdit {
namespace cuda {
namespace {

constexpr int kForwardWarps = 8;  // warps per block of the forward
// x's shared-memory budget per block: 8 widened rows of the projection's K = 2688
// (84 KB), two blocks per SM on sm_90 (228 KB), one on sm_80 (164 KB).
constexpr int64_t kForwardSharedBytes = 96 * 1024;

struct LinearForwardArgs {
  const void* x;       // (rows, k) T
  const void* weight;  // (n, k) T
  const void* bias;    // (n,) T or nullptr
  void* out;           // (rows, n) Out
  float* pre;          // (rows, n) fp32 or nullptr
  int64_t rows, k, n;
  bool silu, torch;
};

// The XOR butterfly of numerics 5.2 (offsets 16, 8, 4, 2, 1) over kCount values
// per lane, as a reduce-scatter: at offset o a lane keeps the half of its kLive
// values that its bit o selects and adds its partner's copy of that half, so each
// sum is one the full butterfly forms (IEEE addition commutes), with kCount - 1
// shuffles instead of 5 kCount. After log2(kCount) offsets the lane holds the sum
// of value lane / (32 / kCount) in v[0]; the offsets left are the plain butterfly.
// (A template per halving, so every index is a constant and v stays in registers.)
template <int kLive, int kCount>
__device__ __forceinline__ void butterfly_halves(float (&v)[kCount], int lane, int offset) {
  if constexpr (kLive > 1) {
    const bool upper = (lane & offset) != 0;
#pragma unroll
    for (int i = 0; i < kLive / 2; ++i) {
      const float send = upper ? v[i] : v[i + kLive / 2];
      const float keep = upper ? v[i + kLive / 2] : v[i];
      v[i] = num::add32(keep, __shfl_xor_sync(kFullMask, send, offset));
    }
    butterfly_halves<kLive / 2>(v, lane, offset / 2);
  }
}
template <int kCount>
__device__ __forceinline__ float butterfly_reduce_scatter(float (&v)[kCount], int lane) {
  static_assert(kCount >= 1 && kCount <= kWarpSize && (kCount & (kCount - 1)) == 0, "a power of two <= 32");
  butterfly_halves<kCount>(v, lane, kWarpSize / 2);
  float sum = v[0];
#pragma unroll
  for (int offset = kWarpSize / 2 / kCount; offset >= 1; offset /= 2)
    sum = num::add32(sum, __shfl_xor_sync(kFullMask, sum, offset));
  return sum;
}

// Persistent blocks; each warp takes groups of kColumns output columns (grid
// stride) and keeps one accumulator per (column, row) for kRows rows of x, so a
// weight row streams once per pass of kRows rows. Lane l walks the 16-byte
// vectors l, l+32, ... of the rows (fma in element order) with the next vector's
// loads in flight, then butterfly_reduce_scatter sums the lanes: the order of
// numerics 5.2 for any columns, rows per pass and grid.
// kSharedX: the pass's x rows are widened once into shared memory, laid out
// [row][half][vector][4 floats] so that a lane's two 16-byte reads of a bf16
// vector (elements 0-3, 4-7) are consecutive across the warp (no bank
// conflicts; fp32 has one half). Otherwise x is read (and widened) from global
// memory per vector, through L1, for K too wide for the budget.
template <typename T, typename Out, int kColumns, int kRows, bool kSharedX>
__global__ void __launch_bounds__(kForwardWarps* kWarpSize, 2)
    linear_forward_warp_per_columns_kernel(LinearForwardArgs a) {
  extern __shared__ __align__(16) float x_shared[];  // (kRows, halves, vectors, 4) when kSharedX
  constexpr int kVec = Vec16<T>::kElems;
  constexpr int kHalves = kVec / 4;
  constexpr int kOutputs = kColumns * kRows;  // accumulators per lane, (column, row) at column * kRows + row
  static_assert(kOutputs <= kWarpSize, "one lane writes each (column, row) result");
  const int lane = threadIdx.x % kWarpSize;
  const T* x = static_cast<const T*>(a.x);
  const T* w = static_cast<const T*>(a.weight);
  const int64_t vectors = a.k / kVec;  // 16-byte vectors per row
  const int64_t groups = (a.n + kColumns - 1) / kColumns;
  for (int64_t t0 = 0; t0 < a.rows; t0 += kRows) {
    const int rows = a.rows - t0 < kRows ? static_cast<int>(a.rows - t0) : kRows;  // rows of this pass
    if constexpr (kSharedX) {
      __syncthreads();  // the previous pass has read x_shared
      // All kRows rows staged, those past `rows` as zeros: the row loop below
      // then needs no guard, so the weights' widening is done once per vector
      // instead of once per row (the guard made each row a branch of its own).
      for (int64_t i = threadIdx.x; i < kRows * vectors; i += blockDim.x) {
        const int64_t r = i / vectors, j = i % vectors;
        float v[kVec] = {};
        if (r < rows) unpack16(load16(x + (t0 + r) * a.k + j * kVec), v);
#pragma unroll
        for (int h = 0; h < kHalves; ++h)
          reinterpret_cast<float4*>(x_shared)[(r * kHalves + h) * vectors + j] =
              make_float4(v[4 * h], v[4 * h + 1], v[4 * h + 2], v[4 * h + 3]);
      }
      __syncthreads();
    }
    for (int64_t group = static_cast<int64_t>(blockIdx.x) * kForwardWarps + threadIdx.x / kWarpSize; group < groups;
         group += static_cast<int64_t>(gridDim.x) * kForwardWarps) {
      const int64_t first_column = group * kColumns;
      // Columns past n read column first_column's weights; their sums are not stored.
      const T* w_row[kColumns];
#pragma unroll
      for (int c = 0; c < kColumns; ++c)
        w_row[c] = w + (first_column + c < a.n ? first_column + c : first_column) * a.k;
      float acc[kOutputs];
#pragma unroll
      for (int i = 0; i < kOutputs; ++i) acc[i] = 0.0f;
      uint4 next[kColumns];  // W[first_column + c, j*kVec ..] of the lane's next vector j
      if (lane < vectors) {
#pragma unroll
        for (int c = 0; c < kColumns; ++c) next[c] = load16(w_row[c] + lane * kVec);
      }
      for (int64_t j = lane; j < vectors; j += kWarpSize) {
        float wv[kColumns][kVec];
#pragma unroll
        for (int c = 0; c < kColumns; ++c) unpack16(next[c], wv[c]);
        if (j + kWarpSize < vectors) {
#pragma unroll
          for (int c = 0; c < kColumns; ++c) next[c] = load16(w_row[c] + (j + kWarpSize) * kVec);
        }
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          // A guard, not a break, where x comes from global memory: the loop
          // stays unrolled and acc in registers. Staged rows past `rows` are
          // zeros whose sums are never stored.
          if (kSharedX || r < rows) {
            float xv[kVec];  // x[t0 + r, j*kVec + e]
            if constexpr (kSharedX) {
#pragma unroll
              for (int h = 0; h < kHalves; ++h) {
                const float4 q = reinterpret_cast<const float4*>(x_shared)[(r * kHalves + h) * vectors + j];
                xv[4 * h] = q.x;
                xv[4 * h + 1] = q.y;
                xv[4 * h + 2] = q.z;
                xv[4 * h + 3] = q.w;
              }
            } else {
              unpack16(load16(x + (t0 + r) * a.k + j * kVec), xv);
            }
#pragma unroll
            for (int c = 0; c < kColumns; ++c)
#pragma unroll
              for (int e = 0; e < kVec; ++e) acc[c * kRows + r] = num::fma32(xv[e], wv[c][e], acc[c * kRows + r]);
          }
        }
      }
      const float sum = butterfly_reduce_scatter(acc, lane);
      constexpr int kLanesPerOutput = kWarpSize / kOutputs;
      const int c = lane / kLanesPerOutput / kRows, r = lane / kLanesPerOutput % kRows;
      const int64_t n = first_column + c, t = t0 + r;
      if (lane % kLanesPerOutput != 0 || n >= a.n || r >= rows) continue;
      float v = sum;
      if (a.bias) v = num::add32(v, to_float(static_cast<const T*>(a.bias)[n]));
      if (a.pre) a.pre[t * a.n + n] = v;
      if (a.silu) v = silu_p(v, a.torch);
      static_cast<Out*>(a.out)[t * a.n + n] = from_float<Out>(v);
    }
  }
}

// As many blocks as stay resident on the device's `sms` SMs (at most one per 8
// column groups); x_bytes of shared memory each (0: x read from global memory).
template <typename T, typename Out, int kColumns, int kRows, bool kSharedX>
Status launch_linear_forward_pass(const LinearForwardArgs& a, int64_t x_bytes, int sms, cudaStream_t stream) {
  const auto kernel = linear_forward_warp_per_columns_kernel<T, Out, kColumns, kRows, kSharedX>;
  const int threads = kForwardWarps * kWarpSize;
  const int shared = static_cast<int>(x_bytes);
  if (shared > 48 * 1024)  // above 48 KB a kernel must opt in
    DETDIT_RETURN_IF_ERROR(cuda_status(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared), "cudaFuncSetAttribute"));
  int resident = 0;
  DETDIT_RETURN_IF_ERROR(cuda_status(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, threads, shared),
                                     "cudaOccupancyMaxActiveBlocksPerMultiprocessor"));
  const int64_t needed = blocks_for((a.n + kColumns - 1) / kColumns, kForwardWarps);
  const int64_t most = static_cast<int64_t>(sms) * (resident > 0 ? resident : 1);
  kernel<<<static_cast<unsigned>(needed < most ? needed : most), threads, shared, stream>>>(a);
  return launch_status("linear_forward_warp_per_columns_kernel");
}

template <typename T, typename Out, int kColumns>
Status launch_linear_forward_rows(const LinearForwardArgs& a, int rows, int64_t x_bytes, int sms, cudaStream_t stream) {
  const auto pass = [&](auto rows_tag) {
    constexpr int kRows = decltype(rows_tag)::value;
    if (x_bytes > 0) return launch_linear_forward_pass<T, Out, kColumns, kRows, true>(a, x_bytes, sms, stream);
    return launch_linear_forward_pass<T, Out, kColumns, kRows, false>(a, 0, sms, stream);
  };
  switch (rows) {
    case 8: return pass(std::integral_constant<int, 8>{});
    case 4: return pass(std::integral_constant<int, 4>{});
    case 2: return pass(std::integral_constant<int, 2>{});
    default: return pass(std::integral_constant<int, 1>{});
  }
}

// Rows per pass: the smallest power of two >= min(T, 8), so small T keeps few
// registers; x in shared memory when that many widened rows fit the budget.
// columns: 1, 2 or 4 per warp, or 0 to choose. The choice: 4 unless that leaves
// fewer than 16 warps per SM (the timestep MLP's N = 2688 at 4 columns: 672
// warps, 84 blocks on the 132 SMs of an H200), then the most of 2, 1 that gives
// them; but 4 again when x takes over half the shared budget, where each block
// first copies up to 96 KB of x and only two blocks fit an SM. Measured on an
// H200 (timestep MLP forward): its N = 2688 layer with x
// from global memory (T >= 8) or staged small (T = 1) 13-36 % faster at 1 column
// than at 4; with 4 rows of K = 5376 staged (86 KB, T = 3, 4) 21-28 % slower.
template <typename T, typename Out>
Status launch_linear_forward(const LinearForwardArgs& a, int device, int columns, bool shared_x, cudaStream_t stream) {
  int sms = 0;
  DETDIT_RETURN_IF_ERROR(
      cuda_status(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute"));
  const int rows = a.rows >= 8 ? 8 : a.rows >= 3 ? 4 : static_cast<int>(a.rows);
  int64_t x_bytes = rows * a.k * static_cast<int64_t>(sizeof(float));
  if (!shared_x || x_bytes > kForwardSharedBytes) x_bytes = 0;
  if (columns == 0) {
    const int64_t warps_wanted = static_cast<int64_t>(sms) * 2 * kForwardWarps;
    columns = a.n >= 4 * warps_wanted || x_bytes > kForwardSharedBytes / 2 ? 4 : a.n >= 2 * warps_wanted ? 2 : 1;
  }
  switch (columns) {
    case 1: return launch_linear_forward_rows<T, Out, 1>(a, rows, x_bytes, sms, stream);
    case 2: return launch_linear_forward_rows<T, Out, 2>(a, rows, x_bytes, sms, stream);
    default: return launch_linear_forward_rows<T, Out, 4>(a, rows, x_bytes, sms, stream);
  }
}

struct LinearPartialsArgs {
  const float* grad;  // (rows, n) fp32
  const void* weight; // (n, k) T
  float* partials;    // (chunks, rows, k) fp32
  int64_t rows, k, n;
};

// Rows t0 .. t0 + kRows - 1 (those < rows) of chunk `chunk`'s d_x partials at
// columns [vec * kVec, +kVec): acc[r] to partials[chunk, t0 + r, vec * kVec ..],
// in stores of min(kVec, 4) floats (16 bytes at most: kVec = 8 is two; kVec =
// 2, the fused kernel's fp32 8-byte vectors, one of 8 bytes).
template <int kRows, int kVec>
__device__ void store_partial_rows(float* partials, int64_t chunk, int64_t t0, int64_t rows, int64_t k, int64_t vec,
                                   const float (&acc)[kRows][kVec]) {
  constexpr int kPiece = kVec < 4 ? kVec : 4;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (t0 + r >= rows) break;
    float* dst = partials + (chunk * rows + t0 + r) * k + vec * kVec;
#pragma unroll
    for (int q = 0; q < kVec / kPiece; ++q) {
      float piece[kPiece];  // acc[r][q * kPiece + e]
#pragma unroll
      for (int e = 0; e < kPiece; ++e) piece[e] = acc[r][q * kPiece + e];
      store_vec<float, kPiece>(dst + q * kPiece, piece);
    }
  }
}

// grid (chunks, K-vector blocks); one thread per 16-byte vector of columns.
template <typename T, int kRows>
__global__ void linear_backward_input_partials_kernel(LinearPartialsArgs a) {
  constexpr int kVec = Vec16<T>::kElems;
  const int64_t chunk = blockIdx.x;
  const int64_t vec = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;  // columns [vec*kVec, +kVec)
  if (vec * kVec >= a.k) return;
  const T* w = static_cast<const T*>(a.weight);
  const int64_t n_begin = chunk * kLinearChunkRows;
  const int64_t n_end = n_begin + kLinearChunkRows < a.n ? n_begin + kLinearChunkRows : a.n;
  for (int64_t t0 = 0; t0 < a.rows; t0 += kRows) {
    float acc[kRows][kVec];
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[r][e] = 0.0f;
    for (int64_t n = n_begin; n < n_end; ++n) {  // ascending n
      float wv[kVec];
      unpack16(load16(w + n * a.k + vec * kVec), wv);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (t0 + r >= a.rows) break;
        const float g = a.grad[(t0 + r) * a.n + n];
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[r][e] = num::fma32(g, wv[e], acc[r][e]);
      }
    }
    store_partial_rows<kRows, kVec>(a.partials, chunk, t0, a.rows, a.k, vec, acc);
  }
}

template <typename T>
Status launch_linear_backward_input_partials(const LinearPartialsArgs& a, int rows_per_pass, cudaStream_t stream) {
  constexpr int kThreads = 128;
  const int64_t chunks = (a.n + kLinearChunkRows - 1) / kLinearChunkRows;
  if (chunks == 0 || a.k == 0) return Status();
  const dim3 grid(static_cast<unsigned>(chunks), blocks_for(a.k / Vec16<T>::kElems, kThreads));
  switch (rows_per_pass) {
    case 1: linear_backward_input_partials_kernel<T, 1><<<grid, kThreads, 0, stream>>>(a); break;
    case 2: linear_backward_input_partials_kernel<T, 2><<<grid, kThreads, 0, stream>>>(a); break;
    default: linear_backward_input_partials_kernel<T, 4><<<grid, kThreads, 0, stream>>>(a); break;
  }
  return launch_status("linear_backward_input_partials_kernel");
}

struct LinearFusedArgs {
  const float* grad;  // (rows, n) fp32
  const void* weight; // (n, k) T
  const void* x;      // (rows, k) T
  float* partials;    // (chunks, rows, k) fp32
  void* d_weight;     // (n, k) T
  int64_t rows, k, n;
};

// Elements of the fused kernel's column vector (one per thread) for kRows rows
// of x: 16 bytes (8 bf16 / 4 fp32) for kRows <= 4, 8 bytes (4 bf16 / 2 fp32)
// for kRows = 8. A thread holds x and the d_x chains, 2 * kRows * kVec floats:
// 16 bytes at kRows = 8 would be 128 of them for bf16 (~160 registers, ~12
// warps per SM, too few loads in flight for this memory-bound kernel); 8 bytes
// halve them. The FMAs per byte of W are the same at either width; the
// per-row work of a thread (g reads, addressing, the loop) doubles per byte,
// which is small beside the 2 * kRows * kVec FMAs of a row.
template <typename T, int kRows>
constexpr int fused_vector_elems() {
  return (kRows <= 4 ? 16 : 8) / static_cast<int>(sizeof(T));
}

// W bytes each thread keeps in flight: its next 64 / (vector bytes) rows (4 of
// 16 bytes or 8 of 8 bytes), 16 registers of raw storage either way. With the
// 16-24 warps per SM that kRows = 4 and 8 leave, that is 32-48 KB of loads in
// flight per SM, about twice what the W reads need at full rate (they are half
// the traffic: ~2 TB/s x ~1 us of loaded latency / 132 SMs = ~16 KB on an H200).
constexpr int kFusedAheadBytes = 64;

// The two block sizes of the fused kernel (the larger: its __launch_bounds__).
constexpr int kFusedMinThreads = 96;
constexpr int kFusedMaxThreads = 128;

// Threads per block of the fused kernel over `vectors` column vectors: 96 or
// 128, whichever leaves fewer idle lanes in the last K block (a tie: 128, fewer
// blocks). A block keeps its registers until the whole block ends, so idle
// warps there are occupancy lost. At the H3 shape (K = 2688 bf16) the 672
// 8-byte vectors are 7 blocks of 96 exactly (128: 6 blocks, 3 of the last
// block's 4 warps idle); the 336 16-byte vectors leave 48 lanes idle either
// way (10.5 warps). Blocks of one or two warps would load the g slice and
// wait at the barrier more often per byte of W.
int fused_threads(int64_t vectors) {
  const auto idle = [vectors](int64_t threads) { return (threads - vectors % threads) % threads; };
  return idle(kFusedMinThreads) < idle(kFusedMaxThreads) ? kFusedMinThreads : kFusedMaxThreads;
}

// The d_x chunk partials of the kernel above and d_W of the one below from one
// read of W: grid (chunks, K blocks), one thread per kVec-element column vector
// (fused_vector_elems) and every row of x (rows <= kRows, one pass). For each
// weight row n of the chunk, ascending, the thread adds g * W[n, k] to the d_x
// chains of every t (the partials kernel's order) and forms d_W[n, k] as the
// ascending-t chain of g * x[t, k] (the d_W kernel's), so both are the same bits.
// The block's (64, rows) slice of g is read from global memory once, into
// shared memory, and each n's g[0..rows) is then one or two broadcast vector
// reads of it; each thread's W rows are loaded kAhead rows before their use.
template <typename T, int kRows, int kVec>
__global__ void __launch_bounds__(kFusedMaxThreads)
    linear_backward_weight_and_input_partials_kernel(LinearFusedArgs a) {
  constexpr int kChunk = static_cast<int>(kLinearChunkRows);
  constexpr int kAhead = kFusedAheadBytes / (kVec * static_cast<int>(sizeof(T)));  // W rows in flight per thread
  constexpr int kGPiece = kRows < 4 ? kRows : 4;  // g values per shared read (16 bytes at most)
  using Raw = decltype(ElemVec<T, kVec>::raw);
  // g_tile[j][t] = g[t, n_begin + j]: one n's rows are adjacent, read as vectors.
  // +0.0 where t >= rows (read with the vector, in no chain) or j >= count.
  __shared__ __align__(16) float g_tile[kChunk][kRows];
  const int64_t chunk = blockIdx.x;
  const int64_t n_begin = chunk * kLinearChunkRows;
  const int count = static_cast<int>(a.n - n_begin < kLinearChunkRows ? a.n - n_begin : kLinearChunkRows);
  const int64_t vec = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;  // columns [vec*kVec, +kVec)
  const bool active = vec * kVec < a.k;  // the last K block's spare lanes only help load g
  const T* w = static_cast<const T*>(a.weight) + n_begin * a.k + vec * kVec;  // W[n_begin + j, vec*kVec] at w + j*k
  T* d_w = static_cast<T*>(a.d_weight) + n_begin * a.k + vec * kVec;          // d_W likewise
  // ahead[j % kAhead]: W row n_begin + j, raw (bf16 in half the registers).
  // The first kAhead rows are issued before the g slice is waited for.
  ElemVec<T, kVec> ahead[kAhead];
  float xv[kRows][kVec];  // x[t, vec*kVec + e]
  if (active) {
#pragma unroll
    for (int q = 0; q < kAhead; ++q)
      if (q < count) ahead[q].raw = __ldg(reinterpret_cast<const Raw*>(w + q * a.k));
#pragma unroll
    for (int r = 0; r < kRows; ++r)
      if (r < a.rows) load_readonly<T, kVec, true>(static_cast<const T*>(a.x) + r * a.k + vec * kVec, xv[r]);
  }
  // Element i = r * 64 + j of the slice (consecutive threads: consecutive n of
  // one row of g), copied by cp.async: the copies hold no registers and do not
  // wait for one another, so the fill costs one latency per block, which the
  // ring's first loads (already in flight) overlap.
  for (int i = threadIdx.x; i < kChunk * kRows; i += blockDim.x) {
    const int r = i / kChunk, j = i % kChunk;
    if (r < a.rows && j < count)
      __pipeline_memcpy_async(&g_tile[j][r], a.grad + r * a.n + n_begin + j, sizeof(float));
    else
      g_tile[j][r] = 0.0f;
  }
  __pipeline_commit();
  __pipeline_wait_prior(0);
  __syncthreads();
  if (!active) return;
  float acc[kRows][kVec];  // the d_x chains: acc[t][e] for column vec*kVec + e
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[r][e] = 0.0f;
  // kAhead rows per trip, so that every ring index is a constant (registers).
  for (int j0 = 0; j0 < count; j0 += kAhead) {
#pragma unroll
    for (int q = 0; q < kAhead; ++q) {
      const int j = j0 + q;  // W row n = n_begin + j, ascending
      if (j >= count) break;
      float wv[kVec];  // W[n, vec*kVec + e]
      widen(ahead[q], wv);
      if (j + kAhead < count) ahead[q].raw = __ldg(reinterpret_cast<const Raw*>(w + (j + kAhead) * a.k));
      float g[kRows];  // g[t, n]
#pragma unroll
      for (int p = 0; p < kRows / kGPiece; ++p) {
        float piece[kGPiece];  // g[p * kGPiece + e, n]
        load_vec<float, kGPiece>(&g_tile[j][p * kGPiece], piece);
#pragma unroll
        for (int e = 0; e < kGPiece; ++e) g[p * kGPiece + e] = piece[e];
      }
      float dw[kVec];  // d_W[n, vec*kVec + e]
#pragma unroll
      for (int e = 0; e < kVec; ++e) dw[e] = 0.0f;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (r >= a.rows) break;
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          acc[r][e] = num::fma32(g[r], wv[e], acc[r][e]);
          dw[e] = num::fma32(g[r], xv[r][e], dw[e]);
        }
      }
      store_vec<T, kVec>(d_w + j * a.k, dw);
    }
  }
  store_partial_rows<kRows, kVec>(a.partials, chunk, 0, a.rows, a.k, vec, acc);
}

template <typename T, int kRows>
void launch_linear_backward_fused_rows(const LinearFusedArgs& a, unsigned chunks, cudaStream_t stream) {
  constexpr int kVec = fused_vector_elems<T, kRows>();
  const int64_t vectors = a.k / kVec;  // K is a multiple of the 16-byte vector (validated), so of kVec
  const int threads = fused_threads(vectors);
  const dim3 grid(chunks, blocks_for(vectors, threads));
  linear_backward_weight_and_input_partials_kernel<T, kRows, kVec><<<grid, threads, 0, stream>>>(a);
}

// kRows: the smallest of 1, 2, 4, 8 >= T (registers grow with it).
template <typename T>
Status launch_linear_backward_fused(const LinearFusedArgs& a, cudaStream_t stream) {
  const int64_t chunks = (a.n + kLinearChunkRows - 1) / kLinearChunkRows;
  if (chunks == 0 || a.k == 0) return Status();
  const unsigned c = static_cast<unsigned>(chunks);
  if (a.rows <= 1)
    launch_linear_backward_fused_rows<T, 1>(a, c, stream);
  else if (a.rows <= 2)
    launch_linear_backward_fused_rows<T, 2>(a, c, stream);
  else if (a.rows <= 4)
    launch_linear_backward_fused_rows<T, 4>(a, c, stream);
  else
    launch_linear_backward_fused_rows<T, 8>(a, c, stream);
  return launch_status("linear_backward_weight_and_input_partials_kernel");
}

// The most rows of x the fused kernel takes in one pass (its registers: x and
// the d_x chains, 2 * kRows * kVec floats per thread); more rows run the two
// kernels.
constexpr int64_t kFusedMaxRows = 8;

// d_W[n, k..k+3] = R(ascending-t fma chain of grad[t, n] * x[t, k]).
template <typename X, typename Out>
__global__ void linear_backward_weight_kernel(const float* grad, const X* x, Out* d_weight, int64_t rows, int64_t k,
                                              int64_t n) {
  const int64_t quad = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // 4 columns of one row
  const int64_t quads_per_row = k / 4;
  if (quad >= n * quads_per_row) return;
  const int64_t row = quad / quads_per_row;
  const int64_t col = (quad % quads_per_row) * 4;
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int64_t t = 0; t < rows; ++t) {
    const float g = grad[t * n + row];
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[e] = num::fma32(g, to_float(x[t * k + col + e]), acc[e]);
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) d_weight[row * k + col + e] = from_float<Out>(acc[e]);
}

// d_b[n] = R(ascending-t chain of grad[t, n]).
template <typename Out>
__global__ void linear_backward_bias_kernel(const float* grad, Out* d_bias, int64_t rows, int64_t n) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= n) return;
  float acc = 0.0f;
  for (int64_t t = 0; t < rows; ++t) acc = num::add32(acc, grad[t * n + col]);
  d_bias[col] = from_float<Out>(acc);
}

// T in {fp32, bf16}: the linear operand dtypes (validated by src/linear.cc).
template <typename Fn>
Status dispatch_operand(DType dtype, Fn&& fn) {
  if (dtype == DType::kBF16) return fn(Bf16{});
  return fn(float{});
}

}  // namespace

Status linear_forward(const LinearParams& p, Stream stream) {
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.x.device));
  LinearForwardArgs a{p.x.data, p.weight.data, p.bias.present() ? p.bias.data : nullptr, p.out.data,
                      p.pre_activation.present() ? p.pre_activation.ptr<float>() : nullptr,
                      p.x.shape[0], p.x.shape[1], p.weight.shape[0],
                      p.activation == Activation::kSilu, p.numerics == Numerics::kTorch};
  if (a.rows == 0 || a.n == 0) return Status();
  const int columns = launch_tuning().linear_columns_per_warp;
  const bool shared_x = launch_tuning().linear_shared_x;
  return dispatch_operand(p.x.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (p.out.dtype == DType::kF32)
      return launch_linear_forward<T, float>(a, p.x.device.index, columns, shared_x, as_cuda_stream(stream));
    return launch_linear_forward<T, T>(a, p.x.device.index, columns, shared_x, as_cuda_stream(stream));
  });
}

Status linear_backward_input_partials(const LinearBackwardInputParams& p, Stream stream) {
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.weight.device));
  LinearPartialsArgs a{p.grad.ptr<const float>(), p.weight.data, p.partials.ptr<float>(), p.grad.shape[0],
                       p.weight.shape[1], p.weight.shape[0]};
  if (a.rows == 0) return Status();
  return dispatch_operand(p.weight.dtype, [&](auto tag) {
    return launch_linear_backward_input_partials<decltype(tag)>(a, launch_tuning().linear_partial_rows,
                                                                as_cuda_stream(stream));
  });
}

Status linear_backward_fused(const LinearBackwardInputParams& in, const LinearBackwardWeightParams& w, Stream stream,
                             bool* launched) {
  *launched = false;
  // One operand dtype for x, W and d_W (the projection's), every row in one
  // pass, and 16-byte vectors of x and d_W; otherwise the caller runs the two.
  // W's alignment, K a multiple of its vector and T >= 1: validated already.
  const int64_t rows = in.grad.shape[0], n = in.weight.shape[0], k = in.weight.shape[1];
  if (!w.d_weight.present() || w.x.dtype != in.weight.dtype || w.d_weight.dtype != in.weight.dtype ||
      rows > kFusedMaxRows || !address_aligned(w.x.data, 16) || !address_aligned(w.d_weight.data, 16))
    return Status();
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(in.weight.device));
  *launched = true;
  LinearFusedArgs a{in.grad.ptr<const float>(), in.weight.data, w.x.data, in.partials.ptr<float>(),
                    w.d_weight.data, rows, k, n};
  return dispatch_operand(in.weight.dtype, [&](auto tag) {
    return launch_linear_backward_fused<decltype(tag)>(a, as_cuda_stream(stream));
  });
}

Status linear_backward_weight(const LinearBackwardWeightParams& p, Stream stream) {
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.grad.device));
  const int64_t rows = p.grad.shape[0], n = p.grad.shape[1], k = p.x.shape[1];
  const int threads = launch_tuning().elementwise_threads;
  cudaStream_t s = as_cuda_stream(stream);
  if (p.d_weight.present() && n * k > 0) {
    DETDIT_RETURN_IF_ERROR(dispatch_operand(p.x.dtype, [&](auto xtag) {
      using X = decltype(xtag);
      return dispatch_operand(p.d_weight.dtype, [&](auto otag) {
        using Out = decltype(otag);
        linear_backward_weight_kernel<X, Out><<<blocks_for(n * (k / 4), threads), threads, 0, s>>>(
            p.grad.ptr<const float>(), p.x.ptr<const X>(), p.d_weight.ptr<Out>(), rows, k, n);
        return launch_status("linear_backward_weight_kernel");
      });
    }));
  }
  if (p.d_bias.present() && n > 0) {
    DETDIT_RETURN_IF_ERROR(dispatch_operand(p.d_bias.dtype, [&](auto otag) {
      using Out = decltype(otag);
      linear_backward_bias_kernel<Out><<<blocks_for(n, threads), threads, 0, s>>>(p.grad.ptr<const float>(),
                                                                                   p.d_bias.ptr<Out>(), rows, n);
      return launch_status("linear_backward_bias_kernel");
    }));
  }
  return Status();
}

}  // namespace cuda
}  // namespace detdit
