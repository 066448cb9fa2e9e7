// The parallel problems, one rank's run of them, and the MPI world of the CLI
// (parallel_common.h).
#include "parallel_common.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cases/parallel_for.h"
#include "detdit/adaln.h"
#include "detdit/gate_residual.h"
#include "detdit/gate_residual_rmsnorm.h"
#include "detdit/rmsnorm.h"
#include "environment.h"

#ifdef DETDIT_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace detdit {
namespace cli {
namespace {

uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

Status copy_weight(const Weights& weights, const std::string& name, HostTensor* out) {
  TensorView v;
  DETDIT_RETURN_IF_ERROR(weights.view(name, &v));
  *out = HostTensor(v.dtype, std::vector<int64_t>(v.shape, v.shape + v.rank));
  std::memcpy(out->data(), v.data, out->nbytes());
  return Status::ok_status();
}

Status output(DType dtype, std::vector<int64_t> shape, const Device& device, const char* name, bool per_position,
              std::vector<SpOutput>* outputs) {
  SpOutput o{name, per_position, DeviceTensor()};
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

}  // namespace

HostTensor packed_rows(Packing packing, int64_t seq_len, int64_t num_timesteps) {
  const cases::IndexCase index = cases::make_index_case(packing, seq_len, num_timesteps, 1);
  HostTensor rows(DType::kI32, {seq_len});
  for (int64_t s = 0; s < seq_len; ++s) rows.ptr<int32_t>()[s] = static_cast<int32_t>(index.row(s));
  return rows;
}

void fill_hashed(HostTensor* buffer, uint64_t seed) {
  const int64_t count = buffer->numel();
  constexpr int64_t kBlock = int64_t{1} << 16;
  const uint64_t key = mix64(seed + 0x5DEECE66Dull);
  const bool bf16 = buffer->dtype() == DType::kBF16;
  uint16_t* half = buffer->ptr<uint16_t>();
  uint32_t* single = buffer->ptr<uint32_t>();
  cases::parallel_for(0, (count + kBlock - 1) / kBlock, [&](int64_t block) {
    const int64_t end = std::min(count, (block + 1) * kBlock);
    for (int64_t i = block * kBlock; i < end; ++i) {
      const uint64_t h = mix64(key + static_cast<uint64_t>(i));
      const uint32_t sign = static_cast<uint32_t>(h >> 63);
      const uint32_t exponent = 125u + static_cast<uint32_t>((h >> 32) % 3u);  // 2^-2 .. 2^0
      if (bf16) {
        half[i] = static_cast<uint16_t>((sign << 15) | (exponent << 7) | static_cast<uint32_t>(h & 0x7Fu));
      } else {
        single[i] = (sign << 31) | (exponent << 23) | static_cast<uint32_t>(h & 0x7FFFFFu);
      }
    }
  });
}

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

Status make_sp_problem(const Weights& weights, Packing packing, int64_t seq_len, uint64_t seed, SpProblem* problem) {
  SpProblem& p = *problem;
  p.packing = packing;
  p.seq_len = seq_len;
  p.batch = kSpBatch;
  p.hidden = weights.config.hidden;
  const int64_t rows = 3 * kSpTimesteps;
  p.rows = packed_rows(packing, seq_len, kSpTimesteps);
  p.x = HostTensor(DType::kBF16, {p.batch, seq_len, p.hidden});
  fill_hashed(&p.x, seed + 101);
  p.grad = HostTensor(DType::kBF16, {p.batch, seq_len, p.hidden});
  fill_hashed(&p.grad, seed + 102);
  DETDIT_RETURN_IF_ERROR(copy_weight(weights, "transformer_blocks.0.norm1.weight", &p.weight));
  p.shift = HostTensor(DType::kBF16, {rows, p.hidden});
  fill_verify_normal(&p.shift, seed + 103, 0.0, 0.5);
  p.scale = HostTensor(DType::kBF16, {rows, p.hidden});
  fill_verify_normal(&p.scale, seed + 104, 0.0, 0.5);
  p.gate = HostTensor(DType::kBF16, {rows, p.hidden});
  fill_verify_normal(&p.gate, seed + 105, 0.0, 0.5);
  return Status::ok_status();
}

Status make_sp_index(const SpProblem& problem, const Device& device, SpIndex* index) {
  DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(problem.rows, device, &index->index));
  return IndexPlan::from_row_index(index->index.view(), 3 * kSpTimesteps, problem.batch, &index->plan);
}

Status prepare_sp_run(const SpProblem& pr, const SpIndex& index, SpVariant variant, const Device& device,
                      Stream stream, const SpPlan* sp, Communicator* comm, SpRun* run) {
  if (sp != nullptr && comm == nullptr) return Status::value_error("an sp run needs a communicator");
  const int64_t lo = sp ? sp->local_begin() : 0, hi = sp ? sp->local_end() : pr.seq_len;
  const int64_t batch = pr.batch, hidden = pr.hidden, rows = pr.shift.shape()[0], local = hi - lo;
  // (B, S_local, H) rows of this rank (the whole sequence for WS1).
  auto upload_rows = [&](const HostTensor& full, DeviceTensor* t) {
    return sp ? DeviceTensor::from_host(local_rows(full, batch, pr.seq_len, lo, hi), device, t)
              : DeviceTensor::from_host(full, device, t);
  };
  run->inputs.resize(6);
  DETDIT_RETURN_IF_ERROR(upload_rows(pr.x, &run->inputs[0]));
  DETDIT_RETURN_IF_ERROR(upload_rows(pr.grad, &run->inputs[1]));
  const TensorView x = run->inputs[0].view(), grad = run->inputs[1].view();
  const std::vector<int64_t> act_shape = {batch, local, hidden}, table_shape = {rows, hidden};
  std::vector<SpOutput>& out = run->outputs;
  const SpPlan plan_copy = sp ? *sp : SpPlan();
  const bool parallel = sp != nullptr;

  if (variant == SpVariant::kGateResidualRmsnorm) {
    const HostTensor* tables[] = {&pr.weight, &pr.shift, &pr.scale, &pr.gate};
    for (int i = 0; i < 4; ++i) DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(*tables[i], device, &run->inputs[2 + i]));
    DETDIT_RETURN_IF_ERROR(output(DType::kBF16, act_shape, device, "h", true, &out));
    DETDIT_RETURN_IF_ERROR(output(DType::kBF16, act_shape, device, "out", true, &out));
    DETDIT_RETURN_IF_ERROR(output(DType::kF32, {batch * local}, device, "rstd", true, &out));
    DETDIT_RETURN_IF_ERROR(output(DType::kBF16, act_shape, device, "d_residual", true, &out));
    DETDIT_RETURN_IF_ERROR(output(DType::kBF16, act_shape, device, "d_y", true, &out));
    DETDIT_RETURN_IF_ERROR(output(DType::kF32, table_shape, device, "d_gate", false, &out));
    DETDIT_RETURN_IF_ERROR(output(DType::kF32, {hidden}, device, "d_weight", false, &out));
    DETDIT_RETURN_IF_ERROR(output(DType::kF32, table_shape, device, "d_shift", false, &out));
    DETDIT_RETURN_IF_ERROR(output(DType::kF32, table_shape, device, "d_scale", false, &out));
    // residual = x, y = grad; the gradients reaching out and h are x and grad.
    GateResidualRmsnormParams f;
    f.in = {x, grad, run->inputs[5].view(), run->inputs[2].view(), run->inputs[3].view(), run->inputs[4].view(),
            index.plan};
    f.in.numerics = pr.numerics;
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
    DETDIT_RETURN_IF_ERROR(output(DType::kBF16, act_shape, device, "out", true, &out));
    DETDIT_RETURN_IF_ERROR(output(DType::kBF16, act_shape, device, "d_residual", true, &out));
    DETDIT_RETURN_IF_ERROR(output(DType::kBF16, act_shape, device, "d_y", true, &out));
    DETDIT_RETURN_IF_ERROR(output(DType::kF32, table_shape, device, "d_gate", false, &out));
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
  DETDIT_RETURN_IF_ERROR(output(DType::kBF16, act_shape, device, "out", true, &out));
  DETDIT_RETURN_IF_ERROR(output(DType::kF32, {batch * local}, device, "rstd", true, &out));
  DETDIT_RETURN_IF_ERROR(output(DType::kBF16, act_shape, device, "dx", true, &out));
  DETDIT_RETURN_IF_ERROR(output(DType::kF32, {hidden}, device, "d_weight", false, &out));
  RmsnormParams f;
  f.in.x = x;
  f.in.weight = run->inputs[2].view();
  f.in.numerics = pr.numerics;
  f.out = out[0].tensor.view();
  f.rstd = out[1].tensor.view();
  if (modulated) {
    DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(pr.shift, device, &run->inputs[3]));
    DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(pr.scale, device, &run->inputs[4]));
    DETDIT_RETURN_IF_ERROR(output(DType::kF32, table_shape, device, "d_shift", false, &out));
    DETDIT_RETURN_IF_ERROR(output(DType::kF32, table_shape, device, "d_scale", false, &out));
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

// ---- tp_adaln_projection -----------------------------------------------------

Status make_tp_problem(const Weights& weights, int64_t timesteps, uint64_t seed, TpProblem* problem) {
  TpProblem& p = *problem;
  DETDIT_RETURN_IF_ERROR(weights.view("transformer_blocks.0.adaln_proj.linear.weight", &p.weight));
  DETDIT_RETURN_IF_ERROR(weights.view("transformer_blocks.0.adaln_proj.linear.bias", &p.bias));
  p.timesteps = timesteps;
  p.out_features = p.weight.shape[0];
  p.in_features = p.weight.shape[1];
  p.temb = HostTensor(DType::kF32, {timesteps, p.in_features});
  fill_verify_normal(&p.temb, seed + 201);
  p.grad_table = HostTensor(DType::kF32, {timesteps, p.out_features});
  fill_verify_normal(&p.grad_table, seed + 202);
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
                      Communicator* comm, TpRun* run) {
  run->begin = 0;
  run->end = pr.out_features;
  if (comm != nullptr) {
    DETDIT_RETURN_IF_ERROR(tp_column_shard(pr.out_features, comm->world_size(), comm->rank(), &run->begin, &run->end));
  }
  const int64_t columns = run->end - run->begin, t = pr.timesteps, d = pr.in_features;
  const DType dtype = weights.weight_view.dtype;
  run->inputs.resize(2);
  DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(pr.temb, device, &run->inputs[0]));
  DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(pr.grad_table, device, &run->inputs[1]));
  std::vector<SpOutput>& out = run->outputs;
  DETDIT_RETURN_IF_ERROR(output(dtype, {t, pr.out_features}, device, "table", false, &out));
  DETDIT_RETURN_IF_ERROR(output(dtype, {t, d}, device, "act", false, &out));
  DETDIT_RETURN_IF_ERROR(output(DType::kF32, {t, d}, device, "d_temb", false, &out));
  DETDIT_RETURN_IF_ERROR(output(dtype, {columns, d}, device, "d_weight", true, &out));
  DETDIT_RETURN_IF_ERROR(output(dtype, {columns}, device, "d_bias", true, &out));
  // This rank's rows of the shared weight: views, no copies.
  const TensorView weight = weights.weight_view.narrow(0, run->begin, columns);
  const TensorView bias = weights.bias_view.narrow(0, run->begin, columns);
  const TensorView temb = run->inputs[0].view();
  const AdalnProjectionParams f{{temb, weight, bias, pr.numerics}, out[0].tensor.view(), out[1].tensor.view()};
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

// ---- --comm mpi ---------------------------------------------------------------

Status open_mpi_world(bool cuda, std::unique_ptr<Communicator>* comm, Device* device, NcclOptions options) {
  std::unique_ptr<Communicator> mpi;
  DETDIT_RETURN_IF_ERROR(create_mpi_communicator(&mpi));
  if (!cuda) {
    *device = Device::cpu();
    *comm = std::move(mpi);
    return Status::ok_status();
  }
  // The rank on this host and the ranks on this host (Open MPI's launcher
  // variables; a single-host launcher without them: the MPI rank and world).
  auto from_env = [](const char* name, int fallback) {
    const char* value = std::getenv(name);
    return value != nullptr && *value != '\0' ? std::atoi(value) : fallback;
  };
  const int local_rank = from_env("OMPI_COMM_WORLD_LOCAL_RANK", mpi->rank());
  const int local_size = from_env("OMPI_COMM_WORLD_LOCAL_SIZE", mpi->world_size());
  const int gpus = cuda_device_count();
  Status usable;
  if (gpus == 0) {
    usable = Status::runtime_error("rank " + std::to_string(mpi->rank()) + " sees no CUDA device");
  } else if (local_size > gpus) {
    // NCCL refuses two ranks on one GPU; say so before it does.
    usable = Status::value_error(std::to_string(local_size) + " ranks on this host but " + std::to_string(gpus) +
                                 " GPUs: --comm mpi --device cuda needs one GPU per rank (use -np <= " +
                                 std::to_string(gpus) + ", or --comm inprocess to share one GPU)");
  }
  // Every rank learns whether any rank lacks a GPU before NCCL would wait for it.
  DETDIT_RETURN_IF_ERROR(mpi->agree(usable));
  *device = Device::cuda(local_rank % gpus);
#ifdef DETDIT_WITH_CUDA
  cudaSetDevice(device->index);
#endif
  // NVLink multicast (NVLS) stays off on the GPU machines: NCCL reads this
  // variable in ncclCommInitRank. A value the user set wins.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  return create_nccl_communicator_mpi(*device, comm, options);
}

int agree_on_command_line(int argc, char** argv) {
  if (!launched_by_mpi()) return -1;
  std::unique_ptr<Communicator> mpi;
  if (!create_mpi_communicator(&mpi).ok()) return -1;  // no MPI: no collective can wait either
  // The arguments NUL-separated, compared whole: their lengths first, then the
  // lines padded with NULs past the longest to a multiple of 4 bytes (what
  // gather_host_bytes moves; at least 4, also for an empty line).
  std::string line;
  for (int i = 1; i < argc; ++i) line.append(argv[i], std::strlen(argv[i]) + 1);
  const uint64_t length = line.size();
  const int world = mpi->world_size();
  std::vector<uint64_t> lengths(static_cast<std::size_t>(world));
  std::vector<char> all;
  Status status = gather_host_bytes(*mpi, &length, sizeof length, &all);
  if (status.ok()) {
    std::memcpy(lengths.data(), all.data(), all.size());
    line.resize((*std::max_element(lengths.begin(), lengths.end()) / 4 + 1) * 4, '\0');
    status = gather_host_bytes(*mpi, line.data(), line.size(), &all);
  }
  for (int r = 1; status.ok() && r < world; ++r) {
    if (lengths[r] != lengths[0] || std::memcmp(all.data() + r * line.size(), all.data(), line.size()) != 0)
      status = Status::value_error("rank " + std::to_string(r) + " was started with another command line than rank 0; "
                                   "under mpirun every rank must run the same detdit command with the same options");
  }
  if (status.ok()) return -1;
  std::fprintf(stderr, "detdit: rank %d of %d: %s\n", mpi->rank(), mpi->world_size(), status.to_string().c_str());
  return 2;
}

Status all_ranks_ok(Communicator& comm, const Status& local) {
  const int32_t failed = local.ok() ? 0 : 1;
  std::vector<char> all;
  DETDIT_RETURN_IF_ERROR(gather_host_bytes(comm, &failed, sizeof failed, &all));
  if (!local.ok()) return local;
  for (int r = 0; r < comm.world_size(); ++r) {
    if (reinterpret_cast<const int32_t*>(all.data())[r] != 0) {
      return Status::runtime_error("rank " + std::to_string(r) + " failed (its own output says why)");
    }
  }
  return Status::ok_status();
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

}  // namespace cli
}  // namespace detdit
