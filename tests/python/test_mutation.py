"""Every public call of the detdit package that takes tensors, every tensor argument, every
mutation: the exception of the mutation's kind (docs/python.md, Errors) with a message that
names the argument, and no input changed, not one byte (the inputs' memory is compared before
and after, a strided view's whole base included).

The mutations: a dtype detdit takes nowhere (float64), one dimension more, a size of one less
in the last dimension, a strided view (where the argument must be contiguous), a meta tensor,
a CUDA tensor among CPU ones (skipped without a GPU), None (where the argument is required),
an int and a float. detdit.distributed's calls need a process group: test_distributed.py."""
import re

import pytest
import torch

import detdit
from conftest import normal, packing

bf16 = torch.bfloat16
# The mutations, (name, the kind it raises).
MUTATIONS = [("dtype", TypeError), ("rank", ValueError), ("size", ValueError), ("strided", ValueError),
             ("meta", ValueError), ("cuda", ValueError), ("none", TypeError), ("int", TypeError),
             ("float", TypeError)]


def inputs():
    """One valid argument set: S = 40 positions, T = 2 timesteps, H = 16, D = 16."""
    ti, tags = packing(40, 2, 100)
    return {"ti": ti, "tags": tags, "plan": detdit.plan(ti, tags, 2), "tplan": detdit.plan_from_rows(ti, 2),
            "x": normal((1, 40, 16), 1, bf16), "y": normal((1, 40, 16), 2, bf16), "w": normal((16,), 3, bf16),
            "table": normal((6, 16), 4, bf16), "table2": normal((6, 16), 5, bf16), "t": torch.tensor([0.25, 0.5]),
            "temb": normal((2, 16), 6), "pw": normal((288, 16), 7, bf16), "pb": normal((288,), 8, bf16),
            "fw": normal((32, 16), 9, bf16), "fb": normal((32,), 10, bf16), "rows": normal((6, 96), 11, bf16),
            "f": normal((2, 16), 12), "w1": normal((32, 16), 13), "b1": normal((32,), 14),
            "w2": normal((16, 32), 15), "b2": normal((16,), 16), "lx": normal((4, 16), 17),
            "lw": normal((8, 16), 18), "lb": normal((8,), 19), "ptable": normal((2, 288), 20, bf16)}


def rmsnorm_module(x):
    module = detdit.nn.RMSNorm(16)
    return module(x)


def modulation_module(temb, plan):
    module = detdit.nn.AdaLNModulation(16, 16)
    return module(temb, plan)


# The table: (call, its arguments by name, a str naming an entry of inputs(), {tensor argument:
# what it takes}). What an argument takes: "c" it must be contiguous, "o" None is allowed;
# "MUTATION=NAME": that mutation's message names NAME, the argument it is checked against (the
# one the op's shapes are read from: x's K against weight's); "MUTATION=any": that mutation is
# a valid call (a size nothing else has; the call's only tensor, on CUDA).
TABLE = [
    (detdit.plan, dict(timestep_indices="ti", token_tags="tags", num_timesteps=2),
     {"timestep_indices": "c", "token_tags": "c"}),
    (detdit.plan_from_rows, dict(row_index="ti", num_rows=2), {"row_index": "c size=any cuda=any"}),
    (detdit.timestep_sinusoid, dict(timesteps="t"), {"timesteps": "c size=any cuda=any"}),
    (detdit.linear, dict(x="lx", weight="lw", bias="lb"), {"x": "c size=weight", "weight": "c", "bias": "co"}),
    (detdit.timestep_mlp, dict(features="f", w1="w1", b1="b1", w2="w2", b2="b2"),
     {"features": "c size=w1", "w1": "c", "b1": "c", "w2": "c", "b2": "c"}),
    (detdit.adaln_projection, dict(temb="temb", weight="pw", bias="pb"), {"temb": "c", "weight": "c", "bias": "c"}),
    (detdit.adaln_table_chunks, dict(table="ptable", hidden=16), {"table": "c cuda=any"}),
    (detdit.adaln_row_gather, dict(rows="rows", index_plan="plan"), {"rows": ""}),
    (detdit.rmsnorm, dict(x="x", weight="w", shift="table", scale="table2", plan="plan"),
     {"x": "c", "weight": "c", "shift": "co", "scale": "co"}),
    (detdit.gate_residual, dict(residual="x", y="y", gate="table", plan="plan"),
     {"residual": "c", "y": "c", "gate": "c"}),
    (detdit.gate_residual_rmsnorm, dict(residual="x", y="y", gate="table", weight="w", shift="table",
                                        scale="table2", plan="plan"),
     {"residual": "c", "y": "c", "gate": "c", "weight": "c", "shift": "co", "scale": "co"}),
    (detdit.final_adaln_out, dict(x="x", norm_weight="w", temb="temb", weight="fw", bias="fb", plan="tplan"),
     {"x": "c size=norm_weight", "norm_weight": "c", "temb": "c", "weight": "c", "bias": "c"}),
    (detdit.adaln_modulation, dict(temb="temb", weight="pw", bias="pb", plan="plan"),
     {"temb": "c", "weight": "c", "bias": "c"}),
    (rmsnorm_module, dict(x="x"), {"x": "c"}),
    (modulation_module, dict(temb="temb", plan="plan"), {"temb": "c"}),
]

ROWS = {call.__name__: (call, arguments, tensors) for call, arguments, tensors in TABLE}
CASES = [(call.__name__, argument, mutation, kind) for call, _, tensors in TABLE for argument in tensors
         for mutation, kind in MUTATIONS]


def mutated(t, mutation):
    """t mutated (see the module docstring); the strided view also returns its base."""
    if mutation == "dtype":
        return t.double(), None
    if mutation == "rank":
        return t[None].clone(), None
    if mutation == "size":
        return t[..., :-1].clone(), None
    if mutation == "strided":
        base = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        view = base[..., ::2]
        view.copy_(t)
        return view, base
    if mutation == "meta":
        return torch.empty_like(t, device="meta"), None
    if mutation == "cuda":
        return t.cuda(), None
    return {"none": None, "int": 3, "float": 0.5}[mutation], None


def memory(t):
    """The bytes of t's memory on the host."""
    return t.detach().cpu().contiguous().view(-1).view(torch.uint8).clone()


@pytest.mark.parametrize("name,argument,mutation,kind", CASES, ids=[f"{n}-{a}-{m}" for n, a, m, _ in CASES])
def test_a_mutated_argument_is_refused_naming_it_and_changes_nothing(name, argument, mutation, kind):
    call, arguments, tensors = ROWS[name]
    flags, *overrides = tensors[argument].split() or [""]
    named = dict(override.split("=") for override in overrides).get(mutation, argument)
    if mutation == "strided" and "c" not in flags:
        pytest.skip(f"{argument} of {name} may be strided")
    if mutation == "none" and "o" in flags:
        pytest.skip(f"{argument} of {name} is optional")
    if named == "any":
        pytest.skip(f"{argument} of {name}: the {mutation} mutation is a valid call")
    if mutation == "cuda" and not torch.cuda.is_available():
        pytest.skip("a CUDA tensor among CPU ones needs a CUDA GPU and a CUDA build of torch "
                    "(torch.cuda.is_available() is False)")
    values = inputs()
    args = {key: values[value] if isinstance(value, str) else value for key, value in arguments.items()}
    args[argument], base = mutated(args[argument], mutation)
    checked = [t for t in list(args.values()) + [base] if isinstance(t, torch.Tensor) and not t.is_meta]
    before = [memory(t) for t in checked]
    with pytest.raises(kind) as error:
        call(**args)
    assert re.search(rf"\b{named}\b", str(error.value)), f"the message does not name {named}: {error.value}"
    for t, b in zip(checked, before):
        assert torch.equal(memory(t), b), "an input changed"
