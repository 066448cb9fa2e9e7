"""detdit.nn: modules that mirror diffusers' MiniMax-H3 conditioning modules.

Parameter names and shapes follow the H3 manifest (docs/weights.md), so a state dict
of the real model's conditioning tensors loads unchanged into :class:`H3Conditioning`
(``time_embedder.linear_1.weight``, ``transformer_blocks.{i}.adaln_proj.linear.weight``,
``transformer_blocks.{i}.norm1.weight``, ``norm_out.norm.weight``, ...). Defaults are the
H3 sizes and dtypes: the time embedder is float32, everything else bfloat16. Pass
``device="meta"`` to build the full-size structure without allocating it.

The other DiT families (docs/python.md, "Drop-in modules"): modules with the call signatures
of SGLang-diffusion's fused layers (:class:`LayerNormScaleShift`,
:class:`ScaleResidualLayerNormScaleShift`, their RMSNorm counterparts, :class:`MulAdd`,
:class:`ScaleResidual`, :class:`ResidualRMSNorm`, and MiniMax-H3's indexed
:class:`RMSNormIndexedScaleShift` / :class:`GateResidualRMSNormIndexedScaleShift`), for an
inference engine to assign in place of its own; and modules with diffusers' parameter names
and shapes (:class:`FP32LayerNorm`, :class:`AdaLayerNormZero`, :class:`AdaLayerNormZeroSingle`,
:class:`AdaLayerNormContinuous`, :class:`SD35AdaLayerNormZeroX`, :class:`CogVideoXLayerNormZero`,
:class:`AdaLayerNorm`, :class:`AdaLayerNormSingle`), whose state dicts load unchanged, for a trainer.
"""
import torch
import torch.nn.functional as F
from torch import nn

from . import (ADALN_CHUNKS, H3_FREQ_DIM, H3_HIDDEN_SIZE, H3_MAX_PERIOD, H3_NORM_EPS, H3_TIME_EMBED_DIM,
               H3_TIME_EMBED_HIDDEN_DIM, NUM_MODALITIES)
from . import adaln_modulation, adaln_projection, adaln_table_chunks, final_adaln_out, gate_residual
from . import gate_residual_layernorm, gate_residual_rmsnorm, layernorm, linear, plan_from_rows, rmsnorm
from . import timestep_mlp, timestep_sinusoid

__all__ = ["Timesteps", "TimestepEmbedding", "AdaLNModulation", "RMSNorm", "GatedResidual", "AdaLayerNormOut",
           "H3BlockConditioning", "H3TokenRefiner", "H3Conditioning",
           "LayerNormScaleShift", "RMSNormScaleShift", "ScaleResidualLayerNormScaleShift",
           "ScaleResidualRMSNormScaleShift", "MulAdd", "ScaleResidual", "ResidualRMSNorm", "RMSNormIndexedScaleShift",
           "GateResidualRMSNormIndexedScaleShift", "FP32LayerNorm", "AdaLayerNormZero", "AdaLayerNormZeroSingle",
           "AdaLayerNormContinuous", "SD35AdaLayerNormZeroX", "CogVideoXLayerNormZero", "AdaLayerNorm",
           "AdaLayerNormSingle"]


class Timesteps(nn.Module):
    """diffusers' ``Timesteps(num_channels, flip_sin_to_cos, downscale_freq_shift, scale=1)``, same
    constructor order and attributes, plus the timesteps' bound ``t_max`` (1: t = 1 - sigma in
    [0, 1], MiniMax-H3; 1000: sigma * 1000) and ``max_period``: ``(T,)`` timesteps ->
    ``(T, num_channels)`` float32 (:func:`detdit.timestep_sinusoid`). No parameters."""

    def __init__(self, num_channels=H3_FREQ_DIM, flip_sin_to_cos=True, downscale_freq_shift=0, scale=1, t_max=1.0,
                 max_period=H3_MAX_PERIOD, numerics="portable", check_range=True):
        super().__init__()
        self.num_channels, self.flip_sin_to_cos = num_channels, flip_sin_to_cos
        self.downscale_freq_shift, self.scale, self.t_max = downscale_freq_shift, scale, t_max
        self.max_period, self.numerics = max_period, numerics
        self.check_range = check_range  # False: t pre-validated (no host read; CUDA-graph capturable)

    def forward(self, timesteps):
        return timestep_sinusoid(timesteps, self.num_channels, self.max_period, self.flip_sin_to_cos,
                                 self.downscale_freq_shift, self.scale, self.t_max, self.numerics, self.check_range)


class TimestepEmbedding(nn.Module):
    """diffusers' ``TimestepEmbedding``: ``linear_2(silu(linear_1(features)))``, float32."""

    def __init__(self, in_channels=H3_FREQ_DIM, hidden_dim=H3_TIME_EMBED_HIDDEN_DIM, out_dim=H3_TIME_EMBED_DIM,
                 numerics="portable", device=None):
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, hidden_dim, device=device, dtype=torch.float32)
        self.linear_2 = nn.Linear(hidden_dim, out_dim, device=device, dtype=torch.float32)
        self.numerics = numerics

    def forward(self, features):
        return timestep_mlp(features, self.linear_1.weight, self.linear_1.bias, self.linear_2.weight,
                            self.linear_2.bias, self.numerics)


class AdaLNModulation(nn.Module):
    """H3's per-block ``adaln_proj``: ``linear`` ``(18H, D)`` maps ``bf16(silu(temb))`` to the
    ``(T, 18H)`` table of 6 modulation vectors per (timestep, modality) row.

    ``forward(temb, plan)`` is the fused op: six ``(S, H)`` tensors (shift_msa, scale_msa,
    gate_msa, shift_mlp, scale_mlp, gate_mlp) gathered for every position, with the table
    gradient kept float32 into the projection backward. ``chunks(temb)`` returns the six
    ``(3T, H)`` table views instead, for the plan-indexed ops (rmsnorm, gate_residual); on
    that path autograd hands the projection a table gradient in the table's dtype (each
    consumer's table gradient is rounded once), as the separate diffusers ops do.
    """

    def __init__(self, hidden_size=H3_HIDDEN_SIZE, time_embed_dim=H3_TIME_EMBED_DIM, dtype=torch.bfloat16,
                 numerics="portable", device=None):
        super().__init__()
        self.hidden_size = hidden_size
        self.linear = nn.Linear(time_embed_dim, NUM_MODALITIES * ADALN_CHUNKS * hidden_size, device=device,
                                dtype=dtype)
        self.numerics = numerics

    def forward(self, temb, plan):
        out = adaln_modulation(temb, self.linear.weight, self.linear.bias, plan, self.numerics)
        return out.unbind(0)

    def table(self, temb):
        return adaln_projection(temb, self.linear.weight, self.linear.bias, self.numerics)

    def chunks(self, temb):
        return adaln_table_chunks(self.table(temb), self.hidden_size)


class RMSNorm(nn.Module):
    """RMSNorm with ``weight`` (H3's ``norm1``/``norm2``/``final_norm``/``norm_out.norm``);
    ``forward(x, shift, scale, plan)`` applies ``n * (1 + scale[i]) + shift[i]``."""

    def __init__(self, hidden_size=H3_HIDDEN_SIZE, eps=H3_NORM_EPS, dtype=torch.bfloat16, numerics="portable",
                 device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.eps, self.numerics = eps, numerics

    def forward(self, x, shift=None, scale=None, plan=None):
        return rmsnorm(x, self.weight, shift, scale, plan, self.eps, self.numerics)

    def gated(self, residual, y, gate, shift=None, scale=None, plan=None):
        """The gated residual into this norm, fused: ``h = residual + gate[i] * y`` and
        ``self(h, shift, scale, plan)``; returns ``(h, out)``, bitwise equal to the two."""
        return gate_residual_rmsnorm(residual, y, gate, self.weight, shift, scale, plan, self.eps, self.numerics)


class GatedResidual(nn.Module):
    """``residual + gate[i] * y`` (gate ``(R, H)`` indexed by the plan). No parameters."""

    def forward(self, residual, y, gate, plan):
        return gate_residual(residual, y, gate, plan)


class AdaLayerNormOut(nn.Module):
    """H3's ``norm_out`` (``MiniMaxH3AdaLayerNormOut``): ``linear`` ``(2H, D)`` gives shift and
    scale (shift first) from ``bf16(silu(temb))``; ``norm`` is the RMSNorm they modulate,
    indexed by the timestep index (a plan with ``num_rows = T``)."""

    def __init__(self, hidden_size=H3_HIDDEN_SIZE, time_embed_dim=H3_TIME_EMBED_DIM, eps=H3_NORM_EPS,
                 dtype=torch.bfloat16, numerics="portable", device=None):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps, dtype, numerics, device)
        self.linear = nn.Linear(time_embed_dim, 2 * hidden_size, device=device, dtype=dtype)
        self.eps, self.numerics = eps, numerics

    def forward(self, x, temb, plan):
        return final_adaln_out(x, self.norm.weight, temb, self.linear.weight, self.linear.bias, plan, self.eps,
                               self.numerics)


class H3BlockConditioning(nn.Module):
    """The conditioning tensors of one H3 transformer block: ``adaln_proj``, ``norm1``, ``norm2``.

    ``forward(x, temb, plan, attn, ffn)`` runs the block's conditioning around the two
    sublayers (callables on the modulated ``(B, S, H)`` activations), as diffusers does:
    ``x = x + gate_msa * attn(norm1(x) * (1 + scale_msa) + shift_msa)``, then the same with
    ``norm2``/``ffn`` and the ``_mlp`` vectors, all indexed by the plan. The attention's
    gated residual and ``norm2`` run as one fused op (``norm2.gated``, :meth:`RMSNorm.gated`),
    bitwise equal to the two separate ops, forward and backward.
    """

    def __init__(self, hidden_size=H3_HIDDEN_SIZE, time_embed_dim=H3_TIME_EMBED_DIM, eps=H3_NORM_EPS,
                 dtype=torch.bfloat16, numerics="portable", device=None):
        super().__init__()
        self.adaln_proj = AdaLNModulation(hidden_size, time_embed_dim, dtype, numerics, device)
        self.norm1 = RMSNorm(hidden_size, eps, dtype, numerics, device)
        self.norm2 = RMSNorm(hidden_size, eps, dtype, numerics, device)
        self.gate = GatedResidual()

    def forward(self, x, temb, plan, attn, ffn):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaln_proj.chunks(temb)
        h, n = self.norm2.gated(x, attn(self.norm1(x, shift_msa, scale_msa, plan)), gate_msa, shift_mlp, scale_mlp,
                                plan)
        return self.gate(h, ffn(n), gate_mlp, plan)


class H3TokenRefiner(nn.Module):
    """The token refiner's conditioning tensor: ``final_norm`` (a plain RMSNorm)."""

    def __init__(self, hidden_size=H3_HIDDEN_SIZE, eps=H3_NORM_EPS, dtype=torch.bfloat16, numerics="portable",
                 device=None):
        super().__init__()
        self.final_norm = RMSNorm(hidden_size, eps, dtype, numerics, device)


class H3Conditioning(nn.Module):
    """Every conditioning module of MiniMax-H3 under the model's own names, so the manifest's
    tensors (``time_embedder.*``, ``transformer_blocks.{i}.{adaln_proj.linear,norm1,norm2}.*``,
    ``token_refiner.final_norm.weight``, ``norm_out.{norm,linear}.*``) load with
    ``load_state_dict(strict=True)``. ``time_proj`` has no parameters."""

    def __init__(self, num_blocks=50, hidden_size=H3_HIDDEN_SIZE, freq_dim=H3_FREQ_DIM,
                 time_embed_hidden_dim=H3_TIME_EMBED_HIDDEN_DIM, time_embed_dim=H3_TIME_EMBED_DIM, eps=H3_NORM_EPS,
                 dtype=torch.bfloat16, numerics="portable", device=None):
        super().__init__()
        self.time_proj = Timesteps(freq_dim, max_period=H3_MAX_PERIOD, numerics=numerics)
        self.time_embedder = TimestepEmbedding(freq_dim, time_embed_hidden_dim, time_embed_dim, numerics, device)
        self.transformer_blocks = nn.ModuleList(
            H3BlockConditioning(hidden_size, time_embed_dim, eps, dtype, numerics, device) for _ in range(num_blocks))
        self.token_refiner = H3TokenRefiner(hidden_size, eps, dtype, numerics, device)
        self.norm_out = AdaLayerNormOut(hidden_size, time_embed_dim, eps, dtype, numerics, device)

    def temb(self, t):
        """``(T,)`` timesteps -> ``(T, D)`` float32 embedding."""
        return self.time_embedder(self.time_proj(t))


# ---- Drop-in modules for the other DiT families --------------------------------------------
# Rollout side: SGLang-diffusion's fused layers, same constructor and forward signatures, so an
# engine swaps them in by assignment. Trainer side: diffusers' norm modules, same parameter
# names and shapes, so their state dicts load unchanged. The arithmetic is detdit's ops'
# (docs/numerics.md 5.12, 9): the modulation and the gated residual are eager's operations,
# the norms deterministic and within their stated bounds of eager's.


def _upcast_of(compute_dtype, where):
    """SGLang's compute dtype as detdit's recipe: torch.float32 is upcast (every step in FP32,
    one rounding to x's dtype at the end, Wan's diffusers arithmetic); None is each op
    rounding to its operands' promoted dtype, as eager does."""
    if compute_dtype is None:
        return False
    if compute_dtype == torch.float32:
        return True
    raise ValueError(f"{where}: compute_dtype must be torch.float32 (upcast) or None (each op rounds), "
                     f"got {compute_dtype}")


def _gate_of(gate, where):
    """SGLang's gate argument: a tensor, or the int 1 for no gate (``residual + x``). SGLang
    asserts an int gate is 1; any other int (or a bool) is a ValueError here too."""
    if gate is None or isinstance(gate, torch.Tensor):
        return gate
    if type(gate) is int and gate == 1:
        return None
    raise ValueError(f"{where}: gate must be a tensor or the int 1 (no gate), got {gate!r}")


def _norm(kind, x, weight, bias, shift, scale, eps, upcast):
    """The modulated norm ("layer" or "rms") of x in the recipe upcast. The ops take the
    parameters in x's dtype: with upcast, parameters in another dtype (SGLang's fp32 weights,
    Wan's fp32 norm2 under bf16 activations) take the norm of ``x.float()`` with every tensor
    widened (exact), rounded once to x's dtype at the end, which is the upcast recipe's
    arithmetic (FP32LayerNorm's ``weight.float()``); each op rounding, they are cast to x's
    dtype, the dtype eager's norm computes in."""
    if upcast and any(t is not None and t.dtype != x.dtype for t in (weight, bias)):
        wide = [None if t is None else t.float() for t in (weight, bias, shift, scale)]
        return _norm(kind, x.float(), *wide, eps, False).to(x.dtype)
    weight, bias = [None if t is None else t.to(x.dtype) for t in (weight, bias)]
    if kind == "layer":
        return layernorm(x, weight, bias, shift, scale, eps=eps, upcast=upcast)
    if weight is None:  # rn(n * 1) = n: a weight of ones gives the norm without affine
        weight = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    return rmsnorm(x, weight, shift, scale, eps=eps, upcast=upcast)


def _gated_norm(kind, residual, x, gate, weight, bias, shift, scale, eps, upcast):
    """``h = residual + gate * x`` (gate None: ``residual + x``), then the modulated norm of the
    stored h; returns ``(out, h)``. One fused op where the parameters have h's dtype, else the
    gated residual and :func:`_norm` (the same bits: the fused ops equal the two composed)."""
    h_dtype = residual.dtype if upcast or gate is None else torch.promote_types(residual.dtype, gate.dtype)
    if any(t is not None and t.dtype != h_dtype for t in (weight, bias)):
        if upcast:
            h = gate_residual(residual, x, gate, upcast=True)
            return _norm(kind, h, weight, bias, shift, scale, eps, True), h
        weight, bias = [None if t is None else t.to(h_dtype) for t in (weight, bias)]
    if kind == "layer":
        return gate_residual_layernorm(residual, x, gate, weight, bias, shift, scale, eps=eps, upcast=upcast)
    if weight is None:
        weight = torch.ones(residual.shape[-1], dtype=h_dtype, device=residual.device)
    h, out = gate_residual_rmsnorm(residual, x, gate, weight, shift, scale, eps=eps, upcast=upcast)
    return out, h


class ResidualRMSNorm(nn.Module):
    """SGLang-diffusion's ``RMSNorm(hidden_size, eps=1e-6, dtype=torch.float32)``:
    ``forward(x)`` is the norm of x times ``weight``; ``forward(x, residual)`` returns
    ``(norm(h), h)`` with ``h = x + residual``. (detdit.nn.RMSNorm is H3's modulated norm,
    hence the name.) The norm is computed in FP32 and rounded once to x's dtype, as SGLang's
    native path: with a weight in x's dtype it is detdit's rmsnorm, with an fp32 weight under
    16-bit x the FP32 norm of ``x.float()`` (the weight is never rounded).

    Choice where SGLang is ambiguous: h is the sum rounded to x's dtype (the residual the
    next layer sees) and the norm reads that stored h, as eager ``h = x + residual;
    norm(h)`` does. SGLang's native path normalises the FP32 sum before rounding it, its
    CUDA kernels differ among themselves. ``has_weight=False`` (the argument SGLang's older
    scale-shift layers pass) keeps no weight. ``var_hidden_size`` is not supported."""

    def __init__(self, hidden_size, eps=1e-6, dtype=torch.float32, var_hidden_size=None, has_weight=True,
                 device=None):
        super().__init__()
        if var_hidden_size is not None:
            raise ValueError("ResidualRMSNorm: var_hidden_size is not supported (the norm runs over every column)")
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device)) if has_weight else None
        self.variance_epsilon = eps

    def forward(self, x, residual=None):
        if residual is None:
            return _norm("rms", x, self.weight, None, None, None, self.variance_epsilon, True)
        return _gated_norm("rms", residual, x, None, self.weight, None, None, None, self.variance_epsilon, True)


class _NormScaleShift(nn.Module):
    """SGLang-diffusion's ``LayerNormScaleShift`` / ``RMSNormScaleShift``:
    ``forward(x, shift, scale) = norm(x) * (1 + scale) + shift``, shift and scale in any of
    detdit's modulation forms (per sample ``(B, H)`` / ``(B, 1, H)``, per frame
    ``(B, F, 1, H)``, per token ``(B, S, H)``; fp32 or x's dtype). The constructor is
    SGLang's (the norm type is the class's); ``compute_dtype`` picks the recipe:
    torch.float32 (the default, SGLang's newest layers compute in FP32) is detdit's upcast
    recipe, one rounding to x's dtype at the end (Wan's diffusers arithmetic; SGLang's native
    path rounds the norm to x's dtype once more before modulating); None rounds each op as
    eager does (SD3, Flux: out fp32 for fp32 shift and scale). Parameters (``norm.weight``,
    ``norm.bias`` with ``elementwise_affine``) in ``dtype``, as SGLang's."""

    _kind = None

    def __init__(self, hidden_size, eps=1e-6, elementwise_affine=False, dtype=torch.float32,
                 compute_dtype=torch.float32, prefix="", device=None):
        super().__init__()
        self.upcast = _upcast_of(compute_dtype, type(self).__name__)
        self.eps = eps
        if self._kind == "layer":
            self.norm = FP32LayerNorm(hidden_size, eps, elementwise_affine, elementwise_affine, device, dtype)
        else:
            self.norm = ResidualRMSNorm(hidden_size, eps, dtype, has_weight=elementwise_affine, device=device)

    def forward(self, x, shift, scale):
        return _norm(self._kind, x, self.norm.weight, getattr(self.norm, "bias", None), shift, scale, self.eps,
                     self.upcast)


class LayerNormScaleShift(_NormScaleShift):
    __doc__ = _NormScaleShift.__doc__
    _kind = "layer"


class RMSNormScaleShift(_NormScaleShift):
    __doc__ = _NormScaleShift.__doc__
    _kind = "rms"


class _ScaleResidualNormScaleShift(_NormScaleShift):
    """SGLang-diffusion's ``ScaleResidualLayerNormScaleShift`` /
    ``ScaleResidualRMSNormScaleShift``: ``forward(residual, x, gate, shift, scale)`` returns
    ``(out, residual_out)`` with ``residual_out = residual + x * gate`` and ``out =
    norm(residual_out) * (1 + scale) + shift``, one fused op. ``gate`` is a tensor in the
    form of shift and scale, or the int 1 for no gate (``residual + x``); SGLang asserts an int
    gate is 1, and any other int is a ValueError here. Constructor and recipe as
    :class:`LayerNormScaleShift`; with upcast, ``residual_out`` is Wan's
    ``(residual.float() + x * gate).type_as(residual)``, rounded once, and the norm reads it."""

    def forward(self, residual, x, gate, shift, scale):
        gate = _gate_of(gate, type(self).__name__)
        return _gated_norm(self._kind, residual, x, gate, self.norm.weight, getattr(self.norm, "bias", None), shift,
                           scale, self.eps, self.upcast)


class ScaleResidualLayerNormScaleShift(_ScaleResidualNormScaleShift):
    __doc__ = _ScaleResidualNormScaleShift.__doc__
    _kind = "layer"


class ScaleResidualRMSNormScaleShift(_ScaleResidualNormScaleShift):
    __doc__ = _ScaleResidualNormScaleShift.__doc__
    _kind = "rms"


class MulAdd(nn.Module):
    """SGLang-diffusion's ``MulAdd``: ``forward(a, b, c, k=0) = c + a * (k + b)``, b in any
    modulation form (``(B, 1, H)``, per frame ``(B, F, 1, H)``, ...). Choice: k applies in
    every form, as SGLang's CUDA kernel does (its native path drops k for a per-frame b).
    ``k=0`` is SGLang's ``c + a * (0 + b)``; it differs from ``c + a * b`` only in the sign of a
    zero product. ``compute_dtype`` (detdit's addition; SGLang's layer has none): None rounds
    each op as eager does, torch.float32 is the upcast recipe."""

    def __init__(self, prefix="", compute_dtype=None):
        super().__init__()
        self.upcast = _upcast_of(compute_dtype, "MulAdd")

    def forward(self, a, b, c, k=0):
        return gate_residual(c, a, b, k=k, upcast=self.upcast)


class ScaleResidual(nn.Module):
    """SGLang-diffusion's ``ScaleResidual``: ``forward(residual, x, gate) = residual + x *
    gate`` (eager's bits), gate in any modulation form or the int 1 (``residual + x``).
    ``compute_dtype`` as in :class:`MulAdd`."""

    def __init__(self, prefix="", compute_dtype=None):
        super().__init__()
        self.upcast = _upcast_of(compute_dtype, "ScaleResidual")

    def forward(self, residual, x, gate):
        return gate_residual(residual, x, _gate_of(gate, "ScaleResidual"), upcast=self.upcast)


def _plan_of(indices, x, num_rows):
    """A plan, or the plan of an ``(S,)`` row index for x's rows: built (and validated, a host
    read) on every call; build it once per step with plan_from_rows and pass that instead."""
    if isinstance(indices, torch.Tensor):
        seq = indices.shape[0] if indices.dim() == 1 else -1
        batch = x.shape[0] if x.dim() == 3 else 1
        if x.dim() == 2 and seq > 0:
            batch = x.shape[0] // seq
        return plan_from_rows(indices, num_rows, batch)
    return indices


class RMSNormIndexedScaleShift(nn.Module):
    """MiniMax-H3's indexed modulated RMSNorm with the call shape of SGLang's
    ``rmsnorm_indexed_scale_shift(x, gamma, scale, shift, indices, *, eps)``:
    ``rmsnorm(x) * gamma`` modulated by ``scale[indices]`` and ``shift[indices]`` (note the
    order: scale before shift). x ``(S, H)`` (or ``(B, S, H)``), gamma ``(H,)``, scale and
    shift ``(R, H)`` tables in x's dtype, indices an ``(S,)`` row index or a prebuilt plan
    (:func:`detdit.plan_from_rows`: one per step saves validating the index per call). The H3
    rule: :func:`detdit.rmsnorm` with a plan; eps defaults to the constructor's."""

    def __init__(self, eps=H3_NORM_EPS, numerics="portable"):
        super().__init__()
        self.eps, self.numerics = eps, numerics

    def forward(self, x, gamma, scale, shift, indices, *, eps=None):
        plan = _plan_of(indices, x, scale.shape[0])
        return rmsnorm(x, gamma, shift, scale, plan, self.eps if eps is None else eps, self.numerics)


class GateResidualRMSNormIndexedScaleShift(nn.Module):
    """MiniMax-H3's gated residual and the indexed modulated RMSNorm after it, with the call
    shape of SGLang's ``gate_residual_rmsnorm_indexed_scale_shift_(residual, update, gate,
    gamma, scale, shift, indices, *, eps)``, returning ``(out, residual_out)`` with
    ``residual_out = residual + gate[indices] * update``. Functional: residual is not updated
    in place (autograd needs it), assign the returned tensor. :func:`detdit.gate_residual_rmsnorm`
    with a plan (fused, bitwise equal to the two ops); indices as in
    :class:`RMSNormIndexedScaleShift`."""

    def __init__(self, eps=H3_NORM_EPS, numerics="portable"):
        super().__init__()
        self.eps, self.numerics = eps, numerics

    def forward(self, residual, update, gate, gamma, scale, shift, indices, *, eps=None):
        plan = _plan_of(indices, residual, gate.shape[0])
        h, out = gate_residual_rmsnorm(residual, update, gate, gamma, shift, scale, plan,
                                       self.eps if eps is None else eps, self.numerics)
        return out, h


# ---- Trainer side: diffusers' modules (parameter names and shapes as diffusers') ----------


def _silu_linear(emb, proj, chunks):
    """``proj(silu(emb))`` cast to the projection's dtype: detdit.adaln_projection with the
    module's chunk count, so the act is eager CUDA's (``silu`` in FP32, one rounding) on every
    device and the table is detdit's deterministic linear (docs/numerics.md 5.4). diffusers'
    modules always have the bias; a projection without one is refused."""
    if proj.bias is None:
        raise ValueError("detdit.nn: the AdaLN projection needs its bias (diffusers' bias=True); got bias=False")
    return adaln_projection(emb, proj.weight, proj.bias, chunks=chunks)


def _drop_bias(norm, bias):
    # nn.LayerNorm takes bias= only from torch 2.1; diffusers' bias=False leaves no bias parameter
    if not bias and norm.elementwise_affine:
        norm.register_parameter("bias", None)
    return norm


class FP32LayerNorm(nn.LayerNorm):
    """diffusers' ``FP32LayerNorm(dim, eps, elementwise_affine, bias)``: the LayerNorm of
    ``x.float()`` with ``weight.float()`` and ``bias.float()``, cast to x's dtype (one
    rounding). ``weight``, ``bias`` as nn.LayerNorm's; detdit's layernorm computes it (the
    upcast recipe; an fp32 weight under 16-bit x goes through ``x.float()``)."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, device=None, dtype=None):
        super().__init__(normalized_shape, eps, elementwise_affine, device=device, dtype=dtype)
        _drop_bias(self, bias)

    def forward(self, x):
        return _norm("layer", x, self.weight, self.bias, None, None, self.eps, True)


def _layer_norm_module(norm_type, dim, eps, fp32_eps=1e-5):
    """diffusers' AdaLayerNormZero norms: "layer_norm" is LayerNorm(dim, eps, no affine);
    "fp32_layer_norm" FP32LayerNorm(dim, no affine, no bias) with its default eps."""
    if norm_type == "layer_norm":
        return nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
    if norm_type == "fp32_layer_norm":
        return FP32LayerNorm(dim, eps=fp32_eps, elementwise_affine=False, bias=False)
    raise ValueError(f"unsupported norm_type {norm_type!r}: 'layer_norm' or 'fp32_layer_norm'")


def _modulated_layernorm(norm, x, shift, scale):
    """``norm(x) * (1 + scale[:, None]) + shift[:, None]`` with (B, H) shift and scale, each op
    rounding as eager's: the LayerNorm's output is the FP32 norm rounded once to x's dtype,
    which is also what FP32LayerNorm returns for the 16-bit x it is given."""
    weight, bias = (norm.weight, norm.bias) if norm.elementwise_affine else (None, None)
    return _norm("layer", x, weight, bias, shift, scale, norm.eps, False)


class AdaLayerNormZero(nn.Module):
    """diffusers' ``AdaLayerNormZero(embedding_dim, num_embeddings=None,
    norm_type="layer_norm", bias=True)`` (SD3, Flux, HunyuanVideo): ``linear`` ``(6H, H)``
    maps ``silu(emb)`` to shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp;
    ``forward(x, emb=emb)`` returns ``(norm(x) * (1 + scale_msa) + shift_msa, gate_msa,
    shift_mlp, scale_mlp, gate_mlp)``, each ``(B, H)``. ``norm`` is LayerNorm(H, eps 1e-6,
    no affine), or FP32LayerNorm (eps 1e-5) for "fp32_layer_norm". The class-label embedding
    (``num_embeddings``) is not supported: pass emb."""

    def __init__(self, embedding_dim, num_embeddings=None, norm_type="layer_norm", bias=True):
        super().__init__()
        if num_embeddings is not None:
            raise ValueError("AdaLayerNormZero: num_embeddings (the class-label embedding) is not supported; "
                             "pass emb")
        self.emb = None
        self.silu = nn.SiLU()
        self.linear = nn.Linear(embedding_dim, 6 * embedding_dim, bias=bias)
        self.norm = _layer_norm_module(norm_type, embedding_dim, 1e-6)

    def forward(self, x, timestep=None, class_labels=None, hidden_dtype=None, emb=None):
        if emb is None:
            raise ValueError("AdaLayerNormZero: emb is required (the class-label embedding is not supported)")
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = _silu_linear(emb, self.linear, 6).chunk(6, 1)
        return _modulated_layernorm(self.norm, x, shift_msa, scale_msa), gate_msa, shift_mlp, scale_mlp, gate_mlp


class AdaLayerNormZeroSingle(nn.Module):
    """diffusers' ``AdaLayerNormZeroSingle(embedding_dim, norm_type="layer_norm", bias=True)``
    (Flux's and HunyuanVideo's single blocks): ``linear`` ``(3H, H)``, shift, scale, gate;
    ``forward(x, emb)`` returns ``(norm(x) * (1 + scale) + shift, gate)``."""

    def __init__(self, embedding_dim, norm_type="layer_norm", bias=True):
        super().__init__()
        self.silu = nn.SiLU()
        self.linear = nn.Linear(embedding_dim, 3 * embedding_dim, bias=bias)
        if norm_type != "layer_norm":
            raise ValueError(f"AdaLayerNormZeroSingle: unsupported norm_type {norm_type!r}: 'layer_norm'")
        self.norm = nn.LayerNorm(embedding_dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x, emb=None):
        shift_msa, scale_msa, gate_msa = _silu_linear(emb, self.linear, 3).chunk(3, 1)
        return _modulated_layernorm(self.norm, x, shift_msa, scale_msa), gate_msa


class AdaLayerNormContinuous(nn.Module):
    """diffusers' ``AdaLayerNormContinuous(embedding_dim, conditioning_embedding_dim,
    elementwise_affine=True, eps=1e-5, bias=True, norm_type="layer_norm")`` (the final layer of
    SD3, Flux, HunyuanVideo, Qwen-Image): ``linear`` ``(2H, C)`` maps
    ``silu(conditioning).to(x.dtype)`` to **scale, shift** (scale first);
    ``forward(x, conditioning_embedding) = norm(x) * (1 + scale)[:, None] + shift[:, None]``.
    ``norm`` is LayerNorm(H, eps, elementwise_affine, bias). norm_type "rms_norm" is not
    supported (diffusers' RMSNorm rounds to the weight's dtype before the weight's product,
    which detdit's rmsnorm does not)."""

    def __init__(self, embedding_dim, conditioning_embedding_dim, elementwise_affine=True, eps=1e-5, bias=True,
                 norm_type="layer_norm"):
        super().__init__()
        if norm_type != "layer_norm":
            raise ValueError(f"AdaLayerNormContinuous: unsupported norm_type {norm_type!r}: 'layer_norm'")
        self.silu = nn.SiLU()
        self.linear = nn.Linear(conditioning_embedding_dim, 2 * embedding_dim, bias=bias)
        self.norm = _drop_bias(nn.LayerNorm(embedding_dim, eps, elementwise_affine), bias)

    def forward(self, x, conditioning_embedding):
        scale, shift = _silu_linear(conditioning_embedding, self.linear, 2).chunk(2, 1)
        return _modulated_layernorm(self.norm, x, shift, scale)


class SD35AdaLayerNormZeroX(nn.Module):
    """diffusers' ``SD35AdaLayerNormZeroX(embedding_dim, norm_type="layer_norm", bias=True)``
    (SD3.5's dual-attention blocks): ``linear`` ``(9H, H)`` maps ``silu(emb)`` to AdaLayerNormZero's
    six chunks then shift_msa2, scale_msa2, gate_msa2; ``forward(hidden_states, emb)`` returns
    ``(norm(x) * (1 + scale_msa) + shift_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp,
    norm(x) * (1 + scale_msa2) + shift_msa2, gate_msa2)``. diffusers modulates one norm(x)
    twice; here each modulated output is its own layernorm call, the same bits (the norm is
    deterministic, the modulation eager's operations on it). ``norm`` is LayerNorm(H, eps 1e-6,
    no affine)."""

    def __init__(self, embedding_dim, norm_type="layer_norm", bias=True):
        super().__init__()
        self.silu = nn.SiLU()
        self.linear = nn.Linear(embedding_dim, 9 * embedding_dim, bias=bias)
        if norm_type != "layer_norm":
            raise ValueError(f"SD35AdaLayerNormZeroX: unsupported norm_type {norm_type!r}: 'layer_norm'")
        self.norm = nn.LayerNorm(embedding_dim, elementwise_affine=False, eps=1e-6)

    def forward(self, hidden_states, emb=None):
        (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp, shift_msa2, scale_msa2,
         gate_msa2) = _silu_linear(emb, self.linear, 9).chunk(9, 1)
        norm_hidden_states = _modulated_layernorm(self.norm, hidden_states, shift_msa, scale_msa)
        norm_hidden_states2 = _modulated_layernorm(self.norm, hidden_states, shift_msa2, scale_msa2)
        return norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp, norm_hidden_states2, gate_msa2


class CogVideoXLayerNormZero(nn.Module):
    """diffusers' ``CogVideoXLayerNormZero(conditioning_dim, embedding_dim,
    elementwise_affine=True, eps=1e-5, bias=True)``: ``linear`` ``(6H, C)`` maps ``silu(temb)``
    to shift, scale, gate, enc_shift, enc_scale, enc_gate; one ``norm`` (LayerNorm(H, eps,
    elementwise_affine, bias)) serves both streams. ``forward(hidden_states,
    encoder_hidden_states, temb)`` returns ``(norm(x) * (1 + scale) + shift, norm(enc) * (1 +
    enc_scale) + enc_shift, gate[:, None, :], enc_gate[:, None, :])``."""

    def __init__(self, conditioning_dim, embedding_dim, elementwise_affine=True, eps=1e-5, bias=True):
        super().__init__()
        self.silu = nn.SiLU()
        self.linear = nn.Linear(conditioning_dim, 6 * embedding_dim, bias=bias)
        self.norm = _drop_bias(nn.LayerNorm(embedding_dim, eps=eps, elementwise_affine=elementwise_affine), bias)

    def forward(self, hidden_states, encoder_hidden_states, temb):
        shift, scale, gate, enc_shift, enc_scale, enc_gate = _silu_linear(temb, self.linear, 6).chunk(6, 1)
        hidden_states = _modulated_layernorm(self.norm, hidden_states, shift, scale)
        encoder_hidden_states = _modulated_layernorm(self.norm, encoder_hidden_states, enc_shift, enc_scale)
        return hidden_states, encoder_hidden_states, gate[:, None, :], enc_gate[:, None, :]


class AdaLayerNorm(nn.Module):
    """diffusers' ``AdaLayerNorm(embedding_dim, num_embeddings=None, output_dim=None,
    norm_elementwise_affine=False, norm_eps=1e-5, chunk_dim=0)``: ``linear`` ``(output_dim, D)``
    (output_dim defaults to 2D) maps ``silu(temb)`` to two chunks; ``norm`` is
    LayerNorm(output_dim // 2, norm_eps, norm_elementwise_affine). ``forward(x, timestep=None,
    temb=None) = norm(x) * (1 + scale) + shift``. ``chunk_dim=1`` (CogVideoX's ``norm_out``):
    temb ``(B, D)``, **shift, scale** (shift first), each ``(B, H)`` broadcast over x's ``(B, S,
    H)`` positions. ``chunk_dim=0``: temb one ``(D,)`` row, **scale, shift** (scale first), each
    ``(H,)`` broadcast over every row of x. The timestep embedding (``num_embeddings``, a
    ``timestep`` argument) and any other temb shape are a ValueError."""

    def __init__(self, embedding_dim, num_embeddings=None, output_dim=None, norm_elementwise_affine=False,
                 norm_eps=1e-5, chunk_dim=0):
        super().__init__()
        if num_embeddings is not None:
            raise ValueError("AdaLayerNorm: num_embeddings (the timestep's nn.Embedding) is not supported; pass temb")
        if chunk_dim not in (0, 1):
            raise ValueError(f"AdaLayerNorm: chunk_dim must be 0 or 1, got {chunk_dim!r}")
        self.chunk_dim = chunk_dim
        output_dim = output_dim or embedding_dim * 2
        self.emb = None
        self.silu = nn.SiLU()
        self.linear = nn.Linear(embedding_dim, output_dim)
        self.norm = nn.LayerNorm(output_dim // 2, norm_eps, norm_elementwise_affine)

    def forward(self, x, timestep=None, temb=None):
        if timestep is not None or temb is None:
            raise ValueError("AdaLayerNorm: pass temb (the timestep embedding, num_embeddings, is not supported)")
        if self.chunk_dim == 1:
            if temb.dim() != 2 or x.dim() != 3:
                raise ValueError(f"AdaLayerNorm(chunk_dim=1): temb must be (B, D) and x (B, S, H), got "
                                 f"{tuple(temb.shape)} and {tuple(x.shape)}")
            shift, scale = _silu_linear(temb, self.linear, 2).chunk(2, 1)
            return _modulated_layernorm(self.norm, x, shift, scale)
        if temb.dim() != 1:
            raise ValueError(f"AdaLayerNorm(chunk_dim=0): temb must be one (D,) row (diffusers' chunk(2, dim=0) "
                             f"splits it into scale and shift), got {tuple(temb.shape)}")
        scale, shift = _silu_linear(temb[None], self.linear, 2).chunk(2, 1)
        # one (1, H) row for every row of x: x as one sample of all its rows (the norm is row-wise)
        return _modulated_layernorm(self.norm, x.reshape(1, -1, x.shape[-1]), shift, scale).reshape(x.shape)


class PixArtAlphaCombinedTimestepSizeEmbeddings(nn.Module):
    """diffusers' ``PixArtAlphaCombinedTimestepSizeEmbeddings`` without the additional
    conditions: ``time_proj`` Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0) of t in
    [0, t_max], cast to hidden_dtype, then ``timestep_embedder`` TimestepEmbedding(256, H) in its
    parameters' dtype."""

    def __init__(self, embedding_dim, t_max=1000.0):
        super().__init__()
        self.time_proj = Timesteps(256, True, 0, t_max=t_max)
        self.timestep_embedder = TimestepEmbedding(256, embedding_dim, embedding_dim)

    def forward(self, timestep, hidden_dtype=None):
        features = self.time_proj(timestep)
        return self.timestep_embedder(features if hidden_dtype is None else features.to(hidden_dtype))


class AdaLayerNormSingle(nn.Module):
    """diffusers' ``AdaLayerNormSingle(embedding_dim, use_additional_conditions=False)``
    (LTX-Video, PixArt): ``emb`` the timestep embedding (``emb.timestep_embedder.linear_1``
    ``(H, 256)``, ``linear_2`` ``(H, H)``), ``linear`` ``(6H, H)``; ``forward(timestep,
    added_cond_kwargs=None, batch_size=None, hidden_dtype=None)`` returns
    ``(linear(silu(embedded_timestep)), embedded_timestep)``, no modulation inside. ``timestep``
    is ``(T,)`` in [0, ``t_max``] (detdit's addition: the sinusoid's bound, 1000 for sigma *
    1000); the sinusoid is cast to ``hidden_dtype`` (the model's), as diffusers does, and the
    time MLP runs in its parameters' dtype. ``use_additional_conditions=True`` (PixArt's
    resolution and aspect-ratio embedders) is a ValueError; without it diffusers ignores
    added_cond_kwargs and batch_size, and so does this."""

    def __init__(self, embedding_dim, use_additional_conditions=False, t_max=1000.0):
        super().__init__()
        if use_additional_conditions:
            raise ValueError("AdaLayerNormSingle: use_additional_conditions (the resolution and aspect-ratio "
                             "embedders) is not supported")
        self.emb = PixArtAlphaCombinedTimestepSizeEmbeddings(embedding_dim, t_max)
        self.silu = nn.SiLU()
        self.linear = nn.Linear(embedding_dim, 6 * embedding_dim, bias=True)

    def forward(self, timestep, added_cond_kwargs=None, batch_size=None, hidden_dtype=None):
        embedded_timestep = self.emb(timestep, hidden_dtype)
        return _silu_linear(embedded_timestep, self.linear, 6), embedded_timestep
