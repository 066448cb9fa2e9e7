// Timing on the CPU (steady clock, memcpy) and on CUDA (events on the
// caller's stream, a device-to-device copy).
#include "cases/timing.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "cases/tensor.h"

#ifdef DETDIT_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace detdit {
namespace cases {
namespace {

#ifdef DETDIT_WITH_CUDA
Status cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::ok_status();
  return Status::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}
#endif

// The time of one call: the steady clock on the CPU; on CUDA the time between
// two events on the stream (stop waits for the work to finish).
class Timer {
 public:
  Timer(const Device& device, Stream stream) : cuda_(device.is_cuda()), stream_(stream) {
#ifdef DETDIT_WITH_CUDA
    if (cuda_) {
      cudaEventCreate(&begin_);
      cudaEventCreate(&end_);
    }
#endif
  }
  ~Timer() {
#ifdef DETDIT_WITH_CUDA
    if (cuda_) {
      cudaEventDestroy(begin_);
      cudaEventDestroy(end_);
    }
#endif
  }
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;

  Status start() {
    if (!cuda_) {
      start_ = std::chrono::steady_clock::now();
      return Status::ok_status();
    }
#ifdef DETDIT_WITH_CUDA
    return cuda_status(cudaEventRecord(begin_, static_cast<cudaStream_t>(stream_)), "cudaEventRecord");
#else
    return Status::runtime_error("CUDA timing needs a CUDA build of detdit");
#endif
  }
  Status stop(double* seconds) {
    if (!cuda_) {
      *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
      return Status::ok_status();
    }
#ifdef DETDIT_WITH_CUDA
    DETDIT_RETURN_IF_ERROR(cuda_status(cudaEventRecord(end_, static_cast<cudaStream_t>(stream_)), "cudaEventRecord"));
    DETDIT_RETURN_IF_ERROR(cuda_status(cudaEventSynchronize(end_), "cudaEventSynchronize"));
    float ms = 0;
    DETDIT_RETURN_IF_ERROR(cuda_status(cudaEventElapsedTime(&ms, begin_, end_), "cudaEventElapsedTime"));
    *seconds = ms * 1e-3;
    return Status::ok_status();
#else
    return Status::runtime_error("CUDA timing needs a CUDA build of detdit");
#endif
  }

 private:
  bool cuda_;
  Stream stream_;
  std::chrono::steady_clock::time_point start_;
#ifdef DETDIT_WITH_CUDA
  cudaEvent_t begin_ = nullptr, end_ = nullptr;
#endif
};

}  // namespace

Status time_calls(const Device& device, Stream stream, int warmup, int repeats, const std::function<Status()>& call,
                  double* median_seconds) {
  Timer timer(device, stream);
  std::vector<double> times;
  for (int i = 0; i < warmup + repeats; ++i) {
    double seconds = 0;
    DETDIT_RETURN_IF_ERROR(timer.start());
    DETDIT_RETURN_IF_ERROR(call());
    DETDIT_RETURN_IF_ERROR(timer.stop(&seconds));
    if (i >= warmup) times.push_back(seconds);
  }
  std::sort(times.begin(), times.end());
  *median_seconds = times[times.size() / 2];
  return Status::ok_status();
}

Status measure_copy_bandwidth(const Device& device, Stream stream, std::size_t bytes, int repeats,
                              double* bytes_per_second) {
  // Both buffers are written when made (the canary): no first-use page fault is timed.
  DeviceTensor src, dst;
  const std::vector<int64_t> shape = {static_cast<int64_t>((bytes + 3) / 4)};
  DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(DType::kF32, shape, device, &src, stream));
  DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(DType::kF32, shape, device, &dst, stream));
  auto copy = [&]() -> Status {
    if (!device.is_cuda()) {
      std::memcpy(dst.view().data, src.view().data, bytes);
      return Status::ok_status();
    }
#ifdef DETDIT_WITH_CUDA
    return cuda_status(cudaMemcpyAsync(dst.view().data, src.view().data, bytes, cudaMemcpyDeviceToDevice,
                                       static_cast<cudaStream_t>(stream)),
                       "cudaMemcpyAsync");
#else
    return Status::runtime_error("a CUDA copy needs a CUDA build of detdit");
#endif
  };
  double seconds = 0;
  DETDIT_RETURN_IF_ERROR(time_calls(device, stream, 1, repeats, copy, &seconds));
  *bytes_per_second = 2.0 * static_cast<double>(bytes) / seconds;
  return Status::ok_status();
}

}  // namespace cases
}  // namespace detdit
