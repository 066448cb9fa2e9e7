// The IndexPlan torch class and its two constructors (contract in plan.h).
#include "plan.h"

#include <algorithm>
#include <atomic>

namespace detdit_torch {

// Never reused, so a compiled graph that guards on an id can only run with the
// plan it was traced with: a CUDA graph captures the plan's device tables by
// address (docs/python.md, torch.compile).
int64_t new_plan_id() {
  static std::atomic<int64_t> next_id{1};
  return next_id++;
}

PlanHolder::PlanHolder(IndexPlan p) : plan(std::move(p)), id_(new_plan_id()) {}

Tensor PlanHolder::row_index() const {
  Tensor rows = at::empty({plan.seq_len()}, at::TensorOptions().dtype(at::kInt));
  std::copy_n(plan.host_tables().row_of_seq, plan.seq_len(), rows.data_ptr<int32_t>());
  return rows;
}

PlanHolder::State PlanHolder::state() const { return State(row_index(), num_rows(), batch(), device()); }

bool PlanHolder::equals(const PlanHolder& other) const {
  if (seq_len() != other.seq_len() || batch() != other.batch() || num_rows() != other.num_rows() ||
      device() != other.device())
    return false;
  const int32_t* mine = plan.host_tables().row_of_seq;
  return std::equal(mine, mine + seq_len(), other.plan.host_tables().row_of_seq);
}

std::string PlanHolder::repr() const {
  return "IndexPlan(seq_len=" + std::to_string(seq_len()) + ", batch=" + std::to_string(batch()) +
         ", num_rows=" + std::to_string(num_rows()) + ", device=" + device() + ")";
}

PlanHolder::Flat PlanHolder::flatten() const {
  // Strings, because dynamo guards a string by its value even under
  // dynamic=True, where it would turn an int into an unguarded symbol.
  return {Field("id", std::to_string(id_)),
          Field("seq_len", std::to_string(seq_len())),
          Field("batch", std::to_string(batch())),
          Field("num_rows", std::to_string(num_rows())),
          Field("positions", std::to_string(positions())),
          Field("num_chunks", std::to_string(num_chunks())),
          Field("num_segments", std::to_string(num_segments())),
          Field("device", device())};
}

const IndexPlan& PlanHolder::single_batch(detdit::Stream stream) {
  if (plan.batch() == 1) return plan;
  std::lock_guard<std::mutex> lock(mutex_);
  if (!single_batch_.valid()) {
    TensorView rows = TensorView::contiguous(const_cast<int32_t*>(plan.device_tables().row_of_seq), DType::kI32,
                                             {plan.seq_len()}, plan.device());
    check_ok(IndexPlan::from_row_index(rows, plan.num_rows(), 1, &single_batch_, stream));
  }
  return single_batch_;
}

const IndexPlan& plan_of(const OptPlan& plan) {
  static const IndexPlan kAbsent;
  return plan.has_value() && *plan ? (*plan)->plan : kAbsent;
}

PlanPtr required_plan(const PlanPtr& plan, const char* op) {
  if (!plan) C10_THROW_ERROR(ValueError, std::string(op) + " needs an IndexPlan (detdit.plan(...)), got None");
  return plan;
}

PlanPtr make_plan(const Tensor& timestep_indices, const Tensor& token_tags, int64_t num_timesteps, int64_t batch) {
  DeviceScope scope(timestep_indices);
  IndexPlan plan;
  check_ok(IndexPlan::from_timesteps_and_tags(view(timestep_indices, "timestep_indices"),
                                              view(token_tags, "token_tags"), num_timesteps, batch, &plan,
                                              scope.stream()));
  return c10::make_intrusive<PlanHolder>(std::move(plan));
}

PlanPtr make_plan_from_rows(const Tensor& row_index, int64_t num_rows, int64_t batch) {
  DeviceScope scope(row_index);
  IndexPlan plan;
  check_ok(IndexPlan::from_row_index(view(row_index, "row_index"), num_rows, batch, &plan, scope.stream()));
  return c10::make_intrusive<PlanHolder>(std::move(plan));
}

PlanPtr plan_from_state(const PlanHolder::State& state) {
  const auto& [row_index, num_rows, batch, device] = state;
  return make_plan_from_rows(row_index.to(c10::Device(device)), num_rows, batch);
}

}  // namespace detdit_torch
