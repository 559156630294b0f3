"""Fault suite, data plane: F21 (a peer of a transfer dies) and issue item 6 (segments of a dead receiver)."""

from __future__ import annotations

import os
import pickle
import signal
import time

import numpy as np
import psutil
import pytest

import mesharray as ma
from mesharray.transport import shm

pytestmark = pytest.mark.timeout(90)


class Keeper(ma.Actor):
    """Keeps what it receives (its shared-memory slots stay busy) and owns a Buffer."""

    def __init__(self) -> None:
        self.kept: list = []
        self.data = np.arange(1 << 20, dtype="float32")
        self.buf = ma.Buffer(self.data)

    @ma.endpoint
    def keep(self, a) -> int:
        self.kept.append(a)
        return len(self.kept)

    @ma.endpoint
    def pid(self) -> int:
        return os.getpid()

    @ma.endpoint
    def buffer(self) -> ma.Buffer:
        return self.buf


def _memfds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += "memfd:mesharray" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return n


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts memfds through /proc (Linux)")
def test_item6_segments_held_by_a_dead_receiver_are_freed():
    # 8 x 16 MiB kept by an actor that is then SIGKILLed: its busy bytes are never
    # cleared by it; the controller frees them when it learns of the death, and a
    # stopped mesh leaves at most MESHARRAY_SHM_KEEP (64 MiB) of free segments mapped
    shm.trim(0)  # (free segments earlier tests' meshes left in this process: up to 64 MiB of any size)
    after = []
    for _ in range(3):
        with ma.proc_mesh(procs=2, forward_logs=False) as procs:
            k = procs.spawn("k", Keeper).slice(procs=1)
            for i in range(8):
                k.keep.call_one(np.full(4 << 20, i, dtype="float32")).get(timeout=30)
            os.kill(k.pid.call_one().get(timeout=10), signal.SIGKILL)
            with pytest.raises(ma.ActorDiedError):
                k.keep.call_one(1).get(timeout=10)
        after.append(_memfds())
    assert after[-1] == after[0], f"memfds grew across meshes: {after}"
    assert after[-1] <= 2 * 3, f"{after[-1]} memfds left open after the meshes stopped"


def test_F21_buffer_read_from_a_dead_owner_fails_fast_and_the_mesh_lives():
    with ma.proc_mesh(procs=2, forward_logs=False) as procs:
        k = procs.spawn("k", Keeper)
        b0, b1 = np.asarray(k.buffer.call().get(timeout=10)).ravel().tolist()
        dst = np.empty(1 << 20, dtype="float32")
        b1.read_into(dst).get(timeout=10)
        assert dst[12345] == 12345.0
        pid = k.slice(procs=1).pid.call_one().get(timeout=10)
        os.kill(pid, signal.SIGKILL)
        try:
            psutil.Process(pid).wait(timeout=10)
        except psutil.NoSuchProcess:
            pass  # gone already: reaped by its parent between the kill and this look
        t0 = time.monotonic()
        with pytest.raises(ma.ActorDiedError):
            b1.read_into(dst).get(timeout=10)
        assert time.monotonic() - t0 < 2.0
        # the live owner's buffer and actor still work
        b0.read_into(dst).get(timeout=10)
        assert dst[7] == 7.0
        assert k.slice(procs=0).keep.call_one(np.ones(4)).get(timeout=10) == 1


def test_buffer_server_is_not_held_by_idle_or_slow_clients():
    # the same bounds as the control listener (item 3): a slow client's header is cut
    # at the handshake deadline, idle sockets cost no thread beyond a cap, and the
    # server keeps serving real readers
    import socket
    import threading

    from mesharray.transport import onesided
    from mesharray.transport.auth import HANDSHAKE_TIMEOUT

    data = np.ones(1 << 16, dtype="float32")
    buf = ma.Buffer(data)
    host, port = onesided._registry().server_address()

    # a client dribbling its header is cut at the deadline
    slow = socket.create_connection((host, port))
    t0 = time.monotonic()
    closed_after = None
    try:
        while time.monotonic() - t0 < HANDSHAKE_TIMEOUT + 4:
            try:
                slow.send(b"M")
                if slow.recv(1, socket.MSG_DONTWAIT) == b"":
                    closed_after = time.monotonic() - t0
                    break
            except BlockingIOError:
                pass
            except OSError:
                closed_after = time.monotonic() - t0
                break
            time.sleep(0.25)
    finally:
        slow.close()
    assert closed_after is not None, "a client dribbling its header held its connection past the deadline"
    assert HANDSHAKE_TIMEOUT - 1 <= closed_after <= HANDSHAKE_TIMEOUT + 3

    # a flood of idle sockets costs at most the cap in threads
    threads0 = threading.active_count()
    idle = [socket.create_connection((host, port)) for _ in range(200)]
    try:
        time.sleep(0.3)
        assert threading.active_count() <= threads0 + 64 + 2
    finally:
        for s in idle:
            s.close()
    time.sleep(0.5)

    # a real reader through the stream server itself (not the same-host fast path)
    handle = pickle.loads(pickle.dumps(buf))
    dst = np.zeros(1 << 16, dtype="float32")
    onesided._stream(handle._state, False, dst.ctypes.data, dst.nbytes)
    assert float(dst.sum()) == float(1 << 16)
