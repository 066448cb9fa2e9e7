// One DiT family's conditioning path as op cases (detdit verify --model NAME):
// the sites of docs/models.md in the order the model computes them, at the
// weights' dimensions, each an op case of the op-case library with its own
// checks (FP64 oracle or the contract written out, repeatability, a sample
// alone equal to its slice of the batch, CUDA = CPU). The path is chained:
// every site's inputs that an earlier site makes (features, the time
// embedding, the AdaLN tables, h, the block's output, the final norm's
// output) are that site's CPU (portable) outputs; the sublayers' outputs
// (attention, FFN) and the pooled text are stand-ins from the verify stream,
// and every weight comes from the family's weights file (io/manifest.h).
#pragma once

#include <string>
#include <vector>

#include "cases/op_case.h"
#include "cases/parallel_cases.h"
#include "detdit/status.h"

namespace detdit {
namespace cases {

// One site of the path: what the model computes there ("norm1: modulated
// LayerNorm, per sample") and the op case that computes it.
struct ModelSite {
  std::string site;
  OpCase c;
};

// The sites of context.model's path (context.model "h3" has none: its verify
// cases are the ops' own). B = 2 samples of S = 1024 positions (--quick 256;
// per-token families S = 64, --quick 16). A ValueError when the context has
// no weights or a tensor the path reads is absent or differs in dtype or
// size; building runs each site's forward once on the CPU.
Status model_sites(const CaseContext& context, std::vector<ModelSite>* sites);

// The block's first AdaLN projection (the family's weights, K chunks, T rows
// as model_sites', a stand-in bf16 temb) for tp_adaln_projection at tp worlds
// (check_tp_worlds: every rank byte-equal to one process).
Status model_tp_shape(const CaseContext& context, std::string* site, TpShape* shape);

}  // namespace cases
}  // namespace detdit
