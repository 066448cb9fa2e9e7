"""The modulation forms through detdit.rmsnorm / detdit.gate_residual against plain eager PyTorch
on the CPU, on the exported C++ form cases (cases/forms_cases.cc: per sample, per frame, per
token, the views of a (B, 6, H) / (B, F, 6, H) / (B, S, 6, H) parent, x-dtype and fp32
modulation, k).

Bitwise where eager's CPU arithmetic is the same IEEE operations as docs/numerics.md 5.12:
- gate_residual, both recipes: eager ``residual + gate * y`` (``residual + (k + gate) * y``)
  with PyTorch's type promotion (upcast=False; a 16-bit op on the CPU is the FP32 op rounded
  once), and Wan's ``(residual.float() + y.float() * gate.float()).type_as(residual)``
  (upcast=True); and autograd's d_residual and d_y (row-local: ``grad * gate`` cast to y's
  dtype). d_gate sums over positions in detdit's order, not eager's: not compared here.
- rmsnorm, upcast=False: the modulation ``n * (1 + scale) + shift`` applied by eager to
  detdit's own plain norm n (the same bytes as the modulated op's n, 5.6 / 5.12).
Within a bound: the norm itself. Eager computes it as ``x * rsqrt(mean(x^2) + eps) * w`` in
FP32 with its own reduction order; detdit's rstd is the row tree of section 7, so the FP32
values differ by a few FP32 ulps and n (rounded to x's 16-bit dtype) by at most 1 ulp of that
dtype; checked below.
"""
import pytest
import torch

import detdit
from conftest import assert_bitwise_equal
from test_cases import form_views, is_form_case


# The ops with `.forms` overloads; gate_residual_rmsnorm's form cases run in the C++ suites
# (its binding takes the H3 rule's indexed table only).
_FORMS_OVERLOADS = ("rmsnorm", "gate_residual")


def _form_cases(op_cases, op, upcast=None):
    cases = [c for c in op_cases if c.op == op and is_form_case(c)
             and (upcast is None or (c.arguments["upcast"] == "true") == upcast)]
    assert cases, f"no exported {op} form case"
    return cases


def _broadcast(m, x):
    """m (per sample (B, H) / (B, 1, H), per frame (B, F, H) / (B, F, 1, H), per token
    (B, S, H)) as the models broadcast it against x (B, S, H): frame f covers positions
    [f L, (f + 1) L), L = S / F."""
    if m.dim() == 4:
        m = m.squeeze(2)
    if m.dim() == 2:
        return m.unsqueeze(1)
    return m.repeat_interleave(x.shape[1] // m.shape[1], dim=1)


def _k(c):
    return float(c.arguments["k"]) if "k" in c.arguments else None


@pytest.mark.parametrize("upcast", [False, True])
def test_gate_residual_equals_eager_bitwise(op_cases, upcast):
    compared = 0
    for c in _form_cases(op_cases, "gate_residual", upcast):
        if "modulation" not in c:
            continue
        (gate,) = form_views(c, (2,), "d_gate")
        k = _k(c)
        residual = c["residual"].clone().requires_grad_()
        y = c["y"].clone().requires_grad_()
        got = detdit.gate_residual(residual, y, gate, k=k, upcast=upcast)
        got.backward(c["grad"])
        r, yy = c["residual"].clone().requires_grad_(), c["y"].clone().requires_grad_()
        g = _broadcast(gate, r)
        term = g if k is None else k + g
        if upcast:
            term = term.float() if k is None else k + g.float()
            expected = (r.float() + yy.float() * term).type_as(r)
        else:
            expected = r + term * yy
        expected.backward(c["grad"])
        assert_bitwise_equal(got, expected, f"{c}: out")
        assert_bitwise_equal(residual.grad, r.grad, f"{c}: d_residual")
        assert_bitwise_equal(y.grad, yy.grad, f"{c}: d_y")
        compared += 1
    assert compared > 0


def test_gate_residual_without_a_gate_is_eager_add(op_cases):
    compared = 0
    for c in _form_cases(op_cases, "gate_residual"):
        if "modulation" in c:
            continue
        upcast = c.arguments["upcast"] == "true"
        got = detdit.gate_residual(c["residual"], c["y"], upcast=upcast)
        assert_bitwise_equal(got, c["residual"] + c["y"], f"{c}")
        compared += 1
    assert compared == 2


def test_rmsnorm_modulation_equals_eager_on_detdits_norm_bitwise(op_cases):
    compared = 0
    for c in _form_cases(op_cases, "rmsnorm", upcast=False):
        if "modulation" not in c:
            continue
        x, w, eps = c["x"], c["weight"], c.eps()
        shift, scale = form_views(c, (0, 1), "d_shift")
        n = detdit.rmsnorm(x, w, eps=eps)
        expected = n * (1 + _broadcast(scale, x)) + _broadcast(shift, x)
        got = detdit.rmsnorm(x, w, shift, scale, eps=eps)
        assert got.dtype == expected.dtype, f"{c}: {got.dtype} vs eager {expected.dtype}"
        assert_bitwise_equal(got, expected, f"{c}")
        compared += 1
    assert compared > 0


def test_rmsnorm_without_modulation_is_the_plain_norm_in_both_recipes(op_cases):
    compared = 0
    for c in _form_cases(op_cases, "rmsnorm"):
        if "modulation" in c:
            continue
        got = detdit.rmsnorm(c["x"], c["weight"], eps=c.eps(), upcast=c.arguments["upcast"] == "true")
        assert_bitwise_equal(got, detdit.rmsnorm(c["x"], c["weight"], eps=c.eps()), f"{c}")
        compared += 1
    assert compared == 2


def _ulps(a, b):
    """|a - b| in units of the last place of a's 16-bit dtype, elementwise (same-sign finite values)."""
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    return (a.view(bits).to(torch.int32) - b.view(bits).to(torch.int32)).abs()


def test_rmsnorm_norm_is_within_one_ulp_of_eager(op_cases):
    worst = 0
    for c in _form_cases(op_cases, "rmsnorm"):
        x, w, eps = c["x"], c["weight"], c.eps()
        if x.dtype == torch.float32:
            continue
        xf = x.float()
        eager = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)
        n = detdit.rmsnorm(x, w, eps=eps)
        same_sign = (n.float() * eager.float() > 0) | (n == eager)
        assert bool(same_sign.all()), f"{c}: a sign differs"
        worst = max(worst, int(_ulps(n, eager).max()))
    assert worst <= 1, f"detdit's norm is {worst} ulps from eager's FP32 norm"


def test_fake_kernels_give_the_real_outputs_shapes_and_dtypes(op_cases):
    """The `.forms` overloads' fake kernels (detdit/_compile.py, torch.compile's metadata)
    against the real kernels on every exported form case: each output's shape and dtype."""
    from detdit import _compile
    ops = torch.ops.detdit
    checked = 0
    for c in op_cases:
        if not is_form_case(c) or c.op not in _FORMS_OVERLOADS:
            continue
        upcast, modulated = c.arguments["upcast"] == "true", "modulation" in c
        if c.op == "rmsnorm":
            x, w, eps = c["x"], c["weight"], c.eps()
            shift, scale = form_views(c, (0, 1), "d_shift") if modulated else (None, None)
            mask = [True, True, modulated, modulated]
            forward = (x, w, shift, scale, None, eps, "portable", upcast)
            real = ops.rmsnorm.forms(*forward)
            backward = (c["grad"], x, w, shift, scale, None, real[1], eps, "portable", upcast, mask)
            pairs = [(real, _compile.FAKE_KERNELS["rmsnorm.forms"](*forward)),
                     (ops.rmsnorm_backward.forms(*backward), _compile.FAKE_KERNELS["rmsnorm_backward.forms"](*backward))]
        else:
            gate = form_views(c, (2,), "d_gate")[0] if modulated else None
            forward = (c["residual"], c["y"], gate, None, upcast, _k(c))
            backward = (c["grad"], c["y"], gate, None, upcast, _k(c), [True, True, modulated])
            pairs = [((ops.gate_residual.forms(*forward),), (_compile.FAKE_KERNELS["gate_residual.forms"](*forward),)),
                     (ops.gate_residual_backward.forms(*backward),
                      _compile.FAKE_KERNELS["gate_residual_backward.forms"](*backward))]
        for real, fake in pairs:
            for r, f in zip(real, fake):
                if r is None:  # not wanted (output_mask) or absent
                    assert f is None, f"{c}: the fake kernel returns a tensor where the op returns none"
                    continue
                assert (tuple(f.shape), f.dtype) == (tuple(r.shape), r.dtype), \
                    f"{c}: fake {f.shape} {f.dtype}, real {r.shape} {r.dtype}"
        checked += 1
    assert checked > 50


def test_autograd_equals_the_raw_backward(op_cases):
    """detdit.rmsnorm / detdit.gate_residual's autograd (the `.forms` Functions) gives the raw
    `_backward.forms` op's gradients, bitwise, on every exported form case with a modulation."""
    ops = torch.ops.detdit
    checked = 0
    for c in op_cases:
        if not is_form_case(c) or "modulation" not in c or c.op not in _FORMS_OVERLOADS:
            continue
        upcast = c.arguments["upcast"] == "true"
        if c.op == "rmsnorm":
            x, w, eps = c["x"], c["weight"], c.eps()
            views = form_views(c, (0, 1), "d_shift")
            leaves = [t.clone().requires_grad_() for t in (x, w, *views)]
            detdit.rmsnorm(leaves[0], leaves[1], leaves[2], leaves[3], eps=eps, upcast=upcast).backward(c["grad"])
            rstd = ops.rmsnorm.forms(x, w, *views, None, eps, "portable", upcast)[1]
            raw = ops.rmsnorm_backward.forms(c["grad"], x, w, *views, None, rstd, eps, "portable", upcast, [True] * 4)
        else:
            (gate,) = form_views(c, (2,), "d_gate")
            leaves = [t.clone().requires_grad_() for t in (c["residual"], c["y"], gate)]
            detdit.gate_residual(*leaves, k=_k(c), upcast=upcast).backward(c["grad"])
            raw = ops.gate_residual_backward.forms(c["grad"], c["y"], gate, None, upcast, _k(c), [True] * 3)
        for leaf, expected in zip(leaves, raw):
            assert_bitwise_equal(leaf.grad, expected, f"{c}: autograd vs raw backward")
        checked += 1
    assert checked > 50


@pytest.mark.parametrize("upcast", [False, True])
@pytest.mark.parametrize("k", [None, 1.0])
def test_indexed_gate_in_fp32_equals_eager_bitwise(op_cases, upcast, k):
    """The indexed form outside the H3 rule (an fp32 (R, H) table with the plan, upcast, k)
    through detdit.gate_residual (the `.forms` overload with a plan) against eager's
    ``residual + table[row] * y`` (type promotion) or Wan's FP32 recipe, bitwise."""
    from op_cases import find
    c = find(op_cases, "gate_residual", "bfloat16 H=20 interleaved_S257_T3_B2 contiguous gate")
    table = c["table"].float()
    rows = c.rows().repeat(c.plans["plan"]["batch"])  # the table row of each of the B*S positions
    residual, y = c["residual"], c["y"]
    got = detdit.gate_residual(residual, y, table, c.plan(), k=k, upcast=upcast)
    term = table[rows] if k is None else k + table[rows]
    expected = (residual.float() + y.float() * term).type_as(residual) if upcast else residual + term * y
    assert_bitwise_equal(got, expected, f"{c}: fp32 table, k={k}, upcast={upcast}")
