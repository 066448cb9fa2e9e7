"""The binding fails closed before it allocates, converts or parses anything: a malformed
input is refused with the exception of its kind, naming the argument, and never turns into a
torch allocation error, a dispatcher RuntimeError, a silently truncated integer or an aborted
interpreter.

The broadcast views below have shapes of 2**36 rows and more that their memory does not
back; sizing an output from them asks torch for terabytes (a RuntimeError, or worse)."""
import re
import subprocess
import sys

import pytest
import torch

import detdit
import detdit.distributed
from conftest import normal

ops = torch.ops.detdit
HUGE = 2 ** 36
bf16 = torch.bfloat16


@pytest.fixture
def case(modulated_rows):
    return modulated_rows  # conftest.py: an exported C++ case's inputs, S = 255, T = 3, H = 12


def broadcast(shape, dtype=torch.float32):
    """A view of `shape` over one row of memory (stride 0 in every dim but the last)."""
    return torch.zeros((1,) * (len(shape) - 1) + (shape[-1],), dtype=dtype).expand(*shape)


# ---------------------------------------------------------------------------
# item 9: validate before allocating

def forward_cases(case):
    """(the argument named, the call) for every forward op given one broadcast input."""
    plan, x, w, table = case["plan"], case["x"], case["w"], case["table"]
    H, T = x.shape[-1], case["T"]
    return [
        ("x", lambda: detdit.rmsnorm(broadcast((1, HUGE, H), bf16), w)),
        ("x", lambda: detdit.linear(broadcast((HUGE, 16)), normal((8, 16), 1))),
        ("weight", lambda: detdit.linear(normal((4, 16), 1), broadcast((HUGE, 16)))),
        ("temb", lambda: detdit.adaln_projection(broadcast((HUGE, 8)), normal((18, 8), 2, bf16),
                                                 normal((18,), 3, bf16))),
        ("residual", lambda: detdit.gate_residual(broadcast((1, HUGE, H), bf16), x, table, plan)),
        ("residual", lambda: detdit.gate_residual_rmsnorm(broadcast((1, HUGE, H), bf16), x, table, w,
                                                          plan=plan)),
        ("timesteps", lambda: detdit.timestep_sinusoid(torch.zeros(1).expand(HUGE))),
        ("features", lambda: detdit.timestep_mlp(broadcast((HUGE, 8)), normal((8, 8), 4), normal((8,), 5),
                                                 normal((8, 8), 6), normal((8,), 7))),
        ("temb", lambda: detdit.adaln_modulation(broadcast((HUGE, 8)), normal((18 * H, 8), 8, bf16),
                                                 normal((18 * H,), 9, bf16), plan)),
        ("x", lambda: detdit.final_adaln_out(broadcast((1, HUGE, H), bf16), w, normal((T, 8), 10),
                                             normal((2 * H, 8), 11, bf16), normal((2 * H,), 12, bf16),
                                             detdit.plan_from_rows(case["ti"], T))),
        ("x", lambda: detdit.layernorm(broadcast((1, HUGE, H), bf16), None, None, table, table, plan, upcast=True)),
        ("residual", lambda: detdit.gate_residual_layernorm(broadcast((1, HUGE, H), bf16), x, table, plan=plan)),
    ]


@pytest.mark.parametrize("index", range(12))
def test_forward_ops_refuse_broadcast_inputs_before_allocating(case, index):
    name, call = forward_cases(case)[index]
    with pytest.raises(ValueError, match=f"^{name} must be contiguous"):
        call()


def test_adaln_row_gather_refuses_broadcast_columns_before_allocating(case):
    rows = torch.zeros(6, 1).expand(6, 6 * HUGE)  # (R, 6H) with column stride 0
    with pytest.raises(ValueError, match="^rows must have unit column stride, got stride 0"):
        detdit.adaln_row_gather(rows, case["plan"])


def backward_cases(case):
    """(the error, the raw backward call) for each output sized from an input detdit refuses."""
    plan, x, w = case["plan"], case["x"], case["w"]
    S, H, T = x.shape[1], x.shape[-1], case["T"]
    rstd = torch.ones(S)
    # table gradients are sized from the plan's rows, not from a table of the wrong row count
    big_table = broadcast((HUGE, H), bf16)
    return [
        (rf"gate must be \(R, H\) = \({3 * T}, {H}\)", lambda: ops.gate_residual_backward(x, x, big_table, plan,
                                                                                         [True, True, True])),
        (rf"shift must be \(R, H\) = \({3 * T}, {H}\)",
         lambda: ops.rmsnorm_backward.plan(x, x, w, big_table, big_table, plan, rstd, 1e-5, "portable",
                                           [True, True, True, True])),
        ("x must be contiguous",
         lambda: ops.rmsnorm_backward(x, broadcast((1, HUGE, H), bf16), w, None, None, None, rstd, 1e-5,
                                      "portable", [True, True, False, False])),
        ("grad must be contiguous",
         lambda: ops.linear_backward(broadcast((HUGE, 8)), normal((4, 16), 1), normal((8, 16), 2), torch.empty(0),
                                     "none", "portable", [True, True, True])),
        ("grad must be contiguous", lambda: ops.adaln_row_gather_backward(broadcast((6, HUGE, H), bf16), plan)),
        ("temb must be contiguous",
         lambda: ops.adaln_modulation_backward(normal((6, S, H), 3, bf16), broadcast((HUGE, 8)),
                                               normal((18 * H, 8), 4, bf16), normal((T, 8), 5, bf16), plan,
                                               "portable", [True, True, True])),
        ("x must be contiguous",
         lambda: ops.layernorm_backward.forms(x, broadcast((1, HUGE, H), bf16), None, None, None, None, None, rstd,
                                              rstd, 1e-5, "portable", True, [True] * 5)),
        (f"shift has F = {HUGE} frames, which must divide S", lambda: ops.layernorm_backward.forms(
            x, x, None, None, broadcast((1, HUGE, H), bf16), None, None, rstd, rstd, 1e-5, "portable", False,
            [True] * 5)),
        ("y must be contiguous",
         lambda: ops.gate_residual_layernorm_backward(x, None, broadcast((1, HUGE, H), bf16), None, None, None, None,
                                                      None, None, x, rstd, rstd, 1e-5, "portable", False, None,
                                                      [True] * 7)),
    ]


@pytest.mark.parametrize("index", range(9))
def test_backward_ops_refuse_before_allocating(case, index):
    message, call = backward_cases(case)[index]
    with pytest.raises(ValueError, match="^" + message):
        call()


def mismatch_cases():
    """(the error, the call) for an output sized from two real inputs whose shared dim differs:
    the output would take terabytes (a matrix product's (T, N) from 2**20 rows each, a table
    gradient's (R, H) from a plan of 2**28 rows); the mismatch is refused before it is sized."""
    big = 2 ** 20
    plan = detdit.plan_from_rows(torch.zeros(4, dtype=torch.int64), 2 ** 28)  # S = 4, R = 2**28
    x, w = normal((1, 4, 64), 110, bf16), torch.ones(64, dtype=bf16)
    small_table = torch.zeros(3, 64, dtype=bf16)
    return [
        (r"weight must be \(N, K\) = \(\*, 8\)", lambda: detdit.linear(torch.zeros(big, 8), torch.zeros(big, 16))),
        (r"weight must be \(N, D\) with temb's D = \(\*, 8\)",
         lambda: detdit.adaln_projection(torch.zeros(big, 8), torch.zeros(big, 16, dtype=bf16),
                                         torch.zeros(big, dtype=bf16))),
        (r"w1 must be \(H, K\) = \(\*, 8\)",
         lambda: detdit.timestep_mlp(torch.zeros(big, 8), torch.zeros(big, 16), torch.zeros(big), torch.zeros(8, big),
                                     torch.zeros(8))),
        (r"shift must be \(R, H\) = \(268435456, 64\)",
         lambda: ops.rmsnorm_backward.plan(x, x, w, small_table, small_table, plan, torch.ones(4), 1e-5, "portable",
                                           [True, True, True, True])),
    ]


@pytest.mark.parametrize("index", range(4))
def test_outputs_of_two_inputs_are_sized_only_once_their_shared_dims_agree(index):
    message, call = mismatch_cases()[index]
    with pytest.raises(ValueError, match="^" + message):
        call()


# ---------------------------------------------------------------------------
# item 10: TypeError for an argument of the wrong type; ValueError naming the argument

def type_cases(case):
    """(the TypeError's message, the call) for an argument of the wrong type to each wrapper."""
    x, w, plan, ti, tags, table = case["x"], case["w"], case["plan"], case["ti"], case["tags"], case["table"]
    return [
        ("rmsnorm: weight must be a torch.Tensor, got NoneType", lambda: detdit.rmsnorm(x, None)),
        ("plan: num_timesteps must be an int, got float", lambda: detdit.plan(ti, tags, float(case["T"]))),
        ("plan: batch must be an int, got bool", lambda: detdit.plan(ti, tags, case["T"], batch=True)),
        ("plan_from_rows: num_rows must be an int, got str", lambda: detdit.plan_from_rows(ti, "2")),
        ("linear: activation must be a str, got NoneType",
         lambda: detdit.linear(normal((1, 8), 1), normal((4, 8), 2), activation=None)),
        ("rmsnorm: plan must be a detdit IndexPlan", lambda: detdit.rmsnorm(x, w, table, table, ti)),
        ("gate_residual_rmsnorm: plan must be a detdit IndexPlan",
         lambda: detdit.gate_residual_rmsnorm(x, x, table, w, plan=ti)),
        ("rmsnorm: eps must be a real number, got str", lambda: detdit.rmsnorm(x, w, eps="abc")),
        ("gate_residual_rmsnorm: eps must be a real number, got str",
         lambda: detdit.gate_residual_rmsnorm(x, x, table, w, plan=plan, eps="abc")),
        ("timestep_sinusoid: num_channels must be an int, got float",
         lambda: detdit.timestep_sinusoid(torch.tensor([0.5]), num_channels=256.0)),
        ("timestep_sinusoid: max_period must be a real number, got str",
         lambda: detdit.timestep_sinusoid(torch.tensor([0.5]), max_period="1e4")),
        ("timestep_sinusoid: check_range must be a bool, got int",
         lambda: detdit.timestep_sinusoid(torch.tensor([0.5]), check_range=1)),
        ("adaln_projection: bias must be a torch.Tensor, got NoneType",
         lambda: detdit.adaln_projection(normal((1, 8), 1), normal((18, 8), 2, bf16), None)),
        ("gate_residual: gate must be a torch.Tensor or None, got list", lambda: detdit.gate_residual(x, x, [1.0], plan)),
        ("adaln_table_chunks: hidden must be an int, got float",
         lambda: detdit.adaln_table_chunks(normal((2, 18 * 16), 3, bf16), 16.0)),
        ("adaln_row_gather: rows must be a torch.Tensor, got NoneType", lambda: detdit.adaln_row_gather(None, plan)),
    ]


@pytest.mark.parametrize("index", range(16))
def test_wrong_argument_types_are_type_errors(case, index):
    message, call = type_cases(case)[index]
    with pytest.raises(TypeError, match="^" + re.escape(message)):
        call()


def test_numeric_arguments_still_take_ints_floats_and_numpy_scalars(case):
    x, w = case["x"], case["w"]
    expected = detdit.rmsnorm(x, w)
    assert torch.equal(detdit.rmsnorm(x, w, eps=1e-5), expected)
    assert detdit.timestep_sinusoid(torch.tensor([0.5]), max_period=10000).shape == (1, 256)
    np = pytest.importorskip("numpy")
    assert torch.equal(detdit.rmsnorm(x, w, eps=np.float64(1e-5)), expected)


def test_adaln_table_chunks_of_the_wrong_layout_are_value_errors():
    table = normal((2, 18 * 16), 1, bf16)
    with pytest.raises(ValueError, match=r"^adaln_table_chunks: table must be \(T, 18 \* hidden\) = \(T, 126\)"):
        detdit.adaln_table_chunks(table, 7)
    with pytest.raises(ValueError, match="^adaln_table_chunks: table must be"):
        detdit.adaln_table_chunks(table, 0)
    with pytest.raises(ValueError, match="^adaln_table_chunks: table must be"):
        detdit.adaln_table_chunks(table.view(-1), 16)
    with pytest.raises(ValueError, match="^adaln_table_chunks: table must be contiguous"):
        detdit.adaln_table_chunks(normal((4, 18 * 16), 2, bf16)[::2], 16)
    chunks = detdit.adaln_table_chunks(table, 16)
    assert len(chunks) == 6 and all(c.shape == (6, 16) for c in chunks)


# ---------------------------------------------------------------------------
# item 11: int64 arguments the library takes as int are range-checked, never truncated

def test_sp_plan_world_and_rank_are_range_checked(case):
    plan = case["plan"]
    with pytest.raises(ValueError, match="^world must fit in a 32-bit int, got 4294967298"):
        ops.sp_plan(plan, 2 ** 32 + 2, 1)
    with pytest.raises(ValueError, match="^rank must fit in a 32-bit int, got 4294967296"):
        ops.sp_plan(plan, 2, 2 ** 32)
    with pytest.raises(ValueError, match="^world must fit in a 32-bit int, got -4294967294"):
        ops.sp_plan(plan, -2 ** 32 + 2, 0)
    assert ops.sp_plan(plan, 2, 1).world() == 2


# ---------------------------------------------------------------------------
# item 12: a malformed device string is a ValueError, not an aborted interpreter

@pytest.mark.parametrize("device", ["cuda:x", "cuda:", "cuda:-1", "cuda:1x", "cudax", "cuda0",
                                    "cuda:99999999999999999999", "gpu"])
def test_register_communicator_refuses_a_malformed_device(device):
    # in a child process: before the fix "cuda:x" aborted the interpreter (std::stoi threw
    # through the CPython frame), which would take the test run down with it
    script = ("import detdit\n"
              "try:\n"
              f"    detdit._C._register_communicator(lambda s, r: None, 0, 1, {device!r})\n"
              "except ValueError as e:\n"
              "    print('ValueError:', e)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"ValueError: device must be 'cpu', 'cuda' or 'cuda:N', got '{device}'" in done.stdout, done.stdout


def test_register_communicator_takes_cpu_and_cuda_ordinals():
    for device in ["cpu", "cuda", "cuda:0", "cuda:3"]:
        handle = detdit._C._register_communicator(lambda s, r: None, 0, 1, device)
        detdit._C._release_communicator(handle)


# ---------------------------------------------------------------------------
# Python-level mistakes get their kind: meta tensors, ints past int64, a missing plan, a device
# that is not one (the table of tests/python/test_mutation.py mutates every tensor argument)

def test_every_op_with_a_tensor_argument_refuses_a_meta_tensor_at_the_meta_key():
    from detdit import _compile
    for name in _compile.FAKE_KERNELS:
        if not name.startswith("plan_handle"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"detdit::{name}", "Meta"), name
    meta = torch.empty(4, 8, device="meta")
    # a backward op has no Autograd kernel: torch 1.x would stop at AutogradMeta
    with pytest.raises(ValueError, match="^grad must be a CPU or CUDA tensor, got one on meta$"):
        ops.linear_backward(meta, torch.zeros(4, 8), torch.zeros(8, 8), torch.empty(0), "none", "portable",
                            [True, True, True])
    with pytest.raises(ValueError, match="^weight must be a CPU or CUDA tensor, got one on meta$"):
        detdit.linear(torch.zeros(4, 8), torch.empty(8, 8, device="meta").requires_grad_())


def test_fake_tensors_still_pass_the_fake_kernels():
    # the meta refusal is for eager calls: tracing's FakeTensors are meta tensors underneath
    from detdit import _compile
    if _compile.REASON is not None:
        pytest.skip(_compile.REASON)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        out = detdit.linear(torch.empty(4, 16), torch.empty(8, 16))
    assert out.shape == (4, 8)


def test_ints_past_int64_are_value_errors_naming_them():
    t = torch.tensor([0.5])
    for value in (2 ** 63, -2 ** 63 - 1):
        with pytest.raises(ValueError, match=f"^timestep_sinusoid: num_channels must fit in a 64-bit int, got {value}$"):
            detdit.timestep_sinusoid(t, num_channels=value)
    # in int64, but (T, num_channels) float32 would overflow torch's byte count
    with pytest.raises(ValueError, match="^num_channels = 4611686018427387904 makes the"):
        detdit.timestep_sinusoid(t, num_channels=2 ** 62)
    with pytest.raises(ValueError, match="^plan: num_timesteps must fit in a 64-bit int"):
        detdit.plan(torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), 2 ** 63)


def test_shard_rows_range_checks_and_type_checks():
    shard_rows = detdit.distributed.shard_rows
    with pytest.raises(ValueError, match="^world must fit in a 32-bit int, got 4294967298$"):
        shard_rows(1152, 2 ** 32 + 2, 0)
    with pytest.raises(ValueError, match="^rank must fit in a 32-bit int, got 4294967296$"):
        shard_rows(1152, 2, 2 ** 32)
    with pytest.raises(ValueError, match="^shard_rows: out_features must fit in a 64-bit int"):
        shard_rows(2 ** 64, 2, 0)
    with pytest.raises(TypeError, match="^shard_rows: world must be an int, got float$"):
        shard_rows(1152, 2.0, 0)
    assert shard_rows(1152, 2, 1) == slice(576, 1152)


def test_a_missing_plan_to_the_raw_sp_plan_op_is_the_librarys_value_error():
    with pytest.raises(ValueError, match=r"^sp_plan needs an IndexPlan \(detdit.plan\(...\)\), got None$"):
        ops.sp_plan(None, 2, 0)


def test_release_scratch_memory_takes_a_device_or_a_str_only():
    with pytest.raises(ValueError, match="^release_scratch_memory: device must be a cpu or cuda device, got 'gpu'$"):
        detdit.release_scratch_memory("gpu")
    for value in (5, True, None):  # torch.device(5) is cuda:5: an int is refused, not read as an index
        with pytest.raises(TypeError, match="^release_scratch_memory: device must be a torch.device or a str"):
            detdit.release_scratch_memory(value)
    assert detdit.release_scratch_memory(torch.device("cpu")) is None


def test_every_listed_case_is_parametrized(case):
    # the parametrize ranges above must cover the case lists
    assert (len(forward_cases(case)), len(backward_cases(case)), len(type_cases(case))) == (12, 9, 16)
