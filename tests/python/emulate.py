"""Independent exact emulations of docs/numerics.md in eager PyTorch (CPU).

These re-derive detdit's bits from the written contract with torch's own IEEE
float32/float64 arithmetic, sharing no code with the C++ library, so a test
that compares the binding to them checks both the binding's marshalling and
the library against the contract. Each function cites its section.

fma32 is exact: the float64 sum of the exact product and c is made
round-to-odd (TwoSum error, then the last bit forced odd when inexact), and
rounding a round-to-odd 53-bit value to 24 bits is the correctly rounded
result (53 >= 24 + 2), i.e. one rounding, as fmaf.
"""
import torch

INF = float("inf")
CHUNK = 256  # positions per chunk of the canonical reduction (6.5)
LINEAR_CHUNK = 64  # rows of N per linear d_x partial (6.2)


def fma32(a, b, c):
    """fmaf(a, b, c) elementwise on float32 tensors (broadcasting)."""
    a, b, c = a.double(), b.double(), c.double()
    p = a * b  # exact: 24 + 24 bits fit in 53
    s = p + c
    # TwoSum: the exact error of s = p + c.
    bv = s - p
    err = (p - (s - bv)) + (c - bv)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.full_like(s, INF), torch.full_like(s, -INF))
    s = torch.where((err != 0) & even, torch.nextafter(s, toward), s)
    return s.float()


def round_to(v, dtype):
    """R_T: round float32 to the storage dtype and back (identity for float32)."""
    return v.to(dtype).float()


def row_tree_sum(a, b):
    """Section 7: the RMSNorm row tree of rows a, b (M, H) float32 -> (M,) float32."""
    rows, hidden = a.shape
    vectors = hidden // 4
    lanes = torch.zeros(rows, 128, dtype=torch.float32)
    for start in range(0, vectors, 128):
        count = min(128, vectors - start)
        for e in range(4):
            idx = (torch.arange(start, start + count) * 4 + e)
            lanes[:, :count] = fma32(a[:, idx], b[:, idx], lanes[:, :count])
    warps = lanes.view(rows, 4, 32)
    for offset in (16, 8, 4, 2, 1):
        n = 32 - offset
        updated = warps[:, :, :n] + warps[:, :, offset:offset + n]
        warps = torch.cat([updated, warps[:, :, n:]], dim=2)
    w = warps[:, :, 0]
    return (w[:, 0] + w[:, 2]) + (w[:, 1] + w[:, 3])


def rsqrt_portable(v):
    """Section 4: float(1.0 / sqrt(double(v)))."""
    return (1.0 / torch.sqrt(v.double())).float()


def rmsnorm_forward(x, weight, shift=None, scale=None, rows=None, eps=1e-5):
    """Section 5.6, portable profile. x (M, H) in T; shift/scale (R, H); rows (M,) table row
    per position. Returns (out in T, rstd (M,) float32)."""
    dtype = x.dtype
    xf = x.float()
    hidden = xf.shape[1]
    ss = row_tree_sum(xf, xf)
    ms = ss / torch.tensor(float(hidden), dtype=torch.float32)
    rstd = rsqrt_portable(ms + torch.tensor(eps, dtype=torch.float32))
    n = round_to(weight.float() * (rstd[:, None] * xf), dtype)
    if shift is None:
        return n.to(dtype), rstd
    t1 = round_to(1 + scale.float()[rows], dtype)
    v = round_to(n * t1, dtype)
    return round_to(v + shift.float()[rows], dtype).to(dtype), rstd


def canonical_reduce(values_fn, rows, num_rows, width, use_fma):
    """Section 6.5: row r's result = ascending fold over chunks of the chunk's ascending chain
    over its positions p (rows[p] == r). values_fn(p) gives the term of position p: a float32
    (width,) tensor (add chain) or a pair (a, b) for fma(a, b, acc). Returns (num_rows, width)
    float32. Dense per-chunk partials (+0.0 for absent rows) give the sparse layout's bits."""
    total = torch.zeros(num_rows, width, dtype=torch.float32)
    positions = rows.numel()
    for begin in range(0, positions, CHUNK):
        partial = torch.zeros(num_rows, width, dtype=torch.float32)
        for p in range(begin, min(begin + CHUNK, positions)):
            r = int(rows[p])
            if use_fma:
                a, b = values_fn(p)
                partial[r] = fma32(a, b, partial[r])
            else:
                partial[r] = partial[r] + values_fn(p)
        total = total + partial
    return total


def rmsnorm_backward(grad, x, weight, rstd, shift=None, scale=None, rows=None, num_rows=None):
    """Section 6.7, portable. Returns (dx in T, d_weight fp32, d_shift fp32, d_scale fp32)."""
    dtype = x.dtype
    xf, g, w = x.float(), grad.float(), weight.float()
    positions, hidden = xf.shape
    if shift is not None:
        t1 = round_to(1 + scale.float()[rows], dtype)
        d_n = g * t1
    else:
        d_n = g
    wd = w * d_n
    dot = row_tree_sum(wd, xf)
    h = torch.tensor(float(hidden), dtype=torch.float32)
    coef = (((rstd * rstd) * rstd) * dot) / h
    dx = round_to((rstd[:, None] * w) * d_n - xf * coef[:, None], dtype).to(dtype)
    xhat = xf * rstd[:, None]
    single = torch.zeros(positions, dtype=torch.int64)
    d_weight = canonical_reduce(lambda p: (d_n[p], xhat[p]), single, 1, hidden, True)[0]
    if shift is None:
        return dx, d_weight, None, None
    n = round_to(w * (rstd[:, None] * xf), dtype)
    d_shift = canonical_reduce(lambda p: g[p], rows, num_rows, hidden, False)
    d_scale = canonical_reduce(lambda p: (g[p], n[p]), rows, num_rows, hidden, True)
    return dx, d_weight, d_shift, d_scale


def linear_forward(x, weight, bias=None):
    """Section 5.2 without activation: 32 lanes over 16-byte vectors, XOR butterfly, bias.
    x (T, K), weight (N, K) float32 or bfloat16 -> (T, N) float32 (before R_out)."""
    xf, wf = x.float(), weight.float()
    width = 4 if x.dtype == torch.float32 else 8
    vectors = xf.shape[1] // width
    lanes = torch.zeros(xf.shape[0], wf.shape[0], 32, dtype=torch.float32)
    for start in range(0, vectors, 32):
        count = min(32, vectors - start)
        for e in range(width):
            k = torch.arange(start, start + count) * width + e  # (count,) one element per lane
            xa = xf[:, k][:, None, :]  # (T, 1, count)
            wa = wf[:, k][None, :, :]  # (1, N, count)
            lanes[:, :, :count] = fma32(xa, wa, lanes[:, :, :count])
    for offset in (16, 8, 4, 2, 1):
        lanes = lanes + lanes[:, :, torch.arange(32) ^ offset]
    v = lanes[:, :, 0]
    if bias is not None:
        v = v + bias.float()[None, :]
    return v


def linear_backward(grad, x, weight):
    """Section 6.2: (d_x fp32 fold, d_weight fp32, d_bias fp32) from grad (T, N) fp32."""
    g, xf, wf = grad.float(), x.float(), weight.float()
    outputs = wf.shape[0]
    d_x = torch.zeros_like(xf)
    for begin in range(0, outputs, LINEAR_CHUNK):
        partial = torch.zeros_like(xf)
        for n in range(begin, min(begin + LINEAR_CHUNK, outputs)):
            partial = fma32(g[:, n:n + 1], wf[n][None, :], partial)
        d_x = d_x + partial
    d_weight = torch.zeros_like(wf)
    d_bias = torch.zeros(outputs, dtype=torch.float32)
    for t in range(xf.shape[0]):
        d_weight = fma32(g[t][:, None], xf[t][None, :], d_weight)
        d_bias = d_bias + g[t]
    return d_x, d_weight, d_bias
