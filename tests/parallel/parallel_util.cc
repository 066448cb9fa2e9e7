#include "parallel/parallel_util.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>

#if defined(DETDIT_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

#include "support/rowwise_fixture.h"

namespace detdit {
namespace testing {

#if defined(DETDIT_MPIEXEC)
namespace {
std::string self_path() {
  char buffer[4096];
  const ssize_t length = readlink("/proc/self/exe", buffer, sizeof(buffer) - 1);
  return length > 0 ? std::string(buffer, static_cast<std::size_t>(length)) : std::string();
}

int count_of(const std::string& text, const std::string& needle) {
  int count = 0;
  for (std::size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++count;
  return count;
}
}  // namespace
#endif

DeviceArena::~DeviceArena() {
#if defined(DETDIT_WITH_CUDA)
  for (void* memory : device_memory_) cudaFree(memory);
#endif
}

TensorView DeviceArena::allocate(DType dtype, const std::vector<int64_t>& shape) {
  host_.emplace_back(dtype, shape);
  TensorView view = host_.back().view();
  if (!device_.is_cuda()) return view;
#if defined(DETDIT_WITH_CUDA)
  void* memory = nullptr;
  cudaMalloc(&memory, view.nbytes() > 0 ? view.nbytes() : 1);
  device_memory_.push_back(memory);
  view.data = memory;
  view.device = device_;
#endif
  return view;
}

TensorView DeviceArena::upload(const HostTensor& t) {
  TensorView view = allocate(t.dtype(), t.shape());
#if defined(DETDIT_WITH_CUDA)
  if (device_.is_cuda()) {
    cudaMemcpyAsync(view.data, t.data(), t.nbytes(), cudaMemcpyHostToDevice, static_cast<cudaStream_t>(stream_));
    return view;
  }
#endif
  std::memcpy(view.data, t.data(), t.nbytes());
  return view;
}

TensorView DeviceArena::empty(DType dtype, std::vector<int64_t> shape, uint8_t fill) {
  TensorView view = allocate(dtype, shape);
#if defined(DETDIT_WITH_CUDA)
  if (device_.is_cuda()) {
    cudaMemsetAsync(view.data, fill, view.nbytes(), static_cast<cudaStream_t>(stream_));
    return view;
  }
#endif
  std::memset(view.data, fill, view.nbytes());
  return view;
}

TensorView DeviceArena::empty_like(const HostTensor& t, uint8_t fill) { return empty(t.dtype(), t.shape(), fill); }

HostTensor DeviceArena::download(const TensorView& v) {
  std::vector<int64_t> shape(v.shape, v.shape + v.rank);
  HostTensor out(v.dtype, shape);
#if defined(DETDIT_WITH_CUDA)
  if (v.device.is_cuda()) {
    cudaMemcpyAsync(out.data(), v.data, v.nbytes(), cudaMemcpyDeviceToHost, static_cast<cudaStream_t>(stream_));
    cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
    return out;
  }
#endif
  std::memcpy(out.data(), v.data, v.nbytes());
  return out;
}

Status one_rank_nccl_communicator(std::unique_ptr<Communicator>* comm, NcclOptions options) {
  NcclUniqueId id;
  DETDIT_RETURN_IF_ERROR(nccl_unique_id(&id));
  return create_nccl_communicator_from_id(id, 1, 0, Device::cuda(0), comm, options);
}

Status replayed_as_cuda_graph(Stream stream, const std::function<Status()>& op) {
#if defined(DETDIT_WITH_CUDA)
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  auto failed = [](const char* what, cudaError_t e) {
    return Status::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
  };
  cudaError_t e = cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
  if (e != cudaSuccess) return failed("cudaStreamBeginCapture", e);
  const Status called = op();
  cudaGraph_t graph = nullptr;
  e = cudaStreamEndCapture(s, &graph);  // always ends the capture, also after an error
  if (!called.ok()) {
    if (graph != nullptr) cudaGraphDestroy(graph);
    return Status::runtime_error("inside the capture: " + called.to_string());
  }
  if (e != cudaSuccess) return failed("the capture (a capture-unsafe call inside the op?)", e);
  cudaGraphExec_t exec = nullptr;
  e = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  if (e != cudaSuccess) return failed("cudaGraphInstantiate", e);
  for (int replay = 0; replay < 2 && e == cudaSuccess; ++replay) e = cudaGraphLaunch(exec, s);
  if (e == cudaSuccess) e = cudaStreamSynchronize(s);
  cudaGraphExecDestroy(exec);
  return e == cudaSuccess ? Status() : failed("replaying the graph", e);
#else
  (void)stream;
  (void)op;
  return Status::runtime_error("a CUDA graph needs a CUDA build of detdit");
#endif
}

int cuda_device_count() {
  int count = 0;
#if defined(DETDIT_WITH_CUDA)
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
#endif
  return count;
}

void set_cuda_device(int index) {
#if defined(DETDIT_WITH_CUDA)
  cudaSetDevice(index);
#else
  (void)index;
#endif
}

void expect_every_rank_refused(int world, ErrorKind kind, const std::string& needle,
                               const std::function<Status(Communicator& comm, bool* untouched)>& call) {
  std::vector<Status> results(static_cast<std::size_t>(world));
  // char, not bool: the ranks write their entries from their own threads
  // (std::vector<bool> packs neighbours into one word).
  std::vector<char> untouched(static_cast<std::size_t>(world), 0);
  (void)InProcessGroup::run(world, [&](Communicator& comm) -> Status {
    bool kept = false;
    results[comm.rank()] = call(comm, &kept);
    untouched[comm.rank()] = kept;
    return Status();
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(refused(results[r], kind, needle)) << "rank " << r;
    EXPECT_TRUE(untouched[r]) << "rank " << r << " wrote an output";
  }
}

int launch_under_mpi(int ranks, const std::string& worker_test, int timeout_s, std::string* output) {
  output->clear();
#if defined(DETDIT_MPIEXEC)
  // --oversubscribe: more ranks than the 2 cores of CI; --allow-run-as-root: CI
  // runs as root. The shared-memory transport is enough on one host, without
  // its cross-memory-attach copies (ptrace-restricted in containers). A hung
  // rank ends the run after timeout_s instead of stalling the suite.
  const std::string command = "timeout -k 5 " + std::to_string(timeout_s) + " " + DETDIT_MPIEXEC +
                              " --oversubscribe --allow-run-as-root --mca btl self,vader" +
                              " --mca btl_vader_single_copy_mechanism none" +
                              " -np " + std::to_string(ranks) + " " + self_path() +
                              " --gtest_color=no --gtest_also_run_disabled_tests --gtest_filter=" + worker_test + " 2>&1";
  *output = command + "\n";
  FILE* pipe = popen(command.c_str(), "r");
  if (!pipe) return -1;
  char chunk[4096];
  while (std::size_t n = std::fread(chunk, 1, sizeof(chunk), pipe)) output->append(chunk, n);
  const int status = pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
#else
  (void)ranks;
  (void)worker_test;
  (void)timeout_s;
  *output = "built without MPI";
  return -1;
#endif
}

::testing::AssertionResult run_under_mpi(int ranks, const std::string& worker_test, int timeout_s) {
#if defined(DETDIT_MPIEXEC)
  std::string output;
  const int exit_code = launch_under_mpi(ranks, worker_test, timeout_s, &output);
  const int passed = count_of(output, "[  PASSED  ] 1 test.");
  if (exit_code != 0 || passed != ranks)
    return ::testing::AssertionFailure() << "exit code " << exit_code << ", " << passed << " of " << ranks
                                         << " ranks passed; output:\n"
                                         << output;
  return ::testing::AssertionSuccess() << ranks << " ranks passed";
#else
  (void)ranks;
  (void)worker_test;
  (void)timeout_s;
  return ::testing::AssertionFailure() << "built without MPI";
#endif
}

}  // namespace testing
}  // namespace detdit
