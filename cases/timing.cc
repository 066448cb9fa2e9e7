// Timing on the CPU (steady clock, memcpy) and on CUDA (events on the
// caller's stream, a device-to-device copy).
#include "cases/timing.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cases/tensor.h"
#include "detdit/parallel.h"

#ifdef DETDIT_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace detdit {
namespace cases {
namespace {

#ifdef DETDIT_WITH_CUDA
Status cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::ok_status();
  return Status::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}
#endif

// The time of one call: the steady clock on the CPU; on CUDA the time between
// two events on the stream (stop waits for the work to finish).
class Timer {
 public:
  Timer(const Device& device, Stream stream) : cuda_(device.is_cuda()), stream_(stream) {
#ifdef DETDIT_WITH_CUDA
    if (cuda_) {
      cudaEventCreate(&begin_);
      cudaEventCreate(&end_);
    }
#endif
  }
  ~Timer() {
#ifdef DETDIT_WITH_CUDA
    if (cuda_) {
      cudaEventDestroy(begin_);
      cudaEventDestroy(end_);
    }
#endif
  }
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;

  Status start() {
    if (!cuda_) {
      start_ = std::chrono::steady_clock::now();
      return Status::ok_status();
    }
#ifdef DETDIT_WITH_CUDA
    return cuda_status(cudaEventRecord(begin_, static_cast<cudaStream_t>(stream_)), "cudaEventRecord");
#else
    return Status::runtime_error("CUDA timing needs a CUDA build of detdit");
#endif
  }
  Status stop(double* seconds) {
    if (!cuda_) {
      *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
      return Status::ok_status();
    }
#ifdef DETDIT_WITH_CUDA
    DETDIT_RETURN_IF_ERROR(cuda_status(cudaEventRecord(end_, static_cast<cudaStream_t>(stream_)), "cudaEventRecord"));
    DETDIT_RETURN_IF_ERROR(cuda_status(cudaEventSynchronize(end_), "cudaEventSynchronize"));
    float ms = 0;
    DETDIT_RETURN_IF_ERROR(cuda_status(cudaEventElapsedTime(&ms, begin_, end_), "cudaEventElapsedTime"));
    *seconds = ms * 1e-3;
    return Status::ok_status();
#else
    return Status::runtime_error("CUDA timing needs a CUDA build of detdit");
#endif
  }

 private:
  bool cuda_;
  Stream stream_;
  std::chrono::steady_clock::time_point start_;
#ifdef DETDIT_WITH_CUDA
  cudaEvent_t begin_ = nullptr, end_ = nullptr;
#endif
};

}  // namespace

Status time_calls(const Device& device, Stream stream, int warmup, int repeats, const std::function<Status()>& call,
                  double* median_seconds) {
  Timer timer(device, stream);
  std::vector<double> times;
  for (int i = 0; i < warmup + repeats; ++i) {
    double seconds = 0;
    DETDIT_RETURN_IF_ERROR(timer.start());
    DETDIT_RETURN_IF_ERROR(call());
    DETDIT_RETURN_IF_ERROR(timer.stop(&seconds));
    if (i >= warmup) times.push_back(seconds);
  }
  std::sort(times.begin(), times.end());
  *median_seconds = times[times.size() / 2];
  return Status::ok_status();
}

Status measure_copy_bandwidth(const Device& device, Stream stream, std::size_t bytes, int repeats,
                              double* bytes_per_second) {
  // Both buffers are written when made (the canary): no first-use page fault is timed.
  DeviceTensor src, dst;
  const std::vector<int64_t> shape = {static_cast<int64_t>((bytes + 3) / 4)};
  DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(DType::kF32, shape, device, &src, stream));
  DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(DType::kF32, shape, device, &dst, stream));
  auto copy = [&]() -> Status {
    if (!device.is_cuda()) {
      std::memcpy(dst.view().data, src.view().data, bytes);
      return Status::ok_status();
    }
#ifdef DETDIT_WITH_CUDA
    return cuda_status(cudaMemcpyAsync(dst.view().data, src.view().data, bytes, cudaMemcpyDeviceToDevice,
                                       static_cast<cudaStream_t>(stream)),
                       "cudaMemcpyAsync");
#else
    return Status::runtime_error("a CUDA copy needs a CUDA build of detdit");
#endif
  };
  double seconds = 0;
  DETDIT_RETURN_IF_ERROR(time_calls(device, stream, 1, repeats, copy, &seconds));
  *bytes_per_second = 2.0 * static_cast<double>(bytes) / seconds;
  return Status::ok_status();
}

// ---- parallel regions ---------------------------------------------------------

Status sp_region_bench_regions(const CaseContext& context, const SpRegionCase& c, const Device& device,
                               std::vector<TimedRegion>* regions) {
  auto pr = std::make_shared<SpProblem>();
  DETDIT_RETURN_IF_ERROR(make_sp_problem(context, c.shape, pr.get()));
  auto index = std::make_shared<SpIndex>();
  DETDIT_RETURN_IF_ERROR(make_sp_index(*pr, device, index.get()));
  TimedRegion region{"sp_region", c.name, "fwd+bwd", nullptr, nullptr};
  region.prepare = [pr, index, device](Stream stream, Communicator* comm, ParallelRun* run) {
    SpPlan sp;
    if (comm != nullptr) DETDIT_RETURN_IF_ERROR(SpPlan::create(index->plan, comm->world_size(), comm->rank(), &sp, stream));
    return prepare_sp_run(*pr, *index, SpVariant::kGateResidualRmsnorm, device, stream, comm != nullptr ? &sp : nullptr,
                          comm, run);
  };
  const int64_t hidden = c.shape.hidden;
  region.describe = [index, hidden](int world, Metrics* metrics) {
    SpPlan sp;
    DETDIT_RETURN_IF_ERROR(SpPlan::create(index->plan, world, 0, &sp));
    metrics->push_back({"send_rows_per_rank", sp_send_rows_per_rank(sp)});
    metrics->push_back({"bytes_sent_per_rank", {sp_backward_bytes_per_rank(sp, SpVariant::kGateResidualRmsnorm, hidden)}});
    return Status::ok_status();
  };
  regions->push_back(std::move(region));
  return Status::ok_status();
}

Status tp_adaln_projection_bench_regions(const CaseContext& context, const TpCase& c, const Device& device,
                                         std::vector<TimedRegion>* regions) {
  auto pr = std::make_shared<TpProblem>();
  DETDIT_RETURN_IF_ERROR(make_tp_problem(context, c.shape, pr.get()));
  auto weights = std::make_shared<TpWeights>();
  DETDIT_RETURN_IF_ERROR(upload_tp_weights(*pr, device, weights.get()));
  for (const std::string phase : {"fwd", "fwd+bwd"}) {
    TimedRegion region{"tp_adaln_projection", c.name, phase, nullptr, nullptr};
    region.prepare = [pr, weights, device](Stream stream, Communicator* comm, ParallelRun* run) {
      return prepare_tp_run(*pr, *weights, device, stream, comm, run);
    };
    // A world that cannot split N (more ranks than 64-column chunks) is an error.
    const TpShape shape = c.shape;
    region.describe = [shape, phase](int world, Metrics* metrics) {
      double forward = 0, backward = 0;
      DETDIT_RETURN_IF_ERROR(tp_bytes_sent_per_rank(shape, world, &forward, &backward));
      metrics->push_back({"bytes_sent_per_rank", {forward + (phase == "fwd+bwd" ? backward : 0)}});
      return Status::ok_status();
    };
    regions->push_back(std::move(region));
  }
  return Status::ok_status();
}

namespace {

// One rank's result.
struct RankTiming {
  double median = 0;  // NaN: the rank failed
  double wrong = 0, compared = 0;
  double link_seconds = 0, link_bytes = 0, collectives = 0;  // a prediction's collectives of one step
};
enum class RegionRun { kWs1, kMeasured, kPredicted };

double slowest(const std::vector<RankTiming>& ranks) {
  double worst = 0;
  for (const RankTiming& r : ranks) worst = std::max(worst, r.median);
  return worst;
}

// Every rank's result over `comm` into *all (rank order). Every rank takes
// part, a failed one (`local` not OK) sending a NaN median, so none waits
// forever; the result is `local`'s error, the exchange's, or "`what` failed
// on rank q" for the first rank that sent NaN.
Status gather_ranks(Communicator& comm, const Status& local, RankTiming mine, const std::string& what,
                    std::vector<RankTiming>* all) {
  if (!local.ok()) mine.median = std::nan("");
  std::vector<char> bytes;
  const Status gathered = gather_host_bytes(comm, &mine, sizeof mine, &bytes);
  DETDIT_RETURN_IF_ERROR(local);
  DETDIT_RETURN_IF_ERROR(gathered);
  all->resize(static_cast<std::size_t>(comm.world_size()));
  std::memcpy(all->data(), bytes.data(), all->size() * sizeof mine);
  for (int q = 0; q < comm.world_size(); ++q) {
    if (std::isnan((*all)[q].median)) return Status::runtime_error(what + " failed on rank " + std::to_string(q));
  }
  return Status::ok_status();
}

// One rank: its run prepared on a stream of its own through `comm` (nullptr:
// WS1) and the median of its timed steps; then WS1 keeps its outputs (*ws1),
// a prediction's rank runs one more step (its collectives are the link
// model's input), and a measured rank counts the elements of its outputs that
// differ bitwise from WS1's (its part of sharded ones; compare_with_ws1).
Status time_rank(const RegionTiming& timing, const TimedRegion& region, Communicator* comm,
                 std::vector<HostTensor>* ws1, RankTiming* result) {
  RankStream stream(timing.device);
  ParallelRun run;
  DETDIT_RETURN_IF_ERROR(region.prepare(stream.get(), comm, &run));
  auto step = [&]() -> Status {
    DETDIT_RETURN_IF_ERROR(run.forward());
    return region.phase == "fwd+bwd" ? run.backward() : Status::ok_status();
  };
  DETDIT_RETURN_IF_ERROR(time_calls(timing.device, stream.get(), timing.warmup, timing.repeats, step, &result->median));
  if (comm == nullptr) {
    ws1->resize(run.outputs.size());
    for (std::size_t i = 0; i < ws1->size(); ++i)
      DETDIT_RETURN_IF_ERROR(run.outputs[i].tensor.to_host(&(*ws1)[i], stream.get()));
    return Status::ok_status();
  }
  if (auto* predicting = dynamic_cast<PredictionComm*>(comm)) {
    predicting->calls.clear();
    DETDIT_RETURN_IF_ERROR(step());
    result->link_seconds = predicting->link_seconds(timing.predict->bus_bytes_per_second,
                                                    timing.predict->latency_seconds, &result->link_bytes);
    result->collectives = static_cast<double>(predicting->calls.size());
    return Status::ok_status();
  }
  std::vector<OutputReport> reports;
  DETDIT_RETURN_IF_ERROR(compare_with_ws1(run, *ws1, stream.get(), "", &reports));
  for (std::size_t i = 0; i < reports.size(); ++i) {
    const double elements = static_cast<double>(run.outputs[i].tensor.view().numel());
    result->compared += elements;
    result->wrong += reports[i].mismatch.shape_error.empty() ? static_cast<double>(reports[i].mismatch.count) : elements;
  }
  return Status::ok_status();
}

// The ranks of one world into *ranks: WS1 (every process of `mpi` times its
// own; its outputs into *ws1), `mpi`'s world or `world` in-process ranks
// (kMeasured, compared with *ws1), or a prediction of `world`.
Status time_world(const RegionTiming& timing, Communicator* mpi, const TimedRegion& region, RegionRun how, int world,
                  std::vector<HostTensor>* ws1, std::vector<RankTiming>* ranks) {
  ranks->assign(static_cast<std::size_t>(world), RankTiming{});
  if (how == RegionRun::kPredicted) {
    for (int q = 0; q < world; ++q) {
      PredictionComm comm(world, q, timing.device);
      const Status s = time_rank(timing, region, &comm, ws1, &(*ranks)[static_cast<std::size_t>(q)]);
      if (!s.ok()) return Status(s.kind(), "rank " + std::to_string(q) + ": " + s.message());
    }
    return Status::ok_status();
  }
  if (mpi != nullptr) {
    RankTiming mine;
    const Status s = time_rank(timing, region, how == RegionRun::kWs1 ? nullptr : mpi, ws1, &mine);
    return gather_ranks(*mpi, s, mine, how == RegionRun::kWs1 ? "WS1" : "world " + std::to_string(world), ranks);
  }
  if (how == RegionRun::kWs1) return time_rank(timing, region, nullptr, ws1, &ranks->front());
  return InProcessGroup::run(world, [&](Communicator& comm) {
    return time_rank(timing, region, &comm, ws1, &(*ranks)[static_cast<std::size_t>(comm.rank())]);
  }, timing.device);
}

void count_wrong(const std::vector<OutputReport>& reports, BenchRow* r) {
  for (const OutputReport& o : reports) {
    r->compared += o.mismatch.compared;
    r->wrong += o.mismatch.shape_error.empty() ? o.mismatch.count : o.mismatch.compared;
    if (o.still_canary && r->error.empty()) r->error = o.output + ": the CPU reference never wrote it";
  }
}

}  // namespace

Status bench_op_case(const OpCase& c, const Device& device, int warmup, int repeats, std::vector<BenchRow>* rows) {
  // At the H3 shapes a case is tens of GB on the host: the inputs are filled
  // once for both runs, the device's outputs downloaded and its tensors freed
  // before the CPU reference runs.
  std::map<std::string, HostTensor> inputs, got, expected;
  make_inputs(c, &inputs);
  auto t = std::make_unique<Instance>();
  DETDIT_RETURN_IF_ERROR(instantiate(c, device, nullptr, t.get(), &inputs));
  auto forward = [&] { return run(c, Phase::kForward, *t); };
  auto backward = [&] { return run(c, Phase::kBackward, *t); };
  std::vector<BenchRow> timed;  // fwd, then bwd and fwd+bwd where the case has a backward
  auto time = [&](const char* phase, double bytes, const std::string& byte_model, const std::function<Status()>& call) {
    timed.push_back(BenchRow(c.op, c.name, phase, false));
    timed.back().bytes = bytes;
    timed.back().byte_model = byte_model;
    return time_calls(device, nullptr, warmup, repeats, call, &timed.back().median_seconds);
  };
  const bool has_backward = c.has(Phase::kBackward);
  DETDIT_RETURN_IF_ERROR(time("fwd", c.bytes[0], c.byte_model[0], forward));
  if (has_backward) {
    DETDIT_RETURN_IF_ERROR(time("bwd", c.bytes[1], c.byte_model[1], backward));
    DETDIT_RETURN_IF_ERROR(time("fwd+bwd", c.bytes[0] + c.bytes[1], "fwd + bwd floors", [&] {
      DETDIT_RETURN_IF_ERROR(forward());
      return backward();
    }));
  }
  DETDIT_RETURN_IF_ERROR(download_outputs(c, *t, &got));
  t.reset();
  auto reference = std::make_unique<Instance>();
  DETDIT_RETURN_IF_ERROR(instantiate(c, Device::cpu(), nullptr, reference.get(), &inputs));
  inputs.clear();
  DETDIT_RETURN_IF_ERROR(run(c, Phase::kForward, *reference));
  if (has_backward) DETDIT_RETURN_IF_ERROR(run(c, Phase::kBackward, *reference));
  DETDIT_RETURN_IF_ERROR(download_outputs(c, *reference, &expected));
  reference.reset();
  const auto forward_reports = compare_outputs(c, Phase::kForward, expected, got);
  count_wrong(forward_reports, &timed[0]);
  if (has_backward) {
    const auto backward_reports = compare_outputs(c, Phase::kBackward, expected, got);
    count_wrong(backward_reports, &timed[1]);
    count_wrong(forward_reports, &timed[2]);
    count_wrong(backward_reports, &timed[2]);
  }
  rows->insert(rows->end(), timed.begin(), timed.end());
  return Status::ok_status();
}

void time_region(const RegionTiming& timing, Communicator* mpi, const TimedRegion& region, const std::vector<int>& worlds,
                 std::vector<BenchRow>* rows) {
  std::vector<std::pair<int, RegionRun>> runs = {{1, RegionRun::kWs1}};
  if (mpi != nullptr || timing.predict == nullptr)
    for (int world : worlds) runs.push_back({world, RegionRun::kMeasured});
  if (timing.predict != nullptr)
    for (int world : timing.predict->worlds) runs.push_back({world, RegionRun::kPredicted});
  const std::size_t first = rows->size();  // the WS1 row
  std::vector<HostTensor> ws1;             // WS1's outputs on this device, for #wrong
  for (const auto& [world, how] : runs) {
    BenchRow r(region.op, region.name, region.phase, true);
    r.world = world;
    r.ws1 = how == RegionRun::kWs1;
    r.simulated = mpi == nullptr && how != RegionRun::kPredicted;
    r.predicted = how == RegionRun::kPredicted;
    std::vector<RankTiming> ranks;
    Status s = r.ws1 ? Status::ok_status() : region.describe(world, &r.metrics);
    if (s.ok()) s = time_world(timing, mpi, region, how, world, &ws1, &ranks);
    if (!s.ok()) {
      r.error = s.to_string();
      rows->push_back(r);
      if (r.ws1) return;
      continue;
    }
    if (!r.ws1 || mpi != nullptr)  // in-process WS1 is one run, not ranks
      for (const RankTiming& rank : ranks) r.rank_medians.push_back(rank.median);
    for (const RankTiming& rank : ranks) r.median_seconds = std::max(r.median_seconds, rank.median);
    r.ws1_median_seconds = r.ws1 ? r.median_seconds : (*rows)[first].median_seconds;
    if (!r.predicted) {
      for (const RankTiming& rank : ranks) {
        r.wrong += static_cast<int64_t>(rank.wrong);
        r.compared += static_cast<int64_t>(rank.compared);
      }
      rows->push_back(r);
      continue;
    }
    // The slowest rank's compute plus the longest link time of a rank.
    const RankTiming link = *std::max_element(ranks.begin(), ranks.end(), [](const RankTiming& a, const RankTiming& b) {
      return a.link_seconds < b.link_seconds;
    });
    r.metrics.push_back({"predicted_compute_us", {r.median_seconds * 1e6}});
    r.metrics.push_back({"predicted_link_us", {link.link_seconds * 1e6}});
    r.metrics.push_back({"collectives_per_step", {link.collectives}});
    r.metrics.push_back({"link_bytes_per_rank", {link.link_bytes}});
    r.median_seconds += link.link_seconds;
    for (std::size_t i = first; i < rows->size(); ++i) {
      const BenchRow& m = (*rows)[i];
      if (m.ws1 || m.predicted || m.world != world || !m.error.empty()) continue;
      r.metrics.push_back({"measured_us", {m.median_seconds * 1e6}});
      r.metrics.push_back({"prediction_error_percent", {100.0 * (r.median_seconds - m.median_seconds) / m.median_seconds}});
    }
    rows->push_back(r);
  }
}



Status measure_link(const Device& device, Communicator& comm, int warmup, int repeats, LinkModel* link) {
  // An all-gather of 8 bytes per rank is the latency; one of `large` bytes per
  // rank, less the latency, gives the bus bandwidth: (world - 1) * large bytes
  // over that time (nccl-tests' convention). Each the slowest rank's median.
  const int world = comm.world_size();
  const std::size_t large = device.is_cuda() ? std::size_t(32) << 20 : std::size_t(4) << 20;
  RankStream stream(device);
  DeviceTensor send, recv;
  DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(DType::kF32, {static_cast<int64_t>(large / 4)}, device, &send, stream.get()));
  DETDIT_RETURN_IF_ERROR(
      DeviceTensor::empty(DType::kF32, {static_cast<int64_t>(world * large / 4)}, device, &recv, stream.get()));
  double seconds[2] = {0, 0};
  const std::size_t sizes[2] = {8, large};
  for (int k = 0; k < 2; ++k) {
    RankTiming mine;
    const Status s = time_calls(device, stream.get(), warmup, repeats, [&] {
      return comm.all_gather(send.view().data, sizes[k], recv.view().data, DType::kF32, stream.get());
    }, &mine.median);
    std::vector<RankTiming> ranks;
    DETDIT_RETURN_IF_ERROR(gather_ranks(comm, s, mine, "measuring the link", &ranks));
    seconds[k] = slowest(ranks);
  }
  link->latency_seconds = seconds[0];
  link->bus_bytes_per_second =
      static_cast<double>(world - 1) * static_cast<double>(large) / std::max(seconds[1] - seconds[0], 1e-9);
  return Status::ok_status();
}

}  // namespace cases
}  // namespace detdit
