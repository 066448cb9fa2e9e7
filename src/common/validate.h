// Argument validation shared by every op and both backends.
//
// Each check returns a Status whose message names the argument, what was
// expected and what was got, e.g.
//   TypeError: x must be float32 or bfloat16, got float16
//   ValueError: weight must be (N, K) = (5376, 256), got (5376, 128) float32 on cpu
// Ops run every check, of every argument, before allocating or writing
// anything, so a failed call leaves its outputs untouched.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "detdit/numerics.h"
#include "detdit/plan.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {
namespace check {

// ValueError for a present view no op can take: a rank past kMaxRank, a
// negative dimension, more bytes than the address space, or a null data
// pointer to a non-empty tensor ("<name> is (4, 8) float32 on cpu with a null
// data pointer"). Absent views pass. Every check below that takes a view runs
// it first, so each argument an op checks at all, optional or not, is refused
// before the op allocates or writes anything.
Status well_formed(const TensorView& t, const char* name);
// ValueError "<name> is required" when absent, then well_formed.
Status present(const TensorView& t, const char* name);
// TypeError "<name> must be float32 or bfloat16, got float16".
Status dtype(const TensorView& t, const char* name, std::initializer_list<DType> allowed);
// TypeError "<name> must have <other>'s dtype <d>, got <d2>".
Status same_dtype(const TensorView& t, const char* name, const TensorView& other, const char* other_name);
// ValueError "<name> must be a <rank>-D <layout> tensor, got ...".
Status rank(const TensorView& t, const char* name, int rank, const char* layout);
// ValueError "<name> must be <layout> = (d0, d1), got ..."; a dim of -1 matches anything.
Status shape(const TensorView& t, const char* name, std::initializer_list<int64_t> dims, const char* layout);
Status contiguous(const TensorView& t, const char* name);
// ValueError "<name> must have unit column stride".
Status unit_column_stride(const TensorView& t, const char* name);
// ValueError "<name> must be <bytes>-byte aligned (...)".
Status aligned(const TensorView& t, const char* name, std::size_t bytes, const char* why);
// ValueError "<name> is on cuda:1, <other> is on cuda:0".
Status same_device(const TensorView& t, const char* name, const TensorView& other, const char* other_name);
// ValueError when the profile is neither portable nor torch, or torch on the CPU.
Status numerics_on(Numerics numerics, const Device& device);
// ValueError when the plan is missing or on another device than t.
Status plan_on(const IndexPlan& plan, const char* name, const TensorView& t, const char* t_name);
// ValueError "<name> must not alias <other>" when the byte ranges overlap.
Status no_alias(const TensorView& t, const char* name, const TensorView& other, const char* other_name);

}  // namespace check
}  // namespace detdit
