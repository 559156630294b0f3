"""A reader thread that polls its socket before blocking (``set_read_spin``), and the spin
settings' copies that the per-message paths read."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from mesharray.transport import connection, poller
from mesharray.transport import spin as policy
from mesharray.transport.connection import Connection
from mesharray.transport.spin import _spin_recv, set_read_spin, set_reply_spin

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


def test_a_poll_that_finds_nothing_backs_off_and_a_message_while_polling_resets_it(spin):
    spin(50e-6)
    a, b = socket.socketpair()
    conn = Connection(a, name="backoff")
    conn._init_reading()  # (what start() does before its reader thread reads)
    buf = bytearray(16)
    try:
        late = threading.Timer(0.3, b.send, (b"x",))
        late.start()
        assert _spin_recv(conn, a, buf) == 1  # polled 50 µs, then blocked until it came (0.3 s)
        late.join()
        assert (conn._spin_backoff, conn._spin_skip) == (1, 1)
        b.send(b"y")
        assert _spin_recv(conn, a, buf) == 1  # (skipped: a blocking read)
        assert (conn._spin_backoff, conn._spin_skip) == (1, 0)
        # (8 -> 16 -> 32 are the same step, not timed: from 32 it doubles to the cap, and stays)
        for expect, preset in ((2, None), (4, None), (8, None), (64, 32), (64, None)):
            if preset is not None:
                conn._spin_backoff = preset
            late = threading.Timer(0.3, b.send, (b"z",))
            late.start()
            assert _spin_recv(conn, a, buf) == 1
            late.join()
            assert conn._spin_backoff == expect
            for _ in range(conn._spin_skip):
                b.send(b"s")
                _spin_recv(conn, a, buf)
        b.send(b"w")
        assert _spin_recv(conn, a, buf) == 1  # there while polling: polls every read again
        assert (conn._spin_backoff, conn._spin_skip) == (0, 0)
    finally:
        conn.close()
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


@pytest.mark.skipif(not hasattr(os, "sched_yield"), reason="no sched_yield on this system")
def test_the_end_of_a_spin_returns_the_eof(spin):
    spin(100e-6)
    a, b = socket.socketpair()
    conn = Connection(a, name="eof")
    conn._init_reading()
    try:
        threading.Timer(0.3, b.close).start()
        assert _spin_recv(conn, a, bytearray(8)) == 0  # the peer closed: recv's 0, as without polling
    finally:
        conn.close()
