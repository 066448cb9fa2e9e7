"""detdit.distributed: tensor and sequence parallelism over a torch.distributed group.

Every rank's outputs and gradients are byte-equal to one process (docs/parallel.md):

- ``tp_adaln_projection(temb, weight_shard, bias_shard, comm, out_features=N, chunks=K)``: rank r
  owns whole 64-column chunks of the ``(T, N)`` table, ``C // tp`` of the ``C = ceil(N / 64)``
  chunks plus one for each of the first ``C % tp`` ranks (``shard_rows(N, tp, r)``: those
  rows of the projection's weight and bias). Every rank gets the full table; backward gives
  the shard's ``dW``/``db`` and the full, replicated ``d_temb``. ``chunks`` as
  ``detdit.adaln_projection``'s: None for H3's projection, a family's chunk count (the same
  on every rank) for a DiT family's.
- ``SpRegion(plan, comm)``: rank r holds positions ``[r*S//sp, (r+1)*S//sp)`` of every batch
  item (``region.local_slice``); the plan (full ``(S,)`` index), the tables and the norm
  weight are replicated. ``region.rmsnorm``, ``region.gate_residual`` and the two fused,
  ``region.gate_residual_rmsnorm``, take the local rows ``(B, S_local, H)``. Their
  replicated gradients (``d_weight``, ``d_shift``,
  ``d_scale``, ``d_gate``) are already the full sums, identical on every rank: do not
  all-reduce them again.

The only collectives are a rank-ordered all-gather and a broadcast of bytes through
``torch.distributed`` (gloo on the CPU, NCCL on GPUs); detdit never reduces inside a
collective. Every call is
checked across ranks, and a validation error on one rank fails the call on every rank.
"""
import torch
import torch.distributed as dist

from . import (_BOOL, _C, H3_NORM_EPS, _INT, _OPTIONAL_INT, _OPTIONAL_REAL, _OPTIONAL_TENSOR, _REAL, _TENSOR, _check,
               _h3_rule, _profile)

__all__ = ["Communicator", "SpRegion", "sp_region", "tp_adaln_projection", "shard_rows"]

_ops = torch.ops.detdit

# The world size of each registered communicator handle, for the fake kernel of
# tp_adaln_projection (its table is world * N wide, detdit._compile).
_WORLDS = {}


def _world_of(handle):
    if handle not in _WORLDS:
        raise ValueError(f"communicator handle {handle} is not registered (use detdit.distributed.Communicator(group))")
    return _WORLDS[handle]


def _global_rank(group, rank):
    # torch.distributed.broadcast names its source by global rank.
    if group is None or group is dist.GroupMember.WORLD:
        return rank
    get = getattr(dist, "get_global_rank", None) or dist.distributed_c10d._get_global_rank
    return get(group, rank)


class Communicator:
    """detdit's view of a torch.distributed process group (default: the world group).

    ``device``: where the ops' buffers live, ``"cpu"`` (default for gloo) or ``"cuda:N"``
    (default for NCCL: the current CUDA device)."""

    def __init__(self, group=None, device=None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        nccl = dist.get_backend(group) == "nccl"
        device = torch.device(device if device is not None else ("cuda" if nccl else "cpu"))
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = str(device)
        world = self.world

        def gather(send, recv, root=None):
            # root None: all-gather, send (bytes,) uint8 into recv (world * bytes,), rank-ordered.
            # root r: broadcast rank r's recv (bytes,) into every rank's recv (send is recv).
            if root is not None:
                staged = recv.to(self.device) if nccl and not recv.is_cuda else recv
                dist.broadcast(staged, src=_global_rank(group, root), group=group)
                if staged is not recv:
                    recv.copy_(staged.cpu())
            elif nccl and not send.is_cuda:  # call headers live on the host; NCCL moves device memory
                staged = send.to(self.device)
                parts = [torch.empty_like(staged) for _ in range(world)]
                dist.all_gather(parts, staged, group=group)
                recv.copy_(torch.cat(parts).cpu())
            else:
                dist.all_gather(list(recv.view(world, -1).unbind(0)), send, group=group)

        self._gather = gather
        self.handle = _C._register_communicator(gather, self.rank, self.world, self.device)
        _WORLDS[self.handle] = self.world

    def __del__(self):
        handle = getattr(self, "handle", None)
        if handle is not None:
            _WORLDS.pop(handle, None)
            _C._release_communicator(handle)


def shard_rows(out_features, world, rank):
    """The ``slice`` of the ``out_features`` weight rows (table columns) that rank ``rank`` of
    a ``world``-way tp_adaln_projection owns: whole 64-row chunks, ``C // world`` of the
    ``C = ceil(out_features / 64)`` chunks and one more for each of the first ``C % world``
    ranks; the last rank's last chunk may be short. ValueError when ``world`` exceeds ``C``
    (or an int is out of range: world and rank must fit in a 32-bit int); TypeError for a
    non-int."""
    _check("shard_rows", out_features=(out_features, _INT), world=(world, _INT), rank=(rank, _INT))
    return slice(*_C._tp_column_shard(out_features, world, rank))


def tp_adaln_projection(temb, weight_shard, bias_shard, comm, numerics="portable", out_features=None, chunks=None):
    """The ``(T, N)`` AdaLN table from this rank's weight rows ``shard_rows(N, tp, rank)`` and
    their bias; byte-equal to ``detdit.adaln_projection`` with the same ``chunks``, gradients
    included. ``out_features`` is N; it may be left out when every rank owns the same number of
    rows (N = tp * the shard's rows). ``chunks=None``: H3's projection (``N = 18H``, temb
    float32); a family's chunk count: N a positive multiple of it, temb float32 or the weight's
    dtype (``detdit.adaln_projection``). Every rank must pass the same ``chunks``: a different
    one fails the call on every rank."""
    _check("tp_adaln_projection", out_features=(out_features, _OPTIONAL_INT), chunks=(chunks, _OPTIONAL_INT))
    if chunks is not None and chunks < 1:
        raise ValueError(f"tp_adaln_projection: chunks must be a positive chunk count or None (H3), got {chunks}")
    return _ops.tp_adaln_projection.default(temb, weight_shard, bias_shard, comm.handle, _profile(numerics),
                                            out_features, chunks or 0)[0]


class SpRegion:
    """The sequence-parallel region of one packed index: build once per step (it derives the
    chunk owners and the rows that move from the replicated plan) and reuse in every block.

    ``plan=None`` with ``seq_len`` (S, the global sequence length) and ``batch`` makes a region
    without an index: positions only, for the per-sample, per-frame and per-token modulation
    forms and the plain ops."""

    def __init__(self, plan, comm, seq_len=None, batch=None):
        self.comm = comm
        self.plan = plan
        if plan is None:
            if seq_len is None or batch is None:
                raise ValueError("a region without an index (plan=None) needs seq_len= and batch=")
            _check("SpRegion", seq_len=(seq_len, _INT), batch=(batch, _INT))
            self.sp = _ops.sp_plan.positions(seq_len, batch, comm.world, comm.rank)
        else:
            if seq_len is not None or batch is not None:
                raise ValueError("seq_len= and batch= are for a region without an index (plan=None); "
                                 "a plan gives its own")
            self.sp = _ops.sp_plan.default(plan, comm.world, comm.rank)

    @property
    def local_slice(self):
        """This rank's positions ``slice(r*S//sp, (r+1)*S//sp)`` of the sequence dim."""
        return slice(self.sp.local_begin(), self.sp.local_end())

    def rmsnorm(self, x, weight, shift=None, scale=None, eps=H3_NORM_EPS, numerics="portable", upcast=False):
        """``detdit.rmsnorm`` of the local rows: the modulation forms and recipes as
        :meth:`layernorm`'s (indexed ``(R, H)`` tables with the region's plan)."""
        _check("SpRegion.rmsnorm", x=(x, _TENSOR), weight=(weight, _TENSOR), shift=(shift, _OPTIONAL_TENSOR),
               scale=(scale, _OPTIONAL_TENSOR), eps=(eps, _REAL), upcast=(upcast, _BOOL))
        if self._h3_rule(x, (shift, scale), upcast):
            return _ops.sp_rmsnorm.default(x, weight, shift, scale, self.sp, self.comm.handle, float(eps),
                                           _profile(numerics))[0]
        return _ops.sp_rmsnorm.forms(x, weight, shift, scale, self.sp, self.comm.handle, float(eps),
                                     _profile(numerics), upcast)[0]

    def gate_residual(self, residual, y, gate=None, k=None, upcast=False):
        """``detdit.gate_residual`` of the local rows: the gate's forms and recipes as
        :meth:`layernorm`'s modulation, the gate optional, the constant k."""
        _check("SpRegion.gate_residual", residual=(residual, _TENSOR), y=(y, _TENSOR),
               gate=(gate, _OPTIONAL_TENSOR), upcast=(upcast, _BOOL), k=(k, _OPTIONAL_REAL))
        if gate is not None and self._h3_rule(residual, (gate,), upcast, k):
            return _ops.sp_gate_residual.default(residual, y, gate, self.sp, self.comm.handle)
        return _ops.sp_gate_residual.forms(residual, y, gate, self.sp, self.comm.handle, upcast,
                                           None if k is None else float(k))

    def _h3_rule(self, x, tables, upcast, k=None):
        # the H3 rule's overloads (an index, tables in x's dtype, no upcast, no k); every other
        # call takes the `.forms` overload
        return self.plan is not None and _h3_rule(x, tables, self.plan, upcast, k)

    def gate_residual_rmsnorm(self, residual, y, gate=None, weight=None, shift=None, scale=None, eps=H3_NORM_EPS,
                              numerics="portable", upcast=False, k=None):
        """``detdit.gate_residual_rmsnorm`` of the local rows: ``(h, out)``, the forms and
        recipes of :meth:`gate_residual` then :meth:`rmsnorm` (the gate optional, k; indexed
        ``(R, H)`` tables with the region's plan), all present modulation tensors in one form;
        weight is required. Every rank must use h and out alike (each needs a gradient on
        every rank or on none), as for the separate ops, whose backward collectives every
        rank runs."""
        _check("SpRegion.gate_residual_rmsnorm", residual=(residual, _TENSOR), y=(y, _TENSOR),
               gate=(gate, _OPTIONAL_TENSOR), weight=(weight, _TENSOR), shift=(shift, _OPTIONAL_TENSOR),
               scale=(scale, _OPTIONAL_TENSOR), eps=(eps, _REAL), upcast=(upcast, _BOOL), k=(k, _OPTIONAL_REAL))
        if gate is not None and self._h3_rule(residual, (gate, shift, scale), upcast, k):
            h, out, _ = _ops.sp_gate_residual_rmsnorm.default(residual, y, gate, weight, shift, scale, self.sp,
                                                              self.comm.handle, float(eps), _profile(numerics))
            return h, out
        h, out, _ = _ops.sp_gate_residual_rmsnorm.forms(residual, y, gate, weight, shift, scale, self.sp,
                                                        self.comm.handle, float(eps), _profile(numerics), upcast,
                                                        None if k is None else float(k))
        return h, out

    def layernorm(self, x, weight=None, bias=None, shift=None, scale=None, eps=1e-5, upcast=False,
                  numerics="portable"):
        """``detdit.layernorm`` of the local rows ``(B, S_local, H)``, with the region's plan for
        the indexed form. Per-sample ``(B, H)`` / ``(B, 1, H)`` and per-frame ``(B, F, H)`` /
        ``(B, F, 1, H)`` shift and scale are replicated and mean the global positions (frame
        ``s // (S/F)`` of the full S); per-token ones are the local rows ``(B, S_local, H)``,
        and so are their gradients."""
        _check("SpRegion.layernorm", x=(x, _TENSOR), weight=(weight, _OPTIONAL_TENSOR),
               bias=(bias, _OPTIONAL_TENSOR), shift=(shift, _OPTIONAL_TENSOR), scale=(scale, _OPTIONAL_TENSOR),
               eps=(eps, _REAL), upcast=(upcast, _BOOL))
        return _ops.sp_layernorm.default(x, weight, bias, shift, scale, self.sp, self.comm.handle, float(eps),
                                         _profile(numerics), upcast)[0]

    def gate_residual_layernorm(self, residual, y, gate=None, weight=None, bias=None, shift=None, scale=None,
                                eps=1e-5, upcast=False, numerics="portable", k=None):
        """``detdit.gate_residual_layernorm`` of the local rows: ``(out, h)``, the modulation
        forms as :meth:`layernorm`'s (no indexed form). Every rank must use out and h alike
        (each needs a gradient on every rank or on none)."""
        _check("SpRegion.gate_residual_layernorm", residual=(residual, _TENSOR), y=(y, _TENSOR),
               gate=(gate, _OPTIONAL_TENSOR), weight=(weight, _OPTIONAL_TENSOR), bias=(bias, _OPTIONAL_TENSOR),
               shift=(shift, _OPTIONAL_TENSOR), scale=(scale, _OPTIONAL_TENSOR), eps=(eps, _REAL),
               upcast=(upcast, _BOOL), k=(k, _OPTIONAL_REAL))
        out, h, _, _ = _ops.sp_gate_residual_layernorm.default(residual, y, gate, weight, bias, shift, scale, self.sp,
                                                               self.comm.handle, float(eps), _profile(numerics),
                                                               upcast, None if k is None else float(k))
        return out, h


def sp_region(plan, comm, seq_len=None, batch=None):
    """``SpRegion(plan, comm, seq_len=..., batch=...)``."""
    return SpRegion(plan, comm, seq_len=seq_len, batch=batch)
