// detdit bench (bench.cc): the op cases of the op-case library (cases/,
// Suite::kBench) timed forward, backward and both, each checked bitwise
// against the CPU reference (#wrong), with the bytes floor of each case; and
// the parallel regions (bench_parallel.cc), simulated in-process, measured
// under --comm mpi or predicted (--predict-world). Timing is cases/timing.h's.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "detdit/comm.h"
#include "detdit/status.h"
#include "detdit/tensor.h"
#include "progress.h"
#include "io/weights.h"

namespace detdit {
namespace cli {

// The link model of a prediction (--predict-world): a collective of `bytes`
// per rank costs latency + (world - 1) * bytes / bus bandwidth (all_gather) or
// latency + bytes / bus bandwidth (broadcast), nccl-tests' bus-bandwidth
// convention, one after another in the order the region calls them
// (cases::PredictionComm::link_seconds).
struct LinkModel {
  std::vector<int> worlds;          // the world sizes predicted
  double bus_bytes_per_second = 0;  // bus bandwidth
  double latency_seconds = 0;       // per collective
  std::string source;               // where the two figures come from
};

// What every timed call of a run shares. The op cases run on the device's
// default stream; each rank of a parallel region on a stream of its own.
struct BenchContext {
  Device device;
  int warmup = 0, repeats = 1;
  bool quick = false;
  const io::Weights* weights = nullptr;
  uint64_t seed = 0;
  const LinkModel* predict = nullptr;  // set: the parallel regions are predicted, not simulated
};

// One row of the report: one phase of an op case, or one world of a parallel
// region (WS1 included).
struct BenchRow {
  BenchRow() = default;
  BenchRow(std::string op_, std::string name_, std::string phase_, bool parallel_)
      : op(std::move(op_)), name(std::move(name_)), phase(std::move(phase_)), parallel(parallel_) {}

  std::string op, name, phase;  // "sp_region", "S=32768 block", "fwd+bwd"
  double median_seconds = 0;    // a region: its slowest rank's (predicted: plus the link model's time)
  int64_t wrong = 0, compared = 0;  // elements vs the CPU reference (an op case) or WS1 on the same device
  std::string error;
  // An op case: its bytes floor and the tensors it counts.
  double bytes = 0;
  std::string byte_model;
  // A parallel region.
  bool parallel = false;
  int world = 1;
  bool ws1 = false;             // the public single-device ops on the whole problem
  bool simulated = true;        // in-process ranks sharing one device
  bool predicted = false;       // each rank alone on the device + the link model (not checked)
  std::vector<double> rank_medians;
  double ws1_median_seconds = 0;  // WS1 on the same device in the same run
  std::vector<std::pair<std::string, std::vector<double>>> metrics;  // rows / bytes each rank sends, ...
};

// ---- parallel regions (bench_parallel.cc) -------------------------------------

bool is_parallel_op(const std::string& op);  // sp_region, tp_adaln_projection
// mpi: this process's rank of a --comm mpi run (nullptr: in-process ranks on
// context.device). ops / names filter (empty: all). Each (op, case, phase)
// timed is reported to `progress`; parallel_bench_count says how many there are.
std::size_t parallel_bench_count(const BenchContext& context, const std::set<std::string>& ops,
                                 const std::set<std::string>& names);
Status run_parallel_bench(const BenchContext& context, Communicator* mpi, const std::set<std::string>& ops,
                          const std::set<std::string>& names, Progress* progress, std::vector<BenchRow>* rows);
// The link model of `comm`'s world, measured on this rank's device (every
// rank calls it): the latency and bus bandwidth of its all-gather.
Status measure_link(const BenchContext& context, Communicator& comm, int warmup, int repeats, LinkModel* link);

}  // namespace cli
}  // namespace detdit
