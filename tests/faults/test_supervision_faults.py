"""Fault suite, supervision: item 2 (no false deaths), F4 (hang / SIGSTOP), item 11 messages."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

import mesharray as ma
from tests.support.actors import Faulty, GilHog

pytestmark = pytest.mark.timeout(90)
ROOT = Path(__file__).resolve().parents[2]


def test_item2_an_endpoint_holding_the_gil_longer_than_the_heartbeat_timeout_is_not_killed():
    with ma.proc_mesh(procs=2, heartbeat_timeout=1.0, heartbeat_interval=0.2, forward_logs=False) as procs:
        g = procs.spawn("g", GilHog).slice(procs=1)
        pid = g.pid.call_one().get(timeout=10)
        t0 = time.monotonic()
        assert g.hog.call_one(27).get(timeout=60) is True  # ~3 s without a heartbeat
        assert time.monotonic() - t0 > 1.0, "the endpoint did not hold the GIL long enough to test anything"
        assert g.pid.call_one().get(timeout=10) == pid  # the same process, alive
        # responsive again at its next heartbeat (its thread gets the GIL back after the reply: under
        # load, that beat may reach the controller after the call's reply)
        deadline = time.monotonic() + 2.0
        while procs.stats()["unresponsive_now"] and time.monotonic() < deadline:
            time.sleep(0.02)
        stats = procs.stats()
        assert stats["deaths"] == 0 and stats["unresponsive"] >= 1 and stats["unresponsive_now"] == 0


def test_F4_stopped_worker_is_reported_unresponsive_times_out_and_teardown_kills_it():
    procs = ma.proc_mesh(procs=2, heartbeat_timeout=1.0, heartbeat_interval=0.2, forward_logs=False)
    try:
        g = procs.spawn("g", GilHog)
        one = g.slice(procs=1)
        pid = one.pid.call_one().get(timeout=10)
        one.stop_self.broadcast()
        time.sleep(1.8)
        with pytest.raises(TimeoutError) as info:
            one.pid.call_one().get(timeout=1.5)
        msg = str(info.value)
        assert "get(timeout=1.5)" in msg and "may have run on rank 1" in msg
        assert "rank 1 is unresponsive" in msg and "heartbeat_timeout" in msg
        assert procs.stats()["unresponsive_now"] == 1 and procs.stats()["deaths"] == 0
        assert g.slice(procs=0).pid.call_one().get(timeout=10) != pid  # the other rank works
    finally:
        t0 = time.monotonic()
        procs.stop()
    assert time.monotonic() - t0 < 15
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_item2_a_paused_controller_does_not_blame_its_workers(tmp_path):
    # even with kill_unresponsive=True, the controller's own pause (SIGSTOP, 3 s >
    # heartbeat_timeout) is not a worker's fault
    script = tmp_path / "controller.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time
        import mesharray as ma
        from tests.support.actors import Faulty
        with ma.proc_mesh(procs=2, heartbeat_timeout=1.0, heartbeat_interval=0.2, forward_logs=False,
                          kill_unresponsive=True) as procs:
            a = procs.spawn("a", Faulty)
            pids = a.pid.call().get(timeout=10)
            print("ready", flush=True)
            sys.stdin.readline()           # the test pauses us for 3 s, then resumes us
            time.sleep(0.5)
            print("after", a.pid.call().get(timeout=10).tolist() == pids.tolist(), procs.stats()["deaths"],
                  flush=True)
    """))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout.readline().strip() == "ready"
        os.kill(p.pid, signal.SIGSTOP)
        time.sleep(3.0)
        os.kill(p.pid, signal.SIGCONT)
        out, err = p.communicate("\n", timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert out.strip().endswith("after True 0"), (out, err[-2000:])


def test_item11_a_call_after_stop_raises_mesh_stopped():
    procs = ma.proc_mesh(procs=1)
    a = procs.spawn("a", Faulty)
    procs.stop()
    with pytest.raises(ma.MeshStoppedError):
        a.echo.call_one(1).get(timeout=10)
    with pytest.raises(ma.MeshStoppedError):
        a.echo.call(1).get(timeout=10)
    with pytest.raises(ma.MeshStoppedError):
        a.echo.broadcast(1)


def test_item11_a_dead_peer_without_a_known_rank_is_named_by_pid_not_an_empty_list():
    err = ma.ActorDiedError((), 1234, reason="connection to unix:@x lost")
    assert "ranks  died" not in str(err) and "pid 1234" in str(err)
    assert str(ma.ActorDiedError((3,), 7)) == "process of rank 3 (pid 7) died"


def test_item9_pending_calls_are_bounded(tmp_path):
    # a loop of call_one() never waited on: past MESHARRAY_MAX_PENDING per peer the
    # caller waits for replies (default) or gets BackpressureError (asked for)
    script = tmp_path / "pending.py"
    script.write_text(textwrap.dedent("""
        import sys
        import mesharray as ma
        from tests.support.actors import Faulty
        from mesharray.runtime import channel
        from mesharray.runtime.router import get_router
        with ma.proc_mesh(procs=1, forward_logs=False) as procs:
            a = procs.spawn("a", Faulty)
            futs, most = [], 0
            try:
                for i in range(3000):
                    futs.append(a.echo.call_one(i))
                    most = max(most, max(len(c.pending) for c in get_router().channels.values()))
                print("sent", len(futs), most <= channel.MAX_PENDING, flush=True)
            except ma.BackpressureError as e:
                print("refused", len(futs), "MESHARRAY_MAX_PENDING=100" in str(e), flush=True)
            print("values", [f.get(timeout=30) for f in futs] == list(range(len(futs))), flush=True)
    """))
    for mode, expect in (("wait", "sent 3000 True"), ("raise", "refused")):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "MESHARRAY_MAX_PENDING": "100", "MESHARRAY_PENDING_FULL": mode}
        out = subprocess.run([sys.executable, str(script)], capture_output=True,
                             text=True, env=env, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        lines = out.stdout.split("\n")
        assert lines[0].startswith(expect) and lines[1] == "values True", out.stdout
        if mode == "raise":  # at least the bound went out before the refusal (replies may free a few)
            _, n, named = lines[0].split()
            assert int(n) >= 100 and named == "True"


def test_F18_a_fast_sender_and_a_slow_actor_bounded_memory_no_false_death(tmp_path):
    script = tmp_path / "flood.py"
    script.write_text(textwrap.dedent("""
        import sys, threading
        import psutil
        import mesharray as ma
        from tests.support.actors import Slow
        me = psutil.Process()
        peak = [me.memory_info().rss]
        stop = threading.Event()
        def sample():
            while not stop.wait(0.01):
                peak[0] = max(peak[0], me.memory_info().rss)
        with ma.proc_mesh(procs=1, forward_logs=False, heartbeat_timeout=1.0, heartbeat_interval=0.2) as procs:
            s = procs.spawn("s", Slow)
            s.count.call_one().get(timeout=10)
            base = me.memory_info().rss
            threading.Thread(target=sample, daemon=True).start()
            payload = b"x" * (16 << 10)
            futs = [s.take.call_one(payload) for _ in range(3000)]     # replies awaited: bounded
            for _ in range(3000):
                s.take.broadcast(payload)                             # no replies: the send backlog bounds them
            assert all(f.get(timeout=60) == len(payload) for f in futs)
            n = s.count.call_one().get(timeout=60)
            stop.set()
            st = procs.stats()
            print(n, st["deaths"], (peak[0] - base) >> 20, flush=True)
    """))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MESHARRAY_MAX_PENDING": "200",
           "MESHARRAY_SEND_BACKLOG": str(4 << 20)}
    out = subprocess.run([sys.executable, str(script)], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    n, deaths, grew_mib = map(int, out.stdout.split())
    assert n == 6000 and deaths == 0
    assert grew_mib < 64, f"the controller grew {grew_mib} MiB while flooding a slow actor"


def test_item11_an_exception_in_a_broadcast_endpoint_reaches_the_caller_at_its_next_call():
    with ma.proc_mesh(procs=2, forward_logs=False) as procs:
        a = procs.spawn("a", Faulty)
        a.raise_.broadcast("from a broadcast")  # nobody waits on it...
        with pytest.raises(ma.ActorError) as info:
            a.slice(procs=1).echo.call_one(5).get(timeout=10)  # ...so the next call says it
        err = info.value
        assert isinstance(err.exception, ValueError) and str(err.exception) == "from a broadcast"
        assert "this call did not run: an earlier broadcast" in str(err)
        # told once; the actor lives and the next call runs
        assert a.slice(procs=1).echo.call_one(6).get(timeout=10) == 6
        # rank 0 had the same failure: its next call (here through call()) reports it too
        with pytest.raises(ma.ActorError):
            a.echo.call(7).get(timeout=10)
        assert a.echo.call(8).get(timeout=10).tolist() == [[8, 8]]
