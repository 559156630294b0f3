"""The distributed debugger: ``breakpoint()`` in an actor, a ``(ma-debug)`` console at the controller.

Worker side
-----------
A worker process (:func:`install_worker`) replaces ``sys.breakpointhook`` and
``pdb.set_trace``: code of an actor that calls either gets a :class:`pdb.Pdb`
whose input and output are the controller's. The paused thread (often the
reader of the controller's connection, since synchronous endpoints run
inline) tells the controller on that connection (a DEBUG frame ``paused``:
rank, coordinates, actor, endpoint, file and line, the worker's listener
address), then waits for pdb commands. They come on a connection of their
own, which the controller opens to the worker's listener (authenticated with
the mesh's secret, with its own reader thread): ``hello`` (a client attached:
send what pdb printed so far), ``cmd`` (one line for pdb). The worker answers
on it with ``out`` (pdb's output up to its next prompt) or ``running`` (pdb
let the code run on). The heartbeat thread goes on meanwhile, so a paused rank
is never unresponsive; the controller reports it as *paused*.
``MESHARRAY_DEBUG=0`` (in the workers' environment, or the controller's when
the mesh is configured) makes ``breakpoint()`` a no-op with a warning;
``PYTHONBREAKPOINT=0`` too, as in plain Python.

Controller side
---------------
:class:`Debugger` (one per process, :func:`debugger`) keeps the paused
sessions that the controllers' connections report, runs each pdb exchange, and
offers :class:`Console`, the ``(ma-debug)`` commands: ``list``, ``attach N``
(a ``(Pdb)`` session on rank N; ``detach`` goes back), ``cast RANKS CMD``
(``cast 0,2 p x``, ``cast * c``), ``continue`` (every paused rank), ``help``.
N is a rank's flat rank in its actor mesh. With a terminal (stdin is a tty,
not a notebook kernel) the console runs there, in a thread, while the
script's own thread keeps waiting for its call: when the last paused rank
continues the console ends and the script goes on where it was. In any case
the debugger listens for ``python -m mesharray debug [JOBFILE]`` from another
terminal (:mod:`mesharray.observe.debug`): a unix socket that takes only a
client that knows the mesh's secret (the HMAC handshake of every mesharray
connection: the debugger runs code on every rank), announced by a
*rendezvous* file (JSON, mode 0600, in a 0700 directory): the user's
(:func:`rendezvous_dir`) and the directory of each job file the process
attached through (:func:`announce_in`).
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import pdb
import pickle
import queue
import sys
import tempfile
import threading
import time
import warnings
from typing import Any

from ..transport.address import connect
from ..transport.listener import Listener
from . import protocol as P
from .channel import Channel
from .context import current

__all__ = ["install_worker", "configure", "on_command", "debugger", "Debugger", "Console", "rendezvous_dir",
           "announce_in", "read_rendezvous", "HELP"]

_dumps = pickle.dumps


def _msg(obj: dict) -> list:
    return [_dumps(obj, protocol=5)]


# =========================================================================== worker side
_enabled = True
_me: dict = {}  # rank, pid, host, address of this worker; "chan": its controller channel
_sessions: dict[int, _Io] = {}
_next_sid = itertools.count(1).__next__


def install_worker(chan: Channel, rank: int, pid: int, host: str, address: str) -> None:
    """Make ``breakpoint()`` and ``pdb.set_trace()`` in this worker process talk to the controller (``chan``)."""
    _me.update(chan=chan, rank=rank, pid=pid, host=host, address=address)
    sys.breakpointhook = _breakpointhook
    pdb.set_trace = _set_trace


def configure(enabled: bool) -> None:
    """The controller's ``MESHARRAY_DEBUG`` (False: ``breakpoint()`` is a no-op with a warning)."""
    global _enabled
    _enabled = bool(enabled)


def _breakpointhook(*args: Any, **kwargs: Any) -> None:  # noqa: ARG001  (breakpoint()'s signature)
    _set_trace(_frame=sys._getframe(1))


def _set_trace(*, header: str | None = None, _frame: Any = None) -> None:
    frame = _frame if _frame is not None else sys._getframe(1)
    if not _enabled or os.environ.get("MESHARRAY_DEBUG") == "0" or os.environ.get("PYTHONBREAKPOINT") == "0":
        warnings.warn(f"breakpoint() at {frame.f_code.co_filename}:{frame.f_lineno} on rank {_me.get('rank')} "
                      f"ignored: the debugger is off (MESHARRAY_DEBUG=0)", RuntimeWarning, stacklevel=3)
        return
    dbg = _RemotePdb()
    if header is not None:
        dbg.message(header)
    dbg.set_trace(frame)


def _where(frame: Any) -> tuple[str, str]:
    """(endpoint, file:line) of a paused frame: the endpoint is the outermost frame below the worker's code
    (its reader thread's loop, whose call path is compiled and has no Python frame, or the worker's
    own: an async actor's task, a main-thread task)."""
    endpoint = frame.f_code.co_name
    package = __name__.rsplit(".", 2)[0]
    roots = {getattr(sys.modules.get(package + m), "__file__", None) for m in (".runtime.worker", ".transport.connection")}
    f = frame
    while f is not None and f.f_code.co_filename not in roots:
        if f.f_code.co_filename != pdb.__file__ and "bdb" not in f.f_code.co_filename:
            endpoint = f.f_code.co_name
        f = f.f_back
    return endpoint, f"{frame.f_code.co_filename}:{frame.f_lineno}"


class _Io:
    """A paused session's pdb input and output: lines from the debug client, text back to it."""

    def __init__(self, sid: int) -> None:
        self.sid = sid
        self.lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.buf: list[str] = []
        self.client: Channel | None = None
        self.waiting = False
        self.where = ""
        self.seq = 0
        self.lock = threading.Lock()

    # pdb's stdout
    def write(self, text: str) -> int:
        self.buf.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    # pdb's stdin: the next command (pdb has printed its prompt)
    def readline(self) -> str:
        with self.lock:
            if self.buf and self.buf[-1] == "(Pdb) ":
                self.buf.pop()  # (pdb's prompt: the client shows its own)
            self.waiting = True
            self._prompt_locked()
        line = self.lines.get()
        with self.lock:
            self.waiting = False
        return line if line.endswith("\n") else line + "\n"

    def _prompt_locked(self) -> None:
        if self.client is None or not self.waiting:
            return
        text = "".join(self.buf)
        self.buf.clear()
        self._send({"op": "out", "text": text, "prompt": True, "where": self.where})

    def _send(self, msg: dict) -> None:
        self.seq += 1
        msg.update(sid=self.sid, seq=self.seq)
        try:
            assert self.client is not None
            self.client.send(P.DEBUG, parts=_msg(msg))
        except Exception:  # the client went away: the next one attaches again
            self.client = None

    def attach(self, client: Channel, prompt: bool = True) -> None:
        """A client attached (``prompt``: send what pdb printed so far now; else with the next answer)."""
        with self.lock:
            self.client = client
            if prompt and self.waiting:
                self._prompt_locked()

    def running(self) -> None:
        with self.lock:
            text = "".join(self.buf)
            self.buf.clear()
            if self.client is not None:
                self._send({"op": "running", "text": text})


class _RemotePdb(pdb.Pdb):
    """pdb on a worker: its terminal is the controller's (see the module docstring)."""

    def __init__(self) -> None:
        self._io = _Io(_next_sid())
        super().__init__(stdin=self._io, stdout=self._io, nosigint=True)  # type: ignore[arg-type]
        self.use_rawinput = False
        self._announced = False
        self._ran_on = False  # continued (or quit): not stepping

    def set_continue(self) -> None:
        self._ran_on = True
        super().set_continue()

    def set_quit(self) -> None:
        self._ran_on = True
        super().set_quit()

    def interaction(self, frame: Any, traceback: Any) -> None:
        io = self._io
        endpoint, where = _where(frame)
        io.where = where
        _sessions[io.sid] = io
        if not self._announced:  # (again after each time it ran on: see running)
            self._announced = True
            self._announce(endpoint, where)
        try:
            super().interaction(frame, traceback)
        finally:
            io.running()
            if self._ran_on:  # (continued: not stepping)
                self._ran_on = False
                self._announced = False
                _sessions.pop(io.sid, None)
                self._tell({"op": "resumed", "sid": io.sid, "seq": io.seq + 1})

    def _announce(self, endpoint: str, where: str) -> None:
        ctx = current.get()
        rank = _me.get("rank")
        n, coords, actor = rank, {"rank": rank}, "?"
        if ctx is not None:
            actor = ctx.actor_name
            shape = ctx._spawn_shape  # (the actor mesh's: N is the flat rank in it)
            try:
                n = list(shape).index(ctx.global_rank)
                coords = shape.coordinates(ctx.global_rank)
            except (AttributeError, ValueError, TypeError):
                pass
        io = self._io
        io.seq += 1
        msg = {"op": "paused", "sid": io.sid, "seq": io.seq, "rank": rank, "n": n, "coords": coords,
               "actor": actor, "endpoint": endpoint, "where": where, "pid": _me.get("pid"),
               "host": _me.get("host"), "address": _me.get("address")}
        if not self._tell(msg):  # no controller: nobody can drive this session; let the code run on
            self.set_continue()

    @staticmethod
    def _tell(msg: dict) -> bool:
        """A session's news on the controller's connection: ``paused``, and ``resumed`` (before the call's
        reply, on the same connection: the controller knows it resumed when it has the reply)."""
        msg["address"] = _me.get("address")
        chan = _me.get("chan")
        if chan is None:
            return False
        try:
            chan.send(P.DEBUG, parts=_msg(msg))
            return True
        except Exception:
            return False


def on_command(chan: Channel, payload: Any) -> None:
    """A DEBUG frame from a debug client: ``hello`` (attach) or ``cmd`` (one pdb line) for a session."""
    msg = pickle.loads(payload)
    io = _sessions.get(msg.get("sid"))
    if io is None:
        try:
            chan.send(P.DEBUG, parts=_msg({"op": "gone", "sid": msg.get("sid")}))
        except Exception:
            pass
        return
    if msg.get("op") == "hello":
        io.attach(chan)
    elif msg.get("op") == "cmd":
        if io.client is not chan:
            io.attach(chan, prompt=False)
        io.lines.put(str(msg.get("line", "")))


# =========================================================================== controller side
HELP = """commands:
  list              the paused ranks: N (flat rank in its actor mesh), coordinates, actor, endpoint, file:line
  attach N          a (Pdb) session on rank N (pdb's commands: p, n, s, l, w, c ...); 'detach' comes back here
  cast RANKS CMD    one pdb command to several ranks: 'cast 0,2 p x', 'cast 1:3 n', 'cast * c'
  continue          let every paused rank run on
  help              this text"""


class _Paused:
    """One paused session, as the controller knows it."""

    __slots__ = ("key", "rank", "n", "coords", "actor", "endpoint", "where", "pid", "address", "seq", "paused",
                 "events", "worker_rank")

    def __init__(self, key: tuple, msg: dict) -> None:
        self.key = key
        self.events: queue.SimpleQueue[dict] = queue.SimpleQueue()
        self.seq = 0
        self.paused = True
        self.update(msg)

    def update(self, msg: dict) -> None:
        self.rank = msg.get("rank")
        self.worker_rank = msg.get("rank")
        self.n = msg.get("n")
        self.coords = msg.get("coords")
        self.actor = str(msg.get("actor"))
        self.endpoint = str(msg.get("endpoint"))
        self.where = str(msg.get("where"))
        self.pid = msg.get("pid")
        self.address = str(msg.get("address"))

    def line(self) -> str:
        coords = ",".join(f"{k}={v}" for k, v in (self.coords or {}).items())
        return f"  {self.n:>3}  {coords:<20} {self.actor}.{self.endpoint}  {self.where}"


class Debugger:
    """The paused sessions of this controller process, and the pdb exchanges with them."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.sessions: dict[tuple, _Paused] = {}
        self._chans: dict[str, Channel] = {}  # worker address -> the debug connection to it
        self._infos: dict[str, Any] = {}  # worker address -> the controller's WorkerInfo
        self.secret: bytes | None = None
        self.server: Listener | None = None
        self.rendezvous: list[str] = []
        self._console: threading.Thread | None = None
        self._noticed = False
        self.changed = threading.Condition(self._lock)

    # -- events -----------------------------------------------------------------------------
    def controller_event(self, secret: bytes, info: Any, payload: Any, notice: Any = None) -> None:
        """A DEBUG frame on a controller's connection (a worker paused): record it, offer a console.

        Runs in whoever reads that connection (maybe the script's own thread, waiting for its
        reply): it never blocks; the console runs in a thread of its own.
        """
        msg = pickle.loads(payload)
        key = (msg.get("address"), msg.get("sid"))
        if msg.get("op") == "resumed":
            with self._lock:
                p = self.sessions.get(key)
                if p is not None and msg.get("seq", 0) > p.seq:
                    p.seq = msg["seq"]
                    self._resumed(p)
            return
        if msg.get("op") != "paused":
            return
        with self._lock:
            self.secret = secret
            p = self.sessions.get(key)
            if p is None:
                p = self.sessions[key] = _Paused(key, msg)
            elif msg.get("seq", 0) < p.seq:
                return
            else:
                p.update(msg)
            p.seq = msg.get("seq", 0)
            p.paused = True
            if info is not None:
                self._infos[p.address] = info
                _mark(info, p.where, key, True)
            self.changed.notify_all()
        self._serve()
        text = f"mesharray: rank {p.n} of {p.actor} paused in {p.endpoint} at {p.where} (breakpoint)"
        if _has_terminal():
            print(f"\n{text}", file=sys.stderr, flush=True)
            self._start_console()
        elif not self._noticed:
            self._noticed = True
            print(f"{text}; attach from a terminal with: python -m mesharray debug [JOBFILE]",
                  file=sys.stderr, flush=True)
        if notice is not None:
            notice(text)

    def _on_worker_frame(self, chan: Channel, kind: int, flags: int, msg_id: int, target: int, view: int,
                         payload: Any) -> None:
        if kind != P.DEBUG:
            return
        msg = pickle.loads(payload)
        key = (chan.peer.get("address"), msg.get("sid"))
        with self._lock:
            p = self.sessions.get(key)
        if p is not None:
            p.events.put(msg)

    # -- queries ------------------------------------------------------------------------------
    def paused(self) -> list[_Paused]:
        """The sessions paused now (those of a worker that died or was stopped are forgotten)."""
        with self._lock:
            for key, p in list(self.sessions.items()):
                info = self._infos.get(p.address)
                if info is not None and info.error is not None:
                    del self.sessions[key]
            return sorted((p for p in self.sessions.values() if p.paused), key=lambda p: (p.actor, p.n or 0, p.key))

    def listing(self) -> str:
        ps = self.paused()
        if not ps:
            return "no rank is paused"
        return "\n".join(["    N  coordinates          actor.endpoint  file:line", *(p.line() for p in ps)])

    def find(self, n: int) -> _Paused:
        for p in self.paused():
            if p.n == n:
                return p
        raise ValueError(f"rank {n} is not paused; paused ranks: {[p.n for p in self.paused()]}")

    # -- exchanges ----------------------------------------------------------------------------
    def _chan(self, p: _Paused) -> Channel:
        with self._lock:
            chan = self._chans.get(p.address)
            if chan is None or chan.closed:
                assert self.secret is not None
                sock = connect(p.address, self.secret)
                chan = Channel(sock, handler=self._on_worker_frame, name=f"debug rank {p.rank}")
                chan.peer["address"] = p.address
                chan.start()
                self._chans[p.address] = chan
            return chan

    def _send(self, p: _Paused, msg: dict) -> None:
        msg["sid"] = p.key[1]
        self._chan(p).send(P.DEBUG, parts=_msg(msg))

    def _reply(self, p: _Paused, timeout: float = 60.0) -> tuple[str, bool]:
        """What pdb said after a command, and whether the rank is still paused."""
        text: list[str] = []
        deadline = time.monotonic() + timeout
        running = False
        while True:
            wait = (0.3 if running else deadline - time.monotonic())
            try:
                msg = p.events.get(timeout=max(0.0, wait))
            except queue.Empty:
                if running:  # it ran on and did not stop again (soon): it continues
                    return "".join(text), False
                return "".join(text) + f"(rank {p.n} did not answer in {timeout:g} s)\n", True
            op = msg.get("op")
            text.append(msg.get("text", ""))
            if op == "out" and msg.get("prompt"):
                p.where = msg.get("where") or p.where
                if running:  # (stopped again: a step)
                    self._paused_again(p)
                return "".join(text), True
            if op == "running":
                running = True
                self._resumed(p)
            elif op == "gone":
                self._resumed(p)
                return "".join(text), False

    def _resumed(self, p: _Paused) -> None:
        self._set_paused(p, False)

    def _paused_again(self, p: _Paused) -> None:
        self._set_paused(p, True)

    def _set_paused(self, p: _Paused, paused: bool) -> None:
        with self._lock:
            p.paused = paused
            info = self._infos.get(p.address)
            if info is not None:
                _mark(info, p.where, p.key, paused)
            self.changed.notify_all()

    def hello(self, p: _Paused) -> str:
        """Attach to ``p``: what pdb printed so far."""
        self._drain(p)
        self._send(p, {"op": "hello"})
        text, _ = self._reply(p)
        return text

    def command(self, p: _Paused, line: str) -> tuple[str, bool]:
        """One pdb line on ``p``: (pdb's output, whether it is still paused)."""
        self._drain(p)
        self._send(p, {"op": "cmd", "line": line})
        return self._reply(p)

    @staticmethod
    def _drain(p: _Paused) -> None:
        while True:
            try:
                p.events.get_nowait()
            except queue.Empty:
                return

    def cast(self, ranks: str, line: str) -> str:
        ps = self.paused()
        if ranks.strip() == "*":
            chosen = ps
        else:
            want = _parse_ranks(ranks)
            chosen = [p for p in ps if p.n in want]
            missing = sorted(want - {p.n for p in chosen})
            if missing:
                return f"not paused: {missing}; paused ranks: {[p.n for p in ps]}\n"
        for p in chosen:
            self._drain(p)
            self._send(p, {"op": "cmd", "line": line})
        out = []
        for p in chosen:
            text, still = self._reply(p)
            out.append("".join(f"[{p.n}] {ln}\n" for ln in text.splitlines()) or f"[{p.n}]\n")
            if not still:
                out.append(f"[{p.n}] (running)\n")
        return "".join(out)

    def continue_all(self) -> str:
        return self.cast("*", "c") if self.paused() else "no rank is paused\n"

    # -- console and server ---------------------------------------------------------------------
    def _start_console(self) -> None:
        with self._lock:
            if self._console is not None and self._console.is_alive():
                return
            self._console = threading.Thread(target=_terminal_console, args=(self,), name="mesharray-debug",
                                             daemon=True)
            self._console.start()

    def _serve(self) -> None:
        with self._lock:
            if self.server is not None:
                return
            assert self.secret is not None
            self.server = Listener(self.secret, self._on_client, kind="unix")
            for d in [rendezvous_dir(), *_dirs]:
                self._announce(d)
            atexit.register(self.close)

    def _announce(self, d: str) -> None:
        if self.server is None or self.secret is None:
            return
        try:
            _private_dir(d)
            path = os.path.join(d, f"debug-{os.getpid()}.json")
            tmp = f"{path}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"pid": os.getpid(), "address": self.server.address, "secret": self.secret.hex(),
                           "argv": sys.argv[:4], "started": time.time()}, f)
            os.replace(tmp, path)
            self.rendezvous.append(path)
        except OSError:
            pass

    def _on_client(self, sock: Any) -> None:
        console = Console(self)
        chan: Channel

        def on_frame(c: Channel, kind: int, flags: int, msg_id: int, target: int, view: int, payload: Any) -> None:
            if kind != P.DEBUG:
                return
            line = pickle.loads(payload).get("line", "")
            try:
                text = console.handle(line)
            except Exception as exc:  # (a client's mistake must not end its session)
                text = f"error: {exc}\n"
            c.send(P.DEBUG, parts=_msg({"text": text, "prompt": console.prompt, "paused": len(self.paused())}))

        chan = Channel(sock, handler=on_frame, name="debug client")
        chan.start()

    def close(self) -> None:
        for path in self.rendezvous:
            try:
                os.unlink(path)
            except OSError:
                pass
        self.rendezvous.clear()
        if self.server is not None:
            self.server.close()
            self.server = None
        for chan in list(self._chans.values()):
            chan.close(join=False)
        self._chans.clear()


def _mark(info: Any, where: str, key: tuple, paused: bool) -> None:
    """Keep the controller's view of a worker's paused sessions (reported as paused, never as unresponsive)."""
    sessions = getattr(info, "paused", None)
    if sessions is None:
        return
    if paused:
        sessions[key] = where
    else:
        sessions.pop(key, None)


def _parse_ranks(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if ":" in part:
            a, b = part.split(":", 1)
            out.update(range(int(a), int(b)))
        elif part:
            out.add(int(part))
    return out


class Console:
    """The ``(ma-debug)`` commands of one user (the terminal's, or a ``python -m mesharray debug`` client)."""

    def __init__(self, dbg: Debugger) -> None:
        self.dbg = dbg
        self.attached: _Paused | None = None

    @property
    def prompt(self) -> str:
        return "(Pdb) " if self.attached is not None else "(ma-debug) "

    def handle(self, line: str) -> str:
        """Run one line typed at :attr:`prompt`; what to print."""
        dbg = self.dbg
        if self.attached is not None:
            if line.strip() == "detach":
                self.attached = None
                return ""
            text, still = dbg.command(self.attached, line)
            if not still:
                text += f"(rank {self.attached.n} runs on)\n"
                self.attached = None
            return text
        cmd, _, rest = line.strip().partition(" ")
        rest = rest.strip()
        if not cmd:
            return ""
        if cmd in ("list", "ls"):
            return dbg.listing() + "\n"
        if cmd == "attach":
            try:
                p = dbg.find(int(rest))
            except ValueError as exc:
                return f"{exc}\n"
            self.attached = p
            return dbg.hello(p)
        if cmd == "cast":
            ranks, _, pdb_line = rest.partition(" ")
            if not ranks or not pdb_line.strip():
                return "usage: cast RANKS CMD (e.g. cast 0,2 p x; cast * c)\n"
            try:
                return dbg.cast(ranks, pdb_line.strip())
            except ValueError as exc:
                return f"bad ranks {ranks!r}: {exc}\n"
        if cmd in ("continue", "cont", "c"):
            return dbg.continue_all()
        if cmd in ("help", "h", "?"):
            return HELP + "\n"
        return f"unknown command {cmd!r}\n{HELP}\n"


def _terminal_console(dbg: Debugger) -> None:
    """The console on this process's terminal, until no rank is paused (then the script goes on)."""
    console = Console(dbg)
    print(dbg.listing(), flush=True)
    while dbg.paused() or console.attached is not None:
        try:
            line = input(console.prompt)
        except EOFError:  # no more input: let every rank run on
            print(dbg.continue_all(), end="", flush=True)
            break
        try:
            text = console.handle(line)
        except Exception as exc:
            text = f"error: {exc}\n"
        print(text, end="", flush=True)
    print("mesharray: no rank is paused; the script goes on", flush=True)


def _has_terminal() -> bool:
    try:
        return sys.stdin is not None and sys.stdin.isatty() and "ipykernel" not in sys.modules
    except (AttributeError, ValueError):
        return False


_debugger: Debugger | None = None
_debugger_lock = threading.Lock()
_dirs: list[str] = []


def debugger() -> Debugger:
    """This process's :class:`Debugger`."""
    global _debugger
    with _debugger_lock:
        if _debugger is None:
            _debugger = Debugger()
        return _debugger


def rendezvous_dir() -> str:
    """Where a controller announces its debugger: ``$MESHARRAY_DEBUG_DIR``, else a directory of the user's."""
    d = os.environ.get("MESHARRAY_DEBUG_DIR")
    if d:
        return d
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return os.path.join(base, f"mesharray-{os.getuid()}" if hasattr(os, "getuid") else "mesharray")


def _private_dir(d: str) -> None:
    os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.stat(d)
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise OSError(f"{d} belongs to another user")


def announce_in(d: str) -> None:
    """Announce this process's debugger (once it listens) in directory ``d`` too (a job file's)."""
    d = os.path.abspath(d)
    if d in _dirs:
        return
    _dirs.append(d)
    dbg = _debugger
    if dbg is not None and dbg.server is not None:
        dbg._announce(d)


def read_rendezvous(d: str) -> list[dict]:
    """The live controllers' debuggers announced in ``d`` (newest first)."""
    out = []
    try:
        names = os.listdir(d)
    except OSError:
        return []
    for name in names:
        if not (name.startswith("debug-") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(d, name), encoding="utf-8") as f:
                rec = json.load(f)
            os.kill(int(rec["pid"]), 0)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        rec["path"] = os.path.join(d, name)
        out.append(rec)
    return sorted(out, key=lambda r: -r.get("started", 0))
