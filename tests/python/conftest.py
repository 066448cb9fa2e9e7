"""Shared helpers of the detdit binding tests (pytest). Run from the repo root:
PYTHONPATH=python /usr/bin/python3 -m pytest tests/python -q (after building the extension,
see docs/python.md)."""
import atexit
import os
import shutil
import sys
import tempfile

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                   reason="needs a CUDA GPU and a CUDA build of torch (torch.cuda.is_available() is False)")


def _int_view(t):
    return t.contiguous().view({4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()])


def assert_bitwise_equal(actual, expected, what):
    """Byte equality, with a report: count, first index, both values in hex, ulp distance."""
    assert actual is not None and expected is not None, f"{what}: missing tensor"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = _int_view(actual.detach().cpu()), _int_view(expected.detach().cpu())
    differ = a != e
    if bool(differ.any()):
        count = int(differ.sum())
        first = int(differ.flatten().nonzero()[0])
        got, want = int(a.flatten()[first]), int(e.flatten()[first])
        bits = actual.element_size() * 8
        mask = (1 << bits) - 1
        raise AssertionError(
            f"{what}: {count} of {a.numel()} elements differ; first at flat index {first}: "
            f"got {float(actual.detach().cpu().flatten()[first])!r} (0x{got & mask:0{bits // 4}x}), "
            f"expected {float(expected.detach().cpu().flatten()[first])!r} (0x{want & mask:0{bits // 4}x}), "
            f"{abs(got - want)} ulp apart")


def assert_close_to(actual, reference, bound, what):
    """max |actual - reference| <= bound (reference float64)."""
    err = (actual.detach().double().cpu() - reference.detach().double().cpu()).abs().max().item()
    assert err <= bound, f"{what}: max abs error {err:.3e} exceeds the bound {bound:.3e}"
    return err


def normal(shape, seed, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def packing(seq_len, num_timesteps, seed):
    """A packed sequence: (timestep_indices, token_tags), int64, mixed order."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, num_timesteps, (seq_len,), generator=g),
            torch.randint(0, 3, (seq_len,), generator=g))


def packed(kind, seq_len, num_timesteps):
    """The two packings of the C++ op cases (cases/index_case.h): (timestep_indices,
    token_tags), int64. "block": T contiguous runs, each 5 % text (first), 15 % audio (last),
    the rest video; "interleaved": position s has timestep s % T, tag [0,1,0,2,0,0,1,0,2,0][s % 10]."""
    s = torch.arange(seq_len)
    if kind == "interleaved":
        return s % num_timesteps, torch.tensor([0, 1, 0, 2, 0, 0, 1, 0, 2, 0])[s % 10]
    assert kind == "block", kind
    ti, tags = torch.empty(seq_len, dtype=torch.int64), torch.empty(seq_len, dtype=torch.int64)
    for t in range(num_timesteps):
        begin, end = t * seq_len // num_timesteps, (t + 1) * seq_len // num_timesteps
        text, audio = (end - begin) * 5 // 100, (end - begin) * 15 // 100
        run = torch.arange(begin, end)
        ti[begin:end] = t
        tags[begin:end] = torch.where(run - begin < text, 1, torch.where(end - run <= audio, 2, 0))
    return ti, tags


_exported = []  # the session's export: [cases], made once by exported_cases()


def exported_cases():
    """The C++ op cases of the test suite (cases/), exported once per session by the build's
    tests/detdit_export_cases (op_cases.py: export_for_tests, the default set and the larger
    cases op_cases.NAMED names): inputs, plans' indexes, arguments and the outputs of the CPU
    reference. $DETDIT_OP_CASES names a directory op_cases.py wrote already (the torch 2.6
    job's chroot has no C++ build of it: scripts/torch_compile_check.sh). Without either
    (DETDIT_BUILD_DIR unset, or the target not built) every test that uses them fails, naming
    what to build: it is never skipped. For the functions that build inputs outside a fixture
    (test_compile.py's inputs()); tests take the op_cases fixture."""
    import op_cases as cases  # after sys.path has this directory
    if not _exported:
        if os.environ.get("DETDIT_OP_CASES"):
            _exported.append(cases.load_for_tests(os.environ["DETDIT_OP_CASES"]))
        else:
            path, why = cases.program_path()
            if path is None:
                pytest.fail(why, pytrace=False)
            directory = tempfile.mkdtemp(prefix="detdit_op_cases_")
            atexit.register(shutil.rmtree, directory, True)
            try:
                cases.export_for_tests(directory)
            except RuntimeError as e:
                pytest.fail(str(e), pytrace=False)
            _exported.append(cases.load_for_tests(directory))
    return _exported[0]


@pytest.fixture(scope="session")
def op_cases():
    """exported_cases() as a fixture."""
    return exported_cases()


@pytest.fixture
def modulated_rows(op_cases):
    """One valid set of a modulated row-wise op's inputs, from the exported C++ case "rmsnorm
    modulated bfloat16 H=12 block_S255_T3_B1": "ti", "tags" ((S,) int64), "T", "plan" (batch
    1), "x" ((1, S, H) bf16), "w" ((H,)), "table" ((3T, H): chunk 0 of the case's AdaLN rows,
    contiguous). Fresh copies for each test."""
    import op_cases as cases
    c = cases.find(op_cases, "rmsnorm", "modulated bfloat16 H=12 block_S255_T3_B1")
    ti, tags = (t.clone() for t in c.index())
    hidden = c["x"].shape[-1]
    return {"ti": ti, "tags": tags, "T": c.plans["plan"]["num_timesteps"], "plan": c.plan(),
            "x": c["x"].clone().view(1, -1, hidden), "w": c["weight"].clone(),
            "table": cases.table_chunk(c["table"], hidden, 0).contiguous()}
