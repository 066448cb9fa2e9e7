#!/usr/bin/env python3
"""detdit against PyTorch eager and torch.compile on the row-wise cases of `detdit bench`.

The cases are the benchmark suite's (cases/rowwise_cases.cc, Suite::kBench): bf16,
H = 5376, B = 2, T = 3 timesteps x 3 modalities, S in {4097, 32768, 131072}, block and
interleaved packing (cases/index_case.cc's definitions, replayed below):

  gate_residual_rmsnorm  h = residual + gate[i] * y; out = rms_norm(h) * w * (1 + scale[i]) + shift[i]
                         (both h and out returned, gradients arriving at both: the H3 block region)
  rmsnorm                out = rms_norm(x) * w * (1 + scale[i]) + shift[i]
  gate_residual          out = residual + gate[i] * y

The input values are this script's own (normal, fixed seeds), not the bench's bytes.
Candidates, all in one process on one GPU: detdit portable, detdit torch profile, PyTorch
eager (the region as diffusers writes it), and torch.compile of that same eager function.
Each is timed forward (autograd on, as in training) and forward + backward
(torch.autograd.grad of every output with its incoming gradient, w.r.t. every input), by
CUDA events, median of --repeats after --warmup, next to a device-to-device copy measured
in the same process (read + write counted). Bytes floors: each B*S*H tensor read or
written once (region forward: residual, y, h, out; forward + backward adds d_out, d_h,
h, y, d_residual, d_y; the small tables, the weight and detdit's rstd are left out), stated
per case in the JSON.

Equality: every output and gradient of a candidate's forward + backward is compared
bitwise (integer views) with eager's and with detdit portable's, and with the same
candidate's second run on the same inputs. A difference is reported as the count of
differing elements, the first index, both values in hex and the ulp distance.

Exit status 1 when a promise of detdit fails: a detdit candidate is not the same bytes run
to run, or the torch profile's forward outputs differ from eager's. Speed is reported,
not judged.

    python3 scripts/torch_compare.py [--quick] [--out compare.json] [--ops gate_residual_rmsnorm]
    detdit report compare.json --out compare.svg      # the equality matrix and the times

Needs torch with CUDA (torch.compile needs triton) and the detdit extension (docs/python.md).
"""
import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import detdit

HIDDEN, BATCH, TIMESTEPS, EPS = 5376, 2, 3, 1e-5
INTERLEAVED_TAGS = (0, 1, 0, 2, 0, 0, 1, 0, 2, 0)
SEQ_LENS, QUICK_SEQ_LENS = (4097, 32768, 131072), (4097,)
PACKINGS = ("block", "interleaved")
CANDIDATES = ("detdit portable", "detdit torch", "eager", "torch.compile")
DEVICE = "cuda"
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def index_case(packing, seq_len, num_timesteps=TIMESTEPS):
    """(timestep index, tag) of each of S positions: cases/index_case.cc's make_index_case."""
    if packing == "interleaved":
        return ([s % num_timesteps for s in range(seq_len)], [INTERLEAVED_TAGS[s % 10] for s in range(seq_len)])
    timesteps, tags = [0] * seq_len, [0] * seq_len
    for t in range(num_timesteps):
        begin, end = t * seq_len // num_timesteps, (t + 1) * seq_len // num_timesteps
        text, audio = (end - begin) * 5 // 100, (end - begin) * 15 // 100
        for s in range(begin, end):
            timesteps[s] = t
            tags[s] = 1 if s - begin < text else 2 if end - s <= audio else 0
    return timesteps, tags


# Each op: its inputs (name, shape in (P, H, R) terms, mean, std), its outputs, the number of
# B*S*H tensors the forward and the backward must move, and its two implementations.
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


OPS = {
    "gate_residual_rmsnorm": dict(
        inputs=[("residual", "BSH", 0.0, 1.0), ("y", "BSH", 0.0, 3.0), ("gate", "RH", 0.0, 0.5),
                ("weight", "H", 1.0, 0.5), ("shift", "RH", 0.0, 0.5), ("scale", "RH", 0.0, 0.5)],
        outputs=["h", "out"], grads_in=["d_h", "d_out"], floor_forward=4, floor_backward=6,
        eager=region_eager, detdit=region_detdit),
    "rmsnorm": dict(
        inputs=[("x", "BSH", 0.0, 3.0), ("weight", "H", 1.0, 0.5), ("shift", "RH", 0.0, 0.5),
                ("scale", "RH", 0.0, 0.5)],
        outputs=["out"], grads_in=["d_out"], floor_forward=2, floor_backward=3,
        eager=rmsnorm_eager, detdit=rmsnorm_detdit),
    "gate_residual": dict(
        inputs=[("residual", "BSH", 0.0, 1.0), ("y", "BSH", 0.0, 3.0), ("gate", "RH", 0.0, 0.5)],
        outputs=["out"], grads_in=["d_out"], floor_forward=3, floor_backward=4,
        eager=gate_residual_eager, detdit=gate_residual_detdit),
}


def median_us(fn, warmup, repeats):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3)
    return statistics.median(times)


def copy_gbps(warmup, repeats):
    source = torch.empty(1 << 30, dtype=torch.int16, device=DEVICE)  # 2 GiB
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
    """One op at one (S, packing): inputs, incoming gradients and the candidates' callables."""

    def __init__(self, op, seq_len, packing, compiled):
        self.op, self.seq_len, self.packing, self.spec = op, seq_len, packing, OPS[op]
        self.name = f"bf16 H{HIDDEN} {packing}_S{seq_len}_T{TIMESTEPS}_B{BATCH}"
        timesteps, tags = index_case(packing, seq_len)
        ti = torch.tensor(timesteps, dtype=torch.int64, device=DEVICE)
        tg = torch.tensor(tags, dtype=torch.int64, device=DEVICE)
        self.rows = ti * 3 + tg  # (S,) the AdaLN row of each position
        self.plan = detdit.plan(ti, tg, TIMESTEPS, BATCH)
        gen = torch.Generator(device=DEVICE).manual_seed(seq_len * 10 + PACKINGS.index(packing))
        dims = {"BSH": (BATCH, seq_len, HIDDEN), "RH": (3 * TIMESTEPS, HIDDEN), "H": (HIDDEN,)}

        def normal(shape, mean, std):
            return (torch.randn(shape, device=DEVICE, generator=gen) * std + mean).to(torch.bfloat16)

        self.leaves = [normal(dims[kind], mean, std).requires_grad_(True) for _, kind, mean, std in self.spec["inputs"]]
        self.grads_in = [normal(dims["BSH"], 0.0, 1.0) for _ in self.spec["grads_in"]]
        self.tensor_names = self.spec["outputs"] + ["d_" + name for name, *_ in self.spec["inputs"]]
        self.elements = BATCH * seq_len * HIDDEN
        self.floor_forward = self.spec["floor_forward"] * self.elements * 2
        self.floor_both = self.floor_forward + self.spec["floor_backward"] * self.elements * 2
        eager = self.spec["eager"]
        self.functions = {
            "detdit portable": lambda *x: self.spec["detdit"](*x, self.plan, "portable"),
            "detdit torch": lambda *x: self.spec["detdit"](*x, self.plan, "torch"),
            "eager": lambda *x: eager(*x, self.rows),
            "torch.compile": lambda *x: compiled[op](*x, self.rows),
        }

    def forward(self, candidate):
        return self.functions[candidate](*self.leaves)

    def forward_backward(self, candidate):
        outputs = self.forward(candidate)
        grads = torch.autograd.grad(outputs, self.leaves, self.grads_in)
        return [o.detach() for o in outputs] + list(grads)


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


def run_case(case, args, gbps, report, table):
    spec, names = case.spec, case.tensor_names
    n_out = len(spec["outputs"])
    results, references = {}, {}
    for candidate in CANDIDATES:
        first = case.forward_backward(candidate)
        second = case.forward_backward(candidate)
        run_to_run = {name: compare(a, b) for name, a, b in zip(names, first, second)}
        del second
        if candidate in ("eager", "detdit portable"):
            references[candidate] = first
        results[candidate] = (first, run_to_run)
        torch.cuda.synchronize()
    rows = []
    for candidate in CANDIDATES:
        first, run_to_run = results[candidate]
        vs = {ref: {name: compare(r, a) for name, r, a in zip(names, references[ref], first)}
              for ref in ("eager", "detdit portable")}
        is_detdit = candidate.startswith("detdit")
        outputs = lambda d: {k: v for k, v in d.items() if k in spec["outputs"]}  # noqa: E731
        grads = lambda d: {k: v for k, v in d.items() if k not in spec["outputs"]}  # noqa: E731
        checks = [check_row("outputs == eager", outputs(vs["eager"]), candidate == "detdit torch"),
                  check_row("grads == eager", grads(vs["eager"]), False),
                  check_row("outputs == detdit", outputs(vs["detdit portable"]), False),
                  check_row("grads == detdit", grads(vs["detdit portable"]), False),
                  check_row("run to run", run_to_run, is_detdit)]
        fwd = median_us(lambda: case.forward(candidate), args.warmup, args.repeats)
        both = median_us(lambda: case.forward_backward(candidate), args.warmup, args.repeats)
        timing = {}
        for phase, us, floor in (("fwd", fwd, case.floor_forward), ("fwd+bwd", both, case.floor_both)):
            timing[phase] = {"median_us": us, "bytes": floor, "gbps": floor / (us * 1e-6) / 1e9,
                             "percent_of_copy": 100 * floor / (us * 1e-6) / 1e9 / gbps}
        rows.append((candidate, timing, checks))
        report["cases"].append({"op": case.op, "case": f"{case.packing} S{case.seq_len}, {candidate}", "candidate": candidate,
                                "device": torch.cuda.get_device_name(), "seconds": both * 1e-6,
                                "timing": timing, "checks": checks})
    del results, references
    for phase in ("fwd", "fwd+bwd"):
        times = {candidate: timing[phase]["median_us"] for candidate, timing, _ in rows}
        for mine in ("detdit portable", "detdit torch"):
            for other in ("eager", "torch.compile"):
                report["speedups"].append({"op": case.op, "case": case.name, "phase": phase, "detdit": mine,
                                           "vs": other, "detdit_us": times[mine], "other_us": times[other],
                                           "speedup": times[other] / times[mine]})
    for candidate, timing, checks in rows:
        cells = " | ".join(("equal" if c["pass"] else "DIFFER") for c in checks)
        table.append(f"| {case.op} | {case.name} | {candidate} | {timing['fwd']['median_us']:.0f} | "
                     f"{timing['fwd']['percent_of_copy']:.0f} % | {timing['fwd+bwd']['median_us']:.0f} | "
                     f"{timing['fwd+bwd']['percent_of_copy']:.0f} % | {cells} |")


def git_state():
    def git(*argv):
        try:
            return subprocess.run(["git", *argv], capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD") or "unknown", "dirty": bool(status)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="S = 4097 only")
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated: " + ", ".join(OPS))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compile-mode", default="default", help="torch.compile's mode")
    parser.add_argument("--out", help="write the JSON report here")
    args = parser.parse_args()
    ops = args.ops.split(",")
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        parser.error(f"unknown op {unknown[0]!r}; expected one of {', '.join(OPS)}")
    if not torch.cuda.is_available():
        sys.exit("torch_compare: needs a CUDA GPU (torch.cuda.is_available() is False)")

    started = time.time()
    gbps = copy_gbps(args.warmup, args.repeats)
    compiled = {op: torch.compile(OPS[op]["eager"], mode=args.compile_mode) for op in ops}
    report = {"kind": "detdit_torch_compare", "format_version": 1,
              "title": "detdit vs PyTorch eager and torch.compile",
              "time_label": "forward + backward, median of the timed calls (seconds)",
              "git": git_state(),
              "environment": {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "cuda_runtime": torch.version.cuda or "none", "compiler": f"torch.compile mode={args.compile_mode}"},
              "options": {"repeats": args.repeats, "warmup": args.warmup, "quick": args.quick, "ops": ops},
              "copy_gbps": gbps, "cases": [], "speedups": []}
    table = ["| op | case | candidate | fwd us | fwd % copy | fwd+bwd us | fwd+bwd % copy | "
             "outputs == eager | grads == eager | outputs == detdit | grads == detdit | run to run |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | --- | --- | --- | --- | --- |"]
    for op in ops:
        for seq_len in QUICK_SEQ_LENS if args.quick else SEQ_LENS:
            for packing in PACKINGS:
                case = Case(op, seq_len, packing, compiled)
                run_case(case, args, gbps, report, table)
                del case
                torch.cuda.empty_cache()
    checks = [c for case in report["cases"] for c in case["checks"]]
    failed = [(f"{case['op']} / {case['case']}", c["check"]) for case in report["cases"] for c in case["checks"]
              if not c["pass"] and c["promise"]]
    report.update(verdict="FAIL" if failed else "PASS", checks_total=len(checks),
                  checks_passed=sum(c["pass"] for c in checks), seconds=time.time() - started)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}; copy (read + write) {gbps:.0f} GB/s; "
          f"commit {report['git']['commit'][:12]}{' (dirty)' if report['git']['dirty'] else ''}\n")
    print("\n".join(table))
    print("\n| op | case | phase | detdit | vs eager | vs torch.compile |\n| --- | --- | --- | --- | ---: | ---: |")
    pairs = {}
    for s in report["speedups"]:
        pairs.setdefault((s["op"], s["case"], s["phase"], s["detdit"]), {})[s["vs"]] = s["speedup"]
    for (op, name, phase, mine), vs in pairs.items():
        print(f"| {op} | {name} | {phase} | {mine} | {vs['eager']:.2f}x | {vs['torch.compile']:.2f}x |")
    for name, check in failed:
        print(f"FAILED: {name}: {check}")
    print(f"torch_compare: {report['verdict']}, {len(failed)} promise(s) broken, "
          f"{report['checks_passed']}/{len(checks)} comparisons equal")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
