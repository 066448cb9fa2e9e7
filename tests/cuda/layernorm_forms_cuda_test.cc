// The modulated layernorm on CUDA (src/cuda/layernorm.cu, fold_group_partials,
// fold_segment_partials): every form (per sample, per frame, per token,
// indexed, none) x recipe (modulation in x's dtype or fp32, upcast false /
// true) x affine variant, portable profile, byte-equal to the CPU reference
// (tests/cpu/layernorm_forms_test.cc checks the CPU against numerics 9.5 /
// 9.6), forward (out, mean, rstd) and every gradient (dx, d_weight, d_bias,
// d_shift, d_scale). The modulation tensors are chunk views of a (B, F, 6, H)
// (or (R, 6, H)) tensor, as the models make them. Torch profile: only rsqrt
// differs, so out is numerics 9.5 written out on the device's (mean, rstd),
// and the backward (no profile function) is the CPU backward on them.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/layernorm_math.h"
#include "common/scalar_math.h"
#include "cuda/cuda_test_util.h"
#include "detdit/layernorm.h"
#include "support/rowwise_fixture.h"

namespace detdit {
namespace testing {
namespace {

struct Form {
  const char* name;
  int64_t frames;  // F (0: none; -1: indexed through a plan)
};
struct Recipe {
  DType x, mod;
  bool upcast;
};
enum class Affine { kNone, kWeight, kWeightBias };

const Form kForms[] = {{"none", 0}, {"per_sample", 1}, {"per_frame F=3", 3}, {"per_token", 300}, {"indexed", -1}};
const Recipe kRecipes[] = {{DType::kBF16, DType::kBF16, false}, {DType::kBF16, DType::kF32, false},
                           {DType::kBF16, DType::kF32, true},   {DType::kF16, DType::kF16, true},
                           {DType::kF32, DType::kF32, false}};
constexpr int64_t kB = 2, kS = 300;

DType out_dtype(const Recipe& r, const Form& f) {
  return f.frames == 0 || r.upcast || r.mod != DType::kF32 ? r.x : DType::kF32;
}

// Chunk c of the parent (B, F, 6, H) as a (B, F, H) view (per sample (B, H));
// indexed: the parent is (R, 6, H) and the chunk an (R, H) view.
TensorView chunk(const TensorView& parent, int64_t c, const Form& f) {
  TensorView v = parent;
  const int64_t h = parent.shape[parent.rank - 1];
  v.data = static_cast<char*>(parent.data) + c * h * static_cast<int64_t>(dtype_size(parent.dtype));
  if (f.frames == 1 || f.frames < 0) {
    v.rank = 2;
    v.shape[0] = parent.shape[0];
    v.shape[1] = h;
    v.strides[0] = parent.strides[0];
    v.strides[1] = 1;
  } else {
    v.rank = 3;
    v.shape[0] = parent.shape[0];
    v.shape[1] = parent.shape[1];
    v.shape[2] = h;
    v.strides[0] = parent.strides[0];
    v.strides[1] = parent.strides[1];
    v.strides[2] = 1;
  }
  v.shape[3] = v.strides[3] = 0;
  return v;
}

// H = 64 (threads 0..15 hold one vector each) and H = 1032 (258 vectors:
// threads 0 and 1 hold three, the others two); the affine variant rotates.
TEST(LayernormFormsCuda, EveryFormAndRecipeEqualsTheCpu) {
  DETDIT_SKIP_WITHOUT_CUDA();
  const IndexCase c = make_index_case(Packing::kInterleaved, kS, 3, kB);
  const PlanPair plans = adaln_plan_pair(c);
  int k = 0;
  for (int64_t h : {int64_t{64}, int64_t{1032}})
    for (const Form& f : kForms)
      for (const Recipe& r : kRecipes) {
        const Affine affine = static_cast<Affine>(k++ % 3);
        const bool has_w = affine != Affine::kNone, has_b = affine == Affine::kWeightBias;
        SCOPED_TRACE(std::string(f.name) + " H=" + std::to_string(h) + " x " + dtype_name(r.x) + " mod " +
                     dtype_name(r.mod) + (r.upcast ? " upcast" : "") + " affine " +
                     std::to_string(static_cast<int>(affine)));
        const bool indexed = f.frames < 0, modulated = f.frames != 0;
        const std::vector<int64_t> parent_shape = indexed ? std::vector<int64_t>{c.num_rows(), 6, h}
                                                          : std::vector<int64_t>{kB, modulated ? f.frames : 1, 6, h};
        const DType out = out_dtype(r, f);
        Pair x = random_pair(r.x, {kB, kS, h}, 1), w = random_pair(r.x, {h}, 2, 1.0, 0.1);
        Pair b = random_pair(r.x, {h}, 5, 0.0, 0.1);
        Pair parent = random_pair(r.mod, parent_shape, 3, 0.0, 0.5);
        Pair grad = random_pair(out, {kB, kS, h}, 4);
        Pair y = output_pair(out, {kB, kS, h});
        Pair mean = output_pair(DType::kF32, {kB * kS}), rstd = output_pair(DType::kF32, {kB * kS});
        Pair dx = output_pair(r.x, {kB, kS, h}), d_weight = output_pair(DType::kF32, {h});
        Pair d_bias = output_pair(r.x, {h});
        const std::vector<int64_t> grad_shape =
            indexed ? std::vector<int64_t>{c.num_rows(), h}
                    : (f.frames == 1 ? std::vector<int64_t>{kB, h} : std::vector<int64_t>{kB, f.frames, h});
        Pair d_shift = output_pair(DType::kF32, grad_shape), d_scale = output_pair(r.mod, grad_shape);
        for (bool gpu : {false, true}) {
          auto v = [&](const Pair& p) { return gpu ? p.d() : p.h(); };
          LayernormInputs in;
          in.x = v(x);
          if (has_w) in.weight = v(w);
          if (has_b) in.bias = v(b);
          if (modulated) {
            in.shift = chunk(v(parent), 0, f);
            in.scale = chunk(v(parent), 1, f);
          }
          if (indexed) in.plan = gpu ? plans.dev : plans.host;
          in.eps = 1e-6f;
          in.upcast = r.upcast;
          DETDIT_ASSERT_OK(layernorm_forward({in, v(y), v(mean), v(rstd)}));
          LayernormBackwardParams bp{in, v(mean), v(rstd), v(grad), v(dx), TensorView(), TensorView()};
          if (has_w) bp.d_weight = v(d_weight);
          if (has_b) bp.d_bias = v(d_bias);
          if (modulated) {
            bp.d_shift = v(d_shift);
            bp.d_scale = v(d_scale);
          }
          DETDIT_ASSERT_OK(layernorm_backward(bp));
        }
        EXPECT_GPU_EQ_CPU(y);
        EXPECT_GPU_EQ_CPU(mean);
        EXPECT_GPU_EQ_CPU(rstd);
        EXPECT_GPU_EQ_CPU(dx);
        if (has_w) {
          EXPECT_GPU_EQ_CPU(d_weight);
        }
        if (has_b) {
          EXPECT_GPU_EQ_CPU(d_bias);
        }
        if (modulated) {
          EXPECT_GPU_EQ_CPU(d_shift);
          EXPECT_GPU_EQ_CPU(d_scale);
        }
      }
}

// Per sample (B = 2, S = 300, H = 1032, weight and bias), the each-op and the
// upcast recipes, torch profile on the device against the CPU.
TEST(LayernormFormsCuda, TorchProfileIsNumerics95OnTheDevicesStatistics) {
  DETDIT_SKIP_WITHOUT_CUDA();
  constexpr int64_t h = 1032;
  const Form f{"per_sample", 1};
  for (const Recipe& r : {kRecipes[1], kRecipes[2]}) {
    SCOPED_TRACE(std::string("x ") + dtype_name(r.x) + " mod " + dtype_name(r.mod) + (r.upcast ? " upcast" : ""));
    const DType out = out_dtype(r, f), promoted = r.mod == DType::kF32 ? DType::kF32 : r.x;
    Pair x = random_pair(r.x, {kB, kS, h}, 1), w = random_pair(r.x, {h}, 2, 1.0, 0.1);
    Pair b = random_pair(r.x, {h}, 5, 0.0, 0.1), parent = random_pair(r.mod, {kB, 1, 6, h}, 3, 0.0, 0.5);
    Pair grad = random_pair(out, {kB, kS, h}, 4), y = output_pair(out, {kB, kS, h});
    Pair mean = output_pair(DType::kF32, {kB * kS}), rstd = output_pair(DType::kF32, {kB * kS});
    Pair dx = output_pair(r.x, {kB, kS, h}), d_weight = output_pair(DType::kF32, {h});
    Pair d_bias = output_pair(DType::kF32, {h}), d_shift = output_pair(DType::kF32, {kB, h});
    Pair d_scale = output_pair(DType::kF32, {kB, h});
    auto inputs = [&](bool gpu) {
      auto v = [&](const Pair& p) { return gpu ? p.d() : p.h(); };
      LayernormInputs in;
      in.x = v(x);
      in.weight = v(w);
      in.bias = v(b);
      in.shift = chunk(v(parent), 0, f);
      in.scale = chunk(v(parent), 1, f);
      in.eps = 1e-6f;
      in.upcast = r.upcast;
      in.numerics = gpu ? Numerics::kTorch : Numerics::kPortable;
      return in;
    };
    const LayernormInputs dev = inputs(true);
    DETDIT_ASSERT_OK(layernorm_forward({dev, y.d(), mean.d(), rstd.d()}));
    DETDIT_ASSERT_OK(layernorm_backward(
        {dev, mean.d(), rstd.d(), grad.d(), dx.d(), d_weight.d(), d_bias.d(), d_shift.d(), d_scale.d()}));
    const HostTensor got_mean = mean.result(), got_rstd = rstd.result(), got_out = y.result();
    int64_t out_diff = 0;
    for (int64_t p = 0; p < kB * kS; ++p) {
      const float mu = got_mean.ptr<float>()[p], rs = got_rstd.ptr<float>()[p];
      for (int64_t i = 0; i < h; ++i) {
        const float v = layernorm::normalised(static_cast<float>(x.host.get(p * h + i)), mu, rs, true,
                                              static_cast<float>(w.host.get(i)), true,
                                              static_cast<float>(b.host.get(i)));
        const int64_t row = (p / kS) * 6 * h;  // sample p / S of the (B, 1, 6, H) parent
        const float scale = static_cast<float>(parent.host.get(row + h + i));
        const float shift = static_cast<float>(parent.host.get(row + i));
        const float n = r.upcast ? v : round_as(v, r.x);
        const float t1 = r.upcast ? num::add32(1.0f, scale) : round_as(num::add32(1.0f, scale), r.mod);
        const float u = r.upcast ? num::mul32(n, t1) : round_as(num::mul32(n, t1), promoted);
        out_diff += num::float_bits(round_as(num::add32(u, shift), out)) !=
                    num::float_bits(static_cast<float>(got_out.get(p * h + i)));
      }
    }
    EXPECT_EQ(out_diff, 0) << "out elements that differ from numerics 9.5 on the device's statistics";
    // The CPU backward (portable; the backward calls no profile function) on the device's statistics.
    HostTensor cpu_mean = got_mean, cpu_rstd = got_rstd;
    DETDIT_ASSERT_OK(layernorm_backward({inputs(false), cpu_mean.view(), cpu_rstd.view(), grad.h(), dx.h(),
                                         d_weight.h(), d_bias.h(), d_shift.h(), d_scale.h()}));
    EXPECT_GPU_EQ_CPU(dx);
    EXPECT_GPU_EQ_CPU(d_weight);
    EXPECT_GPU_EQ_CPU(d_bias);
    EXPECT_GPU_EQ_CPU(d_shift);
    EXPECT_GPU_EQ_CPU(d_scale);
  }
}

}  // namespace
}  // namespace testing
}  // namespace detdit
