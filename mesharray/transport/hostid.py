"""Which host a process is on, for the runtime's "can these two share memory?" question.

Two processes may use shared memory (segments, cross-memory attach, the
shared-memory collectives) only when they are on one kernel, in one PID
namespace — and, when the user names hosts (``MESHARRAY_HOST_ID``, which host
agents set for their workers), under the same name. That last rule is what
lets tests and benchmarks run several "hosts" on one machine: agents with
different host ids never share memory, so everything between them takes the
network path a real cluster would.

- :func:`host_id` — the host's name, for people (``MESHARRAY_HOST_ID``, else the hostname).
- :func:`memory_domain` — an opaque key; equal keys mean memory can be shared.
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket

__all__ = ["host_id", "memory_domain"]


def host_id() -> str:
    """The host's name: ``MESHARRAY_HOST_ID`` if set, else the machine's hostname."""
    return os.environ.get("MESHARRAY_HOST_ID") or socket.gethostname()


@functools.lru_cache(maxsize=4)
def _machine(named: str) -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # no /proc (macOS): the hostname names the kernel; one PID namespace
        return f"{socket.gethostname()}|{named}"
    return f"{boot}:{ns}|{named}"


def memory_domain() -> str:
    """A short key equal for exactly the processes that may share memory with this one.

    Computed once per ``MESHARRAY_HOST_ID`` (a process keeps its kernel and PID namespace),
    so a zygote that asks before it forks answers for its forks too.

    Examples
    --------
    >>> len(memory_domain())
    16
    """
    return _domain(os.environ.get("MESHARRAY_HOST_ID", ""))


@functools.lru_cache(maxsize=4)
def _domain(named: str) -> str:
    return hashlib.sha256(_machine(named).encode()).hexdigest()[:16]
