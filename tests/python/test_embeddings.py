"""The families' timestep embeddings in the activation dtype against diffusers' arithmetic, on the CPU.

diffusers' TimestepEmbedding, PixArtAlphaTextProjection(act_fn="silu") and
CombinedTimestep[Guidance]TextProjEmbeddings, loaded in bf16, run linear_1 -> SiLU -> linear_2 and the
adds as eager bf16 ops; here they are written in plain torch ops. torch's bf16 linear is not detdit's
reduction (docs/numerics.md 5.2), so the end-to-end outputs and the gradients are compared within a
stated bound; what involves no reduction is compared bitwise: the linears' FP32 results (emulate.py's
section 5.2) rounded once, the SiLU of the stored pre (eager's F.silu on a bf16 tensor: FP32, one
rounding), and the adds of the stored embeddings (eager's bf16 +).
"""
import torch
import torch.nn.functional as F

import detdit
import emulate
from conftest import assert_bitwise_equal, normal

BF = torch.bfloat16
ops = torch.ops.detdit


def mlp_weights(k, h, d, seed):
    return [normal((h, k), seed, BF, 0.05), normal((h,), seed + 1, BF), normal((d, h), seed + 2, BF, 0.02),
            normal((d,), seed + 3, BF)]


def silu(h):
    """Eager's F.silu on a bf16 tensor as PyTorch computes it on CUDA and in its current CPU kernels: FP32 on
    the stored value, one rounding. (Debian's torch 1.13 CPU kernel rounds exp(-x) and 1 + exp(-x) to bf16 on
    the way, 30 % of the results one ulp off: not the arithmetic the models run on a GPU.)"""
    return F.silu(h.float()).to(h.dtype)


def eager_mlp(x, w1, b1, w2, b2):
    """TimestepEmbedding / PixArtAlphaTextProjection(act_fn="silu"): linear_1, SiLU, linear_2 in x's dtype."""
    return F.linear(silu(F.linear(x, w1, b1)), w2, b2)


def relative(actual, reference):
    a, r = actual.detach().double(), reference.detach().double()
    return ((a - r).abs().max() / r.abs().max()).item()


# Two bf16 roundings apart, relative to the largest value: a pre that the two reductions round to
# neighbouring bf16 values moves hidden and temb by about one ulp (2^-8 relative) each.
BOUND_FORWARD = 2.0 ** -6
# Eager rounds d_hidden and d_pre to bf16 on the way (detdit keeps them FP32, numerics 6.3): a few ulps
# (measured: up to 1.6 % of the largest gradient in these cases).
BOUND_GRADIENTS = 2.0 ** -5


def check_mlp_op(op, x, w):
    out, pre, hidden = op(x, *w, "portable")
    assert out.dtype == pre.dtype == hidden.dtype == BF
    assert_bitwise_equal(pre, emulate.linear_forward(x, w[0], w[1]).to(BF), "pre = R(linear_1)")
    assert_bitwise_equal(hidden, silu(pre), "hidden = the SiLU of the bf16 pre, rounded once")
    assert_bitwise_equal(out, emulate.linear_forward(hidden, w[2], w[3]).to(BF), "out = R(linear_2)")
    assert relative(out, eager_mlp(x, *w)) <= BOUND_FORWARD


def leaves(tensors):
    return [t.clone().requires_grad_(True) for t in tensors]


def check_gradients(ours, theirs, names):
    for a, b, name in zip(ours, theirs, names):
        assert a.grad.dtype == BF, name
        err = relative(a.grad, b.grad)
        assert err <= BOUND_GRADIENTS, f"{name}: {err:.3e}"


def test_timestep_mlp_bf16_against_eager():
    f, w = normal((3, 256), 10, BF), mlp_weights(256, 64, 48, 11)
    check_mlp_op(ops.timestep_mlp, f, w)
    ours, theirs = leaves([f] + w), leaves([f] + w)
    g = normal((3, 48), 15, BF)
    detdit.timestep_mlp(*ours).backward(g)
    eager_mlp(*theirs).backward(g)
    check_gradients(ours, theirs, ["d_features", "d_w1", "d_b1", "d_w2", "d_b2"])


def test_timestep_mlp_fp32_keeps_its_dtype():
    f, w = normal((2, 16), 20), [t.float() for t in mlp_weights(16, 8, 8, 21)]
    temb, pre, hidden = ops.timestep_mlp(f, *w, "portable")
    assert temb.dtype == pre.dtype == hidden.dtype == torch.float32


def test_text_projection_against_eager():
    """PixArtAlphaTextProjection(act_fn="silu") at SD3's pooled-text layout scaled down: timestep_mlp on the
    pooled text (every stage bitwise); detdit.text_projection, its one-line wrapper, the same bytes and, under
    autograd, eager's gradients."""
    p, w = normal((2, 64), 30, BF), mlp_weights(64, 40, 40, 31)
    check_mlp_op(ops.timestep_mlp, p, w)
    assert_bitwise_equal(detdit.text_projection(p, *w), ops.timestep_mlp(p, *w, "portable")[0], "text_projection")
    ours, theirs = leaves([p] + w), leaves([p] + w)
    g = normal((2, 40), 35, BF)
    detdit.text_projection(*ours).backward(g)
    eager_mlp(*theirs).backward(g)
    check_gradients(ours, theirs, ["d_pooled", "d_w1", "d_b1", "d_w2", "d_b2"])


def test_timestep_mlp_refuses_fp16():
    w = [t.half() for t in mlp_weights(16, 8, 8, 40)]
    try:
        detdit.timestep_mlp(normal((1, 16), 41, torch.float16), *w)
    except TypeError as e:
        assert "float32 or bfloat16" in str(e)
    else:
        raise AssertionError("fp16 accepted")


def eager_combined(t_feat, g_feat, pooled, tw, gw, xw):
    """CombinedTimestepGuidanceTextProjEmbeddings' forward (without guidance: CombinedTimestepTextProjEmbeddings)."""
    temb = eager_mlp(t_feat, *tw)
    if g_feat is not None:
        temb = temb + eager_mlp(g_feat, *gw)
    return temb + eager_mlp(pooled, *xw)


def run_combined(guided):
    """Flux's layout (guided, pooled 768 scaled down to 48) or SD3's (pooled 2048 -> 64), K = 32, H = 40."""
    b, k, p, h = 2, 32, (48 if guided else 64), 40
    tw, gw, xw = mlp_weights(k, h, h, 50), mlp_weights(k, h, h, 60), mlp_weights(p, h, h, 70)
    # the sinusoid of sigma * 1000 cast to the model dtype, as the models do (here any bf16 features)
    t_feat, g_feat, pooled = normal((b, k), 51, BF), (normal((b, k), 61, BF) if guided else None), normal((b, p), 71, BF)
    temb = detdit.combined_timestep_embedding(t_feat, pooled, tw, xw, g_feat, gw if guided else None)
    # bitwise: the adds of the stored embeddings, diffusers' order
    parts = [detdit.timestep_mlp(t_feat, *tw)] + ([detdit.timestep_mlp(g_feat, *gw)] if guided else [])
    parts.append(detdit.text_projection(pooled, *xw))
    expected = parts[0] + parts[1] if guided else parts[0]
    assert_bitwise_equal(temb, expected + parts[-1], "temb = (t_emb + g_emb) + text_emb")
    assert relative(temb, eager_combined(t_feat, g_feat, pooled, tw, gw, xw)) <= BOUND_FORWARD
    inputs = [t_feat, pooled] + ([g_feat] if guided else []) + tw + xw + (gw if guided else [])
    ours, theirs = leaves(inputs), leaves(inputs)
    g = normal((b, h), 80, BF)

    def split(ls):
        n = 3 if guided else 2
        feats, rest = ls[:n], ls[n:]
        return feats[0], feats[1], (feats[2] if guided else None), rest[0:4], rest[4:8], (rest[8:12] if guided else None)

    t, p_, gf, a, x, gg = split(ours)
    detdit.combined_timestep_embedding(t, p_, a, x, gf, gg).backward(g)
    t, p_, gf, a, x, gg = split(theirs)
    eager_combined(t, gf, p_, a, gg, x).backward(g)
    check_gradients(ours, theirs, [f"input {i}" for i in range(len(inputs))])


def test_combined_timestep_embedding_flux_layout():
    run_combined(guided=True)


def test_combined_timestep_embedding_sd3_layout():
    run_combined(guided=False)
