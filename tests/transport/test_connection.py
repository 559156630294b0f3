"""Authentication, listeners and bad frames over real sockets."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest

from mesharray import AuthenticationError
from mesharray._core import pack_header
from mesharray.transport import auth
from mesharray.transport.address import connect, parse_address
from mesharray.transport.connection import Connection
from mesharray.transport.listener import Listener

pytestmark = pytest.mark.timeout(30)

SECRET = b"s" * 32


class Echo:
    """A listener whose connections echo every frame back."""

    def __init__(self, kind="unix", limit=None):
        self.conns = []
        self.closed = []
        self.limit = limit
        self.listener = Listener(SECRET, self._on_socket, kind=kind)

    def _on_socket(self, sock):
        c = Connection(sock, handler=self._echo, on_close=lambda c, e: self.closed.append(e),
                       limit=self.limit, name="server")
        self.conns.append(c)
        c.start()

    @staticmethod
    def _echo(conn, kind, flags, msg_id, target, view, payload):
        conn.send(kind, flags, msg_id, target, view, [bytes(payload)])

    def close(self):
        self.listener.close()
        for c in self.conns:
            c.close()


def _client(address, secret=SECRET):
    got = []
    ev = threading.Event()

    def on(conn, *frame):
        got.append(frame)
        ev.set()

    c = Connection(connect(address, secret), handler=on, name="client")
    c.start()
    return c, got, ev


@pytest.fixture(params=["unix", "tcp"])
def echo(request):
    e = Echo(kind=request.param)
    yield e
    e.close()


def test_round_trip(echo):
    c, got, ev = _client(echo.listener.address)
    c.send(3, 1, 42, 7, 9, [b"hello", b" world"])
    assert ev.wait(5)
    assert got[0][:5] == (3, 1, 42, 7, 9) and bytes(got[0][5]) == b"hello world"
    big = bytes(range(256)) * 8192  # 2 MiB: larger than the receive buffer
    ev.clear()
    c.send(4, 0, 1, 0, 0, [big])
    assert ev.wait(5) and bytes(got[1][5]) == big
    c.close()


def test_tcp_listener_binds_loopback():
    e = Echo(kind="tcp")
    try:
        assert e.listener.address.startswith("tcp:127.0.0.1:")
    finally:
        e.close()


def test_wrong_secret_is_refused_and_listener_keeps_serving(echo, caplog):
    with caplog.at_level(logging.WARNING, logger="mesharray.transport"):
        with pytest.raises(AuthenticationError):
            connect(echo.listener.address, b"x" * 32)
        deadline = time.monotonic() + 5
        while echo.listener.refused < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert echo.listener.refused == 1
    assert "wrong secret" in caplog.text
    c, got, ev = _client(echo.listener.address)
    c.send(1, 0, 1, 0, 0, [b"ok"])
    assert ev.wait(5)
    c.close()


def test_garbage_before_handshake_is_refused(echo):
    fam, addr = parse_address(echo.listener.address)
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.connect(addr)
    s.recv(36)
    s.sendall(b"GET / HTTP/1.1\r\n" + b"x" * 100)
    s.settimeout(5)
    assert _closed_by_peer(s)
    s.close()
    c, got, ev = _client(echo.listener.address)
    c.send(1, 0, 1, 0, 0, [b"still serving"])
    assert ev.wait(5)
    c.close()


def _closed_by_peer(s):
    try:
        return s.recv(100) == b""
    except ConnectionResetError:
        return True


def _raw_authenticated(address):
    fam, addr = parse_address(address)
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.connect(addr)
    auth.client_handshake(s, SECRET)
    return s


def test_malformed_frame_drops_only_that_connection(caplog):
    e = Echo()
    try:
        with caplog.at_level(logging.WARNING, logger="mesharray.transport"):
            s = _raw_authenticated(e.listener.address)
            s.sendall(b"\xde\xad" + b"\x00" * 30)
            s.settimeout(5)
            assert _closed_by_peer(s)
            s.close()
        assert "bad frame magic" in caplog.text
        c, got, ev = _client(e.listener.address)
        c.send(1, 0, 1, 0, 0, [b"fine"])
        assert ev.wait(5)
        c.close()
    finally:
        e.close()


def test_oversized_frame_is_refused_before_allocation(caplog):
    e = Echo(limit=1 << 20)
    try:
        with caplog.at_level(logging.WARNING, logger="mesharray.transport"):
            s = _raw_authenticated(e.listener.address)
            s.sendall(pack_header(1, 0, (1 << 32) - 1))  # claims 4 GiB
            s.settimeout(5)
            assert _closed_by_peer(s)
            s.close()
        assert "exceeds the limit of 1048576 bytes" in caplog.text
        c, got, ev = _client(e.listener.address)
        c.send(1, 0, 1, 0, 0, [b"x" * 1000])
        assert ev.wait(5)
        c.close()
    finally:
        e.close()


def test_parse_address_errors():
    with pytest.raises(ValueError, match="expected 'unix:PATH' or 'tcp:HOST:PORT'"):
        parse_address("http://x")
    with pytest.raises(ValueError, match="bad tcp address"):
        parse_address("tcp:nohost")
    with pytest.raises(TypeError):
        parse_address(5)


def test_worker_with_wrong_secret_is_refused_by_a_controller():
    from mesharray.runtime.controller import Controller

    ctl = Controller()
    try:
        with pytest.raises(AuthenticationError):
            connect(ctl.address, b"wrong" * 8)
        assert ctl.workers == {}
    finally:
        ctl.stop()


class Gated:
    """A listener whose reader handles frames only once ``gate`` is set (a busy peer)."""

    def __init__(self, kind="unix"):
        self.gate = threading.Event()
        self.frames = []
        self.conns = []
        self.done = threading.Event()
        self.expect = None
        self.listener = Listener(SECRET, self._on_socket, kind=kind)

    def _on_socket(self, sock):
        c = Connection(sock, handler=self._on_frame, name="gated")
        self.conns.append(c)
        c.start()

    def _on_frame(self, conn, kind, flags, msg_id, target, view, payload):
        self.gate.wait(20)
        self.frames.append((msg_id, bytes(payload)))
        if self.expect is not None and len(self.frames) >= self.expect:
            self.done.set()

    def close(self):
        self.gate.set()
        self.listener.close()
        for c in self.conns:
            c.close()


def test_a_send_to_a_busy_peer_does_not_block_the_sender_nor_other_peers():
    busy, idle = Gated(), Echo()
    try:
        slow = Connection(connect(busy.listener.address, SECRET), name="to-busy")
        fast, got, ev = _client(idle.listener.address)
        frame = b"x" * 4000
        n = 4000  # 16 MB: far more than the socket buffers hold while the peer does not read
        busy.expect = n
        t0 = time.monotonic()
        for i in range(n):
            slow.send(1, 0, i, 0, 0, [frame])
        assert time.monotonic() - t0 < 5
        assert slow.backlog_bytes > 0  # the rest waits in the backlog, not in the sender
        fast.send(2, 0, 7, 0, 0, [b"ping"])
        assert ev.wait(5) and bytes(got[0][5]) == b"ping"
        busy.gate.set()
        assert busy.done.wait(20)
        # everything arrived, in order, once the peer read it
        assert [m for m, _ in busy.frames] == list(range(n))
        assert all(p == frame for _, p in busy.frames)
        deadline = time.monotonic() + 5
        while slow.backlog_bytes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert slow.backlog_bytes == 0
        slow.close()
        fast.close()
    finally:
        busy.close()
        idle.close()


def test_a_large_frame_returns_once_the_socket_has_its_borrowed_buffers():
    import numpy as np

    mine, peer = socket.socketpair()
    c = Connection(mine, name="to-sleeper")
    received = bytearray()

    def read_later():  # a peer that reads nothing for half a second
        time.sleep(0.5)
        while len(received) < 24 + (8 << 20):
            chunk = peer.recv(1 << 20)
            if not chunk:
                break
            received.extend(chunk)

    reader = threading.Thread(target=read_later)
    try:
        data = np.arange(8 << 20, dtype=np.uint8)  # 8 MiB, written without a copy
        reader.start()
        t0 = time.monotonic()
        c.send(1, 0, 1, 0, 0, [memoryview(data)])
        # the caller may reuse its buffer as soon as send returns: it waited for the peer
        assert time.monotonic() - t0 > 0.3
        data[:] = 0
        reader.join(10)
        assert bytes(received[24:]) == np.arange(8 << 20, dtype=np.uint8).tobytes()
    finally:
        c.close()
        peer.close()
        reader.join(10)


def test_backlog_is_bounded_and_a_closed_peer_fails_the_waiting_sender(monkeypatch):
    from mesharray.errors import TransportError
    from mesharray.transport import connection

    monkeypatch.setattr(connection, "BACKLOG_MAX", 1 << 20)
    busy = Gated()
    try:
        c = Connection(connect(busy.listener.address, SECRET), name="to-busy")
        failed = []

        def flood():
            try:
                for i in range(10_000):
                    c.send(1, 0, i, 0, 0, [b"y" * 4000])
            except TransportError as exc:
                failed.append(exc)

        t = threading.Thread(target=flood)
        t.start()
        time.sleep(0.5)
        assert t.is_alive()  # waits: the backlog is over its bound
        assert c.backlog_bytes <= (1 << 20) + 4100
        c.close()  # closing wakes the waiting sender with an error, not a hang
        t.join(5)
        assert not t.is_alive() and failed
    finally:
        busy.close()


def test_a_corked_reply_to_a_large_frame_goes_out_at_once():
    """A reader that corks its reply to a frame larger than its receive buffer flushes it before reading on.

    (It used to wait for the next uncorked frame, a worker's heartbeat: a 64 MiB argument to
    another host with a small result took 0.3-0.5 s instead of 60 ms.)
    """
    a, b = socket.socketpair()

    def on_server(conn, kind, flags, msg_id, target, view, payload):
        conn.send(kind, flags, msg_id, target, view, [str(len(payload)).encode()], cork=True)

    server = Connection(a, handler=on_server, name="server")
    client, got, ev = None, [], threading.Event()

    def on_client(conn, *frame):
        got.append(frame)
        ev.set()

    client = Connection(b, handler=on_client, name="client")
    server.start()
    client.start()
    try:
        big = b"x" * (8 << 20)  # far over the receive buffer: the large-frame path
        client.send(1, 0, 7, 0, 0, [big])
        assert ev.wait(5), "the corked reply never left the server"
        assert bytes(got[0][-1]) == str(len(big)).encode()
    finally:
        client.close()
        server.close()
