// combined_timestep_embedding on CUDA: every case of cases/embedding_cases.cc
// (Flux's and SD3's layouts, bf16 and fp32) byte-equal to the CPU reference,
// forward and every gradient. (timestep_mlp's bf16 cases, the pooled-text
// embedder's among them, run with its own, tests/cuda/timestep_mlp_cuda_test.cc.)
#include <gtest/gtest.h>

#include "cuda/cuda_test_util.h"

namespace detdit {
namespace testing {
namespace {

DETDIT_CUDA_OP_CASES(CombinedTimestepEmbeddingCaseCuda, "combined_timestep_embedding");

}  // namespace
}  // namespace testing
}  // namespace detdit
