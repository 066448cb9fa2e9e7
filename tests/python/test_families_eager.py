"""Each DiT family's norm, modulation and gated-residual sites, computed as the family's
diffusers code computes them in plain PyTorch on the CPU, against detdit's portable ops.

One row per family (FAMILIES below, read from diffusers' transformer sources): the norm (LayerNorm or RMSNorm, its
affine and eps), the modulation form (the views of the (B, 6, H) / (B, F, 6, H) / (B, S, 6, H)
tensor the model makes), its dtype and the recipe (each op rounds, or Wan's FP32 upcast).
Three sites per row, forward and every gradient:
- norm:   ``norm(x) * (1 + scale) + shift``                       (norm1 of a block)
- gate:   ``residual + gate * y``                                  (the gated residual)
- region: ``h = residual + gate * y; norm(h) * (1 + scale) + shift``  (norm2 after it)

What is exact and asserted byte for byte:
- repeatability: a second call gives the same bytes (outputs and gradients);
- batch invariance: sample 0's outputs and its per-sample / per-frame gradients (d_shift,
  d_scale, d_gate: chunks counted from the sample's first position) are the same bytes alone
  and with other samples in the batch;
- the gated residual's output, d_residual and d_y equal eager's (the same IEEE operations).
What is bounded, against the float64 value of the same graph (every input widened, every
cast an identity): detdit's outputs and gradients are at least as close to it as eager's, to
one ulp of the tensor's dtype at its largest magnitude; an FP32 sum over positions (Wan's
d_shift, d_scale, d_gate) may be further by the bound of recursive summation, n * 2^-24 of that
magnitude (detdit's chunks are chains of 256, eager sums pairwise). Eager is no fixed target:
on the CPU, torch 1.13's 16-bit LayerNorm rounds its statistics coarsely (several ulps from
float64 where detdit is within one), so "as close as eager" is the claim that holds for every
torch version.
"""
import pytest
import torch
import torch.nn.functional as F

import detdit
from conftest import assert_bitwise_equal
from family_paths import randn as _randn, ulp as _ulp

# name: (norm, affine, eps, form, modulation dtype, upcast). The activations are bf16.
FAMILIES = {
    "sd3_flux_hunyuan_qwen": ("layer", "none", 1e-6, "per_sample", torch.bfloat16, False),
    "cogvideox": ("layer", "weight+bias", 1e-5, "per_sample", torch.bfloat16, False),
    "wan_a14b": ("layer", "none", 1e-6, "per_sample", torch.float32, True),
    "wan_ti2v_5b": ("layer", "none", 1e-6, "per_token", torch.float32, True),
    "skyreels_v2_df": ("layer", "none", 1e-6, "per_frame", torch.float32, True),
    "ltx_video": ("rms", "none", 1e-6, "per_token", torch.bfloat16, False),
    "minimax_h3": ("rms", "weight", 1e-5, "indexed", torch.bfloat16, False),
}
BATCH, SEQ, HIDDEN, FRAMES, ROWS = 3, 525, 64, 21, 5  # S = 21 frames of 25; S > 256: several chunks


class Family:
    def __init__(self, name):
        self.name = name
        self.norm, self.affine, self.eps, self.form, self.mod_dtype, self.upcast = FAMILIES[name]

    def inputs(self, batch=BATCH, seed=0):
        """x, y, residual (B, S, H) bf16; the modulation parent; weight, bias, the grad of out."""
        shape = (batch, SEQ, HIDDEN)
        t = {"x": _randn(shape, seed + 1, torch.bfloat16, 3.0, 1.0), "y": _randn(shape, seed + 2, torch.bfloat16),
             "residual": _randn(shape, seed + 3, torch.bfloat16, 2.0),
             "grad": _randn(shape, seed + 4, torch.bfloat16)}
        parent = {"per_sample": (batch, 6, HIDDEN), "per_frame": (batch, FRAMES, 6, HIDDEN),
                  "per_token": (batch, SEQ, 6, HIDDEN), "indexed": (ROWS, 6, HIDDEN)}[self.form]
        t["parent"] = _randn(parent, seed + 5, self.mod_dtype, 0.5)
        if self.affine != "none":
            t["weight"] = _randn((HIDDEN,), seed + 6, torch.bfloat16, 0.5, 1.0)
        if self.affine == "weight+bias":
            t["bias"] = _randn((HIDDEN,), seed + 7, torch.bfloat16, 0.5)
        if self.form == "indexed":
            t["rows"] = torch.randint(0, ROWS, (SEQ,), generator=torch.Generator().manual_seed(seed + 8))
        return t

    def chunks(self, parent):
        """shift, scale, gate of the first three chunks, as the model views them."""
        if self.form == "per_sample":
            return [parent[:, c:c + 1] for c in range(3)]  # (B, 1, H), Wan's chunk(6, dim=1)
        if self.form == "per_frame":
            return [parent[:, :, c:c + 1] for c in range(3)]  # (B, F, 1, H)
        if self.form == "per_token":
            return [parent[:, :, c] for c in range(3)]  # (B, S, H)
        return [parent[:, c] for c in range(3)]  # (R, H) tables

    # --- eager, as the family's diffusers code computes it; truth: the same graph in float64 ---
    def _broadcast(self, m, t):
        if self.form == "per_frame":  # (B, F, 1, H) against the frames of (B, S, H)
            return m, lambda v: v.unflatten(1, (FRAMES, SEQ // FRAMES)), lambda v: v.flatten(1, 2)
        if self.form == "indexed":
            return m[t["rows"]], lambda v: v, lambda v: v
        return m, lambda v: v, lambda v: v

    def eager_norm(self, x, t, wide, narrow):
        w, b = t.get("weight"), t.get("bias")
        if self.norm == "rms":  # x * rsqrt(mean(x^2) + eps) in FP32 (diffusers' RMSNorm, H3's norm), cast back
            xf = wide(x)
            n = x * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return narrow(n if w is None else n * wide(w), x)
        if self.upcast:  # FP32LayerNorm of x.float()
            return F.layer_norm(wide(x), (HIDDEN,), None if w is None else wide(w), None if b is None else wide(b),
                                self.eps)
        return F.layer_norm(x, (HIDDEN,), w, b, self.eps)

    def eager_modulate(self, n, shift, scale, t, like, narrow):
        shift, split, join = self._broadcast(shift, t)
        scale, _, _ = self._broadcast(scale, t)
        out = join(split(n) * (1 + scale) + shift)
        return narrow(out, like) if self.upcast else out

    def eager_gate(self, residual, y, gate, t, wide, narrow):
        gate, split, join = self._broadcast(gate, t)
        if self.upcast:  # Wan: (residual.float() + y * gate).type_as(residual), gate fp32
            return narrow(join(split(wide(residual)) + split(y) * gate), residual)
        return join(split(residual) + gate * split(y))

    def eager(self, site, t, leaves, truth=False):
        """truth: the same graph on float64 copies, every cast an identity."""
        wide = (lambda v: v) if truth else (lambda v: v.float())
        narrow = (lambda v, like: v) if truth else (lambda v, like: v.to(like.dtype))
        shift, scale, gate = self.chunks(leaves["parent"])
        if site == "gate":
            return (self.eager_gate(leaves["residual"], leaves["y"], gate, t, wide, narrow),)
        x = leaves["x"]
        if site == "region":
            x = self.eager_gate(leaves["residual"], leaves["y"], gate, t, wide, narrow)
        out = self.eager_modulate(self.eager_norm(x, leaves, wide, narrow), shift, scale, t, x, narrow)
        return (out, x) if site == "region" else (out,)

    # --- detdit ---------------------------------------------------------------------------
    def plan(self, t, batch):
        return detdit.plan_from_rows(t["rows"], ROWS, batch) if self.form == "indexed" else None

    def detdit(self, site, t, leaves):
        shift, scale, gate = self.chunks(leaves["parent"])
        batch = leaves["x"].shape[0]
        plan = self.plan(t, batch)
        if site == "gate":
            return (detdit.gate_residual(leaves["residual"], leaves["y"], gate, plan=plan, upcast=self.upcast),)
        w, b = leaves.get("weight"), leaves.get("bias")
        if self.norm == "rms":
            if w is None:  # a weight of ones: rn(n * 1) = n, the no-affine norm's bits
                w = torch.ones(HIDDEN, dtype=torch.bfloat16)
            if site == "norm":
                return (detdit.rmsnorm(leaves["x"], w, shift, scale, plan=plan, eps=self.eps, upcast=self.upcast),)
            h, out = detdit.gate_residual_rmsnorm(leaves["residual"], leaves["y"], gate, w, shift, scale, plan=plan,
                                                  eps=self.eps, upcast=self.upcast)
            return out, h
        if site == "norm":
            return (detdit.layernorm(leaves["x"], w, b, shift, scale, plan=plan, eps=self.eps, upcast=self.upcast),)
        return detdit.gate_residual_layernorm(leaves["residual"], leaves["y"], gate, w, b, shift, scale, plan=plan,
                                              eps=self.eps, upcast=self.upcast)

    def run(self, site, t, how):
        """Outputs and the gradients of every leaf the site reads (grad of out; of h, too).
        how: "detdit", "eager" or "truth" (eager's graph in float64)."""
        names = {"norm": ["x", "parent", "weight", "bias"], "gate": ["residual", "y", "parent"],
                 "region": ["residual", "y", "parent", "weight", "bias"]}[site]
        wide = torch.float64 if how == "truth" else None
        leaves = {k: v.to(wide or v.dtype, copy=True).requires_grad_(k in names)
                  if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in t.items()}
        if how == "detdit":
            outs = self.detdit(site, t, leaves)
        else:
            outs = self.eager(site, t, leaves, truth=how == "truth")
        grads = [leaves["grad"].to(outs[0].dtype)] + [leaves["y"].detach().to(o.dtype) for o in outs[1:]]  # d_h: y's
        torch.autograd.backward(outs, grads)
        return ({f"out{i}": o.detach() for i, o in enumerate(outs)} |
                {f"d_{k}": leaves[k].grad for k in names if k in leaves and leaves[k].grad is not None})


SITES = ["norm", "gate", "region"]
REDUCED = ("d_parent", "d_weight", "d_bias")  # sums over positions


@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("name", list(FAMILIES))
def test_site_matches_the_familys_eager_code(name, site):
    f = Family(name)
    t = f.inputs()
    got, eager, truth = f.run(site, t, "detdit"), f.run(site, t, "eager"), f.run(site, t, "truth")
    assert got.keys() == eager.keys(), f"{name} {site}: outputs {sorted(got)} vs eager {sorted(eager)}"
    for key in got:
        what = f"{name} {site} {key}"
        a, e = got[key], eager[key]
        assert a.dtype == e.dtype and a.shape == e.shape, f"{what}: {a.dtype} {tuple(a.shape)} vs {e.dtype} {tuple(e.shape)}"
        if site == "gate" and key != "d_parent" or site == "region" and key == "out1":
            assert_bitwise_equal(a, e, what)  # the gated residual: eager's IEEE operations exactly
            continue
        # at least as close to the float64 value of the same graph as eager's, to one ulp of the
        # tensor's dtype at its largest magnitude; an FP32 sum over positions may be further by
        # the bound of recursive summation, n * 2^-24 of that magnitude (eager sums pairwise)
        scale = truth[key].abs().max().item()
        slack = _ulp(torch.tensor(scale), a.dtype).item()
        if key in REDUCED and a.dtype == torch.float32:
            slack += BATCH * SEQ * 2.0 ** -24 * scale
        ta = (a.double() - truth[key]).abs().max().item()
        te = (e.double() - truth[key]).abs().max().item()
        assert ta <= te + slack, f"{what}: detdit is {ta:.3e} from float64, eager {te:.3e} (slack {slack:.1e})"


@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("name", list(FAMILIES))
def test_site_is_repeatable_and_batch_invariant(name, site):
    f = Family(name)
    t = f.inputs()
    first, second = f.run(site, t, "detdit"), f.run(site, t, "detdit")
    for key in first:
        assert_bitwise_equal(second[key], first[key], f"{name} {site} {key}: a second call")
    alone = f.run(site, {k: (v[:1] if k in ("x", "y", "residual", "grad") or
                             (k == "parent" and f.form != "indexed") else v) for k, v in t.items()}, "detdit")
    for key, value in alone.items():
        if key in ("d_weight", "d_bias") or (key == "d_parent" and f.form == "indexed"):
            continue  # sums over every position of the batch: other samples' terms belong in them
        assert_bitwise_equal(value, first[key][:1], f"{name} {site} {key}: sample 0 alone vs in a batch of {BATCH}")
