"""One block's conditioning path of every DiT family (family_paths.FAMILIES: SD3.5, Flux.1,
Wan 2.1, Wan 2.2 A14B, Wan 2.2 TI2V-5B, HunyuanVideo, Qwen-Image and its edit models
(``zero_cond_t``), CogVideoX and CogVideoX 1.5 image-to-video (the ofs embedding), LTX-Video image-
and text-to-video, MiniMax-H3), written as the family's diffusers code computes it in plain PyTorch and through
detdit, on random weights in the family's state-dict layout at small shapes (H = 64, B = 2,
S = 32 image and 8 text positions, bf16 activations, the family's dtypes for the time MLP and
the tables). test_families_eager.py checks single norm / gate sites; this checks the whole
path: the sinusoid in the family's convention, the time MLP, combined embeddings, every
projection and its chunk order, every norm, modulation and gated residual, the final layer.

What is asserted (CPU):
- against eager, segment by segment: detdit runs each segment between two taps (family_paths)
  on the values eager's path had there and is back-propagated with the gradients eager's had
  there; every tap's value, every gradient arriving at a tap, every parameter's and input's
  gradient is byte-equal to eager's where detdit computes eager's operations (a gated
  residual's output; the gradient of its sublayer operand, unless a fused norm adds its dx),
  else at least as close to the float64 value of the same segment as eager's, to one ulp of the
  tensor's dtype at its largest magnitude (plus n * 2^-24 of it for FP32, n the longest sum);
- every norm site (the norm, its modulation and its casts) is byte-equal to the family's eager
  operations run on detdit's own plain norm;
- repeatable: a second run gives the same bytes, outputs and every gradient;
- batch-invariant: sample 0 alone gives the bytes it has in the batch, outputs and the
  gradients of its inputs (parameters' gradients sum over the batch);
- sequence parallel: over one spawned group of 4 gloo processes, world sizes 1, 2 and 4 give
  every rank's outputs and input gradients byte-equal to one process's rows, and every
  replicated gradient byte-equal (proj_out's, and for per-token families everything upstream
  of the modulation, are sums over the rank's own positions, reduced by the caller).
- detdit.nn's modules at the family's sites (diffusers' AdaLayerNorm* and FP32LayerNorm, loading
  the family's tensors; SGLang's LayerNormScaleShift family; H3's) and detdit's composite final
  layers give the path's bytes; detdit's chunk orders are diffusers'.
On a GPU (test_gpu_*): the torch profile's gated residuals and LayerNorm sites byte-equal to
eager on the same GPU.
"""
import datetime
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import detdit
import detdit.distributed
import family_paths as fp
from conftest import assert_bitwise_equal, requires_cuda

HERE = os.path.dirname(os.path.abspath(__file__))
NAMES = list(fp.FAMILIES)


def _compare_path(fam, device="cpu", numerics="portable", bitwise_kinds=("gate",)):
    sd = {k: v.to(device) for k, v in fam.state_dict().items()}
    inp = {k: (v.to(device), s, kind) for k, (v, s, kind) in fam.inputs().items()}
    ref, ep, ex, _, _ = fp.run_eager(fam, sd, inp)
    plans = fam.plans({k: v for k, (v, _, _) in inp.items()}, fam.batch)
    got, dp, dx, ends = fp.run_forced(fam, sd, inp, ref, "detdit", fp.Ops(plans=plans, numerics=numerics))
    truth, tp, tx, _ = fp.run_forced(fam, sd, inp, ref, "truth")
    if numerics == "portable":  # every norm site: the family's own operations on detdit's plain norm
        own = fp.run_forced(fam, sd, inp, ref, "detdit_norms")[0]
        for name, kind in ref.kinds.items():
            if kind in ("norm", "rms"):
                assert_bitwise_equal(got.values[name], own.values[name],
                                     f"{fam.name} tap {name}: the eager site on detdit's plain norm")
    assert got.values.keys() == ref.values.keys(), f"{fam.name}: taps {list(got.values)} vs eager {list(ref.values)}"
    for name in ref.values:
        exact = ref.kinds[name] in bitwise_kinds
        fp.check_against_eager(fam, got.values[name].detach().cpu(), ref.values[name].detach().cpu(),
                               truth.values[name].detach().cpu(), f"{fam.name} tap {name}", exact,
                               assert_bitwise_equal)
        if ref.nodes[name].requires_grad and name not in ends:  # an output's is the given gradient
            fp.check_against_eager(fam, _cpu(got.nodes[name].grad), _cpu(ref.downstream_grad(name)),
                                   _cpu(truth.nodes[name].grad), f"{fam.name} gradient at tap {name}", False,
                                   assert_bitwise_equal)
    for k in ep:
        fp.check_against_eager(fam, _cpu(dp[k].grad), _cpu(ep[k].grad), _cpu(tp[k].grad), f"{fam.name} d {k}", False,
                               assert_bitwise_equal)
    for k, (_, _, kind) in inp.items():
        if kind in ("const", "shared"):
            continue
        exact = kind == "sub" and k not in fam.fused_gates()
        fp.check_against_eager(fam, _cpu(dx[k].grad), _cpu(ex[k].grad), _cpu(tx[k].grad), f"{fam.name} d {k}", exact,
                               assert_bitwise_equal)


def _cpu(t):
    return None if t is None else t.detach().cpu()


@pytest.mark.parametrize("name", NAMES)
def test_path_matches_the_familys_eager_code(name):
    _compare_path(fp.FAMILIES[name])


@pytest.mark.parametrize("name", NAMES)
def test_path_is_repeatable_and_batch_invariant(name):
    fam = fp.FAMILIES[name]
    sd, inp = fam.state_dict(), fam.inputs()
    grads = fp.output_grads(fam, fp.run_eager(fam, sd, inp)[3])
    first = fp.run_detdit(fam, sd, inp, grads)
    second = fp.run_detdit(fam, sd, inp, grads)
    assert first.keys() == second.keys()
    for key in first:
        if first[key] is None:
            assert second[key] is None, f"{name} {key}: a gradient in the second run only"
            continue
        assert_bitwise_equal(second[key], first[key], f"{name} {key}: a second run")
    one = {k: (v if kind == "shared" else v[:1], s, kind) for k, (v, s, kind) in inp.items()}
    alone = fp.run_detdit(fam, sd, one, {k: v[:1] for k, v in grads.items()})
    checked = 0
    for key, value in alone.items():
        name_ = key.split(".", 1)[1]
        if key.startswith("d.") and (name_ in sd or inp[name_][2] in ("const", "shared")):
            continue  # parameters' gradients: sums over the batch
        if value is None:
            assert first[key] is None, f"{name} {key}: no gradient alone"
            continue
        assert_bitwise_equal(value, first[key][:1], f"{name} {key}: sample 0 alone vs in a batch of {fam.batch}")
        checked += 1
    assert checked >= len(fam.outputs) + 1


def _values(inp):
    return {k: v for k, (v, _, _) in inp.items()}


# ---- sequence parallel: one spawned group of 4, world sizes 1, 2, 4 ---------------------------

WORLDS = (1, 2, 4)


def _sp_worker(rank, world, init_file, names):
    sys.path.insert(0, HERE)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    groups = {w: dist.new_group(list(range(w))) for w in WORLDS}  # every rank creates every group
    comms = {w: detdit.distributed.Communicator(groups[w]) for w in WORLDS if rank < w}
    for name in names:  # every rank in the same order; a group's ranks run its collectives together
        fam = fp.FAMILIES[name]
        sd, inp = fam.state_dict(), fam.inputs()
        plans = fam.plans(_values(inp), fam.batch)
        with torch.no_grad():
            outs = fam.detdit(*fp.leaves(fam, sd, inp), lambda n, t, kind=None: t, fp.Ops(plans=plans))
        grads = fp.output_grads(fam, outs)
        ws1 = fp.run_detdit(fam, sd, inp, grads)
        for w, comm in comms.items():
            _sp_family(fam, comm, sd, inp, plans, grads, ws1)
    dist.barrier()
    dist.destroy_process_group()


def _sp_family(fam, comm, sd, inp, plans, grads, ws1):
    regions = {}
    for stream in set(fam.streams) | set(plans):
        if stream in plans:
            regions[stream] = detdit.distributed.SpRegion(plans[stream], comm)
        else:
            regions[stream] = detdit.distributed.SpRegion(None, comm, seq_len=fp.STREAM_LEN[stream], batch=fam.batch)
    local = {s: r.local_slice for s, r in regions.items()}
    sp = fp.run_detdit(fam, sd, inp, grads, fp.Ops(regions=regions, plans=plans), local)
    where = f"{fam.name}, rank {comm.rank} of {comm.world}"
    for k, stream in fam.outputs.items():
        assert_bitwise_equal(sp[f"out.{k}"], ws1[f"out.{k}"][:, local[stream]], f"{where}: {k}")
    for k, (_, stream, kind) in inp.items():
        if kind in ("const", "shared"):
            continue
        a, e = sp[f"d.{k}"], ws1[f"d.{k}"]
        if stream is not None:
            a, e = a[:, local[stream]], e[:, local[stream]]
        assert_bitwise_equal(a, e, f"{where}: d {k}")
    for k in sd:
        if not k.startswith(fam.sp_partial or ("\0",)):
            assert_bitwise_equal(sp[f"d.{k}"], ws1[f"d.{k}"], f"{where}: d {k} (replicated)")


def test_path_byte_equal_across_sp_world_sizes(tmp_path):
    mp.spawn(_sp_worker, args=(max(WORLDS), str(tmp_path / "init"), NAMES), nprocs=max(WORLDS), join=True)


# ---- GPU: the torch profile --------------------------------------------------------------------

@requires_cuda
@pytest.mark.parametrize("name", NAMES)
def test_gpu_torch_profile_path_equals_eager(name):
    """Each segment on eager's values on the GPU, detdit's norms in the torch profile: the gated
    residuals and every LayerNorm site byte-equal to eager; the RMSNorm sites (LTX-Video's
    diffusers RMSNorm, H3's) within the CPU's bound (the torch profile gives F.rms_norm's bits,
    which diffusers' RMSNorm does not promise)."""
    _compare_path(fp.FAMILIES[name], "cuda", "torch", ("gate", "norm"))


# ---- detdit.nn's modules and detdit's composite ops at the family's sites -------------------------


@pytest.mark.parametrize("name", NAMES)
def test_modules_and_composites_at_the_familys_sites(name):
    """Each detdit.nn module that holds one of the family's sites under diffusers' names loads the
    family's tensors with strict=True (names, shapes; the dtypes the model holds them in) and
    computes the detdit path's bytes there; so does each composite op of its sites (the final
    layers in one call); detdit's chunk orders name the family's chunks in diffusers' order."""
    fam = fp.FAMILIES[name]
    sd, inp = fam.state_dict(), fam.inputs()
    grads = fp.output_grads(fam, fp.run_eager(fam, sd, inp)[3])
    tape = fp.Tape()
    fp.run_detdit(fam, sd, inp, grads, tape=tape)
    values = {k: t.detach() for k, t in tape.values.items()}
    for order, names in fam.orders.items():
        assert detdit.adaln_chunk_order(order) == names, f"{name}: detdit's {order} order"
    for label, make, prefix, checks in fam.modules(sd, values, _values(inp)):
        module = make() if make is not None else None
        if module is not None and prefix is None:
            assert not module.state_dict(), f"{name} {label}: parameters {list(module.state_dict())}"
        elif module is not None:
            strip, add = prefix if isinstance(prefix, tuple) else (prefix, "")
            mine = {add + k[len(strip):]: t for k, t in sd.items() if k.startswith(strip)}
            module.load_state_dict(mine, strict=True)
            for k, t in module.state_dict().items():
                assert t.dtype == mine[k].dtype, f"{name} {label}: {k} is {t.dtype}, the model holds {mine[k].dtype}"
        with torch.no_grad():
            results = checks(module)
        assert results, f"{name} {label}: nothing to check"
        for what, got, want in results:
            assert_bitwise_equal(got, want, f"{name} {label}: {what}")
