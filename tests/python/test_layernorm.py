"""detdit.layernorm from Python (CPU; the CUDA bytes are the C++ CUDA tests').

PyTorch's CPU layer norm is not a bitwise oracle for detdit's portable profile (it reduces in
another order, with a vectorised Welford and 1/sqrt, docs/numerics.md 9): the comparisons with
torch.nn.functional.layer_norm here are within stated bounds, against float64 references.
Exact here: autograd gives the raw backward op's bytes, a row alone gives the bytes it has in a
batch, the fake kernels give the real kernels' output metadata, and the errors.
"""
import pytest
import torch
import torch.nn.functional as F

import detdit
from conftest import assert_bitwise_equal, normal
from detdit import _compile

ops = torch.ops.detdit
AFFINES = ("none", "weight", "weight+bias")


def make(dtype, hidden, rows, affine, seed):
    x = normal((rows, hidden), seed, dtype, scale=3.0)
    w = (1 + normal((hidden,), seed + 1, scale=0.5)).to(dtype) if affine != "none" else None
    b = normal((hidden,), seed + 2, dtype, scale=0.5) if affine == "weight+bias" else None
    return x, w, b


def f64(t):
    return None if t is None else t.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("affine", AFFINES)
def test_forward_and_gradients_within_bounds_of_float64_layer_norm(dtype, affine):
    # bounds: out within one rounding to dtype (bf16 2^-8 relative) plus FP32 statistics; the
    # gradients are FP32 sums of FP32 terms stored in dtype (dx) or float (d_weight, d_bias).
    hidden, rows = 3072, 300
    x, w, b = make(dtype, hidden, rows, affine, 10)
    grad = normal((rows, hidden), 13, dtype)
    leaves = [t.clone().requires_grad_(True) if t is not None else None for t in (x, w, b)]
    out = detdit.layernorm(*leaves, eps=1e-6)
    out.backward(grad)
    ref_leaves = [f64(t).requires_grad_(True) if t is not None else None for t in (x, w, b)]
    ref = F.layer_norm(ref_leaves[0], (hidden,), ref_leaves[1], ref_leaves[2], eps=1e-6)
    ref.backward(grad.double())
    rel = 2e-6 if dtype == torch.float32 else 2 ** -8
    scale = ref.abs().max().item()
    assert (out.double() - ref).abs().max().item() <= rel * scale + 1e-5
    dx_scale = ref_leaves[0].grad.abs().max().item()
    assert (leaves[0].grad.double() - ref_leaves[0].grad).abs().max().item() <= (rel + 1e-5) * dx_scale
    for got, want in ((leaves[1], ref_leaves[1]), (leaves[2], ref_leaves[2])):
        if got is not None:
            assert got.grad.dtype == dtype
            assert (got.grad.double() - want.grad).abs().max().item() <= (rel + 1e-4) * want.grad.abs().max().item()
    # and torch's own CPU layer norm in FP32, within two roundings' bound (not in bf16: some torch
    # versions' CPU bf16 layer norm errs by far more than one rounding, e.g. 1.13's by 3e-2 here)
    if dtype == torch.float32:
        eager = F.layer_norm(x, (hidden,), w, b, eps=1e-6)
        assert (out.detach().double() - eager.double()).abs().max().item() <= 2 * rel * scale + 1e-5


@pytest.mark.parametrize("affine", AFFINES)
def test_autograd_gives_the_raw_backward_ops_bytes(affine):
    x, w, b = make(torch.bfloat16, 68, 257, affine, 20)
    grad = normal((257, 68), 23, torch.bfloat16)
    leaves = [t.clone().requires_grad_(True) if t is not None else None for t in (x, w, b)]
    detdit.layernorm(*leaves, eps=1e-6).backward(grad)
    out, mean, rstd = ops.layernorm(x, w, b, 1e-6, "portable")
    dx, d_weight, d_bias = ops.layernorm_backward(grad, x, w, b, mean, rstd, 1e-6, "portable", [True] * 3)
    assert_bitwise_equal(leaves[0].grad, dx, "dx")
    for leaf, want, name in ((leaves[1], d_weight, "d_weight"), (leaves[2], d_bias, "d_bias")):
        if leaf is None:
            assert want is None, name
        else:
            assert_bitwise_equal(leaf.grad, want, name)
    assert mean.dtype == rstd.dtype == torch.float32 and mean.shape == rstd.shape == (257,)


def test_a_row_alone_gives_its_bytes_in_the_batch():
    x, w, b = make(torch.bfloat16, 2432, 40, "weight+bias", 30)
    batch = detdit.layernorm(x.view(4, 10, 2432), w, b, eps=1e-6)
    for row in (0, 17, 39):
        alone = detdit.layernorm(x[row:row + 1].clone(), w, b, eps=1e-6)
        assert_bitwise_equal(alone[0], batch.view(40, 2432)[row], f"row {row}")


@pytest.mark.parametrize("affine", AFFINES)
def test_fake_kernels_give_the_kernels_output_metadata(affine):
    x, w, b = make(torch.bfloat16, 16, 6, affine, 40)
    real = ops.layernorm(x, w, b, 1e-5, "portable")
    fake = _compile.FAKE_KERNELS["layernorm"](x, w, b, 1e-5, "portable")
    mean, rstd = real[1], real[2]
    for mask in ([True] * 3, [False, True, False], [True, False, True]):
        real_b = ops.layernorm_backward(x, x, w, b, mean, rstd, 1e-5, "portable", mask)
        fake_b = _compile.FAKE_KERNELS["layernorm_backward"](x, x, w, b, mean, rstd, 1e-5, "portable", mask)
        for r, f in zip(list(real) + list(real_b), list(fake) + list(fake_b)):
            assert (r is None) == (f is None)
            if r is not None:
                assert (r.shape, r.dtype, r.device, r.stride()) == (f.shape, f.dtype, f.device, f.stride())


def test_errors():
    x, w, b = make(torch.float32, 16, 4, "weight+bias", 50)
    with pytest.raises(ValueError, match="bias needs weight"):
        detdit.layernorm(x, None, b)
    with pytest.raises(ValueError, match="must be a multiple of 4"):
        detdit.layernorm(x[:, :14].contiguous())
    with pytest.raises(ValueError, match="numerics=torch exists on CUDA only"):
        detdit.layernorm(x, w, b, numerics="torch")
    with pytest.raises(TypeError, match="layernorm: weight must be a torch.Tensor or None"):
        detdit.layernorm(x, 1.0)
