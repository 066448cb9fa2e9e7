// The binding's boundary between torch and detdit: tensor views, output
// allocation, argument parsing, the device and stream of a call, and the
// mapping of a detdit Status to the Python exception of its kind.
//
// Contract:
// - view(t, name) is t as a detdit::TensorView (pointer, dtype, shape,
//   strides, device); an undefined tensor (or absent optional) is an absent
//   view. A dtype detdit does not take is a TypeError, a device other than the
//   CPU or CUDA and a rank outside [1, kMaxRank] are ValueErrors, each naming
//   the argument.
// - A non-ok Status raises kType -> TypeError, kValue -> ValueError,
//   kIndex -> IndexError, anything else -> RuntimeError, with the library's
//   message unchanged.
// - An output is sized only from dims detdit pins to memory: an input of the
//   layout detdit requires of it (require_contiguous, require_unit_column_stride:
//   detdit's checks and messages, run before the output is allocated), a
//   built plan, or a size argument already range-checked; and an output sized
//   from dims of two inputs (a matrix product's (T, N), a table gradient's
//   (R, H)) only once the dims they share agree (require_dims: detdit's shape
//   check and message, run first). A strided or
//   expanded view, whose shape its memory does not back, never sizes an
//   allocation; the rest of detdit's validation runs in the call, before
//   anything is written. Every shape helper here gives 0 for a dim an input
//   lacks: a malformed input gets an empty output and detdit's error about the
//   input, never a torch error.
// - to_int: an int64 argument that detdit takes as an int is range-checked
//   (ValueError naming it), never truncated.
// - DeviceScope: on CUDA, the tensor's device is current for the call and the
//   call runs on torch's current stream of that device.
#pragma once

#include <ATen/ATen.h>
#include <torch/version.h>

#include <array>
#include <optional>
#include <string>

#ifdef DETDIT_TORCH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "detdit/detdit.h"

namespace detdit_torch {

using at::Tensor;
using detdit::DType;
using detdit::ErrorKind;
using detdit::IndexPlan;
using detdit::Numerics;
using detdit::Status;
using detdit::TensorView;
// c10::optional is its own type in torch 1.x and a deprecated alias of
// std::optional since torch 2.2: name the one this torch's kernels take.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 2)
template <typename T>
using Optional = std::optional<T>;
#else
template <typename T>
using Optional = c10::optional<T>;
#endif
using OptTensor = Optional<Tensor>;

// Raise the Python exception of the Status's kind, with its message.
[[noreturn]] void raise(const Status& status);
void check_ok(const Status& status);

// A view of t; an undefined tensor is an absent view.
TensorView view(const Tensor& t, const char* name);
TensorView view(const OptTensor& t, const char* name);

Numerics parse_numerics(const std::string& numerics);
detdit::Activation parse_activation(const std::string& activation);

// The layout checks detdit runs on an input whose dims size an output (see
// the contract), with detdit's messages; an undefined tensor passes (detdit
// reports it).
void require_contiguous(const Tensor& t, const char* name);
void require_unit_column_stride(const Tensor& t, const char* name);
// t must be `layout` = dims (-1: any size), as detdit's shape checks say it.
void require_dims(const Tensor& t, const char* name, std::initializer_list<int64_t> dims, const char* layout);

// value as an int, or a ValueError naming the argument when it does not fit.
int to_int(int64_t value, const char* name);

// Size of dim i of t (negative i from the end), or 0 when t lacks that dim.
int64_t dim_or_zero(const Tensor& t, int64_t i);
// Rows of a (..., H) tensor: the product of every dim but the last.
int64_t leading_rows(const Tensor& t);
// The (rows, cols) of a 2-D tensor, 0 for a dim it lacks.
std::array<int64_t, 2> matrix_shape(const Tensor& t);

// An output of `shape` and `dtype` on like's device (the CPU for an undefined like).
Tensor empty_like_shape(const Tensor& like, at::IntArrayRef shape, at::ScalarType dtype);
// An output only when `wanted`, else undefined (absent view).
Tensor maybe_empty(bool wanted, const Tensor& like, at::IntArrayRef shape, at::ScalarType dtype);
// An output with t's shape, dtype and device when `wanted`; undefined when
// not wanted or when t is (detdit then reports t).
Tensor output_like(const Tensor& t, bool wanted = true);

// The device context of a call (see the contract).
class DeviceScope {
 public:
  explicit DeviceScope(const Tensor& t) {
#ifdef DETDIT_TORCH_CUDA
    if (t.defined() && t.is_cuda()) {
      guard_.emplace(t.device());
      stream_ = c10::cuda::getCurrentCUDAStream(t.get_device()).stream();
    }
#else
    (void)t;
#endif
  }
  detdit::Stream stream() const { return stream_; }

 private:
#ifdef DETDIT_TORCH_CUDA
  Optional<c10::cuda::CUDAGuard> guard_;
#endif
  detdit::Stream stream_ = nullptr;
};

}  // namespace detdit_torch
