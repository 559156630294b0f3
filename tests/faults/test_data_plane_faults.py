"""Fault suite, data plane: F21 (a peer of a transfer dies) and issue item 6 (segments of a dead receiver)."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import psutil
import pytest

import mesharray as ma

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
        psutil.Process(pid).wait(timeout=10) if psutil.pid_exists(pid) else None
        t0 = time.monotonic()
        with pytest.raises(ma.ActorDiedError):
            b1.read_into(dst).get(timeout=10)
        assert time.monotonic() - t0 < 2.0
        # the live owner's buffer and actor still work
        b0.read_into(dst).get(timeout=10)
        assert dst[7] == 7.0
        assert k.slice(procs=0).keep.call_one(np.ones(4)).get(timeout=10) == 1
