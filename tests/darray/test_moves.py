"""Blocks move worker to worker: ``to_mesh`` between and within process meshes, and ops whose
operands live on different ranks."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import mesharray as ma
import mesharray.darray.instructions as I
from mesharray.darray import context as context_module
from mesharray.darray import data_context
from mesharray.darray.storage import distributed
from mesharray.errors import ActorDiedError, MeshShapeError

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def two():
    a, b = ma.proc_mesh(procs=2), ma.proc_mesh(procs=2)
    yield a, b
    a.stop()
    b.stop()


@pytest.fixture(scope="module")
def grid():
    mesh = ma.proc_mesh(hosts=2, procs=2)
    yield mesh
    mesh.stop()


def _np(x):
    return np.asarray(x.fetch())


def _replies(mesh):
    return mesh.stats()["replies"]


def test_to_mesh_between_disjoint_meshes_moves_every_block(two):
    a, b = two
    w = a.arange((3, 2), dtype="float32") + a.rank_array(dtype="float32") * 100
    ref = _np(w)
    before = _replies(a), _replies(b)
    moved = w.to_mesh(b)
    assert _replies(a) == before[0]  # nothing came back to the controller to make it
    assert type(moved._storage).__name__ == "DistributedStorage"
    assert moved.mesh_shape == b.mesh_shape and moved.local_shape == (3, 2) and moved.dtype == np.float32
    assert set(moved._storage.ranks.ravel().tolist()) == set(b.mesh_shape.ranks())
    np.testing.assert_array_equal(_np(moved), ref)
    # the copy is its own: computing on it leaves the original alone
    np.testing.assert_array_equal(_np(moved * 2 - 1), ref * 2 - 1)
    np.testing.assert_array_equal(_np(w), ref)


def test_to_mesh_fans_one_block_out(two):
    a, b = two
    w = a.arange(4) + a.rank_array() * 10
    one = w.slice(procs=slice(1, 2))  # a size-1 dim broadcasts
    np.testing.assert_array_equal(_np(one.to_mesh(b)), [[np.arange(4) + 10] * 2])
    scalar_mesh = w.slice(procs=1)  # a missing dim broadcasts too
    np.testing.assert_array_equal(_np(scalar_mesh.to_mesh(b)), [[np.arange(4) + 10] * 2])


def test_pipeline_stage_within_one_mesh(grid):
    acts = grid.arange(3) * 10 + grid.rank_array()  # each rank its own activations
    ref = _np(acts)
    nxt = acts[0].to_mesh(grid[1])  # stage 0's blocks go to stage 1's ranks
    assert set(nxt._storage.ranks.ravel().tolist()) == set(grid[1].mesh_shape.ranks())
    np.testing.assert_array_equal(_np(nxt), ref[0])
    back = nxt.to_mesh(grid[0])
    np.testing.assert_array_equal(_np(back), ref[0])
    # onto the same ranks: a copy, nothing moves
    np.testing.assert_array_equal(_np(acts.to_mesh(grid)), ref)


def test_alignment_by_name_positional_and_errors(grid, two):
    a, _ = two
    x = grid.rank_array()
    # transposed names line up by name
    t = x.transpose("procs", "hosts")
    np.testing.assert_array_equal(_np(t.to_mesh(grid)), _np(x))
    # other names: positionally from the right
    y = a.rank_array() * 1.5  # (hosts=1, procs=2) -> broadcast over grid's hosts
    np.testing.assert_array_equal(_np(y.to_mesh(grid)), np.broadcast_to(_np(y), (2, 2)))
    with pytest.raises(MeshShapeError, match=r"dim 'hosts' has size 2 here and 1 there"):
        x.to_mesh(a)


def test_mismatched_meshes_are_refused_and_lose_nothing(two):
    a, b = two
    big = ma.proc_mesh(procs=3)
    try:
        w = big.rank_array()
        with pytest.raises(MeshShapeError, match=r"dim 'procs' has size 3 here and 2 there"):
            w.to_mesh(a)
        np.testing.assert_array_equal(_np(w.slice(procs=slice(0, 2)).to_mesh(a)), [[0, 1]])
    finally:
        big.stop()


def test_gathered_array_is_scattered(two):
    _, b = two
    g = ma.MeshArray(np.arange(6.0).reshape(1, 2, 3), ["hosts", "procs"])
    d = g.to_mesh(b)
    assert type(d._storage).__name__ == "DistributedStorage"
    np.testing.assert_array_equal(_np(d), g.to_numpy())


@pytest.mark.parametrize("shape,dtype", [((), "int64"), ((0,), "float32"), ((5, 3), "complex128"),
                                         ((7,), "bool")])
def test_uneven_shapes_and_dtypes(two, shape, dtype):
    a, b = two
    x = (a.arange(shape or (), dtype="int64") + a.rank_array()).astype(dtype) if shape != () else \
        a.rank_array().astype(dtype)
    np.testing.assert_array_equal(_np(x.to_mesh(b)), _np(x))


def test_ops_with_operands_on_different_ranks_move_blocks(grid, two):
    x = grid.arange(4, dtype="float64") + grid.rank_array() * 10
    ref = _np(x)
    # rows live on different ranks: the second row's blocks move to the first's
    np.testing.assert_array_equal(_np(x[0] + x[1]), ref[0] + ref[1])
    # a transposed operand: position (i, j) of x.T's values sits on another rank
    # (names line up: the transposed array is x itself, no block moves)
    np.testing.assert_array_equal(_np(x * 2 + x.transpose("procs", "hosts")), ref * 3)
    # the same names over other positions: block (i, j) of `swapped` is x's (j, i), on another rank
    swapped = x.transpose("procs", "hosts").rename(procs="hosts", hosts="procs")
    np.testing.assert_array_equal(_np(x * 2 + swapped), ref * 2 + ref.transpose(1, 0, 2))
    # another process mesh's array: moved to the first operand's ranks
    a, b = two
    u, v = a.arange(3) + a.rank_array(), b.arange(3) * 100 + b.rank_array()
    s = u + v
    assert s._storage.ctx is u._storage.ctx
    np.testing.assert_array_equal(_np(s), _np(u) + _np(v))
    np.testing.assert_array_equal(_np(v - u), _np(v) - _np(u))  # the other way round: lives on b


def _boom(x):
    raise ZeroDivisionError("the sender's block failed")


def _later(fn, x):
    """``fn`` of each block of ``x`` (same shape and dtype), sent fire-and-forget like any op."""
    st = distributed(x)
    bid = st.ctx.new_id()
    st.ctx.send(st._unique(), [I.Apply(bid, fn, [I.BlockRef(st.bid)])])
    return ma.MeshArray.from_storage(x.mesh_shape, st._derive(bid))


def _failing(mesh):
    """An array whose blocks failed to be made on the workers."""
    return _later(_boom, mesh.ones(2))


def test_failed_block_moves_its_failure(two):
    a, b = two
    with np.errstate(divide="ignore"):
        broken = a.ones(2) / a.zeros(2)  # inf: numbers move as they are
    np.testing.assert_array_equal(_np(broken.to_mesh(b)), np.full((1, 2, 2), np.inf))
    # a block whose making failed (an op sent fire-and-forget): the receivers raise the original error
    failed = _failing(a)
    with pytest.raises(ma.ActorError, match="the sender's block failed") as info:
        failed.to_mesh(b).fetch()
    assert isinstance(info.value.exception, ZeroDivisionError)
    with pytest.raises(ma.ActorError, match="the sender's block failed"):
        (a.ones(2) + failed).to_mesh(b).fetch()
    # both meshes keep working
    np.testing.assert_array_equal(_np(a.ones(2).to_mesh(b)), np.ones((1, 2, 2)))


def test_small_moves_in_a_row_travel_as_one_and_keep_each_failure(two, monkeypatch):
    """Small blocks moved to the same ranks one after another (a model's weights sent each step) go as
    one instruction, one broadcast per sender; each array keeps its own values, or its own failure."""
    a, b = two
    # (no idle flush between the moves, however slow this machine is: a flushed move merges with none)
    monkeypatch.setattr(context_module, "FLUSH_IDLE", 30.0)
    monkeypatch.setattr(context_module, "FLUSH_AGE", 30.0)
    sent = []
    ctxs = [data_context(m) for m in (a, b)]
    for ctx in ctxs:
        def spy(ranks, wire, real=ctx._broadcast):
            sent.append([w[0] for w in wire if w[0] in ("move", "moves")] + [len(w[1]) for w in wire if w[0] == "moves"])
            return real(ranks, wire)
        ctx._broadcast = spy
    try:
        ws = [a.arange(5, dtype="float32") * (i + 1) + a.rank_array(dtype="float32") for i in range(3)]
        failed = _failing(a)
        a.sync()
        sent.clear()
        moved = [w.to_mesh(b) for w in ws[:2]] + [failed.to_mesh(b)] + [ws[2].to_mesh(b)]
        b.sync()
        a.sync()
        assert sent == [["moves", 4], ["moves", 4]]  # the receivers' message and the senders'
    finally:
        for ctx in ctxs:
            del ctx._broadcast
    for i in (0, 1):
        np.testing.assert_array_equal(_np(moved[i]), _np(ws[i]))
    np.testing.assert_array_equal(_np(moved[3]), _np(ws[2]))
    with pytest.raises(ma.ActorError, match="the sender's block failed") as info:
        moved[2].fetch()
    assert isinstance(info.value.exception, ZeroDivisionError)
    # a large block between small ones is not merged; every value still arrives
    big = a.ones(1 << 16, dtype="float32") * a.rank_array(dtype="float32")
    got = [x.to_mesh(b) for x in (ws[0], big, ws[1], ws[2])]
    np.testing.assert_array_equal(_np(got[1].sum(axis=-1)), [[0.0, float(1 << 16)]])
    for x, y in zip((ws[0], ws[1], ws[2]), (got[0], got[2], got[3])):
        np.testing.assert_array_equal(_np(y), _np(x))


def test_small_moves_of_mixed_dtypes_merge_and_keep_their_values(two, monkeypatch):
    # blocks of 3, 1 and 5 bytes and 8-byte elements share one broadcast, each at its own aligned place
    pytest.importorskip("torch", reason="one of the blocks is a torch engine's")
    a, b = two
    monkeypatch.setattr(context_module, "FLUSH_IDLE", 30.0)
    monkeypatch.setattr(context_module, "FLUSH_AGE", 30.0)
    xs = [a.arange(3, dtype="int8"), a.full((1,), 7, dtype="uint8"), a.arange(5, dtype="float16") / 4,
          a.arange(3, dtype="float64") + a.rank_array(dtype="float64") / 3,
          a.arange(2, dtype="float32", engine="torch") * 2]
    moved = [x.to_mesh(b) for x in xs]
    for x, y in zip(xs, moved):
        got, want = _np(y), _np(x)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(_np(moved[3] * 3 + moved[4].sum(axis=-1)), _np(xs[3] * 3 + 2.0))


def test_small_rolls_within_a_mesh_merge_and_roll(grid):
    xs = [grid.arange(3) + grid.rank_array() * 10 + i for i in range(3)]
    rolled = [x.roll(1, axis=0) for x in xs]
    for x, r in zip(xs, rolled):
        np.testing.assert_array_equal(_np(r), np.roll(_np(x), 1, axis=0))


def _sleep(x):
    time.sleep(1.0)
    return x


@pytest.mark.timeout(60)
def test_sender_dying_mid_move_raises_actor_died():
    src, dst = ma.proc_mesh(procs=2), ma.proc_mesh(procs=2)
    try:
        x = src.ones(1 << 20, dtype="float32")
        np.testing.assert_array_equal(_np(x.to_mesh(dst).sum(axis=-1)), [[1 << 20] * 2])  # groups made
        slow = _later(_sleep, x)  # the senders are busy: the receivers wait inside the move
        moved = slow.to_mesh(dst)
        time.sleep(0.3)
        os.kill(src.pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(ActorDiedError) as info:
            moved.fetch()
        assert 1 in info.value.ranks
        assert time.monotonic() - t0 < 15
        # the receivers are free again: the destination mesh still works
        np.testing.assert_array_equal(_np(dst.ones(3).sum(axis="procs")), [[2.0] * 3])
    finally:
        src.stop()
        dst.stop()


def test_torch_blocks_move(two):
    torch = pytest.importorskip("torch")
    a, b = two
    x = a.arange(4, dtype="float32", engine="torch") + a.rank_array(dtype="float32", engine="torch")
    y = x.to_mesh(b)
    assert y._storage.engine == "torch"
    np.testing.assert_array_equal(_np(y), _np(x))
    assert b.apply(lambda t: torch.is_tensor(t), y).fetch().tolist() == [[True, True]]


@pytest.mark.timeout(60)
def test_large_move_goes_straight_between_processes(two):
    a, b = two
    x = a.ones(8 << 20, dtype="float32") * (a.rank_array(dtype="float32") + 1)
    y = x.to_mesh(b)
    np.testing.assert_array_equal(_np(y.sum(axis=-1)), [[8 << 20, 16 << 20]])


def test_apply_runs_on_its_mesh_and_moves_operands_there(two, grid):
    a, b = two
    u, v = a.arange(3) + a.rank_array(), b.arange(3) * 100 + b.rank_array()
    np.testing.assert_array_equal(_np(a.apply(np.add, u, v)), _np(u) + _np(v))
    on_b = b.apply(np.add, u, v)  # runs on b: u's blocks move there
    assert on_b._storage.ctx is v._storage.ctx
    np.testing.assert_array_equal(_np(on_b), _np(u) + _np(v))
    x = grid.rank_array() * 1.0
    np.testing.assert_array_equal(_np(grid[0].apply(np.subtract, x[0], x[1])), _np(x[0]) - _np(x[1]))
    with pytest.raises(MeshShapeError, match="the mesh layout it runs on"):
        a.apply(np.add, u, grid.rank_array())


N_MOVES = 3000  # (at 300 the old lock order deadlocked only sometimes; at 3000 in the first run)


def test_moves_both_ways_from_two_threads_do_not_deadlock(two):
    """A move queues on both meshes' buffers at once (so that it can merge with the move before it):
    one thread moving a -> b while another moves b -> a must not hold one buffer each and wait."""
    import threading

    a, b = two
    xa, xb = a.ones((4,), dtype="float32"), b.ones((4,), dtype="float32") * 2
    errors: list = []

    def mover(x, to):
        try:
            for _ in range(N_MOVES):
                x.to_mesh(to)
        except BaseException as exc:  # (reported below)
            errors.append(exc)

    ts = [threading.Thread(target=mover, args=(xa, b), daemon=True),
          threading.Thread(target=mover, args=(xb, a), daemon=True)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
    assert not any(t.is_alive() for t in ts), "two threads moving in opposite directions deadlocked"
    assert not errors, errors
    np.testing.assert_array_equal(_np(xa.to_mesh(b)), np.ones((1, 2, 4)))
    np.testing.assert_array_equal(_np(xb.to_mesh(a)), np.full((1, 2, 4), 2.0))
