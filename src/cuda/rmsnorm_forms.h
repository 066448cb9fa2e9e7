// rmsnorm on CUDA for the modulation forms and recipes (numerics 5.12, 6.11)
// other than the H3 rule (src/cuda/rmsnorm_forms.cu). The backend entry
// points of src/cuda/rmsnorm.cu hand a call here when rmsnorm_h3_rule is
// false, so the H3 rule's kernels and their bits are untouched.
#pragma once

#include "detdit/modulation.h"
#include "detdit/rmsnorm.h"
#include "detdit/status.h"

namespace detdit {
namespace cuda {

// The indexed form or none, the modulation in x's dtype, upcast = false.
bool rmsnorm_h3_rule(const RmsnormInputs& in, const ResolvedModulation& mod);

Status rmsnorm_forms_forward(const RmsnormParams& p, Stream stream);
Status rmsnorm_forms_backward_rows(const RmsnormBackwardParams& p, Stream stream);
// Every chunk (the public backward; the SP region runs the H3 rule only).
Status rmsnorm_forms_backward_partials(const RmsnormBackwardParams& p, const TensorView& weight_partials,
                                       const TensorView& table_partials, Stream stream);

}  // namespace cuda
}  // namespace detdit
