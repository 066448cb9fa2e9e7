"""torch.compile support for the detdit ops: fake kernels, fake plans, and the autograd of
ops traced with a fake plan. Imported by ``detdit`` (and by torch, which the C++ library
names as the ops' fake-kernel module from torch 2.4); on a torch without
``torch.library.register_fake`` (torch < 2.4) it registers nothing (``REASON`` says why).

Contract:
- Every ``torch.ops.detdit`` op but the plan constructors (``plan``, ``plan_from_rows``,
  ``sp_plan``: they validate data on the host, so a plan is built outside a compiled region)
  and ``release_scratch_memory`` (memory management, outside any model) has a fake kernel:
  each output's shape, dtype and device as the kernel allocates it (ops.cpp, distributed.cpp:
  contiguous, ``at::empty``), ``None`` where the output mask (or an absent table) leaves the
  kernel's output undefined. Plan-sized dims come from the plan.
- A plan, ``IndexPlan`` or ``SpPlan``, is a graph input that tracing sees as a fake plan:
  :class:`FakeIndexPlan` / :class:`FakeSpPlan`, built from the C++ ``__obj_flatten__``
  (plan.h: a never-reused id and the sizes). Dynamo guards on those values, so a compiled
  graph runs with the plan it was traced with and no other: a CUDA graph (``mode=
  "reduce-overhead"``) replays the plan's device tables by address.
- Every op but the sp_ ops and ``plan_handle`` declares no side effect: torch would take an
  op with a plan (a torch class) argument for an effectful one and order it by tokens; a
  detdit op is a pure function of its arguments (a plan never changes once built). The sp_
  ops run collectives and keep torch's ordering; their outputs then come back as a list,
  which the traced Functions accept. ``plan_handle`` keeps torch's ordering too, so its token
  keeps it in the forward graph and the backward graph takes no plan (see _register).
- torch runs an op whose plan argument is a fake plan in Python, where the C++ autograd
  Functions (autograd.h) cannot go; for those ops (every op with a plan, the ``.plan``
  overload of rmsnorm; ``TRACED_AUTOGRAD``) :func:`autograd_function` makes the same Functions
  in Python, registered at AutogradCPU and AutogradCUDA: the same backward op, given the
  same arguments and output mask, so a compiled graph runs the kernels eager autograd runs,
  with the same bits. They save a plan's handle (a tensor, from the op ``plan_handle``, whose
  fake kernel tracing runs) instead of the plan and call the backward op's ``.handle``
  overload, which resolves it to the live plan: torch 2.11's AOTAutograd refuses a torch-class
  object saved for a compiled backward. Ops without a plan keep their C++ Function, which
  calls its ops through the dispatcher and so is traced as it is.
- Every op with an IndexPlan also has a ``.tables`` overload taking the plan's tables (a tensor,
  ``plan.tables()``) in the plan's place: a compiled graph of tensors only, which CUDA graphs
  need (docs/python.md). Its fake kernel is the plan overload's (S from the tables' length);
  its Autograd kernel, on every torch, is :func:`autograd_function` of ``TABLES_AUTOGRAD``,
  which saves the tables as they are and calls the backward's ``.tables`` overload.
- A meta tensor given to an op eagerly is the ValueError naming the argument that any other
  device detdit does not run on is (:func:`refuse_meta`), on every torch; tracing's fake
  tensors (meta underneath) pass.
"""
import torch

__all__ = ["FakeIndexPlan", "FakeSpPlan", "FAKE_PLAN_TYPES", "FAKE_KERNELS", "TRACED_AUTOGRAD", "autograd_function", "REASON"]

_ops = torch.ops.detdit

# The C++ Functions' refusal of a double backward (autograd.h, check_first_order).
_FIRST_ORDER_ONLY = ("detdit ops support first-order gradients only: backward with create_graph=True "
                     "(double backward) is not implemented")


class FakeIndexPlan:
    """What tracing sees of an ``IndexPlan``: its sizes, from ``__obj_flatten__`` (strings)."""

    def __init__(self, id, seq_len, batch, num_rows, positions, num_chunks, num_segments, device):
        # every __obj_flatten__ key is an attribute: dynamo reads each one (OutputGraph)
        self.id, self._device = int(id), device
        self._seq_len, self._batch, self._num_rows = int(seq_len), int(batch), int(num_rows)
        self._positions, self._num_chunks, self._num_segments = int(positions), int(num_chunks), int(num_segments)

    @classmethod
    def __obj_unflatten__(cls, flat):
        return cls(**dict(flat))

    def seq_len(self):
        return self._seq_len

    def batch(self):
        return self._batch

    def num_rows(self):
        return self._num_rows

    def positions(self):
        return self._positions

    def num_chunks(self):
        return self._num_chunks

    def num_segments(self):
        return self._num_segments

    def device(self):
        return self._device

    def row_index(self):
        return torch.empty(self._seq_len, dtype=torch.int32)

    def handle(self):
        return torch.empty((1,), dtype=torch.int64)

    def __repr__(self):
        return (f"FakeIndexPlan(seq_len={self._seq_len}, batch={self._batch}, num_rows={self._num_rows}, "
                f"device={self._device})")


class FakeSpPlan:
    """What tracing sees of an ``SpPlan``: its sizes, from ``__obj_flatten__`` (strings)."""

    def __init__(self, id, world, rank, local_begin, local_end, local_seq_len, max_send):
        self.id, self._world, self._rank = int(id), int(world), int(rank)
        self._local_begin, self._local_end = int(local_begin), int(local_end)
        self._local_seq_len, self._max_send = int(local_seq_len), int(max_send)

    @classmethod
    def __obj_unflatten__(cls, flat):
        return cls(**dict(flat))

    def world(self):
        return self._world

    def rank(self):
        return self._rank

    def local_begin(self):
        return self._local_begin

    def local_end(self):
        return self._local_end

    def local_seq_len(self):
        return self._local_seq_len

    def max_send(self):
        return self._max_send

    def handle(self):
        return torch.empty((1,), dtype=torch.int64)


# ---------------------------------------------------------------------------
# Output allocation, as tensors.cpp does it

def _dim(t, i):
    """dim_or_zero: size of dim i of t, 0 when t is absent or lacks it."""
    if t is None:
        return 0
    i = i + t.dim() if i < 0 else i
    return t.size(i) if 0 <= i < t.dim() else 0


def _rows(t):
    """leading_rows: the product of every dim but the last (0 below 2-D)."""
    if t is None or t.dim() < 2:
        return 0
    rows = 1
    for size in t.shape[:-1]:
        rows = rows * size
    return rows


def _matrix(t):
    return (_dim(t, 0), _dim(t, 1))


def _empty(like, shape, dtype):
    return torch.empty(shape, dtype=dtype, device=like.device if like is not None else "cpu")


def _maybe(wanted, like, shape, dtype):
    return _empty(like, shape, dtype) if wanted else None


def _like(t, wanted=True):
    return torch.empty(t.shape, dtype=t.dtype, device=t.device) if wanted and t is not None else None


def _table_grad(wanted, table, like):
    return _empty(like, _matrix(table), table.dtype) if wanted and table is not None else None


def _hidden_of(width, parts, name, layout):
    # the kernel reports an uneven width before anything is allocated (ops.cpp, hidden_of)
    if width % parts != 0:
        raise ValueError(f"{name} must be {layout}: its width {width} is not a multiple of {parts}")
    return width // parts


def _sizes(plan):
    """The plan whose sizes a fake kernel reads: a real plan itself, else the fake plan that a
    traced plan (torch's FakeScriptObject) wraps."""
    return plan if isinstance(plan, torch.ScriptObject) else plan.wrapped_obj


def _seq_len(plan):
    """S of a plan argument: a plan's (real or fake) seq_len(), or the length of its tables (the
    `.tables` overloads: an (S,) tensor)."""
    return plan.shape[0] if isinstance(plan, torch.Tensor) else _sizes(plan).seq_len()


# ---------------------------------------------------------------------------
# The fake kernels, in the order of ops.h and distributed.h

def _timestep_sinusoid(timesteps, num_channels, max_period, numerics, check_range=True, flip_sin_to_cos=True,
                       downscale_freq_shift=0.0, scale=1.0, t_max=1.0):
    if num_channels < 1:
        raise ValueError(f"num_channels must be positive, got {num_channels}")
    return _empty(timesteps, (_dim(timesteps, 0), num_channels), torch.float32)


def _timestep_sinusoid_backward(grad_features, timesteps, max_period, numerics, check_range=True,
                                flip_sin_to_cos=True, downscale_freq_shift=0.0, scale=1.0, t_max=1.0):
    return _empty(timesteps, (_dim(timesteps, 0),), timesteps.dtype)


def _linear(x, weight, bias, activation, numerics):
    shape = (_dim(x, 0), _dim(weight, 0))
    return _empty(x, shape, x.dtype), _empty(x, shape if activation == "silu" else (0,), torch.float32)


def _linear_backward(grad, x, weight, pre, activation, numerics, output_mask):
    return (_maybe(output_mask[0], x, _matrix(x), x.dtype), _maybe(output_mask[1], x, _matrix(weight), weight.dtype),
            _maybe(output_mask[2], x, (_dim(weight, 0),), weight.dtype))


def _mlp_dtype(x):
    """The MLP's dtype: the input's (fp32 or bf16; the kernel refuses any other)."""
    return x.dtype if x.dtype.is_floating_point else torch.float32


def _timestep_mlp(features, w1, b1, w2, b2, numerics):
    rows, hidden, dtype = _dim(features, 0), _dim(w1, 0), _mlp_dtype(features)
    return (_empty(features, (rows, _dim(w2, 0)), dtype), _empty(features, (rows, hidden), dtype),
            _empty(features, (rows, hidden), dtype))


def _timestep_mlp_backward(grad_temb, features, w1, w2, pre, hidden, numerics, output_mask):
    dtype = _mlp_dtype(features)
    return (_maybe(output_mask[0], features, _matrix(features), dtype),
            _maybe(output_mask[1], features, _matrix(w1), dtype), _maybe(output_mask[2], features, (_dim(w1, 0),), dtype),
            _maybe(output_mask[3], features, _matrix(w2), dtype), _maybe(output_mask[4], features, (_dim(w2, 0),), dtype))


def _adaln_projection_with(columns, temb, weight):
    return (_empty(temb, (_dim(temb, 0), columns), weight.dtype), _empty(temb, _matrix(temb), weight.dtype))


def _adaln_projection(temb, weight, bias, numerics, chunks=0):
    return _adaln_projection_with(_dim(weight, 0), temb, weight)


def _adaln_projection_backward(grad_table, temb, weight, act, numerics, output_mask, chunks=0):
    # d_temb in temb's dtype (float32 but for a family's bf16 temb)
    return (_maybe(output_mask[0], temb, _matrix(temb), temb.dtype),
            _maybe(output_mask[1], temb, _matrix(weight), weight.dtype),
            _maybe(output_mask[2], temb, (_dim(weight, 0),), weight.dtype))


def _adaln_table_add(table, proj):
    dtype = table.dtype if table.dtype == proj.dtype else torch.float32
    return _empty(proj, (_dim(proj, 0), _dim(table, 0), _dim(table, 1)), dtype)


def _adaln_table_add_backward(grad, table_dtype, proj_dtype, proj_broadcast, output_mask):
    rows, k, hidden = _dim(grad, 0), _dim(grad, 1), _dim(grad, 2)
    return (_maybe(output_mask[0], grad, (k, hidden), table_dtype),
            _maybe(output_mask[1], grad, (rows, 1 if proj_broadcast else k, hidden), proj_dtype))


def _adaln_row_gather(rows, plan):
    hidden = _hidden_of(_dim(rows, 1), 6, "rows", "(R, 6H)")
    return _empty(rows, (6, _seq_len(plan), hidden), rows.dtype)


def _adaln_row_gather_backward(grad, plan):
    return _empty(grad, (_sizes(plan).num_rows(), 6 * _dim(grad, -1)), grad.dtype)


def _rmsnorm(x, weight, shift, scale, plan, eps, numerics):
    return _like(x), _empty(x, (_rows(x),), torch.float32)


def _rmsnorm_backward(grad, x, weight, shift, scale, plan, rstd, eps, numerics, output_mask):
    return (_like(x, output_mask[0]), _maybe(output_mask[1], x, (_dim(weight, 0),), weight.dtype),
            _table_grad(output_mask[2], shift, x), _table_grad(output_mask[3], scale, x))


def _gate_residual(residual, y, gate, plan):
    return _like(residual)


def _gate_residual_backward(grad, y, gate, plan, output_mask):
    return (_like(y, output_mask[0]), _like(y, output_mask[1]),
            _maybe(output_mask[2], y, _matrix(gate), gate.dtype))


def _modulated_out(x, modulation, upcast):
    # numerics 5.12: fp32 out for fp32 modulation with upcast false, else x's dtype (ops.cpp)
    fp32 = modulation is not None and modulation.dtype == torch.float32 and not upcast
    return _empty(x, tuple(x.shape), torch.float32 if fp32 else x.dtype)


def _modulation_grad(wanted, modulation, like, plan):
    # the indexed form's (R, H) table, else the modulation tensor's own shape (ops.cpp)
    if not wanted or modulation is None:
        return None
    shape = _matrix(modulation) if plan is not None else tuple(modulation.shape)
    return _empty(like, shape, modulation.dtype)


def _rmsnorm_forms(x, weight, shift, scale, plan, eps, numerics, upcast):
    return _modulated_out(x, shift, upcast), _empty(x, (_rows(x),), torch.float32)


def _rmsnorm_backward_forms(grad, x, weight, shift, scale, plan, rstd, eps, numerics, upcast, output_mask):
    return (_like(x, output_mask[0]), _maybe(output_mask[1], x, (_dim(weight, 0),), weight.dtype),
            _modulation_grad(output_mask[2], shift, x, plan), _modulation_grad(output_mask[3], scale, x, plan))


def _gate_residual_forms(residual, y, gate, plan, upcast, k):
    return _modulated_out(residual, gate, upcast)


def _gate_residual_backward_forms(grad, y, gate, plan, upcast, k, output_mask):
    return (_like(y, output_mask[0]), _like(y, output_mask[1]), _modulation_grad(output_mask[2], gate, y, plan))


def _gate_residual_rmsnorm(residual, y, gate, weight, shift, scale, plan, eps, numerics):
    return _like(residual), _like(residual), _empty(residual, (_rows(residual),), torch.float32)


def _gate_residual_rmsnorm_backward(d_out, d_h, y, gate, weight, shift, scale, plan, h, rstd, eps, numerics,
                                    output_mask):
    # no d_out: the gate_residual backward of d_h alone; neither: nothing (ops.cpp)
    if d_out is None:
        if d_h is None:
            return (None,) * 6
        return (*_gate_residual_backward(d_h, y, gate, plan, output_mask[:3]), None, None, None)
    return (_like(h, output_mask[0]), _like(h, output_mask[1]), _maybe(output_mask[2], h, _matrix(gate), gate.dtype),
            _maybe(output_mask[3], h, (_dim(weight, 0),), weight.dtype), _table_grad(output_mask[4], shift, h),
            _table_grad(output_mask[5], scale, h))


def _gate_residual_rmsnorm_forms(residual, y, gate, weight, shift, scale, plan, eps, numerics, upcast, k):
    # (h, out, rstd): h gate_residual's out, out rmsnorm's of h (ops.cpp)
    h = _modulated_out(residual, gate, upcast)
    out, rstd = _rmsnorm_forms(h, weight, shift, scale, plan, eps, numerics, upcast)
    return h, out, rstd


def _gate_residual_rmsnorm_backward_forms(d_out, d_h, y, gate, weight, shift, scale, plan, h, rstd, eps, numerics,
                                          upcast, k, output_mask):
    # no d_out: the gate_residual backward of d_h alone; neither: nothing (ops.cpp)
    if d_out is None:
        if d_h is None:
            return (None,) * 6
        return (*_gate_residual_backward_forms(d_h, y, gate, plan, upcast, k, output_mask[:3]), None, None, None)
    norm = _rmsnorm_backward_forms(d_out, h, weight, shift, scale, plan, rstd, eps, numerics, upcast,
                                   (False,) + tuple(output_mask[3:]))
    return (*_gate_residual_backward_forms(d_out, y, gate, plan, upcast, k, output_mask[:3]), *norm[1:])


def _final_adaln_out(x, norm_weight, temb, weight, bias, plan, eps, numerics):
    return (_like(x), _empty(x, (_dim(temb, 0), _dim(weight, 0)), weight.dtype),
            _empty(x, _matrix(temb), weight.dtype), _empty(x, (_rows(x),), torch.float32))


def _final_adaln_out_backward(grad, x, norm_weight, temb, weight, table, act, rstd, plan, eps, numerics, output_mask):
    return (_like(x, output_mask[0]), _maybe(output_mask[1], x, (_dim(norm_weight, 0),), norm_weight.dtype),
            _maybe(output_mask[2], x, _matrix(temb), torch.float32), _maybe(output_mask[3], x, _matrix(weight), weight.dtype),
            _maybe(output_mask[4], x, (_dim(weight, 0),), weight.dtype))


def _adaln_modulation(temb, weight, bias, plan, numerics):
    outputs = _dim(weight, 0)
    hidden = _hidden_of(outputs, 18, "weight", "(18H, D)")
    return (_empty(temb, (6, _seq_len(plan), hidden), weight.dtype),
            _empty(temb, (_dim(temb, 0), outputs), weight.dtype), _empty(temb, _matrix(temb), weight.dtype))


def _adaln_modulation_backward(grad, temb, weight, act, plan, numerics, output_mask):
    return _adaln_projection_backward(grad, temb, weight, act, numerics, output_mask)


def _tp_adaln_projection(temb, weight, bias, comm, numerics, out_features=None, chunks=0):
    from .distributed import _world_of
    columns = _world_of(comm) * _dim(weight, 0) if out_features is None else out_features
    return _adaln_projection_with(columns, temb, weight)


def _tp_adaln_projection_backward(grad_table, temb, weight, act, comm, numerics, output_mask, chunks=0):
    return _adaln_projection_backward(grad_table, temb, weight, act, numerics, output_mask)


def _sp_rmsnorm(x, weight, shift, scale, sp, comm, eps, numerics):
    return _rmsnorm(x, weight, shift, scale, None, eps, numerics)


def _sp_rmsnorm_backward(grad, x, weight, shift, scale, sp, rstd, comm, eps, numerics):
    # every gradient on every rank (distributed.h)
    return _rmsnorm_backward(grad, x, weight, shift, scale, None, rstd, eps, numerics, (True,) * 4)


def _sp_gate_residual(residual, y, gate, sp, comm):
    return _like(residual)


def _sp_gate_residual_backward(grad, y, gate, sp, comm):
    return _gate_residual_backward(grad, y, gate, None, (True,) * 3)


def _sp_gate_residual_rmsnorm(residual, y, gate, weight, shift, scale, sp, comm, eps, numerics):
    return _gate_residual_rmsnorm(residual, y, gate, weight, shift, scale, None, eps, numerics)


def _sp_gate_residual_rmsnorm_backward(d_out, d_h, y, gate, weight, shift, scale, sp, h, rstd, comm, eps, numerics):
    return _gate_residual_rmsnorm_backward(d_out, d_h, y, gate, weight, shift, scale, None, h, rstd, eps, numerics,
                                           (True,) * 6)


def _adaln_row_gather_backward_handle(grad, plan_handle, num_rows):
    return _empty(grad, (num_rows, 6 * _dim(grad, -1)), grad.dtype)


def _layernorm(x, weight, bias, eps, numerics):
    return _like(x), _empty(x, (_rows(x),), torch.float32), _empty(x, (_rows(x),), torch.float32)


def _layernorm_backward(grad, x, weight, bias, mean, rstd, eps, numerics, output_mask):
    # a parameter's gradient only where it is asked for and the parameter is given (ops.cpp)
    return (_like(x, output_mask[0]),
            _maybe(output_mask[1] and weight is not None, x, (_dim(x, -1),), weight.dtype if weight is not None else x.dtype),
            _maybe(output_mask[2] and bias is not None, x, (_dim(x, -1),), bias.dtype if bias is not None else x.dtype))


def _layernorm_forms(x, weight, bias, shift, scale, plan, eps, numerics, upcast):
    rows = (_rows(x),)
    return _modulated_out(x, shift, upcast), _empty(x, rows, torch.float32), _empty(x, rows, torch.float32)


def _layernorm_backward_forms(grad, x, weight, bias, shift, scale, plan, mean, rstd, eps, numerics, upcast,
                              output_mask):
    return (*_layernorm_backward(grad, x, weight, bias, mean, rstd, eps, numerics, output_mask[:3]),
            _modulation_grad(output_mask[3], shift, x, plan), _modulation_grad(output_mask[4], scale, x, plan))


def _gate_residual_layernorm(residual, y, gate, weight, bias, shift, scale, plan, eps, numerics, upcast, k):
    # (out, h, mean, rstd): h gate_residual's out, out layernorm's of h (ops.cpp)
    h = _modulated_out(residual, gate, upcast)
    out, mean, rstd = _layernorm_forms(h, weight, bias, shift, scale, plan, eps, numerics, upcast)
    return out, h, mean, rstd


def _gate_residual_layernorm_backward(d_out, d_h, y, gate, weight, bias, shift, scale, plan, h, mean, rstd, eps,
                                      numerics, upcast, k, output_mask):
    # no d_out: the gate_residual backward of d_h alone; neither: nothing (ops.cpp)
    if d_out is None:
        if d_h is None:
            return (None,) * 7
        return (*_gate_residual_backward_forms(d_h, y, gate, plan, upcast, k, output_mask[:3]), None, None, None, None)
    norm = _layernorm_backward_forms(d_out, h, weight, bias, shift, scale, plan, mean, rstd, eps, numerics, upcast,
                                     (False,) + tuple(output_mask[3:]))
    return (*_gate_residual_backward_forms(d_out, y, gate, plan, upcast, k, output_mask[:3]), *norm[1:])


def _sp_rmsnorm_forms(x, weight, shift, scale, sp, comm, eps, numerics, upcast):
    return _rmsnorm_forms(x, weight, shift, scale, None, eps, numerics, upcast)


def _sp_rmsnorm_backward_forms(grad, x, weight, shift, scale, sp, rstd, comm, eps, numerics, upcast):
    # every gradient on every rank; a modulation gradient has its tensor's shape (distributed.h)
    return _rmsnorm_backward_forms(grad, x, weight, shift, scale, None, rstd, eps, numerics, upcast, (True,) * 4)


def _sp_gate_residual_forms(residual, y, gate, sp, comm, upcast, k):
    return _gate_residual_forms(residual, y, gate, None, upcast, k)


def _sp_gate_residual_backward_forms(grad, y, gate, sp, comm, upcast, k):
    return _gate_residual_backward_forms(grad, y, gate, None, upcast, k, (True,) * 3)


def _sp_gate_residual_rmsnorm_forms(residual, y, gate, weight, shift, scale, sp, comm, eps, numerics, upcast, k):
    return _gate_residual_rmsnorm_forms(residual, y, gate, weight, shift, scale, None, eps, numerics, upcast, k)


def _sp_gate_residual_rmsnorm_backward_forms(d_out, d_h, y, gate, weight, shift, scale, sp, h, rstd, comm, eps,
                                             numerics, upcast, k):
    # every gradient on every rank; a modulation gradient has its tensor's shape (distributed.h)
    return _gate_residual_rmsnorm_backward_forms(d_out, d_h, y, gate, weight, shift, scale, None, h, rstd, eps,
                                                 numerics, upcast, k, (True,) * 6)


def _sp_layernorm(x, weight, bias, shift, scale, sp, comm, eps, numerics, upcast):
    return _layernorm_forms(x, weight, bias, shift, scale, None, eps, numerics, upcast)


def _sp_layernorm_backward(grad, x, weight, bias, shift, scale, sp, mean, rstd, comm, eps, numerics, upcast):
    # every gradient on every rank; a modulation gradient has its tensor's shape (distributed.h)
    return _layernorm_backward_forms(grad, x, weight, bias, shift, scale, None, mean, rstd, eps, numerics, upcast,
                                     (True,) * 5)


def _sp_gate_residual_layernorm(residual, y, gate, weight, bias, shift, scale, sp, comm, eps, numerics, upcast, k):
    return _gate_residual_layernorm(residual, y, gate, weight, bias, shift, scale, None, eps, numerics, upcast, k)


def _sp_gate_residual_layernorm_backward(d_out, d_h, y, gate, weight, bias, shift, scale, sp, h, mean, rstd, comm,
                                         eps, numerics, upcast, k):
    return _gate_residual_layernorm_backward(d_out, d_h, y, gate, weight, bias, shift, scale, None, h, mean, rstd,
                                             eps, numerics, upcast, k, (True,) * 7)


FAKE_KERNELS = {
    "timestep_sinusoid": _timestep_sinusoid, "timestep_sinusoid_backward": _timestep_sinusoid_backward,
    "linear": _linear, "linear_backward": _linear_backward,
    "timestep_mlp": _timestep_mlp, "timestep_mlp_backward": _timestep_mlp_backward,
    "adaln_projection": _adaln_projection, "adaln_projection_backward": _adaln_projection_backward,
    "adaln_table_add": _adaln_table_add, "adaln_table_add_backward": _adaln_table_add_backward,
    "adaln_row_gather": _adaln_row_gather, "adaln_row_gather_backward": _adaln_row_gather_backward,
    "rmsnorm": _rmsnorm, "rmsnorm_backward": _rmsnorm_backward,
    "rmsnorm.plan": _rmsnorm, "rmsnorm_backward.plan": _rmsnorm_backward,
    "rmsnorm.forms": _rmsnorm_forms, "rmsnorm_backward.forms": _rmsnorm_backward_forms,
    "gate_residual.forms": _gate_residual_forms, "gate_residual_backward.forms": _gate_residual_backward_forms,
    "gate_residual": _gate_residual, "gate_residual_backward": _gate_residual_backward,
    "gate_residual_rmsnorm": _gate_residual_rmsnorm, "gate_residual_rmsnorm_backward": _gate_residual_rmsnorm_backward,
    "gate_residual_rmsnorm.forms": _gate_residual_rmsnorm_forms,
    "gate_residual_rmsnorm_backward.forms": _gate_residual_rmsnorm_backward_forms,
    "final_adaln_out": _final_adaln_out, "final_adaln_out_backward": _final_adaln_out_backward,
    "adaln_modulation": _adaln_modulation, "adaln_modulation_backward": _adaln_modulation_backward,
    "tp_adaln_projection": _tp_adaln_projection, "tp_adaln_projection_backward": _tp_adaln_projection_backward,
    "sp_rmsnorm": _sp_rmsnorm, "sp_rmsnorm_backward": _sp_rmsnorm_backward,
    "sp_gate_residual": _sp_gate_residual, "sp_gate_residual_backward": _sp_gate_residual_backward,
    "sp_gate_residual_rmsnorm": _sp_gate_residual_rmsnorm,
    "sp_gate_residual_rmsnorm_backward": _sp_gate_residual_rmsnorm_backward,
    "layernorm": _layernorm, "layernorm_backward": _layernorm_backward,
    "layernorm.forms": _layernorm_forms, "layernorm_backward.forms": _layernorm_backward_forms,
    "gate_residual_layernorm": _gate_residual_layernorm,
    "gate_residual_layernorm_backward": _gate_residual_layernorm_backward,
    "sp_rmsnorm.forms": _sp_rmsnorm_forms, "sp_rmsnorm_backward.forms": _sp_rmsnorm_backward_forms,
    "sp_gate_residual.forms": _sp_gate_residual_forms, "sp_gate_residual_backward.forms": _sp_gate_residual_backward_forms,
    "sp_gate_residual_rmsnorm.forms": _sp_gate_residual_rmsnorm_forms,
    "sp_gate_residual_rmsnorm_backward.forms": _sp_gate_residual_rmsnorm_backward_forms,
    "sp_layernorm": _sp_layernorm, "sp_layernorm_backward": _sp_layernorm_backward,
    "sp_gate_residual_layernorm": _sp_gate_residual_layernorm,
    "sp_gate_residual_layernorm_backward": _sp_gate_residual_layernorm_backward,
}
# The `.handle` overloads of the backward ops (the plan's handle in its place, registration.cpp;
# `.forms_handle` for a `.forms` overload): the same outputs, which no fake kernel reads from the
# plan but adaln_row_gather's (num_rows).
FAKE_KERNELS.update({f"{name}.handle": FAKE_KERNELS[name] for name in (
    "rmsnorm_backward", "gate_residual_backward", "gate_residual_rmsnorm_backward", "final_adaln_out_backward",
    "adaln_modulation_backward", "sp_rmsnorm_backward", "sp_gate_residual_backward",
    "sp_gate_residual_rmsnorm_backward", "sp_layernorm_backward", "sp_gate_residual_layernorm_backward")})
FAKE_KERNELS.update({f"{name}_handle": FAKE_KERNELS[name] for name in (
    "sp_rmsnorm_backward.forms", "sp_gate_residual_backward.forms", "sp_gate_residual_rmsnorm_backward.forms")})
FAKE_KERNELS["adaln_row_gather_backward.handle"] = _adaln_row_gather_backward_handle
# The `.tables` overloads (the plan's tables in its place, registration.cpp): the same outputs, S
# from the tables' length.
FAKE_KERNELS.update({f"{name}.tables": FAKE_KERNELS[name] for name in (
    "adaln_row_gather", "gate_residual", "gate_residual_rmsnorm", "final_adaln_out", "adaln_modulation",
    "rmsnorm_backward", "gate_residual_backward", "gate_residual_rmsnorm_backward", "final_adaln_out_backward",
    "adaln_modulation_backward")})
FAKE_KERNELS.update({"rmsnorm.tables": _rmsnorm, "adaln_row_gather_backward.tables": _adaln_row_gather_backward_handle})


def _plan_handle(plan):
    return torch.empty((1,), dtype=torch.int64)  # plan.cpp: one int64 on the CPU


FAKE_KERNELS.update({"plan_handle": _plan_handle, "plan_handle.sp": _plan_handle})


# ---------------------------------------------------------------------------
# Meta tensors given to an op eagerly

# The type of torch's fake tensors (torch.compile's tracing, FakeTensorMode); None where this
# torch has none.
try:
    from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor
except ImportError:
    _FakeTensor = None


def is_eager_meta(value):
    """Whether value is a meta tensor that is not tracing's (see refuse_meta)."""
    return (isinstance(value, torch.Tensor) and value.is_meta
            and not (_FakeTensor is not None and isinstance(value, _FakeTensor)))


def refuse_meta(name, args, kwargs):
    """The ValueError that tensors.cpp's view() raises for a tensor on neither the CPU nor CUDA,
    for the first argument of the op overload `name` (a key of FAKE_KERNELS) that is a meta
    tensor, in the schema's order; nothing when none is.

    A meta tensor never reaches the C++ kernels: the dispatcher sends a call with one to the
    op's Meta kernel. Torch without fake kernels has none (the call would be the dispatcher's
    NotImplementedError), so _register_meta_refusals registers this there; from torch 2.4 the
    Meta kernel is the fake kernel (torch.library.register_fake registers it at Meta too),
    which calls this first. The two callers of a fake kernel are told apart by the tensors'
    type: tracing (torch.compile, FakeTensorMode) passes FakeTensors, which are meta tensors
    underneath (their device reads "meta" inside a kernel) and are let through; a plain meta
    tensor is a caller's eager call, refused like any other device detdit does not run on."""
    names = [argument.name for argument in _overload(name)._schema.arguments]
    values = {**dict(zip(names, args)), **kwargs}
    for argument in names:
        if is_eager_meta(values.get(argument)):
            raise ValueError(f"{argument} must be a CPU or CUDA tensor, got one on meta")


def _refusing_meta(name, kernel):
    """The fake kernel `kernel` of `name`, refusing a plain meta tensor first (refuse_meta)."""
    def fake_kernel(*args, **kwargs):
        refuse_meta(name, args, kwargs)
        return kernel(*args, **kwargs)

    return fake_kernel


# ---------------------------------------------------------------------------
# The autograd of ops traced with a fake plan: autograd.h's Functions, in Python

def _contiguous(grad):
    return grad.contiguous() if grad is not None else None


# Per op: how many leading arguments get a gradient, the outputs marked non-differentiable,
# whether absent gradients are materialised as zeros, and the backward call of
# (arguments, outputs, grads, mask) -> that many gradients. Each is autograd.h's Function's
# call, with the plan given to the backward op's `overload` in the plan's place:
# - "handle" (TRACED_AUTOGRAD): the plan's handle, saved instead of the plan (torch 2.11's
#   AOTAutograd refuses a plan saved for a compiled backward, and saves the handle, a tensor);
# - "tables" (TABLES_AUTOGRAD, the `.tables` overloads' own autograd): the plan's tables, a
#   tensor saved as it is.
# adaln_row_gather's backward also takes the plan's num_rows: the rows' first dimension, which
# the forward checked equal to it.
def _index_plan_autograd(overload):
    def backward(op):
        return getattr(getattr(_ops, op + "_backward"), overload)

    return {
        "adaln_row_gather": (1, (), True, lambda a, o, g, m: (backward("adaln_row_gather")(
            _contiguous(g[0]), a[1], a[0].shape[0]),)),
        "rmsnorm": (4, (1,), True, lambda a, o, g, m: backward("rmsnorm")(
            _contiguous(g[0]), a[0], a[1], a[2], a[3], a[4], o[1], a[5], a[6], m)),
        "gate_residual": (3, (), True, lambda a, o, g, m: backward("gate_residual")(
            _contiguous(g[0]), a[1], a[2], a[3], m)),
        # h and out may each get a gradient or none: not materialised (GateResidualRmsnormFunction)
        "gate_residual_rmsnorm": (6, (2,), False, lambda a, o, g, m: backward("gate_residual_rmsnorm")(
            _contiguous(g[1]), _contiguous(g[0]), a[1], a[2], a[3], a[4], a[5], a[6], o[0], o[2], a[7], a[8], m)),
        "final_adaln_out": (5, (1, 2, 3), True, lambda a, o, g, m: backward("final_adaln_out")(
            _contiguous(g[0]), a[0], a[1], a[2], a[3], o[1], o[2], o[3], a[5], a[6], a[7], m)),
        "adaln_modulation": (3, (1, 2), True, lambda a, o, g, m: backward("adaln_modulation")(
            _contiguous(g[0]), a[0], a[1], o[2], a[3], a[4], m)),
    }


# The ops traced with a fake plan (rmsnorm's through its `.plan` overload) and the sp_ ops.
TRACED_AUTOGRAD = {
    **{"rmsnorm.plan" if name == "rmsnorm" else name: entry
       for name, entry in _index_plan_autograd("handle").items()},
    "sp_rmsnorm": (4, (1,), True, lambda a, o, g, m: _ops.sp_rmsnorm_backward.handle(
        _contiguous(g[0]), a[0], a[1], a[2], a[3], a[4], o[1], a[5], a[6], a[7])),
    "sp_gate_residual": (3, (), True, lambda a, o, g, m: _ops.sp_gate_residual_backward.handle(
        _contiguous(g[0]), a[1], a[2], a[3], a[4])),
    "sp_gate_residual_rmsnorm": (6, (2,), False, lambda a, o, g, m: _ops.sp_gate_residual_rmsnorm_backward.handle(
        _contiguous(g[1]), _contiguous(g[0]), a[1], a[2], a[3], a[4], a[5], a[6], o[0], o[2], a[7], a[8], a[9])),
    # the modulation forms' sp_ ops: autograd.h's Sp*Forms / SpLayernorm / SpGateResidualLayernorm Functions
    "sp_rmsnorm.forms": (4, (1,), True, lambda a, o, g, m: _ops.sp_rmsnorm_backward.forms_handle(
        _contiguous(g[0]), a[0], a[1], a[2], a[3], a[4], o[1], a[5], a[6], a[7], a[8])),
    "sp_gate_residual.forms": (3, (), True, lambda a, o, g, m: _ops.sp_gate_residual_backward.forms_handle(
        _contiguous(g[0]), a[1], a[2], a[3], a[4], a[5], a[6])),
    "sp_gate_residual_rmsnorm.forms": (6, (2,), False, lambda a, o, g, m: (
        _ops.sp_gate_residual_rmsnorm_backward.forms_handle(
            _contiguous(g[1]), _contiguous(g[0]), a[1], a[2], a[3], a[4], a[5], a[6], o[0], o[2], a[7], a[8], a[9],
            a[10], a[11]))),
    "sp_layernorm": (5, (1, 2), True, lambda a, o, g, m: _ops.sp_layernorm_backward.handle(
        _contiguous(g[0]), a[0], a[1], a[2], a[3], a[4], a[5], o[1], o[2], a[6], a[7], a[8], a[9])),
    # out and h may each get a gradient or none: not materialised (SpGateResidualLayernormFunction)
    "sp_gate_residual_layernorm": (7, (2, 3), False, lambda a, o, g, m: (
        _ops.sp_gate_residual_layernorm_backward.handle(
            _contiguous(g[0]), _contiguous(g[1]), a[1], a[2], a[3], a[4], a[5], a[6], a[7], o[1], o[2], o[3], a[8],
            a[9], a[10], a[11], a[12]))),
}


# The Autograd kernel of each `.tables` overload on every torch, eager and traced
# (_register_tables_autograd).
TABLES_AUTOGRAD = {name + ".tables": entry for name, entry in _index_plan_autograd("tables").items()}


def _is_plan(arg):
    """A plan argument: a torch-class object (eager) or the fake that tracing gives one."""
    return isinstance(arg, (torch.ScriptObject, *FAKE_PLAN_TYPES))


def _is_sp_plan(plan):
    """An SpPlan, real or fake (it has local_seq_len(); an IndexPlan has not)."""
    return hasattr(_sizes(plan), "local_seq_len")


def _handle_of(plan):
    """plan.handle() through the op (``plan_handle``, ``plan_handle.sp``), which tracing sees."""
    return _ops.plan_handle.sp(plan) if _is_sp_plan(plan) else _ops.plan_handle.default(plan)


def _overload(name):
    op, _, overload = name.partition(".")
    return getattr(getattr(_ops, op), overload or "default")


def _below_autograd(op, args):
    """op(*args) with the autograd keys skipped, as at::AutoDispatchBelowAutograd: torch 2.x
    binds the guard as a context manager, torch 1.x as an object that holds it while alive
    (the tests run these Functions there too)."""
    guard = torch._C._AutoDispatchBelowAutograd()
    if hasattr(guard, "__enter__"):
        with guard:
            return op(*args)
    result = op(*args)
    del guard
    return result


def autograd_function(name):
    """The torch.autograd.Function of the op overload `name` (a key of TRACED_AUTOGRAD or
    TABLES_AUTOGRAD): its
    forward runs the op below autograd and saves every argument and output; its backward
    makes the backward call autograd.h's Function makes, with the mask of the leading
    arguments that need a gradient."""
    num_grads, non_differentiable, materialize, backward_call = {**TRACED_AUTOGRAD, **TABLES_AUTOGRAD}[name]
    op = _overload(name)

    def forward(ctx, *args):
        result = _below_autograd(op, args)
        # a tuple, or a list where torch's effect handling ran the op (see _register)
        outs = tuple(result) if isinstance(result, (tuple, list)) else (result,)
        # tensors and the plans' handles are saved (a plan itself never is: see TRACED_AUTOGRAD)
        is_plan = [_is_plan(a) for a in args]
        saved = [_handle_of(a) if p else a if isinstance(a, torch.Tensor) else None for a, p in zip(args, is_plan)]
        ctx.save_for_backward(*saved, *outs)
        ctx.others = [None if s is not None else a for a, s in zip(args, saved)]
        ctx.mark_non_differentiable(*[outs[i] for i in non_differentiable])
        ctx.set_materialize_grads(materialize)
        return outs if len(outs) > 1 else outs[0]

    def backward(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(_FIRST_ORDER_ONLY)
        saved, others = ctx.saved_tensors, ctx.others
        args = [s if o is None else o for s, o in zip(saved, others)]
        outs = saved[len(others):]
        grads_in = backward_call(args, outs, grads, list(ctx.needs_input_grad[:num_grads]))
        return (*grads_in, *([None] * (len(args) - num_grads)))

    return type(f"Traced{name.replace('.', '_')}Function", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})


def _register_autograd():
    for name in TRACED_AUTOGRAD:
        apply = autograd_function(name).apply
        for key in (torch._C.DispatchKey.AutogradCPU, torch._C.DispatchKey.AutogradCUDA):
            _overload(name).py_impl(key)(apply)


# The registrations of _register_tables_autograd, kept alive with the module (a torch.library
# Library removes its registrations when it is freed).
_TABLES_LIBRARY = []


# The Meta kernels of _register_meta_refusals, kept alive with the module.
_META_LIBRARY = []


def _register_meta_refusals():
    """On a torch without fake kernels, the Meta and AutogradMeta kernels of every op with a
    tensor argument: refuse_meta (plan_handle takes none; the plan constructors validate their
    tensors' device in C++, release_scratch_memory takes none). AutogradMeta too: torch 1.x has
    no fallthrough there, so an op without an Autograd kernel (the backward ops) would stop at
    it with the dispatcher's NotImplementedError; torch 2.x falls through to Meta."""
    library = torch.library.Library("detdit", "IMPL")
    for name in FAKE_KERNELS:
        if not name.startswith("plan_handle"):
            for key in ("Meta", "AutogradMeta"):
                library.impl(name, lambda *args, _name=name, **kwargs: refuse_meta(_name, args, kwargs), key)
    _META_LIBRARY.append(library)


def _register_tables_autograd():
    """The Autograd kernel of each `.tables` overload: its Function (autograd_function), on every
    torch. No plan object takes part, so the C++ dispatcher runs it in eager and in tracing alike."""
    library = torch.library.Library("detdit", "IMPL")
    for name in TABLES_AUTOGRAD:
        library.impl(name, autograd_function(name).apply, "Autograd")
    _TABLES_LIBRARY.append(library)


def _register():
    from torch._library.fake_class_registry import register_fake_class
    from torch._higher_order_ops import effects
    for name, kernel in FAKE_KERNELS.items():
        torch.library.register_fake(f"detdit::{name}", _refusing_meta(name, kernel))
        # torch takes an op with a torch-class argument (a plan) for one with side effects and
        # threads ordering tokens through the graph around it; a detdit op is a pure function
        # of its arguments (a plan never changes once built), so it declares no effect. Not
        # the sp_ ops: they run collectives, which every rank must call in program order, and
        # torch's default (ordered, for their SpPlan argument) keeps that order.
        # Nor plan_handle, whose ordering is wanted: only the backward uses a handle, and
        # AOTAutograd's partitioner puts an op that only the backward needs into the backward
        # graph, which then takes the plan itself as a saved input (torch 2.11 refuses a
        # torch-class object saved for the backward). An ordered op's effect token is an output
        # of the forward graph, so the op stays there and the handle, a tensor, is saved.
        if hasattr(effects, "_register_effectful_op") and not name.startswith(("sp_", "plan_handle")):
            effects._register_effectful_op(_overload(name), None)
    register_fake_class("detdit::IndexPlan", FakeIndexPlan)
    register_fake_class("detdit::SpPlan", FakeSpPlan)
    _register_autograd()


#: None when this torch has what the registrations need; else what it lacks.
REASON = None if hasattr(torch.library, "register_fake") else (
    f"torch {torch.__version__} has no torch.library.register_fake (torch >= 2.4): detdit ops are not traceable")
# The type tracing gives a plan argument (a FakeScriptObject wraps a FakeIndexPlan/FakeSpPlan);
# the wrappers in detdit/__init__.py accept it beside torch.ScriptObject. Empty without tracing.
FAKE_PLAN_TYPES = ()
if REASON is None:
    from torch._library.fake_class_registry import FakeScriptObject
    FAKE_PLAN_TYPES = (FakeScriptObject,)
    _register()
else:
    _register_meta_refusals()
_register_tables_autograd()
