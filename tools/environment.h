// What a report records about where it ran: git state, compiler, CUDA, device.
#pragma once

#include <string>

#include "detdit/tensor.h"

namespace detdit {
namespace cli {

struct Environment {
  std::string commit;        // git rev-parse HEAD of the source tree at run time ("unknown" without git)
  bool dirty = false;        // tracked files modified (git status --porcelain --untracked-files=no)
  std::string build_commit;  // HEAD when the build was configured
  std::string compiler;      // e.g. "GCC 12.2.0"
  std::string cuda_runtime;  // "12.8" or "none" (CPU-only build)
  std::string cuda_driver;   // "12.8" or "none"
  std::string device_name;   // "cpu (2 threads)" or "cuda:0 NVIDIA H200"
  std::string host;
};

Environment collect_environment(const Device& device);

// Number of usable CUDA devices (0 in a CPU-only build or without a GPU).
int cuda_device_count();

}  // namespace cli
}  // namespace detdit
