#include "environment.h"

#include <unistd.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <thread>

#include "build_commit.h"  // generated: DETDIT_BUILD_COMMIT, DETDIT_BUILD_DIRTY

#ifdef DETDIT_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace detdit {
namespace cli {
namespace {

std::string version_string(int v) {
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

}  // namespace

int cuda_device_count() {
#ifdef DETDIT_WITH_CUDA
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
#else
  return 0;
#endif
}

Environment collect_environment(const Device& device) {
  Environment env;
  env.commit = DETDIT_BUILD_COMMIT;
  env.dirty = DETDIT_BUILD_DIRTY != 0;
#if defined(__clang__)
  env.compiler = "Clang " __clang_version__;
#elif defined(__GNUC__)
  env.compiler = "GCC " __VERSION__;
#else
  env.compiler = "unknown";
#endif
  env.cuda_runtime = env.cuda_driver = "none";
  env.device_name = "cpu (" + std::to_string(std::thread::hardware_concurrency()) + " threads)";
#ifdef DETDIT_WITH_CUDA
  int v = 0;
  if (cudaRuntimeGetVersion(&v) == cudaSuccess) env.cuda_runtime = version_string(v);
  if (cudaDriverGetVersion(&v) == cudaSuccess && v > 0) env.cuda_driver = version_string(v);
  if (device.is_cuda()) {
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, device.index) == cudaSuccess) {
      env.device_name = device.to_string() + " " + prop.name + " (sm_" + std::to_string(prop.major) +
                        std::to_string(prop.minor) + ")";
    }
  }
  cudaGetLastError();
#else
  (void)device;
  (void)version_string;
#endif
  char host[256] = {0};
  if (::gethostname(host, sizeof host - 1) == 0) env.host = host;
  return env;
}

void record_environment(const Environment& env, nlohmann::ordered_json* report) {
  (*report)["detdit_version"] = DETDIT_VERSION;
  (*report)["git"] = {{"commit", env.commit}, {"dirty", env.dirty}};
  (*report)["environment"] = {{"host", env.host},
                              {"device", env.device_name},
                              {"compiler", env.compiler},
                              {"cuda_runtime", env.cuda_runtime},
                              {"cuda_driver", env.cuda_driver}};
}

}  // namespace cli
}  // namespace detdit
