"""How replies are read: by the waiting caller itself, or by the poller thread when nobody waits."""

from __future__ import annotations

import threading
import time

import pytest

from mesharray.runtime.router import get_router
from tests.support.actors import Counter, Probe

pytestmark = pytest.mark.timeout(60)


def _conn(mesh, i=0):
    """The transport connection under the channel to rank ``i`` of ``mesh``."""
    return get_router().channels[mesh._addresses[mesh._shape.rank(i)]].conn


def test_a_future_nobody_gets_still_completes_through_done(procs):
    c = procs.spawn("w_done", Counter, 7).slice(procs=1)
    fut = c.get.call_one()
    t = time.monotonic()
    while not fut.done():
        assert time.monotonic() - t < 5, "done() never became true"
        time.sleep(0.001)
    assert fut.get(timeout=1) == 7


def test_done_callback_runs_without_get(procs):
    c = procs.spawn("w_cb", Counter, 3)
    got = threading.Event()
    out = []
    fut = c.get.call()
    fut.add_done_callback(lambda f: (out.append(f.get().tolist()), got.set()))
    assert got.wait(10)
    assert out == [[[3, 3, 3, 3]]]
    one = c.slice(procs=2)
    got.clear()
    one.get.call_one().add_done_callback(lambda f: (out.append(f.get()), got.set()))
    assert got.wait(10)
    assert out[-1] == 3


def test_a_dropped_future_gives_the_connection_back_to_the_poller(procs):
    p = procs.spawn("w_drop", Probe, "d").slice(procs=3)
    conn = _conn(p)
    p.pid.call_one()  # parked for a caller that never comes
    t = time.monotonic()
    while conn.poller.is_parked(conn):
        assert time.monotonic() - t < 2, "the poller never took the connection back"
        time.sleep(0.01)
    assert p.pid.call_one().get(timeout=5) > 0
    assert procs.stats()["alive"] == 4
    # once nothing is parked the poller sleeps without a timeout; a new park wakes it
    poller = conn.poller
    t = time.monotonic()
    while poller._timeout >= 0:
        assert time.monotonic() - t < 2, "the poller kept sweeping with nothing parked"
        time.sleep(0.01)
    p.pid.call_one()
    t = time.monotonic()
    while poller.is_parked(conn):
        assert time.monotonic() - t < 2, "a park after an idle spell was never swept"
        time.sleep(0.01)
    assert procs.stats()["alive"] == 4


def test_call_get_reads_replies_in_the_calling_thread(procs):
    c = procs.spawn("w_call", Counter, 1)
    seen = set()
    conns = [_conn(c, i) for i in range(4)]
    cls = type(conns[0])
    origs = {name: getattr(cls, name) for name in ("_read_some", "_read_polled")}  # (the two readers)

    def spy(name):
        def read(self, *a):
            if self in conns:
                seen.add(threading.current_thread().name)
            return origs[name](self, *a)
        return read

    for name in origs:
        setattr(cls, name, spy(name))
    try:
        for i in range(20):  # (a wait with a deadline and one without)
            fut = c.get.call()
            assert (fut.get(timeout=10) if i % 2 else fut.get()).tolist() == [[1, 1, 1, 1]]
    finally:
        for name, orig in origs.items():
            setattr(cls, name, orig)
    assert threading.current_thread().name in seen


def test_get_with_timeout_on_a_slow_call_then_the_reply(procs):
    p = procs.spawn("w_slow", Probe, "s")
    fut = p.sleep.call(0.5, 1)
    with pytest.raises(TimeoutError):
        fut.get(timeout=0.05)
    assert fut.get(timeout=10).tolist() == [[1, 1, 1, 1]]
    f1 = p.slice(procs=0).sleep.call_one(0.3, "x")
    with pytest.raises(TimeoutError):
        f1.get(timeout=0.01)
    assert f1.get(timeout=10) == "x"
