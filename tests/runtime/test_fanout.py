"""``call()`` on many actors in a loop: the lean path (runtime.channel.Fanout) and everything it leaves
to the general one. Whichever path a call takes, the caller sees the same values, errors, order and
counts."""

from __future__ import annotations

import os
import signal
import socket
import time

import numpy as np
import pytest

import mesharray as ma
from mesharray._core import dispatch_frames, pack_frame
from mesharray.errors import BrokenTransportError
from mesharray.runtime import protocol as P
from mesharray.runtime.channel import Fanout
from mesharray.runtime.router import get_router
from mesharray.transport.connection import Connection
from tests.support.actors import Counter, Probe

pytestmark = pytest.mark.timeout(60)


def _fanout(fut) -> Fanout | None:
    chan = fut._chan
    return chan if isinstance(chan, Fanout) else None


def test_a_call_loop_takes_the_lean_path_with_the_same_results(procs):
    p = procs.spawn("fan_echo", Probe, "f")
    s0 = procs.stats()
    for i in range(30):
        fut = p.echo.call(i)
        assert fut.get(timeout=10).tolist() == [[i, i, i, i]]
    fan = _fanout(p.echo.call(0))
    assert fan is not None and len(fan.chans) == 4  # kept for the endpoint and its mesh
    assert p.echo._caller.fan[3] is fan
    # no arguments, keyword arguments, a slice (another Fanout, of its own channels)
    assert p.pid.call().get(timeout=10).size == 4
    assert p.echo.call(x=5).get(timeout=10).tolist() == [[5, 5, 5, 5]]
    assert p[0, 1:3].echo.call("s").get(timeout=10).tolist() == ["s", "s"]
    assert len(_fanout(p[0, 1:3].echo.call(0)).chans) == 2
    s1 = procs.stats()
    # every reply counted once, by the reader that routed it (the 31st call and the others above)
    assert s1["replies"] - s0["replies"] >= 30 * 4
    assert s1["calls"] - s0["calls"] >= 30 * 4


def test_errors_large_arguments_and_replies_go_through(procs):
    p = procs.spawn("fan_err", Probe, "e")
    p.echo.call(0).get(timeout=10)
    s0 = procs.stats()
    with pytest.raises(ma.ActorError, match="boom"):
        p.fail.call("boom").get(timeout=10)  # (raises at the first error reply)
    p.echo.call(0).get(timeout=10)  # (its replies come after the other errors: all read by then)
    assert procs.stats()["errors"] - s0["errors"] == 4  # (the reader counts the routed error replies)
    a = np.arange(1 << 20, dtype=np.float32)  # 4 MiB: through shared memory, the general path
    got = p.double.call(a).get(timeout=30)
    assert got.shape[:2] == (1, 4)
    assert np.array_equal(got[0, 3], a * 2)
    assert p.echo.call(1).get(timeout=10).tolist() == [[1, 1, 1, 1]]  # the lean path again


def test_calls_in_flight_cork_the_next_one_behind_them_in_order(procs):
    c = procs.spawn("fan_order", Counter, 0)
    c.get.call().get(timeout=10)
    futs = []
    for i in range(50):  # one call() after another without waiting: each channel has calls in flight
        futs.append(c.record.call(i))
    last = c.recorded.call()
    for f in futs:
        assert f.get(timeout=10).tolist() == [[None] * 4]
    assert last.get(timeout=10).tolist() == [[list(range(50))] * 4]
    fut = c.get.call()
    assert fut.get(timeout=10).tolist() == [[0] * 4]
    assert all(not ch.pending for ch in _fanout(fut).chans)


def test_get_with_a_deadline_then_the_replies(procs):
    p = procs.spawn("fan_slow", Probe, "s")
    p.echo.call(0).get(timeout=10)
    fut = p.sleep.call(0.3, "late")
    assert _fanout(fut) is not None
    with pytest.raises(TimeoutError):
        fut.get(timeout=0.05)
    assert fut.get(timeout=10).tolist() == [["late"] * 4]
    assert p.echo.call(2).get().tolist() == [[2, 2, 2, 2]]


def test_a_rank_dying_mid_call_fails_the_call_and_the_rest_keep_working():
    with ma.proc_mesh(procs=3, forward_logs=False) as procs:
        p = procs.spawn("fan_die", Probe, "d")
        for _ in range(5):
            p.pid.call().get(timeout=10)
        pid = p.slice(procs=1).pid.call_one().get(timeout=10)
        fut = p.sleep.call(2.0)  # every rank busy; rank 1 dies meanwhile
        assert _fanout(fut) is not None
        time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(ma.ActorDiedError) as info:
            fut.get(timeout=10)
        assert info.value.ranks == (1,) and info.value.pid == pid
        assert time.monotonic() - t0 < 2.0
        with pytest.raises(ma.ActorDiedError):
            p.echo.call(1).get(timeout=10)  # the dead rank fails every later call (the general path)
        live = p[0, ::2]
        for i in range(5):
            assert live.echo.call(i).get(timeout=10).tolist() == [i, i]
        assert _fanout(live.echo.call(0)) is not None


def test_frames_lost_on_purpose_still_reach_the_injected_handlers():
    with ma.proc_mesh(procs=2, forward_logs=False) as procs:
        p = procs.spawn("fan_inject", Probe, "i")
        p.echo.call(0).get(timeout=10)
        chan = get_router().channels[p._addresses[1]]
        # replies lost: the routed path must not go around the handler that loses them
        chan.conn.inject(drop_in=lambda kind: kind == P.REPLY)
        fut = p.echo.call(1)
        with pytest.raises(TimeoutError):
            fut.get(timeout=0.3)
        assert chan.conn.dropped_in == 1
        chan.conn.inject()
        chan.pending.clear()  # (the lost reply's call, which nothing will answer)
        assert p.echo.call(2).get(timeout=10).tolist() == [[2, 2]]  # replies routed again
        # calls lost: write_frame leaves the frame to the faulty send, which drops it
        chan.conn.inject(drop_out=lambda kind: kind == P.CALL)
        fut = p.echo.call(3)
        with pytest.raises(TimeoutError):
            fut.get(timeout=0.3)
        assert chan.conn.dropped_out == 1
        chan.conn.inject()
        chan.pending.clear()
        assert p.echo.call(4).get(timeout=10).tolist() == [[4, 4]]


def test_write_frame_writes_only_with_nothing_ahead_of_it():
    a, b = socket.socketpair()
    conn = Connection(a, name="wf")
    try:
        frame = pack_frame(P.CALL, 1, 7, 1, 0, [b"xyz"], 1 << 14, 1 << 20)[1]
        assert conn.write_frame(frame)
        assert b.recv(100) == frame
        assert (conn.frames_out, conn.bytes_out) == (1, len(frame))
        assert conn.send(P.CALL, 0, 8, 1, 0, [b"corked"], cork=True)  # a frame corked ahead of it
        assert not conn.write_frame(frame)
        conn.flush()
        conn.inject(delay=0.001)
        assert not conn.write_frame(frame)  # (left to the injected send)
        conn.inject()
        assert conn.write_frame(frame)
        conn.close()
        assert not conn.write_frame(frame)
    finally:
        conn.close()
        b.close()


def test_routed_frames_are_counted_and_a_callback_error_stops_after_its_frame():
    frames = b"".join(pack_frame(P.REPLY, 0, mid, status, 0, [b"v"], 64, 1 << 20)[1]
                      for mid, status in ((1, 0), (2, 1), (3, 0), (9, 0)))
    got, counts = [], [0, 0]

    def bad(target, payload):
        raise ValueError("callback")

    table = {1: lambda t, p: got.append((1, t)), 2: lambda t, p: got.append((2, t)), 3: bad}
    start, status, err = dispatch_frames(None, None, frames, 0, len(frames), 1 << 20, False, None, 0.0,
                                         P.REPLY, table, counts)
    assert got == [(1, 0), (2, 1)] and isinstance(err, ValueError)
    assert start == 3 * 25 and status == 0  # past the frame whose callback raised
    assert counts == [3, 1] and table == {}
    # a frame of another kind still goes to the handler; one without a callback is dropped
    seen = []
    start, status, err = dispatch_frames(lambda c, *f: seen.append(f[0]), None, frames + pack_frame(
        P.LOG, 0, 0, 1, 0, [b"x"], 64, 1 << 20)[1], start, len(frames) + 25, 1 << 20, False, None, 0.0,
        P.REPLY, table, counts)
    assert (err, seen, counts) == (None, [P.LOG], [4, 1])


def test_a_connection_broken_under_a_call_fails_its_future_not_the_send():
    with ma.proc_mesh(procs=2, forward_logs=False) as procs:
        p = procs.spawn("fan_broken", Probe, "b")
        for _ in range(3):
            p.echo.call(0).get(timeout=10)
        chan = get_router().channels[p._addresses[1]]
        chan.conn.sock.shutdown(socket.SHUT_WR)  # the next write to rank 1 fails (EPIPE)
        fut = p.echo.call(1)  # (rank 0's frame still goes: nothing raises here)
        with pytest.raises(ma.ActorDiedError) as info:
            fut.get(timeout=10)
        assert info.value.ranks == (1,)
        assert p.slice(procs=0).echo.call(2).get(timeout=10).tolist() == [2]


class _FakeEpoll:
    """A readiness set that records which fds are armed; ``during_disarm(fd)`` runs inside each disarm
    (what another thread may do meanwhile: CPython runs other threads during the system call)."""

    def __init__(self) -> None:
        self.armed: set = set()
        self.during_disarm = None

    def disarm(self, fd: int) -> None:
        if self.during_disarm is not None:
            self.during_disarm(fd)
        self.armed.discard(fd)

    def arm(self, fd: int) -> None:
        self.armed.add(fd)

    def wake(self) -> None:
        pass


def test_park_all_never_leaves_a_connection_both_disarmed_and_unparked():
    from mesharray.transport.poller import Poller

    socks = [socket.socketpair() for _ in range(3)]
    conns = [Connection(a, name=f"p{i}") for i, (a, _) in enumerate(socks)]
    poller = Poller.__new__(Poller)  # (its state without its thread: the fake poller below is driven by hand)
    poller._readiness = ep = _FakeEpoll()
    poller._conns, poller._parked, poller._timeout = {}, {}, -1.0
    poller._sweep_lock = __import__("threading").Lock()
    try:
        for i, c in enumerate(conns):
            c.poller, c._fd = poller, 100 + i
            ep.arm(c._fd)
        # the poller thread ends a read of conns[2] (and re-arms it) while park_all disarms conns[0]
        ep.during_disarm = lambda fd: poller.rearm(conns[2]) if fd == conns[0]._fd else None
        poller.park_all(conns, time.monotonic())
        for c in conns:  # read by someone: the poller (armed) or a caller (parked: the sweep re-arms it)
            assert c._fd in ep.armed or c in poller._parked, c.name
        ep.during_disarm = None
        poller.park(conns[1])  # (already parked: no disarm)
        assert conns[1] in poller._parked
    finally:
        for a, b in socks:
            a.close()
            b.close()


def test_an_error_while_writing_leaves_no_call_registered_that_was_not_sent():
    with ma.proc_mesh(procs=3, forward_logs=False) as procs:
        p = procs.spawn("fan_interrupt", Probe, "x")
        for _ in range(3):
            p.echo.call(0).get(timeout=10)
        fan = _fanout(p.echo.call(0))  # (a future nobody waits on: the poller reads its replies)
        deadline = time.monotonic() + 10
        while any(ch.pending for ch in fan.chans) and time.monotonic() < deadline:
            time.sleep(0.01)
        victim = fan.chans[1].conn

        def interrupted(frame):
            raise KeyboardInterrupt

        victim.write_frame = interrupted  # (an interrupt landing between two writes)
        try:
            with pytest.raises(KeyboardInterrupt):
                p.echo.call(1)
        finally:
            del victim.write_frame
        assert not fan.chans[1].pending and not fan.chans[2].pending  # (rank 0's was sent: its reply comes)
        deadline = time.monotonic() + 10
        while fan.chans[0].pending and time.monotonic() < deadline:
            fan.unpark()
            time.sleep(0.01)
        assert not fan.chans[0].pending
        assert p.echo.call(2).get(timeout=10).tolist() == [[2, 2, 2]]
        assert _fanout(p.echo.call(3)) is fan  # the lean path, not corked behind calls nobody sent


def test_a_peer_gone_right_after_the_handshake_is_a_death_and_leaves_no_socket_open(monkeypatch):
    import gc

    from mesharray.runtime.channel import Channel
    from mesharray.transport.listener import Listener

    router = get_router()
    accepted = []
    listener = Listener(router.secret, accepted.append)
    try:
        def broken(self, kind, *a, **k):
            raise BrokenTransportError("connection broke while sending: [Errno 32] Broken pipe")

        monkeypatch.setattr(Channel, "send", broken)  # (the HELLO: the peer closed after the handshake)
        with pytest.raises(ma.ActorDiedError, match="cannot connect"):
            router.channel(listener.address)
        assert listener.address not in router.channels
        monkeypatch.undo()
        gc.collect()  # (an unclosed socket would be a ResourceWarning here, an error under this suite's filters)
    finally:
        listener.close()
        for s in accepted:
            s.close()
