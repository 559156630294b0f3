"""The channel contract: the runtime's per-peer state lives on a Channel, the Connection under it is
a socket with framing and nothing else."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import typing

import numpy as np
import pytest

from mesharray._core import Shape
from mesharray.runtime import protocol as P
from mesharray.runtime.channel import Channel, flush_all
from mesharray.runtime.future import Future
from mesharray.runtime.router import get_router
from mesharray.transport.connection import Connection
from tests.support.actors import Counter, Probe

pytestmark = pytest.mark.timeout(60)

RUNTIME_FIELDS = ("pending", "views_out", "views_in", "peer", "died", "t_oneway", "on_cork")


def test_a_connection_has_no_runtime_state():
    a, b = socket.socketpair()
    try:
        conn = Connection(a, name="bare")
        for field in RUNTIME_FIELDS:
            assert not hasattr(conn, field), field
    finally:
        a.close()
        b.close()


def test_transport_imports_nothing_of_the_runtime():
    code = ("import sys, mesharray.transport.connection, mesharray.transport.listener, mesharray.transport.address, "
            "mesharray.transport.shm, mesharray.transport.auth; "
            "print([m for m in sys.modules if m.startswith(('mesharray.runtime', 'mesharray.actor'))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _echo_peer(sock):
    """A bare thread-mode Connection that answers every CALL with a REPLY carrying its payload."""
    def on(conn, kind, flags, msg_id, target, view, payload):
        if kind == P.CALL and flags & P.F_REPLY:
            conn.send(P.REPLY, 0, msg_id, P.OK, 0, [bytes(payload)])
    c = Connection(sock, handler=on, name="echo-peer")
    c.start()
    return c


def test_a_channel_resolves_replies_and_fails_what_is_pending():
    a, b = socket.socketpair()
    peer = _echo_peer(b)
    seen = []
    frames = []
    chan = Channel(a, handler=lambda ch, *f: frames.append(f[0]), name="to-echo")
    chan.start(polled=True)
    try:
        done = threading.Event()

        def cb(status, payload):
            seen.append((status, bytes(payload)))
            done.set()
        chan.call(P.CALL, 1, 0, [b"ping"], cb, park=True)
        assert chan.wait(done.is_set, None)  # read in this thread
        assert seen == [(P.OK, b"ping")]
        assert not chan.pending
        # a view is defined once per channel
        s = Shape({"procs": 2})
        assert chan.view_id(s) == chan.view_id(s) == 1
        # pending calls get the death error, and so does every later call
        peer.close()
        got = []
        err = RuntimeError("gone")
        chan.pending[12345] = lambda st, p: got.append((st, p))
        chan.fail(err)
        assert got == [(P.DIED, err)] and not chan.pending
        chan.call(P.CALL, 1, 0, [b"late"], lambda st, p: got.append((st, p)))
        assert got[-1] == (P.DIED, err)
        assert frames == []  # REPLY frames never reach the owner's handler
    finally:
        chan.close()
        peer.close()


def test_broadcasts_and_calls_are_ordered_per_peer(procs):
    c = procs.spawn("ch_order", Counter, 0).slice(procs=2)
    futs = []
    for i in range(300):
        c.record.broadcast(i)
        if i % 50 == 0:
            futs.append(c.record.call_one(-i))
    flush_all()
    assert [f.get(timeout=10) for f in futs] == [None] * len(futs)
    got = c.recorded.call_one().get(timeout=10)
    want = []
    for i in range(300):
        want.append(i)
        if i % 50 == 0:
            want.append(-i)
    assert got == want


def test_call_one_parks_and_reads_in_the_caller(procs):
    p = procs.spawn("ch_park", Probe, "p").slice(procs=1)
    p.pid.call_one().get(timeout=10)
    chan = get_router().channels[p._addresses[p._shape.rank(0)]]
    assert chan.polled
    conn = chan.conn
    seen = []
    origs = {name: getattr(Connection, name) for name in ("_read_some", "_read_polled")}  # (the two readers)

    def spy(name):
        def read(self, *a):
            if self is conn:
                seen.append(threading.current_thread().name)
            return origs[name](self, *a)
        return read

    for name in origs:
        setattr(Connection, name, spy(name))
    try:
        for i in range(20):
            fut = p.pid.call_one()
            assert conn.poller.is_parked(conn)  # parked before the call was written
            assert (fut.get(timeout=10) if i % 2 else fut.get()) > 0  # (a read with a deadline, and without)
    finally:
        for name, orig in origs.items():
            setattr(Connection, name, orig)
    assert threading.current_thread().name in seen
    assert not chan.pending


def test_future_is_generic_and_the_only_future():
    assert Future[int] is not None
    assert typing.get_type_hints(Future.get)["return"] is typing.get_args(Future.__orig_bases__[0])[0]
    from mesharray.buffer import Buffer

    b = Buffer(np.ones(2))
    try:
        out = np.zeros(2)
        f = b.read_into(out)
        assert type(f) is Future and f.get() == 16
    finally:
        b.drop()


def test_frames_longer_than_the_receive_buffer_both_ways(procs):
    # a pickled bytes object travels inline: a frame larger than the 256 KiB receive buffer,
    # read incrementally by the worker's reader thread and by the caller (poll mode)
    p = procs.spawn("ch_big", Probe, "b")
    one = p.slice(procs=0)
    for n in (300_000, 3 << 20):
        data = bytes(range(256)) * (n // 256)
        assert one.echo.call_one(data).get(timeout=30) == data
        out = p.echo.call(data).get(timeout=30)
        assert all(v == data for v in out.tolist()[0])
    assert one.echo.call_one(b"small").get(timeout=10) == b"small"
