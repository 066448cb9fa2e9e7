// bench_main: first timing table of the CUDA ops at the H3 shapes (forward and
// backward): median of CUDA-event timings after warm-up, the bytes each op
// must move at least (each input read once, each output written once), GB/s
// and the percentage of a device-to-device copy measured in the same run.
// Prints a markdown table (docs/benchmarking.md). Not a test; run by
// `gpu_check.sh bench` beside `detdit bench` and scripts/torch_bench.py; the
// before/after kernel tables of docs/benchmarking.md come from it.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "common/scalar_math.h"
#include "detdit/adaln.h"
#include "detdit/gate_residual.h"
#include "detdit/linear.h"
#include "detdit/plan.h"
#include "detdit/rmsnorm.h"
#include "detdit/timestep.h"

namespace {

using namespace detdit;

constexpr int kWarmup = 3, kRepeats = 20;
constexpr int64_t kHidden = 5376, kTimeDim = 2688, kFreq = 256;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}
void check(const Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.to_string().c_str());
    std::exit(1);
  }
}

// Pseudo-random values in [-2, 2) (never zeros: zeros can time faster).
__global__ void fill_kernel(void* data, DType dtype, int64_t count, uint32_t seed, float offset) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
  h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
  const float v = num::add32(offset, num::mul32(static_cast<float>(h & 0xFFFFu), 6.103515625e-05f) - 2.0f);
  if (dtype == DType::kF32) static_cast<float*>(data)[i] = v;
  else static_cast<uint16_t*>(data)[i] = num::float_to_bf16(v);
}

struct Tensor {
  TensorView view;
  Tensor(DType dtype, std::initializer_list<int64_t> shape, uint32_t seed = 1, float offset = 0.0f) {
    view = TensorView::contiguous(nullptr, dtype, shape, Device::cuda(0));
    check(cudaMalloc(&view.data, view.nbytes()), "cudaMalloc");
    const int64_t n = view.numel();
    fill_kernel<<<static_cast<unsigned>((n + 255) / 256), 256>>>(view.data, dtype, n, seed, offset);
    check(cudaGetLastError(), "fill");
  }
  ~Tensor() { cudaFree(view.data); }
  double bytes() const { return static_cast<double>(view.nbytes()); }
};

float median_ms(cudaStream_t stream, const std::function<void()>& run) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start), cudaEventCreate(&stop);
  for (int i = 0; i < kWarmup; ++i) run();
  std::vector<float> times;
  for (int i = 0; i < kRepeats; ++i) {
    cudaEventRecord(start, stream);
    run();
    cudaEventRecord(stop, stream);
    check(cudaEventSynchronize(stop), "event");
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    times.push_back(ms);
  }
  cudaEventDestroy(start), cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

double copy_gbps = 0;
void row(const char* op, const char* shape, float ms, double bytes) {
  const double gbps = bytes / (ms * 1e-3) / 1e9;
  std::printf("| %s | %s | %.1f | %.1f | %.0f | %.0f %% |\n", op, shape, ms * 1e3, bytes / 1e6, gbps,
              100.0 * gbps / copy_gbps);
}

IndexPlan block_plan(int64_t seq_len, int64_t timesteps, int64_t batch, cudaStream_t stream) {
  // T contiguous runs; in each the first 5 % text, the last 15 % audio, the rest video.
  std::vector<int64_t> rows(seq_len);
  for (int64_t s = 0; s < seq_len; ++s) {
    const int64_t t = s * timesteps / seq_len, begin = t * seq_len / timesteps, end = (t + 1) * seq_len / timesteps;
    const double f = static_cast<double>(s - begin) / static_cast<double>(end - begin);
    rows[s] = t * 3 + (f < 0.05 ? 1 : f >= 0.85 ? 2 : 0);
  }
  void* d = nullptr;
  check(cudaMalloc(&d, seq_len * 8), "cudaMalloc");
  check(cudaMemcpy(d, rows.data(), seq_len * 8, cudaMemcpyHostToDevice), "upload");
  IndexPlan plan;
  check(IndexPlan::from_row_index(TensorView::contiguous(d, DType::kI64, {seq_len}, Device::cuda(0)), 3 * timesteps,
                                  batch, &plan, stream),
        "plan");
  cudaFree(d);
  return plan;
}

}  // namespace

int main() {
  cudaStream_t stream;
  check(cudaStreamCreate(&stream), "stream");
  cudaDeviceProp prop;
  check(cudaGetDeviceProperties(&prop, 0), "properties");
  {
    const std::size_t bytes = std::size_t(2) << 30;  // 2 GiB each way
    void *a, *b;
    check(cudaMalloc(&a, bytes), "cudaMalloc"), check(cudaMalloc(&b, bytes), "cudaMalloc");
    const float ms = median_ms(stream, [&] { cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream); });
    copy_gbps = 2.0 * bytes / (ms * 1e-3) / 1e9;
    cudaFree(a), cudaFree(b);
  }
  std::printf("device: %s, %d SMs; device-to-device copy (read + write): %.0f GB/s\n\n", prop.name,
              prop.multiProcessorCount, copy_gbps);
  std::printf("| op | shape | median us | bytes floor (MB) | GB/s | %% of copy |\n| --- | --- | --- | --- | --- | --- |\n");
  const Stream st = stream;

  // adaln_projection (T, 18H) from temb (T, D), bf16 weight (18H, D) = 520 MB.
  for (int64_t t : {1, 4, 8}) {
    const int64_t n = 18 * kHidden;
    Tensor temb(DType::kF32, {t, kTimeDim}, 2), w(DType::kBF16, {n, kTimeDim}, 3), b(DType::kBF16, {n}, 4);
    Tensor table(DType::kBF16, {t, n}), act(DType::kBF16, {t, kTimeDim}), grad(DType::kF32, {t, n}, 5);
    Tensor d_temb(DType::kF32, {t, kTimeDim}), d_w(DType::kBF16, {n, kTimeDim}), d_b(DType::kBF16, {n});
    const std::string shape = "T=" + std::to_string(t) + " N=18H D=2688 bf16";
    AdalnProjectionParams f{{temb.view, w.view, b.view}, table.view, act.view};
    check(adaln_projection_forward(f, st), "projection");
    row("adaln_projection fwd", shape.c_str(), median_ms(stream, [&] { check(adaln_projection_forward(f, st), "projection"); }),
        w.bytes() + b.bytes() + temb.bytes() + table.bytes() + act.bytes());
    AdalnProjectionBackwardParams bp{f.in, act.view, grad.view, d_temb.view, d_w.view, d_b.view};
    row("adaln_projection bwd", shape.c_str(),
        median_ms(stream, [&] { check(adaln_projection_backward(bp, st), "projection bwd"); }),
        w.bytes() + d_w.bytes() + grad.bytes() + act.bytes() + temb.bytes() + d_temb.bytes() + d_b.bytes());
  }

  // timestep_mlp, FP32: W1 (H, 256), W2 (D, H).
  {
    const int64_t t = 8;
    Tensor f(DType::kF32, {t, kFreq}, 6), w1(DType::kF32, {kHidden, kFreq}, 7), b1(DType::kF32, {kHidden}, 8);
    Tensor w2(DType::kF32, {kTimeDim, kHidden}, 9), b2(DType::kF32, {kTimeDim}, 10);
    Tensor temb(DType::kF32, {t, kTimeDim}), pre(DType::kF32, {t, kHidden}), hid(DType::kF32, {t, kHidden});
    TimestepMlpParams p{{f.view, w1.view, b1.view, w2.view, b2.view}, temb.view, pre.view, hid.view};
    row("timestep_mlp fwd", "T=8 fp32", median_ms(stream, [&] { check(timestep_mlp_forward(p, st), "mlp"); }),
        w1.bytes() + w2.bytes() + b1.bytes() + b2.bytes() + f.bytes() + temb.bytes() + pre.bytes() + hid.bytes());
    Tensor g(DType::kF32, {t, kTimeDim}, 11), d_f(DType::kF32, {t, kFreq}), d_w1(DType::kF32, {kHidden, kFreq});
    Tensor d_b1(DType::kF32, {kHidden}), d_w2(DType::kF32, {kTimeDim, kHidden}), d_b2(DType::kF32, {kTimeDim});
    TimestepMlpBackwardParams bp{p.in, pre.view, hid.view, g.view, d_f.view, d_w1.view, d_b1.view, d_w2.view, d_b2.view};
    row("timestep_mlp bwd", "T=8 fp32", median_ms(stream, [&] { check(timestep_mlp_backward(bp, st), "mlp bwd"); }),
        2 * (w1.bytes() + w2.bytes()) + pre.bytes() + hid.bytes() + g.bytes() + f.bytes());
  }

  // Row-wise ops at S = 32768, B = 1 and 2, H = 5376 bf16, block packing, T = 4.
  for (int64_t batch : {1, 2}) {
    const int64_t seq = 32768, t = 4, rows = batch * seq, table_rows = 3 * t;
    const IndexPlan plan = block_plan(seq, t, batch, stream);
    const std::string shape = "B=" + std::to_string(batch) + " S=32768 H=5376 bf16";
    Tensor x(DType::kBF16, {rows, kHidden}, 12), w(DType::kBF16, {kHidden}, 13, 1.0f);
    Tensor shift(DType::kBF16, {table_rows, kHidden}, 14), scale(DType::kBF16, {table_rows, kHidden}, 15);
    Tensor out(DType::kBF16, {rows, kHidden}), rstd(DType::kF32, {rows}), grad(DType::kBF16, {rows, kHidden}, 16);
    RmsnormParams f;
    f.in = {x.view, w.view, shift.view, scale.view, plan};
    f.out = out.view, f.rstd = rstd.view;
    row("rmsnorm modulated fwd", shape.c_str(), median_ms(stream, [&] { check(rmsnorm_forward(f, st), "rmsnorm"); }),
        x.bytes() + out.bytes() + rstd.bytes() + shift.bytes() + scale.bytes());
    Tensor dx(DType::kBF16, {rows, kHidden}), d_w(DType::kF32, {kHidden});
    Tensor d_shift(DType::kF32, {table_rows, kHidden}), d_scale(DType::kF32, {table_rows, kHidden});
    RmsnormBackwardParams b;
    b.in = f.in;
    b.rstd = rstd.view, b.grad = grad.view, b.dx = dx.view, b.d_weight = d_w.view;
    b.d_shift = d_shift.view, b.d_scale = d_scale.view;
    row("rmsnorm modulated bwd", shape.c_str(),
        median_ms(stream, [&] { check(rmsnorm_backward(b, st), "rmsnorm bwd"); }),
        x.bytes() + grad.bytes() + dx.bytes() + rstd.bytes() + shift.bytes() + scale.bytes() + d_shift.bytes() +
            d_scale.bytes());

    Tensor y(DType::kBF16, {rows, kHidden}, 17), gate(DType::kBF16, {table_rows, kHidden}, 18);
    GateResidualParams gf{{x.view, y.view, gate.view, plan}, out.view};
    row("gate_residual fwd", shape.c_str(),
        median_ms(stream, [&] { check(gate_residual_forward(gf, st), "gate"); }),
        x.bytes() + y.bytes() + out.bytes() + gate.bytes());
    Tensor d_res(DType::kBF16, {rows, kHidden}), d_y(DType::kBF16, {rows, kHidden});
    Tensor d_gate(DType::kF32, {table_rows, kHidden});
    GateResidualBackwardParams gb{gf.in, grad.view, d_res.view, d_y.view, d_gate.view};
    row("gate_residual bwd", shape.c_str(),
        median_ms(stream, [&] { check(gate_residual_backward(gb, st), "gate bwd"); }),
        grad.bytes() + y.bytes() + d_res.bytes() + d_y.bytes() + gate.bytes() + d_gate.bytes());

    Tensor table(DType::kBF16, {table_rows, 6 * kHidden}, 19), mod(DType::kBF16, {6, seq, kHidden});
    AdalnRowGatherParams af{table.view, plan, mod.view};
    row("adaln_row_gather fwd", shape.c_str(),
        median_ms(stream, [&] { check(adaln_row_gather_forward(af, st), "gather"); }), mod.bytes() + table.bytes());
    Tensor mod_grad(DType::kBF16, {6, rows, kHidden}, 20), d_table(DType::kF32, {table_rows, 6 * kHidden});
    AdalnRowGatherBackwardParams ab{mod_grad.view, plan, d_table.view};
    row("adaln_row_gather bwd", shape.c_str(),
        median_ms(stream, [&] { check(adaln_row_gather_backward(ab, st), "gather bwd"); }),
        mod_grad.bytes() + d_table.bytes());
  }
  check(cudaStreamSynchronize(stream), "sync");
  return 0;
}
