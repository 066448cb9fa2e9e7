"""Each op through the binding (CPU) against an independent derivation of its bits.

Bitwise where docs/numerics.md fixes every rounding with IEEE operations only (the exact
emulations of emulate.py, or eager PyTorch where the contract is eager's arithmetic);
within stated bounds of an FP64 evaluation where a portable exp/sin/cos is involved.

Inputs: the C++ op cases' (op_cases fixture, op_cases.py) where the C++ test suite has a case
of the shape a test needs; the rest (a hidden size of 1088 or 528 for every lane of the row
tree's rounds, a K of 1096 for the linear's lanes, the sinusoid's edge timesteps) are
built here.
"""
import math

import pytest
import torch

import detdit
import emulate
from conftest import assert_bitwise_equal, assert_close_to, normal, packing
from op_cases import find

ops = torch.ops.detdit
DTYPES = [torch.float32, torch.bfloat16]


def rows_of(ti, tags):
    return ti * 3 + tags


# ---------------------------------------------------------------- timestep_sinusoid

def sinusoid_reference(t, channels, max_period):
    """Section 5.1 with float32 rounding of c, 1/half, c*k, *1/half and t*freq (torch float32
    ops are IEEE), exp/cos/sin in float64: differs from detdit only by the portable functions'
    final roundings (<= 1 ulp each)."""
    half = channels // 2
    c = torch.tensor(-math.log(max_period), dtype=torch.float32)
    inv_half = torch.tensor(1.0 / half, dtype=torch.float32)
    exponent = (c * torch.arange(half, dtype=torch.float32)) * inv_half
    freq = torch.exp(exponent.double()).float()
    arg = (t.float()[:, None] * freq[None, :]).double()
    return torch.cat([torch.cos(arg), torch.sin(arg)], dim=1), freq.double(), arg


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_timestep_sinusoid_forward_and_backward(dtype):
    t = torch.tensor([0.0, 1.0, 0.25, 0.7731, 1e-3, 0.5], dtype=dtype)
    out = detdit.timestep_sinusoid(t, 256, 10000)
    assert out.dtype == torch.float32 and out.shape == (6, 256)
    ref, freq, arg = sinusoid_reference(t, 256, 10000)
    # 1 ulp of the freq rounding moves arg by <= 2^-23 relative (|arg| <= 1), plus 1 ulp of the result.
    assert_close_to(out, ref, 2.0 ** -21, "features vs FP64")
    assert_bitwise_equal(detdit.timestep_sinusoid(t, 256, 10000), out, "repeat")
    assert_bitwise_equal(detdit.timestep_sinusoid(t, 256, 10000, check_range=False), out, "check_range=False")
    # row-local: each row equals the op on that timestep alone
    for i in range(t.numel()):
        assert_bitwise_equal(detdit.timestep_sinusoid(t[i:i + 1], 256, 10000)[0], out[i], f"row {i} alone")

    tg = t.clone().requires_grad_(True)
    g = normal((6, 256), 1)
    detdit.timestep_sinusoid(tg, 256, 10000).backward(g)
    assert tg.grad.dtype == dtype
    terms = torch.cat([-g.double()[:, :128] * torch.sin(arg) * freq, g.double()[:, 128:] * torch.cos(arg) * freq], 1)
    d_ref = terms.sum(1)
    # an ascending float32 chain of 2*128 rounded terms, then one cast to dtype
    bound = (300 * 2.0 ** -24) * terms.abs().sum(1).max().item() + (d_ref.abs().max().item() * 2.0 ** -7
                                                                     if dtype != torch.float32 else 0.0)
    assert_close_to(tg.grad, d_ref, bound, "d_t vs FP64")


# ---------------------------------------------------------------- linear

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_forward_and_backward_bitwise(dtype, with_bias):
    x = normal((3, 1096), 2, dtype)  # >= 4 vectors per lane, a partial last round
    w = normal((200, 1096), 3, dtype, scale=0.1)
    b = normal((200,), 4, dtype, scale=0.02) if with_bias else None
    out, pre = ops.linear(x, w, b, "none", "portable")
    assert out.dtype == dtype and pre.numel() == 0
    assert_bitwise_equal(out, emulate.linear_forward(x, w, b).to(dtype), "linear out")
    # row invariance: row 1 alone gives the same bits
    assert_bitwise_equal(detdit.linear(x[1:2], w, b)[0], out[1], "linear row 1 alone")

    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    bg = b.clone().requires_grad_(True) if with_bias else None
    grad = normal((3, 200), 5, dtype)
    detdit.linear(xg, wg, bg).backward(grad)
    d_x, d_w, d_b = emulate.linear_backward(grad.float(), x, w)
    assert_bitwise_equal(xg.grad, d_x.to(dtype), "linear d_x")
    assert_bitwise_equal(wg.grad, d_w.to(dtype), "linear d_weight")
    if with_bias:
        assert_bitwise_equal(bg.grad, d_b.to(dtype), "linear d_bias")


def test_linear_silu():
    x, w, b = normal((2, 64), 6), normal((96, 64), 7, scale=0.2), normal((96,), 8, scale=0.1)
    out, pre = ops.linear(x, w, b, "silu", "portable")
    assert_bitwise_equal(pre, emulate.linear_forward(x, w, b), "pre-activation")
    silu = pre.double() * torch.sigmoid(pre.double())
    # rn(z / rn(1 + exp_P(-z))): three roundings, each <= 1/2 ulp, exp_P <= 1 ulp
    assert_close_to(out, silu, 4 * 2.0 ** -24 * silu.abs().max().item(), "silu out vs FP64")


# ---------------------------------------------------------------- timestep_mlp

def test_timestep_mlp_forward_bitwise_given_hidden(op_cases):
    c = find(op_cases, "timestep_mlp", "T=3 K=24 H=72 D=64")
    f, w1, b1, w2, b2 = (c[n] for n in ("features", "w1", "b1", "w2", "b2"))
    temb, pre, hidden = ops.timestep_mlp(f, w1, b1, w2, b2, "portable")
    assert_bitwise_equal(pre, emulate.linear_forward(f, w1, b1), "mlp pre")
    assert_close_to(hidden, pre.double() * torch.sigmoid(pre.double()), 4 * 2.0 ** -24 * pre.abs().max().item(),
                    "mlp hidden = silu(pre)")
    assert_bitwise_equal(temb, emulate.linear_forward(hidden, w2, b2), "mlp temb from the saved hidden")

    params = [t.clone().requires_grad_(True) for t in (f, w1, b1, w2, b2)]
    g = c["grad_temb"]
    detdit.timestep_mlp(*params).backward(g)
    d_hidden, d_w2, d_b2 = emulate.linear_backward(g, hidden, w2)
    assert_bitwise_equal(params[3].grad, d_w2, "mlp d_w2")
    assert_bitwise_equal(params[4].grad, d_b2, "mlp d_b2")


# ---------------------------------------------------------------- adaln_projection

@pytest.mark.parametrize("name", ["float32 T=1 D=8 N=126", "bfloat16 T=3 D=24 N=72"])
def test_adaln_projection_bitwise_given_act(op_cases, name):
    c = find(op_cases, "adaln_projection", name)
    temb, w, b = c["temb"], c["weight"], c["bias"]
    dtype, rows, hidden = w.dtype, temb.shape[0], w.shape[0] // 18
    table, act = ops.adaln_projection(temb, w, b, "portable")
    assert table.dtype == dtype and act.dtype == dtype and table.shape == (rows, 18 * hidden)
    silu = temb.double() * torch.sigmoid(temb.double())
    # one cast of the FP32 SiLU: within one ulp of dtype of the FP64 SiLU
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -22
    assert_close_to(act, silu, ulp * silu.abs().max().item(), "act = R(silu(temb))")
    assert_bitwise_equal(table, emulate.linear_forward(act, w, b).to(dtype), "table from the saved act")

    wg, bg = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
    tg = temb.clone().requires_grad_(True)
    g = c["grad_table"].to(dtype)  # autograd hands a table its gradient in the table's dtype
    detdit.adaln_projection(tg, wg, bg).backward(g)
    d_act, d_w, d_b = emulate.linear_backward(g.float(), act, w)
    assert_bitwise_equal(wg.grad, d_w.to(dtype), "projection d_weight")
    assert_bitwise_equal(bg.grad, d_b.to(dtype), "projection d_bias")
    z = temb.double()
    s = torch.sigmoid(z)
    d_temb_ref = d_act.double() * s * (1 + z * (1 - s))  # d_act is exact FP32: not rounded through the cast
    assert_close_to(tg.grad, d_temb_ref, 16 * 2.0 ** -24 * d_temb_ref.abs().max().item() + 1e-30,
                    "d_temb vs FP64 SiLU VJP of the exact d_act")


# ---------------------------------------------------------------- plans

def test_plan_tables_and_row_index():
    ti, tags = packing(300, 4, 18)
    plan = detdit.plan(ti, tags, 4, batch=2)
    assert (plan.seq_len(), plan.batch(), plan.num_rows(), plan.positions()) == (300, 2, 12, 600)
    assert plan.num_chunks() == 3 and plan.device() == "cpu"
    assert torch.equal(plan.row_index(), rows_of(ti, tags).to(torch.int32))
    again = detdit.plan_from_rows(rows_of(ti, tags).to(torch.int32), 12, batch=2)
    assert torch.equal(again.row_index(), plan.row_index()) and again.num_segments() == plan.num_segments()


# ---------------------------------------------------------------- adaln_row_gather

@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "float16"])
def test_adaln_row_gather_forward_and_backward(op_cases, dtype_name):
    c = find(op_cases, "adaln_row_gather", f"{dtype_name} H=20 interleaved_S257_T3_B2")
    dtype = c["grad"].dtype
    spec = c.plans["plan"]
    seq, timesteps, hidden = spec["seq_len"], spec["num_timesteps"], c["grad"].shape[-1]
    rows_index = c.rows()
    plan = c.plan()
    rows = c["rows_storage"]
    # the same rows at a row stride of 12H: any row stride
    strided = torch.stack([rows, torch.zeros_like(rows)], 1).flatten(0, 1)[::2]
    for source, name in ((rows, "rows"), (strided, "strided rows")):
        out = detdit.adaln_row_gather(source, plan)
        expect = torch.stack([source[:, c * hidden:(c + 1) * hidden].index_select(0, rows_index) for c in range(6)])
        assert_bitwise_equal(out, expect, f"gather of {name} vs six index_selects")

    rg = rows.clone().requires_grad_(True)
    grad = c["grad"][:, :seq]  # autograd's gradient of the (6, S, H) output: item 0's
    detdit.adaln_row_gather(rg, plan).backward(grad)
    g = grad.float()
    ref = torch.cat([emulate.canonical_reduce(lambda p, c=c: g[c, p], rows_index, 3 * timesteps, hidden, False)
                     for c in range(6)], dim=1)
    assert_bitwise_equal(rg.grad, ref.to(dtype), "d_rows (batch-summed grad, batch-1 index)")

    # the raw backward op with the full (6, B*S, H) grad reduces over p = b*S + s
    grad_b = c["grad"].float()
    full = ops.adaln_row_gather_backward(c["grad"], plan)
    rows_b = rows_index.repeat(spec["batch"])
    ref_b = torch.cat([emulate.canonical_reduce(lambda p, c=c: grad_b[c, p], rows_b, 3 * timesteps, hidden, False)
                       for c in range(6)], dim=1)
    assert_bitwise_equal(full, ref_b.to(dtype), "d_rows over B*S positions")


# ---------------------------------------------------------------- rmsnorm

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("modulated", [False, True])
def test_rmsnorm_forward_and_backward_bitwise(dtype, modulated):
    batch, seq, timesteps, hidden = 2, 300, 2, 1088  # 272 vectors: every lane of all 4 warps, 3 rounds
    ti, tags = packing(seq, timesteps, 24)
    rows_index = rows_of(ti, tags)
    plan = detdit.plan(ti, tags, timesteps, batch=batch)
    x = normal((batch, seq, hidden), 25, dtype, scale=3.0)
    w = (1 + normal((hidden,), 26, scale=0.05)).to(dtype)
    shift = normal((3 * timesteps, hidden), 27, dtype, scale=0.5) if modulated else None
    scale = normal((3 * timesteps, hidden), 28, dtype, scale=0.5) if modulated else None
    rows_b = rows_index.repeat(batch)

    out, rstd = ops.rmsnorm(x, w, shift, scale, plan if modulated else None, 1e-5, "portable")
    ref_out, ref_rstd = emulate.rmsnorm_forward(x.view(-1, hidden), w, shift, scale, rows_b)
    assert_bitwise_equal(rstd, ref_rstd, "rstd")
    assert_bitwise_equal(out, ref_out.view_as(x), "rmsnorm out")
    # batch invariance: item 1 alone
    plan1 = detdit.plan(ti, tags, timesteps, batch=1)
    alone = detdit.rmsnorm(x[1:], w, shift, scale, plan1 if modulated else None)
    assert_bitwise_equal(alone[0], out[1], "item 1 alone")

    leaves = [t.clone().requires_grad_(True) if t is not None else None for t in (x, w, shift, scale)]
    grad = normal((batch, seq, hidden), 29, dtype)
    detdit.rmsnorm(*leaves, plan=plan if modulated else None).backward(grad)
    dx, dw, dsh, dsc = emulate.rmsnorm_backward(grad.view(-1, hidden), x.view(-1, hidden), w, ref_rstd, shift,
                                                scale, rows_b, 3 * timesteps)
    assert_bitwise_equal(leaves[0].grad, dx.view_as(x), "dx")
    assert_bitwise_equal(leaves[1].grad, dw.to(dtype), "d_weight")
    if modulated:
        assert_bitwise_equal(leaves[2].grad, dsh.to(dtype), "d_shift")
        assert_bitwise_equal(leaves[3].grad, dsc.to(dtype), "d_scale")


# ---------------------------------------------------------------- gate_residual

@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "float16"])
def test_gate_residual_forward_and_backward(op_cases, dtype_name):
    c = find(op_cases, "gate_residual", f"{dtype_name} H=20 interleaved_S257_T3_B2 contiguous gate")
    dtype = c["y"].dtype
    spec = c.plans["plan"]
    batch, seq, timesteps, hidden = spec["batch"], spec["seq_len"], spec["num_timesteps"], c["y"].shape[-1]
    rows_index = c.rows()
    plan = c.plan()
    residual, y = c["residual"].view(batch, seq, hidden), c["y"].view(batch, seq, hidden)
    gate = c["table"]
    out = detdit.gate_residual(residual, y, gate, plan)
    assert_bitwise_equal(out, residual + gate[rows_index] * y, "out vs eager res + gate[idx] * y")

    leaves = [t.clone().requires_grad_(True) for t in (residual, y, gate)]
    grad = c["grad"].view(batch, seq, hidden)
    detdit.gate_residual(*leaves, plan).backward(grad)
    assert_bitwise_equal(leaves[0].grad, grad, "d_residual")
    assert_bitwise_equal(leaves[1].grad, grad * gate[rows_index], "d_y vs eager grad * gate[idx]")
    g, yf = grad.float().view(-1, hidden), y.float().view(-1, hidden)
    ref = emulate.canonical_reduce(lambda p: (g[p], yf[p]), rows_index.repeat(batch), 3 * timesteps, hidden, True)
    assert_bitwise_equal(leaves[2].grad, ref.to(dtype), "d_gate")


# ---------------------------------------------------------------- final_adaln_out, adaln_modulation

@pytest.mark.parametrize("dtype", DTYPES)
def test_final_adaln_out_bitwise(dtype):
    batch, seq, timesteps, hidden, dim = 2, 300, 3, 528, 24
    ti = packing(seq, timesteps, 35)[0]
    plan = detdit.plan_from_rows(ti, timesteps, batch=batch)
    x = normal((batch, seq, hidden), 36, dtype, scale=2.0)
    nw = (1 + normal((hidden,), 37, scale=0.05)).to(dtype)
    temb = normal((timesteps, dim), 38, scale=2.0)
    w = normal((2 * hidden, dim), 39, dtype, scale=0.2)
    b = normal((2 * hidden,), 40, dtype, scale=0.02)
    out, table, act, rstd = ops.final_adaln_out(x, nw, temb, w, b, plan, 1e-5, "portable")
    # the same act as the projection (one cast after the FP32 SiLU), then the exact chain
    assert_bitwise_equal(act, ops.adaln_projection(temb, torch.zeros(18, dim, dtype=dtype),
                                                   torch.zeros(18, dtype=dtype), "portable")[1], "act")
    assert_bitwise_equal(table, emulate.linear_forward(act, w, b).to(dtype), "norm_out table")
    rows_b = ti.repeat(batch)
    ref, ref_rstd = emulate.rmsnorm_forward(x.view(-1, hidden), nw, table[:, :hidden], table[:, hidden:], rows_b)
    assert_bitwise_equal(rstd, ref_rstd, "rstd")
    assert_bitwise_equal(out, ref.view_as(x), "final out (shift first)")

    leaves = [t.clone().requires_grad_(True) for t in (x, nw, temb, w, b)]
    grad = normal((batch, seq, hidden), 41, dtype)
    detdit.final_adaln_out(*leaves, plan).backward(grad)
    dx, dnw, dsh, dsc = emulate.rmsnorm_backward(grad.view(-1, hidden), x.view(-1, hidden), nw, ref_rstd,
                                                 table[:, :hidden], table[:, hidden:], rows_b, timesteps)
    assert_bitwise_equal(leaves[0].grad, dx.view_as(x), "final dx")
    assert_bitwise_equal(leaves[1].grad, dnw.to(dtype), "final d_norm_weight")
    d_table = torch.cat([dsh, dsc], 1)  # FP32, never rounded
    _, d_w, d_b = emulate.linear_backward(d_table, act, w)
    assert_bitwise_equal(leaves[3].grad, d_w.to(dtype), "final d_weight from the FP32 table grad")
    assert_bitwise_equal(leaves[4].grad, d_b.to(dtype), "final d_bias from the FP32 table grad")


@pytest.mark.parametrize("dtype", DTYPES)
def test_adaln_modulation_equals_projection_then_gather(dtype):
    seq, timesteps, hidden, dim = 300, 2, 8, 24
    ti, tags = packing(seq, timesteps, 42)
    plan = detdit.plan(ti, tags, timesteps, batch=1)
    temb = normal((timesteps, dim), 43, scale=2.0)
    w = normal((18 * hidden, dim), 44, dtype, scale=0.2)
    b = normal((18 * hidden,), 45, dtype, scale=0.02)
    out, table, act = ops.adaln_modulation(temb, w, b, plan, "portable")
    sep_table, sep_act = ops.adaln_projection(temb, w, b, "portable")
    assert_bitwise_equal(table, sep_table, "fused table")
    assert_bitwise_equal(out, detdit.adaln_row_gather(sep_table.view(3 * timesteps, -1), plan),
                         "fused == projection then gather")

    leaves = [t.clone().requires_grad_(True) for t in (temb, w, b)]
    grad = normal((6, seq, hidden), 46, dtype)
    detdit.adaln_modulation(*leaves, plan).backward(grad)
    g = grad.float()
    rows_index = rows_of(ti, tags)
    d_rows = torch.cat([emulate.canonical_reduce(lambda p, c=c: g[c, p], rows_index, 3 * timesteps, hidden, False)
                        for c in range(6)], dim=1)  # FP32, kept
    _, d_w, d_b = emulate.linear_backward(d_rows.view(timesteps, -1), act, w)
    assert_bitwise_equal(leaves[1].grad, d_w.to(dtype), "fused d_weight from the FP32 table grad")
    assert_bitwise_equal(leaves[2].grad, d_b.to(dtype), "fused d_bias from the FP32 table grad")
