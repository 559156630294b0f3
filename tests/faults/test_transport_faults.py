"""Fault suite, transport: F6-F11, and the transport items of issue 10.

F6 partition (reset, blackhole), F7 lost request vs lost reply, F8 malformed
frames, F9 oversized frames (sender and receiver), F10 hostile handshakes
(wrong secret, replay, reflection, slow-loris, idle floods), F11 where
listeners bind; plus the uid check on unix sockets, the listener that no
exception ends, and the fault-injection hook (``Connection.inject``) the
partition cases use. Each case: what the user sees, within its bound, and that
the rest keeps working. Every test has a timeout and leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import tracemalloc

import numpy as np
import psutil
import pytest

import mesharray as ma
from mesharray._core import pack_header
from mesharray.errors import AuthenticationError, BrokenTransportError, SerializationError
from mesharray.runtime import protocol as P
from mesharray.transport import auth, framing
from mesharray.transport.address import connect, parse_address
from mesharray.transport.connection import Connection
from mesharray.transport.listener import Listener
from tests.support.actors import Faulty

pytestmark = pytest.mark.timeout(90)

SECRET = b"k" * 32
MiB = 1 << 20


# -- helpers -------------------------------------------------------------------------------
def _ctl(procs):
    return procs._root.controller


def _conn_to(procs, rank: int) -> Connection:
    """The controller's connection to ``rank`` (its calls go out and its replies come back on it)."""
    return _ctl(procs).workers[rank].conn.conn


def _closed_by_peer(s: socket.socket, timeout: float = 5.0) -> bool:
    s.settimeout(timeout)
    try:
        while True:
            data = s.recv(4096)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def _raw(address: str) -> socket.socket:
    fam, addr = parse_address(address)
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.connect(addr)
    return s


def _mac(tag: bytes, a: bytes, b: bytes, secret: bytes = SECRET) -> bytes:
    return hmac.new(secret, tag + a + b, hashlib.sha256).digest()


class Server:
    """A listener whose connections record (and echo) every frame; thread or poll mode."""

    def __init__(self, polled: bool = False, limit: int | None = None, **listener_kw) -> None:
        self.conns: list[Connection] = []
        self.frames: list = []
        self.closed: list = []
        self.polled = polled
        self.limit = limit
        self.listener = Listener(SECRET, self._on_socket, **listener_kw)

    def _on_socket(self, sock: socket.socket) -> None:
        c = Connection(sock, handler=self._on_frame, on_close=lambda c, e: self.closed.append(e),
                       limit=self.limit, name="server")
        self.conns.append(c)
        if self.polled:
            c.start_polled()
        else:
            c.start()

    def _on_frame(self, conn, kind, flags, msg_id, target, view, payload) -> None:
        self.frames.append((kind, bytes(payload)))
        conn.send(kind, flags, msg_id, target, view, [bytes(payload)])

    def works(self) -> bool:
        """A real client still gets through: handshake, a frame out, its echo back."""
        got = threading.Event()
        c = Connection(connect(self.listener.address, SECRET), handler=lambda *f: got.set(), name="client")
        c.start()
        try:
            c.send(1, 0, 1, 0, 0, [b"ping"])
            return got.wait(5)
        finally:
            c.close()

    def close(self) -> None:
        self.listener.close()
        for c in self.conns:
            c.close()


@pytest.fixture
def server():
    s = Server()
    yield s
    s.close()


def _wait(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# -- the fault-injection hook ------------------------------------------------------------
def test_inject_drops_and_delays_frames_and_is_off_by_default(server):
    got = []
    c = Connection(connect(server.listener.address, SECRET), handler=lambda conn, *f: got.append(f[0]), name="c")
    c.start()
    try:
        assert "send" not in vars(c) and c.handler.__name__ == "<lambda>"  # off: class code paths only
        c.inject(drop_out=lambda kind: kind == 2)
        c.send(2, 0, 1, 0, 0, [b"lost"])
        c.send(3, 0, 2, 0, 0, [b"kept"])
        assert _wait(lambda: got == [3]) and c.dropped_out == 1
        c.inject(drop_in=True)
        c.send(4, 0, 3, 0, 0, [b"echo lost"])
        assert _wait(lambda: c.dropped_in == 1) and got == [3]
        c.inject(delay=0.2)
        t0 = time.monotonic()
        c.send(5, 0, 4, 0, 0, [b"late"])
        assert time.monotonic() - t0 >= 0.2
        assert _wait(lambda: got == [3, 5])
        c.inject()  # off again: nothing of the hook is left on the instance
        assert "send" not in vars(c) and c.handler.__name__ == "<lambda>"
        c.send(6, 0, 5, 0, 0, [b"normal"])
        assert _wait(lambda: got == [3, 5, 6])
    finally:
        c.close()


# -- F6: partition -----------------------------------------------------------------------------
def test_F6_reset_connection_fails_pending_calls_fast():
    with ma.proc_mesh(procs=2, forward_logs=False) as procs:
        a = procs.spawn("a", Faulty)
        assert a.slice(procs=1).echo.call_one(1).get(timeout=10) == 1
        pending = a.slice(procs=1).sleep.call_one(30)
        conn = _conn_to(procs, 1)
        t0 = time.monotonic()
        conn.sock.shutdown(socket.SHUT_RDWR)  # the link is cut under a call in flight
        with pytest.raises((ma.ActorDiedError, BrokenTransportError)) as info:
            pending.get(timeout=10)
        assert time.monotonic() - t0 < 2.0
        assert "rank 1" in str(info.value)
        assert a.slice(procs=0).echo.call_one(7).get(timeout=10) == 7  # the other rank is unaffected


def test_F6_tcp_reset_is_a_broken_transport_error():
    accepted: list[socket.socket] = []
    lst = Listener(SECRET, accepted.append, kind="tcp")
    try:
        closed = []
        c = Connection(connect(lst.address, SECRET), handler=lambda *f: None,
                       on_close=lambda conn, exc: closed.append(exc), name="client")
        c.start()
        assert _wait(lambda: accepted)
        srv = accepted[0]
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        srv.close()  # an RST, as from a peer host that lost the connection's state
        assert _wait(lambda: closed, 2.0)
        assert isinstance(closed[0], BrokenTransportError)
        with pytest.raises((BrokenTransportError, ma.errors.ClosedTransportError)):
            c.send(1, 0, 2, 0, 0, [b"after"])
        c.close()
    finally:
        lst.close()


def test_F6_blackhole_is_bounded_and_runs_nothing_twice():
    with ma.proc_mesh(procs=2, forward_logs=False, heartbeat_timeout=2.0) as procs:
        a = procs.spawn("a", Faulty)
        victim = a.slice(procs=1)
        assert victim.recorded.call_one().get(timeout=10) == []
        conn = _conn_to(procs, 1)
        conn.inject(drop_out=True, drop_in=True)  # every frame either way is lost
        fut = victim.record.call_one(1)
        t0 = time.monotonic()
        with pytest.raises((TimeoutError, ma.SupervisionError)):
            fut.get(timeout=8)
        assert time.monotonic() - t0 < 9
        assert conn.dropped_out >= 1
        conn.inject()
        assert a.slice(procs=0).echo.call_one(5).get(timeout=10) == 5
        # the request was lost, and nothing re-sent it: rank 1 never ran it (if it is still
        # there: the heartbeat machinery may have declared it dead meanwhile)
        try:
            seen = victim.recorded.call_one().get(timeout=10)
        except ma.SupervisionError:
            return
        assert seen == []


# -- F7: lost request vs lost reply --------------------------------------------------------------
@pytest.mark.parametrize("lost", ["request", "reply"])
def test_F7_lost_request_or_reply_says_the_call_may_have_run(lost):
    with ma.proc_mesh(procs=2, forward_logs=False) as procs:
        a = procs.spawn("a", Faulty)
        victim = a.slice(procs=1)
        assert victim.recorded.call_one().get(timeout=10) == []
        conn = _conn_to(procs, 1)
        if lost == "request":
            conn.inject(drop_out=lambda kind: kind == P.CALL)
        else:
            conn.inject(drop_in=lambda kind: kind == P.REPLY)
        fut = victim.record.call_one(1)
        with pytest.raises(TimeoutError, match="the call may have run on rank 1"):
            fut.get(timeout=1.0)
        conn.inject()
        assert not fut.done()  # still pending: a late reply would complete it
        # what actually happened, which the caller could not know: never twice
        assert victim.recorded.call_one().get(timeout=10) == ([] if lost == "request" else [1])
        assert a.slice(procs=0).echo.call_one(3).get(timeout=10) == 3


# -- F8: malformed frames --------------------------------------------------------------------
def _header(magic=0x4D41, kind=1, flags=0, length=0, msg_id=0, target=0, view=0) -> bytes:
    return struct.pack("<HBBIQII", magic, kind, flags, length, msg_id, target, view)


MALFORMED = {
    "bad magic": _header(magic=0xDEAD),
    "bad kind": _header(kind=0),
    "garbage": os.urandom(4096),
    "over the limit": _header(length=(1 << 32) - 1),
}


@pytest.mark.parametrize("case", [*MALFORMED, "truncated"])
@pytest.mark.parametrize("side", ["worker", "controller"])
def test_F8_malformed_frames_close_that_connection_only(case, side, caplog):
    with ma.proc_mesh(procs=2, forward_logs=False) as procs:
        a = procs.spawn("a", Faulty)
        pids = a.pid.call().get(timeout=10).tolist()
        ctl = _ctl(procs)
        address = ctl.address if side == "controller" else procs._root.addresses[1]
        with caplog.at_level(logging.WARNING, logger="mesharray.transport"):
            s = connect(address, ctl.secret)
            if case == "truncated":  # a frame cut short: the peer goes away mid-payload
                s.sendall(_header(kind=P.HEARTBEAT, length=1000) + b"x" * 100)
                s.close()
            else:
                s.sendall(MALFORMED[case])
                assert _closed_by_peer(s), f"{case}: the connection should have been dropped"
                s.close()
        # the server is healthy: the mesh works, nobody died, and a new client gets in
        assert a.pid.call().get(timeout=10).tolist() == pids
        assert a.echo.call(2).get(timeout=10).tolist() == [[2, 2]]
        connect(address, ctl.secret).close()


# -- F9: oversized frames ----------------------------------------------------------------------
def test_F9_sender_refuses_a_frame_over_the_limit_and_the_receiver_lives(monkeypatch):
    monkeypatch.setenv("MESHARRAY_MAX_FRAME", str(MiB))  # the workers' limit
    monkeypatch.setattr(framing, "max_frame_size", MiB)  # the controller's
    with ma.proc_mesh(procs=2, forward_logs=False) as procs:
        a = procs.spawn("a", Faulty)
        one = a.slice(procs=1)
        pid = one.pid.call_one().get(timeout=10)
        big = b"x" * (2 * MiB)
        msg = rf"message of \d+ bytes is over the frame limit of {MiB} bytes \(MESHARRAY_MAX_FRAME\)"
        with pytest.raises(SerializationError, match=msg):
            one.length.call_one(big)
        with pytest.raises(SerializationError, match=msg):
            a.length.call(big)
        with pytest.raises(SerializationError, match=msg):
            a.length.broadcast(big)
        # a large buffer travels out of band (shared memory), not in the frame
        assert one.length.call_one(np.zeros(2 * MiB, np.uint8)).get(timeout=10) == 2 * MiB
        # a reply over the limit: the worker refuses to send it and says so
        with pytest.raises(ma.ActorError, match="over the frame limit") as info:
            one.make.call_one(2 * MiB).get(timeout=10)
        assert isinstance(info.value.exception, TypeError)
        # its telemetry row counts no reply bytes (refused when pickled: framing.dumps checks the limit)
        rows = procs.telemetry.sql("SELECT max(bytes_out) AS bo FROM messages WHERE endpoint = 'make'")
        assert rows[0]["bo"] == 0
        # the receiving actors live on, nothing was lost on their connections
        assert one.pid.call_one().get(timeout=10) == pid
        assert a.echo.call(4).get(timeout=10).tolist() == [[4, 4]]
        assert not _ctl(procs).workers[1].conn.pending


def test_F9_header_over_the_limit_is_refused_before_allocation(caplog):
    s = Server(limit=MiB)
    try:
        with caplog.at_level(logging.WARNING, logger="mesharray.transport"):
            raw = connect(s.listener.address, SECRET)
            tracemalloc.start()
            try:
                raw.sendall(pack_header(1, 0, (1 << 32) - 1))  # claims 4 GiB
                assert _closed_by_peer(raw)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            raw.close()
        assert peak < 4 * MiB
        assert f"exceeds the limit of {MiB} bytes" in caplog.text
        assert s.works()
    finally:
        s.close()


@pytest.mark.parametrize("polled", [False, True])
def test_F9_lying_length_costs_what_arrived_not_what_it_claims(polled):
    """Item 5: a header within the limit that claims 2 GiB and sends 3 MiB makes the receiver
    hold ~what it received (plus a bounded chunk), not 2 GiB."""
    s = Server(polled=polled)
    try:
        raw = connect(s.listener.address, SECRET)
        assert _wait(lambda: s.conns)
        tracemalloc.start()
        try:
            raw.sendall(pack_header(1, 0, (1 << 31) - 1) + b"y" * (3 * MiB))
            time.sleep(0.5)  # let the reader take what came
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 16 * MiB, f"{peak / MiB:.0f} MiB allocated for 3 MiB received"
        raw.close()  # the frame never completes: the connection ends without a handler call
        assert _wait(lambda: s.closed)
        assert s.frames == []
        assert s.works()
        # and a real large frame still arrives whole
        got = threading.Event()
        frames = []
        c = Connection(connect(s.listener.address, SECRET),
                       handler=lambda conn, *f: (frames.append(bytes(f[-1])), got.set()), name="c")
        c.start()
        big = os.urandom(1 << 10) * (5 << 10)  # 5 MiB: several growth steps
        c.send(1, 0, 1, 0, 0, [big])
        assert got.wait(10) and frames[0] == big
        c.close()
    finally:
        s.close()


def test_F9_lying_headers_neither_bloat_a_worker_nor_stall_the_controller():
    with ma.proc_mesh(procs=2, forward_logs=False) as procs:
        a = procs.spawn("a", Faulty)
        ctl = _ctl(procs)
        pid = a.slice(procs=1).pid.call_one().get(timeout=10)
        worker = psutil.Process(pid)
        rss0 = worker.memory_info().rss
        me = psutil.Process()
        my_rss0 = me.memory_info().rss
        liars = [connect(procs._root.addresses[1], ctl.secret)]
        liars += [connect(ctl.address, ctl.secret) for _ in range(2)]  # read by the controller's poller
        for s in liars:
            s.sendall(pack_header(P.HEARTBEAT, 0, (1 << 31) - 1) + b"z" * MiB)
        worst = 0.0
        for _ in range(50):  # the controller keeps answering quickly meanwhile
            t0 = time.monotonic()
            a.slice(procs=0).echo.call_one(1).get(timeout=10)
            worst = max(worst, time.monotonic() - t0)
        time.sleep(0.3)
        assert worst < 1.0, f"a call took {worst:.2f} s while lying headers were read"
        assert worker.memory_info().rss - rss0 < 128 * MiB
        assert me.memory_info().rss - my_rss0 < 128 * MiB
        for s in liars:
            s.close()
        assert a.pid.call().get(timeout=10).tolist()[0][1] == pid  # nobody was declared dead


# -- F10: hostile handshakes --------------------------------------------------------------------
def test_F10_wrong_secret_is_refused_and_the_listener_keeps_serving(server):
    with pytest.raises(AuthenticationError):
        connect(server.listener.address, b"w" * 32)
    assert _wait(lambda: server.listener.refused == 1)
    assert server.works()


def test_F10_replayed_handshake_is_refused(server):
    # a genuine answer, recorded on one connection ...
    s1 = _raw(server.listener.address)
    ns1 = s1.recv(36)[4:]
    nc = os.urandom(32)
    answer = auth.MAGIC + nc + _mac(b"C", ns1, nc)
    s1.sendall(answer)
    assert s1.recv(32) == _mac(b"S", nc, ns1)
    # ... replayed on another: its server nonce differs, the MAC does not match
    s2 = _raw(server.listener.address)
    s2.recv(36)
    s2.sendall(answer)
    assert _closed_by_peer(s2)
    s1.close()
    s2.close()
    assert server.works()


def test_F10_reflected_nonce_is_refused(server):
    s = _raw(server.listener.address)
    ns = s.recv(36)[4:]
    s.sendall(auth.MAGIC + ns + _mac(b"C", ns, ns))  # our nonce sent back (even with a valid MAC)
    assert _closed_by_peer(s)
    s.close()
    assert server.works()


def test_F10_slow_loris_is_closed_at_the_whole_handshake_deadline():
    srv = Server(handshake_timeout=1.0)
    try:
        threads0 = threading.active_count()
        socks = [_raw(srv.listener.address) for _ in range(20)]
        for s in socks:
            s.recv(36)
            s.setblocking(False)
        t0 = time.monotonic()
        closed_at: dict = {}
        msg = auth.MAGIC + os.urandom(64)
        i = 0
        while len(closed_at) < len(socks) and time.monotonic() - t0 < 5:
            for s in socks:  # one byte each every 0.3 s: each recv alone would be in time
                if s in closed_at:
                    continue
                try:
                    s.send(msg[i:i + 1])
                    if s.recv(1) == b"":
                        closed_at[s] = time.monotonic() - t0
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError:
                    closed_at[s] = time.monotonic() - t0
            assert threading.active_count() <= threads0 + 1
            i += 1
            time.sleep(0.3)
        assert len(closed_at) == len(socks)
        assert max(closed_at.values()) < 2.5
        for s in socks:
            s.close()
        assert srv.works()
    finally:
        srv.close()


def test_F10_idle_sockets_make_no_threads_and_are_capped():
    srv = Server(max_handshakes=32, evict_after=0.05)
    try:
        threads0 = threading.active_count()
        idle = [_raw(srv.listener.address) for _ in range(400)]
        assert _wait(lambda: srv.listener.refused >= 400 - 32)
        assert srv.listener.pending_handshakes <= 32
        assert threading.active_count() <= threads0 + 1  # (+1: a reader a client may leave)
        assert srv.works()  # a real peer gets in while the idle ones are there
        for s in idle:
            s.close()
    finally:
        srv.close()


def test_F10_slow_real_peers_beyond_the_cap_wait_and_are_never_evicted():
    # a thousand workers starting at once on two cores: every peer answers, but late (here 0.3 s,
    # with 4 pending at most): the ones beyond the cap wait in the listen backlog, none is closed
    srv = Server(max_handshakes=4, evict_after=2.0)
    try:
        def slow_client(out: list) -> None:
            s = _raw(srv.listener.address)
            try:
                s.settimeout(10)
                hello = s.recv(4 + 32)
                time.sleep(0.3)
                nc = os.urandom(32)
                s.sendall(auth.MAGIC + nc + _mac(b"C", hello[4:], nc))
                out.append(s.recv(32) == _mac(b"S", nc, hello[4:]))
            except OSError as exc:
                out.append(exc)
            finally:
                s.close()

        out: list = []
        threads = [threading.Thread(target=slow_client, args=(out,)) for _ in range(16)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        assert out == [True] * 16
        assert srv.listener.refused == 0
        assert time.monotonic() - t0 >= 4 * 0.3 * 0.9  # (in rounds of 4: the cap held)
        assert srv.works()
    finally:
        srv.close()


def test_F10_handshake_settings_come_from_the_environment():
    assert Listener(SECRET, lambda s: s.close()).handshake_timeout == auth.HANDSHAKE_TIMEOUT
    out = subprocess.run([sys.executable, "-c", "from mesharray.transport import auth, listener; "
                          "print(auth.HANDSHAKE_TIMEOUT, listener.MAX_HANDSHAKES)"],
                         env={**os.environ, "MESHARRAY_HANDSHAKE_TIMEOUT": "2.5", "MESHARRAY_MAX_HANDSHAKES": "7"},
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["2.5", "7"]


def test_item3_listener_survives_failures_in_its_thread(monkeypatch, caplog):
    calls = {"n": 0}
    real = Listener._admit

    def flaky_admit(self, s):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated failure while admitting a peer")
        return real(self, s)

    monkeypatch.setattr(Listener, "_admit", flaky_admit)
    fail_handler = {"on": True}

    srv = Server()
    real_on_socket = srv._on_socket

    def on_socket(sock):
        if fail_handler["on"]:
            fail_handler["on"] = False
            raise RuntimeError("can't start new thread")
        real_on_socket(sock)

    srv.listener.on_connection = on_socket
    try:
        with caplog.at_level(logging.WARNING, logger="mesharray.transport"):
            with pytest.raises((AuthenticationError, BrokenTransportError, OSError)):
                connect(srv.listener.address, SECRET, timeout=2.0)  # refused: _admit failed
            s = connect(srv.listener.address, SECRET)  # authenticated; the handler fails
            assert _closed_by_peer(s)
            s.close()
        assert "simulated failure" in caplog.text and "can't start new thread" in caplog.text
        assert srv.works()
    finally:
        srv.close()


# -- F11: where listeners bind --------------------------------------------------------------------
def test_F11_listeners_are_local_by_default():
    u = Listener(SECRET, lambda s: s.close())
    t = Listener(SECRET, lambda s: s.close(), kind="tcp")
    try:
        assert u.address.startswith("unix:@")  # abstract: no file, same host only
        assert t.address.startswith("tcp:127.0.0.1:")
    finally:
        u.close()
        t.close()
    with ma.proc_mesh(procs=1, forward_logs=False) as procs:
        assert _ctl(procs).address.startswith("unix:@")
        assert all(a.startswith("unix:@") for a in procs._root.addresses)


def test_F11_every_interface_needs_a_secret_and_warns():
    with pytest.raises(ValueError, match="without a secret"):
        Listener(b"", lambda s: s.close(), kind="tcp", host="0.0.0.0")
    with pytest.raises(ValueError, match="without a secret"):
        Listener(b"", lambda s: s.close(), kind="tcp", host="")
    with pytest.warns(RuntimeWarning, match="every interface"):
        t = Listener(SECRET, lambda s: s.close(), kind="tcp", host="0.0.0.0")
    t.close()
    Listener(b"", lambda s: s.close(), kind="tcp", host="127.0.0.1").close()  # loopback: allowed


# -- item 4: the peer's uid on unix sockets --------------------------------------------------------
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to connect as another uid (setuid 65534)")
def test_item4_other_uid_is_refused_before_the_handshake(server, caplog):
    fam, addr = parse_address(server.listener.address)
    with caplog.at_level(logging.WARNING, logger="mesharray.transport"):
        pid = os.fork()
        if pid == 0:  # the child: become nobody, connect, see whether the handshake even starts
            code = 3
            try:
                os.setgid(65534)
                os.setuid(65534)
                s = socket.socket(fam, socket.SOCK_STREAM)
                s.connect(addr)
                s.settimeout(5)
                try:
                    code = 0 if s.recv(100) == b"" else 1  # 0: closed before any handshake byte
                except ConnectionResetError:
                    code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _wait(lambda: server.listener.refused == 1)
    assert "from uid 65534" in caplog.text
    assert server.works()  # our own uid (and root) still get in
