// The layernorm op's cases (cases/layernorm_cases.cc), for the tests that
// build one by hand.
#pragma once

#include <cstdint>

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

}  // namespace cases
}  // namespace detdit
