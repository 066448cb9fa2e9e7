"""scripts/torch_compare.py (a GPU script: detdit against eager PyTorch on the bench's cases)
imports and loads its inputs on the CPU: --dry-run exports the bench cases of a row-wise and
both projection ops (--quick --small: S = 4097, T in {1, 4}, the projections scaled down),
builds every case's leaves, plan and incoming gradients, and runs no candidate. It needs the
build's tests/detdit_export_cases ($DETDIT_BUILD_DIR), as the script does."""
import os
import subprocess
import sys

import pytest

import op_cases

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def test_torch_compare_dry_run_loads_the_bench_cases_inputs():
    path, why = op_cases.program_path()
    if path is None:
        pytest.fail(why, pytrace=False)
    run = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "torch_compare.py"), "--dry-run", "--quick",
                          "--small", "--ops", "gate_residual_rmsnorm,adaln_projection,timestep_mlp"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    expected = [f"gate_residual_rmsnorm bf16 H5376 {packing}_S4097_T3_B2" for packing in ("block", "interleaved")]
    expected += [f"adaln_projection bfloat16 T={t} D=512 N=9216" for t in (1, 4)]
    expected += [f"timestep_mlp T={t} K=256 H=1024 D=512" for t in (1, 4)]
    assert [line.split(":")[0] for line in lines[:-1]] == expected, run.stdout
    # the region's six leaves and two incoming gradients: (B, S, H) rows and (3T, H) table chunks
    rows, chunk = "(2, 4097, 5376) bfloat16", "(9, 5376) bfloat16"
    assert lines[0].endswith(", ".join([rows, rows, chunk, "(5376,) bfloat16", chunk, chunk, rows, rows]))
    assert lines[-1] == "torch_compare: dry run, no candidate run"
