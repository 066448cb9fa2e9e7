"""Gradients through the binding against FP64 eager PyTorch formulas (diffusers semantics,
straight-through at the model's rounding points), and autograd through the whole H3
conditioning chain: repeatable to the bit, batch invariant, close to an FP64 eager model.

Bounds are normwise: max |detdit - fp64| <= tol * max |fp64|, with tol = 2^-16 for float32
results (sums of up to ~10^3 rounded terms) and 2^-6 for bfloat16 results (a few bf16
roundings of the forward feed every gradient).
"""
import pytest
import torch
import torch.nn.functional as F

import detdit
from conftest import assert_bitwise_equal, normal, packing

TOL = {torch.float32: 2.0 ** -16, torch.bfloat16: 2.0 ** -6}


def check_normwise(actual, reference, dtype, what):
    ref = reference.detach().double()
    err = (actual.detach().double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert scale > 0, f"{what}: zero reference (the check would be empty)"
    assert err <= TOL[dtype] * scale, f"{what}: max abs error {err:.3e} > {TOL[dtype]:.1e} * max|ref| {scale:.3e}"


def fp64_leaves(*tensors):
    return [t.detach().double().requires_grad_(True) for t in tensors]


def rms64(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_modulated_and_gate_grads_vs_fp64(dtype):
    batch, seq, timesteps, hidden = 2, 300, 2, 256
    ti, tags = packing(seq, timesteps, 50)
    idx = ti * 3 + tags
    plan = detdit.plan(ti, tags, timesteps, batch=batch)
    x = normal((batch, seq, hidden), 51, dtype)
    w = (1 + normal((hidden,), 52, scale=0.05)).to(dtype)
    shift = normal((3 * timesteps, hidden), 53, dtype, scale=0.3)
    scale = normal((3 * timesteps, hidden), 54, dtype, scale=0.3)
    y = normal((batch, seq, hidden), 55, dtype)
    gate = normal((3 * timesteps, hidden), 56, dtype)
    grad = normal((batch, seq, hidden), 57, dtype)

    leaves = [t.clone().requires_grad_(True) for t in (x, w, shift, scale, y, gate)]
    h = detdit.rmsnorm(leaves[0], leaves[1], leaves[2], leaves[3], plan)
    out = detdit.gate_residual(h, leaves[4] * 1, leaves[5], plan)
    out.backward(grad)

    ref = fp64_leaves(x, w, shift, scale, y, gate)
    h64 = rms64(ref[0], ref[1]) * (1 + ref[3][idx]) + ref[2][idx]
    out64 = h64 + ref[5][idx] * ref[4]
    out64.backward(grad.double())
    check_normwise(out, out64, dtype, "forward")
    for leaf, r, name in zip(leaves, ref, ["dx", "d_weight", "d_shift", "d_scale", "d_y", "d_gate"]):
        check_normwise(leaf.grad, r.grad, dtype, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_projection_gather_and_final_grads_vs_fp64(dtype):
    batch, seq, timesteps, hidden, dim = 2, 300, 2, 32, 40
    ti, tags = packing(seq, timesteps, 60)
    idx = ti * 3 + tags
    plan = detdit.plan(ti, tags, timesteps, batch=batch)
    tplan = detdit.plan_from_rows(ti, timesteps, batch=batch)
    temb = normal((timesteps, dim), 61, scale=2.0)
    w = normal((18 * hidden, dim), 62, dtype, scale=0.15)
    b = normal((18 * hidden,), 63, dtype, scale=0.02)
    x = normal((batch, seq, hidden), 64, dtype)
    nw = (1 + normal((hidden,), 65, scale=0.05)).to(dtype)
    wo = normal((2 * hidden, dim), 66, dtype, scale=0.15)
    bo = normal((2 * hidden,), 67, dtype, scale=0.02)
    g_mod = normal((6, seq, hidden), 68, dtype)
    g_out = normal((batch, seq, hidden), 69, dtype)

    for fused in (True, False):
        leaves = [t.clone().requires_grad_(True) for t in (temb, w, b, x, nw, wo, bo)]
        if fused:
            mods = detdit.adaln_modulation(leaves[0], leaves[1], leaves[2], plan)
        else:
            table = detdit.adaln_projection(leaves[0], leaves[1], leaves[2])
            mods = detdit.adaln_row_gather(table.view(3 * timesteps, -1), plan)
        out = detdit.final_adaln_out(leaves[3], leaves[4], leaves[0], leaves[5], leaves[6], tplan)
        torch.autograd.backward([mods, out], [g_mod, g_out])

        r = fp64_leaves(temb, w, b, x, nw, wo, bo)
        act = F.silu(r[0])
        table64 = act @ r[1].T + r[2]
        mods64 = table64.view(3 * timesteps, 6, hidden)[idx].permute(1, 0, 2)
        so = act @ r[5].T + r[6]
        out64 = rms64(r[3], r[4]) * (1 + so[:, hidden:][ti]) + so[:, :hidden][ti]
        torch.autograd.backward([mods64, out64], [g_mod.double(), g_out.double()])
        mode = "fused" if fused else "separate"
        check_normwise(mods, mods64, dtype, f"{mode} modulation forward")
        check_normwise(out, out64, dtype, "final forward")
        for leaf, ref, name in zip(leaves, r, ["d_temb", "d_weight", "d_bias", "dx", "d_norm_weight",
                                               "d_norm_out.weight", "d_norm_out.bias"]):
            check_normwise(leaf.grad, ref.grad, dtype, f"{mode}: {name}")


def test_timestep_path_grads_vs_fp64():
    t = torch.tensor([0.05, 0.4, 0.93])
    w1, b1 = normal((64, 32), 70, scale=0.2), normal((64,), 71, scale=0.02)
    w2, b2 = normal((48, 64), 72, scale=0.15), normal((48,), 73, scale=0.02)
    g = normal((3, 48), 74)
    leaves = [v.clone().requires_grad_(True) for v in (t, w1, b1, w2, b2)]
    temb = detdit.timestep_mlp(detdit.timestep_sinusoid(leaves[0], 32), *leaves[1:])
    temb.backward(g)
    r = fp64_leaves(t, w1, b1, w2, b2)
    freq = torch.exp(-torch.log(torch.tensor(10000.0, dtype=torch.float64)) * torch.arange(16) / 16)
    arg = r[0][:, None] * freq
    f64 = torch.cat([torch.cos(arg), torch.sin(arg)], 1)
    temb64 = F.linear(F.silu(F.linear(f64, r[1], r[2])), r[3], r[4])
    temb64.backward(g.double())
    check_normwise(temb, temb64, torch.float32, "temb")
    for leaf, ref, name in zip(leaves, r, ["d_t", "d_w1", "d_b1", "d_w2", "d_b2"]):
        check_normwise(leaf.grad, ref.grad, torch.float32, name)


def small_model(seed):
    torch.manual_seed(seed)
    model = detdit.nn.H3Conditioning(num_blocks=2, hidden_size=64, freq_dim=32, time_embed_hidden_dim=64,
                                     time_embed_dim=40)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name.endswith("norm.weight"):
                p.copy_(1 + 0.05 * torch.randn_like(p.float()))
    return model


def chain(model, t, x, ti, tags, sublayer, batch):
    """The H3 conditioning chain (include/detdit/chain.h): timestep path, every block's modulated norms and
    gated residuals around the sublayers, then norm_out."""
    plan = detdit.plan(ti, tags, t.numel(), batch=batch)
    tplan = detdit.plan_from_rows(ti, t.numel(), batch=batch)
    temb = model.temb(t)
    for block in model.transformer_blocks:
        x = block(x, temb, plan, sublayer, sublayer)
    return model.norm_out(x, temb, tplan)


def test_autograd_through_the_chain_repeatable_and_batch_invariant():
    model = small_model(80)
    seq, hidden = 300, 64
    ti, tags = packing(seq, 2, 81)
    t = torch.tensor([0.3, 0.8])
    x = normal((2, seq, hidden), 82, torch.bfloat16)
    mix = normal((hidden, hidden), 83, torch.bfloat16, scale=0.1)

    def sublayer(h):
        return h @ mix  # a stand-in for attention / FFN: a fixed bf16 matmul, row-local

    def run(xs, batch):
        model.zero_grad()
        out = chain(model, t, xs.clone().requires_grad_(True), ti, tags, sublayer, batch)
        out.float().pow(2).sum().backward()
        return out, {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}

    out_a, grads_a = run(x, 2)
    out_b, grads_b = run(x, 2)
    assert_bitwise_equal(out_b, out_a, "chain output, second run")
    for name in grads_a:
        if name.startswith("token_refiner"):  # not part of this chain
            assert grads_a[name] is None
            continue
        assert grads_a[name] is not None and torch.isfinite(grads_a[name].float()).all(), name
        assert grads_a[name].abs().sum() > 0, f"{name}: zero gradient"
        assert_bitwise_equal(grads_b[name], grads_a[name], f"{name}, second run")
    # row-local forward: item 0 alone gives the same output rows
    out_single, _ = run(x[:1], 1)
    assert_bitwise_equal(out_single[0], out_a[0], "chain output of item 0 alone")


def test_chain_close_to_fp64_eager_model():
    model = small_model(90)
    seq, hidden = 40, 64
    ti, tags = packing(seq, 2, 91)
    idx = ti * 3 + tags
    t = torch.tensor([0.3, 0.8])
    x = normal((1, seq, hidden), 92)
    params32 = {n: p.detach().clone().float().requires_grad_(True) for n, p in model.named_parameters()}
    model32 = small_model(90).float()
    model32.load_state_dict({n: p.detach() for n, p in params32.items()})
    out = chain(model32, t, x, ti, tags, lambda h: h, 1)
    out.pow(2).sum().backward()

    p64 = {n: p.detach().double().requires_grad_(True) for n, p in model32.named_parameters()}
    freq = torch.exp(-torch.log(torch.tensor(10000.0, dtype=torch.float64)) * torch.arange(16) / 16)
    arg = t.double()[:, None] * freq
    temb = F.linear(F.silu(F.linear(torch.cat([torch.cos(arg), torch.sin(arg)], 1),
                                    p64["time_embedder.linear_1.weight"], p64["time_embedder.linear_1.bias"])),
                    p64["time_embedder.linear_2.weight"], p64["time_embedder.linear_2.bias"])
    h = x.double()
    for i in range(2):
        pre = f"transformer_blocks.{i}."
        table = F.linear(F.silu(temb), p64[pre + "adaln_proj.linear.weight"], p64[pre + "adaln_proj.linear.bias"])
        c = table.view(-1, 6 * hidden).chunk(6, -1)
        n1 = rms64(h, p64[pre + "norm1.weight"]) * (1 + c[1][idx]) + c[0][idx]
        h = h + c[2][idx] * n1
        n2 = rms64(h, p64[pre + "norm2.weight"]) * (1 + c[4][idx]) + c[3][idx]
        h = h + c[5][idx] * n2
    so = F.linear(F.silu(temb), p64["norm_out.linear.weight"], p64["norm_out.linear.bias"])
    out64 = rms64(h, p64["norm_out.norm.weight"]) * (1 + so[:, hidden:][ti]) + so[:, :hidden][ti]
    out64.pow(2).sum().backward()
    check_normwise(out, out64, torch.float32, "chain forward")
    for name, p in model32.named_parameters():
        if name.startswith("token_refiner"):
            assert p.grad is None  # not in the chain
            continue
        check_normwise(p.grad, p64[name].grad, torch.float32, f"chain grad {name}")


def test_no_grad_and_inference_mode_give_the_same_bits():
    ti, tags = packing(40, 2, 95)
    plan = detdit.plan(ti, tags, 2)
    x = normal((1, 40, 16), 96, torch.bfloat16)
    w = torch.ones(16, dtype=torch.bfloat16, requires_grad=True)
    table = normal((6, 16), 97, torch.bfloat16).requires_grad_(True)
    graph = detdit.rmsnorm(x, w, table, table, plan)
    assert graph.requires_grad and graph.grad_fn is not None
    with torch.no_grad():
        plain = detdit.rmsnorm(x, w, table, table, plan)
    with torch.inference_mode():  # no Autograd key: the CPU kernel directly
        inference = detdit.rmsnorm(x, w, table, table, plan)
    assert not plain.requires_grad and not inference.requires_grad
    assert_bitwise_equal(plain, graph, "no_grad")
    assert_bitwise_equal(inference, graph, "inference_mode")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_silu_grads_vs_fp64(dtype):
    x, w, b = normal((3, 64), 98, dtype), normal((96, 64), 99, dtype, scale=0.2), normal((96,), 100, dtype)
    g = normal((3, 96), 101, dtype)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    out = detdit.linear(*leaves, activation="silu")
    out.backward(g)
    r = fp64_leaves(x, w, b)
    out64 = F.silu(F.linear(*r))
    out64.backward(g.double())
    check_normwise(out, out64, dtype, "silu(linear) forward")
    for leaf, ref, name in zip(leaves, r, ["d_x", "d_weight", "d_bias"]):
        check_normwise(leaf.grad, ref.grad, dtype, name)


def test_strided_incoming_grads_give_the_contiguous_bits():
    """Autograd may hand a backward an expanded or transposed gradient; every op's Function
    makes it contiguous, so the gradients are the bits of the same values given contiguous."""
    batch, seq, timesteps, hidden = 2, 40, 2, 64
    ti, tags = packing(seq, timesteps, 90)
    plan = detdit.plan(ti, tags, timesteps, batch=batch)
    bf = torch.bfloat16
    x, y = normal((batch, seq, hidden), 91, bf), normal((batch, seq, hidden), 92, bf)
    w = (1 + normal((hidden,), 93, scale=0.05)).to(bf)
    table = normal((3 * timesteps, hidden), 94, bf, scale=0.3)
    lx, lw, lb = normal((3, 40), 95, bf), normal((24, 40), 96, bf, scale=0.1), normal((24,), 97, bf)
    cases = {
        "linear": (lambda a, b, c: detdit.linear(a, b, c, activation="silu"), (lx, lw, lb)),
        "rmsnorm": (lambda a, b, c: detdit.rmsnorm(a, b, c, c, plan), (x, w, table)),
        "gate_residual": (lambda a, b, c: detdit.gate_residual(a, b, c, plan), (x, y, table)),
    }
    for name, (op, args) in cases.items():
        leaves = [t.clone().requires_grad_(True) for t in args]
        out = op(*leaves)
        grad = normal(tuple(out.shape), 98, out.dtype)
        strided = grad.transpose(-1, -2).contiguous().transpose(-1, -2)
        assert not strided.is_contiguous() and torch.equal(strided, grad)
        contiguous_grads = torch.autograd.grad(out, leaves, grad, retain_graph=True)
        strided_grads = torch.autograd.grad(out, leaves, strided)
        for a, b, i in zip(contiguous_grads, strided_grads, range(len(leaves))):
            assert_bitwise_equal(b, a, f"{name} gradient {i} from a strided incoming gradient")
