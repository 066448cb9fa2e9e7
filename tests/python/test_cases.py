"""Every exported C++ op case through the PyTorch binding on the CPU, byte for byte.

The cases are the C++ suites' own (cases/, Suite::kTest, the small ones: op_cases.py): their
inputs, their plans and the outputs of their CPU run. Each case runs here through the
binding's operators, ``torch.ops.detdit.<op>`` and ``<op>_backward`` (the kernels autograd
calls), forward and then backward with the case's incoming gradients, and every output the
binding returns must hold the C++ run's bytes; a second run must give the same bytes again.
This checks the binding's plumbing (argument order, views and strides, plans, dtypes, the
batch) against the library the C++ suites check; the independent oracles are test_ops.py's.

Where the binding returns a gradient in its input's dtype and the case writes it in FP32 (a
weight or table gradient of a 16-bit op), the binding's bytes must be the C++ FP32 value
rounded once to that dtype (torch's round-to-nearest-even cast): docs/numerics.md's rule that
gradient arithmetic is FP32 and every output is rounded once to its dtype. Outputs the binding does not return (linear's chunk partials,
scratch inside the op; linear's pre-activation without SiLU) and cases it cannot express
(linear with an output dtype other than x's) are listed per op below, each with its reason.
"""
import pytest
import torch

from conftest import assert_bitwise_equal
from op_cases import form_views, is_form_case, table_chunk  # noqa: F401 (test_forms_eager imports them from here)

ops = torch.ops.detdit


def _linear(c):
    activation = c.arguments["activation"]
    bias = c["bias"] if "bias" in c else None
    out, pre = ops.linear(c["x"], c["weight"], bias, activation, c.numerics or "portable")
    # the case's backward is the linear's own (its grad is the gradient of pre): no SiLU VJP
    d_x, d_w, d_b = ops.linear_backward(c["grad"], c["x"], c["weight"], pre, "none", "portable", [True] * 3)
    got = {"out": out, "d_x": d_x, "d_weight": d_w, "d_bias": d_b}
    if activation == "silu":
        got["pre"] = pre  # without an activation the binding returns no pre-activation
    return got


def _linear_unsupported(c):
    out = next(t for t in c.outputs if t["name"] == "out")
    x = next(t for t in c.inputs if t["name"] == "x")
    if out["dtype"] != x["dtype"]:
        return "the binding's linear returns x's dtype (no output-dtype argument)"
    return None


def _timestep_sinusoid(c):
    t, max_period = c["timesteps"], float(c.arguments["max_period"])
    channels = c["grad_features"].shape[1]
    convention = (c.arguments["flip_sin_to_cos"] == "true", float(c.arguments["downscale_freq_shift"]),
                  float(c.arguments["scale"]), float(c.arguments["t_max"]))
    features = ops.timestep_sinusoid(t, channels, max_period, c.numerics, True, *convention)
    d_t = ops.timestep_sinusoid_backward(c["grad_features"], t, max_period, c.numerics, True, *convention)
    return {"features": features, "d_timesteps": d_t}


def _timestep_mlp(c):
    f, w1, b1, w2, b2 = (c[n] for n in ("features", "w1", "b1", "w2", "b2"))
    temb, pre, hidden = ops.timestep_mlp(f, w1, b1, w2, b2, c.numerics)
    grads = ops.timestep_mlp_backward(c["grad_temb"], f, w1, w2, pre, hidden, c.numerics, [True] * 5)
    return dict(zip(("temb", "pre", "hidden", "d_features", "d_w1", "d_b1", "d_w2", "d_b2"),
                    (temb, pre, hidden) + tuple(grads)))


def _combined_timestep_embedding(c):
    """detdit.combined_timestep_embedding (the Python composition of timestep_mlp on each input and torch's
    adds) and its autograd against the C++ op's bytes; each MLP's saved tensors from its own operator."""
    import detdit
    mlps = [("timestep_features", "timestep_"), ("pooled", "text_")]
    if "guidance_features" in c:
        mlps.append(("guidance_features", "guidance_"))
    leaves = {name: c[name].clone().requires_grad_(True)
              for x, prefix in mlps for name in (x, prefix + "w1", prefix + "b1", prefix + "w2", prefix + "b2")}
    weights = {prefix: [leaves[prefix + n] for n in ("w1", "b1", "w2", "b2")] for _, prefix in mlps}
    guided = "guidance_features" in c
    temb = detdit.combined_timestep_embedding(leaves["timestep_features"], leaves["pooled"], weights["timestep_"],
                                              weights["text_"], leaves.get("guidance_features"),
                                              weights.get("guidance_"), c.numerics)
    temb.backward(c["grad_temb"])
    got = {"temb": temb.detach()}
    for x, prefix in mlps:
        _, got[prefix + "pre"], got[prefix + "hidden"] = ops.timestep_mlp(
            c[x], *(c[prefix + n] for n in ("w1", "b1", "w2", "b2")), c.numerics)
        got["d_" + x] = leaves[x].grad
        for n in ("w1", "b1", "w2", "b2"):
            got["d_" + prefix + n] = leaves[prefix + n].grad
    assert guided == ("guidance_" in weights)
    return got


def _adaln_projection(c):
    chunks = int(c.arguments.get("chunks", 0))  # absent: H3's projection
    table, act = ops.adaln_projection(c["temb"], c["weight"], c["bias"], c.numerics, chunks)
    grads = ops.adaln_projection_backward(c["grad_table"], c["temb"], c["weight"], act, c.numerics, [True] * 3,
                                          chunks)
    return dict(zip(("table", "act", "d_temb", "d_weight", "d_bias"), (table, act) + tuple(grads)))


def _adaln_table_add(c):
    table, proj = c["table"], c["proj"]
    out = ops.adaln_table_add(table, proj)
    broadcast = proj.shape[1] == 1 and table.shape[0] != 1
    d_table, d_proj = ops.adaln_table_add_backward(c["grad"], table.dtype, proj.dtype, broadcast, [True] * 2)
    return {"out": out, "d_table": d_table, "d_proj": d_proj}


def _adaln_modulation(c):
    plan = c.plan()
    out, table, act = ops.adaln_modulation(c["temb"], c["weight"], c["bias"], plan, c.numerics)
    grads = ops.adaln_modulation_backward(c["grad"], c["temb"], c["weight"], act, plan, c.numerics, [True] * 3)
    return dict(zip(("out", "table", "act", "d_temb", "d_weight", "d_bias"), (out, table, act) + tuple(grads)))


def _final_adaln_out(c):
    plan, eps = c.plan(), c.eps()
    x, nw, temb, w, b = (c[n] for n in ("x", "norm_weight", "temb", "weight", "bias"))
    out, table, act, rstd = ops.final_adaln_out(x, nw, temb, w, b, plan, eps, c.numerics)
    grads = ops.final_adaln_out_backward(c["grad"], x, nw, temb, w, table, act, rstd, plan, eps, c.numerics,
                                         [True] * 5)
    return dict(zip(("out", "table", "act", "rstd", "dx", "d_norm_weight", "d_temb", "d_weight", "d_bias"),
                    (out, table, act, rstd) + tuple(grads)))


def _tables(c, hidden, chunks):
    """The (R, H) views the C++ case reads: chunks of its (R, 6H) table, or column 1 on of its
    (R, H + 1) storage tensors (rows that are not vector-aligned)."""
    views = []
    for storage, chunk in chunks:
        views.append(c[storage][:, 1:hidden + 1] if storage in c else table_chunk(c["table"], hidden, chunk))
    return views


def _rmsnorm_forms(c):
    x, w, eps = c["x"], c["weight"], c.eps()
    upcast = c.arguments["upcast"] == "true"
    modulated = "modulation" in c
    shift, scale = form_views(c, (0, 1), "d_shift") if modulated else (None, None)
    out, rstd = ops.rmsnorm.forms(x, w, shift, scale, None, eps, c.numerics, upcast)
    grads = ops.rmsnorm_backward.forms(c["grad"], x, w, shift, scale, None, rstd, eps, c.numerics, upcast,
                                       [True, True, modulated, modulated])
    got = dict(zip(("out", "rstd", "dx", "d_weight"), (out, rstd) + tuple(grads[:2])))
    if modulated:
        got["d_shift"], got["d_scale"] = grads[2], grads[3]
    return got


def _rmsnorm(c):
    if is_form_case(c):
        return _rmsnorm_forms(c)
    x, w, eps = c["x"], c["weight"], c.eps()
    hidden = x.shape[-1]
    modulated = "plan" in c.plans
    shift, scale = _tables(c, hidden, (("shift_storage", 0), ("scale_storage", 1))) if modulated else (None, None)
    plan = c.plan() if modulated else None
    out, rstd = ops.rmsnorm(x, w, shift, scale, plan, eps, c.numerics)
    grads = ops.rmsnorm_backward(c["grad"], x, w, shift, scale, plan, rstd, eps, c.numerics,
                                 [True, True, modulated, modulated])
    got = dict(zip(("out", "rstd", "dx", "d_weight"), (out, rstd) + tuple(grads[:2])))
    if modulated:
        got["d_shift"], got["d_scale"] = grads[2], grads[3]
    return got


def _gate_residual_forms(c):
    upcast = c.arguments["upcast"] == "true"
    k = float(c.arguments["k"]) if "k" in c.arguments else None
    gate = form_views(c, (2,), "d_gate")[0] if "modulation" in c else None
    out = ops.gate_residual.forms(c["residual"], c["y"], gate, None, upcast, k)
    grads = ops.gate_residual_backward.forms(c["grad"], c["y"], gate, None, upcast, k, [True, True, gate is not None])
    got = dict(zip(("out", "d_residual", "d_y"), (out,) + tuple(grads[:2])))
    if gate is not None:
        got["d_gate"] = grads[2]
    return got


def _gate_residual(c):
    if is_form_case(c):
        return _gate_residual_forms(c)
    hidden = c["residual"].shape[-1]
    gate = c["table"] if c["table"].shape[1] == hidden else table_chunk(c["table"], hidden, 2)
    plan = c.plan()
    out = ops.gate_residual(c["residual"], c["y"], gate, plan)
    grads = ops.gate_residual_backward(c["grad"], c["y"], gate, plan, [True] * 3)
    return dict(zip(("out", "d_residual", "d_y", "d_gate"), (out,) + tuple(grads)))


def _gate_residual_rmsnorm_forms(c):
    """A form case (cases/forms_cases.cc): gate, shift and scale chunks 2, 3 and 4 of the
    case's parent (all three or none), through `gate_residual_rmsnorm.forms`."""
    residual, y, w, eps = c["residual"], c["y"], c["weight"], c.eps()
    upcast = c.arguments["upcast"] == "true"
    k = float(c.arguments["k"]) if "k" in c.arguments else None
    gated = "modulation" in c
    gate, shift, scale = form_views(c, (2, 3, 4), "d_gate") if gated else (None, None, None)
    plan = c.plan() if "plan" in c.plans else None
    h, out, rstd = ops.gate_residual_rmsnorm.forms(residual, y, gate, w, shift, scale, plan, eps, c.numerics, upcast,
                                                   k)
    d_h = c["d_h"] if "d_h" in c else None
    grads = ops.gate_residual_rmsnorm_backward.forms(c["d_out"], d_h, y, gate, w, shift, scale, plan, h, rstd, eps,
                                                     c.numerics, upcast, k, [True, True, gated, True, gated, gated])
    got = {"h": h, "out": out, "rstd": rstd}
    for name, grad in zip(("d_residual", "d_y", "d_gate", "d_weight", "d_shift", "d_scale"), grads):
        if grad is not None:
            got[name] = grad
    return got


def _gate_residual_rmsnorm(c):
    if is_form_case(c):
        return _gate_residual_rmsnorm_forms(c)
    residual, y, w, eps = c["residual"], c["y"], c["weight"], c.eps()
    hidden = residual.shape[-1]
    modulated = any(t["name"] == "d_shift" for t in c.outputs)
    (gate,) = _tables(c, hidden, (("gate_storage", 2),))
    shift, scale = _tables(c, hidden, (("shift_storage", 3), ("scale_storage", 4))) if modulated else (None, None)
    plan = c.plan()
    h, out, rstd = ops.gate_residual_rmsnorm(residual, y, gate, w, shift, scale, plan, eps, c.numerics)
    d_h = c["d_h"] if "d_h" in c else None
    grads = ops.gate_residual_rmsnorm_backward(c["d_out"], d_h, y, gate, w, shift, scale, plan, h, rstd, eps,
                                               c.numerics, [True, True, True, True, modulated, modulated])
    got = dict(zip(("h", "out", "rstd", "d_residual", "d_y", "d_gate", "d_weight"), (h, out, rstd) + tuple(grads[:4])))
    if modulated:
        got["d_shift"], got["d_scale"] = grads[4], grads[5]
    return got


def _layernorm_forms(c):
    """A form case (cases/layernorm_cases.cc): shift and scale chunks 0 and 1 of the case's
    parent ((R, 6, H) with the plan for the indexed form), weight and bias optional, through
    `layernorm.forms`."""
    x, eps = c["x"], c.eps()
    w = c["weight"] if "weight" in c else None
    b = c["bias"] if "bias" in c else None
    upcast = c.arguments["upcast"] == "true"
    plan = c.plan() if "plan" in c.plans else None
    modulated = "modulation" in c
    shift, scale = form_views(c, (0, 1), "d_shift") if modulated else (None, None)
    out, mean, rstd = ops.layernorm.forms(x, w, b, shift, scale, plan, eps, c.numerics, upcast)
    grads = ops.layernorm_backward.forms(c["grad"], x, w, b, shift, scale, plan, mean, rstd, eps, c.numerics, upcast,
                                         [True, w is not None, b is not None, modulated, modulated])
    got = {"out": out, "mean": mean, "rstd": rstd}
    for name, grad in zip(("dx", "d_weight", "d_bias", "d_shift", "d_scale"), grads):
        if grad is not None:
            got[name] = grad
    return got


def _layernorm(c):
    """The offset cases' grad and dx are flat (M*H + 1,) storage whose (M, H) rows start at
    element 1 (off the vector boundary): the binding gets that view of grad, and its dx is
    compared as the same view of the case's dx (element 0, which the case leaves the canary,
    is not an output of the op)."""
    if is_form_case(c):
        return _layernorm_forms(c)
    x, eps = c["x"], c.eps()
    w = c["weight"] if "weight" in c else None
    b = c["bias"] if "bias" in c else None
    out, mean, rstd = ops.layernorm(x, w, b, eps, c.numerics)
    grad = c["grad"]
    offset = grad.dim() == 1
    if offset:
        grad = grad[1:].view(x.shape)
    dx, d_weight, d_bias = ops.layernorm_backward(grad, x, w, b, mean, rstd, eps, c.numerics,
                                                  [True, w is not None, b is not None])
    if offset:
        whole = c["dx"].clone()  # the case's bytes outside the rows: element 0
        whole[1:] = dx.reshape(-1)
        dx = whole
    got = {"out": out, "mean": mean, "rstd": rstd, "dx": dx}
    if w is not None:
        got["d_weight"] = d_weight
    if b is not None:
        got["d_bias"] = d_bias
    return got


def _gate_residual_layernorm(c):
    """A case of cases/gate_residual_layernorm_cases.cc: gate, shift and scale chunks 2, 0 and 1
    of the case's parent ((R, 6, H) with the plan for the indexed form), each present where the
    case has its gradient; weight, bias and d_h optional."""
    names = {t["name"] for t in c.outputs}
    gated, modulated = "d_gate" in names, "d_shift" in names
    gate = form_views(c, (2,), "d_gate")[0] if gated else None
    shift, scale = form_views(c, (0, 1), "d_shift") if modulated else (None, None)
    w = c["weight"] if "weight" in c else None
    b = c["bias"] if "bias" in c else None
    plan = c.plan() if "plan" in c.plans else None
    upcast, eps = c.arguments["upcast"] == "true", c.eps()
    k = float(c.arguments["k"]) if "k" in c.arguments else None
    y = c["y"]
    out, h, mean, rstd = ops.gate_residual_layernorm(c["residual"], y, gate, w, b, shift, scale, plan, eps,
                                                     c.numerics, upcast, k)
    d_h = c["d_h"] if "d_h" in c else None
    grads = ops.gate_residual_layernorm_backward(c["d_out"], d_h, y, gate, w, b, shift, scale, plan, h, mean, rstd,
                                                 eps, c.numerics, upcast, k, [True] * 7)
    got = {"out": out, "h": h, "mean": mean, "rstd": rstd}
    for name, grad in zip(("d_residual", "d_y", "d_gate", "d_weight", "d_bias", "d_shift", "d_scale"), grads):
        if grad is not None:
            got[name] = grad
    return got


def _adaln_row_gather(c):
    plan = c.plan()
    width = 6 * c["grad"].shape[-1]
    out = ops.adaln_row_gather(c["rows_storage"][:, :width], plan)
    return {"out": out, "d_rows": ops.adaln_row_gather_backward(c["grad"], plan)}


# op -> (the binding's run of a case: {output name: tensor}, the outputs it does not return
# (name -> reason), the cases it cannot express (case -> reason or None)).
RECIPES = {
    "linear": (_linear, {"partials": "scratch inside the binding's linear_backward",
                         "pre": "returned only with activation='silu' (compared there)"}, _linear_unsupported),
    "timestep_sinusoid": (_timestep_sinusoid, {}, None),
    "timestep_mlp": (_timestep_mlp, {}, None),
    "combined_timestep_embedding": (_combined_timestep_embedding, {}, None),
    "adaln_projection": (_adaln_projection, {}, None),
    "adaln_table_add": (_adaln_table_add, {}, None),
    "adaln_modulation": (_adaln_modulation, {}, None),
    "final_adaln_out": (_final_adaln_out, {}, None),
    "rmsnorm": (_rmsnorm, {}, None),
    "gate_residual": (_gate_residual, {}, None),
    "gate_residual_rmsnorm": (_gate_residual_rmsnorm, {}, None),
    "layernorm": (_layernorm, {}, None),
    "gate_residual_layernorm": (_gate_residual_layernorm, {}, None),
    "adaln_row_gather": (_adaln_row_gather, {}, None),
}
# Op cases the binding has no single operator for: the whole conditioning chain (the C++
# suites run it; in Python it is a composition of the ops above, test_nn.py).
NOT_BINDING_OPS = {"chain": "no binding operator: a composition of the ops (tests/python/test_nn.py)"}


def _expected(case_tensor, actual):
    """The case's bytes in the binding's dtype: itself, or its FP32 value rounded once."""
    if actual.dtype == case_tensor.dtype:
        return case_tensor
    assert case_tensor.dtype == torch.float32, f"case output is {case_tensor.dtype}, binding gives {actual.dtype}"
    return case_tensor.to(actual.dtype)


def test_every_exported_op_has_a_binding_recipe(op_cases):
    ops_exported = {c.op for c in op_cases}
    missing = ops_exported - set(RECIPES) - set(NOT_BINDING_OPS)
    assert not missing, f"exported op cases with no binding run in test_cases.py: {sorted(missing)}"
    assert set(RECIPES) <= ops_exported, f"ops with no exported case: {sorted(set(RECIPES) - ops_exported)}"


@pytest.mark.parametrize("op", sorted(RECIPES))
def test_binding_equals_cpp_case_bytes(op_cases, op):
    run, not_returned, unsupported = RECIPES[op]
    cases = [c for c in op_cases if c.op == op]
    compared = 0
    for c in cases:
        if unsupported is not None and unsupported(c) is not None:
            continue
        assert c.outputs_written, f"{c}: exported without outputs"
        got = run(c)
        again = run(c)
        for spec in c.outputs:
            name = spec["name"]
            if name not in got:
                assert name in not_returned, f"{c}: output {name} neither compared nor listed as not returned"
                continue
            assert_bitwise_equal(got[name], _expected(c[name], got[name]), f"{c}: {name}")
            assert_bitwise_equal(again[name], got[name], f"{c}: {name} run again")
            compared += 1
        assert compared > 0, f"{c}: no output compared"
    assert compared > 0, f"{op}: no exported case ran through the binding"
