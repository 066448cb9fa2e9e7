// The cases of layernorm and gate_residual_layernorm (cases/layernorm_cases.cc,
// cases/gate_residual_layernorm_cases.cc), for the tests that build one by
// hand, and the test and verify shapes the two ops' generators share.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "cases/forms_cases.h"
#include "cases/op_case.h"
#include "detdit/tensor.h"

namespace detdit {
namespace cases {

enum class LayernormAffine { kNone, kWeight, kWeightBias };
const char* affine_name(LayernormAffine affine);  // "no affine", "weight", "weight+bias"

struct LayernormShape {
  DType dtype = DType::kBF16;
  int64_t hidden = 0;
  int64_t rows = 1;  // M = B*S positions
  LayernormAffine affine = LayernormAffine::kNone;
  DType grad_dtype = DType::kF32;  // d_weight / d_bias
  double x_mean = 0.0;             // the rows' mean (large: the statistics' cancellation)
  // grad and dx as views one element past a vector boundary (the scalar path)
  bool offset_grad = false;
};
// x ~ uniform(x_mean, std 3), weight ~ (1, 0.5), bias ~ (0, 0.5), grad ~ (0, 1), from `seed`.
OpCase layernorm_case(const LayernormShape& s, uint64_t seed);

// layernorm with shift = chunk 0 and scale = chunk 1 of the form's parent
// (cases/forms_cases.h; kNone: the plain norm of a (B, S, H) x), the recipe
// and dtypes of `s`, weight and bias per `affine` (x's dtype), d_weight and
// d_bias fp32, d_shift and d_scale s.grad_dtype. Its equivalent route is
// docs/numerics.md 9 evaluated step by step (cases/oracle.h layernorm_numerics9).
OpCase layernorm_form_case(const FormShape& s, LayernormAffine affine, uint64_t seed, bool verify_values = false);

// The DiT families' bench shapes of layernorm's and gate_residual_layernorm's
// form cases (the rule: cases/layernorm_cases.cc).
std::vector<FormShape> family_bench_forms(const CaseContext& ctx);

// The test suites' forms of layernorm's and gate_residual_layernorm's form
// cases: each of `forms` (a form, F for per frame, the chunk dimension kept)
// at B = 2, S = 294 (a per-sample group of 294 positions is two reduction
// chunks, 256 + 38, counted from the sample's first position), H = 16; per
// token S = 37, H = 12 (its (B, S, 6, H) parent grows with S).
struct TestForm {
  ModulationForm form;
  int64_t frames;
  bool keep;
};
std::vector<FormShape> layernorm_test_forms(std::initializer_list<TestForm> forms);

// The test suites' recipes of both ops: {x's dtype, fp32} modulation x {each
// op, upcast}, x bf16.
struct TestRecipe {
  DType mod;
  bool upcast;
};
inline constexpr TestRecipe kLayernormTestRecipes[] = {
    {DType::kBF16, false}, {DType::kF32, false}, {DType::kF32, true}, {DType::kBF16, true}};

// The affine parameters in a case's bytes (OpCase::set_bytes): the forward
// reads weight and bias, the backward reads each and writes its gradient, where present.
void add_affine_bytes(bool weight, bool bias, std::vector<std::string>* fwd, std::vector<std::string>* bwd);

// verify's form of both ops (B = 2, S = 4095 divisible by F = 21; --quick
// B = 1, S = 252) at the weights' H.
FormShape layernorm_verify_form(const CaseContext& ctx, ModulationForm form, DType mod_dtype, bool upcast);

// gate_residual_layernorm: the gate = chunk 2, shift and scale chunks 0 and 1
// of the form's parent, each present or not; d_h present or not. Its
// equivalent route is gate_residual then layernorm composed on the CPU.
struct GateLayernormShape {
  FormShape form;  // kNone: no gate, plain norm
  LayernormAffine affine = LayernormAffine::kNone;
  bool gate = true, norm_modulation = true;  // which modulation tensors a grouped / indexed form has
  bool d_h = false;
};
OpCase gate_residual_layernorm_case(const GateLayernormShape& s, uint64_t seed, bool verify_values = false);

}  // namespace cases
}  // namespace detdit
