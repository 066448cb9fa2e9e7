// The cases of layernorm (plain F.layer_norm: no affine, weight, weight and
// bias). Suites: kTest sweeps the affine variants, every dtype, H from one
// vector (4) to widths where the 128 threads hold unequal shares (2432) and
// M around a reduction chunk (255, 256, 257, 600), rows with a large mean,
// and grad / dx views off the vector boundary; kBench the DiT widths
// (bf16, no affine: H = 1536, 3072, 5120) at B*S = 8192 and 65536 (--quick /
// CPU: 8192); kVerify the weights' H (no affine, bf16, verify's positions)
// with its FP64 accuracy check.
#include "cases/layernorm_cases.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "cases/oracle.h"
#include "detdit/layernorm.h"

namespace detdit {
namespace cases {

const char* affine_name(LayernormAffine affine) {
  switch (affine) {
    case LayernormAffine::kWeight: return "weight";
    case LayernormAffine::kWeightBias: return "weight+bias";
    default: return "no affine";
  }
}

namespace {

constexpr double kBf16Roundoff = 0x1p-8;  // u: one bf16 rounding errs by at most u relative

// verify's oracle of the forward: out against the FP64 layer norm (no affine,
// bf16), in units of u = 2^-8 of max(|out|, 2^-4): one rounding to bf16 (at
// most u relative), plus the FP32 statistics (~1e-6 of the row's scale; the
// floor 2^-4 keeps values near zero, whose error is the statistics' absolute
// one, measurable).
AccuracyCheck layernorm_forward_accuracy() {
  AccuracyCheck a;
  a.name = "accuracy vs fp64";
  a.bound = 1.01;
  a.unit = "u=2^-8 of max(|out|, 2^-4)";
  a.error = [](const std::map<std::string, HostTensor>& t) {
    const HostTensor& x = t.at("x");
    const HostTensor& grad = t.at("grad");
    const LayernormReference ref = layernorm_reference(x, nullptr, nullptr, grad, 1e-6, DType::kBF16);
    const HostTensor& out = t.at("out");
    double worst = 0;
    for (int64_t i = 0; i < out.numel(); ++i) {
      const double exact = ref.exact_out[i], err = std::fabs(out.get(i) - exact);
      if (std::isnan(err)) return static_cast<double>(NAN);  // fails the check
      worst = std::max(worst, err / std::max(std::fabs(exact), 0x1p-4));
    }
    return worst / kBf16Roundoff;
  };
  return a;
}

}  // namespace

OpCase layernorm_case(const LayernormShape& s, uint64_t seed) {
  OpCase c;
  c.op = "layernorm";
  c.name = std::string(affine_name(s.affine)) + " " + dtype_name(s.dtype) + " H=" + std::to_string(s.hidden) +
           " M=" + std::to_string(s.rows) + (s.x_mean != 0 ? " mean " + std::to_string(static_cast<int>(s.x_mean)) : "") +
           (s.offset_grad ? " offset grad" : "") +
           (s.grad_dtype != DType::kF32 ? std::string(" grads ") + dtype_name(s.grad_dtype) : "");
  const int64_t M = s.rows, H = s.hidden;
  const bool weight = s.affine != LayernormAffine::kNone, bias = s.affine == LayernormAffine::kWeightBias;
  const bool offset = s.offset_grad;
  c.positions = M;
  c.input("x", Phase::kForward, s.dtype, {M, H}, uniform_values(seed + 1, s.x_mean, 3.0), 0);
  if (weight) c.input("weight", Phase::kForward, s.dtype, {H}, uniform_values(seed + 2, 1.0, 0.5));
  if (bias) c.input("bias", Phase::kForward, s.dtype, {H}, uniform_values(seed + 3, 0.0, 0.5));
  c.output("out", Phase::kForward, s.dtype, {M, H}, 0);
  c.output("mean", Phase::kForward, DType::kF32, {M}, 0);
  c.output("rstd", Phase::kForward, DType::kF32, {M}, 0);
  // offset: grad and dx are flat (M*H + 1,) storage whose rows start one
  // element past the start, so every row is off its vector boundary.
  const int64_t grad_elems = M * H + (offset ? 1 : 0);
  c.input("grad", Phase::kBackward, s.dtype, offset ? std::vector<int64_t>{grad_elems} : std::vector<int64_t>{M, H},
          uniform_values(seed + 4, 0.0, 1.0), offset ? -1 : 0);
  c.output("dx", Phase::kBackward, s.dtype, offset ? std::vector<int64_t>{grad_elems} : std::vector<int64_t>{M, H},
           offset ? -1 : 0);
  if (weight) c.output("d_weight", Phase::kBackward, s.grad_dtype, {H});
  if (bias) c.output("d_bias", Phase::kBackward, s.grad_dtype, {H});
  c.takes_profile = true;  // rsqrt
  c.arguments["eps"] = argument_text(1e-6f);
  auto inputs = [weight, bias](const Instance& t) {
    LayernormInputs in;
    in.x = t["x"];
    if (weight) in.weight = t["weight"];
    if (bias) in.bias = t["bias"];
    in.eps = 1e-6f;
    in.numerics = t.numerics;
    return in;
  };
  // The (M, H) rows of grad / dx (offset: starting at element 1 of the flat storage).
  auto rows_of = [offset, M, H](const TensorView& t) {
    if (!offset) return t;
    return TensorView::contiguous(static_cast<char*>(t.data) + dtype_size(t.dtype), t.dtype, {M, H}, t.device);
  };
  c.forward = [inputs](const Instance& t, Stream stream) {
    return layernorm_forward({inputs(t), t["out"], t["mean"], t["rstd"]}, stream);
  };
  c.backward = [inputs, rows_of, weight, bias](const Instance& t, Stream stream) {
    const TensorView none;
    return layernorm_backward({inputs(t), t["mean"], t["rstd"], rows_of(t["grad"]), rows_of(t["dx"]),
                               weight ? t["d_weight"] : none, bias ? t["d_bias"] : none},
                              stream);
  };
  std::vector<std::string> fwd = {"x", "out", "mean", "rstd"}, bwd = {"x", "mean", "rstd", "grad", "dx"};
  if (weight) {
    fwd.push_back("weight");
    bwd.insert(bwd.end(), {"weight", "d_weight"});
  }
  if (bias) {
    fwd.push_back("bias");
    bwd.push_back("d_bias");
  }
  c.set_bytes(Phase::kForward, fwd);
  c.set_bytes(Phase::kBackward, bwd);
  if (!offset)
    c.alone = [s, seed](int64_t) {
      LayernormShape alone = s;
      alone.rows = 1;
      return layernorm_case(alone, seed);
    };
  return c;
}

namespace {

std::vector<OpCase> layernorm_cases(Suite suite, const CaseContext& ctx) {
  std::vector<OpCase> cases;
  const LayernormAffine affines[] = {LayernormAffine::kNone, LayernormAffine::kWeight, LayernormAffine::kWeightBias};
  if (suite == Suite::kTest) {
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16})
      for (LayernormAffine affine : affines) {
        for (int64_t hidden : {4, 12, 68, 2432})
          cases.push_back(layernorm_case({dtype, hidden, 3, affine}, 500));
        for (int64_t rows : {255, 256, 257})
          cases.push_back(layernorm_case({dtype, 20, rows, affine}, 510));
      }
    cases.push_back(layernorm_case({DType::kBF16, 3072, 600, LayernormAffine::kWeightBias, DType::kBF16}, 520));
    cases.push_back(layernorm_case({DType::kF32, 5120, 9, LayernormAffine::kNone, DType::kF32, 100.0}, 530));
    cases.push_back(layernorm_case({DType::kBF16, 1536, 5, LayernormAffine::kWeight, DType::kF32, 1000.0}, 540));
    cases.push_back(
        layernorm_case({DType::kF16, 516, 300, LayernormAffine::kWeightBias, DType::kF16, 0.0, true}, 550));
    cases.push_back(layernorm_case({DType::kBF16, 68, 257, LayernormAffine::kNone, DType::kF32, 0.0, true}, 560));
    return cases;
  }
  if (suite == Suite::kBench) {
    for (int64_t hidden : {1536, 3072, 5120})
      for (int64_t rows : ctx.small ? std::vector<int64_t>{8192} : std::vector<int64_t>{8192, 65536})
        cases.push_back(layernorm_case({DType::kBF16, hidden, rows, LayernormAffine::kNone}, ctx.seed + 900));
    return cases;
  }
  // kVerify: the weights' width, no affine (the DiT norm sites), bf16.
  OpCase c = layernorm_case({DType::kBF16, ctx.hidden, ctx.quick ? 257 : 4097, LayernormAffine::kNone}, ctx.seed + 90);
  c.accuracy.push_back(layernorm_forward_accuracy());
  cases.push_back(std::move(c));
  return cases;
}

DETDIT_OP_CASES("layernorm", layernorm_cases);

}  // namespace
}  // namespace cases
}  // namespace detdit
