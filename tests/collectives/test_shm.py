"""The shared-memory collective backend, with real processes."""

import os
import signal
import time

import numpy as np
import pytest

from mesharray.collectives import ShmCollective, new_group, unique_segment_name
from mesharray.errors import ActorDiedError, SupervisionError
from tests.collectives._procs import run_ranks

pytestmark = pytest.mark.timeout(90)


def _data(rank, n, dtype, seed=0):
    rng = np.random.default_rng(seed + rank)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(n).astype(dtype)
    return rng.integers(-100, 100, n).astype(dtype)


def _all_ops(rank, size, name):
    # every collective, small (one round) and large (several rounds: capacity 64 KiB)
    g = ShmCollective(name, rank, size, capacity=64 << 10, timeout=30)
    out = {}
    try:
        for n in (1, 1000, 100_003):
            for dtype in ("float32", "float64", "int32", "int64"):
                x = _data(rank, n, dtype, seed=n)
                out[("allreduce", n, dtype)] = g.allreduce(x, op="sum")
            x = _data(rank, n, "float64", seed=7)
            for op in ("prod", "min", "max", "mean"):
                out[("allreduce", n, op)] = g.allreduce(x, op=op)
            y = x.copy()
            g.allreduce(y, y, op="max")  # in place
            out[("inplace", n)] = y
            out[("reduce", n)] = g.reduce(x, root=size - 1)
            b = x.copy() if rank == 1 % size else np.zeros_like(x)
            out[("bcast", n)] = g.broadcast(b, root=1 % size)
            out[("allgather", n)] = g.allgather(x)
            rs = _data(rank, size * n, "float32", seed=11).reshape(size, n)
            out[("reduce_scatter", n)] = g.reduce_scatter(rs)
        g.barrier()
    finally:
        g.close()
    return out


@pytest.mark.parametrize("size", [2, 3])
def test_every_collective_matches_numpy(size):
    name = unique_segment_name("test")
    res = run_ranks(_all_ops, size, name)
    for n in (1, 1000, 100_003):
        for dtype in ("float32", "float64", "int32", "int64"):
            stack = np.stack([_data(r, n, dtype, seed=n) for r in range(size)])
            expected = np.add.reduce(stack, axis=0, dtype=stack.dtype)
            for r in range(size):
                # same summation order as NumPy: bit-identical
                np.testing.assert_array_equal(res[r][("allreduce", n, dtype)], expected)
        xs = np.stack([_data(r, n, "float64", seed=7) for r in range(size)])
        for op, fn in (("prod", np.prod), ("min", np.min), ("max", np.max), ("mean", np.mean)):
            for r in range(size):
                np.testing.assert_allclose(res[r][("allreduce", n, op)], fn(xs, axis=0), rtol=1e-12)
        for r in range(size):
            np.testing.assert_array_equal(res[r][("inplace", n)], xs.max(axis=0))
            np.testing.assert_array_equal(res[r][("bcast", n)], xs[1 % size])
            np.testing.assert_array_equal(res[r][("allgather", n)], xs)
            rs = np.stack([_data(q, size * n, "float32", seed=11).reshape(size, n) for q in range(size)])
            np.testing.assert_array_equal(res[r][("reduce_scatter", n)], rs.sum(axis=0)[r])
            if r == size - 1:
                np.testing.assert_array_equal(res[r][("reduce", n)], xs.sum(axis=0))
            else:
                assert res[r][("reduce", n)] is None
    assert not os.path.exists(f"/dev/shm/{name}"), "segment left behind"


def _die_mid_collective(rank, size, name):
    g = ShmCollective(name, rank, size, timeout=30)
    g.allreduce(np.ones(10))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        g.allreduce(np.ones(10))
    except ActorDiedError as exc:
        took = time.monotonic() - t0
        try:
            g.allreduce(np.ones(10))
        except SupervisionError as again:
            later = str(again)
        g.close()
        return ("died", exc.ranks, took, later)
    return ("no error",)


def test_dead_peer_fails_survivors_quickly():
    res = run_ranks(_die_mid_collective, 3, unique_segment_name("test"), expect_exit={1})
    for r in (0, 2):
        kind, ranks, took, later = res[r]
        # (the other survivor may have reported and exited by the time this one looks:
        # then it is named too, rightly; seen under load) -- never the survivor itself
        assert kind == "died" and 1 in ranks and set(ranks) <= {0, 1, 2} - {r}
        assert took < 2.0
        assert "broken" in later


def _timeout_rank(rank, size, name):
    g = ShmCollective(name, rank, size, timeout=0.5)
    try:
        if rank == 0:
            try:
                g.allreduce(np.ones(3))
            except TimeoutError as exc:
                return str(exc)
        else:
            time.sleep(1.5)  # alive, but never calls the collective
        return None
    finally:
        g.close()


def test_live_but_absent_peer_times_out():
    res = run_ranks(_timeout_rank, 2, unique_segment_name("test"))
    assert "timed out after 0.5 s waiting for rank 1" in res[0]


def test_single_member_group_and_errors():
    with new_group("shm", name=unique_segment_name("test"), rank=0, size=1) as g:
        x = np.arange(6, dtype="int32").reshape(2, 3)
        np.testing.assert_array_equal(g.allreduce(x), x)
        np.testing.assert_array_equal(g.allgather(x), x[None])
        with pytest.raises(ValueError, match="unknown reduction op 'avg'"):
            g.allreduce(x, op="avg")
        with pytest.raises(TypeError, match="op 'mean' needs a floating dtype, got int32"):
            g.allreduce(x, op="mean")
        with pytest.raises(TypeError, match="got complex64"):
            g.allreduce(np.ones(2, "complex64"))
        with pytest.raises(ValueError, match="must be C-contiguous"):
            g.allreduce(np.ones((4, 4))[:, 0])
        with pytest.raises(ValueError, match="out has dtype float64 and 2 elements"):
            g.allreduce(np.ones(3), out=np.ones(2))
        with pytest.raises(ValueError, match="root must be a rank in \\[0, 1\\), got 3"):
            g.broadcast(np.ones(3), root=3)
    with pytest.raises(Exception, match="is closed"):
        g.allreduce(x)
    with pytest.raises(ValueError, match="rank must be in \\[0, 2\\), got 2"):
        ShmCollective("x", 2, 2)
    with pytest.raises(TypeError, match="size must be an int"):
        ShmCollective("x", 0, 2.0)
    with pytest.raises(ValueError, match="without '/'"):
        ShmCollective("a/b", 0, 1)
    with pytest.raises(ValueError, match="unknown collective backend 'ucx'"):
        new_group("ucx")


def test_name_clash_is_reported():
    name = unique_segment_name("test")
    # rank 0 creates the segment exclusively: a leftover or a second group with the name clashes
    path = f"/dev/shm/{name}"
    fd = os.open(path, os.O_CREAT | os.O_RDWR)
    os.close(fd)
    try:
        with pytest.raises(FileExistsError, match="already exists"):
            ShmCollective(name, 0, 2, timeout=0.3)
    finally:
        os.unlink(path)


def _checked(rank, size, name):
    # capacity 64 KiB: the 100_003-element case takes several rounds
    g = ShmCollective(name, rank, size, capacity=64 << 10, timeout=30)
    out = []
    try:
        for n in (1, 100_003):
            x = np.full(n, float(rank + 1))
            res = np.zeros(n)
            out.append((g.allreduce_checked(x, res), res[:3].tolist()))
            # rank 1's input is missing: nobody reduces, everybody learns who, nobody waits
            bad = g.allreduce_checked(np.zeros(1) if rank == 1 else x, np.zeros(n), failed=rank == 1)
            out.append(bad)
            # the group stays in step for the next collective
            out.append(g.allreduce(np.ones(2)).tolist())
    finally:
        g.close()
    return out


@pytest.mark.parametrize("size", [2, 3])
def test_allreduce_checked_agrees_on_failed_inputs(size):
    res = run_ranks(_checked, size, unique_segment_name("test"))
    total = float(sum(range(1, size + 1)))
    for r in range(size):
        assert res[r] == [([], [total] * 1), [1], [float(size)] * 2,
                          ([], [total] * 3), [1], [float(size)] * 2]


def test_member_that_finds_the_segment_before_it_is_sized_waits_for_it(monkeypatch):
    # rank 0 creates the segment empty and sizes it right after: a member that looks
    # in between must wait, not report that the members disagree on its size
    import threading

    name = unique_segment_name("sizing")
    real_fstat = os.fstat
    seen = []

    def fstat(fd):
        st = real_fstat(fd)
        if os.readlink(f"/proc/self/fd/{fd}").endswith(name) and not seen:
            seen.append(st.st_size)
            return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, st.st_uid, st.st_gid,
                                   0, int(st.st_atime), int(st.st_mtime), int(st.st_ctime)))
        return st

    groups = {}
    creator = threading.Thread(target=lambda: groups.setdefault(0, ShmCollective(name, 0, 2, timeout=10)))
    creator.start()
    while not os.path.exists(f"/dev/shm/{name}"):
        time.sleep(0.001)
    monkeypatch.setattr(os, "fstat", fstat)
    g1 = ShmCollective(name, 1, 2, timeout=10)
    monkeypatch.undo()
    creator.join(10)
    assert seen  # the member did see an unsized segment once
    try:
        out = np.empty(3)
        t = threading.Thread(target=groups[0].allreduce, args=(np.ones(3),))
        t.start()
        g1.allreduce(np.full(3, 2.0), out)
        t.join(10)
        assert out.tolist() == [3.0, 3.0, 3.0]
    finally:
        g1.close()
        groups[0].close()


def test_late_member_of_group_abandoned_for_a_dead_peer_fails_fast():
    # rank 0 creates the segment, finds rank 2 dead during the join and unlinks the
    # name; rank 1, arriving only now (a loaded machine), must not wait the whole
    # timeout for a segment that will never appear again: its worker's reader thread
    # would miss the join of the next collective sent to it
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    me = os.getpid()
    name = unique_segment_name("test")
    with pytest.raises(ActorDiedError):
        ShmCollective(name, 0, 3, capacity=4096, timeout=20, peer_pids=(me, me, dead.pid))
    assert not os.path.exists(f"/dev/shm/{name}")
    t0 = time.monotonic()
    with pytest.raises(ActorDiedError) as info:
        ShmCollective(name, 1, 3, capacity=4096, timeout=20, peer_pids=(me, me, dead.pid))
    assert time.monotonic() - t0 < 2.0
    assert info.value.ranks == (2,)



_MPI_CHECK = """
import numpy as np
from mpi4py import MPI
from mesharray.collectives.mpi import MpiCollective
g = MpiCollective(MPI.COMM_SELF)
try:
    g.allreduce("abc")
except TypeError as e:
    assert "must be a NumPy array or a buffer, got str" in str(e), e
else:
    raise SystemExit("no TypeError")
ro = np.ones(3)
ro.flags.writeable = False
try:
    g.allreduce(np.ones(3), out=ro)
except ValueError as e:
    assert "out is read-only" in str(e), e
else:
    raise SystemExit("no ValueError")
"""


@pytest.mark.timeout(60)
def test_backends_refuse_the_same_mistakes_the_same_way():
    # one set of argument checks (collectives/_args.py): a non-buffer is a TypeError,
    # a read-only destination a ValueError, whichever backend runs the collective
    g = ShmCollective(unique_segment_name("test"), 0, 1, capacity=4096)
    try:
        with pytest.raises(TypeError, match="must be a NumPy array or a buffer, got str"):
            g.allreduce("abc")
        ro = np.ones(3)
        ro.flags.writeable = False
        with pytest.raises(ValueError, match="out is read-only"):
            g.allreduce(np.ones(3), out=ro)
    finally:
        g.close()
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (pip install mesharray[mpi])")
    # MPI is initialised in a child: initialising it in the test process would break
    # every later test that starts processes
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _MPI_CHECK], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_crowded_join_names_a_dead_member_waiting_behind_a_late_one():
    # six members on this machine's cores (crowded where they outnumber them): a waiting member
    # signals only the first member not in yet every 0.1 s, here rank 1, alive and 3 s late; rank
    # 4, dead, must still be named by the check of every member (each second at six members), not
    # when rank 1 arrives, and the late member must not wait for a segment that is gone
    import subprocess
    import sys
    import threading

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    me = os.getpid()
    pids = (me, me, me, me, dead.pid, me)
    name = unique_segment_name("test")
    got: dict = {}

    def member(rank: int) -> None:
        t0 = time.monotonic()
        if rank == 1:
            time.sleep(3.0)
        try:
            ShmCollective(name, rank, 6, capacity=4096, timeout=20, peer_pids=pids).close()
            got[rank] = ("joined", time.monotonic() - t0)
        except ActorDiedError as exc:
            got[rank] = (exc.ranks, time.monotonic() - t0)

    threads = [threading.Thread(target=member, args=(r,)) for r in (0, 1, 2, 3, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert set(got) == {0, 1, 2, 3, 5}
    for r in (0, 2, 3, 5):
        ranks, took = got[r]
        assert ranks == (4,), got
        assert took < 2.5, got  # (rank 1 comes in at 3 s)
    assert got[1][0] == (4,), got
    assert not os.path.exists(f"/dev/shm/{name}")
