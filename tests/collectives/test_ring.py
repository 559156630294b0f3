"""The ring between host leaders, over real TCP data-plane links (members as threads of this process)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import mesharray as ma
from mesharray.collectives import ring as ring_mod
from mesharray.collectives.ring import RingCollective
from mesharray.transport.dataplane import Rendezvous, TcpPlane

pytestmark = pytest.mark.timeout(60)
SECRET = b"r" * 32


def _rings(n: int):
    """``n`` ring members wired over TcpPlane links; returns (members, planes)."""
    rvs = [Rendezvous() for _ in range(n)]
    planes = [TcpPlane(SECRET, "127.0.0.1", rv.put) for rv in rvs]
    rights = [planes[i].connect(planes[(i + 1) % n].address, f"to{(i + 1) % n}".encode()) for i in range(n)]
    lefts = [rvs[i].take(f"to{i}".encode(), 10) for i in range(n)]
    return [RingCollective(i, n, rights[i], lefts[i]) for i in range(n)], planes


def _run_all(members, fn):
    out: list = [None] * len(members)
    errs: list = []

    def run(i):
        try:
            out[i] = fn(members[i], i)
        except BaseException as exc:
            errs.append(exc)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(members))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    if errs:
        raise errs[0]
    return out


@pytest.fixture(params=[2, 3])
def ring(request, monkeypatch):
    monkeypatch.setattr(ring_mod, "CHUNK", 4096)  # many chunks per segment: the pipelining is exercised
    members, planes = _rings(request.param)
    yield members
    for m in members:
        m.close()
    for p in planes:
        p.close()


@pytest.mark.parametrize("op", ["sum", "prod", "min", "max", "mean"])
@pytest.mark.parametrize("count", [1, 2, 7, 10_001])
def test_allreduce_equals_numpy(ring, op, count):
    n = len(ring)
    rng = np.random.default_rng(count)
    data = [rng.integers(1, 4, size=count).astype(np.float64) for _ in range(n)]
    got = _run_all(ring, lambda m, i: m.allreduce(data[i], op=op))
    want = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max, "mean": np.mean}[op](np.stack(data), axis=0)
    for g in got:
        np.testing.assert_allclose(g, want)


def test_allreduce_in_place_and_repeated(ring):
    n = len(ring)
    bufs = [np.full(5000, i + 1, dtype=np.int64) for i in range(n)]
    for _ in range(3):
        _run_all(ring, lambda m, i: m.allreduce(bufs[i], out=bufs[i]))
    total = sum(range(1, n + 1)) * n ** 2
    for b in bufs:
        assert (b == total).all()


def test_allreduce_into_another_array_leaves_the_input_and_overlaps_are_safe(ring):
    n = len(ring)
    sends = [np.arange(10_000, dtype=np.float32) + i for i in range(n)]
    kept = [x.copy() for x in sends]
    outs = [np.full(10_000, np.nan, dtype=np.float32) for _ in range(n)]
    _run_all(ring, lambda m, i: m.allreduce(sends[i], out=outs[i]))
    want = sum(kept)
    for i in range(n):
        np.testing.assert_array_equal(outs[i], want)
        np.testing.assert_array_equal(sends[i], kept[i])  # the input is read, never written
    # ``out`` a shifted view of the same memory as ``send``: the result is still the sum of the inputs
    bufs = [np.concatenate([np.arange(10_000, dtype=np.float64) + i, np.zeros(3)]) for i in range(n)]
    _run_all(ring, lambda m, i: m.allreduce(bufs[i][:10_000], out=bufs[i][3:]))
    for b in bufs:
        np.testing.assert_array_equal(b[3:], sum(np.arange(10_000, dtype=np.float64) + i for i in range(n)))


def test_broadcast_and_allgather(ring):
    n = len(ring)
    bufs = [np.full(9999, i, dtype=np.float32) for i in range(n)]
    _run_all(ring, lambda m, i: m.broadcast(bufs[i], root=n - 1))
    for b in bufs:
        assert (b == n - 1).all()
    got = _run_all(ring, lambda m, i: m.allgather(np.full(3, i, dtype=np.int32)))
    for g in got:
        np.testing.assert_array_equal(g, np.repeat(np.arange(n), 3).reshape(n, 3))


def test_bad_arguments_are_clear(ring):
    with pytest.raises(ValueError, match="unknown reduction op 'median'"):
        ring[0].allreduce(np.ones(2), op="median")
    with pytest.raises(TypeError, match="floating dtype"):
        ring[0].allreduce(np.ones(2, dtype=np.int32), op="mean")
    with pytest.raises(ValueError, match="root must be a member"):
        ring[0].broadcast(np.ones(2), root=len(ring))


def test_a_broken_link_is_actor_died_not_a_hang():
    members, planes = _rings(2)
    try:
        members[1].left.close()  # member 1 loses its link from member 0 ...
        members[1].right.close()
        with pytest.raises(ma.ActorDiedError, match="link"):
            members[0].allreduce(np.ones(1 << 16))  # ... and member 0 finds out instead of waiting
    finally:
        for m in members:
            m.close()
        for p in planes:
            p.close()


def test_a_silent_neighbour_times_out_instead_of_hanging(monkeypatch):
    from mesharray.transport import dataplane

    monkeypatch.setattr(dataplane, "LINK_TIMEOUT", 0.5)  # (MESHARRAY_COLLECTIVE_TIMEOUT, 60 s by default)
    members, planes = _rings(2)
    try:
        with pytest.raises(ma.ActorDiedError, match="timed out"):
            members[0].allreduce(np.ones(1 << 10))  # member 1 is alive but never takes part
    finally:
        for m in members:
            m.close()
        for p in planes:
            p.close()
