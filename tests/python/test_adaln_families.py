"""The DiT families' AdaLN projections, chunk orders and Wan's / LTX-Video's table add,
through the binding on the CPU, against the eager formulas of diffusers' modules written
here in plain torch ops: bitwise where the arithmetic is elementwise (the SiLU's cast, the
table add, its d_proj), the table from the saved act bitwise equal to emulate.py's linear
(docs/numerics.md 5.2), and against eager's own bf16 linear within a stated bound (detdit's
FP32 reduction order differs from torch's); d_table against emulate.py's canonical
reduction bitwise and eager's sum within a bound; rows alone equal rows in the batch."""
import pytest
import torch
import torch.nn.functional as F

import detdit
import emulate
from conftest import assert_bitwise_equal, assert_close_to, normal

BF16_ULP = 2.0 ** -8  # half a bf16 ulp relative: one rounding


@pytest.mark.parametrize("order,temb_dtype,rows", [
    ("ada_layer_norm_zero", torch.bfloat16, 2),         # SD3 / Flux: bf16 temb per sample
    ("sd35_ada_layer_norm_zero_x", torch.bfloat16, 3),
    ("ada_layer_norm_zero_single", torch.float32, 2),
    ("ada_layer_norm_continuous", torch.bfloat16, 2),   # norm_out: scale first
    ("wan_block", torch.bfloat16, 40),                  # per token (T = B*S)
])
def test_family_projection_is_eager_linear_of_silu(order, temb_dtype, rows):
    names = detdit.adaln_chunk_order(order)
    k, hidden, dim = len(names), 8, 16
    temb = normal((rows, dim), 1, temb_dtype, 2.0)
    w = normal((k * hidden, dim), 2, torch.bfloat16, 0.1)
    b = normal((k * hidden,), 3, torch.bfloat16, 0.5)
    table = detdit.adaln_projection(temb, w, b, chunks=k)
    act = F.silu(temb.float()).to(torch.bfloat16)  # numerics 5.4: R_W(silu(temb)), temb widened exactly
    if temb_dtype == torch.bfloat16:
        # eager's CUDA SiLU of a bf16 tensor is this formula (FP32 of the widened value, one
        # rounding); a CPU build of torch may round each of its steps to bf16 instead (the CPU
        # kernel of torch 1.13 does): within one bf16 ulp
        silu = F.silu(temb).double()
        assert_close_to(act, silu, 2.0 ** -7 * silu.abs().max().item(), "act vs eager's bf16 silu")
    assert_bitwise_equal(table, emulate.linear_forward(act, w, b).to(torch.bfloat16), "table from act")
    eager = F.linear(F.silu(temb).to(torch.bfloat16), w, b)
    # both are one rounding of nearly the same FP32 sum: at most one bf16 ulp of the largest output
    assert_close_to(table, eager.double(), 2 * BF16_ULP * eager.abs().max().item(), "table vs eager linear")
    # the chunk views are eager's chunk(K, dim=1), in the family's order
    for got, want in zip(detdit.adaln_table_chunks(table, hidden, order), table.chunk(k, dim=1)):
        assert got.data_ptr() == want.data_ptr() and got.shape == want.shape and got.stride() == want.stride()


def test_family_projection_gradients_in_temb_dtype_and_batch_invariant():
    k, hidden, dim, rows = 6, 8, 16, 5
    temb = normal((rows, dim), 4, torch.bfloat16, 2.0)
    w = normal((k * hidden, dim), 5, torch.bfloat16, 0.1)
    b = normal((k * hidden,), 6, torch.bfloat16, 0.5)
    g = normal((rows, k * hidden), 7, torch.bfloat16)
    tg = temb.clone().requires_grad_(True)
    table = detdit.adaln_projection(tg, w, b, chunks=k)
    table.backward(g)
    assert tg.grad.dtype == torch.bfloat16
    # the bf16 d_temb is the library's FP32 d_temb of the widened temb, rounded once
    t32 = temb.float().requires_grad_(True)
    detdit.adaln_projection(t32, w, b, chunks=k).backward(g)
    assert_bitwise_equal(tg.grad, t32.grad.to(torch.bfloat16), "bf16 d_temb = R(fp32 d_temb)")
    for r in (0, rows - 1):
        alone = detdit.adaln_projection(temb[r:r + 1], w, b, chunks=k)
        assert_bitwise_equal(alone, table[r:r + 1].detach(), f"row {r} alone")


def test_family_projection_refuses_what_h3_refuses():
    temb = normal((2, 16), 8, torch.bfloat16)
    w, b = normal((12, 16), 9, torch.bfloat16), normal((12,), 10, torch.bfloat16)
    with pytest.raises(TypeError, match="temb must be float32"):
        detdit.adaln_projection(temb, w, b)  # H3's projection: fp32 temb
    with pytest.raises(ValueError, match="not a positive multiple of 5"):
        detdit.adaln_projection(temb, w, b, chunks=5)
    with pytest.raises(ValueError, match="unknown AdaLN chunk order 'flux'"):
        detdit.adaln_chunk_order("flux")


def _eager_table_add(table, proj):
    return table[None] + proj


@pytest.mark.parametrize("table_dtype,proj_dtype,broadcast,rows", [
    (torch.float32, torch.bfloat16, False, 3),   # Wan block: fp32 table + bf16 projection -> fp32
    (torch.bfloat16, torch.bfloat16, False, 4),  # LTX-Video block
    (torch.float32, torch.float32, True, 3),     # Wan final: table (2, H) + temb (B, 1, H)
    (torch.bfloat16, torch.bfloat16, True, 5),   # LTX-Video final
    (torch.float32, torch.bfloat16, False, 600),  # per token, d_table over three 256-row chunks
])
def test_table_add_is_eager_and_its_gradients(table_dtype, proj_dtype, broadcast, rows):
    k, hidden = (2 if broadcast else 6), 8
    table = normal((k, hidden), 11, table_dtype, 0.5)
    proj = normal((rows, 1 if broadcast else k, hidden), 12, proj_dtype)
    grad_dtype = table_dtype if table_dtype == proj_dtype else torch.float32
    g = normal((rows, k, hidden), 13, grad_dtype)
    tg, pg = table.clone().requires_grad_(True), proj.clone().requires_grad_(True)
    out = detdit.adaln_table_add(tg, pg)
    te, pe = table.clone().requires_grad_(True), proj.clone().requires_grad_(True)
    eager = _eager_table_add(te, pe)
    assert_bitwise_equal(out, eager, "out = table + proj (one rounding, promoted dtype)")
    out.backward(g)
    eager.backward(g)
    # d_proj: the cast of the gradient (summed over the K chunks first when broadcast: two terms
    # for the final tables, so any order is the same sum)
    assert_bitwise_equal(pg.grad, pe.grad, "d_proj")
    # d_table: the canonical reduction over the T rows (numerics 6.5), rounded once
    g32 = g.float().reshape(rows, k * hidden)
    want = emulate.canonical_reduce(lambda p: g32[p], torch.zeros(rows, dtype=torch.int64), 1, k * hidden, False)
    assert_bitwise_equal(tg.grad, want.reshape(k, hidden).to(table_dtype), "d_table = canonical reduction")
    # eager's sum is another FP32 order: within a few FP32 ulps of the sum's magnitude, then one rounding
    ulp = 2.0 ** -7 if table_dtype == torch.bfloat16 else 0.0  # one bf16 rounding step apart at most
    bound = rows * 2.0 ** -24 * g32.abs().sum(0).max().item() + ulp * te.grad.abs().max().item()
    assert_close_to(tg.grad, te.grad.double(), bound, "d_table vs eager sum")


def test_table_add_rows_alone_and_layouts():
    table = normal((1, 6, 8), 14, torch.float32)  # Wan stores (1, 6, H)
    proj = normal((4, 48), 15, torch.bfloat16)  # the (T, 6H) projection as it comes
    out = detdit.adaln_table_add(table, proj)
    assert out.shape == (4, 6, 8) and out.dtype == torch.float32
    assert_bitwise_equal(out, table + proj.unflatten(1, (6, 8)), "Wan's table + unflattened projection")
    for r in range(4):
        assert_bitwise_equal(detdit.adaln_table_add(table, proj[r:r + 1]), out[r:r + 1], f"row {r} alone")
    shifts = detdit.adaln_table_chunks(out, 8, "wan_block")
    assert len(shifts) == 6 and all(c.shape == (4, 8) for c in shifts)
    assert_bitwise_equal(shifts[3], out[:, 3], "c_shift")
    with pytest.raises(TypeError):
        detdit.adaln_table_add(table, "proj")
    with pytest.raises(ValueError, match="proj must be"):
        detdit.adaln_table_add(table[0], normal((4, 3, 8), 16, torch.bfloat16))


# ---------------------------------------------------------------- final layers (compositions)

def _eager_continuous(x, temb, w, b, pw, pb, eps):
    emb = F.linear(F.silu(temb).to(x.dtype), w, b)  # AdaLayerNormContinuous: scale, then shift
    scale, shift = emb.chunk(2, dim=1)
    if scale.shape[0] != x.shape[0]:
        scale, shift = scale.view(x.shape), shift.view(x.shape)
    else:
        scale, shift = scale[:, None, :], shift[:, None, :]
    n = F.layer_norm(x, (x.shape[-1],), eps=eps) * (1 + scale) + shift
    return F.linear(n, pw, pb)


def _eager_table(x, temb, table, pw, pb, eps, upcast):
    mod = table[None] + temb.reshape(-1, 1, x.shape[-1])  # Wan / LTX: table + temb.unsqueeze(1)
    shift, scale = mod[:, 0], mod[:, 1]
    if shift.shape[0] != x.shape[0]:
        shift, scale = shift.view(x.shape), scale.view(x.shape)
    else:
        shift, scale = shift[:, None, :], scale[:, None, :]
    if upcast:  # Wan: FP32LayerNorm, then .type_as(x)
        n = (F.layer_norm(x.float(), (x.shape[-1],), eps=eps) * (1 + scale) + shift).type_as(x)
    else:
        n = F.layer_norm(x, (x.shape[-1],), eps=eps) * (1 + scale) + shift
    return F.linear(n, pw, pb)


def _final_inputs(per_token, dtype=torch.bfloat16):
    batch, seq, hidden, dim, out = 3, 5, 16, 8, 12
    x = normal((batch, seq, hidden), 21, dtype)
    temb = normal((batch * seq if per_token else batch, dim), 22, dtype, 2.0)
    w, b = normal((2 * hidden, dim), 23, dtype, 0.1), normal((2 * hidden,), 24, dtype, 0.1)
    pw, pb = normal((out, hidden), 25, dtype, 0.2), normal((out,), 26, dtype, 0.1)
    return x, temb, w, b, pw, pb


@pytest.mark.parametrize("per_token", [False, True])
def test_final_layer_continuous_vs_eager_and_batch_invariant(per_token):
    x, temb, w, b, pw, pb = _final_inputs(per_token)
    xs = x.clone().requires_grad_(True)
    out = detdit.final_layer_continuous(xs, temb, w, b, pw, pb)
    eager = _eager_continuous(x, temb, w, b, pw, pb, 1e-6)
    assert out.shape == eager.shape and out.dtype == eager.dtype
    # every step is one or two bf16 roundings apart from eager's (the linears' FP32 orders differ
    # and a bf16 step can flip): a few bf16 ulps of the output's magnitude
    assert_close_to(out, eager.double(), 8 * 2.0 ** -8 * eager.abs().max().item(), "final_layer_continuous")
    g = normal(out.shape, 27, out.dtype)
    out.backward(g)
    assert xs.grad.dtype == x.dtype
    # sample 0 alone: its output and dx bitwise as in the batch
    rows = x.shape[1] if per_token else 1
    x0 = x[:1].clone().requires_grad_(True)
    out0 = detdit.final_layer_continuous(x0, temb[:rows], w, b, pw, pb)
    assert_bitwise_equal(out0, out[:1].detach(), "sample 0 alone: out")
    out0.backward(g[:1])
    assert_bitwise_equal(x0.grad, xs.grad[:1], "sample 0 alone: dx")


@pytest.mark.parametrize("upcast,table_dtype,per_token", [
    (True, torch.float32, False),    # Wan 2.1 / 2.2 A14B
    (True, torch.float32, True),     # Wan 2.2 TI2V per token
    (False, torch.bfloat16, False),  # LTX-Video
    (False, torch.bfloat16, True),   # LTX-Video image-to-video per token
])
def test_final_layer_table_vs_eager_and_batch_invariant(upcast, table_dtype, per_token):
    x, _, _, _, pw, pb = _final_inputs(per_token)
    batch, seq, hidden = x.shape
    temb = normal((batch * seq if per_token else batch, hidden), 28, table_dtype)
    table = normal((2, hidden), 29, table_dtype, 0.3)
    xs, tg = x.clone().requires_grad_(True), table.clone().requires_grad_(True)
    out = detdit.final_layer_table(xs, temb, tg, pw, pb, upcast=upcast)
    eager = _eager_table(x, temb, table, pw, pb, 1e-6, upcast)
    assert out.shape == eager.shape and out.dtype == eager.dtype
    assert_close_to(out, eager.double(), 8 * 2.0 ** -8 * eager.abs().max().item(), "final_layer_table")
    g = normal(out.shape, 30, out.dtype)
    out.backward(g)
    assert tg.grad.dtype == table_dtype and xs.grad.dtype == x.dtype
    rows = seq if per_token else 1
    x0 = x[:1].clone().requires_grad_(True)
    out0 = detdit.final_layer_table(x0, temb[:rows], table, pw, pb, upcast=upcast)
    assert_bitwise_equal(out0, out[:1].detach(), "sample 0 alone: out")
    out0.backward(g[:1])
    assert_bitwise_equal(x0.grad, xs.grad[:1], "sample 0 alone: dx")
