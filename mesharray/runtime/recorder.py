"""What every process records about itself, cheaply, for telemetry (``procs.telemetry``).

On by default (``MESHARRAY_TELEMETRY=0`` turns recording off). Per call that
a worker handles: a row ``(wall start ns, duration ns, actor, endpoint, caller
pid, msg id, bytes in, bytes out, status)`` appended to ``_core.CallRows`` (a
ring of C structs that reads like a list of tuples) — two clock reads, no lock.
Per actor: spawn, failed spawn, stop. Per error: its type, message and remote
traceback. Per process: CPU, RSS, threads and fds,
sampled every couple of seconds by the heartbeat thread.

Spans need no bytes on the wire: a call's span id is ``(caller pid, msg id)``,
which both ends know. When code inside an actor calls another actor, the
caller records a *link* ``(parent span, child span)``; the controller, which
collects everything (:mod:`mesharray.observe`), rebuilds each span's parent and
trace from the links.

Memory is bounded: at most ``MESHARRAY_TELEMETRY_ROWS`` (100 000) call rows
are kept; the oldest are folded, a 32nd of that at a time, into per-(actor,
endpoint, status) counters and latency histograms (what Prometheus scrapes) and
dropped.
"""

from __future__ import annotations

import contextvars
import os
import resource
import sys
import threading
import time
import traceback
from bisect import bisect_left
from typing import Any

from .._core import CallRows

__all__ = ["REC", "Recorder", "ENABLED", "SPAN", "BUCKETS", "process_sample", "thread_stacks"]

ENABLED = os.environ.get("MESHARRAY_TELEMETRY", "1") != "0"
MAX_ROWS = int(os.environ.get("MESHARRAY_TELEMETRY_ROWS", "100000"))
#: latency histogram bucket upper bounds, in seconds (Prometheus ``le``)
BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0,
           2.5, 5.0, 10.0)
#: the span of the call an async actor's task is handling: (caller pid, msg id) (sync
#: calls have theirs in ``REC.current`` under the thread's id)
SPAN: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("mesharray_span", default=None)


class _Series:
    """An append-only series with absolute indices: readers ask for what came after index ``i``."""

    __slots__ = ("items", "base", "maxlen")

    def __init__(self, maxlen: int) -> None:
        self.items: list = []
        self.base = 0  # absolute index of items[0]
        self.maxlen = maxlen

    def append(self, x: Any) -> None:
        self.items.append(x)
        if len(self.items) > self.maxlen:
            half = len(self.items) // 2
            del self.items[:half]
            self.base += half

    def since(self, i: int) -> tuple[list, int]:
        items, base = list(self.items), self.base
        return items[max(0, i - base):], base + len(items)


class Recorder:
    """This process's telemetry rows (appended by the runtime, read by the controller's queries)."""

    def __init__(self) -> None:
        #: the call rows, oldest first (a list of tuples to Python; the call path pushes C structs)
        self.rows = CallRows()
        self.rows_base = 0  # absolute index of rows[0]
        self.links = _Series(MAX_ROWS)
        self.actors = _Series(10000)
        self.errors = _Series(1000)
        self.samples = _Series(1200)
        #: thread id -> (actor, endpoint, monotonic start ns, caller pid, msg id) of the call it runs now
        self.current: dict[int, tuple[str, str, int, int, int]] = {}
        #: wall clock minus the monotonic clock (ns): rows time calls with one monotonic read
        self.wall_offset = self.rows.offset = time.time_ns() - time.perf_counter_ns()
        #: (actor, endpoint, status) -> [count, seconds, bytes in, bytes out, *bucket counts]
        self.agg: dict[tuple, list] = {}
        self._folded = 0  # rows[:_folded] are in agg
        self._lock = threading.Lock()

    def call(self, row: tuple) -> None:
        rows = self.rows
        rows.append(row)
        if len(rows) > MAX_ROWS:
            self.trim()

    def trim(self) -> None:
        """Fold the oldest call rows into the aggregates and drop them (the list object stays).

        A 32nd of :data:`MAX_ROWS` at a time: this runs in the thread that handles calls, so
        what one trim drops stalls every call to the worker meanwhile (``docs/internals.md``,
        "Telemetry").
        """
        with self._lock:
            rows = self.rows
            if len(rows) > MAX_ROWS:
                n = min(len(rows), max(1, MAX_ROWS // 32, len(rows) - MAX_ROWS))
                self._fold(n)
                del rows[:n]
                self.rows_base += n
                self._folded -= n

    def _fold(self, upto: int | None = None) -> None:
        """Add the rows not folded yet, up to index ``upto`` (default: all), to the aggregates."""
        rows, agg, nb = self.rows, self.agg, len(BUCKETS)
        end = len(rows) if upto is None else max(upto, self._folded)
        for r in rows[self._folded:end]:
            key = (r[2], r[3], r[8])
            a = agg.get(key)
            if a is None:
                a = agg[key] = [0, 0.0, 0, 0] + [0] * nb
            dur = r[1] / 1e9
            a[0] += 1
            a[1] += dur
            a[2] += r[6]
            a[3] += r[7]
            i = bisect_left(BUCKETS, dur)  # the first bucket with dur <= its bound (none past the last)
            if i < nb:
                a[4 + i] += 1
        self._folded = end

    def aggregates(self) -> dict:
        """Counters and histograms of every call so far (histogram buckets not cumulative)."""
        with self._lock:
            self._fold()
            return {k: list(v) for k, v in self.agg.items()}

    def error(self, actor: str, endpoint: str, exc: BaseException) -> None:
        self.errors.append((time.time_ns(), actor, endpoint, type(exc).__name__, str(exc)[:2000],
                            "".join(traceback.format_exception(exc))[-8000:]))

    def actor(self, name: str, event: str, detail: str = "") -> None:
        self.actors.append((time.time_ns(), name, event, detail))

    def sample(self) -> None:
        self.samples.append(process_sample())
        self.wall_offset = self.rows.offset = time.time_ns() - time.perf_counter_ns()  # (follows clock adjustments)

    def snapshot(self, since: dict | None = None) -> dict:
        """What was recorded after the absolute indices in ``since``, the next indices, and the state now."""
        since = since or {}
        with self._lock:
            rows, base = list(self.rows), self.rows_base
        i = since.get("messages", 0)
        out: dict[str, Any] = {"pid": os.getpid(), "now": time.time_ns(),
                               "messages": rows[max(0, i - base):], "next": {"messages": base + len(rows)}}
        for name in ("links", "actors", "errors", "samples"):
            out[name], out["next"][name] = getattr(self, name).since(since.get(name, 0))
        out["process"] = process_sample()
        off = self.wall_offset
        out["current"] = [(a, e, t + off) for a, e, t, *_ in list(self.current.values())]
        return out


_statm: tuple[int, int] | None = None  # (pid, descriptor of its /proc/PID/statm), opened once per process


def _rss() -> int:
    """This process's resident bytes: ``/proc/self/statm`` read with one ``pread`` of a descriptor
    kept open (a forked child opens its own: the inherited one reads its parent), else the peak
    from ``getrusage``."""
    global _statm
    pid = os.getpid()
    for _ in range(2):  # (a descriptor that stopped working, closed by someone else: opened again once)
        cached = _statm
        try:
            if cached is None or cached[0] != pid:  # (a child forked without os.fork's hooks leaves it open)
                if not _HAVE_PROC:
                    break
                cached = (pid, os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC))
                if _statm is not None and _statm[0] == pid:  # (another thread opened one meanwhile)
                    os.close(cached[1])
                    cached = _statm
                _statm = cached
            return int(os.pread(cached[1], 128, 0).split()[1]) * _PAGE
        except (OSError, ValueError, IndexError):
            if _statm is cached:
                _statm = None  # (not closed: the number may be another file's by now)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def _forget_statm() -> None:
    global _statm
    if _statm is not None:
        try:
            os.close(_statm[1])
        except OSError:
            pass
        _statm = None


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_HAVE_PROC = os.path.exists("/proc/self/statm")
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_statm)


def process_sample() -> tuple[int, float, int, int, int]:
    """``(wall ns, CPU seconds, RSS bytes, threads, open fds)`` of this process."""
    t = os.times()
    rss = _rss()
    try:
        # Linux 6.2 and later give the count of open descriptors as the size of /proc/PID/fd (one
        # stat, where listing it makes a string per descriptor); 0 before, which lists it (less
        # the descriptor the listing itself holds open)
        fds = os.stat("/proc/self/fd").st_size or len(os.listdir("/proc/self/fd")) - 1
    except OSError:
        fds = -1
    return (time.time_ns(), t.user + t.system, rss, threading.active_count(), fds)


def thread_stacks(native: bool = False) -> str:
    """Every Python thread's stack, innermost call last (what ``procs.stacks()`` shows).

    ``native``: also ``py-spy dump --native`` of this process, where ``py-spy`` is installed.
    """
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        out.append(f"Thread {names.get(ident, '?')} ({ident}):\n" + "".join(traceback.format_stack(frame)))
    text = "\n".join(out)
    if native:
        import shutil
        import subprocess

        spy = shutil.which("py-spy")
        if spy is None:
            text += "\n(native frames: py-spy is not installed on this host)"
        else:
            try:
                r = subprocess.run([spy, "dump", "--native", "--pid", str(os.getpid())], capture_output=True,
                                   text=True, timeout=20)
                text += "\n--- py-spy dump --native ---\n" + (r.stdout or r.stderr)
            except (OSError, subprocess.TimeoutExpired) as exc:
                text += f"\n(py-spy failed: {exc})"
    return text


REC = Recorder()


_setproctitle: Any = None  # the module once looked for (False: not installed)


def set_title(text: str) -> None:
    """Name this process in ``ps``/``top``: ``setproctitle`` if installed, else ``/proc/self/comm`` (15 bytes)."""
    global _setproctitle
    if _setproctitle is None:  # (looked for once: a failed import searches all of sys.path again)
        try:
            import setproctitle  # type: ignore[import-not-found]

            _setproctitle = setproctitle
        except ImportError:
            _setproctitle = False
    if _setproctitle:
        try:
            _setproctitle.setproctitle(text)
        except Exception:  # pragma: no cover - best effort
            pass
        return
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(text[:15])
    except OSError:
        pass
