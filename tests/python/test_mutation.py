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
from op_cases import find, table_chunk

bf16 = torch.bfloat16
# The mutations, (name, the kind it raises).
MUTATIONS = [("dtype", TypeError), ("rank", ValueError), ("size", ValueError), ("strided", ValueError),
             ("meta", ValueError), ("cuda", ValueError), ("none", TypeError), ("int", TypeError),
             ("float", TypeError)]


def inputs(cases):
    """One valid argument set (fresh copies), from the exported C++ op cases (op_cases fixture):
    the row-wise ops and the AdaLN projections at H = 20, D = 24, T = 3 on the interleaved
    sequence of S = 257, B = 2 (op_cases.NAMED), a linear, the MLP and the sinusoid's small
    cases. ptable, a (T, 18H) table, is adaln_modulation's table output."""
    norm = find(cases, "rmsnorm", "modulated bfloat16 H=20 interleaved_S257_T3_B2")
    gate = find(cases, "gate_residual", "bfloat16 H=20 interleaved_S257_T3_B2 contiguous gate")
    modulation = find(cases, "adaln_modulation", "bfloat16 H=20 D=24 interleaved_S257_T3_B2")
    final = find(cases, "final_adaln_out", "bfloat16 H=20 D=24 interleaved_S257_T3_B2")
    gather = find(cases, "adaln_row_gather", "bfloat16 H=20 interleaved_S257_T3_B2")
    mlp = find(cases, "timestep_mlp", "T=3 K=24 H=72 D=64")
    linear = find(cases, "linear", "float32 T=3 K=8 N=64 bias silu out float32")
    sinusoid = find(cases, "timestep_sinusoid", "float32 T=8192 C=2")
    index = norm.plans["plan"]
    rows = (index["batch"], index["seq_len"], norm["x"].shape[-1])
    ti, tags = norm.index()
    values = {"ti": ti, "tags": tags, "x": norm["x"].view(rows), "y": gate["y"].view(rows), "w": norm["weight"],
              "table": gate["table"], "table2": table_chunk(norm["table"], rows[2], 1).contiguous(),
              "t": sinusoid["timesteps"], "temb": modulation["temb"], "pw": modulation["weight"],
              "pb": modulation["bias"], "fw": final["weight"], "fb": final["bias"], "rows": gather["rows_storage"],
              "f": mlp["features"], "w1": mlp["w1"], "b1": mlp["b1"], "w2": mlp["w2"], "b2": mlp["b2"],
              "lx": linear["x"], "lw": linear["weight"], "lb": linear["bias"], "ptable": modulation["table"]}
    values = {k: v.clone() for k, v in values.items()}
    values.update(plan=norm.plan(), tplan=final.plan(), T=index["num_timesteps"], hidden=rows[2],
                  dim=modulation["temb"].shape[-1])
    return values


def rmsnorm_module(x, hidden):
    module = detdit.nn.RMSNorm(hidden)
    return module(x)


def modulation_module(temb, plan, hidden, dim):
    module = detdit.nn.AdaLNModulation(hidden, dim)
    return module(temb, plan)


# The table: (call, its arguments by name, each a str naming an entry of inputs(), {tensor argument:
# what it takes}). What an argument takes: "c" it must be contiguous, "o" None is allowed;
# "MUTATION=NAME": that mutation's message names NAME, the argument it is checked against (the
# one the op's shapes are read from: x's K against weight's); "MUTATION=any": that mutation is
# a valid call (a size nothing else has; the call's only tensor, on CUDA).
TABLE = [
    (detdit.plan, dict(timestep_indices="ti", token_tags="tags", num_timesteps="T"),
     {"timestep_indices": "c", "token_tags": "c"}),
    (detdit.plan_from_rows, dict(row_index="ti", num_rows="T"), {"row_index": "c size=any cuda=any"}),
    (detdit.timestep_sinusoid, dict(timesteps="t"), {"timesteps": "c size=any cuda=any"}),
    (detdit.linear, dict(x="lx", weight="lw", bias="lb"), {"x": "c size=weight", "weight": "c", "bias": "co"}),
    (detdit.timestep_mlp, dict(features="f", w1="w1", b1="b1", w2="w2", b2="b2"),
     {"features": "c size=w1", "w1": "c", "b1": "c", "w2": "c", "b2": "c"}),
    (detdit.adaln_projection, dict(temb="temb", weight="pw", bias="pb"), {"temb": "c", "weight": "c", "bias": "c"}),
    (detdit.adaln_table_chunks, dict(table="ptable", hidden="hidden"), {"table": "c cuda=any"}),
    (detdit.adaln_row_gather, dict(rows="rows", index_plan="plan"), {"rows": ""}),
    (detdit.rmsnorm, dict(x="x", weight="w", shift="table", scale="table2", plan="plan"),
     {"x": "c", "weight": "c", "shift": "co", "scale": "co"}),
    (detdit.gate_residual, dict(residual="x", y="y", gate="table", plan="plan"),
     {"residual": "c size=gate", "y": "c", "gate": "co"}),  # no gate: the plain residual add
    (detdit.gate_residual_rmsnorm, dict(residual="x", y="y", gate="table", weight="w", shift="table",
                                        scale="table2", plan="plan"),
     {"residual": "c size=gate", "y": "c", "gate": "co", "weight": "c", "shift": "co", "scale": "co"}),
    (detdit.final_adaln_out, dict(x="x", norm_weight="w", temb="temb", weight="fw", bias="fb", plan="tplan"),
     {"x": "c size=norm_weight", "norm_weight": "c", "temb": "c", "weight": "c", "bias": "c"}),
    (detdit.adaln_modulation, dict(temb="temb", weight="pw", bias="pb", plan="plan"),
     {"temb": "c", "weight": "c", "bias": "c"}),
    (detdit.layernorm, dict(x="x", weight="w", bias="w", shift="table", scale="table2", plan="plan"),
     {"x": "c", "weight": "co", "bias": "co", "shift": "co", "scale": "co"}),
    (detdit.gate_residual_layernorm, dict(residual="x", y="y", gate="table", weight="w", bias="w", shift="table",
                                          scale="table2", plan="plan"),
     {"residual": "c size=gate", "y": "c", "gate": "co", "weight": "co", "bias": "co", "shift": "co", "scale": "co"}),
    (rmsnorm_module, dict(x="x", hidden="hidden"), {"x": "c"}),
    (modulation_module, dict(temb="temb", plan="plan", hidden="hidden", dim="dim"), {"temb": "c"}),
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
def test_a_mutated_argument_is_refused_naming_it_and_changes_nothing(op_cases, name, argument, mutation, kind):
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
    values = inputs(op_cases)
    args = {key: values[value] for key, value in arguments.items()}
    args[argument], base = mutated(args[argument], mutation)
    checked = [t for t in list(args.values()) + [base] if isinstance(t, torch.Tensor) and not t.is_meta]
    before = [memory(t) for t in checked]
    with pytest.raises(kind) as error:
        call(**args)
    assert re.search(rf"\b{named}\b", str(error.value)), f"the message does not name {named}: {error.value}"
    for t, b in zip(checked, before):
        assert torch.equal(memory(t), b), "an input changed"
