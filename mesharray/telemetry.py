"""Telemetry: worker output forwarded to the controller, and runtime counters.

Log forwarding
--------------
A worker that owns its process (``run_worker(exit_process=True)``) replaces
its file descriptors 1 and 2 by pipes; a thread per pipe sends what is written
(by ``print``, ``logging``, C code, anything) to the controller as LOG frames.
The controller prints complete lines on its own ``sys.stdout`` /
``sys.stderr``, prefixed with the rank's coordinates in its process mesh, e.g.
``[procs=2] hello``. On by default; ``proc_mesh(..., forward_logs=False)``
leaves the workers' output on the terminal they inherited, unprefixed.

Counters
--------
:class:`Counters` counts replies, errors, spawns, deaths and forwarded log
bytes per process mesh; the process's router counts the calls and broadcasts
it sent. ``ProcMesh.stats()`` returns both as a dict.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

__all__ = ["Counters", "forward_process_output", "flush_forwarding", "LogSink", "set_worker_label"]

_threads: list[threading.Thread] = []
_label: str | None = None


def set_worker_label(label) -> None:
    global _label
    _label = label


def forward_process_output(conn) -> None:
    """Redirect fds 1 and 2 of this process to ``conn`` as LOG frames."""
    from .runtime import protocol as P

    for fd, stream in ((1, 1), (2, 2)):
        r, w = os.pipe()
        os.dup2(w, fd)
        os.close(w)

        def pump(r=r, stream=stream):
            while True:
                try:
                    data = os.read(r, 65536)
                except OSError:
                    return
                if not data:
                    os.close(r)
                    return
                try:
                    conn.send(P.LOG, 0, 0, stream, 0, [data])
                except ConnectionError:
                    return

        t = threading.Thread(target=pump, name=f"mesharray-log-{fd}", daemon=True)
        t.start()
        _threads.append(t)
    for out in (sys.stdout, sys.stderr):
        try:
            out.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # a TextIOWrapper, or replaced
        except (AttributeError, ValueError):
            pass
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")


def flush_forwarding(timeout: float = 1.0) -> None:
    """Close fds 1 and 2 and let the pumps send what is left (before ``os._exit``)."""
    if not _threads:
        return
    for fd in (1, 2):
        try:
            os.close(fd)
        except OSError:
            pass
    for t in _threads:
        t.join(timeout)


class LogSink:
    """Controller side: reassemble lines per (rank, stream) and print them prefixed."""

    def __init__(self) -> None:
        self._partial: dict = {}
        self._lock = threading.Lock()

    def write(self, label: str, stream: int, data: bytes) -> None:
        key = (label, stream)
        with self._lock:
            buf = self._partial.pop(key, b"") + data
            *lines, rest = buf.split(b"\n")
            if rest:
                self._partial[key] = rest
            if not lines:
                return
            out = sys.stdout if stream == 1 else sys.stderr
            text = "".join(f"[{label}] {ln.decode(errors='replace')}\n" for ln in lines)
            try:
                out.write(text)
                out.flush()
            except (ValueError, OSError):
                pass

    def flush(self) -> None:
        with self._lock:
            items, self._partial = self._partial, {}
        for (label, stream), rest in items.items():
            out = sys.stdout if stream == 1 else sys.stderr
            try:
                out.write(f"[{label}] {rest.decode(errors='replace')}\n")
            except (ValueError, OSError):
                pass


class Counters:
    """Runtime counters of one process mesh (read with ``ProcMesh.stats()``)."""

    __slots__ = ("replies", "errors", "deaths", "log_bytes", "spawns", "unresponsive")

    def __init__(self) -> None:
        self.unresponsive = 0  # times a worker's heartbeats stopped for heartbeat_timeout
        self.replies = 0
        self.errors = 0
        self.deaths = 0
        self.log_bytes = 0
        self.spawns = 0

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}
