// The IndexPlan torch class, `torch.classes.detdit.IndexPlan`: a validated
// detdit::IndexPlan built once per step by `detdit::plan` (timestep indices
// and token tags) or `detdit::plan_from_rows` (a row index) and passed to
// every indexed op. Its methods are those registered in registration.cpp.
//
// Under torch.compile a plan is a graph input that is never traced into:
// `__obj_flatten__` gives what dynamo guards on and what the fake plan of
// detdit/_compile.py is built from (contract there): the plan's id, unique
// in the process and never reused, and its sizes, all as strings.
//
// Pickling (what torch.compile's inductor does with a plan it holds as a graph
// constant, and copy.deepcopy): the state is the plan's source, its (S,) row
// index as int32 on the CPU, the row count, the batch and the device; a plan
// is rebuilt from it by plan_from_rows, so an unpickled plan is validated like
// any other and gets a new id. Two plans are equal (`==`) when they are the
// same table: equal sizes, device and row index.
#pragma once

#include <torch/custom_class.h>

#include <mutex>
#include <string>
#include <tuple>

#include "tensors.h"

namespace detdit_torch {

struct PlanHolder : torch::CustomClassHolder {
  IndexPlan plan;

  explicit PlanHolder(IndexPlan p);
  ~PlanHolder() override;

  int64_t seq_len() const { return plan.seq_len(); }
  int64_t batch() const { return plan.batch(); }
  int64_t num_rows() const { return plan.num_rows(); }
  int64_t positions() const { return plan.positions(); }
  int64_t num_chunks() const { return plan.num_chunks(); }
  int64_t num_segments() const { return plan.num_segments(); }
  std::string device() const { return plan.device().to_string(); }
  // The validated (S,) table row of every sequence position, int32 on the CPU.
  Tensor row_index() const;
  // "IndexPlan(seq_len=S, batch=B, num_rows=R, device=D)".
  std::string repr() const;

  using Field = std::tuple<std::string, std::string>;
  using Flat = std::tuple<Field, Field, Field, Field, Field, Field, Field, Field>;
  // (("id", ...), ("seq_len", ...), ("batch", ...), ("num_rows", ...),
  // ("positions", ...), ("num_chunks", ...), ("num_segments", ...), ("device", ...)).
  Flat flatten() const;

  // (row_index, num_rows, batch, device): the pickled state (plan_state).
  using State = std::tuple<Tensor, int64_t, int64_t, std::string>;

  // The same index with batch 1, for the backward of ops whose output has no
  // batch dim (adaln_row_gather, adaln_modulation: (6, S, H)): autograd hands
  // them a (6, S, H) grad, already summed over the batch by whatever broadcast
  // the output. Built on first use from the plan's validated row index (on
  // CUDA this one build copies the index to the host once).
  const IndexPlan& single_batch(detdit::Stream stream);

  int64_t id() const { return id_; }

 private:
  friend Tensor plan_tables(const c10::intrusive_ptr<PlanHolder>& plan);
  std::mutex mutex_;
  IndexPlan single_batch_;
  int64_t id_;
  Tensor tables_;  // made on first use by plan_tables
};

using PlanPtr = c10::intrusive_ptr<PlanHolder>;
using OptPlan = Optional<PlanPtr>;

// A new id for a plan object (IndexPlan, SpPlan): counts up from 1, never reused.
int64_t new_plan_id();

// A plan object as a tensor: what the traced autograd of detdit/_compile.py
// saves for the backward, since torch 2.11's AOTAutograd refuses a
// torch-class object saved for a backward graph and saves a tensor. The
// handle (`plan.handle()`) is one int64 on the CPU, the plan's id, and its
// storage holds a reference to the plan, which so lives as long as the
// handle. The `.handle` overloads of the backward ops resolve it: a tensor
// that names no live plan of the expected class is refused (TypeError for
// the wrong dtype, device or size, ValueError otherwise), so only a built,
// validated plan reaches a kernel.
Tensor make_plan_handle(const c10::intrusive_ptr<torch::CustomClassHolder>& plan, int64_t id);
c10::intrusive_ptr<torch::CustomClassHolder> resolve_plan_handle(const Tensor& handle, const char* op);
// Called by a plan object's destructor: its id resolves no more.
void forget_plan_handle(int64_t id);
Tensor plan_handle(const PlanPtr& plan);
PlanPtr plan_of_handle(const Tensor& handle, const char* op);

// The plan's tables (`plan.tables()`): the tensor that stands for the plan
// where a compiled graph must take tensors only (torch.compile's CUDA graphs
// take no torch-class input; docs/python.md, torch.compile). An (S,) int32
// copy of the validated row index on the plan's device, made once per plan
// (again if it was modified in place), whose storage was made here: its
// DataPtr's deleter is this file's and its context names the plan (weakly:
// the plan owns its tables, not the reverse). No kernel reads it; the
// `.tables` overloads resolve it to the plan with plan_of_tables and run on
// the plan's own tables.
Tensor plan_tables(const PlanPtr& plan);
// The plan whose tables `tables` is: refused with a ValueError naming `op`'s
// argument plan_tables when the storage is not one plan_tables made (a copy,
// any other tensor, a view of other memory), when it is a view of a part of
// it, when it was modified in place since it was made (its version counter
// moved), or when its plan has been freed. While the current CUDA stream is
// capturing a graph the plan is kept alive until the process ends: torch's
// CUDA graphs hold no reference to their inputs, and a replay reads the
// plan's tables at the addresses it captured.
PlanPtr plan_of_tables(const Tensor& tables, const char* op);

// The plan of an optional argument; an empty IndexPlan for None.
const IndexPlan& plan_of(const OptPlan& plan);
// A plan argument that the op requires: None is a ValueError naming the op.
PlanPtr required_plan(const PlanPtr& plan, const char* op);

// detdit::plan and detdit::plan_from_rows.
PlanPtr make_plan(const Tensor& timestep_indices, const Tensor& token_tags, int64_t num_timesteps, int64_t batch);
PlanPtr make_plan_from_rows(const Tensor& row_index, int64_t num_rows, int64_t batch);
// A plan's pickled state, and the plan of one, through plan_from_rows (a
// device that is not a torch device string is a ValueError naming it).
PlanHolder::State plan_state(const IndexPlan& plan);
PlanPtr plan_from_state(const PlanHolder::State& state);
// The same table: equal sizes, device and row index.
bool same_table(const IndexPlan& a, const IndexPlan& b);

}  // namespace detdit_torch
