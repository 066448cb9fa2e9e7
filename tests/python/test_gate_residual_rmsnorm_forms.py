"""detdit.gate_residual_rmsnorm in every modulation form and recipe (the `.forms` overloads; CPU).

The gate, shift and scale as views of a (B, 6, H) per-sample, (B, F, 6, H) per-frame or
(B, S, 6, H) per-token tensor (chunks 2, 3 and 4: gate_msa, shift_mlp, scale_mlp), the chunk
dimension dropped or kept, bf16 or fp32, both recipes, with and without k, the gate absent,
and fp32 (R, H) tables with a plan. Exact here: h, out and every gradient (reaching h and
out, out only, h only) equal detdit.gate_residual then detdit.rmsnorm under autograd,
bitwise; autograd gives the raw `_backward.forms` op's bytes; the fake kernels give the
real kernels' output shapes and dtypes; bad calls raise their kind with every input unchanged.
"""
import pytest
import torch

import detdit
from conftest import normal, packing
from detdit import _compile
from test_layernorm_forms import (B, BF, F32, H, S, assert_all_equal, assert_fakes_match,
                                  assert_region_equals_composed, grads, leaves, parent, region_cases,
                                  unchanged_after)
from test_layernorm_forms import region_inputs as layernorm_region_inputs

ops = torch.ops.detdit

CASES = region_cases("token")  # without the gate: the norm modulated per token


def region_inputs(form, gated, mod_dtype, upcast, seed):
    """residual, y, gate, weight, shift, scale: shift and scale chunks 3 and 4, the weight alone."""
    residual, y, gate, weight, _, shift, scale = layernorm_region_inputs(form, gated, mod_dtype, upcast, seed,
                                                                          chunks=(3, 4), kind="weight")
    return residual, y, gate, weight, shift, scale


def composed(residual, y, gate, weight, shift, scale, upcast, k, plan=None):
    h = detdit.gate_residual(residual, y, gate, plan, k=k, upcast=upcast)
    return h, detdit.rmsnorm(h, weight, shift, scale, plan, eps=1e-6, upcast=upcast)


@pytest.mark.parametrize("form,gated,mod_dtype,upcast,k", CASES)
def test_fused_equals_the_two_ops_under_autograd(form, gated, mod_dtype, upcast, k):
    # a gradient reaching h and out, h only, out only
    assert_region_equals_composed(detdit.gate_residual_rmsnorm, composed,
                                  region_inputs(form, gated, mod_dtype, upcast, 201), ((0, 1), (0,), (1,)), 202,
                                  f"{form} gated={gated} {mod_dtype} upcast={upcast} k={k}", upcast=upcast, k=k)


@pytest.mark.parametrize("upcast,k", [(False, None), (False, 1.0), (True, None), (True, 0.5)])
def test_fp32_tables_with_a_plan_equal_the_two_ops(upcast, k):
    """The indexed form outside the H3 rule (fp32 tables, upcast, k): the `.forms` overload."""
    ti, tags = packing(S, 3, 211)
    plan = detdit.plan(ti, tags, 3, batch=B)
    residual, y = normal((B, S, H), 212, BF, scale=2.0), normal((B, S, H), 213, BF)
    gate, shift, scale = (normal((9, H), 214 + c, scale=0.3) for c in range(3))
    weight = (1 + normal((H,), 217, scale=0.5)).to(BF if upcast else F32)
    assert_region_equals_composed(detdit.gate_residual_rmsnorm, composed, (residual, y, gate, weight, shift, scale),
                                  ((0, 1),), 218, "indexed", upcast=upcast, k=k, plan=plan)


@pytest.mark.parametrize("form,gated,mod_dtype,upcast,k", CASES[::3])
def test_autograd_equals_the_raw_backward(form, gated, mod_dtype, upcast, k):
    inputs = region_inputs(form, gated, mod_dtype, upcast, 221)
    residual, y, gate, weight, shift, scale = inputs
    h, out, rstd = ops.gate_residual_rmsnorm.forms(*inputs, None, 1e-6, "portable", upcast, k)
    d_h, d_out = normal(tuple(h.shape), 222, h.dtype), normal(tuple(out.shape), 223, out.dtype)
    for reach in ((d_h, d_out), (d_h, None), (None, d_out)):
        ls = leaves(*inputs)
        got = detdit.gate_residual_rmsnorm(*ls, eps=1e-6, upcast=upcast, k=k)
        torch.autograd.backward([t for t, g in zip(got, reach) if g is not None], [g for g in reach if g is not None])
        raw = ops.gate_residual_rmsnorm_backward.forms(reach[1], reach[0], y, gate, weight, shift, scale, None, h,
                                                       rstd, 1e-6, "portable", upcast, k, [True] * 6)
        want = [r if t is not None else None for r, t in zip(raw, inputs)]
        assert_all_equal(grads(ls), want, f"{form} upcast={upcast} k={k} d_out={reach[1] is not None}")


def test_fake_kernels_give_the_real_outputs_shapes_and_dtypes():
    for form, gated, mod_dtype, upcast, k in CASES:
        inputs = region_inputs(form, gated, mod_dtype, upcast, 231)
        residual, y, gate, weight, shift, scale = inputs
        forward = (*inputs, None, 1e-5, "portable", upcast, k)
        real = ops.gate_residual_rmsnorm.forms(*forward)
        pairs = [(real, _compile.FAKE_KERNELS["gate_residual_rmsnorm.forms"](*forward))]
        h, out, rstd = real
        for d_out, d_h, mask in ((out, h, [True] * 6), (out, None, [True, False, True, False, True, False]),
                                 (None, h, [True] * 6), (None, None, [True] * 6)):
            backward = (d_out, d_h, y, gate, weight, shift, scale, None, h, rstd, 1e-5, "portable", upcast, k, mask)
            pairs.append((ops.gate_residual_rmsnorm_backward.forms(*backward),
                          _compile.FAKE_KERNELS["gate_residual_rmsnorm_backward.forms"](*backward)))
        assert_fakes_match(pairs, f"{form} gated={gated}")


def test_errors_leave_the_inputs_unchanged():
    x, y = normal((B, S, H), 241, BF), normal((B, S, H), 242, BF)
    p = parent("sample", BF, 243)
    gate, shift, scale = p[:, 2], p[:, 3], p[:, 4]
    w = torch.ones(H, dtype=BF)
    per_token = parent("token", BF, 244)[:, :, 0]
    frames7 = normal((B, 7, H), 245, BF)
    every = [x, y, p, per_token, frames7, w]
    calls = [
        (ValueError, "one modulation form", lambda: detdit.gate_residual_rmsnorm(x, y, per_token, w, shift, scale)),
        (ValueError, r"gate.*300.*7|gate.*7.*300", lambda: detdit.gate_residual_rmsnorm(x, y, frames7, w)),
        (TypeError, "gate", lambda: detdit.gate_residual_rmsnorm(x, y, gate.half(), w)),
        (TypeError, "gate_residual_rmsnorm: weight must be a torch.Tensor, got NoneType",
         lambda: detdit.gate_residual_rmsnorm(x, y, gate)),
        (TypeError, "gate_residual_rmsnorm: k must be a real number or None",
         lambda: detdit.gate_residual_rmsnorm(x, y, gate, w, k="1")),
    ]
    for error, match, call in calls:
        unchanged_after(call, every, error, match)
    ti, tags = packing(S, 3, 246)
    tables = detdit.plan_tables(detdit.plan(ti, tags, 3, batch=B))
    with pytest.raises(TypeError, match="PlanTables take the H3 rule only"):
        detdit.gate_residual_rmsnorm(x, y, normal((9, H), 247), w, plan=tables)
