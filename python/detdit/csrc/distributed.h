// detdit.distributed's C++ half: a detdit::Communicator whose only transport
// is a Python callable doing a torch.distributed all-gather of bytes
// (registered from Python, referred to by an integer handle: a schema cannot
// carry a Python callable), the SpPlan torch class, and the device kernels of
// the tp_/sp_ ops (the single-device ops' _with forms, ops.h, with the
// tp_/sp_ entry points of detdit/parallel.h).
//
// Contract: every rank's outputs and gradients are byte-equal to one process.
// The backward kernels of the sp_ ops compute every output on every rank
// (the collectives need each replicated output on each rank), and
// tp_adaln_projection_backward always computes d_temb for the same reason.
// The forward kernels of the sp_ ops take the communicator handle and do not
// use it (the forward does not communicate): the schema carries it so that the
// autograd Function can hand it to the backward.
#pragma once

#include <Python.h>

#include <torch/custom_class.h>

#include <array>
#include <string>
#include <tuple>

#include "detdit/parallel.h"
#include "plan.h"
#include "tensors.h"

namespace detdit_torch {

// The SpPlan torch class; under torch.compile a graph input like the
// IndexPlan (plan.h): `__obj_flatten__` gives its never-reused id and sizes.
struct SpPlanHolder : torch::CustomClassHolder {
  detdit::SpPlan sp;
  explicit SpPlanHolder(detdit::SpPlan s);
  ~SpPlanHolder() override;
  int64_t world() const { return sp.world(); }
  int64_t rank() const { return sp.rank(); }
  int64_t local_begin() const { return sp.local_begin(); }
  int64_t local_end() const { return sp.local_end(); }
  int64_t local_seq_len() const { return sp.local_seq_len(); }
  int64_t max_send() const { return sp.max_send(); }

  using Field = PlanHolder::Field;
  using Flat = std::tuple<Field, Field, Field, Field, Field, Field, Field>;
  // (("id", ...), ("world", ...), ("rank", ...), ("local_begin", ...),
  // ("local_end", ...), ("local_seq_len", ...), ("max_send", ...)), as strings.
  Flat flatten() const;

  // Pickled as the IndexPlan it was made from (its global plan; plan.h) and
  // (world, rank), and rebuilt by sp_plan; equal when those are. A region
  // without an index pickles as ([seq_len] (int64), 0, batch, "cpu", world,
  // rank): num_rows 0, which no IndexPlan has, marks it; rebuilt by
  // sp_plan.positions, equal to another index-free one of the same seq_len,
  // batch, world and rank.
  using State = std::tuple<Tensor, int64_t, int64_t, std::string, int64_t, int64_t>;
  State state() const;
  bool equals(const SpPlanHolder& other) const;

  int64_t id() const { return id_; }

 private:
  int64_t id_;
};
using SpPlanPtr = c10::intrusive_ptr<SpPlanHolder>;

// An SpPlan's handle (`sp.handle()`) and its resolution, as plan.h's for an IndexPlan.
Tensor sp_plan_handle(const SpPlanPtr& sp);
SpPlanPtr sp_plan_of_handle(const Tensor& handle, const char* op);

// detdit::sp_plan: the SpPlan of rank `rank` of `world` for the replicated plan.
// The plan is optional in the schema only so that a missing one is
// required_plan's ValueError rather than the dispatcher's RuntimeError.
SpPlanPtr make_sp_plan(const OptPlan& plan, int64_t world, int64_t rank);
// sp_plan.positions: the SpPlan of a region without an index
// (detdit::SpPlan::create(seq_len, batch, world, rank)), for the grouped
// modulation forms and the plain ops.
SpPlanPtr make_sp_plan_positions(int64_t seq_len, int64_t batch, int64_t world, int64_t rank);
// The SpPlan of a pickled state (SpPlanHolder::state), through sp_plan.
SpPlanPtr sp_plan_from_state(const SpPlanHolder::State& state);

// tp_adaln_projection: (table (T, N) full, act (T, D)); weight/bias are this
// rank's shard, rows [begin, end) of tp_column_shard(N, world, rank)
// (detdit/parallel.h). N = out_features, or world * the shard's rows when
// absent (an even split). chunks: AdalnProjectionInputs::chunks (0: H3's
// projection; every rank's must agree). Backward: (d_temb replicated, in
// temb's dtype as adaln_projection's, d_weight, d_bias of the shard).
std::tuple<Tensor, Tensor> tp_adaln_projection(const Tensor& temb, const Tensor& weight, const Tensor& bias,
                                               int64_t comm, const std::string& numerics,
                                               Optional<int64_t> out_features, int64_t chunks);
std::tuple<Tensor, Tensor, Tensor> tp_adaln_projection_backward(const Tensor& grad_table, const Tensor& temb,
                                                                const Tensor& weight, const Tensor& act,
                                                                int64_t comm, const std::string& numerics,
                                                                std::array<bool, 3> output_mask, int64_t chunks);

// sp_rmsnorm: the local rows (B, S_local, H); (out, rstd). Backward: (dx
// local, d_weight, d_shift, d_scale replicated).
std::tuple<Tensor, Tensor> sp_rmsnorm(const Tensor& x, const Tensor& weight, const OptTensor& shift,
                                      const OptTensor& scale, const SpPlanPtr& sp, int64_t comm, double eps,
                                      const std::string& numerics);
std::tuple<Tensor, Tensor, Tensor, Tensor> sp_rmsnorm_backward(const Tensor& grad, const Tensor& x,
                                                               const Tensor& weight, const OptTensor& shift,
                                                               const OptTensor& scale, const SpPlanPtr& sp,
                                                               const Tensor& rstd, int64_t comm, double eps,
                                                               const std::string& numerics);

// sp_rmsnorm.forms: rmsnorm.forms (ops.h) of the local rows, every form and
// recipe: the modulation as sp_layernorm's (grouped forms replicated and
// global, per token local; indexed with the region's plan). Backward: (dx
// local, d_weight replicated, d_shift / d_scale in their tensors' shape).
std::tuple<Tensor, Tensor> sp_rmsnorm_forms(const Tensor& x, const Tensor& weight, const OptTensor& shift,
                                            const OptTensor& scale, const SpPlanPtr& sp, int64_t comm, double eps,
                                            const std::string& numerics, bool upcast);
std::tuple<Tensor, Tensor, Tensor, Tensor> sp_rmsnorm_backward_forms(const Tensor& grad, const Tensor& x,
                                                                     const Tensor& weight, const OptTensor& shift,
                                                                     const OptTensor& scale, const SpPlanPtr& sp,
                                                                     const Tensor& rstd, int64_t comm, double eps,
                                                                     const std::string& numerics, bool upcast);

// sp_gate_residual.forms: gate_residual.forms (ops.h) of the local rows,
// every form, recipe and k, the gate optional. Backward: (d_residual, d_y
// local, d_gate in its tensor's shape).
Tensor sp_gate_residual_forms(const Tensor& residual, const Tensor& y, const OptTensor& gate, const SpPlanPtr& sp,
                              int64_t comm, bool upcast, Optional<double> k);
std::tuple<Tensor, Tensor, Tensor> sp_gate_residual_backward_forms(const Tensor& grad, const Tensor& y,
                                                                   const OptTensor& gate, const SpPlanPtr& sp,
                                                                   int64_t comm, bool upcast, Optional<double> k);

// sp_gate_residual: out (local rows). Backward: (d_residual, d_y local,
// d_gate replicated).
Tensor sp_gate_residual(const Tensor& residual, const Tensor& y, const Tensor& gate, const SpPlanPtr& sp,
                        int64_t comm);
std::tuple<Tensor, Tensor, Tensor> sp_gate_residual_backward(const Tensor& grad, const Tensor& y, const Tensor& gate,
                                                             const SpPlanPtr& sp, int64_t comm);

// sp_gate_residual_rmsnorm: (h, out, rstd) of the local rows. Backward:
// (d_residual, d_y local, d_gate, d_weight, d_shift, d_scale replicated); an
// absent d_out runs the sp_gate_residual backward of d_h alone (as
// gate_residual_rmsnorm_backward, ops.h), so every rank must agree on which
// of d_out and d_h it has, as every rank of the separate ops runs the same
// backward nodes.
std::tuple<Tensor, Tensor, Tensor> sp_gate_residual_rmsnorm(const Tensor& residual, const Tensor& y,
                                                            const Tensor& gate, const Tensor& weight,
                                                            const OptTensor& shift, const OptTensor& scale,
                                                            const SpPlanPtr& sp, int64_t comm, double eps,
                                                            const std::string& numerics);
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> sp_gate_residual_rmsnorm_backward(
    const OptTensor& d_out, const OptTensor& d_h, const Tensor& y, const Tensor& gate, const Tensor& weight,
    const OptTensor& shift, const OptTensor& scale, const SpPlanPtr& sp, const Tensor& h, const Tensor& rstd,
    int64_t comm, double eps, const std::string& numerics);

// sp_gate_residual_rmsnorm.forms: gate_residual_rmsnorm.forms (ops.h) of the
// local rows, every form, recipe and k, the gate optional; the modulation as
// sp_rmsnorm.forms' (indexed with the region's plan). (h, out, rstd).
// Backward from d_out and d_h, either absent, as
// sp_gate_residual_rmsnorm_backward: (d_residual, d_y local, d_weight
// replicated, d_gate / d_shift / d_scale in their tensors' shape); every rank
// must agree on which of d_out and d_h it has.
std::tuple<Tensor, Tensor, Tensor> sp_gate_residual_rmsnorm_forms(
    const Tensor& residual, const Tensor& y, const OptTensor& gate, const Tensor& weight, const OptTensor& shift,
    const OptTensor& scale, const SpPlanPtr& sp, int64_t comm, double eps, const std::string& numerics, bool upcast,
    Optional<double> k);
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> sp_gate_residual_rmsnorm_backward_forms(
    const OptTensor& d_out, const OptTensor& d_h, const Tensor& y, const OptTensor& gate, const Tensor& weight,
    const OptTensor& shift, const OptTensor& scale, const SpPlanPtr& sp, const Tensor& h, const Tensor& rstd,
    int64_t comm, double eps, const std::string& numerics, bool upcast, Optional<double> k);

// sp_layernorm: layernorm.forms (ops.h) of the local rows (B, S_local, H):
// (out, mean, rstd). Per-sample / per-frame shift and scale are replicated and
// resolved against the global (B, S, H), per token they are the local rows;
// the indexed form takes the region's plan. Backward: (dx local, d_weight,
// d_bias replicated, d_shift / d_scale in their tensors' shape: replicated
// for the grouped and indexed forms, local rows per token).
std::tuple<Tensor, Tensor, Tensor> sp_layernorm(const Tensor& x, const OptTensor& weight, const OptTensor& bias,
                                                const OptTensor& shift, const OptTensor& scale, const SpPlanPtr& sp,
                                                int64_t comm, double eps, const std::string& numerics, bool upcast);
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> sp_layernorm_backward(
    const Tensor& grad, const Tensor& x, const OptTensor& weight, const OptTensor& bias, const OptTensor& shift,
    const OptTensor& scale, const SpPlanPtr& sp, const Tensor& mean, const Tensor& rstd, int64_t comm, double eps,
    const std::string& numerics, bool upcast);

// sp_gate_residual_layernorm: gate_residual_layernorm (ops.h) of the local
// rows, the grouped forms and none (the library refuses a plan): (out, h,
// mean, rstd). Backward from d_out and d_h, either absent, as
// sp_gate_residual_rmsnorm_backward: (d_residual, d_y local, d_gate, d_weight,
// d_bias, d_shift, d_scale as sp_layernorm's); every rank must agree on which
// of d_out and d_h it has.
std::tuple<Tensor, Tensor, Tensor, Tensor> sp_gate_residual_layernorm(
    const Tensor& residual, const Tensor& y, const OptTensor& gate, const OptTensor& weight, const OptTensor& bias,
    const OptTensor& shift, const OptTensor& scale, const SpPlanPtr& sp, int64_t comm, double eps,
    const std::string& numerics, bool upcast, Optional<double> k);
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> sp_gate_residual_layernorm_backward(
    const OptTensor& d_out, const OptTensor& d_h, const Tensor& y, const OptTensor& gate, const OptTensor& weight,
    const OptTensor& bias, const OptTensor& shift, const OptTensor& scale, const SpPlanPtr& sp, const Tensor& h,
    const Tensor& mean, const Tensor& rstd, int64_t comm, double eps, const std::string& numerics, bool upcast,
    Optional<double> k);

// Python: _C._register_communicator(gather, rank, world, device) -> handle.
PyObject* register_communicator(PyObject*, PyObject* args);
// Python: _C._release_communicator(handle). Ops that captured it keep it alive.
PyObject* release_communicator(PyObject*, PyObject* args);
// Python: _C._tp_column_shard(columns, world, rank) -> (begin, end): the
// columns rank owns in a world-way tp_adaln_projection (detdit/parallel.h).
PyObject* tp_column_shard(PyObject*, PyObject* args);

}  // namespace detdit_torch
