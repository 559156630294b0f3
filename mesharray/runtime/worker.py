"""The worker loop: :func:`run_worker`, what every worker process runs.

A worker connects to its controller, authenticates, says HELLO (rank, pid,
host, its own listener's address) and serves frames until the controller goes
away. It runs in its own process (``bootstrap.local``, or ``mpirun`` for ranks
1..N-1) or in a thread of the controller process (rank 0 under MPI):
``exit_process`` says which.

Execution model
---------------
- Each inbound connection (the controller's, and one per peer that calls this
  worker's actors) has its own reader thread. Frames from one sender are
  handled in order by that thread.
- An actor whose endpoints are all synchronous runs them **inline in the
  reader thread**, under the actor's lock (so two senders never run one
  actor's code at the same time). No thread hop: this is what keeps a call
  round trip in the tens of microseconds. That path is compiled: each
  connection's handler is a ``_core.CallServer``, and the slots' fields and
  the fences' counters are C fields (``_core.ActorSlot``, ``_core.CallOrder``);
  :meth:`Worker._frame` takes what it does not run (see ``docs/internals.md``).
- An actor with any ``async`` endpoint gets a mailbox on the worker's asyncio
  loop (one thread, started on first need); its messages run one at a time in
  arrival order (sync endpoints of such an actor too), except endpoints
  declared ``@endpoint(concurrent=True)``, which start as their own task.
- Replies go back on the connection that carried the call.
- Heartbeats go to the controller every ``heartbeat_interval`` seconds from a
  thread of their own (its loop compiled: ``transport._wire.Beats``); the
  controller declares a worker hung when they stop.
- The process's main thread runs what :func:`run_on_main_thread` hands it
  (``ma.spmd`` runs a user's script there, as ``python script.py`` would:
  signal handlers and libraries that check for the main thread work), one
  task at a time; otherwise it waits for the end.
- When the controller connection ends (EOF: the controller died or stopped
  us), the worker exits, also while a main-thread task still runs (another
  thread then ends the process: a script blocked in a collective cannot be
  asked to return); on Linux, ``PR_SET_PDEATHSIG`` also kills it when its
  parent process dies.
- A worker of a host with a relay (``run_worker(relay=...)``, see
  :mod:`.relay`) also connects to the relay: messages the controller sent to
  many ranks come on that connection (a reader thread of its own; replies go
  back on it), and its heartbeats go there instead. The frames of both
  connections are handled in the order the controller sent them: a ``FENCE(n)``
  on one makes its reader wait until n counted frames (calls, spawns, actor
  stops, the stop) of the other were handled (:class:`_Order`). The worker
  exits when the relay's connection ends, as when the controller's does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import mmap
import os
import pickle
import queue
import socket
import sys
import threading
import time
import traceback
from functools import partial
from time import perf_counter_ns
from typing import Any, Callable, TypeVar

from .._core import ActorSlot, CallOrder, CallServer, pack_header, serve_setup, serve_sync
from .._platform import sched_batch, worker_sched, worker_spin
from ..errors import SerializationError
from ..transport import framing
from ..transport.address import connect, dual_address
from ..transport.connection import SMALL_FRAME, Beats, Connection
from ..transport.dataplane import start_process_plane
from ..transport.hostid import host_id, memory_domain
from ..transport.listener import Listener
from ..transport.spin import set_read_spin
from . import debugger
from . import protocol as P
from .channel import Channel
from .context import Context, current
from .logs import flush_forwarding, forward_process_output, prepare_logging, set_worker_label, sync_replies
from .recorder import ENABLED as RECORD
from .recorder import MAX_ROWS, REC, SPAN, set_title, thread_stacks
from .router import set_secret

__all__ = ["run_worker", "Worker", "error_record", "set_sched_class", "set_spin", "prepare_process",
           "run_on_main_thread"]

log = logging.getLogger("mesharray.worker")

_EMPTY_OK = framing.encode(framing.dumps(None))
_EMPTY_OK_BYTES = 24 + sum(len(p) for p in _EMPTY_OK)  # (the frame's size, for the telemetry row)
# the pickled payload of a call without arguments (what the caller sends, byte for byte)
_NO_ARGS_BYTES = b"".join(framing.encode(framing.dumps(((), {}))))
_NO_ARGS_LEN = len(_NO_ARGS_BYTES)
_names: dict[bytes, str] = {}  # u8 n + method name -> name
_record = REC.call
_CALL = P.CALL
_T = TypeVar("_T")

#: the worker that owns this process's main thread (run_worker with exit_process=True)
_main_worker: Worker | None = None


def run_on_main_thread(fn: Callable[[], _T]) -> concurrent.futures.Future[_T]:
    """Run ``fn()`` on this worker process's main thread; a future of what it returns (or raises).

    For code that must run where ``python script.py`` runs a script:
    ``signal.signal`` works only there, and libraries (torch's DataLoader,
    ...) behave differently elsewhere. Tasks run one at a time, in order. The
    future is cancelled when the worker stops before the task started; a task
    running when the worker stops is not waited for (the process exits).

    Raises
    ------
    RuntimeError
        This process's main thread is not a worker's: rank 0 of an MPI job
        runs its worker in a thread of the controller's script.
    """
    w = _main_worker
    if w is None or w.main_tasks is None:
        raise RuntimeError("this worker does not own its process's main thread (rank 0 under mpirun runs in "
                           "the controller's process): nothing can run there")
    fut: concurrent.futures.Future[_T] = concurrent.futures.Future()
    w.main_tasks.put((fn, fut))
    if w.done.is_set():  # stopped meanwhile: nobody will take it
        fut.cancel()
    return fut


_prctl: Any = None  # libc's prctl, looked up once (a zygote does it for its forks)


def _set_pdeathsig() -> None:
    global _prctl
    if sys.platform.startswith("linux"):
        try:
            if _prctl is None:
                import ctypes

                _prctl = ctypes.CDLL(None, use_errno=True).prctl
            import signal

            _prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        except Exception:  # pragma: no cover - best effort
            pass


_prepared = False  # this process (or the zygote it was forked from) ran prepare_process


def prepare_process() -> None:
    """What every worker process sets up before anything else, done once: :func:`set_sched_class`,
    :func:`set_spin`, the lookup of ``prctl``, the host's memory domain and the handler of forwarded
    logs. A zygote runs it before it forks: the forks inherit the scheduling class (Linux keeps it
    across fork), the spin setting, the lookup, the domain and the handler, and :func:`run_worker`
    then has nothing to do here but ``PR_SET_PDEATHSIG`` (which fork resets)."""
    global _prepared, _prctl
    if _prepared:
        return
    set_sched_class()
    set_spin()
    memory_domain()  # (cached: its files are read once, not by each fork)
    prepare_logging()
    if sys.platform.startswith("linux") and _prctl is None:
        try:
            import ctypes

            _prctl = ctypes.CDLL(None, use_errno=True).prctl
        except Exception:  # pragma: no cover - best effort
            _prctl = False
    _prepared = True


def set_sched_class() -> None:
    """Put this worker process in the workers' scheduling class (``MESHARRAY_WORKER_SCHED``).

    For a process that is a worker and nothing else, before it starts any thread (they all
    inherit it): :func:`run_worker` does it when it owns its process, the MPI bootstrap on
    ranks 1..N-1. ``SCHED_BATCH``: a worker woken by a message does not preempt the process
    that sent it, so a controller calling 8 workers on 2 cores sends all 8 before any runs
    (``docs/internals.md``, "Threads").
    """
    try:
        policy = worker_sched()
    except ValueError as exc:  # (set in this worker's environment only: the controller checks its own)
        print(f"mesharray worker {os.getpid()}: {exc}; keeping the default scheduling class",
              file=sys.stderr, flush=True)
        return
    if policy == "batch":
        sched_batch()


def set_spin() -> None:
    """Make this worker process's readers poll briefly before blocking (``MESHARRAY_WORKER_SPIN_US``).

    For a process that is a worker and nothing else (where :func:`set_sched_class` is called).
    A message that comes within the spin is read without waking the reader, the largest cost
    of a small message on a virtual machine whose idle CPUs halt. A reader whose polls find
    nothing backs off (:func:`~mesharray.transport.spin.set_read_spin`; ``docs/internals.md``,
    "Threads").
    """
    try:
        seconds = worker_spin()
    except ValueError as exc:  # (set in this worker's environment only: the controller checks its own)
        print(f"mesharray worker {os.getpid()}: {exc}; keeping the default",
              file=sys.stderr, flush=True)
        seconds = worker_spin("")
    set_read_spin(seconds)


def _pickle_exc(exc: BaseException):
    # An exception class the user defined in their script (``__main__``) came
    # here by value with the actor's code: plain pickle cannot name it, but
    # cloudpickle sends it back by value with the id it came with, so the
    # controller gets its own class again and ``except Boom`` catches it.
    try:
        data = pickle.dumps(exc, protocol=5)
        pickle.loads(data)
        return exc
    except Exception:
        pass
    try:
        import cloudpickle

        cloudpickle.loads(cloudpickle.dumps(exc, protocol=5))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}")


def error_record(exc: BaseException, actor_name: str, coords, host: str, pid: int) -> dict:
    """The picklable description of an exception raised by user code in an actor."""
    chain: list[tuple[BaseException, bool]] = []
    seen = {id(exc)}
    e = exc
    while len(chain) < 16:
        if e.__cause__ is not None:
            nxt, is_cause = e.__cause__, True
        elif e.__context__ is not None and not e.__suppress_context__:
            nxt, is_cause = e.__context__, False
        else:
            break
        if id(nxt) in seen:
            break
        seen.add(id(nxt))
        chain.append((_pickle_exc(nxt), is_cause))
        e = nxt
    return {
        "exc": _pickle_exc(exc),
        "chain": chain,
        "tb": "".join(traceback.format_exception(exc)),
        "rank": coords,
        "actor": actor_name,
        "host": host,
        "pid": pid,
    }


def _error_parts(rec: dict) -> list:
    try:
        return framing.encode(framing.dumps(rec))
    except Exception:  # unpicklable, or too large for a frame: its text, cut short
        rec = dict(rec, exc=RuntimeError(repr(rec["exc"])[:1 << 16]), chain=[], tb=rec["tb"][-(1 << 16):])
        return framing.encode(framing.dumps(rec))


class _Slot(ActorSlot):
    """One actor hosted by this worker (its fields: :class:`~mesharray._core.ActorSlot`'s)."""

    __slots__ = ()

    def __init__(self, actor_id, name, shape) -> None:
        self.actor_id = actor_id
        self.name = name
        self.obj: Any = None
        self.shape = shape
        self.lock = threading.Lock()
        self.is_async = False
        self.failure: Any = None  # error record when the constructor raised
        self.queue: Any = None  # the asyncio.Queue of an async actor (made on its loop)
        self.concurrent: set[str] = set()
        self.endpoints: set[str] = set()
        self.ctx: Context = None  # type: ignore[assignment]  # set at spawn, before any message
        self.bound: dict = {}
        # per sender (channel): the error of a broadcast endpoint that raised, told to
        # that sender at its next call that waits for a reply
        self.broadcast_error: dict = {}


class _Order(CallOrder):
    """Counted frames handled from the controller's connection (``direct``) and the relay's (``relayed``),
    and the wait of a reader that met a ``FENCE`` (see the module docstring; the fields are
    :class:`~mesharray._core.CallOrder`'s: the compiled call path counts)."""

    __slots__ = ()

    def __init__(self) -> None:
        self.direct = 0
        self.relayed = 0
        self.cond = threading.Condition()
        self.waiting = 0

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()


_COUNTED = frozenset((P.CALL, P.SPAWN, P.STOP_ACTOR, P.STOP))  # (runtime.hosts.COUNTED)
_HEARTBEAT_FRAME: bytes = pack_header(P.HEARTBEAT, 0, 0)  # (a frame with no payload: its header)


def _sample_every(interval: float) -> int:
    """Heartbeats between two process samples of the recorder: one every 2 s."""
    return max(1, round(2.0 / interval))


# the compiled call path (mesharray._core's _serve.pxi): this module's constants and tables
serve_setup({"CALL": P.CALL, "REPLY": P.REPLY, "OK": P.OK, "FENCE": P.FENCE, "F_REPLY": P.F_REPLY}, _COUNTED,
            framing.decode, _names, _NO_ARGS_BYTES, _EMPTY_OK, _EMPTY_OK_BYTES, current, perf_counter_ns, REC,
            RECORD, MAX_ROWS, (SerializationError, ConnectionError), SMALL_FRAME, Connection.write_frame)


class Worker:
    """State of one worker: its actors, its connections, its event loop."""

    def __init__(self, rank: int, secret: bytes, exit_process: bool) -> None:
        self.rank = rank
        self.secret = secret
        self.exit_process = exit_process
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.actors: dict[int, _Slot] = {}
        self.done = threading.Event()
        self.controller: Channel | None = None
        self.relay: Channel | None = None  # the connection to the host's relay, if any
        self.order = _Order()
        self.listener: Listener | None = None
        self.local_listener: Listener | None = None
        self.inbound: set[Channel] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._loop_lock = threading.Lock()
        self.heartbeat_interval = 0.5
        #: the heartbeat thread's loop (heartbeat_loop), stopped by stop_serving
        self.beats = Beats(time.monotonic, self.heartbeat_interval, REC.sample if RECORD else None,
                           _sample_every(self.heartbeat_interval))
        #: (the relay's segment, this rank's offset in it): where ``beats`` go, if the relay gave one
        self.beat_slot: tuple | None = None
        self.exitcode = 0
        self.host_id = host_id()
        self.label: str | None = None
        self.mesh_name = "procs"
        self.actor_names: list[str] = []
        #: tasks for the main thread (run_on_main_thread), None while it does not serve them
        self.main_tasks: queue.SimpleQueue | None = None
        self.main_busy = False
        #: ends the process (run_worker sets it): called once, by the main thread or, when a
        #: main-thread task still runs at the stop, by a thread of its own
        self.finish: Callable[[], Any] | None = None
        self._finish_lock = threading.Lock()

    def stop_serving(self) -> None:
        """The controller is gone or stopped us: wake the main thread, which ends the process.

        When the main thread is busy with a task (a script blocked in a
        collective), a thread of its own ends the process instead.
        """
        self.beats.stop()
        self.done.set()
        tasks = self.main_tasks
        if tasks is not None:
            tasks.put(None)
            if self.main_busy and self.finish is not None:
                threading.Thread(target=self.finish, name="mesharray-exit", daemon=True).start()

    def serve_main_thread(self) -> None:
        """Run the tasks of :func:`run_on_main_thread` until the worker stops (the main thread's loop)."""
        tasks = self.main_tasks
        assert tasks is not None
        while not self.done.is_set():
            item = tasks.get()
            if item is None:
                break
            fn, fut = item
            if self.done.is_set() or not fut.set_running_or_notify_cancel():
                fut.cancel()
                continue
            self.main_busy = True
            try:
                result = fn()
            except BaseException as exc:  # (SystemExit and KeyboardInterrupt too: the caller decides)
                fut.set_exception(exc)
            else:
                fut.set_result(result)
            finally:
                self.main_busy = False
        while True:  # tasks queued after the stop never run
            try:
                item = tasks.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[1].cancel()

    # -- connections ------------------------------------------------------
    def on_peer_socket(self, sock) -> None:
        chan = Channel(sock, handler=self.on_frame, on_close=self._peer_closed, name="peer", on_call=self._call)
        # calls go straight from the reader to the compiled call path (on_call stays the channel's
        # own route to them, for a connection whose handler is the channel's again)
        chan.conn.handler = CallServer(self, chan)
        self.inbound.add(chan)
        try:
            chan.start()
        except BaseException:  # no thread to be had: the listener logs it and closes the socket
            self.inbound.discard(chan)
            raise

    def _peer_closed(self, conn, exc) -> None:
        self.inbound.discard(conn)

    def on_controller_closed(self, conn, exc) -> None:
        self.stop_serving()
        self.order.wake()

    def _sender(self, conn):
        """Who sent on ``conn``: the controller for the relay's connection too (its broadcasts' errors)."""
        return self.controller if conn is self.relay and conn is not None else conn

    # -- the two connections of a rank with a relay: one order (see _Order) -------------
    def _await(self, relayed: bool, n: int) -> None:
        o = self.order
        with o.cond:
            o.waiting += 1
            try:
                while (o.relayed if relayed else o.direct) < n and not self.done.is_set():
                    o.cond.wait(0.2)
            finally:
                o.waiting -= 1

    # -- the event loop for async actors ------------------------------------
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            with self._loop_lock:
                if self._loop is None:
                    loop = asyncio.new_event_loop()
                    t = threading.Thread(target=loop.run_forever, name="mesharray-actor-loop", daemon=True)
                    t.start()
                    self._loop_thread = t
                    self._loop = loop
        return self._loop

    # -- frames -------------------------------------------------------------
    def on_frame(self, conn, kind, flags, msg_id, target, view, payload) -> None:
        # ``conn`` is the peer's Channel (it keeps VIEW frames and hands CALLs to _call directly)
        if kind == P.CALL:
            self._call(conn, flags, msg_id, target, view, payload)
        elif kind == P.SPAWN:
            self._spawn(conn, msg_id, target, payload)
        elif kind == P.HELLO:
            conn.peer.update(pickle.loads(payload))
        elif kind == P.CONFIG:
            self._configure(conn, pickle.loads(payload))
        elif kind == P.STOP_ACTOR:
            slot = self.actors.pop(target, None)
            if slot is not None and RECORD:
                REC.actor(slot.name, "stopped")
            if slot is not None and slot.queue is not None:
                self.loop().call_soon_threadsafe(slot.queue.put_nowait, None)
        elif kind == P.INTROSPECT:
            self._introspect(conn, msg_id, payload)
        elif kind == P.DEBUG:
            debugger.on_command(conn, payload)
        elif kind == P.STOP:
            if flags & P.F_REPLY:
                conn.send(P.REPLY, 0, msg_id, P.OK, 0, _EMPTY_OK)
            self.stop_serving()
        else:
            log.warning("worker %d: ignoring frame of unknown kind %d", self.rank, kind)

    def _configure(self, conn, cfg: dict) -> None:
        """The controller's settings: all of them once adopted, then any of them (``procs.logging``);
        from the host's relay, the slot its heartbeats go to (``beat_slot``)."""
        if "beat_slot" in cfg:
            self._open_beat_slot(*cfg.pop("beat_slot"))
            if not cfg:
                return
        if "pid" in cfg:
            conn.peer["pid"] = cfg["pid"]
        self.heartbeat_interval = cfg.get("heartbeat_interval", self.heartbeat_interval)
        self.beats.interval, self.beats.sample_every = self.heartbeat_interval, _sample_every(self.heartbeat_interval)
        if "label" in cfg:
            set_worker_label(cfg["label"])
            self.label = cfg["label"] or self.label
        self.mesh_name = cfg.get("mesh") or self.mesh_name
        if "log_level" in cfg:
            logging.getLogger().setLevel(cfg["log_level"])
        if cfg.get("sync_output"):  # the controller is a notebook: a call's output goes before its reply
            sync_replies(conn.conn, P.REPLY)
            if self.relay is not None:
                sync_replies(self.relay.conn, P.REPLY)
        if self.relay is not None and "pid" in cfg:
            self.relay.peer["pid"] = cfg["pid"]  # (relayed calls are the controller's: telemetry spans)
        if "debug" in cfg:
            debugger.configure(cfg["debug"])
        self._retitle()

    def _spawn(self, conn, msg_id, actor_id, payload) -> None:
        name, cls, args, kwargs, shape = None, None, (), {}, None
        try:
            name, cls, args, kwargs, shape = framing.decode(payload)
        except BaseException as exc:
            rec = error_record(exc, name or "?", None, self.host, self.pid)
            conn.send(P.REPLY, 0, msg_id, P.ERR, 0, _error_parts(rec))
            return
        slot = _Slot(actor_id, name, shape)
        eps = getattr(cls, "_mesharray_endpoints", None) or {}
        slot.endpoints = set(eps)
        slot.concurrent = {n for n, opts in eps.items() if opts.get("concurrent")}
        slot.is_async = any(inspect.iscoroutinefunction(getattr(cls, n, None)) for n in eps)
        ctx = Context(name, None, shape, None, self.rank, self.host, self.pid)
        token = current.set(ctx)
        try:
            obj = cls(*args, **kwargs)
            ctx.actor = obj
            slot.obj = obj
            slot.ctx = ctx
        except BaseException as exc:
            slot.failure = error_record(exc, name, _coords(shape, self.rank), self.host, self.pid)
        finally:
            current.reset(token)
        self.actors[actor_id] = slot
        if RECORD:
            REC.actor(name, "spawned" if slot.failure is None else "spawn_failed",
                      "" if slot.failure is None else repr(slot.failure["exc"])[:500])
            if not name.startswith("__"):
                self.actor_names.append(name)
                self._retitle()
        if slot.is_async and slot.failure is None:
            loop = self.loop()
            ready = threading.Event()

            def start():
                slot.queue = asyncio.Queue()
                loop.create_task(self._mailbox(slot))
                ready.set()

            loop.call_soon_threadsafe(start)
            ready.wait()
        if msg_id:
            if slot.failure is not None:
                conn.send(P.REPLY, 0, msg_id, P.ERR, 0, _error_parts(slot.failure))
            else:
                conn.send(P.REPLY, 0, msg_id, P.OK, 0, _EMPTY_OK)

    def _call(self, conn, flags, msg_id, actor_id, view, payload) -> None:
        """A call (or broadcast) from channel ``conn`` (what :meth:`_frame` does for one)."""
        self._frame(conn, None, _CALL, flags, msg_id, actor_id, view, payload)

    def _frame(self, conn, _c, kind, flags, msg_id, actor_id, view, payload) -> None:
        """A frame of channel ``conn`` (from its connection ``_c``): a call runs here, any other
        kind goes to the channel. A call to a synchronous actor runs in the compiled
        :func:`~mesharray._core.serve_sync`; the connections' handlers (:class:`~mesharray._core.CallServer`)
        run those themselves and come here for the rest (a missing or failed actor, an async one)."""
        if kind != _CALL:
            conn._on_frame(_c, kind, flags, msg_id, actor_id, view, payload)
            return
        slot = self.actors.get(actor_id)
        reply = flags & P.F_REPLY
        if slot is None or slot.failure is not None:
            if slot is None:
                exc = RuntimeError(f"no actor with id {actor_id} on rank {self.rank} (stopped?)")
                rec = error_record(exc, "?", None, self.host, self.pid)
            else:
                rec = slot.failure
            if reply:
                conn.send(P.REPLY, 0, msg_id, P.ERR, 0, _error_parts(rec))
            else:  # a broadcast has nobody to tell but the log: never drop it silently
                print(f"broadcast of {P.decode_method(payload)[0]!r} to a missing actor dropped: "
                      f"{rec['exc']}", file=sys.stderr, flush=True)
            return
        if not slot.is_async:
            serve_sync(self, conn, conn.conn, slot, flags, msg_id, view, payload)
            return
        n = payload[0]
        key = bytes(payload[:1 + n])
        method = _names.get(key)
        if method is None:
            method = _names[key] = key[1:].decode()
        vshape = conn.views_in.get(view) if view else None
        self.loop().call_soon_threadsafe(slot.queue.put_nowait, (conn, msg_id, reply, method, payload, n, vshape))

    def _invoke(self, slot, method, payload, n):
        """Run endpoint ``method`` on a CALL payload (``n``: its method name's length): what sync and
        async calls share. Returns what the endpoint returns (an awaitable for an ``async`` one).
        """
        fn = slot.bound.get(method) or self._endpoint(slot, method)
        if len(payload) - 1 - n == _NO_ARGS_LEN and payload.endswith(_NO_ARGS_BYTES):
            return fn()  # no arguments: nothing to unpickle
        args, kwargs = framing.decode(memoryview(payload)[1 + n:])
        return fn(*args, **kwargs)

    def _endpoint(self, slot, method):
        if method not in slot.endpoints:
            raise AttributeError(f"actor {slot.name!r} ({type(slot.obj).__name__}) has no endpoint {method!r}")
        fn = slot.bound[method] = getattr(slot.obj, method)
        return fn

    def _reply_parts(self, chan, msg_id, slot, method, result):
        """The payload of the reply ``result`` (None: it cannot be pickled, and the caller was told)."""
        if result is None:
            return _EMPTY_OK
        try:
            return framing.encode_one(framing.dumps(result), chan.conn.same_host, chan.peer.get("pid"))
        except Exception as exc:
            err = TypeError(f"endpoint {method!r} returned a value of type {type(result).__name__} "
                            f"that cannot be sent: {exc}")
            self._fail(chan, msg_id, True, slot, err, method)
            return None

    def _send_reply(self, chan, msg_id, slot, method, result, parts, cork=False) -> bool:
        """Send a reply's payload (see :meth:`_reply`); False if it could not go."""
        conn = chan.conn
        try:
            conn.send(P.REPLY, 0, msg_id, P.OK, 0, parts, cork=cork and conn.more)
        except (SerializationError, ConnectionError) as exc:
            self._reply_failed(chan, msg_id, slot, method, result, exc)
            return False
        return True

    def _reply_failed(self, chan, msg_id, slot, method, result, exc) -> None:
        if isinstance(exc, SerializationError):  # over the frame limit, nothing sent: the caller must hear of it
            self._fail(chan, msg_id, True, slot, TypeError(
                f"endpoint {method!r} returned a value of type {type(result).__name__} that cannot be sent: "
                f"{exc}"), method)
        # (a ConnectionError: the caller is gone)

    def _fail(self, conn, msg_id, reply, slot, exc, method: str = "?") -> None:
        if RECORD:
            REC.error(slot.name, method, exc)
        rec = error_record(exc, slot.name, _coords(slot.shape, self.rank), self.host, self.pid)
        if reply:
            try:
                conn.send(P.REPLY, 0, msg_id, P.ERR, 0, _error_parts(rec))
            except ConnectionError:
                pass
        else:
            print(f"broadcast to actor {slot.name!r} raised:\n{rec['tb']}", file=sys.stderr, flush=True)
            # nobody waits for a broadcast: its sender hears of it at its next call here
            slot.broadcast_error.setdefault(self._sender(conn), rec)

    def _tell_broadcast_error(self, conn, msg_id, slot) -> bool:
        """Answer this call with the error of an earlier broadcast from the same sender (once)."""
        rec = slot.broadcast_error.pop(self._sender(conn), None)
        if rec is None:
            return False
        rec = dict(rec, tb="this call did not run: an earlier broadcast from this caller to this actor raised "
                           "(a broadcast has no reply, so its error comes with the next call):\n" + rec["tb"])
        try:
            conn.send(P.REPLY, 0, msg_id, P.ERR, 0, _error_parts(rec))
        except ConnectionError:
            pass
        return True

    async def _mailbox(self, slot) -> None:
        loop = asyncio.get_running_loop()
        while True:
            item = await slot.queue.get()
            if item is None:
                return
            if item[3] in slot.concurrent:
                loop.create_task(self._run_async(slot, *item))
            else:
                await self._run_async(slot, *item)

    async def _run_async(self, slot, conn, msg_id, reply, method, payload, n, vshape) -> None:
        if reply and slot.broadcast_error and self._tell_broadcast_error(conn, msg_id, slot):
            return
        ctx = Context(slot.name, slot.obj, slot.shape, vshape, self.rank, self.host, self.pid)
        token = current.set(ctx)
        t0 = perf_counter_ns()
        w0 = t0 + REC.wall_offset
        caller = conn.peer.get("pid") or 0
        stok = SPAN.set((caller, msg_id))  # (a task's own context: concurrent calls keep theirs)
        status, out = "ok", 0
        try:
            result = self._invoke(slot, method, payload, n)
            if inspect.isawaitable(result):
                result = await result
        except BaseException as exc:
            self._fail(conn, msg_id, reply, slot, exc, method)
            status = type(exc).__name__
            return
        finally:
            current.reset(token)
            SPAN.reset(stok)
            if RECORD and status != "ok":
                _record((w0, perf_counter_ns() - t0, slot.name, method, caller, msg_id, len(payload), 0, status))
        parts = self._reply_parts(conn, msg_id, slot, method, result) if reply else None
        if parts is not None:
            out = _EMPTY_OK_BYTES if parts is _EMPTY_OK else 24 + sum(map(len, parts))
        if RECORD:  # (before the reply goes: a caller that then reads telemetry finds the row)
            _record((w0, perf_counter_ns() - t0, slot.name, method, caller, msg_id, len(payload), out, status))
        if parts is not None:
            self._send_reply(conn, msg_id, slot, method, result, parts)

    # -- telemetry ----------------------------------------------------------
    def _introspect(self, conn, msg_id, payload) -> None:
        """Answer the controller's telemetry questions (on a connection of their own: never behind a call)."""
        req = pickle.loads(payload)
        what = req.get("what")
        try:
            if what == "snapshot":
                ans: Any = REC.snapshot(req.get("since"))
                ans.update(rank=self.rank, host=self.host_id, aggregates=REC.aggregates() if req.get("agg") else None)
            elif what == "stacks":
                ans = {"rank": self.rank, "pid": self.pid, "stacks": thread_stacks(bool(req.get("native")))}
            else:
                raise ValueError(f"unknown telemetry request {what!r}")
            conn.send(P.REPLY, 0, msg_id, P.OK, 0, framing.encode(framing.dumps(ans)))
        except Exception as exc:
            rec = error_record(exc, "__telemetry__", None, self.host, self.pid)
            conn.send(P.REPLY, 0, msg_id, P.ERR, 0, _error_parts(rec))

    def _retitle(self) -> None:
        actors = ",".join(self.actor_names[-3:])
        set_title(f"mesharray {self.mesh_name} rank {self.rank} [{self.label or ''}]" + (f" {actors}" if actors else ""))

    # -- life ---------------------------------------------------------------
    def _open_beat_slot(self, pid: int, fd: int, offset: int) -> None:
        """Send heartbeats into the relay's segment (its ``memfd``, opened through ``/proc``) at
        ``offset``; where it cannot be opened, they go on as frames."""
        try:
            f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
            try:
                mm = mmap.mmap(f, 0)
            finally:
                os.close(f)
        except (OSError, ValueError):
            return
        try:
            self.beats.slot(mm, offset)
        except (ValueError, BufferError):  # (not a slot of this segment: beats go on as frames)
            mm.close()
            return
        self.beat_slot = (mm, offset)

    def heartbeat_loop(self) -> None:
        """The heartbeat thread: ``beats`` (compiled) until the worker stops serving. Into the relay's
        slot once it gave one, else as frames to the relay (a relay watches its host's heartbeats)
        or the controller: the frame packed once and written by the compiled path, through
        ``send`` when frames wait ahead of it, which keeps their order."""
        conn = self.relay or self.controller
        if conn is None:
            return
        self.beats.to(conn.conn, _HEARTBEAT_FRAME, partial(conn.send, P.HEARTBEAT))
        self.beats.run()

    def shutdown(self) -> None:
        for lst in (self.listener, self.local_listener):
            if lst is not None:
                lst.close()
        for c in list(self.inbound):
            c.close(join=False)
        if self.relay is not None:
            self.relay.conn.drain(2.0)
            self.relay.close(join=False)
        if self.controller is not None:
            # replies and log lines the controller has not read yet go out first
            self.controller.conn.drain(2.0)
            self.controller.close(join=False)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._loop_thread is not None:
                self._loop_thread.join(2.0)
            if not self._loop.is_running():
                self._loop.close()


def _coords(shape, rank):
    try:
        return shape.coordinates(rank)
    except Exception:
        return {"rank": rank}


def run_worker(controller_address: str, secret: bytes, rank: int, *, listen: str = "unix",
               listen_host: str = "127.0.0.1", exit_process: bool = True, forward_logs: bool = True,
               ready: threading.Event | None = None, data_plane: str | None = None,
               relay: str | None = None) -> int:
    """Run a worker until its controller goes away (or stops it).

    Parameters
    ----------
    controller_address : str
        The controller listener's address (``"unix:PATH"`` or ``"tcp:HOST:PORT"``).
    secret : bytes
        The job secret (never pass it on a command line: argv is world-readable).
    rank : int
        This worker's global rank in the root process mesh.
    listen : {"unix", "tcp"}
        The kind of this worker's own listener (actor-to-actor calls come here);
        use ``"tcp"`` when callers may live on other hosts.
    listen_host : str
        Interface of a TCP listener (default 127.0.0.1).
    exit_process : bool
        True when the worker owns its process: it sets ``PR_SET_PDEATHSIG``,
        forwards its stdout/stderr to the controller (if ``forward_logs``) and
        calls ``os._exit`` at the end. False to run in a thread of another
        program (rank 0 of an MPI job runs in the controller's process).
    forward_logs : bool
        Send this process's stdout/stderr/logging to the controller, where they
        are printed prefixed by the rank.
    ready : threading.Event, optional
        Set once the worker has said hello (useful when running in a thread).
    data_plane : {"tcp", "ucx"}, optional
        With ``listen="tcp"``: the kind of this process's data plane (bulk data
        to other hosts; default TCP).
    relay : str, optional
        The address of this host's relay (:mod:`mesharray.runtime.relay`):
        messages to many ranks come through it, heartbeats go to it.

    Returns
    -------
    int
        The exit code (when ``exit_process`` is False).

    Examples
    --------
    >>> import threading
    >>> from mesharray.runtime.worker import run_worker
    >>> t = threading.Thread(target=run_worker, args=(ctl.address, secret, 0),   # doctest: +SKIP
    ...                      kwargs={"exit_process": False}, daemon=True)
    """
    if exit_process:
        _set_pdeathsig()
        prepare_process()
    set_secret(secret)
    w = Worker(rank, secret, exit_process)
    w.listener = Listener(secret, w.on_peer_socket, kind=listen, host=listen_host)
    address = w.listener.address
    extra: dict = {"domain": memory_domain(), "host_id": host_id()}
    if listen == "tcp":
        # callers on other hosts come over TCP; those of this host over a unix socket (and
        # their large payloads through shared memory); bulk data between hosts has its own plane
        w.local_listener = Listener(secret, w.on_peer_socket, kind="unix")
        address = dual_address(address, w.local_listener.address, extra["domain"])
        plane = start_process_plane(secret, listen_host, data_plane or "tcp")
        extra.update(data=plane.address, data_kind=plane.kind)
    from .router import get_router

    get_router().identity = {"role": "peer", "rank": rank, "pid": w.pid, "host": w.host}
    if exit_process and threading.current_thread() is threading.main_thread():
        global _main_worker
        w.main_tasks = queue.SimpleQueue()  # (before any call can arrive)
        _main_worker = w
    sock = connect(controller_address, secret)
    chan = Channel(sock, handler=w.on_frame, on_close=w.on_controller_closed, name="controller",
                   on_call=w._call)
    chan.conn.handler = CallServer(w, chan)  # (calls straight from the reader; see on_peer_socket)
    w.controller = chan
    if exit_process and forward_logs:
        forward_process_output(chan.conn)
    if exit_process:  # breakpoint() in an actor: a pdb driven from the controller
        debugger.install_worker(chan, rank, w.pid, w.host, address)
    hello = {"role": "worker", "rank": rank, "pid": w.pid, "host": w.host,
             "address": address, "forward_logs": forward_logs, **extra}
    chan.send(P.HELLO, parts=[pickle.dumps(hello)])
    if relay is not None:
        chan.conn.handler = CallServer(w, chan, 1)  # (counted: see _Order)
        rsock = connect(relay, secret)
        rchan = Channel(rsock, handler=w.on_frame, on_close=w.on_controller_closed, name="relay", on_call=w._call)
        rchan.conn.handler = CallServer(w, rchan, 2)
        rchan.conn.same_host = False  # (replies go on to the controller's host: in the frame, never shared memory)
        w.relay = rchan
        rchan.send(P.HELLO, parts=[pickle.dumps({"role": "worker", "rank": rank, "pid": w.pid,
                                                 "address": address})])
    chan.start()
    if w.relay is not None:
        w.relay.start()
    if ready is not None:
        ready.set()
    hb = threading.Thread(target=w.heartbeat_loop, name="mesharray-heartbeat", daemon=True)
    hb.start()

    def finish() -> int:
        with w._finish_lock:  # once: the main thread, or the thread ending a process whose main thread is busy
            w.shutdown()
            hb.join(1.0)
            if exit_process:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                except Exception:
                    pass
                flush_forwarding()
                os._exit(w.exitcode)
            return w.exitcode

    if w.main_tasks is not None:
        w.finish = finish
        w.serve_main_thread()
    else:
        w.done.wait()
    return finish()
