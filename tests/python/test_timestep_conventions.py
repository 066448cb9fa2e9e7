"""timestep_sinusoid and detdit.nn.Timesteps in the conventions of the DiT families, on the CPU.

The reference is diffusers' get_timestep_embedding written out in plain torch ops (float32, CPU).
The portable profile differs from it in three places, so the check is a bound, not bytes:
PyTorch's CPU kernel divides the exponent by (half - shift) where detdit multiplies by the FP32
reciprocal (PyTorch's CUDA kernel does the same, docs/numerics.md 5.1): the exponent moves by at
most one of its ulps; exp, sin and cos are detdit's portable functions against PyTorch's CPU ones
(each side within one ulp of the exact value). freq therefore differs by at most ulp(exponent) +
2^-22 relative, arg = scale * (t * freq) by |arg| times that plus two roundings, and sin/cos move by
no more than their argument (|d sin| <= |d arg|) plus one ulp of a result below 1 on each side:

    |detdit - diffusers| <= |arg| * (ulp(exponent) + 2^-21) + 2^-22        per element,

which is 4 ulps of the argument plus 1 ulp of the exponent's share, and 2^-22 (2 ulps of 1).
"""
import math

import pytest
import torch

import detdit
from detdit.nn import Timesteps


def diffusers_embedding(timesteps, embedding_dim, flip_sin_to_cos, downscale_freq_shift, scale, max_period=10000):
    """get_timestep_embedding's steps as plain torch ops; also returns the argument and exponent."""
    half_dim = embedding_dim // 2
    exponent = -math.log(max_period) * torch.arange(start=0, end=half_dim, dtype=torch.float32)
    exponent = exponent / (half_dim - downscale_freq_shift)
    emb = torch.exp(exponent)
    emb = timesteps[:, None].float() * emb[None, :]
    emb = scale * emb
    arg = emb
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)
    if flip_sin_to_cos:
        emb = torch.cat([emb[:, half_dim:], emb[:, :half_dim]], dim=-1)
    if embedding_dim % 2 == 1:
        emb = torch.nn.functional.pad(emb, (0, 1, 0, 0))
    return emb, arg, exponent


def ulp(x):
    """The FP32 ulp of |x| (normal values; 2^-149 below)."""
    _, e = torch.frexp(x.abs().float())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), (e - 24).clamp(min=-149))


def columns(values, embedding_dim):
    """(T, half) per-frequency values laid out as the features' columns (either order; the pad 0)."""
    both = torch.cat([values, values], dim=-1)
    if embedding_dim % 2 == 1:
        both = torch.nn.functional.pad(both, (0, 1, 0, 0))
    return both


def timesteps_for(t_max, count, seed, integer=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(count, generator=g, dtype=torch.float64) * t_max
    if integer:
        t = t.floor().clamp(max=t_max - 1)
    t[0], t[1] = 0.0, (t_max - 1 if integer else t_max)
    return t.to(dtype)


# (name, Timesteps arguments (num_channels, flip_sin_to_cos, downscale_freq_shift, scale), t_max,
#  integer timesteps, timesteps dtype)
FAMILIES = [
    ("SD3/Flux/HunyuanVideo/LTX sigma*1000", (256, True, 0, 1), 1000.0, False, torch.float32),
    ("Flux bf16 t", (256, True, 0, 1), 1000.0, False, torch.bfloat16),
    ("Wan integer t", (256, True, 0, 1), 1000.0, True, torch.float32),
    ("CogVideoX C=1920", (1920, True, 0, 1), 1000.0, True, torch.float32),
    ("Qwen-Image scale=1000", (256, True, 0, 1000), 1.0, False, torch.bfloat16),
    ("Flux guidance*1000", (256, True, 0, 1), 20000.0, False, torch.float32),
    ("H3", (256, True, 0, 1), 1.0, False, torch.float32),
    ("odd C, [sin | cos], shift 1", (255, False, 1, 1), 1000.0, False, torch.float32),
    ("C=1", (1, True, 0, 1), 1000.0, False, torch.float32),
]


@pytest.mark.parametrize("name,args,t_max,integer,dtype", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_matches_diffusers_within_the_stated_bound(name, args, t_max, integer, dtype):
    channels, flip, shift, scale = args
    t = timesteps_for(t_max, 64, 7, integer, dtype)
    module = Timesteps(channels, flip, shift, scale, t_max=t_max)
    got = module(t)
    want, arg, exponent = diffusers_embedding(t, channels, flip, shift, scale)
    assert got.dtype == torch.float32 and got.shape == (64, channels)
    assert torch.equal(detdit.timestep_sinusoid(t, channels, 10000, flip, shift, scale, t_max), got)
    bound = columns(arg.abs() * (ulp(exponent)[None, :] + 2.0 ** -21), channels) + 2.0 ** -22
    excess = (got.double() - want.double()).abs() - bound.double()
    assert excess.max().item() <= 0, f"{name}: {excess.max().item()} past the bound"
    if channels % 2:
        assert torch.equal(got[:, -1], torch.zeros(64)) and not got[:, -1].signbit().any()


def test_defaults_are_h3_bitwise():
    t = timesteps_for(1.0, 33, 8)
    h3 = detdit.timestep_sinusoid(t)
    assert torch.equal(detdit.timestep_sinusoid(t, 256, 10000, True, 0, 1, 1.0).view(torch.int32), h3.view(torch.int32))
    assert torch.equal(Timesteps()(t).view(torch.int32), h3.view(torch.int32))
    # the H3 module keeps its constructor by keyword
    assert torch.equal(detdit.nn.H3Conditioning(num_blocks=0, hidden_size=8, time_embed_hidden_dim=8,
                                                time_embed_dim=8, device="meta").time_proj(t), h3)


def test_module_mirrors_diffusers_constructor():
    m = Timesteps(1920, True, 0)  # CogVideoX's positional call
    assert (m.num_channels, m.flip_sin_to_cos, m.downscale_freq_shift, m.scale, m.t_max) == (1920, True, 0, 1, 1.0)
    m = Timesteps(num_channels=256, flip_sin_to_cos=True, downscale_freq_shift=0, scale=1000)  # Qwen-Image's
    assert m.scale == 1000 and list(m.parameters()) == []
    with pytest.raises(TypeError, match="flip_sin_to_cos must be a bool, got int"):
        Timesteps(256, 10000)(torch.tensor([0.5]))  # the old (num_channels, max_period) order fails closed


def test_gradient_follows_the_convention():
    t = timesteps_for(1.0, 16, 9).requires_grad_(True)
    g = torch.randn(16, 255, generator=torch.Generator().manual_seed(10))
    detdit.timestep_sinusoid(t, 255, 10000, False, 1, 1000, 1.0).backward(g)
    d = t.grad.clone()
    # the same through the raw backward op, and the pad column's gradient never read
    g_nan = g.clone()
    g_nan[:, -1] = float("nan")
    raw = torch.ops.detdit.timestep_sinusoid_backward(g_nan, t.detach(), 10000.0, "portable", True, False, 1.0, 1000.0,
                                                      1.0)
    assert torch.equal(raw, d)
    # against the diffusers formula's autograd in FP64: each term |scale freq g| moves by the
    # argument's error (2^-23 + |scale| t_max 2^-21, cases/timestep_cases.cc) and its own roundings
    # (2^-22), and the chain of half sums by at most half 2^-23 of the sum of |terms|
    tt = t.detach().double().requires_grad_(True)
    half = 127
    freq = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float64) / (half - 1))
    arg = 1000 * tt[:, None] * freq[None, :]
    (torch.cat([torch.sin(arg), torch.cos(arg), torch.zeros(16, 1, dtype=torch.float64)], -1) * g.double()).sum().backward()
    weight = (1000 * freq[None, :] * (g[:, :half].abs() + g[:, half:2 * half].abs()).double()).sum(-1)
    bound = weight * (2.0 ** -23 + 1000 * 2.0 ** -21 + 2.0 ** -22 + half * 2.0 ** -23)
    assert ((d.double() - tt.grad).abs() <= bound).all()


@pytest.mark.parametrize("bad,where", [(float("nan"), "nan"), (float("inf"), "inf"), (-1.0, "-1"), (1000.5, "1000.5")])
def test_each_convention_refuses_values_outside_its_range(bad, where):
    t = torch.tensor([0.0, 999.0, bad, 1.0])
    with pytest.raises(ValueError, match=rf"^timestep must be finite and lie in \[0, t_max\] = \[0, 1000\] "
                                         rf"\(got timesteps\[2\] = {where}\)$"):
        Timesteps(256, True, 0, t_max=1000)(t)
    # H3's default refuses the sigma * 1000 convention, saying how to ask for it
    with pytest.raises(ValueError, match=r"lie in \[0, 1\]: detdit consumes t = 1 - sigma unscaled unless t_max "
                                         r"says otherwise \(t_max = 1000 for sigma \* 1000\) \(got timesteps\[1\] = 999\)"):
        detdit.timestep_sinusoid(t)


def test_bad_convention_arguments_are_refused():
    t = torch.tensor([0.5])
    with pytest.raises(ValueError, match=r"^\|scale\| \* t_max = 1001000 exceeds 1e6"):
        detdit.timestep_sinusoid(t, scale=1000, t_max=1001)
    with pytest.raises(ValueError, match=r"exceeds 1e6"):  # also without the host read
        detdit.timestep_sinusoid(t, t_max=2e6, check_range=False)
    with pytest.raises(ValueError, match="downscale_freq_shift must be finite and less than half = num_channels // 2 = 128"):
        detdit.timestep_sinusoid(t, downscale_freq_shift=128)
    with pytest.raises(ValueError, match="t_max .* must be finite and positive, got 0"):
        detdit.timestep_sinusoid(t, t_max=0)
    with pytest.raises(ValueError, match="scale must be finite"):
        detdit.timestep_sinusoid(t, scale=float("inf"))
    with pytest.raises(ValueError, match="num_channels must be positive, got 0"):
        detdit.timestep_sinusoid(t, num_channels=0)
    for name, kwargs in [("flip_sin_to_cos must be a bool, got int", dict(flip_sin_to_cos=1)),
                         ("downscale_freq_shift must be a real number, got str", dict(downscale_freq_shift="0")),
                         ("scale must be a real number, got NoneType", dict(scale=None)),
                         ("t_max must be a real number, got str", dict(t_max="1000"))]:
        with pytest.raises(TypeError, match=f"^timestep_sinusoid: {name}$"):
            detdit.timestep_sinusoid(t, **kwargs)
