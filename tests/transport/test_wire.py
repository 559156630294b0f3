"""The compiled per-message read and write of a connection (``mesharray.transport._wire``).

``Connection._read_polled`` (a polled connection's read: every reply of a
``call()``, every frame a relay forwards or gathers) and ``Connection.write_frame``
(a ``call()``'s and a relay's frames) are compiled; their Python lived in
``connection.py``. What they must keep: frames whole and in order across
partial reads and writes, large frames, the backlog when a peer's socket is
full, and each failure reported as the connection's.
"""

from __future__ import annotations

import ast
import logging
import mmap
import socket
import struct
import threading
import time
import types
from pathlib import Path

import pytest

from mesharray._core import pack_frame
from mesharray.errors import BrokenTransportError
from mesharray.transport import _wire
from mesharray.transport.connection import SMALL_FRAME, Connection

pytestmark = pytest.mark.timeout(60)


def test_the_stub_names_what_the_extension_has():
    tree = ast.parse((Path(__file__).resolve().parents[2] / "mesharray" / "transport" / "_wire.pyi").read_text())
    stub = {n.name: [a.arg for a in n.args.args] for n in tree.body if isinstance(n, ast.FunctionDef)}
    binary = {k: v for k, v in vars(_wire).items() if not k.startswith("_") and not isinstance(v, types.ModuleType)
              and callable(v) and not isinstance(v, type)}
    assert set(stub) == set(binary)
    for name, fn in binary.items():
        assert list(fn.__code__.co_varnames[:fn.__code__.co_argcount]) == stub[name], name
    # the class: every C field of Wire, and nothing else, annotated in the stub
    stub_cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Wire")
    fields = {a.target.id for a in stub_cls.body if isinstance(a, ast.AnnAssign)}
    fields |= {f.name for f in stub_cls.body if isinstance(f, ast.FunctionDef)}  # (properties)
    assert fields == {k for k, v in vars(_wire.Wire).items() if type(v).__name__ == "getset_descriptor"}
    assert {k for k, v in vars(_wire).items() if isinstance(v, type) and not k.startswith("_")} == {"Wire", "Beats"}
    beats = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Beats")
    assert {a.target.id for a in beats.body if isinstance(a, ast.AnnAssign)} == {
        k for k, v in vars(_wire.Beats).items() if type(v).__name__ == "getset_descriptor"}
    assert {f.name for f in beats.body if isinstance(f, ast.FunctionDef)} - {"__init__"} == {
        k for k in vars(_wire.Beats) if not k.startswith("_")} - {"interval", "sample_every"}


class _Polled:
    """A socketpair: ``a`` written with ``write_frame``, ``b`` read by the poller (``_read_polled``)."""

    def __init__(self, rcvbuf: int | None = None) -> None:
        sa, sb = socket.socketpair()
        if rcvbuf is not None:
            sb.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            sa.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, rcvbuf)
        self.got: list = []
        self.closed: list = []
        self.done = threading.Event()
        self.a = Connection(sa, name="writer")
        self.b = Connection(sb, handler=self._on, on_close=lambda c, e: (self.closed.append(e), self.done.set()),
                            name="reader")
        self.b.start_polled()

    def _on(self, conn, kind, flags, msg_id, target, view, payload):
        self.got.append((kind, msg_id, bytes(payload)))

    def wait_for(self, n: int, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.got) < n and time.monotonic() < deadline:
            time.sleep(0.002)
        assert len(self.got) >= n, f"{len(self.got)} of {n} frames"

    def close(self) -> None:
        self.a.close()
        self.b.close()


def _frame(msg_id: int, size: int) -> bytes:
    payload = bytes([msg_id % 251]) * size
    n, data = pack_frame(5, 0, msg_id, 0, 0, [payload], SMALL_FRAME, 1 << 30)
    assert data is not None and n == size
    return data


def test_frames_written_faster_than_the_peer_reads_arrive_whole_and_in_order():
    p = _Polled(rcvbuf=4096)  # (small buffers: the socket fills, and the rest of a frame waits in the backlog)
    try:
        sizes = [(i * 997) % SMALL_FRAME + 1 for i in range(400)]
        refused = 0
        for i, size in enumerate(sizes):
            f = _frame(i, size)
            if not p.a.write_frame(f):  # (a backlog is pending: the caller sends it as send would)
                refused += 1
                p.a.send(5, 0, i, 0, 0, [f[24:]])
        p.wait_for(len(sizes))
        assert [m for _, m, _ in p.got] == list(range(len(sizes)))
        assert all(body == bytes([m % 251]) * sizes[m] for _, m, body in p.got)
        assert p.a.frames_out == len(sizes) and refused > 0  # (the backlog was exercised)
    finally:
        p.close()


def test_write_frame_leaves_a_frame_to_send_while_frames_are_corked():
    p = _Polled()
    try:
        p.a.send(5, 0, 1, 0, 0, [b"first"], cork=True)
        assert p.a.write_frame(_frame(2, 3)) is False  # (would overtake the corked frame)
        p.a.send(5, 0, 2, 0, 0, [b"\x02" * 3])
        p.wait_for(2)
        assert [m for _, m, _ in p.got] == [1, 2]
    finally:
        p.close()


def test_a_frame_larger_than_the_receive_buffer_arrives_whole():
    p = _Polled()
    try:
        big = bytes(range(256)) * ((1 << 20) // 256 + 3)  # over the 256 KiB receive buffer
        p.a.send(5, 0, 1, 0, 0, [big])
        p.a.write_frame(_frame(2, 10))
        p.wait_for(2)
        assert p.got[0] == (5, 1, big) and p.got[1][1] == 2
    finally:
        p.close()


def test_the_peer_closing_ends_a_polled_connection_cleanly_and_writing_to_it_names_it():
    p = _Polled()
    try:
        p.a.write_frame(_frame(1, 8))
        p.wait_for(1)
        p.a.sock.close()  # (the peer goes away without a word)
        assert p.done.wait(10)
        assert p.closed == [None]  # an EOF: no error
        sa, sb = socket.socketpair()
        c = Connection(sa, name="to-a-dead-peer")
        sb.close()
        with pytest.raises(BrokenTransportError, match="to-a-dead-peer broke while sending"):
            for _ in range(3):
                c.write_frame(_frame(1, 8))
        c.close()
    finally:
        p.close()


def test_a_bad_frame_drops_the_connection_and_says_why(caplog):
    p = _Polled()
    try:
        with caplog.at_level(logging.WARNING, logger="mesharray.transport"):
            p.a.sock.sendall(b"\x00" * 24)  # magic 0
            assert p.done.wait(10)
        assert "bad frame from reader" in caplog.text
        assert p.closed and "magic" in str(p.closed[0])
    finally:
        p.close()


def test_a_reader_thread_hands_over_small_and_large_frames_in_order_and_ends_on_eof():
    # the compiled reader loop (_wire.read_loop): small frames in its buffer, a frame longer
    # than the buffer read by the connection's Python and back, then an EOF ends it cleanly
    sa, sb = socket.socketpair()
    got: list = []
    closed: list = []
    ended = threading.Event()

    def on_close(conn, exc):
        closed.append(exc)
        ended.set()

    reader = Connection(sb, handler=lambda conn, kind, f, m, t, v, p: got.append((m, bytes(p))), on_close=on_close,
                        name="reader")
    reader.start()
    writer = Connection(sa, name="writer")
    big = bytes(range(256)) * ((1 << 20) // 256 + 5)
    try:
        for i in range(50):
            writer.send(5, 0, i, 0, 0, [b"s%d" % i])
        writer.send(5, 0, 50, 0, 0, [big])
        for i in range(51, 100):
            writer.send(5, 0, i, 0, 0, [b"s%d" % i])
        deadline = time.monotonic() + 10
        while len(got) < 100 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert [m for m, _ in got] == list(range(100))
        assert got[50][1] == big and got[99][1] == b"s99"
        assert reader.bytes_in == sum(24 + len(p) for _, p in got)
        sa.close()  # (the peer goes away)
        assert ended.wait(10) and closed == [None]
    finally:
        reader.close()


def _run(beats) -> threading.Thread:
    t = threading.Thread(target=beats.run, daemon=True)
    t.start()
    return t


def test_heartbeats_go_into_the_slot_until_stopped_and_the_stop_is_immediate():
    seg = mmap.mmap(-1, 64)
    samples = []
    beats = _wire.Beats(time.monotonic, 0.01, lambda: samples.append(1), 3)
    beats.slot(seg, 16)
    t0 = time.monotonic()
    t = _run(beats)
    deadline = time.monotonic() + 10
    while len(samples) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    (beat,) = struct.unpack_from("=d", seg, 16)
    assert t0 < beat <= time.monotonic() and len(samples) >= 2  # (a sample every third beat)
    assert seg[:16] == bytes(16) and seg[24:] == bytes(40)  # (its slot alone)
    beats.interval = 60.0  # (the next wait would be a minute: the stop does not wait for it)
    time.sleep(0.05)
    s = time.monotonic()
    beats.stop()
    t.join(5)
    assert not t.is_alive() and time.monotonic() - s < 1.0
    beats.stop()  # (again: nothing)
    again = _run(beats)
    again.join(5)
    assert not again.is_alive()  # (a run after the stop ends at once)


def test_heartbeats_go_as_frames_without_a_slot_and_end_when_the_connection_breaks():
    p = _Polled()
    beats = _wire.Beats(time.monotonic, 0.01)
    sent = []

    def fallback():  # (what the worker gives: send, which raises once the connection is closed)
        sent.append(1)
        p.a.send(9)

    beats.to(p.a, pack_frame(9, 0, 0, 0, 0, [], SMALL_FRAME, 1 << 30)[1], fallback)
    t = _run(beats)
    try:
        p.wait_for(3)
        assert {k for k, _, _ in p.got} == {9} and not sent  # (written whole by the compiled path)
    finally:
        p.close()
    t.join(5)
    assert not t.is_alive() and sent  # (the connection closed: send raised, the loop returned)


def test_a_heartbeat_slot_outside_the_segment_or_a_bad_interval_is_refused():
    beats = _wire.Beats(time.monotonic, 0.5)
    seg = mmap.mmap(-1, 16)
    with pytest.raises(ValueError, match="offset 16 .* 16 bytes"):
        beats.slot(seg, 16)
    with pytest.raises(ValueError, match="offset 4 "):
        beats.slot(seg, 4)
    with pytest.raises(ValueError, match="offset 9223372036854775800 "):
        beats.slot(seg, 2**63 - 8)  # (past the end however the sum would wrap)
    beats.slot(seg, 8)
    with pytest.raises(ValueError, match="interval must be > 0 and finite seconds, got 0"):
        _wire.Beats(time.monotonic, 0.0)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="interval must be > 0 and finite"):
            beats.interval = bad
    assert beats.interval == 0.5  # (a refused value leaves the last one)
    with pytest.raises(ValueError, match="must be >= 1, got 0"):
        beats.sample_every = 0
