"""PyTorch eager baseline for the row-wise ops at the shapes of bench_main
(tests/cuda/tools/bench_main.cu): B=1, S=32768, H=5376, bf16, a 12-row table
indexed per position with bench_main's block packing (T=4). Times what a diffusers MiniMax-H3 block runs today:

  rmsnorm modulated: F.rms_norm(x, (H,), w, eps) * (1 + scale[rows]) + shift[rows]
  gate_residual:     residual + gate[rows] * y

forward alone and backward alone (torch.autograd.grad on a kept graph), with
CUDA events, 3 warm-ups, median of 20, plus a device-to-device copy measured in
the same process. Bytes floors are bench_main's, so the columns compare.

    python3 scripts/torch_bench.py        # on a GPU machine with torch
"""
import statistics

import torch
import torch.nn.functional as F

WARMUP, REPEATS = 3, 20
BATCH, SEQ, HIDDEN, TABLE_ROWS = 1, 32768, 5376, 12


def block_rows(timesteps=TABLE_ROWS // 3):
    """bench_main's block packing: T contiguous runs, in each the first 5 % text, the last
    15 % audio, the rest video; row t*3 + tag."""
    rows = torch.empty(SEQ, dtype=torch.long)
    for s in range(SEQ):
        t = s * timesteps // SEQ
        begin, end = t * SEQ // timesteps, (t + 1) * SEQ // timesteps
        f = (s - begin) / (end - begin)
        rows[s] = t * 3 + (1 if f < 0.05 else 2 if f >= 0.85 else 0)
    return rows


def median_us(fn):
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(REPEATS):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3)
    return statistics.median(times)


def main():
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape):
        return (torch.rand(shape, device=dev, generator=gen) * 4 - 2).to(torch.bfloat16)

    source = torch.empty(1 << 30, dtype=torch.int16, device=dev)  # 2 GiB
    target = torch.empty_like(source)
    copy_us = median_us(lambda: target.copy_(source))
    copy_gbps = 2 * source.numel() * 2 / (copy_us * 1e-6) / 1e9
    del source, target

    rows = block_rows().to(dev)
    x = rand(BATCH, SEQ, HIDDEN).requires_grad_(True)
    w = rand(HIDDEN).requires_grad_(True)
    shift, scale, gate = (rand(TABLE_ROWS, HIDDEN).requires_grad_(True) for _ in range(3))
    y = rand(BATCH, SEQ, HIDDEN).requires_grad_(True)
    grad = rand(BATCH, SEQ, HIDDEN)
    elements = BATCH * SEQ * HIDDEN

    def rmsnorm():
        return F.rms_norm(x, (HIDDEN,), w, 1e-5) * (1 + scale[rows]) + shift[rows]

    def gate_residual():
        return x + gate[rows] * y

    cases = []
    for name, fn, inputs, fwd_bytes, bwd_bytes in (
        ("rmsnorm modulated", rmsnorm, (x, w, shift, scale), 2 * elements * 2, 3 * elements * 2),
        ("gate_residual", gate_residual, (x, y, gate), 3 * elements * 2, 4 * elements * 2),
    ):
        cases.append((name + " fwd", median_us(fn), fwd_bytes))
        out = fn()
        cases.append((name + " bwd", median_us(lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True)),
                      bwd_bytes))
        del out

    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}; copy (read + write): {copy_gbps:.0f} GB/s\n")
    print("| op (PyTorch eager) | shape | median us | bytes floor (MB) | GB/s | % of copy |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, us, floor in cases:
        gbps = floor / (us * 1e-6) / 1e9
        print(f"| {name} | B={BATCH} S={SEQ} H={HIDDEN} bf16 | {us:.1f} | {floor / 1e6:.1f} | {gbps:.0f} | "
              f"{100 * gbps / copy_gbps:.0f} % |")


if __name__ == "__main__":
    main()
