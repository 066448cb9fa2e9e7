"""detdit.layernorm's modulation and detdit.gate_residual_layernorm from Python (CPU).

The forms (docs/numerics.md 5.12, 9.5 to 9.7): shift, scale and gate as views of a (B, 6, H)
per-sample, (B, F, 6, H) per-frame or (B, S, 6, H) per-token tensor, the chunk dimension
dropped or kept, in x's dtype or fp32, and both recipes. Exact here:
- the modulation against eager on detdit's own plain norm n: ``n * (1 + scale) + shift``
  with PyTorch's type promotion (upcast=False), and Wan's ``(n32 * (1 + scale) +
  shift).type_as(x)`` on the FP32 norm n32 of ``x.float()`` (upcast=True), bitwise (9.5);
- the indexed form (a plan) gives the per-token form's bytes with the rows gathered;
- a sample's outputs and per-sample gradients are the same bytes alone as in a batch;
- autograd gives the raw `_backward` ops' bytes;
- gate_residual_layernorm's out, h and every gradient (a gradient reaching out and h, out
  only, h only) equal detdit.gate_residual then detdit.layernorm under autograd, bitwise;
- the fake kernels give the real kernels' output shapes and dtypes;
- bad calls raise the right exception and leave every input unchanged.
"""
import itertools

import pytest
import torch

import detdit
from conftest import assert_bitwise_equal, normal, packing
from detdit import _compile

ops = torch.ops.detdit
BF, F32 = torch.bfloat16, torch.float32
B, S, H, FRAMES = 2, 300, 20, 3  # a sample's 300 positions are two reduction chunks (256 + 44)
FORMS = ("sample", "sample_keep", "frame", "frame_keep", "token")


def parent(form, dtype, seed, batch=B):
    """The (B, 6, H) / (B, F, 6, H) / (B, S, 6, H) tensor the models chunk."""
    shape = {"sample": (batch, 6, H), "frame": (batch, FRAMES, 6, H), "token": (batch, S, 6, H)}[form.split("_")[0]]
    return normal(shape, seed, scale=0.3).to(dtype)


def chunk(p, form, c):
    """Chunk c of parent p as the form's view: p[:, c] / p[:, :, c], or with the chunk
    dimension kept (p[:, c:c+1] / p[:, :, c:c+1])."""
    index = slice(c, c + 1) if form.endswith("_keep") else c
    return p[:, index] if p.dim() == 3 else p[:, :, index]


def broadcast(m, x):
    """m as the models broadcast it against x (B, S, H): frame f covers [f L, (f + 1) L)."""
    if m.dim() == 4:
        m = m.squeeze(2)
    if m.dim() == 2 or m.shape[1] == 1:
        return m.view(m.shape[0], 1, m.shape[-1])
    return m.repeat_interleave(x.shape[1] // m.shape[1], dim=1)


def affine(kind, dtype, seed):
    w = (1 + normal((H,), seed, scale=0.5)).to(dtype) if kind != "none" else None
    b = normal((H,), seed + 1, dtype, scale=0.5) if kind == "weight+bias" else None
    return w, b


def leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) if t is not None else None for t in tensors]


def grads(ts):
    return [t.grad if t is not None else None for t in ts]


def assert_all_equal(got, want, what):
    assert len(got) == len(want)
    for k, (a, b) in enumerate(zip(got, want)):
        assert (a is None) == (b is None), f"{what} [{k}]: None on one side only"
        if a is not None:
            assert_bitwise_equal(a, b, f"{what} [{k}]")


def assert_fakes_match(pairs, what):
    """Each (real outputs, fake kernel's outputs) pair: as many, None at the same places, the same
    shapes, dtypes and strides."""
    for real_outs, fake_outs in pairs:
        assert len(real_outs) == len(fake_outs)
        for r, f in zip(real_outs, fake_outs):
            assert (r is None) == (f is None), f"{what}: None on one side only"
            if r is not None:
                assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride()), what


LAYERNORM_CASES = list(itertools.product(FORMS, (BF, F32), (False, True), ("none", "weight+bias")))


# ---------------------------------------------------------------------------
# layernorm


@pytest.mark.parametrize("form,mod_dtype,upcast,kind", LAYERNORM_CASES)
def test_layernorm_modulation_equals_eager_on_detdits_norm_bitwise(form, mod_dtype, upcast, kind):
    x = normal((B, S, H), 1, BF, scale=2.0)
    w, b = affine(kind, BF, 2)
    p = parent(form, mod_dtype, 3)
    shift, scale = chunk(p, form, 0), chunk(p, form, 1)
    got = detdit.layernorm(x, w, b, shift, scale, upcast=upcast)
    if upcast:
        n32 = detdit.layernorm(x.float(), *(None if t is None else t.float() for t in (w, b)))
        expected = (n32 * (1 + broadcast(scale, x).float()) + broadcast(shift, x).float()).type_as(x)
    else:
        expected = detdit.layernorm(x, w, b) * (1 + broadcast(scale, x)) + broadcast(shift, x)
    assert got.dtype == expected.dtype == (F32 if mod_dtype == F32 and not upcast else BF)
    assert_bitwise_equal(got, expected, f"{form} {mod_dtype} upcast={upcast} {kind}")


@pytest.mark.parametrize("form,mod_dtype,upcast,kind", LAYERNORM_CASES)
def test_layernorm_autograd_equals_the_raw_backward(form, mod_dtype, upcast, kind):
    x = normal((B, S, H), 11, BF, scale=2.0)
    w, b = affine(kind, BF, 12)
    p = parent(form, mod_dtype, 13)
    shift, scale = chunk(p, form, 0), chunk(p, form, 1)
    out, mean, rstd = ops.layernorm.forms(x, w, b, shift, scale, None, 1e-6, "portable", upcast)
    grad = normal(tuple(out.shape), 14, out.dtype)
    ls = leaves(x, w, b, shift, scale)
    detdit.layernorm(*ls, eps=1e-6, upcast=upcast).backward(grad)
    raw = ops.layernorm_backward.forms(grad, x, w, b, shift, scale, None, mean, rstd, 1e-6, "portable", upcast,
                                       [True] * 5)
    assert_all_equal(grads(ls), list(raw), f"{form} {mod_dtype} upcast={upcast} {kind}")
    assert ls[3].grad.shape == shift.shape and ls[3].grad.dtype == mod_dtype
    # a gradient not asked for is not computed
    some = ops.layernorm_backward.forms(grad, x, w, b, shift, scale, None, mean, rstd, 1e-6, "portable", upcast,
                                        [False, False, True, False, True])
    assert some[0] is None and some[1] is None and some[3] is None
    assert_bitwise_equal(some[4], raw[4], "d_scale alone")


def test_layernorm_plain_calls_are_unchanged_by_upcast_and_keywords():
    x = normal((B, S, H), 21, BF, scale=2.0)
    w, b = affine("weight+bias", BF, 22)
    plain = ops.layernorm(x, w, b, 1e-6, "portable")[0]
    assert_bitwise_equal(detdit.layernorm(x, w, b, eps=1e-6), plain, "keyword eps")
    assert_bitwise_equal(detdit.layernorm(x, w, b, eps=1e-6, upcast=True), plain, "upcast without modulation")
    assert_bitwise_equal(detdit.layernorm(x, w, b, eps=1e-6, numerics="portable"), plain, "keyword numerics")


@pytest.mark.parametrize("mod_dtype", [BF, F32])
def test_layernorm_indexed_form_is_the_per_token_form_of_the_gathered_rows(mod_dtype):
    ti, tags = packing(S, 3, 31)
    plan = detdit.plan(ti, tags, 3, batch=B)
    rows = (ti * 3 + tags).repeat(B)
    tables = [normal((9, H), 32 + c, scale=0.3).to(mod_dtype) for c in range(2)]
    gathered = [t[rows].view(B, S, H) for t in tables]
    x = normal((B, S, H), 34, BF, scale=2.0)
    w, b = affine("weight+bias", BF, 35)
    for upcast in (False, True):
        indexed = leaves(x, w, b, *tables)
        per_token = leaves(x, w, b, *gathered)
        out_i = detdit.layernorm(*indexed, plan=plan, upcast=upcast)
        out_t = detdit.layernorm(*per_token, upcast=upcast)
        assert_bitwise_equal(out_i, out_t, f"out upcast={upcast}")
        grad = normal(tuple(out_i.shape), 36, out_i.dtype)
        out_i.backward(grad)
        out_t.backward(grad)
        assert_all_equal(grads(indexed[:3]), grads(per_token[:3]), f"dx, d_weight, d_bias upcast={upcast}")
        assert indexed[3].grad.shape == (9, H) and indexed[3].grad.dtype == mod_dtype


@pytest.mark.parametrize("form", ["sample", "frame"])
def test_layernorm_a_sample_alone_has_its_bytes_in_the_batch(form):
    """Out and the per-sample / per-frame gradients of sample 1 do not depend on sample 0."""
    x = normal((B, S, H), 41, BF, scale=2.0)
    p = parent(form, F32, 42)
    grad = normal((B, S, H), 43, BF)
    results = []
    for rows in (slice(0, B), slice(1, 2)):
        ls = leaves(x[rows], chunk(p[rows], form, 0), chunk(p[rows], form, 1))
        out = detdit.layernorm(ls[0], None, None, ls[1], ls[2], upcast=True)
        out.backward(grad[rows])
        results.append([out.detach()[-1], ls[0].grad[-1], ls[1].grad[-1], ls[2].grad[-1]])
    assert_all_equal(results[1], results[0], f"{form}: sample 1 alone vs in the batch")


def test_layernorm_fake_kernels_give_the_real_outputs_shapes_and_dtypes():
    ti, tags = packing(S, 3, 51)
    plan = detdit.plan(ti, tags, 3, batch=B)
    x = normal((B, S, H), 52, BF)
    for form, mod_dtype, upcast, kind in LAYERNORM_CASES + [("indexed", F32, False, "weight"),
                                                             ("indexed", BF, True, "none")]:
        w, b = affine(kind, BF, 53)
        if form == "indexed":
            shift, scale, p = normal((9, H), 54).to(mod_dtype), normal((9, H), 55).to(mod_dtype), plan
        else:
            m = parent(form, mod_dtype, 54)
            shift, scale, p = chunk(m, form, 0), chunk(m, form, 1), None
        forward = (x, w, b, shift, scale, p, 1e-5, "portable", upcast)
        real = ops.layernorm.forms(*forward)
        pairs = [(real, _compile.FAKE_KERNELS["layernorm.forms"](*forward))]
        for mask in ([True] * 5, [False, True, False, True, False]):
            backward = (real[0], x, w, b, shift, scale, p, real[1], real[2], 1e-5, "portable", upcast, mask)
            pairs.append((ops.layernorm_backward.forms(*backward),
                          _compile.FAKE_KERNELS["layernorm_backward.forms"](*backward)))
        assert_fakes_match(pairs, form)


# ---------------------------------------------------------------------------
# gate_residual_layernorm

# The gated-residual regions (gate_residual_layernorm here, gate_residual_rmsnorm in
# test_gate_residual_rmsnorm_forms.py): their cases, inputs and checks.


def region_cases(no_gate_form):
    """(form of gate, shift and scale or None: no modulation at all, gate present, modulation
    dtype, upcast, k): the gate in every form, dtype, recipe and k; residual + y into the plain
    norm; no gate into the norm modulated in no_gate_form."""
    cases = [(form, True, mod_dtype, upcast, k)
             for form in FORMS for mod_dtype in (BF, F32) for upcast in (False, True) for k in (None, 1.0)]
    cases += [(None, False, BF, upcast, None) for upcast in (False, True)]
    cases += [(no_gate_form, False, F32, upcast, None) for upcast in (False, True)]
    return cases


def region_inputs(form, gated, mod_dtype, upcast, seed, chunks=(0, 1), kind="weight+bias"):
    """residual, y, gate, weight, bias, shift, scale of a case: the gate chunk 2 of the form's
    parent, shift and scale its chunks `chunks`; the norm's affine `kind` in h's dtype."""
    residual, y = normal((B, S, H), seed, BF, scale=2.0), normal((B, S, H), seed + 1, BF)
    gate = shift = scale = None
    if form is not None:
        p = parent(form, mod_dtype, seed + 2)
        shift, scale = chunk(p, form, chunks[0]), chunk(p, form, chunks[1])
        gate = chunk(p, form, 2) if gated else None
    # the norm runs on h: fp32 for an fp32 gate with upcast=False, and its parameters with it
    h_dtype = F32 if gate is not None and gate.dtype == F32 and not upcast else BF
    w, b = affine(kind, h_dtype, seed + 3)
    return residual, y, gate, w, b, shift, scale


def assert_region_equals_composed(region, composed, inputs, reaches, seed, what, **kwargs):
    """region(*inputs, eps=1e-6, **kwargs) and composed(*inputs, **kwargs) on leaves of the same
    inputs: their outputs, then for each reach (the outputs a gradient reaches, incoming gradient
    i drawn from seed + i) every input's gradient, bitwise."""
    for reach in reaches:
        fused, separate = leaves(*inputs), leaves(*inputs)
        got = region(*fused, eps=1e-6, **kwargs)
        want = composed(*separate, **kwargs)
        where = f"{what} reach={reach}"
        assert_all_equal(list(got), list(want), f"{where}: outputs")
        incoming = [normal(tuple(want[i].shape), seed + i, want[i].dtype) for i in reach]
        torch.autograd.backward([got[i] for i in reach], incoming)
        torch.autograd.backward([want[i] for i in reach], incoming)
        assert_all_equal(grads(fused), grads(separate), f"{where}: gradients")


FUSED_CASES = region_cases("sample")


def composed(residual, y, gate, w, b, shift, scale, upcast, k, plan=None):
    h = detdit.gate_residual(residual, y, gate, plan, k=k, upcast=upcast)
    return detdit.layernorm(h, w, b, shift, scale, plan, eps=1e-6, upcast=upcast), h


@pytest.mark.parametrize("form,gated,mod_dtype,upcast,k", FUSED_CASES)
def test_gate_residual_layernorm_equals_the_two_ops_under_autograd(form, gated, mod_dtype, upcast, k):
    # a gradient reaching out and h, out only, h only
    assert_region_equals_composed(detdit.gate_residual_layernorm, composed,
                                  region_inputs(form, gated, mod_dtype, upcast, 61), ((0, 1), (0,), (1,)), 62,
                                  f"{form} gated={gated} {mod_dtype} upcast={upcast} k={k}", upcast=upcast, k=k)


@pytest.mark.parametrize("upcast,k", [(False, None), (True, 0.5)])
def test_gate_residual_layernorm_indexed_form_equals_the_two_ops(upcast, k):
    ti, tags = packing(S, 3, 71)
    plan = detdit.plan(ti, tags, 3, batch=B)
    residual, y = normal((B, S, H), 72, BF, scale=2.0), normal((B, S, H), 73, BF)
    tables = [normal((9, H), 74 + c, scale=0.3).to(F32) for c in range(3)]
    w, b = affine("weight", F32 if not upcast else BF, 77)
    inputs = (residual, y, tables[0], w, b, tables[1], tables[2])
    assert_region_equals_composed(detdit.gate_residual_layernorm, composed, inputs, ((0, 1),), 78, "indexed",
                                  upcast=upcast, k=k, plan=plan)


@pytest.mark.parametrize("form,gated,mod_dtype,upcast,k", FUSED_CASES[::3])
def test_gate_residual_layernorm_autograd_equals_the_raw_backward(form, gated, mod_dtype, upcast, k):
    inputs = region_inputs(form, gated, mod_dtype, upcast, 81)
    residual, y, gate, w, b, shift, scale = inputs
    out, h, mean, rstd = ops.gate_residual_layernorm(*inputs, None, 1e-6, "portable", upcast, k)
    d_out, d_h = normal(tuple(out.shape), 82, out.dtype), normal(tuple(h.shape), 83, h.dtype)
    for reach in ((d_out, d_h), (d_out, None), (None, d_h)):
        ls = leaves(*inputs)
        got = detdit.gate_residual_layernorm(*ls, eps=1e-6, upcast=upcast, k=k)
        torch.autograd.backward([t for t, g in zip(got, reach) if g is not None], [g for g in reach if g is not None])
        raw = ops.gate_residual_layernorm_backward(*reach, y, gate, w, b, shift, scale, None, h, mean, rstd, 1e-6,
                                                   "portable", upcast, k, [True] * 7)
        want = [r if t is not None else None for r, t in zip(raw, inputs)]
        assert_all_equal(grads(ls), want, f"{form} upcast={upcast} k={k} d_out={reach[0] is not None}")
    none = ops.gate_residual_layernorm_backward(None, None, y, gate, w, b, shift, scale, None, h, mean, rstd, 1e-6,
                                                "portable", upcast, k, [True] * 7)
    assert list(none) == [None] * 7


def test_gate_residual_layernorm_fake_kernels_give_the_real_outputs_shapes_and_dtypes():
    for form, gated, mod_dtype, upcast, k in FUSED_CASES:
        inputs = region_inputs(form, gated, mod_dtype, upcast, 91)
        residual, y, gate, w, b, shift, scale = inputs
        forward = (*inputs, None, 1e-5, "portable", upcast, k)
        real = ops.gate_residual_layernorm(*forward)
        pairs = [(real, _compile.FAKE_KERNELS["gate_residual_layernorm"](*forward))]
        out, h, mean, rstd = real
        for d_out, d_h, mask in ((out, h, [True] * 7), (out, None, [True, False, True, False, True, True, False]),
                                 (None, h, [True] * 7), (None, None, [True] * 7)):
            backward = (d_out, d_h, y, gate, w, b, shift, scale, None, h, mean, rstd, 1e-5, "portable", upcast, k,
                        mask)
            pairs.append((ops.gate_residual_layernorm_backward(*backward),
                          _compile.FAKE_KERNELS["gate_residual_layernorm_backward"](*backward)))
        assert_fakes_match(pairs, f"{form} gated={gated}")


# ---------------------------------------------------------------------------
# errors: the exception of the kind, and no input changed


def unchanged_after(call, tensors, error, match):
    before = [t.clone() for t in tensors]
    with pytest.raises(error, match=match):
        call()
    for t, b in zip(tensors, before):
        assert_bitwise_equal(t, b, "an input after the failed call")


def test_errors():
    x, y = normal((B, S, H), 101, BF), normal((B, S, H), 102, BF)
    p = parent("sample", BF, 103)
    shift, scale, gate = p[:, 0], p[:, 1], p[:, 2]
    per_token = parent("token", BF, 104)[:, :, 0]
    frames7 = normal((B, 7, H), 105, BF)
    every = [x, y, p, per_token, frames7]
    # mixed forms: shift per sample, scale per token; the fused op's gate per token, shift per sample
    unchanged_after(lambda: detdit.layernorm(x, None, None, shift, per_token), every, ValueError, "form")
    unchanged_after(lambda: detdit.gate_residual_layernorm(x, y, per_token, None, None, shift, scale), every,
                    ValueError, "one modulation form")
    # S % F != 0 names the argument, S and F
    unchanged_after(lambda: detdit.layernorm(x, None, None, frames7, frames7), every, ValueError,
                    r"shift.*300.*7|shift.*7.*300")
    unchanged_after(lambda: detdit.gate_residual_layernorm(x, y, frames7), every, ValueError, r"gate.*300.*7|gate.*7.*300")
    # a shape that is no form: (R, H) without a plan, a (B, S + 1, H) tensor
    unchanged_after(lambda: detdit.layernorm(x, None, None, normal((9, H), 106, BF), normal((9, H), 107, BF)), every,
                    ValueError, "plan")
    unchanged_after(lambda: detdit.layernorm(x, None, None, normal((B, S + 1, H), 108, BF), None), every, ValueError,
                    "shift")
    # dtypes: fp16 modulation with bf16 x, fp64 x, shift and scale of two dtypes
    unchanged_after(lambda: detdit.layernorm(x, None, None, shift.half(), scale.half()), every, TypeError, "shift")
    unchanged_after(lambda: detdit.layernorm(x, None, None, shift, scale.float()), every, TypeError, "scale")
    unchanged_after(lambda: detdit.gate_residual_layernorm(x, y, gate.half()), every, TypeError, "gate")
    unchanged_after(lambda: detdit.gate_residual_layernorm(x.double(), y.double()), every, TypeError, "float64|double")
    # the wrappers' argument types
    with pytest.raises(TypeError, match="layernorm: shift must be a torch.Tensor or None"):
        detdit.layernorm(x, None, None, 0.5)
    with pytest.raises(TypeError, match="layernorm: upcast must be a bool"):
        detdit.layernorm(x, upcast=1)
    with pytest.raises(TypeError, match="gate_residual_layernorm: k must be a real number or None"):
        detdit.gate_residual_layernorm(x, y, gate, k="1")
    with pytest.raises(TypeError, match="gate_residual_layernorm: gate must be a torch.Tensor or None"):
        detdit.gate_residual_layernorm(x, y, 1.0)
    ti, tags = packing(S, 3, 109)
    with pytest.raises(TypeError, match="PlanTables"):
        detdit.layernorm(x, None, None, normal((9, H), 110, BF), normal((9, H), 111, BF),
                         detdit.plan_tables(detdit.plan(ti, tags, 3, batch=B)))
