// gate_residual_layernorm on CUDA: the fused op on the GPU byte-equal to the
// CPU reference (which tests/cpu/gate_residual_layernorm_test.cc checks
// against the two ops composed), forward (h, out, mean, rstd) and every
// gradient, over every modulation form x recipe x affine variant x which
// modulation tensors are present, with and without k and d_h, with g in
// d_residual, in scratch, and the norm's gradients alone; and every test case
// of the op (cases/gate_residual_layernorm_cases.cc: the per frame F = 21
// form, modulation-dtype gradients, fp16 wide rows) equal to the CPU's.
// Portable profile.
// The forward's one kernel against the two ops' kernels it fuses
// (gate_residual, then layernorm of h) on the GPU, both profiles: every form,
// recipe, presence and k (and a gate in the activation dtype beside fp32
// shift and scale), widths whose rows take less than one batch of
// vectors per thread, exactly one, and two and three, rows whose residual, y
// and modulation tensors allow vector loads and rows that do not, with and
// without mean and rstd; in the portable profile the CPU's bytes as well.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "support/gate_residual_layernorm_fixture.h"

namespace detdit {
namespace testing {
namespace {

DETDIT_CUDA_OP_CASES(GateResidualLayernormCaseCuda, "gate_residual_layernorm");

// A subset of the CPU suite's sweep (tests/cpu/gate_residual_layernorm_test.cc).
const GrlnForm kForms[] = {{"none", GrlnKind::kNone, 0, false},
                           {"per_sample (B, H)", GrlnKind::kGrouped, 1, false},
                           {"per_sample (B, 1, H)", GrlnKind::kGrouped, 1, true},
                           {"per_frame (B, F, 1, H)", GrlnKind::kGrouped, 3, true},
                           {"per_token", GrlnKind::kGrouped, kGrlnS, false},
                           {"indexed", GrlnKind::kIndexed, 0, false}};
const GrlnRecipe kRecipes[] = {{DType::kBF16, DType::kBF16, false}, {DType::kBF16, DType::kF32, false},
                               {DType::kBF16, DType::kF32, true},   {DType::kF16, DType::kF16, true},
                               {DType::kF32, DType::kF32, false}};

TEST(GateResidualLayernormCuda, EqualsTheCpu) {
  DETDIT_SKIP_WITHOUT_CUDA();
  const int checked = for_each_grln_forms_problem(kForms, kRecipes, GrlnNorm::kLayernorm,
                                                  [&](const GrlnForm& f, const GrlnProblem& p, int index) {
    SCOPED_TRACE(std::string(f.name) + ": " + p.describe());
    expect_grln_cuda_equals_cpu(GrlnInputs(p, 2000 + index));
  });
  EXPECT_GT(checked, 200);
}

// ---- the forward: one kernel against the two ops it fuses --------------------

// A problem's inputs on `device`, the row tensors and the modulation parent
// `offset` elements past an aligned allocation (1: no vector loads of
// residual, y, gate, shift or scale).
struct ForwardInputs {
  DeviceTensor residual, y, parent, gate_parent, w, b;
  TensorView residual_view, y_view;
  const void* parent_base;
  const void* gate_parent_base;  // the parent in the activation dtype, or nullptr
  IndexPlan plan;
};

// `t`'s values rounded to `dtype`.
HostTensor converted(const HostTensor& t, DType dtype) {
  HostTensor c(dtype, t.shape());
  for (int64_t i = 0; i < t.numel(); ++i) c.set(i, t.get(i));
  return c;
}

Status upload_at(const HostTensor& host, int64_t offset, const Device& device, DeviceTensor* dev, const void** base) {
  const std::size_t size = dtype_size(host.dtype());
  HostTensor flat(host.dtype(), {host.numel() + offset});
  std::memcpy(static_cast<char*>(flat.data()) + offset * size, host.data(), host.nbytes());
  DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(flat, device, dev));
  *base = static_cast<const char*>(dev->view().data) + offset * size;
  return Status();
}

// gate_in_x: a gate in the activation dtype (the parent's values rounded to
// it) beside fp32 shift and scale; weight and bias in h's dtype `h_dtype`.
Status forward_inputs(const GrlnInputs& in, int64_t offset, bool gate_in_x, DType h_dtype, const Device& device,
                      ForwardInputs* f) {
  const GrlnProblem& p = in.p;
  const void *residual, *y;
  DETDIT_RETURN_IF_ERROR(upload_at(in.residual, offset, device, &f->residual, &residual));
  DETDIT_RETURN_IF_ERROR(upload_at(in.y, offset, device, &f->y, &y));
  DETDIT_RETURN_IF_ERROR(upload_at(in.parent, offset, device, &f->parent, &f->parent_base));
  f->gate_parent_base = nullptr;
  if (gate_in_x)
    DETDIT_RETURN_IF_ERROR(
        upload_at(converted(in.parent, p.x_dtype), offset, device, &f->gate_parent, &f->gate_parent_base));
  DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(converted(in.w, h_dtype), device, &f->w));
  DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(converted(in.b, h_dtype), device, &f->b));
  f->residual_view = TensorView::contiguous(const_cast<void*>(residual), p.x_dtype, {p.batch, p.seq, p.hidden}, device);
  f->y_view = TensorView::contiguous(const_cast<void*>(y), p.x_dtype, {p.batch, p.seq, p.hidden}, device);
  f->plan = in.plan;
  if (p.kind == GrlnKind::kIndexed && device.is_cuda())
    DETDIT_RETURN_IF_ERROR(cases::adaln_plan(in.index, device, &f->plan));
  return Status();
}

// One forward run: which op, its profile, the inputs' alignment and dtypes,
// and which outputs.
struct ForwardRun {
  Numerics numerics;
  int64_t offset;   // elements past a vector boundary (upload_at)
  bool stats;       // mean and rstd asked for (and returned)
  bool gate_in_x;   // forward_inputs
};

// The forward on `device`: the fused op, or (fused = false) gate_residual into
// h then layernorm of h.
Status run_forward(const GrlnInputs& in, const ForwardRun& run, const Device& device, bool fused,
                   GrlnOutputs* outputs) {
  const GrlnProblem& p = in.p;
  // The problem's dtypes, h's and out's with a gate in the activation dtype.
  const DType h_dtype = run.gate_in_x ? p.x_dtype : p.h_dtype();
  const DType out_dtype = run.gate_in_x && !p.upcast ? DType::kF32 : run.gate_in_x ? p.x_dtype : p.out_dtype();
  ForwardInputs f;
  DETDIT_RETURN_IF_ERROR(forward_inputs(in, run.offset, run.gate_in_x, h_dtype, device, &f));
  std::map<std::string, DeviceTensor> dev;
  DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(h_dtype, in.act_shape(), device, &dev["h"]));
  DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(out_dtype, in.act_shape(), device, &dev["out"]));
  if (run.stats)
    for (const char* name : {"mean", "rstd"})
      DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(DType::kF32, {p.positions()}, device, &dev[name]));
  auto view = [&](const char* name) { return dev.count(name) ? dev[name].view() : TensorView(); };
  GateResidualLayernormInputs args;
  args.residual = f.residual_view;
  args.y = f.y_view;
  if (p.has_gate()) args.gate = in.chunk(f.parent_base, 2, device);
  if (run.gate_in_x) {  // the same view over the activation-dtype parent
    args.gate = in.chunk(f.gate_parent_base, 0, device);
    args.gate.data = static_cast<char*>(args.gate.data) + 2 * p.hidden * static_cast<int64_t>(dtype_size(p.x_dtype));
    args.gate.dtype = p.x_dtype;
  }
  if (p.affine != GrlnAffine::kNone) args.weight = f.w.view();
  if (p.affine == GrlnAffine::kWeightBias) args.bias = f.b.view();
  if (p.modulated()) {
    args.shift = in.chunk(f.parent_base, 0, device);
    args.scale = in.chunk(f.parent_base, 1, device);
  }
  args.plan = f.plan;
  args.has_k = p.has_k;
  args.k = kGrlnK;
  args.eps = kGrlnEps;
  args.numerics = run.numerics;
  args.upcast = p.upcast;
  if (fused) {
    DETDIT_RETURN_IF_ERROR(
        gate_residual_layernorm_forward({args, view("h"), view("out"), view("mean"), view("rstd")}));
  } else {
    DETDIT_RETURN_IF_ERROR(gate_residual_forward(
        {GateResidualInputs{args.residual, args.y, args.gate, args.plan, args.has_k, args.k, args.upcast}, view("h")}));
    DETDIT_RETURN_IF_ERROR(layernorm_forward({LayernormInputs{view("h"), args.weight, args.bias, args.shift, args.scale,
                                                              args.plan, args.eps, args.numerics, args.upcast},
                                              view("out"), view("mean"), view("rstd")}));
  }
  for (auto& [name, t] : dev) DETDIT_RETURN_IF_ERROR(t.to_host(&(*outputs)[name]));
  return Status();
}

struct Width {
  int64_t hidden;
  const char* why;
};
// Vectors of 4 per row over 128 threads, in batches of 8 per thread.
const Width kWidths[] = {{72, "18 vectors: threads 18.. idle"},
                         {1028, "257 vectors: thread 0 has 3, the rest 2"},
                         {4096, "one whole batch per thread"},
                         {5376, "a second, partial batch"},
                         {8196, "three batches for thread 0"}};
const GrlnRecipe kForwardRecipes[] = {{DType::kBF16, DType::kBF16, false}, {DType::kBF16, DType::kF32, false},
                                      {DType::kBF16, DType::kF32, true},   {DType::kBF16, DType::kBF16, true},
                                      {DType::kF16, DType::kF16, false},   {DType::kF16, DType::kF32, false},
                                      {DType::kF16, DType::kF16, true},    {DType::kF32, DType::kF32, false},
                                      {DType::kF32, DType::kF32, true}};

// 300 rows: more blocks than one wave of some GPUs' SMs take, and past one
// 256-position chunk; S divisible by the per-frame form's F = 3.
constexpr int64_t kForwardS = 150;
const GrlnForm kForwardForms[] = {{"none", GrlnKind::kNone, 0, false},
                                  {"per_sample (B, H)", GrlnKind::kGrouped, 1, false},
                                  {"per_sample (B, 1, H)", GrlnKind::kGrouped, 1, true},
                                  {"per_frame (B, F, H)", GrlnKind::kGrouped, 3, false},
                                  {"per_frame (B, F, 1, H)", GrlnKind::kGrouped, 3, true},
                                  {"per_token", GrlnKind::kGrouped, kForwardS, false},
                                  {"indexed", GrlnKind::kIndexed, 0, false}};

TEST(GateResidualLayernormCuda, ForwardIsTheComposition) {
  DETDIT_SKIP_WITHOUT_CUDA();
  int checked = 0;
  for (const GrlnForm& f : kForwardForms)
    for (const GrlnRecipe& r : kForwardRecipes)
      for (int presence = 0; presence < (f.kind == GrlnKind::kNone ? 1 : 4); ++presence)
        for (bool k : {false, true}) {
          // presence 3: gate, shift and scale, the gate in the activation dtype and the norm's fp32
          const bool gate_in_x = presence == 3;
          if (gate_in_x && (r.mod != DType::kF32 || r.x == DType::kF32)) continue;
          if (k && (f.kind == GrlnKind::kNone || presence == 2)) continue;
          const Width& width = kWidths[checked % 5];
          const GrlnAffine affine = static_cast<GrlnAffine>(checked % 3);
          const ForwardRun run{Numerics::kPortable, (checked / 2) % 2,  // both alignments at every width
                               checked % 7 != 3, gate_in_x};
          const GrlnProblem p{2, kForwardS, width.hidden, f.kind, f.frames, f.with_unit, r.x, r.mod, r.upcast, affine,
                              presence != 2, presence != 1, k, false};
          const GrlnInputs in(p, 7000 + checked);
          for (Numerics numerics : {Numerics::kPortable, Numerics::kTorch}) {
            ForwardRun this_run = run;
            this_run.numerics = numerics;
            SCOPED_TRACE(std::string(f.name) + ": " + p.describe() + (gate_in_x ? " (gate in x's dtype)" : "") +
                         " (" + width.why + ")" + (run.offset ? ", rows and modulation off a vector boundary" : "") +
                         (run.stats ? "" : ", no mean and rstd") +
                         (numerics == Numerics::kTorch ? ", torch profile" : ", portable profile"));
            GrlnOutputs fused, composed;
            DETDIT_ASSERT_OK(run_forward(in, this_run, Device::cuda(0), true, &fused));
            DETDIT_ASSERT_OK(run_forward(in, this_run, Device::cuda(0), false, &composed));
            ASSERT_EQ(fused.size(), run.stats ? 4u : 2u);
            ASSERT_EQ(composed.size(), fused.size());
            for (const auto& [name, expected] : composed) {
              SCOPED_TRACE(name);
              EXPECT_BITWISE_EQ(expected, fused.at(name));
            }
            if (numerics == Numerics::kPortable) {
              GrlnOutputs cpu;
              DETDIT_ASSERT_OK(run_forward(in, this_run, Device::cpu(), true, &cpu));
              for (const auto& [name, expected] : cpu) {
                SCOPED_TRACE(name + " against the CPU");
                EXPECT_BITWISE_EQ(expected, fused.at(name));
              }
            }
          }
          ++checked;
        }
  // 9 plain; 6 forms x (9 recipes x 5 (presence, k) + 3 fp32 recipes x 2 (k) with the gate in x's dtype)
  EXPECT_EQ(checked, 9 + 6 * (9 * 5 + 3 * 2));
}
}  // namespace
}  // namespace testing
}  // namespace detdit
