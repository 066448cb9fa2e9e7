#include "environment.h"

#include <unistd.h>

#include <cstdio>
#include <thread>

#ifdef DETDIT_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#ifndef DETDIT_SOURCE_DIR
#define DETDIT_SOURCE_DIR "."
#endif
#ifndef DETDIT_BUILD_COMMIT
#define DETDIT_BUILD_COMMIT "unknown"
#endif

namespace detdit {
namespace cli {
namespace {

// The first line of a command's stdout ("" when it fails).
std::string command_output(const std::string& command, bool* any_output = nullptr) {
  std::FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return "";
  std::string out;
  char buffer[256];
  while (std::fgets(buffer, sizeof buffer, pipe) != nullptr) out += buffer;
  int rc = ::pclose(pipe);
  if (any_output != nullptr) *any_output = !out.empty();
  if (rc != 0) return "";
  std::size_t newline = out.find('\n');
  return newline == std::string::npos ? out : out.substr(0, newline);
}

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
  const std::string git = std::string("git -C '") + DETDIT_SOURCE_DIR + "' ";
  env.commit = command_output(git + "rev-parse HEAD 2>/dev/null");
  if (env.commit.empty()) env.commit = "unknown";
  bool any = false;
  command_output(git + "status --porcelain --untracked-files=no 2>/dev/null", &any);
  env.dirty = any;
  env.build_commit = DETDIT_BUILD_COMMIT;
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

}  // namespace cli
}  // namespace detdit
