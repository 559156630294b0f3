"""The compiled small round of the shared-memory allreduce (``small_allreduce_checked``), with real processes.

Members on the compiled path and on the Python one (``allreduce_checked``) take part in
the same rounds: a worker may take either for a reduction plan, so both must agree.
"""

import os
import signal
import time

import numpy as np
import pytest

from mesharray._core import small_round
from mesharray.collectives import ShmCollective, unique_segment_name
from mesharray.errors import ActorDiedError
from tests.collectives._procs import run_ranks

pytestmark = pytest.mark.timeout(90)

DTYPES = ("float32", "float64", "int8", "int32", "int64", "uint16", "uint64")
OPS = ("sum", "prod", "min", "max")


def _data(rank, shape, dtype, seed):
    rng = np.random.default_rng(seed * 31 + rank)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    return rng.integers(1, 4, shape).astype(dtype)  # small: prod of a few ranks fits int8


def _mixed(rank, size, name):
    # even ranks on the compiled round, odd ranks on the Python one, in the same rounds
    g = ShmCollective(name, rank, size, timeout=30)
    compiled = rank % 2 == 0
    out = {}
    try:
        for shape in ((), (7,), (3, 5), (1000,)):
            for dtype in DTYPES:
                for op in OPS:
                    x = _data(rank, shape, dtype, seed=len(shape) + DTYPES.index(dtype))
                    res = np.empty(shape, dtype)
                    bad = g.small_allreduce_checked(x, res, op) if compiled else g.allreduce_checked(x, res, op)
                    out[(shape, dtype, op)] = (bad, res)
            x = _data(rank, shape, "float64", seed=99)
            res = np.empty(shape)
            g.small_allreduce_checked(x, res, "mean") if compiled else g.allreduce_checked(x, res, "mean")
            out[(shape, "mean")] = res
        # rank 1's input failed: nobody reduces, everybody learns who, the group stays in step
        x = np.ones(4)
        if rank == 1:
            out["failed"] = g.allreduce_checked(np.zeros(1), None, failed=True)
        else:
            out["failed"] = g.small_allreduce_checked(x, np.empty(4), "sum") if compiled else \
                g.allreduce_checked(x, np.empty(4))
        out["after"] = g.allreduce(np.ones(2)).tolist()
    finally:
        g.close()
    return out


@pytest.mark.parametrize("size", [2, 3, 4])
def test_compiled_and_python_rounds_agree_with_numpy(size):
    name = unique_segment_name("test")
    res = run_ranks(_mixed, size, name)
    funcs = {"sum": np.add.reduce, "prod": np.multiply.reduce, "min": np.minimum.reduce, "max": np.maximum.reduce}
    for shape in ((), (7,), (3, 5), (1000,)):
        for dtype in DTYPES:
            stack = np.stack([_data(r, shape, dtype, seed=len(shape) + DTYPES.index(dtype)) for r in range(size)])
            for op in OPS:
                expected = funcs[op](stack, axis=0, dtype=stack.dtype)
                for r in range(size):
                    bad, got = res[r][(shape, dtype, op)]
                    assert bad == []
                    # members added in rank order, as NumPy does: bit-identical
                    np.testing.assert_array_equal(got, expected, err_msg=f"{shape} {dtype} {op} rank {r}")
        xs = np.stack([_data(r, shape, "float64", seed=99) for r in range(size)])
        for r in range(size):
            np.testing.assert_allclose(res[r][(shape, "mean")], xs.mean(axis=0), rtol=1e-12)
    for r in range(size):
        assert res[r]["failed"] == [1]
        assert res[r]["after"] == [float(size)] * 2
    assert not os.path.exists(f"/dev/shm/{name}"), "segment left behind"


def _slow_peer(rank, size, name):
    # rank 1 arrives 30 ms late (past the 5 ms a compiled wait runs before it returns to
    # check that the member it waits for is alive): every other rank resumes its round
    g = ShmCollective(name, rank, size, timeout=30)
    got = []
    try:
        for i in range(4):
            if rank == 1:
                time.sleep(0.03)
            res = np.empty(3)
            bad = g.small_allreduce_checked(np.full(3, float(rank + i)), res, "sum")
            got.append((bad, res.tolist()))
            if rank == 0 and i == 1:
                time.sleep(0.03)  # and once the others wait for rank 0 to finish the round before
    finally:
        g.close()
    return got


def test_a_slow_member_is_waited_for_and_the_sums_are_right():
    res = run_ranks(_slow_peer, 3, unique_segment_name("test"))
    for r in range(3):
        assert res[r] == [([], [float(sum(q + i for q in range(3)))] * 3) for i in range(4)]


def _die_in_small_round(rank, size, name):
    g = ShmCollective(name, rank, size, timeout=30)
    g.small_allreduce_checked(np.ones(2), np.empty(2), "sum")
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        g.small_allreduce_checked(np.ones(2), np.empty(2), "sum")
    except ActorDiedError as exc:
        took = time.monotonic() - t0
        g.close()
        return ("died", exc.ranks, took)
    return ("no error",)


def test_a_member_killed_before_its_small_round_fails_the_others_quickly():
    res = run_ranks(_die_in_small_round, 3, unique_segment_name("test"), expect_exit={1})
    for r in (0, 2):
        kind, ranks, took = res[r]
        # (the other survivor may have reported and exited by the time this one looks)
        assert kind == "died" and 1 in ranks and set(ranks) <= {0, 1, 2} - {r}
        assert took < 2.0


def _failed_then_plain(rank, size, name, iters):
    # rank 1's input fails every other round and it goes straight on to the next round,
    # which rewrites its status word: rank 0 (on the compiled path, with another thread
    # holding the GIL as a worker's do) must still learn who failed in the round before
    import threading

    g = ShmCollective(name, rank, size, timeout=30)
    stop = []
    if rank == 0:
        def hog():
            while not stop:
                pass

        threading.Thread(target=hog, daemon=True).start()
    missed = 0
    try:
        for _ in range(iters):
            if rank == 0:
                if g.small_allreduce_checked(np.ones(4), np.full(4, -7.0), "sum") != [1]:
                    missed += 1
                out = np.empty(4)
                assert g.small_allreduce_checked(np.ones(4), out, "sum") == [] and out.tolist() == [2.0] * 4
            else:
                g.allreduce_checked(np.zeros(1), None, failed=True)
                g.allreduce_checked(np.ones(4), np.empty(4))
    finally:
        stop.append(True)
        g.close()
    return missed


def test_a_failed_member_is_reported_even_when_it_is_already_in_the_next_round():
    res = run_ranks(_failed_then_plain, 2, unique_segment_name("test"), 200)
    assert res[0] == 0


def test_one_member_group_and_argument_errors():
    with ShmCollective(unique_segment_name("test"), 0, 1, capacity=4096) as g:
        out = np.empty(3)
        assert g.small_allreduce_checked(np.arange(3.0), out, "max") == []
        assert out.tolist() == [0.0, 1.0, 2.0]
        assert g.small_bytes == 4096
        with pytest.raises(ValueError, match="unknown reduction op 'avg'"):
            g.small_allreduce_checked(np.arange(3.0), out, "avg")
        with pytest.raises(ValueError, match="takes at most 4096 bytes, got 8192"):
            g.small_allreduce_checked(np.ones(1024), np.empty(1024), "sum")
        with pytest.raises(ValueError, match=r"send's shape \(3,\) and dtype float64.*got out \(3,\) float32"):
            g.small_allreduce_checked(np.arange(3.0), np.empty(3, "float32"), "sum")
        with pytest.raises(ValueError, match="C-contiguous"):
            g.small_allreduce_checked(np.ones((2, 2)), np.empty((2, 2), order="F"), "sum")
        ro = np.empty(3)
        ro.flags.writeable = False
        with pytest.raises((ValueError, BufferError)):
            g.small_allreduce_checked(np.arange(3.0), ro, "sum")
        # nothing was taken by a refused call: the group goes on at once (a round taken and
        # never finished would make this wait for the group's timeout)
        t0 = time.monotonic()
        assert g.allreduce(np.ones(2)).tolist() == [1.0, 1.0]
        assert g.small_allreduce_checked(np.arange(3.0), out, "sum") == [] and out.tolist() == [0.0, 1.0, 2.0]
        assert time.monotonic() - t0 < 1.0
    bad = np.zeros(2, np.uint8)
    with pytest.raises(TypeError, match="reduction kernels support .*got 'complex128'"):
        small_round(0, 1, 0, 1, 0, 0, 0, [0], 0, "complex128", "sum", False, 0, 0.0, bad[:1])
    with pytest.raises(ValueError, match="rank 2, 1 slots and 2 status bytes do not fit a group of size 2"):
        small_round(0, 2, 2, 1, 0, 0, 0, [0], 0, "float64", "sum", False, 0, 0.0, bad)


def test_a_long_wait_naps_and_a_late_peer_is_still_seen_at_once():
    """A member waiting for a peer far behind (a generator waiting for a trainer's backward pass) gives
    up its core after a short spin; the peer's flag is still seen within a nap (at most 1 ms late)."""
    from mesharray._core import atomic_store, wait_flags

    flags = np.zeros(8, dtype=np.int64)
    t_cpu, t0 = time.thread_time(), time.perf_counter()
    assert wait_flags(flags.ctypes.data, 8, [0], 1, 0.5) == 0  # nobody came: the first index still short
    assert time.perf_counter() - t0 >= 0.5
    assert time.thread_time() - t_cpu < 0.2  # (a spinning wait costs the whole 0.5 s)
    import threading

    stored = []

    def arrive():
        atomic_store(flags.ctypes.data, 1)
        stored.append(time.perf_counter())

    late = threading.Timer(0.2, arrive)
    late.start()
    assert wait_flags(flags.ctypes.data, 8, [0], 1, 5.0) == -1
    seen = time.perf_counter()
    late.join()
    assert seen - stored[0] < 0.05, seen - stored[0]  # (a nap is at most 1 ms)
