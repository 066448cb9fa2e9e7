// torch_parity_main (tests/cuda/tools/): runs one detdit op in the torch profile on raw files, for
// scripts/torch_parity.py (which makes the inputs with PyTorch on the GPU and
// compares detdit's output bytes with PyTorch eager's).
//
//   torch_parity_main sinusoid  T C FLIP SHIFT SCALE TMAX  t.f32 out.f32   (FLIP 0 or 1)
//   torch_parity_main rmsnorm   DT M N           x w out
//   torch_parity_main modulated DT B S N R       x w shift scale index.i64 out
//   torch_parity_main gate      DT B S N R       res y gate index.i64 out
//   torch_parity_main silu_cast T D              temb.f32 act.bf16
//   torch_parity_main gather    DT S R H         rows index.i64 out
//   torch_parity_main layernorm DT M N           x w|- b|- grad out mean.f32 rstd.f32 dx  (eps 1e-6)
//   torch_parity_main layernorm_forms DT MT UP B S F N   x shift scale out
//   torch_parity_main gate_forms      DT MT UP B S F N   res y gate out
//   torch_parity_main region          DT MT UP B S F N   res y gate shift scale h out
// The forms' commands: x, res, y (B, S, N) in DT; shift, scale, gate (B, F, N)
// in MT (F = 1 per sample, 1 < F < S per frame, F = S per token); UP is 0 or 1
// (upcast); the norm has no affine and eps 1e-6 (SD3, Flux, Wan); out and h
// have the ops' output dtypes (modulation.h modulated_out_dtype). region is
// gate_residual_layernorm.
// DT is f32, bf16 or f16; files are raw little-endian, contiguous. Exit 0 on
// success; any Status error or I/O failure prints it and exits 1.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "detdit/adaln.h"
#include "detdit/gate_residual.h"
#include "detdit/gate_residual_layernorm.h"
#include "detdit/layernorm.h"
#include "detdit/modulation.h"
#include "detdit/plan.h"
#include "detdit/rmsnorm.h"
#include "detdit/timestep.h"

namespace {

using namespace detdit;

[[noreturn]] void fail(const std::string& message) {
  std::fprintf(stderr, "torch_parity_main: %s\n", message.c_str());
  std::exit(1);
}

void ok(const Status& s) {
  if (!s.ok()) fail(s.to_string());
}

DType parse_dtype(const std::string& name) {
  if (name == "f32") return DType::kF32;
  if (name == "bf16") return DType::kBF16;
  if (name == "f16") return DType::kF16;
  fail("unknown dtype " + name);
}

// A contiguous device tensor, optionally read from a raw file of exactly its size.
struct Buffer {
  void* data = nullptr;
  TensorView view;
  Buffer(DType dtype, std::initializer_list<int64_t> shape, const char* path = nullptr) {
    view = TensorView::contiguous(nullptr, dtype, shape, Device::cuda(0));
    if (cudaMalloc(&data, view.nbytes() > 0 ? view.nbytes() : 16) != cudaSuccess) fail("cudaMalloc failed");
    view.data = data;
    if (!path) return;
    std::ifstream in(path, std::ios::binary);
    std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (bytes.size() != view.nbytes())
      fail(std::string(path) + ": expected " + std::to_string(view.nbytes()) + " bytes, got " +
           std::to_string(bytes.size()));
    if (cudaMemcpy(data, bytes.data(), bytes.size(), cudaMemcpyHostToDevice) != cudaSuccess) fail("upload failed");
  }
  ~Buffer() { cudaFree(data); }
  void save(const char* path) const {
    std::vector<char> bytes(view.nbytes());
    if (cudaDeviceSynchronize() != cudaSuccess ||
        cudaMemcpy(bytes.data(), data, bytes.size(), cudaMemcpyDeviceToHost) != cudaSuccess)
      fail(std::string("download failed: ") + cudaGetErrorString(cudaGetLastError()));
    std::ofstream out(path, std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out) fail(std::string("cannot write ") + path);
  }
};

IndexPlan plan_of(const Buffer& index, int64_t rows, int64_t batch) {
  IndexPlan plan;
  ok(IndexPlan::from_row_index(index.view, rows, batch, &plan));
  return plan;
}

int64_t arg(char** argv, int i) { return std::stoll(argv[i]); }

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) fail("usage: see the header of tests/cuda/tools/torch_parity_main.cc");
  const std::string op = argv[1];
  auto need = [&](int count) {
    if (argc != count) fail(op + ": expected " + std::to_string(count - 2) + " arguments");
  };
  if (op == "sinusoid") {
    need(10);
    const int64_t count = arg(argv, 2), channels = arg(argv, 3);
    Buffer t(DType::kF32, {count}, argv[8]), out(DType::kF32, {count, channels});
    TimestepSinusoidParams p{{t.view, 10000.0f, Numerics::kTorch}, out.view};
    p.in.flip_sin_to_cos = arg(argv, 4) != 0;
    p.in.downscale_freq_shift = std::stof(argv[5]);
    p.in.scale = std::stof(argv[6]);
    p.in.t_max = std::stof(argv[7]);
    ok(timestep_sinusoid_forward(p));
    out.save(argv[9]);
  } else if (op == "rmsnorm") {
    need(8);
    const DType dt = parse_dtype(argv[2]);
    const int64_t rows = arg(argv, 3), hidden = arg(argv, 4);
    Buffer x(dt, {rows, hidden}, argv[5]), w(dt, {hidden}, argv[6]), out(dt, {rows, hidden});
    RmsnormParams p;
    p.in.x = x.view, p.in.weight = w.view, p.out = out.view, p.in.numerics = Numerics::kTorch;
    ok(rmsnorm_forward(p));
    out.save(argv[7]);
  } else if (op == "modulated" || op == "gate") {
    need(op == "modulated" ? 13 : 12);
    const DType dt = parse_dtype(argv[2]);
    const int64_t batch = arg(argv, 3), seq = arg(argv, 4), hidden = arg(argv, 5), rows = arg(argv, 6);
    Buffer a(dt, {batch * seq, hidden}, argv[7]);
    if (op == "modulated") {
      Buffer w(dt, {hidden}, argv[8]), shift(dt, {rows, hidden}, argv[9]), scale(dt, {rows, hidden}, argv[10]);
      Buffer index(DType::kI64, {seq}, argv[11]), out(dt, {batch * seq, hidden});
      RmsnormParams p;
      p.in.x = a.view, p.in.weight = w.view, p.in.shift = shift.view, p.in.scale = scale.view;
      p.in.plan = plan_of(index, rows, batch), p.out = out.view, p.in.numerics = Numerics::kTorch;
      ok(rmsnorm_forward(p));
      out.save(argv[12]);
    } else {
      Buffer y(dt, {batch * seq, hidden}, argv[8]), gate(dt, {rows, hidden}, argv[9]);
      Buffer index(DType::kI64, {seq}, argv[10]), out(dt, {batch * seq, hidden});
      ok(gate_residual_forward(GateResidualParams{{a.view, y.view, gate.view, plan_of(index, rows, batch)}, out.view}));
      out.save(argv[11]);
    }
  } else if (op == "silu_cast") {
    need(6);
    // act = bf16(silu(temb)) is the saved act of adaln_projection (its weight
    // is a placeholder here: only act is compared).
    const int64_t rows = arg(argv, 2), dim = arg(argv, 3);
    Buffer temb(DType::kF32, {rows, dim}, argv[4]), act(DType::kBF16, {rows, dim});
    Buffer w(DType::kBF16, {18, dim}), b(DType::kBF16, {18}), table(DType::kBF16, {rows, 18});
    cudaMemset(w.data, 0, w.view.nbytes());
    cudaMemset(b.data, 0, b.view.nbytes());
    ok(adaln_projection_forward(
        AdalnProjectionParams{{temb.view, w.view, b.view, Numerics::kTorch}, table.view, act.view}));
    act.save(argv[5]);
  } else if (op == "gather") {
    need(9);
    const DType dt = parse_dtype(argv[2]);
    const int64_t seq = arg(argv, 3), rows = arg(argv, 4), hidden = arg(argv, 5);
    Buffer table(dt, {rows, 6 * hidden}, argv[6]), index(DType::kI64, {seq}, argv[7]);
    Buffer out(dt, {6, seq, hidden});
    ok(adaln_row_gather_forward(AdalnRowGatherParams{table.view, plan_of(index, rows, 1), out.view}));
    out.save(argv[8]);
  } else if (op == "layernorm") {
    need(13);
    const DType dt = parse_dtype(argv[2]);
    const int64_t rows = arg(argv, 3), hidden = arg(argv, 4);
    const bool has_w = std::string(argv[6]) != "-", has_b = std::string(argv[7]) != "-";
    Buffer x(dt, {rows, hidden}, argv[5]), w(dt, {hidden}, has_w ? argv[6] : nullptr);
    Buffer b(dt, {hidden}, has_b ? argv[7] : nullptr), grad(dt, {rows, hidden}, argv[8]);
    Buffer out(dt, {rows, hidden}), mean(DType::kF32, {rows}), rstd(DType::kF32, {rows}), dx(dt, {rows, hidden});
    LayernormInputs in;
    in.x = x.view, in.eps = 1e-6f, in.numerics = Numerics::kTorch;
    if (has_w) in.weight = w.view;
    if (has_b) in.bias = b.view;
    ok(layernorm_forward(LayernormParams{in, out.view, mean.view, rstd.view}));
    ok(layernorm_backward(LayernormBackwardParams{in, mean.view, rstd.view, grad.view, dx.view, TensorView(), TensorView()}));
    out.save(argv[9]);
    mean.save(argv[10]);
    rstd.save(argv[11]);
    dx.save(argv[12]);
  } else if (op == "layernorm_forms" || op == "gate_forms" || op == "region") {
    const int extra = op == "layernorm_forms" ? 4 : op == "gate_forms" ? 4 : 7;
    need(9 + extra);
    const DType dt = parse_dtype(argv[2]), mt = parse_dtype(argv[3]);
    const bool upcast = std::string(argv[4]) == "1";
    const int64_t batch = arg(argv, 5), seq = arg(argv, 6), frames = arg(argv, 7), hidden = arg(argv, 8);
    // The promoted dtype of an op on dt activations and mt modulation.
    const DType out_dt = upcast ? dt : mt;
    Buffer a(dt, {batch, seq, hidden}, argv[9]);
    if (op == "layernorm_forms") {
      Buffer shift(mt, {batch, frames, hidden}, argv[10]), scale(mt, {batch, frames, hidden}, argv[11]);
      Buffer out(out_dt, {batch, seq, hidden});
      LayernormInputs in;
      in.x = a.view, in.shift = shift.view, in.scale = scale.view, in.eps = 1e-6f;
      in.numerics = Numerics::kTorch, in.upcast = upcast;
      ok(layernorm_forward(LayernormParams{in, out.view, TensorView(), TensorView()}));
      out.save(argv[12]);
    } else if (op == "gate_forms") {
      Buffer y(dt, {batch, seq, hidden}, argv[10]), gate(mt, {batch, frames, hidden}, argv[11]);
      Buffer out(out_dt, {batch, seq, hidden});
      GateResidualInputs in{a.view, y.view, gate.view, IndexPlan(), false, 0.0f, upcast};
      ok(gate_residual_forward(GateResidualParams{in, out.view}));
      out.save(argv[12]);
    } else {
      Buffer y(dt, {batch, seq, hidden}, argv[10]), gate(mt, {batch, frames, hidden}, argv[11]);
      Buffer shift(mt, {batch, frames, hidden}, argv[12]), scale(mt, {batch, frames, hidden}, argv[13]);
      Buffer h(out_dt, {batch, seq, hidden}), out(out_dt, {batch, seq, hidden});
      GateResidualLayernormInputs in;
      in.residual = a.view, in.y = y.view, in.gate = gate.view, in.shift = shift.view, in.scale = scale.view;
      in.eps = 1e-6f, in.numerics = Numerics::kTorch, in.upcast = upcast;
      ok(gate_residual_layernorm_forward(GateResidualLayernormParams{in, h.view, out.view, TensorView(), TensorView()}));
      h.save(argv[14]);
      out.save(argv[15]);
    }
  } else {
    fail("unknown op " + op);
  }
  return 0;
}
