"""Fan-out through the hosts: one relay process per host, frames once per host, each rank's order across both paths,
and the failures of a rank or a relay."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from mh_agents import SECRET, agents, wait_until

import mesharray as ma
from mesharray import _platform
from mesharray.runtime.router import get_router
from tests.support.actors import Counter, Probe
from tests.support.procs import gone

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def mesh():
    """Two attached hosts with three processes each (relays on): ``(procs, counters, probes)``."""
    with agents(2, first_ip=14, prefix="r") as ags:
        hosts = ma.attach([a.url for a in ags], secret=SECRET, transport="tcp")
        procs = hosts.spawn_procs(per_host={"procs": 3})
        try:
            yield procs, procs.spawn("counters", Counter), procs.spawn("probes", Probe)
        finally:
            procs.stop()
            hosts.detach()


def _relay_pids(procs) -> list[int]:
    ctl = procs._root.controller
    return [ctl._relays[h].peer["pid"] for h in sorted(ctl._relays)]


def test_messages_to_several_hosts_leave_the_controller_once_per_host(mesh):
    procs, counters, _ = mesh
    assert procs._root.controller.plane is not None and len(_relay_pids(procs)) == 2
    router = get_router()
    counters.get.call().get(timeout=30)  # (views defined, plans made)
    calls, oneway = router.sent_calls, router.sent_oneway
    for _ in range(5):
        assert np.asarray(counters.get.call().get(timeout=30)).shape == (2, 3)
    counters.incr.broadcast(0)
    assert router.sent_calls - calls == 5 * 2  # one frame per host, not one per rank
    assert router.sent_oneway - oneway == 2
    calls = router.sent_calls
    counters[0].get.call().get(timeout=30)  # the ranks of one host: the direct path
    assert router.sent_calls - calls == 3


def test_each_rank_keeps_the_controllers_order_across_both_paths(mesh):
    _, counters, _ = mesh
    counters.recorded.call().get(timeout=30)
    want = {r: [] for r in range(6)}
    i = 0
    for step in range(40):
        # relayed broadcasts and calls, direct calls and broadcasts to single ranks and to one host
        counters.record.broadcast(i)
        for r in range(6):
            want[r].append(i)
        i += 1
        r = step % 6
        counters[r // 3, r % 3].record.call_one(i).get(timeout=30)
        want[r].append(i)
        i += 1
        h = step % 2
        counters[h].record.broadcast(i)
        for q in range(3 * h, 3 * h + 3):
            want[q].append(i)
        i += 1
        if step % 5 == 0:
            counters.record.call(i).get(timeout=30)
            for q in range(6):
                want[q].append(i)
            i += 1
    got = np.asarray(counters.recorded.call().get(timeout=30)).ravel()
    assert [list(got[r]) for r in range(6)] == [want[r] for r in range(6)]


def test_large_arguments_and_replies_go_through_the_relays(mesh):
    _, _, probes = mesh
    blob = np.arange(200_000, dtype=np.float64)  # 1.6 MB: over the small-frame size, shared memory on a host
    out = np.asarray(probes.double.call(blob).get(timeout=60))
    assert out.shape == (2, 3, blob.size)
    for v in out.reshape(6, -1):
        np.testing.assert_array_equal(v, blob * 2)
    text = "x" * 40_000  # a pickle over the small-frame size, inline
    assert all(v == text for v in np.asarray(probes.echo.call(text).get(timeout=60)).ravel())


def test_a_relayed_broadcast_that_raised_is_told_at_the_next_direct_call(mesh):
    _, _, probes = mesh
    probes.fail.broadcast("from a relayed broadcast")
    with pytest.raises(ma.ActorError, match="from a relayed broadcast"):
        probes[1, 2].pid.call_one().get(timeout=30)
    assert probes[1, 2].pid.call_one().get(timeout=30) > 0  # told once


def test_arrays_reduce_across_hosts_through_the_relays(mesh):
    procs, _, _ = mesh
    x = procs.ones((3,)) * procs.rank_array()
    for _ in range(3):
        assert float(np.asarray(x.sum().fetch())) == 3 * sum(range(6))
    np.testing.assert_array_equal(np.asarray(x.sum(axis="hosts").fetch())[:, 0], [3, 5, 7])
    assert float(np.asarray(x.max().fetch())) == 5
    # the ranks that send no result back (all but the first) left their host rounds before the
    # results were in: each still holds every result where a later op reads it
    r = procs.rank_array().astype("float64")
    for i in range(4):
        total = r.sum(keepdims=True)
        np.testing.assert_array_equal(np.asarray((r * i + total).fetch()).ravel(), [15 + i * k for k in range(6)])
    assert np.asarray(r.mean(keepdims=True).fetch()).ravel().tolist() == [2.5]


def test_a_rank_dead_after_tiny_reductions_across_hosts_fails_the_next_ones_not_hangs():
    ags, hosts, procs = _two_hosts(26, "y", procs=3)
    try:
        r = procs.rank_array().astype("float64")
        for _ in range(5):
            assert float(np.asarray(r.sum().fetch())) == 15.0
        s = r.sum(keepdims=True)  # (its members may not have its result yet)
        os.kill(procs.pids[4], signal.SIGKILL)  # a member of the second host
        t = time.monotonic()
        for _ in range(2):
            with pytest.raises(ma.ActorDiedError) as ei:
                float(np.asarray(r.sum().fetch()))
            assert 4 in ei.value.ranks
        with pytest.raises(ma.ActorDiedError):
            (r + s).fetch()
        assert time.monotonic() - t < 15
    finally:
        procs.stop()
        hosts.detach()
        ags.__exit__(None, None, None)


def test_telemetry_goes_once_per_host_through_the_relays(mesh):
    procs, counters, _ = mesh
    counters.get.call().get(timeout=30)
    rows = procs.telemetry.sql("SELECT host, count(DISTINCT rank) AS n FROM messages WHERE actor = 'counters' "
                               "GROUP BY host ORDER BY host")
    assert rows == [{"host": "r0", "n": 3}, {"host": "r1", "n": 3}] and rows.missing == []
    assert procs.telemetry._links == {}  # no connection of the controller's own to any rank
    assert sorted(procs.stacks()) == list(range(6))
    assert list(procs.telemetry.stacks(ranks=[4])) == [4]


def _two_hosts(first_ip: int, prefix: str, procs: int = 2, **kw):
    ags_cm = agents(2, first_ip=first_ip, prefix=prefix)
    ags = ags_cm.__enter__()
    hosts = ma.attach([a.url for a in ags], secret=SECRET, transport="tcp")
    return ags_cm, hosts, hosts.spawn_procs(per_host={"procs": procs}, **kw)


def test_a_dead_rank_fails_a_pending_relayed_call_within_the_bound_and_spares_the_rest():
    ags, hosts, procs = _two_hosts(16, "d")
    try:
        p = procs.spawn("p", Probe)
        pids = np.asarray(p.pid.call().get(timeout=30))
        fut = p.sleep.call(5.0, "late")  # (the other ranks answer after 5 s: the death must not wait for them)
        time.sleep(0.2)
        t = time.monotonic()
        os.kill(int(pids[1, 1]), signal.SIGKILL)
        with pytest.raises(ma.ActorDiedError) as ei:
            fut.get(timeout=10)
        assert time.monotonic() - t <= 1.0
        assert ei.value.ranks == (3,) and ei.value.signal == signal.SIGKILL
        # the other ranks of both hosts keep working, through their relays and directly
        time.sleep(5.0)  # (the ranks still sleeping in the failed call)
        assert p[0].pid.call().get(timeout=30).shape == (2,)
        assert p[1, 0].pid.call_one().get(timeout=30) == int(pids[1, 0])
        with pytest.raises(ma.ActorDiedError):
            p.pid.call().get(timeout=30)
    finally:
        procs.stop()
        hosts.detach()
        ags.__exit__(None, None, None)


def test_a_rank_that_replied_then_exited_keeps_its_reply_in_a_relayed_call():
    # its reply reached the relay, which waits for the host's other ranks; the controller
    # records the death meanwhile: the call still gets the reply, not the death
    ags, hosts, procs = _two_hosts(24, "x")
    try:
        p = procs.spawn("p", Probe)
        pids = np.asarray(p.pid.call().get(timeout=30))
        got = p.reply_then_exit.call(int(pids[0, 0]), 1.0).get(timeout=30)
        assert got.tolist() == [["bye", "ok"], ["ok", "ok"]]
        with pytest.raises(ma.ActorDiedError) as ei:
            p.pid.call().get(timeout=30)
        assert ei.value.ranks == (0,)
        assert p[1].pid.call().get(timeout=30).tolist() == pids[1].tolist()
    finally:
        procs.stop()
        hosts.detach()
        ags.__exit__(None, None, None)


def test_a_dead_relay_is_the_death_of_its_hosts_ranks():
    ags, hosts, procs = _two_hosts(18, "e")
    try:
        p = procs.spawn("p", Probe)
        pids = np.asarray(p.pid.call().get(timeout=30))
        fut = p.sleep.call(2.0)
        time.sleep(0.2)
        t = time.monotonic()
        os.kill(_relay_pids(procs)[1], signal.SIGKILL)
        with pytest.raises(ma.ActorDiedError) as ei:
            fut.get(timeout=10)
        assert time.monotonic() - t <= 1.0
        assert "relay of host e1" in str(ei.value)
        assert wait_until(lambda: all(gone(int(q)) for q in pids[1]), 5)  # its ranks went with it
        with pytest.raises(ma.ActorDiedError, match="relay of host e1"):
            p[1, 0].pid.call_one().get(timeout=10)
        assert p[0].pid.call().get(timeout=30).shape == (2,)  # the other host keeps working
        assert procs.stats()["deaths"] == 2
    finally:
        procs.stop()
        hosts.detach()
        ags.__exit__(None, None, None)


class _BeatSlot(ma.Actor):
    @ma.endpoint
    def beat_slot(self):
        from mesharray.runtime import worker

        w = worker._main_worker
        return None if w is None or w.beat_slot is None else w.beat_slot[1]


def test_a_stopped_rank_is_reported_unresponsive_through_its_relay():
    ags, hosts, procs = _two_hosts(20, "u", heartbeat_timeout=1.0, heartbeat_interval=0.2)
    try:
        p = procs.spawn("p", Probe)
        pids = np.asarray(p.pid.call().get(timeout=30))
        if _platform.memfd_via_proc():  # (Linux: the ranks write their heartbeats into the relay's slots)
            slots = procs.spawn("slots", _BeatSlot).beat_slot.call().get(timeout=30)
            assert sorted(np.asarray(slots).ravel().tolist()) == [0, 0, 8, 8]
        time.sleep(1.5)
        assert procs.stats()["unresponsive_now"] == 0  # idle: no false report
        os.kill(int(pids[1, 0]), signal.SIGSTOP)
        try:
            t = time.monotonic()
            assert wait_until(lambda: procs.stats()["unresponsive_now"] == 1, 5)
            assert time.monotonic() - t < 1.0 + 1.5
            assert p[0].pid.call().get(timeout=30).shape == (2,)
        finally:
            os.kill(int(pids[1, 0]), signal.SIGCONT)
        assert wait_until(lambda: procs.stats()["unresponsive_now"] == 0, 5)
        assert p.pid.call().get(timeout=30).shape == (2, 2)
    finally:
        procs.stop()
        hosts.detach()
        ags.__exit__(None, None, None)


def test_relays_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("MESHARRAY_RELAY", "0")
    ags, hosts, procs = _two_hosts(22, "o")
    try:
        assert procs._root.controller.plane is None
        c = procs.spawn("c", Counter)
        router = get_router()
        c.get.call().get(timeout=30)
        calls = router.sent_calls
        c.get.call().get(timeout=30)
        assert router.sent_calls - calls == 4  # one frame per rank
    finally:
        procs.stop()
        hosts.detach()
        ags.__exit__(None, None, None)




def test_a_call_one_keeps_its_place_while_another_thread_calls_the_same_rank(mesh):
    # a direct frame is counted in the order it goes out: another thread's direct calls to the rank,
    # counted in between, must not let a later relayed broadcast overtake this thread's call_one
    import threading

    procs, _, _ = mesh
    probes = procs.spawn("probes_threads", Probe)
    c = procs.spawn("order_threads", Counter)
    c.recorded.call().get(timeout=30)
    stop = threading.Event()

    def noise():
        while not stop.is_set():
            probes[0, 0].echo.call_one(1).get(timeout=30)

    th = threading.Thread(target=noise)
    th.start()
    try:
        futs = []
        for i in range(600):
            c.record.broadcast(2 * i)
            futs.append(c[0, 0].record.call_one(2 * i + 1))
            if i % 50 == 0:
                futs[-1].get(timeout=30)
        for f in futs:
            f.get(timeout=60)
    finally:
        stop.set()
        th.join(30)
    assert c[0, 0].recorded.call_one().get(timeout=30) == list(range(1200))


def test_telemetry_asking_a_stopped_rank_does_not_hold_up_its_hosts_calls(mesh):
    import threading

    procs, _, _ = mesh
    probes = procs.spawn("probes_telemetry", Probe)
    pid = probes[0, 1].where.call_one().get(timeout=30)["pid"]
    procs.telemetry.collect(timeout=3.0)
    os.kill(pid, signal.SIGSTOP)
    try:
        procs.telemetry.collect(timeout=1.0)  # unanswered: the relay drops its link, the next query connects anew
        th = threading.Thread(target=procs.telemetry.collect, kwargs={"timeout": 1.0})
        th.start()
        time.sleep(0.3)
        t = time.monotonic()
        probes[:, 0].echo.call(2).get(timeout=60)  # ranks 0 and 3: relayed, rank 0's host being asked meanwhile
        took = time.monotonic() - t
        th.join(60)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert took < 1.0, took
    assert wait_until(lambda: procs.stats()["unresponsive_now"] == 0, 10)


def test_a_relay_slow_to_start_holds_back_only_its_own_meshes_workers():
    """A zygote serves several meshes: while one mesh's relay is still reaching its controller (here
    one that never answers), the zygote forks another mesh's workers and reports its exits at once."""
    import socket

    from mesharray.bootstrap.local import LocalBootstrap, Zygote
    from mesharray.runtime.controller import Controller

    silent = socket.socket()  # accepts connections (the kernel's backlog) and never authenticates
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    zyg = Zygote()
    reports: list = []
    stuck = ctl = other = None
    try:
        stuck = LocalBootstrap(None, 1, address=f"tcp:127.0.0.1:{silent.getsockname()[1]}", secret=SECRET,
                               ranks=[0], zygote=zyg, on_report=reports.append,
                               relay={"controller": f"tcp:127.0.0.1:{silent.getsockname()[1]}", "ranks": [0],
                                      "host": 0, "host_id": "slow"})
        assert wait_until(lambda: any(m[:2] == ("forked", -1) for m in reports), 10)  # its relay runs
        t = time.monotonic()
        ctl = Controller(name="other")
        other = LocalBootstrap(ctl, 2, zygote=zyg)
        ctl.adopt(2, timeout=8)
        assert time.monotonic() - t < 3.0  # (it waited for the relay's handshake to time out: 5 s)
        pid = other.pids[1]
        os.kill(pid, signal.SIGKILL)
        assert other.exit_status(1, timeout=3.0) is not None  # the zygote reaps and reports meanwhile
        assert not any(m[0] == "forked" and m[1] == 0 for m in reports)  # its own worker waits for it
    finally:
        if ctl is not None:
            ctl.stop(timeout=1.0)
        for b in (other, stuck):
            if b is not None:
                b.close(timeout=2.0)
        zyg.close()
        silent.close()
