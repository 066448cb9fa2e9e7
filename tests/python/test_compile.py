"""detdit under torch.compile (detdit/_compile.py, docs/python.md):
- the plan's str()/repr() and __obj_flatten__ (the id dynamo guards on, never reused);
- every op's fake kernel gives the kernel's output metadata (shape, dtype, device, strides,
  which outputs are None), run directly with real tensors: any torch;
- the Python autograd of ops traced with a fake plan equals the C++ Functions bitwise
  (outputs, every gradient, which gradients are None): any torch;
- torch >= 2.4: torch.library.opcheck passes on every op (CPU, and CUDA when present); an H3
  block with the conditioning chain and final_adaln_out compiles with fullgraph=True into one
  graph with no break, and its outputs and every gradient are bitwise equal to eager (backend
  aot_eager, and inductor where it takes a plan input); the same under no_grad and under
  dynamic=True at two sequence lengths; the block given PlanTables compiles into a graph of
  tensor inputs only (aot_eager and inductor) equal to eager; CUDA: given PlanTables, recorded and
  replayed as CUDA graphs (mode="reduce-overhead"), with no cudagraph skipped, to the same bits.
  CI runs these on Debian 13's torch 2.6 (scripts/torch_compile_check.sh);
- plan tables, any torch: every `.tables` overload equals its plan overload, the wrappers'
  autograd with PlanTables equals the C++ Functions, and only a live plan's own unmodified
  tables are taken (copies, same bytes, parts, modified tables, a freed plan's: ValueError).
"""
import os
import re

import pytest
import torch
import torch.distributed as dist

import detdit
import detdit.distributed
from conftest import assert_bitwise_equal, exported_cases, normal, packing, requires_cuda
from detdit import _compile
from op_cases import find, table_chunk

ops = torch.ops.detdit
BATCH, SEQ, TIMESTEPS, HIDDEN, DIM = 2, 40, 2, 64, 16
BF = torch.bfloat16

requires_compile = pytest.mark.skipif(_compile.REASON is not None, reason=str(_compile.REASON))
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


def _inductor_takes_plan_inputs():
    """Whether this torch's inductor lowers a torch-class graph input (a plan): torch 2.6's
    GraphLowering.placeholder asserts that every input is a tensor, a symbol or a number; later
    torch wraps a FakeScriptObject input (ir.TorchBindObject)."""
    if _compile.REASON is not None:
        return False
    import inspect
    from torch._inductor.graph import GraphLowering
    return "FakeScriptObject" in inspect.getsource(GraphLowering.placeholder)


# The compiled-block tests run under both backends: aot_eager (dynamo and AOTAutograd, the graph
# run as traced: what a plan input meets) and inductor, where its placeholders take a plan.
BACKENDS = ["aot_eager", pytest.param("inductor", marks=pytest.mark.skipif(
    not _inductor_takes_plan_inputs(),
    reason=f"torch {torch.__version__}'s inductor takes no torch-class graph input (a plan): "
           "its GraphLowering.placeholder asserts a tensor"))]


@pytest.fixture(scope="module")
def comm():
    """A one-rank gloo group in this process: the sp_/tp_ ops' communicator."""
    if dist.is_initialized():
        pytest.skip("a torch.distributed group is already initialised in this process")
    # an in-memory store: no port, and no TCPStore (Debian's torch 2.6 has no libuv for it)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield detdit.distributed.Communicator()
    dist.destroy_process_group()


def inputs(device):
    """Representative inputs of every op on `device` (tensors do not require grad, fresh copies):
    the exported C++ op cases (conftest.exported_cases) of the row-wise ops and the AdaLN
    projections at H = 20, D = 24, T = 3 on the interleaved sequence of S = 257, B = 2, a bf16
    linear with bias and SiLU, the MLP and the sinusoid (C = 2) cases. gather_grad is item 0 of
    adaln_modulation's (6, B*S, H) gradient; table_grad, a (T, 18H) table gradient, is the
    values of adaln_modulation's table output."""
    cases = exported_cases()
    norm = find(cases, "rmsnorm", "modulated bfloat16 H=20 interleaved_S257_T3_B2")
    gate = find(cases, "gate_residual", "bfloat16 H=20 interleaved_S257_T3_B2 contiguous gate")
    modulation = find(cases, "adaln_modulation", "bfloat16 H=20 D=24 interleaved_S257_T3_B2")
    final = find(cases, "final_adaln_out", "bfloat16 H=20 D=24 interleaved_S257_T3_B2")
    gather = find(cases, "adaln_row_gather", "bfloat16 H=20 interleaved_S257_T3_B2")
    mlp = find(cases, "timestep_mlp", "T=3 K=24 H=72 D=64")
    bf16_mlp = find(cases, "timestep_mlp", "bfloat16 T=3 K=32 H=48 D=48")
    text = find(cases, "timestep_mlp", "bfloat16 T=3 K=24 H=48 D=48")  # the pooled-text embedder's layout
    linear = find(cases, "linear", "bfloat16 T=3 K=24 N=64 bias silu out bfloat16")
    sinusoid = find(cases, "timestep_sinusoid", "float32 T=8192 C=2")
    index = norm.plans["plan"]
    seq, hidden = index["seq_len"], norm["x"].shape[-1]
    rows = (index["batch"], seq, hidden)
    values = dict(
        t=sinusoid["timesteps"], f_grad=sinusoid["grad_features"],
        x=norm["x"].view(rows), y=gate["y"].view(rows), grad=norm["grad"].view(rows), w=norm["weight"],
        table=gate["table"], table2=table_chunk(norm["table"], hidden, 1).contiguous(),
        temb=modulation["temb"], pw=modulation["weight"], pb=modulation["bias"], fw=final["weight"],
        fb=final["bias"], lx=linear["x"], lw=linear["weight"], lb=linear["bias"], lg=linear["grad"],
        f=mlp["features"], w1=mlp["w1"], b1=mlp["b1"], w2=mlp["w2"], b2=mlp["b2"], temb_grad=mlp["grad_temb"],
        bf=bf16_mlp["features"], bw1=bf16_mlp["w1"], bb1=bf16_mlp["b1"], bw2=bf16_mlp["w2"], bb2=bf16_mlp["b2"],
        btemb_grad=bf16_mlp["grad_temb"], pooled=text["features"], tw1=text["w1"], tb1=text["b1"], tw2=text["w2"],
        tb2=text["b2"], out_grad=text["grad_temb"],
        rows=gather["rows_storage"], gather_grad=modulation["grad"][:, :seq], table_grad=modulation["table"])
    values = {k: v.contiguous().clone().to(device) for k, v in values.items()}
    values.update(plan=norm.plan(device=device), tplan=final.plan(device=device))
    return values


def op_cases(device, comm=None):
    """(case name, op overload, args) for every op: forward ops, and backward ops on their
    forward's saved tensors with several output masks. The sp_/tp_ ops need `comm` (CPU)."""
    i = inputs(device)
    x, y, w, grad, plan, eps, p = i["x"], i["y"], i["w"], i["grad"], i["plan"], 1e-5, "portable"
    T, T2 = i["table"], i["table2"]
    _, pre = ops.linear.default(i["lx"], i["lw"], i["lb"], "silu", p)
    _, mlp_pre, mlp_hidden = ops.timestep_mlp.default(i["f"], i["w1"], i["b1"], i["w2"], i["b2"], p)
    bf16_mlp = (i["bf"], i["bw1"], i["bb1"], i["bw2"], i["bb2"])
    _, bf16_pre, bf16_hidden = ops.timestep_mlp.default(*bf16_mlp, p)
    text = (i["pooled"], i["tw1"], i["tb1"], i["tw2"], i["tb2"])
    _, text_pre, text_hidden = ops.timestep_mlp.default(*text, p)
    _, act = ops.adaln_projection.default(i["temb"], i["pw"], i["pb"], p)
    _, rstd = ops.rmsnorm.plan(x, w, T, T2, plan, eps, p)
    _, plain_rstd = ops.rmsnorm.default(x, w, None, None, None, eps, p)
    h, _, h_rstd = ops.gate_residual_rmsnorm.default(x, y, T, w, T2, T, plan, eps, p)
    _, f_table, f_act, f_rstd = ops.final_adaln_out.default(x, w, i["temb"], i["fw"], i["fb"], i["tplan"], eps, p)
    _, _, m_act = ops.adaln_modulation.default(i["temb"], i["pw"], i["pb"], plan, p)
    # the modulation forms (`.forms`): per-sample views of a (B, 6, H) fp32 tensor, no plan
    batch, hidden = x.shape[0], x.shape[-1]
    mod = torch.linspace(-0.5, 0.5, batch * 6 * hidden, device=device).view(batch, 6, hidden)
    shift, scale, gate = mod[:, 0], mod[:, 1], mod[:, 2:3]
    _, forms_rstd = ops.rmsnorm.forms(x, w, shift, scale, None, eps, p, True)
    _, ln_mean, ln_rstd = ops.layernorm.forms(x, w, w, shift, scale, None, eps, p, True)
    gr_h, _, gr_rstd = ops.gate_residual_rmsnorm.forms(x, y, gate, w, mod[:, 3], mod[:, 4], None, eps, p, True, 1.0)
    _, gl_h, gl_mean, gl_rstd = ops.gate_residual_layernorm.default(x, y, gate, w, w, shift, scale, None, eps, p, True,
                                                                    1.0)
    cases = [
        ("rmsnorm_forms", ops.rmsnorm.forms, (x, w, shift, scale, None, eps, p, False)),
        ("rmsnorm_forms_upcast", ops.rmsnorm.forms, (x, w, shift, scale, None, eps, p, True)),
        ("rmsnorm_backward_forms", ops.rmsnorm_backward.forms,
         (grad, x, w, shift, scale, None, forms_rstd, eps, p, True, [True] * 4)),
        ("gate_residual_forms", ops.gate_residual.forms, (x, y, gate, None, False, 1.0)),
        ("gate_residual_forms_no_gate", ops.gate_residual.forms, (x, y, None, None, True, None)),
        ("gate_residual_backward_forms", ops.gate_residual_backward.forms,
         (grad, y, gate, None, True, 1.0, [True] * 3)),
        ("gate_residual_rmsnorm_forms", ops.gate_residual_rmsnorm.forms,
         (x, y, gate, w, mod[:, 3], mod[:, 4], None, eps, p, True, 1.0)),
        ("gate_residual_rmsnorm_forms_no_gate", ops.gate_residual_rmsnorm.forms,
         (x, y, None, w, None, None, None, eps, p, False, None)),
        ("gate_residual_rmsnorm_backward_forms", ops.gate_residual_rmsnorm_backward.forms,
         (grad, grad, y, gate, w, mod[:, 3], mod[:, 4], None, gr_h, gr_rstd, eps, p, True, 1.0, [True] * 6)),
        ("gate_residual_rmsnorm_backward_forms_no_d_out", ops.gate_residual_rmsnorm_backward.forms,
         (None, grad, y, gate, w, mod[:, 3], mod[:, 4], None, gr_h, gr_rstd, eps, p, True, 1.0, [True] * 6)),
        ("layernorm", ops.layernorm.default, (x, w, w, eps, p)),
        ("layernorm_backward", ops.layernorm_backward.default,
         (grad, x, w, w, ln_mean, ln_rstd, eps, p, [True, False, True])),
        ("layernorm_forms", ops.layernorm.forms, (x, w, w, shift, scale, None, eps, p, False)),
        ("layernorm_forms_upcast", ops.layernorm.forms, (x, None, None, shift, scale, None, eps, p, True)),
        ("layernorm_backward_forms", ops.layernorm_backward.forms,
         (grad, x, w, w, shift, scale, None, ln_mean, ln_rstd, eps, p, True, [True] * 5)),
        ("gate_residual_layernorm", ops.gate_residual_layernorm.default,
         (x, y, gate, w, w, shift, scale, None, eps, p, True, 1.0)),
        ("gate_residual_layernorm_no_gate", ops.gate_residual_layernorm.default,
         (x, y, None, None, None, None, None, None, eps, p, False, None)),
        ("gate_residual_layernorm_backward", ops.gate_residual_layernorm_backward.default,
         (grad, grad, y, gate, w, w, shift, scale, None, gl_h, gl_mean, gl_rstd, eps, p, True, 1.0, [True] * 7)),
        ("gate_residual_layernorm_backward_no_d_h", ops.gate_residual_layernorm_backward.default,
         (grad, None, y, gate, w, w, shift, scale, None, gl_h, gl_mean, gl_rstd, eps, p, True, 1.0, [True] * 7)),
        ("gate_residual_layernorm_backward_no_d_out", ops.gate_residual_layernorm_backward.default,
         (None, grad, y, gate, w, w, shift, scale, None, gl_h, gl_mean, gl_rstd, eps, p, True, 1.0, [True] * 7)),
        ("timestep_sinusoid", ops.timestep_sinusoid.default, (i["t"], i["f_grad"].shape[1], 10000.0, p, True)),
        ("timestep_sinusoid_backward", ops.timestep_sinusoid_backward.default, (i["f_grad"], i["t"], 10000.0, p, True)),
        ("timestep_sinusoid_conventions", ops.timestep_sinusoid.default,
         (i["t"], 3, 10000.0, p, True, False, 0.5, 1000.0, 1.0)),
        ("timestep_sinusoid_backward_conventions", ops.timestep_sinusoid_backward.default,
         (i["f_grad"], i["t"], 10000.0, p, True, False, 0.5, 1000.0, 1.0)),
        ("linear", ops.linear.default, (i["lx"], i["lw"], i["lb"], "silu", p)),
        ("linear_none", ops.linear.default, (i["lx"], i["lw"], None, "none", p)),
        ("linear_backward", ops.linear_backward.default, (i["lg"], i["lx"], i["lw"], pre, "silu", p, [True] * 3)),
        ("linear_backward_weight", ops.linear_backward.default,
         (i["lg"], i["lx"], i["lw"], pre, "silu", p, [False, True, False])),
        ("timestep_mlp", ops.timestep_mlp.default, (i["f"], i["w1"], i["b1"], i["w2"], i["b2"], p)),
        ("timestep_mlp_backward", ops.timestep_mlp_backward.default,
         (i["temb_grad"], i["f"], i["w1"], i["w2"], mlp_pre, mlp_hidden, p, [True] * 5)),
        ("timestep_mlp_bf16", ops.timestep_mlp.default, bf16_mlp + (p,)),
        ("timestep_mlp_backward_bf16", ops.timestep_mlp_backward.default,
         (i["btemb_grad"], i["bf"], i["bw1"], i["bw2"], bf16_pre, bf16_hidden, p, [True] * 5)),
        ("timestep_mlp_pooled_text", ops.timestep_mlp.default, text + (p,)),
        ("timestep_mlp_backward_pooled_text", ops.timestep_mlp_backward.default,
         (i["out_grad"], i["pooled"], i["tw1"], i["tw2"], text_pre, text_hidden, p, [True, False, True, True, False])),
        ("adaln_projection", ops.adaln_projection.default, (i["temb"], i["pw"], i["pb"], p)),
        ("adaln_projection_backward", ops.adaln_projection_backward.default,
         (i["table_grad"], i["temb"], i["pw"], act, p, [True] * 3)),
        ("adaln_table_add", ops.adaln_table_add.default, (torch.ones(6, hidden, device=device), torch.ones(3, 6, hidden, dtype=torch.bfloat16, device=device))),
        ("adaln_table_add_broadcast", ops.adaln_table_add.default,
         (torch.ones(2, hidden, dtype=torch.bfloat16, device=device),
          torch.ones(3, 1, hidden, dtype=torch.bfloat16, device=device))),
        ("adaln_table_add_backward", ops.adaln_table_add_backward.default,
         (torch.ones(3, 2, hidden, device=device), torch.float32, torch.bfloat16, True, [True, True])),
        ("adaln_row_gather", ops.adaln_row_gather.default, (i["rows"], plan)),
        ("adaln_row_gather_backward", ops.adaln_row_gather_backward.default, (i["gather_grad"], plan)),
        ("rmsnorm", ops.rmsnorm.default, (x, w, None, None, None, eps, p)),
        ("rmsnorm_plan", ops.rmsnorm.plan, (x, w, T, T2, plan, eps, p)),
        ("rmsnorm_backward", ops.rmsnorm_backward.default,
         (grad, x, w, None, None, None, plain_rstd, eps, p, [True, True, False, False])),
        ("rmsnorm_backward_plan", ops.rmsnorm_backward.plan, (grad, x, w, T, T2, plan, rstd, eps, p, [True] * 4)),
        ("rmsnorm_backward_plan_some", ops.rmsnorm_backward.plan,
         (grad, x, w, T, T2, plan, rstd, eps, p, [False, True, False, True])),
        ("gate_residual", ops.gate_residual.default, (x, y, T, plan)),
        ("gate_residual_backward", ops.gate_residual_backward.default, (grad, y, T, plan, [True] * 3)),
        ("gate_residual_backward_some", ops.gate_residual_backward.default, (grad, y, T, plan, [True, False, False])),
        ("gate_residual_rmsnorm", ops.gate_residual_rmsnorm.default, (x, y, T, w, T2, T, plan, eps, p)),
        ("gate_residual_rmsnorm_backward", ops.gate_residual_rmsnorm_backward.default,
         (grad, y, y, T, w, T2, T, plan, h, h_rstd, eps, p, [True] * 6)),
        ("gate_residual_rmsnorm_backward_no_d_h", ops.gate_residual_rmsnorm_backward.default,
         (grad, None, y, T, w, T2, T, plan, h, h_rstd, eps, p, [True] * 6)),
        ("gate_residual_rmsnorm_backward_no_d_out", ops.gate_residual_rmsnorm_backward.default,
         (None, grad, y, T, w, T2, T, plan, h, h_rstd, eps, p, [True] * 6)),
        ("final_adaln_out", ops.final_adaln_out.default, (x, w, i["temb"], i["fw"], i["fb"], i["tplan"], eps, p)),
        ("final_adaln_out_backward", ops.final_adaln_out_backward.default,
         (grad, x, w, i["temb"], i["fw"], f_table, f_act, f_rstd, i["tplan"], eps, p, [True] * 5)),
        ("adaln_modulation", ops.adaln_modulation.default, (i["temb"], i["pw"], i["pb"], plan, p)),
        ("adaln_modulation_backward", ops.adaln_modulation_backward.default,
         (i["gather_grad"], i["temb"], i["pw"], m_act, plan, p, [True] * 3)),
        ("plan_handle", ops.plan_handle.default, (plan,)),
    ]
    if comm is not None:
        sp, c = detdit.distributed.SpRegion(plan, comm).sp, comm.handle
        _, sp_rstd = ops.sp_rmsnorm.default(x, w, T, T2, sp, c, eps, p)
        sp_h, _, sp_h_rstd = ops.sp_gate_residual_rmsnorm.default(x, y, T, w, T2, T, sp, c, eps, p)
        _, tp_act = ops.tp_adaln_projection.default(i["temb"], i["pw"], i["pb"], c, p)
        # a family's projection (6 chunks of the 18H columns) with a bf16 temb: d_temb in bf16
        family_temb = i["temb"].bfloat16()
        _, family_act = ops.tp_adaln_projection.default(family_temb, i["pw"], i["pb"], c, p, None, 6)
        cases += [
            ("tp_adaln_projection", ops.tp_adaln_projection.default, (i["temb"], i["pw"], i["pb"], c, p)),
            ("tp_adaln_projection_backward", ops.tp_adaln_projection_backward.default,
             (i["table_grad"], i["temb"], i["pw"], tp_act, c, p, [True] * 3)),
            ("tp_adaln_projection_family", ops.tp_adaln_projection.default,
             (family_temb, i["pw"], i["pb"], c, p, None, 6)),
            ("tp_adaln_projection_backward_family", ops.tp_adaln_projection_backward.default,
             (i["table_grad"], family_temb, i["pw"], family_act, c, p, [True] * 3, 6)),
            ("plan_handle_sp", ops.plan_handle.sp, (sp,)),
            ("sp_rmsnorm", ops.sp_rmsnorm.default, (x, w, T, T2, sp, c, eps, p)),
            ("sp_rmsnorm_backward", ops.sp_rmsnorm_backward.default, (grad, x, w, T, T2, sp, sp_rstd, c, eps, p)),
            ("sp_gate_residual", ops.sp_gate_residual.default, (x, y, T, sp, c)),
            ("sp_gate_residual_backward", ops.sp_gate_residual_backward.default, (grad, y, T, sp, c)),
            ("sp_gate_residual_rmsnorm", ops.sp_gate_residual_rmsnorm.default, (x, y, T, w, T2, T, sp, c, eps, p)),
            ("sp_gate_residual_rmsnorm_backward", ops.sp_gate_residual_rmsnorm_backward.default,
             (grad, y, y, T, w, T2, T, sp, sp_h, sp_h_rstd, c, eps, p)),
        ]
        # the layernorm ops on a region without an index, modulated per sample in fp32
        free = detdit.distributed.SpRegion(None, comm, seq_len=x.shape[1], batch=x.shape[0]).sp
        ms, mc = x[:, 0].float().contiguous(), x[:, 1].float().contiguous()
        _, ln_mean, ln_rstd = ops.sp_layernorm.default(x, w, w, ms, mc, free, c, eps, p, False)
        _, ln_h, ln_h_mean, ln_h_rstd = ops.sp_gate_residual_layernorm.default(x, y, ms, w, w, ms, mc, free, c, eps, p,
                                                                              True, None)
        ln_back = (y, ms, w, w, ms, mc, free, ln_h, ln_h_mean, ln_h_rstd, c, eps, p, True, None)
        grr_h, _, grr_rstd = ops.sp_gate_residual_rmsnorm.forms(x, y, ms, w, ms, mc, free, c, eps, p, True, 1.0)
        grr_back = (y, ms, w, ms, mc, free, grr_h, grr_rstd, c, eps, p, True, 1.0)
        cases += [
            ("sp_layernorm", ops.sp_layernorm.default, (x, w, w, ms, mc, free, c, eps, p, False)),
            ("sp_layernorm_backward", ops.sp_layernorm_backward.default,
             (grad.float(), x, w, w, ms, mc, free, ln_mean, ln_rstd, c, eps, p, False)),
            ("sp_gate_residual_layernorm", ops.sp_gate_residual_layernorm.default,
             (x, y, ms, w, w, ms, mc, free, c, eps, p, True, 1.0)),
            ("sp_gate_residual_layernorm_backward", ops.sp_gate_residual_layernorm_backward.default,
             (grad, grad) + ln_back),
            ("sp_gate_residual_layernorm_backward_no_d_out", ops.sp_gate_residual_layernorm_backward.default,
             (None, grad) + ln_back),
            ("sp_rmsnorm_forms", ops.sp_rmsnorm.forms, (x, w, ms, mc, free, c, eps, p, False)),
            ("sp_rmsnorm_backward_forms", ops.sp_rmsnorm_backward.forms,
             (grad.float(), x, w, ms, mc, free, ln_rstd, c, eps, p, False)),
            ("sp_gate_residual_forms", ops.sp_gate_residual.forms, (x, y, ms, free, c, True, 1.0)),
            ("sp_gate_residual_backward_forms", ops.sp_gate_residual_backward.forms, (grad, y, ms, free, c, True, 1.0)),
            ("sp_gate_residual_backward_forms_no_gate", ops.sp_gate_residual_backward.forms,
             (grad, y, None, free, c, False, None)),
            ("sp_gate_residual_rmsnorm_forms", ops.sp_gate_residual_rmsnorm.forms,
             (x, y, ms, w, ms, mc, free, c, eps, p, True, 1.0)),
            ("sp_gate_residual_rmsnorm_forms_no_gate", ops.sp_gate_residual_rmsnorm.forms,
             (x, y, None, w, ms, mc, free, c, eps, p, False, None)),
            ("sp_gate_residual_rmsnorm_backward_forms", ops.sp_gate_residual_rmsnorm_backward.forms,
             (grad, grad) + grr_back),
            ("sp_gate_residual_rmsnorm_backward_forms_no_d_out", ops.sp_gate_residual_rmsnorm_backward.forms,
             (None, grad) + grr_back),
        ]
    return cases


def fake_kernel_of(op):
    name = op._schema.name.split("::")[1] + ("" if op._overloadname == "default" else "." + op._overloadname)
    return _compile.FAKE_KERNELS[name]


def flat(result):
    return list(result) if isinstance(result, (tuple, list)) else [result]


def test_every_op_has_a_fake_kernel():
    names = {s.name.split("::")[1] + ("." + s.overload_name if s.overload_name else "")
             for s in torch._C._jit_get_all_schemas() if s.name.startswith("detdit::")}
    # The constructors validate on the host (a plan is built outside a compiled region);
    # release_scratch_memory manages memory, outside any model; adaln_chunk_order takes a name.
    host_only = {"plan", "plan_from_rows", "sp_plan", "sp_plan.positions", "release_scratch_memory",
                 "adaln_chunk_order"}
    assert names - host_only == set(_compile.FAKE_KERNELS), names ^ set(_compile.FAKE_KERNELS)


def test_plan_str_repr_and_flatten():
    ti, tags = packing(SEQ, TIMESTEPS, 330)
    plan, other = detdit.plan(ti, tags, TIMESTEPS, BATCH), detdit.plan(ti, tags, TIMESTEPS, BATCH)
    text = f"IndexPlan(seq_len={SEQ}, batch={BATCH}, num_rows={3 * TIMESTEPS}, device=cpu)"
    assert str(plan) == text
    if torch.__version__ >= "2.4":  # torch 1.13's ScriptObject does not forward repr() to the class
        assert repr(plan) == text
    flat_plan = dict(plan.__obj_flatten__())
    assert flat_plan["seq_len"] == str(SEQ) and flat_plan["batch"] == str(BATCH) and flat_plan["device"] == "cpu"
    assert flat_plan["id"] != dict(other.__obj_flatten__())["id"], "two plans share the id dynamo guards on"
    fake = _compile.FakeIndexPlan.__obj_unflatten__(plan.__obj_flatten__())
    for method in ("seq_len", "batch", "num_rows", "positions", "num_chunks", "num_segments", "device"):
        assert getattr(fake, method)() == getattr(plan, method)(), method


@pytest.mark.parametrize("device", DEVICES)
def test_plans_pickle_through_their_builder_and_compare_by_table(device):
    # inductor pickles a plan it holds as a graph constant, opcheck deep-copies the arguments
    # and compares them with ==: a plan's state is its source (row index, rows, batch,
    # device), rebuilt and validated by plan_from_rows; == compares the tables.
    import copy
    import pickle
    ti, tags = packing(SEQ, TIMESTEPS, 332)
    ti, tags = ti.to(device), tags.to(device)
    plan = detdit.plan(ti, tags, TIMESTEPS, BATCH)
    sp_plan = ops.sp_plan(plan, 2, 1)
    for real in (plan, sp_plan):
        for copied in (copy.deepcopy(real), pickle.loads(pickle.dumps(real))):
            assert copied == real and str(copied) == str(real)
            assert dict(copied.__obj_flatten__())["id"] != dict(real.__obj_flatten__())["id"]
    same_table = detdit.plan_from_rows(ti * 3 + tags, 3 * TIMESTEPS, BATCH)
    assert plan == same_table and not plan != same_table
    for other in (detdit.plan_from_rows(ti * 3 + tags, 3 * TIMESTEPS, BATCH + 1),
                  detdit.plan_from_rows(ti * 3 + tags, 3 * TIMESTEPS + 1, BATCH),
                  detdit.plan(ti, (tags + 1) % 3, TIMESTEPS, BATCH)):
        assert plan != other and not plan == other
    for other in (ops.sp_plan(plan, 2, 0), ops.sp_plan(plan, 3, 1)):
        assert sp_plan != other and not sp_plan == other
    assert sp_plan == ops.sp_plan(same_table, 2, 1) and not sp_plan != ops.sp_plan(same_table, 2, 1)
    # an unpickled state goes through the builder's validation like any other plan
    (rows, num_rows, batch, where), plan_class = plan.__getstate__()
    bad = rows.clone()
    bad[SEQ // 2] = num_rows
    sp_class = sp_plan.__getstate__()[1]
    for state, error, message in (
            (((bad, num_rows, batch, where), plan_class), IndexError, rf"row_index\[{SEQ // 2}\] = {num_rows} is outside"),
            (((rows, 0, batch, where), plan_class), ValueError, "num_rows"),
            (((rows, num_rows, 0, where), plan_class), ValueError, "batch"),
            (((rows, num_rows, batch, "bogus"), plan_class), ValueError, "device must be a torch device.*got 'bogus'"),
            (((rows, num_rows, batch, where, 2, 2), sp_class), ValueError, "rank")):
        unpickled = torch.ScriptObject.__new__(torch.ScriptObject)
        with pytest.raises(error, match=message):
            unpickled.__setstate__(state)


def test_fake_plans_have_every_flattened_key_and_plans_have_no_len():
    # dynamo reads every __obj_flatten__ key as an attribute of the fake plan (OutputGraph);
    # torch's schema check (opcheck) probes each argument with len(), expecting TypeError.
    ti, tags = packing(SEQ, TIMESTEPS, 331)
    plan = detdit.plan(ti, tags, TIMESTEPS, BATCH)
    sp_plan = ops.sp_plan(plan, 2, 1)
    for real, fake_class in ((plan, _compile.FakeIndexPlan), (sp_plan, _compile.FakeSpPlan)):
        fake = fake_class.__obj_unflatten__(real.__obj_flatten__())
        for key, value in real.__obj_flatten__():
            assert hasattr(fake, key), f"{fake_class.__name__} has no attribute {key}"
        assert fake.id == int(dict(real.__obj_flatten__())["id"])
        with pytest.raises(TypeError, match="has no len"):
            len(real)


@pytest.mark.parametrize("device", DEVICES)
def test_fake_kernels_give_the_kernels_output_metadata(device, comm):
    for name, op, args in op_cases(device, comm if device == "cpu" else None):
        real, fake = flat(op(*args)), flat(fake_kernel_of(op)(*args))
        assert len(real) == len(fake), name
        for k, (r, f) in enumerate(zip(real, fake)):
            if r is None or f is None:
                assert r is None and f is None, f"{name} output {k}: kernel {r is None}, fake {f is None} for None"
                continue
            assert (r.shape, r.dtype, r.device, r.stride()) == (f.shape, f.dtype, f.device, f.stride()), \
                f"{name} output {k}: kernel {(r.shape, r.dtype, r.device, r.stride())}, " \
                f"fake {(f.shape, f.dtype, f.device, f.stride())}"


def traced_autograd_cases(device, comm):
    i = inputs(device)
    x, y, w, T, T2, plan, eps, p = i["x"], i["y"], i["w"], i["table"], i["table2"], i["plan"], 1e-5, "portable"
    cases = [
        ("adaln_row_gather", (i["rows"], plan)),
        ("rmsnorm.plan", (x, w, T, T2, plan, eps, p)),
        ("gate_residual", (x, y, T, plan)),
        ("gate_residual_rmsnorm", (x, y, T, w, T2, T, plan, eps, p)),
        ("final_adaln_out", (x, w, i["temb"], i["fw"], i["fb"], i["tplan"], eps, p)),
        ("adaln_modulation", (i["temb"], i["pw"], i["pb"], plan, p)),
    ]
    if comm is not None:
        sp, c = detdit.distributed.SpRegion(plan, comm).sp, comm.handle
        cases += [("sp_rmsnorm", (x, w, T, T2, sp, c, eps, p)), ("sp_gate_residual", (x, y, T, sp, c)),
                  ("sp_gate_residual_rmsnorm", (x, y, T, w, T2, T, sp, c, eps, p))]
        # the modulation forms' sp_ ops on a region without an index, per sample in fp32 (no gate:
        # the gradients it leaves None)
        free = detdit.distributed.SpRegion(None, comm, seq_len=x.shape[1], batch=x.shape[0]).sp
        ms, mc = x[:, 0].float().contiguous(), x[:, 1].float().contiguous()
        cases += [("sp_rmsnorm.forms", (x, w, ms, mc, free, c, eps, p, False)),
                  ("sp_gate_residual.forms", (x, y, ms, free, c, True, 1.0)),
                  ("sp_gate_residual_rmsnorm.forms", (x, y, ms, w, ms, mc, free, c, eps, p, True, 1.0)),
                  ("sp_layernorm", (x, w, w, ms, mc, free, c, eps, p, True)),
                  ("sp_gate_residual_layernorm", (x, y, None, w, None, ms, mc, free, c, eps, p, False, None))]
    return cases


@pytest.mark.parametrize("device", DEVICES)
def test_traced_autograd_equals_the_cpp_functions(device, comm):
    """Each Function of TRACED_AUTOGRAD against the op's C++ Autograd kernel: the same outputs,
    every gradient and which gradients are None, bitwise; the fused ops with a gradient
    reaching h and out, out only and h only, and some inputs not requiring grad."""
    assert set(_compile.TRACED_AUTOGRAD) == {name for name, _ in traced_autograd_cases("cpu", comm)}
    for name, args in traced_autograd_cases(device, comm if device == "cpu" else None):
        num_grads = _compile.TRACED_AUTOGRAD[name][0]
        fused = "gate_residual_rmsnorm" in name or "gate_residual_layernorm" in name
        for reach in ((0, 1), (1,), (0,)) if fused else ((0,),):
            for frozen in (None, 0) if num_grads > 1 else (None,):
                results = []
                for run in (_compile._overload(name), _compile.autograd_function(name).apply):
                    leaves = [a.detach().clone().requires_grad_(k < num_grads and k != frozen and a.is_floating_point())
                              if isinstance(a, torch.Tensor) else a for k, a in enumerate(args)]
                    outs = flat(run(*leaves))
                    torch.autograd.backward([outs[k] for k in reach],
                                            [normal(tuple(outs[k].shape), 340 + k, outs[k].dtype).to(device)
                                             for k in reach])
                    grads = [a.grad if isinstance(a, torch.Tensor) else None for a in leaves[:num_grads]]
                    results.append((outs, grads))
                (cpp_outs, cpp_grads), (py_outs, py_grads) = results
                what = f"{name} (gradient into outputs {reach}, input {frozen} frozen)"
                for k, (a, b) in enumerate(zip(py_outs, cpp_outs)):
                    assert_bitwise_equal(a, b, f"{what}: output {k}")
                    assert a.requires_grad == b.requires_grad, f"{what}: output {k} differentiable on one side only"
                for k, (a, b) in enumerate(zip(py_grads, cpp_grads)):
                    assert (a is None) == (b is None), f"{what}: gradient {k} is None on one side only"
                    if a is not None:
                        assert_bitwise_equal(a, b, f"{what}: gradient {k}")


def test_plan_handles_resolve_only_to_live_plans(comm):
    """The `.handle` backward overloads (what the traced autograd saves instead of a plan):
    a handle keeps its plan alive and gives the plan's bytes; a tensor that names no live plan,
    or a plan of the other class, or is no handle at all, is refused before any kernel runs."""
    import gc
    i = inputs("cpu")
    mask = [True, True, True]
    want = ops.gate_residual_backward.default(i["grad"], i["y"], i["table"], i["plan"], mask)
    handle = i["plan"].handle()
    assert handle.dtype == torch.int64 and handle.device.type == "cpu" and handle.numel() == 1
    # the op (what the traced autograd calls) and the method give one handle
    assert torch.equal(ops.plan_handle.default(i["plan"]), handle)
    sp = detdit.distributed.SpRegion(i["tplan"], comm).sp
    assert torch.equal(ops.plan_handle.sp(sp), sp.handle()) and not torch.equal(sp.handle(), handle)
    copied = handle.clone()  # names the same plan, but holds no reference to it
    del i["plan"]
    gc.collect()
    got = ops.gate_residual_backward.handle(i["grad"], i["y"], i["table"], handle, mask)  # still alive: the handle
    for k, (a, b) in enumerate(zip(got, want)):
        assert_bitwise_equal(a, b, f"gate_residual_backward.handle output {k}")
    assert_bitwise_equal(ops.gate_residual_backward.handle(i["grad"], i["y"], i["table"], copied, mask)[1], want[1],
                         "a copy of a live plan's handle")
    del handle
    gc.collect()
    with pytest.raises(ValueError, match="names no live plan"):  # the plan died with its last handle
        ops.gate_residual_backward.handle(i["grad"], i["y"], i["table"], copied, mask)
    with pytest.raises(ValueError, match="names no live plan"):
        ops.gate_residual_backward.handle(i["grad"], i["y"], i["table"], torch.tensor([2 ** 62]), mask)
    with pytest.raises(TypeError, match="plan_handle must be a plan's handle"):
        ops.gate_residual_backward.handle(i["grad"], i["y"], i["table"], torch.tensor([1], dtype=torch.int32), mask)
    with pytest.raises(ValueError, match="names an IndexPlan, expected an SpPlan"):
        ops.sp_gate_residual_backward.handle(i["grad"], i["y"], i["table"], i["tplan"].handle(), comm.handle)
    with pytest.raises(ValueError, match="num_rows must be the plan's"):
        ops.adaln_row_gather_backward.handle(i["gather_grad"], i["tplan"].handle(), 99)


def tables_cases(device):
    """(case name, the op's `.tables` overload, its args, the plan overload, its args) for every case
    of op_cases whose op takes an IndexPlan: the plan's tables in its place (and
    adaln_row_gather_backward's num_rows)."""
    cases = []
    for name, op, args in op_cases(device):
        if name == "plan_handle" or not any(isinstance(a, torch.ScriptObject) for a in args):
            continue
        packet = getattr(ops, op._schema.name.split("::")[1])
        tables_args = [a.tables() if isinstance(a, torch.ScriptObject) else a for a in args]
        if name == "adaln_row_gather_backward":
            tables_args.append(args[1].num_rows())
        cases.append((name, packet.tables, tables_args, op, args))
    return cases


@pytest.mark.parametrize("device", DEVICES)
def test_every_tables_overload_equals_its_plan_overload(device):
    """The `.tables` overload of every op with an IndexPlan (forward and backward, every output
    mask of op_cases) gives the plan overload's outputs, bitwise."""
    cases = tables_cases(device)
    tables_ops = {str(op) for _, op, _, _, _ in cases}
    every = {f"detdit.{s.name.split('::')[1]}.tables" for s in torch._C._jit_get_all_schemas()
             if s.name.startswith("detdit::") and s.overload_name == "tables"}
    assert tables_ops == every, every ^ tables_ops
    for name, tables_op, tables_args, op, args in cases:
        for k, (a, b) in enumerate(zip(flat(tables_op(*tables_args)), flat(op(*args)))):
            assert (a is None) == (b is None), f"{name} output {k}: None on one side only"
            if a is not None:
                assert_bitwise_equal(a, b, f"{name}.tables output {k}")


@pytest.mark.parametrize("device", DEVICES)
def test_tables_autograd_equals_the_cpp_functions(device):
    """The wrappers given PlanTables (the `.tables` overloads and their Autograd kernel,
    _compile.TABLES_AUTOGRAD) against the same wrappers given the plan (the C++ Functions): the
    same outputs, every gradient and which gradients are None, bitwise; the fused op with a gradient
    reaching h and out, out only and h only."""
    i = inputs(device)
    x, y, w, T, T2, eps = i["x"], i["y"], i["w"], i["table"], i["table2"], 1e-5
    calls = [
        ("adaln_row_gather", (i["rows"],), lambda a, p: detdit.adaln_row_gather(*a, p)),
        ("rmsnorm", (x, w, T, T2), lambda a, p: detdit.rmsnorm(*a, plan=p, eps=eps)),
        ("gate_residual", (x, y, T), lambda a, p: detdit.gate_residual(*a, p)),
        ("gate_residual_rmsnorm", (x, y, T, w, T2, T), lambda a, p: detdit.gate_residual_rmsnorm(*a, plan=p)),
        ("final_adaln_out", (x, w, i["temb"], i["fw"], i["fb"]), lambda a, p: detdit.final_adaln_out(*a, p)),
        ("adaln_modulation", (i["temb"], i["pw"], i["pb"]), lambda a, p: detdit.adaln_modulation(*a, p)),
    ]
    assert {name + ".tables" for name, _, _ in calls} == set(_compile.TABLES_AUTOGRAD)
    for name, args, call in calls:
        plan = i["tplan"] if name == "final_adaln_out" else i["plan"]
        for reach in ((0, 1), (1,), (0,)) if name == "gate_residual_rmsnorm" else ((0,),):
            results = []
            for p in (plan, detdit.plan_tables(plan)):
                leaves = [a.detach().clone().requires_grad_(True) for a in args]
                outs = flat(call(leaves, p))
                torch.autograd.backward([outs[k] for k in reach],
                                        [normal(tuple(outs[k].shape), 350 + k, outs[k].dtype).to(device)
                                         for k in reach])
                results.append((outs, [a.grad for a in leaves]))
            (plan_outs, plan_grads), (tables_outs, tables_grads) = results
            what = f"{name} with PlanTables (gradient into outputs {reach})"
            for k, (a, b) in enumerate(zip(tables_outs, plan_outs)):
                assert_bitwise_equal(a, b, f"{what}: output {k}")
            for k, (a, b) in enumerate(zip(tables_grads, plan_grads)):
                assert (a is None) == (b is None), f"{what}: gradient {k} is None on one side only"
                if a is not None:
                    assert_bitwise_equal(a, b, f"{what}: gradient {k}")


def test_plan_tables_stand_only_for_the_live_plan_that_made_them():
    """Only a live plan's own, unmodified tables reach a kernel: a copy of them, a tensor of the
    same bytes, a part or a reshape of them, tables modified in place and the tables of a freed plan
    are each a ValueError naming plan_tables, from every `.tables` overload, with the inputs
    untouched. The tables' bytes are never read: changed behind the version counter (`.data`)
    they still give the plan's result. plan.tables() is one tensor per plan, new once modified."""
    import gc
    cases = tables_cases("cpu")
    i = inputs("cpu")
    plan = i["plan"]
    tables = plan.tables()
    assert tables is plan.tables() and tables.dtype == torch.int32
    assert torch.equal(tables, plan.row_index())

    def refused(make, message):
        for name, tables_op, tables_args, _, _ in cases:
            # the tables are the one int32 argument
            args = [make(a) if isinstance(a, torch.Tensor) and a.dtype == torch.int32 else a for a in tables_args]
            before = [a.clone() for a in args if isinstance(a, torch.Tensor)]
            op_name = re.escape(tables_op._schema.name.split("::")[1])
            with pytest.raises(ValueError, match=rf"^{op_name}: plan_tables must be the tables of a live IndexPlan "
                                                 rf"\(plan.tables\(\), detdit.plan_tables\(plan\)\), got .*{message}"):
                tables_op(*args)
            for a, b in zip([a for a in args if isinstance(a, torch.Tensor)], before):
                assert_bitwise_equal(a, b, f"{name}: an input after the refusal")

    refused(lambda t: t.clone(), "that no plan made")
    refused(lambda t: t.new_zeros(t.shape), "that no plan made")
    refused(lambda t: plan.row_index(), "that no plan made")
    refused(lambda t: torch.cat([t[:1], t[1:]]), "that no plan made")
    refused(lambda t: t[1:], r"a part or a reshaped view .* at offset 1\), expected the whole int32 tensor of "
                             rf"shape \[{plan.seq_len()}\]")
    refused(lambda t: t.view(plan.seq_len(), 1), "a part or a reshaped view")
    gate, want = i["table"], ops.gate_residual.default(i["x"], i["y"], i["table"], plan)
    tables.data[0] = 1 - tables[0]  # behind the version counter: no kernel reads the tables
    assert_bitwise_equal(ops.gate_residual.tables(i["x"], i["y"], gate, tables), want, "tables changed through .data")
    modified = plan.tables()
    modified.add_(0)  # in place: the version counter moves
    refused(lambda t: modified, r"tables modified in place since the plan made them \(version 1, made at version 0\)")
    fresh = plan.tables()
    assert fresh is not modified and fresh._version == 0
    assert_bitwise_equal(ops.gate_residual.tables(i["x"], i["y"], gate, fresh), want, "the tables made after that")
    ti, tags = packing(SEQ, TIMESTEPS, 300)
    freed = detdit.plan(ti, tags, TIMESTEPS, BATCH)
    freed_tables = freed.tables()  # the tables do not keep their plan alive
    del freed
    gc.collect()
    refused(lambda t: freed_tables, r"the tables of a plan that has been freed")


def test_plan_tables_wrapper_types():
    i = inputs("cpu")
    with pytest.raises(TypeError, match="plan_tables: plan must be a detdit IndexPlan .*got Tensor"):
        detdit.plan_tables(i["plan"].tables())
    with pytest.raises(TypeError, match=r"PlanTables: tables must be a torch.Tensor \(plan.tables\(\)\), got list"):
        detdit.PlanTables([0, 1])
    forged = detdit.PlanTables(i["plan"].row_index())
    assert repr(forged) == f"PlanTables(seq_len={i['plan'].seq_len()}, device=cpu)"
    with pytest.raises(ValueError, match="gate_residual: plan_tables must be the tables of a live IndexPlan"):
        detdit.gate_residual(i["x"], i["y"], i["table"], forged)


def test_traced_autograd_refuses_double_backward():
    i = inputs("cpu")
    x = i["x"].clone().requires_grad_(True)
    out = _compile.autograd_function("gate_residual").apply(x, i["y"], i["table"], i["plan"])
    with pytest.raises(RuntimeError, match="first-order gradients only"):
        torch.autograd.grad(out.float().sum(), x, create_graph=True)


# ---------------------------------------------------------------------------
# torch >= 2.4: opcheck and torch.compile


@requires_compile
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_every_op(device, comm):
    for name, op, args in op_cases(device, comm if device == "cpu" else None):
        is_backward = "backward" in name
        args = [a.detach().clone().requires_grad_(not is_backward and a.is_floating_point())
                if isinstance(a, torch.Tensor) else a for a in args]
        torch.library.opcheck(op, args)


def block_model(device):
    model = detdit.nn.H3Conditioning(num_blocks=1, hidden_size=HIDDEN, time_embed_hidden_dim=32, time_embed_dim=DIM)
    with torch.no_grad():
        for k, param in enumerate(model.parameters()):
            param.copy_(normal(tuple(param.shape), 400 + k, param.dtype, scale=0.1))
        for norm in (model.transformer_blocks[0].norm1, model.transformer_blocks[0].norm2, model.norm_out.norm):
            norm.weight.add_(1)
    return model.to(device)


def fresh_block(device):
    """Dynamo's caches cleared, then (model, region, stand-in weights) on device."""
    torch._dynamo.reset()
    model = block_model(device)
    return (model, *block_region(model))


def block_region(model):
    """The H3 block region: temb from t, norm1 -> attention -> gate + norm2 (fused) -> FFN ->
    gate, then norm_out. The attention and FFN stand-ins are detdit.linear (row-wise, so they
    too are the same kernels compiled or not)."""
    wa = normal((HIDDEN, HIDDEN), 450, BF, scale=0.1).to(next(model.parameters()).device).requires_grad_(True)
    wf = normal((HIDDEN, HIDDEN), 451, BF, scale=0.1).to(wa.device).requires_grad_(True)

    def region(x, t, plan, tplan):
        temb = model.temb(t)

        def attn(n):
            return detdit.linear(n.reshape(-1, HIDDEN), wa).view(n.shape)

        def ffn(n):
            return detdit.linear(n.reshape(-1, HIDDEN), wf, activation="silu").view(n.shape)

        x = model.transformer_blocks[0](x, temb, plan, attn, ffn)
        return model.norm_out(x, temb, tplan)

    return region, [wa, wf]


def region_inputs(device, seq, seed):
    """(x, t, plan, tplan) of the block region at sequence length seq; x and t require grad."""
    ti, tags = packing(seq, TIMESTEPS, seed)
    plan = detdit.plan(ti.to(device), tags.to(device), TIMESTEPS, BATCH)
    tplan = detdit.plan_from_rows(ti.to(device), TIMESTEPS, BATCH)
    x = normal((BATCH, seq, HIDDEN), seed + 1, BF, scale=2.0).to(device).requires_grad_(True)
    return x, torch.tensor([0.25, 0.8], device=device, requires_grad=True), plan, tplan


def run_region(fn, model, weights, device, seq, seed):
    """fn's output and every gradient (x, t, the stand-ins' weights, the model's parameters)
    for a fixed output gradient."""
    x, t, plan, tplan = region_inputs(device, seq, seed)
    for param in [*model.parameters(), *weights]:
        param.grad = None
    out = fn(x, t, plan, tplan)
    out.backward(normal(tuple(out.shape), seed + 2, out.dtype).to(device))
    return [out.detach().clone(), x.grad, t.grad] + [param.grad for param in [*weights, *model.parameters()]]


RESULT_NAMES = ["out", "dx", "dt", "d_attn_weight", "d_ffn_weight"]


def assert_same_results(got, want, what, model):
    names = RESULT_NAMES + [name for name, _ in model.named_parameters()]
    assert len(got) == len(want)
    for name, a, b in zip(names, got, want):
        assert (a is None) == (b is None), f"{what}: {name} is None on one side only"
        if a is not None:  # the token refiner's norm is no part of the block: no gradient
            assert_bitwise_equal(a, b, f"{what}: {name}")


@requires_compile
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_block_is_one_graph_and_equals_eager(device, backend):
    model, region, weights = fresh_block(device)
    explained = torch._dynamo.explain(region)(*region_inputs(device, SEQ, 460))
    assert explained.graph_break_count == 0 and explained.graph_count == 1, str(explained)
    traced = {str(op) for graph_ops in explained.ops_per_graph for op in graph_ops if "detdit" in str(op)}
    for op in ("timestep_sinusoid", "timestep_mlp", "adaln_projection", "rmsnorm.plan", "gate_residual_rmsnorm",
               "linear", "gate_residual.default", "final_adaln_out"):
        assert any(op in name for name in traced), f"detdit op {op} is not a node of the graph: {sorted(traced)}"

    torch._dynamo.reset()
    compiled = torch.compile(region, fullgraph=True, backend=backend)
    eager = run_region(region, model, weights, device, SEQ, 470)
    assert_same_results(run_region(compiled, model, weights, device, SEQ, 470), eager, "compiled vs eager", model)


def layernorm_region(x, y, mod, w, b):
    """Wan's recipe (per-sample fp32 modulation, upcast) through the modulated LayerNorm and the
    fused region after it, then SD3's (each op) on the region's out with a per-token bf16 shift
    and scale: every modulation a view of mod (B, 6, H)."""
    n = detdit.layernorm(x, None, None, mod[:, 0], mod[:, 1], upcast=True)
    out, h = detdit.gate_residual_layernorm(n, y, mod[:, 2], w, b, mod[:, 3], mod[:, 4], upcast=True, k=1.0)
    per_token = out * 0.125
    return detdit.layernorm(h, w, b, per_token, per_token, eps=1e-6), h


def run_layernorm_region(fn, device, seed):
    x, y = (normal((BATCH, SEQ, HIDDEN), seed + k, BF, scale=2.0).to(device).requires_grad_(True) for k in (0, 1))
    mod = normal((BATCH, 6, HIDDEN), seed + 2, scale=0.3).to(device).requires_grad_(True)
    w = (1 + normal((HIDDEN,), seed + 3, scale=0.3)).to(BF).to(device).requires_grad_(True)
    b = normal((HIDDEN,), seed + 4, BF, scale=0.3).to(device).requires_grad_(True)
    outs = fn(x, y, mod, w, b)
    torch.autograd.backward(list(outs), [normal(tuple(o.shape), seed + 5 + k, o.dtype).to(device)
                                         for k, o in enumerate(outs)])
    return [o.detach() for o in outs] + [t.grad for t in (x, y, mod, w, b)]


@requires_compile
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_layernorm_forms_are_one_graph_and_equal_eager(device, backend):
    """layernorm.forms and gate_residual_layernorm (no plan) compile with fullgraph=True into
    one graph with no break, their outputs and every gradient bitwise equal to eager."""
    torch._dynamo.reset()
    x, y = (normal((BATCH, SEQ, HIDDEN), 480 + k, BF).to(device) for k in (0, 1))
    mod = normal((BATCH, 6, HIDDEN), 482).to(device)
    w, b = torch.ones(HIDDEN, dtype=BF, device=device), torch.zeros(HIDDEN, dtype=BF, device=device)
    explained = torch._dynamo.explain(layernorm_region)(x, y, mod, w, b)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, str(explained)
    traced = {str(op) for graph_ops in explained.ops_per_graph for op in graph_ops if "detdit" in str(op)}
    for op in ("layernorm.forms", "gate_residual_layernorm"):
        assert any(op in name for name in traced), f"detdit op {op} is not a node of the graph: {sorted(traced)}"
    torch._dynamo.reset()
    compiled = torch.compile(layernorm_region, fullgraph=True, backend=backend)
    eager = run_layernorm_region(layernorm_region, device, 490)
    got = run_layernorm_region(compiled, device, 490)
    for name, a, e in zip(["out", "h", "dx", "dy", "d_mod", "d_weight", "d_bias"], got, eager):
        assert_bitwise_equal(a, e, f"compiled vs eager: {name}")


def sp_forms_region(region, x, y, mod, w, b):
    """The sp_ ops beyond the H3 rule on a region without an index, each feeding the next: Wan's
    recipe (per-sample fp32 modulation, views of mod (B, 6, H), upcast) with k, then SD3's (each
    op) with per-token bf16 modulation."""
    n = region.rmsnorm(x, w, mod[:, 0], mod[:, 1], upcast=True)
    g = region.gate_residual(x, n, mod[:, 2], k=1.0, upcast=True)
    h, out = region.gate_residual_rmsnorm(g, y, mod[:, 3], w, mod[:, 4], mod[:, 5], upcast=True, k=1.0)
    per_token = out * 0.125
    n = region.layernorm(out, w, b, mod[:, 0], mod[:, 1], upcast=True)
    return region.gate_residual_layernorm(h, n, per_token, w, b, per_token, per_token, eps=1e-6)


@requires_compile
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_sp_forms_are_one_graph_and_equal_eager(comm, backend):
    """sp_rmsnorm.forms, sp_gate_residual.forms, sp_gate_residual_rmsnorm.forms, sp_layernorm and
    sp_gate_residual_layernorm (SpRegion's methods, one rank) compile with fullgraph=True into one
    graph with no break, their SpPlan a graph input and their autograd TRACED_AUTOGRAD's; outputs
    and every gradient bitwise equal to eager."""
    region = detdit.distributed.SpRegion(None, comm, seq_len=SEQ, batch=BATCH)

    def fn(x, y, mod, w, b):
        return sp_forms_region(region, x, y, mod, w, b)

    torch._dynamo.reset()
    x, y = (normal((BATCH, SEQ, HIDDEN), 530 + k, BF) for k in (0, 1))
    mod, w, b = normal((BATCH, 6, HIDDEN), 532), torch.ones(HIDDEN, dtype=BF), torch.zeros(HIDDEN, dtype=BF)
    explained = torch._dynamo.explain(fn)(x, y, mod, w, b)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, str(explained)
    traced = {str(op) for graph_ops in explained.ops_per_graph for op in graph_ops if "detdit" in str(op)}
    for op in ("sp_rmsnorm.forms", "sp_gate_residual.forms", "sp_gate_residual_rmsnorm.forms", "sp_layernorm",
               "sp_gate_residual_layernorm"):
        assert any(op in name for name in traced), f"detdit op {op} is not a node of the graph: {sorted(traced)}"
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    eager = run_layernorm_region(fn, "cpu", 540)
    got = run_layernorm_region(compiled, "cpu", 540)
    for name, a, e in zip(["out", "h", "dx", "dy", "d_mod", "d_weight", "d_bias"], got, eager):
        assert_bitwise_equal(a, e, f"compiled vs eager: {name}")


@requires_compile
def test_the_forward_graph_saves_no_plan_for_the_backward():
    """AOTAutograd's forward graph saves the plans' handles (tensors) for the backward, never a
    plan: torch 2.11 refuses a torch-class object saved for a compiled backward. plan_handle's
    ordering (torch's default, kept by _compile._register) keeps it in the forward graph; torch
    2.6 orders every op with a plan argument anyway, so there this passes either way. The
    forward graph's outputs are the region's output, then what it saves: any fake plan among
    them is a saved plan."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._library.fake_class_registry import FakeScriptObject
    forward_outputs = []

    def forward_compiler(graph, _):
        output = next(node for node in graph.graph.nodes if node.op == "output")
        forward_outputs.extend(node.meta.get("val") for node in output.args[0] if isinstance(node, torch.fx.Node))
        return make_boxed_func(graph.forward)

    def backend(module, example_inputs):
        return aot_module_simplified(module, example_inputs, fw_compiler=forward_compiler,
                                     bw_compiler=lambda graph, _: make_boxed_func(graph.forward))

    model, region, weights = fresh_block("cpu")
    try:
        run_region(torch.compile(region, fullgraph=True, backend=backend), model, weights, "cpu", SEQ, 470)
    finally:  # the saved plans, if any, say more than the error torch gives for them
        assert forward_outputs, "no forward graph was compiled"
        saved = [str(value) for value in forward_outputs if isinstance(value, FakeScriptObject)]
        assert not saved, f"the forward graph saves {len(saved)} plan(s) for the backward: {saved}"


@requires_compile
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_block_without_grad_equals_eager(device, backend):
    """Inference (a rollout engine's forward): nothing is saved for a backward, so no plan
    crosses into a backward graph. A second plan recompiles (the graph is specialised to its
    plan) and is as exact."""
    model, region, _ = fresh_block(device)
    compiled = torch.compile(region, fullgraph=True, backend=backend)
    with torch.no_grad():
        for seed in (510, 520):
            x, t, plan, tplan = region_inputs(device, SEQ, seed)
            assert_bitwise_equal(compiled(x, t, plan, tplan), region(x, t, plan, tplan),
                                 f"no_grad: compiled vs eager, plan of seed {seed}")


@requires_compile
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_dynamic_shapes_two_sequence_lengths(device, backend):
    model, region, weights = fresh_block(device)
    compiled = torch.compile(region, fullgraph=True, dynamic=True, backend=backend)
    for seq, seed in ((SEQ, 480), (SEQ + 24, 490)):
        eager = run_region(region, model, weights, device, seq, seed)
        assert_same_results(run_region(compiled, model, weights, device, seq, seed), eager,
                            f"dynamic=True at S={seq}", model)


def tables_region(region):
    """region taking PlanTables: the plans' tables are made outside the compiled function."""
    def with_tables(x, t, plan, tplan):
        return region(x, t, detdit.plan_tables(plan), detdit.plan_tables(tplan))
    return with_tables


@requires_compile
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_block_with_plan_tables_takes_tensors_only_and_equals_eager(device, backend):
    """The tensor-only boundary: given PlanTables the H3 block compiles into one graph with no
    break whose inputs are tensors and symbols only (no plan: what CUDA graphs need), under both
    backends (torch 2.6's inductor too, which takes no plan input); its outputs and every
    gradient are bitwise equal to eager with the plans. Tables that are not a plan's are refused
    by the compiled graph too."""
    model, region, weights = fresh_block(device)
    x, t, plan, tplan = region_inputs(device, SEQ, 460)
    tables, ttables = detdit.plan_tables(plan), detdit.plan_tables(tplan)
    explained = torch._dynamo.explain(region)(x, t, tables, ttables)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, str(explained)
    inputs_of_graph = [node.meta.get("example_value") for node in explained.graphs[0].graph.nodes
                       if node.op == "placeholder"]
    assert all(isinstance(v, (torch.Tensor, torch.SymInt)) for v in inputs_of_graph), (
        f"a graph input is no tensor: {[type(v).__name__ for v in inputs_of_graph]}")
    traced = {str(op) for graph_ops in explained.ops_per_graph for op in graph_ops if "detdit" in str(op)}
    for op in ("rmsnorm.tables", "gate_residual_rmsnorm.tables", "gate_residual.tables", "final_adaln_out.tables"):
        assert any(op in name for name in traced), f"detdit op {op} is not a node of the graph: {sorted(traced)}"

    torch._dynamo.reset()
    compiled = tables_region(torch.compile(region, fullgraph=True, backend=backend))
    eager = run_region(region, model, weights, device, SEQ, 470)
    assert_same_results(run_region(compiled, model, weights, device, SEQ, 470), eager, "compiled vs eager", model)
    compiled_fn = torch.compile(region, fullgraph=True, backend=backend)
    forged = detdit.PlanTables(plan.row_index().to(device))
    with pytest.raises(ValueError, match="plan_tables must be the tables of a live IndexPlan .* that no plan made"):
        compiled_fn(x, t, forged, ttables)


@requires_compile
@requires_cuda
def test_cuda_graph_replays_equal_eager():
    """mode="reduce-overhead" with PlanTables: CUDA graphs are recorded (none skipped) and every
    call, warm-up, recording and replays, gives eager's bits (eager with the plans). A plan
    itself as a graph input records none on torch 2.11 (docs/python.md)."""
    from torch._dynamo.utils import counters
    device = "cuda"
    model, region, weights = fresh_block(device)
    counters.clear()
    model.time_proj.check_range = False  # no host read of t: capturable
    compiled = tables_region(torch.compile(region, mode="reduce-overhead", fullgraph=True))
    x0, t0, plan, tplan = region_inputs(device, SEQ, 500)  # one plan: a CUDA graph reads its tables by address
    grad = normal((BATCH, SEQ, HIDDEN), 502, BF).to(device)

    def step(fn):
        for param in [*model.parameters(), *weights]:
            param.grad = None
        x, t = x0.detach().clone().requires_grad_(True), t0.detach().clone().requires_grad_(True)
        out = fn(x, t, plan, tplan)
        out.backward(grad)
        return [out.detach().clone(), x.grad.clone(), t.grad.clone()] + [
            None if param.grad is None else param.grad.clone() for param in [*weights, *model.parameters()]]

    eager = step(region)
    for replay in range(4):  # warm-up, recording, then replays
        torch.compiler.cudagraph_mark_step_begin()
        assert_same_results(step(compiled), eager, f"reduce-overhead call {replay}", model)
    assert counters["inductor"]["cudagraph_skips"] == 0, f"cudagraphs were skipped: {dict(counters['inductor'])}"
    assert counters["inductor"]["cudagraph_recorded_non_static_inputs"] > 0, (
        f"no CUDA graph was recorded: {dict(counters['inductor'])}")
