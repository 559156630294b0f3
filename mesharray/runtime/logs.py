"""Worker output forwarded to the controller and printed there, one prefixed line per rank.

Forwarding (worker side)
------------------------
A worker that owns its process (``run_worker(exit_process=True)``) replaces
its file descriptors 1 and 2 by pipes (:func:`forward_process_output`); one
thread sends what is written (by ``print``, ``logging``, C code,
anything) to the controller as LOG frames on the worker's controller
connection. :func:`flush_forwarding` closes the pipes before the process exits
so that the pump sends what is left. On by default;
``proc_mesh(..., forward_logs=False)`` leaves the workers' output on the
terminal they inherited, unprefixed.

Printing (controller side)
--------------------------
:class:`LogSink` reassembles complete lines per (rank, stream), keeps every
line for the ``logs`` table of ``procs.telemetry`` and prints it on the
controller's own ``sys.stdout`` / ``sys.stderr``, prefixed with the rank's
coordinates in its process mesh, e.g. ``[procs=2] hello``. Identical lines of
several ranks print once, their labels joined by :func:`compress_labels`.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import sys
import threading
import time

from . import protocol as P

__all__ = ["forward_process_output", "prepare_logging", "flush_forwarding", "drain_output", "sync_replies", "LogSink",
           "set_worker_label", "compress_labels"]

_threads: list[threading.Thread] = []
_label: str | None = None


def set_worker_label(label) -> None:
    global _label
    _label = label


_pipes: list[tuple[int, int]] = []  # (read end, stream) of the forwarded fds
_pipe_lock = threading.Lock()  # held while a pipe's bytes go from read to sent: see drain_output
_log_conn = None


#: the root logger's handler of a worker that forwards its output (see prepare_logging)
_handler: logging.Handler | None = None


def prepare_logging() -> None:
    """Make the handler :func:`forward_process_output` gives the root logger (``INFO``, to
    ``sys.stderr``) now: a zygote does it once before it forks, for all its workers."""
    global _handler
    if _handler is None:
        h = logging.StreamHandler()  # (sys.stderr: after the fork, the pipe to the controller)
        h.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        _handler = h


def forward_process_output(conn) -> None:
    """Redirect fds 1 and 2 of this process to ``conn`` as LOG frames.

    One thread waits for output on both pipes (``poll``) and then, holding a
    lock shared with :func:`drain_output`, reads what a pipe holds
    (non-blocking) and sends it: bytes read are always sent before anyone
    else may read the pipe. The root logger, if it has no handler, logs
    ``INFO`` and above to the forwarded ``sys.stderr``.
    """
    global _log_conn
    _log_conn = conn
    live: dict[int, int] = {}  # read end -> stream
    pipes = [os.pipe(), os.pipe()]  # (both made before either fd moves: a failure leaves both alone)
    for fd, (r, w) in zip((1, 2), pipes):
        os.dup2(w, fd)
        os.close(w)
        os.set_blocking(r, False)
        _pipes.append((r, fd))
        live[r] = fd

    def pump() -> None:
        p = select.poll()
        for r in live:
            p.register(r, select.POLLIN)
        while live:
            try:
                for r, _ in p.poll():
                    stream = live.get(r)
                    if stream is None:
                        continue
                    with _pipe_lock:
                        if not _pump_once(r, stream):
                            p.unregister(r)
                            del live[r]
                            _pipes.remove((r, stream))  # (before its fd number can be reused)
                            os.close(r)
            except (OSError, ConnectionError):
                return

    t = threading.Thread(target=pump, name="mesharray-log", daemon=True)
    t.start()
    _threads.append(t)
    for out in (sys.stdout, sys.stderr):
        try:
            out.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # a TextIOWrapper, or replaced
        except (AttributeError, ValueError):
            pass
    root = logging.getLogger()
    if not root.handlers:
        prepare_logging()
        root.addHandler(_handler)  # type: ignore[arg-type]  # (made just above)
        root.setLevel(logging.INFO)


def _pump_once(r: int, stream: int) -> bool:
    """Send what pipe ``r`` holds now as LOG frames (``_pipe_lock`` held); False at its end."""
    while True:
        try:
            data = os.read(r, 65536)
        except BlockingIOError:
            return True
        if not data:
            return False
        _log_conn.send(P.LOG, 0, 0, stream, 0, [data])  # type: ignore[union-attr]  # (set before any pump)


def drain_output() -> None:
    """Send this process's output so far (flushed, and what its pipes hold) before returning.

    A worker whose controller runs in a notebook calls it before each reply
    (see :func:`sync_replies`): the LOG frames precede the REPLY on the
    connection, so the controller has shown a call's output when its
    ``get()`` returns.
    """
    for out in (sys.stdout, sys.stderr):
        try:
            out.flush()
        except (AttributeError, ValueError, OSError):
            pass
    with _pipe_lock:
        for r, stream in _pipes:
            try:
                _pump_once(r, stream)
            except (OSError, ConnectionError):
                pass


def sync_replies(conn, reply_kind: int) -> None:
    """Make ``conn`` (a worker's connection to its controller) drain this process's output before
    every frame of ``reply_kind``: the notebook mode of a worker. Replaces the connection's ``send``
    (an instance attribute), so a worker outside notebooks runs the same code as before."""
    if "send" in conn.__dict__ or not _pipes:
        return  # (already synced; or nothing forwarded)
    send = conn.send

    def synced_send(kind: int, flags: int = 0, msg_id: int = 0, target: int = 0, view: int = 0,
                    parts=(), cork: bool = False) -> bool:
        if kind == reply_kind:
            drain_output()
        return send(kind, flags, msg_id, target, view, parts, cork)

    conn.send = synced_send
    conn._faulty = True  # (send is replaced: write_frame, the compiled paths' writes, leaves every frame to it)


def flush_forwarding(timeout: float = 1.0) -> None:
    """Close fds 1 and 2 and let the pump send what is left (before ``os._exit``)."""
    if not _threads:
        return
    for fd in (1, 2):
        try:
            os.close(fd)
        except OSError:
            pass
    for t in _threads:
        t.join(timeout)


_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _level(stream: int, text: str) -> str:
    head = text.split(" ", 1)[0].rstrip(":")
    if head in _LEVELS:  # logging's default format in workers: "LEVEL name: message"
        return head
    return "ERROR" if stream == 2 and text.startswith("Traceback") else ("INFO" if stream == 1 else "")


class LogSink:
    """Controller side: reassemble lines per (rank, stream), keep them for telemetry, print them prefixed.

    Identical lines from several ranks within ``MESHARRAY_LOG_WINDOW`` seconds
    (0.25) print once, with the ranks' labels compressed: 8 ranks printing
    ``step done`` give one ``[procs=0:8] step done``. Each rank's own lines keep
    their order. ``MESHARRAY_LOG_AGGREGATE=0`` (or ``aggregate = False``) prints
    every line as it comes. Every line is kept, per rank, in :meth:`rows` (the
    ``logs`` telemetry table), whatever is printed; the lines of ranks in
    ``muted`` are not printed (``procs.logging(stream=False)``). :meth:`show`
    prints what waits for its window now (a notebook's ``get()`` does, so that
    a call's output shows in the cell that made it).
    """

    def __init__(self, aggregate: bool | None = None, window: float | None = None) -> None:
        self._partial: dict = {}
        self._lock = threading.Lock()
        self.aggregate = (os.environ.get("MESHARRAY_LOG_AGGREGATE", "1") != "0") if aggregate is None else aggregate
        self.window = float(os.environ.get("MESHARRAY_LOG_WINDOW", "0.25")) if window is None else window
        self._rows: collections.deque = collections.deque(maxlen=int(os.environ.get("MESHARRAY_LOG_ROWS", "100000")))
        # lines waiting to be printed: [stream, text, labels] in arrival order, and each
        # rank's last entry index (a line may only join an entry after it: order per rank)
        self._pending: list[list] = []
        self._last: dict = {}
        self._timer: threading.Timer | None = None
        self.muted: set = set()  # ranks whose lines are kept but not printed

    def write(self, label: str, stream: int, data: bytes, rank: int | None = None) -> None:
        key = (label, stream)
        with self._lock:
            buf = self._partial.pop(key, b"") + data
            *lines, rest = buf.split(b"\n")
            if rest:
                self._partial[key] = rest
            if not lines:
                return
            texts = [ln.decode(errors="replace") for ln in lines]
            now = time.time()
            for t in texts:
                self._rows.append((now, rank, label, "stdout" if stream == 1 else "stderr", _level(stream, t), t))
            if rank in self.muted:
                return
            if not self.aggregate or self.window <= 0:
                self._print(stream, "".join(f"[{label}] {t}\n" for t in texts))
                return
            who = label if rank is None else rank
            for t in texts:
                start = self._last.get(who, -1) + 1
                for i in range(start, len(self._pending)):
                    e = self._pending[i]
                    if e[0] == stream and e[1] == t and label not in e[2]:
                        e[2].append(label)
                        self._last[who] = i
                        break
                else:
                    self._pending.append([stream, t, [label]])
                    self._last[who] = len(self._pending) - 1
            if self._timer is None:
                self._timer = threading.Timer(self.window, self._emit)
                self._timer.daemon = True
                self._timer.start()

    def show(self) -> None:
        """Print now the lines that wait for the end of their aggregation window."""
        if not self._pending:
            return
        with self._lock:
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        self._emit()

    def _emit(self) -> None:
        with self._lock:
            self._timer = None
            pending, self._pending, self._last = self._pending, [], {}
        out: dict[int, list[str]] = {1: [], 2: []}
        for stream, text, labels in pending:
            out[stream].append(f"[{compress_labels(labels)}] {text}\n")
        for stream, lines in out.items():
            if lines:
                self._print(stream, "".join(lines))

    @staticmethod
    def _print(stream: int, text: str) -> None:
        out = sys.stdout if stream == 1 else sys.stderr
        try:
            out.write(text)
            out.flush()
        except (ValueError, OSError):
            pass

    def rows(self) -> list[tuple]:
        """Every line kept: ``(unix time, rank, label, stream, level, text)``."""
        with self._lock:
            return list(self._rows)

    def flush(self) -> None:
        with self._lock:
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        self._emit()
        with self._lock:
            items, self._partial = self._partial, {}
        for (label, stream), rest in items.items():
            self._print(stream, f"[{label}] {rest.decode(errors='replace')}\n")


def _ranges(values: list[int]) -> str:
    vs = sorted(set(values))
    out, i = [], 0
    while i < len(vs):
        j = i
        while j + 1 < len(vs) and vs[j + 1] == vs[j] + 1:
            j += 1
        out.append(f"{vs[i]}:{vs[j] + 1}" if j > i else str(vs[i]))
        i = j + 1
    return ",".join(out)


def compress_labels(labels: list[str]) -> str:
    """One label for several ranks' identical output: ``["procs=0", ..., "procs=7"]`` → ``"procs=0:8"``.

    Examples
    --------
    >>> compress_labels(["procs=0", "procs=1", "procs=2", "procs=3"])
    'procs=0:4'
    >>> compress_labels(["hosts=0,procs=1", "hosts=1,procs=1"])
    'hosts=0:2,procs=1'
    >>> compress_labels(["procs=0", "procs=2", "procs=3"])
    'procs=0,2:4'
    """
    if len(labels) == 1:
        return labels[0]
    parsed = []
    for lab in labels:
        try:
            parsed.append({k: int(v) for k, v in (kv.split("=") for kv in lab.split(","))})
        except ValueError:
            return ",".join(labels)
    keys = list(parsed[0])
    if any(list(p) != keys for p in parsed):
        return ",".join(labels)
    return ",".join(f"{k}={_ranges([p[k] for p in parsed])}" for k in keys)
