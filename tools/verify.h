// The `detdit verify` case registry. A case is one op in one situation (e.g.
// adaln_projection at the H3 shape); it runs its checks and returns one
// CheckRow per check. Each area registers its cases in its own file,
// tools/verify_<area>.cc, with DETDIT_VERIFY_CASE, so adding cases never
// touches this framework.
//
// A check passes when every bitwise comparison it ran matched and, where it
// measured an error against an FP64 oracle, the error is within its bound.
// A case that returns an error Status fails as one check carrying the message.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "detdit/comm.h"
#include "detdit/numerics.h"
#include "detdit/status.h"
#include "detdit/tensor.h"
#include "registry.h"
#include "weights_source.h"

namespace detdit {
namespace cli {

struct CheckRow {
  std::string check;            // "repeatability", "row invariance T=1..4", "accuracy vs fp64"
  int64_t bitwise_run = 0;      // bitwise comparisons made (whole tensors)
  int64_t bitwise_passed = 0;   // of those, byte-equal
  double max_error = std::numeric_limits<double>::quiet_NaN();  // vs the FP64 oracle
  double bound = std::numeric_limits<double>::quiet_NaN();      // the bar max_error must meet; NaN: no error measured
  std::string error_unit;       // what max_error measures, e.g. "abs", "ulp(bf16)", "rel"
  double seconds = 0;
  bool pass = false;
  std::string detail;           // first mismatch, or why it failed
  // Informational rows (e.g. the naive-SP contrast) show a measurement; they
  // are not counted as checks unless their computation failed.
  bool informational = false;
  // Named measurements recorded in the JSON report (e.g. rows and bytes each
  // rank moves): one value, or one per rank.
  std::vector<std::pair<std::string, std::vector<double>>> metrics;
};

struct VerifyContext {
  bool quick = false;
  Device device;
  const Weights* weights = nullptr;
  uint64_t seed = 0;
  // --comm mpi: this process's rank of the world (NCCL on CUDA, MPI on the
  // CPU); only the cases registered with DETDIT_VERIFY_PARALLEL_CASE run, each
  // on every rank, and the framework merges the ranks' rows. nullptr: the
  // default in-process run.
  Communicator* comm = nullptr;
};

using VerifyFn = Status (*)(const VerifyContext& context, std::vector<CheckRow>* rows);

struct VerifyCase {
  const char* op;    // the op's snake_case name, or "weights" / "chain"
  const char* name;  // the situation, e.g. "h3 T=4"
  bool cpu;          // runs with --device cpu
  bool cuda;         // runs with --device cuda
  VerifyFn run;
  bool comm = false;  // runs under --comm mpi too (uses context.comm)
  // Whether the case applies to this run (e.g. a size only without --quick);
  // nullptr: always.
  bool (*enabled)(const VerifyContext& context) = nullptr;
};

inline std::vector<VerifyCase>& verify_registry() { return registry<VerifyCase>(); }

// DETDIT_VERIFY_CASE("rmsnorm", "modulated S=4097", /*cpu=*/true, /*cuda=*/true, run_fn);
#define DETDIT_VERIFY_CASE(op, name, cpu, cuda, fn) \
  DETDIT_CLI_REGISTER(::detdit::cli::VerifyCase, detdit_verify_case_, op, name, cpu, cuda, fn)
// A case that also runs under --comm mpi (one rank per process), and only
// where enabled(context) says so.
#define DETDIT_VERIFY_PARALLEL_CASE(op, name, cpu, cuda, fn, enabled) \
  DETDIT_CLI_REGISTER(::detdit::cli::VerifyCase, detdit_verify_case_, op, name, cpu, cuda, fn, true, enabled)

// Helpers for cases.

// A row that compares two byte ranges; fills bitwise_run/passed and detail
// (first differing element index and both values in hex).
void compare_bytes(const void* expected, const void* actual, std::size_t bytes, DType dtype, const std::string& what,
                   CheckRow* row);
// pass = all bitwise comparisons matched and (no bound, or max_error <= bound;
// a NaN max_error fails).
void finish_row(CheckRow* row);

// Owned, 64-byte aligned host memory for case inputs and outputs.
class HostBuffer {
 public:
  HostBuffer() = default;
  HostBuffer(DType dtype, std::vector<int64_t> shape);
  TensorView view() const;
  void* data() const { return const_cast<unsigned char*>(bytes_.data()) + offset_; }
  template <typename T>
  T* ptr() const { return static_cast<T*>(data()); }
  std::size_t nbytes() const { return nbytes_; }
  int64_t numel() const;
  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  // Deterministic N(mean, std) values rounded to the dtype (float dtypes).
  void fill_normal(uint64_t seed, double mean = 0.0, double std = 1.0);
  // Element i as double (float dtypes).
  double get(int64_t i) const;

 private:
  DType dtype_ = DType::kF32;
  std::vector<int64_t> shape_;
  std::vector<unsigned char> bytes_;
  std::size_t offset_ = 0, nbytes_ = 0;
};

// The bf16 nearest to a double (ties to even), for finite x: an FP64
// oracle's correctly rounded bf16 (x -> float -> bf16 would round twice).
uint16_t bf16_nearest(double x);

// Seconds since an arbitrary origin (steady clock).
double now_seconds();

// Runs fn(&row) and times it; an error Status fails the row with its message.
template <typename Fn>
CheckRow timed_check(const std::string& name, Fn&& fn) {
  CheckRow row;
  row.check = name;
  const double start = now_seconds();
  Status status = fn(&row);
  row.seconds = now_seconds() - start;
  if (!status.ok()) {
    row.detail = status.to_string();
    row.pass = false;
    return row;
  }
  finish_row(&row);
  return row;
}

// A case's tensor on the case's device: a CPU tensor owns host memory, a CUDA
// tensor device memory (cudaMalloc; CUDA builds only). Made from a host
// buffer (copied) or empty (filled with 0xA5 bytes so unwritten outputs show).
class DeviceTensor {
 public:
  static Status from_host(const HostBuffer& host, const Device& device, DeviceTensor* tensor);
  // The same from a buffer that is no longer needed: a CPU tensor takes it over (no copy).
  static Status from_host(HostBuffer&& host, const Device& device, DeviceTensor* tensor);
  static Status empty(DType dtype, std::vector<int64_t> shape, const Device& device, DeviceTensor* tensor);
  const TensorView& view() const { return view_; }
  // A host copy (synchronises the device).
  Status to_host(HostBuffer* host) const;
  // A host copy after the work on `stream` (synchronises only that stream; a
  // rank thread sharing the GPU with other ranks uses this).
  Status to_host(HostBuffer* host, Stream stream) const;

 private:
  std::shared_ptr<void> memory_;
  TensorView view_;
  std::vector<int64_t> shape_;
};

}  // namespace cli
}  // namespace detdit
