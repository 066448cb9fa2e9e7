// Bench timers and the copy-bandwidth baseline for the CPU (steady clock,
// memcpy) and CUDA (events on the context's stream, device-to-device copy).
#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#include "bench.h"

#ifdef DETDIT_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace detdit {
namespace cli {
namespace {

class CpuTimer : public BenchTimer {
 public:
  Status start() override {
    start_ = std::chrono::steady_clock::now();
    return Status::ok_status();
  }
  Status stop(double* seconds) override {
    *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    return Status::ok_status();
  }

 private:
  std::chrono::steady_clock::time_point start_;
};

#ifdef DETDIT_WITH_CUDA
Status cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::ok_status();
  return Status::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

class CudaTimer : public BenchTimer {
 public:
  explicit CudaTimer(Stream stream) : stream_(static_cast<cudaStream_t>(stream)) {
    cudaEventCreate(&begin_);
    cudaEventCreate(&end_);
  }
  ~CudaTimer() override {
    cudaEventDestroy(begin_);
    cudaEventDestroy(end_);
  }
  Status start() override { return cuda_status(cudaEventRecord(begin_, stream_), "cudaEventRecord"); }
  Status stop(double* seconds) override {
    DETDIT_RETURN_IF_ERROR(cuda_status(cudaEventRecord(end_, stream_), "cudaEventRecord"));
    DETDIT_RETURN_IF_ERROR(cuda_status(cudaEventSynchronize(end_), "cudaEventSynchronize"));
    float ms = 0;
    DETDIT_RETURN_IF_ERROR(cuda_status(cudaEventElapsedTime(&ms, begin_, end_), "cudaEventElapsedTime"));
    *seconds = ms * 1e-3;
    return Status::ok_status();
  }

 private:
  cudaStream_t stream_;
  cudaEvent_t begin_, end_;
};
#endif

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

Status make_bench_timer(const BenchContext& context, std::unique_ptr<BenchTimer>* timer) {
  if (!context.device.is_cuda()) {
    timer->reset(new CpuTimer());
    return Status::ok_status();
  }
#ifdef DETDIT_WITH_CUDA
  timer->reset(new CudaTimer(context.stream));
  return Status::ok_status();
#else
  return Status::runtime_error("CUDA timing needs a CUDA build of detdit");
#endif
}

Status measure_copy_bandwidth(const BenchContext& context, std::size_t bytes, int repeats, double* bytes_per_second) {
  std::unique_ptr<BenchTimer> timer;
  DETDIT_RETURN_IF_ERROR(make_bench_timer(context, &timer));
  std::vector<double> times;
  if (!context.device.is_cuda()) {
    std::vector<unsigned char> src(bytes, 1), dst(bytes, 0);  // touched: no first-use page faults in the timing
    for (int i = 0; i < repeats + 1; ++i) {
      double seconds = 0;
      DETDIT_RETURN_IF_ERROR(timer->start());
      std::memcpy(dst.data(), src.data(), bytes);
      DETDIT_RETURN_IF_ERROR(timer->stop(&seconds));
      if (i > 0) times.push_back(seconds);  // the first copy is a warm-up
    }
  } else {
#ifdef DETDIT_WITH_CUDA
    void *src = nullptr, *dst = nullptr;
    DETDIT_RETURN_IF_ERROR(cuda_status(cudaMalloc(&src, bytes), "cudaMalloc"));
    Status status = cuda_status(cudaMalloc(&dst, bytes), "cudaMalloc");
    for (int i = 0; status.ok() && i < repeats + 1; ++i) {
      double seconds = 0;
      status = timer->start();
      if (status.ok()) {
        status = cuda_status(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice,
                                             static_cast<cudaStream_t>(context.stream)),
                             "cudaMemcpyAsync");
      }
      if (status.ok()) status = timer->stop(&seconds);
      if (i > 0) times.push_back(seconds);
    }
    cudaFree(src);
    cudaFree(dst);
    DETDIT_RETURN_IF_ERROR(status);
#endif
  }
  *bytes_per_second = 2.0 * static_cast<double>(bytes) / median(times);
  return Status::ok_status();
}

}  // namespace cli
}  // namespace detdit
