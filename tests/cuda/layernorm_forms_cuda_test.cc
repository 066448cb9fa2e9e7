// The modulated layernorm on CUDA (src/cuda/layernorm.cu, fold_group_partials,
// fold_segment_partials): every form (per sample, per frame, per token,
// indexed, none) x recipe (modulation in x's dtype or fp32, upcast false /
// true) x affine variant, portable profile, byte-equal to the CPU reference
// (tests/cpu/layernorm_forms_test.cc checks the CPU against numerics 9.5 /
// 9.6), forward (out, mean, rstd) and every gradient (dx, d_weight, d_bias,
// d_shift, d_scale). The modulation tensors are chunk views of a (B, F, 6, H)
// (or (R, 6, H)) tensor, as the models make them.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "detdit/layernorm.h"

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

}  // namespace
}  // namespace testing
}  // namespace detdit
