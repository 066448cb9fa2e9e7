// detdit bench: the op cases of the op-case library (cases/, Suite::kBench)
// timed forward, backward and both, each checked bitwise against the CPU
// reference (#wrong), with the bytes floor of each case; and the parallel
// regions (bench_parallel.cc).
//
// Timing: BenchTimer measures one call. On the CPU it is the wall clock; on
// CUDA it is a pair of CUDA events on the stream (bench_timer.cc), so timed
// work must only be enqueued on context.stream.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "detdit/comm.h"
#include "detdit/numerics.h"
#include "detdit/status.h"
#include "detdit/tensor.h"
#include "progress.h"
#include "io/weights.h"

namespace detdit {
namespace cli {

// The link model of a prediction (--predict-world): a collective of `bytes`
// per rank costs latency + (world - 1) * bytes / bus bandwidth (all_gather) or
// latency + bytes / bus bandwidth (broadcast), nccl-tests' bus-bandwidth
// convention, one after another in the order the region calls them.
struct LinkModel {
  std::vector<int> worlds;          // the world sizes predicted
  double bus_bytes_per_second = 0;  // bus bandwidth
  double latency_seconds = 0;       // per collective
  std::string source;               // where the two figures come from
};

struct BenchContext {
  Device device;
  Stream stream = nullptr;
  bool quick = false;
  const io::Weights* weights = nullptr;
  uint64_t seed = 0;
  const LinkModel* predict = nullptr;  // set: the parallel regions are predicted, not simulated
};

// Times one call on the context's device.
class BenchTimer {
 public:
  virtual ~BenchTimer() = default;
  virtual Status start() = 0;
  virtual Status stop(double* seconds) = 0;  // waits for the work to finish
};
Status make_bench_timer(const BenchContext& context, std::unique_ptr<BenchTimer>* timer);
// The median of `repeats` timed calls of `call` (on context.stream) after `warmup` untimed ones.
Status time_calls(const BenchContext& context, int warmup, int repeats, const std::function<Status()>& call,
                  double* median_seconds);

// ---- parallel regions (bench_parallel.cc) -------------------------------------
// Not registry cases: each times WS1 and several world sizes in one go.

struct ParallelBenchResult {
  std::string op, name, phase;  // "sp_region", "S=32768 block", "fwd+bwd"
  int world = 1;
  bool ws1 = false;             // the public single-device ops on the whole problem
  bool simulated = true;        // in-process ranks sharing one device
  bool predicted = false;       // each rank alone on the device + the link model (not checked: #wrong 0 of 0)
  double median_seconds = 0;    // the slowest rank's median (predicted: plus the link model's time)
  std::vector<double> rank_medians;
  double ws1_median_seconds = 0;  // WS1 on the same device in the same run
  std::vector<std::pair<std::string, std::vector<double>>> metrics;  // rows / bytes each rank sends
  int64_t wrong = 0, compared = 0;  // elements vs WS1's outputs on the same device
  std::string error;
};

// A target of docs/design.md: measured_speedup = WS1 time / world time (NaN
// when this run did not measure it).
struct ParallelTarget {
  std::string target;
  double required_speedup = 0;
  double measured_speedup = std::numeric_limits<double>::quiet_NaN();
  bool simulated = true;
  bool predicted = false;
};

bool is_parallel_op(const std::string& op);  // sp_region, tp_adaln_projection
// mpi: this process's rank of a --comm mpi run (nullptr: in-process ranks on
// context.device). ops / names filter (empty: all). Each (op, case, phase)
// timed is reported to `progress`; parallel_bench_count says how many there are.
std::size_t parallel_bench_count(const BenchContext& context, const std::set<std::string>& ops,
                                 const std::set<std::string>& names);
Status run_parallel_bench(const BenchContext& context, Communicator* mpi, int warmup, int repeats,
                          const std::set<std::string>& ops, const std::set<std::string>& names, Progress* progress,
                          std::vector<ParallelBenchResult>* results);
std::vector<ParallelTarget> parallel_targets(const std::vector<ParallelBenchResult>& results);
// The link model of `comm`'s world, measured on this rank's device (every
// rank calls it): the latency and bus bandwidth of its all-gather.
Status measure_link(const BenchContext& context, Communicator& comm, int warmup, int repeats, LinkModel* link);

// Copy bandwidth of the device in bytes/s (read + write counted), measured now:
// memcpy on the CPU, a device-to-device copy on CUDA; median of `repeats`.
Status measure_copy_bandwidth(const BenchContext& context, std::size_t bytes, int repeats, double* bytes_per_second);

}  // namespace cli
}  // namespace detdit
