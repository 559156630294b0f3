"""A reader thread that polls its socket before blocking (``set_read_spin``), and the spin
settings' copies that the per-message paths read."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from mesharray.errors import BrokenTransportError
from mesharray.transport import connection, poller
from mesharray.transport import spin as policy
from mesharray.transport._wire import spin_recv
from mesharray.transport.connection import Connection
from mesharray.transport.spin import set_read_spin, set_reply_spin

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def spin():
    """The process's read spin, set by the test and put back after it."""
    before = policy._spin
    yield set_read_spin
    set_read_spin(before)


def test_a_polling_reader_gets_every_frame_in_order(spin):
    spin(200e-6)
    a, b = socket.socketpair()
    got: list[bytes] = []
    done = threading.Event()

    def on(conn, kind, flags, msg_id, target, view, payload):
        got.append(bytes(payload))
        if len(got) == 3000:
            done.set()

    reader = Connection(a, handler=on, name="polling")
    reader.start()
    writer = Connection(b, name="writer")
    try:
        for i in range(3000):
            writer.send(1, 0, i, 0, 0, [b"%d" % i])
            if i % 7 == 0:
                time.sleep(0.0002 * (i % 3))  # gaps inside, at and past the spin
        assert done.wait(30)
        assert got == [b"%d" % i for i in range(3000)]
    finally:
        writer.close()
        reader.close()


def test_a_poll_that_finds_nothing_backs_off_and_a_message_while_polling_resets_it():
    # a reader thread's read (the compiled loop's): state is [reads left to block at once, back-off]
    a, b = socket.socketpair()
    buf = bytearray(16)
    st = [0, 0]
    try:
        late = threading.Timer(0.3, b.send, (b"x",))
        late.start()
        assert spin_recv(a, buf, 50e-6, st) == 1  # polled 50 µs, then blocked until it came (0.3 s)
        late.join()
        assert st == [1, 1]
        b.send(b"y")
        assert spin_recv(a, buf, 50e-6, st) == 1  # (skipped: a blocking read)
        assert st == [0, 1]
        # (8 -> 16 -> 32 are the same step, not timed: from 32 it doubles to the cap, and stays)
        for expect, preset in ((2, None), (4, None), (8, None), (64, 32), (64, None)):
            if preset is not None:
                st[1] = preset
            late = threading.Timer(0.3, b.send, (b"z",))
            late.start()
            assert spin_recv(a, buf, 50e-6, st) == 1
            late.join()
            assert st[1] == expect
            for _ in range(st[0]):
                b.send(b"s")
                spin_recv(a, buf, 50e-6, st)
        b.send(b"w")
        assert spin_recv(a, buf, 50e-6, st) == 1  # there while polling: polls every read again
        assert st == [0, 0]
        b.send(b"v")
        assert spin_recv(a, buf, 0.0, st) == 1 and st == [0, 0]  # no spin: a blocking read, no state
    finally:
        a.close()
        b.close()


def test_a_negative_spin_is_refused(spin):
    before = policy._spin
    with pytest.raises(ValueError, match="read spin must be >= 0 seconds, got -1"):
        spin(-1)
    assert policy._spin == connection._spin == before


def test_the_setters_keep_every_copy_the_hot_paths_read(spin):
    # Connection's reads and the callers' waits test a setting as a global of their own module
    # (no attribute lookup per message): each setter must update those copies too
    before = policy._reply_spin
    try:
        spin(123e-6)
        set_reply_spin(45e-6)
        for module in (policy, connection, poller):
            assert (module._spin, module._reply_spin) == (123e-6, 45e-6), module.__name__
        with pytest.raises(ValueError, match="reply spin must be >= 0 seconds, got -1"):
            set_reply_spin(-1)
        assert poller._reply_spin == connection._reply_spin == 45e-6
    finally:
        set_reply_spin(before)


def test_the_end_of_a_spin_returns_the_eof():
    a, b = socket.socketpair()
    try:
        threading.Timer(0.3, b.close).start()
        assert spin_recv(a, bytearray(8), 100e-6, [0, 0]) == 0  # the peer closed: recv's 0, as without polling
    finally:
        a.close()


def test_a_reader_thread_takes_a_new_spin_at_its_next_read(spin):
    # the compiled loop reads the setting on every read: a worker's set_spin after its
    # connections started applies to them
    a, b = socket.socketpair()
    got: list[bytes] = []
    reader = Connection(a, handler=lambda conn, kind, f, m, t, v, p: got.append(bytes(p)), name="r")
    reader.start()
    writer = Connection(b, name="w")
    try:
        spin(0.0)
        writer.send(1, 0, 1, 0, 0, [b"blocking"])
        _until(lambda: len(got) == 1)
        spin(300e-6)
        for i in range(200):
            writer.send(1, 0, i, 0, 0, [b"%d" % i])
        _until(lambda: len(got) == 201)
        assert got[1:] == [b"%d" % i for i in range(200)]
    finally:
        writer.close()
        reader.close()


def test_a_socket_with_a_timeout_ends_its_reader_when_nothing_comes():
    a, b = socket.socketpair()
    a.settimeout(0.2)
    ended = threading.Event()
    reader = Connection(a, handler=lambda *f: None, on_close=lambda conn, exc: ended.set(), name="quiet")
    reader.start()
    try:
        assert ended.wait(10)
        assert isinstance(reader.closed_error, BrokenTransportError) and "timed out" in str(reader.closed_error)
    finally:
        reader.close()
        b.close()


def _until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def _switches(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts a thread's context switches in /proc (Linux)")
def test_a_reader_that_replied_sleeps_through_its_peer_reading_the_reply():
    # A thread asleep in recv on a unix socket used to wake each time the peer read a message
    # that this process had written there (the kernel's write-space wake-up), then sleep again:
    # a second context switch per call on every worker. After a reply, the reader now waits in a
    # poll for input. Here a connection's reader thread answers each frame at once, as a worker
    # does, and the peer reads the answer 5 ms later, while the reader waits for the next frame.
    a, b = socket.socketpair()
    tid: list[int] = []

    def answer(conn, kind, flags, msg_id, target, view, payload):
        if not tid:
            tid.append(threading.get_native_id())
        conn.send(2, 0, msg_id, 0, 0, [b"ok"])

    reader = Connection(a, handler=answer, name="answering")
    reader.start()
    writer = Connection(b, name="asking")
    try:
        writer.send(1, 0, 0, 0, 0, [b"first"])
        assert len(b.recv(64)) > 0  # (its answer: the reader thread is known)
        time.sleep(0.05)
        before = _switches(tid[0])
        for i in range(1, 41):
            writer.send(1, 0, i, 0, 0, [b"again"])
            time.sleep(0.005)  # (answered, and waiting again)
            assert len(b.recv(64)) > 0
            time.sleep(0.002)
        per_frame = (_switches(tid[0]) - before) / 40
        assert per_frame < 1.5, f"the reader slept {per_frame:.2f} times per frame (1: only for the next frame)"
    finally:
        writer.close()
        reader.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts a thread's context switches in /proc (Linux)")
def test_a_blocked_reader_sleeps_through_its_peer_reading_what_it_wrote():
    # spin_recv's wait, polled first: the peer's reads of what this side wrote do not wake it
    a, b = socket.socketpair()
    buf = bytearray(64)
    got: list[int] = []
    tid: list[int] = []

    def read() -> None:
        tid.append(threading.get_native_id())
        got.append(spin_recv(a, buf, 0.0, [0, 0]))

    t = threading.Thread(target=read, daemon=True)
    try:
        t.start()
        while not tid:
            time.sleep(0.001)
        time.sleep(0.05)  # (asleep in its wait by now)
        before = _switches(tid[0])
        for _ in range(50):
            a.send(b"x" * 32)  # what this side wrote, read by the peer while the reader waits
            assert b.recv(64) == b"x" * 32
            time.sleep(0.001)
        woken = _switches(tid[0]) - before
        b.send(b"end")
        t.join(10)
        assert got == [3] and bytes(buf[:3]) == b"end"
        assert woken <= 5, f"the waiting reader woke {woken} times for 50 reads of its peer"
    finally:
        a.close()
        b.close()
