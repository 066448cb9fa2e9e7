// cases/op_case.h: binding a case to a device, running it, comparing outputs,
// and the registry of case generators.
#include "cases/op_case.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ostream>
#include <utility>

namespace detdit {
namespace cases {

const char* phase_name(Phase phase) { return phase == Phase::kForward ? "fwd" : "bwd"; }

namespace {

[[noreturn]] void unknown(const char* what, const std::string& name) {
  // A case that names a tensor it did not declare is a bug in the case file.
  std::fprintf(stderr, "detdit cases: unknown %s '%s'\n", what, name.c_str());
  std::abort();
}

}  // namespace

Fill uniform_values(uint64_t seed, double mean, double std) {
  return [seed, mean, std](HostTensor* t) { fill_counter_uniform(t, seed, mean, std); };
}

Fill weight_or(const CaseContext& context, const std::string& name, Fill fallback) {
  if (!context.weight) return fallback;
  const auto weight = context.weight;
  return [weight, name, fallback](HostTensor* t) {
    TensorView w;
    if (weight(name, &w).ok() && w.nbytes() == t->nbytes() && w.dtype == t->dtype())
      std::memcpy(t->data(), w.data, t->nbytes());
    else
      fallback(t);
  };
}

const TensorView& Instance::operator[](const std::string& name) const { return tensor(name).view(); }

const DeviceTensor& Instance::tensor(const std::string& name) const {
  const auto it = tensors_.find(name);
  if (it == tensors_.end()) unknown("tensor", name);
  return it->second;
}

const IndexPlan& Instance::plan(const std::string& name) const {
  const auto it = plans_.find(name);
  if (it == plans_.end()) unknown("plan", name);
  return it->second;
}

OpCase& OpCase::input(std::string name, Phase phase, DType dtype, std::vector<int64_t> shape, Fill fill,
                      int position_dim) {
  TensorSpec spec;
  spec.name = std::move(name);
  spec.phase = phase;
  spec.dtype = dtype;
  spec.shape = std::move(shape);
  spec.fill = std::move(fill);
  spec.position_dim = position_dim;
  tensors.push_back(std::move(spec));
  return *this;
}

OpCase& OpCase::output(std::string name, Phase phase, DType dtype, std::vector<int64_t> shape, int position_dim) {
  TensorSpec spec;
  spec.name = std::move(name);
  spec.phase = phase;
  spec.output = true;
  spec.dtype = dtype;
  spec.shape = std::move(shape);
  spec.position_dim = position_dim;
  tensors.push_back(std::move(spec));
  return *this;
}

const TensorSpec& OpCase::spec(const std::string& name) const {
  for (const TensorSpec& t : tensors)
    if (t.name == name) return t;
  unknown("tensor", name);
}

double OpCase::tensor_bytes(const std::string& name) const {
  const TensorSpec& t = spec(name);
  int64_t n = 1;
  for (int64_t d : t.shape) n *= d;
  return static_cast<double>(n) * static_cast<double>(dtype_size(t.dtype));
}

void OpCase::set_bytes(Phase phase, const std::vector<std::string>& names, double extra,
                       const std::string& extra_name) {
  double total = extra;
  std::string model;
  for (const std::string& name : names) {
    total += tensor_bytes(name);
    model += (model.empty() ? "" : " + ") + name;
  }
  if (!extra_name.empty()) model += (model.empty() ? "" : " + ") + extra_name;
  bytes[static_cast<int>(phase)] = total;
  byte_model[static_cast<int>(phase)] = model;
}

std::string argument_text(double value) {
  char text[32];
  for (int digits = 1; digits <= 17; ++digits) {  // %.17g always reads back exactly
    std::snprintf(text, sizeof text, "%.*g", digits, value);
    if (std::strtod(text, nullptr) == value) break;
  }
  return text;
}

void PrintTo(const OpCase& c, std::ostream* os) { *os << c.full_name(); }

namespace {

HostTensor filled(const TensorSpec& spec) {
  HostTensor host(spec.dtype, spec.shape);
  if (spec.fill) spec.fill(&host);
  return host;
}

}  // namespace

void make_inputs(const OpCase& c, std::map<std::string, HostTensor>* inputs) {
  inputs->clear();
  for (const TensorSpec& spec : c.tensors)
    if (!spec.output) (*inputs)[spec.name] = filled(spec);
}

Status instantiate(const OpCase& c, const Device& device, Stream stream, Instance* instance,
            const std::map<std::string, HostTensor>* inputs) {
  Instance t;
  t.device = device;
  t.stream = stream;
  t.numerics = c.numerics;
  for (const TensorSpec& spec : c.tensors) {
    DeviceTensor tensor;
    if (spec.output) {
      DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(spec.dtype, spec.shape, device, &tensor, stream));
    } else if (inputs != nullptr) {
      DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(inputs->at(spec.name), device, &tensor, stream));
    } else {
      DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(filled(spec), device, &tensor, stream));
    }
    t.tensors_[spec.name] = std::move(tensor);
  }
  for (const PlanSpec& spec : c.plans) {
    IndexPlan plan;
    DETDIT_RETURN_IF_ERROR(spec.rows == PlanSpec::Rows::kAdaln ? adaln_plan(spec.index, device, &plan, stream)
                                                                : timestep_plan(spec.index, device, &plan, stream));
    t.plans_[spec.name] = plan;
  }
  *instance = std::move(t);
  return Status();
}

Status run(const OpCase& c, Phase phase, const Instance& instance) {
  const RunFn& fn = phase == Phase::kForward ? c.forward : c.backward;
  if (!fn) return Status::value_error(c.full_name() + " has no " + phase_name(phase) + " phase");
  return fn(instance, instance.stream);
}

namespace {

Status download_tensors(const OpCase& c, const Instance& instance, bool outputs_only,
                        std::map<std::string, HostTensor>* host) {
  host->clear();
  for (const TensorSpec& spec : c.tensors)
    if (spec.output || !outputs_only)
      DETDIT_RETURN_IF_ERROR(instance.tensor(spec.name).to_host(&(*host)[spec.name], instance.stream));
  return Status();
}

}  // namespace

Status download(const OpCase& c, const Instance& instance, std::map<std::string, HostTensor>* host) {
  return download_tensors(c, instance, false, host);
}

Status download_outputs(const OpCase& c, const Instance& instance, std::map<std::string, HostTensor>* host) {
  return download_tensors(c, instance, true, host);
}

std::vector<OutputReport> compare_outputs(const OpCase& c, Phase phase,
                                          const std::map<std::string, HostTensor>& expected,
                                          const std::map<std::string, HostTensor>& actual) {
  std::vector<OutputReport> reports;
  for (const TensorSpec& spec : c.tensors) {
    if (!spec.output || spec.phase != phase) continue;
    OutputReport r;
    r.output = spec.name;
    const HostTensor& e = expected.at(spec.name);
    r.mismatch = compare(e, actual.at(spec.name));
    r.still_canary = e.nbytes() > 0 && all_bytes_are(e, kCanary);
    reports.push_back(std::move(r));
  }
  return reports;
}

Status compare_with_cpu(const OpCase& c, const Device& device, std::vector<OutputReport>* reports) {
  Instance cpu, other;
  {
    std::map<std::string, HostTensor> inputs;  // filled once for both
    make_inputs(c, &inputs);
    DETDIT_RETURN_IF_ERROR(instantiate(c, Device::cpu(), nullptr, &cpu, &inputs));
    DETDIT_RETURN_IF_ERROR(instantiate(c, device, nullptr, &other, &inputs));
  }
  reports->clear();
  for (Phase phase : {Phase::kForward, Phase::kBackward}) {
    if (!c.has(phase)) continue;
    DETDIT_RETURN_IF_ERROR(run(c, phase, cpu));
    DETDIT_RETURN_IF_ERROR(run(c, phase, other));
  }
  std::map<std::string, HostTensor> expected, actual;
  DETDIT_RETURN_IF_ERROR(download_outputs(c, cpu, &expected));
  DETDIT_RETURN_IF_ERROR(download_outputs(c, other, &actual));
  for (Phase phase : {Phase::kForward, Phase::kBackward}) {
    std::vector<OutputReport> r = compare_outputs(c, phase, expected, actual);
    reports->insert(reports->end(), r.begin(), r.end());
  }
  return Status();
}

HostTensor slice_of(const HostTensor& t, int dim, int64_t index) {
  std::vector<int64_t> shape = t.shape();
  int64_t outer = 1, inner = 1;
  for (int d = 0; d < dim; ++d) outer *= shape[d];
  for (std::size_t d = dim + 1; d < shape.size(); ++d) inner *= shape[d];
  const int64_t extent = shape[dim];
  shape[dim] = 1;
  HostTensor out(t.dtype(), shape);
  const std::size_t width = dtype_size(t.dtype()), block = static_cast<std::size_t>(inner) * width;
  for (int64_t o = 0; o < outer; ++o)  // (outer, extent, inner) -> (outer, 1, inner)
    std::memcpy(static_cast<char*>(out.data()) + o * block,
                static_cast<const char*>(t.data()) + (o * extent + index) * block, block);
  return out;
}

namespace {

Status run_all(const OpCase& c, const Instance& instance) {
  for (Phase phase : {Phase::kForward, Phase::kBackward})
    if (c.has(phase)) DETDIT_RETURN_IF_ERROR(run(c, phase, instance));
  return Status();
}

}  // namespace

Status compare_positions_alone(const OpCase& c, const Device& device, const std::vector<int64_t>& positions,
                               std::vector<OutputReport>* reports, const std::map<std::string, HostTensor>* full_run) {
  reports->clear();
  if (!c.alone) return Status::value_error(c.full_name() + " has no one-position form");
  std::map<std::string, HostTensor> ran;
  if (!full_run) {
    Instance full;
    DETDIT_RETURN_IF_ERROR(instantiate(c, device, nullptr, &full));
    DETDIT_RETURN_IF_ERROR(run_all(c, full));
    DETDIT_RETURN_IF_ERROR(download(c, full, &ran));
  }
  const std::map<std::string, HostTensor>& all = full_run ? *full_run : ran;
  for (int64_t p : positions) {
    OpCase alone = c.alone(p);
    alone.numerics = c.numerics;
    std::map<std::string, HostTensor> inputs, got;
    for (const TensorSpec& spec : alone.tensors)
      if (!spec.output)
        inputs[spec.name] = spec.position_dim >= 0 ? slice_of(all.at(spec.name), spec.position_dim, p) : all.at(spec.name);
    Instance one;
    DETDIT_RETURN_IF_ERROR(instantiate(alone, device, nullptr, &one, &inputs));
    DETDIT_RETURN_IF_ERROR(run_all(alone, one));
    DETDIT_RETURN_IF_ERROR(download(alone, one, &got));
    for (const TensorSpec& spec : alone.tensors) {
      if (!spec.output || spec.position_dim < 0) continue;
      OutputReport r;
      r.output = spec.name + " at " + std::to_string(p);
      r.mismatch = compare(slice_of(all.at(spec.name), spec.position_dim, p), got.at(spec.name));
      reports->push_back(std::move(r));
    }
  }
  return Status();
}

std::vector<CaseFamily>& case_families() {
  // A function-local static: registrations from other translation units'
  // static initialisers always find it constructed.
  static std::vector<CaseFamily> families;
  return families;
}

std::vector<OpCase> op_cases(const std::string& op, Suite suite, const CaseContext& context) {
  std::vector<OpCase> out;
  for (const CaseFamily& f : case_families()) {
    if (!op.empty() && op != f.op) continue;
    std::vector<OpCase> cases = f.generate(suite, context);
    for (OpCase& c : cases) out.push_back(std::move(c));
  }
  return out;
}

std::vector<std::string> case_ops() {
  std::vector<std::string> ops;
  for (const CaseFamily& f : case_families()) ops.push_back(f.op);
  return ops;
}

}  // namespace cases
}  // namespace detdit
