#!/usr/bin/env python3
"""detdit against PyTorch eager and torch.compile on the cases of `detdit bench`.

The inputs are the bench cases' own bytes: the C++ op cases (cases/, Suite::kBench) written
out by the build's tests/detdit_export_cases (--suite bench --forward-only: inputs only, one
case at a time into a temporary directory, deleted before the next; tests/python/op_cases.py
reads them), or read from --cases DIR, a directory that program wrote.

Row-wise cases (cases/rowwise_cases.cc, Suite::kBench): bf16, H = 5376, B = 2, T = 3
timesteps x 3 modalities, S in {4097, 32768, 131072}, block and interleaved packing
(cases/index_case.cc); the gate, shift and scale are the chunks of the case's (3T, 6H) AdaLN
rows the C++ op reads, as contiguous leaves:

  gate_residual_rmsnorm  h = residual + gate[i] * y; out = rms_norm(h) * w * (1 + scale[i]) + shift[i]
                         (both h and out returned, gradients arriving at both: the H3 block region)
  rmsnorm                out = rms_norm(x) * w * (1 + scale[i]) + shift[i]
  gate_residual          out = residual + gate[i] * y

Projection cases (cases/projection_cases.cc and cases/timestep_cases.cc, Suite::kBench),
T in {1, 3, 4, 8, 16, 32}, bias present in every linear:

  adaln_projection  table = F.linear(F.silu(temb).to(bf16), W, b): temb (T, 2688) fp32,
                    W (96768, 2688) bf16, b (96768,) bf16, table (T, 96768) bf16
                    (docs/numerics.md 5.4: SiLU in FP32, one cast to the weight's dtype,
                    then the linear; 18 * 5376 = 96768 rows)
  timestep_mlp      temb = F.linear(F.silu(F.linear(f, W1, b1)), W2, b2), all fp32:
                    f (T, 256), W1 (5376, 256), W2 (2688, 5376) (numerics 5.3), with TF32
                    off for these cases (torch.backends.cuda.matmul.allow_tf32 and
                    torch.backends.cudnn.allow_tf32 False, restored after; recorded per case
                    in the JSON's "settings")

The incoming gradients are the cases' (d_out, d_h; grad_table, grad_temb); that of a bf16
output is bf16 (autograd hands a bf16 table a bf16 gradient; the bench's FP32 grad_table is not
reachable through autograd, numerics 8: it is rounded once to bf16 here).
--quick: S = 4097 only and T in {1, 4} (the bench's small set, the exporter's --small).
--small (for a CPU run of the projection cases; the JSON's options record it): T in {1, 4} and
the projections scaled down (the exporter's --hidden 512 --time-embed-dim 512
--time-embed-hidden 1024: adaln_projection D = 512, N = 18 * 512; timestep_mlp K = 256,
H = 1024, D = 512); the row-wise cases are not changed by it.
--dry-run: export and load every selected case's inputs on the CPU, build its leaves, plan and
incoming gradients, print each case's shapes, and run no candidate (what a machine without a
GPU can check of this script).

Candidates, all in one process on one device: detdit portable, detdit torch profile, PyTorch
eager (as diffusers writes it), and torch.compile of that same eager function. Each is timed
forward (autograd on, as in training) and forward + backward (torch.autograd.grad of every
output with its incoming gradient, w.r.t. every input, the weights and biases included),
median of --repeats after --warmup, next to a copy measured in the same process (read + write
counted). On CUDA the times are CUDA events and the copy is device to device (2 GiB); with
--device cpu they are time.perf_counter around the (synchronous) calls and the copy is a CPU
tensor copy (256 MiB).

Bytes floors, stated per case in the JSON ("floor"):
  row-wise: each B*S*H tensor read or written once (region forward: residual, y, h, out;
    forward + backward adds d_out, d_h, h, y, d_residual, d_y; the small tables, the weight
    and detdit's rstd are left out);
  adaln_projection: forward = the weight's bytes (N * K * 2 for bf16); forward + backward =
    three times them (W read forward; W read for d_temb and d_W written backward);
  timestep_mlp: forward = both weights' bytes ((H * K + D * H) * 4); forward + backward =
    three times them. Activations, biases and gradients of the T rows are left out.

Equality: every output and gradient of a candidate's forward + backward is compared
bitwise (integer views) with eager's and with detdit portable's, and with the same
candidate's second run on the same inputs. A difference is reported as the count of
differing elements, the first index, both values in hex and the ulp distance. For
adaln_projection the detdit candidates also compare their `act` (the raw op's second
output) with F.silu(temb).to(bf16).

Promises (exit status 1 when one fails): a detdit candidate is the same bytes run to run;
on the row-wise cases the torch profile's forward outputs equal eager's; on adaln_projection
the torch profile's act equals F.silu(temb).to(bf16). The projections' table/temb are not
promised equal to eager (detdit's lane order and butterfly, numerics 5.2, against cuBLAS).
Speed is reported, not judged.

Skipped candidates (the torch profile with --device cpu: it is CUDA only; torch.compile
where torch has none, torch < 2.0, or where it raised) appear in the JSON as skipped, with
the reason, never as passing: their case has "skipped": true and one check row with
"skipped": true and "pass": false, counted in "checks_skipped", not in checks_total.

    DETDIT_BUILD_DIR=build python3 scripts/torch_compare.py [--quick] [--small] [--device cpu] [--out compare.json]
        [--ops gate_residual_rmsnorm] [--cases DIR] [--dry-run]
    detdit report compare.json --out compare.svg      # the equality matrix and the times

--out is rewritten after every case (verdict "INCOMPLETE" until the last), so a run stopped
at a time limit keeps the cases it finished. The default --ops is every op above.

Needs torch (CUDA unless --device cpu; torch.compile needs triton on CUDA), the detdit
extension (docs/python.md) and the build's tests/detdit_export_cases ($DETDIT_BUILD_DIR, or
--build-dir; not with --cases). A case's exported inputs take disk space while it runs
(--export-dir; the region's: 0.4 GB at S = 4097, 11 GB at S = 131072). The rmsnorm ops' eager
form needs F.rms_norm (torch >= 2.4).
"""
import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

import detdit

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
import op_cases  # noqa: E402  (the C++ op cases' reader: tests/python/op_cases.py)

EPS = 1e-5
# The exporter's sizes of --small's projections (the row-wise ops keep H3's).
SMALL_PROJECTION_SIZES = ("--hidden", "512", "--time-embed-dim", "512", "--time-embed-hidden", "1024")
CANDIDATES = ("detdit portable", "detdit torch", "eager", "torch.compile")
DEVICE = "cuda"  # --device
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
TF32_FLAGS = ("torch.backends.cuda.matmul.allow_tf32", "torch.backends.cudnn.allow_tf32")


def synchronize():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def device_name():
    if DEVICE == "cuda":
        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        model = None
    return f"CPU {model or platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


# ---- the row-wise ops ------------------------------------------------------------------
# Each op: its inputs (name, and the case's tensor: a name, or the chunk of its (3T, 6H)
# "table" rows the C++ op reads), its outputs, its incoming gradients (name, the case's
# tensor), the number of B*S*H tensors the forward and the backward must move, and its two
# implementations.
def region_eager(residual, y, gate, weight, shift, scale, rows):
    h = residual + gate[rows] * y
    return h, F.rms_norm(h, (h.shape[-1],), weight, EPS) * (1 + scale[rows]) + shift[rows]


def region_detdit(residual, y, gate, weight, shift, scale, plan, numerics):
    return detdit.gate_residual_rmsnorm(residual, y, gate, weight, shift, scale, plan, EPS, numerics)


def rmsnorm_eager(x, weight, shift, scale, rows):
    return (F.rms_norm(x, (x.shape[-1],), weight, EPS) * (1 + scale[rows]) + shift[rows],)


def rmsnorm_detdit(x, weight, shift, scale, plan, numerics):
    return (detdit.rmsnorm(x, weight, shift, scale, plan, EPS, numerics),)


def gate_residual_eager(residual, y, gate, rows):
    return (residual + gate[rows] * y,)


def gate_residual_detdit(residual, y, gate, plan, numerics):
    del numerics  # one profile: a product and a sum, each rounded once (docs/numerics.md)
    return (detdit.gate_residual(residual, y, gate, plan),)


# ---- the modulation forms (per sample, per frame, per token: the DiT families) ----------
# The case's modulation parent ((B, 6, H), (B, F, 6, H), (B, S, 6, H)) is the leaf; shift,
# scale and the gate are its chunks 0, 1 and 2 (op_cases.form_views), as the models view them.
def _frames(x, m):
    """x (B, S, H) as (B, F, L, H) and the modulation view m as (B, F, 1, H): broadcasting by
    views, as the models do (no copy); F = 1 per sample, S per token."""
    batch, seq_len, hidden = x.shape
    m = m.reshape(batch, -1, 1, hidden)
    return x.view(batch, m.shape[1], seq_len // m.shape[1], hidden), m


def _modulate(n, shift, scale, upcast, like):
    nv, sc = _frames(n, scale)
    sh = _frames(n, shift)[1]
    out = nv * (1 + sc.float()) + sh.float() if upcast else nv * (1 + sc) + sh
    return (out.type_as(like) if upcast else out).reshape(n.shape)


def _gate(residual, y, gate, upcast):
    r, g = _frames(residual, gate)
    yv = _frames(y, gate)[0]
    h = (r.float() + yv.float() * g.float()).type_as(residual) if upcast else r + g * yv
    return h.reshape(residual.shape)


def region_forms_eager(residual, y, modulation, views, upcast, eps):
    shift, scale, gate = views(modulation)
    h = _gate(residual, y, gate, upcast)
    n = F.layer_norm(h.float() if upcast else h, (h.shape[-1],), eps=eps)
    return h, _modulate(n, shift, scale, upcast, h)


def region_forms_detdit(residual, y, modulation, views, upcast, eps, numerics):
    shift, scale, gate = views(modulation)
    out, h = detdit.gate_residual_layernorm(residual, y, gate, None, None, shift, scale, eps=eps, upcast=upcast,
                                            numerics=numerics)
    return h, out


def layernorm_forms_eager(x, modulation, views, upcast, eps):
    shift, scale = views(modulation)[:2]
    return (_modulate(F.layer_norm(x.float() if upcast else x, (x.shape[-1],), eps=eps), shift, scale, upcast, x),)


def layernorm_forms_detdit(x, modulation, views, upcast, eps, numerics):
    shift, scale = views(modulation)[:2]
    return (detdit.layernorm(x, None, None, shift, scale, eps=eps, upcast=upcast, numerics=numerics),)


# ---- the projection ops ----------------------------------------------------------------
def adaln_projection_eager(temb, weight, bias):
    return (F.linear(F.silu(temb).to(weight.dtype), weight, bias),)


def adaln_projection_detdit(temb, weight, bias, numerics):
    return (detdit.adaln_projection(temb, weight, bias, numerics),)


def timestep_mlp_eager(features, w1, b1, w2, b2):
    return (F.linear(F.silu(F.linear(features, w1, b1)), w2, b2),)


def timestep_mlp_detdit(features, w1, b1, w2, b2, numerics):
    return (detdit.timestep_mlp(features, w1, b1, w2, b2, numerics),)


OPS = {
    "gate_residual_rmsnorm": dict(
        kind="rowwise", needs_rms_norm=True,
        inputs=[("residual", "residual"), ("y", "y"), ("gate", 2), ("weight", "weight"), ("shift", 3), ("scale", 4)],
        outputs=["h", "out"], grads_in=[("d_h", "d_h"), ("d_out", "d_out")], floor_forward=4, floor_backward=6,
        floor="each B*S*H tensor once: forward residual, y, h, out; backward d_out, d_h, h, y, d_residual, d_y",
        eager=region_eager, detdit=region_detdit,
        eager_source="h = residual + gate[rows] * y; out = F.rms_norm(h, (H,), weight, eps) * (1 + scale[rows]) + shift[rows]"),
    "rmsnorm": dict(
        kind="rowwise", needs_rms_norm=True,
        inputs=[("x", "x"), ("weight", "weight"), ("shift", 0), ("scale", 1)],
        outputs=["out"], grads_in=[("d_out", "grad")], floor_forward=2, floor_backward=3,
        floor="each B*S*H tensor once: forward x, out; backward d_out, x, dx",
        eager=rmsnorm_eager, detdit=rmsnorm_detdit,
        eager_source="F.rms_norm(x, (H,), weight, eps) * (1 + scale[rows]) + shift[rows]"),
    "gate_residual": dict(
        kind="rowwise",
        inputs=[("residual", "residual"), ("y", "y"), ("gate", 2)],
        outputs=["out"], grads_in=[("d_out", "grad")], floor_forward=3, floor_backward=4,
        floor="each B*S*H tensor once: forward residual, y, out; backward d_out, y, d_residual, d_y",
        eager=gate_residual_eager, detdit=gate_residual_detdit,
        eager_source="residual + gate[rows] * y"),
    # The forms' ops: inputs (the case's tensors), outputs, incoming gradients (name, the case's
    # tensor); the floors count (B, S, H) tensors of the activations' dtype.
    "gate_residual_layernorm": dict(
        kind="forms", inputs=["residual", "y", "modulation"], chunks=3,
        outputs=["h", "out"], grads_in=[("d_h", "d_h"), ("d_out", "d_out")], floor_forward=4, floor_backward=6,
        floor="each B*S*H tensor once: forward residual, y, h, out; backward d_out, d_h, h, y, d_residual, d_y",
        eager=region_forms_eager, detdit=region_forms_detdit,
        eager_source="h = residual + gate * y; out = F.layer_norm(h, (H,), eps=1e-6) * (1 + scale) + shift, "
                     "broadcast per sample / frame / token; upcast: Wan's (res.float() + y * gate).type_as(res), "
                     "(F.layer_norm(h.float()) * (1 + scale) + shift).type_as(h)"),
    "layernorm": dict(
        kind="forms", inputs=["x", "modulation"], chunks=2,
        outputs=["out"], grads_in=[("d_out", "grad")], floor_forward=2, floor_backward=3,
        floor="each B*S*H tensor once: forward x, out; backward d_out, x, dx",
        eager=layernorm_forms_eager, detdit=layernorm_forms_detdit,
        eager_source="F.layer_norm(x, (H,), eps=1e-6) * (1 + scale) + shift, broadcast per sample / frame / token; "
                     "upcast: (F.layer_norm(x.float()) * (1 + scale) + shift).type_as(x)"),
    # Inputs: the case's tensors of these names; incoming gradients: (name, the case's tensor,
    # the dtype autograd hands the output); dims: the sizes of the case's shape, by input.
    "adaln_projection": dict(
        kind="projection",
        inputs=["temb", "weight", "bias"],
        outputs=["table"], grads_in=[("d_table", "grad_table", torch.bfloat16)], weights=["weight"],
        dims=dict(T=("temb", 0), D=("temb", 1), N=("weight", 0)), settings={},
        floor="forward: the weight's bytes (N * K * 2, bf16); forward + backward: three times them "
              "(W read forward; W read for d_temb and d_W written backward); temb, bias, act, table and "
              "the T-row gradients left out",
        eager=adaln_projection_eager, detdit=adaln_projection_detdit,
        eager_source="F.linear(F.silu(temb).to(torch.bfloat16), weight, bias)"),
    "timestep_mlp": dict(
        kind="projection",
        inputs=["features", "w1", "b1", "w2", "b2"],
        outputs=["temb"], grads_in=[("d_temb", "grad_temb", torch.float32)], weights=["w1", "w2"],
        dims=dict(T=("features", 0), K=("features", 1), H=("w1", 0), D=("w2", 0)),
        settings={flag: False for flag in TF32_FLAGS},
        floor="forward: both weights' bytes ((H * K + D * H) * 4, fp32); forward + backward: three times "
              "them (W1, W2 read forward; read for the input gradients and d_W1, d_W2 written backward); "
              "features, biases, pre, hidden, temb and the T-row gradients left out",
        eager=timestep_mlp_eager, detdit=timestep_mlp_detdit,
        eager_source="F.linear(F.silu(F.linear(features, w1, b1)), w2, b2) (fp32, TF32 off)"),
}


def _flag(name):
    """The module attribute a TF32_FLAGS name denotes: (object, attribute)."""
    path, attribute = name.rsplit(".", 1)
    obj = torch
    for part in path.split(".")[1:]:
        obj = getattr(obj, part)
    return obj, attribute


def backend_state():
    """The matmul precision settings as torch reports them now (recorded per case)."""
    state = {}
    getters = [(name, lambda name=name: bool(getattr(*_flag(name)))) for name in TF32_FLAGS]
    getters += [("torch.backends.cuda.matmul.fp32_precision", lambda: torch.backends.cuda.matmul.fp32_precision),
                ("torch.get_float32_matmul_precision()", torch.get_float32_matmul_precision)]
    for name, getter in getters:
        try:
            state[name] = getter()
        except (AttributeError, AssertionError):  # absent (torch 1.13's cuda.matmul asserts)
            pass
        except RuntimeError as error:  # torch >= 2.9 refuses some reads after a mix of the two APIs
            state[name] = f"unreadable: {str(error).splitlines()[0][:200]}"
    return state


@contextlib.contextmanager
def backend_settings(settings):
    """Sets the TF32 flags a case asks for, restoring the previous values after."""
    saved = {}
    try:
        for name, value in settings.items():
            obj, attribute = _flag(name)
            saved[name] = getattr(obj, attribute)
            setattr(obj, attribute, value)
        yield
    finally:
        for name, value in saved.items():
            obj, attribute = _flag(name)
            setattr(obj, attribute, value)


def median_us(fn, warmup, repeats):
    """Median time of fn in microseconds: CUDA events on CUDA, perf_counter on the CPU."""
    for _ in range(warmup):
        fn()
    synchronize()
    times = []
    for _ in range(repeats):
        if DEVICE == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) * 1e3)
        else:  # CPU ops return when they are done
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def copy_gbps(warmup, repeats):
    """Copy bandwidth, read + write counted: 2 GiB device to device, or 256 MiB on the CPU."""
    source = torch.empty(1 << 30 if DEVICE == "cuda" else 1 << 27, dtype=torch.int16, device=DEVICE)
    source.random_()
    target = torch.empty_like(source)
    us = median_us(lambda: target.copy_(source), warmup, repeats)
    return 2 * source.numel() * source.element_size() / (us * 1e-6) / 1e9


def ordered(bits, width):
    """Sign-magnitude float bits as integers ordered like the floats (for ulp distances)."""
    bits = bits.to(torch.int64)
    if width == 16:
        bits = bits & 0xFFFF
        return torch.where(bits >= 0x8000, 0x8000 - bits, bits)
    bits = bits & 0xFFFFFFFF
    return torch.where(bits >= 0x80000000, 0x80000000 - bits, bits)


def compare(expected, actual):
    """None when the bytes are equal, else what differs (count, first index, hex, ulp)."""
    if expected.dtype != actual.dtype or expected.shape != actual.shape:
        return {"reason": f"{actual.dtype} {tuple(actual.shape)} vs {expected.dtype} {tuple(expected.shape)}"}
    a, b = expected.reshape(-1).view(INT_VIEW[expected.dtype]), actual.reshape(-1).view(INT_VIEW[actual.dtype])
    differ = a != b
    count = int(differ.sum())
    if count == 0:
        return None
    first = int(differ.nonzero()[0, 0])
    width = 8 * expected.element_size()
    mask = (1 << width) - 1
    ulp = (ordered(a[first:first + 1], width) - ordered(b[first:first + 1], width)).abs()
    return {"count": count, "fraction": count / a.numel(), "first_index": first,
            "expected": f"0x{int(a[first]) & mask:0{width // 4}x}", "actual": f"0x{int(b[first]) & mask:0{width // 4}x}",
            "ulp": int(ulp[0])}


class Case:
    """One op at one shape: inputs (leaves), incoming gradients and the candidates' callables.

    Subclasses set op, spec, name, label, leaves, grads_in, tensor_names, floor_forward,
    floor_both, functions, settings, shape and torch_equals_eager."""

    def forward(self, candidate):
        return self.functions[candidate](*self.leaves)

    def forward_backward(self, candidate):
        outputs = self.forward(candidate)
        grads = torch.autograd.grad(outputs, self.leaves, self.grads_in)
        return [o.detach() for o in outputs] + list(grads)

    def extra_checks(self, candidate):
        """Check rows beyond the five every case has (none by default)."""
        del candidate
        return []


class RowwiseCase(Case):
    """A row-wise op at one (S, packing): an exported bench case (op_cases.Case)."""

    def __init__(self, op, case, compiled):
        self.op, self.spec = op, OPS[op]
        index = case.plans["plan"]
        batch, seq_len, timesteps, packing = index["batch"], index["seq_len"], index["num_timesteps"], index["packing"]
        table = case["table"]
        hidden = table.shape[1] // 6
        self.name = f"bf16 H{hidden} {packing}_S{seq_len}_T{timesteps}_B{batch}"
        self.label = f"{packing} S{seq_len}"
        self.shape = {"B": batch, "S": seq_len, "H": hidden, "T": timesteps, "packing": packing}
        self.settings, self.torch_equals_eager = {}, True
        ti, tg = (t.to(DEVICE) for t in case.index())
        self.rows = ti * 3 + tg  # (S,) the AdaLN row of each position
        self.plan = case.plan(device=DEVICE)

        def tensor(source):
            """A case tensor on the device: (B, S, H) per-position rows, a table chunk (3T, H)."""
            if isinstance(source, int):
                return op_cases.table_chunk(table, hidden, source).to(DEVICE).contiguous()
            t = case[source].to(DEVICE)
            return t.view(batch, seq_len, hidden) if t.dim() == 2 and t.shape[0] == batch * seq_len else t

        self.leaves = [tensor(source).requires_grad_(True) for _, source in self.spec["inputs"]]
        self.grads_in = [tensor(source) for _, source in self.spec["grads_in"]]
        self.tensor_names = self.spec["outputs"] + ["d_" + name for name, *_ in self.spec["inputs"]]
        self.elements = batch * seq_len * hidden
        self.floor_forward = self.spec["floor_forward"] * self.elements * 2
        self.floor_both = self.floor_forward + self.spec["floor_backward"] * self.elements * 2
        eager = self.spec["eager"]
        self.functions = {
            "detdit portable": lambda *x: self.spec["detdit"](*x, self.plan, "portable"),
            "detdit torch": lambda *x: self.spec["detdit"](*x, self.plan, "torch"),
            "eager": lambda *x: eager(*x, self.rows),
            "torch.compile": lambda *x: compiled[op](*x, self.rows),
        }


class FormsCase(Case):
    """layernorm or gate_residual_layernorm in a modulation form at a DiT family's shape: an
    exported bench case (cases/layernorm_cases.cc family_bench_forms)."""

    def __init__(self, op, case, compiled):
        self.op, self.spec = op, OPS[op]
        first = case[self.spec["inputs"][0]]
        batch, seq_len, hidden = first.shape
        upcast, eps = case.arguments["upcast"] == "true", case.eps()
        self.name = case.name
        self.label = f"{case.name} B{batch} S{seq_len} H{hidden}"
        self.shape = {"B": batch, "S": seq_len, "H": hidden, "upcast": upcast}
        # torch's profile: the forward and dx are eager's (docs/numerics.md 9); the sums over
        # positions are detdit's reduction in both profiles
        self.settings, self.torch_equals_eager = {}, True
        self.leaves = [case[name].to(DEVICE).requires_grad_(True) for name in self.spec["inputs"]]
        self.grads_in = [case[source].to(DEVICE) for _, source in self.spec["grads_in"]]
        self.tensor_names = self.spec["outputs"] + ["d_" + name for name in self.spec["inputs"]]
        # the chunks without their chunk dimension ((B, H), (B, F, H), (B, S, H)): the same form
        # as a kept dimension, and the forward-only export lists no gradient to tell them apart
        chunker, chunks = op_cases.form_chunker(case, None), tuple(range(self.spec["chunks"]))
        views = lambda modulation: chunker(modulation, chunks)  # noqa: E731
        self.elements = batch * seq_len * hidden
        self.floor_forward = self.spec["floor_forward"] * self.elements * first.element_size()
        self.floor_both = self.floor_forward + self.spec["floor_backward"] * self.elements * first.element_size()
        eager, detdit_fn = self.spec["eager"], self.spec["detdit"]
        self.functions = {
            "detdit portable": lambda *x: detdit_fn(*x, views, upcast, eps, "portable"),
            "detdit torch": lambda *x: detdit_fn(*x, views, upcast, eps, "torch"),
            "eager": lambda *x: eager(*x, views, upcast, eps),
            "torch.compile": lambda *x: compiled[op](*x, views, upcast, eps),
        }


class ProjectionCase(Case):
    """adaln_projection or timestep_mlp at T rows: an exported bench case (op_cases.Case) at
    the bench's shapes (or --small's)."""

    def __init__(self, op, case, small, compiled):
        self.op, self.spec = op, OPS[op]
        sizes = {d: case[name].shape[axis] for d, (name, axis) in self.spec["dims"].items()}
        self.shape, self.settings, self.torch_equals_eager = sizes, dict(self.spec["settings"]), False
        self.name = case.name
        self.label = f"T={sizes['T']}" + (" (small)" if small else "")
        self.leaves = [case[name].to(DEVICE).requires_grad_(True) for name in self.spec["inputs"]]
        self.grads_in = [case[source].to(DEVICE, dtype) for _, source, dtype in self.spec["grads_in"]]
        self.tensor_names = self.spec["outputs"] + ["d_" + name for name in self.spec["inputs"]]
        by_name = dict(zip(self.spec["inputs"], self.leaves))
        weight_bytes = sum(by_name[w].numel() * by_name[w].element_size() for w in self.spec["weights"])
        self.floor_forward, self.floor_both = weight_bytes, 3 * weight_bytes
        detdit_fn, eager = self.spec["detdit"], self.spec["eager"]
        self.functions = {
            "detdit portable": lambda *x: detdit_fn(*x, "portable"),
            "detdit torch": lambda *x: detdit_fn(*x, "torch"),
            "eager": eager,
            "torch.compile": lambda *x: compiled[op](*x),
        }

    def extra_checks(self, candidate):
        """adaln_projection: a detdit candidate's act against F.silu(temb).to(bf16)."""
        if self.op != "adaln_projection" or not candidate.startswith("detdit"):
            return []
        temb, weight, bias = (t.detach() for t in self.leaves)
        profile = candidate.split()[1]
        with torch.no_grad():
            act = torch.ops.detdit.adaln_projection(temb, weight, bias, profile)[1]
            expected = F.silu(temb).to(weight.dtype)
        return [check_row("act == F.silu(temb).to(bf16)", {"act": compare(expected, act)},
                          candidate == "detdit torch")]


def check_row(check, differences, promise):
    """A verify-report check row (docs/cli.md): one bitwise comparison of several tensors."""
    differing = {name: d for name, d in differences.items() if d is not None}
    detail = "; ".join(
        f"{name}: {d['count']} differ ({100 * d['fraction']:.1f} %), first [{d['first_index']}] "
        f"{d['expected']} vs {d['actual']} ({d['ulp']} ulp)" if "count" in d else f"{name}: {d['reason']}"
        for name, d in differing.items()) or "every byte equal"
    return {"check": check, "bitwise_run": 1, "bitwise_passed": int(not differing), "max_error_vs_fp64": None,
            "bound": None, "pass": not differing, "promise": promise, "detail": detail,
            "tensors": {name: d for name, d in differences.items()}}


def skipped_row(reason):
    """The one check row of a skipped candidate: not run, so neither a check nor a pass."""
    return {"check": "skipped: " + reason, "bitwise_run": 0, "bitwise_passed": 0, "max_error_vs_fp64": None,
            "bound": None, "pass": False, "skipped": True, "promise": False, "detail": reason}


def run_case(case, args, gbps, skipped, report, table):
    """Every candidate of one case: checked twice, then timed; rows into report and table.

    skipped: candidate -> reason, for the whole run; a torch.compile that raises here is
    added to it for this case."""
    spec, names = case.spec, case.tensor_names
    skipped = dict(skipped)
    results, references = {}, {}
    for candidate in CANDIDATES:
        if candidate in skipped:
            continue
        try:
            first = case.forward_backward(candidate)
        except Exception as error:  # noqa: BLE001 - only torch.compile's failure is a skip
            if candidate != "torch.compile":
                raise
            skipped[candidate] = f"torch.compile raised {type(error).__name__}: {str(error).splitlines()[0][:300]}"
            continue
        second = case.forward_backward(candidate)
        run_to_run = {name: compare(a, b) for name, a, b in zip(names, first, second)}
        del second
        if candidate in ("eager", "detdit portable"):
            references[candidate] = first
        results[candidate] = (first, run_to_run)
        synchronize()
    rows = []
    common = {"op": case.op, "device": device_name(), "shape": case.shape, "settings": backend_state(),
              "floor": spec["floor"], "eager_source": spec["eager_source"]}
    for candidate in CANDIDATES:
        if candidate in skipped:
            reason = skipped[candidate]
            rows.append((candidate, None, [skipped_row(reason)]))
            report["cases"].append(dict(common, case=f"{case.label}, {candidate}", candidate=candidate,
                                        skipped=True, skip_reason=reason, seconds=None, timing=None,
                                        checks=[skipped_row(reason)]))
            continue
        first, run_to_run = results[candidate]
        vs = {ref: {name: compare(r, a) for name, r, a in zip(names, references[ref], first)}
              for ref in ("eager", "detdit portable")}
        is_detdit = candidate.startswith("detdit")
        outputs = lambda d: {k: v for k, v in d.items() if k in spec["outputs"]}  # noqa: E731
        grads = lambda d: {k: v for k, v in d.items() if k not in spec["outputs"]}  # noqa: E731
        checks = [check_row("outputs == eager", outputs(vs["eager"]),
                            candidate == "detdit torch" and case.torch_equals_eager),
                  check_row("grads == eager", grads(vs["eager"]), False),
                  check_row("outputs == detdit", outputs(vs["detdit portable"]), False),
                  check_row("grads == detdit", grads(vs["detdit portable"]), False),
                  check_row("run to run", run_to_run, is_detdit)] + case.extra_checks(candidate)
        fwd = median_us(lambda: case.forward(candidate), args.warmup, args.repeats)
        both = median_us(lambda: case.forward_backward(candidate), args.warmup, args.repeats)
        timing = {}
        for phase, us, floor in (("fwd", fwd, case.floor_forward), ("fwd+bwd", both, case.floor_both)):
            timing[phase] = {"median_us": us, "bytes": floor, "gbps": floor / (us * 1e-6) / 1e9,
                             "percent_of_copy": 100 * floor / (us * 1e-6) / 1e9 / gbps}
        rows.append((candidate, timing, checks))
        report["cases"].append(dict(common, case=f"{case.label}, {candidate}", candidate=candidate,
                                    seconds=both * 1e-6, timing=timing, checks=checks))
    del results, references
    for phase in ("fwd", "fwd+bwd"):
        times = {candidate: timing[phase]["median_us"] for candidate, timing, _ in rows if timing is not None}
        for mine in ("detdit portable", "detdit torch"):
            for other in ("eager", "torch.compile"):
                if mine in times and other in times:
                    report["speedups"].append({"op": case.op, "case": case.name, "phase": phase, "detdit": mine,
                                               "vs": other, "detdit_us": times[mine], "other_us": times[other],
                                               "speedup": times[other] / times[mine]})
    for candidate, timing, checks in rows:
        if timing is None:
            table.append(f"| {case.op} | {case.name} | {candidate} | skipped: {skipped[candidate]} "
                         "| | | | | | | | |")
            continue
        cells = " | ".join(("equal" if c["pass"] else "DIFFER") for c in checks[:5])
        extra = "; ".join(f"{c['check']}: {'equal' if c['pass'] else 'DIFFER'}" for c in checks[5:])
        table.append(f"| {case.op} | {case.name} | {candidate} | {timing['fwd']['median_us']:.0f} | "
                     f"{timing['fwd']['percent_of_copy']:.0f} % | {timing['fwd+bwd']['median_us']:.0f} | "
                     f"{timing['fwd+bwd']['percent_of_copy']:.0f} % | {cells} | {extra} |")


def git_state():
    def git(*argv):
        try:
            return subprocess.run(["git", *argv], capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD") or "unknown", "dirty": bool(status)}


def export_args(op, args):
    """The exporter's arguments of op's bench cases for these options."""
    small = ("--small",) if args.quick or args.small else ()
    sizes = SMALL_PROJECTION_SIZES if args.small and OPS[op]["kind"] == "projection" else ()
    return ("--suite", "bench", "--forward-only", "--max-elements", "0", *small, *sizes)


def exported_cases(op, args):
    """op's bench cases (op_cases.Case, tensors mapped), one at a time: from --cases, or each
    exported alone into a temporary directory that is deleted once the next is asked for (a
    case's inputs take up to 11 GB on disk)."""
    if args.cases:
        yield from (c for c in op_cases.load(args.cases, copy=False) if c.op == op)
        return
    listing = tempfile.mkdtemp(prefix=f"torch_compare_{op}_", dir=args.export_dir)
    try:
        op_cases.export(listing, *export_args(op, args), "--op", op, "--list", build_dir=args.build_dir)
        with open(os.path.join(listing, "index.json")) as f:
            entries = json.load(f)["cases"]
        # The modulation forms' cases (an "upcast" argument: cases/forms_cases.cc) are compared
        # by the forms' ops; the row-wise ops' candidates take the H3 rule's indexed tables.
        forms = OPS[op]["kind"] == "forms"
        names = [entry["name"] for entry in entries if ("upcast" in entry["arguments"]) == forms]
        for entry in entries:
            if ("upcast" in entry["arguments"]) != forms:
                why = ("not a modulation form case" if forms
                       else "a modulation form case; the candidates take the indexed table")
                print(f"{op} {entry['name']}: not compared ({why})", file=sys.stderr)
    finally:
        shutil.rmtree(listing, ignore_errors=True)
    for name in names:
        directory = tempfile.mkdtemp(prefix=f"torch_compare_{op}_", dir=args.export_dir)
        try:
            op_cases.export(directory, *export_args(op, args), "--case", f"{op} {name}", build_dir=args.build_dir)
            (case,) = op_cases.load(directory, copy=False)
            yield case
        finally:
            shutil.rmtree(directory, ignore_errors=True)


def cases_of(op, args, compiled):
    """The cases of one op, made one at a time (each frees its tensors before the next)."""
    for case in exported_cases(op, args):
        if OPS[op]["kind"] == "rowwise":
            yield RowwiseCase(op, case, compiled)
        elif OPS[op]["kind"] == "forms":
            yield FormsCase(op, case, compiled)
        else:
            yield ProjectionCase(op, case, args.small, compiled)


def main():
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="S = 4097 only; T in {1, 4}")
    parser.add_argument("--small", action="store_true",
                        help="projection cases scaled down (T in {1, 4}, D = 512, N = 18 * 512; MLP H = 1024, "
                             "D = 512) for a CPU run; row-wise cases unchanged")
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated: " + ", ".join(OPS))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: perf_counter timing, a CPU copy, no torch profile")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compile-mode", default="default", help="torch.compile's mode")
    parser.add_argument("--out", help="write the JSON report here (rewritten after every case, verdict "
                                      "INCOMPLETE until the last)")
    parser.add_argument("--cases", help="a directory detdit_export_cases --suite bench wrote (default: export "
                                        "each op's cases into a temporary directory)")
    parser.add_argument("--build-dir", default=os.environ.get("DETDIT_BUILD_DIR"),
                        help="the build with tests/detdit_export_cases (default $DETDIT_BUILD_DIR)")
    parser.add_argument("--export-dir", help="where the temporary exports go (default: the system's temporary "
                                             "directory)")
    parser.add_argument("--dry-run", action="store_true",
                        help="export and load the selected cases' inputs on the CPU and print their shapes; "
                             "run no candidate")
    args = parser.parse_args()
    ops = args.ops.split(",")
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        parser.error(f"unknown op {unknown[0]!r}; expected one of {', '.join(OPS)}")
    if args.dry_run:  # runs no candidate: needs neither a GPU nor F.rms_norm
        DEVICE = "cpu"
        for op in ops:
            count = 0
            for case in cases_of(op, args, {}):
                shapes = ", ".join(f"{tuple(t.shape)} {str(t.dtype)[6:]}" for t in case.leaves + case.grads_in)
                print(f"{op} {case.name}: leaves and incoming gradients {shapes}")
                count += 1
                del case
            if count == 0:
                sys.exit(f"torch_compare: no {op} case")
        print("torch_compare: dry run, no candidate run")
        return
    if not hasattr(F, "rms_norm"):
        needing = [op for op in ops if OPS[op].get("needs_rms_norm")]
        if needing:
            parser.error(f"{', '.join(needing)}: the eager form needs F.rms_norm (torch >= 2.4; this is torch "
                         f"{torch.__version__})")
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("torch_compare: needs a CUDA GPU (torch.cuda.is_available() is False); --device cpu runs on the CPU")

    skipped = {}
    if DEVICE == "cpu":
        skipped["detdit torch"] = ("the torch profile is CUDA only (docs/numerics.md 4: a CPU tensor is a "
                                   "ValueError)")
    if not hasattr(torch, "compile"):
        skipped["torch.compile"] = f"torch {torch.__version__} has no torch.compile (torch < 2.0)"
    started = time.time()
    gbps = copy_gbps(args.warmup, args.repeats)
    compiled = {} if "torch.compile" in skipped else {
        op: torch.compile(OPS[op]["eager"], mode=args.compile_mode) for op in ops}
    report = {"kind": "detdit_torch_compare", "format_version": 1,
              "title": "detdit vs PyTorch eager and torch.compile",
              "time_label": "forward + backward, median of the timed calls (seconds)",
              "git": git_state(),
              "environment": {"device": device_name(), "torch": torch.__version__,
                              "cuda_runtime": torch.version.cuda or "none",
                              "compiler": (f"torch.compile mode={args.compile_mode}" if "torch.compile" not in skipped
                                           else "torch.compile skipped: " + skipped["torch.compile"]),
                              "timer": "CUDA events" if DEVICE == "cuda" else "time.perf_counter (synchronous CPU calls)",
                              "copy": "2 GiB device to device" if DEVICE == "cuda" else "256 MiB CPU tensor copy",
                              "settings_at_start": backend_state()},
              "options": {"repeats": args.repeats, "warmup": args.warmup, "quick": args.quick, "small": args.small,
                          "device": DEVICE, "ops": ops},
              "skipped_candidates": skipped,
              "copy_gbps": gbps, "cases": [], "speedups": []}
    table = ["| op | case | candidate | fwd us | fwd % copy | fwd+bwd us | fwd+bwd % copy | "
             "outputs == eager | grads == eager | outputs == detdit | grads == detdit | run to run | more |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | --- | --- | --- | --- | --- | --- |"]
    for op in ops:
        for case in cases_of(op, args, compiled):
            with backend_settings(case.settings):
                run_case(case, args, gbps, skipped, report, table)
            del case
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
            if args.out:  # what is done so far survives a run stopped at a time limit
                with open(args.out, "w") as f:
                    json.dump(dict(report, verdict="INCOMPLETE", seconds=time.time() - started), f, indent=1)
    rows = [c for case in report["cases"] for c in case["checks"]]
    checks = [c for c in rows if not c.get("skipped")]
    failed = [(f"{case['op']} / {case['case']}", c["check"]) for case in report["cases"] for c in case["checks"]
              if not c["pass"] and c["promise"]]
    report.update(verdict="FAIL" if failed else "PASS", checks_total=len(checks),
                  checks_passed=sum(c["pass"] for c in checks), checks_skipped=len(rows) - len(checks),
                  seconds=time.time() - started)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    print(f"torch {torch.__version__} on {device_name()}; copy (read + write) {gbps:.0f} GB/s; "
          f"commit {report['git']['commit'][:12]}{' (dirty)' if report['git']['dirty'] else ''}\n")
    print("\n".join(table))
    print("\n| op | case | phase | detdit | vs eager | vs torch.compile |\n| --- | --- | --- | --- | ---: | ---: |")
    pairs = {}
    for s in report["speedups"]:
        pairs.setdefault((s["op"], s["case"], s["phase"], s["detdit"]), {})[s["vs"]] = s["speedup"]
    for (op, name, phase, mine), vs in pairs.items():
        cells = " | ".join(f"{vs[other]:.2f}x" if other in vs else "skipped" for other in ("eager", "torch.compile"))
        print(f"| {op} | {name} | {phase} | {mine} | {cells} |")
    for name, check in failed:
        print(f"FAILED: {name}: {check}")
    skipped_note = f", {report['checks_skipped']} skipped (not run)" if report["checks_skipped"] else ""
    print(f"torch_compare: {report['verdict']}, {len(failed)} promise(s) broken, "
          f"{report['checks_passed']}/{len(checks)} comparisons equal{skipped_note}; {time.time() - started:.0f} s")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
