"""``/proc/<pid>/stat``: the one parser (below every layer that needs it), and the liveness
checks built on it (:func:`exists`: a signal 0; :func:`alive`: no zombie either).

Fields after the parenthesised command name (which may itself hold spaces and
parentheses, hence the split at the *last* ``)``), numbered as in ``proc(5)``
from field 3 (the state) on.

Where there is no ``/proc`` (macOS; ``MESHARRAY_PORTABLE=1``), :func:`state`
and :func:`start_time` ask :mod:`psutil` instead (a default dependency off
Linux); without it they know only whether the process exists.
"""

from __future__ import annotations

import os

from . import _platform

__all__ = ["stat_fields", "start_time", "state", "exists", "alive"]

# psutil's status names -> the letters of proc(5)
_PSUTIL_STATES = {"running": b"R", "sleeping": b"S", "disk-sleep": b"D", "stopped": b"T", "tracing-stop": b"t",
                  "zombie": b"Z", "dead": b"X", "idle": b"I", "waking": b"W", "parked": b"P", "locked": b"L",
                  "waiting": b"W"}


def _use_proc() -> bool:
    return _platform.LINUX_NATIVE and os.path.isdir("/proc/self")


def _psutil():
    try:
        import psutil
    except ImportError:
        return None
    return psutil


def stat_fields(pid: int) -> list[bytes] | None:
    """Fields 3.. of ``/proc/<pid>/stat`` (``[0]`` is the state); ``None`` if unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:].split()
    except (OSError, ValueError):
        return None


def start_time(pid: int) -> int:
    """The process's start time (clock ticks since boot, field 22); 0 if unknown.

    Without ``/proc``: psutil's creation time in hundredths of a second since
    the epoch. Either way only equality matters (is this still the same
    process?), and one job takes one way.
    """
    if not _use_proc():
        ps = _psutil()
        if ps is None:
            return 0
        try:
            return int(ps.Process(pid).create_time() * 100)
        except (ps.Error, OSError, ValueError):
            return 0
    fields = stat_fields(pid)
    try:
        return int(fields[19]) if fields is not None else 0
    except (ValueError, IndexError):
        return 0


def state(pid: int) -> bytes | None:
    """The one-letter state (``b"R"``, ``b"S"``, ``b"Z"``, ...); ``None`` if unknown or gone.

    Without ``/proc`` and psutil: ``b"?"`` for a process that exists (its
    state unknown), ``None`` for one that does not.
    """
    if not _use_proc():
        ps = _psutil()
        if ps is None:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return None
            except OSError:
                pass
            return b"?"
        try:
            return _PSUTIL_STATES.get(ps.Process(pid).status(), b"?")
        except (ps.Error, OSError, ValueError):
            return None
    fields = stat_fields(pid)
    return fields[0][:1] if fields else None


def exists(pid: int) -> bool:
    """Whether process ``pid`` exists: a signal 0 (a zombie exists; :func:`alive` tells those apart).

    A ``pid`` of 0 or less names no process yet (a peer that has not said
    its pid): nothing is known against it, so it counts as there.
    """
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is no zombie (a read of its stat; unknown state counts as alive)."""
    if pid <= 0:
        return True
    return exists(pid) and state(pid) not in (b"Z", b"X")
