"""Bad inputs raise the Python exception of their kind with the library's message:
TypeError (dtype), ValueError (shape, size, range, device, layout, profile), IndexError
(index entries), RuntimeError (unsupported requests such as double backward)."""
import pytest
import torch

import detdit
from conftest import normal

ops = torch.ops.detdit


@pytest.fixture
def case(modulated_rows):
    return modulated_rows  # conftest.py: an exported C++ case's inputs, S = 255, T = 3, H = 12


def test_type_errors(case):
    with pytest.raises(TypeError, match="float64|double"):
        detdit.rmsnorm(case["x"].double(), case["w"].double())
    with pytest.raises(TypeError, match="temb"):  # the SiLU runs before the cast: temb must be FP32
        detdit.adaln_projection(normal((1, 8), 1, torch.bfloat16), normal((18, 8), 2, torch.bfloat16),
                                normal((18,), 3, torch.bfloat16))
    with pytest.raises(TypeError):  # the time embedder is an FP32 module
        bf = torch.bfloat16
        detdit.timestep_mlp(normal((1, 8), 4), normal((8, 8), 5, bf), normal((8,), 6, bf), normal((8, 8), 7, bf),
                            normal((8,), 8, bf))
    with pytest.raises(TypeError, match="share an integer dtype"):
        detdit.plan(case["ti"].int(), case["tags"], case["T"])
    with pytest.raises(TypeError, match="weight"):
        detdit.rmsnorm(case["x"], case["w"].float())
    with pytest.raises(TypeError, match="numerics"):
        detdit.rmsnorm(case["x"], case["w"], numerics=None)
    with pytest.raises(TypeError, match="plan must be a detdit IndexPlan"):
        detdit.gate_residual(case["x"], case["x"], case["table"], case["ti"])


def test_value_errors(case):
    x, w, plan = case["x"], case["w"], case["plan"]
    with pytest.raises(ValueError, match=r"\[0, 1\]"):  # the t*1000 convention fails closed
        detdit.timestep_sinusoid(torch.tensor([0.5, 999.0]))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        detdit.timestep_sinusoid(torch.tensor([float("nan")]))
    with pytest.raises(ValueError, match="CUDA only|cuda"):
        detdit.rmsnorm(x, w, numerics="torch")
    with pytest.raises(ValueError, match="numerics must be 'portable' or 'torch'"):
        detdit.rmsnorm(x, w, numerics="fast")
    with pytest.raises(ValueError, match="activation must be"):
        detdit.linear(normal((1, 8), 9), normal((4, 8), 10), activation="gelu")
    with pytest.raises(ValueError, match="weight"):
        detdit.rmsnorm(x, torch.ones(x.shape[-1] - 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError):  # not contiguous
        detdit.rmsnorm(x.transpose(1, 2).contiguous().transpose(1, 2), w)
    with pytest.raises(ValueError):  # H % 4 != 0: torch leaves the vectorized path; detdit refuses
        detdit.rmsnorm(normal((1, 40, 18), 12, torch.bfloat16), torch.ones(18, dtype=torch.bfloat16))
    # without a plan the gate takes the grouped forms: a table is refused, saying why
    with pytest.raises(ValueError, match=r"plan is required for an \(R, H\) table"):
        detdit.gate_residual(x, x, case["table"], None)
    with pytest.raises(ValueError):  # modulation without a plan
        detdit.rmsnorm(x, w, case["table"], case["table"])
    with pytest.raises(ValueError):  # the plan says 1 x S positions, x has 2 x S
        detdit.gate_residual(torch.cat([x, x]), torch.cat([x, x]), case["table"], plan)
    with pytest.raises(ValueError, match="not a multiple of 6"):
        detdit.adaln_row_gather(normal((3 * case["T"], 13), 13), plan)  # R right, 13 columns
    with pytest.raises(ValueError, match="num_channels"):
        detdit.timestep_sinusoid(torch.tensor([0.5]), num_channels=0)
    with pytest.raises(ValueError, match="0-D|dimensions"):
        detdit.timestep_sinusoid(torch.tensor(0.5))
    with pytest.raises(ValueError, match=r"lie in \[0, t_max\] = \[0, 1000\] \(got timesteps\[1\] = 1001\)"):
        detdit.timestep_sinusoid(torch.tensor([0.5, 1001.0]), t_max=1000)
    with pytest.raises(ValueError, match="exceeds 1e6"):
        detdit.timestep_sinusoid(torch.tensor([0.5]), scale=1000, t_max=1001)


def test_index_errors(case):
    ti, tags = case["ti"], case["tags"]
    bad_tags = tags.clone()
    bad_tags[7] = 3  # a 4th modality
    with pytest.raises(IndexError, match=r"token_tags\[7\] = 3"):
        detdit.plan(ti, bad_tags, case["T"])
    bad_ti = ti.clone()
    bad_ti[5] = case["T"]  # a timestep offset past T
    with pytest.raises(IndexError, match=rf"timestep_indices\[5\] = {case['T']}"):
        detdit.plan(bad_ti, tags, case["T"])
    with pytest.raises(IndexError, match=r"row_index\[0\] = -1"):
        detdit.plan_from_rows(torch.tensor([-1, 0]), 3)
    with pytest.raises(IndexError):
        detdit.plan_from_rows(torch.tensor([0, 3]), 3)


def test_double_backward_is_refused(case):
    x = case["x"].float().requires_grad_(True)
    out = detdit.rmsnorm(x, case["w"].float())
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=False)  # first order is fine
    assert torch.isfinite(g).all()
    with pytest.raises(RuntimeError, match="first-order"):
        torch.autograd.grad(detdit.rmsnorm(x, case["w"].float()).sum(), x, create_graph=True)


def test_failed_call_leaves_inputs_unchanged(case):
    x, table = case["x"], case["table"]
    before = [t.clone() for t in (x, table)]
    with pytest.raises(ValueError):
        detdit.gate_residual(x, x[:, :20], table, case["plan"])
    for t, b in zip((x, table), before):
        assert torch.equal(t, b)


def test_release_scratch_memory_takes_a_cpu_or_cuda_device():
    assert detdit.release_scratch_memory("cpu") is None  # the CPU has no pool: nothing to do
    with pytest.raises(ValueError, match="release_scratch_memory: device must be a cpu or cuda device, got meta"):
        detdit.release_scratch_memory("meta")
    with pytest.raises(RuntimeError, match=r"release_scratch_memory\(cuda:100\)"):  # no such device, or no CUDA
        detdit.release_scratch_memory(torch.device("cuda", 100))
