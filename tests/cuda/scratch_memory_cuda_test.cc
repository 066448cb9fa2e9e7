// detdit's CUDA scratch pool (include/detdit/memory.h): the memory a freed
// temporary used stays mapped across a host synchronisation (so the next call
// does not map it again), release_scratch_memory hands it back, and the first
// scratch of a process may be taken inside a stream capture. Observed
// through the pool's own mapped bytes (cuda::scratch_reserved_bytes), which
// other processes on the GPU do not move.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "common/backends.h"
#include "common/scratch.h"
#include "cuda/cuda_test_util.h"
#include "detdit/memory.h"

namespace detdit {
namespace testing {
namespace {

constexpr std::size_t kScratchBytes = std::size_t(256) << 20;

uint64_t reserved(const Device& device) {
  uint64_t bytes = 0;
  const Status s = cuda::scratch_reserved_bytes(device, &bytes);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return bytes;
}

// A temporary of kScratchBytes, written, then freed on the default stream.
void use_scratch(const Device& device) {
  std::shared_ptr<void> owner;
  const Status s = allocate_scratch(device, kScratchBytes, nullptr, &owner);
  ASSERT_TRUE(s.ok()) << s.to_string();
  DETDIT_CUDA_CHECK(cudaMemsetAsync(owner.get(), 0, kScratchBytes, nullptr));
}

TEST(ScratchMemoryCuda, AFreedTemporaryStaysMappedUntilReleased) {
  DETDIT_SKIP_WITHOUT_CUDA();
  const Device device = Device::cuda(0);
  DETDIT_CUDA_CHECK(cudaDeviceSynchronize());
  ASSERT_TRUE(release_scratch_memory(device).ok());
  EXPECT_EQ(reserved(device), 0u) << "nothing is allocated, yet the released pool keeps memory";

  use_scratch(device);
  // The device's default pool would give the memory back here (release threshold 0).
  DETDIT_CUDA_CHECK(cudaDeviceSynchronize());
  const uint64_t kept = reserved(device);
  EXPECT_GE(kept, kScratchBytes) << "the freed scratch was unmapped at the synchronisation";

  use_scratch(device);  // maps nothing new
  DETDIT_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(reserved(device), kept);

  const Status released = release_scratch_memory(device);
  ASSERT_TRUE(released.ok()) << released.to_string();
  EXPECT_EQ(reserved(device), 0u) << "release_scratch_memory left " << reserved(device) << " bytes mapped";
}

// ctest runs each test in its own process, so this capture takes the process's
// first scratch: the pool is made while the stream captures in global mode.
TEST(ScratchMemoryCuda, TheFirstScratchMayBeTakenInsideACapture) {
  DETDIT_SKIP_WITHOUT_CUDA();
  const Device device = Device::cuda(0);
  cudaStream_t stream = nullptr;
  DETDIT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  DETDIT_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  Status taken;
  {
    std::shared_ptr<void> owner;
    taken = allocate_scratch(device, kScratchBytes, stream, &owner);
    if (taken.ok()) {
      EXPECT_EQ(cudaMemsetAsync(owner.get(), 0, kScratchBytes, stream), cudaSuccess);
    }
  }  // the free is captured too
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
  ASSERT_TRUE(taken.ok()) << taken.to_string();
  ASSERT_EQ(ended, cudaSuccess) << cudaGetErrorString(ended);
  cudaGraphExec_t exec = nullptr;
  DETDIT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  DETDIT_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  DETDIT_CUDA_CHECK(cudaStreamSynchronize(stream));
  DETDIT_CUDA_CHECK(cudaGraphExecDestroy(exec));
  DETDIT_CUDA_CHECK(cudaGraphDestroy(graph));
  DETDIT_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(ScratchMemoryCuda, ABadOrdinalIsARuntimeError) {
  DETDIT_SKIP_WITHOUT_CUDA();
  int count = 0;
  DETDIT_CUDA_CHECK(cudaGetDeviceCount(&count));
  const Status s = release_scratch_memory(Device::cuda(count));
  EXPECT_EQ(s.kind(), ErrorKind::kRuntime) << s.to_string();
  EXPECT_NE(s.message().find("release_scratch_memory(cuda:" + std::to_string(count) + ")"), std::string::npos)
      << s.to_string();
}

}  // namespace
}  // namespace testing
}  // namespace detdit
