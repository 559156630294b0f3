"""The single-copy (cross-memory attach) allreduce of the shared-memory backend, with real processes.

``single_copy_min=0`` sends every allreduce through it, whatever its size, so
that odd and tiny sizes are covered; under ``MESHARRAY_PORTABLE=1`` the group
must agree on the slot path instead and give the same results.
"""

import os
import signal
import threading
import time

import numpy as np
import pytest

from mesharray import _platform
from mesharray.collectives import ShmCollective, unique_segment_name
from mesharray.collectives.shm import SINGLE_COPY_MIN, SINGLE_COPY_MIN_SHARED_CORES
from mesharray.errors import ActorDiedError, SupervisionError
from tests.collectives._procs import run_ranks

pytestmark = pytest.mark.timeout(120)

DTYPES = ("float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
# 1 and 7: fewer elements than (or not divisible by) the members; 100_003: several chunks of
# reduce_remote per member for 8-byte types, and a share that is no multiple of a chunk
SIZES = (1, 7, 100_003)
NP_OPS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


def _data(rank, n, dtype, seed):
    rng = np.random.default_rng(1000 * seed + rank)
    dt = np.dtype(dtype)
    if dt.kind == "f":
        return rng.standard_normal(n).astype(dt)
    lo, hi = (0, 4) if dt.kind == "u" else (-3, 4)  # small: products of 4 members stay exact-ish
    return rng.integers(lo, hi, n).astype(dt)


def _expected(op, dtype, n, size, seed):
    stack = np.stack([_data(r, n, dtype, seed) for r in range(size)])
    if op == "mean":
        return np.add.reduce(stack, axis=0, dtype=stack.dtype) / size
    # the reduction order of NumPy's axis-0 reduce: floats are bit-identical
    return NP_OPS[op].reduce(stack, axis=0, dtype=stack.dtype)


def _every_op(rank, size, name, min_bytes):
    g = ShmCollective(name, rank, size, capacity=64 << 10, timeout=30, single_copy_min=min_bytes)
    out = {"agreed": g.single_copy_min}
    try:
        for seed, n in enumerate(SIZES):
            for dtype in DTYPES:
                for op in ("sum", "prod", "min", "max") + (("mean",) if dtype.startswith("float") else ()):
                    out[(n, dtype, op)] = g.allreduce(_data(rank, n, dtype, seed), op=op)
            # in place, from every member's own buffer
            y = _data(rank, n, "float64", seed)
            g.allreduce(y, y)
            out[(n, "inplace")] = y
            # a collective of another kind in between keeps the group in step
            out[(n, "allgather")] = g.allgather(np.full(3, rank))
            out[(n, "checked")] = g.allreduce_checked(_data(rank, n, "float32", seed), op="sum")
    finally:
        g.close()
    return out


@pytest.mark.parametrize("size", [2, 3, 4])
def test_single_copy_allreduce_matches_numpy(size):
    res = run_ranks(_every_op, size, unique_segment_name("test"), 0, timeout=110)
    # the portable paths have no cross-memory attach: the group agrees on the slots
    assert {r["agreed"] for r in res} == ({None} if _platform.PORTABLE else {0})
    for seed, n in enumerate(SIZES):
        for dtype in DTYPES:
            for op in ("sum", "prod", "min", "max") + (("mean",) if dtype.startswith("float") else ()):
                want = _expected(op, dtype, n, size, seed)
                for r in range(size):
                    got = res[r][(n, dtype, op)]
                    if op == "mean":
                        np.testing.assert_allclose(got, want, rtol=1e-6 if dtype == "float32" else 1e-12)
                    else:
                        np.testing.assert_array_equal(got, want, err_msg=f"{op} {dtype} n={n} rank {r}")
        for r in range(size):
            np.testing.assert_array_equal(res[r][(n, "inplace")], _expected("sum", "float64", n, size, seed))
            np.testing.assert_array_equal(res[r][(n, "allgather")], np.repeat(np.arange(size), 3).reshape(size, 3))
            assert res[r][(n, "checked")] == []


def _auto(size):
    return SINGLE_COPY_MIN if size <= len(os.sched_getaffinity(0)) else SINGLE_COPY_MIN_SHARED_CORES


def _many_rounds(rank, size, name):
    # default threshold: large messages take the single-copy path, small ones the slots,
    # one after the other on the same group, with different buffers every time
    g = ShmCollective(name, rank, size, capacity=64 << 10, timeout=30)
    sums = []
    try:
        for i in range(12):
            n = (_auto(size) // 4 + 12_345) if i % 3 else 1000  # float32: above and below it
            x = np.full(n, float(rank + i), dtype="float32")
            out = g.allreduce(x)
            sums.append((n, float(out[0]), float(out[-1])))
        return g.single_copy_min, sums
    finally:
        g.close()


@pytest.mark.parametrize("size", [2, 3])
def test_many_operations_alternating_paths(size):
    res = run_ranks(_many_rounds, size, unique_segment_name("test"))
    for agreed, sums in res:
        assert agreed == (None if _platform.PORTABLE else _auto(size))
        for i, (n, first, last) in enumerate(sums):
            want = float(sum(r + i for r in range(size)))
            assert first == last == want, (i, n)


def _checked_failure(rank, size, name):
    g = ShmCollective(name, rank, size, capacity=64 << 10, timeout=30, single_copy_min=0)
    n = 300_001
    try:
        res = []
        for failing in (1, None):
            out = np.zeros(n)
            if rank == failing:
                # a failed member passes a stand-in of one element: it takes the slot path
                # while its peers take the single-copy one; the arrival is common to both
                res.append(g.allreduce_checked(np.zeros(1), failed=True))
            else:
                res.append(g.allreduce_checked(np.full(n, rank + 1.0), out))
                res.append(float(out[n // 2]))
        return res
    finally:
        g.close()


def test_checked_allreduce_with_a_failed_member():
    res = run_ranks(_checked_failure, 3, unique_segment_name("test"))
    assert res[1] == [[1], [], 6.0]
    for r in (0, 2):
        assert res[r] == [[1], 0.0, [], 6.0]


def _offers(rank, size, name):
    # one member that offers no single copy turns it off for the whole group
    g = ShmCollective(name, rank, size, timeout=30, single_copy_min=None if rank == 1 else 1024)
    try:
        return g.single_copy_min, g.allreduce(np.full(100_000, rank + 1.0))[::9999].tolist()
    finally:
        g.close()


def test_members_agree_on_the_path():
    res = run_ranks(_offers, 3, unique_segment_name("test"))
    assert [agreed for agreed, _ in res] == [None] * 3
    assert all(vals == [6.0] * 11 for _, vals in res)


def _largest_offer_wins(rank, size, name):
    g = ShmCollective(name, rank, size, timeout=30, single_copy_min=1024 * (rank + 1))
    try:
        return g.single_copy_min
    finally:
        g.close()


def test_largest_threshold_wins():
    res = run_ranks(_largest_offer_wins, 2, unique_segment_name("test"))
    assert res == ([None, None] if _platform.PORTABLE else [2048, 2048])


def _die_during_single_copy(rank, size, name):
    g = ShmCollective(name, rank, size, timeout=30, single_copy_min=0)
    x = np.ones(4 << 20, dtype="float32")  # 16 MiB: each operation takes milliseconds
    g.allreduce(x)
    if rank == 1:
        # die from another thread while this one is inside an operation
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGKILL)).start()
        while True:
            g.allreduce(x)
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < 20:
            g.allreduce(x)
    except ActorDiedError as exc:
        took = time.monotonic() - t0
        try:
            g.allreduce(x)
        except SupervisionError as again:
            later = str(again)
        g.close()
        return ("died", exc.ranks, took, later)
    return ("no error",)


@pytest.mark.parametrize("size", [2, 3])
def test_peer_killed_mid_operation_fails_survivors_quickly(size):
    res = run_ranks(_die_during_single_copy, size, unique_segment_name("test"), expect_exit={1})
    for r in range(size):
        if r == 1:
            continue
        kind, ranks, took, later = res[r]
        assert kind == "died" and ranks == (1,)
        assert took < 2.0
        assert "broken" in later


def _leave_then_die(rank, size, name):
    from mesharray._proc_stat import alive as _pid_alive
    g = ShmCollective(name, rank, size, timeout=30)
    g.allreduce(np.ones(8))
    if rank == 0:  # closes the group and exits: it left, it did not die
        g.close()
        return ("left",)
    others = [g._pid(j) for j in range(size) if j != rank]
    deadline = time.monotonic() + 20
    if rank == 1 and size == 3:
        while _pid_alive(others[0]) and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    while any(_pid_alive(p) for p in others) and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        g.allreduce(np.ones(8))
    except SupervisionError as exc:
        return (type(exc).__name__, getattr(exc, "ranks", None), str(exc))
    finally:
        g.close()
    return ("no error",)


@pytest.mark.parametrize("size", [2, 3])
def test_a_member_that_closed_and_exited_is_not_named_dead(size):
    # with 3 members, rank 1 is killed after rank 0 left: only rank 1 died; with 2, nobody died
    res = run_ranks(_leave_then_die, size, unique_segment_name("test"), expect_exit={1} if size == 3 else None)
    assert res[0] == ("left",)
    kind, ranks, msg = res[size - 1]
    if size == 3:
        assert (kind, ranks) == ("ActorDiedError", (1,)), msg
    else:
        assert kind == "SupervisionError" and "rank(s) [0] closed shared-memory group" in msg, msg


def test_single_member_and_argument_checks():
    with ShmCollective(unique_segment_name("test"), 0, 1, single_copy_min=0) as g:
        assert g.single_copy_min is None  # nobody to copy from
        np.testing.assert_array_equal(g.allreduce(np.arange(5.0)), np.arange(5.0))
    with pytest.raises(TypeError, match="single_copy_min must be an int, 'auto' or None, got 1.5"):
        ShmCollective(unique_segment_name("test"), 0, 1, single_copy_min=1.5)
    with pytest.raises(ValueError, match="single_copy_min must be >= 0 bytes, 'auto' or None, got -1"):
        ShmCollective(unique_segment_name("test"), 0, 1, single_copy_min=-1)


def _mismatched_sizes(rank, size, name):
    # rank 1 passes half the bytes of rank 0: a peer writing the reduced chunks into rank
    # 1's buffer by rank 0's size would go past its end; both must refuse instead
    g = ShmCollective(name, rank, size, timeout=30, single_copy_min=0)
    try:
        n = 1 << 18 if rank == 0 else 1 << 17
        send = np.ones(n)
        guard = np.full(1 << 17, 7.0)  # memory around the smaller buffer must stay as it was
        out = np.full(n, -1.0)
        try:
            g.allreduce(send, out)
            said = None
        except ValueError as exc:
            said = str(exc)
        untouched = bool((out == -1.0).all()) and bool((guard == 7.0).all())
        after = g.allreduce(np.ones(4)).tolist()  # the group is still in step
        return said, untouched, after
    finally:
        g.close()


@pytest.mark.skipif(not _platform.LINUX_NATIVE, reason="cross-memory attach is Linux only")
def test_members_passing_different_sizes_are_refused_without_writing_each_other():
    res = run_ranks(_mismatched_sizes, 2, unique_segment_name("test"))
    for r in range(2):
        said, untouched, after = res[r]
        assert said is not None and "passed different sizes to one allreduce" in said
        assert "rank 0: 2097152 bytes" in said and "rank 1: 1048576 bytes" in said
        assert untouched and after == [2.0] * 4
