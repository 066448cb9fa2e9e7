// bench of the parallel regions: the tp_adaln_projection forward and
// forward+backward, and the sp_region forward+backward (the fused
// gate_residual_rmsnorm forward and its backward with gradients reaching out
// and h: the region every H3 block runs twice), per world size, next to WS1
// (the public single-device op) on the same device in the same run.
//
// Per rank: the median of the timed steps (cases/timing.h, on the rank's own
// stream); a world's time is its slowest rank's median. With --comm mpi each
// rank is a process on its own GPU (NCCL; the results are all-gathered);
// in-process ranks share one device and are a simulation (they compete for
// it), said so in the output. #wrong: elements of the last timed outputs that
// differ bitwise from WS1's on the same device.
//
// The problems, their sizes and world sizes are cases/parallel_cases.h's
// (sp_region_bench_cases, tp_adaln_projection_bench_cases; on the CPU, run only
// when --ops names these ops, a smoke test of the timing path, not a
// performance claim), and so are the bytes each rank sends.
//
// --predict-world (context.predict): instead of the simulation (in-process),
// or beside the measured MPI world (--comm mpi, whose link is then measured,
// measure_link), each rank of each world size runs its share alone on the
// device, one rank after another, through a communicator that moves nothing
// (cases::PredictionComm). A world's prediction is its slowest rank's median
// plus the link model's time for one step's collectives (LinkModel, bench.h).
// Not compared with WS1: the received values are not there. The fold chain's
// serial order across ranks is in the model's collectives, not in the compute
// (each rank's own fold segment is timed, the wait for its predecessor's is not).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "bench.h"
#include "cases/timing.h"
#include "parallel_common.h"

namespace detdit {
namespace cli {
namespace {

// A region as bench times it: how a rank prepares its run (comm == nullptr:
// WS1, the whole problem on the device; a step is the forward, and the
// backward after it for phase "fwd+bwd") and what a rank of a world sends
// (an error: the world cannot split the problem).
struct Region {
  std::string op, name, phase;
  std::function<Status(Stream, Communicator*, ParallelRun*)> prepare;
  std::function<Status(int world, BenchRow*)> describe;
};

// One rank's result; plain doubles, all-gathered as bytes under MPI.
struct RankResult {
  double median = 0;  // NaN: the rank failed
  double wrong = 0, compared = 0;
  double link_seconds = 0, link_bytes = 0, collectives = 0;  // a prediction's collectives of one step
};

double slowest(const std::vector<RankResult>& ranks) {
  double worst = 0;
  for (const RankResult& r : ranks) worst = std::max(worst, r.median);
  return worst;
}

// Every rank's result over `comm` into *all (rank order). Every rank takes
// part, a failed one (`local` not OK) sending a NaN median, so none waits
// forever; the result is `local`'s error, the exchange's, or "`what` failed
// on rank q" for the first rank that sent NaN.
Status gather_ranks(Communicator& comm, const Status& local, RankResult mine, const std::string& what,
                    std::vector<RankResult>* all) {
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
// differ bitwise from WS1's (its part of sharded ones; cases::compare_with_ws1).
Status time_rank(const BenchContext& ctx, const Region& region, Communicator* comm, std::vector<HostTensor>* ws1,
                 RankResult* result) {
  RankStream stream(ctx.device);
  ParallelRun run;
  DETDIT_RETURN_IF_ERROR(region.prepare(stream.get(), comm, &run));
  auto step = [&]() -> Status {
    DETDIT_RETURN_IF_ERROR(run.forward());
    return region.phase == "fwd+bwd" ? run.backward() : Status::ok_status();
  };
  DETDIT_RETURN_IF_ERROR(cases::time_calls(ctx.device, stream.get(), ctx.warmup, ctx.repeats, step, &result->median));
  if (comm == nullptr) {
    ws1->resize(run.outputs.size());
    for (std::size_t i = 0; i < ws1->size(); ++i)
      DETDIT_RETURN_IF_ERROR(run.outputs[i].tensor.to_host(&(*ws1)[i], stream.get()));
    return Status::ok_status();
  }
  if (auto* predicting = dynamic_cast<cases::PredictionComm*>(comm)) {
    predicting->calls.clear();
    DETDIT_RETURN_IF_ERROR(step());
    result->link_seconds = predicting->link_seconds(ctx.predict->bus_bytes_per_second, ctx.predict->latency_seconds,
                                                    &result->link_bytes);
    result->collectives = static_cast<double>(predicting->calls.size());
    return Status::ok_status();
  }
  std::vector<cases::OutputReport> reports;
  DETDIT_RETURN_IF_ERROR(cases::compare_with_ws1(run, *ws1, stream.get(), "", &reports));
  for (std::size_t i = 0; i < reports.size(); ++i) {
    const double elements = static_cast<double>(run.outputs[i].tensor.view().numel());
    result->compared += elements;
    result->wrong += reports[i].mismatch.shape_error.empty() ? static_cast<double>(reports[i].mismatch.count) : elements;
  }
  return Status::ok_status();
}

enum class Run { kWs1, kMeasured, kPredicted };

// The ranks of one world: WS1 (every MPI process times its own), the MPI
// world or `world` in-process ranks (kMeasured), or a prediction: each rank
// alone through a PredictionComm, one after another.
Status time_world(const BenchContext& ctx, Communicator* mpi, const Region& region, Run how, int world,
                  std::vector<HostTensor>* ws1, std::vector<RankResult>* ranks) {
  ranks->assign(static_cast<std::size_t>(world), RankResult{});
  if (how == Run::kPredicted) {
    for (int q = 0; q < world; ++q) {
      cases::PredictionComm comm(world, q, ctx.device);
      const Status s = time_rank(ctx, region, &comm, ws1, &(*ranks)[static_cast<std::size_t>(q)]);
      if (!s.ok()) return Status(s.kind(), "rank " + std::to_string(q) + ": " + s.message());
    }
    return Status::ok_status();
  }
  if (mpi != nullptr) {
    RankResult mine;
    const Status s = time_rank(ctx, region, how == Run::kWs1 ? nullptr : mpi, ws1, &mine);
    return gather_ranks(*mpi, s, mine, how == Run::kWs1 ? "WS1" : "world " + std::to_string(world), ranks);
  }
  if (how == Run::kWs1) return time_rank(ctx, region, nullptr, ws1, &ranks->front());
  return InProcessGroup::run(world, [&](Communicator& comm) {
    return time_rank(ctx, region, &comm, ws1, &(*ranks)[static_cast<std::size_t>(comm.rank())]);
  }, ctx.device);
}

// One row per world of the region: WS1 first, then every world of `worlds`
// (in-process, or the MPI world) unless predicting in-process, then every
// world of ctx.predict (each process of an MPI world predicts alone on its
// device). A prediction of a world that was also measured records the
// measurement and its error; a world that cannot split the problem is an
// error row; when WS1 fails nothing else is timed.
void time_region(const BenchContext& ctx, Communicator* mpi, const Region& region, const std::vector<int>& worlds,
                 std::vector<BenchRow>* rows) {
  std::vector<std::pair<int, Run>> runs = {{1, Run::kWs1}};
  if (mpi != nullptr || ctx.predict == nullptr)
    for (int world : worlds) runs.push_back({world, Run::kMeasured});
  if (ctx.predict != nullptr)
    for (int world : ctx.predict->worlds) runs.push_back({world, Run::kPredicted});
  const std::size_t first = rows->size();  // the WS1 row
  std::vector<HostTensor> ws1;             // WS1's outputs on this device, for #wrong
  for (const auto& [world, how] : runs) {
    BenchRow r(region.op, region.name, region.phase, true);
    r.world = world;
    r.ws1 = how == Run::kWs1;
    r.simulated = mpi == nullptr && how != Run::kPredicted;
    r.predicted = how == Run::kPredicted;
    std::vector<RankResult> ranks;
    Status s = r.ws1 ? Status::ok_status() : region.describe(world, &r);
    if (s.ok()) s = time_world(ctx, mpi, region, how, world, &ws1, &ranks);
    if (!s.ok()) {
      r.error = s.to_string();
      rows->push_back(r);
      if (r.ws1) return;
      continue;
    }
    if (!r.ws1 || mpi != nullptr)  // in-process WS1 is one run, not ranks
      for (const RankResult& rank : ranks) r.rank_medians.push_back(rank.median);
    r.median_seconds = slowest(ranks);
    r.ws1_median_seconds = r.ws1 ? r.median_seconds : (*rows)[first].median_seconds;
    if (!r.predicted) {
      for (const RankResult& rank : ranks) {
        r.wrong += static_cast<int64_t>(rank.wrong);
        r.compared += static_cast<int64_t>(rank.compared);
      }
      rows->push_back(r);
      continue;
    }
    // The slowest rank's compute plus the longest link time of a rank.
    const RankResult link = *std::max_element(ranks.begin(), ranks.end(), [](const RankResult& a, const RankResult& b) {
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

bool wanted(const std::set<std::string>& filter, const std::string& item) { return filter.empty() || filter.count(item); }

// The problems bench times (cases/parallel_cases.h) on this run's device.
cases::ParallelSetting setting_of(const BenchContext& ctx, Communicator* mpi) {
  cases::ParallelSetting s;
  s.cuda = ctx.device.is_cuda();
  s.quick = ctx.quick;
  s.mpi_world = mpi != nullptr ? mpi->world_size() : 0;
  return s;
}

}  // namespace

bool is_parallel_op(const std::string& op) { return op == "sp_region" || op == "tp_adaln_projection"; }

Status measure_link(const BenchContext& ctx, Communicator& comm, int warmup, int repeats, LinkModel* link) {
  // An all-gather of 8 bytes per rank is the latency; one of `large` bytes per
  // rank, less the latency, gives the bus bandwidth: (world - 1) * large bytes
  // over that time (nccl-tests' convention). Each the slowest rank's median.
  const int world = comm.world_size();
  const std::size_t large = ctx.device.is_cuda() ? std::size_t(32) << 20 : std::size_t(4) << 20;
  RankStream stream(ctx.device);
  cases::DeviceTensor send, recv;
  DETDIT_RETURN_IF_ERROR(cases::DeviceTensor::empty(DType::kF32, {static_cast<int64_t>(large / 4)}, ctx.device, &send,
                                                    stream.get()));
  DETDIT_RETURN_IF_ERROR(cases::DeviceTensor::empty(DType::kF32, {static_cast<int64_t>(world * large / 4)}, ctx.device,
                                                    &recv, stream.get()));
  double seconds[2] = {0, 0};
  const std::size_t sizes[2] = {8, large};
  for (int k = 0; k < 2; ++k) {
    RankResult mine;
    const Status s = cases::time_calls(ctx.device, stream.get(), warmup, repeats, [&] {
      return comm.all_gather(send.view().data, sizes[k], recv.view().data, DType::kF32, stream.get());
    }, &mine.median);
    std::vector<RankResult> ranks;
    DETDIT_RETURN_IF_ERROR(gather_ranks(comm, s, mine, "measuring the link", &ranks));
    seconds[k] = slowest(ranks);
  }
  link->latency_seconds = seconds[0];
  link->bus_bytes_per_second =
      static_cast<double>(world - 1) * static_cast<double>(large) / std::max(seconds[1] - seconds[0], 1e-9);
  return Status::ok_status();
}

std::size_t parallel_bench_count(const BenchContext& ctx, const std::set<std::string>& ops,
                                 const std::set<std::string>& names) {
  const cases::CaseContext context = case_context(*ctx.weights, ctx.quick, ctx.seed);
  std::size_t count = 0;
  if (wanted(ops, "sp_region"))
    for (const cases::SpRegionCase& c : cases::sp_region_bench_cases(context, setting_of(ctx, nullptr)))
      count += wanted(names, c.name);
  if (wanted(ops, "tp_adaln_projection"))
    for (const cases::TpCase& c : cases::tp_adaln_projection_bench_cases(context, setting_of(ctx, nullptr)))
      count += wanted(names, c.name) ? 2 : 0;  // fwd and fwd+bwd
  return count;
}

Status run_parallel_bench(const BenchContext& ctx, Communicator* mpi, const std::set<std::string>& ops,
                          const std::set<std::string>& names, Progress* progress, std::vector<BenchRow>* rows) {
  const cases::CaseContext context = case_context(*ctx.weights, ctx.quick, ctx.seed);
  auto time = [&](const Region& region, const std::vector<int>& worlds) {
    const std::string label = region.op + " " + region.name + " " + region.phase;
    progress->started(label);
    time_region(ctx, mpi, region, worlds, rows);
    progress->finished(label);
  };
  if (wanted(ops, "sp_region")) {
    for (const cases::SpRegionCase& c : cases::sp_region_bench_cases(context, setting_of(ctx, mpi))) {
      if (!wanted(names, c.name)) continue;
      SpProblem pr;
      DETDIT_RETURN_IF_ERROR(cases::make_sp_problem(context, c.shape, &pr));
      SpIndex index;
      DETDIT_RETURN_IF_ERROR(cases::make_sp_index(pr, ctx.device, &index));
      Region region{"sp_region", c.name, "fwd+bwd", nullptr, nullptr};
      region.prepare = [&](Stream stream, Communicator* comm, ParallelRun* run) {
        SpPlan sp;
        if (comm != nullptr) DETDIT_RETURN_IF_ERROR(SpPlan::create(index.plan, comm->world_size(), comm->rank(), &sp, stream));
        return cases::prepare_sp_run(pr, index, SpVariant::kGateResidualRmsnorm, ctx.device, stream,
                                     comm != nullptr ? &sp : nullptr, comm, run);
      };
      region.describe = [&](int world, BenchRow* r) {
        SpPlan sp;
        DETDIT_RETURN_IF_ERROR(SpPlan::create(index.plan, world, 0, &sp));
        r->metrics.push_back({"send_rows_per_rank", cases::sp_send_rows_per_rank(sp)});
        r->metrics.push_back(
            {"bytes_sent_per_rank", {cases::sp_backward_bytes_per_rank(sp, SpVariant::kGateResidualRmsnorm, c.shape.hidden)}});
        return Status::ok_status();
      };
      time(region, c.worlds);
    }
  }
  if (wanted(ops, "tp_adaln_projection")) {
    for (const cases::TpCase& c : cases::tp_adaln_projection_bench_cases(context, setting_of(ctx, mpi))) {
      if (!wanted(names, c.name)) continue;
      TpProblem pr;
      DETDIT_RETURN_IF_ERROR(cases::make_tp_problem(context, c.shape, &pr));
      TpWeights weights;
      DETDIT_RETURN_IF_ERROR(cases::upload_tp_weights(pr, ctx.device, &weights));
      for (const char* phase : {"fwd", "fwd+bwd"}) {
        Region region{"tp_adaln_projection", c.name, phase, nullptr, nullptr};
        region.prepare = [&](Stream stream, Communicator* comm, ParallelRun* run) {
          return cases::prepare_tp_run(pr, weights, ctx.device, stream, comm, run);
        };
        // A world that cannot split N (more ranks than 64-column chunks) is an error row.
        region.describe = [&](int world, BenchRow* r) {
          double forward = 0, backward = 0;
          DETDIT_RETURN_IF_ERROR(cases::tp_bytes_sent_per_rank(c.shape, world, &forward, &backward));
          r->metrics.push_back({"bytes_sent_per_rank", {forward + (r->phase == "fwd+bwd" ? backward : 0)}});
          return Status::ok_status();
        };
        time(region, c.worlds);
      }
    }
  }
  return Status::ok_status();
}

}  // namespace cli
}  // namespace detdit
