"""detdit.nn: modules that mirror diffusers' MiniMax-H3 conditioning modules.

Parameter names and shapes follow the H3 manifest (docs/weights.md), so a state dict
of the real model's conditioning tensors loads unchanged into :class:`H3Conditioning`
(``time_embedder.linear_1.weight``, ``transformer_blocks.{i}.adaln_proj.linear.weight``,
``transformer_blocks.{i}.norm1.weight``, ``norm_out.norm.weight``, ...). Defaults are the
H3 sizes and dtypes: the time embedder is float32, everything else bfloat16. Pass
``device="meta"`` to build the full-size structure without allocating it.
"""
import torch
from torch import nn

from . import (ADALN_CHUNKS, H3_FREQ_DIM, H3_HIDDEN_SIZE, H3_MAX_PERIOD, H3_NORM_EPS, H3_TIME_EMBED_DIM,
               H3_TIME_EMBED_HIDDEN_DIM, NUM_MODALITIES)
from . import adaln_modulation, adaln_projection, adaln_table_chunks, final_adaln_out, gate_residual
from . import gate_residual_rmsnorm, rmsnorm, timestep_mlp, timestep_sinusoid

__all__ = ["Timesteps", "TimestepEmbedding", "AdaLNModulation", "RMSNorm", "GatedResidual", "AdaLayerNormOut",
           "H3BlockConditioning", "H3TokenRefiner", "H3Conditioning"]


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
