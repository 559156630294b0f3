"""``/proc/<pid>/stat``: the one parser (below every layer that needs it).

Fields after the parenthesised command name (which may itself hold spaces and
parentheses, hence the split at the *last* ``)``), numbered as in ``proc(5)``
from field 3 (the state) on.
"""

from __future__ import annotations

__all__ = ["stat_fields", "start_time", "state"]


def stat_fields(pid: int) -> list[bytes] | None:
    """Fields 3.. of ``/proc/<pid>/stat`` (``[0]`` is the state); ``None`` if unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:].split()
    except (OSError, ValueError):
        return None


def start_time(pid: int) -> int:
    """The process's start time (clock ticks since boot, field 22); 0 if unknown."""
    fields = stat_fields(pid)
    try:
        return int(fields[19]) if fields is not None else 0
    except (ValueError, IndexError):
        return 0


def state(pid: int) -> bytes | None:
    """The one-letter state (``b"R"``, ``b"S"``, ``b"Z"``, ...); ``None`` if unknown."""
    fields = stat_fields(pid)
    return fields[0][:1] if fields else None
