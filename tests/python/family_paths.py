"""One block's conditioning path of every DiT family, twice: in plain PyTorch as the family's
diffusers code computes it, and through detdit; and the harness that compares the two
(test_family_paths.py).

A family (FAMILIES) knows:
- ``params()``: its conditioning tensors in diffusers' state-dict layout (key names, shapes and the
  dtypes the model holds them in when loaded in bf16), at small sizes (H = 64);
- ``inputs(batch, seed)``: the model's inputs as its pipeline passes them (timesteps in the family's
  convention and dtype, guidance, pooled text) and the block's hidden states, each with its sequence
  stream (or None: one row per sample);
- ``eager(p, x, tap, c)``: the path in plain torch ops, with every cast through ``c`` (``c(t, dtype)``
  is ``t.to(dtype)``, the identity in the float64 "truth" run of the same graph);
- ``detdit(p, x, tap, ops)``: the same through detdit's functions; ``ops`` runs the sequence-dim ops
  (detdit's, or an SP region's on this rank's rows).

The attention and FFN of a block are stand-ins, ``sublayer(n, y) = n * y`` with y an input (so a
gradient reaches every norm); every stream's hidden states are inputs of their own (a single-stream
block reads its own, not the double block's output). The final layer reads the image stream of the
double block.

``tap(name, t)`` marks a point both sides pass through. The eager run records the value there and
the gradient arriving from downstream; a forced run (detdit's, or the float64 truth's) takes the
eager value as a fresh leaf at each tap and is back-propagated with eager's gradients there, so every
segment between two taps is compared on the same inputs and upstream gradients, to its own bound.
"""
import math

import torch
import torch.nn.functional as F

import detdit

BF, F32, F64 = torch.bfloat16, torch.float32, torch.float64

def randn(shape, seed, dtype, std=1.0, mean=0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * std + mean).to(dtype)


def ulp(v, dtype):
    """One unit in the last place of dtype at |v|."""
    mant = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}[dtype]
    exponent = torch.frexp(v.double().abs().clamp_min(torch.finfo(dtype).tiny))[1]
    return torch.ldexp(torch.ones_like(v, dtype=torch.float64), exponent - mant)


def sublayer(n, y):
    """The attention / FFN stand-in: elementwise, the same torch op on both sides."""
    return n * y


# ---- eager building blocks (diffusers' arithmetic, in plain torch) -------------------------


def eager_sinusoid(t, dim, flip=True, shift=0.0, scale=1.0, max_period=10000, wide=False):
    """get_timestep_embedding: exponent -ln(max_period) * k / (half - shift) and exp in FP32,
    arg = t.float() * freq, then scale * arg; [sin | cos], swapped to [cos | sin] by flip."""
    dt = F64 if wide else F32
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=dt, device=t.device) / (half - shift)
    arg = t.to(dt)[:, None] * torch.exp(exponent)[None, :]
    arg = scale * arg
    emb = torch.cat([torch.sin(arg), torch.cos(arg)], dim=-1)
    if flip:
        emb = torch.cat([emb[:, half:], emb[:, :half]], dim=-1)
    if dim % 2:
        emb = F.pad(emb, (0, 1))
    return emb


def eager_mlp(f, p, prefix):
    """TimestepEmbedding / PixArtAlphaTextProjection (SiLU): linear_2(silu(linear_1(f))), in the
    parameters' dtype."""
    h = F.silu(F.linear(f, p[prefix + "linear_1.weight"], p[prefix + "linear_1.bias"]))
    return F.linear(h, p[prefix + "linear_2.weight"], p[prefix + "linear_2.bias"])


def mlp_params(prefix, k, hidden, out, dtype):
    """An MLP's (shape, dtype, std) by diffusers' key: linear_1 (hidden, k), linear_2 (out, hidden)."""
    return {prefix + "linear_1.weight": ((hidden, k), dtype, 1 / math.sqrt(k)),
            prefix + "linear_1.bias": ((hidden,), dtype, 0.1),
            prefix + "linear_2.weight": ((out, hidden), dtype, 1 / math.sqrt(hidden)),
            prefix + "linear_2.bias": ((out,), dtype, 0.1)}


def linear_params(prefix, n, k, dtype, std=None):
    """A Linear(k, n)'s weight and bias (shape, dtype, std)."""
    return {prefix + "weight": ((n, k), dtype, std or 1 / math.sqrt(k)), prefix + "bias": ((n,), dtype, 0.1)}


# ---- detdit building blocks ----------------------------------------------------------------


def detdit_sinusoid(t, dim, t_max, scale=1.0):
    """Timesteps(dim, flip_sin_to_cos=True, downscale_freq_shift=0, scale) of t in [0, t_max]."""
    if not t.is_floating_point():  # get_timestep_embedding's own t.float(), exact for these integers
        t = t.float()
    return detdit.timestep_sinusoid(t, dim, flip_sin_to_cos=True, downscale_freq_shift=0, scale=scale, t_max=t_max)


def mlp_weights(p, prefix):
    return tuple(p[prefix + k] for k in ("linear_1.weight", "linear_1.bias", "linear_2.weight", "linear_2.bias"))


def detdit_mlp(f, p, prefix):
    """linear_2(silu(linear_1(f))) in the parameters' dtype: detdit.timestep_mlp (a bf16 one
    rounds pre and hidden to bf16 as eager does)."""
    return detdit.timestep_mlp(f, *mlp_weights(p, prefix))


def detdit_combined(t_features, pooled, p, prefix, g_features=None):
    """CombinedTimestep(Guidance)TextProjEmbeddings: (t_emb + g_emb) + text_emb."""
    ts, gs, text = (prefix + k for k in ("timestep_embedder.", "guidance_embedder.", "text_embedder."))
    return detdit.combined_timestep_embedding(t_features, pooled, mlp_weights(p, ts), mlp_weights(p, text),
                                              g_features, None if g_features is None else mlp_weights(p, gs))


def detdit_table_add(table, proj, shape):
    """Wan's / LTX-Video's ``table + proj`` (proj (T, K*H), or (T, 1, H) broadcast over the K
    chunks), viewed as shape."""
    return detdit.adaln_table_add(table, proj).view(shape)


def detdit_linear(x, weight, bias):
    """detdit.linear over the last dim of any rows (it takes (T, K)): row-wise, so the rows'
    order and count change no bit."""
    return detdit.linear(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])


def detdit_final_table(x, temb, table, sd, eps, upcast):
    """detdit.final_layer_table (Wan's, LTX-Video's final layer in one call): a callable."""
    return lambda: detdit.final_layer_table(x, temb, table, sd["proj_out.weight"], sd["proj_out.bias"], eps=eps,
                                            upcast=upcast)


def detdit_adaln(emb, p, prefix, chunks, dtype=None):
    """linear(silu(emb)) into the family's `chunks` chunks (dtype: cast emb first, as
    AdaLayerNormContinuous's ``silu(emb).to(x.dtype)``, the same for a bf16 emb):
    detdit.adaln_projection."""
    return detdit.adaln_projection(emb if dtype is None else emb.to(dtype), p[prefix + "weight"], p[prefix + "bias"],
                                   chunks=chunks)


class Ops:
    """The sequence-dim ops of the detdit side: detdit's functions on the whole sequence, or
    (regions: stream -> SpRegion) an SP region's on this rank's rows. plans: stream -> the
    IndexPlan of an indexed family. numerics: the norms' profile ("torch": CUDA only)."""

    def __init__(self, regions=None, plans=None, numerics="portable"):
        self.regions, self.plans, self.numerics = regions, plans or {}, numerics

    def layernorm(self, stream, x, w=None, b=None, shift=None, scale=None, eps=1e-5, upcast=False):
        if self.regions is not None:
            return self.regions[stream].layernorm(x, w, b, shift, scale, eps=eps, upcast=upcast,
                                                  numerics=self.numerics)
        return detdit.layernorm(x, w, b, shift, scale, eps=eps, upcast=upcast, numerics=self.numerics)

    def rmsnorm(self, stream, x, w, shift=None, scale=None, eps=1e-6):
        if self.regions is not None:
            return self.regions[stream].rmsnorm(x, w, shift, scale, eps=eps, numerics=self.numerics)
        return detdit.rmsnorm(x, w, shift, scale, plan=self.plans.get(stream), eps=eps, numerics=self.numerics)

    def gate_residual(self, stream, residual, y, gate=None, upcast=False):
        if self.regions is not None:
            return self.regions[stream].gate_residual(residual, y, gate, upcast=upcast)
        return detdit.gate_residual(residual, y, gate, plan=self.plans.get(stream), upcast=upcast)

    def gate_residual_layernorm(self, stream, residual, y, gate, w=None, b=None, shift=None, scale=None, eps=1e-5):
        if self.regions is not None:
            return self.regions[stream].gate_residual_layernorm(residual, y, gate, w, b, shift, scale, eps=eps,
                                                                numerics=self.numerics)
        return detdit.gate_residual_layernorm(residual, y, gate, w, b, shift, scale, eps=eps, numerics=self.numerics)

    def gate_residual_rmsnorm(self, stream, residual, y, gate, w, shift, scale, eps):
        if self.regions is not None:
            return self.regions[stream].gate_residual_rmsnorm(residual, y, gate, w, shift, scale, eps=eps,
                                                              numerics=self.numerics)
        return detdit.gate_residual_rmsnorm(residual, y, gate, w, shift, scale, plan=self.plans[stream], eps=eps,
                                            numerics=self.numerics)


# ---- the families ----------------------------------------------------------------------------

HIDDEN, FREQ = 64, 256
ZERO6 = ("shift_msa", "scale_msa", "gate_msa", "shift_mlp", "scale_mlp", "gate_mlp")  # AdaLayerNormZero's chunk(6)
STREAM_LEN = {"img": 32, "txt": 8, "joint": 40}  # S of each stream (multiples of 4: SP worlds 1, 2, 4)


class Family:
    """Base: sizes, the random state dict and inputs, what the harness needs to know."""
    name = ""
    batch = 2
    streams = ("img",)
    outputs = {"out": "img"}  # output name -> its stream
    sp_partial = ("proj_out.",)  # params whose gradients are sums over one rank's positions under SP

    def params(self):
        raise NotImplementedError

    def state_dict(self, seed=0):
        return {k: randn(shape, seed + 11 * i, dtype, std) for i, (k, (shape, dtype, std)) in
                enumerate(sorted(self.params().items()))}

    def stand_ins(self):
        """name -> stream of every sublayer stand-in's second operand."""
        raise NotImplementedError

    def hidden_inputs(self):
        return {f"x_{s}": s for s in self.streams}

    def timestep_inputs(self, batch, seed):
        raise NotImplementedError

    def inputs(self, batch=None, seed=100):
        """name -> (tensor, stream or None, kind): kind "const" (per-sample or per-token timesteps,
        guidance: no gradient), "shared" (no batch dim, no gradient: H3's timesteps and index),
        "sample" (one row per sample, differentiable), "pos" (hidden states), "sub" (stand-in operands)."""
        batch = batch or self.batch
        out = dict(self.timestep_inputs(batch, seed))
        for i, (name, stream) in enumerate(sorted(self.hidden_inputs().items())):
            out[name] = (randn((batch, STREAM_LEN[stream], HIDDEN), seed + 10 + i, BF, 2.0, 0.5), stream, "pos")
        for i, (name, stream) in enumerate(sorted(self.stand_ins().items())):
            out[name] = (randn((batch, STREAM_LEN[stream], HIDDEN), seed + 40 + i, BF), stream, "sub")
        return out

    def plans(self, x, batch):
        """stream -> the IndexPlan of an indexed family's modulation (none here)."""
        return {}

    orders = {}  # detdit's chunk order name -> the chunks' names in diffusers' order (read from the model)

    def modules(self, sd, v, x):
        """The detdit.nn modules that hold this family's sites under diffusers' names, and detdit's
        composite ops of its sites: a list of (label, make() -> the module (in the dtypes the model
        holds) or None for a composite, the state-dict prefix a module loads (or (prefix, the
        module's own prefix for those keys), or None: a module without parameters), checks(module) ->
        [(what, got, want)]) with want the free detdit path's value there (v: its tap values, x:
        its inputs)."""
        return []

    def fused_gates(self):
        """The stand-in operands whose gated residual feeds a norm in the same detdit call (the
        fused gate_residual_layernorm / rmsnorm): their gradient carries that norm's dx, so it is
        bounded, not byte-equal."""
        return set()

    @property
    def longest_sum(self):
        """The longest sum in the path (linear K, LayerNorm's H, a gradient over positions)."""
        return max(FREQ, HIDDEN, self.batch * STREAM_LEN["joint"])


def _chunks(emb, n):
    """(B, n*H) -> n chunks (B, 1, H), the (B, H) chunk unsqueezed as the models broadcast it."""
    return [v[:, None] for v in emb.chunk(n, dim=1)]


class Joint(Family):
    """SD3 / SD3.5, Flux.1 (dev), HunyuanVideo, Qwen-Image: AdaLayerNormZero double blocks (image and
    text streams), Flux's and HunyuanVideo's AdaLayerNormZeroSingle block, the final
    AdaLayerNormContinuous (scale first) and proj_out."""
    streams = ("img", "txt", "joint")
    pooled = None  # pooled text width (text_embedder); None: no text embedder
    guidance = False
    single = False
    eps = 1e-6
    final_temb = "temb"  # the tap of the time embedding the text stream and the final layer read

    def split_temb(self, temb, tap):
        """(the image stream's time embedding, the text stream's and the final layer's): temb for
        both (Qwen-Image's edit models split their doubled batch)."""
        return temb, temb

    def img_chunks(self, emb, n, x):
        """The image stream's n modulation chunks of its projection emb, as the model takes them:
        per sample, (B, 1, H)."""
        return _chunks(emb, n)

    def detdit_img_chunks(self, emb, n, x):
        """The same through detdit (its own call where the model's differs)."""
        return _chunks(emb, n)

    @property
    def orders(self):
        out = {"ada_layer_norm_zero": ZERO6, "ada_layer_norm_continuous": ("scale", "shift")}
        if any(ic == 9 for _, _, ic, _, _ in self.blocks()):
            out["sd35_ada_layer_norm_zero_x"] = ZERO6 + ("shift_msa2", "scale_msa2", "gate_msa2")
        if self.single:
            out["ada_layer_norm_zero_single"] = ("shift", "scale", "gate")
        return out

    def blocks(self):
        """(prefix, img norm key, img chunks, txt norm key, txt chunks) of each double block."""
        return [("transformer_blocks.0.", "norm1.linear.", 6, "norm1_context.linear.", 6)]

    def params(self):
        H = HIDDEN
        p = mlp_params("time_text_embed.timestep_embedder.", FREQ, H, H, BF)
        if self.guidance:
            p |= mlp_params("time_text_embed.guidance_embedder.", FREQ, H, H, BF)
        if self.pooled:
            p |= mlp_params("time_text_embed.text_embedder.", self.pooled, H, H, BF)
        for prefix, ik, ic, tk, tc in self.blocks():
            p |= linear_params(prefix + ik, ic * H, H, BF, 0.3 / math.sqrt(H))
            p |= linear_params(prefix + tk, tc * H, H, BF, 0.3 / math.sqrt(H))
        if self.single:
            p |= linear_params("single_transformer_blocks.0.norm.linear.", 3 * H, H, BF, 0.3 / math.sqrt(H))
        p |= linear_params("norm_out.linear.", 2 * H, H, BF, 0.3 / math.sqrt(H))
        p |= linear_params("proj_out.", 64, H, BF)
        return p

    def hidden_inputs(self):
        return {"x_img": "img", "x_txt": "txt"} | ({"x_joint": "joint"} if self.single else {})

    def fused_gates(self):
        out = set()
        for i, (_, _, ic, _, tc) in enumerate(self.blocks()):
            out.add(f"y{i}_img_attn2" if ic == 9 else f"y{i}_img_attn")
            if tc == 6:
                out.add(f"y{i}_txt_attn")
        return out

    def stand_ins(self):
        out = {}
        for i, (_, _, ic, _, tc) in enumerate(self.blocks()):
            out |= {f"y{i}_img_attn": "img", f"y{i}_img_ff": "img"}
            if ic == 9:
                out[f"y{i}_img_attn2"] = "img"
            if tc == 6:
                out |= {f"y{i}_txt_attn": "txt", f"y{i}_txt_ff": "txt"}
        if self.single:
            out["y_single"] = "joint"
        return out

    def modules(self, sd, v, x):
        import detdit.nn as dn
        H, out, temb = HIDDEN, [], v[self.final_temb]
        prefix, ik, ic, tk, tc = self.blocks()[0]

        def zero(m, inp, key, norm):  # AdaLayerNormZero: (x_mod, gate_msa, shift_mlp, scale_mlp, gate_mlp)
            want = [v[norm]] + [c[:, 0] for c in _chunks(v[key], 6)[2:]]
            return [(f"{norm} output {k}", a, b) for k, (a, b) in enumerate(zip(m(inp, emb=temb), want))]

        if ic == 6 and ik == "norm1.linear.":
            out.append(("norm1", lambda: dn.AdaLayerNormZero(H).to(BF), prefix + "norm1.",
                        lambda m: zero(m, x["x_img"], "b0.img.emb", "y0_img.n1")))
        if ic == 9 and ik == "norm1.linear.":  # SD3.5's dual-attention block: one norm(x), two modulations
            def zero_x(m):
                ch = [c[:, 0] for c in _chunks(v["b0.img.emb"], 9)]
                want = [v["b0.img.n1"], *ch[2:6], v["b0.img.n1b"], ch[8]]
                return [(f"norm1 output {k}", a, b) for k, (a, b) in enumerate(zip(m(x["x_img"], temb), want))]
            out.append(("norm1 (dual attention)", lambda: dn.SD35AdaLayerNormZeroX(H).to(BF), prefix + "norm1.",
                        zero_x))
        if tc == 6 and tk == "norm1_context.linear.":
            out.append(("norm1_context", lambda: dn.AdaLayerNormZero(H).to(BF), prefix + "norm1_context.",
                        lambda m: zero(m, x["x_txt"], "b0.txt.emb", "y0_txt.n1")))
        if self.single:
            def single(m):
                got = m(x["x_joint"], emb=temb)
                gate = _chunks(v["single.emb"], 3)[2][:, 0]
                return [("single.n", got[0], v["single.n"]), ("single gate", got[1], gate)]
            out.append(("single norm", lambda: dn.AdaLayerNormZeroSingle(H).to(BF), "single_transformer_blocks.0.norm.",
                        single))
        last = len(self.blocks()) - 1
        *_, lic, _, ltc = self.blocks()[last]
        final_key = f"y{last}_img.h2" if lic == 6 else f"b{last}.img.h2"
        continuous = lambda: dn.AdaLayerNormContinuous(H, H, elementwise_affine=False, eps=self.eps).to(BF)  # noqa
        out.append(("norm_out", continuous, "norm_out.", lambda m: [("final.n", m(v[final_key], temb), v["final.n"])]))
        if ltc == 2:
            out.append(("norm1_context (last)", continuous, f"transformer_blocks.{last}.norm1_context.",
                        lambda m: [(f"b{last}.txt.n", m(v[f"y{last - 1}_txt.h2"], temb), v[f"b{last}.txt.n"])]))
        out.append(("final_layer_continuous", None, None, lambda m: [("out", detdit.final_layer_continuous(
            v[final_key], temb, sd["norm_out.linear.weight"], sd["norm_out.linear.bias"], sd["proj_out.weight"],
            sd["proj_out.bias"], eps=self.eps), v["out"])]))
        # the rollout side (SGLang's layers, each op rounding: compute_dtype None) on block 0's text stream
        sh, sc, g, sh2, sc2, g2 = _chunks(v["b0.txt.emb"], 6)
        attn = sublayer(v["y0_txt.n1"], x["y0_txt_attn"])
        ff = sublayer(v["y0_txt.n2"], x["y0_txt_ff"])
        rollout = dict(eps=self.eps, elementwise_affine=False, compute_dtype=None)
        out.append(("LayerNormScaleShift", lambda: dn.LayerNormScaleShift(H, **rollout), None,
                    lambda m: [("y0_txt.n1", m(x["x_txt"], sh, sc), v["y0_txt.n1"])]))
        out.append(("ScaleResidualLayerNormScaleShift", lambda: dn.ScaleResidualLayerNormScaleShift(H, **rollout), None,
                    lambda m: list(zip(("y0_txt.n2", "y0_txt.h1"), m(x["x_txt"], attn, g, sh2, sc2),
                                       (v["y0_txt.n2"], v["y0_txt.h1"])))))
        out.append(("ScaleResidual", lambda: dn.ScaleResidual(), None,
                    lambda m: [("y0_txt.h2", m(v["y0_txt.h1"], ff, g2), v["y0_txt.h2"])]))
        return out

    # -- eager --
    def eager_temb(self, p, x, tap, c):
        wide = c.truth
        f = tap("t_features", eager_sinusoid(self.model_t(x["t"]), FREQ, scale=self.sin_scale, wide=wide))
        temb = eager_mlp(c(f, BF), p, "time_text_embed.timestep_embedder.")
        if self.guidance:
            g = tap("g_features", eager_sinusoid(self.model_g(x["guidance"]), FREQ, wide=wide))
            temb = temb + eager_mlp(c(g, BF), p, "time_text_embed.guidance_embedder.")
        if self.pooled:
            temb = temb + eager_mlp(x["pooled"], p, "time_text_embed.text_embedder.")
        return tap("temb", temb)

    def eager_stream(self, key, x, chunks, y, tap, c):
        """norm1 * (1 + scale_msa) + shift_msa; x + gate_msa * attn; norm2 ... ; x + gate_mlp * ff."""
        sh, sc, g, sh2, sc2, g2 = chunks
        ln = lambda v: c.layer_norm(v, eps=self.eps)  # noqa: E731
        n1 = tap(f"{key}.n1", ln(x) * (1 + sc) + sh, kind="norm")
        h = x + g * sublayer(n1, y[f"{key}_attn"])
        n2 = tap(f"{key}.n2", ln(h) * (1 + sc2) + sh2, kind="norm")
        h = tap(f"{key}.h1", h, kind="gate")
        return tap(f"{key}.h2", h + g2 * sublayer(n2, y[f"{key}_ff"]), kind="gate")

    def eager_continuous(self, key, x, temb, p, prefix, tap, c):
        """AdaLayerNormContinuous (no affine): linear(silu(temb).to(x.dtype)) -> scale, shift."""
        emb = tap(f"{key}.emb", F.linear(c(F.silu(temb), x.dtype), p[prefix + "weight"], p[prefix + "bias"]))
        scale, shift = _chunks(emb, 2)
        return tap(f"{key}.n", c.layer_norm(x, eps=self.eps) * (1 + scale) + shift, kind="norm")

    def eager(self, p, x, tap, c):
        img_temb, temb = self.split_temb(self.eager_temb(p, x, tap, c), tap)
        img, txt, out = x["x_img"], x["x_txt"], {}
        for i, (prefix, ik, ic, tk, tc) in enumerate(self.blocks()):
            emb = tap(f"b{i}.img.emb", F.linear(F.silu(img_temb), p[prefix + ik + "weight"], p[prefix + ik + "bias"]))
            ch = self.img_chunks(emb, ic, x)
            if ic == 9:  # SD35AdaLayerNormZeroX: one norm(x), two modulations, two gated residuals
                n = c.layer_norm(img, eps=self.eps)
                n1 = tap(f"b{i}.img.n1", n * (1 + ch[1]) + ch[0], kind="norm")
                n1b = tap(f"b{i}.img.n1b", n * (1 + ch[7]) + ch[6], kind="norm")
                h = tap(f"b{i}.img.h0", img + ch[2] * sublayer(n1, x[f"y{i}_img_attn"]), kind="gate")
                h = h + ch[8] * sublayer(n1b, x[f"y{i}_img_attn2"])
                n2 = tap(f"b{i}.img.n2", c.layer_norm(h, eps=self.eps) * (1 + ch[4]) + ch[3], kind="norm")
                h = tap(f"b{i}.img.h1", h, kind="gate")
                img = tap(f"b{i}.img.h2", h + ch[5] * sublayer(n2, x[f"y{i}_img_ff"]), kind="gate")
            else:
                img = self.eager_stream(f"y{i}_img", img, ch, x, tap, c)
            if tc == 6:
                emb = tap(f"b{i}.txt.emb", F.linear(F.silu(temb), p[prefix + tk + "weight"], p[prefix + tk + "bias"]))
                txt = self.eager_stream(f"y{i}_txt", txt, _chunks(emb, 6), x, tap, c)
            else:  # SD3's last block (context_pre_only): AdaLayerNormContinuous; attention reads its output
                out["txt_n"] = self.eager_continuous(f"b{i}.txt", txt, temb, p, prefix + tk, tap, c)
                txt = None
        if txt is not None:
            out["txt"] = txt
        if self.single:
            emb = tap("single.emb", F.linear(F.silu(temb), p["single_transformer_blocks.0.norm.linear.weight"],
                                              p["single_transformer_blocks.0.norm.linear.bias"]))
            sh, sc, g = _chunks(emb, 3)
            xs = x["x_joint"]
            n = tap("single.n", c.layer_norm(xs, eps=self.eps) * (1 + sc) + sh, kind="norm")
            out["joint"] = tap("single.h", xs + g * sublayer(n, x["y_single"]), kind="gate")
        y = self.eager_continuous("final", img, temb, p, "norm_out.linear.", tap, c)
        out["out"] = tap("out", F.linear(y, p["proj_out.weight"], p["proj_out.bias"]))
        return out

    # -- detdit --
    def detdit_temb(self, p, x, tap):
        f = tap("t_features", detdit_sinusoid(self.model_t(x["t"]), FREQ, self.t_max, self.sin_scale))
        if not self.pooled:  # Qwen-Image: the timestep embedder alone
            return tap("temb", detdit_mlp(f.to(BF), p, "time_text_embed.timestep_embedder."))
        g = None
        if self.guidance:
            g = tap("g_features", detdit_sinusoid(self.model_g(x["guidance"]), FREQ, self.g_max)).to(BF)
        return tap("temb", detdit_combined(f.to(BF), x["pooled"], p, "time_text_embed.", g))

    def detdit_stream(self, stream, key, x, chunks, y, tap, ops):
        sh, sc, g, sh2, sc2, g2 = chunks
        n1 = tap(f"{key}.n1", ops.layernorm(stream, x, shift=sh, scale=sc, eps=self.eps), kind="norm")
        n2, h = ops.gate_residual_layernorm(stream, x, sublayer(n1, y[f"{key}_attn"]), g, shift=sh2, scale=sc2,
                                            eps=self.eps)
        n2 = tap(f"{key}.n2", n2, kind="norm")
        h = tap(f"{key}.h1", h, kind="gate")
        return tap(f"{key}.h2", ops.gate_residual(stream, h, sublayer(n2, y[f"{key}_ff"]), g2), kind="gate")

    def detdit_continuous(self, stream, key, x, temb, p, prefix, tap, ops):
        emb = tap(f"{key}.emb", detdit_adaln(temb, p, prefix, 2, x.dtype))
        scale, shift = _chunks(emb, 2)
        return tap(f"{key}.n", ops.layernorm(stream, x, shift=shift, scale=scale, eps=self.eps), kind="norm")

    def detdit(self, p, x, tap, ops):
        img_temb, temb = self.split_temb(self.detdit_temb(p, x, tap), tap)
        img, txt, out = x["x_img"], x["x_txt"], {}
        for i, (prefix, ik, ic, tk, tc) in enumerate(self.blocks()):
            ch = self.detdit_img_chunks(tap(f"b{i}.img.emb", detdit_adaln(img_temb, p, prefix + ik, ic)), ic, x)
            if ic == 9:
                n1 = tap(f"b{i}.img.n1", ops.layernorm("img", img, shift=ch[0], scale=ch[1], eps=self.eps), kind="norm")
                n1b = tap(f"b{i}.img.n1b", ops.layernorm("img", img, shift=ch[6], scale=ch[7], eps=self.eps),
                          kind="norm")
                h = tap(f"b{i}.img.h0", ops.gate_residual("img", img, sublayer(n1, x[f"y{i}_img_attn"]), ch[2]),
                        kind="gate")
                n2, h = ops.gate_residual_layernorm("img", h, sublayer(n1b, x[f"y{i}_img_attn2"]), ch[8],
                                                    shift=ch[3], scale=ch[4], eps=self.eps)
                n2 = tap(f"b{i}.img.n2", n2, kind="norm")
                h = tap(f"b{i}.img.h1", h, kind="gate")
                img = tap(f"b{i}.img.h2", ops.gate_residual("img", h, sublayer(n2, x[f"y{i}_img_ff"]), ch[5]),
                          kind="gate")
            else:
                img = self.detdit_stream("img", f"y{i}_img", img, ch, x, tap, ops)
            if tc == 6:
                ch = _chunks(tap(f"b{i}.txt.emb", detdit_adaln(temb, p, prefix + tk, 6)), 6)
                txt = self.detdit_stream("txt", f"y{i}_txt", txt, ch, x, tap, ops)
            else:
                out["txt_n"] = self.detdit_continuous("txt", f"b{i}.txt", txt, temb, p, prefix + tk, tap, ops)
                txt = None
        if txt is not None:
            out["txt"] = txt
        if self.single:
            emb = tap("single.emb", detdit_adaln(temb, p, "single_transformer_blocks.0.norm.linear.", 3))
            sh, sc, g = _chunks(emb, 3)
            xs = x["x_joint"]
            n = tap("single.n", ops.layernorm("joint", xs, shift=sh, scale=sc, eps=self.eps), kind="norm")
            out["joint"] = tap("single.h", ops.gate_residual("joint", xs, sublayer(n, x["y_single"]), g), kind="gate")
        y = self.detdit_continuous("img", "final", img, temb, p, "norm_out.linear.", tap, ops)
        out["out"] = tap("out", detdit_linear(y, p["proj_out.weight"], p["proj_out.bias"]))
        return out

    # -- timesteps as the pipeline passes them and the model prepares them --
    sin_scale, t_max, g_max = 1.0, 1000.0, 1e4

    def model_t(self, t):
        return t

    def model_g(self, g):
        return g

    def timestep_inputs(self, batch, seed):
        sigma = torch.linspace(1.0, 0.05, batch, dtype=F32)
        out = {"t": (self.pipeline_t(sigma), None, "const")}
        if self.guidance:
            out["guidance"] = (self.pipeline_g(batch), None, "const")
        if self.pooled:
            out["pooled"] = (randn((batch, self.pooled), seed + 1, BF, 1.0), None, "sample")
        return out

    def pipeline_t(self, sigma):
        return sigma * 1000  # FlowMatchEuler: sigma * 1000 in FP32, (0, 1000]

    @property
    def outputs(self):
        names = {"out": "img", "txt": "txt"}
        if any(tc != 6 for *_, tc in self.blocks()):
            names = {"out": "img", "txt_n": "txt"}
        return names | ({"joint": "joint"} if self.single else {})


class SD3(Joint):
    """SD3.5: block 0 a dual-attention block (SD35AdaLayerNormZeroX, 9 chunks), block 1 the last
    block (context_pre_only: the text stream's AdaLayerNormContinuous, no text FFN)."""
    name = "sd3"
    pooled = 48

    def blocks(self):
        return [("transformer_blocks.0.", "norm1.linear.", 9, "norm1_context.linear.", 6),
                ("transformer_blocks.1.", "norm1.linear.", 6, "norm1_context.linear.", 2)]


class Flux(Joint):
    """Flux.1-dev: the timestep round trip through bf16 (the pipeline passes bf16 t / 1000, the
    model multiplies by 1000 in bf16), guidance * 1000 in bf16, pooled text 768 (here 40)."""
    name = "flux"
    pooled, guidance, single = 40, True, True

    def pipeline_t(self, sigma):
        return (sigma * 1000).to(BF) / 1000

    def model_t(self, t):
        return t.to(BF) * 1000

    def pipeline_g(self, batch):
        return torch.full((batch,), 3.5, dtype=F32)

    def model_g(self, g):
        return g.to(BF) * 1000


class Hunyuan(Joint):
    """HunyuanVideo: t = sigma * 1000 in FP32, guidance a bf16 tensor times 1000.0 (bf16 product,
    the pipeline's), pooled text 768 (here 40). The token refiner (context_embedder): its own
    CombinedTimestepTextProjEmbeddings on the same t and the mean-pooled text (4096, here 56),
    one refiner block: affine LayerNorms (eps 1e-6) without modulation, residuals gated by
    HunyuanVideoAdaNorm's linear(silu(temb)) (gate_msa, gate_mlp)."""
    name = "hunyuan_video"
    pooled, guidance, single = 40, True, True
    ref_pooled = 56
    REF = "context_embedder."
    BLOCK = "context_embedder.token_refiner.refiner_blocks.0."

    def pipeline_g(self, batch):
        return torch.full((batch,), 6.0, dtype=BF) * 1000.0

    def params(self):
        H = HIDDEN
        p = super().params()
        p |= mlp_params(self.REF + "time_text_embed.timestep_embedder.", FREQ, H, H, BF)
        p |= mlp_params(self.REF + "time_text_embed.text_embedder.", self.ref_pooled, H, H, BF)
        for k in ("norm1", "norm2"):
            p[self.BLOCK + k + ".weight"], p[self.BLOCK + k + ".bias"] = ((H,), BF, 0.2), ((H,), BF, 0.2)
        p |= linear_params(self.BLOCK + "norm_out.linear.", 2 * H, H, BF, 0.3 / math.sqrt(H))
        return p

    def state_dict(self, seed=0):
        sd = super().state_dict(seed)
        for k in ("norm1", "norm2"):
            sd[self.BLOCK + k + ".weight"] = sd[self.BLOCK + k + ".weight"] + 1
        return sd

    def hidden_inputs(self):
        return super().hidden_inputs() | {"x_ref": "txt"}

    def stand_ins(self):
        return super().stand_ins() | {"y_ref_attn": "txt", "y_ref_ff": "txt"}

    def timestep_inputs(self, batch, seed):
        return super().timestep_inputs(batch, seed) | {
            "pooled_ref": (randn((batch, self.ref_pooled), seed + 2, BF, 1.0), None, "sample")}

    @property
    def outputs(self):
        return super().outputs | {"ref": "txt"}

    def eager(self, p, x, tap, c):
        out = super().eager(p, x, tap, c)
        f = tap("ref.t_features", eager_sinusoid(x["t"], FREQ, wide=c.truth))
        temb = eager_mlp(c(f, BF), p, self.REF + "time_text_embed.timestep_embedder.")
        temb = tap("ref.temb", temb + eager_mlp(x["pooled_ref"], p, self.REF + "time_text_embed.text_embedder."))
        b = self.BLOCK
        gates = tap("ref.gates", F.linear(F.silu(temb), p[b + "norm_out.linear.weight"], p[b + "norm_out.linear.bias"]))
        g1, g2 = _chunks(gates, 2)
        h = x["x_ref"]
        n1 = tap("ref.n1", c.layer_norm(h, p[b + "norm1.weight"], p[b + "norm1.bias"], 1e-6), kind="norm")
        h = tap("ref.h1", h + sublayer(n1, x["y_ref_attn"]) * g1, kind="gate")
        n2 = tap("ref.n2", c.layer_norm(h, p[b + "norm2.weight"], p[b + "norm2.bias"], 1e-6), kind="norm")
        out["ref"] = tap("ref.h2", h + sublayer(n2, x["y_ref_ff"]) * g2, kind="gate")
        return out

    def detdit(self, p, x, tap, ops):
        out = super().detdit(p, x, tap, ops)
        f = tap("ref.t_features", detdit_sinusoid(x["t"], FREQ, self.t_max))
        temb = tap("ref.temb", detdit_combined(f.to(BF), x["pooled_ref"], p, self.REF + "time_text_embed."))
        b = self.BLOCK
        g1, g2 = _chunks(tap("ref.gates", detdit_adaln(temb, p, b + "norm_out.linear.", 2)), 2)
        h = x["x_ref"]
        n1 = tap("ref.n1", ops.layernorm("txt", h, p[b + "norm1.weight"], p[b + "norm1.bias"], eps=1e-6), kind="norm")
        h = tap("ref.h1", ops.gate_residual("txt", h, sublayer(n1, x["y_ref_attn"]), g1), kind="gate")
        n2 = tap("ref.n2", ops.layernorm("txt", h, p[b + "norm2.weight"], p[b + "norm2.bias"], eps=1e-6), kind="norm")
        out["ref"] = tap("ref.h2", ops.gate_residual("txt", h, sublayer(n2, x["y_ref_ff"]), g2), kind="gate")
        return out


class Qwen(Joint):
    """Qwen-Image: img_mod / txt_mod Sequential(SiLU, Linear) (keys ``img_mod.1``), the same six
    chunks; the pipeline passes bf16 t / 1000 and Timesteps scales by 1000 (after the frequency
    product); no pooled text, no guidance."""
    name = "qwen_image"
    sin_scale, t_max = 1000.0, 1.0

    def blocks(self):
        return [("transformer_blocks.0.", "img_mod.1.", 6, "txt_mod.1.", 6)]

    def pipeline_t(self, sigma):
        return (sigma * 1000).to(BF) / 1000


class QwenEdit(Qwen):
    """Qwen-Image's edit models (``zero_cond_t``): the model doubles the timesteps to ``[t, 0]``
    (bf16), so the sinusoid, the time MLP and img_mod run on 2B rows; each image token takes its
    shift, scale and gate from the t half (``modulate_index`` 0: the generated image's tokens, first)
    or the 0 half (1: the reference image's tokens, after them), so the image stream's modulation is
    per token (B, S, H): torch.where in the model, detdit's row gather on the detdit side; txt_mod and
    the final layer read the t half."""
    name = "qwen_image_edit"
    reference = 12  # the last 12 of the image stream's 32 tokens: SP ranks hold both kinds at 2 and 4
    final_temb = "temb_t"
    # per token: the image modulation's gradients, and what is upstream of them, sum over this rank's tokens
    sp_partial = ("proj_out.", "time_text_embed.", "transformer_blocks.0.img_mod.")

    def model_t(self, t):
        return torch.cat([t, t * 0])

    def timestep_inputs(self, batch, seed):
        S = STREAM_LEN["img"]
        index = torch.tensor([0] * (S - self.reference) + [1] * self.reference, dtype=torch.int).expand(batch, S)
        return super().timestep_inputs(batch, seed) | {"modulate_index": (index.contiguous(), "img", "const")}

    def split_temb(self, temb, tap):
        return temb, tap("temb_t", temb.chunk(2, dim=0)[0])

    def img_chunks(self, emb, n, x):
        """_modulate's selection: torch.where(index == 0, the t half's (B, 1, H), the 0 half's)."""
        index = x["modulate_index"].unsqueeze(-1)  # (B, S, 1)
        B = index.shape[0]
        return [torch.where(index == 0, v[:B], v[B:]) for v in _chunks(emb, n)]  # (B, S, H) each

    def detdit_img_chunks(self, emb, n, x):
        """Token s of sample b reads row b (index 0) or B + b (index 1) of the (2B, 6H) projection:
        adaln_row_gather by the plan of those rows over the B * S positions (a byte copy; its
        gradient the plan's reduction over the positions), each chunk viewed (B, S, H)."""
        index = x["modulate_index"]
        B, S = index.shape
        rows = torch.arange(B, dtype=index.dtype, device=index.device)[:, None] + B * index
        gathered = detdit.adaln_row_gather(emb, detdit.plan_from_rows(rows.flatten(), 2 * B))  # (6, B * S, H)
        return [v.view(B, S, HIDDEN) for v in gathered.unbind(0)]

    def modules(self, sd, v, x):
        import detdit.nn as dn
        out = super().modules(sd, v, x)
        # SGLang's layers take the per-token form: block 0's image stream
        sh, sc, g, sh2, sc2, g2 = self.img_chunks(v["b0.img.emb"], 6, x)
        attn, ff = sublayer(v["y0_img.n1"], x["y0_img_attn"]), sublayer(v["y0_img.n2"], x["y0_img_ff"])
        rollout = dict(eps=self.eps, elementwise_affine=False, compute_dtype=None)
        return out + [
            ("LayerNormScaleShift (per token)", lambda: dn.LayerNormScaleShift(HIDDEN, **rollout), None,
             lambda m: [("y0_img.n1", m(x["x_img"], sh, sc), v["y0_img.n1"])]),
            ("ScaleResidualLayerNormScaleShift (per token)",
             lambda: dn.ScaleResidualLayerNormScaleShift(HIDDEN, **rollout), None,
             lambda m: list(zip(("y0_img.n2", "y0_img.h1"), m(x["x_img"], attn, g, sh2, sc2),
                                (v["y0_img.n2"], v["y0_img.h1"])))),
            ("ScaleResidual (per token)", lambda: dn.ScaleResidual(), None,
             lambda m: [("y0_img.h2", m(v["y0_img.h1"], ff, g2), v["y0_img.h2"])])]


class Wan(Family):
    """Wan 2.1 / 2.2: the FP32 time embedder, its bf16 output, time_proj (bf16) of its SiLU, the FP32
    ``scale_shift_table + timestep_proj.float()``; FP32LayerNorm norm1 / norm3 modulated and norm2
    affine (FP32 weight, unmodulated, before the ungated cross-attention residual), every step of
    the upcast recipe; the final FP32 table plus the time embedding itself (shift, scale)."""
    name = "wan_2_1"
    per_token = False
    out_channels = 16
    stand = {"y_attn": "img", "y_cross": "img", "y_ff": "img"}
    eps = 1e-6
    orders = {"wan_block": ("shift", "scale", "gate", "c_shift", "c_scale", "c_gate"),
              "scale_shift_table_final": ("shift", "scale")}

    def params(self):
        H = HIDDEN
        p = mlp_params("condition_embedder.time_embedder.", FREQ, H, H, F32)
        p |= linear_params("condition_embedder.time_proj.", 6 * H, H, BF, 0.3 / math.sqrt(H))
        p["blocks.0.scale_shift_table"] = ((1, 6, H), F32, 1 / math.sqrt(H))
        p["blocks.0.norm2.weight"] = ((H,), F32, 0.2)
        p["blocks.0.norm2.bias"] = ((H,), F32, 0.2)
        p["scale_shift_table"] = ((1, 2, H), F32, 1 / math.sqrt(H))
        p |= linear_params("proj_out.", 4 * self.out_channels, H, BF)
        return p

    def state_dict(self, seed=0):
        sd = super().state_dict(seed)
        sd["blocks.0.norm2.weight"] = sd["blocks.0.norm2.weight"] + 1  # around 1, as a trained norm's
        return sd

    def stand_ins(self):
        return self.stand

    def modules(self, sd, v, x):
        import detdit.nn as dn
        final = detdit_final_table(v["h3"], v["temb"], sd["scale_shift_table"], sd, self.eps, True)
        sh, sc, g, csh, csc, cg = self._split(v["mod"])
        attn, cross = sublayer(v["n1"], x["y_attn"]), sublayer(v["n2"], x["y_cross"])
        rollout = dict(eps=self.eps, elementwise_affine=False, compute_dtype=F32)  # SGLang's FP32 compute: upcast
        return [("norm2", lambda: dn.FP32LayerNorm(HIDDEN, eps=self.eps, elementwise_affine=True), "blocks.0.norm2.",
                 lambda m: [("n2", m(v["h1"].float()).to(BF), v["n2"])]),
                ("LayerNormScaleShift", lambda: dn.LayerNormScaleShift(HIDDEN, **rollout), None,
                 lambda m: [("n1", m(x["x_img"], sh, sc), v["n1"])]),
                ("ScaleResidual", lambda: dn.ScaleResidual(compute_dtype=F32), None,
                 lambda m: [("h1", m(x["x_img"], attn, g), v["h1"])]),
                ("ScaleResidualLayerNormScaleShift", lambda: dn.ScaleResidualLayerNormScaleShift(HIDDEN, **rollout),
                 None, lambda m: list(zip(("n3", "h2"), m(v["h1"], cross, 1, csh, csc), (v["n3"], v["h2"])))),
                ("final_layer_table", None, None, lambda m: [("out", final(), v["out"])])]

    @property
    def sp_partial(self):  # per token: everything upstream of the modulation sums over this rank's tokens
        return ("proj_out.", "condition_embedder.", "blocks.0.scale_shift_table", "scale_shift_table") \
            if self.per_token else ("proj_out.",)

    def timestep_inputs(self, batch, seed):
        # UniPC with flow sigmas: integer timesteps in [0, 999], int64
        t = torch.tensor([999, 437, 12][:batch] + [500] * max(0, batch - 3), dtype=torch.int64)
        if self.per_token:  # TI2V: t * mask per token (FP32), the first frame's tokens at 0
            mask = torch.ones(batch, STREAM_LEN["img"])
            mask[:, :STREAM_LEN["img"] // 4] = 0
            return {"t": (mask * t[:, None].float(), "img", "const")}
        return {"t": (t, None, "const")}

    def _mod(self, table, proj, c):
        """table (1, K, H) + the projection (B, K*H) or (B, S, K*H), in FP32 (the table's dtype)."""
        K = table.shape[1]
        if self.per_token:
            return table.unsqueeze(0) + c(proj.unflatten(-1, (K, HIDDEN)), F32)  # (B, S, K, H)
        return table + c(proj.unflatten(-1, (K, HIDDEN)), F32)  # (B, K, H)

    def _split(self, mod):
        if self.per_token:
            return [v.squeeze(2) for v in mod.chunk(mod.shape[2], dim=2)]  # (B, S, H) each
        return list(mod.chunk(mod.shape[1], dim=1))  # (B, 1, H) each

    def eager(self, p, x, tap, c):
        t = x["t"]
        f = tap("t_features", eager_sinusoid(t.flatten(), FREQ, wide=c.truth))
        temb = eager_mlp(c(f, F32), p, "condition_embedder.time_embedder.")  # FP32 (kept FP32 at load)
        temb = tap("temb", c(temb, BF))  # .type_as(encoder_hidden_states)
        proj = F.linear(F.silu(temb), p["condition_embedder.time_proj.weight"], p["condition_embedder.time_proj.bias"])
        proj = tap("proj", proj if not self.per_token else proj.unflatten(0, t.shape))
        mod = tap("mod", self._mod(p["blocks.0.scale_shift_table"], proj, c))
        sh, sc, g, csh, csc, cg = self._split(mod)
        ln = lambda v, w=None, b=None: c.layer_norm(c(v, F32), w, b, self.eps)  # noqa: E731
        h = x["x_img"]
        n1 = tap("n1", c(ln(h) * (1 + sc) + sh, BF), kind="norm")
        h = tap("h1", c(c(h, F32) + sublayer(n1, x["y_attn"]) * g, BF), kind="gate")
        n2 = tap("n2", c(ln(h, p["blocks.0.norm2.weight"], p["blocks.0.norm2.bias"]), BF), kind="norm")
        h = tap("h2", h + sublayer(n2, x["y_cross"]), kind="gate")
        n3 = tap("n3", c(ln(h) * (1 + csc) + csh, BF), kind="norm")
        h = tap("h3", c(c(h, F32) + c(sublayer(n3, x["y_ff"]), F32) * cg, BF), kind="gate")
        temb_rows = temb if not self.per_token else temb.unflatten(0, t.shape)
        table = p["scale_shift_table"]
        fmod = tap("final.mod", table.unsqueeze(0) + temb_rows.unsqueeze(2) if self.per_token
                   else table + temb_rows.unsqueeze(1))
        shift, scale = self._split(fmod)
        y = tap("final.n", c(ln(h) * (1 + scale) + shift, BF), kind="norm")
        return {"out": tap("out", F.linear(y, p["proj_out.weight"], p["proj_out.bias"]))}

    def detdit(self, p, x, tap, ops):
        t = x["t"]
        f = tap("t_features", detdit_sinusoid(t.flatten(), FREQ, 1000.0))
        temb = tap("temb", detdit_mlp(f, p, "condition_embedder.time_embedder.").to(BF))
        proj = detdit_adaln(temb, p, "condition_embedder.time_proj.", 6)
        proj = tap("proj", proj if not self.per_token else proj.unflatten(0, t.shape))
        mod = tap("mod", detdit_table_add(p["blocks.0.scale_shift_table"], proj.reshape(-1, 6 * HIDDEN),
                                          (*proj.shape[:-1], 6, HIDDEN)))
        sh, sc, g, csh, csc, cg = self._split(mod)
        h = x["x_img"]
        n1 = tap("n1", ops.layernorm("img", h, shift=sh, scale=sc, eps=self.eps, upcast=True), kind="norm")
        h = tap("h1", ops.gate_residual("img", h, sublayer(n1, x["y_attn"]), g, upcast=True), kind="gate")
        # norm2: FP32LayerNorm with its FP32 weight of x.float(), then .type_as(x)
        n2 = tap("n2", ops.layernorm("img", h.float(), p["blocks.0.norm2.weight"], p["blocks.0.norm2.bias"],
                                     eps=self.eps).to(BF), kind="norm")
        h = tap("h2", ops.gate_residual("img", h, sublayer(n2, x["y_cross"])), kind="gate")
        n3 = tap("n3", ops.layernorm("img", h, shift=csh, scale=csc, eps=self.eps, upcast=True), kind="norm")
        h = tap("h3", ops.gate_residual("img", h, sublayer(n3, x["y_ff"]), cg, upcast=True), kind="gate")
        fmod = tap("final.mod", detdit_table_add(p["scale_shift_table"], temb.reshape(-1, 1, HIDDEN),
                                                 (*t.shape, 2, HIDDEN)))
        shift, scale = self._split(fmod)
        y = tap("final.n", ops.layernorm("img", h, shift=shift, scale=scale, eps=self.eps, upcast=True), kind="norm")
        return {"out": tap("out", detdit_linear(y, p["proj_out.weight"], p["proj_out.bias"]))}


class WanA14B(Wan):
    """Wan 2.2 A14B: each of the two experts has Wan 2.1's layout; the high-noise expert
    (``transformer``) runs t >= boundary (0.875 * 1000), the low-noise one below."""
    name = "wan_2_2_a14b"

    def timestep_inputs(self, batch, seed):
        return {"t": (torch.tensor([999, 900, 876][:batch], dtype=torch.int64), None, "const")}


class WanTI2V(Wan):
    """Wan 2.2 TI2V-5B: per-token timesteps (t * mask, the first latent frame at 0), so the time
    embedding, the projection and both tables' sums are per token (B, S, 6, H); 48 channels."""
    name = "wan_2_2_ti2v_5b"
    per_token = True
    out_channels = 48


class CogVideoX(Family):
    """CogVideoX: the sinusoid H wide, TimestepEmbedding(H, D) in bf16; CogVideoXLayerNormZero
    (Linear(D, 6H): shift, scale, gate, enc_shift, enc_scale, enc_gate; one affine LayerNorm, eps
    1e-5, for both streams) as norm1 and norm2; norm_final (affine) then AdaLayerNorm(chunk_dim 1:
    shift, scale) with its own affine LayerNorm; proj_out."""
    name = "cogvideox"
    streams = ("img", "txt")
    outputs = {"out": "img", "txt": "txt"}
    D = 48  # time_embed_dim (512 in the models)
    eps = 1e-5
    ofs = False  # CogVideoX 1.5 image-to-video's ofs embedding
    out_features = 64  # proj_out: patch 2 x 2 x 16 channels
    orders = {"cogvideox_layer_norm_zero": ("shift", "scale", "gate", "enc_shift", "enc_scale", "enc_gate"),
              "ada_layer_norm": ("shift", "scale")}

    def params(self):
        H, D = HIDDEN, self.D
        p = mlp_params("time_embedding.", H, D, D, BF)
        for k in ("norm1", "norm2"):
            p |= linear_params(f"transformer_blocks.0.{k}.linear.", 6 * H, D, BF, 0.3 / math.sqrt(D))
            p[f"transformer_blocks.0.{k}.norm.weight"] = ((H,), BF, 0.2)
            p[f"transformer_blocks.0.{k}.norm.bias"] = ((H,), BF, 0.2)
        p["norm_final.weight"], p["norm_final.bias"] = ((H,), BF, 0.2), ((H,), BF, 0.2)
        p |= linear_params("norm_out.linear.", 2 * H, D, BF, 0.3 / math.sqrt(D))
        p["norm_out.norm.weight"], p["norm_out.norm.bias"] = ((H,), BF, 0.2), ((H,), BF, 0.2)
        if self.ofs:  # TimestepEmbedding(ofs_embed_dim, ofs_embed_dim), ofs_embed_dim = time_embed_dim (512)
            p |= mlp_params("ofs_embedding.", D, D, D, BF)
        p |= linear_params("proj_out.", self.out_features, H, BF)
        return p

    def state_dict(self, seed=0):
        sd = super().state_dict(seed)
        for k in sd:
            if k.endswith("norm.weight") or k == "norm_final.weight":
                sd[k] = sd[k] + 1
        return sd

    def stand_ins(self):
        return {"y_img_attn": "img", "y_img_ff": "img", "y_txt_attn": "txt", "y_txt_ff": "txt"}

    def modules(self, sd, v, x):
        import detdit.nn as dn
        sh, sc, g, esh, esc, eg = _chunks(v["norm1.emb"], 6)
        affine = dict(elementwise_affine=True, dtype=BF, compute_dtype=None)
        out = [("LayerNormScaleShift (norm1's norm)", lambda: dn.LayerNormScaleShift(HIDDEN, self.eps, **affine),
                ("transformer_blocks.0.norm1.norm.", "norm."),
                lambda m: [("norm1.img", m(x["x_img"], sh, sc), v["norm1.img"]),
                           ("norm1.txt", m(x["x_txt"], esh, esc), v["norm1.txt"])])]
        for k, img, txt in (("norm1", x["x_img"], x["x_txt"]), ("norm2", v["norm1.img_h"], v["norm1.txt_h"])):
            def zero(m, k=k, img=img, txt=txt):  # (img, txt, gate, enc_gate), gates (B, 1, H)
                g, eg = _chunks(v[f"{k}.emb"], 6)[2::3]
                names = (f"{k}.img", f"{k}.txt", f"{k} gate", f"{k} enc_gate")
                return list(zip(names, m(img, txt, v["temb"]), (v[f"{k}.img"], v[f"{k}.txt"], g, eg)))
            out.append((k, lambda: dn.CogVideoXLayerNormZero(self.D, HIDDEN, eps=self.eps).to(BF),
                        f"transformer_blocks.0.{k}.", zero))
        out.append(("norm_out", lambda: dn.AdaLayerNorm(self.D, output_dim=2 * HIDDEN, norm_elementwise_affine=True,
                                                        norm_eps=self.eps, chunk_dim=1).to(BF), "norm_out.",
                    lambda m: [("final.n", m(v["norm_final"], temb=v["temb"]), v["final.n"])]))
        return out

    def timestep_inputs(self, batch, seed):
        out = {"t": (torch.tensor([999, 321, 7][:batch], dtype=torch.int64), None, "const")}
        if self.ofs:  # the pipeline's latents.new_full((1,), 2.0): one bf16 row for the whole batch
            out["ofs"] = (torch.full((1,), 2.0, dtype=BF), None, "shared")
        return out

    def eager(self, p, x, tap, c):
        f = tap("t_features", eager_sinusoid(x["t"], HIDDEN, wide=c.truth))
        temb = eager_mlp(c(f, BF), p, "time_embedding.")
        if self.ofs:  # ofs_proj (Timesteps(D, True, 0)), cast to the model's dtype, ofs_embedding; emb + ofs_emb
            fo = tap("ofs_features", eager_sinusoid(x["ofs"], self.D, wide=c.truth))
            temb = temb + eager_mlp(c(fo, BF), p, "ofs_embedding.")
        temb = tap("temb", temb)
        img, txt = x["x_img"], x["x_txt"]
        for k, site in (("norm1", "attn"), ("norm2", "ff")):
            pre = f"transformer_blocks.0.{k}."
            emb = tap(f"{k}.emb", F.linear(F.silu(temb), p[pre + "linear.weight"], p[pre + "linear.bias"]))
            sh, sc, g, esh, esc, eg = _chunks(emb, 6)
            ln = lambda v: c.layer_norm(v, p[pre + "norm.weight"], p[pre + "norm.bias"], self.eps)  # noqa: E731
            n_img = tap(f"{k}.img", ln(img) * (1 + sc) + sh, kind="norm")
            n_txt = tap(f"{k}.txt", ln(txt) * (1 + esc) + esh, kind="norm")
            img = tap(f"{k}.img_h", img + g * sublayer(n_img, x[f"y_img_{site}"]), kind="gate")
            txt = tap(f"{k}.txt_h", txt + eg * sublayer(n_txt, x[f"y_txt_{site}"]), kind="gate")
        nf = tap("norm_final", c.layer_norm(img, p["norm_final.weight"], p["norm_final.bias"], self.eps), kind="norm")
        emb = tap("final.emb", F.linear(F.silu(temb), p["norm_out.linear.weight"], p["norm_out.linear.bias"]))
        shift, scale = _chunks(emb, 2)
        y = tap("final.n", c.layer_norm(nf, p["norm_out.norm.weight"], p["norm_out.norm.bias"], self.eps)
                * (1 + scale) + shift, kind="norm")
        return {"out": tap("out", F.linear(y, p["proj_out.weight"], p["proj_out.bias"])), "txt": txt}

    def detdit(self, p, x, tap, ops):
        f = tap("t_features", detdit_sinusoid(x["t"], HIDDEN, 1000.0))
        temb = detdit_mlp(f.to(BF), p, "time_embedding.")
        if self.ofs:  # ofs is the pipeline's constant 2.0: t_max 2
            fo = tap("ofs_features", detdit_sinusoid(x["ofs"], self.D, 2.0))
            temb = temb + detdit_mlp(fo.to(BF), p, "ofs_embedding.")  # eager's bf16 add, broadcast over the batch
        temb = tap("temb", temb)
        img, txt = x["x_img"], x["x_txt"]
        for k, site in (("norm1", "attn"), ("norm2", "ff")):
            pre = f"transformer_blocks.0.{k}."
            sh, sc, g, esh, esc, eg = _chunks(tap(f"{k}.emb", detdit_adaln(temb, p, pre + "linear.", 6)), 6)
            w, b = p[pre + "norm.weight"], p[pre + "norm.bias"]
            n_img = tap(f"{k}.img", ops.layernorm("img", img, w, b, sh, sc, eps=self.eps), kind="norm")
            n_txt = tap(f"{k}.txt", ops.layernorm("txt", txt, w, b, esh, esc, eps=self.eps), kind="norm")
            img = tap(f"{k}.img_h", ops.gate_residual("img", img, sublayer(n_img, x[f"y_img_{site}"]), g), kind="gate")
            txt = tap(f"{k}.txt_h", ops.gate_residual("txt", txt, sublayer(n_txt, x[f"y_txt_{site}"]), eg),
                      kind="gate")
        nf = tap("norm_final", ops.layernorm("img", img, p["norm_final.weight"], p["norm_final.bias"], eps=self.eps),
                 kind="norm")
        shift, scale = _chunks(tap("final.emb", detdit_adaln(temb, p, "norm_out.linear.", 2)), 2)
        y = tap("final.n", ops.layernorm("img", nf, p["norm_out.norm.weight"], p["norm_out.norm.bias"], shift, scale,
                                         eps=self.eps), kind="norm")
        return {"out": tap("out", detdit_linear(y, p["proj_out.weight"], p["proj_out.bias"])), "txt": txt}


class CogVideoX15I2V(CogVideoX):
    """CogVideoX 1.5 image-to-video: the ofs embedding (Timesteps(D, True, 0) of the pipeline's one
    bf16 ofs row, TimestepEmbedding(D, D) in bf16) added to the time embedding before the blocks,
    broadcast over the batch; patch_size_t 2, so proj_out has 2 x 2 x 2 x 16 = 128 outputs."""
    name = "cogvideox_1_5_i2v"
    ofs = True
    out_features = 128


class LTX(Family):
    """LTX-Video image-to-video: per-token timesteps t * (1 - mask) (the conditioning frame's
    tokens at 0); AdaLayerNormSingle (TimestepEmbedding in bf16, then linear(silu) to 6H per token);
    block ``scale_shift_table (6, H) + temb`` in bf16; RMSNorm without affine (eps 1e-6) as norm1 and
    norm2; the cross-attention residual ungated; the final ``table (2, H) + embedded_timestep``
    (shift, scale) around a LayerNorm without affine; proj_out (128)."""
    name = "ltx_video"
    per_token = True
    stand = {"y_attn": "img", "y_cross": "img", "y_ff": "img"}
    eps = 1e-6

    @property
    def sp_partial(self):  # per token: everything upstream of the modulation sums over this rank's tokens
        return ("proj_out.", "time_embed.", "transformer_blocks.0.scale_shift_table", "scale_shift_table") \
            if self.per_token else ("proj_out.",)

    def params(self):
        H = HIDDEN
        p = mlp_params("time_embed.emb.timestep_embedder.", FREQ, H, H, BF)
        p |= linear_params("time_embed.linear.", 6 * H, H, BF, 0.3 / math.sqrt(H))
        p["transformer_blocks.0.scale_shift_table"] = ((6, H), BF, 1 / math.sqrt(H))
        p["scale_shift_table"] = ((2, H), BF, 1 / math.sqrt(H))
        p |= linear_params("proj_out.", 128, H, BF)
        return p

    def stand_ins(self):
        return self.stand

    def timestep_inputs(self, batch, seed):
        sigma = torch.linspace(1.0, 0.3, batch, dtype=F32)
        if not self.per_token:  # text-to-video: t = sigma * 1000 per sample, FP32
            return {"t": (sigma * 1000, None, "const")}
        mask = torch.zeros(batch, STREAM_LEN["img"])
        mask[:, :STREAM_LEN["img"] // 4] = 1  # the conditioning frame
        return {"t": ((sigma * 1000)[:, None] * (1 - mask), "img", "const")}

    orders = {"ada_layer_norm_zero": ZERO6, "scale_shift_table_final": ("shift", "scale")}

    def modules(self, sd, v, x):
        import detdit.nn as dn
        final = detdit_final_table(v["h3"], v["embedded"], sd["scale_shift_table"], sd, self.eps, False)
        sh, sc, g, sh2, sc2, g2 = v["mod"].unbind(dim=2)
        cross, ff = sublayer(v["h1"], x["y_cross"]), sublayer(v["n2"], x["y_ff"])
        rollout = dict(eps=self.eps, elementwise_affine=False, compute_dtype=None)
        t = x["t"]
        return [("time_embed", lambda: dn.AdaLayerNormSingle(HIDDEN).to(BF), "time_embed.",
                 lambda m: list(zip(("temb", "embedded"), m(t.flatten(), batch_size=t.shape[0], hidden_dtype=BF),
                                    (v["temb"], v["embedded"])))),
                ("final_layer_table", None, None, lambda m: [("out", final(), v["out"])]),
                ("RMSNormScaleShift", lambda: dn.RMSNormScaleShift(HIDDEN, **rollout), None,
                 lambda m: [("n1", m(x["x_img"], sh, sc), v["n1"])]),
                ("ScaleResidualRMSNormScaleShift", lambda: dn.ScaleResidualRMSNormScaleShift(HIDDEN, **rollout), None,
                 lambda m: list(zip(("n2", "h2"), m(v["h1"], cross, 1, sh2, sc2), (v["n2"], v["h2"])))),
                ("ScaleResidual", lambda: dn.ScaleResidual(), None, lambda m: [("h3", m(v["h2"], ff, g2), v["h3"])])]

    def _mod(self, table, temb_rows):  # (K, H)[None, None] + (B, S, K, H)
        return table[None, None] + temb_rows

    def eager(self, p, x, tap, c):
        t = x["t"]
        B, S = t.shape if self.per_token else (t.shape[0], 1)  # S: timestep rows per sample
        f = tap("t_features", eager_sinusoid(t.flatten(), FREQ, wide=c.truth))
        emb = tap("embedded", eager_mlp(c(f, BF), p, "time_embed.emb.timestep_embedder."))
        temb = tap("temb", F.linear(F.silu(emb), p["time_embed.linear.weight"], p["time_embed.linear.bias"]))
        mod = tap("mod", self._mod(p["transformer_blocks.0.scale_shift_table"], temb.view(B, S, 6, HIDDEN)))
        sh, sc, g, sh2, sc2, g2 = mod.unbind(dim=2)
        h = x["x_img"]
        n1 = tap("n1", c.rms(h, None, self.eps) * (1 + sc) + sh, kind="rms")
        h = tap("h1", h + sublayer(n1, x["y_attn"]) * g, kind="gate")
        h = tap("h2", h + sublayer(h, x["y_cross"]), kind="gate")
        n2 = tap("n2", c.rms(h, None, self.eps) * (1 + sc2) + sh2, kind="rms")
        h = tap("h3", h + sublayer(n2, x["y_ff"]) * g2, kind="gate")
        fmod = tap("final.mod", p["scale_shift_table"][None, None] + emb.view(B, S, HIDDEN)[:, :, None])
        shift, scale = fmod[:, :, 0], fmod[:, :, 1]
        y = tap("final.n", c.layer_norm(h, eps=self.eps) * (1 + scale) + shift, kind="norm")
        return {"out": tap("out", F.linear(y, p["proj_out.weight"], p["proj_out.bias"]))}

    def detdit(self, p, x, tap, ops):
        t = x["t"]
        B, S = t.shape if self.per_token else (t.shape[0], 1)  # S: timestep rows per sample
        f = tap("t_features", detdit_sinusoid(t.flatten(), FREQ, 1000.0))
        emb = tap("embedded", detdit_mlp(f.to(BF), p, "time_embed.emb.timestep_embedder."))
        temb = tap("temb", detdit_adaln(emb, p, "time_embed.linear.", 6))
        mod = tap("mod", detdit_table_add(p["transformer_blocks.0.scale_shift_table"], temb, (B, S, 6, HIDDEN)))
        sh, sc, g, sh2, sc2, g2 = mod.unbind(dim=2)
        h = x["x_img"]
        ones = torch.ones(HIDDEN, dtype=BF, device=h.device)  # no affine: rn(n * 1) = n
        n1 = tap("n1", ops.rmsnorm("img", h, ones, sh, sc, eps=self.eps), kind="rms")
        h = tap("h1", ops.gate_residual("img", h, sublayer(n1, x["y_attn"]), g), kind="gate")
        h = tap("h2", ops.gate_residual("img", h, sublayer(h, x["y_cross"])), kind="gate")
        n2 = tap("n2", ops.rmsnorm("img", h, ones, sh2, sc2, eps=self.eps), kind="rms")
        h = tap("h3", ops.gate_residual("img", h, sublayer(n2, x["y_ff"]), g2), kind="gate")
        fmod = tap("final.mod", detdit_table_add(p["scale_shift_table"], emb.reshape(-1, 1, HIDDEN), (B, S, 2, HIDDEN)))
        shift, scale = fmod[:, :, 0], fmod[:, :, 1]
        y = tap("final.n", ops.layernorm("img", h, shift=shift, scale=scale, eps=self.eps), kind="norm")
        return {"out": tap("out", detdit_linear(y, p["proj_out.weight"], p["proj_out.bias"]))}


class H3(Family):
    """MiniMax-H3: t = 1 - sigma in [0, 1], the FP32 time embedder (256 -> Hh -> D); per block
    ``adaln_proj`` maps bf16(silu(temb)) to a (T, 18H) table whose (3T, H) chunk rows (timestep
    index * 3 + modality tag) modulate each position of the packed sequence (an index); RMSNorm
    with weight (eps 1e-5); ``norm_out``: shift, scale (shift first) of bf16(silu(temb)) indexed by
    the timestep index; the token refiner's ``final_norm`` (plain RMSNorm with weight) on the text
    tokens. The sequence's timesteps, index and plans are shared by the batch."""
    name = "minimax_h3"
    needs = ()
    T, Hh, D = 2, 48, 40
    streams = ("img", "txt")
    outputs = {"out": "img", "txt": "txt"}
    stand = {"y_attn": "img", "y_ff": "img"}
    sp_partial = ()  # no proj_out; every table is per timestep, its gradient replicated by the region
    eps = 1e-5
    orders = {"h3": ZERO6}

    def params(self):
        H, D = HIDDEN, self.D
        p = mlp_params("time_embedder.", FREQ, self.Hh, D, F32)
        p |= linear_params("transformer_blocks.0.adaln_proj.linear.", 18 * H, D, BF, 0.3 / math.sqrt(D))
        p["transformer_blocks.0.norm1.weight"] = ((H,), BF, 0.1)
        p["transformer_blocks.0.norm2.weight"] = ((H,), BF, 0.1)
        p["norm_out.norm.weight"] = ((H,), BF, 0.1)
        p["token_refiner.final_norm.weight"] = ((H,), BF, 0.1)
        p |= linear_params("norm_out.linear.", 2 * H, D, BF, 0.3 / math.sqrt(D))
        return p

    def state_dict(self, seed=0):
        sd = super().state_dict(seed)
        for k in sd:
            if k.endswith("norm.weight") or k.endswith("norm1.weight") or k.endswith("norm2.weight"):
                sd[k] = sd[k] + 1
        return sd

    def stand_ins(self):
        return self.stand

    def timestep_inputs(self, batch, seed):
        S = STREAM_LEN["img"]
        g = torch.Generator().manual_seed(seed + 3)
        return {"t": (torch.tensor([0.93, 0.25]), None, "shared"),
                "ti": (torch.randint(0, self.T, (S,), generator=g), None, "shared"),
                "tags": (torch.randint(0, 3, (S,), generator=g), None, "shared")}

    def fused_gates(self):
        return {"y_attn"}

    def modules(self, sd, v, x):
        import detdit.nn as dn
        def make():
            return dn.H3Conditioning(num_blocks=1, hidden_size=HIDDEN, freq_dim=FREQ, time_embed_hidden_dim=self.Hh,
                                     time_embed_dim=self.D)

        def checks(m):
            temb = m.temb(x["t"])
            batch = x["x_img"].shape[0]
            block = m.transformer_blocks[0](x["x_img"], temb, self.plans(x, batch)["img"],
                                            lambda n: sublayer(n, x["y_attn"]), lambda n: sublayer(n, x["y_ff"]))
            return [("temb", temb, v["temb"]), ("block output", block, v["h2"]),
                    ("token_refiner.final_norm", m.token_refiner.final_norm(x["x_txt"]), v["refiner"])]

        pre = "transformer_blocks.0."
        sh, sc, g, sh2, sc2, g2 = detdit.adaln_table_chunks(v["table"], HIDDEN)
        plan = self.plans(x, x["x_img"].shape[0])["img"]
        attn = sublayer(v["n1"], x["y_attn"])
        return [("H3Conditioning", make, "", checks),
                ("RMSNormIndexedScaleShift", lambda: dn.RMSNormIndexedScaleShift(self.eps), None,
                 lambda m: [("n1", m(x["x_img"], sd[pre + "norm1.weight"], sc, sh, plan), v["n1"])]),
                ("GateResidualRMSNormIndexedScaleShift", lambda: dn.GateResidualRMSNormIndexedScaleShift(self.eps),
                 None, lambda m: list(zip(("n2", "h1"),
                                          m(x["x_img"], attn, g, sd[pre + "norm2.weight"], sc2, sh2, plan),
                                          (v["n2"], v["h1"]))))]

    def plans(self, x, batch):
        return {"img": detdit.plan(x["ti"], x["tags"], self.T, batch),
                "final": detdit.plan_from_rows(x["ti"], self.T, batch)}

    def eager(self, p, x, tap, c):
        H = HIDDEN
        f = tap("t_features", eager_sinusoid(x["t"], FREQ, wide=c.truth))
        temb = tap("temb", eager_mlp(c(f, F32), p, "time_embedder."))
        pre = "transformer_blocks.0."
        table = tap("table", F.linear(c(F.silu(temb), BF), p[pre + "adaln_proj.linear.weight"],
                                      p[pre + "adaln_proj.linear.bias"]))
        rows = (x["ti"] * 3 + x["tags"]).long()
        sh, sc, g, sh2, sc2, g2 = [v[rows][None] for v in table.view(-1, 6 * H).chunk(6, -1)]
        h = x["x_img"]
        n1 = tap("n1", c.rms(h, p[pre + "norm1.weight"], self.eps) * (1 + sc) + sh, kind="rms")
        h = h + g * sublayer(n1, x["y_attn"])
        n2 = tap("n2", c.rms(h, p[pre + "norm2.weight"], self.eps) * (1 + sc2) + sh2, kind="rms")
        h = tap("h1", h, kind="gate")
        h = tap("h2", h + g2 * sublayer(n2, x["y_ff"]), kind="gate")
        fin = tap("final.table", F.linear(c(F.silu(temb), BF), p["norm_out.linear.weight"], p["norm_out.linear.bias"]))
        shift, scale = fin[:, :H][x["ti"]][None], fin[:, H:][x["ti"]][None]
        txt = tap("refiner", c.rms(x["x_txt"], p["token_refiner.final_norm.weight"], self.eps), kind="rms")
        return {"out": tap("out", c.rms(h, p["norm_out.norm.weight"], self.eps) * (1 + scale) + shift, kind="rms"),
                "txt": txt}

    def detdit(self, p, x, tap, ops):
        H = HIDDEN
        f = tap("t_features", detdit.timestep_sinusoid(x["t"], FREQ))
        temb = tap("temb", detdit_mlp(f, p, "time_embedder."))
        pre = "transformer_blocks.0."
        table = tap("table", detdit.adaln_projection(temb, p[pre + "adaln_proj.linear.weight"],
                                                     p[pre + "adaln_proj.linear.bias"]))
        sh, sc, g, sh2, sc2, g2 = detdit.adaln_table_chunks(table, H)
        h = x["x_img"]
        n1 = tap("n1", ops.rmsnorm("img", h, p[pre + "norm1.weight"], sh, sc, eps=self.eps), kind="rms")
        h, n2 = ops.gate_residual_rmsnorm("img", h, sublayer(n1, x["y_attn"]), g, p[pre + "norm2.weight"], sh2, sc2,
                                          self.eps)
        n2 = tap("n2", n2, kind="rms")
        h = tap("h1", h, kind="gate")
        h = tap("h2", ops.gate_residual("img", h, sublayer(n2, x["y_ff"]), g2), kind="gate")
        # norm_out: final_adaln_out's projection and norm as two ops (an SP region has the norm, not the fused op)
        fin = tap("final.table", detdit.linear(F.silu(temb).to(BF), p["norm_out.linear.weight"],
                                               p["norm_out.linear.bias"]))
        shift, scale = fin[:, :H], fin[:, H:]
        txt = tap("refiner", ops.rmsnorm("txt", x["x_txt"], p["token_refiner.final_norm.weight"], eps=self.eps),
                  kind="rms")
        return {"out": tap("out", ops.rmsnorm("final", h, p["norm_out.norm.weight"], shift, scale, eps=self.eps),
                           kind="rms"), "txt": txt}


class LTXTextToVideo(LTX):
    """LTX-Video text-to-video: one timestep per sample, so the block and final modulation are
    per sample (B, 1, H)."""
    name = "ltx_video_t2v"
    per_token = False


FAMILIES = {f.name: f for f in (SD3(), Flux(), Wan(), WanA14B(), WanTI2V(), Hunyuan(), Qwen(), QwenEdit(),
                                 CogVideoX(), CogVideoX15I2V(), LTX(), LTXTextToVideo(), H3())}


# ---- the harness -----------------------------------------------------------------------------


class Cast:
    """The eager path's casts and norms: ``c(t, dtype)``; ``c.layer_norm``, ``c.rms``. The truth
    run (float64) makes every cast the identity; detdit_norms puts detdit's plain norm in place of
    eager's, so every other operation of a norm site is eager's own (test: byte for byte)."""

    def __init__(self, truth, detdit_norms=False):
        self.truth, self.detdit_norms = truth, detdit_norms

    def __call__(self, t, dtype):
        return t if self.truth else t.to(dtype)

    def layer_norm(self, x, w=None, b=None, eps=1e-5):
        if self.detdit_norms:
            return detdit.layernorm(x, w, b, eps=eps)
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)

    def rms(self, x, w, eps):
        """diffusers' RMSNorm without affine (w None: x * rsqrt(mean(x.float()^2) + eps), back to
        x's dtype) and H3's with its weight (times w.float() before the one cast)."""
        if self.detdit_norms:
            return detdit.rmsnorm(x, torch.ones(x.shape[-1], dtype=x.dtype, device=x.device) if w is None else w,
                                  eps=eps)
        n = x * torch.rsqrt(self(x, F32).pow(2).mean(-1, keepdim=True) + eps)
        return self(n if w is None else n * self(w, F32), x.dtype)


class Tape:
    """The taps of one run. Free (ref None): records each value and passes on a view of it whose
    gradient (retained) is what arrives from downstream. Forced: records the value computed here
    and passes on a fresh leaf holding the reference run's value (float64 in the truth run)."""

    def __init__(self, ref=None, wide=False):
        self.ref, self.wide = ref, wide
        self.values, self.nodes, self.kinds = {}, {}, {}

    def __call__(self, name, t, kind=None):
        """kind: "gate" (a gated residual's output: eager's operations, byte for byte), "norm" (a
        LayerNorm site's output, modulated or not), "rms" (an RMSNorm site's), None."""
        assert name not in self.values, f"tap {name} twice"
        self.values[name] = t
        self.kinds[name] = kind
        if self.ref is None:
            node = t.view_as(t)
            if node.requires_grad:
                node.retain_grad()
        else:
            assert name in self.ref.values, f"tap {name}: not in the eager path"
            v = self.ref.values[name]
            node = v.detach().to(F64 if self.wide else v.dtype, copy=True).requires_grad_(v.requires_grad)
        self.nodes[name] = node
        return node

    def downstream_grad(self, name):
        return self.nodes[name].grad


def leaves(fam, sd, inp, wide=False):
    """Fresh leaves of the parameters and the inputs (float64 copies in the truth run; the
    timesteps keep their dtype: the model's own arithmetic on them is part of both paths)."""
    to = (lambda v: v.to(F64, copy=True)) if wide else (lambda v: v.clone())
    p = {k: to(v).requires_grad_() for k, v in sd.items()}
    x = {k: v if kind in ("const", "shared") else to(v).requires_grad_() for k, (v, _, kind) in inp.items()}
    return p, x


def output_grads(fam, outs, seed=900):
    return {k: randn(v.shape, seed + i, v.dtype).to(v.device) for i, (k, v) in enumerate(sorted(outs.items()))}


def run_eager(fam, sd, inp, grads=None):
    """The eager path, free; backward with grads (random ones if None). Returns the tape, the
    leaves (p, x), the outputs and the grads used."""
    p, x = leaves(fam, sd, inp)
    tape = Tape()
    outs = fam.eager(p, x, tape, Cast(False))
    grads = grads or output_grads(fam, outs)
    torch.autograd.backward([outs[k] for k in sorted(outs)], [grads[k] for k in sorted(outs)])
    return tape, p, x, outs, grads


def run_forced(fam, sd, inp, ref, how, ops=None):
    """how "detdit", "truth" (eager in float64) or "detdit_norms" (eager with detdit's plain norms):
    every segment on the eager run's values at its taps, back-propagated
    with the eager gradients arriving there. Returns (tape, p, x, the names of the taps that are
    the path's outputs)."""
    wide = how == "truth"
    p, x = leaves(fam, sd, inp, wide)
    tape = Tape(ref, wide)
    if how in ("truth", "detdit_norms"):
        outs = fam.eager(p, x, tape, Cast(wide, how == "detdit_norms"))
    else:
        outs = fam.detdit(p, x, tape, ops or Ops(plans=fam.plans(x, _batch(inp))))
    ends = {name for name, node in tape.nodes.items() if any(node is o for o in outs.values())}
    tensors, grads = [], []
    for name, v in tape.values.items():
        g = ref.downstream_grad(name)
        if g is not None and v.requires_grad:
            tensors.append(v)
            grads.append(g.to(v.dtype))
    torch.autograd.backward(tensors, grads)
    return tape, p, x, ends


def _batch(inp):
    return next(v.shape[0] for v, _, kind in inp.values() if kind in ("pos", "sub"))


def run_detdit(fam, sd, inp, grads, ops=None, local=None, tape=None):
    """detdit's path, free (no forcing): outputs, and the gradients of every parameter and input.
    local: stream -> the slice of positions this rank holds (inputs are cut to it; grads too).
    tape: a free Tape to record the values at the taps."""
    p, x = leaves(fam, sd, inp)
    xs = dict(x)
    if local is not None:
        for k, (_, stream, kind) in inp.items():
            if stream is not None:
                xs[k] = x[k][:, local[stream]].contiguous() if kind not in ("const", "shared") \
                    else x[k][:, local[stream]]
    ops = ops or Ops(plans=fam.plans(x, _batch(inp)))
    outs = fam.detdit(p, xs, tape or (lambda name, t, kind=None: t), ops)
    g = {k: v if local is None else v[:, local[fam.outputs[k]]].contiguous() for k, v in grads.items()}
    torch.autograd.backward([outs[k] for k in sorted(outs)], [g[k] for k in sorted(outs)])
    result = {f"out.{k}": v.detach() for k, v in outs.items()}
    result |= {f"d.{k}": v.grad for k, v in p.items()}
    result |= {f"d.{k}": v.grad for k, v in x.items() if isinstance(v, torch.Tensor) and v.requires_grad}
    return result


def check_against_eager(fam, got, eager, truth, what, exact, assert_bitwise_equal):
    """got (detdit) against eager: byte for byte where exact, else at least as close to the float64
    value of the same segment as eager's, to one ulp of the tensor's dtype at its largest magnitude,
    plus for FP32 the recursive-summation bound n * 2^-24 of that magnitude, n the path's longest sum
    (test_families_eager.py's bound, per segment)."""
    assert (got is None) == (eager is None), f"{what}: gradient present in one run only"
    if got is None:
        return
    assert got.dtype == eager.dtype and got.shape == eager.shape, \
        f"{what}: {got.dtype} {tuple(got.shape)} vs eager {eager.dtype} {tuple(eager.shape)}"
    if exact:
        assert_bitwise_equal(got, eager, what)
        return
    scale = truth.abs().max().item()
    slack = ulp(torch.tensor(scale), got.dtype).item()
    if got.dtype == F32:
        slack += fam.longest_sum * 2.0 ** -24 * scale
    ta = (got.double() - truth).abs().max().item()
    te = (eager.double() - truth).abs().max().item()
    assert ta <= te + slack, f"{what}: detdit is {ta:.3e} from float64, eager {te:.3e} (slack {slack:.1e})"
