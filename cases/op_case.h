// The op-case library: every op's problems described once, driven by the CUDA
// tests (CPU vs GPU bytes at every tunable), `detdit verify` (accuracy against
// an FP64 oracle, repeatability, row invariance, CUDA = CPU) and `detdit
// bench` (forward and backward timed, every case checked against the CPU).
//
// An OpCase is one op in one situation. It names its tensors (TensorSpec: the
// phase that reads or writes it, dtype, shape, and for an input how its values
// are made, a pure function of the case, so every device gets the same bytes),
// its plans (PlanSpec: an index case built on the instance's device), how to
// call the op in each phase (forward, backward) from an Instance of those
// tensors, and the bytes a call must move at least (each input read once, each
// output written once). Outputs start as the canary (cases/tensor.h).
//
// The per-op files (cases/<family>_cases.cc) register a generator per op with
// DETDIT_OP_CASES; op_cases(op, suite, context) returns its cases for a suite.
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cases/index_case.h"
#include "cases/tensor.h"
#include "detdit/numerics.h"
#include "detdit/plan.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {
namespace cases {

enum class Phase { kForward = 0, kBackward = 1 };
const char* phase_name(Phase phase);  // "fwd" / "bwd"

// Which problems a driver wants.
enum class Suite {
  kTest,    // awkward legal shapes, every dtype, small (the CUDA tests)
  kVerify,  // the weights' shapes at verify's sizes (detdit verify)
  kBench,   // the H3 shapes at the benchmark sizes (detdit bench)
};

// What a generator may read: the weights' dimensions and tensors (verify and
// bench; tests have none), --quick, the seed of the inputs.
struct CaseContext {
  int64_t hidden = 5376, time_embed_dim = 2688, freq_dim = 256, time_embed_hidden = 5376;
  // A DiT family's weights (verify --model; io/manifest.h): its name, pooled text and proj_out widths.
  std::string model = "h3";
  int64_t pooled_dim = 0, out_dim = 0;
  // A host view of the named weight (empty: no weights, e.g. in the tests).
  std::function<Status(const std::string& name, TensorView* view)> weight;
  bool quick = false;
  // The benchmark's smallest sizes only (--quick, or the CPU, where the H3
  // sizes take minutes).
  bool small = false;
  uint64_t seed = 0;
};

// How an input's values are made: a pure function of the case.
using Fill = std::function<void(HostTensor*)>;
// fill_counter_uniform(seed, mean, std) (cases/tensor.h).
Fill uniform_values(uint64_t seed, double mean, double std);
// A copy of the context's named weight, or `fallback` when the context has no
// weights (the tests) or the weight's dtype or size differs from the tensor's.
Fill weight_or(const CaseContext& context, const std::string& name, Fill fallback);

struct TensorSpec {
  std::string name;
  Phase phase = Phase::kForward;  // the phase that reads (input) or writes (output) it
  bool output = false;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  Fill fill;  // inputs: the values (absent: zeros)
  // The dimension that indexes positions (slice p = position p), or -1: the
  // row-invariance check takes slice p of such inputs into a one-position
  // instance and compares slice p of such outputs with it.
  int position_dim = -1;
};

// A plan built from an IndexCase on the instance's device, through the device
// index tensors (so the CUDA path of plan building is exercised too).
struct PlanSpec {
  enum class Rows { kAdaln, kTimestep };  // row ti*3 + tag (R = 3T), or ti (R = T)
  std::string name;
  IndexCase index;
  Rows rows = Rows::kAdaln;
};

struct OpCase;

// A case's tensors and plans on one device.
class Instance {
 public:
  const TensorView& operator[](const std::string& name) const;  // aborts on an unknown name (a case bug)
  const IndexPlan& plan(const std::string& name) const;
  const DeviceTensor& tensor(const std::string& name) const;
  Device device;
  Stream stream = nullptr;
  Numerics numerics = Numerics::kPortable;  // the case's profile (OpCase::numerics)

 private:
  friend Status instantiate(const OpCase& c, const Device& device, Stream stream, Instance* instance,
                     const std::map<std::string, HostTensor>* inputs);
  std::map<std::string, DeviceTensor> tensors_;
  std::map<std::string, IndexPlan> plans_;
  std::vector<DeviceTensor> index_tensors_;
};

using RunFn = std::function<Status(const Instance& t, Stream stream)>;

// An FP64-oracle check of a case's outputs on host copies (verify): the error
// measure, its bound and unit (pass: error <= bound, NaN fails).
struct AccuracyCheck {
  std::string name;  // "accuracy vs fp64"
  double bound = 0;
  std::string unit;
  std::function<double(const std::map<std::string, HostTensor>& tensors)> error;
};

// A second route to a case's outputs that must give the same bytes (the fused
// op as its separate ops composed): from host copies of a run's inputs and
// outputs (download), `compute` recomputes every output of both phases (of the
// forward alone where forward_only) on the CPU into `expected` (compare_outputs
// then names each difference).
struct EquivalentRoute {
  std::string name;  // "= gate_residual then rmsnorm"
  // The route gives the forward's outputs alone (compute fills those; e.g. a
  // byte copy's direct form, where the backward's sums have no second route).
  bool forward_only = false;
  std::function<Status(const std::map<std::string, HostTensor>& tensors, std::map<std::string, HostTensor>* expected)>
      compute;
};

struct OpCase {
  std::string op;    // the op's snake_case name
  std::string name;  // the situation, e.g. "bf16 H=5376 block_S4097_T3_B2"
  std::vector<TensorSpec> tensors;
  std::vector<PlanSpec> plans;
  RunFn forward, backward;  // backward may be empty
  // The bytes floor of one call of each phase, and how it was counted.
  double bytes[2] = {0, 0};
  std::string byte_model[2];
  std::vector<AccuracyCheck> accuracy;
  EquivalentRoute equivalent;  // may be empty
  // The same case for position p alone (S = B = 1; the driver copies slice p
  // of every per-position input into it), for the row-invariance check; may be empty.
  std::function<OpCase(int64_t position)> alone;
  int64_t positions = 0;  // extent of the position dimensions
  // How many positions verify's row-invariance check takes alone: that many
  // spread from the first to the last, every position when there are no more
  // (a cheap case may ask for all of them).
  int64_t alone_probes = 8;
  // Whether the op's forward takes a numerics profile (the run functions pass
  // the instance's profile to every phase that takes one; linear's backward
  // has no profile function), and the profile a driver asks for: portable
  // unless a driver sets the torch profile on a copy of the case (CUDA only;
  // then the CPU has no reference to compare with).
  bool takes_profile = false;
  Numerics numerics = Numerics::kPortable;
  // The op's arguments that are not tensors, plans or the profile, as the
  // bindings name them (e.g. "eps", "activation"), each as text (numbers:
  // argument_text's exact decimal): what a binding needs to call the op as
  // the run functions do (tests/support/export_cases.cc writes them out).
  std::map<std::string, std::string> arguments;

  bool has(Phase phase) const { return phase == Phase::kForward ? static_cast<bool>(forward) : static_cast<bool>(backward); }
  // Adds a tensor; returns *this for chaining.
  OpCase& input(std::string name, Phase phase, DType dtype, std::vector<int64_t> shape, Fill fill,
                int position_dim = -1);
  OpCase& output(std::string name, Phase phase, DType dtype, std::vector<int64_t> shape, int position_dim = -1);
  const TensorSpec& spec(const std::string& name) const;  // aborts on an unknown name (a case bug)
  double tensor_bytes(const std::string& name) const;
  // The bytes floor of `phase`: the named tensors read or written once, plus
  // `extra` (e.g. the rows of a table view); byte_model lists the names.
  void set_bytes(Phase phase, const std::vector<std::string>& names, double extra = 0, const std::string& extra_name = "");
  std::string full_name() const { return op + " " + name; }
};

// A number as the shortest decimal text that reads back as the same double
// (an FP32 argument such as eps reads back as the same float).
std::string argument_text(double value);

// Prints the case as its full name (GoogleTest's parameter printer).
void PrintTo(const OpCase& c, std::ostream* os);

// Host tensors of the case's inputs, each filled by its Fill (absent: zeros).
void make_inputs(const OpCase& c, std::map<std::string, HostTensor>* inputs);
// Creates the case's tensors (inputs filled, outputs the canary) and plans on
// `device`. With `inputs` (make_inputs' or others), every input takes those
// host bytes instead of its fill.
Status instantiate(const OpCase& c, const Device& device, Stream stream, Instance* instance,
            const std::map<std::string, HostTensor>* inputs = nullptr);
// Runs one phase (the backward reads what the forward wrote into the instance).
Status run(const OpCase& c, Phase phase, const Instance& instance);
// Host copies of every tensor of the instance (after the work on its stream).
Status download(const OpCase& c, const Instance& instance, std::map<std::string, HostTensor>* host);
// Host copies of the outputs alone (what compare_outputs reads; at the H3
// shapes the inputs are gigabytes more).
Status download_outputs(const OpCase& c, const Instance& instance, std::map<std::string, HostTensor>* host);

// The outputs of `phase` compared bitwise, expected vs actual (host copies);
// each mismatch named. `written` also fails an expected output that is still
// all canary (the comparison would be vacuous).
struct OutputReport {
  std::string output;
  Mismatch mismatch;
  bool still_canary = false;
};
std::vector<OutputReport> compare_outputs(const OpCase& c, Phase phase,
                                          const std::map<std::string, HostTensor>& expected,
                                          const std::map<std::string, HostTensor>& actual);

// Runs the case on the CPU and on `device` (forward, then backward when the
// case has one) and compares every output: the reports of both phases.
Status compare_with_cpu(const OpCase& c, const Device& device, std::vector<OutputReport>* reports);

// Row invariance: for each of `positions`, the case of that position alone
// (c.alone(p)), whose per-position inputs are slice p of the full case's, run
// on `device` forward (and backward): slice p of every per-position output of
// the full run must equal its output. Reports are named "<output> at p".
// full_run: host copies of every tensor of a full run on `device` (download's),
// used instead of running the full case again.
Status compare_positions_alone(const OpCase& c, const Device& device, const std::vector<int64_t>& positions,
                               std::vector<OutputReport>* reports,
                               const std::map<std::string, HostTensor>* full_run = nullptr);
// Slice `index` of dimension `dim` of a contiguous host tensor (that dimension
// becomes 1).
HostTensor slice_of(const HostTensor& t, int dim, int64_t index);

// ---- the registry -----------------------------------------------------------

using CaseGenerator = std::vector<OpCase> (*)(Suite suite, const CaseContext& context);
struct CaseFamily {
  const char* op;
  CaseGenerator generate;
};
std::vector<CaseFamily>& case_families();
// The cases of `op` (every op when op is empty) for `suite`.
std::vector<OpCase> op_cases(const std::string& op, Suite suite, const CaseContext& context);
// The ops with registered cases, in registration order.
std::vector<std::string> case_ops();

struct CaseRegistrar {
  CaseRegistrar(const char* op, CaseGenerator generate) { case_families().push_back({op, generate}); }
};

}  // namespace cases
}  // namespace detdit

#define DETDIT_CASES_CONCAT_(a, b) a##b
#define DETDIT_CASES_CONCAT(a, b) DETDIT_CASES_CONCAT_(a, b)
// DETDIT_OP_CASES("rmsnorm", rmsnorm_cases): registers the generator of an op.
#define DETDIT_OP_CASES(op, generator) \
  static ::detdit::cases::CaseRegistrar DETDIT_CASES_CONCAT(detdit_case_family_, __LINE__)(op, generator)
