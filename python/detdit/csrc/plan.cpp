// The IndexPlan torch class and its two constructors (contract in plan.h).
#include "plan.h"

#ifdef DETDIT_TORCH_CUDA
#include <c10/cuda/CUDAException.h>
#endif

#include <algorithm>
#include <atomic>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <vector>

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

namespace {

// The context of a storage made by plan_tables: its deleter (the function
// below, which nothing else uses) is what tells a plan's tables from any
// other tensor.
struct TablesContext {
  TablesContext(const PlanPtr& owner, Tensor bytes) : plan(owner), memory(std::move(bytes)) {}
  c10::weak_intrusive_ptr<PlanHolder> plan;
  Tensor memory;        // the bytes, allocated by torch on the plan's device
  int64_t version = 0;  // the tables' version counter when they were made
};
void delete_tables_context(void* context) { delete static_cast<TablesContext*>(context); }

const TablesContext* tables_context(const Tensor& tables) {
  if (!tables.defined() || !tables.has_storage()) return nullptr;
  const c10::DataPtr& data = tables.storage().data_ptr();
  if (data.get_deleter() != &delete_tables_context) return nullptr;
  return static_cast<const TablesContext*>(data.get_context());
}

std::string describe(const Tensor& t) {
  if (!t.defined()) return "an undefined tensor";
  return std::string("a tensor of dtype ") + c10::toString(t.scalar_type()) + ", shape " + c10::str(t.sizes()) +
         ", on " + t.device().str();
}

// The plans used while a CUDA graph was being captured, kept until the
// process ends (plan.h). Leaked, as the handle registry.
void keep_for_cuda_graphs(const PlanPtr& plan) {
  static std::mutex* mutex = new std::mutex;
  static auto* kept = new std::unordered_set<int64_t>;
  static auto* plans = new std::vector<PlanPtr>;
  std::lock_guard<std::mutex> lock(*mutex);
  if (kept->insert(plan->id()).second) plans->push_back(plan);
}

bool capturing_cuda_graph(const Tensor& tables) {
#ifdef DETDIT_TORCH_CUDA
  if (tables.is_cuda()) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(tables.device().index()).stream(), &status));
    return status != cudaStreamCaptureStatusNone;
  }
#endif
  (void)tables;
  return false;
}

}  // namespace

Tensor plan_tables(const PlanPtr& plan) {
  std::lock_guard<std::mutex> lock(plan->mutex_);
  const Tensor& made = plan->tables_;
  if (made.defined() && made._version() == tables_context(made)->version) return made;
  auto* context = new TablesContext(plan, row_index_of(plan->plan).to(c10::Device(plan->device())));
  Tensor tables = at::for_blob(context->memory.data_ptr(), context->memory.sizes())
                      .context(context, &delete_tables_context)
                      .target_device(context->memory.device())
                      .options(context->memory.options())
                      .make_tensor();
  context->version = tables._version();
  plan->tables_ = tables;
  return tables;
}

PlanPtr plan_of_tables(const Tensor& tables, const char* op) {
  const std::string expected = std::string(op) + ": plan_tables must be the tables of a live IndexPlan " +
                               "(plan.tables(), detdit.plan_tables(plan)), got ";
  const TablesContext* context = tables_context(tables);
  if (!context)
    C10_THROW_ERROR(ValueError, expected + describe(tables) + " that no plan made (a copy of a plan's tables, " +
                                    "or any other tensor, never stands for a plan)");
  if (tables.storage_offset() != 0 || !tables.sizes().equals(context->memory.sizes()) ||
      !tables.strides().equals(context->memory.strides()) || tables.scalar_type() != at::kInt)
    C10_THROW_ERROR(ValueError, expected + "a part or a reshaped view of a plan's tables (" + describe(tables) +
                                    " at offset " + std::to_string(tables.storage_offset()) + "), expected the " +
                                    "whole int32 tensor of shape " + c10::str(context->memory.sizes()));
  if (tables._version() != context->version)
    C10_THROW_ERROR(ValueError, expected + "tables modified in place since the plan made them (version " +
                                    std::to_string(tables._version()) + ", made at version " +
                                    std::to_string(context->version) + "): they are read-only; plan.tables() " +
                                    "gives unmodified ones");
  PlanPtr plan = context->plan.lock();
  if (!plan)
    C10_THROW_ERROR(ValueError, expected + "the tables of a plan that has been freed (keep the plan alive while " +
                                    "its tables are used)");
  if (capturing_cuda_graph(tables)) keep_for_cuda_graphs(plan);
  return plan;
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
