// The IndexPlan torch class and its two constructors (contract in plan.h).
#include "plan.h"

#include <algorithm>
#include <atomic>
#include <optional>
#include <unordered_map>

namespace detdit_torch {

// Never reused, so a compiled graph that guards on an id can only run with the
// plan it was traced with: a CUDA graph captures the plan's device tables by
// address (docs/python.md, torch.compile).
int64_t new_plan_id() {
  static std::atomic<int64_t> next_id{1};
  return next_id++;
}

PlanHolder::PlanHolder(IndexPlan p) : plan(std::move(p)), id_(new_plan_id()) {}
PlanHolder::~PlanHolder() { forget_plan_handle(id_); }

namespace {

// The plans that have handed out a handle, by id (weak: a handle, not the
// registry, keeps its plan alive). Leaked, so that plans destroyed during
// exit still find it.
struct HandleRegistry {
  std::mutex mutex;
  std::unordered_map<int64_t, c10::weak_intrusive_ptr<torch::CustomClassHolder>> plans;
};
HandleRegistry& handle_registry() {
  static HandleRegistry* registry = new HandleRegistry;
  return *registry;
}

}  // namespace

Tensor make_plan_handle(const c10::intrusive_ptr<torch::CustomClassHolder>& plan, int64_t id) {
  {
    HandleRegistry& r = handle_registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    r.plans.emplace(id, c10::weak_intrusive_ptr<torch::CustomClassHolder>(plan));
  }
  auto* value = new int64_t(id);
  // the deleter owns a reference to the plan: the plan outlives every handle
  return at::from_blob(value, {1}, [plan, value](void*) { delete value; },
                       at::TensorOptions().dtype(at::kLong));
}

c10::intrusive_ptr<torch::CustomClassHolder> resolve_plan_handle(const Tensor& handle, const char* op) {
  if (!handle.defined() || handle.scalar_type() != at::kLong || !handle.device().is_cpu() || handle.numel() != 1)
    C10_THROW_ERROR(TypeError, std::string(op) + ": plan_handle must be a plan's handle (plan.handle(): one int64 " +
                                   "on the CPU), got " + (handle.defined() ? handle.toString() + " of " +
                                   std::to_string(handle.numel()) + " elements" : std::string("None")));
  const int64_t id = handle.item<int64_t>();
  c10::intrusive_ptr<torch::CustomClassHolder> plan;
  {
    HandleRegistry& r = handle_registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.plans.find(id);
    if (it != r.plans.end()) plan = it->second.lock();
  }
  if (!plan)
    C10_THROW_ERROR(ValueError, std::string(op) + ": plan_handle names no live plan (id " + std::to_string(id) +
                                    "): pass plan.handle() of a plan, which lives while its handle does");
  return plan;
}

void forget_plan_handle(int64_t id) {
  HandleRegistry& r = handle_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.plans.erase(id);
}

Tensor plan_handle(const PlanPtr& plan) { return make_plan_handle(plan, plan->id()); }

PlanPtr plan_of_handle(const Tensor& handle, const char* op) {
  PlanPtr plan = c10::dynamic_intrusive_pointer_cast<PlanHolder>(resolve_plan_handle(handle, op));
  if (!plan)
    C10_THROW_ERROR(ValueError, std::string(op) + ": plan_handle names an SpPlan, expected an IndexPlan's handle");
  return plan;
}

namespace {

Tensor row_index_of(const IndexPlan& plan) {
  Tensor rows = at::empty({plan.seq_len()}, at::TensorOptions().dtype(at::kInt));
  std::copy_n(plan.host_tables().row_of_seq, plan.seq_len(), rows.data_ptr<int32_t>());
  return rows;
}

}  // namespace

Tensor PlanHolder::row_index() const { return row_index_of(plan); }

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

PlanHolder::State plan_state(const IndexPlan& plan) {
  return PlanHolder::State(row_index_of(plan), plan.num_rows(), plan.batch(), plan.device().to_string());
}

PlanPtr plan_from_state(const PlanHolder::State& state) {
  const auto& [row_index, num_rows, batch, device] = state;
  std::optional<c10::Device> where;
  try {
    where = c10::Device(device);
  } catch (const c10::Error&) {
    C10_THROW_ERROR(ValueError, "a pickled detdit plan's device must be a torch device such as 'cpu' or 'cuda:0', "
                                "got '" + device + "'");
  }
  return make_plan_from_rows(row_index.to(*where), num_rows, batch);
}

bool same_table(const IndexPlan& a, const IndexPlan& b) {
  if (a.seq_len() != b.seq_len() || a.batch() != b.batch() || a.num_rows() != b.num_rows() ||
      a.device().to_string() != b.device().to_string())
    return false;
  const int32_t* rows = a.host_tables().row_of_seq;
  return std::equal(rows, rows + a.seq_len(), b.host_tables().row_of_seq);
}

}  // namespace detdit_torch
