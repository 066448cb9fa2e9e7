"""detdit.gate_residual_rmsnorm (the fused gate + norm region) through the binding, on the
CPU: h, out and every gradient are bitwise equal, in value, dtype and presence, to autograd
through detdit.gate_residual then detdit.rmsnorm: with and without a gradient reaching h
from another consumer, with no gradient reaching out, with only some inputs requiring
grad; plain and modulated norm, fp32 and bf16, block and interleaved packings, (B, S, H)
and (M, H) rows. The raw ops, bad input (the separate ops' exception kinds and messages),
first order only, and the H3 block module that uses the op. The SP form is checked in
test_distributed.py, the CUDA kernels in test_cuda.py."""
import pytest
import torch

import detdit
from conftest import assert_bitwise_equal, normal, packed

ops = torch.ops.detdit
SEQ, TIMESTEPS, BATCH, HIDDEN = 300, 3, 2, 20


def region_inputs(dtype, modulated, seed=0):
    """residual, y, gate, weight, shift, scale (shift/scale None for a plain norm)."""
    rows = 3 * TIMESTEPS
    shift = normal((rows, HIDDEN), seed + 5, dtype, scale=0.3) if modulated else None
    scale = normal((rows, HIDDEN), seed + 6, dtype, scale=0.3) if modulated else None
    return [normal((BATCH, SEQ, HIDDEN), seed + 1, dtype, scale=2.0), normal((BATCH, SEQ, HIDDEN), seed + 2, dtype),
            normal((rows, HIDDEN), seed + 3, dtype), (1 + normal((HIDDEN,), seed + 4, scale=0.05)).to(dtype), shift,
            scale]


def separate(residual, y, gate, weight, shift, scale, plan, eps=detdit.H3_NORM_EPS, numerics="portable"):
    h = detdit.gate_residual(residual, y, gate, plan)
    return h, detdit.rmsnorm(h, weight, shift, scale, plan, eps, numerics)


def run(region, inputs, plan, loss_of, wants=None):
    """(h, out, grads of the six inputs) of region(...) under loss_of(h, out).backward();
    wants[i] False: input i does not require grad."""
    wants = wants or [True] * 6
    leaves = [None if t is None else t.clone().requires_grad_(want) for t, want in zip(inputs, wants)]
    h, out = region(*leaves, plan)
    loss_of(h, out).backward()
    return h, out, [None if t is None else t.grad for t in leaves]


def assert_same_results(fused, expected, what):
    names = ["h", "out", "d_residual", "d_y", "d_gate", "d_weight", "d_shift", "d_scale"]
    for name, got, want in zip(names, [fused[0], fused[1], *fused[2]], [expected[0], expected[1], *expected[2]]):
        if want is None:
            assert got is None, f"{what}: {name} is {got!r}, the separate ops give None"
        else:
            assert_bitwise_equal(got, want, f"{what}: {name}")  # value, dtype and shape


def losses(dtype, shape):
    g_out, g_h = normal(shape, 11, dtype), normal(shape, 12, dtype)
    return {
        "out only": lambda h, out: (out * g_out).sum(),
        "out and h": lambda h, out: (out * g_out).sum() + (h * g_h).sum(),
        "h only": lambda h, out: (h * g_h).sum(),  # no gradient reaches out: no norm gradients
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("modulated", [False, True])
@pytest.mark.parametrize("packing_kind", ["block", "interleaved"])
def test_fused_equals_gate_residual_then_rmsnorm(dtype, modulated, packing_kind):
    ti, tags = packed(packing_kind, SEQ, TIMESTEPS)
    plan = detdit.plan(ti, tags, TIMESTEPS, BATCH)
    inputs = region_inputs(dtype, modulated)
    for name, loss_of in losses(dtype, (BATCH, SEQ, HIDDEN)).items():
        what = f"{dtype} {'modulated' if modulated else 'plain'} {packing_kind}, loss of {name}"
        expected = run(separate, inputs, plan, loss_of)
        fused = run(detdit.gate_residual_rmsnorm, inputs, plan, loss_of)
        assert_same_results(fused, expected, what)
        if name != "h only":  # the case is not vacuous: the norm's gradients exist
            assert fused[2][3] is not None and fused[2][3].abs().sum() > 0, what


@pytest.mark.parametrize("wants", [[False, True, False, False, False, False], [True, False, True, False, True, False],
                                   [False, False, False, True, False, True]])
def test_fused_equals_separate_when_only_some_inputs_require_grad(wants):
    ti, tags = packed("interleaved", SEQ, TIMESTEPS)
    plan = detdit.plan(ti, tags, TIMESTEPS, BATCH)
    inputs = region_inputs(torch.bfloat16, True, seed=20)
    loss_of = losses(torch.bfloat16, (BATCH, SEQ, HIDDEN))["out and h"]
    expected = run(separate, inputs, plan, loss_of, wants)
    fused = run(detdit.gate_residual_rmsnorm, inputs, plan, loss_of, wants)
    assert_same_results(fused, expected, f"requires_grad {wants}")


def test_fused_equals_separate_on_flat_rows():
    ti, tags = packed("block", SEQ, TIMESTEPS)
    plan = detdit.plan(ti, tags, TIMESTEPS, BATCH)
    inputs = [t if t is None or t.dim() < 3 else t.reshape(BATCH * SEQ, HIDDEN)
              for t in region_inputs(torch.float32, True, seed=30)]
    loss_of = losses(torch.float32, (BATCH * SEQ, HIDDEN))["out and h"]
    assert_same_results(run(detdit.gate_residual_rmsnorm, inputs, plan, loss_of),
                        run(separate, inputs, plan, loss_of), "(M, H) rows")


def test_raw_ops():
    ti, tags = packed("interleaved", SEQ, TIMESTEPS)
    plan = detdit.plan(ti, tags, TIMESTEPS, BATCH)
    residual, y, gate, weight, shift, scale = region_inputs(torch.bfloat16, True, seed=40)
    h, out, rstd = ops.gate_residual_rmsnorm(residual, y, gate, weight, shift, scale, plan, 1e-5, "portable")
    _, norm_rstd = ops.rmsnorm(h, weight, shift, scale, plan, 1e-5, "portable")
    assert_bitwise_equal(rstd, norm_rstd, "rstd")
    d_out, d_h = normal(h.shape, 41, torch.bfloat16), normal(h.shape, 42, torch.bfloat16)
    args = (y, gate, weight, shift, scale, plan, h, rstd, 1e-5, "portable")
    dn, d_weight, d_shift, d_scale = ops.rmsnorm_backward(d_out, h, weight, shift, scale, plan, rstd, 1e-5, "portable",
                                                          [True] * 4)
    g = dn + d_h  # autograd's sum of h's two gradients (one rounding in bf16)
    d_residual, d_y, d_gate = ops.gate_residual_backward(g, y, gate, plan, [True] * 3)
    grads = ops.gate_residual_rmsnorm_backward(d_out, d_h, *args, [True] * 6)
    for name, got, want in zip(["d_residual", "d_y", "d_gate", "d_weight", "d_shift", "d_scale"], grads,
                               [d_residual, d_y, d_gate, d_weight, d_shift, d_scale]):
        assert_bitwise_equal(got, want, f"raw backward {name}")
    masked = ops.gate_residual_rmsnorm_backward(d_out, d_h, *args, [False, True, False, True, False, False])
    assert [t is None for t in masked] == [True, False, True, False, True, True]
    assert_bitwise_equal(masked[1], d_y, "masked d_y")
    assert_bitwise_equal(masked[3], d_weight, "masked d_weight")
    # no gradient reached out: the gate's backward of d_h alone, no norm gradients
    only_h = ops.gate_residual_rmsnorm_backward(None, d_h, *args, [True] * 6)
    for name, got, want in zip(["d_residual", "d_y", "d_gate"], only_h,
                               ops.gate_residual_backward(d_h, y, gate, plan, [True] * 3)):
        assert_bitwise_equal(got, want, f"d_out absent: {name}")
    assert only_h[3:] == (None, None, None)
    assert ops.gate_residual_rmsnorm_backward(None, None, *args, [True] * 6) == (None,) * 6


@pytest.fixture
def bad_case():
    ti, tags = packed("interleaved", 40, 2)
    bf = torch.bfloat16
    return {"plan": detdit.plan(ti, tags, 2, 1), "x": normal((1, 40, 16), 101, bf), "y": normal((1, 40, 16), 102, bf),
            "table": normal((6, 16), 103, bf), "w": torch.ones(16, dtype=bf)}


BAD_INPUTS = {  # name -> changes to the good arguments (residual, y, gate, weight, shift, scale, plan, eps, numerics)
    "residual float64": lambda c: {"residual": c["x"].double()},
    "residual not contiguous": lambda c: {"residual": normal((1, 16, 40), 1, torch.bfloat16).transpose(1, 2)},
    "y dtype": lambda c: {"y": c["y"].float()},
    "y shape": lambda c: {"y": c["y"][:, :20]},
    "gate rows": lambda c: {"gate": c["table"][:5]},
    "weight dtype": lambda c: {"weight": c["w"].float()},
    "weight float64": lambda c: {"weight": c["w"].double()},
    "weight size": lambda c: {"weight": c["w"][:12]},
    "shift without scale": lambda c: {"scale": None},
    "shift rows": lambda c: {"shift": c["table"][:5]},
    "positions": lambda c: {"residual": torch.cat([c["x"], c["x"]]), "y": torch.cat([c["y"], c["y"]])},
    "H = 18": lambda c: {"residual": normal((1, 40, 18), 2, torch.bfloat16), "y": normal((1, 40, 18), 3, torch.bfloat16),
                         "gate": normal((6, 18), 4, torch.bfloat16), "weight": torch.ones(18, dtype=torch.bfloat16),
                         "shift": normal((6, 18), 5, torch.bfloat16), "scale": normal((6, 18), 6, torch.bfloat16)},
    "eps": lambda c: {"eps": -1.0},
    "numerics fast": lambda c: {"numerics": "fast"},
    "numerics torch on the CPU": lambda c: {"numerics": "torch"},
    "numerics None": lambda c: {"numerics": None},
}


def call_both(case, changes):
    args = {"residual": case["x"], "y": case["y"], "gate": case["table"], "weight": case["w"], "shift": case["table"],
            "scale": case["table"].flip(0), "plan": case["plan"], "eps": 1e-5, "numerics": "portable"}
    args.update(changes)
    outcomes = []
    for fn in (separate, detdit.gate_residual_rmsnorm):
        try:
            fn(**args)
            outcomes.append(None)
        except Exception as e:  # noqa: BLE001 (the kind is what is compared)
            outcomes.append((type(e), str(e)))
    return outcomes


def as_the_fused_op_names_it(outcome):
    """The separate ops' outcome as the fused op reports it: the norm's input, rmsnorm's x, is
    the fused op's h."""
    if outcome is None:
        return None
    kind, message = outcome
    return kind, message.replace("x's dtype", "h's dtype").replace("got x (", "got h (")


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_raises_what_the_separate_ops_raise(bad_case, name):
    expected, fused = call_both(bad_case, BAD_INPUTS[name](bad_case))
    assert expected is not None, f"{name}: the separate ops accept it (not a bad input)"
    # rmsnorm's x is the fused op's h: where the separate ops' error names x, the fused op's names h
    assert fused == as_the_fused_op_names_it(expected)


# fp32 modulation is a form of the fused op as of the separate ops (the promoted recipe,
# docs/numerics.md 5.12): the same outcome. An fp32 gate makes h fp32, so a bf16 weight is
# refused by both, naming the weight; with an fp32 weight, shift and scale (the norm's
# parameters in h's dtype), and fp32 shift and scale alone, both take the call (their bits:
# test_gate_residual_rmsnorm_forms.py).
@pytest.mark.parametrize("name", ["gate", "gate and weight", "shift and scale"])
def test_fp32_modulation_is_a_form_of_the_fused_op(bad_case, name):
    changes = {"gate": {"gate": bad_case["table"].float()},
               "gate and weight": {"gate": bad_case["table"].float(), "weight": bad_case["w"].float(),
                                   "shift": bad_case["table"].float(), "scale": bad_case["table"].flip(0).float()},
               "shift and scale": {"shift": bad_case["table"].float(), "scale": bad_case["table"].flip(0).float()}}[name]
    expected, fused = call_both(bad_case, changes)
    assert fused == as_the_fused_op_names_it(expected)
    if name == "gate":
        assert fused is not None and fused[0] is TypeError and fused[1].startswith("weight must have h's dtype"), fused
    else:
        assert fused is None, fused


def test_bad_plan_is_what_the_separate_ops_raise(bad_case):
    (kind, message), fused = call_both(bad_case, {"plan": None})
    # without a plan the gate takes the grouped forms: an (R, H) table is refused, saying why
    assert kind is ValueError and message.startswith("plan is required for an (R, H) table"), message
    assert fused == (kind, message)
    (kind, _), (fused_kind, fused_message) = call_both(bad_case, {"plan": bad_case["x"]})
    assert (kind, fused_kind) == (TypeError, TypeError)
    assert fused_message.startswith("gate_residual_rmsnorm: plan must be a detdit IndexPlan")


def test_bad_backward_gradients_name_the_fused_op_tensors(bad_case):
    c = bad_case
    h, out, rstd = ops.gate_residual_rmsnorm(c["x"], c["y"], c["table"], c["w"], None, None, c["plan"], 1e-5,
                                             "portable")
    args = (c["y"], c["table"], c["w"], None, None, c["plan"], h, rstd, 1e-5, "portable", [True] * 6)
    with pytest.raises(ValueError, match="d_h must have h's shape"):
        ops.gate_residual_rmsnorm_backward(out, out[:, :20], *args)
    with pytest.raises(TypeError, match="d_out"):
        ops.gate_residual_rmsnorm_backward(out.float(), None, *args)
    with pytest.raises(TypeError, match="d_out must be float32, bfloat16, float16"):
        ops.gate_residual_rmsnorm_backward(out.double(), None, *args)


def test_double_backward_is_refused(bad_case):
    c = bad_case
    residual = c["x"].float().requires_grad_(True)
    h, out = detdit.gate_residual_rmsnorm(residual, c["y"].float(), c["table"].float(), c["w"].float(),
                                          plan=c["plan"])
    with pytest.raises(RuntimeError, match="first-order"):
        torch.autograd.grad((out + h).sum(), residual, create_graph=True)


def test_failed_call_leaves_inputs_unchanged(bad_case):
    c = bad_case
    inputs = [c["x"], c["y"], c["table"], c["w"]]
    before = [t.clone() for t in inputs]
    with pytest.raises(TypeError):
        detdit.gate_residual_rmsnorm(*inputs, c["table"], c["table"].float(), c["plan"])
    for t, b in zip(inputs, before):
        assert torch.equal(t, b)


def test_h3_block_conditioning_equals_the_separate_ops():
    hidden, dim = 24, 16
    block = detdit.nn.H3BlockConditioning(hidden_size=hidden, time_embed_dim=dim)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(normal(tuple(p.shape), 50 + p.numel(), p.dtype, scale=0.1))
        block.norm2.weight.add_(1)
    ti, tags = packed("block", SEQ, TIMESTEPS)
    plan = detdit.plan(ti, tags, TIMESTEPS, BATCH)
    temb = normal((TIMESTEPS, dim), 60, scale=2.0)
    x0 = normal((BATCH, SEQ, hidden), 61, torch.bfloat16)
    attn_w, ffn_w = normal((hidden,), 62, torch.bfloat16), normal((hidden,), 63, torch.bfloat16)
    grad = normal((BATCH, SEQ, hidden), 64, torch.bfloat16)

    def attn(n):
        return n * attn_w

    def ffn(n):
        return n * ffn_w

    def diffusers_order(x):  # the block as the two separate ops on both sides of each sublayer
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.adaln_proj.chunks(temb)
        x = detdit.gate_residual(x, attn(block.norm1(x, shift_msa, scale_msa, plan)), gate_msa, plan)
        return detdit.gate_residual(x, ffn(block.norm2(x, shift_mlp, scale_mlp, plan)), gate_mlp, plan)

    results = []
    for forward in (diffusers_order, lambda x: block(x, temb, plan, attn, ffn)):
        block.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        out = forward(x)
        out.backward(grad)
        results.append([out, x.grad] + [p.grad for p in block.parameters()])
    names = ["out", "dx"] + [name for name, _ in block.named_parameters()]
    for name, fused, expected in zip(names, results[1], results[0]):
        assert_bitwise_equal(fused, expected, f"H3BlockConditioning {name}")
