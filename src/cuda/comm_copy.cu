// Stream-ordered copies and events of the communicators and the parallel ops
// (contract in src/parallel/comm_copy.h). Byte copies and an exact upcast:
// nothing here rounds.
#include <cuda_runtime.h>

#include <string>

#include "common/storage.h"
#include "parallel/comm_copy.h"

namespace detdit {
namespace cuda {
namespace {

Status cuda_failure(const char* what, cudaError_t code) {
  return Status::runtime_error(std::string(what) + " failed: " + cudaGetErrorString(code));
}

// dst (rows, cols) fp32 <- src rows of `row_stride` elements; one thread per element.
template <typename T>
__global__ void upcast_columns_kernel(const T* src, int64_t row_stride, int64_t rows, int64_t cols, float* dst) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * cols) return;
  const int64_t t = i / cols, j = i % cols;
  dst[i] = to_float(src[t * row_stride + j]);
}

}  // namespace

Status comm_event_create(const Device& device, void** event) {
  cudaError_t code = cudaSetDevice(device.index);
  if (code != cudaSuccess) return cuda_failure("cudaSetDevice", code);
  cudaEvent_t e = nullptr;
  code = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  if (code != cudaSuccess) return cuda_failure("cudaEventCreateWithFlags", code);
  *event = e;
  return Status();
}

void comm_event_destroy(void* event) { cudaEventDestroy(static_cast<cudaEvent_t>(event)); }

Status comm_event_record(void* event, Stream stream) {
  cudaError_t code = cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream));
  if (code != cudaSuccess) return cuda_failure("cudaEventRecord", code);
  return Status();
}

Status comm_stream_wait(Stream stream, void* event) {
  cudaError_t code = cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0);
  if (code != cudaSuccess) return cuda_failure("cudaStreamWaitEvent", code);
  return Status();
}

Status comm_copy_async(void* dst, const void* src, std::size_t bytes, Stream stream) {
  if (bytes == 0) return Status();
  cudaError_t code = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream));
  if (code != cudaSuccess) return cuda_failure("cudaMemcpyAsync", code);
  return Status();
}

Status comm_copy_2d_async(void* dst, std::size_t dst_pitch, const void* src, std::size_t src_pitch,
                          std::size_t width, std::size_t height, Stream stream) {
  if (width == 0 || height == 0) return Status();
  cudaError_t code = cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height, cudaMemcpyDeviceToDevice,
                                       static_cast<cudaStream_t>(stream));
  if (code != cudaSuccess) return cuda_failure("cudaMemcpy2DAsync", code);
  return Status();
}

Status comm_columns_to_f32(const void* src, DType src_dtype, int64_t src_row_stride, int64_t rows, int64_t cols,
                           float* dst, Stream stream) {
  const int64_t count = rows * cols;
  if (count == 0) return Status();
  constexpr int kThreads = 256;
  const unsigned blocks = static_cast<unsigned>((count + kThreads - 1) / kThreads);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (src_dtype == DType::kBF16)
    upcast_columns_kernel<<<blocks, kThreads, 0, s>>>(static_cast<const Bf16*>(src), src_row_stride, rows, cols, dst);
  else
    upcast_columns_kernel<<<blocks, kThreads, 0, s>>>(static_cast<const float*>(src), src_row_stride, rows, cols, dst);
  cudaError_t code = cudaGetLastError();
  if (code != cudaSuccess) return cuda_failure("upcast_columns_kernel", code);
  return Status();
}

}  // namespace cuda
}  // namespace detdit
