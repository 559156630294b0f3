"""A member that needs a small allreduce's result later leaves its host round at once (``small_allreduce_lazy``).

Host rounds are what groups of more members than CPUs use; each child below sees one
CPU (its affinity), so a group of 3 or 4 takes them on any machine.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from mesharray.collectives import ShmCollective, unique_segment_name
from mesharray.errors import ActorDiedError
from tests.collectives._procs import run_ranks

pytestmark = [pytest.mark.timeout(90),
              pytest.mark.skipif(not hasattr(os, "sched_setaffinity"),
                                 reason="needs os.sched_setaffinity (Linux) to give each member one CPU")]


def _one_cpu() -> None:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def _lazy_rounds(rank, size, name):
    # rank 0 needs every result at once (it sends it back, as a mesh's fetched rank does); the
    # others need it later: they leave each round, and learn its outcome when it is finished
    _one_cpu()
    g = ShmCollective(name, rank, size, timeout=30)
    assert g.sleepy
    outcomes: dict = {}
    left = []
    try:
        for i in range(12):
            x = np.full(3, rank + i, dtype=np.float64)
            out = np.empty(3)
            if rank == 0:
                time.sleep(0.3 if i < 2 else 0)  # (the others arrive first: they cannot have the result yet)
                outcomes[i] = (g.small_allreduce_prechecked(x, out, "sum", "float64"), out.tolist())
            else:
                got = g.small_allreduce_lazy(x, out, "mean" if i == 5 else "sum", "float64",
                                             lambda o, i=i, out=out: outcomes.__setitem__(i, (o, out.tolist())))
                if got is None:
                    left.append(i)
                    if i == 3:
                        g.settle()  # (what a worker does before an op that reads the block)
                        assert 3 in outcomes
                else:
                    outcomes[i] = (got, out.tolist())
        # a round whose input failed on rank 2: nothing reduced, everyone learns who
        if rank == 2:
            outcomes["failed"] = (g.allreduce_checked(np.zeros(1), None, failed=True), None)
        elif rank == 0:
            outcomes["failed"] = (g.small_allreduce_prechecked(np.ones(2), np.empty(2), "sum", "float64"), None)
        else:
            got = g.small_allreduce_lazy(np.ones(2), np.empty(2), "sum", "float64",
                                         lambda o: outcomes.__setitem__("failed", (o, None)))
            if got is not None:
                outcomes["failed"] = (got, None)
        # a large allreduce (slot rounds) after a pending host round: it finishes that round first
        big = g.allreduce(np.full(1 << 16, float(rank)))
        outcomes["big"] = float(big[0])
    finally:
        g.close()
    return outcomes, left


def test_members_leave_their_rounds_and_get_every_outcome_before_the_next():
    size = 4
    res = run_ranks(_lazy_rounds, size, unique_segment_name("test"), timeout=60)
    total = sum(range(size))
    for rank, (outcomes, left) in enumerate(res):
        for i in range(12):
            want = (total + size * i) / (size if i == 5 and rank else 1)
            assert outcomes[i] == ([], [want] * 3), (rank, i, outcomes[i])
        assert outcomes["failed"][0] == [2], (rank, outcomes["failed"])
        assert outcomes["big"] == total
        if rank:
            assert 0 in left or 1 in left, left  # (rank 0 came last: these members did not wait)


def _a_member_dies(rank, size, name):
    _one_cpu()
    g = ShmCollective(name, rank, size, timeout=30, peer_pids=None)
    assert g.sleepy
    if rank == 2:
        time.sleep(0.2)
        os._exit(0)  # dies without arriving
    seen: list = []
    out = np.empty(1)
    t0 = time.monotonic()
    if rank == 0:
        try:
            g.small_allreduce_prechecked(np.ones(1), out, "sum", "float64")
        except ActorDiedError as exc:
            seen.append(exc)
    else:
        got = g.small_allreduce_lazy(np.ones(1), out, "sum", "float64", seen.append)
        assert got is None
        g.settle()
    took = time.monotonic() - t0
    g.close()
    assert len(seen) == 1 and isinstance(seen[0], ActorDiedError), seen
    return seen[0].ranks, took


def test_a_member_that_left_its_round_learns_of_a_peer_that_died_before_arriving():
    res = run_ranks(_a_member_dies, 3, unique_segment_name("test"), expect_exit={2}, timeout=60)
    for rank in (0, 1):
        ranks, took = res[rank]
        assert list(ranks) == [2] and took < 10.0, (rank, res[rank])


def _two_settlers(rank, size, name):
    import threading

    _one_cpu()
    g = ShmCollective(name, rank, size, timeout=30)
    assert g.sleepy
    order: list = []
    try:
        if rank == 0:
            time.sleep(0.5)  # (the other member left its round and two of its threads wait for it)
            g.small_allreduce_prechecked(np.ones(1), np.empty(1), "sum", "float64")
            return order
        out = np.empty(1)
        assert g.small_allreduce_lazy(np.ones(1), out, "sum", "float64", lambda o: order.append(("done", o))) is None
        a = threading.Thread(target=lambda: (g.settle(), order.append("a settled")))
        a.start()
        time.sleep(0.1)  # (a is waiting for the result, without the GIL)
        g.settle()  # a second thread: it returns once the round a settles is finished, not at once
        order.append("b settled")
        a.join(10)
        order.append(float(out[0]))
    finally:
        g.close()
    return order


def test_a_second_thread_that_settles_waits_for_the_round_another_is_settling():
    res = run_ranks(_two_settlers, 2, unique_segment_name("test"), timeout=60)
    order = res[1]
    assert order.index(("done", [])) < order.index("b settled"), order
    assert order[-1] == 2.0
