"""A member's part of a small reduction, compiled (``_core.PlanRunner``, what ``DataActor.run`` tries first).

The program a 1-element sum sends every member but its root is ``[("free", ...), ("kplan", ...),
("check", ...)]``. Each member below is a real process with one CPU of a real shared-memory group
(so its small allreduces are host rounds on any machine) and this process's real block store; rank
0 plays the root (it needs each result at once, as a fetched rank does).
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from mesharray.collectives import ShmCollective, unique_segment_name
from tests.collectives._procs import run_ranks

pytestmark = [pytest.mark.timeout(90),
              pytest.mark.skipif(not hasattr(os, "sched_setaffinity"),
                                 reason="needs os.sched_setaffinity (Linux) to give each member one CPU")]


def _members(rank, size, name):
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    from mesharray._core import FastRun, PlanRunner
    from mesharray.darray import worker as W
    from mesharray.engines import get_engine

    g = ShmCollective(name, rank, size, timeout=30)
    assert g.sleepy
    store, eng = W.STORE, get_engine("numpy")
    plans = {1: b"sum-plan", 2: b"mean-plan"}
    cache: dict = {}
    last: list = [b"", None]
    slow: list = []
    runner = PlanRunner(store, plans, cache, last, lambda *a: slow.append(a), W._settled)
    out: dict = {}
    try:
        prog = [("kplan", 10, 1, 1, (0,), 8)]
        assert runner.run(prog) is False  # (its rank is not known yet)
        runner.me = rank
        assert runner.run(prog) is False  # (no state for the plan yet: the Python path makes it)
        for op, key in (("sum", b"sum-plan"), ("mean", b"mean-plan")):
            cache[key] = [None, (g, op, np.dtype(np.float64), eng, g.small_bytes, "float64", g.lazy_target())]
        assert runner.run([("kplan", 10, 1, 1, (rank,), 8)]) is False  # (a root sends it back: Python)
        assert runner.run([("check", (rank,))]) is False  # (a check of this rank: Python)
        assert runner.run([("free", [99]), ("apply", 5, None, [])]) is False  # (an op it does not run)
        store.put(1, np.float32(rank).reshape(()).copy(), eng)  # (not the plan's dtype: the Python path)
        if rank:
            assert runner.run([("kplan", 10, 1, 1, (0,), 8)]) is True
            assert slow == [(rank, 10, 1, b"sum-plan", True)], slow
        # DataActor.run as the call path finds it: PlanRunner, else the Python path with the program
        fast = FastRun(runner, lambda p: ("python", p))
        other = [("free", [99]), ("apply", 5, None, [])]
        assert fast(other) == ("python", other)
        assert fast((("kplan", 10, 1, 1, (0,), 8),)) == ("python", (("kplan", 10, 1, 1, (0,), 8),))  # (a tuple)
        assert fast([("kplans", 10, 1, 1, (0,), 8)])[0] == "python"  # (codes compared whole)
        prev = None
        for i in range(8):
            store.put(1, np.full((), float(rank + i)), eng)
            bid = 100 + i
            if rank == 0:
                time.sleep(0.2 if i == 0 else 0)  # (the members arrive first and leave)
                res = np.empty(())
                assert g.small_allreduce_prechecked(store.get(1), res, "sum", "float64") == []
                out[i] = float(res)
            else:
                prog = [("free", [prev] if prev else []), ("kplan", bid, 1, 1, (0,), 8), ("check", (0,))]
                if i % 2:
                    assert runner.run(prog) is True
                else:
                    assert fast(prog) is None
                if prev is not None:
                    assert prev not in store.blocks and prev not in store.lazy
            prev = bid
        if rank:
            store.settle()  # (what an op that reads the block does first)
            out["last"] = float(store.get(prev))
            out["lazy"] = dict(store.lazy)
        # a mean: its finish divides the result
        if rank == 0:
            res = np.empty(())
            g.small_allreduce_prechecked(np.full((), 1.0), res, "sum", "float64")
        else:
            store.put(2, np.full((), 1.0), eng)
            assert runner.run([("kplan", 200, 2, 2, (0,), 8)]) is True
            out["mean"] = float(store.get(200))
        # a round whose input failed on rank 2: the members that left learn it when it ends
        if rank == 2:
            g.allreduce_checked(np.zeros(1), None, failed=True)
        elif rank == 0:
            out["failed"] = g.small_allreduce_prechecked(np.ones(()), np.empty(()), "sum", "float64")
        else:
            store.put(3, np.ones(()), eng)
            assert runner.run([("kplan", 300, 3, 1, (0,), 8)]) is True
            store.settle()
            exc = store.failed.get(300)
            out["failed"] = (type(exc).__name__, getattr(exc, "ranks", None))
        big = g.allreduce(np.full(1 << 14, float(rank)))  # (slot rounds after the host rounds)
        out["big"] = float(big[0])
    finally:
        g.close()
    return out


def test_a_members_program_of_small_sums_runs_compiled_and_keeps_every_outcome():
    size = 4
    res = run_ranks(_members, size, unique_segment_name("test"), timeout=60)
    total = sum(range(size))
    assert [res[0][i] for i in range(8)] == [total + size * i for i in range(8)]
    for rank in (1, 3):
        assert res[rank]["last"] == total + size * 7
        assert res[rank]["lazy"] == {}
        assert res[rank]["mean"] == 1.0
        assert res[rank]["failed"] == ("InputFailed", [2]), res[rank]["failed"]
    assert res[0]["failed"] == [2]
    assert all(r["big"] == total for r in res)
