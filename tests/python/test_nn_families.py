"""detdit.nn's drop-in modules for the DiT families, on the CPU against the same computation in
plain PyTorch.

Rollout side (SGLang-diffusion's call signatures) and trainer side (diffusers' parameter names):
- bitwise: the modulation ``n * (1 + scale) + shift`` applied by eager to detdit's plain norm n
  (in the recipe's dtype: x's for each-op, FP32 of ``x.float()`` for upcast, then one
  rounding), the gated residual (eager's ``residual + x * gate``, Wan's upcast form), and the
  projection's chunks as the modules hand them on;
- within the bound tests/python/test_families_eager.py uses: the norms and the projection are
  at least as close to the float64 value of the same graph as eager's, to one ulp of the
  result's dtype at its largest magnitude;
- a state dict of modules under diffusers' names (a small tree of plain torch modules made
  here; diffusers is not installed) loads unchanged, strict, and back;
- autograd gradients within normwise bounds of float64 eager; repeatable to the bit.
"""
import ast
import inspect
import os
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import detdit
import detdit.nn as dnn
from conftest import assert_bitwise_equal

B, S, H, FRAMES, COND = 2, 24, 64, 4, 32
BF16 = torch.bfloat16


def _randn(shape, seed, dtype=BF16, std=1.0, mean=0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * std + mean).to(dtype)


def _ulp(v, dtype):
    mant = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24, torch.float64: 53}[dtype]
    exponent = torch.frexp(torch.tensor(v, dtype=torch.float64).abs().clamp_min(torch.finfo(dtype).tiny))[1]
    return float(torch.ldexp(torch.ones((), dtype=torch.float64), exponent - mant))


def assert_as_close_as_eager(got, eager, truth, what):
    """got is at least as close to the float64 truth as eager is, to one ulp of got's dtype at
    the truth's largest magnitude (the bound of test_families_eager.py)."""
    assert got.dtype == eager.dtype and got.shape == eager.shape, f"{what}: {got.dtype} {tuple(got.shape)} vs " \
                                                                   f"{eager.dtype} {tuple(eager.shape)}"
    truth = truth.detach().double()
    slack = _ulp(truth.abs().max().item(), got.dtype)
    tg = (got.detach().double() - truth).abs().max().item()
    te = (eager.detach().double() - truth).abs().max().item()
    assert tg <= te + slack, f"{what}: detdit is {tg:.3e} from float64, eager {te:.3e} (slack {slack:.1e})"


def check_normwise(actual, reference, dtype, what):
    """test_autograd.py's bound: max |detdit - fp64| <= tol * max |fp64|, tol 2^-16 for fp32
    activations, 2^-6 for bf16 (a few bf16 roundings of the forward feed every gradient)."""
    ref = reference.detach().double()
    assert ref.abs().max().item() > 0, f"{what}: zero reference (the check would be empty)"
    err = (actual.detach().double() - ref).abs().max().item()
    bound = {torch.float32: 2.0 ** -16, BF16: 2.0 ** -6}[dtype] * ref.abs().max().item()
    assert err <= bound, f"{what}: {err:.3e} exceeds {bound:.3e}"


# ---- eager references: plain torch -------------------------------------------------------------
def per(v, m, fn):
    """fn(v, m) with m broadcast as the models do: (B, H) per sample, (B, F, 1, H) per frame over
    the frames of (B, S, H), (B, 1, H) / (B, S, H) / gathered rows as they are."""
    if m.dim() == 2 and v.dim() == 3 and m.shape[0] == v.shape[0] and m.shape[1] == v.shape[2]:
        return fn(v, m[:, None])
    if m.dim() == 4:
        return fn(v.unflatten(1, (m.shape[1], -1)), m).flatten(1, 2)
    return fn(v, m)


def eager_modulate(n, shift, scale):
    return per(per(n, scale, lambda v, s: v * (1 + s)), shift, lambda v, s: v + s)


def eager_gate(residual, x, gate, upcast, k=None):
    if gate is None:
        return residual + x
    term = (lambda g: g) if k is None else (lambda g: k + g)
    split, join = (lambda v: v), (lambda v: v)
    if gate.dim() == 4:  # per frame: (B, F, 1, H) against the frames of (B, S, H)
        split, join = (lambda v: v.unflatten(1, (gate.shape[1], -1))), (lambda v: v.flatten(1, 2))
    if upcast:
        return join(split(residual.float()) + split(x.float()) * term(gate.float())).to(residual.dtype)
    return join(split(residual) + split(x) * term(gate))


def eager_norm(kind, x, w, b, eps):
    """eager's norm in x's dtype (torch's layer_norm; the FP32 RMSNorm rounded once)."""
    if kind == "layer":
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)
    xf = x.double() if x.dtype == torch.float64 else x.float()
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (n if w is None else n * w.to(xf.dtype)).to(x.dtype)


def detdit_plain_norm(kind, x, w, b, eps):
    if kind == "layer":
        return detdit.layernorm(x, w, b, eps=eps)
    return detdit.rmsnorm(x, torch.ones(x.shape[-1], dtype=x.dtype) if w is None else w, eps=eps)


def modulation(form, dtype, seed):
    """shift, scale, gate as the models view them."""
    if form == "per_sample":
        parent = _randn((B, 6, H), seed, dtype, 0.5)
        return [parent[:, c:c + 1] for c in range(3)]
    if form == "per_frame":
        parent = _randn((B, FRAMES, 6, H), seed, dtype, 0.5)
        return [parent[:, :, c:c + 1] for c in range(3)]
    parent = _randn((B, S, 6, H), seed, dtype, 0.5)
    return [parent[:, :, c] for c in range(3)]


def reference_norm_scale_shift(kind, x, w, b, shift, scale, eps, upcast):
    """The module's arithmetic with detdit's plain norm n in place of eager's: the modulation
    (and the final rounding) are eager's operations."""
    if upcast:
        f = [None if t is None else t.float() for t in (w, b)]
        return eager_modulate(detdit_plain_norm(kind, x.float(), *f, eps), shift.float(), scale.float()).to(x.dtype)
    w, b = [None if t is None else t.to(x.dtype) for t in (w, b)]
    return eager_modulate(detdit_plain_norm(kind, x, w, b, eps), shift, scale)


def check_plain_norm(kind, x, w, b, eps, what):
    """detdit's plain norm within the bound of eager's (float64 truth of the same graph)."""
    w, b = [None if t is None else t.to(x.dtype) for t in (w, b)]
    truth = eager_norm(kind, x.double(), *[None if t is None else t.double() for t in (w, b)], eps)
    assert_as_close_as_eager(detdit_plain_norm(kind, x, w, b, eps), eager_norm(kind, x, w, b, eps), truth, what)


MODULE = {("layer", False): dnn.LayerNormScaleShift, ("rms", False): dnn.RMSNormScaleShift,
          ("layer", True): dnn.ScaleResidualLayerNormScaleShift, ("rms", True): dnn.ScaleResidualRMSNormScaleShift}
CASES = [  # (compute dtype, modulation dtype, parameter dtype, affine)
    (torch.float32, torch.float32, torch.float32, True),   # Wan: fp32 weights under bf16 x, the x.float() route
    (torch.float32, BF16, BF16, True),                     # upcast, parameters in x's dtype: the fused route
    (torch.float32, torch.float32, torch.float32, False),
    (None, BF16, BF16, True),                              # SD3, Flux: each op rounds in bf16
    (None, torch.float32, BF16, False),                    # each op, fp32 modulation: out fp32
]


def make(kind, gated, compute_dtype, param_dtype, affine, eps=1e-6):
    module = MODULE[kind, gated](H, eps=eps, elementwise_affine=affine, dtype=param_dtype,
                                 compute_dtype=compute_dtype)
    with torch.no_grad():
        for i, p in enumerate(module.parameters()):
            p.copy_(_randn(p.shape, 90 + i, torch.float64, 0.5, 1.0 if i == 0 else 0.0))  # not bf16-exact in fp32
    return module


@pytest.mark.parametrize("form", ["per_sample", "per_frame", "per_token"])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_norm_scale_shift_matches_eager(kind, case, form):
    compute_dtype, mod_dtype, param_dtype, affine = CASES[case]
    module = make(kind, False, compute_dtype, param_dtype, affine)
    x = _randn((B, S, H), 1, BF16, 3.0, 1.0)
    shift, scale, _ = modulation(form, mod_dtype, 2)
    w, b = module.norm.weight, getattr(module.norm, "bias", None)
    out = module(x, shift, scale)
    want = reference_norm_scale_shift(kind, x, w, b, shift, scale, 1e-6, compute_dtype is not None)
    assert_bitwise_equal(out, want, f"{kind} {CASES[case]} {form}")
    check_plain_norm(kind, x, w, b, 1e-6, f"{kind} norm")


@pytest.mark.parametrize("form", ["per_sample", "per_frame", "per_token", "int_gate"])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_scale_residual_norm_scale_shift_matches_eager(kind, case, form):
    compute_dtype, mod_dtype, param_dtype, affine = CASES[case]
    upcast = compute_dtype is not None
    module = make(kind, True, compute_dtype, param_dtype, affine)
    residual, x = _randn((B, S, H), 3, BF16, 2.0), _randn((B, S, H), 4)
    shift, scale, gate = modulation("per_sample" if form == "int_gate" else form, mod_dtype, 5)
    out, h = module(residual, x, 1 if form == "int_gate" else gate, shift, scale)
    want_h = eager_gate(residual, x, None if form == "int_gate" else gate, upcast)
    assert_bitwise_equal(h, want_h, f"{kind} {CASES[case]} {form}: residual_out")
    want = reference_norm_scale_shift(kind, want_h, module.norm.weight, getattr(module.norm, "bias", None), shift,
                                      scale, 1e-6, upcast)
    assert_bitwise_equal(out, want, f"{kind} {CASES[case]} {form}: out")


def test_int_gate_other_than_one_is_refused():
    module = dnn.ScaleResidualLayerNormScaleShift(H)
    t = _randn((B, S, H), 1)
    shift, scale, _ = modulation("per_sample", BF16, 2)
    for gate in (0, 2, True):
        with pytest.raises(ValueError, match="the int 1"):
            module(t, t, gate, shift, scale)
    with pytest.raises(ValueError, match="compute_dtype"):
        dnn.LayerNormScaleShift(H, compute_dtype=BF16)


def test_sglang_modules_hold_sglangs_parameters():
    for cls in (dnn.LayerNormScaleShift, dnn.ScaleResidualLayerNormScaleShift):
        state = cls(H, elementwise_affine=True).state_dict()
        assert {k: (v.shape, v.dtype) for k, v in state.items()} == {
            "norm.weight": ((H,), torch.float32), "norm.bias": ((H,), torch.float32)}, cls.__name__
        assert not cls(H).state_dict(), cls.__name__
    for cls in (dnn.RMSNormScaleShift, dnn.ScaleResidualRMSNormScaleShift):
        state = cls(H, elementwise_affine=True, dtype=BF16).state_dict()
        assert {k: (v.shape, v.dtype) for k, v in state.items()} == {"norm.weight": ((H,), BF16)}, cls.__name__
        assert not cls(H).state_dict(), cls.__name__


@pytest.mark.parametrize("form", ["per_sample", "per_frame", "per_token"])
@pytest.mark.parametrize("mod_dtype", [BF16, torch.float32])
def test_mul_add_and_scale_residual_are_eagers_bits(form, mod_dtype):
    a, c = _randn((B, S, H), 6), _randn((B, S, H), 7, BF16, 2.0)
    _, b, gate = modulation(form, mod_dtype, 8)
    for k in (0, 1, 0.5):  # k in every form (SGLang's native path drops it for a per-frame b)
        assert_bitwise_equal(dnn.MulAdd()(a, b, c, k), eager_gate(c, a, b, False, k), f"MulAdd k={k} {form}")
        assert_bitwise_equal(dnn.MulAdd(compute_dtype=torch.float32)(a, b, c, k), eager_gate(c, a, b, True, k),
                             f"MulAdd upcast k={k} {form}")
    assert_bitwise_equal(dnn.MulAdd()(a, b, c), eager_gate(c, a, b, False, 0), f"MulAdd default k {form}")
    assert_bitwise_equal(dnn.ScaleResidual()(c, a, gate), eager_gate(c, a, gate, False), f"ScaleResidual {form}")
    assert_bitwise_equal(dnn.ScaleResidual(compute_dtype=torch.float32)(c, a, gate), eager_gate(c, a, gate, True),
                         f"ScaleResidual upcast {form}")
    assert_bitwise_equal(dnn.ScaleResidual()(c, a, 1), c + a, "ScaleResidual int gate")


@pytest.mark.parametrize("weight_dtype", [torch.float32, BF16])
def test_residual_rmsnorm_matches_sglangs_arithmetic(weight_dtype):
    norm = dnn.ResidualRMSNorm(H, eps=1e-6, dtype=weight_dtype)
    with torch.no_grad():
        norm.weight.copy_(_randn((H,), 9, torch.float64, 0.5, 1.0))
    x, residual = _randn((B, S, H), 10, BF16, 3.0), _randn((B, S, H), 11, BF16, 2.0)
    # SGLang's native arithmetic: (x.float() * rsqrt(mean(x^2) + eps) * weight).to(x.dtype)
    def sglang(v, w):
        vf = v.to(torch.float64 if v.dtype == torch.float64 else torch.float32)
        return (vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.to(vf.dtype)).to(v.dtype)
    out = norm(x)
    assert_as_close_as_eager(out, sglang(x, norm.weight), sglang(x.double(), norm.weight.double()), "no residual")
    out_r, h = norm(x, residual)
    assert_bitwise_equal(h, x + residual, "residual_out")  # the sum rounded to x's dtype
    assert_bitwise_equal(out_r, norm(h), "the norm of the stored residual_out")
    assert norm.state_dict().keys() == {"weight"}
    with pytest.raises(ValueError, match="var_hidden_size"):
        dnn.ResidualRMSNorm(H, var_hidden_size=H // 2)


def test_h3_indexed_modules_have_sglangs_call_shape():
    rows = 5
    x, residual, update = _randn((S, H), 12, BF16, 3.0), _randn((S, H), 13, BF16, 2.0), _randn((S, H), 14)
    gamma = _randn((H,), 15, BF16, 0.5, 1.0)
    shift, scale, gate = [_randn((rows, H), 16 + i, BF16, 0.5) for i in range(3)]
    indices = torch.randint(0, rows, (S,), generator=torch.Generator().manual_seed(19), dtype=torch.int32)
    n = detdit.rmsnorm(x, gamma, eps=1e-5)
    idx = indices.long()
    out = dnn.RMSNormIndexedScaleShift()(x, gamma, scale, shift, indices, eps=1e-5)
    assert_bitwise_equal(out, n * (1 + scale[idx]) + shift[idx], "rmsnorm_indexed_scale_shift")
    plan = detdit.plan_from_rows(indices, rows)
    assert_bitwise_equal(dnn.RMSNormIndexedScaleShift(eps=1e-5)(x, gamma, scale, shift, plan), out, "with a plan")
    region = dnn.GateResidualRMSNormIndexedScaleShift()
    out_g, h = region(residual, update, gate, gamma, scale, shift, indices, eps=1e-5)
    assert_bitwise_equal(h, residual + gate[idx] * update, "gate_residual_rmsnorm_indexed_scale_shift_ residual")
    assert_bitwise_equal(out_g, dnn.RMSNormIndexedScaleShift()(h, gamma, scale, shift, plan), "its out")
    # (B, S, H) activations with an (S,) index shared by the batch
    xb = _randn((B, S, H), 20, BF16, 3.0)
    nb = detdit.rmsnorm(xb, gamma, eps=1e-5)
    assert_bitwise_equal(dnn.RMSNormIndexedScaleShift()(xb, gamma, scale, shift, indices),
                         nb * (1 + scale[idx]) + shift[idx], "batched")


# ---- trainer side: diffusers' names and arithmetic in plain torch ------------------------------
class RefFP32LayerNorm(nn.LayerNorm):
    def forward(self, x):
        return F.layer_norm(x.float(), self.normalized_shape, None if self.weight is None else self.weight.float(),
                            None if self.bias is None else self.bias.float(), self.eps).to(x.dtype)


class RefAdaLayerNormZero(nn.Module):
    def __init__(self, dim, norm_type="layer_norm"):
        super().__init__()
        self.emb = None
        self.silu = nn.SiLU()
        self.linear = nn.Linear(dim, 6 * dim)
        self.norm = (nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6) if norm_type == "layer_norm"
                     else RefFP32LayerNorm(dim, elementwise_affine=False))

    def forward(self, x, emb):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.linear(self.silu(emb)).chunk(6, dim=1)
        return self.norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None], gate_msa, shift_mlp, scale_mlp, gate_mlp


class RefAdaLayerNormZeroSingle(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.silu = nn.SiLU()
        self.linear = nn.Linear(dim, 3 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x, emb):
        shift, scale, gate = self.linear(self.silu(emb)).chunk(3, dim=1)
        return self.norm(x) * (1 + scale[:, None]) + shift[:, None], gate


class RefAdaLayerNormContinuous(nn.Module):
    def __init__(self, dim, cond, elementwise_affine=True, eps=1e-5):
        super().__init__()
        self.silu = nn.SiLU()
        self.linear = nn.Linear(cond, 2 * dim)
        self.norm = nn.LayerNorm(dim, eps, elementwise_affine)

    def forward(self, x, cond):
        scale, shift = self.linear(self.silu(cond).to(x.dtype)).chunk(2, dim=1)
        return self.norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]


def tree(ref):
    """A small model under diffusers' names: a Flux-like double block, a single block, Wan's
    affine FP32 norm2 and the final layer. ref: the plain-torch modules or detdit.nn's."""
    m = nn.Module()
    m.transformer_blocks = nn.ModuleList([nn.Module()])
    blk = m.transformer_blocks[0]
    blk.norm1 = (RefAdaLayerNormZero if ref else dnn.AdaLayerNormZero)(H)
    blk.norm1_context = (RefAdaLayerNormZero(H, "fp32_layer_norm") if ref
                         else dnn.AdaLayerNormZero(H, norm_type="fp32_layer_norm"))
    blk.norm2 = (RefFP32LayerNorm if ref else dnn.FP32LayerNorm)(H, 1e-6, True)
    single = RefAdaLayerNormZeroSingle if ref else dnn.AdaLayerNormZeroSingle
    m.single_transformer_blocks = nn.ModuleList([single(H)])
    m.norm_out = (RefAdaLayerNormContinuous(H, COND, True, 1e-6) if ref
                  else dnn.AdaLayerNormContinuous(H, COND, elementwise_affine=True, eps=1e-6))
    return m


def ref_tree(dtype=BF16, seed=30):
    torch.manual_seed(seed)
    m = tree(True)
    with torch.no_grad():
        for i, (name, p) in enumerate(m.named_parameters()):
            p.copy_(_randn(p.shape, seed + i, torch.float64, 0.3, 1.0 if name.endswith("norm.weight") else 0.0))
    return m.to(dtype)


def test_state_dict_loads_unchanged_and_back():
    ref = ref_tree()
    mine = tree(False).to(BF16)
    state = ref.state_dict()
    mine.load_state_dict(state, strict=True)
    assert list(mine.state_dict()) == list(state)
    for name, tensor in mine.state_dict().items():
        assert_bitwise_equal(tensor, state[name], name)
    again = tree(True)
    again.load_state_dict(mine.state_dict(), strict=True)
    assert "transformer_blocks.0.norm1.linear.weight" in state and state[
        "transformer_blocks.0.norm1.linear.weight"].shape == (6 * H, H)
    assert state["single_transformer_blocks.0.linear.weight"].shape == (3 * H, H)
    assert state["norm_out.linear.weight"].shape == (2 * H, COND)
    assert {"transformer_blocks.0.norm2.weight", "transformer_blocks.0.norm2.bias",
            "norm_out.norm.weight", "norm_out.norm.bias"} <= set(state)


def _projection(module, emb):
    """detdit's projection as the module computes it (adaln_projection: the act is FP32 SiLU
    rounded once to the weight's dtype, eager CUDA's), and eager's linear on that act, and
    float64's."""
    w, b = module.linear.weight, module.linear.bias
    act = F.silu(emb.float()).to(w.dtype)
    got = detdit.adaln_projection(emb, w, b, chunks=w.shape[0] // x_hidden(module))
    return got, F.linear(act, w, b), F.linear(act.double(), w.double(), b.double())


def x_hidden(module):
    """The hidden size the module's norm normalises (its chunks are this wide)."""
    return module.norm.normalized_shape[0]


def test_adaln_zero_modules_match_diffusers_arithmetic():
    ref = ref_tree()
    mine = tree(False).to(BF16)
    mine.load_state_dict(ref.state_dict())
    x, emb, cond = _randn((B, S, H), 40, BF16, 3.0, 1.0), _randn((B, H), 41), _randn((B, COND), 42)
    for name in ("norm1", "norm1_context"):
        module = getattr(mine.transformer_blocks[0], name)
        got = module(x, emb=emb)
        proj, proj_eager, proj_truth = _projection(module, emb)
        assert_as_close_as_eager(proj, proj_eager, proj_truth, f"{name} projection")
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = proj.chunk(6, dim=1)
        n = detdit.layernorm(x, eps=module.norm.eps)  # FP32LayerNorm's output is the FP32 norm rounded once too
        assert_bitwise_equal(got[0], n * (1 + scale_msa[:, None]) + shift_msa[:, None], f"{name} x")
        for i, (a, e) in enumerate(zip(got[1:], (gate_msa, shift_mlp, scale_mlp, gate_mlp))):
            assert_bitwise_equal(a, e, f"{name} output {i + 1}")
        check_plain_norm("layer", x, None, None, module.norm.eps, f"{name} norm")
        assert_as_close_as_eager(n, getattr(ref.transformer_blocks[0], name).norm(x),
                                 F.layer_norm(x.double(), (H,), None, None, module.norm.eps), f"{name} norm vs ref")
    single = mine.single_transformer_blocks[0]
    out, gate = single(x, emb=emb)
    proj, _, _ = _projection(single, emb)
    shift, scale, g = proj.chunk(3, dim=1)
    assert_bitwise_equal(out, detdit.layernorm(x, eps=1e-6) * (1 + scale[:, None]) + shift[:, None], "single x")
    assert_bitwise_equal(gate, g, "single gate")
    final = mine.norm_out
    proj, proj_eager, proj_truth = _projection(final, cond.float())
    assert_as_close_as_eager(proj, proj_eager, proj_truth, "norm_out projection")
    scale, shift = proj.chunk(2, dim=1)  # scale first
    n = detdit.layernorm(x, final.norm.weight, final.norm.bias, eps=1e-6)
    assert_bitwise_equal(final(x, cond.float()), n * (1 + scale)[:, None, :] + shift[:, None, :], "norm_out")
    check_plain_norm("layer", x, final.norm.weight, final.norm.bias, 1e-6, "norm_out norm")


@pytest.mark.parametrize("weight_dtype", [torch.float32, BF16])
def test_fp32_layernorm_is_diffusers(weight_dtype):
    norm = dnn.FP32LayerNorm(H, 1e-6, True, dtype=weight_dtype)
    ref = RefFP32LayerNorm(H, 1e-6, True, dtype=weight_dtype)
    with torch.no_grad():
        norm.weight.copy_(_randn((H,), 50, torch.float64, 0.5, 1.0))
        norm.bias.copy_(_randn((H,), 51, torch.float64, 0.5))
    ref.load_state_dict(norm.state_dict())
    x = _randn((B, S, H), 52, BF16, 3.0, 1.0)
    got = norm(x)
    # one rounding of the FP32 norm of x.float() with the parameters widened
    want = detdit.layernorm(x.float(), norm.weight.float(), norm.bias.float(), eps=1e-6).to(BF16)
    assert_bitwise_equal(got, want, "FP32LayerNorm")
    truth = F.layer_norm(x.double(), (H,), norm.weight.double(), norm.bias.double(), 1e-6)
    assert_as_close_as_eager(got, ref(x), truth, "FP32LayerNorm vs diffusers'")
    assert dnn.FP32LayerNorm(H, elementwise_affine=True, bias=False).state_dict().keys() == {"weight"}


class RefSD35AdaLayerNormZeroX(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.silu = nn.SiLU()
        self.linear = nn.Linear(dim, 9 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x, emb):
        sh, sc, g, sh_mlp, sc_mlp, g_mlp, sh2, sc2, g2 = self.linear(self.silu(emb)).chunk(9, dim=1)
        n = self.norm(x)
        return n * (1 + sc[:, None]) + sh[:, None], g, sh_mlp, sc_mlp, g_mlp, n * (1 + sc2[:, None]) + sh2[:, None], g2


class RefCogVideoXLayerNormZero(nn.Module):
    def __init__(self, cond, dim, elementwise_affine=True, eps=1e-5):
        super().__init__()
        self.silu = nn.SiLU()
        self.linear = nn.Linear(cond, 6 * dim)
        self.norm = nn.LayerNorm(dim, eps=eps, elementwise_affine=elementwise_affine)

    def forward(self, x, enc, temb):
        sh, sc, g, esh, esc, eg = self.linear(self.silu(temb)).chunk(6, dim=1)
        return (self.norm(x) * (1 + sc)[:, None, :] + sh[:, None, :],
                self.norm(enc) * (1 + esc)[:, None, :] + esh[:, None, :], g[:, None, :], eg[:, None, :])


class RefAdaLayerNorm(nn.Module):
    def __init__(self, dim, output_dim=None, affine=False, eps=1e-5, chunk_dim=0):
        super().__init__()
        output_dim = output_dim or 2 * dim
        self.emb, self.chunk_dim = None, chunk_dim
        self.silu = nn.SiLU()
        self.linear = nn.Linear(dim, output_dim)
        self.norm = nn.LayerNorm(output_dim // 2, eps, affine)

    def forward(self, x, temb):
        temb = self.linear(self.silu(temb))
        if self.chunk_dim == 1:
            shift, scale = temb.chunk(2, dim=1)
            shift, scale = shift[:, None, :], scale[:, None, :]
        else:
            scale, shift = temb.chunk(2, dim=0)
        return self.norm(x) * (1 + scale) + shift


class RefAdaLayerNormSingle(nn.Module):
    """emb (PixArtAlphaCombinedTimestepSizeEmbeddings: the sinusoid cast to hidden_dtype, the
    time MLP) and linear(silu(emb)); the sinusoid is family_paths' plain-torch one."""

    def __init__(self, dim):
        super().__init__()
        self.emb = nn.Module()
        self.emb.timestep_embedder = nn.Module()
        self.emb.timestep_embedder.linear_1 = nn.Linear(256, dim)
        self.emb.timestep_embedder.linear_2 = nn.Linear(dim, dim)
        self.silu = nn.SiLU()
        self.linear = nn.Linear(dim, 6 * dim)

    def embed(self, features):
        e = self.emb.timestep_embedder
        return e.linear_2(F.silu(e.linear_1(features)))

    def forward(self, t, hidden_dtype):
        from family_paths import eager_sinusoid
        emb = self.embed(eager_sinusoid(t, 256).to(hidden_dtype))
        return self.linear(self.silu(emb)), emb


def _loaded(ref, mine, seed):
    """ref's parameters random (norm weights around 1), in bf16; mine loads ref's state dict
    strict, with the same names, shapes and dtypes."""
    with torch.no_grad():
        for i, (name, p) in enumerate(ref.named_parameters()):
            p.copy_(_randn(p.shape, seed + i, torch.float64, 0.3, 1.0 if name == "norm.weight" else 0.0))
    ref, mine = ref.to(BF16), mine.to(BF16)
    state = ref.state_dict()
    mine.load_state_dict(state, strict=True)
    assert {k: (v.shape, v.dtype) for k, v in mine.state_dict().items()} == {
        k: (v.shape, v.dtype) for k, v in state.items()}
    return ref, mine


def _check_projection(module, emb, chunks, what):
    """The module's projection is adaln_projection (as close to float64 as eager's linear);
    returns its `chunks` chunks."""
    w, b = module.linear.weight, module.linear.bias
    act = F.silu(emb.float()).to(w.dtype)
    proj = detdit.adaln_projection(emb, w, b, chunks=chunks)
    assert_as_close_as_eager(proj, F.linear(act, w, b), F.linear(act.double(), w.double(), b.double()),
                             f"{what} projection")
    return proj.chunk(chunks, dim=1)


def test_sd35_ada_layer_norm_zero_x_is_diffusers():
    ref, mine = _loaded(RefSD35AdaLayerNormZeroX(H), dnn.SD35AdaLayerNormZeroX(H), 80)
    assert mine.state_dict()["linear.weight"].shape == (9 * H, H)
    x, emb = _randn((B, S, H), 81, BF16, 3.0, 1.0), _randn((B, H), 82)
    got = mine(x, emb)
    sh, sc, g, sh_mlp, sc_mlp, g_mlp, sh2, sc2, g2 = _check_projection(mine, emb, 9, "SD35AdaLayerNormZeroX")
    assert detdit.adaln_chunk_order("sd35_ada_layer_norm_zero_x") == (
        "shift_msa", "scale_msa", "gate_msa", "shift_mlp", "scale_mlp", "gate_mlp", "shift_msa2", "scale_msa2",
        "gate_msa2")
    n = detdit.layernorm(x, eps=1e-6)  # one norm, modulated twice (diffusers' norm_hidden_states)
    want = (n * (1 + sc[:, None]) + sh[:, None], g, sh_mlp, sc_mlp, g_mlp, n * (1 + sc2[:, None]) + sh2[:, None], g2)
    assert len(got) == 7
    for i, (a, e) in enumerate(zip(got, want)):
        assert_bitwise_equal(a, e, f"SD35AdaLayerNormZeroX output {i}")
    check_plain_norm("layer", x, None, None, 1e-6, "SD35AdaLayerNormZeroX norm")
    eager = ref(x, emb)
    assert [t.shape for t in eager] == [t.shape for t in got]
    with pytest.raises(ValueError, match="norm_type"):
        dnn.SD35AdaLayerNormZeroX(H, norm_type="fp32_layer_norm")
    with pytest.raises(ValueError, match="bias"):
        dnn.SD35AdaLayerNormZeroX(H, bias=False)(x, emb)


@pytest.mark.parametrize("affine", [True, False])
def test_cogvideox_layer_norm_zero_is_diffusers(affine):
    ref, mine = _loaded(RefCogVideoXLayerNormZero(COND, H, affine), dnn.CogVideoXLayerNormZero(
        COND, H, elementwise_affine=affine), 83)
    assert mine.state_dict()["linear.weight"].shape == (6 * H, COND)
    x, enc, temb = _randn((B, S, H), 84, BF16, 3.0, 1.0), _randn((B, 8, H), 85, BF16, 2.0), _randn((B, COND), 86)
    got = mine(x, enc, temb)
    sh, sc, g, esh, esc, eg = _check_projection(mine, temb, 6, "CogVideoXLayerNormZero")
    assert detdit.adaln_chunk_order("cogvideox_layer_norm_zero") == (
        "shift", "scale", "gate", "enc_shift", "enc_scale", "enc_gate")
    w, b = (mine.norm.weight, mine.norm.bias) if affine else (None, None)
    want = (detdit.layernorm(x, w, b, eps=1e-5) * (1 + sc)[:, None, :] + sh[:, None, :],
            detdit.layernorm(enc, w, b, eps=1e-5) * (1 + esc)[:, None, :] + esh[:, None, :], g[:, None, :],
            eg[:, None, :])
    assert len(got) == 4
    for i, (a, e) in enumerate(zip(got, want)):
        assert_bitwise_equal(a, e, f"CogVideoXLayerNormZero output {i}")
    for what, v in (("x", x), ("enc", enc)):
        check_plain_norm("layer", v, w, b, 1e-5, f"CogVideoXLayerNormZero norm of {what}")
    assert [t.shape for t in ref(x, enc, temb)] == [t.shape for t in got]
    with pytest.raises(ValueError, match="bias"):
        dnn.CogVideoXLayerNormZero(COND, H, bias=False)(x, enc, temb)
    assert dnn.CogVideoXLayerNormZero(COND, H, bias=False).norm.bias is None  # diffusers' LayerNorm(bias=False)


@pytest.mark.parametrize("chunk_dim", [1, 0])
def test_ada_layer_norm_is_diffusers(chunk_dim):
    affine = chunk_dim == 1  # CogVideoX's norm_out: AdaLayerNorm(D, output_dim=2H, affine, chunk_dim=1)
    ref, mine = _loaded(RefAdaLayerNorm(COND, 2 * H, affine, 1e-5, chunk_dim), dnn.AdaLayerNorm(
        COND, output_dim=2 * H, norm_elementwise_affine=affine, chunk_dim=chunk_dim), 87)
    assert mine.state_dict()["linear.weight"].shape == (2 * H, COND)
    x = _randn((B, S, H), 88, BF16, 3.0, 1.0)
    temb = _randn((B, COND), 89) if chunk_dim == 1 else _randn((COND,), 89)
    got = mine(x, temb=temb)
    first, second = _check_projection(mine, temb if chunk_dim == 1 else temb[None], 2, "AdaLayerNorm")
    w, b = (mine.norm.weight, mine.norm.bias) if affine else (None, None)
    n = detdit.layernorm(x, w, b, eps=1e-5)
    if chunk_dim == 1:  # shift first, each (B, 1, H)
        assert detdit.adaln_chunk_order("ada_layer_norm") == ("shift", "scale")
        want = n * (1 + second[:, None, :]) + first[:, None, :]
    else:  # scale first, one (H,) row for every row of x
        want = n * (1 + first[0]) + second[0]
    assert_bitwise_equal(got, want, f"AdaLayerNorm chunk_dim={chunk_dim}")
    check_plain_norm("layer", x, w, b, 1e-5, "AdaLayerNorm norm")
    assert ref(x, temb).shape == got.shape
    with pytest.raises(ValueError, match="num_embeddings"):
        dnn.AdaLayerNorm(COND, num_embeddings=10)
    with pytest.raises(ValueError, match="chunk_dim"):
        dnn.AdaLayerNorm(COND, chunk_dim=2)
    with pytest.raises(ValueError, match="temb"):
        mine(x, timestep=torch.zeros(B), temb=temb)
    with pytest.raises(ValueError, match="temb must be"):
        mine(x, temb=temb[0] if chunk_dim == 1 else temb[None])


@pytest.mark.parametrize("t", [[999.0, 3.5], [1000.0, 0.0, 250.25, 17.0]])
def test_ada_layer_norm_single_is_diffusers(t):
    from family_paths import eager_sinusoid
    ref, mine = _loaded(RefAdaLayerNormSingle(H), dnn.AdaLayerNormSingle(H), 90)
    assert {k: tuple(v.shape) for k, v in mine.state_dict().items()} == {
        "emb.timestep_embedder.linear_1.weight": (H, 256), "emb.timestep_embedder.linear_1.bias": (H,),
        "emb.timestep_embedder.linear_2.weight": (H, H), "emb.timestep_embedder.linear_2.bias": (H,),
        "linear.weight": (6 * H, H), "linear.bias": (6 * H,)}
    t = torch.tensor(t, dtype=torch.float32)  # sigma * 1000 (per sample, or per token flattened)
    table, embedded = mine(t, batch_size=2, hidden_dtype=BF16)
    # the module is detdit's sinusoid, cast to hidden_dtype, its time MLP, then adaln_projection
    features = detdit.timestep_sinusoid(t, 256, t_max=1000)
    e = mine.emb.timestep_embedder
    emb = detdit.timestep_mlp(features.to(BF16), e.linear_1.weight, e.linear_1.bias, e.linear_2.weight,
                              e.linear_2.bias)
    assert_bitwise_equal(embedded, emb, "AdaLayerNormSingle embedded_timestep")
    assert_bitwise_equal(table, detdit.adaln_projection(emb, mine.linear.weight, mine.linear.bias, chunks=6),
                         "AdaLayerNormSingle table")
    # each step as close to float64 as diffusers' eager step, on the same input
    assert_as_close_as_eager(features, eager_sinusoid(t, 256), eager_sinusoid(t, 256, wide=True), "sinusoid")
    f = features.to(BF16)
    truth = RefAdaLayerNormSingle(H).double()
    truth.load_state_dict(ref.state_dict())
    assert_as_close_as_eager(emb, ref.embed(f), truth.embed(f.double()), "time MLP")
    _check_projection(mine, emb, 6, "AdaLayerNormSingle")
    eager_table, eager_emb = ref(t, BF16)
    assert eager_table.shape == table.shape and eager_emb.shape == embedded.shape
    with pytest.raises(ValueError, match="use_additional_conditions"):
        dnn.AdaLayerNormSingle(H, use_additional_conditions=True)
    with pytest.raises(ValueError):
        mine(t * 2, hidden_dtype=BF16)  # above the sinusoid's bound t_max = 1000


# ---- autograd and repeatability ----------------------------------------------------------------
def _setups(dtype):
    """(name, detdit module, float64 eager function of the same parameters, input leaves, call).
    dtype: the activations' and the diffusers modules' (the SGLang modules keep fp32 parameters
    and fp32 modulation, as Wan's)."""
    x, res, emb, cond = (_randn((B, S, H), 60, dtype, 2.0, 0.5), _randn((B, S, H), 61, dtype),
                         _randn((B, H), 62, dtype), _randn((B, COND), 63, dtype))
    shift, scale, gate = modulation("per_token", torch.float32, 64)
    fshift, fscale, fgate = modulation("per_frame", torch.float32, 65)
    setups = []

    m = make("layer", False, torch.float32, torch.float32, True)
    setups.append(("LayerNormScaleShift", m, lambda v, p: eager_modulate(
        F.layer_norm(v["x"], (H,), p["norm.weight"], p["norm.bias"], 1e-6), v["shift"], v["scale"]),
        {"x": x, "shift": shift, "scale": scale}, lambda mod, v: mod(v["x"], v["shift"], v["scale"])))

    m = make("rms", True, None, torch.float32, True)
    setups.append(("ScaleResidualRMSNormScaleShift", m, lambda v, p: eager_modulate(
        eager_norm("rms", eager_gate(v["res"], v["x"], v["gate"], False), p["norm.weight"], None, 1e-6),
        v["shift"], v["scale"]), {"res": res, "x": x, "gate": fgate, "shift": fshift, "scale": fscale},
        lambda mod, v: mod(v["res"], v["x"], v["gate"], v["shift"], v["scale"])[0]))

    setups.append(("MulAdd", dnn.MulAdd(), lambda v, p: eager_gate(v["c"], v["a"], v["b"], False, 0.5),
                   {"a": x, "b": gate, "c": res}, lambda mod, v: mod(v["a"], v["b"], v["c"], 0.5)))

    torch.manual_seed(66)
    m = dnn.AdaLayerNormZero(H).to(dtype)
    setups.append(("AdaLayerNormZero", m, lambda v, p: _bound(RefAdaLayerNormZero(H), p)(v["x"], v["emb"])[0],
                   {"x": x, "emb": emb},
        lambda mod, v: mod(v["x"], emb=v["emb"])[0]))

    torch.manual_seed(67)
    m = dnn.AdaLayerNormContinuous(H, COND, eps=1e-6).to(dtype)
    with torch.no_grad():
        m.norm.weight.copy_(_randn((H,), 68, torch.float64, 0.5, 1.0))
    setups.append(("AdaLayerNormContinuous", m, lambda v, p: _bound(RefAdaLayerNormContinuous(H, COND, True, 1e-6),
                                                                     p)(v["x"], v["cond"]),
                   {"x": x, "cond": cond}, lambda mod, v: mod(v["x"], v["cond"])))

    torch.manual_seed(69)
    m = dnn.SD35AdaLayerNormZeroX(H).to(dtype)  # both modulations of one norm: their gradients meet in x
    setups.append(("SD35AdaLayerNormZeroX", m, lambda v, p: (lambda o: torch.cat([o[0], o[5]], 1))(
        _bound(RefSD35AdaLayerNormZeroX(H), p)(v["x"], v["emb"])), {"x": x, "emb": emb},
        lambda mod, v: (lambda o: torch.cat([o[0], o[5]], 1))(mod(v["x"], v["emb"]))))

    torch.manual_seed(71)
    m = dnn.CogVideoXLayerNormZero(COND, H).to(dtype)  # one affine norm for both streams
    with torch.no_grad():
        m.norm.weight.copy_(_randn((H,), 72, torch.float64, 0.5, 1.0))
        m.norm.bias.copy_(_randn((H,), 73, torch.float64, 0.5))
    setups.append(("CogVideoXLayerNormZero", m, lambda v, p: torch.cat(
        _bound(RefCogVideoXLayerNormZero(COND, H), p)(v["x"], v["res"], v["cond"])[:2], 1),
        {"x": x, "res": res, "cond": cond}, lambda mod, v: torch.cat(mod(v["x"], v["res"], v["cond"])[:2], 1)))

    torch.manual_seed(74)
    m = dnn.AdaLayerNorm(COND, output_dim=2 * H, norm_elementwise_affine=True, chunk_dim=1).to(dtype)
    with torch.no_grad():
        m.norm.weight.copy_(_randn((H,), 75, torch.float64, 0.5, 1.0))
    setups.append(("AdaLayerNorm", m, lambda v, p: _bound(RefAdaLayerNorm(COND, 2 * H, True, 1e-5, 1), p)(
        v["x"], v["cond"]), {"x": x, "cond": cond}, lambda mod, v: mod(v["x"], temb=v["cond"])))

    m = dnn.ResidualRMSNorm(H)
    setups.append(("ResidualRMSNorm", m, lambda v, p: eager_norm("rms", v["x"] + v["res"], p["weight"], None, 1e-6),
                   {"x": x, "res": res}, lambda mod, v: mod(v["x"], v["res"])[0]))
    return setups


def _bound(ref, params):
    """ref (a plain-torch module) called with the given float64 parameters (their gradients
    reach them)."""
    ref = ref.double()
    return lambda *args: torch.nn.utils.stateless.functional_call(ref, params, args)


def _run(module, call, inputs, grad_seed=70):
    leaves = {k: v.clone().requires_grad_(True) for k, v in inputs.items()}
    module.zero_grad(set_to_none=True)
    out = call(module, leaves)
    out.backward(_randn(out.shape, grad_seed, out.dtype))
    return out.detach(), {k: v.grad for k, v in leaves.items()}, {n: p.grad for n, p in module.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("setup", range(9))
def test_gradients_close_to_fp64_eager_and_repeatable(setup, dtype):
    name, module, eager64, inputs, call = _setups(dtype)[setup]
    out, grads, pgrads = _run(module, call, inputs)
    params = {n: p.detach().double().requires_grad_(True) for n, p in module.named_parameters()}
    leaves = {k: v.double().requires_grad_(True) for k, v in inputs.items()}
    ref = eager64(leaves, params)
    ref.backward(_randn(out.shape, 70, out.dtype).double())
    check_normwise(out, ref, dtype, f"{name} forward")
    for k, g in grads.items():
        check_normwise(g, leaves[k].grad, dtype, f"{name} d_{k}")
    for n, g in pgrads.items():
        check_normwise(g, params[n].grad, dtype, f"{name} d_{n}")
    out2, grads2, pgrads2 = _run(module, call, inputs)
    assert_bitwise_equal(out2, out, f"{name}: a second call")
    for k in grads:
        assert_bitwise_equal(grads2[k], grads[k], f"{name} d_{k}: a second call")
    for n in pgrads:
        assert_bitwise_equal(pgrads2[n], pgrads[n], f"{name} d_{n}: a second call")


def test_documented_constructors_are_the_real_ones():
    """docs/python.md's rows of detdit.nn constructors (`nn.Name(...)`): each documented
    parameter is the constructor's, in its order, with its default; a parameter left out has a
    default."""
    doc = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "python.md")
    rows = re.findall(r"^\| `nn\.(\w+)\((.*?)\)`", open(doc).read(), re.M)
    assert len(rows) >= 10, f"only {len(rows)} detdit.nn rows found in docs/python.md"
    problems = []
    for name, documented in rows:
        params = inspect.signature(getattr(dnn, name)).parameters
        given = [g.strip() for g in documented.replace("\\|", "|").split(",") if g.strip()]
        names = [g.split("=")[0].strip() for g in given]
        real = [n for n in params if n in names]
        if real != names:
            problems.append(f"{name}: documented ({', '.join(names)}), real ({', '.join(params)})")
            continue
        for n, p in params.items():
            if n not in names and p.default is inspect.Parameter.empty:
                problems.append(f"{name}: the required {n} is not documented")
        for g in given:
            n, _, text = g.partition("=")
            default = params[n.strip()].default
            if not text:
                if default is not inspect.Parameter.empty:
                    problems.append(f"{name}: {n} has a default ({default!r}) the row does not show")
                continue
            text = text.strip().split("|")[0]  # a choice lists the default first
            value = torch.float32 if text == "torch.float32" else ast.literal_eval(text)
            if value != default:
                problems.append(f"{name}: {n} defaults to {default!r}, documented {text}")
    assert not problems, "\n".join(problems)
