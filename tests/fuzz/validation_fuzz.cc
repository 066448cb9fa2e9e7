// libFuzzer harness of the op entry points' validation (docs/ops.md: every
// argument is validated before anything is written): rmsnorm_forward and
// gate_residual_forward on CPU views whose dtypes, ranks, shapes, strides,
// byte offsets and aliasing come from the input, over small real buffers.
// Every call must return a Status without a crash or a sanitizer finding;
// a refused call must leave every buffer as it was (inputs and the canary
// of the outputs); an accepted call must give the same bytes when repeated.
// A violated check traps. Build and run: tests/fuzz/run_fuzzer.sh SECONDS
// validation.
//
// A well-formed view (rank 1..4, no negative dimension) is made only when
// every element it spans lies inside its buffer: the ops trust a valid view
// to describe memory the caller owns, so a larger one would be the harness's
// out-of-bounds read, not the library's. Malformed views (rank 0 or past 4,
// negative or overflowing dimensions) are always made: validation must refuse
// them before anything reads them.
//
// Written against the public Params of today (include/detdit/rmsnorm.h,
// gate_residual.h); keep it small, it follows them when they change.
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "detdit/gate_residual.h"
#include "detdit/plan.h"
#include "detdit/rmsnorm.h"

namespace {

using detdit::DType;
using detdit::TensorView;

void require(bool condition) {
  if (!condition) __builtin_trap();
}

constexpr std::size_t kBufferBytes = 64 * 1024;
constexpr uint8_t kInputByte = 0x3F;  // a finite value in every float dtype
constexpr uint8_t kCanary = 0xA5;
constexpr int kBuffers = 6;

// The input as a stream of bytes; zeros once it is spent.
class Bytes {
 public:
  Bytes(const uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  uint8_t next() { return at_ < size_ ? data_[at_++] : 0; }

 private:
  const uint8_t* data_;
  std::size_t size_, at_ = 0;
};

struct Buffers {
  std::array<std::vector<uint8_t>, kBuffers> bytes;
  std::array<uint8_t*, kBuffers> base;  // 64-byte aligned
  std::vector<uint8_t> input_pattern, canary_pattern;
  Buffers() : input_pattern(kBufferBytes, kInputByte), canary_pattern(kBufferBytes, kCanary) {
    for (int i = 0; i < kBuffers; ++i) {
      bytes[i].assign(kBufferBytes + 64, 0);
      const auto address = reinterpret_cast<std::uintptr_t>(bytes[i].data());
      base[i] = bytes[i].data() + (64 - address % 64) % 64;
    }
  }
  const std::vector<uint8_t>& pattern(int i, int inputs) const { return i < inputs ? input_pattern : canary_pattern; }
  void fill(int inputs) {
    for (int i = 0; i < kBuffers; ++i) std::memcpy(base[i], pattern(i, inputs).data(), kBufferBytes);
  }
  bool untouched(int inputs) const {
    for (int i = 0; i < kBuffers; ++i) {
      if (std::memcmp(base[i], pattern(i, inputs).data(), kBufferBytes) != 0) return false;
    }
    return true;
  }
  std::vector<uint8_t> snapshot() const {
    std::vector<uint8_t> all;
    for (int i = 0; i < kBuffers; ++i) all.insert(all.end(), base[i], base[i] + kBufferBytes);
    return all;
  }
};

// A view of buffer `own` (or, when the input says so, of another buffer: an
// output aliasing an input), or absent. Returns false when a well-formed view
// would reach outside its buffer.
bool make_view(Bytes& in, const Buffers& buffers, int own, TensorView* view) {
  const uint8_t flags = in.next();
  *view = TensorView();
  if ((flags & 7) == 0) return true;  // absent
  TensorView v;
  v.dtype = static_cast<DType>(in.next() % 6);  // 5 is no dtype
  v.rank = in.next() % 6;                       // 0 and 5 are no valid rank
  const int stored = v.rank < detdit::kMaxRank ? v.rank : detdit::kMaxRank;
  bool well_formed = v.rank >= 1 && v.rank <= detdit::kMaxRank;
  for (int d = 0; d < stored; ++d) {
    const uint8_t b = in.next();
    v.shape[d] = b == 255 ? -1 : b == 254 ? int64_t{1} << 40 : b % 9;
    well_formed = well_formed && v.shape[d] >= 0 && v.shape[d] < 64;
  }
  int64_t stride = 1;
  for (int d = stored - 1; d >= 0; --d) {
    if (flags & 8) {
      v.strides[d] = static_cast<int64_t>(in.next() % 24) - 2;  // any stride, negative ones too
    } else {
      v.strides[d] = stride;
      stride *= v.shape[d] > 0 && v.shape[d] < 64 ? v.shape[d] : 1;
    }
  }
  const int buffer = flags & 16 ? in.next() % kBuffers : own;
  // The base sits mid-buffer (negative strides reach below it), possibly
  // misaligned.
  const int64_t start = static_cast<int64_t>(kBufferBytes / 2) + in.next() % 64;
  v.data = buffers.base[buffer] + start;
  if (well_formed) {
    int64_t low = 0, high = 0;  // element offsets of the span
    bool empty = false;
    for (int d = 0; d < v.rank; ++d) {
      empty = empty || v.shape[d] == 0;
      const int64_t reach = (v.shape[d] - 1) * v.strides[d];
      (reach < 0 ? low : high) += reach;
    }
    const int64_t size = static_cast<int64_t>(detdit::dtype_size(v.dtype));
    if (!empty && (start + low * size < 0 || start + (high + 1) * size > static_cast<int64_t>(kBufferBytes))) {
      return false;
    }
  }
  *view = v;
  return true;
}

detdit::IndexPlan make_plan(Bytes& in) {
  const uint8_t b = in.next();
  if ((b & 1) == 0) return detdit::IndexPlan();
  const int64_t seq_len = 1 + (b >> 1) % 6, batch = 1 + (b >> 4) % 2, rows = 1 + (b >> 5) % 4;
  std::vector<int64_t> index(static_cast<std::size_t>(seq_len));
  for (int64_t& r : index) r = in.next() % rows;
  detdit::IndexPlan plan;
  const TensorView view = TensorView::contiguous(index.data(), DType::kI64, {seq_len});
  require(detdit::IndexPlan::from_row_index(view, rows, batch, &plan).ok());
  return plan;
}

float pick_eps(uint8_t b) {
  const float values[] = {1e-5f, 0.0f, -1.0f, __builtin_nanf(""), __builtin_inff(), 1e-30f};
  return values[b % 6];
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Buffers buffers;  // 384 KiB, allocated once
  Bytes in(data, size);
  const bool gate = in.next() & 1;
  const auto numerics = static_cast<detdit::Numerics>(in.next() % 3);  // 2 is no profile
  const detdit::IndexPlan plan = make_plan(in);
  std::array<TensorView, kBuffers> views;
  // rmsnorm: x, weight, shift, scale | out, rstd; gate_residual: residual, y, gate | out.
  const int inputs = gate ? 3 : 4;
  for (int i = 0; i < (gate ? 4 : kBuffers); ++i) {
    if (!make_view(in, buffers, i, &views[i])) return 0;
  }
  const float eps = pick_eps(in.next());
  auto call = [&]() {
    if (gate) {
      detdit::GateResidualParams p;
      p.in.residual = views[0];
      p.in.y = views[1];
      p.in.gate = views[2];
      p.in.plan = plan;
      p.out = views[3];
      return detdit::gate_residual_forward(p);
    }
    detdit::RmsnormParams p;
    p.in.x = views[0];
    p.in.weight = views[1];
    p.in.shift = views[2];
    p.in.scale = views[3];
    p.in.plan = plan;
    p.out = views[4];
    p.rstd = views[5];
    p.in.eps = eps;
    p.in.numerics = numerics;
    return detdit::rmsnorm_forward(p);
  };
  buffers.fill(inputs);
  const detdit::Status first = call();
  if (!first.ok()) {
    require(!first.message().empty());
    require(buffers.untouched(inputs));  // nothing written, not even scratch in a caller's buffer
    return 0;
  }
  // Accepted: the same call on the same inputs gives the same bytes.
  const std::vector<uint8_t> written = buffers.snapshot();
  buffers.fill(inputs);
  require(call().ok());
  require(buffers.snapshot() == written);
  return 0;
}
