// Timing on a device, for `detdit bench`: the median of repeated calls (the
// wall clock on the CPU; on CUDA a pair of events on the given stream, so the
// timed work must be enqueued on that stream), the copy bandwidth of a
// device, the baseline of a bench row's "% of copy", an op case's phases
// timed and their outputs checked against a CPU run, and the ranks of a
// parallel region (sp_region, tp_adaln_projection) timed per world size next
// to WS1 (the public single-device op) on the same device.
//
// A parallel region per rank: the median of its timed steps on its own
// stream; a world's time is its slowest rank's median. Under a multi-process
// communicator each rank is a process (the results are all-gathered);
// in-process ranks share one device and are a simulation (they compete for
// it). #wrong: elements of the last timed outputs that differ bitwise from
// WS1's on the same device. A prediction (RegionRun::kPredicted) runs each
// rank of a world alone on the device, one after another, through a
// communicator that moves nothing (PredictionComm); its time is its slowest
// rank's median plus the link model's time for one step's collectives. It is
// not compared with WS1 (the received values are not there). The fold
// chain's serial order across ranks is in the model's collectives, not in the
// compute (each rank's own fold segment is timed, the wait for its
// predecessor's is not).
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "cases/op_case.h"
#include "cases/parallel_cases.h"
#include "detdit/comm.h"
#include "detdit/numerics.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {
namespace cases {

// The median of `repeats` timed calls of `call` (its work on `stream` of
// `device`) after `warmup` untimed ones.
Status time_calls(const Device& device, Stream stream, int warmup, int repeats, const std::function<Status()>& call,
                  double* median_seconds);

// The copy bandwidth of `device` in bytes/s (read + write counted), measured
// now: the median of `repeats` copies of `bytes` after one untimed (memcpy on
// the CPU, a device-to-device copy on `stream` on CUDA).
Status measure_copy_bandwidth(const Device& device, Stream stream, std::size_t bytes, int repeats,
                              double* bytes_per_second);

// ---- parallel regions ---------------------------------------------------------

// The link model of a prediction: a collective of `bytes` per rank costs
// latency + (world - 1) * bytes / bus bandwidth (all_gather) or latency +
// bytes / bus bandwidth (broadcast), nccl-tests' bus-bandwidth convention, one
// after another in the order the region calls them (PredictionComm::link_seconds).
struct LinkModel {
  std::vector<int> worlds;          // the world sizes predicted
  double bus_bytes_per_second = 0;  // bus bandwidth
  double latency_seconds = 0;       // per collective
  std::string source;               // where the two figures come from
};

using Metrics = std::vector<std::pair<std::string, std::vector<double>>>;

// A region as bench times it: how a rank prepares its run (comm == nullptr:
// WS1, the whole problem on the device; a step is the forward, and the
// backward after it for phase "fwd+bwd") and what a rank of a world sends (an
// error: the world cannot split the problem). It owns its problem.
struct TimedRegion {
  std::string op, name, phase;
  std::function<Status(Stream, Communicator*, ParallelRun*)> prepare;
  std::function<Status(int world, Metrics*)> describe;
};
// The regions of a bench case: the sp_region's fwd+bwd of the fused
// gate_residual_rmsnorm (the region every H3 block runs twice); the
// tp_adaln_projection's fwd and fwd+bwd.
Status sp_region_bench_regions(const CaseContext& context, const SpRegionCase& c, const Device& device,
                               std::vector<TimedRegion>* regions);
Status tp_adaln_projection_bench_regions(const CaseContext& context, const TpCase& c, const Device& device,
                                         std::vector<TimedRegion>* regions);

struct RegionTiming {
  Device device;
  int warmup = 0, repeats = 1;
  const LinkModel* predict = nullptr;  // set: the worlds of predict->worlds are predicted
};

// One row of a bench report: one phase of an op case, or one world of a
// parallel region (WS1 included).
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
  Metrics metrics;                // rows / bytes each rank sends, ...
};

// An op case's phases timed on `device` (its default stream): rows fwd, and
// bwd and fwd+bwd where the case has a backward, each with its bytes floor;
// then the outputs of the timed calls compared bitwise with a CPU run of the
// same case (wrong / compared).
Status bench_op_case(const OpCase& c, const Device& device, int warmup, int repeats, std::vector<BenchRow>* rows);

// One row per world of the region: WS1 first (every process of `mpi` times
// its own), then every world of `worlds` (in-process ranks, or `mpi`'s world)
// unless predicting in-process, then every world of timing.predict (each
// process of an MPI world predicts alone on its device). A prediction of a
// world that was also measured records the measurement and its error; a
// world that cannot split the problem is an error row; when WS1 fails nothing
// else is timed.
void time_region(const RegionTiming& timing, Communicator* mpi, const TimedRegion& region, const std::vector<int>& worlds,
                 std::vector<BenchRow>* rows);

// The link model of `comm`'s world, measured on this rank's device (every
// rank calls it): the latency and bus bandwidth of its all-gather.
Status measure_link(const Device& device, Communicator& comm, int warmup, int repeats, LinkModel* link);

}  // namespace cases
}  // namespace detdit
