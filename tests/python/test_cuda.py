"""GPU checks through the binding (skipped, with the reason, without a CUDA GPU):
- portable CUDA == portable CPU, bitwise, forward and backward of every op;
- numerics="torch" == eager PyTorch on the same GPU, bitwise, for the eager-replayable ops
  (timestep_sinusoid, rmsnorm plain and modulated, the SiLU + cast before a projection,
  gate_residual, adaln_row_gather);
- a forward + backward region captured in a CUDA graph replays to the eager bits;
- gate_residual_rmsnorm (its own CUDA forward kernel): h, out and every gradient equal to
  gate_residual then rmsnorm on the GPU (both profiles) and, portable, to the CPU.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import detdit
from conftest import assert_bitwise_equal, normal, packing, requires_cuda

pytestmark = requires_cuda
ops = torch.ops.detdit


def leaves_on(device, *tensors):
    return [t.detach().to(device).requires_grad_(t.is_floating_point()) for t in tensors]


def run_both(fn, inputs, grad_of_outputs):
    """fn(*leaves) -> output; returns [(output, grads)] for cpu and cuda."""
    results = []
    for device in ("cpu", "cuda"):
        leaves = leaves_on(device, *inputs)
        out = fn(device, *leaves)
        out.backward(grad_of_outputs.to(device))
        results.append((out.detach().cpu(), [None if x.grad is None else x.grad.cpu() for x in leaves]))
    return results


def compare(results, what):
    (out_cpu, grads_cpu), (out_cuda, grads_cuda) = results
    assert_bitwise_equal(out_cuda, out_cpu, f"{what} forward")
    for i, (gc, gg) in enumerate(zip(grads_cpu, grads_cuda)):
        if gc is not None:
            assert_bitwise_equal(gg, gc, f"{what} grad of input {i}")


def plans(device, ti, tags, timesteps, batch):
    return detdit.plan(ti.to(device), tags.to(device), timesteps, batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_portable_cuda_equals_cpu(dtype):
    batch, seq, timesteps, hidden, dim = 2, 300, 2, 1088, 40
    ti, tags = packing(seq, timesteps, 200)

    t = torch.tensor([0.1, 0.6])
    compare(run_both(lambda d, x: detdit.timestep_sinusoid(x, 256), [t], normal((2, 256), 201)), "sinusoid")

    mlp = [normal((2, 256), 202), normal((96, 256), 203, scale=0.1), normal((96,), 204, scale=0.02),
           normal((dim, 96), 205, scale=0.1), normal((dim,), 206, scale=0.02)]
    compare(run_both(lambda d, *p: detdit.timestep_mlp(*p), mlp, normal((2, dim), 207)), "timestep_mlp")

    lin = [normal((3, 1096), 208, dtype), normal((200, 1096), 209, dtype, scale=0.1), normal((200,), 210, dtype)]
    compare(run_both(lambda d, *p: detdit.linear(*p), lin, normal((3, 200), 211, dtype)), "linear")

    proj = [normal((timesteps, dim), 212, scale=2.0), normal((18 * 64, dim), 213, dtype, scale=0.15),
            normal((18 * 64,), 214, dtype, scale=0.02)]
    compare(run_both(lambda d, *p: detdit.adaln_projection(*p), proj, normal((timesteps, 18 * 64), 215, dtype)),
            "adaln_projection")
    compare(run_both(lambda d, *p: detdit.adaln_modulation(*p, plans(d, ti, tags, timesteps, batch)), proj,
                     normal((6, seq, 64), 216, dtype)), "adaln_modulation")
    rows = normal((3 * timesteps, 6 * 64), 217, dtype)
    compare(run_both(lambda d, r: detdit.adaln_row_gather(r, plans(d, ti, tags, timesteps, batch)), [rows],
                     normal((6, seq, 64), 218, dtype)), "adaln_row_gather")

    x = normal((batch, seq, hidden), 219, dtype, scale=2.0)
    w = (1 + normal((hidden,), 220, scale=0.05)).to(dtype)
    table = normal((3 * timesteps, hidden), 221, dtype, scale=0.3)
    g = normal((batch, seq, hidden), 222, dtype)
    compare(run_both(lambda d, *p: detdit.rmsnorm(*p), [x, w], g), "rmsnorm plain")
    compare(run_both(lambda d, *p: detdit.rmsnorm(*p, plan=plans(d, ti, tags, timesteps, batch)),
                     [x, w, table, table.flip(0)], g), "rmsnorm modulated")
    compare(run_both(lambda d, *p: detdit.gate_residual(*p, plans(d, ti, tags, timesteps, batch)),
                     [x, normal((batch, seq, hidden), 223, dtype), table], g), "gate_residual")
    fin = [x, w, normal((timesteps, dim), 224, scale=2.0), normal((2 * hidden, dim), 225, dtype, scale=0.15),
           normal((2 * hidden,), 226, dtype, scale=0.02)]
    compare(run_both(lambda d, *p: detdit.final_adaln_out(*p, detdit.plan_from_rows(ti.to(d), timesteps, batch)),
                     fin, g), "final_adaln_out")


def test_torch_profile_equals_eager():
    dev = "cuda"
    batch, seq, timesteps, hidden = 2, 300, 2, 1088
    ti, tags = packing(seq, timesteps, 230)
    ti, tags = ti.to(dev), tags.to(dev)
    idx = ti * 3 + tags
    plan = detdit.plan(ti, tags, timesteps, batch)

    # diffusers Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)
    t = torch.rand(7, generator=torch.Generator().manual_seed(231)).to(dev)
    half = 128
    exponent = -math.log(10000) * torch.arange(0, half, dtype=torch.float32, device=dev)
    emb = torch.exp(exponent / half)
    emb = t[:, None].float() * emb[None, :]
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)
    eager = torch.cat([emb[:, half:], emb[:, :half]], dim=-1)
    assert_bitwise_equal(detdit.timestep_sinusoid(t, 256, numerics="torch"), eager, "sinusoid vs diffusers")

    for dtype in (torch.bfloat16, torch.float32):
        x = normal((batch, seq, hidden), 232, dtype, scale=2.0).to(dev)
        w = (1 + normal((hidden,), 233, scale=0.05)).to(dtype).to(dev)
        shift = normal((3 * timesteps, hidden), 234, dtype, scale=0.3).to(dev)
        scale = normal((3 * timesteps, hidden), 235, dtype, scale=0.3).to(dev)
        n = F.rms_norm(x, (hidden,), w, 1e-5)
        assert_bitwise_equal(detdit.rmsnorm(x, w, numerics="torch"), n, f"rmsnorm vs F.rms_norm {dtype}")
        assert_bitwise_equal(detdit.rmsnorm(x, w, shift, scale, plan, numerics="torch"),
                             n * (1 + scale[idx]) + shift[idx], f"modulated rmsnorm vs eager {dtype}")
        y = normal((batch, seq, hidden), 236, dtype).to(dev)
        assert_bitwise_equal(detdit.gate_residual(x, y, scale, plan), x + scale[idx] * y, f"gate {dtype}")
        rows = normal((3 * timesteps, 6 * 64), 237, dtype).to(dev)
        gathered = torch.stack([rows[:, c * 64:(c + 1) * 64].index_select(0, idx) for c in range(6)])
        assert_bitwise_equal(detdit.adaln_row_gather(rows, plan), gathered, f"gather {dtype}")

    temb = normal((timesteps, 40), 238, scale=3.0).to(dev)
    weight = normal((18 * 64, 40), 239, torch.bfloat16).to(dev)
    _, act = ops.adaln_projection(temb, weight, torch.zeros(18 * 64, dtype=torch.bfloat16, device=dev), "torch")
    assert_bitwise_equal(act, F.silu(temb).to(torch.bfloat16), "SiLU + cast vs F.silu(temb).to(bf16)")


@pytest.mark.parametrize("channels,flip,shift,scale,t_max,dtype", [
    (256, True, 0, 1, 1000.0, torch.float32),      # SD3, Flux, HunyuanVideo, LTX: sigma * 1000
    (256, True, 0, 1000, 1.0, torch.bfloat16),     # Qwen-Image: bf16 t in [0, 1], scale 1000
    (1920, True, 0, 1, 1000.0, torch.float32),     # CogVideoX: C = H
    (255, False, 1, 1, 1000.0, torch.float16),     # odd C, [sin | cos], shift 1
])
def test_sinusoid_conventions_torch_profile_equals_eager_and_portable_equals_cpu(channels, flip, shift, scale, t_max,
                                                                                dtype):
    dev = "cuda"
    t = (torch.rand(64, generator=torch.Generator().manual_seed(240)) * t_max).to(dtype)
    t[:2] = torch.tensor([0.0, t_max])
    half = channels // 2
    tc = t.to(dev)
    exponent = -math.log(10000) * torch.arange(0, half, dtype=torch.float32, device=dev)
    emb = torch.exp(exponent / (half - shift))
    emb = scale * (tc[:, None].float() * emb[None, :])
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)
    if flip:
        emb = torch.cat([emb[:, half:], emb[:, :half]], dim=-1)
    eager = F.pad(emb, (0, channels % 2, 0, 0))
    got = detdit.timestep_sinusoid(tc, channels, 10000, flip, shift, scale, t_max, numerics="torch")
    assert_bitwise_equal(got, eager, "sinusoid vs diffusers")
    g = normal((64, channels), 241)
    compare(run_both(lambda d, x: detdit.timestep_sinusoid(x, channels, 10000, flip, shift, scale, t_max), [t], g),
            "sinusoid convention")


def test_cuda_graph_capture_of_forward_and_backward():
    dev = "cuda"
    batch, seq, timesteps, hidden = 2, 300, 2, 256
    ti, tags = packing(seq, timesteps, 240)
    plan = detdit.plan(ti.to(dev), tags.to(dev), timesteps, batch)  # built (and synchronised) before capture
    x = normal((batch, seq, hidden), 241, torch.bfloat16).to(dev).requires_grad_(True)
    w = torch.ones(hidden, dtype=torch.bfloat16, device=dev).requires_grad_(True)
    table = normal((3 * timesteps, hidden), 242, torch.bfloat16, scale=0.3).to(dev).requires_grad_(True)
    grad = normal((batch, seq, hidden), 244, torch.bfloat16).to(dev)

    def region():
        h = detdit.rmsnorm(x, w, table, table, plan)
        out = detdit.gate_residual(x, h, table, plan)
        # detached, so no returned tensor keeps this call's autograd graph (and with it the
        # leaves' AccumulateGrad nodes, bound to the stream they were made on) alive into
        # the capture: a graph node of the eager run on the legacy default stream would make
        # the captured backward sync with that stream, which a capture refuses (torch warns:
        # "AccumulateGrad node's stream does not match"); pure torch ops fail the same way
        return (out.detach(), *torch.autograd.grad(out, (x, w, table), grad))

    eager = [t.clone() for t in region()]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            region()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = region()
    for replay in range(2):
        for t in captured:
            t.fill_(float("nan"))  # outside the graph: only the replay can write the right bits back
        graph.replay()
        torch.cuda.synchronize()
        for name, got, want in zip(["out", "dx", "dw", "d_table"], captured, eager):
            assert_bitwise_equal(got, want, f"graph replay {replay}: {name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("modulated", [False, True])
def test_gate_residual_rmsnorm_equals_separate_ops_and_cpu(dtype, modulated):
    batch, seq, timesteps, hidden = 2, 300, 2, 1088
    ti, tags = packing(seq, timesteps, 250)
    rows = 3 * timesteps
    inputs = [normal((batch, seq, hidden), 251, dtype, scale=2.0), normal((batch, seq, hidden), 252, dtype),
              normal((rows, hidden), 253, dtype), (1 + normal((hidden,), 254, scale=0.05)).to(dtype),
              normal((rows, hidden), 255, dtype, scale=0.3), normal((rows, hidden), 256, dtype, scale=0.3)]
    if not modulated:
        inputs = inputs[:4]
    g_out, g_h = normal((batch, seq, hidden), 257, dtype), normal((batch, seq, hidden), 258, dtype)

    def run(device, fused, numerics):
        plan = plans(device, ti, tags, timesteps, batch)
        leaves = leaves_on(device, *inputs)
        tables = leaves[4:] if modulated else [None, None]
        if fused:
            h, out = detdit.gate_residual_rmsnorm(*leaves[:4], *tables, plan, numerics=numerics)
        else:
            h = detdit.gate_residual(*leaves[:3], plan)
            out = detdit.rmsnorm(h, leaves[3], *tables, plan, numerics=numerics)
        ((out * g_out.to(device)).sum() + (h * g_h.to(device)).sum()).backward()
        return [t.detach().cpu() for t in (h, out, *(leaf.grad for leaf in leaves))]

    names = ["h", "out", "d_residual", "d_y", "d_gate", "d_weight", "d_shift", "d_scale"]
    cpu = run("cpu", True, "portable")
    for numerics in ("portable", "torch"):
        fused, separate = run("cuda", True, numerics), run("cuda", False, numerics)
        for name, got, want in zip(names, fused, separate):
            assert_bitwise_equal(got, want, f"{numerics} CUDA fused vs separate ops: {name}")
    for name, got, want in zip(names, run("cuda", True, "portable"), cpu):
        assert_bitwise_equal(got, want, f"portable CUDA vs CPU: {name}")


def test_release_scratch_memory_between_backwards_keeps_the_bits():
    # The fused backward takes its partials from detdit's scratch pool; releasing the pool
    # between two identical backwards (each after a synchronisation) maps them anew and must
    # not change a byte. "cuda" without an index is the current device.
    batch, seq, timesteps, hidden = 2, 300, 2, 1088
    ti, tags = packing(seq, timesteps, 260)
    plan = plans("cuda", ti, tags, timesteps, batch)
    inputs = leaves_on("cuda", normal((batch, seq, hidden), 261), normal((batch, seq, hidden), 262),
                       normal((3 * timesteps, hidden), 263), 1 + normal((hidden,), 264, scale=0.05))

    def grads():
        h, out = detdit.gate_residual_rmsnorm(*inputs, plan=plan)
        return torch.autograd.grad((out * out).sum() + h.sum(), inputs)

    first = grads()
    torch.cuda.synchronize()
    detdit.release_scratch_memory("cuda")
    detdit.release_scratch_memory(torch.device("cuda", torch.cuda.current_device()))
    second = grads()
    for name, a, b in zip(["d_residual", "d_y", "d_gate", "d_weight"], second, first):
        assert_bitwise_equal(a, b, f"after release_scratch_memory: {name}")
