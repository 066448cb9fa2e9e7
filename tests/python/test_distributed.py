"""detdit.distributed with 2-4 gloo processes (torch.multiprocessing): every rank's
outputs and gradients of tp_adaln_projection, of the SP region (modulated rmsnorm,
gate_residual) and of the fused SP gate_residual_rmsnorm are byte-equal to the same ops in
one process, computed by each rank."""
import datetime
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))


def _setup(rank, world, init_file):
    sys.path.insert(0, HERE)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: loopback, whatever the hostname resolves to
    # a collective that only some ranks enter fails after a minute instead of hanging the suite
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)


def _sp_checks(rank, world):
    import detdit
    import detdit.distributed
    from conftest import assert_bitwise_equal, normal, packing

    batch, seq, timesteps, hidden = 2, 300, 2, 64
    ti, tags = packing(seq, timesteps, 300)
    plan = detdit.plan(ti, tags, timesteps, batch)
    x = normal((batch, seq, hidden), 301, torch.bfloat16)
    w = (1 + normal((hidden,), 302, scale=0.05)).bfloat16()
    shift = normal((3 * timesteps, hidden), 303, torch.bfloat16, scale=0.3)
    scale = normal((3 * timesteps, hidden), 304, torch.bfloat16, scale=0.3)
    y = normal((batch, seq, hidden), 305, torch.bfloat16)
    gate = normal((3 * timesteps, hidden), 306, torch.bfloat16)
    grad = normal((batch, seq, hidden), 307, torch.bfloat16)

    def run(region):
        leaves = [t.clone().requires_grad_(True) for t in (x, w, shift, scale, y, gate)]
        if region is None:
            xs, ys, gs = leaves[0], leaves[4], grad
            h = detdit.rmsnorm(xs, leaves[1], leaves[2], leaves[3], plan)
            out = detdit.gate_residual(xs, h * ys, leaves[5], plan)
        else:
            local = region.local_slice
            xs = leaves[0][:, local].contiguous()
            ys, gs = leaves[4][:, local].contiguous(), grad[:, local].contiguous()
            h = region.rmsnorm(xs, leaves[1], leaves[2], leaves[3])
            out = region.gate_residual(xs, h * ys, leaves[5])
        out.backward(gs)
        return out, [leaf.grad for leaf in leaves]

    comm = detdit.distributed.Communicator()
    region = detdit.distributed.SpRegion(plan, comm)
    local = region.local_slice
    assert (local.start, local.stop) == (rank * seq // world, (rank + 1) * seq // world)
    ws1_out, ws1_grads = run(None)
    sp_out, sp_grads = run(region)
    assert_bitwise_equal(sp_out, ws1_out[:, local], f"rank {rank}/{world}: out")
    for name, i in (("dx", 0), ("d_y", 4)):
        # the local rows' grads come through the SP region; the other rows' are zero here
        assert_bitwise_equal(sp_grads[i][:, local], ws1_grads[i][:, local], f"rank {rank}/{world}: {name}")
    for name, i in (("d_weight", 1), ("d_shift", 2), ("d_scale", 3), ("d_gate", 5)):
        assert_bitwise_equal(sp_grads[i], ws1_grads[i], f"rank {rank}/{world}: {name} (replicated)")


def _sp_fused_checks(rank, world):
    import detdit
    import detdit.distributed
    from conftest import assert_bitwise_equal, normal, packed

    batch, seq, timesteps, hidden = 2, 600, 3, 32
    ti, tags = packed("interleaved", seq, timesteps)
    plan = detdit.plan(ti, tags, timesteps, batch)
    bf = torch.bfloat16
    residual, y = normal((batch, seq, hidden), 320, bf), normal((batch, seq, hidden), 321, bf)
    gate, w = normal((3 * timesteps, hidden), 322, bf), (1 + normal((hidden,), 323, scale=0.05)).bfloat16()
    shift = normal((3 * timesteps, hidden), 324, bf, scale=0.3)
    scale = normal((3 * timesteps, hidden), 325, bf, scale=0.3)
    g_out, g_h = normal((batch, seq, hidden), 326, bf), normal((batch, seq, hidden), 327, bf)
    comm = detdit.distributed.Communicator()
    region = detdit.distributed.SpRegion(plan, comm)
    local = region.local_slice

    def run(sp, modulated, reaching):
        leaves = [t.clone().requires_grad_(True) for t in (residual, y, gate, w, shift, scale)]
        tables = leaves[4:] if modulated else [None, None]
        if sp:
            rows = [leaves[0][:, local].contiguous(), leaves[1][:, local].contiguous()]
            h, out = region.gate_residual_rmsnorm(*rows, leaves[2], leaves[3], *tables)
            grads = {"out": g_out[:, local], "h": g_h[:, local]}
        else:
            h, out = detdit.gate_residual_rmsnorm(*leaves[:4], *tables, plan)
            grads = {"out": g_out, "h": g_h}
        sum(((h if name == "h" else out) * grads[name]).sum() for name in reaching).backward()
        return h, out, [leaf.grad for leaf in leaves]

    for modulated in (False, True):
        for reaching in (("out",), ("out", "h"), ("h",)):
            what = f"rank {rank}/{world} {'modulated' if modulated else 'plain'}, gradient of {'+'.join(reaching)}"
            ws1_h, ws1_out, ws1_grads = run(False, modulated, reaching)
            sp_h, sp_out, sp_grads = run(True, modulated, reaching)
            assert_bitwise_equal(sp_h, ws1_h[:, local], f"{what}: h")
            assert_bitwise_equal(sp_out, ws1_out[:, local], f"{what}: out")
            for name, i in (("d_residual", 0), ("d_y", 1)):
                assert_bitwise_equal(sp_grads[i][:, local], ws1_grads[i][:, local], f"{what}: {name}")
            for name, i in (("d_gate", 2), ("d_weight", 3), ("d_shift", 4), ("d_scale", 5)):
                if ws1_grads[i] is None:
                    assert sp_grads[i] is None, f"{what}: {name} is not None"
                else:
                    assert_bitwise_equal(sp_grads[i], ws1_grads[i], f"{what}: {name} (replicated)")

    # a bad input fails on every rank with the WS1 error, and the region still works afterwards
    rows = residual[:, local].contiguous(), y[:, local].contiguous()
    with pytest.raises(TypeError, match="y must have residual's dtype bfloat16, got float32"):
        region.gate_residual_rmsnorm(rows[0], rows[1].float(), gate, w, shift, scale)
    h, out = region.gate_residual_rmsnorm(*rows, gate, w, shift, scale)
    assert_bitwise_equal(out, detdit.gate_residual_rmsnorm(residual, y, gate, w, shift, scale, plan)[1][:, local],
                         f"rank {rank}/{world}: out after the failed call")


def _tp_checks(rank, world, timesteps, dim):
    import detdit
    import detdit.distributed
    from conftest import assert_bitwise_equal, normal

    hidden = 128
    n = 18 * hidden
    temb = normal((timesteps, dim), 310, scale=2.0)
    w = normal((n, dim), 311, torch.bfloat16, scale=0.15)
    b = normal((n,), 312, torch.bfloat16, scale=0.02)
    g = normal((timesteps, n), 313, torch.bfloat16)
    rows = slice(rank * n // world, (rank + 1) * n // world)
    comm = detdit.distributed.Communicator()

    leaves = [t.clone().requires_grad_(True) for t in (temb, w, b)]
    ws1 = detdit.adaln_projection(*leaves)
    ws1.backward(g)
    shard = [temb.clone().requires_grad_(True), w[rows].clone().requires_grad_(True),
             b[rows].clone().requires_grad_(True)]
    tp = detdit.distributed.tp_adaln_projection(*shard, comm)
    tp.backward(g)
    assert_bitwise_equal(tp, ws1, f"rank {rank}/{world}: table")
    assert_bitwise_equal(shard[0].grad, leaves[0].grad, f"rank {rank}/{world}: d_temb")
    assert_bitwise_equal(shard[1].grad, leaves[1].grad[rows], f"rank {rank}/{world}: d_weight shard")
    assert_bitwise_equal(shard[2].grad, leaves[2].grad[rows], f"rank {rank}/{world}: d_bias shard")

    # ranks may differ in which inputs need a gradient: every rank still takes part in
    # d_temb's collectives (none hangs), and the rank that wants d_temb gets WS1's bytes
    temb_leaf = temb.clone().requires_grad_(rank == 0)
    w_leaf = w[rows].clone().requires_grad_(True)
    detdit.distributed.tp_adaln_projection(temb_leaf, w_leaf, b[rows].clone(), comm).backward(g)
    if rank == 0:
        assert_bitwise_equal(temb_leaf.grad, leaves[0].grad, f"rank {rank}/{world}: d_temb, other ranks not asking")
    else:
        assert temb_leaf.grad is None
    assert_bitwise_equal(w_leaf.grad, leaves[1].grad[rows], f"rank {rank}/{world}: d_weight shard, mixed needs")

    # a shard that is not whole 64-column chunks fails on every rank
    with pytest.raises(ValueError):
        detdit.distributed.tp_adaln_projection(temb, w[:100], b[:100], comm)
    # shards of different sizes (rank 0 alone has a valid 9*64 rows): every rank fails, none hangs
    size = 576 if rank == 0 else 640
    with pytest.raises(ValueError):
        detdit.distributed.tp_adaln_projection(temb, w[:size], b[:size], comm)
    # and the communicator still works afterwards
    assert_bitwise_equal(detdit.distributed.tp_adaln_projection(temb, w[rows], b[rows], comm), ws1.detach(),
                         f"rank {rank}/{world}: table after the failed calls")


def _sp_mismatch_checks(rank, world):
    """Ranks holding different indexes of one length (rank 1 relabels the timesteps): the
    backward fails on every rank (it used to succeed with a different d_shift per rank)."""
    import detdit
    import detdit.distributed
    from conftest import normal, packing

    batch, seq, timesteps, hidden = 2, 300, 2, 64
    ti, tags = packing(seq, timesteps, 300)
    if rank == 1:
        ti = timesteps - 1 - ti
    plan = detdit.plan(ti, tags, timesteps, batch)
    region = detdit.distributed.SpRegion(plan, detdit.distributed.Communicator())
    local = region.local_slice
    x = normal((batch, seq, hidden), 301, torch.bfloat16)[:, local].contiguous().requires_grad_(True)
    w = (1 + normal((hidden,), 302, scale=0.05)).bfloat16()
    shift = normal((3 * timesteps, hidden), 303, torch.bfloat16, scale=0.3).requires_grad_(True)
    scale = normal((3 * timesteps, hidden), 304, torch.bfloat16, scale=0.3).requires_grad_(True)
    out = region.rmsnorm(x, w, shift, scale)
    with pytest.raises(ValueError, match="ranks disagree on the call"):  # the signatures hold the plan fingerprints
        out.backward(normal((batch, seq, hidden), 307, torch.bfloat16)[:, local].contiguous())


def _tp_uneven_checks(rank, world):
    """tp_adaln_projection at a world size that does not split N's 64-column chunks evenly
    (N = 1152: 18 chunks; tp = 4 owns 5, 5, 4, 4) and at an N that is no multiple of 64
    (N = 720: 12 chunks, the last one short): byte-equal to one process."""
    import detdit
    import detdit.distributed
    from conftest import assert_bitwise_equal, normal

    comm = detdit.distributed.Communicator()
    for n, timesteps, dim in ((1152, 3, 16), (720, 2, 24)):
        temb = normal((timesteps, dim), 340, scale=2.0)
        w = normal((n, dim), 341, torch.bfloat16, scale=0.15)
        b = normal((n,), 342, torch.bfloat16, scale=0.02)
        g = normal((timesteps, n), 343, torch.bfloat16)
        rows = detdit.distributed.shard_rows(n, world, rank)
        leaves = [t.clone().requires_grad_(True) for t in (temb, w, b)]
        ws1 = detdit.adaln_projection(*leaves)
        ws1.backward(g)
        shard = [temb.clone().requires_grad_(True), w[rows].clone().requires_grad_(True),
                 b[rows].clone().requires_grad_(True)]
        tp = detdit.distributed.tp_adaln_projection(*shard, comm, out_features=n)
        tp.backward(g)
        what = f"rank {rank}/{world}, N={n}, rows {rows.start}:{rows.stop}"
        assert_bitwise_equal(tp, ws1, f"{what}: table")
        assert_bitwise_equal(shard[0].grad, leaves[0].grad, f"{what}: d_temb")
        assert_bitwise_equal(shard[1].grad, leaves[1].grad[rows], f"{what}: d_weight shard")
        assert_bitwise_equal(shard[2].grad, leaves[2].grad[rows], f"{what}: d_bias shard")
    # a shard that is not this rank's share of out_features fails on every rank, sized from nothing
    with pytest.raises(ValueError, match="shard of the out_features"):
        detdit.distributed.tp_adaln_projection(temb, w[:64], b[:64], comm, out_features=2**40)


def _tp_family_checks(rank, world):
    """tp_adaln_projection of a DiT family's projection (chunks = 6, AdaLayerNormZero's; H = 48,
    so N = 288: 5 64-column chunks, the last one short, split 2-1-1-1 at tp = 4; a bf16 temb,
    T = 1 and 3): the table, d_temb and the shard's dW/db byte-equal to the one-process
    adaln_projection(chunks=6) and its gradients. A rank passing another chunks count fails
    every rank, forward and backward, and the communicator keeps working."""
    import detdit
    import detdit.distributed
    from conftest import assert_bitwise_equal, normal

    comm = detdit.distributed.Communicator()
    chunks, n, dim = 6, 6 * 48, 24
    w = normal((n, dim), 361, torch.bfloat16, scale=0.15)
    b = normal((n,), 362, torch.bfloat16, scale=0.02)
    rows = detdit.distributed.shard_rows(n, world, rank)
    for timesteps in (1, 3):
        temb = normal((timesteps, dim), 360 + timesteps, torch.bfloat16, scale=2.0)
        g = normal((timesteps, n), 363 + timesteps, torch.bfloat16)
        leaves = [t.clone().requires_grad_(True) for t in (temb, w, b)]
        ws1 = detdit.adaln_projection(*leaves, chunks=chunks)
        ws1.backward(g)
        shard = [temb.clone().requires_grad_(True), w[rows].clone().requires_grad_(True),
                 b[rows].clone().requires_grad_(True)]
        tp = detdit.distributed.tp_adaln_projection(*shard, comm, out_features=n, chunks=chunks)
        tp.backward(g)
        what = f"rank {rank}/{world}, T={timesteps}, rows {rows.start}:{rows.stop}"
        assert leaves[0].grad.dtype == torch.bfloat16
        assert_bitwise_equal(tp, ws1, f"{what}: table")
        assert_bitwise_equal(shard[0].grad, leaves[0].grad, f"{what}: d_temb")
        assert_bitwise_equal(shard[1].grad, leaves[1].grad[rows], f"{what}: d_weight shard")
        assert_bitwise_equal(shard[2].grad, leaves[2].grad[rows], f"{what}: d_bias shard")

    with pytest.raises(ValueError, match="chunks must be a positive chunk count or None"):
        detdit.distributed.tp_adaln_projection(temb, w[rows], b[rows], comm, out_features=n, chunks=0)
    if world > 1:
        # rank 0 takes the table for 3 chunks (288 is a multiple of 3 too), the others for 6
        other = 3 if rank == 0 else chunks
        disagree = "ranks disagree on the call: rank 0 calls .*chunks 3.*chunks 6"
        with pytest.raises(ValueError, match=disagree):
            detdit.distributed.tp_adaln_projection(temb, w[rows], b[rows], comm, out_features=n, chunks=other)
        _, act = torch.ops.detdit.tp_adaln_projection.default(temb, w[rows], b[rows], comm.handle, "portable", n,
                                                              chunks)
        with pytest.raises(ValueError, match=disagree):
            torch.ops.detdit.tp_adaln_projection_backward.default(g, temb, w[rows], act, comm.handle, "portable",
                                                                  [True] * 3, other)
    assert_bitwise_equal(detdit.distributed.tp_adaln_projection(temb, w[rows], b[rows], comm, out_features=n,
                                                                chunks=chunks),
                         detdit.adaln_projection(temb, w, b, chunks=chunks), f"rank {rank}/{world}: after the failures")


def _local_error_checks(rank, world):
    """A binding check that fails on one rank only (a non-contiguous input, found before
    anything is allocated): every rank raises, the others naming that rank; none waits."""
    import detdit
    import detdit.distributed
    from conftest import normal, packing

    comm = detdit.distributed.Communicator()
    n, dim = 18 * 64, 16
    temb = normal((2, dim), 350, scale=2.0)
    w, b = normal((n, dim), 351, torch.bfloat16, scale=0.15), normal((n,), 352, torch.bfloat16)
    rows = detdit.distributed.shard_rows(n, world, rank)
    bad_temb = normal((dim, 2), 353).t() if rank == 1 else temb  # (2, dim), not contiguous
    with pytest.raises(ValueError, match="temb must be contiguous" if rank == 1 else "rank 1 failed"):
        detdit.distributed.tp_adaln_projection(bad_temb, w[rows], b[rows], comm)

    batch, seq, timesteps, hidden = 2, 300, 2, 64
    ti, tags = packing(seq, timesteps, 354)
    region = detdit.distributed.SpRegion(detdit.plan(ti, tags, timesteps, batch), comm)
    local = region.local_slice
    x = normal((batch, seq, hidden), 355, torch.bfloat16)[:, local].contiguous()
    weight = (1 + normal((hidden,), 356, scale=0.05)).bfloat16()
    shift = normal((3 * timesteps, hidden), 357, torch.bfloat16, scale=0.3)
    scale = normal((3 * timesteps, hidden), 358, torch.bfloat16, scale=0.3)
    _, rstd = torch.ops.detdit.sp_rmsnorm.default(x, weight, shift, scale, region.sp, comm.handle, 1e-5, "portable")
    grad = normal((batch, hidden, x.shape[1]), 359, torch.bfloat16).transpose(1, 2)  # not contiguous
    grad = grad if rank == 1 else grad.contiguous()
    with pytest.raises(ValueError, match="grad must be contiguous" if rank == 1 else "rank 1 failed"):
        torch.ops.detdit.sp_rmsnorm_backward.default(grad, x, weight, shift, scale, region.sp, rstd, comm.handle,
                                                     1e-5, "portable")
    # and the communicator still works afterwards, on every rank
    table = detdit.distributed.tp_adaln_projection(temb, w[rows], b[rows], comm)
    assert torch.equal(table.view(torch.int16), detdit.adaln_projection(temb, w, b).view(torch.int16))


def _sp_positions_checks(rank, world):
    # a region without an index: its local slice, its pickled state, and a plain rmsnorm on it
    import copy
    import pickle

    import detdit
    import detdit.distributed
    from conftest import assert_bitwise_equal, normal

    batch, seq, hidden = 2, 300, 32
    comm = detdit.distributed.Communicator()
    region = detdit.distributed.sp_region(None, comm, seq_len=seq, batch=batch)
    local = region.local_slice
    assert (local.start, local.stop) == (rank * seq // world, (rank + 1) * seq // world)
    assert (region.sp.world(), region.sp.rank(), region.sp.local_seq_len()) == (world, rank, local.stop - local.start)
    for copied in (copy.deepcopy(region.sp), pickle.loads(pickle.dumps(region.sp))):
        assert copied == region.sp and not copied != region.sp
        assert (copied.local_begin(), copied.local_end()) == (local.start, local.stop)
    ops = torch.ops.detdit
    for other in (ops.sp_plan.positions(seq + 1, batch, world, rank), ops.sp_plan.positions(seq, batch + 1, world, rank),
                  ops.sp_plan.positions(seq, batch, world + 1, rank)):
        assert region.sp != other and not region.sp == other
    with pytest.raises(ValueError, match="seq_len= and batch="):
        detdit.distributed.SpRegion(None, comm)
    with pytest.raises(ValueError, match="need seq_len >= 1 and batch >= 1"):
        ops.sp_plan.positions(seq, 0, world, rank)
    if world > 1:
        with pytest.raises(ValueError, match="every rank needs a row"):
            ops.sp_plan.positions(world - 1, batch, world, rank)

    x = normal((batch, seq, hidden), 340, torch.bfloat16)
    w = (1 + normal((hidden,), 341, scale=0.05)).bfloat16()
    grad = normal((batch, seq, hidden), 342, torch.bfloat16)
    ws1 = [t.clone().requires_grad_(True) for t in (x, w)]
    ws1_out = detdit.rmsnorm(ws1[0], ws1[1])
    ws1_out.backward(grad)
    sp = [x[:, local].contiguous().requires_grad_(True), w.clone().requires_grad_(True)]
    sp_out = region.rmsnorm(sp[0], sp[1])
    sp_out.backward(grad[:, local].contiguous())
    assert_bitwise_equal(sp_out, ws1_out[:, local], f"rank {rank}/{world}: out")
    assert_bitwise_equal(sp[0].grad, ws1[0].grad[:, local], f"rank {rank}/{world}: dx")
    assert_bitwise_equal(sp[1].grad, ws1[1].grad, f"rank {rank}/{world}: d_weight (replicated)")


def _sp_layernorm_checks(rank, world):
    # layernorm and gate_residual_layernorm on a region without an index, per sample, per frame
    # (frames of 50 positions: some straddle the ranks) and per token, both recipes: every
    # output and gradient byte-equal to one process on the full sequence
    import detdit
    import detdit.distributed
    from conftest import assert_bitwise_equal, normal, packing

    batch, seq, frames, hidden = 2, 300, 6, 32
    bf, f32 = torch.bfloat16, torch.float32
    comm = detdit.distributed.Communicator()
    region = detdit.distributed.SpRegion(None, comm, seq_len=seq, batch=batch)
    local = region.local_slice
    shapes = {"per_sample": (batch, hidden), "per_frame": (batch, frames, hidden), "per_token": (batch, seq, hidden)}
    x, residual, y = (normal((batch, seq, hidden), seed, bf) for seed in (350, 351, 352))
    weight = (1 + normal((hidden,), 353, scale=0.05)).bfloat16()
    bias = normal((hidden,), 354, bf, scale=0.1)

    def sp_rows(t):
        # the SP region's view of an input: the local rows of an activation or a per-token tensor
        return t[:, local].contiguous() if t.dim() == 3 and t.shape[1] == seq else t

    for form, shape in shapes.items():
        for upcast, mdtype in ((False, f32), (False, bf), (True, bf)):
            where = f"rank {rank}/{world}: {form}, upcast={upcast}, {mdtype}"
            shift, scale, gate = (normal(shape, seed, mdtype, scale=0.3) for seed in (355, 356, 357))
            # layernorm
            ws1 = [t.clone().requires_grad_(True) for t in (x, weight, bias, shift, scale)]
            out = detdit.layernorm(ws1[0], ws1[1], ws1[2], ws1[3], ws1[4], upcast=upcast)
            grad = normal(tuple(out.shape), 358, out.dtype)
            out.backward(grad)
            sp = [sp_rows(t).clone().requires_grad_(True) for t in (x, weight, bias, shift, scale)]
            sp_out = region.layernorm(sp[0], sp[1], sp[2], sp[3], sp[4], upcast=upcast)
            sp_out.backward(grad[:, local].contiguous())
            assert_bitwise_equal(sp_out, out[:, local], f"{where}: layernorm out")
            for i, name in enumerate(("dx", "d_weight", "d_bias", "d_shift", "d_scale")):
                assert_bitwise_equal(sp[i].grad, sp_rows(ws1[i].grad), f"{where}: layernorm {name}")
            # gate_residual_layernorm, gradients reaching both out and h
            for k in (None, 1.0):
                # the norm's parameters have h's dtype: fp32 for an fp32 gate with upcast off
                leaves = (residual, y, gate, weight.to(mdtype), bias.to(mdtype), shift, scale)
                ws1 = [t.clone().requires_grad_(True) for t in leaves]
                out, h = detdit.gate_residual_layernorm(*ws1[:7], upcast=upcast, k=k)
                d_out, d_h = normal(tuple(out.shape), 359, out.dtype), normal(tuple(h.shape), 360, h.dtype)
                torch.autograd.backward([out, h], [d_out, d_h])
                sp = [sp_rows(t).clone().requires_grad_(True) for t in leaves]
                sp_out, sp_h = region.gate_residual_layernorm(*sp, upcast=upcast, k=k)
                torch.autograd.backward([sp_out, sp_h], [d_out[:, local].contiguous(), d_h[:, local].contiguous()])
                assert_bitwise_equal(sp_out, out[:, local], f"{where}, k={k}: out")
                assert_bitwise_equal(sp_h, h[:, local], f"{where}, k={k}: h")
                for i, name in enumerate(("d_residual", "d_y", "d_gate", "d_weight", "d_bias", "d_shift", "d_scale")):
                    assert_bitwise_equal(sp[i].grad, sp_rows(ws1[i].grad), f"{where}, k={k}: {name}")
                # the replicated gradients are the same bytes on every rank
                replicated = (3, 4) if form == "per_token" else (2, 3, 4, 5, 6)
                mine = torch.cat([sp[i].grad.float().flatten() for i in replicated]).view(torch.int32)
                every = [torch.empty_like(mine) for _ in range(world)]
                dist.all_gather(every, mine)
                for r, theirs in enumerate(every):
                    assert torch.equal(theirs, mine), f"{where}, k={k}: replicated gradients differ from rank {r}'s"

    # on a region with an index: layernorm in the indexed form (the region's plan), both recipes;
    # gate_residual_layernorm refuses the plan
    timesteps = 2
    ti, tags = packing(seq, timesteps, 361)
    plan = detdit.plan(ti, tags, timesteps, batch)
    indexed = detdit.distributed.SpRegion(plan, comm)
    for upcast, mdtype in ((False, f32), (True, bf)):
        where = f"rank {rank}/{world}: indexed, upcast={upcast}, {mdtype}"
        shift, scale = (normal((3 * timesteps, hidden), seed, mdtype, scale=0.3) for seed in (362, 363))
        ws1 = [t.clone().requires_grad_(True) for t in (x, weight, bias, shift, scale)]
        out = detdit.layernorm(ws1[0], ws1[1], ws1[2], ws1[3], ws1[4], plan, upcast=upcast)
        grad = normal(tuple(out.shape), 364, out.dtype)
        out.backward(grad)
        sp = [sp_rows(t).clone().requires_grad_(True) for t in (x, weight, bias, shift, scale)]
        sp_out = indexed.layernorm(sp[0], sp[1], sp[2], sp[3], sp[4], upcast=upcast)
        sp_out.backward(grad[:, local].contiguous())
        assert_bitwise_equal(sp_out, out[:, local], f"{where}: layernorm out")
        for i, name in enumerate(("dx", "d_weight", "d_bias", "d_shift", "d_scale")):
            assert_bitwise_equal(sp[i].grad, sp_rows(ws1[i].grad), f"{where}: layernorm {name}")
    with pytest.raises(ValueError):
        indexed.gate_residual_layernorm(x[:, local].contiguous(), y[:, local].contiguous(), shift=shift, scale=scale)


def _sp_forms_checks(rank, world):
    # rmsnorm and gate_residual beyond the H3 rule on a region without an index: per sample, per
    # frame (frames straddling ranks), per token, both recipes, k, no gate; and an fp32 table with
    # upcast on a region with an index: every output and gradient byte-equal to one process
    import detdit
    import detdit.distributed
    from conftest import assert_bitwise_equal, normal, packing

    batch, seq, frames, hidden = 2, 300, 6, 32
    bf, f32 = torch.bfloat16, torch.float32
    comm = detdit.distributed.Communicator()
    timesteps = 2
    ti, tags = packing(seq, timesteps, 370)
    plan = detdit.plan(ti, tags, timesteps, batch)
    free = detdit.distributed.SpRegion(None, comm, seq_len=seq, batch=batch)
    indexed = detdit.distributed.SpRegion(plan, comm)
    local = free.local_slice
    x, y = normal((batch, seq, hidden), 371, bf), normal((batch, seq, hidden), 372, bf)
    weight = (1 + normal((hidden,), 373, scale=0.05)).bfloat16()

    def sp_rows(t):
        return t[:, local].contiguous() if t is not None and t.dim() == 3 and t.shape[1] == seq else t

    cases = [(free, None, shape) for shape in ((batch, hidden), (batch, frames, hidden), (batch, seq, hidden))]
    cases.append((indexed, plan, (3 * timesteps, hidden)))
    for region, region_plan, shape in cases:
        for upcast, mdtype in ((False, f32), (False, bf), (True, bf)):
            where = f"rank {rank}/{world}: {shape}, upcast={upcast}, {mdtype}"
            shift, scale, gate = (normal(shape, seed, mdtype, scale=0.3) for seed in (374, 375, 376))
            ws1 = [t.clone().requires_grad_(True) for t in (x, weight, shift, scale)]
            out = detdit.rmsnorm(*ws1, region_plan, upcast=upcast)
            grad = normal(tuple(out.shape), 377, out.dtype)
            out.backward(grad)
            sp = [sp_rows(t).clone().requires_grad_(True) for t in (x, weight, shift, scale)]
            sp_out = region.rmsnorm(*sp, upcast=upcast)
            sp_out.backward(grad[:, local].contiguous())
            assert_bitwise_equal(sp_out, out[:, local], f"{where}: rmsnorm out")
            for i, name in enumerate(("dx", "d_weight", "d_shift", "d_scale")):
                assert_bitwise_equal(sp[i].grad, sp_rows(ws1[i].grad), f"{where}: rmsnorm {name}")
            for k, with_gate in ((None, True), (1.0, True), (None, False)):
                ws1 = [t.clone().requires_grad_(True) for t in (x, y, gate)]
                g = ws1[2] if with_gate else None
                out = detdit.gate_residual(ws1[0], ws1[1], g, region_plan, k=k, upcast=upcast)
                grad = normal(tuple(out.shape), 378, out.dtype)
                out.backward(grad)
                sp = [sp_rows(t).clone().requires_grad_(True) for t in (x, y, gate)]
                sp_out = region.gate_residual(sp[0], sp[1], sp[2] if with_gate else None, k=k, upcast=upcast)
                sp_out.backward(grad[:, local].contiguous())
                what = f"{where}, k={k}, gate={with_gate}: gate_residual"
                assert_bitwise_equal(sp_out, out[:, local], f"{what} out")
                for i, name in enumerate(("d_residual", "d_y", "d_gate")[:3 if with_gate else 2]):
                    assert_bitwise_equal(sp[i].grad, sp_rows(ws1[i].grad), f"{what} {name}")


def _sp_gate_residual_rmsnorm_forms_checks(rank, world):
    # the fused gate_residual_rmsnorm beyond the H3 rule: on a region without an index per
    # sample, per frame (frames straddling ranks), per token and unmodulated, and an indexed
    # table on a region with an index; each op (fp32 modulation) and upcast with k, with and
    # without the gate; gradients reaching h and out, and (first recipe) out only, h only:
    # h, out and every gradient byte-equal to one process
    import detdit
    import detdit.distributed
    from conftest import assert_bitwise_equal, normal, packing

    batch, seq, frames, hidden = 2, 300, 6, 32
    bf, f32 = torch.bfloat16, torch.float32
    comm = detdit.distributed.Communicator()
    timesteps = 2
    ti, tags = packing(seq, timesteps, 380)
    plan = detdit.plan(ti, tags, timesteps, batch)
    free = detdit.distributed.SpRegion(None, comm, seq_len=seq, batch=batch)
    indexed = detdit.distributed.SpRegion(plan, comm)
    local = free.local_slice
    residual, y = normal((batch, seq, hidden), 381, bf), normal((batch, seq, hidden), 382, bf)
    weight = 1 + normal((hidden,), 383, scale=0.05)

    def sp_rows(t):
        return t[:, local].contiguous() if t is not None and t.dim() == 3 and t.shape[1] == seq else t

    cases = [(free, None, shape) for shape in ((batch, hidden), (batch, frames, hidden), (batch, seq, hidden), None)]
    cases.append((indexed, plan, (3 * timesteps, hidden)))
    names = ("d_residual", "d_y", "d_gate", "d_weight", "d_shift", "d_scale")
    for region, region_plan, shape in cases:
        for n, (upcast, mdtype, k) in enumerate(((False, f32, None), (True, bf, 1.0))):
            shift, scale, gate = ((None,) * 3 if shape is None else
                                  (normal(shape, seed, mdtype, scale=0.3) for seed in (384, 385, 386)))
            for with_gate in (True, False) if shape is not None else (False,):
                # the norm's weight has h's dtype: fp32 behind an fp32 gate with upcast off
                h_dtype = f32 if with_gate and gate is not None and gate.dtype == f32 and not upcast else bf
                leaves = (residual, y, gate if with_gate else None, weight.to(h_dtype), shift, scale)
                for reaching in (("out", "h"), ("out",), ("h",)) if n == 0 and with_gate else (("out", "h"),):
                    where = f"rank {rank}/{world}: {shape}, upcast={upcast}, {mdtype}, k={k}, gate={with_gate}, " \
                            f"gradient of {'+'.join(reaching)}"
                    ws1 = [None if t is None else t.clone().requires_grad_(True) for t in leaves]
                    h, out = detdit.gate_residual_rmsnorm(*ws1, region_plan, upcast=upcast, k=k)
                    grads = {"out": normal(tuple(out.shape), 387, out.dtype), "h": normal(tuple(h.shape), 388, h.dtype)}
                    outs = {"out": out, "h": h}
                    torch.autograd.backward([outs[r] for r in reaching], [grads[r] for r in reaching])
                    sp = [None if t is None else sp_rows(t).clone().requires_grad_(True) for t in leaves]
                    sp_h, sp_out = region.gate_residual_rmsnorm(*sp, upcast=upcast, k=k)
                    sp_outs = {"out": sp_out, "h": sp_h}
                    torch.autograd.backward([sp_outs[r] for r in reaching],
                                            [grads[r][:, local].contiguous() for r in reaching])
                    assert_bitwise_equal(sp_h, h[:, local], f"{where}: h")
                    assert_bitwise_equal(sp_out, out[:, local], f"{where}: out")
                    for i, name in enumerate(names):
                        if ws1[i] is None:
                            continue
                        if ws1[i].grad is None:
                            assert sp[i].grad is None, f"{where}: {name} is not None"
                        else:
                            assert_bitwise_equal(sp[i].grad, sp_rows(ws1[i].grad), f"{where}: {name}")


def _worker(rank, world, init_file, checks):
    _setup(rank, world, init_file)
    if "sp" in checks:
        _sp_checks(rank, world)
    if "sp_fused" in checks:
        _sp_fused_checks(rank, world)
    if "sp_mismatch" in checks:
        _sp_mismatch_checks(rank, world)
    if "tp" in checks:
        _tp_checks(rank, world, 4, 64)  # N/tp = 1152, 768, 576: whole 64-row chunks
    if "tp_unaligned" in checks:
        _tp_checks(rank, world, 3, 40)
    if "tp_uneven" in checks:
        _tp_uneven_checks(rank, world)
    if "tp_family" in checks:
        _tp_family_checks(rank, world)
    if "local_error" in checks:
        _local_error_checks(rank, world)
    if "sp_positions" in checks:
        _sp_positions_checks(rank, world)
    if "sp_layernorm" in checks:
        _sp_layernorm_checks(rank, world)
    if "sp_forms" in checks:
        _sp_forms_checks(rank, world)
    if "sp_fused_forms" in checks:
        _sp_gate_residual_rmsnorm_forms_checks(rank, world)
    dist.destroy_process_group()


def _spawn(worker, world, tmp_path, *extra):
    mp.spawn(worker, args=(world, str(tmp_path / "init"), *extra), nprocs=world, join=True)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sp_region_and_tp_projection_byte_equal_to_one_process(world, tmp_path):
    _spawn(_worker, world, tmp_path, ("sp", "tp"))


@pytest.mark.parametrize("world", [2, 3])
def test_sp_gate_residual_rmsnorm_byte_equal_to_one_process(world, tmp_path):
    _spawn(_worker, world, tmp_path, ("sp_fused",))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_sp_region_without_an_index(world, tmp_path):
    _spawn(_worker, world, tmp_path, ("sp_positions",))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_sp_layernorm_and_gate_residual_layernorm_byte_equal_to_one_process(world, tmp_path):
    _spawn(_worker, world, tmp_path, ("sp_layernorm",))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_sp_rmsnorm_and_gate_residual_forms_byte_equal_to_one_process(world, tmp_path):
    _spawn(_worker, world, tmp_path, ("sp_forms",))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_sp_gate_residual_rmsnorm_forms_byte_equal_to_one_process(world, tmp_path):
    _spawn(_worker, world, tmp_path, ("sp_fused_forms",))


def test_sp_region_ranks_with_different_indexes_fail_together(tmp_path):
    _spawn(_worker, 2, tmp_path, ("sp_mismatch",))


# Regression: tp_adaln_projection_backward once placed d_act past its scratch when the
# gathered d_x partials were not a multiple of 256 bytes (T = 3, D = 40, tp = 2: 17280
# bytes; heap corruption, glibc aborted). The case above is 256-byte aligned.
def test_tp_adaln_projection_unaligned_partials(tmp_path):
    _spawn(_worker, 2, tmp_path, ("tp_unaligned",))


@pytest.mark.parametrize("world", [3, 4])
def test_tp_adaln_projection_uneven_split_byte_equal_to_one_process(world, tmp_path):
    _spawn(_worker, world, tmp_path, ("tp_uneven",))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_tp_adaln_projection_family_byte_equal_to_one_process(world, tmp_path):
    _spawn(_worker, world, tmp_path, ("tp_family",))


def test_a_binding_check_failing_on_one_rank_fails_every_rank(tmp_path):
    _spawn(_worker, 2, tmp_path, ("local_error",))
