// sp_region's grouped modulation forms (per sample, per frame, per token) and
// the plain ops of an SpPlan without an index: every rank's outputs and
// gradients byte-equal to WS1 (the public single-device ops on the full
// sequence), at world sizes 1..8, in-process on the CPU. Shapes where group
// chunks straddle ranks: S = 2100 with F = 3 (L = 700: two 256-chunks and a
// short one per frame), F = 7 (L = 300), per sample (L = S, odd S = 4097),
// and S = 40 at world 8 (5 positions per rank, groups shorter than a chunk).
// Recipes: modulation in x's dtype, fp32 modulation of bf16 x (out fp32),
// upcast, and the gate's k. Modulation tensors are views of (B, 6, H) and
// (B, F, 6, H) tensors, as the models chunk them. Also the collective
// validation of the forms (every rank refuses, nothing written), the ranks as
// MPI processes, and ranks sharing one GPU (skipped without one).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "cases/parallel_cases.h"
#include "detdit/comm.h"
#include "detdit/gate_residual.h"
#include "detdit/gate_residual_layernorm.h"
#include "detdit/gate_residual_rmsnorm.h"
#include "detdit/layernorm.h"
#include "detdit/parallel.h"
#include "detdit/rmsnorm.h"
#include "parallel/parallel_util.h"
#include "support/rowwise_fixture.h"
#include "support/test_util.h"

namespace detdit {
namespace {

using testing::HostTensor;
using testing::kCanary;

// A modulation form of a test: frames F (1: per sample; 0: per token) and
// whether each tensor is a view of a wider (B, [F,] 6, H) tensor.
struct Form {
  int64_t frames = 1;
  bool chunked = true;
  std::string name() const {
    return frames == 0 ? "per_token" : frames == 1 ? "per_sample" : "per_frame F=" + std::to_string(frames);
  }
};

struct Recipe {
  DType x = DType::kBF16, mod = DType::kBF16;
  bool upcast = false, has_k = false;
  std::string name() const {
    return std::string("x ") + dtype_name(x) + " mod " + dtype_name(mod) + (upcast ? " upcast" : "") +
           (has_k ? " k" : "");
  }
};

// A modulation tensor of the form: the full (B, F, H) values (per token (B,
// S, H)) and, when chunked, their storage as slot `slot` of (B, F, 6, H).
struct Mod {
  HostTensor storage;  // (B, F, 6, H) or (B, F, H)
  int64_t batch = 0, frames = 0, hidden = 0;
  bool chunked = false;
  int slot = 0;
  bool per_sample = false;
  // The view the op takes: (B, H) / (B, 1, H) per sample, (B, F, 1, H) / (B, F, H) per frame or token.
  TensorView view() const { return view_at(storage.data(), Device::cpu()); }
  // The view over a copy of storage at `base` on `device`.
  TensorView view_at(void* base, Device device) const {
    const int64_t row = chunked ? 6 * hidden : hidden;
    void* data = static_cast<char*>(base) + (chunked ? slot * hidden : 0) * dtype_size(storage.dtype());
    const DType t = storage.dtype();
    if (per_sample) {
      if (chunked) return TensorView::strided(data, t, {batch, 1, hidden}, {row, row, 1}, device);
      return TensorView::strided(data, t, {batch, hidden}, {row, 1}, device);
    }
    if (chunked) return TensorView::strided(data, t, {batch, frames, 1, hidden}, {frames * row, row, row, 1}, device);
    return TensorView::strided(data, t, {batch, frames, hidden}, {frames * row, row, 1}, device);
  }
};

Mod make_mod(DType dtype, int64_t batch, int64_t frames, int64_t hidden, bool chunked, int slot, uint64_t seed,
             double mean, double std) {
  Mod m;
  m.batch = batch;
  m.frames = frames;
  m.hidden = hidden;
  m.chunked = chunked;
  m.slot = slot;
  m.per_sample = frames == 1;
  m.storage = chunked ? testing::random_tensor(dtype, {batch, frames, 6, hidden}, seed, mean, std)
                      : testing::random_tensor(dtype, {batch, frames, hidden}, seed, mean, std);
  return m;
}

// A gradient output shaped like a modulation view: fresh contiguous (B, H) or (B, F, H).
HostTensor grad_like(const Mod& m, DType dtype) {
  if (m.per_sample) return HostTensor(dtype, {m.batch, m.hidden});
  return HostTensor(dtype, {m.batch, m.frames, m.hidden});
}

// The view of gradient g of modulation m: m's view's shape (with its unit
// dimension when chunked); a per-token or table modulation's (not chunked,
// not per sample) g as it is.
TensorView grad_view(const TensorView& g, const Mod& m) {
  if (m.per_sample && m.chunked) return g.reshaped({m.batch, 1, m.hidden});
  if (m.chunked) return g.reshaped({m.batch, m.frames, 1, m.hidden});
  return g;
}

// One rank's tensors on `device` (the CPU or a CUDA device), so a rank's code
// is the same for both: each host tensor is uploaded once; out() marks it an
// output, copied back into the host tensor by sync().
class OnDevice {
 public:
  explicit OnDevice(Device device) : stream_(device), arena_(device, stream_.get()) {}
  TensorView operator()(const HostTensor& t) {
    for (const auto& [host, view] : views_)
      if (host == &t) return view;
    views_.emplace_back(&t, arena_.upload(t));
    return views_.back().second;
  }
  TensorView out(HostTensor& t) {
    outputs_.push_back(&t);
    return (*this)(t);
  }
  TensorView mod(const Mod& m) {
    const TensorView storage = (*this)(m.storage);
    return m.view_at(storage.data, storage.device);
  }
  Stream stream() { return stream_.get(); }
  void sync() {
    for (HostTensor* t : outputs_) {
      const HostTensor back = arena_.download((*this)(*t));
      std::memcpy(t->data(), back.data(), t->nbytes());
    }
  }

 private:
  cases::RankStream stream_;
  testing::DeviceArena arena_;
  std::vector<std::pair<const HostTensor*, TensorView>> views_;
  std::vector<HostTensor*> outputs_;
};

// WS1's tensors where they are, on the host: OnDevice's interface, so one
// function of an op fills its Params for WS1 (OnHost) and for a rank
// (OnDevice) from either's tensors.
struct OnHost {
  TensorView operator()(const HostTensor& t) const { return t.view(); }
  TensorView out(HostTensor& t) const { return t.view(); }
  TensorView mod(const Mod& m) const { return m.view(); }
};

struct Bounds {
  int64_t lo, hi;
};
Bounds bounds(int64_t seq_len, int world, int rank) { return {rank * seq_len / world, (rank + 1) * seq_len / world}; }

HostTensor slice(const HostTensor& full, int64_t batch, int64_t seq_len, Bounds b) {
  return cases::local_rows(full, batch, seq_len, b.lo, b.hi);
}

// A per-token modulation's local rows as a Mod (contiguous (B, S_local, H)).
Mod local_token_mod(const Mod& full, int64_t seq_len, Bounds b) {
  Mod m = full;
  m.chunked = false;
  m.frames = b.hi - b.lo;
  m.storage = slice(full.storage, full.batch, seq_len, b);
  return m;
}

// Every byte of `local` equals rows [lo, hi) of each item of `full`.
::testing::AssertionResult equal_rows(const HostTensor& full, const HostTensor& local, int64_t batch,
                                      int64_t seq_len, Bounds b) {
  return testing::bitwise_equal(slice(full, batch, seq_len, b), local);
}

// What a rank holds of a tensor of WS1's: rows [lo, hi) of each item (a
// per-position tensor) or the whole of it (weights, grouped modulation and
// their gradients).
enum class Part { kRows, kWhole };

// An output of an op's tensors (its Data): name, member, the part a rank holds.
template <typename Data>
struct Output {
  const char* name;
  HostTensor Data::*tensor;
  Part part;
};

// How a case's tensors are split over the ranks: the per-position inputs,
// the per-token modulation (its rows too; empty for the other forms) and the
// outputs the case asks for, in the order they are compared.
template <typename Data>
struct Parts {
  std::vector<HostTensor Data::*> rows;
  std::vector<Mod Data::*> token_mods;
  std::vector<Output<Data>> outputs;
};

// The part a rank holds of a modulation gradient: its rows per token, else all of it.
Part mod_part(bool token) { return token ? Part::kRows : Part::kWhole; }

// One rank's tensors of a case: WS1's inputs as the rank holds them, and the
// outputs fresh and filled with the canary, each of the shape of its part.
template <typename Data>
Data rank_data(const Data& ws1, const Parts<Data>& parts, int64_t batch, int64_t seq_len, Bounds bd) {
  Data mine = ws1;
  for (HostTensor Data::*t : parts.rows) mine.*t = slice(ws1.*t, batch, seq_len, bd);
  for (Mod Data::*m : parts.token_mods) mine.*m = local_token_mod(ws1.*m, seq_len, bd);
  for (const Output<Data>& o : parts.outputs) {
    const HostTensor& full = ws1.*o.tensor;
    mine.*o.tensor = HostTensor(full.dtype(), o.part == Part::kRows ? slice(full, batch, seq_len, bd).shape()
                                                                    : full.shape());
    (mine.*o.tensor).fill_bytes(kCanary);
  }
  return mine;
}

std::string rank_where(const std::string& case_name, const Communicator& comm) {
  return case_name + " world " + std::to_string(comm.world_size()) + " rank " + std::to_string(comm.rank());
}

// Every output of a rank byte-equal to its part of WS1's.
template <typename Data>
void expect_parts_equal(const Data& ws1, const Data& mine, const Parts<Data>& parts, int64_t batch, int64_t seq_len,
                        Bounds bd, const std::string& where) {
  for (const Output<Data>& o : parts.outputs) {
    if (o.part == Part::kRows) {
      EXPECT_TRUE(equal_rows(ws1.*o.tensor, mine.*o.tensor, batch, seq_len, bd)) << where << " " << o.name;
    } else {
      EXPECT_TRUE(testing::bitwise_equal(ws1.*o.tensor, mine.*o.tensor)) << where << " " << o.name;
    }
  }
}

// One rank of a case: its SpPlan (over the row index `index` of `table_rows`
// rows when given, its IndexPlan passed on), its tensors (rank_data), `run`
// (the SP forward and backward on them), then every output compared with WS1's.
template <typename Case, typename Data, typename Run>
Status run_rank(Communicator& comm, Device device, const Case& c, const Data& ws1, const Parts<Data>& parts,
                const Run& run, const HostTensor* index = nullptr, int64_t table_rows = 0) {
  OnDevice dev(device);
  const Bounds bd = bounds(c.seq_len, comm.world_size(), comm.rank());
  IndexPlan plan;
  SpPlan sp;
  if (index) {
    DETDIT_RETURN_IF_ERROR(IndexPlan::from_row_index(dev(*index), table_rows, c.batch, &plan, dev.stream()));
    DETDIT_RETURN_IF_ERROR(SpPlan::create(plan, comm.world_size(), comm.rank(), &sp, dev.stream()));
  } else {
    DETDIT_RETURN_IF_ERROR(SpPlan::create(c.seq_len, c.batch, comm.world_size(), comm.rank(), &sp));
  }
  Data mine = rank_data(ws1, parts, c.batch, c.seq_len, bd);
  DETDIT_RETURN_IF_ERROR(run(dev, sp, plan, mine));
  dev.sync();
  expect_parts_equal(ws1, mine, parts, c.batch, c.seq_len, bd, rank_where(c.name(), comm));
  return Status();
}

// The world sizes every in-process case runs at, and the tiny shards' (S = 40:
// 5 positions per rank at world 8).
const std::vector<int> kEveryWorld = {1, 2, 3, 4, 5, 6, 7, 8};
const std::vector<int> kTinyWorlds = {3, 5, 7, 8};
// The grouped forms every op runs, and the tiny shards' (frames of 10 and
// samples of 40 positions).
const Form kEveryForm[] = {Form{1, true}, Form{1, false}, Form{3, true}, Form{7, false}, Form{0, false}};
const Form kTinyForms[] = {Form{1, false}, Form{4, true}, Form{0, false}};

// rank(comm) on every rank of an in-process group of each world size on
// `device`, each run expected to succeed.
void run_every_world(const std::vector<int>& worlds, Device device,
                     const std::function<Status(Communicator&)>& rank) {
  for (int world : worlds) {
    SCOPED_TRACE("world " + std::to_string(world));
    DETDIT_EXPECT_OK(InProcessGroup::run(world, rank, device));
  }
}

// A case: WS1 (ws1(c, &d)), the outputs in `written` not left all zero by
// it, then rank(comm, device, c, d) on every rank of each world size.
template <typename Case, typename Data, typename Rank>
void run_case(const Case& c, void (*ws1)(const Case&, Data*), const Rank& rank, const std::vector<int>& worlds,
              Device device, std::initializer_list<HostTensor Data::*> written = {}) {
  SCOPED_TRACE(c.name());
  Data d;
  ws1(c, &d);
  for (HostTensor Data::*t : written) ASSERT_FALSE(testing::all_bytes_are(d.*t, 0)) << "WS1 left an output zero";
  run_every_world(worlds, device, [&](Communicator& comm) { return rank(comm, device, c, d); });
}

// A case of each of kTinyForms at S = 40 with recipe r, run at kTinyWorlds.
template <typename Case, typename Run>
void run_tiny_shards(const Recipe& r, const Run& run) {
  for (const Form& form : kTinyForms) {
    Case tiny;
    tiny.seq_len = 40;
    tiny.form = form;
    tiny.recipe = r;
    run(tiny, kTinyWorlds, Device::cpu());
  }
}

DType out_dtype(const Recipe& r) { return (r.mod == DType::kF32 && !r.upcast) ? DType::kF32 : r.x; }

// A modulation tensor's view: a grouped one's (a Mod) or an indexed table's
// (a host tensor) as it is; a gradient's view likewise.
template <typename Place>
TensorView mod_input(Place& at, const Mod& m) {
  return at.mod(m);
}
template <typename Place>
TensorView mod_input(Place& at, const HostTensor& table) {
  return at(table);
}
TensorView mod_grad(const TensorView& g, const Mod& m) { return grad_view(g, m); }
TensorView mod_grad(const TensorView& g, const HostTensor&) { return g; }

// ---------------------------------------------------------------- rmsnorm

struct NormCase {
  int64_t batch = 2, seq_len = 2100, hidden = 16;
  Form form;
  Recipe recipe;
  std::string name() const {
    return "rmsnorm B" + std::to_string(batch) + " S" + std::to_string(seq_len) + " H" + std::to_string(hidden) +
           " " + form.name() + " " + recipe.name();
  }
};

struct NormData {
  HostTensor x, weight, grad;
  Mod shift, scale;
  HostTensor out, rstd, dx, d_weight, d_shift, d_scale;
};

Parts<NormData> norm_parts(const NormCase& c) {
  using D = NormData;
  const bool token = c.form.frames == 0;
  Parts<D> p;
  p.rows = {&D::x, &D::grad};
  if (token) p.token_mods = {&D::shift, &D::scale};
  p.outputs = {{"out", &D::out, Part::kRows},
               {"rstd", &D::rstd, Part::kRows},
               {"dx", &D::dx, Part::kRows},
               {"d_weight", &D::d_weight, Part::kWhole},
               {"d_shift", &D::d_shift, mod_part(token)},
               {"d_scale", &D::d_scale, mod_part(token)}};
  return p;
}

// rmsnorm's call on a case's tensors (NormData or IndexedRecipeData), with
// `plan` (absent without an index).
template <typename Case, typename Place, typename Data>
RmsnormParams rmsnorm_call(const Case& c, Place& at, Data& t, const IndexPlan& plan) {
  RmsnormParams f;
  f.in.x = at(t.x);
  f.in.weight = at(t.weight);
  f.in.shift = mod_input(at, t.shift);
  f.in.scale = mod_input(at, t.scale);
  f.in.plan = plan;
  f.in.upcast = c.recipe.upcast;
  f.out = at.out(t.out);
  f.rstd = at.out(t.rstd);
  return f;
}

template <typename Place, typename Data>
RmsnormBackwardParams rmsnorm_backward_call(Place& at, Data& t, const RmsnormParams& f) {
  RmsnormBackwardParams b;
  b.in = f.in;
  b.rstd = f.rstd;
  b.grad = at(t.grad);
  b.dx = at.out(t.dx);
  b.d_weight = at.out(t.d_weight);
  b.d_shift = mod_grad(at.out(t.d_shift), t.shift);
  b.d_scale = mod_grad(at.out(t.d_scale), t.scale);
  return b;
}

void norm_ws1(const NormCase& c, NormData* d) {
  const int64_t frames = c.form.frames == 0 ? c.seq_len : c.form.frames;
  d->x = testing::random_tensor(c.recipe.x, {c.batch, c.seq_len, c.hidden}, 1);
  d->weight = testing::random_tensor(c.recipe.x, {c.hidden}, 2, 1.0, 0.1);
  d->shift = make_mod(c.recipe.mod, c.batch, frames, c.hidden, c.form.chunked && c.form.frames != 0, 0, 3, 0.0, 0.5);
  d->scale = make_mod(c.recipe.mod, c.batch, frames, c.hidden, c.form.chunked && c.form.frames != 0, 1, 4, 0.0, 0.5);
  if (c.form.frames == 0) d->shift.per_sample = d->scale.per_sample = false;
  const DType out = out_dtype(c.recipe);
  d->grad = testing::random_tensor(out, {c.batch, c.seq_len, c.hidden}, 5);
  d->out = HostTensor(out, {c.batch, c.seq_len, c.hidden});
  d->rstd = HostTensor(DType::kF32, {c.batch * c.seq_len});
  d->dx = HostTensor(c.recipe.x, {c.batch, c.seq_len, c.hidden});
  d->d_weight = HostTensor(c.recipe.x, {c.hidden});
  d->d_shift =
      c.form.frames == 0 ? HostTensor(c.recipe.mod, {c.batch, c.seq_len, c.hidden}) : grad_like(d->shift, c.recipe.mod);
  d->d_scale =
      c.form.frames == 0 ? HostTensor(c.recipe.mod, {c.batch, c.seq_len, c.hidden}) : grad_like(d->scale, DType::kF32);
  OnHost host;
  const RmsnormParams f = rmsnorm_call(c, host, *d, IndexPlan());
  DETDIT_ASSERT_OK(rmsnorm_forward(f));
  DETDIT_ASSERT_OK(rmsnorm_backward(rmsnorm_backward_call(host, *d, f)));
}

// One rank: the SP forward and backward of its rows, each output compared.
Status norm_rank(Communicator& comm, Device device, const NormCase& c, const NormData& d) {
  return run_rank(comm, device, c, d, norm_parts(c),
                  [&](OnDevice& dev, const SpPlan& sp, const IndexPlan&, NormData& t) {
    const RmsnormParams f = rmsnorm_call(c, dev, t, IndexPlan());
    DETDIT_RETURN_IF_ERROR(sp_rmsnorm_forward(sp, f, dev.stream()));
    return sp_rmsnorm_backward(comm, sp, rmsnorm_backward_call(dev, t, f), dev.stream());
  });
}

void run_norm_case(const NormCase& c, const std::vector<int>& worlds = kEveryWorld,
                   Device device = Device::cpu()) {
  using D = NormData;
  run_case(c, norm_ws1, norm_rank, worlds, device, {&D::out, &D::dx, &D::d_shift, &D::d_scale});
}

const Recipe kRecipes[] = {
    {DType::kBF16, DType::kBF16, false, false},
    {DType::kBF16, DType::kF32, false, false},
    {DType::kBF16, DType::kF32, true, false},
    {DType::kF32, DType::kF32, false, false},
};

TEST(SpForms, RmsnormEveryFormAndRecipeEveryWorldSize) {
  for (const Recipe& r : kRecipes) {
    for (Form form : kEveryForm) {
      NormCase c;
      c.form = form;
      c.recipe = r;
      run_norm_case(c);
    }
  }
}

TEST(SpForms, RmsnormOddSequencePerSampleAndTinyShards) {
  NormCase odd;
  odd.seq_len = 4097;
  odd.form = Form{1, true};
  run_norm_case(odd);
  // 5 positions per rank at world 8; frames of 10 and samples of 40 positions.
  run_tiny_shards<NormCase>(kRecipes[1], run_norm_case);
}

// ---------------------------------------------------------------- gate_residual

struct GateCase {
  int64_t batch = 2, seq_len = 2100, hidden = 16;
  Form form;
  Recipe recipe;
  bool gate = true;
  std::string name() const {
    return "gate_residual B" + std::to_string(batch) + " S" + std::to_string(seq_len) + " " +
           (gate ? form.name() : "no gate") + " " + recipe.name();
  }
};

struct GateData {
  HostTensor residual, y, grad;
  Mod gate;
  HostTensor out, d_residual, d_y, d_gate;
};

Parts<GateData> gate_parts(const GateCase& c) {
  using D = GateData;
  const bool token = c.form.frames == 0;
  Parts<D> p;
  p.rows = {&D::residual, &D::y, &D::grad};
  if (token) p.token_mods = {&D::gate};
  p.outputs = {{"out", &D::out, Part::kRows},
               {"d_residual", &D::d_residual, Part::kRows},
               {"d_y", &D::d_y, Part::kRows}};
  if (c.gate) p.outputs.push_back({"d_gate", &D::d_gate, mod_part(token)});
  return p;
}

template <typename Place>
GateResidualParams gate_forward(const GateCase& c, Place& at, GateData& t) {
  GateResidualParams f;
  f.in.residual = at(t.residual);
  f.in.y = at(t.y);
  f.in.gate = c.gate ? at.mod(t.gate) : TensorView();
  f.in.has_k = c.recipe.has_k;
  f.in.k = 1.0f;
  f.in.upcast = c.recipe.upcast;
  f.out = at.out(t.out);
  return f;
}

template <typename Place>
GateResidualBackwardParams gate_backward(const GateCase& c, Place& at, GateData& t, const GateResidualParams& f) {
  GateResidualBackwardParams b;
  b.in = f.in;
  b.grad = at(t.grad);
  b.d_residual = at.out(t.d_residual);
  b.d_y = at.out(t.d_y);
  b.d_gate = c.gate ? grad_view(at.out(t.d_gate), t.gate) : TensorView();
  return b;
}

void gate_ws1(const GateCase& c, GateData* d) {
  const int64_t frames = c.form.frames == 0 ? c.seq_len : c.form.frames;
  d->residual = testing::random_tensor(c.recipe.x, {c.batch, c.seq_len, c.hidden}, 21);
  d->y = testing::random_tensor(c.recipe.x, {c.batch, c.seq_len, c.hidden}, 22);
  d->gate = make_mod(c.recipe.mod, c.batch, frames, c.hidden, c.form.chunked && c.form.frames != 0, 2, 23, 0.0, 0.5);
  if (c.form.frames == 0) d->gate.per_sample = false;
  const DType out = c.gate ? out_dtype(c.recipe) : c.recipe.x;
  d->grad = testing::random_tensor(out, {c.batch, c.seq_len, c.hidden}, 24);
  d->out = HostTensor(out, {c.batch, c.seq_len, c.hidden});
  d->d_residual = HostTensor(c.recipe.x, {c.batch, c.seq_len, c.hidden});
  d->d_y = HostTensor(c.recipe.x, {c.batch, c.seq_len, c.hidden});
  d->d_gate =
      c.form.frames == 0 ? HostTensor(DType::kF32, {c.batch, c.seq_len, c.hidden}) : grad_like(d->gate, DType::kF32);
  OnHost host;
  const GateResidualParams f = gate_forward(c, host, *d);
  DETDIT_ASSERT_OK(gate_residual_forward(f));
  DETDIT_ASSERT_OK(gate_residual_backward(gate_backward(c, host, *d, f)));
}

Status gate_rank(Communicator& comm, Device device, const GateCase& c, const GateData& d) {
  return run_rank(comm, device, c, d, gate_parts(c),
                  [&](OnDevice& dev, const SpPlan& sp, const IndexPlan&, GateData& t) {
    const GateResidualParams f = gate_forward(c, dev, t);
    DETDIT_RETURN_IF_ERROR(sp_gate_residual_forward(sp, f, dev.stream()));
    return sp_gate_residual_backward(comm, sp, gate_backward(c, dev, t, f), dev.stream());
  });
}

void run_gate_case(const GateCase& c, const std::vector<int>& worlds = kEveryWorld,
                   Device device = Device::cpu()) {
  run_case(c, gate_ws1, gate_rank, worlds, device);
}

TEST(SpForms, GateResidualEveryFormAndRecipeEveryWorldSize) {
  for (Recipe r : kRecipes) {
    for (bool k : {false, true}) {
      r.has_k = k;
      for (Form form : kEveryForm) {
        GateCase c;
        c.form = form;
        c.recipe = r;
        run_gate_case(c);
      }
    }
  }
  GateCase plain;  // no gate: the plain residual add
  plain.gate = false;
  run_gate_case(plain);
}

TEST(SpForms, GateResidualOddSequenceAndTinyShards) {
  GateCase odd;
  odd.seq_len = 4097;
  odd.form = Form{1, true};
  run_gate_case(odd);
  run_tiny_shards<GateCase>(kRecipes[2], run_gate_case);
}


// ---------------------------------------------------------------- layernorm

struct LayernormCase {
  int64_t batch = 2, seq_len = 2100, hidden = 16;
  Form form;
  bool modulated = true;
  Recipe recipe;
  int affine = 2;  // 0: none, 1: weight, 2: weight and bias
  std::string name() const {
    return "layernorm B" + std::to_string(batch) + " S" + std::to_string(seq_len) + " " +
           (modulated ? form.name() : "plain") + " affine " + std::to_string(affine) + " " + recipe.name();
  }
};

struct LayernormData {
  HostTensor x, weight, bias, grad;
  Mod shift, scale;
  HostTensor out, mean, rstd, dx, d_weight, d_bias, d_shift, d_scale;
};

// layernorm's outputs (of an index-free or an indexed case: `affine`, `modulated`).
template <typename D>
std::vector<Output<D>> layernorm_outputs(int affine, bool modulated, Part mod) {
  std::vector<Output<D>> o = {{"out", &D::out, Part::kRows},
                              {"mean", &D::mean, Part::kRows},
                              {"rstd", &D::rstd, Part::kRows},
                              {"dx", &D::dx, Part::kRows}};
  if (affine >= 1) o.push_back({"d_weight", &D::d_weight, Part::kWhole});
  if (affine >= 2) o.push_back({"d_bias", &D::d_bias, Part::kWhole});
  if (modulated) {
    o.push_back({"d_shift", &D::d_shift, mod});
    o.push_back({"d_scale", &D::d_scale, mod});
  }
  return o;
}

Parts<LayernormData> layernorm_parts(const LayernormCase& c) {
  using D = LayernormData;
  const bool token = c.form.frames == 0;
  Parts<D> p;
  p.rows = {&D::x, &D::grad};
  if (token) p.token_mods = {&D::shift, &D::scale};
  p.outputs = layernorm_outputs<D>(c.affine, c.modulated, mod_part(token));
  return p;
}

// layernorm's call on a case's tensors (LayernormData or IndexedData), with
// `plan` (absent without an index) and eps (absent: the op's default).
template <typename Case, typename Place, typename Data>
LayernormParams layernorm_call(const Case& c, Place& at, Data& t, const IndexPlan& plan,
                               std::optional<float> eps) {
  LayernormParams f;
  f.in.x = at(t.x);
  f.in.weight = c.affine >= 1 ? at(t.weight) : TensorView();
  f.in.bias = c.affine >= 2 ? at(t.bias) : TensorView();
  f.in.shift = c.modulated ? mod_input(at, t.shift) : TensorView();
  f.in.scale = c.modulated ? mod_input(at, t.scale) : TensorView();
  f.in.plan = plan;
  if (eps) f.in.eps = *eps;
  f.in.upcast = c.recipe.upcast;
  f.out = at.out(t.out);
  f.mean = at.out(t.mean);
  f.rstd = at.out(t.rstd);
  return f;
}

template <typename Case, typename Place, typename Data>
LayernormBackwardParams layernorm_backward_call(const Case& c, Place& at, Data& t, const LayernormParams& f) {
  LayernormBackwardParams b;
  b.in = f.in;
  b.mean = f.mean;
  b.rstd = f.rstd;
  b.grad = at(t.grad);
  b.dx = at.out(t.dx);
  b.d_weight = c.affine >= 1 ? at.out(t.d_weight) : TensorView();
  b.d_bias = c.affine >= 2 ? at.out(t.d_bias) : TensorView();
  if (c.modulated) {
    b.d_shift = mod_grad(at.out(t.d_shift), t.shift);
    b.d_scale = mod_grad(at.out(t.d_scale), t.scale);
  }
  return b;
}

void layernorm_ws1(const LayernormCase& c, LayernormData* d) {
  const int64_t frames = c.form.frames == 0 ? c.seq_len : c.form.frames;
  const bool chunked = c.form.chunked && c.form.frames != 0;
  d->x = testing::random_tensor(c.recipe.x, {c.batch, c.seq_len, c.hidden}, 41, 0.5, 2.0);
  d->weight = testing::random_tensor(c.recipe.x, {c.hidden}, 42, 1.0, 0.1);
  d->bias = testing::random_tensor(c.recipe.x, {c.hidden}, 43, 0.0, 0.1);
  d->shift = make_mod(c.recipe.mod, c.batch, frames, c.hidden, chunked, 3, 44, 0.0, 0.5);
  d->scale = make_mod(c.recipe.mod, c.batch, frames, c.hidden, chunked, 4, 45, 0.0, 0.5);
  if (c.form.frames == 0) d->shift.per_sample = d->scale.per_sample = false;
  const DType out = c.modulated ? out_dtype(c.recipe) : c.recipe.x;
  d->grad = testing::random_tensor(out, {c.batch, c.seq_len, c.hidden}, 46);
  d->out = HostTensor(out, {c.batch, c.seq_len, c.hidden});
  d->mean = HostTensor(DType::kF32, {c.batch * c.seq_len});
  d->rstd = HostTensor(DType::kF32, {c.batch * c.seq_len});
  d->dx = HostTensor(c.recipe.x, {c.batch, c.seq_len, c.hidden});
  d->d_weight = HostTensor(DType::kF32, {c.hidden});
  d->d_bias = HostTensor(c.recipe.x, {c.hidden});
  const bool token = c.form.frames == 0;
  d->d_shift = token ? HostTensor(DType::kF32, {c.batch, c.seq_len, c.hidden}) : grad_like(d->shift, DType::kF32);
  d->d_scale = token ? HostTensor(c.recipe.mod, {c.batch, c.seq_len, c.hidden}) : grad_like(d->scale, c.recipe.mod);
  OnHost host;
  const LayernormParams f = layernorm_call(c, host, *d, IndexPlan(), 1e-6f);
  DETDIT_ASSERT_OK(layernorm_forward(f));
  DETDIT_ASSERT_OK(layernorm_backward(layernorm_backward_call(c, host, *d, f)));
}

Status layernorm_rank(Communicator& comm, Device device, const LayernormCase& c, const LayernormData& d) {
  return run_rank(comm, device, c, d, layernorm_parts(c),
                  [&](OnDevice& dev, const SpPlan& sp, const IndexPlan&, LayernormData& t) {
    const LayernormParams f = layernorm_call(c, dev, t, IndexPlan(), 1e-6f);
    DETDIT_RETURN_IF_ERROR(sp_layernorm_forward(sp, f, dev.stream()));
    return sp_layernorm_backward(comm, sp, layernorm_backward_call(c, dev, t, f), dev.stream());
  });
}

void run_layernorm_case(const LayernormCase& c, const std::vector<int>& worlds = kEveryWorld,
                        Device device = Device::cpu()) {
  run_case(c, layernorm_ws1, layernorm_rank, worlds, device);
}

TEST(SpForms, LayernormEveryFormRecipeAndAffineEveryWorldSize) {
  for (const Recipe& r : kRecipes) {
    for (Form form : {Form{1, true}, Form{3, true}, Form{7, false}, Form{0, false}}) {
      LayernormCase c;
      c.form = form;
      c.recipe = r;
      c.affine = form.frames == 3 ? 1 : form.frames == 7 ? 0 : 2;
      run_layernorm_case(c);
    }
  }
  for (int affine : {0, 1, 2}) {
    LayernormCase plain;
    plain.modulated = false;
    plain.affine = affine;
    run_layernorm_case(plain);
  }
}

TEST(SpForms, LayernormTinyShards) {
  run_tiny_shards<LayernormCase>(kRecipes[2], run_layernorm_case);
}



// ---------------------------------------------------------------- layernorm, indexed

// The (S,) row index of R rows: blocks of S/R positions (block) or a stride
// through the rows (interleaved), so chunks hold one or many segments.
HostTensor row_index(int64_t seq_len, int64_t rows, bool interleaved) {
  HostTensor index(DType::kI32, {seq_len});
  for (int64_t s = 0; s < seq_len; ++s)
    index.ptr<int32_t>()[s] = static_cast<int32_t>(interleaved ? (s * 7 / 3) % rows : s * rows / seq_len);
  return index;
}

struct IndexedCase {
  int64_t batch = 2, seq_len = 2100, hidden = 16, rows = 6;
  bool interleaved = false;
  Recipe recipe;
  int affine = 2;
  bool modulated = true;
  std::string name() const {
    return "layernorm indexed S" + std::to_string(seq_len) + (interleaved ? " interleaved" : " block") + " affine " +
           std::to_string(affine) + (modulated ? " " : " plain ") + recipe.name();
  }
};

struct IndexedData {
  HostTensor index, x, weight, bias, shift, scale, grad;
  HostTensor out, mean, rstd, dx, d_weight, d_bias, d_shift, d_scale;
};

Parts<IndexedData> indexed_parts(const IndexedCase& c) {
  using D = IndexedData;
  Parts<D> p;
  p.rows = {&D::x, &D::grad};
  p.outputs = layernorm_outputs<D>(c.affine, c.modulated, Part::kWhole);
  return p;
}

void indexed_ws1(const IndexedCase& c, IndexedData* d) {
  const std::vector<int64_t> rows = {c.batch, c.seq_len, c.hidden};
  d->index = row_index(c.seq_len, c.rows, c.interleaved);
  IndexPlan plan;
  DETDIT_ASSERT_OK(IndexPlan::from_row_index(d->index.view(), c.rows, c.batch, &plan));
  d->x = testing::random_tensor(c.recipe.x, rows, 61, 0.5, 2.0);
  d->weight = testing::random_tensor(c.recipe.x, {c.hidden}, 62, 1.0, 0.1);
  d->bias = testing::random_tensor(c.recipe.x, {c.hidden}, 63, 0.0, 0.1);
  d->shift = testing::random_tensor(c.recipe.mod, {c.rows, c.hidden}, 64, 0.0, 0.5);
  d->scale = testing::random_tensor(c.recipe.mod, {c.rows, c.hidden}, 65, 0.0, 0.5);
  const DType out = c.modulated ? out_dtype(c.recipe) : c.recipe.x;
  d->grad = testing::random_tensor(out, rows, 66);
  d->out = HostTensor(out, rows);
  d->mean = HostTensor(DType::kF32, {c.batch * c.seq_len});
  d->rstd = HostTensor(DType::kF32, {c.batch * c.seq_len});
  d->dx = HostTensor(c.recipe.x, rows);
  d->d_weight = HostTensor(c.recipe.x, {c.hidden});
  d->d_bias = HostTensor(DType::kF32, {c.hidden});
  d->d_shift = HostTensor(DType::kF32, {c.rows, c.hidden});
  d->d_scale = HostTensor(c.recipe.mod, {c.rows, c.hidden});
  OnHost host;
  const LayernormParams f = layernorm_call(c, host, *d, plan, std::nullopt);
  DETDIT_ASSERT_OK(layernorm_forward(f));
  DETDIT_ASSERT_OK(layernorm_backward(layernorm_backward_call(c, host, *d, f)));
}

Status indexed_rank(Communicator& comm, Device device, const IndexedCase& c, const IndexedData& d) {
  return run_rank(
      comm, device, c, d, indexed_parts(c),
      [&](OnDevice& dev, const SpPlan& sp, const IndexPlan& plan, IndexedData& t) {
        const LayernormParams f = layernorm_call(c, dev, t, plan, std::nullopt);
        DETDIT_RETURN_IF_ERROR(sp_layernorm_forward(sp, f, dev.stream()));
        return sp_layernorm_backward(comm, sp, layernorm_backward_call(c, dev, t, f), dev.stream());
      },
      &d.index, c.rows);
}

void run_indexed_case(const IndexedCase& c, const std::vector<int>& worlds = kEveryWorld,
                      Device device = Device::cpu()) {
  run_case(c, indexed_ws1, indexed_rank, worlds, device);
}

TEST(SpForms, LayernormIndexedEveryRecipeBothPackingsEveryWorldSize) {
  for (bool interleaved : {false, true}) {
    for (const Recipe& r : kRecipes) {
      IndexedCase c;
      c.interleaved = interleaved;
      c.recipe = r;
      c.affine = r.upcast ? 1 : 2;
      run_indexed_case(c);
    }
    IndexedCase plain;
    plain.interleaved = interleaved;
    plain.modulated = false;
    run_indexed_case(plain);
    IndexedCase tiny;  // 5 positions per rank at world 8: one chunk over every rank
    tiny.seq_len = 40;
    tiny.interleaved = interleaved;
    tiny.recipe = kRecipes[1];
    run_indexed_case(tiny, {3, 5, 8});
  }
  IndexedCase odd;
  odd.seq_len = 4097;
  odd.interleaved = true;
  run_indexed_case(odd);
}


// ---------------------------------------------------------------- rmsnorm and gate_residual, indexed recipes

// The indexed form beyond the H3 rule: an fp32 table of bf16 rows, upcast, k.
struct IndexedRecipeCase {
  int64_t batch = 2, seq_len = 2100, hidden = 16, rows = 6;
  bool interleaved = true;
  Recipe recipe;
  std::string name() const {
    return "indexed S" + std::to_string(seq_len) + (interleaved ? " interleaved " : " block ") + recipe.name();
  }
};

// rmsnorm of x, then gate_residual of residual x and y, over one plan.
struct IndexedRecipeData {
  HostTensor index, x, weight, shift, scale, grad, y, gate, gate_grad;
  HostTensor out, rstd, dx, d_weight, d_shift, d_scale, gate_out, d_residual, d_y, d_gate;
};

Parts<IndexedRecipeData> indexed_recipe_parts() {
  using D = IndexedRecipeData;
  Parts<D> p;
  p.rows = {&D::x, &D::grad, &D::y, &D::gate_grad};
  p.outputs = {{"out", &D::out, Part::kRows},
               {"rstd", &D::rstd, Part::kRows},
               {"dx", &D::dx, Part::kRows},
               {"gate_residual out", &D::gate_out, Part::kRows},
               {"d_residual", &D::d_residual, Part::kRows},
               {"d_y", &D::d_y, Part::kRows},
               {"d_weight", &D::d_weight, Part::kWhole},
               {"d_shift", &D::d_shift, Part::kWhole},
               {"d_scale", &D::d_scale, Part::kWhole},
               {"d_gate", &D::d_gate, Part::kWhole}};
  return p;
}

template <typename Place>
GateResidualParams indexed_gate_forward(const IndexedRecipeCase& c, Place& at, IndexedRecipeData& t,
                                        const IndexPlan& plan) {
  GateResidualParams g;
  g.in.residual = at(t.x);
  g.in.y = at(t.y);
  g.in.gate = at(t.gate);
  g.in.plan = plan;
  g.in.has_k = c.recipe.has_k;
  g.in.k = 1.0f;
  g.in.upcast = c.recipe.upcast;
  g.out = at.out(t.gate_out);
  return g;
}

template <typename Place>
GateResidualBackwardParams indexed_gate_backward(Place& at, IndexedRecipeData& t, const GateResidualParams& g) {
  GateResidualBackwardParams b;
  b.in = g.in;
  b.grad = at(t.gate_grad);
  b.d_residual = at.out(t.d_residual);
  b.d_y = at.out(t.d_y);
  b.d_gate = at.out(t.d_gate);
  return b;
}

void indexed_recipe_ws1(const IndexedRecipeCase& c, IndexedRecipeData* d) {
  const std::vector<int64_t> rows = {c.batch, c.seq_len, c.hidden};
  d->index = row_index(c.seq_len, c.rows, c.interleaved);
  IndexPlan plan;
  DETDIT_ASSERT_OK(IndexPlan::from_row_index(d->index.view(), c.rows, c.batch, &plan));
  const DType out = out_dtype(c.recipe);
  d->x = testing::random_tensor(c.recipe.x, rows, 71);
  d->weight = testing::random_tensor(c.recipe.x, {c.hidden}, 72, 1.0, 0.1);
  d->shift = testing::random_tensor(c.recipe.mod, {c.rows, c.hidden}, 73, 0.0, 0.5);
  d->scale = testing::random_tensor(c.recipe.mod, {c.rows, c.hidden}, 74, 0.0, 0.5);
  d->grad = testing::random_tensor(out, rows, 75);
  d->y = testing::random_tensor(c.recipe.x, rows, 76);
  d->gate = testing::random_tensor(c.recipe.mod, {c.rows, c.hidden}, 77, 0.0, 0.5);
  d->gate_grad = testing::random_tensor(out, rows, 78);
  d->out = HostTensor(out, rows);
  d->rstd = HostTensor(DType::kF32, {c.batch * c.seq_len});
  d->dx = HostTensor(c.recipe.x, rows);
  d->d_weight = HostTensor(DType::kF32, {c.hidden});
  d->d_shift = HostTensor(DType::kF32, {c.rows, c.hidden});
  d->d_scale = HostTensor(c.recipe.mod, {c.rows, c.hidden});
  d->gate_out = HostTensor(out, rows);
  d->d_residual = HostTensor(c.recipe.x, rows);
  d->d_y = HostTensor(c.recipe.x, rows);
  d->d_gate = HostTensor(DType::kF32, {c.rows, c.hidden});
  OnHost host;
  const RmsnormParams f = rmsnorm_call(c, host, *d, plan);
  DETDIT_ASSERT_OK(rmsnorm_forward(f));
  DETDIT_ASSERT_OK(rmsnorm_backward(rmsnorm_backward_call(host, *d, f)));
  const GateResidualParams g = indexed_gate_forward(c, host, *d, plan);
  DETDIT_ASSERT_OK(gate_residual_forward(g));
  DETDIT_ASSERT_OK(gate_residual_backward(indexed_gate_backward(host, *d, g)));
}

Status indexed_recipe_rank(Communicator& comm, Device device, const IndexedRecipeCase& c,
                           const IndexedRecipeData& d) {
  return run_rank(
      comm, device, c, d, indexed_recipe_parts(),
      [&](OnDevice& dev, const SpPlan& sp, const IndexPlan& plan, IndexedRecipeData& t) {
        const RmsnormParams f = rmsnorm_call(c, dev, t, plan);
        DETDIT_RETURN_IF_ERROR(sp_rmsnorm_forward(sp, f, dev.stream()));
        DETDIT_RETURN_IF_ERROR(sp_rmsnorm_backward(comm, sp, rmsnorm_backward_call(dev, t, f), dev.stream()));
        const GateResidualParams g = indexed_gate_forward(c, dev, t, plan);
        DETDIT_RETURN_IF_ERROR(sp_gate_residual_forward(sp, g, dev.stream()));
        return sp_gate_residual_backward(comm, sp, indexed_gate_backward(dev, t, g), dev.stream());
      },
      &d.index, c.rows);
}

void run_indexed_recipe_case(const IndexedRecipeCase& c, const std::vector<int>& worlds = kEveryWorld,
                             Device device = Device::cpu()) {
  run_case(c, indexed_recipe_ws1, indexed_recipe_rank, worlds, device);
}

TEST(SpForms, RmsnormAndGateResidualIndexedRecipesEveryWorldSize) {
  for (bool interleaved : {false, true}) {
    for (Recipe r : {kRecipes[1], kRecipes[2], kRecipes[3]}) {
      for (bool k : {false, true}) {
        r.has_k = k;
        IndexedRecipeCase c;
        c.interleaved = interleaved;
        c.recipe = r;
        run_indexed_recipe_case(c);
      }
    }
    IndexedRecipeCase tiny;
    tiny.seq_len = 40;
    tiny.interleaved = interleaved;
    tiny.recipe = kRecipes[2];
    run_indexed_recipe_case(tiny, {3, 5, 8});
  }
}

// ---------------------------------------------------------------- gate_residual_layernorm

struct FusedCase {
  int64_t batch = 2, seq_len = 2100, hidden = 16;
  Form form;
  bool modulated = true;
  Recipe recipe;
  std::string name() const {
    return "gate_residual_layernorm S" + std::to_string(seq_len) + " " + (modulated ? form.name() : "plain") + " " +
           recipe.name();
  }
};

struct FusedData {
  HostTensor residual, y, weight, bias, d_out, d_h;
  Mod gate, shift, scale;
  HostTensor h, out, mean, rstd, d_residual, d_y, d_gate, d_weight, d_bias, d_shift, d_scale;
};

Parts<FusedData> fused_parts(const FusedCase& c) {
  using D = FusedData;
  const bool token = c.form.frames == 0;
  Parts<D> p;
  p.rows = {&D::residual, &D::y, &D::d_out, &D::d_h};
  if (token) p.token_mods = {&D::gate, &D::shift, &D::scale};
  p.outputs = {{"h", &D::h, Part::kRows},
               {"out", &D::out, Part::kRows},
               {"mean", &D::mean, Part::kRows},
               {"rstd", &D::rstd, Part::kRows},
               {"d_residual", &D::d_residual, Part::kRows},
               {"d_y", &D::d_y, Part::kRows},
               {"d_weight", &D::d_weight, Part::kWhole},
               {"d_bias", &D::d_bias, Part::kWhole}};
  if (c.modulated) {
    for (const Output<D>& o : {Output<D>{"d_gate", &D::d_gate, mod_part(token)},
                               Output<D>{"d_shift", &D::d_shift, mod_part(token)},
                               Output<D>{"d_scale", &D::d_scale, mod_part(token)}})
      p.outputs.push_back(o);
  }
  return p;
}

template <typename Place>
GateResidualLayernormParams fused_forward(const FusedCase& c, Place& at, FusedData& t) {
  GateResidualLayernormParams f;
  f.in.residual = at(t.residual);
  f.in.y = at(t.y);
  f.in.gate = c.modulated ? at.mod(t.gate) : TensorView();
  f.in.weight = at(t.weight);
  f.in.bias = at(t.bias);
  f.in.shift = c.modulated ? at.mod(t.shift) : TensorView();
  f.in.scale = c.modulated ? at.mod(t.scale) : TensorView();
  f.in.has_k = c.recipe.has_k;
  f.in.k = 1.0f;
  f.in.eps = 1e-6f;
  f.in.upcast = c.recipe.upcast;
  f.h = at.out(t.h);
  f.out = at.out(t.out);
  f.mean = at.out(t.mean);
  f.rstd = at.out(t.rstd);
  return f;
}

template <typename Place>
GateResidualLayernormBackwardParams fused_backward(const FusedCase& c, Place& at, FusedData& t,
                                                   const GateResidualLayernormParams& f) {
  GateResidualLayernormBackwardParams b;
  b.in = f.in;
  b.h = f.h;
  b.mean = f.mean;
  b.rstd = f.rstd;
  b.d_out = at(t.d_out);
  b.d_h = at(t.d_h);
  b.d_residual = at.out(t.d_residual);
  b.d_y = at.out(t.d_y);
  b.d_weight = at.out(t.d_weight);
  b.d_bias = at.out(t.d_bias);
  if (c.modulated) {
    b.d_gate = grad_view(at.out(t.d_gate), t.gate);
    b.d_shift = grad_view(at.out(t.d_shift), t.shift);
    b.d_scale = grad_view(at.out(t.d_scale), t.scale);
  }
  return b;
}

void fused_ws1(const FusedCase& c, FusedData* d) {
  const int64_t frames = c.form.frames == 0 ? c.seq_len : c.form.frames;
  const bool chunked = c.form.chunked && c.form.frames != 0, token = c.form.frames == 0;
  const std::vector<int64_t> rows = {c.batch, c.seq_len, c.hidden};
  d->residual = testing::random_tensor(c.recipe.x, rows, 51);
  d->y = testing::random_tensor(c.recipe.x, rows, 52);
  const DType h = c.modulated ? out_dtype(c.recipe) : c.recipe.x;  // h's dtype, the norm's weight's
  d->weight = testing::random_tensor(h, {c.hidden}, 53, 1.0, 0.1);
  d->bias = testing::random_tensor(h, {c.hidden}, 54, 0.0, 0.1);
  d->gate = make_mod(c.recipe.mod, c.batch, frames, c.hidden, chunked, 2, 55, 0.0, 0.5);
  d->shift = make_mod(c.recipe.mod, c.batch, frames, c.hidden, chunked, 3, 56, 0.0, 0.5);
  d->scale = make_mod(c.recipe.mod, c.batch, frames, c.hidden, chunked, 4, 57, 0.0, 0.5);
  if (token) d->gate.per_sample = d->shift.per_sample = d->scale.per_sample = false;
  d->h = HostTensor(h, rows);
  d->out = HostTensor(h, rows);
  d->d_out = testing::random_tensor(h, rows, 58);
  d->d_h = testing::random_tensor(h, rows, 59);
  d->mean = HostTensor(DType::kF32, {c.batch * c.seq_len});
  d->rstd = HostTensor(DType::kF32, {c.batch * c.seq_len});
  d->d_residual = HostTensor(c.recipe.x, rows);
  d->d_y = HostTensor(c.recipe.x, rows);
  d->d_weight = HostTensor(DType::kF32, {c.hidden});
  d->d_bias = HostTensor(DType::kF32, {c.hidden});
  d->d_gate = token ? HostTensor(DType::kF32, rows) : grad_like(d->gate, DType::kF32);
  d->d_shift = token ? HostTensor(DType::kF32, rows) : grad_like(d->shift, DType::kF32);
  d->d_scale = token ? HostTensor(DType::kF32, rows) : grad_like(d->scale, DType::kF32);
  OnHost host;
  const GateResidualLayernormParams f = fused_forward(c, host, *d);
  DETDIT_ASSERT_OK(gate_residual_layernorm_forward(f));
  DETDIT_ASSERT_OK(gate_residual_layernorm_backward(fused_backward(c, host, *d, f)));
}

Status fused_rank(Communicator& comm, Device device, const FusedCase& c, const FusedData& d) {
  return run_rank(comm, device, c, d, fused_parts(c),
                  [&](OnDevice& dev, const SpPlan& sp, const IndexPlan&, FusedData& t) {
    const GateResidualLayernormParams f = fused_forward(c, dev, t);
    DETDIT_RETURN_IF_ERROR(sp_gate_residual_layernorm_forward(sp, f, dev.stream()));
    return sp_gate_residual_layernorm_backward(comm, sp, fused_backward(c, dev, t, f), dev.stream());
  });
}

void run_fused_case(const FusedCase& c, const std::vector<int>& worlds = kEveryWorld,
                    Device device = Device::cpu()) {
  run_case(c, fused_ws1, fused_rank, worlds, device);
}

TEST(SpForms, GateResidualLayernormEveryFormAndRecipeEveryWorldSize) {
  for (Recipe r : kRecipes) {
    r.has_k = r.upcast;
    for (Form form : {Form{1, true}, Form{3, true}, Form{7, false}, Form{0, false}}) {
      FusedCase c;
      c.form = form;
      c.recipe = r;
      run_fused_case(c);
    }
  }
  FusedCase plain;
  plain.modulated = false;
  run_fused_case(plain);
  FusedCase tiny;
  tiny.seq_len = 40;
  tiny.form = Form{4, true};
  run_fused_case(tiny, {3, 5, 8});
}


// ---------------------------------------------------------------- gate_residual_rmsnorm

// Every form beyond the H3 rule (and the H3 rule itself, indexed with the
// table in x's dtype): grouped (form) or indexed (a plan over `rows` table
// rows), with or without the gate, plain or modulated norm.
struct GrrCase {
  int64_t batch = 2, seq_len = 2100, hidden = 16, rows = 6;
  Form form;
  bool indexed = false, gate = true, modulated = true;
  Recipe recipe;
  std::string name() const {
    return "gate_residual_rmsnorm S" + std::to_string(seq_len) + " " + (indexed ? "indexed" : form.name()) +
           (gate ? "" : " no gate") + (modulated ? "" : " plain") + " " + recipe.name();
  }
  bool token() const { return !indexed && form.frames == 0; }
  DType h_dtype() const { return gate && recipe.mod == DType::kF32 && !recipe.upcast ? DType::kF32 : recipe.x; }
  DType out_dtype() const {
    return modulated && recipe.mod == DType::kF32 && !recipe.upcast ? DType::kF32 : h_dtype();
  }
};

struct GrrData {
  HostTensor index, residual, y, weight, d_out, d_h;
  Mod gate, shift, scale;  // grouped; indexed: (R, H) tables in storage
  HostTensor h, out, rstd, d_residual, d_y, d_gate, d_weight, d_shift, d_scale;
};

Parts<GrrData> grr_parts(const GrrCase& c) {
  using D = GrrData;
  Parts<D> p;
  p.rows = {&D::residual, &D::y, &D::d_out, &D::d_h};
  if (c.token()) p.token_mods = {&D::gate, &D::shift, &D::scale};
  p.outputs = {{"h", &D::h, Part::kRows},
               {"out", &D::out, Part::kRows},
               {"rstd", &D::rstd, Part::kRows},
               {"d_residual", &D::d_residual, Part::kRows},
               {"d_y", &D::d_y, Part::kRows},
               {"d_weight", &D::d_weight, Part::kWhole}};
  if (c.gate) p.outputs.push_back({"d_gate", &D::d_gate, mod_part(c.token())});
  if (c.modulated) {
    p.outputs.push_back({"d_shift", &D::d_shift, mod_part(c.token())});
    p.outputs.push_back({"d_scale", &D::d_scale, mod_part(c.token())});
  }
  return p;
}

// The tensors of one call (WS1's or one rank's, on its device).
struct GrrViews {
  TensorView residual, y, gate, weight, shift, scale, d_out, d_h;
  IndexPlan plan;
  TensorView h, out, rstd, d_residual, d_y, d_gate, d_weight, d_shift, d_scale;
};

template <typename Place>
GrrViews grr_views(const GrrCase& c, Place& at, GrrData& t, const IndexPlan& plan) {
  GrrViews v;
  v.plan = plan;
  for (auto [view, m] : {std::make_pair(&v.gate, &t.gate), std::make_pair(&v.shift, &t.shift),
                         std::make_pair(&v.scale, &t.scale)})
    *view = c.indexed ? at(m->storage) : at.mod(*m);
  v.residual = at(t.residual);
  v.y = at(t.y);
  v.weight = at(t.weight);
  v.d_out = at(t.d_out);
  v.d_h = at(t.d_h);
  v.h = at.out(t.h);
  v.out = at.out(t.out);
  v.rstd = at.out(t.rstd);
  v.d_residual = at.out(t.d_residual);
  v.d_y = at.out(t.d_y);
  v.d_weight = at.out(t.d_weight);
  if (c.gate) v.d_gate = grad_view(at.out(t.d_gate), t.gate);
  if (c.modulated) {
    v.d_shift = grad_view(at.out(t.d_shift), t.shift);
    v.d_scale = grad_view(at.out(t.d_scale), t.scale);
  }
  return v;
}

GateResidualRmsnormParams grr_forward(const GrrCase& c, const GrrViews& v) {
  GateResidualRmsnormParams f;
  f.in.residual = v.residual;
  f.in.y = v.y;
  f.in.gate = c.gate ? v.gate : TensorView();
  f.in.weight = v.weight;
  f.in.shift = c.modulated ? v.shift : TensorView();
  f.in.scale = c.modulated ? v.scale : TensorView();
  f.in.plan = v.plan;
  f.in.has_k = c.recipe.has_k;
  f.in.k = 1.0f;
  f.in.eps = 1e-6f;
  f.in.upcast = c.recipe.upcast;
  f.h = v.h;
  f.out = v.out;
  f.rstd = v.rstd;
  return f;
}

GateResidualRmsnormBackwardParams grr_backward(const GrrCase& c, const GrrViews& v) {
  GateResidualRmsnormBackwardParams b;
  b.in = grr_forward(c, v).in;
  b.h = v.h;
  b.rstd = v.rstd;
  b.d_out = v.d_out;
  b.d_h = v.d_h;
  b.d_residual = v.d_residual;
  b.d_y = v.d_y;
  b.d_weight = v.d_weight;
  b.d_gate = c.gate ? v.d_gate : TensorView();
  b.d_shift = c.modulated ? v.d_shift : TensorView();
  b.d_scale = c.modulated ? v.d_scale : TensorView();
  return b;
}

void grr_ws1(const GrrCase& c, GrrData* d) {
  const int64_t frames = c.form.frames == 0 ? c.seq_len : c.form.frames;
  const bool chunked = c.form.chunked && c.form.frames != 0;
  const std::vector<int64_t> rows = {c.batch, c.seq_len, c.hidden};
  d->residual = testing::random_tensor(c.recipe.x, rows, 81);
  d->y = testing::random_tensor(c.recipe.x, rows, 82);
  d->weight = testing::random_tensor(c.h_dtype(), {c.hidden}, 83, 1.0, 0.1);
  IndexPlan plan;
  if (c.indexed) {
    d->index = row_index(c.seq_len, c.rows, true);
    DETDIT_ASSERT_OK(IndexPlan::from_row_index(d->index.view(), c.rows, c.batch, &plan));
    for (auto [m, seed] : {std::make_pair(&d->gate, 84), std::make_pair(&d->shift, 85), std::make_pair(&d->scale, 86)})
      m->storage = testing::random_tensor(c.recipe.mod, {c.rows, c.hidden}, seed, 0.0, 0.5);
  } else {
    d->gate = make_mod(c.recipe.mod, c.batch, frames, c.hidden, chunked, 2, 84, 0.0, 0.5);
    d->shift = make_mod(c.recipe.mod, c.batch, frames, c.hidden, chunked, 3, 85, 0.0, 0.5);
    d->scale = make_mod(c.recipe.mod, c.batch, frames, c.hidden, chunked, 4, 86, 0.0, 0.5);
    if (c.token()) d->gate.per_sample = d->shift.per_sample = d->scale.per_sample = false;
  }
  d->d_out = testing::random_tensor(c.out_dtype(), rows, 87);
  d->d_h = testing::random_tensor(c.h_dtype(), rows, 88);
  d->h = HostTensor(c.h_dtype(), rows);
  d->out = HostTensor(c.out_dtype(), rows);
  d->rstd = HostTensor(DType::kF32, {c.batch * c.seq_len});
  d->d_residual = HostTensor(c.recipe.x, rows);
  d->d_y = HostTensor(c.recipe.x, rows);
  d->d_weight = HostTensor(DType::kF32, {c.hidden});
  auto grad_of = [&](const Mod& m) {
    if (c.indexed) return HostTensor(DType::kF32, {c.rows, c.hidden});
    return c.token() ? HostTensor(DType::kF32, rows) : grad_like(m, DType::kF32);
  };
  d->d_gate = grad_of(d->gate);
  d->d_shift = grad_of(d->shift);
  d->d_scale = grad_of(d->scale);
  OnHost host;
  const GrrViews v = grr_views(c, host, *d, plan);
  DETDIT_ASSERT_OK(gate_residual_rmsnorm_forward(grr_forward(c, v)));
  DETDIT_ASSERT_OK(gate_residual_rmsnorm_backward(grr_backward(c, v)));
}

// A refused call (the fail-closed tests): the SpPlan built without the
// index even for an indexed call, the forward run or not, then `corrupt`
// applied to this rank's views before the backward; *untouched: no gradient
// written.
struct GrrBreak {
  bool index_free_sp = false, forward = true;
  std::function<void(int rank, GrrViews*)> corrupt;
  bool* untouched = nullptr;
};

Status grr_rank(Communicator& comm, Device device, const GrrCase& c, const GrrData& d,
                const GrrBreak* broken = nullptr) {
  if (!broken) {
    return run_rank(
        comm, device, c, d, grr_parts(c),
        [&](OnDevice& dev, const SpPlan& sp, const IndexPlan& plan, GrrData& t) {
          const GrrViews v = grr_views(c, dev, t, plan);
          DETDIT_RETURN_IF_ERROR(sp_gate_residual_rmsnorm_forward(sp, grr_forward(c, v), dev.stream()));
          return sp_gate_residual_rmsnorm_backward(comm, sp, grr_backward(c, v), dev.stream());
        },
        c.indexed ? &d.index : nullptr, c.rows);
  }
  OnDevice dev(device);
  const Bounds bd = bounds(c.seq_len, comm.world_size(), comm.rank());
  IndexPlan plan;
  SpPlan sp;
  if (c.indexed)
    DETDIT_RETURN_IF_ERROR(IndexPlan::from_row_index(dev(d.index), c.rows, c.batch, &plan, dev.stream()));
  if (c.indexed && !broken->index_free_sp) {
    DETDIT_RETURN_IF_ERROR(SpPlan::create(plan, comm.world_size(), comm.rank(), &sp, dev.stream()));
  } else {
    DETDIT_RETURN_IF_ERROR(SpPlan::create(c.seq_len, c.batch, comm.world_size(), comm.rank(), &sp));
  }
  const Parts<GrrData> parts = grr_parts(c);
  GrrData o = rank_data(d, parts, c.batch, c.seq_len, bd);
  GrrViews v = grr_views(c, dev, o, plan);
  Status s;
  if (broken->forward) s = sp_gate_residual_rmsnorm_forward(sp, grr_forward(c, v), dev.stream());
  if (broken->corrupt) broken->corrupt(comm.rank(), &v);
  if (s.ok()) s = sp_gate_residual_rmsnorm_backward(comm, sp, grr_backward(c, v), dev.stream());
  dev.sync();
  // The gradients the call was given (those the case asks for).
  std::vector<const HostTensor*> grads = {&o.d_residual, &o.d_y, &o.d_weight};
  if (c.gate) grads.push_back(&o.d_gate);
  if (c.modulated) grads.insert(grads.end(), {&o.d_shift, &o.d_scale});
  *broken->untouched = true;
  for (const HostTensor* t : grads) *broken->untouched = *broken->untouched && testing::all_bytes_are(*t, kCanary);
  return s;
}

void run_grr_case(const GrrCase& c, const std::vector<int>& worlds = kEveryWorld,
                  Device device = Device::cpu()) {
  using D = GrrData;
  run_case(
      c, grr_ws1, [](Communicator& comm, Device dev, const GrrCase& gc, const GrrData& d) {
        return grr_rank(comm, dev, gc, d);
      },
      worlds, device, {&D::h, &D::out, &D::d_y, &D::d_weight});
}

TEST(SpForms, GateResidualRmsnormEveryFormAndRecipeEveryWorldSize) {
  for (Recipe r : kRecipes) {
    r.has_k = r.upcast;
    for (Form form : {Form{1, true}, Form{3, true}, Form{7, false}, Form{0, false}}) {
      GrrCase c;
      c.form = form;
      c.recipe = r;
      run_grr_case(c);
    }
  }
  GrrCase plain;  // no modulation at all
  plain.gate = plain.modulated = false;
  run_grr_case(plain);
  GrrCase no_gate;  // the plain residual add, a modulated norm
  no_gate.gate = false;
  no_gate.form = Form{3, true};
  no_gate.recipe = kRecipes[1];
  run_grr_case(no_gate);
  GrrCase tiny;
  tiny.seq_len = 40;
  tiny.form = Form{4, true};
  tiny.recipe = kRecipes[2];
  run_grr_case(tiny, {3, 5, 8});
}

// The indexed form: the H3 rule (table in x's dtype, today's route) and
// every recipe beyond it (fp32 table, upcast, k, no gate, a plain norm).
TEST(SpForms, GateResidualRmsnormIndexedEveryRecipeEveryWorldSize) {
  for (Recipe r : kRecipes) {
    for (bool k : {false, true}) {
      r.has_k = k;
      GrrCase c;
      c.indexed = true;
      c.recipe = r;
      run_grr_case(c);
    }
  }
  GrrCase no_gate;
  no_gate.indexed = true;
  no_gate.gate = false;
  no_gate.recipe = kRecipes[1];
  run_grr_case(no_gate);
  GrrCase plain_norm;
  plain_norm.indexed = true;
  plain_norm.modulated = false;
  plain_norm.recipe = kRecipes[1];
  run_grr_case(plain_norm);
  GrrCase tiny;
  tiny.indexed = true;
  tiny.seq_len = 40;
  tiny.recipe = kRecipes[2];
  run_grr_case(tiny, {3, 5, 8});
}


// A bad argument on one rank (rank 1's d_scale of 2 frames for F = 3, rank
// 2's d_weight of 8 columns for H = 16) fails the backward on every rank, nothing
// written; a call neither direction supports (a plan on an SpPlan built
// without the index) is refused by the forward and by the backward, on every
// rank, with the same error.
TEST(SpForms, GateResidualRmsnormRefusalsOnEveryRank) {
  GrrCase frames;
  frames.form = Form{3, true};
  GrrData fd;
  grr_ws1(frames, &fd);
  for (int world : {2, 5}) {
    testing::expect_every_rank_refused(world, ErrorKind::kValue, "d_scale", [&](Communicator& comm, bool* untouched) {
      GrrBreak b;
      b.corrupt = [&](int rank, GrrViews* v) {
        if (rank == 1) v->d_scale = TensorView::contiguous(v->d_scale.data, DType::kF32, {2, 2, 16}, v->d_scale.device);
      };
      b.untouched = untouched;
      return grr_rank(comm, Device::cpu(), frames, fd, &b);
    });
  }
  GrrCase indexed;
  indexed.indexed = true;
  indexed.recipe = kRecipes[1];
  GrrData id;
  grr_ws1(indexed, &id);
  testing::expect_every_rank_refused(3, ErrorKind::kValue, "d_weight", [&](Communicator& comm, bool* untouched) {
    GrrBreak b;
    b.corrupt = [&](int rank, GrrViews* v) {
      if (rank == 2) v->d_weight = v->d_weight.narrow(0, 0, 8);
    };
    b.untouched = untouched;
    return grr_rank(comm, Device::cpu(), indexed, id, &b);
  });
  for (bool forward : {true, false}) {
    testing::expect_every_rank_refused(2, ErrorKind::kValue, "plan must be absent",
                                       [&](Communicator& comm, bool* untouched) {
      GrrBreak b;
      b.index_free_sp = true;
      b.forward = forward;
      b.untouched = untouched;
      return grr_rank(comm, Device::cpu(), indexed, id, &b);
    });
  }
}

// ---------------------------------------------------------------- CUDA: ranks sharing one GPU

// The portable profile gives the same bytes on the CPU and every CUDA GPU, so
// WS1 is the CPU's; every rank runs on cuda:0 with its own stream.
TEST(SpFormsCuda, EveryOpRanksSharingOneGpuMatchWs1) {
  DETDIT_SKIP_WITHOUT_CUDA();
  const Device gpu = Device::cuda(0);
  for (Form form : {Form{1, true}, Form{3, true}, Form{7, false}, Form{0, false}}) {
    for (const Recipe& r : {kRecipes[0], kRecipes[1], kRecipes[2]}) {
      NormCase n;
      n.form = form;
      n.recipe = r;
      run_norm_case(n, {1, 2, 3, 5, 8}, gpu);
      GateCase g;
      g.form = form;
      g.recipe = r;
      g.recipe.has_k = r.upcast;
      run_gate_case(g, {1, 2, 3, 5, 8}, gpu);
      LayernormCase l;
      l.form = form;
      l.recipe = r;
      run_layernorm_case(l, {1, 2, 3, 5, 8}, gpu);
      FusedCase f;
      f.form = form;
      f.recipe = r;
      run_fused_case(f, {1, 2, 3, 5, 8}, gpu);
      GrrCase grr;
      grr.form = form;
      grr.recipe = r;
      grr.recipe.has_k = r.upcast;
      run_grr_case(grr, {1, 2, 3, 5, 8}, gpu);
    }
  }
  NormCase tiny;
  tiny.seq_len = 40;
  tiny.form = Form{4, true};
  run_norm_case(tiny, {3, 8}, gpu);
  for (bool interleaved : {false, true}) {
    IndexedCase indexed;
    indexed.interleaved = interleaved;
    indexed.recipe = kRecipes[1];
    run_indexed_case(indexed, {1, 2, 3, 5, 8}, gpu);
    IndexedRecipeCase recipe;
    recipe.interleaved = interleaved;
    recipe.recipe = kRecipes[2];
    recipe.recipe.has_k = true;
    run_indexed_recipe_case(recipe, {1, 2, 3, 5, 8}, gpu);
  }
  for (const Recipe& r : {kRecipes[0], kRecipes[2]}) {
    GrrCase grr;  // indexed: the H3 rule's route and an upcast one
    grr.indexed = true;
    grr.recipe = r;
    run_grr_case(grr, {1, 2, 3, 5, 8}, gpu);
  }
}

// ---------------------------------------------------------------- fail closed

// A bad argument on one rank fails the call on every rank, before anything is written.
TEST(SpForms, BadArgumentOnOneRankFailsEveryRankAndWritesNothing) {
  const int64_t batch = 2, seq_len = 2100, hidden = 16;
  const Mod gate = make_mod(DType::kBF16, batch, 3, hidden, true, 2, 31, 0.0, 0.5);
  for (int world : {2, 5}) {
    // Rank 1's d_gate has the wrong shape (B, 2, H) for a gate of F = 3 frames.
    testing::expect_every_rank_refused(world, ErrorKind::kValue, "d_gate", [&](Communicator& comm, bool* untouched) {
      const Bounds bd = bounds(seq_len, comm.world_size(), comm.rank());
      SpPlan sp;
      DETDIT_RETURN_IF_ERROR(SpPlan::create(seq_len, batch, comm.world_size(), comm.rank(), &sp));
      const int64_t local = bd.hi - bd.lo;
      HostTensor y = testing::random_tensor(DType::kBF16, {batch, local, hidden}, 32);
      HostTensor grad = testing::random_tensor(DType::kBF16, {batch, local, hidden}, 33);
      HostTensor d_y(DType::kBF16, {batch, local, hidden});
      HostTensor d_gate(DType::kF32, {batch, comm.rank() == 1 ? 2 : 3, hidden});
      d_y.fill_bytes(kCanary);
      d_gate.fill_bytes(kCanary);
      GateResidualBackwardParams b;
      b.in.y = y.view();
      b.in.gate = gate.view();
      b.grad = grad.view();
      b.d_y = d_y.view();
      b.d_gate = d_gate.view();
      const Status s = sp_gate_residual_backward(comm, sp, b);
      *untouched = testing::all_bytes_are(d_y, kCanary) && testing::all_bytes_are(d_gate, kCanary);
      return s;
    });
  }
  // A per-frame F that does not divide S, on every rank: the same ValueError everywhere.
  testing::expect_every_rank_refused(3, ErrorKind::kValue, "must divide S = 2100",
                                     [&](Communicator& comm, bool* untouched) {
    const Bounds bd = bounds(seq_len, comm.world_size(), comm.rank());
    SpPlan sp;
    DETDIT_RETURN_IF_ERROR(SpPlan::create(seq_len, batch, comm.world_size(), comm.rank(), &sp));
    const Mod bad = make_mod(DType::kBF16, batch, 11, hidden, false, 0, 34, 0.0, 0.5);
    HostTensor x = testing::random_tensor(DType::kBF16, {batch, bd.hi - bd.lo, hidden}, 35);
    HostTensor weight = testing::random_tensor(DType::kBF16, {hidden}, 36);
    HostTensor grad = testing::random_tensor(DType::kBF16, x.shape(), 37);
    HostTensor rstd = testing::random_tensor(DType::kF32, {x.numel() / hidden}, 38);
    HostTensor dx(DType::kBF16, x.shape()), d_weight(DType::kBF16, {hidden});
    dx.fill_bytes(kCanary);
    d_weight.fill_bytes(kCanary);
    RmsnormBackwardParams b;
    b.in.x = x.view();
    b.in.weight = weight.view();
    b.in.shift = bad.view();
    b.in.scale = bad.view();
    b.rstd = rstd.view();
    b.grad = grad.view();
    b.dx = dx.view();
    b.d_weight = d_weight.view();
    const Status s = sp_rmsnorm_backward(comm, sp, b);
    *untouched = testing::all_bytes_are(dx, kCanary) && testing::all_bytes_are(d_weight, kCanary);
    return s;
  });
}


// ---------------------------------------------------------------- MPI: ranks as processes

// Each process computes WS1 itself (the inputs are seeded) and runs its rank.
TEST(DISABLED_MpiSpFormsWorker, EveryOpMatchesWs1) {
  std::unique_ptr<Communicator> comm;
  DETDIT_ASSERT_OK(create_mpi_communicator(&comm));
  for (Form form : {Form{1, true}, Form{3, true}, Form{0, false}}) {
    NormCase n;
    n.form = form;
    n.recipe = kRecipes[1];
    NormData nd;
    norm_ws1(n, &nd);
    DETDIT_EXPECT_OK(norm_rank(*comm, Device::cpu(), n, nd));
    GateCase g;
    g.form = form;
    g.recipe = kRecipes[2];
    g.recipe.has_k = true;
    GateData gd;
    gate_ws1(g, &gd);
    DETDIT_EXPECT_OK(gate_rank(*comm, Device::cpu(), g, gd));
    LayernormCase l;
    l.form = form;
    l.recipe = kRecipes[0];
    LayernormData ld;
    layernorm_ws1(l, &ld);
    DETDIT_EXPECT_OK(layernorm_rank(*comm, Device::cpu(), l, ld));
    FusedCase f;
    f.form = form;
    f.recipe = kRecipes[1];
    FusedData fd;
    fused_ws1(f, &fd);
    DETDIT_EXPECT_OK(fused_rank(*comm, Device::cpu(), f, fd));
    GrrCase r;
    r.form = form;
    r.recipe = kRecipes[2];
    r.recipe.has_k = true;
    GrrData rd;
    grr_ws1(r, &rd);
    DETDIT_EXPECT_OK(grr_rank(*comm, Device::cpu(), r, rd));
  }
  GrrCase indexed;  // beyond the H3 rule: an fp32 table
  indexed.indexed = true;
  indexed.recipe = kRecipes[1];
  GrrData id;
  grr_ws1(indexed, &id);
  DETDIT_EXPECT_OK(grr_rank(*comm, Device::cpu(), indexed, id));
}

// A bad d_gate on rank 1 only: every process refused, nothing written.
TEST(DISABLED_MpiSpFormsWorker, BadArgumentOnOneRankFailsEveryRank) {
  std::unique_ptr<Communicator> comm;
  DETDIT_ASSERT_OK(create_mpi_communicator(&comm));
  const int64_t batch = 2, seq_len = 2100, hidden = 16;
  const Bounds bd = bounds(seq_len, comm->world_size(), comm->rank());
  SpPlan sp;
  DETDIT_ASSERT_OK(SpPlan::create(seq_len, batch, comm->world_size(), comm->rank(), &sp));
  const Mod gate = make_mod(DType::kBF16, batch, 3, hidden, true, 2, 31, 0.0, 0.5);
  const int64_t local = bd.hi - bd.lo;
  HostTensor y = testing::random_tensor(DType::kBF16, {batch, local, hidden}, 32);
  HostTensor grad = testing::random_tensor(DType::kBF16, {batch, local, hidden}, 33);
  HostTensor d_y(DType::kBF16, {batch, local, hidden});
  HostTensor d_gate(DType::kF32, {batch, comm->rank() == 1 ? 2 : 3, hidden});
  d_y.fill_bytes(kCanary);
  d_gate.fill_bytes(kCanary);
  GateResidualBackwardParams b;
  b.in.y = y.view();
  b.in.gate = gate.view();
  b.grad = grad.view();
  b.d_y = d_y.view();
  b.d_gate = d_gate.view();
  EXPECT_TRUE(testing::refused(sp_gate_residual_backward(*comm, sp, b), ErrorKind::kValue, "d_gate"));
  EXPECT_TRUE(testing::all_bytes_are(d_y, kCanary));
  EXPECT_TRUE(testing::all_bytes_are(d_gate, kCanary));
}

TEST(SpFormsMpi, RanksAsProcessesMatchWs1) {
#if defined(DETDIT_WITH_MPI)
  for (int ranks : {2, 3, 4}) EXPECT_TRUE(testing::run_under_mpi(ranks, "DISABLED_MpiSpFormsWorker.EveryOpMatchesWs1"));
#else
  GTEST_SKIP() << "built without MPI";
#endif
}

TEST(SpFormsMpi, BadArgumentOnOneRankFailsEveryRank) {
#if defined(DETDIT_WITH_MPI)
  // A hang is a failure after a minute, not CI's clock.
  for (int ranks : {2, 3})
    EXPECT_TRUE(testing::run_under_mpi(ranks, "DISABLED_MpiSpFormsWorker.BadArgumentOnOneRankFailsEveryRank",
                                       /*timeout_s=*/60));
#else
  GTEST_SKIP() << "built without MPI";
#endif
}

}  // namespace
}  // namespace detdit
