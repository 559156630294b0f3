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
from mesharray.transport.connection import Connection, Listener, connect, parse_address

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
