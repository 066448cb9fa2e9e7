// release_scratch_memory on the CPU (include/detdit/memory.h): host scratch
// has no pool, so there is nothing to release and the call succeeds; the CUDA
// side is tests/cuda/scratch_memory_cuda_test.cc.
#include <gtest/gtest.h>

#include "detdit/memory.h"

namespace detdit {
namespace {

TEST(ScratchMemory, TheCpuHasNoPoolAndReleasingSucceeds) {
  const Status s = release_scratch_memory(Device::cpu());
  EXPECT_TRUE(s.ok()) << s.to_string();
}

}  // namespace
}  // namespace detdit
