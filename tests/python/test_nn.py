"""detdit.nn: the H3 conditioning modules load the manifest's tensors unchanged (synthetic
weights written by the detdit CLI's own safetensors writer), have the manifest's names,
shapes and dtypes at full size, and compute what the functional ops compute."""
import os
import re
import subprocess

import pytest
import torch

import detdit
import detdit.safetensors
from conftest import assert_bitwise_equal, packing

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD_DIR = os.path.abspath(os.environ.get("DETDIT_BUILD_DIR", os.path.join(REPO, "build")))
CLI = os.path.join(BUILD_DIR, "detdit")
SMALL = dict(hidden=64, time_embed_hidden=48, time_dim=40, freq_dim=32)


def cli(*args):
    if not os.path.isfile(CLI):
        pytest.fail(f"the detdit CLI is needed at {CLI}: build it (cmake --build {BUILD_DIR}) or set DETDIT_BUILD_DIR")
    return subprocess.run([CLI, *args], check=True, capture_output=True, text=True).stdout


def small_model(blocks):
    return detdit.nn.H3Conditioning(num_blocks=blocks, hidden_size=SMALL["hidden"], freq_dim=SMALL["freq_dim"],
                                    time_embed_hidden_dim=SMALL["time_embed_hidden"],
                                    time_embed_dim=SMALL["time_dim"])


def test_state_dict_loads_synthetic_safetensors(tmp_path):
    cli("weights", "synth", "--out", str(tmp_path), "--blocks", "2", "--hidden", str(SMALL["hidden"]),
        "--time-embed-hidden", str(SMALL["time_embed_hidden"]), "--time-dim", str(SMALL["time_dim"]),
        "--freq-dim", str(SMALL["freq_dim"]))
    weights = detdit.safetensors.load_file(str(tmp_path / "h3_conditioning.safetensors"))
    model = small_model(2)
    model.load_state_dict(weights, strict=True)  # every name, shape and dtype as the manifest has it
    state = model.state_dict()
    for name, tensor in weights.items():
        assert_bitwise_equal(state[name], tensor, name)

    # the loaded model runs the chain
    seq = 40
    ti, tags = packing(seq, 2, 120)
    plan = detdit.plan(ti, tags, 2)
    tplan = detdit.plan_from_rows(ti, 2)
    temb = model.temb(torch.tensor([0.2, 0.9]))
    x = torch.randn(1, seq, SMALL["hidden"]).bfloat16()
    for block in model.transformer_blocks:
        x = block(x, temb, plan, lambda h: h, lambda h: h)
    out = model.norm_out(x, temb, tplan)
    assert out.shape == (1, seq, SMALL["hidden"]) and torch.isfinite(out.float()).all()

    # and writes back the same file contents through detdit.safetensors
    detdit.safetensors.save_file(state, str(tmp_path / "again.safetensors"))
    again = detdit.safetensors.load_file(str(tmp_path / "again.safetensors"))
    assert sorted(again) == sorted(weights)
    for name in weights:
        assert_bitwise_equal(again[name], weights[name], f"round trip {name}")


def manifest():
    """(name pattern, dtype, symbolic shape) rows of `detdit weights manifest`."""
    rows = []
    for line in cli("weights", "manifest").splitlines():
        m = re.match(r"(\S+)\s+(float32|bfloat16)\s+\[([^\]]*)\]", line)
        if m:
            rows.append((m.group(1), getattr(torch, m.group(2)), [d.strip() for d in m.group(3).split(",")]))
    assert len(rows) >= 12, "could not parse the manifest"
    return rows


def test_full_size_names_shapes_dtypes_match_the_manifest():
    blocks = 50
    model = detdit.nn.H3Conditioning(num_blocks=blocks, device="meta")  # H3 sizes, nothing allocated
    dims = {"H": detdit.H3_HIDDEN_SIZE, "Ht": detdit.H3_TIME_EMBED_HIDDEN_DIM, "D": detdit.H3_TIME_EMBED_DIM,
            "F": detdit.H3_FREQ_DIM}

    def size(symbol):
        m = re.fullmatch(r"(\d*)(\w+)", symbol)
        return int(m.group(1) or 1) * dims[m.group(2)]

    expected = {}
    for pattern, dtype, shape in manifest():
        names = [pattern.replace("{i}", str(i)) for i in range(blocks)] if "{i}" in pattern else [pattern]
        for name in names:
            expected[name] = (dtype, tuple(size(s) for s in shape))
    got = {name: (t.dtype, tuple(t.shape)) for name, t in model.state_dict().items()}
    assert got == expected
    assert got["transformer_blocks.0.adaln_proj.linear.weight"] == (torch.bfloat16, (96768, 2688))
    assert got["norm_out.linear.weight"] == (torch.bfloat16, (10752, 2688))


def test_modules_compute_the_functional_ops():
    torch.manual_seed(130)
    model = small_model(1)
    seq, hidden = 300, SMALL["hidden"]
    ti, tags = packing(seq, 2, 131)
    plan = detdit.plan(ti, tags, 2)
    t = torch.tensor([0.25, 0.75])
    features = model.time_proj(t)
    assert_bitwise_equal(features, detdit.timestep_sinusoid(t, SMALL["freq_dim"]), "time_proj")
    temb = model.time_embedder(features)
    e = model.time_embedder
    assert_bitwise_equal(temb, detdit.timestep_mlp(features, e.linear_1.weight, e.linear_1.bias, e.linear_2.weight,
                                                   e.linear_2.bias), "time_embedder")
    proj = model.transformer_blocks[0].adaln_proj
    fused = proj(temb, plan)  # six (S, H): shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp
    chunks = proj.chunks(temb)  # six (3T, H) table views
    assert len(fused) == 6 and len(chunks) == 6
    idx = ti * 3 + tags
    for c in range(6):
        assert_bitwise_equal(fused[c], chunks[c].index_select(0, idx), f"chunk {c}: fused gather vs table view")
    x = torch.randn(1, seq, hidden).bfloat16()
    norm1 = model.transformer_blocks[0].norm1
    assert_bitwise_equal(norm1(x, chunks[0], chunks[1], plan),
                         detdit.rmsnorm(x, norm1.weight, chunks[0], chunks[1], plan), "norm1 modulated")
