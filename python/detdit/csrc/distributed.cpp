// detdit.distributed's C++ half (contract in distributed.h): the
// torch.distributed communicator and its handle registry, the SpPlan
// constructor, and the tp_/sp_ device kernels.
#include "distributed.h"

#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include <torch/csrc/autograd/python_variable.h>

#include "detdit/comm.h"
#include "ops.h"

namespace detdit_torch {
namespace {

// Ranks over a torch.distributed group. The transport is a Python callable
// move(send, recv, root=None): without root it all-gathers the uint8 tensor
// `send` into `recv` (world * send.numel() bytes, rank-ordered); with root it
// broadcasts rank root's `recv` into every rank's `recv` (send is recv). It is
// the only thing that moves bytes, and it never reduces. On top of it, as
// comm.h requires, every all_gather and broadcast first exchanges a
// fixed-size header {call number, op, bytes, dtype, root} so that mismatched
// calls fail with the same ValueError on every rank, and agree() exchanges
// each rank's validation Status.
class TorchDistCommunicator : public detdit::Communicator {
 public:
  TorchDistCommunicator(PyObject* gather, int rank, int world, detdit::Device device)
      : gather_(gather), rank_(rank), world_(world), device_(device) {
    Py_INCREF(gather_);
  }
  ~TorchDistCommunicator() override {
    // A communicator still registered at exit dies after the interpreter:
    // its callable is gone with it and must not be touched.
    if (!Py_IsInitialized()) return;
    PyGILState_STATE gil = PyGILState_Ensure();
    Py_DECREF(gather_);
    PyGILState_Release(gil);
  }
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  detdit::Device device() const override { return device_; }
  const char* backend_id() const override { return "torch.distributed"; }

  Status all_gather(const void* send, std::size_t bytes, void* recv, DType dtype, detdit::Stream) override {
    DETDIT_RETURN_IF_ERROR(check_call(kAllGather, bytes, dtype, 0, Status()));
    return transport(send, bytes, recv, device_.kind == detdit::DeviceKind::kCpu, -1);
  }

  Status broadcast(void* buffer, std::size_t bytes, int root, DType dtype, detdit::Stream) override {
    Status local;
    if (root < 0 || root >= world_)
      local = Status::value_error("broadcast root must be in [0, " + std::to_string(world_) + "), got " +
                                  std::to_string(root));
    else if (bytes > 0 && buffer == nullptr)
      local = Status::value_error("broadcast buffer is null for " + std::to_string(bytes) + " bytes");
    DETDIT_RETURN_IF_ERROR(check_call(kBroadcast, bytes, dtype, root, local));
    return transport(buffer, bytes, buffer, device_.kind == detdit::DeviceKind::kCpu, root);
  }

  // Both forms of comm.h's validation handshake are defined without
  // `override`, so this compiles against either Communicator interface
  // (agree(local) alone, or agree(local, signature) plus a forwarding agree(local)).
  Status agree(const Status& local) { return agree(local, std::string()); }
  Status agree(const Status& local, const std::string& signature) {
    Verdict mine{};
    mine.kind = static_cast<int32_t>(local.kind());
    mine.signature_hash = std::hash<std::string>()(signature);
    std::strncpy(mine.message, local.message().c_str(), sizeof(mine.message) - 1);
    std::strncpy(mine.signature, signature.c_str(), sizeof(mine.signature) - 1);
    std::vector<Verdict> all(static_cast<std::size_t>(world_));
    DETDIT_RETURN_IF_ERROR(transport(&mine, sizeof(Verdict), all.data(), /*host=*/true, -1));
    if (!local.ok()) return local;
    for (int r = 0; r < world_; ++r) {
      const Verdict& v = all[static_cast<std::size_t>(r)];
      if (v.kind != 0)
        return Status(static_cast<ErrorKind>(v.kind), "rank " + std::to_string(r) + " failed: " + v.message);
    }
    for (int r = 1; r < world_; ++r) {
      const Verdict& v = all[static_cast<std::size_t>(r)];
      if (v.signature_hash != all[0].signature_hash)
        return Status::value_error("ranks disagree on the call: rank 0 calls '" + std::string(all[0].signature) +
                                   "', rank " + std::to_string(r) + " calls '" + v.signature + "'");
    }
    return Status();
  }

 private:
  enum Op : int64_t { kAllGather = 1, kBroadcast = 3 };
  struct Header {
    int64_t call, op, bytes, dtype, root, local_error;
  };

  // The header exchange: every rank gets the same verdict (a ValueError
  // naming rank 0's call and the first different one, or naming the ranks
  // whose `local` arguments were invalid: `local` itself on those), then the
  // checks that depend only on agreed values.
  Status check_call(Op op, std::size_t bytes, DType dtype, int root, const Status& local) {
    const Header mine{call_++, op, static_cast<int64_t>(bytes), static_cast<int64_t>(dtype), root,
                      local.ok() ? 0 : 1};
    std::vector<Header> all(static_cast<std::size_t>(world_));
    DETDIT_RETURN_IF_ERROR(transport(&mine, sizeof(Header), all.data(), /*host=*/true, -1));
    auto describe = [](const Header& h) {
      return "call " + std::to_string(h.call) + (h.op == kBroadcast ? " (broadcast from root " +
                                                                          std::to_string(h.root) + ")"
                                                                    : std::string(" (all_gather)")) +
             " with " + std::to_string(h.bytes) + " bytes of " + detdit::dtype_name(static_cast<DType>(h.dtype));
    };
    for (int r = 0; r < world_; ++r) {
      const Header& h = all[static_cast<std::size_t>(r)];
      if (h.call != all[0].call || h.op != all[0].op || h.bytes != all[0].bytes || h.dtype != all[0].dtype ||
          h.root != all[0].root)
        return Status::value_error("mismatched collective calls across ranks: rank 0 sent " + describe(all[0]) +
                                   ", rank " + std::to_string(r) + " " + describe(h));
    }
    if (!local.ok()) return local;
    std::string bad;
    for (int r = 0; r < world_; ++r)
      if (all[static_cast<std::size_t>(r)].local_error) bad += (bad.empty() ? "" : ", ") + std::to_string(r);
    if (!bad.empty())
      return Status::value_error(describe(all[0]) + " had invalid arguments on rank(s) " + bad + "; nothing was moved");
    if (bytes % detdit::dtype_size(dtype) != 0)
      return Status::value_error("a collective of " + std::to_string(bytes) + " bytes is not a whole number of " +
                                 detdit::dtype_name(dtype) + " elements");
    return Status();
  }
  struct Verdict {
    int32_t kind;
    uint64_t signature_hash;  // of the whole signature; the text below may be cut
    char message[1024];
    char signature[512];
  };

  // Calls move(send, recv) (root < 0: all-gather; recv is world * bytes) or
  // move(recv, recv, root) (broadcast; recv is bytes) under the GIL; a Python
  // exception becomes a RuntimeError.
  Status transport(const void* send, std::size_t bytes, void* recv, bool host, int root) {
    if (bytes == 0) return Status();
    const at::Device where = host ? at::Device(at::kCPU) : at::Device(at::kCUDA, device_.index);
    const auto options = at::TensorOptions().dtype(at::kByte).device(where);
    const int64_t received = static_cast<int64_t>(bytes) * (root < 0 ? world_ : 1);
    Tensor send_t = at::from_blob(const_cast<void*>(send), {static_cast<int64_t>(bytes)}, options);
    Tensor recv_t = at::from_blob(recv, {received}, options);
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject* py_send = THPVariable_Wrap(send_t);
    PyObject* py_recv = THPVariable_Wrap(recv_t);
    PyObject* py_root = root < 0 ? nullptr : PyLong_FromLong(root);
    PyObject* result = nullptr;
    if (root < 0 || py_root != nullptr)
      result = PyObject_CallFunctionObjArgs(gather_, py_send, py_recv, py_root, nullptr);
    Py_XDECREF(py_send);
    Py_XDECREF(py_recv);
    Py_XDECREF(py_root);
    Status status;
    if (result == nullptr) {
      std::string message = root < 0 ? "the torch.distributed all-gather failed" : "the torch.distributed broadcast failed";
      PyObject *type, *value, *traceback;
      PyErr_Fetch(&type, &value, &traceback);
      if (value != nullptr) {
        PyObject* text = PyObject_Str(value);
        if (text != nullptr && PyUnicode_Check(text)) message += std::string(": ") + PyUnicode_AsUTF8(text);
        Py_XDECREF(text);
      }
      Py_XDECREF(type);
      Py_XDECREF(value);
      Py_XDECREF(traceback);
      status = Status::runtime_error(message);
    }
    Py_XDECREF(result);
    PyGILState_Release(gil);
    return status;
  }

  PyObject* gather_;
  int rank_, world_;
  detdit::Device device_;
  int64_t call_ = 0;
};

// Communicators by handle: Python registers one per group and passes the
// handle to the ops (a schema cannot carry a Python callable).
std::mutex communicators_mutex;
std::map<int64_t, std::shared_ptr<detdit::Communicator>> communicators;
int64_t next_communicator = 1;

std::shared_ptr<detdit::Communicator> communicator(int64_t handle) {
  std::lock_guard<std::mutex> lock(communicators_mutex);
  auto found = communicators.find(handle);
  if (found == communicators.end())
    C10_THROW_ERROR(ValueError, "communicator handle " + std::to_string(handle) +
                                    " is not registered (use detdit.distributed.Communicator(group))");
  return found->second;
}

// The Status of an error the binding raised itself.
Status status_of(const c10::Error& e) {
  const std::string message = e.what_without_backtrace();
  if (dynamic_cast<const c10::TypeError*>(&e)) return Status::type_error(message);
  if (dynamic_cast<const c10::ValueError*>(&e)) return Status::value_error(message);
  if (dynamic_cast<const c10::IndexError*>(&e)) return Status::index_error(message);
  return Status::runtime_error(message);
}

// The binding's own work before a collective op reaches the library (the
// checks that size its outputs, their allocation) can fail on one rank alone
// while the others already wait in the library's first collective, its
// agreement on every rank's validation (comm.h). So a collective op runs
// through on_every_rank, its library call setting *entered first: a failure
// before that joins the agreement with its error (the other ranks then raise
// "rank r failed: ..." of the same kind instead of waiting) and is raised
// here; once the library is entered, its agreement has decided and errors
// pass as they are.
template <typename Op>
auto on_every_rank(detdit::Communicator& group, Op&& op) -> decltype(op(static_cast<bool*>(nullptr))) {
  // On this rank the agreement returns its own error, which is raised as it was.
  bool entered = false;
  try {
    return op(&entered);
  } catch (const c10::Error& e) {
    if (!entered) static_cast<void>(group.agree(status_of(e), std::string()));
    throw;
  } catch (const std::bad_alloc&) {
    if (!entered)
      static_cast<void>(group.agree(Status::runtime_error("out of memory before the collective call"), std::string()));
    throw;
  }
}

// The full table's width: out_features, checked against this rank's shard
// before anything is sized from it, or world * the shard's rows (an even split).
int64_t tp_columns(const detdit::Communicator& group, const Tensor& weight, Optional<int64_t> out_features) {
  const int64_t rows = dim_or_zero(weight, 0);
  if (!out_features.has_value()) return group.world_size() * rows;
  const int64_t columns = *out_features;
  int64_t begin = 0, end = 0;
  const Status split = detdit::tp_column_shard(columns, group.world_size(), group.rank(), &begin, &end);
  if (!split.ok()) C10_THROW_ERROR(ValueError, "out_features: " + split.message());
  if (end - begin != rows)
    C10_THROW_ERROR(ValueError, "weight must be rank " + std::to_string(group.rank()) + "'s (" +
                                    std::to_string(end - begin) + ", D) shard of the out_features=" +
                                    std::to_string(columns) + " columns split over tp=" +
                                    std::to_string(group.world_size()) + " (rows [" + std::to_string(begin) +
                                    ", " + std::to_string(end) + ")), got " + std::to_string(rows) + " rows");
  return columns;
}

}  // namespace

SpPlanHolder::SpPlanHolder(detdit::SpPlan s) : sp(std::move(s)), id_(new_plan_id()) {}
SpPlanHolder::~SpPlanHolder() { forget_plan_handle(id_); }

Tensor sp_plan_handle(const SpPlanPtr& sp) { return make_plan_handle(sp, sp->id()); }

SpPlanPtr sp_plan_of_handle(const Tensor& handle, const char* op) {
  SpPlanPtr sp = c10::dynamic_intrusive_pointer_cast<SpPlanHolder>(resolve_plan_handle(handle, op));
  if (!sp) C10_THROW_ERROR(ValueError, std::string(op) + ": plan_handle names an IndexPlan, expected an SpPlan's handle");
  return sp;
}

SpPlanHolder::State SpPlanHolder::state() const {
  if (!sp.global_plan().valid())
    return State(at::full({1}, sp.seq_len(), at::kLong), 0, sp.batch(), "cpu", world(), rank());
  const auto [row_index, num_rows, batch, device] = plan_state(sp.global_plan());
  return State(row_index, num_rows, batch, device, world(), rank());
}

bool SpPlanHolder::equals(const SpPlanHolder& other) const {
  if (world() != other.world() || rank() != other.rank()) return false;
  const bool indexed = sp.global_plan().valid();
  if (indexed != other.sp.global_plan().valid()) return false;
  if (!indexed) return sp.seq_len() == other.sp.seq_len() && sp.batch() == other.sp.batch();
  return same_table(sp.global_plan(), other.sp.global_plan());
}

SpPlanPtr sp_plan_from_state(const SpPlanHolder::State& state) {
  const auto& [row_index, num_rows, batch, device, world, rank] = state;
  if (num_rows == 0) {
    if (row_index.dim() != 1 || row_index.numel() != 1 || row_index.scalar_type() != at::kLong)
      C10_THROW_ERROR(ValueError, "a pickled index-free SpPlan's state holds [seq_len] (one int64), got a tensor of " +
                                      std::to_string(row_index.numel()) + " elements");
    return make_sp_plan_positions(row_index.item<int64_t>(), batch, world, rank);
  }
  return make_sp_plan(OptPlan(plan_from_state(PlanHolder::State(row_index, num_rows, batch, device))), world, rank);
}

SpPlanHolder::Flat SpPlanHolder::flatten() const {
  return {Field("id", std::to_string(id_)),
          Field("world", std::to_string(world())),
          Field("rank", std::to_string(rank())),
          Field("local_begin", std::to_string(local_begin())),
          Field("local_end", std::to_string(local_end())),
          Field("local_seq_len", std::to_string(local_seq_len())),
          Field("max_send", std::to_string(max_send()))};
}

SpPlanPtr make_sp_plan(const OptPlan& plan, int64_t world, int64_t rank) {
  const IndexPlan& index = required_plan(plan.value_or(PlanPtr()), "sp_plan")->plan;
  detdit::Stream stream = nullptr;
#ifdef DETDIT_TORCH_CUDA
  if (index.device().is_cuda()) stream = c10::cuda::getCurrentCUDAStream(index.device().index).stream();
#endif
  detdit::SpPlan sp;
  check_ok(detdit::SpPlan::create(index, to_int(world, "world"), to_int(rank, "rank"), &sp, stream));
  return c10::make_intrusive<SpPlanHolder>(std::move(sp));
}

SpPlanPtr make_sp_plan_positions(int64_t seq_len, int64_t batch, int64_t world, int64_t rank) {
  detdit::SpPlan sp;
  check_ok(detdit::SpPlan::create(seq_len, batch, to_int(world, "world"), to_int(rank, "rank"), &sp));
  return c10::make_intrusive<SpPlanHolder>(std::move(sp));
}

// ---------------------------------------------------------------------------
// tp_adaln_projection

std::tuple<Tensor, Tensor> tp_adaln_projection(const Tensor& temb, const Tensor& weight, const Tensor& bias,
                                               int64_t comm, const std::string& numerics,
                                               Optional<int64_t> out_features, int64_t chunks) {
  auto group = communicator(comm);
  return on_every_rank(*group, [&](bool* entered) {
    auto call = [&](const detdit::AdalnProjectionParams& p, detdit::Stream stream) {
      *entered = true;
      return detdit::tp_adaln_projection_forward(*group, p, stream);
    };
    return adaln_projection_with(call, tp_columns(*group, weight, out_features), temb, weight, bias, numerics,
                                 chunks);
  });
}

std::tuple<Tensor, Tensor, Tensor> tp_adaln_projection_backward(const Tensor& grad_table, const Tensor& temb,
                                                                const Tensor& weight, const Tensor& act,
                                                                int64_t comm, const std::string& numerics,
                                                                std::array<bool, 3> output_mask, int64_t chunks) {
  auto group = communicator(comm);
  return on_every_rank(*group, [&](bool* entered) -> std::tuple<Tensor, Tensor, Tensor> {
    auto call = [&](const detdit::AdalnProjectionBackwardParams& p, detdit::Stream stream) {
      *entered = true;
      return detdit::tp_adaln_projection_backward(*group, p, stream);
    };
    // every rank takes part in the collectives, so d_temb is always computed
    auto [d_temb, d_weight, d_bias] = adaln_projection_backward_with(call, grad_table, temb, weight, act, numerics,
                                                                     {true, output_mask[1], output_mask[2]}, chunks);
    return {output_mask[0] ? d_temb : Tensor(), d_weight, d_bias};
  });
}

// ---------------------------------------------------------------------------
// sp_rmsnorm

std::tuple<Tensor, Tensor> sp_rmsnorm(const Tensor& x, const Tensor& weight, const OptTensor& shift,
                                      const OptTensor& scale, const SpPlanPtr& sp, int64_t, double eps,
                                      const std::string& numerics) {
  auto call = [&](const detdit::RmsnormParams& p, detdit::Stream stream) {
    return detdit::sp_rmsnorm_forward(sp->sp, p, stream);
  };
  return rmsnorm_with(call, x, weight, shift, scale, sp->sp.global_plan(), eps, numerics);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> sp_rmsnorm_backward(const Tensor& grad, const Tensor& x,
                                                               const Tensor& weight, const OptTensor& shift,
                                                               const OptTensor& scale, const SpPlanPtr& sp,
                                                               const Tensor& rstd, int64_t comm, double eps,
                                                               const std::string& numerics) {
  auto group = communicator(comm);
  return on_every_rank(*group, [&](bool* entered) {
    auto call = [&](const detdit::RmsnormBackwardParams& p, detdit::Stream stream) {
      *entered = true;
      return detdit::sp_rmsnorm_backward(*group, sp->sp, p, stream);
    };
    return rmsnorm_backward_with(call, grad, x, weight, shift, scale, sp->sp.global_plan(), rstd, eps, numerics,
                                 {true, true, true, true});
  });
}

// ---------------------------------------------------------------------------
// sp_gate_residual

Tensor sp_gate_residual(const Tensor& residual, const Tensor& y, const Tensor& gate, const SpPlanPtr& sp, int64_t) {
  auto call = [&](const detdit::GateResidualParams& p, detdit::Stream stream) {
    return detdit::sp_gate_residual_forward(sp->sp, p, stream);
  };
  return gate_residual_with(call, residual, y, gate, sp->sp.global_plan());
}

std::tuple<Tensor, Tensor, Tensor> sp_gate_residual_backward(const Tensor& grad, const Tensor& y, const Tensor& gate,
                                                             const SpPlanPtr& sp, int64_t comm) {
  auto group = communicator(comm);
  return on_every_rank(*group, [&](bool* entered) {
    auto call = [&](const detdit::GateResidualBackwardParams& p, detdit::Stream stream) {
      *entered = true;
      return detdit::sp_gate_residual_backward(*group, sp->sp, p, stream);
    };
    return gate_residual_backward_with(call, grad, y, gate, sp->sp.global_plan(), {true, true, true});
  });
}

// ---------------------------------------------------------------------------
// sp_gate_residual_rmsnorm

namespace {
// The library calls of an sp_gate_residual_rmsnorm backward on every rank
// (.default and .forms): the fused op, and the gate half alone (no d_out).
// Each sets *entered first, as on_every_rank requires; group and sp outlive them.
struct RegionBackwardCalls {
  Call<detdit::GateResidualRmsnormBackwardParams> call;
  Call<detdit::GateResidualBackwardParams> gate_call;
};

RegionBackwardCalls region_backward_calls(detdit::Communicator& group, const detdit::SpPlan& sp, bool* entered) {
  RegionBackwardCalls calls;
  calls.call = [&group, &sp, entered](const detdit::GateResidualRmsnormBackwardParams& p, detdit::Stream stream) {
    *entered = true;
    return detdit::sp_gate_residual_rmsnorm_backward(group, sp, p, stream);
  };
  calls.gate_call = [&group, &sp, entered](const detdit::GateResidualBackwardParams& p, detdit::Stream stream) {
    *entered = true;
    return detdit::sp_gate_residual_backward(group, sp, p, stream);
  };
  return calls;
}
}  // namespace

std::tuple<Tensor, Tensor, Tensor> sp_gate_residual_rmsnorm(const Tensor& residual, const Tensor& y,
                                                            const Tensor& gate, const Tensor& weight,
                                                            const OptTensor& shift, const OptTensor& scale,
                                                            const SpPlanPtr& sp, int64_t, double eps,
                                                            const std::string& numerics) {
  auto call = [&](const detdit::GateResidualRmsnormParams& p, detdit::Stream stream) {
    return detdit::sp_gate_residual_rmsnorm_forward(sp->sp, p, stream);
  };
  return gate_residual_rmsnorm_with(call, residual, y, gate, weight, shift, scale, sp->sp.global_plan(), eps,
                                    numerics);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> sp_gate_residual_rmsnorm_backward(
    const OptTensor& d_out, const OptTensor& d_h, const Tensor& y, const Tensor& gate, const Tensor& weight,
    const OptTensor& shift, const OptTensor& scale, const SpPlanPtr& sp, const Tensor& h, const Tensor& rstd,
    int64_t comm, double eps, const std::string& numerics) {
  auto group = communicator(comm);
  return on_every_rank(*group, [&](bool* entered) {
    const RegionBackwardCalls calls = region_backward_calls(*group, sp->sp, entered);
    return gate_residual_rmsnorm_backward_with(calls.call, calls.gate_call, d_out, d_h, y, gate, weight, shift, scale,
                                               sp->sp.global_plan(), h, rstd, eps, numerics,
                                               {true, true, true, true, true, true});
  });
}

// ---------------------------------------------------------------------------
// sp_rmsnorm.forms, sp_gate_residual.forms

std::tuple<Tensor, Tensor> sp_rmsnorm_forms(const Tensor& x, const Tensor& weight, const OptTensor& shift,
                                            const OptTensor& scale, const SpPlanPtr& sp, int64_t, double eps,
                                            const std::string& numerics, bool upcast) {
  auto call = [&](const detdit::RmsnormParams& p, detdit::Stream stream) {
    return detdit::sp_rmsnorm_forward(sp->sp, p, stream);
  };
  return rmsnorm_forms_with(call, x, weight, shift, scale, sp->sp.global_plan(), eps, numerics, upcast);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> sp_rmsnorm_backward_forms(const Tensor& grad, const Tensor& x,
                                                                     const Tensor& weight, const OptTensor& shift,
                                                                     const OptTensor& scale, const SpPlanPtr& sp,
                                                                     const Tensor& rstd, int64_t comm, double eps,
                                                                     const std::string& numerics, bool upcast) {
  auto group = communicator(comm);
  return on_every_rank(*group, [&](bool* entered) {
    auto call = [&](const detdit::RmsnormBackwardParams& p, detdit::Stream stream) {
      *entered = true;
      return detdit::sp_rmsnorm_backward(*group, sp->sp, p, stream);
    };
    return rmsnorm_backward_forms_with(call, grad, x, weight, shift, scale, sp->sp.global_plan(), rstd, eps, numerics,
                                       upcast, {true, true, true, true}, /*local_rows=*/true);
  });
}

// The plan of an sp_gate_residual.forms call: the region's, but none for a
// plain residual add (no gate), which is row-local: the library's indexed
// route needs the gate, and its route without a plan takes the call on any
// SpPlan (detdit/parallel.h).
namespace {
IndexPlan gate_plan(const SpPlanPtr& sp, const OptTensor& gate) {
  return gate.has_value() && gate->defined() ? sp->sp.global_plan() : IndexPlan();
}
}  // namespace

Tensor sp_gate_residual_forms(const Tensor& residual, const Tensor& y, const OptTensor& gate, const SpPlanPtr& sp,
                              int64_t, bool upcast, Optional<double> k) {
  auto call = [&](const detdit::GateResidualParams& p, detdit::Stream stream) {
    return detdit::sp_gate_residual_forward(sp->sp, p, stream);
  };
  return gate_residual_forms_with(call, residual, y, gate, gate_plan(sp, gate), upcast, k);
}

std::tuple<Tensor, Tensor, Tensor> sp_gate_residual_backward_forms(const Tensor& grad, const Tensor& y,
                                                                   const OptTensor& gate, const SpPlanPtr& sp,
                                                                   int64_t comm, bool upcast, Optional<double> k) {
  auto group = communicator(comm);
  return on_every_rank(*group, [&](bool* entered) {
    auto call = [&](const detdit::GateResidualBackwardParams& p, detdit::Stream stream) {
      *entered = true;
      return detdit::sp_gate_residual_backward(*group, sp->sp, p, stream);
    };
    return gate_residual_backward_forms_with(call, grad, y, gate, gate_plan(sp, gate), upcast, k,
                                             {true, true, true}, /*local_rows=*/true);
  });
}

// ---------------------------------------------------------------------------
// sp_gate_residual_rmsnorm.forms

std::tuple<Tensor, Tensor, Tensor> sp_gate_residual_rmsnorm_forms(
    const Tensor& residual, const Tensor& y, const OptTensor& gate, const Tensor& weight, const OptTensor& shift,
    const OptTensor& scale, const SpPlanPtr& sp, int64_t, double eps, const std::string& numerics, bool upcast,
    Optional<double> k) {
  auto call = [&](const detdit::GateResidualRmsnormParams& p, detdit::Stream stream) {
    return detdit::sp_gate_residual_rmsnorm_forward(sp->sp, p, stream);
  };
  return gate_residual_rmsnorm_forms_with(call, residual, y, gate, weight, shift, scale, sp->sp.global_plan(), eps,
                                          numerics, upcast, k);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> sp_gate_residual_rmsnorm_backward_forms(
    const OptTensor& d_out, const OptTensor& d_h, const Tensor& y, const OptTensor& gate, const Tensor& weight,
    const OptTensor& shift, const OptTensor& scale, const SpPlanPtr& sp, const Tensor& h, const Tensor& rstd,
    int64_t comm, double eps, const std::string& numerics, bool upcast, Optional<double> k) {
  auto group = communicator(comm);
  return on_every_rank(*group, [&](bool* entered) {
    const RegionBackwardCalls calls = region_backward_calls(*group, sp->sp, entered);
    // the fused op takes the region's plan with or without the gate; the
    // gate half alone (no d_out) takes sp_gate_residual.forms' plan
    return gate_residual_rmsnorm_backward_forms_with(calls.call, calls.gate_call, d_out, d_h, y, gate, weight, shift,
                                                     scale, sp->sp.global_plan(), gate_plan(sp, gate), h, rstd, eps,
                                                     numerics, upcast, k, {true, true, true, true, true, true},
                                                     /*local_rows=*/true);
  });
}

// ---------------------------------------------------------------------------
// sp_layernorm

std::tuple<Tensor, Tensor, Tensor> sp_layernorm(const Tensor& x, const OptTensor& weight, const OptTensor& bias,
                                                const OptTensor& shift, const OptTensor& scale, const SpPlanPtr& sp,
                                                int64_t, double eps, const std::string& numerics, bool upcast) {
  auto call = [&](const detdit::LayernormParams& p, detdit::Stream stream) {
    return detdit::sp_layernorm_forward(sp->sp, p, stream);
  };
  return layernorm_forms_with(call, x, weight, bias, shift, scale, sp->sp.global_plan(), eps, numerics, upcast);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> sp_layernorm_backward(
    const Tensor& grad, const Tensor& x, const OptTensor& weight, const OptTensor& bias, const OptTensor& shift,
    const OptTensor& scale, const SpPlanPtr& sp, const Tensor& mean, const Tensor& rstd, int64_t comm, double eps,
    const std::string& numerics, bool upcast) {
  auto group = communicator(comm);
  return on_every_rank(*group, [&](bool* entered) {
    auto call = [&](const detdit::LayernormBackwardParams& p, detdit::Stream stream) {
      *entered = true;
      return detdit::sp_layernorm_backward(*group, sp->sp, p, stream);
    };
    return layernorm_backward_forms_with(call, grad, x, weight, bias, shift, scale, sp->sp.global_plan(), mean, rstd,
                                         eps, numerics, upcast, {true, true, true, true, true}, /*local_rows=*/true);
  });
}

// ---------------------------------------------------------------------------
// sp_gate_residual_layernorm

std::tuple<Tensor, Tensor, Tensor, Tensor> sp_gate_residual_layernorm(
    const Tensor& residual, const Tensor& y, const OptTensor& gate, const OptTensor& weight, const OptTensor& bias,
    const OptTensor& shift, const OptTensor& scale, const SpPlanPtr& sp, int64_t, double eps,
    const std::string& numerics, bool upcast, Optional<double> k) {
  auto call = [&](const detdit::GateResidualLayernormParams& p, detdit::Stream stream) {
    return detdit::sp_gate_residual_layernorm_forward(sp->sp, p, stream);
  };
  return gate_residual_layernorm_with(call, residual, y, gate, weight, bias, shift, scale, sp->sp.global_plan(), eps,
                                      numerics, upcast, k);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> sp_gate_residual_layernorm_backward(
    const OptTensor& d_out, const OptTensor& d_h, const Tensor& y, const OptTensor& gate, const OptTensor& weight,
    const OptTensor& bias, const OptTensor& shift, const OptTensor& scale, const SpPlanPtr& sp, const Tensor& h,
    const Tensor& mean, const Tensor& rstd, int64_t comm, double eps, const std::string& numerics, bool upcast,
    Optional<double> k) {
  auto group = communicator(comm);
  return on_every_rank(*group, [&](bool* entered) {
    auto call = [&](const detdit::GateResidualLayernormBackwardParams& p, detdit::Stream stream) {
      *entered = true;
      return detdit::sp_gate_residual_layernorm_backward(*group, sp->sp, p, stream);
    };
    auto gate_call = [&](const detdit::GateResidualBackwardParams& p, detdit::Stream stream) {
      *entered = true;
      return detdit::sp_gate_residual_backward(*group, sp->sp, p, stream);
    };
    return gate_residual_layernorm_backward_with(call, gate_call, d_out, d_h, y, gate, weight, bias, shift, scale,
                                                 sp->sp.global_plan(), h, mean, rstd, eps, numerics, upcast, k,
                                                 {true, true, true, true, true, true, true}, /*local_rows=*/true);
  });
}

// ---------------------------------------------------------------------------
// The Python module's functions

namespace {

// "cpu", "cuda" or "cuda:N" (N decimal digits that fit an int) into *device;
// false for anything else. No exception: none may cross the CPython frame of
// the caller (std::stoi would throw on "cuda:x" and abort the interpreter).
bool parse_device(const std::string& where, detdit::Device* device) {
  if (where == "cpu") {
    *device = detdit::Device::cpu();
    return true;
  }
  if (where == "cuda") {
    *device = detdit::Device::cuda(0);
    return true;
  }
  const std::string prefix = "cuda:";
  if (where.size() <= prefix.size() || where.compare(0, prefix.size(), prefix) != 0) return false;
  int64_t ordinal = 0;
  for (std::size_t i = prefix.size(); i < where.size(); ++i) {
    const char c = where[i];
    if (c < '0' || c > '9') return false;
    ordinal = ordinal * 10 + (c - '0');
    if (ordinal > std::numeric_limits<int>::max()) return false;
  }
  *device = detdit::Device::cuda(static_cast<int>(ordinal));
  return true;
}

}  // namespace

// Python: _C._register_communicator(gather, rank, world, device) -> handle.
PyObject* register_communicator(PyObject*, PyObject* args) {
  PyObject* gather;
  int rank, world;
  const char* device;
  if (!PyArg_ParseTuple(args, "Oiis", &gather, &rank, &world, &device)) return nullptr;
  if (!PyCallable_Check(gather)) {
    PyErr_SetString(PyExc_TypeError, "gather must be callable");
    return nullptr;
  }
  if (world < 1 || rank < 0 || rank >= world) {
    PyErr_Format(PyExc_ValueError, "need 0 <= rank < world, got rank=%d, world=%d", rank, world);
    return nullptr;
  }
  detdit::Device dev;
  if (!parse_device(device, &dev)) {
    PyErr_Format(PyExc_ValueError, "device must be 'cpu', 'cuda' or 'cuda:N', got '%s'", device);
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(communicators_mutex);
  const int64_t handle = next_communicator++;
  communicators[handle] = std::make_shared<TorchDistCommunicator>(gather, rank, world, dev);
  return PyLong_FromLongLong(handle);
}

// Python: _C._release_communicator(handle). Ops that captured it keep it alive.
PyObject* release_communicator(PyObject*, PyObject* args) {
  long long handle;
  if (!PyArg_ParseTuple(args, "L", &handle)) return nullptr;
  std::shared_ptr<detdit::Communicator> released;
  {
    std::lock_guard<std::mutex> lock(communicators_mutex);
    auto found = communicators.find(handle);
    if (found != communicators.end()) {
      released = std::move(found->second);
      communicators.erase(found);
    }
  }
  Py_RETURN_NONE;
}

// Python: _C._tp_column_shard(columns, world, rank) -> (begin, end), detdit::tp_column_shard.
// world and rank are parsed as 64-bit and range-checked as to_int does: a
// value past int is a ValueError naming it, not CPython's OverflowError.
PyObject* tp_column_shard(PyObject*, PyObject* args) {
  long long columns, world, rank;
  if (!PyArg_ParseTuple(args, "LLL", &columns, &world, &rank)) return nullptr;
  for (const auto& [value, name] : {std::pair<long long, const char*>(world, "world"), {rank, "rank"}}) {
    if (value < std::numeric_limits<int>::min() || value > std::numeric_limits<int>::max()) {
      PyErr_SetString(PyExc_ValueError,
                      (std::string(name) + " must fit in a 32-bit int, got " + std::to_string(value)).c_str());
      return nullptr;
    }
  }
  int64_t begin = 0, end = 0;
  const Status status =
      detdit::tp_column_shard(columns, static_cast<int>(world), static_cast<int>(rank), &begin, &end);
  if (!status.ok()) {
    PyErr_SetString(PyExc_ValueError, status.message().c_str());
    return nullptr;
  }
  return Py_BuildValue("(LL)", static_cast<long long>(begin), static_cast<long long>(end));
}

}  // namespace detdit_torch
