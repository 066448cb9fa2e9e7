// cases/parallel_cases.h: the sp_region and tp_adaln_projection problems, one
// rank's run of them, and the comparison of every rank with WS1.
#include "cases/parallel_cases.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "detdit/adaln.h"
#include "detdit/gate_residual.h"
#include "detdit/gate_residual_rmsnorm.h"
#include "detdit/rmsnorm.h"

#ifdef DETDIT_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace detdit {
namespace cases {
namespace {

Status output(DType dtype, std::vector<int64_t> shape, const Device& device, const char* name, bool per_position,
              std::vector<RunOutput>* outputs) {
  RunOutput o{name, per_position, DeviceTensor()};
  DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(dtype, std::move(shape), device, &o.tensor));
  outputs->push_back(std::move(o));
  return Status::ok_status();
}

// DeviceTensor uploads are cudaMemcpy calls on the legacy default stream,
// which may return before the DMA lands; a rank's non-blocking stream is not
// ordered after them, so wait for them before any rank work is enqueued.
Status uploads_done(const Device& device) {
#ifdef DETDIT_WITH_CUDA
  if (device.is_cuda()) {
    const cudaError_t err = cudaStreamSynchronize(nullptr);
    if (err != cudaSuccess) return Status::runtime_error(std::string("uploads: ") + cudaGetErrorString(err));
  }
#else
  (void)device;
#endif
  return Status::ok_status();
}

HostTensor filled(DType dtype, std::vector<int64_t> shape, const Fill& fill) {
  HostTensor t(dtype, std::move(shape));
  fill(&t);
  return t;
}

// The fraction of elements of an FP32 rank-order sum that differ from WS1's bits.
double fraction_differing(const std::vector<float>& sum, const HostTensor& ws1) {
  const int64_t count = static_cast<int64_t>(sum.size());
  return static_cast<double>(compare_bytes(ws1.data(), sum.data(), count, DType::kF32).count) /
         static_cast<double>(count);
}

}  // namespace

HostTensor local_rows(const HostTensor& full, int64_t batch, int64_t seq_len, int64_t lo, int64_t hi) {
  const int64_t width = full.numel() / (batch * seq_len);
  const std::size_t element = dtype_size(full.dtype());
  std::vector<int64_t> shape = full.shape();
  if (shape.size() == 3) {
    shape[1] = hi - lo;
  } else {
    shape[0] = batch * (hi - lo);
  }
  HostTensor local(full.dtype(), shape);
  const std::size_t run = static_cast<std::size_t>((hi - lo) * width) * element;
  for (int64_t b = 0; b < batch; ++b) {
    std::memcpy(static_cast<char*>(local.data()) + b * run,
                static_cast<const char*>(full.data()) + static_cast<std::size_t>((b * seq_len + lo) * width) * element,
                run);
  }
  return local;
}

Status run_and_download(const ParallelRun& run, Stream stream, std::vector<HostTensor>* outputs) {
  DETDIT_RETURN_IF_ERROR(run.forward());
  if (run.backward) DETDIT_RETURN_IF_ERROR(run.backward());
  outputs->resize(run.outputs.size());
  for (std::size_t i = 0; i < run.outputs.size(); ++i)
    DETDIT_RETURN_IF_ERROR(run.outputs[i].tensor.to_host(&(*outputs)[i], stream));
  return Status::ok_status();
}

Status compare_with_ws1(const ParallelRun& run, const std::vector<HostTensor>& ws1, Stream stream,
                        const std::string& prefix, std::vector<OutputReport>* reports) {
  if (ws1.size() != run.outputs.size())
    return Status::runtime_error(prefix + "the run has " + std::to_string(run.outputs.size()) + " outputs, WS1 " +
                                 std::to_string(ws1.size()));
  for (std::size_t i = 0; i < run.outputs.size(); ++i) {
    const RunOutput& o = run.outputs[i];
    const TensorView& view = o.tensor.view();
    HostTensor copy;
    const char* got = static_cast<const char*>(view.data);
    if (view.device.is_cuda()) {
      DETDIT_RETURN_IF_ERROR(o.tensor.to_host(&copy, stream));
      got = static_cast<const char*>(copy.data());
    }
    OutputReport report;
    report.output = prefix + o.name;
    const std::size_t bytes = view.nbytes();
    const std::size_t expected_bytes =
        o.per_position ? ws1[i].nbytes() / static_cast<std::size_t>(run.length) * static_cast<std::size_t>(run.hi - run.lo)
                       : ws1[i].nbytes();
    if (bytes != expected_bytes || view.dtype != ws1[i].dtype()) {
      report.mismatch.shape_error = std::to_string(bytes) + " bytes of " + dtype_name(view.dtype) + ", WS1's part has " +
                                    std::to_string(expected_bytes) + " of " + dtype_name(ws1[i].dtype());
      reports->push_back(std::move(report));
      continue;
    }
    const int64_t count = static_cast<int64_t>(bytes / dtype_size(view.dtype));
    if (!o.per_position) {
      report.mismatch = compare_bytes(ws1[i].data(), got, count, view.dtype);
      reports->push_back(std::move(report));
      continue;
    }
    // (batch, lo..hi, ...) of WS1's (batch, length, ...): one memcmp per batch item.
    const std::size_t part = bytes / static_cast<std::size_t>(run.batch);
    const std::size_t item = ws1[i].nbytes() / static_cast<std::size_t>(run.batch);
    const std::size_t offset = item / static_cast<std::size_t>(run.length) * static_cast<std::size_t>(run.lo);
    bool equal = true;
    for (int64_t b = 0; b < run.batch && equal; ++b)
      equal = std::memcmp(static_cast<const char*>(ws1[i].data()) + b * item + offset, got + b * part, part) == 0;
    if (equal) {
      report.mismatch.dtype = view.dtype;
      report.mismatch.compared = count;
    } else {
      const HostTensor expected = local_rows(ws1[i], run.batch, run.length, run.lo, run.hi);
      report.mismatch = compare_bytes(expected.data(), got, count, view.dtype);
    }
    reports->push_back(std::move(report));
  }
  return Status::ok_status();
}

Status run_world(int world, const Device& device, Communicator* comm,
                 const std::function<Status(Communicator& comm)>& rank) {
  if (comm != nullptr) return rank(*comm);
  return InProcessGroup::run(world, rank, device);
}

Status gather_host_bytes(Communicator& comm, const void* record, std::size_t bytes, std::vector<char>* all) {
  if (bytes % 4 != 0) return Status::value_error("gather_host_bytes needs a multiple of 4 bytes, got " + std::to_string(bytes));
  const std::size_t world = static_cast<std::size_t>(comm.world_size());
  all->assign(bytes * world, 0);
  if (!comm.device().is_cuda()) return comm.all_gather(record, bytes, all->data(), DType::kI32, nullptr);
#ifdef DETDIT_WITH_CUDA
  void* device = nullptr;
  if (cudaMalloc(&device, bytes * (world + 1)) != cudaSuccess) {
    return Status::runtime_error(std::string("cudaMalloc: ") + cudaGetErrorString(cudaGetLastError()));
  }
  char* send = static_cast<char*>(device);
  Status status = cudaMemcpy(send, record, bytes, cudaMemcpyHostToDevice) == cudaSuccess
                      ? comm.all_gather(send, bytes, send + bytes, DType::kI32, nullptr)
                      : Status::runtime_error("cudaMemcpy of a record to the device failed");
  if (status.ok() && (cudaDeviceSynchronize() != cudaSuccess ||
                      cudaMemcpy(all->data(), send + bytes, bytes * world, cudaMemcpyDeviceToHost) != cudaSuccess)) {
    status = Status::runtime_error(std::string("gathered records to the host: ") +
                                   cudaGetErrorString(cudaGetLastError()));
  }
  cudaFree(device);
  return status;
#else
  return Status::runtime_error("a CUDA communicator needs a CUDA build of detdit");
#endif
}

// ---- sp_region -------------------------------------------------------------

const char* sp_variant_name(SpVariant variant) {
  switch (variant) {
    case SpVariant::kPlainRmsnorm: return "rmsnorm";
    case SpVariant::kModulatedRmsnorm: return "modulated rmsnorm";
    case SpVariant::kGateResidual: return "gate_residual";
    case SpVariant::kGateResidualRmsnorm: return "gate_residual_rmsnorm";
  }
  return "?";
}

std::string SpShape::name() const {
  return "S=" + std::to_string(seq_len) + " B=" + std::to_string(batch) + " " + packing_name(packing);
}

Status make_sp_problem(const CaseContext& context, const SpShape& shape, SpProblem* problem) {
  SpProblem& p = *problem;
  p.shape = shape;
  const int64_t rows = 3 * shape.timesteps, b = shape.batch, s = shape.seq_len, h = shape.hidden;
  const IndexCase index = make_index_case(shape.packing, s, shape.timesteps, 1);
  p.rows = HostTensor(DType::kI32, {s});
  for (int64_t i = 0; i < s; ++i) p.rows.ptr<int32_t>()[i] = static_cast<int32_t>(index.row(i));
  const uint64_t seed = context.seed;
  p.x = filled(shape.dtype, {b, s, h}, uniform_values(seed + 101, 0.0, 1.0));
  p.grad = filled(shape.dtype, {b, s, h}, uniform_values(seed + 102, 0.0, 1.0));
  p.weight = filled(shape.dtype, {h},
                    weight_or(context, "transformer_blocks.0.norm1.weight", uniform_values(seed + 106, 1.0, 0.2)));
  p.shift = filled(shape.dtype, {rows, h}, uniform_values(seed + 103, 0.0, 0.5));
  p.scale = filled(shape.dtype, {rows, h}, uniform_values(seed + 104, 0.0, 0.5));
  p.gate = filled(shape.dtype, {rows, h}, uniform_values(seed + 105, 0.0, 0.5));
  return Status::ok_status();
}

Status make_sp_index(const SpProblem& problem, const Device& device, SpIndex* index) {
  DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(problem.rows, device, &index->index));
  return IndexPlan::from_row_index(index->index.view(), 3 * problem.shape.timesteps, problem.shape.batch,
                                   &index->plan);
}

Status prepare_sp_run(const SpProblem& pr, const SpIndex& index, SpVariant variant, const Device& device,
                      Stream stream, const SpPlan* sp, Communicator* comm, ParallelRun* run) {
  if (sp != nullptr && comm == nullptr) return Status::value_error("an sp run needs a communicator");
  const SpShape& sh = pr.shape;
  const int64_t lo = sp ? sp->local_begin() : 0, hi = sp ? sp->local_end() : sh.seq_len;
  const int64_t batch = sh.batch, hidden = sh.hidden, rows = pr.shift.shape()[0], local = hi - lo;
  run->batch = batch;
  run->length = sh.seq_len;
  run->lo = lo;
  run->hi = hi;
  // (B, S_local, H) rows of this rank (the whole sequence for WS1).
  auto upload_rows = [&](const HostTensor& full, DeviceTensor* t) {
    return sp ? DeviceTensor::from_host(local_rows(full, batch, sh.seq_len, lo, hi), device, t)
              : DeviceTensor::from_host(full, device, t);
  };
  run->inputs.resize(6);
  DETDIT_RETURN_IF_ERROR(upload_rows(pr.x, &run->inputs[0]));
  DETDIT_RETURN_IF_ERROR(upload_rows(pr.grad, &run->inputs[1]));
  const TensorView x = run->inputs[0].view(), grad = run->inputs[1].view();
  const std::vector<int64_t> act_shape = {batch, local, hidden}, table_shape = {rows, hidden};
  const DType act = sh.dtype, wgrad = sh.weight_grad_dtype, tgrad = sh.table_grad_dtype;
  std::vector<RunOutput>& out = run->outputs;
  const SpPlan plan_copy = sp ? *sp : SpPlan();
  const bool parallel = sp != nullptr;

  if (variant == SpVariant::kGateResidualRmsnorm) {
    const HostTensor* tables[] = {&pr.weight, &pr.shift, &pr.scale, &pr.gate};
    for (int i = 0; i < 4; ++i) DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(*tables[i], device, &run->inputs[2 + i]));
    DETDIT_RETURN_IF_ERROR(output(act, act_shape, device, "h", true, &out));
    DETDIT_RETURN_IF_ERROR(output(act, act_shape, device, "out", true, &out));
    DETDIT_RETURN_IF_ERROR(output(DType::kF32, {batch * local}, device, "rstd", true, &out));
    DETDIT_RETURN_IF_ERROR(output(act, act_shape, device, "d_residual", true, &out));
    DETDIT_RETURN_IF_ERROR(output(act, act_shape, device, "d_y", true, &out));
    DETDIT_RETURN_IF_ERROR(output(tgrad, table_shape, device, "d_gate", false, &out));
    DETDIT_RETURN_IF_ERROR(output(wgrad, {hidden}, device, "d_weight", false, &out));
    DETDIT_RETURN_IF_ERROR(output(tgrad, table_shape, device, "d_shift", false, &out));
    DETDIT_RETURN_IF_ERROR(output(tgrad, table_shape, device, "d_scale", false, &out));
    // residual = x, y = grad; the gradients reaching out and h are x and grad.
    GateResidualRmsnormParams f;
    f.in = {x, grad, run->inputs[5].view(), run->inputs[2].view(), run->inputs[3].view(), run->inputs[4].view(),
            index.plan};
    f.in.numerics = sh.numerics;
    f.h = out[0].tensor.view();
    f.out = out[1].tensor.view();
    f.rstd = out[2].tensor.view();
    GateResidualRmsnormBackwardParams b;
    b.in = f.in;
    b.h = f.h;
    b.rstd = f.rstd;
    b.d_out = x;
    b.d_h = grad;
    b.d_residual = out[3].tensor.view();
    b.d_y = out[4].tensor.view();
    b.d_gate = out[5].tensor.view();
    b.d_weight = out[6].tensor.view();
    b.d_shift = out[7].tensor.view();
    b.d_scale = out[8].tensor.view();
    run->forward = [f, plan_copy, parallel, stream]() {
      return parallel ? sp_gate_residual_rmsnorm_forward(plan_copy, f, stream) : gate_residual_rmsnorm_forward(f, stream);
    };
    run->backward = [b, plan_copy, parallel, comm, stream]() {
      return parallel ? sp_gate_residual_rmsnorm_backward(*comm, plan_copy, b, stream)
                      : gate_residual_rmsnorm_backward(b, stream);
    };
    return uploads_done(device);
  }

  if (variant == SpVariant::kGateResidual) {
    DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(pr.gate, device, &run->inputs[2]));
    DETDIT_RETURN_IF_ERROR(output(act, act_shape, device, "out", true, &out));
    DETDIT_RETURN_IF_ERROR(output(act, act_shape, device, "d_residual", true, &out));
    DETDIT_RETURN_IF_ERROR(output(act, act_shape, device, "d_y", true, &out));
    DETDIT_RETURN_IF_ERROR(output(tgrad, table_shape, device, "d_gate", false, &out));
    // residual = x, y = grad; the incoming gradient of out is x.
    const GateResidualParams f{{x, grad, run->inputs[2].view(), index.plan}, out[0].tensor.view()};
    const GateResidualBackwardParams b{f.in, x, out[1].tensor.view(), out[2].tensor.view(), out[3].tensor.view()};
    run->forward = [f, plan_copy, parallel, stream]() {
      return parallel ? sp_gate_residual_forward(plan_copy, f, stream) : gate_residual_forward(f, stream);
    };
    run->backward = [b, plan_copy, parallel, comm, stream]() {
      return parallel ? sp_gate_residual_backward(*comm, plan_copy, b, stream) : gate_residual_backward(b, stream);
    };
    return uploads_done(device);
  }

  const bool modulated = variant == SpVariant::kModulatedRmsnorm;
  DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(pr.weight, device, &run->inputs[2]));
  DETDIT_RETURN_IF_ERROR(output(act, act_shape, device, "out", true, &out));
  DETDIT_RETURN_IF_ERROR(output(DType::kF32, {batch * local}, device, "rstd", true, &out));
  DETDIT_RETURN_IF_ERROR(output(act, act_shape, device, "dx", true, &out));
  DETDIT_RETURN_IF_ERROR(output(wgrad, {hidden}, device, "d_weight", false, &out));
  RmsnormParams f;
  f.in.x = x;
  f.in.weight = run->inputs[2].view();
  f.in.numerics = sh.numerics;
  f.out = out[0].tensor.view();
  f.rstd = out[1].tensor.view();
  if (modulated) {
    DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(pr.shift, device, &run->inputs[3]));
    DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(pr.scale, device, &run->inputs[4]));
    DETDIT_RETURN_IF_ERROR(output(tgrad, table_shape, device, "d_shift", false, &out));
    DETDIT_RETURN_IF_ERROR(output(tgrad, table_shape, device, "d_scale", false, &out));
    f.in.shift = run->inputs[3].view();
    f.in.scale = run->inputs[4].view();
    f.in.plan = index.plan;  // a plain norm takes no plan
  }
  RmsnormBackwardParams b;
  b.in = f.in;
  b.rstd = f.rstd;
  b.grad = grad;
  b.dx = out[2].tensor.view();
  b.d_weight = out[3].tensor.view();
  if (modulated) {
    b.d_shift = out[4].tensor.view();
    b.d_scale = out[5].tensor.view();
  }
  run->forward = [f, plan_copy, parallel, stream]() {
    return parallel ? sp_rmsnorm_forward(plan_copy, f, stream) : rmsnorm_forward(f, stream);
  };
  run->backward = [b, plan_copy, parallel, comm, stream]() {
    return parallel ? sp_rmsnorm_backward(*comm, plan_copy, b, stream) : rmsnorm_backward(b, stream);
  };
  return uploads_done(device);
}

Status sp_ws1(const SpProblem& problem, const SpIndex& index, SpVariant variant, const Device& device,
              std::vector<HostTensor>* ws1) {
  ParallelRun run;
  DETDIT_RETURN_IF_ERROR(prepare_sp_run(problem, index, variant, device, nullptr, nullptr, nullptr, &run));
  return run_and_download(run, nullptr, ws1);
}

Status sp_rank_against_ws1(const SpProblem& problem, const SpIndex& index, SpVariant variant, const Device& device,
                           Communicator& comm, const std::vector<HostTensor>& ws1, std::vector<OutputReport>* reports) {
  RankStream stream(device);
  SpPlan sp;
  DETDIT_RETURN_IF_ERROR(SpPlan::create(index.plan, comm.world_size(), comm.rank(), &sp, stream.get()));
  ParallelRun run;
  DETDIT_RETURN_IF_ERROR(prepare_sp_run(problem, index, variant, device, stream.get(), &sp, &comm, &run));
  DETDIT_RETURN_IF_ERROR(run.forward());
  DETDIT_RETURN_IF_ERROR(run.backward());
  return compare_with_ws1(run, ws1, stream.get(), std::string(sp_variant_name(variant)) + " ", reports);
}

Status sp_naive_fractions(const SpProblem& pr, const SpIndex& index, const Device& device, SpVariant variant,
                          int world, const std::vector<HostTensor>& ws1,
                          std::vector<std::pair<std::string, double>>* fractions) {
  if (!sp_variant_has_naive_contrast(variant)) return Status::value_error("no naive contrast of this variant");
  const SpShape& sh = pr.shape;
  const bool gate = variant == SpVariant::kGateResidual;
  const int64_t hidden = sh.hidden, rows = pr.shift.shape()[0];
  // WS1's outputs in prepare_sp_run's order: rmsnorm (out, rstd, dx, d_weight,
  // d_shift, d_scale), gate_residual (out, d_residual, d_y, d_gate).
  const HostTensor& first_ws1 = ws1[3];
  if (first_ws1.dtype() != DType::kF32 || (!gate && ws1[5].dtype() != DType::kF32))
    return Status::value_error("the naive contrast compares FP32 gradients");
  std::vector<float> first(gate ? rows * hidden : hidden, 0.0f), second(gate ? 0 : rows * hidden, 0.0f);
  for (int rank = 0; rank < world; ++rank) {
    SpPlan sp;
    DETDIT_RETURN_IF_ERROR(SpPlan::create(index.plan, world, rank, &sp));
    const int64_t lo = sp.local_begin(), hi = sp.local_end();
    DeviceTensor x, grad, rstd, weight, table_a, table_b, part_a, part_b;
    DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(local_rows(pr.x, sh.batch, sh.seq_len, lo, hi), device, &x));
    DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(local_rows(pr.grad, sh.batch, sh.seq_len, lo, hi), device, &grad));
    if (gate) {
      DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(pr.gate, device, &table_a));
      DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(DType::kF32, {rows, hidden}, device, &part_a));
      // As in prepare_sp_run: y = grad, the incoming gradient is x.
      GateResidualBackwardParams b;
      b.grad = x.view();
      b.in.y = grad.view();
      b.in.gate = table_a.view();
      b.in.plan = sp.local_plan();
      b.d_gate = part_a.view();
      DETDIT_RETURN_IF_ERROR(gate_residual_backward(b));
    } else {
      DETDIT_RETURN_IF_ERROR(
          DeviceTensor::from_host(local_rows(ws1[1], sh.batch, sh.seq_len, lo, hi), device, &rstd));
      DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(pr.weight, device, &weight));
      DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(pr.shift, device, &table_a));
      DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(pr.scale, device, &table_b));
      DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(DType::kF32, {hidden}, device, &part_a));
      DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(DType::kF32, {rows, hidden}, device, &part_b));
      RmsnormBackwardParams b;
      b.in.x = x.view();
      b.in.weight = weight.view();
      b.in.shift = table_a.view();
      b.in.scale = table_b.view();
      b.in.plan = sp.local_plan();
      b.rstd = rstd.view();
      b.grad = grad.view();
      b.d_weight = part_a.view();
      b.d_scale = part_b.view();
      DETDIT_RETURN_IF_ERROR(rmsnorm_backward(b));
    }
    HostTensor a, b;
    DETDIT_RETURN_IF_ERROR(part_a.to_host(&a));
    for (std::size_t i = 0; i < first.size(); ++i) first[i] += a.ptr<float>()[i];
    if (!gate) {
      DETDIT_RETURN_IF_ERROR(part_b.to_host(&b));
      for (std::size_t i = 0; i < second.size(); ++i) second[i] += b.ptr<float>()[i];
    }
  }
  if (gate) {
    fractions->push_back({"d_gate", fraction_differing(first, ws1[3])});
  } else {
    fractions->push_back({"d_weight", fraction_differing(first, ws1[3])});
    fractions->push_back({"d_scale", fraction_differing(second, ws1[5])});
  }
  return Status::ok_status();
}

double sp_backward_bytes_per_rank(const SpPlan& sp, SpVariant variant, int64_t hidden) {
  const double activation = 2.0 * static_cast<double>(hidden);  // one bf16 row
  const double h = static_cast<double>(hidden);
  const double send = static_cast<double>(sp.max_send());
  // One broadcast of the chain's FP32 running sums per link.
  const double links = static_cast<double>(sp.chain_links());
  const double rows = static_cast<double>(sp.global_plan().num_rows());
  switch (variant) {
    case SpVariant::kPlainRmsnorm:  // rows x, grad, rstd; d_weight sums (H)
      return send * (2 * activation + 4) + links * h * 4;
    case SpVariant::kModulatedRmsnorm:  // + d_shift | d_scale sums (R, 2H)
      return send * (2 * activation + 4) + links * (h + rows * 2 * h) * 4;
    case SpVariant::kGateResidual:  // rows grad, y; d_gate sums (R, H)
      return send * 2 * activation + links * rows * h * 4;
    case SpVariant::kGateResidualRmsnorm:  // the modulated norm's bytes, then the gate's
      return sp_backward_bytes_per_rank(sp, SpVariant::kModulatedRmsnorm, hidden) +
             sp_backward_bytes_per_rank(sp, SpVariant::kGateResidual, hidden);
  }
  return 0;
}

std::vector<double> sp_send_rows_per_rank(const SpPlan& sp) {
  std::vector<double> send_rows;
  for (const SpPlan::RankTraffic& t : sp.traffic()) send_rows.push_back(static_cast<double>(t.send_rows));
  return send_rows;
}

namespace {

// An sp_region case named "S=<seq_len> <packing>" at the context's H (B = 2, T = 3).
SpRegionCase sp_case(const CaseContext& context, int64_t seq_len, Packing packing) {
  SpRegionCase c;
  c.name = "S=" + std::to_string(seq_len) + " " + packing_name(packing);
  c.shape.packing = packing;
  c.shape.seq_len = seq_len;
  c.shape.hidden = context.hidden;
  return c;
}

}  // namespace

std::vector<SpRegionCase> sp_region_cases(const CaseContext& context, const ParallelSetting& setting) {
  const bool mpi = setting.mpi_world > 0;
  std::vector<SpRegionCase> all;
  for (int64_t seq_len : {int64_t{4097}, int64_t{32768}, int64_t{131072}}) {
    for (Packing packing : {Packing::kBlock, Packing::kInterleaved}) {
      SpRegionCase c = sp_case(context, seq_len, packing);
      // In-process runs do 32768 with --full; multi-process runs always
      // (every rank then holds a share of it).
      c.enabled = seq_len == 4097 || (seq_len == 32768 && (setting.full || mpi)) ||
                  (seq_len == 131072 && mpi && setting.cuda && !setting.quick);
      if (mpi) {
        c.worlds = {setting.mpi_world};
      } else if (!setting.cuda && seq_len > 4097) {
        c.worlds = {3};
      } else if (!setting.cuda && setting.quick) {
        c.worlds = {1, 2, 3, 8};
      } else {
        c.worlds = {1, 2, 3, 4, 5, 6, 7, 8};
      }
      for (int w : c.worlds) {
        // The contrast on the CPU only at S = 4097 (at 32768 it costs a whole backward per world).
        if (!setting.cuda && !mpi && seq_len > 4097) continue;
        if (w == 2 || w == 4 || w == 8 || (mpi && w > 1)) c.naive_worlds.push_back(w);
      }
      all.push_back(std::move(c));
    }
  }
  return all;
}

std::vector<SpRegionCase> sp_region_matrix_cases(const CaseContext& context, const std::vector<int64_t>& seq_lens,
                                                 const std::vector<int>& worlds) {
  std::vector<SpRegionCase> all;
  for (int64_t seq_len : seq_lens)
    for (int64_t batch : {int64_t{1}, int64_t{2}})
      for (Packing packing : {Packing::kBlock, Packing::kInterleaved}) {
        SpRegionCase c;
        c.shape.packing = packing;
        c.shape.seq_len = seq_len;
        c.shape.batch = batch;
        c.shape.hidden = context.hidden;
        c.name = c.shape.name();
        c.worlds = worlds;
        for (int w : worlds)
          if (w == 2 || w == 4 || w == 8) c.naive_worlds.push_back(w);
        all.push_back(std::move(c));
      }
  return all;
}

std::vector<SpRegionCase> sp_region_bench_cases(const CaseContext& context, const ParallelSetting& setting) {
  std::vector<int64_t> lengths = {4097};
  if (setting.cuda) lengths = setting.quick ? std::vector<int64_t>{32768} : std::vector<int64_t>{32768, 131072};
  std::vector<SpRegionCase> all;
  for (int64_t seq_len : lengths) {
    for (Packing packing : {Packing::kBlock, Packing::kInterleaved}) {
      SpRegionCase c = sp_case(context, seq_len, packing);
      c.worlds = setting.mpi_world > 0 ? std::vector<int>{setting.mpi_world} : std::vector<int>{2, 4, 8};
      all.push_back(std::move(c));
    }
  }
  return all;
}

// ---- tp_adaln_projection -----------------------------------------------------

Status make_tp_problem(const CaseContext& context, const TpShape& shape, TpProblem* problem) {
  TpProblem& p = *problem;
  p.shape = shape;
  const int64_t t = shape.timesteps, n = shape.out_features, d = shape.in_features;
  const uint64_t seed = context.seed;
  p.temb = filled(shape.chunks > 0 ? shape.dtype : DType::kF32, {t, d}, uniform_values(seed + 201, 0.0, 1.0));
  p.grad_table = filled(DType::kF32, {t, n}, uniform_values(seed + 202, 0.0, 1.0));
  // The context's projection when it has one of the shape: a view (an H3
  // weight is half a gigabyte), else generated weights of the scale of a
  // linear layer's initialisation.
  TensorView w, b;
  if (context.weight && context.weight(shape.weight + ".weight", &w).ok() &&
      context.weight(shape.weight + ".bias", &b).ok() && w.rank == 2 && w.shape[0] == n &&
      w.shape[1] == d && w.dtype == shape.dtype && b.dtype == shape.dtype && b.rank == 1 && b.shape[0] == n) {
    p.weight = w;
    p.bias = b;
    return Status::ok_status();
  }
  const double bound = 1.0 / std::sqrt(static_cast<double>(d));
  p.owned_weight = filled(shape.dtype, {n, d}, uniform_values(seed + 203, 0.0, bound));
  p.owned_bias = filled(shape.dtype, {n}, uniform_values(seed + 204, 0.0, bound));
  p.weight = p.owned_weight.view();
  p.bias = p.owned_bias.view();
  return Status::ok_status();
}

Status upload_tp_weights(const TpProblem& problem, const Device& device, TpWeights* weights) {
  weights->weight_view = problem.weight;
  weights->bias_view = problem.bias;
  if (!device.is_cuda()) return Status::ok_status();
  const TensorView* sources[] = {&problem.weight, &problem.bias};
  DeviceTensor* targets[] = {&weights->weight, &weights->bias};
  TensorView* views[] = {&weights->weight_view, &weights->bias_view};
  for (int i = 0; i < 2; ++i) {
    HostTensor host(sources[i]->dtype, std::vector<int64_t>(sources[i]->shape, sources[i]->shape + sources[i]->rank));
    std::memcpy(host.data(), sources[i]->data, host.nbytes());
    DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(host, device, targets[i]));
    *views[i] = targets[i]->view();
  }
  return Status::ok_status();
}

Status prepare_tp_run(const TpProblem& pr, const TpWeights& weights, const Device& device, Stream stream,
                      Communicator* comm, ParallelRun* run) {
  const TpShape& sh = pr.shape;
  run->batch = 1;
  run->length = sh.out_features;
  run->lo = 0;
  run->hi = sh.out_features;
  if (comm != nullptr) {
    DETDIT_RETURN_IF_ERROR(tp_column_shard(sh.out_features, comm->world_size(), comm->rank(), &run->lo, &run->hi));
  }
  const int64_t columns = run->hi - run->lo, t = sh.timesteps, d = sh.in_features;
  const DType dtype = weights.weight_view.dtype;
  run->inputs.resize(2);
  DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(pr.temb, device, &run->inputs[0]));
  DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(pr.grad_table, device, &run->inputs[1]));
  std::vector<RunOutput>& out = run->outputs;
  DETDIT_RETURN_IF_ERROR(output(dtype, {t, sh.out_features}, device, "table", false, &out));
  DETDIT_RETURN_IF_ERROR(output(dtype, {t, d}, device, "act", false, &out));
  DETDIT_RETURN_IF_ERROR(output(DType::kF32, {t, d}, device, "d_temb", false, &out));
  DETDIT_RETURN_IF_ERROR(output(dtype, {columns, d}, device, "d_weight", true, &out));
  DETDIT_RETURN_IF_ERROR(output(dtype, {columns}, device, "d_bias", true, &out));
  // This rank's rows of the shared weight: views, no copies.
  const TensorView weight = weights.weight_view.narrow(0, run->lo, columns);
  const TensorView bias = weights.bias_view.narrow(0, run->lo, columns);
  const TensorView temb = run->inputs[0].view();
  const AdalnProjectionParams f{{temb, weight, bias, sh.numerics, sh.chunks}, out[0].tensor.view(),
                                out[1].tensor.view()};
  const AdalnProjectionBackwardParams b{f.in, f.act, run->inputs[1].view(), out[2].tensor.view(),
                                        out[3].tensor.view(), out[4].tensor.view()};
  run->forward = [f, comm, stream]() {
    return comm ? tp_adaln_projection_forward(*comm, f, stream) : adaln_projection_forward(f, stream);
  };
  run->backward = [b, comm, stream]() {
    return comm ? tp_adaln_projection_backward(*comm, b, stream) : adaln_projection_backward(b, stream);
  };
  return uploads_done(device);
}

Status tp_ws1(const TpProblem& problem, const TpWeights& weights, const Device& device, std::vector<HostTensor>* ws1) {
  ParallelRun run;
  DETDIT_RETURN_IF_ERROR(prepare_tp_run(problem, weights, device, nullptr, nullptr, &run));
  return run_and_download(run, nullptr, ws1);
}

Status tp_rank_against_ws1(const TpProblem& problem, const TpWeights& weights, const Device& device,
                           Communicator& comm, const std::vector<HostTensor>& ws1, std::vector<OutputReport>* reports) {
  RankStream stream(device);
  ParallelRun run;
  DETDIT_RETURN_IF_ERROR(prepare_tp_run(problem, weights, device, stream.get(), &comm, &run));
  DETDIT_RETURN_IF_ERROR(run.forward());
  DETDIT_RETURN_IF_ERROR(run.backward());
  return compare_with_ws1(run, ws1, stream.get(), "", reports);
}

TpShape tp_adaln_projection_shape(const CaseContext& context, int64_t timesteps) {
  TpShape shape;
  shape.timesteps = timesteps;
  shape.out_features = 18 * context.hidden;
  shape.in_features = context.time_embed_dim;
  TensorView w;
  if (context.weight && context.weight("transformer_blocks.0.adaln_proj.linear.weight", &w).ok() && w.rank == 2) {
    shape.out_features = w.shape[0];
    shape.in_features = w.shape[1];
    shape.dtype = w.dtype;
  }
  return shape;
}

std::vector<TpCase> tp_adaln_projection_cases(const CaseContext& context, const ParallelSetting& setting) {
  const bool mpi = setting.mpi_world > 0;
  std::vector<int> worlds = {1, 2, 3, 4, 5, 6, 7, 8};
  if (mpi) {
    worlds = {setting.mpi_world};
  } else if (setting.quick && !setting.cuda) {
    worlds = {1, 3, 8};
  }
  std::vector<TpCase> all;
  for (int64_t t = 1; t <= 4; ++t) {
    TpCase c;
    c.name = "T=" + std::to_string(t);
    c.shape = tp_adaln_projection_shape(context, t);
    c.worlds = worlds;
    // On the CPU --quick keeps T = 1 and 4 (each TP world costs a full H3 projection).
    c.enabled = t == 1 || t == 4 || !setting.quick || setting.cuda || mpi;
    all.push_back(std::move(c));
  }
  return all;
}

std::vector<TpCase> tp_adaln_projection_matrix_cases(const CaseContext& context, const std::vector<int>& worlds) {
  std::vector<TpCase> all;
  for (int64_t t : context.quick ? std::vector<int64_t>{1, 4} : std::vector<int64_t>{1, 2, 3, 4}) {
    TpCase c;
    c.name = "T=" + std::to_string(t);
    c.shape = tp_adaln_projection_shape(context, t);
    c.worlds = worlds;
    all.push_back(std::move(c));
  }
  return all;
}

std::vector<TpCase> tp_adaln_projection_bench_cases(const CaseContext& context, const ParallelSetting& setting) {
  std::vector<TpCase> all;
  for (int64_t t : setting.cuda && !setting.quick ? std::vector<int64_t>{1, 4} : std::vector<int64_t>{4}) {
    TpCase c;
    c.name = "T=" + std::to_string(t);
    c.shape = tp_adaln_projection_shape(context, t);
    c.worlds = setting.mpi_world > 0 ? std::vector<int>{setting.mpi_world} : std::vector<int>{2, 4, 8};
    all.push_back(std::move(c));
  }
  return all;
}

Status tp_bytes_sent_per_rank(const TpShape& shape, int world, double* forward, double* backward) {
  int64_t begin = 0, end = 0;
  DETDIT_RETURN_IF_ERROR(tp_column_shard(shape.out_features, world, 0, &begin, &end));
  const double columns = static_cast<double>(end - begin), timesteps = static_cast<double>(shape.timesteps);
  *forward = timesteps * columns * static_cast<double>(dtype_size(shape.dtype));
  *backward = std::ceil(columns / 64) * timesteps * static_cast<double>(shape.in_features) * 4;
  return Status::ok_status();
}

// ---- predicting a world ------------------------------------------------------

Status PredictionComm::all_gather(const void*, std::size_t bytes, void*, DType, Stream) {
  calls.push_back({true, bytes});
  return Status::ok_status();
}

Status PredictionComm::broadcast(void*, std::size_t bytes, int, DType, Stream) {
  calls.push_back({false, bytes});
  return Status::ok_status();
}

double PredictionComm::link_seconds(double bus_bytes_per_second, double latency_seconds, double* bus_bytes) const {
  double seconds = 0;
  *bus_bytes = 0;
  for (const Call& call : calls) {
    const double bytes = static_cast<double>(call.bytes) * (call.all_gather ? world_ - 1 : 1);
    seconds += latency_seconds + bytes / bus_bytes_per_second;
    *bus_bytes += bytes;
  }
  return seconds;
}

}  // namespace cases
}  // namespace detdit
