// tests/support/test_util.h: the bitwise assertion and the CUDA probe.
#include "support/test_util.h"

#if defined(DETDIT_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace detdit {
namespace testing {

::testing::AssertionResult bitwise_equal_bytes(const void* expected, const void* actual, std::size_t count,
                                               DType dtype) {
  const Mismatch m = compare_bytes(expected, actual, static_cast<int64_t>(count), dtype);
  if (m.equal()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << m.describe();
}

::testing::AssertionResult bitwise_equal(const HostTensor& expected, const HostTensor& actual) {
  const Mismatch m = compare(expected, actual);
  if (m.equal()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << m.describe();
}

bool cuda_available(std::string* reason) {
#if defined(DETDIT_WITH_CUDA)
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err == cudaErrorNoDevice || (err == cudaSuccess && count == 0)) {
    *reason = "this machine has no CUDA GPU (cudaGetDeviceCount: " +
              std::string(err == cudaSuccess ? "0 devices" : cudaGetErrorString(err)) + ")";
    return false;
  }
  // What a machine without a GPU answers (no driver is loaded); also a GPU
  // whose driver is older than this CUDA runtime, hence the runtime's words.
  if (err == cudaErrorInsufficientDriver) {
    *reason = std::string("no NVIDIA driver is loaded: no GPU on this machine, or its driver is missing or older "
                          "than this CUDA runtime (cudaGetDeviceCount: ") +
              cudaGetErrorString(err) + ")";
    return false;
  }
  if (err != cudaSuccess) {
    *reason = std::string("cudaGetDeviceCount failed: ") + cudaGetErrorString(err);
    return false;
  }
  return true;
#else
  *reason = "this build has no CUDA backend (nvcc was not found at configure time)";
  return false;
#endif
}

}  // namespace testing
}  // namespace detdit
