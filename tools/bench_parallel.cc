// bench of the parallel regions: the tp_adaln_projection forward and
// forward+backward, and the sp_region forward+backward (the fused
// gate_residual_rmsnorm forward and its backward with gradients reaching out
// and h: the region every H3 block runs twice), per world size, next to WS1
// (the public single-device op) on the same device in the same run.
//
// Per rank: the median of `repeats` timed steps after `warmup` untimed ones
// (CUDA events on the rank's stream on a GPU, wall clock on the CPU); a world's
// time is its slowest rank's median. With --comm mpi each rank is a process
// on its own GPU (NCCL; the medians are all-gathered); in-process ranks share
// one device and are a simulation (they compete for it), said so in the
// output. #wrong: elements of the last timed outputs that differ bitwise from
// WS1's on the same device.
//
// The problems, their sizes and world sizes are cases/parallel_cases.h's
// (sp_region_bench_cases, tp_adaln_projection_bench_cases; on the CPU, run only
// when --ops names these ops, a smoke test of the timing path, not a
// performance claim), and so are the bytes each rank sends.
// Targets (docs/design.md): SP8 >= 6x faster than WS1 at S = 131072; never
// slower than WS1 at S = 32768 (every world size, both packings).
//
// --predict-world (context.predict): instead of the simulation (in-process),
// or beside the measured MPI world (--comm mpi, whose link is then measured,
// measure_link), each rank of each world size runs its share alone on the
// device, one rank after another,
// through a communicator that moves nothing (PredictionComm): its real rows,
// straddling rows and chunk partials, whatever values it would have received.
// A world's prediction is its slowest rank's median plus the link model's time
// for one step's collectives (LinkModel, bench.h). Not compared with WS1: the
// received values are not there. The fold chain's serial order across ranks
// is in the model's collectives, not in the compute (each rank's own fold
// segment is timed, the wait for its predecessor's is not).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "bench.h"
#include "parallel_common.h"

namespace detdit {
namespace cli {
namespace {

// A communicator of rank `rank` of `world` that moves nothing and logs each
// collective: the prediction's rank runs alone (see the top of the file).
class PredictionComm final : public Communicator {
 public:
  struct Call {
    bool all_gather;
    std::size_t bytes;  // per rank
  };
  PredictionComm(int world, int rank, Device device) : world_(world), rank_(rank), device_(device) {}
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  Device device() const override { return device_; }
  const char* backend_id() const override { return "prediction"; }
  Status all_gather(const void*, std::size_t bytes, void*, DType, Stream) override {
    calls.push_back({true, bytes});
    return Status::ok_status();
  }
  Status broadcast(void*, std::size_t bytes, int, DType, Stream) override {
    calls.push_back({false, bytes});
    return Status::ok_status();
  }
  Status agree(const Status& local, const std::string&) override { return local; }

  std::vector<Call> calls;

 private:
  int world_, rank_;
  Device device_;
};

// The link model's time for `calls`, and the bytes it moves (for each call
// the bus-bandwidth bytes of nccl-tests' convention: (world - 1) * bytes for an
// all-gather, bytes for a broadcast, whichever rank is the root).
double link_seconds(const LinkModel& link, int world, const std::vector<PredictionComm::Call>& calls,
                    double* link_bytes) {
  double seconds = 0;
  *link_bytes = 0;
  for (const PredictionComm::Call& call : calls) {
    const double bytes = static_cast<double>(call.bytes) * (call.all_gather ? world - 1 : 1);
    seconds += link.latency_seconds + bytes / link.bus_bytes_per_second;
    *link_bytes += bytes;
  }
  return seconds;
}

// One timed thing of one rank: its prepared run (WS1's or a rank's; the part
// of WS1 its sharded outputs hold) and the step that times it.
struct RankWork {
  ParallelRun run;
  std::function<Status()> step;
};

Status median_of_steps(const BenchContext& ctx, Stream stream, int warmup, int repeats,
                       const std::function<Status()>& step, double* median) {
  BenchContext rank_ctx = ctx;
  rank_ctx.stream = stream;
  return time_calls(rank_ctx, warmup, repeats, step, median);
}

// Every rank's `median` over `comm` into *medians (rank order) and their
// maximum into *slowest. Every rank takes part, a failed one (`local` not OK)
// sending NaN, so none waits forever; the result is `local`'s error, the
// exchange's, or "`what` failed on rank q" for the first rank that sent NaN.
Status gather_medians(Communicator& comm, const Status& local, double median, const std::string& what,
                      std::vector<double>* medians, double* slowest) {
  const double mine = local.ok() ? median : std::nan("");
  std::vector<char> all;
  const Status gathered = gather_host_bytes(comm, &mine, sizeof mine, &all);
  DETDIT_RETURN_IF_ERROR(local);
  DETDIT_RETURN_IF_ERROR(gathered);
  medians->clear();
  for (int q = 0; q < comm.world_size(); ++q) {
    medians->push_back(reinterpret_cast<const double*>(all.data())[q]);
    if (std::isnan(medians->back())) return Status::runtime_error(what + " failed on rank " + std::to_string(q));
  }
  *slowest = *std::max_element(medians->begin(), medians->end());
  return Status::ok_status();
}

// Elements of the run's outputs that differ bitwise from WS1's (its part of
// sharded outputs; cases::compare_with_ws1), and how many were compared.
Status count_wrong(const ParallelRun& run, const std::vector<HostTensor>& ws1, Stream stream, int64_t* wrong,
                   int64_t* compared) {
  std::vector<cases::OutputReport> reports;
  DETDIT_RETURN_IF_ERROR(cases::compare_with_ws1(run, ws1, stream, "", &reports));
  for (std::size_t i = 0; i < reports.size(); ++i) {
    const int64_t elements = run.outputs[i].tensor.view().numel();
    *compared += elements;
    *wrong += reports[i].mismatch.shape_error.empty() ? reports[i].mismatch.count : elements;
  }
  return Status::ok_status();
}

// The rank's work: comm == nullptr is WS1 (the whole problem on this device).
Status prepare_sp_work(const SpProblem& pr, const SpIndex& index, const Device& device, Stream stream,
                       Communicator* comm, RankWork* work) {
  SpPlan sp;
  if (comm != nullptr) DETDIT_RETURN_IF_ERROR(SpPlan::create(index.plan, comm->world_size(), comm->rank(), &sp, stream));
  DETDIT_RETURN_IF_ERROR(cases::prepare_sp_run(pr, index, SpVariant::kGateResidualRmsnorm, device, stream,
                                               comm ? &sp : nullptr, comm, &work->run));
  ParallelRun* region = &work->run;
  work->step = [region]() {
    DETDIT_RETURN_IF_ERROR(region->forward());
    return region->backward();
  };
  return Status::ok_status();
}

Status prepare_tp_work(const TpProblem& pr, const TpWeights& weights, const Device& device, Stream stream,
                       Communicator* comm, bool backward, RankWork* work) {
  DETDIT_RETURN_IF_ERROR(cases::prepare_tp_run(pr, weights, device, stream, comm, &work->run));
  ParallelRun* run = &work->run;
  work->step = [run, backward]() {
    DETDIT_RETURN_IF_ERROR(run->forward());
    return backward ? run->backward() : Status::ok_status();
  };
  return Status::ok_status();
}

// What one timed configuration needs: how to prepare a rank.
struct Timed {
  std::function<Status(Stream, Communicator*, RankWork*)> prepare;
};

// r's prediction at r->world: every rank alone through a PredictionComm, then
// the slowest rank's median plus the link time of one step's collectives.
void predict_world(const BenchContext& ctx, int warmup, int repeats, const Timed& timed, const LinkModel& link,
                   ParallelBenchResult* r) {
  r->simulated = false;
  r->predicted = true;
  double slowest = 0, link_time = 0, received = 0, calls = 0;
  for (int rank = 0; rank < r->world; ++rank) {
    PredictionComm comm(r->world, rank, ctx.device);
    RankStream stream(ctx.device);
    RankWork work;
    double median = 0;
    Status s = timed.prepare(stream.get(), &comm, &work);
    if (s.ok()) s = median_of_steps(ctx, stream.get(), warmup, repeats, work.step, &median);
    if (s.ok()) {  // one more step: its collectives are the model's input
      comm.calls.clear();
      s = work.step();
    }
    if (!s.ok()) {
      r->error = "rank " + std::to_string(rank) + ": " + s.to_string();
      return;
    }
    double rank_received = 0;
    const double rank_link = link_seconds(link, r->world, comm.calls, &rank_received);
    r->rank_medians.push_back(median);
    slowest = std::max(slowest, median);
    if (rank_link > link_time) {
      link_time = rank_link;
      received = rank_received;
      calls = static_cast<double>(comm.calls.size());
    }
  }
  r->median_seconds = slowest + link_time;
  r->metrics.push_back({"predicted_compute_us", {slowest * 1e6}});
  r->metrics.push_back({"predicted_link_us", {link_time * 1e6}});
  r->metrics.push_back({"collectives_per_step", {calls}});
  r->metrics.push_back({"link_bytes_per_rank", {received}});
}

// Times WS1 and every world of `worlds` (in-process) or the MPI world, then
// predicts every world of `predicted` (ctx.predict's model; each process of
// an MPI world predicts alone on its device), and appends one result per
// world (WS1 first). A prediction of a world that was also measured records
// the measurement and its error.
void time_worlds(const BenchContext& ctx, Communicator* mpi, int warmup, int repeats, const std::string& op,
                 const std::string& name, const std::string& phase, const Timed& timed, const std::vector<int>& worlds,
                 const std::vector<int>& predicted, const std::function<void(int world, ParallelBenchResult*)>& describe,
                 std::vector<ParallelBenchResult>* results) {
  const std::size_t first = results->size();  // this configuration's rows start here
  ParallelBenchResult base;
  base.op = op;
  base.name = name;
  base.phase = phase;
  base.simulated = mpi == nullptr;
  // WS1 on this device (every MPI rank times its own), outputs kept for #wrong.
  std::vector<HostTensor> ws1;
  {
    ParallelBenchResult r = base;
    r.world = 1;
    r.ws1 = true;
    RankStream stream(ctx.device);
    RankWork work;
    double median = 0;
    Status s = timed.prepare(stream.get(), nullptr, &work);
    if (s.ok()) s = median_of_steps(ctx, stream.get(), warmup, repeats, work.step, &median);
    ws1.resize(work.run.outputs.size());
    for (std::size_t i = 0; s.ok() && i < ws1.size(); ++i) s = work.run.outputs[i].tensor.to_host(&ws1[i], stream.get());
    double worst = median;
    if (mpi != nullptr) s = gather_medians(*mpi, s, median, "WS1", &r.rank_medians, &worst);
    r.median_seconds = worst;
    r.ws1_median_seconds = worst;
    if (!s.ok()) r.error = s.to_string();
    results->push_back(r);
    if (!s.ok()) return;
  }
  const double ws1_seconds = results->back().median_seconds;
  for (int world : worlds) {
    ParallelBenchResult r = base;
    r.world = world;
    r.ws1_median_seconds = ws1_seconds;
    describe(world, &r);
    std::vector<double> medians(static_cast<std::size_t>(world), 0.0);
    std::vector<int64_t> wrong(static_cast<std::size_t>(world), 0), compared(static_cast<std::size_t>(world), 0);
    auto rank_fn = [&](Communicator& comm) -> Status {
      RankStream stream(ctx.device);
      RankWork work;
      DETDIT_RETURN_IF_ERROR(timed.prepare(stream.get(), &comm, &work));
      const std::size_t q = static_cast<std::size_t>(comm.rank());
      DETDIT_RETURN_IF_ERROR(median_of_steps(ctx, stream.get(), warmup, repeats, work.step, &medians[q]));
      return count_wrong(work.run, ws1, stream.get(), &wrong[q], &compared[q]);
    };
    Status s;
    if (mpi != nullptr) {
      const int rank = mpi->rank();
      s = rank_fn(*mpi);
      // Every rank's {median, wrong, compared}; a failed rank sends a NaN
      // median (it still takes part, so no rank waits forever).
      const std::size_t me = static_cast<std::size_t>(rank);
      double mine[3] = {s.ok() ? medians[me] : std::nan(""), static_cast<double>(wrong[me]),
                        static_cast<double>(compared[me])};
      std::vector<char> all;
      Status gathered = gather_host_bytes(*mpi, mine, sizeof mine, &all);
      for (int q = 0; gathered.ok() && q < world; ++q) {
        const double* rec = reinterpret_cast<const double*>(all.data()) + 3 * q;
        if (std::isnan(rec[0]) && s.ok()) s = Status::runtime_error("rank " + std::to_string(q) + " failed");
        medians[static_cast<std::size_t>(q)] = rec[0];
        wrong[static_cast<std::size_t>(q)] = static_cast<int64_t>(rec[1]);
        compared[static_cast<std::size_t>(q)] = static_cast<int64_t>(rec[2]);
      }
      if (s.ok()) s = gathered;
    } else {
      s = InProcessGroup::run(world, rank_fn, ctx.device);
    }
    if (!s.ok()) {
      r.error = s.to_string();
    } else {
      r.rank_medians = medians;
      r.median_seconds = *std::max_element(medians.begin(), medians.end());
      for (int q = 0; q < world; ++q) {
        r.wrong += wrong[static_cast<std::size_t>(q)];
        r.compared += compared[static_cast<std::size_t>(q)];
      }
    }
    results->push_back(r);
  }
  const std::size_t measured_end = results->size();
  for (int world : predicted) {
    ParallelBenchResult r = base;
    r.world = world;
    r.ws1_median_seconds = ws1_seconds;
    describe(world, &r);
    predict_world(ctx, warmup, repeats, timed, *ctx.predict, &r);
    for (std::size_t i = first; i < measured_end; ++i) {
      const ParallelBenchResult& m = (*results)[i];
      if (m.ws1 || m.world != world || !m.error.empty() || !r.error.empty()) continue;
      r.metrics.push_back({"measured_us", {m.median_seconds * 1e6}});
      r.metrics.push_back({"prediction_error_percent", {100.0 * (r.median_seconds - m.median_seconds) / m.median_seconds}});
    }
    results->push_back(r);
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
    Status s = median_of_steps(ctx, stream.get(), warmup, repeats, [&] {
      return comm.all_gather(send.view().data, sizes[k], recv.view().data, DType::kF32, stream.get());
    }, &seconds[k]);
    std::vector<double> medians;
    DETDIT_RETURN_IF_ERROR(gather_medians(comm, s, seconds[k], "measuring the link", &medians, &seconds[k]));
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

Status run_parallel_bench(const BenchContext& ctx, Communicator* mpi, int warmup, int repeats,
                          const std::set<std::string>& ops, const std::set<std::string>& names,
                          Progress* progress, std::vector<ParallelBenchResult>* results) {
  const cases::CaseContext context = case_context(*ctx.weights, ctx.quick, ctx.seed);
  // Measured: the case's worlds (the MPI world, or in-process 2, 4, 8) unless
  // predicting in-process; predicted: --predict-world's.
  auto measured = [&](const std::vector<int>& worlds) {
    return mpi == nullptr && ctx.predict != nullptr ? std::vector<int>{} : worlds;
  };
  const std::vector<int> predicted = ctx.predict != nullptr ? ctx.predict->worlds : std::vector<int>{};
  if (wanted(ops, "sp_region")) {
    for (const cases::SpRegionCase& c : cases::sp_region_bench_cases(context, setting_of(ctx, mpi))) {
      if (!wanted(names, c.name)) continue;
      SpProblem pr;
      DETDIT_RETURN_IF_ERROR(cases::make_sp_problem(context, c.shape, &pr));
      SpIndex index;
      DETDIT_RETURN_IF_ERROR(cases::make_sp_index(pr, ctx.device, &index));
      Timed timed;
      timed.prepare = [&](Stream stream, Communicator* comm, RankWork* work) {
        return prepare_sp_work(pr, index, ctx.device, stream, comm, work);
      };
      auto describe = [&](int world, ParallelBenchResult* r) {
        SpPlan sp;
        if (!SpPlan::create(index.plan, world, 0, &sp).ok()) return;
        r->metrics.push_back({"send_rows_per_rank", cases::sp_send_rows_per_rank(sp)});
        r->metrics.push_back(
            {"bytes_sent_per_rank", {cases::sp_backward_bytes_per_rank(sp, SpVariant::kGateResidualRmsnorm, c.shape.hidden)}});
      };
      progress->started("sp_region " + c.name + " fwd+bwd");
      time_worlds(ctx, mpi, warmup, repeats, "sp_region", c.name, "fwd+bwd", timed, measured(c.worlds), predicted,
                  describe, results);
      progress->finished("sp_region " + c.name + " fwd+bwd");
    }
  }
  if (wanted(ops, "tp_adaln_projection")) {
    for (const cases::TpCase& c : cases::tp_adaln_projection_bench_cases(context, setting_of(ctx, mpi))) {
      if (!wanted(names, c.name)) continue;
      TpProblem pr;
      DETDIT_RETURN_IF_ERROR(cases::make_tp_problem(context, c.shape, &pr));
      TpWeights weights;
      DETDIT_RETURN_IF_ERROR(cases::upload_tp_weights(pr, ctx.device, &weights));
      // A world size that cannot split N (more ranks than 64-column chunks) is an error row.
      std::vector<int> valid, valid_predicted;
      std::vector<ParallelBenchResult> refused;
      for (bool prediction : {false, true}) {
        for (int world : prediction ? predicted : measured(c.worlds)) {
          double forward = 0, backward = 0;
          const Status split = cases::tp_bytes_sent_per_rank(c.shape, world, &forward, &backward);
          if (split.ok()) {
            (prediction ? valid_predicted : valid).push_back(world);
            continue;
          }
          ParallelBenchResult r;
          r.op = "tp_adaln_projection";
          r.name = c.name;
          r.world = world;
          r.simulated = !prediction && mpi == nullptr;
          r.predicted = prediction;
          r.error = split.to_string();
          refused.push_back(r);
        }
      }
      for (bool backward : {false, true}) {
        Timed timed;
        timed.prepare = [&, backward](Stream stream, Communicator* comm, RankWork* work) {
          return prepare_tp_work(pr, weights, ctx.device, stream, comm, backward, work);
        };
        auto describe = [&, backward](int world, ParallelBenchResult* r) {
          double forward_bytes = 0, backward_bytes = 0;
          if (!cases::tp_bytes_sent_per_rank(c.shape, world, &forward_bytes, &backward_bytes).ok()) return;
          r->metrics.push_back({"bytes_sent_per_rank", {forward_bytes + (backward ? backward_bytes : 0)}});
        };
        const std::string phase = backward ? "fwd+bwd" : "fwd";
        progress->started("tp_adaln_projection " + c.name + " " + phase);
        time_worlds(ctx, mpi, warmup, repeats, "tp_adaln_projection", c.name, phase, timed, valid, valid_predicted,
                    describe, results);
        for (ParallelBenchResult r : refused) {
          r.phase = phase;
          results->push_back(r);
        }
        progress->finished("tp_adaln_projection " + c.name + " " + phase);
      }
    }
  }
  return Status::ok_status();
}

std::vector<ParallelTarget> parallel_targets(const std::vector<ParallelBenchResult>& results) {
  std::vector<ParallelTarget> targets;
  for (const char* packing : {"block", "interleaved"}) {
    ParallelTarget t;
    t.target = std::string("sp_region fwd+bwd S=131072 ") + packing + ": SP8 >= 6x faster than WS1";
    t.required_speedup = 6.0;
    for (const ParallelBenchResult& r : results) {
      if (r.predicted && !std::isnan(t.measured_speedup) && !t.predicted) continue;  // a measurement wins
      if (r.op == "sp_region" && r.name == std::string("S=131072 ") + packing && r.world == 8 && !r.ws1 &&
          r.error.empty()) {
        t.measured_speedup = r.ws1_median_seconds / r.median_seconds;
        t.simulated = r.simulated;
        t.predicted = r.predicted;
      }
    }
    targets.push_back(t);
  }
  for (const char* packing : {"block", "interleaved"}) {
    for (const ParallelBenchResult& r : results) {
      if (r.op != "sp_region" || r.name != std::string("S=32768 ") + packing || r.ws1 || !r.error.empty()) continue;
      ParallelTarget t;
      t.target = "sp_region fwd+bwd S=32768 " + std::string(packing) + " SP" + std::to_string(r.world) +
                 ": never slower than WS1";
      t.required_speedup = 1.0;
      t.measured_speedup = r.ws1_median_seconds / r.median_seconds;
      t.simulated = r.simulated;
      t.predicted = r.predicted;
      targets.push_back(t);
    }
  }
  return targets;
}

}  // namespace cli
}  // namespace detdit
