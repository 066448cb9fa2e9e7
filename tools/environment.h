// What a report records about where it ran and what ran: the commit built,
// compiler, CUDA runtime and driver, device, host.
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <string>

#include "detdit/tensor.h"

namespace detdit {
namespace cli {

struct Environment {
  // The git state of the source tree when this binary was built
  // (tools/build_commit.cmake): HEAD, or "unknown" where the source was no git
  // clone (then dirty is false); dirty: tracked files differed from HEAD.
  std::string commit;
  bool dirty = false;
  std::string compiler;      // e.g. "GCC 12.2.0"
  std::string cuda_runtime;  // "12.8" or "none" (CPU-only build)
  std::string cuda_driver;   // "12.8" or "none"
  std::string device_name;   // "cpu (2 threads)" or "cuda:0 NVIDIA H200"
  std::string host;
};

Environment collect_environment(const Device& device);

// The part every JSON report (verify, bench) shares: "detdit_version",
// "git": {"commit", "dirty"} and "environment": {"host", "device", "compiler",
// "cuda_runtime", "cuda_driver"} ("none" where a CPU-only build or a machine
// without a driver has none).
void record_environment(const Environment& env, nlohmann::ordered_json* report);

// Number of usable CUDA devices (0 in a CPU-only build or without a GPU).
int cuda_device_count();

}  // namespace cli
}  // namespace detdit
