"""DTensor q and k on 2 CPU processes (gloo, loopback): every rotary op under every placement
the sharding rules serve, forward and backward, bit for bit against the single-process call
on the full tensors; context parallel by sequence shards; the errors."""

import datetime
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="no torch.distributed/gloo")

WORLD = 2
OPS = torch.ops.rope_ext


def _worker(rank, port, module, scenario):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # One thread per rank, as torchrun gives each process (OMP_NUM_THREADS=1): WORLD ranks of
    # several threads each on few cores wait at every parallel region for a thread that
    # another rank's thread has taken the core from.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    try:
        from torch.distributed.device_mesh import init_device_mesh

        scenario_fn = getattr(__import__("importlib").import_module(module), scenario)
        scenario_fn(init_device_mesh("cpu", (WORLD,)))
        dist.barrier()  # both ranks done before teardown (gloo aborts a peer torn down early)
    finally:
        dist.destroy_process_group()
    # Done and torn down: leave without the interpreter's own teardown, where a gloo thread
    # still joinable at exit aborted a worker that had passed ("terminate called without an
    # active exception", seen once in CI after torchtitan's DTensor scenario). A failure
    # above raises instead, and the spawn reports it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(scenario: str, module: str = __name__, timeout: float = 120.0) -> None:
    """Runs the function `scenario` of `module` on WORLD processes (a 1-D CPU mesh)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = torch.multiprocessing.start_processes(
        _worker, args=(port, module, scenario), nprocs=WORLD, join=False, start_method="spawn")
    deadline = __import__("time").monotonic() + timeout
    while not context.join(timeout=1.0):
        if __import__("time").monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{scenario} did not finish in {timeout} s")


# ----------------------------------------------------------------------------- scenarios
# Each runs on both ranks; an assertion failing on either fails the test.

def _inputs(dtype=torch.float32, seq=7):
    """q [B, S, Hq, D], k [B, S, Hk, D] (S odd: uneven sequence shards), the real table."""
    import rope_ext

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(4, seq, 4, 32, generator=gen).to(dtype)
    k = torch.randn(4, seq, 2, 32, generator=gen).to(dtype)
    table = torch.view_as_real(rope_ext.precompute_freqs_cis(32, 16))
    positions = torch.randint(0, 16, (4, seq, 1), generator=gen)
    return q, k, table, positions


def _equal(got, want, what):
    from torch.distributed.tensor import DTensor

    full = got.full_tensor() if isinstance(got, DTensor) else got
    assert torch.equal(full, want), f"{what}: max error {(full - want).abs().max().item()}"


def _inplace_supported(q, k, table, positions) -> bool:
    """Whether this torch's DTensor runs the in-place ops (they return nothing, which torch
    2.9's DTensor cannot propagate); where it cannot, the API says so plainly and nothing is
    written."""
    import rope_ext
    import rope_ext.distributed

    if rope_ext.distributed.INPLACE_SUPPORTED:
        return True
    before = q.to_local().clone()
    with pytest.raises(NotImplementedError, match="apply_rotary_qk_: in-place calls on "
                       "DTensors need a newer torch"):
        rope_ext.apply_rotary_qk(q, k, table, positions=positions, inplace=True)
    with pytest.raises((RuntimeError, IndexError)):
        OPS.apply_rotary_qk_(q, k, table, positions)
    assert torch.equal(q.to_local(), before)
    return False


def scenario_placements(mesh):
    """Every op, raw and through the API, on batch / heads / replicated / partial / sequence
    shards (with positions sharded alike, or the API's own positions)."""
    import rope_ext
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    import rope_ext.distributed  # noqa: F401  (the rules, for the raw ops)

    q, k, table, positions = _inputs()
    dtable = distribute_tensor(table, mesh, [Replicate()])
    cases = [([Shard(0)], None), ([Shard(2)], None), ([Replicate()], None),
             ([Shard(0)], positions), ([Shard(1)], positions), ([Shard(2)], positions)]
    for placements, pos in cases:
        what = f"{placements} positions={pos is not None}"
        dpos = None
        if pos is not None:
            dpos = distribute_tensor(pos, mesh, [Shard(p.dim) if isinstance(p, Shard) and
                                                 p.dim < 2 else Replicate() for p in placements])
        want_q, want_k = OPS.apply_rotary_qk(q, k, table, pos)
        dq, dk = (distribute_tensor(t, mesh, placements) for t in (q, k))
        out = OPS.apply_rotary(dq, dtable, dpos)
        assert list(out.placements) == placements, what
        _equal(out, want_q, what)
        got_q, got_k = OPS.apply_rotary_qk(dq, dk, dtable, dpos)
        assert list(got_q.placements) == list(got_k.placements) == placements, what
        _equal(got_q, want_q, what)
        _equal(got_k, want_k, what)
        # No communication: each rank's local result is the local op on its local shards.
        local = OPS.apply_rotary(dq.to_local(), table, None if dpos is None else dpos.to_local())
        assert torch.equal(out.to_local(), local), what
        # (clones: distribute_tensor may keep the very tensor as a replicated local shard)
        iq, ik = (distribute_tensor(t.clone(), mesh, placements) for t in (q, k))
        ix = distribute_tensor(q.clone(), mesh, placements)
        if _inplace_supported(iq, ik, dtable, dpos):
            OPS.apply_rotary_qk_(iq, ik, dtable, dpos)
            assert list(iq.placements) == placements, what
            _equal(iq, want_q, what)
            _equal(ik, want_k, what)
            OPS.apply_rotary_(ix, dtable, dpos)
            _equal(ix, want_q, what)
            rope_ext.apply_rotary(ix, dtable, positions=dpos, inplace=True, inverse=True)
            torch.testing.assert_close(ix.full_tensor(), q, atol=2e-6, rtol=2e-6)  # rotated back
        # The API: complex or real table, plain or DTensor.
        for tab in (dtable, table, torch.view_as_complex(table)):
            api_q, api_k = rope_ext.apply_rotary_qk(dq, dk, tab, positions=dpos)
            _equal(api_q, want_q, what + " api")
            _equal(api_k, want_k, what + " api")
    # A sharded table is gathered (the rules take it replicated).
    sharded_table = distribute_tensor(table, mesh, [Shard(0)])
    _equal(OPS.apply_rotary(distribute_tensor(q, mesh, [Shard(2)]), sharded_table),
           OPS.apply_rotary(q, table), "sharded table")
    # Partial(sum) stays Partial: rank 0 holds x, rank 1 zeros.
    local = q if mesh.get_local_rank() == 0 else torch.zeros_like(q)
    partial = DTensor.from_local(local, mesh, [Partial()], run_check=False)
    out = OPS.apply_rotary(partial, dtable)
    assert list(out.placements) == [Partial()]
    _equal(out, OPS.apply_rotary(q, table), "partial")


def scenario_context_parallel(mesh):
    """Sequence shards without positions: the API gives each shard its global positions
    (uneven shards: 7 rows on 2 ranks); the raw out-of-place op gathers, the in-place op
    refuses; plain-tensor context parallel as torch's context_parallel does it."""
    import rope_ext
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    q, k, table, _ = _inputs()
    for offset in (0, 5):
        want_q, want_k = OPS.apply_rotary_qk(q, k, table, None, offset)
        dq, dk = (distribute_tensor(t, mesh, [Shard(1)]) for t in (q, k))
        got_q, got_k = rope_ext.apply_rotary_qk(dq, dk, table, offset=offset)
        assert list(got_q.placements) == [Shard(1)]
        _equal(got_q, want_q, f"cp offset {offset}")
        _equal(got_k, want_k, f"cp offset {offset}")
        iq, ik = (distribute_tensor(t.clone(), mesh, [Shard(1)]) for t in (q, k))
        if _inplace_supported(iq, ik, table, None):
            rope_ext.apply_rotary_qk(iq, ik, table, offset=offset, inplace=True)
            _equal(iq, want_q, "cp in place")
            _equal(ik, want_k, "cp in place")
        hf_q = distribute_tensor(q.transpose(1, 2).contiguous(), mesh, [Shard(2)])
        got = rope_ext.apply_rotary(hf_q, table, offset=offset, seq_dim=2)
        _equal(got, want_q.transpose(1, 2), "cp [B, H, S, D]")
    dtable = distribute_tensor(table, mesh, [Replicate()])
    dq = distribute_tensor(q, mesh, [Shard(1)])
    _equal(OPS.apply_rotary(dq, dtable), OPS.apply_rotary(q, table), "raw op gathers")
    before = dq.to_local().clone()
    with pytest.raises((RuntimeError, IndexError)):  # a placement change, or no in-place DTensor ops
        OPS.apply_rotary_(dq, dtable)
    assert torch.equal(dq.to_local(), before)
    # torch's own context_parallel shards plain q, k and the table rows alike, load-balanced
    # (rank r holds chunks r and 2W-1-r of a 2W-chunk split), and rope_ext needs nothing more.
    from torch.distributed.tensor.experimental import context_parallel

    seq = 8
    q, k, table, _ = _inputs(seq=seq)
    table = table[:seq].clone()
    want_q, want_k = OPS.apply_rotary_qk(q, k, table)
    rank, chunk = mesh.get_local_rank(), seq // (2 * WORLD)
    rows = torch.cat([torch.arange(c * chunk, (c + 1) * chunk)
                      for c in (rank, 2 * WORLD - 1 - rank)])
    with context_parallel(mesh, buffers=[q, k, table], buffer_seq_dims=[1, 1, 0]):
        assert q.shape[1] == table.shape[0] == seq // WORLD
        got_q, got_k = rope_ext.apply_rotary_qk(q, k, table)
    assert torch.equal(got_q, want_q[:, rows]) and torch.equal(got_k, want_k[:, rows])


def scenario_backward(mesh):
    """Gradients of q, k and the table on DTensors, out of place and in place, against the
    single-process ones."""
    import rope_ext
    import rope_ext.distributed
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    q, k, table, positions = _inputs(torch.float64)
    table = table.double()
    cases = [(placements, pos, inplace)
             for placements, pos in (([Shard(0)], None), ([Shard(2)], positions),
                                     ([Shard(1)], None), ([Replicate()], positions))
             for inplace in ((False, True) if rope_ext.distributed.INPLACE_SUPPORTED
                             else (False,))]
    for placements, pos, inplace in cases:
        what = f"{placements} positions={pos is not None} inplace={inplace}"
        leaves = [t.clone().requires_grad_() for t in (q, k, table)]
        # (an in-place call recovers x from its output: the same call single-process is the
        # reference for the table's gradient)
        want = rope_ext.apply_rotary_qk(*[t * 1.0 if inplace else t for t in leaves[:2]],
                                        leaves[2], positions=pos, interleaved=False,
                                        inplace=inplace)
        sum(w.square().sum() for w in want).backward()
        dleaves = [distribute_tensor(t, mesh, placements).requires_grad_() for t in (q, k)]
        dtable = distribute_tensor(table, mesh, [Replicate()]).requires_grad_()
        inputs = [t * 1.0 for t in dleaves] if inplace else dleaves  # in place needs non-leaves
        got = rope_ext.apply_rotary_qk(*inputs, dtable, positions=pos, interleaved=False,
                                       inplace=inplace)
        for g, w in zip(got, want):
            _equal(g, w.detach(), what)
        sum(g.square().sum() for g in got).backward()
        for d in dleaves:  # the gradient of q and of k is sharded like q and k
            assert list(d.grad.placements) == placements, (what, d.grad.placements)
        for d, leaf in zip([*dleaves, dtable], leaves):
            full = d.grad.full_tensor()
            torch.testing.assert_close(full, leaf.grad, atol=1e-12, rtol=1e-12,
                                       msg=lambda m: f"{what}: {m}")


def scenario_mrope(mesh):
    """MRoPE on DTensors: positions [3, B, S, 1] sharded like q on batch or sequence (their
    axis dim never), or q sharded on heads with positions replicated; values and gradients
    against the single-process call."""
    import rope_ext
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    q, k, _, _ = _inputs(torch.float64)  # 7 rows: uneven sequence shards
    table = torch.view_as_real(rope_ext.precompute_freqs_cis(32, 16, dtype=torch.float64))
    gen = torch.Generator().manual_seed(1)
    positions = torch.randint(0, 16, (3, 4, q.shape[1], 1), generator=gen)
    kw = dict(interleaved=False, mrope_section=[4, 6, 6])
    for placements, pos_placements in (([Shard(0)], [Shard(1)]), ([Shard(1)], [Shard(2)]),
                                       ([Shard(2)], [Replicate()])):
        what = f"MRoPE {placements}"
        leaves = [t.clone().requires_grad_() for t in (q, k, table)]
        want = rope_ext.apply_rotary_qk(*leaves, positions=positions, **kw)
        sum(w.square().sum() for w in want).backward()
        dq, dk = (distribute_tensor(t, mesh, placements).requires_grad_() for t in (q, k))
        dtable = distribute_tensor(table, mesh, [Replicate()]).requires_grad_()
        dpos = distribute_tensor(positions, mesh, pos_placements)
        got = rope_ext.apply_rotary_qk(dq, dk, dtable, positions=dpos, **kw)
        for g, w in zip(got, want):
            assert list(g.placements) == placements, what
            _equal(g, w.detach(), what)
        # Plain-tensor positions: this rank's own (uneven shards too), placed like q.
        local = positions if pos_placements == [Replicate()] else dpos.to_local()
        again = rope_ext.apply_rotary_qk(dq.detach(), dk.detach(), table, positions=local, **kw)
        _equal(again[0], want[0].detach(), what + " local positions")
        sum(g.square().sum() for g in got).backward()
        for d, leaf in zip((dq, dk, dtable), leaves):
            torch.testing.assert_close(d.grad.full_tensor(), leaf.grad, atol=1e-12, rtol=1e-12,
                                       msg=lambda m: f"{what}: {m}")


def scenario_qk_norm(mesh):
    """Fused RMSNorm + RoPE on DTensors: q and k sharded on batch, sequence (their positions
    made global) or heads, plain weights taken as replicated; values and the gradients of q,
    k and both weights (Partial sums of each rank's rows, reduced) against one process. A
    Partial q is gathered first (the norm is not linear)."""
    import rope_ext
    import rope_ext.distributed
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    q, k, _, _ = _inputs(torch.float64)  # 7 rows: uneven sequence shards
    table = torch.view_as_real(rope_ext.precompute_freqs_cis(32, 16, dtype=torch.float64))
    gen = torch.Generator().manual_seed(2)
    weights = [torch.randn(32, generator=gen, dtype=torch.float64) * 0.5 + 1 for _ in range(2)]
    kw = dict(interleaved=False, weight_offset=0.5)
    for placements in ([Shard(0)], [Shard(1)], [Shard(2)], [Replicate()]):
        what = f"rms_norm_rotary_qk {placements}"
        leaves = [t.clone().requires_grad_() for t in (q, k, *weights)]
        want = rope_ext.rms_norm_rotary_qk(*leaves, table, **kw)
        sum(w.square().sum() for w in want).backward()
        dq, dk = (distribute_tensor(t, mesh, placements).requires_grad_() for t in (q, k))
        ws = [w.clone().requires_grad_() for w in weights]
        got = rope_ext.rms_norm_rotary_qk(dq, dk, *ws, table, **kw)
        for g, w in zip(got, want):
            assert list(g.placements) == placements, what
            torch.testing.assert_close(g.full_tensor(), w.detach(), atol=1e-12, rtol=1e-12,
                                       msg=lambda m: f"{what}: {m}")
        if rope_ext.distributed.INPLACE_SUPPORTED:
            iq, ik = dq.detach().clone(), dk.detach().clone()
            rope_ext.rms_norm_rotary_qk(iq, ik, *weights, table, inplace=True, **kw)
            _equal(iq, got[0].detach().full_tensor(), what + " in place")
        sum(g.square().sum() for g in got).backward()
        for d, leaf in zip((dq.grad.full_tensor(), dk.grad.full_tensor(), *(w.grad for w in ws)),
                           leaves):
            torch.testing.assert_close(d, leaf.grad, atol=1e-12, rtol=1e-12,
                                       msg=lambda m: f"{what} gradients: {m}")
    # Partial q: DTensor reduces it before the (nonlinear) norm.
    partial = DTensor.from_local(q / WORLD, mesh, [Partial()], run_check=False)  # exact halves
    got = rope_ext.rms_norm_rotary_qk(partial, distribute_tensor(k, mesh, [Replicate()]),
                                      *weights, table, **kw)
    want = rope_ext.rms_norm_rotary_qk(q, k, *weights, table, **kw)
    torch.testing.assert_close(got[0].full_tensor(), want[0], atol=1e-12, rtol=1e-12)


def scenario_errors(mesh):
    """Bad placements and meshes: clear errors naming them, before anything is written."""
    import rope_ext
    import rope_ext.distributed
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    q, k, table, positions = _inputs()
    dq = distribute_tensor(q.clone(), mesh, [Shard(3)])
    before = dq.to_local().clone()
    for inplace in (False, True):
        if inplace and not rope_ext.distributed.INPLACE_SUPPORTED:
            continue  # (the in-place refusal is _inplace_supported's)
        op = "apply_rotary_" if inplace else "apply_rotary"
        with pytest.raises(ValueError, match=rf"{op}: x is sharded on its last dim \(head_dim\) "
                           r"by \(Shard\(dim=3\),\); rotary pairs need whole rows"):
            rope_ext.apply_rotary(dq, table, inplace=inplace)
    assert torch.equal(dq.to_local(), before)
    dq = distribute_tensor(q, mesh, [Shard(1)])
    dpos = distribute_tensor(positions, mesh, [Replicate()])
    with pytest.raises(ValueError, match=r"apply_rotary_qk: positions are placed \(Replicate\(\),\) "
                       r"but q \(Shard\(dim=1\),\) needs them \(Shard\(dim=1\),\)"):
        rope_ext.apply_rotary_qk(dq, distribute_tensor(k, mesh, [Shard(1)]), table,
                                 positions=dpos)
    other = DeviceMesh("cpu", [1, 0])
    with pytest.raises(ValueError, match="q and k must be DTensors on one device mesh"):
        rope_ext.apply_rotary_qk(dq, distribute_tensor(k, other, [Shard(1)]), table)
    with pytest.raises(ValueError, match="apply_rotary: positions are on device mesh"):
        rope_ext.apply_rotary(dq, table, positions=distribute_tensor(positions, other, [Shard(1)]))
    with pytest.raises(ValueError, match="apply_rotary: freqs_cis is on device mesh"):
        rope_ext.apply_rotary(dq, distribute_tensor(table, other, [Replicate()]))


def scenario_compile(mesh):
    """torch.compile(fullgraph=True) of the API and of the raw op on DTensors."""
    import rope_ext
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    q, k, table, positions = _inputs()
    want = OPS.apply_rotary_qk(q, k, table, positions)
    dq, dk = (distribute_tensor(t, mesh, [Shard(2)]) for t in (q, k))
    dtable = distribute_tensor(table, mesh, [Replicate()])
    dpos = distribute_tensor(positions, mesh, [Replicate()])
    api = torch.compile(lambda q, k, t, p: rope_ext.apply_rotary_qk(q, k, t, positions=p),
                        fullgraph=True)
    raw = torch.compile(lambda q, k, t, p: OPS.apply_rotary_qk(q, k, t, p), fullgraph=True)
    for fn in (api, raw):
        for g, w in zip(fn(dq, dk, dtable, dpos), want):
            assert list(g.placements) == [Shard(2)]
            _equal(g, w, "compiled")


@pytest.mark.parametrize("scenario", ["scenario_placements", "scenario_context_parallel",
                                      "scenario_backward", "scenario_mrope", "scenario_qk_norm",
                                      "scenario_errors",
                                      "scenario_compile"])
def test_dtensor(scenario):
    run(scenario)
