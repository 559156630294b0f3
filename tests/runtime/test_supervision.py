"""Death paths: every one fails pending and later calls fast, views without the dead rank live on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

import mesharray as ma
from tests.support.actors import AsyncActor, Owner, Probe

pytestmark = pytest.mark.timeout(60)


def _wait_died(fut, timeout=5.0):
    t0 = time.monotonic()
    with pytest.raises(ma.ActorDiedError) as ei:
        fut.get(timeout=timeout)
    return ei.value, time.monotonic() - t0


@pytest.mark.parametrize("how, code, sig", [("kill", None, signal.SIGKILL), ("exit", 3, None),
                                            ("segv", None, signal.SIGSEGV)])
def test_worker_death_fails_pending_and_later_calls(how, code, sig):
    owner = Owner()
    with ma.proc_mesh(hosts=1, procs=3, owner=owner, forward_logs=False) as procs:
        p = procs.spawn("p", Probe)
        a = procs.spawn("a", AsyncActor)
        victim = p.slice(procs=1)
        pid = victim.pid.call_one().get(timeout=10)
        pending = a.slice(procs=1).nap.call_one(30, "x")  # runs on the worker's loop thread
        victim.die.broadcast(how)
        err, dt = _wait_died(pending)
        assert dt < 1.0
        assert err.ranks == (1,) and err.pid == pid
        assert err.exitcode == code and err.signal == sig
        assert f"pid {pid}" in str(err)
        # later calls to the dead rank fail at once, calls to a view without it work
        err2, dt2 = _wait_died(victim.echo.call_one(1))
        assert dt2 < 0.5 and err2.ranks == (1,)
        with pytest.raises(ma.ActorDiedError):
            p.echo.call(1).get(timeout=5)
        assert p[0, ::2].echo.call(5).get(timeout=10).tolist() == [5, 5]
        deadline = time.monotonic() + 5
        while len(owner.failures) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert {f.mesh_name for f in owner.failures} == {"p", "a"}
        assert all(f.crashed_ranks == (1,) for f in owner.failures)
        assert procs.stats()["alive"] == 2
    # stop() still worked: context exit returned, nothing left behind (conftest checks)


def test_a_call_to_every_actor_right_after_a_kill_fails_at_once_and_says_how():
    # the call is read by the caller's own thread over all connections at once: the dead
    # one's end must fail its reply at once, although the live workers' heartbeats keep
    # coming in on the others (it waited forever without a timeout)
    with ma.proc_mesh(hosts=1, procs=4, forward_logs=False) as procs:
        p = procs.spawn("p", Probe)
        for _ in range(50):  # the connections stay parked between calls, as in a loop
            p.echo.call(1).get(timeout=10)
        for victim, view in ((1, p), (3, p[0, 2:])):  # (a view without the first dead rank)
            for _ in range(20):
                view.echo.call(1).get(timeout=10)
            os.kill(procs.pids[victim], signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(ma.ActorDiedError) as ei:
                view.echo.call(1).get()  # no timeout: a user's plain get()
            assert time.monotonic() - t0 < 2.0
            assert ei.value.ranks == (victim,) and ei.value.signal == signal.SIGKILL
            assert "connection lost" not in str(ei.value)  # the exit status says it all
        assert p[0, ::2].echo.call(7).get(timeout=10).tolist() == [7, 7]


def test_broadcast_reaches_the_live_actors_then_reports_the_dead_one():
    from tests.support.actors import Counter

    with ma.proc_mesh(hosts=1, procs=3, forward_logs=False) as procs:
        c = procs.spawn("c", Counter, 0)
        assert c.get.call().get(timeout=10).tolist() == [[0, 0, 0]]
        os.kill(procs.pids[1], signal.SIGKILL)
        with pytest.raises(ma.ActorDiedError) as ei:
            for _ in range(200):  # until the death is known (at once, or at the first write after it)
                c.incr.broadcast()
                time.sleep(0.005)
        assert 1 in ei.value.ranks
        n0, n2 = (c.slice(procs=i).get.call_one().get(timeout=10) for i in (0, 2))
        assert n0 == n2 >= 1  # every broadcast reached both survivors, the failing one included


class Stopper:
    """An owner whose ``__supervise__`` stops the mesh, as a user might."""

    def __init__(self) -> None:
        self.procs = None
        self.stopped_at = None

    def __supervise__(self, failure) -> None:
        self.procs.stop()
        self.stopped_at = time.monotonic()


def test_supervise_hook_may_stop_the_mesh():
    owner = Stopper()
    procs = ma.proc_mesh(hosts=1, procs=2, owner=owner, forward_logs=False)
    owner.procs = procs
    p = procs.spawn("p", Probe)
    t0 = time.monotonic()
    p.slice(procs=0).die.broadcast("kill")
    deadline = t0 + 10
    while owner.stopped_at is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert owner.stopped_at is not None and owner.stopped_at - t0 < 3.0
    assert procs.stopped
    procs.stop()


def test_hung_worker_is_killed_by_heartbeats_when_asked():
    # the opt-in policy: kill_unresponsive=True (by default an unresponsive worker
    # is only reported; see tests/faults/test_supervision_faults.py)
    with ma.proc_mesh(hosts=1, procs=2, heartbeat_timeout=1.0, heartbeat_interval=0.2,
                      forward_logs=False, kill_unresponsive=True) as procs:
        p = procs.spawn("p", Probe)
        pending = procs.spawn("a", AsyncActor).slice(procs=0).nap.call_one(30, "x")
        p.slice(procs=0).die.broadcast("stop")  # SIGSTOP: alive but silent
        err, dt = _wait_died(pending, timeout=10)
        assert "no heartbeat" in str(err) and "kill_unresponsive=True" in str(err) and dt < 3.0
        assert p.slice(procs=1).echo.call_one(2).get(timeout=10) == 2


def test_stop_fails_pending_calls_and_spawn_after_stop_raises():
    procs = ma.proc_mesh(hosts=1, procs=2, forward_logs=False)
    p = procs.spawn("p", Probe)
    pending = p.slice(procs=0).sleep.call_one(30)
    time.sleep(0.05)
    t0 = time.monotonic()
    procs.stop()
    assert time.monotonic() - t0 < 8
    with pytest.raises(ma.SupervisionError):
        pending.get(timeout=5)
    with pytest.raises(ma.SupervisionError):
        p.echo.call(1).get(timeout=5)
    procs.stop()  # twice: harmless
    with pytest.raises(RuntimeError, match="stopped"):
        procs.spawn("q", Probe)
    with pytest.raises(RuntimeError, match="stopped"):
        procs[0, 0].spawn("q", Probe)


_ORPHAN_SCRIPT = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {root!r})
    import mesharray as ma
    from tests.support.actors import Probe
    procs = ma.proc_mesh(hosts=1, procs=3, forward_logs=False)
    p = procs.spawn("p", Probe)
    print(" ".join(map(str, p.pid.call().get().tolist()[0])), flush=True)
    time.sleep(60)
""")


def test_workers_exit_when_the_controller_dies(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = tmp_path / "ctl.py"
    script.write_text(_ORPHAN_SCRIPT.format(root=root))
    before = {ch.pid for ch in psutil.Process().children(recursive=True)}
    ctl = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(x) for x in ctl.stdout.readline().split()]
        assert len(pids) == 3
        procs = [psutil.Process(pid) for pid in pids]
        ctl.kill()
        ctl.wait()
        gone, alive = psutil.wait_procs(procs, timeout=5)
        assert not alive, f"workers outlived their controller: {alive}"
    finally:
        if ctl.poll() is None:
            ctl.kill()
            ctl.wait()
        ctl.stdout.close()
        # only what this test started: killing the session's multiprocessing resource
        # tracker too made every later test that uses multiprocessing fail
        for ch in psutil.Process().children(recursive=True):
            if ch.pid not in before:
                ch.kill()


@pytest.mark.parametrize("interval, timeout", [(0.0, 5.0), (float("nan"), 5.0), (0.5, float("inf")), (-1.0, 5.0)])
def test_a_heartbeat_setting_that_is_not_a_positive_finite_time_is_refused_naming_it(interval, timeout):
    from mesharray.runtime.controller import Controller

    with pytest.raises(ValueError, match="must be > 0 and finite seconds, got"):
        Controller(heartbeat_interval=interval, heartbeat_timeout=timeout)
