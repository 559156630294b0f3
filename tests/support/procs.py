"""Helpers the multi-process tests share: a module's mesh fixture, whether a process is gone, waiting for a condition."""

from __future__ import annotations

import time

import pytest

import mesharray as ma


def mesh_fixture(**sizes):
    """A module-scoped ``procs`` fixture: one ``ma.proc_mesh(**sizes)`` for the module's tests, stopped after them.

    ``procs = mesh_fixture(hosts=2, procs=2)`` at a test module's top level.
    """

    @pytest.fixture(scope="module")
    def procs():
        mesh = ma.proc_mesh(**sizes)
        yield mesh
        mesh.stop()

    return procs


def gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (exited, or a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def wait_until(cond, timeout: float = 5.0, step: float = 0.02) -> bool:
    """Poll ``cond()`` every ``step`` seconds until it is true or ``timeout`` seconds passed; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return cond()
