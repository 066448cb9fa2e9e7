#!/usr/bin/env python3
"""torch parity: detdit's torch profile against PyTorch eager on the same GPU, bitwise.

Makes each case's inputs with torch on the GPU, writes them as raw files, runs
detdit's op in the torch profile through the small runner
tests/cuda/tools/torch_parity_main.cc (built with the CUDA tests), and compares
the output bytes with PyTorch eager's (as integer views, so NaNs compare by
their bits). Prints one line per case and a final line
"torch parity: N/N cases bitwise equal"; exits 1 if any case differs.

    python3 scripts/torch_parity.py [--runner build/tests/torch_parity_main]

Needs torch with CUDA; recipes in docs/numerics.md (the torch profile).
"""
import argparse
import math
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def get_timestep_embedding(timesteps, embedding_dim, flip_sin_to_cos=True, downscale_freq_shift=0, scale=1,
                           max_period=10000):
    """diffusers.models.embeddings.get_timestep_embedding, replayed verbatim."""
    half_dim = embedding_dim // 2
    exponent = -math.log(max_period) * torch.arange(start=0, end=half_dim, dtype=torch.float32,
                                                    device=timesteps.device)
    exponent = exponent / (half_dim - downscale_freq_shift)
    emb = torch.exp(exponent)
    emb = timesteps[:, None].float() * emb[None, :]
    emb = scale * emb
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)
    if flip_sin_to_cos:
        emb = torch.cat([emb[:, half_dim:], emb[:, :half_dim]], dim=-1)
    if embedding_dim % 2 == 1:
        emb = torch.nn.functional.pad(emb, (0, 1, 0, 0))
    return emb


class Parity:
    def __init__(self, runner, workdir):
        self.runner, self.workdir = runner, workdir
        self.passed = self.total = 0

    def path(self, name):
        return os.path.join(self.workdir, name)

    def write(self, name, tensor):
        tensor.contiguous().cpu().view(torch.uint8).numpy().tofile(self.path(name))
        return self.path(name)

    def read(self, name, like):
        data = open(self.path(name), "rb").read()
        out = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(like.dtype)
        return out.reshape(like.shape)

    def check(self, label, args, reference, out_name):
        self.total += 1
        result = subprocess.run([self.runner] + [str(a) for a in args], capture_output=True, text=True)
        if result.returncode != 0:
            print(f"FAIL  {label}: runner failed: {result.stderr.strip()}")
            return
        got = self.read(out_name, reference.cpu())
        ref = reference.contiguous().cpu()
        differ = (got.view(INT_VIEW[ref.dtype]) != ref.view(INT_VIEW[ref.dtype])).sum().item()
        if differ == 0:
            self.passed += 1
            print(f"ok    {label}: {ref.numel()} elements bitwise equal")
        else:
            print(f"FAIL  {label}: {differ} of {ref.numel()} elements differ")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runner", default=os.path.join("build", "tests", "torch_parity_main"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("torch parity: no CUDA GPU visible to torch", file=sys.stderr)
        return 1
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(2026)

    def randn(*shape, dtype=torch.float32, std=1.0, mean=0.0):
        return (torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32) * std + mean).to(dtype)

    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
    with tempfile.TemporaryDirectory() as workdir:
        p = Parity(os.path.abspath(args.runner), workdir)

        # timestep_sinusoid vs diffusers' get_timestep_embedding (flip_sin_to_cos, shift 0, period 10000).
        t = torch.rand(8192, generator=gen, device=dev)
        t[:4] = torch.tensor([0.0, 1.0, 0.5, 1e-3], device=dev)
        for channels in (256, 254, 200):
            ref = get_timestep_embedding(t, channels)
            p.check(f"timestep_sinusoid T=8192 C={channels}",
                    ["sinusoid", 8192, channels, 1, 0, 1, 1, p.write("t.bin", t), p.path("out.bin")], ref, "out.bin")
        # The other families' conventions: (label, C, flip, shift, scale, t_max, timesteps). SD3, Flux,
        # HunyuanVideo, LTX: sigma * 1000 (Flux's through bf16); Wan and CogVideoX (C = H = 1920):
        # integers in [0, 999]; Qwen-Image: t in [0, 1] in bf16 with scale 1000; Flux's guidance * 1000;
        # odd C with [sin | cos] and shift 1 (get_timestep_embedding's own defaults).
        sigma = torch.rand(1024, generator=gen, device=dev)
        sigma[:2] = torch.tensor([0.0, 1.0], device=dev)
        integers = (sigma * 1000).floor().clamp(max=999)
        conventions = [
            ("sigma*1000", 256, True, 0, 1, 1000, sigma * 1000),
            ("sigma*1000 bf16", 256, True, 0, 1, 1000, (sigma * 1000).to(torch.bfloat16).float()),
            ("integer t", 256, True, 0, 1, 1000, integers),
            ("integer t C=1920", 1920, True, 0, 1, 1000, integers),
            ("scale=1000 bf16 t", 256, True, 0, 1000, 1, sigma.to(torch.bfloat16).float()),
            ("guidance*1000", 256, True, 0, 1, 20000, sigma * 20000),
            ("sin|cos shift=1 C=255", 255, False, 1, 1, 1000, sigma * 1000),
        ]
        for label, channels, flip, shift, scale, t_max, ts in conventions:
            ref = get_timestep_embedding(ts, channels, flip, shift, scale)
            p.check(f"timestep_sinusoid {label} T={ts.numel()} C={channels}",
                    ["sinusoid", ts.numel(), channels, int(flip), shift, scale, t_max, p.write("t.bin", ts),
                     p.path("out.bin")], ref, "out.bin")

        # rmsnorm vs F.rms_norm, x = 30 randn.
        for name, dtype in DTYPES.items():
            for hidden in (12, 256, 4096, 5376):
                x, w = randn(1000, hidden, dtype=dtype, std=30.0), randn(hidden, dtype=dtype)
                ref = F.rms_norm(x, (hidden,), w, eps=1e-5)
                p.check(f"rmsnorm {name} M=1000 N={hidden}",
                        ["rmsnorm", name, 1000, hidden, p.write("x.bin", x), p.write("w.bin", w), p.path("out.bin")],
                        ref, "out.bin")

        # Modulated norm and gated residual, B=2, S=1025, H=5376, T=3 timesteps x 3 modalities.
        batch, seq, hidden, rows = 2, 1025, 5376, 9
        idx = torch.randint(0, rows, (seq,), generator=gen, device=dev)
        for name, dtype in DTYPES.items():
            x, w = randn(batch, seq, hidden, dtype=dtype, std=3.0), randn(hidden, dtype=dtype)
            shift, scale = randn(rows, hidden, dtype=dtype, std=0.5), randn(rows, hidden, dtype=dtype, std=0.5)
            ref = F.rms_norm(x, (hidden,), w, eps=1e-5) * (1 + scale[idx]) + shift[idx]
            p.check(f"rmsnorm modulated {name} B=2 S=1025 H=5376",
                    ["modulated", name, batch, seq, hidden, rows, p.write("x.bin", x), p.write("w.bin", w),
                     p.write("shift.bin", shift), p.write("scale.bin", scale), p.write("idx.bin", idx),
                     p.path("out.bin")], ref, "out.bin")
            res, y, gate = randn(batch, seq, hidden, dtype=dtype), randn(batch, seq, hidden, dtype=dtype), shift
            ref = res + gate[idx] * y
            p.check(f"gate_residual {name} B=2 S=1025 H=5376",
                    ["gate", name, batch, seq, hidden, rows, p.write("res.bin", res), p.write("y.bin", y),
                     p.write("gate.bin", gate), p.write("idx.bin", idx), p.path("out.bin")], ref, "out.bin")

        # SiLU then one cast: F.silu(temb).to(bfloat16), temb (8, 2688) FP32.
        temb = randn(8, 2688, std=10.0)
        ref = F.silu(temb).to(torch.bfloat16)
        p.check("silu+cast fp32->bf16 T=8 D=2688",
                ["silu_cast", 8, 2688, p.write("temb.bin", temb), p.path("act.bin")], ref, "act.bin")

        # Row gather vs six index_selects of the (3T, 6H) table, bf16, S=4097.
        seq, rows = 4097, 12
        table = randn(rows, 6 * hidden, dtype=torch.bfloat16)
        gidx = torch.randint(0, rows, (seq,), generator=gen, device=dev)
        ref = torch.stack([torch.index_select(table[:, c * hidden:(c + 1) * hidden], 0, gidx) for c in range(6)])
        p.check("adaln_row_gather bf16 S=4097 H=5376 vs index_select",
                ["gather", "bf16", seq, rows, hidden, p.write("table.bin", table), p.write("idx.bin", gidx),
                 p.path("out.bin")], ref, "out.bin")

        # layernorm vs F.layer_norm (eps 1e-6): out, the saved mean and rstd (aten.native_layer_norm) and dx
        # (aten.native_layer_norm_backward); x = 3 randn + 50 (a mean far from 0), without affine, with weight,
        # with weight and bias.
        for name, dtype in DTYPES.items():
            for hidden in (1536, 2432, 3072, 5120):
                for affine in ("none", "weight", "weight+bias"):
                    x, grad = randn(1000, hidden, dtype=dtype, std=3.0, mean=50.0), randn(1000, hidden, dtype=dtype)
                    w = randn(hidden, dtype=dtype, mean=1.0, std=0.5) if affine != "none" else None
                    b = randn(hidden, dtype=dtype, std=0.5) if affine == "weight+bias" else None
                    out, mean, rstd = torch.ops.aten.native_layer_norm(x, [hidden], w, b, 1e-6)
                    dx = torch.ops.aten.native_layer_norm_backward(grad, x, [hidden], mean, rstd, w, b,
                                                                   [True, False, False])[0]
                    args = ["layernorm", name, 1000, hidden, p.write("x.bin", x),
                            p.write("w.bin", w) if w is not None else "-", p.write("b.bin", b) if b is not None else "-",
                            p.write("grad.bin", grad), p.path("out.bin"), p.path("mean.bin"), p.path("rstd.bin"),
                            p.path("dx.bin")]
                    for label, ref, file in (("out", out, "out.bin"), ("mean", mean.reshape(1000), "mean.bin"),
                                             ("rstd", rstd.reshape(1000), "rstd.bin"), ("dx", dx, "dx.bin")):
                        p.check(f"layernorm {affine} {name} M=1000 N={hidden} {label}", args, ref, file)

        # The modulation forms as the families compute them (no-affine LayerNorm, eps 1e-6), B=2, S=1050,
        # H=3072: per sample (F=1), per frame (F=21) and per token (F=S); each op in eager (SD3, Flux:
        # bf16 modulation; fp32 modulation promotes), and Wan's upcast (every site in FP32, one rounding:
        # `(norm(x.float()) * (1 + scale) + shift).type_as(x)`, `(res.float() + y * gate).type_as(res)`).
        batch, seq, hidden = 2, 1050, 3072
        for name, mname, upcast in (("bf16", "bf16", 0), ("f16", "f16", 0), ("bf16", "f32", 0),
                                    ("bf16", "f32", 1), ("f16", "f32", 1), ("f32", "f32", 0)):
            dtype, mdtype = DTYPES[name], DTYPES[mname]
            for frames in (1, 21, seq):
                def per_position(m):  # (B, F, H) -> (B, S, H) as broadcasting over the frame's positions
                    return m.reshape(batch, frames, 1, hidden).expand(batch, frames, seq // frames, hidden).reshape(
                        batch, seq, hidden)
                x, y = randn(batch, seq, hidden, dtype=dtype, std=3.0, mean=2.0), randn(batch, seq, hidden, dtype=dtype)
                shift, scale, gate = (randn(batch, frames, hidden, dtype=mdtype, std=0.5) for _ in range(3))
                sh, sc, gt = per_position(shift), per_position(scale), per_position(gate)
                if upcast:
                    def norm_site(v):
                        return (F.layer_norm(v.float(), (hidden,), eps=1e-6) * (1 + sc.float()) + sh.float()).type_as(v)
                    h = (x.float() + y.float() * gt.float()).type_as(x)
                else:
                    def norm_site(v):
                        return F.layer_norm(v, (hidden,), eps=1e-6) * (1 + sc) + sh
                    h = x + gt * y
                label = f"{name} x, {mname} modulation, upcast={upcast}, F={frames} B=2 S={seq} H={hidden}"
                files = [p.write("x.bin", x), p.write("y.bin", y), p.write("gate.bin", gate),
                         p.write("shift.bin", shift), p.write("scale.bin", scale)]
                dims = [name, mname, upcast, batch, seq, frames, hidden]
                p.check(f"layernorm forms {label}",
                        ["layernorm_forms"] + dims + [files[0], files[3], files[4], p.path("out.bin")],
                        norm_site(x), "out.bin")
                p.check(f"gate_residual forms {label}",
                        ["gate_forms"] + dims + files[:3] + [p.path("out.bin")], h, "out.bin")
                region = ["region"] + dims + files + [p.path("h.bin"), p.path("out.bin")]
                p.check(f"gate_residual_layernorm h {label}", region, h, "h.bin")
                p.check(f"gate_residual_layernorm out {label}", region, norm_site(h), "out.bin")

        print(f"torch parity: {p.passed}/{p.total} cases bitwise equal")
        return 0 if p.passed == p.total else 1


if __name__ == "__main__":
    sys.exit(main())
