"""detdit: deterministic conditioning-path ops for diffusion transformers (MiniMax-H3).

Every op is a torch operator (``torch.ops.detdit.*``, CPU and CUDA kernels, autograd
in C++, fake kernels for torch.compile in ``detdit._compile``); these functions are thin
wrappers that call an op's overload and pick the primary output. Results are a
pure function of the inputs: the same bits run to run, for any batch composition, and
(``numerics="portable"``) on the CPU and every CUDA GPU. ``numerics="torch"`` replays
PyTorch's CUDA math functions (CUDA tensors only). docs/numerics.md is the contract.

Indexed ops take an :class:`IndexPlan` built once per step by :func:`plan` or
:func:`plan_from_rows` and reused by every block. Errors raise TypeError (an argument
of the wrong type, a dtype), ValueError (shape, device, layout, range), IndexError (index
entries) or RuntimeError (environment) with the library's message.
"""
import numbers

import torch

from . import _C  # noqa: F401  (loading it registers torch.ops.detdit and torch.classes.detdit)
from . import _compile  # noqa: F401  (fake kernels, fake plans: torch.compile support, docs/python.md)
from ._version import __version__  # noqa: F401  (written by setup.py from the repository's VERSION)

__all__ = [
    "IndexPlan", "PlanTables", "plan", "plan_from_rows", "plan_tables", "timestep_sinusoid", "linear", "timestep_mlp",
    "text_projection", "combined_timestep_embedding",
    "adaln_projection", "adaln_table_chunks", "adaln_chunk_order", "adaln_table_add", "final_layer_continuous",
    "final_layer_table", "adaln_row_gather", "rmsnorm", "gate_residual",
    "gate_residual_rmsnorm", "final_adaln_out", "adaln_modulation", "layernorm", "gate_residual_layernorm",
    "H3_HIDDEN_SIZE", "H3_FREQ_DIM", "H3_TIME_EMBED_HIDDEN_DIM", "H3_TIME_EMBED_DIM",
    "H3_MAX_PERIOD", "H3_NORM_EPS", "ADALN_CHUNKS", "NUM_MODALITIES",
]

H3_HIDDEN_SIZE = 5376
H3_FREQ_DIM = 256
H3_TIME_EMBED_HIDDEN_DIM = 5376
H3_TIME_EMBED_DIM = 2688
H3_MAX_PERIOD = 10000
H3_NORM_EPS = 1e-5
ADALN_CHUNKS = 6  # shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp
NUM_MODALITIES = 3  # 0 video, 1 text, 2 audio

_ops = torch.ops.detdit

#: The plan type, ``torch.classes.detdit.IndexPlan``. Methods: seq_len(), batch(),
#: num_rows(), positions(), num_chunks(), num_segments(), device(), row_index(), tables()
#: (:class:`PlanTables`); str() (and,
#: where torch forwards it, repr()) says seq_len, batch, num_rows and device.
IndexPlan = torch.classes.detdit.IndexPlan


# The kinds of argument _check tells apart: (the types that pass, what the message says is
# expected). Under torch.compile a size or a scale may arrive as a symbolic int or float.
_SYM_INT = (torch.SymInt,) if hasattr(torch, "SymInt") else ()
_SYM_FLOAT = (torch.SymFloat,) if hasattr(torch, "SymFloat") else ()
_TENSOR = ((torch.Tensor,), "a torch.Tensor")
_OPTIONAL_TENSOR = ((torch.Tensor, type(None)), "a torch.Tensor or None")
_INT = ((int,) + _SYM_INT, "an int")
_OPTIONAL_INT = ((int, type(None)) + _SYM_INT, "an int or None")
_REAL = ((numbers.Real,) + _SYM_INT + _SYM_FLOAT, "a real number")
_OPTIONAL_REAL = ((numbers.Real, type(None)) + _SYM_INT + _SYM_FLOAT, "a real number or None")
_STR = ((str,), "a str")
_BOOL = ((bool,), "a bool")


def _check(op, **args):
    """The TypeError naming op's argument, what it takes and what it got, for the first of
    ``name=(value, kind)`` whose value is not of its kind: torch.ops would report it as a
    RuntimeError (or, for a missing tensor, as one about a device), float() would turn a string
    into a ValueError. bool is an int subclass, but a bool passes only where the kind is _BOOL.
    An int outside int64 (what torch.ops takes) is a ValueError naming the argument: torch.ops
    would report it as a RuntimeError about types."""
    for name, (value, (types, expected)) in args.items():
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise TypeError(f"{op}: {name} must be {expected}, got {type(value).__name__}")
        if type(value) is int and not -2 ** 63 <= value < 2 ** 63:
            raise ValueError(f"{op}: {name} must fit in a 64-bit int, got {value}")


def plan(timestep_indices, token_tags, num_timesteps, batch=1):
    """The plan of a packed sequence: row ``ti*3 + tag`` of a ``(3T, 6H)`` table per position.

    timestep_indices, token_tags: ``(S,)`` int32 or int64 (same dtype and device); the plan
    lives on their device. ``batch`` items share the index.
    """
    _check("plan", timestep_indices=(timestep_indices, _TENSOR), token_tags=(token_tags, _TENSOR),
           num_timesteps=(num_timesteps, _INT), batch=(batch, _INT))
    return _ops.plan.default(timestep_indices, token_tags, num_timesteps, batch)


def plan_from_rows(row_index, num_rows, batch=1):
    """The plan of an ``(S,)`` row index into a table of ``num_rows`` rows (e.g. the timestep
    index of final_adaln_out, ``num_rows = T``)."""
    _check("plan_from_rows", row_index=(row_index, _TENSOR), num_rows=(num_rows, _INT), batch=(batch, _INT))
    return _ops.plan_from_rows.default(row_index, num_rows, batch)


class PlanTables:
    """An :class:`IndexPlan` as a tensor, for a compiled region that must take tensors only
    (``torch.compile(mode="reduce-overhead")``: CUDA graphs take no torch-class input). Made by
    :func:`plan_tables`; every op that takes a plan takes one in the plan's place.

    ``tables``: the plan's tables (``plan.tables()``), an ``(S,)`` int32 copy of its validated
    row index on its device, made once per plan. They stand for the plan, they are not read by
    any kernel: an op resolves them to the plan that made them and runs on the plan's own
    tables. A tensor that is not a live plan's unmodified tables (a copy, any other tensor, a
    part of them, tables modified in place, the tables of a freed plan) is a ValueError naming
    ``plan_tables``, before any kernel runs (docs/python.md, torch.compile)."""

    def __init__(self, tables):
        if not isinstance(tables, torch.Tensor):
            raise TypeError(f"PlanTables: tables must be a torch.Tensor (plan.tables()), got {type(tables).__name__}")
        self.tables = tables

    def __repr__(self):
        return f"PlanTables(seq_len={self.tables.shape[0]}, device={self.tables.device})"


def plan_tables(index_plan):
    """The :class:`PlanTables` of a plan, built outside the compiled region (like the plan):
    the same tables for as long as the plan lives, so a compiled graph traced with them runs
    again with them. From torch 2.4 they are marked a static input
    (``torch._dynamo.mark_static_address``): CUDA graphs read them in place, and dynamo guards on
    them, so a graph runs only with the tables it was traced with."""
    if not isinstance(index_plan, torch.ScriptObject):
        raise TypeError(f"plan_tables: plan must be a detdit IndexPlan (detdit.plan(...)), "
                        f"got {type(index_plan).__name__}")
    tables = index_plan.tables()
    if _compile.REASON is None:
        torch._dynamo.mark_static_address(tables)
    return PlanTables(tables)


# What a plan is: a built plan, its PlanTables, or (torch >= 2.4, under torch.compile) the
# FakeScriptObject that tracing makes of a plan (detdit/_compile.py).
_PLAN_TYPES = (torch.ScriptObject, PlanTables) + _compile.FAKE_PLAN_TYPES


def _require_plan(index_plan, op):
    if index_plan is None:
        raise ValueError(f"{op} needs an IndexPlan (detdit.plan(...)), got None")
    if not isinstance(index_plan, _PLAN_TYPES):
        raise TypeError(f"{op}: plan must be a detdit IndexPlan (detdit.plan(...)) or its PlanTables "
                        f"(detdit.plan_tables(plan)), got {type(index_plan).__name__}")
    return index_plan


def _by_plan(packet, index_plan, op, overload="default"):
    """(the overload of the op packet for this plan argument, the argument it takes): a plan goes
    to `overload`, PlanTables go to the `.tables` overload as their tables."""
    index_plan = _require_plan(index_plan, op)
    if isinstance(index_plan, PlanTables):
        return packet.tables, index_plan.tables
    return getattr(packet, overload), index_plan


def _profile(numerics):
    # torch.ops reports a non-str argument as a RuntimeError; it is a TypeError
    if not isinstance(numerics, str):
        raise TypeError(f"numerics must be 'portable' or 'torch', got {type(numerics).__name__}")
    return numerics


def timestep_sinusoid(timesteps, num_channels=H3_FREQ_DIM, max_period=H3_MAX_PERIOD, flip_sin_to_cos=True,
                      downscale_freq_shift=0, scale=1, t_max=1.0, numerics="portable", check_range=True):
    """``(T,)`` timesteps in [0, t_max] -> ``(T, num_channels)`` float32 features: diffusers'
    ``Timesteps(num_channels, flip_sin_to_cos, downscale_freq_shift, scale)`` (with ``max_period``),
    ``[cos | sin]`` when ``flip_sin_to_cos`` else ``[sin | cos]``, one zero column when
    ``num_channels`` is odd.

    ``t_max`` bounds the timesteps: 1.0 (the default, MiniMax-H3) takes t = 1 - sigma unscaled, so
    the sigma * 1000 convention fails closed unless ``t_max=1000`` (SD3, Flux, Wan, HunyuanVideo,
    LTX-Video, CogVideoX) or larger (a guidance * 1000 embedding) says so; NaN, infinities, negative
    values and values above t_max are a ValueError naming the first one. ``|scale| * t_max`` must
    not exceed 1e6 (the portable sin/cos range). ``check_range=False``: the caller guarantees finite
    t in [0, t_max]; the op then never reads the timesteps on the host (no stream synchronisation,
    so a CUDA graph can capture it)."""
    _check("timestep_sinusoid", timesteps=(timesteps, _TENSOR), num_channels=(num_channels, _INT),
           max_period=(max_period, _REAL), flip_sin_to_cos=(flip_sin_to_cos, _BOOL),
           downscale_freq_shift=(downscale_freq_shift, _REAL), scale=(scale, _REAL), t_max=(t_max, _REAL),
           check_range=(check_range, _BOOL))
    return _ops.timestep_sinusoid.default(timesteps, num_channels, float(max_period), _profile(numerics), check_range,
                                          flip_sin_to_cos, float(downscale_freq_shift), float(scale), float(t_max))


def linear(x, weight, bias=None, activation="none", numerics="portable"):
    """``x W^T + b`` (``activation="silu"``: then SiLU), row-wise deterministic; out in x's dtype."""
    _check("linear", x=(x, _TENSOR), weight=(weight, _TENSOR), bias=(bias, _OPTIONAL_TENSOR),
           activation=(activation, _STR))
    return _ops.linear.default(x, weight, bias, activation, _profile(numerics))[0]


def timestep_mlp(features, w1, b1, w2, b2, numerics="portable"):
    """``W2 silu(W1 f + b1) + b2`` (diffusers' TimestepEmbedding) in the features' dtype: float32 (H3's FP32
    time embedder) or bfloat16 (the activation-dtype MLP of SD3, Flux, HunyuanVideo: the linear's result, the
    SiLU's and temb each rounded once to bfloat16, where eager rounds). Every operand in that dtype."""
    _check("timestep_mlp", features=(features, _TENSOR), w1=(w1, _TENSOR), b1=(b1, _TENSOR), w2=(w2, _TENSOR),
           b2=(b2, _TENSOR))
    return _ops.timestep_mlp.default(features, w1, b1, w2, b2, _profile(numerics))[0]


def text_projection(pooled, w1, b1, w2, b2, numerics="portable"):
    """``W2 silu(W1 pooled + b1) + b2``: diffusers' PixArtAlphaTextProjection with ``act_fn="silu"`` (the pooled
    text embedder of SD3, Flux, HunyuanVideo), diffusers' name for the site. Not an op of its own: it is
    :func:`timestep_mlp` on the pooled text ``(B, P)`` (its bits, autograd and errors, which name timestep_mlp and
    its ``features``)."""
    return timestep_mlp(pooled, w1, b1, w2, b2, numerics=numerics)


def combined_timestep_embedding(timestep_features, pooled, timestep_weights, text_weights, guidance_features=None,
                                guidance_weights=None, numerics="portable"):
    """``temb = (t_emb + g_emb) + text_emb`` (``t_emb + text_emb`` without guidance): diffusers'
    CombinedTimestepGuidanceTextProjEmbeddings (Flux-dev, HunyuanVideo) and CombinedTimestepTextProjEmbeddings
    (SD3, Flux-schnell). ``t_emb = timestep_mlp(timestep_features, *timestep_weights)``, ``g_emb`` the same with
    the guidance's, ``text_emb = text_projection(pooled, *text_weights)`` (timestep_mlp on the pooled text); each
    weights argument is ``(w1, b1, w2, b2)``. The features are timestep_sinusoid's, cast to the pooled text's dtype
    by the caller as the models do. Each add is rounded once to that dtype (eager's ``+``): the C++
    combined_timestep_embedding's bytes."""
    _check("combined_timestep_embedding", timestep_features=(timestep_features, _TENSOR), pooled=(pooled, _TENSOR),
           guidance_features=(guidance_features, _OPTIONAL_TENSOR))
    if (guidance_features is None) != (guidance_weights is None):
        raise ValueError("combined_timestep_embedding: guidance_features and guidance_weights come together "
                         "(both, for a guidance embedder, or neither)")
    temb = timestep_mlp(timestep_features, *timestep_weights, numerics=numerics)
    if guidance_features is not None:
        temb = temb + timestep_mlp(guidance_features, *guidance_weights, numerics=numerics)
    return temb + text_projection(pooled, *text_weights, numerics=numerics)


def adaln_projection(temb, weight, bias, numerics="portable", chunks=None):
    """``table = linear(bf16(silu(temb)))``: ``(T, N)`` in the weight's dtype.

    ``chunks=None``: H3's projection (``N = 18H``, temb float32). A family's chunk count
    (``len(adaln_chunk_order(name))``): N a positive multiple of it, temb float32 or the
    weight's dtype (eager's ``linear(silu(temb))`` on a bf16 temb: the same act), T rows per
    sample or per token; its gradient comes back in temb's dtype."""
    _check("adaln_projection", temb=(temb, _TENSOR), weight=(weight, _TENSOR), bias=(bias, _TENSOR),
           chunks=(chunks, _OPTIONAL_INT))
    if chunks is not None and chunks < 1:
        raise ValueError(f"adaln_projection: chunks must be a positive chunk count or None (H3), got {chunks}")
    return _ops.adaln_projection.default(temb, weight, bias, _profile(numerics), chunks or 0)[0]


def adaln_chunk_order(name):
    """The chunk names of the AdaLN chunk order ``name``, in table column order: ``h3``,
    ``ada_layer_norm_zero``, ``sd35_ada_layer_norm_zero_x``, ``ada_layer_norm_zero_single``,
    ``ada_layer_norm_continuous`` (scale first), ``ada_layer_norm`` (CogVideoX's norm_out),
    ``cogvideox_layer_norm_zero``, ``wan_block``, ``scale_shift_table_final`` (Wan's and
    LTX-Video's final table)."""
    _check("adaln_chunk_order", name=(name, _STR))
    return tuple(_ops.adaln_chunk_order(name))


def adaln_table_chunks(table, hidden, order="h3"):
    """The modulation views of a projection's table, in ``order``'s chunk order.

    ``order="h3"``: the six ``(3T, H)`` views of a ``(T, 18H)`` table (row ``ti*3 + tag``),
    diffusers' ``view(-1, 6H).chunk(6, -1)``: shift_msa, scale_msa, gate_msa, shift_mlp,
    scale_mlp, gate_mlp. Another order of K chunks: the K ``(T, H)`` views of a ``(T, K*H)``
    table or of an ``adaln_table_add`` output ``(T, K, H)`` (``chunk(K, 1)``)."""
    _check("adaln_table_chunks", table=(table, _TENSOR), hidden=(hidden, _INT), order=(order, _STR))
    chunks = ADALN_CHUNKS if order == "h3" else len(adaln_chunk_order(order))
    width = (NUM_MODALITIES if order == "h3" else 1) * chunks * hidden
    layout = "(T, 18 * hidden)" if order == "h3" else f"(T, {chunks} * hidden) or (T, {chunks}, hidden)"
    # the views need exactly this layout; torch's view would report anything else as a RuntimeError
    family_3d = order != "h3" and table.dim() == 3 and tuple(table.shape[1:]) == (chunks, hidden)
    if hidden < 1 or not (family_3d or (table.dim() == 2 and table.shape[1] == width)):
        shown = f"(T, {width})" if order == "h3" else f"(T, {width}) or (T, {chunks}, {hidden})"
        raise ValueError(f"adaln_table_chunks: table must be {layout} = {shown} with hidden >= 1, "
                         f"got {tuple(table.shape)} with hidden = {hidden}")
    if not table.is_contiguous():
        raise ValueError(f"adaln_table_chunks: table must be contiguous (its chunks are views of it), got strides "
                         f"{table.stride()}")
    # no kernel runs, so these are the checks a kernel's argument gets: a projection's dtype, and
    # a device detdit runs on (tracing's fake tensors pass: _compile.refuse_meta)
    if table.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"adaln_table_chunks: table must be float32, bfloat16 or float16 (an adaln_projection "
                        f"table), got {table.dtype}")
    if _compile.is_eager_meta(table):
        raise ValueError("adaln_table_chunks: table must be a CPU or CUDA tensor, got one on meta")
    return table.view(-1, chunks * hidden).chunk(chunks, -1)


def adaln_table_add(table, proj):
    """Wan's and LTX-Video's modulation ``table + proj``: table ``(K, H)`` (a stored ``(1, K, H)``
    table may be passed as it is), proj ``(T, K*H)``, ``(T, K, H)`` or ``(T, 1, H)`` (the final
    layers' time embedding, broadcast over the K chunks) -> ``(T, K, H)`` in the promoted dtype
    (fp32 table + bf16 proj -> fp32, as eager). One rounded add, bitwise eager's; the table's
    gradient is detdit's canonical reduction over the T rows."""
    _check("adaln_table_add", table=(table, _TENSOR), proj=(proj, _TENSOR))
    if table.dim() == 3 and table.shape[0] == 1:
        table = table[0]
    if table.dim() == 2 and proj.dim() == 2 and proj.shape[1] == table.shape[0] * table.shape[1]:
        proj = proj.view(proj.shape[0], table.shape[0], table.shape[1])
    return _ops.adaln_table_add.default(table, proj)


def _modulation_rows(chunk, x, what):
    """A ``(T, H)`` chunk view as layernorm's modulation: per sample ``(B, H)`` (T = B) or per
    token ``(B, S, H)`` (T = B*S)."""
    batch, seq = x.shape[0], x.shape[1]
    if chunk.shape[0] == batch:
        return chunk
    if chunk.shape[0] == batch * seq:
        return chunk.view(batch, seq, chunk.shape[1])
    raise ValueError(f"{what}: temb must have B = {batch} rows (per sample) or B*S = {batch * seq} rows (per token), "
                     f"got {chunk.shape[0]}")


def final_layer_continuous(x, temb, weight, bias, proj_weight, proj_bias=None, eps=1e-6, numerics="portable"):
    """The final layer of SD3, Flux, HunyuanVideo and Qwen-Image: diffusers'
    ``AdaLayerNormContinuous(H, D, elementwise_affine=False, eps)`` then ``proj_out``, as the
    composition ``table = adaln_projection(temb, weight, bias, chunks=2)`` (scale first, then
    shift; the ``ada_layer_norm_continuous`` order), ``n = layernorm(x, shift=, scale=, eps=)``
    (each op rounded as eager; per sample for a ``(B, D)`` temb, per token for ``(B*S, D)``),
    ``out = linear(n, proj_weight, proj_bias)``. x ``(B, S, H)`` in the weights' dtype -> ``(B,
    S, O)``; autograd through the three ops; each sample's outputs and dx are its own."""
    _check("final_layer_continuous", x=(x, _TENSOR), temb=(temb, _TENSOR), weight=(weight, _TENSOR),
           bias=(bias, _TENSOR), proj_weight=(proj_weight, _TENSOR), proj_bias=(proj_bias, _OPTIONAL_TENSOR),
           eps=(eps, _REAL))
    if x.dim() != 3:
        raise ValueError(f"final_layer_continuous: x must be (B, S, H), got {tuple(x.shape)}")
    batch, seq, hidden = x.shape
    table = adaln_projection(temb, weight, bias, numerics, chunks=2)
    scale, shift = (_modulation_rows(c, x, "final_layer_continuous")
                    for c in adaln_table_chunks(table, hidden, "ada_layer_norm_continuous"))
    n = layernorm(x, shift=shift, scale=scale, eps=eps, numerics=numerics)
    out = linear(n.reshape(batch * seq, hidden), proj_weight, proj_bias, numerics=numerics)
    return out.view(batch, seq, out.shape[1])


def final_layer_table(x, temb, table, proj_weight, proj_bias=None, eps=1e-6, upcast=False, numerics="portable"):
    """The final layer of Wan (``upcast=True``: FP32LayerNorm and an fp32 table) and LTX-Video
    (``upcast=False``: bf16, each op rounded): ``shift, scale = table (2, H) + temb`` (the raw
    time embedding broadcast over the two chunks, :func:`adaln_table_add`; the
    ``scale_shift_table_final`` order), ``n = layernorm(x, shift=, scale=, eps=, upcast=)``,
    ``out = linear(n, proj_weight, proj_bias)``. temb ``(B, H)`` per sample or ``(B, S, H)`` /
    ``(B*S, H)`` per token (Wan 2.2 TI2V, LTX-Video image-to-video); x ``(B, S, H)`` -> ``(B,
    S, O)``; autograd through the three ops."""
    _check("final_layer_table", x=(x, _TENSOR), temb=(temb, _TENSOR), table=(table, _TENSOR),
           proj_weight=(proj_weight, _TENSOR), proj_bias=(proj_bias, _OPTIONAL_TENSOR), eps=(eps, _REAL),
           upcast=(upcast, _BOOL))
    if x.dim() != 3:
        raise ValueError(f"final_layer_table: x must be (B, S, H), got {tuple(x.shape)}")
    batch, seq, hidden = x.shape
    mod = adaln_table_add(table, temb.reshape(-1, 1, hidden))
    shift, scale = (_modulation_rows(c, x, "final_layer_table")
                    for c in adaln_table_chunks(mod, hidden, "scale_shift_table_final"))
    n = layernorm(x, shift=shift, scale=scale, eps=eps, upcast=upcast, numerics=numerics)
    out = linear(n.reshape(batch * seq, hidden), proj_weight, proj_bias, numerics=numerics)
    return out.view(batch, seq, out.shape[1])


def adaln_row_gather(rows, index_plan):
    """``(R, 6H)`` rows -> ``(6, S, H)``: the six modulation vectors of every position's row
    (a byte copy, equal to six index_selects). Its gradient arrives as ``(6, S, H)`` (summed
    over the batch by whatever broadcast it) and is reduced with the plan's index, batch 1."""
    _check("adaln_row_gather", rows=(rows, _TENSOR))
    op, index_plan = _by_plan(_ops.adaln_row_gather, index_plan, "adaln_row_gather")
    return op(rows, index_plan)


def _h3_rule(x, tables, plan, upcast, k=None):
    """Whether a modulated call is the H3 rule (numerics 5.6 / 5.7): a plan, every modulation
    tensor in x's dtype, upcast false and no k. Those calls keep the overloads that take a
    plan that is not optional (and PlanTables), which torch.compile traces with a fake plan;
    every other form and recipe goes to the `.forms` overload, whose plan is optional."""
    return (plan is not None and not upcast and k is None
            and all(t is None or t.dtype == x.dtype for t in tables))


def _forms_plan(plan, op):
    """The `.forms` overloads' optional plan: an IndexPlan or None (PlanTables serve the H3
    rule's overloads only)."""
    if plan is None:
        return None
    plan = _require_plan(plan, op)
    if isinstance(plan, PlanTables):
        raise TypeError(f"{op}: PlanTables take the H3 rule only (modulation in x's dtype, upcast=False, no k); "
                        f"with this call pass the IndexPlan itself")
    return plan


def rmsnorm(x, weight, shift=None, scale=None, plan=None, eps=H3_NORM_EPS, numerics="portable", upcast=False):
    """RMSNorm of ``(M, H)`` / ``(B, S, H)`` rows times weight, modulated by shift and scale as
    ``n * (1 + scale) + shift``. The form follows from their shapes (docs/numerics.md 5.12):
    ``(R, H)`` tables with the plan of the positions (indexed), ``(B, H)`` / ``(B, 1, H)`` per
    sample, ``(B, F, H)`` / ``(B, F, 1, H)`` per frame, ``(B, S, H)`` per token (x then
    ``(B, S, H)``), any views with innermost stride 1; fp32 or x's dtype. ``upcast=False``
    rounds each op as eager does (out fp32 for fp32 modulation); ``upcast=True`` computes in
    FP32 and rounds once to x's dtype."""
    _check("rmsnorm", x=(x, _TENSOR), weight=(weight, _TENSOR), shift=(shift, _OPTIONAL_TENSOR),
           scale=(scale, _OPTIONAL_TENSOR), eps=(eps, _REAL), upcast=(upcast, _BOOL))
    if shift is None and scale is None and plan is None and not upcast:
        return _ops.rmsnorm.default(x, weight, shift, scale, None, float(eps), _profile(numerics))[0]
    if _h3_rule(x, (shift, scale), plan, upcast):
        # the overload whose plan is not optional: torch.compile can pass a traced plan only
        # there (csrc/ops.h)
        op, plan = _by_plan(_ops.rmsnorm, plan, "rmsnorm", "plan")
        return op(x, weight, shift, scale, plan, float(eps), _profile(numerics))[0]
    plan = _forms_plan(plan, "rmsnorm")
    return _ops.rmsnorm.forms(x, weight, shift, scale, plan, float(eps), _profile(numerics), upcast)[0]


def gate_residual(residual, y, gate=None, plan=None, k=None, upcast=False):
    """``residual + gate * y`` (SGLang's ``MulAdd``: ``residual + (k + gate) * y`` when k is
    given; None: no k step, so the bits are eager's ``residual + gate * y``), gate in any
    form of :func:`rmsnorm`'s modulation (``(R, H)`` with a plan, per sample, per frame, per
    token) or None (``residual + y``); fp32 or residual's dtype; ``upcast`` as in rmsnorm."""
    _check("gate_residual", residual=(residual, _TENSOR), y=(y, _TENSOR), gate=(gate, _OPTIONAL_TENSOR),
           k=(k, _OPTIONAL_REAL), upcast=(upcast, _BOOL))
    if gate is not None and _h3_rule(residual, (gate,), plan, upcast, k):
        op, plan = _by_plan(_ops.gate_residual, plan, "gate_residual")
        return op(residual, y, gate, plan)
    plan = _forms_plan(plan, "gate_residual")
    return _ops.gate_residual.forms(residual, y, gate, plan, upcast, None if k is None else float(k))


def gate_residual_rmsnorm(residual, y, gate=None, weight=None, shift=None, scale=None, plan=None, eps=H3_NORM_EPS,
                          numerics="portable", upcast=False, k=None):
    """The region every H3 block runs twice, fused: ``h = gate_residual(residual, y, gate,
    plan, k, upcast)``, then ``out = rmsnorm(h, weight, shift, scale, plan, eps, upcast)``;
    returns ``(h, out)`` (:func:`gate_residual_layernorm` returns ``(out, h)``). weight is
    required. Every form of the two ops (the gate absent, indexed with a plan, per sample, per
    frame, per token; fp32 or residual's dtype), all present modulation tensors in one form.
    Forward and every gradient are bitwise equal to :func:`gate_residual` then :func:`rmsnorm`,
    including the gradient that reaches ``h`` from the rest of the network (the next residual
    branch)."""
    _check("gate_residual_rmsnorm", residual=(residual, _TENSOR), y=(y, _TENSOR), gate=(gate, _OPTIONAL_TENSOR),
           weight=(weight, _TENSOR), shift=(shift, _OPTIONAL_TENSOR), scale=(scale, _OPTIONAL_TENSOR),
           eps=(eps, _REAL), upcast=(upcast, _BOOL), k=(k, _OPTIONAL_REAL))
    if gate is not None and _h3_rule(residual, (gate, shift, scale), plan, upcast, k):
        op, plan = _by_plan(_ops.gate_residual_rmsnorm, plan, "gate_residual_rmsnorm")
        h, out, _ = op(residual, y, gate, weight, shift, scale, plan, float(eps), _profile(numerics))
        return h, out
    plan = _forms_plan(plan, "gate_residual_rmsnorm")
    h, out, _ = _ops.gate_residual_rmsnorm.forms(residual, y, gate, weight, shift, scale, plan, float(eps),
                                                 _profile(numerics), upcast, None if k is None else float(k))
    return h, out


def final_adaln_out(x, norm_weight, temb, weight, bias, plan, eps=H3_NORM_EPS, numerics="portable"):
    """H3's norm_out: ``shift, scale = linear(bf16(silu(temb))).chunk(2)`` (shift first), then
    the modulated RMSNorm of x indexed by the timestep index (a plan with ``num_rows = T``)."""
    _check("final_adaln_out", x=(x, _TENSOR), norm_weight=(norm_weight, _TENSOR), temb=(temb, _TENSOR),
           weight=(weight, _TENSOR), bias=(bias, _TENSOR), eps=(eps, _REAL))
    op, plan = _by_plan(_ops.final_adaln_out, plan, "final_adaln_out")
    return op(x, norm_weight, temb, weight, bias, plan, float(eps), _profile(numerics))[0]


def adaln_modulation(temb, weight, bias, plan, numerics="portable"):
    """Fused projection + gather: ``(6, S, H)``; the table gradient stays float32 from the
    gather backward into the projection backward."""
    _check("adaln_modulation", temb=(temb, _TENSOR), weight=(weight, _TENSOR), bias=(bias, _TENSOR))
    op, plan = _by_plan(_ops.adaln_modulation, plan, "adaln_modulation")
    return op(temb, weight, bias, plan, _profile(numerics))[0]


def layernorm(x, weight=None, bias=None, shift=None, scale=None, plan=None, eps=1e-5, upcast=False,
              numerics="portable"):
    """``F.layer_norm(x, (H,), weight, bias, eps)`` over the last dimension of ``(M, H)`` /
    ``(B, S, H)`` rows: without affine, with weight, or with weight and bias (bias needs
    weight), modulated by shift and scale as ``n * (1 + scale) + shift`` in every form of
    :func:`rmsnorm` (``(R, H)`` with a plan, per sample, per frame, per token; fp32 or x's
    dtype; docs/numerics.md 9.5). ``upcast=False`` rounds each op as eager does (out fp32 for
    fp32 modulation); ``upcast=True`` is Wan's FP32 norm, ``(norm(x.float()) * (1 + scale) +
    shift).type_as(x)``, rounded once. ``numerics="torch"`` (CUDA) is eager's forward and dx on
    the same GPU; d_weight and d_bias are detdit's chunked reduction in both profiles
    (docs/numerics.md 9)."""
    _check("layernorm", x=(x, _TENSOR), weight=(weight, _OPTIONAL_TENSOR), bias=(bias, _OPTIONAL_TENSOR),
           shift=(shift, _OPTIONAL_TENSOR), scale=(scale, _OPTIONAL_TENSOR), eps=(eps, _REAL),
           upcast=(upcast, _BOOL))
    if shift is None and scale is None and plan is None and not upcast:
        return _ops.layernorm.default(x, weight, bias, float(eps), _profile(numerics))[0]
    plan = _forms_plan(plan, "layernorm")
    return _ops.layernorm.forms(x, weight, bias, shift, scale, plan, float(eps), _profile(numerics), upcast)[0]


def gate_residual_layernorm(residual, y, gate=None, weight=None, bias=None, shift=None, scale=None, plan=None,
                            eps=1e-5, upcast=False, numerics="portable", k=None):
    """The gated residual and the LayerNorm after it, fused (SD3, Flux, HunyuanVideo, Wan:
    SGLang's ``ScaleResidualLayerNormScaleShift``): ``h = gate_residual(residual, y, gate,
    plan, k, upcast)``, then ``out = layernorm(h, weight, bias, shift, scale, plan, eps,
    upcast)``; returns ``(out, h)`` (note: :func:`gate_residual_rmsnorm` returns ``(h,
    out)``). Every form of the two ops, all present modulation tensors in one form. Forward
    and every gradient, the one reaching ``h`` from the rest of the network included, are
    bitwise equal to the two ops composed (docs/numerics.md 9.7)."""
    _check("gate_residual_layernorm", residual=(residual, _TENSOR), y=(y, _TENSOR), gate=(gate, _OPTIONAL_TENSOR),
           weight=(weight, _OPTIONAL_TENSOR), bias=(bias, _OPTIONAL_TENSOR), shift=(shift, _OPTIONAL_TENSOR),
           scale=(scale, _OPTIONAL_TENSOR), eps=(eps, _REAL), upcast=(upcast, _BOOL), k=(k, _OPTIONAL_REAL))
    plan = _forms_plan(plan, "gate_residual_layernorm")
    out, h, _, _ = _ops.gate_residual_layernorm.default(residual, y, gate, weight, bias, shift, scale, plan,
                                                        float(eps), _profile(numerics), upcast,
                                                        None if k is None else float(k))
    return out, h


def release_scratch_memory(device="cuda"):
    """Hand the memory of detdit's CUDA scratch pool on ``device`` that no allocation holds
    back to the driver (docs/gpu.md). detdit's backwards and composite ops take their
    temporaries from that pool, which keeps them mapped between calls; torch's
    ``torch.cuda.empty_cache()`` does not reach it. Call it when no detdit op is in flight on
    the device (after ``torch.cuda.synchronize()``). ``"cuda"`` without an index means the
    current device; a CPU device has no pool (nothing to do). ``device`` is a
    :class:`torch.device` or a str (``"cpu"``, ``"cuda"``, ``"cuda:N"``); anything else,
    an int included, is a TypeError (torch.device(5) would read 5 as cuda:5); a str that
    names no device, or a device other than the CPU or CUDA, is a ValueError."""
    if not isinstance(device, (torch.device, str)):
        raise TypeError(f"release_scratch_memory: device must be a torch.device or a str, got "
                        f"{type(device).__name__}")
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError:  # torch's parse error of a device string
            raise ValueError(f"release_scratch_memory: device must be a cpu or cuda device, got '{device}'") from None
    torch.ops.detdit.release_scratch_memory(device)


from . import nn, safetensors  # noqa: E402,F401  (after the ops nn wraps)
