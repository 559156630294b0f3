"""F20: restart policy - ``spawn(..., max_restarts=k)`` re-runs ``__init__`` on a new process after a death."""

from __future__ import annotations

import os
import signal
import time

import pytest

import mesharray as ma

pytestmark = pytest.mark.timeout(90)


class Counter(ma.Actor):
    def __init__(self, start: int) -> None:
        self.value = start
        self.inits = 1

    @ma.endpoint
    def incr(self) -> int:
        self.value += 1
        return self.value

    @ma.endpoint
    def pid(self) -> int:
        return os.getpid()

    @ma.endpoint
    def stall(self, seconds: float) -> None:
        time.sleep(seconds)


def _call_when_back(ep, timeout: float = 30.0):
    # calls made while the rank is being restarted fail with ActorDiedError
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ep.call_one().get(timeout=10)
        except ma.ActorDiedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_F20_restart_reruns_init_until_the_budget_is_spent():
    with ma.proc_mesh(procs=2, forward_logs=False) as procs:
        c = procs.spawn("c", Counter, 10, max_restarts=1)
        one = c.slice(procs=1)
        assert one.incr.call_one().get(timeout=10) == 11
        pid = one.pid.call_one().get(timeout=10)
        os.kill(pid, signal.SIGKILL)
        # a new process, and __init__ ran again there: the state starts over
        assert _call_when_back(one.pid) != pid
        assert one.incr.call_one().get(timeout=10) == 11
        assert procs.stats()["restarts"] == 1
        # the other rank was never touched
        assert c.slice(procs=0).incr.call_one().get(timeout=10) == 11
        # the budget is spent: the second death is final
        os.kill(one.pid.call_one().get(timeout=10), signal.SIGKILL)
        time.sleep(0.5)
        with pytest.raises(ma.ActorDiedError):
            one.incr.call_one().get(timeout=10)
        time.sleep(0.5)
        with pytest.raises(ma.ActorDiedError):
            one.incr.call_one().get(timeout=10)
        assert procs.stats()["restarts"] == 1
        assert c.slice(procs=0).incr.call_one().get(timeout=10) == 12


def test_F20_no_restart_when_another_mesh_on_the_rank_did_not_ask_for_it():
    with ma.proc_mesh(procs=2, forward_logs=False) as procs:
        c = procs.spawn("c", Counter, 0, max_restarts=3)
        procs.spawn("d", Counter, 0)  # no restarts: its actors would silently vanish
        pid = c.slice(procs=1).pid.call_one().get(timeout=10)
        os.kill(pid, signal.SIGKILL)
        time.sleep(1.0)
        with pytest.raises(ma.ActorDiedError):
            c.slice(procs=1).incr.call_one().get(timeout=10)
        assert procs.stats()["restarts"] == 0


def test_F20_bad_budget_is_refused():
    with ma.proc_mesh(procs=1) as procs:
        with pytest.raises(ValueError, match="max_restarts"):
            procs.spawn("c", Counter, 0, max_restarts=-1)


class DiesOnRestart(ma.Actor):
    """Its constructor kills its process when run again (a restart that cannot succeed)."""

    def __init__(self, marker: str) -> None:
        if ma.current_rank().get("procs") == 1:
            if os.path.exists(marker):
                os._exit(9)
            open(marker, "w").close()

    @ma.endpoint
    def pid(self) -> int:
        return os.getpid()


def test_F20_a_constructor_that_dies_on_rerun_spends_the_budget(tmp_path):
    with ma.proc_mesh(procs=2, forward_logs=False) as procs:
        d = procs.spawn("d", DiesOnRestart, str(tmp_path / "ran"), max_restarts=2)
        os.kill(d.slice(procs=1).pid.call_one().get(timeout=10), signal.SIGKILL)
        time.sleep(3.0)
        s = procs.stats()
        assert s["restarts"] == 0 and s["deaths"] <= 3, s  # the first death + at most 2 failed restarts
        with pytest.raises(ma.ActorDiedError) as info:
            d.slice(procs=1).pid.call_one().get(timeout=10)
        assert info.value.ranks == (1,)


def test_F20_a_restarted_rank_dying_again_is_named_like_any_rank():
    with ma.proc_mesh(procs=2, forward_logs=False) as procs:
        c = procs.spawn("c", Counter, 0, max_restarts=2)
        one = c.slice(procs=1)
        os.kill(one.pid.call_one().get(timeout=10), signal.SIGKILL)
        pid2 = _call_when_back(one.pid)
        # in flight at the second death (an endpoint that cannot answer first: a quick one's
        # reply can beat the SIGKILL, now that a lone reply is written at once)
        pending = one.stall.call_one(60.0)
        os.kill(pid2, signal.SIGKILL)
        with pytest.raises(ma.ActorDiedError) as info:
            pending.get(timeout=10)
        assert info.value.ranks == (1,) and info.value.pid == pid2


def test_F20_no_restart_once_the_mesh_has_distributed_arrays():
    # the blocks of a rank and its shared-memory groups cannot come back with it
    with ma.proc_mesh(procs=2, forward_logs=False) as procs:
        c = procs.spawn("c", Counter, 0, max_restarts=2)
        procs.ones(2).sum(axis="procs").fetch()
        os.kill(c.slice(procs=1).pid.call_one().get(timeout=10), signal.SIGKILL)
        time.sleep(1.0)
        with pytest.raises(ma.ActorDiedError):
            c.slice(procs=1).incr.call_one().get(timeout=10)
        assert procs.stats()["restarts"] == 0
