"""The controller: one listener, the workers that joined it, and their supervision.

A :class:`Controller` serves one root process mesh. It does not start
processes: a bootstrap does (``bootstrap.local`` forks them from a zygote,
``bootstrap.mpi`` finds them under ``mpirun``), and the controller *adopts*
whatever workers say HELLO with a rank (:meth:`Controller.adopt`). A bootstrap
may give the controller two hooks: ``exit_status(rank, timeout)`` (the exit
code or signal of a dead worker, from ``waitpid``) and ``kill(rank)`` (to end
a hung one).

Supervision
-----------
- **EOF** on a worker's connection: the worker is dead. The controller asks
  the bootstrap for its exit status (waiting at most 0.5 s), builds
  :class:`ActorDiedError` (rank, pid, exit code or signal) and fails every
  pending call on that worker and every later one. Other workers are
  untouched, so views that exclude the dead rank keep working.
- **Heartbeats**: every worker sends one every ``heartbeat_interval`` seconds
  (from a thread of its own). A worker silent for ``heartbeat_timeout``
  seconds (default 5) is *unresponsive*: reported, not killed (a call holding
  the GIL, a stopped process are alive); with ``kill_unresponsive=True`` it is
  declared dead (``reason="no heartbeat for ..."``) and killed through the
  bootstrap. A stall of the controller itself is not counted against workers.
- Failure hooks (``on_failure``) get a :class:`MeshFailure` for each death;
  ``ProcMesh`` uses them to call an owner's ``__supervise__``.

Relays
------
A mesh whose hosts have relays (:mod:`.relay`; host agents start them) has
one more connection per host: the relay says HELLO with ``role="relay"`` and
its host's ranks, and :meth:`Controller.adopt_relays` makes the mesh's
:class:`~.hosts.HostPlane` of them. Its workers' heartbeats go to their relay,
which sends one ``BEAT`` per interval naming the ranks whose heartbeats are
late and for how long: the controller takes that as their last heartbeat (and
the others' as now), so ``heartbeat_timeout``, the warnings and
``kill_unresponsive`` mean what they mean without a relay; a relay that falls
silent makes its ranks unresponsive. A relay whose connection ends takes its
ranks with it: they are declared dead at once, naming the relay.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
from typing import Any, Callable

from .. import _platform
from ..errors import ActorDiedError, BootstrapError, MeshFailure, MeshStoppedError
from ..transport import framing, interrupt, shm
from ..transport.listener import Listener
from ..transport.spin import set_reply_spin
from . import notebook
from . import protocol as P
from .caller import future_callback
from .channel import Channel
from .counters import Counters
from .debugger import debugger
from .future import Future, new_future
from .hosts import Addresses, HostPlane, relayed
from .logs import LogSink
from .router import get_router

__all__ = ["Controller", "WorkerInfo", "stop_actors", "wait_policy"]

log = logging.getLogger("mesharray.controller")


class WorkerInfo:
    """What the controller knows about one worker."""

    __slots__ = ("rank", "pid", "host", "address", "conn", "last_seen", "_error", "died_at", "unresponsive_since",
                 "hello", "paused")

    def __init__(self, rank, pid, host, address, conn, hello: dict | None = None) -> None:
        self.hello = hello or {}  # everything the worker said of itself (memory domain, data plane, ...)
        self.rank = rank
        self.pid = pid
        self.host = host
        self.address = address
        self.conn = conn
        self.last_seen = time.monotonic()
        self._error: BaseException | None = None
        self.died_at: float | None = None  # unix time the death (or stop) was recorded
        self.unresponsive_since: float | None = None  # set while its heartbeats are late
        #: its sessions paused in the debugger (session -> file:line): reported as paused, never unresponsive
        self.paused: dict = {}

    @property
    def error(self) -> BaseException | None:
        """Why the worker is dead (or stopped); ``None`` while alive."""
        return self._error

    @error.setter
    def error(self, err: BaseException | None) -> None:
        self._error = err
        self.died_at = time.time() if err is not None else None

    @property
    def alive(self) -> bool:
        return self.error is None

    def __repr__(self) -> str:
        return f"WorkerInfo(rank={self.rank}, pid={self.pid}, host={self.host!r}, alive={self.alive})"


class Controller:
    """Listener + adopted workers + supervision for one root process mesh.

    Parameters
    ----------
    listen : {"unix", "tcp"}
        Kind of listener: unix sockets for workers on this host, TCP otherwise.
    host : str
        Interface of a TCP listener (default 127.0.0.1: loopback only).
    heartbeat_interval, heartbeat_timeout : float
        Workers send a heartbeat every ``heartbeat_interval`` s; one silent for
        ``heartbeat_timeout`` s is *unresponsive*: reported (a warning, and
        ``unresponsive`` in ``ProcMesh.stats()``), not killed. A process is
        declared dead only on definitive signals: its connection's EOF and its
        exit status. A pause of the controller itself (it is the one that
        could not read heartbeats) is not blamed on the workers.
    kill_unresponsive : bool
        Kill a worker that stays unresponsive for ``heartbeat_timeout`` (its
        calls fail with ``ActorDiedError``), as a hung-process policy.
    name : str
        Name used in log prefixes and failure reports.
    """

    def __init__(self, *, listen: str = "unix", host: str = "127.0.0.1", heartbeat_interval: float = 0.5,
                 heartbeat_timeout: float = 5.0, name: str = "procs", kill_unresponsive: bool = False) -> None:
        if not (0 < heartbeat_timeout < 1e9 and 0 < heartbeat_interval < 1e9):  # (NaN and infinity too)
            raise ValueError(f"heartbeat interval and timeout must be > 0 and finite seconds, got "
                             f"{heartbeat_interval} and {heartbeat_timeout}")
        interrupt.install()  # a Ctrl-C here interrupts the caller, never a connection
        self.router = get_router()
        self.secret = self.router.secret
        self.name = name
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = max(heartbeat_timeout, 2 * heartbeat_interval)
        self.kill_unresponsive = kill_unresponsive
        self.workers: dict[int, WorkerInfo] = {}
        self.labels: dict[int, str] = {}
        self.exit_status: Callable[[int, float], Any] | None = None  # the bootstrap's hooks
        self.kill: Callable[[int], None] | None = None
        self.on_failure: list = []
        self.sink = LogSink()
        self.log_level: int | str | None = None  # the workers' logging level (procs.logging), once set
        self.notebook = notebook.attach(self)  # in a Jupyter kernel: the notebook integration
        self.counters = Counters()
        self.stopping = False
        self.stopped = False
        self._cond = threading.Condition()
        self._conns: set[Channel] = set()
        #: the mesh's fan-out through its hosts' relays (adopt_relays), None without relays
        self.plane: HostPlane | None = None
        self._relays: dict[int, Channel] = {}
        self.listener = Listener(self.secret, self._on_socket, kind=listen, host=host)
        self.address = self.listener.address
        self._monitor = threading.Thread(target=self._monitor_loop, name="mesharray-supervisor", daemon=True)
        self._monitor_stop = threading.Event()
        self._monitor.start()

    # -- connections ------------------------------------------------------
    def _on_socket(self, sock) -> None:
        # replies are resolved (and counted) by the channel; the rest comes to _on_frame
        chan = Channel(sock, handler=self._on_frame, on_close=self._on_close, name="worker",
                       counters=self.counters)
        with self._cond:
            if self.stopping:
                # accepted while stop() closes every connection (a worker that was still starting):
                # closed here, not kept open by a channel that nobody would close
                sock.close()
                return
            self._conns.add(chan)
        chan.start(polled=True)

    def _seen(self, info: WorkerInfo, t: float) -> None:
        """Rank ``info``'s last heartbeat was at ``t``."""
        info.last_seen = t
        if info.unresponsive_since is not None and t > info.unresponsive_since:
            log.warning("rank %d (pid %s) is responsive again after %.1f s", info.rank, info.pid,
                        t - info.unresponsive_since)
            info.unresponsive_since = None

    def _on_frame(self, conn: Channel, kind, flags, msg_id, target, view, payload) -> None:
        if kind == P.HEARTBEAT:
            info = conn.peer.get("info")
            if info is not None:
                self._seen(info, time.monotonic())
        elif kind == P.BEAT:  # a relay's heartbeat of its host
            now = time.monotonic()
            late = pickle.loads(payload)
            workers = self.workers
            for r in conn.peer.get("ranks", ()):
                info = workers.get(r)
                if info is not None and info.error is None:
                    silent = late.get(r)
                    if silent is None:
                        self._seen(info, now)
                    else:  # late at the relay: its last heartbeat is the relay's word, not this beat
                        info.last_seen = now - silent
        elif kind == P.GONE:  # a relay's answer for a dead rank's part of a relayed call (runtime.hosts)
            if self.plane is not None:
                self.plane.gone(conn.peer["host"], msg_id, payload)
        elif kind == P.LOG:
            self.counters.log_bytes += len(payload)
            rank: Any = conn.peer.get("rank")
            self.sink.write(self.labels.get(rank, f"rank={rank}"), target, bytes(payload), rank)
        elif kind == P.DEBUG:  # code of an actor called breakpoint()
            debugger().controller_event(self.secret, conn.peer.get("info"), payload)
        elif kind == P.HELLO:
            hello = pickle.loads(payload)
            if hello.get("role") == "relay":
                host = int(hello["host"])
                conn.name = f"relay of host {hello.get('host_id', host)}"
                conn.peer.update(role="relay", host=host, host_id=hello.get("host_id"), pid=hello.get("pid"),
                                 ranks=tuple(hello.get("ranks", ())), address=hello.get("address"))
                conn.conn.route(P.REPLY, conn.pending, None)  # (gathered replies are counted per rank: runtime.hosts)
                with self._cond:
                    self._relays[host] = conn
                    self._cond.notify_all()
                return
            if hello.get("role") != "worker":
                log.warning("controller: unexpected hello %r", hello)
                return
            rank = int(hello["rank"])
            info = WorkerInfo(rank, hello.get("pid"), hello.get("host"), hello.get("address"), conn, hello)
            conn.name = f"rank {rank}"
            conn.peer.update(rank=rank, ranks=(rank,), pid=info.pid, address=info.address, info=info)
            with self._cond:
                if rank in self.workers and self.workers[rank].alive:
                    log.warning("controller: duplicate hello for rank %d (pid %s); ignoring", rank, info.pid)
                    return
                self.workers[rank] = info
                self._cond.notify_all()
        else:
            log.warning("controller: ignoring frame of kind %d from %s", kind, conn.name)

    def _on_close(self, conn, exc) -> None:
        with self._cond:
            self._conns.discard(conn)
            self._cond.notify_all()
        if conn.peer.get("role") == "relay":
            self._relay_closed(conn, exc)
            return
        info = conn.peer.get("info")
        if info is None or info.error is not None:
            if info is not None:
                self.router.mark_dead(info.address, conn, info.error)
            return
        if self.stopping:
            err = MeshStoppedError(f"process mesh {self.name!r} was stopped")
            info.error = err
            self.router.mark_dead(info.address, conn, err)
            return
        exitcode = signal = None
        if self.exit_status is not None:
            try:
                status = self.exit_status(info.rank, 0.5)
            except Exception:
                status = None
            if status is not None:
                exitcode, signal = status
        # the exit status says it all; without one, what the connection said
        if exitcode is not None or signal is not None:
            reason = ""
        else:
            reason = "connection lost" if exc is None else f"connection lost: {exc}"
        self._fail(info, ActorDiedError((info.rank,), info.pid, exitcode, signal, reason), conn)

    def _fail(self, info: WorkerInfo, err: BaseException, conn=None) -> None:
        with self._cond:
            if info.error is not None:
                return
            info.error = err
            self._cond.notify_all()
        self.counters.deaths += 1
        self.router.mark_dead(info.address, conn or info.conn, err)
        if self.plane is not None:
            self.plane.died(info.rank, err)
        if not self.stopping and self.on_failure:
            # hooks run in a thread of their own: one may stop the mesh, which waits
            # for connections that the thread reporting this failure would close
            failure = MeshFailure(self.name, (info.rank,), err)
            threading.Thread(target=self._run_hooks, args=(failure,), name="mesharray-supervise",
                             daemon=True).start()

    def _run_hooks(self, failure: MeshFailure) -> None:
        for hook in list(self.on_failure):
            try:
                hook(failure)
            except Exception:
                log.exception("failure hook raised")

    def _monitor_loop(self) -> None:
        period = min(self.heartbeat_interval, self.heartbeat_timeout / 4)
        last = time.monotonic()
        while not self._monitor_stop.wait(period):
            now = time.monotonic()
            stalled = now - last - period
            last = now
            if self.stopping:
                continue
            if stalled > self.heartbeat_interval:
                # this process was paused (SIGSTOP, a long GC, a GIL-holding call): nobody
                # read the workers' heartbeats meanwhile, which says nothing about them
                for info in list(self.workers.values()):
                    info.last_seen += stalled
                continue
            for info in list(self.workers.values()):
                if info.error is not None or now - info.last_seen <= self.heartbeat_timeout:
                    continue
                if info.paused:  # in the debugger: paused on purpose, never unresponsive nor killed
                    info.last_seen = now
                    continue
                silent = now - info.last_seen
                if self.kill_unresponsive:
                    err = ActorDiedError((info.rank,), info.pid, reason=(
                        f"no heartbeat for {silent:.1f} s; killed as unresponsive (kill_unresponsive=True)"))
                    self._fail(info, err)
                    if self.kill is not None:
                        try:
                            self.kill(info.rank)
                        except Exception:
                            log.exception("could not kill unresponsive rank %d", info.rank)
                    info.conn.close(join=False)
                elif info.unresponsive_since is None:
                    info.unresponsive_since = now
                    self.counters.unresponsive += 1
                    log.warning(
                        "rank %d (pid %s) is unresponsive: no heartbeat for %.1f s (heartbeat_timeout=%g s). "
                        "It is alive and is not killed: a long call holding the GIL, or a stopped process; "
                        "its calls wait (use get(timeout=...)); proc_mesh(kill_unresponsive=True) kills it",
                        info.rank, info.pid, silent, self.heartbeat_timeout)

    # -- adoption ------------------------------------------------------------
    def adopt(self, n: int, timeout: float = 60.0, progress: bool = True, check=None) -> list[WorkerInfo]:
        """Wait for HELLOs of ranks ``0..n-1`` and configure them.

        ``check()`` is called while waiting (a bootstrap raises there when a
        process it started died early). Prints a progress line on stderr when
        it takes more than a second. Raises :class:`BootstrapError` on timeout.
        """
        t0 = time.monotonic()
        shown = False
        next_note = t0 + 1.0
        with self._cond:
            while True:
                have = sum(1 for r in range(n) if r in self.workers)
                if have == n:
                    break
                now = time.monotonic()
                if now - t0 > timeout:
                    missing = [r for r in range(n) if r not in self.workers]
                    raise BootstrapError(f"only {have} of {n} workers joined within {timeout} s; "
                                         f"missing ranks {missing[:16]}")
                if progress and now >= next_note:
                    print(f"mesharray: {have}/{n} processes started ({now - t0:.1f} s)",
                          file=sys.stderr, flush=True)
                    shown = True
                    next_note = now + 1.0
                self._wait_checked(check)
        infos = [self.workers[r] for r in range(n)]
        for info in infos:
            self._configure(info)
        if shown:
            print(f"mesharray: {n}/{n} processes started ({time.monotonic() - t0:.1f} s)",
                  file=sys.stderr, flush=True)
        return infos

    def _wait_checked(self, check) -> None:
        """Wait on ``self._cond`` (held) for at most 0.1 s, then run ``check()`` (the bootstrap's: it raises
        when the processes cannot join any more) without holding it."""
        self._cond.wait(0.1)
        if check is not None:
            self._cond.release()
            try:
                check()
            finally:
                self._cond.acquire()

    def adopt_relays(self, host_of: list[int], timeout: float = 60.0, check=None) -> HostPlane:
        """Wait for the HELLO of every host's relay (``host_of[r]``: rank r's host) and make the mesh's
        :class:`~.hosts.HostPlane` of them (after :meth:`adopt`)."""
        hosts = max(host_of) + 1
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self._relays) < hosts:
                if time.monotonic() > deadline:
                    missing = [h for h in range(hosts) if h not in self._relays]
                    raise BootstrapError(f"the relays of hosts {missing} did not join within {timeout} s")
                self._wait_checked(check)
            relays = [self._relays[h] for h in range(hosts)]
        plane = HostPlane(host_of, relays, [c.peer.get("host_id") or str(h) for h, c in enumerate(relays)],
                          self._death_of, self.counters)
        cfg = pickle.dumps({"heartbeat_interval": self.heartbeat_interval, "pid": os.getpid(), "mesh": self.name})
        for chan in relays:
            chan.send(P.CONFIG, parts=[cfg])
        for r, info in self.workers.items():
            plane.attach(r, info.conn)
        self.plane = plane
        return plane

    def _death_of(self, rank: int) -> BaseException | None:
        info = self.workers.get(rank)
        return None if info is None else info.error

    def _relay_closed(self, conn: Channel, exc) -> None:
        host = conn.peer["host"]
        pid = conn.peer.get("pid")
        name = conn.peer.get("host_id") or host
        why = "stopped" if self.stopping else ("its connection was lost" if exc is None else f"connection lost: {exc}")
        err: BaseException = ActorDiedError(conn.peer.get("ranks", ()), pid, reason=(
            f"the relay of host {name} (pid {pid}) is gone ({why}); the ranks of that host went with it"))
        if self.stopping:
            err = MeshStoppedError(f"process mesh {self.name!r} was stopped")
        plane = self.plane
        ranks = plane.relay_lost(host, err) if plane is not None else list(conn.peer.get("ranks", ()))
        if not self.stopping:
            for r in ranks:
                info = self.workers.get(r)
                if info is not None and info.error is None:
                    self._fail(info, ActorDiedError((r,), info.pid, None, None, (
                        f"the relay of host {name} (pid {pid}) is gone ({why}); its ranks exit with it")))
                    try:
                        info.conn.close(join=False)
                    except Exception:  # pragma: no cover - already closed
                        pass
        conn.fail(err)  # relayed calls in flight: each rank's own death error (runtime.hosts)

    def addresses(self, n: int) -> Addresses:
        """The worker addresses of ranks ``0..n-1`` (what the process mesh and its actor meshes share)."""
        return Addresses([self.workers[r].address for r in range(n)], self.plane)

    def _configure(self, info: WorkerInfo) -> None:
        info.last_seen = time.monotonic()
        self.router.register(info.address, info.conn)
        cfg = {"heartbeat_interval": self.heartbeat_interval, "pid": os.getpid(), "label": self.labels.get(info.rank),
               "mesh": self.name, "debug": os.environ.get("MESHARRAY_DEBUG", "1") != "0"}
        if self.notebook:  # a call's output goes out before its reply: shown in the cell that made it
            cfg["sync_output"] = True
        if self.log_level is not None:
            cfg["log_level"] = self.log_level
        info.conn.send(P.CONFIG, parts=[pickle.dumps(cfg)])

    def set_log_level(self, ranks: list[int], level: int | str) -> None:
        """Set the ``logging`` level of the workers of ``ranks`` (and of those that join later)."""
        self.log_level = level
        for r in ranks:
            info = self.workers.get(r)
            if info is not None and info.alive:
                try:
                    info.conn.send(P.CONFIG, parts=[pickle.dumps({"log_level": level})])
                except ConnectionError:
                    pass

    def adopt_one(self, rank: int, old_pid: int | None, timeout: float = 30.0) -> WorkerInfo:
        """Wait for the hello of a restarted ``rank`` (a process other than ``old_pid``) and configure it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                info = self.workers.get(rank)
                if info is not None and info.alive and info.pid != old_pid:
                    break
                if self.stopping:
                    raise MeshStoppedError(f"process mesh {self.name!r} is stopping")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BootstrapError(f"rank {rank} did not rejoin within {timeout} s")
                self._cond.wait(min(left, 0.1))
        self._configure(info)
        return info

    # -- stop -------------------------------------------------------------------
    def stop(self, timeout: float = 3.0) -> None:
        """Ask every live worker to exit and wait for their connections to end."""
        if self.stopped:
            return
        with self._cond:  # (a connection accepted from now on is closed at once: _on_socket)
            self.stopping = True
        for info in list(self.workers.values()):
            if info.error is None:
                try:
                    info.conn.send(P.STOP)
                except ConnectionError:
                    pass
        for chan in list(self._relays.values()):  # (they exit once their workers did: nothing waits on them)
            try:
                chan.send(P.STOP)
            except ConnectionError:
                pass
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._conns and time.monotonic() < deadline:
                self._cond.wait(0.02)
        for conn in list(self._conns):
            conn.close(join=False)
        for info in self.workers.values():
            if info.error is None:
                info.error = MeshStoppedError(f"process mesh {self.name!r} was stopped")
                self.router.mark_dead(info.address, info.conn, info.error)
        self.sink.flush()
        self._monitor_stop.set()
        if self._monitor is not threading.current_thread():
            self._monitor.join(2.0)
        self.listener.close()
        self.stopped = True

    # -- actors ------------------------------------------------------------------
    def spawn(self, addresses: Any, ranks: list[int], actor_id: int, name: str, actor_class: type,
              args: tuple, kwargs: dict, shape: Any) -> tuple[Any, list[Future[Any]]]:
        """Construct ``actor_class(*args, **kwargs)`` as actor ``actor_id`` on the workers of ``ranks``.

        One SPAWN frame per rank, pickled once (cloudpickle-compatible: the
        class travels by value when it is not importable, e.g. defined in
        ``__main__``); a rank that cannot be reached fails its future with its
        death error. Returns the pickled message (what :meth:`respawn` sends
        again) and one future per rank, completed when its constructor ran
        (an :class:`~mesharray.ActorError` if it raised).
        """
        message = framing.dumps((name, actor_class, args, kwargs, shape))
        futs = [new_future() for _ in ranks]
        cbs = [future_callback(f) for f in futs]
        plane = relayed(addresses)
        plan = None if plane is None else plane.plan(("spawn", tuple(ranks)), ranks, addresses, self.router)
        if plan is not None and plane is not None:  # ranks of several hosts: once per host, through their relays
            plane.send(plan, P.SPAWN, actor_id, None, framing.encode(message), lambda i, st, pl: cbs[i](st, pl))
            return message, futs
        self.router.send_many(addresses, ranks, P.SPAWN, actor_id, None, message, cbs=cbs)
        return message, futs

    def respawn(self, addresses: Any, rank: int, actor_id: int, message: Any, timeout: float = 60.0) -> None:
        """Send a :meth:`spawn`'s ``message`` again to (a restarted) ``rank`` and wait for its constructor."""
        fut: Future[Any] = new_future()
        self.router.send_many(addresses, [rank], P.SPAWN, actor_id, None, message, cbs=[future_callback(fut)])
        fut.get(timeout=timeout)

    def release(self, addresses: Any, keep_bytes: int) -> None:
        """After :meth:`stop`: forget the stopped workers' addresses and their shared memory.

        Later sends to those addresses raise :class:`~mesharray.MeshStoppedError`;
        the segments the workers sent us are unmapped, and of this process's
        free segments (which carried the mesh's messages) ``keep_bytes`` stay
        mapped for the next mesh.
        """
        for a in addresses:
            self.router.forget(a)
        for info in self.workers.values():
            if info.pid is not None:
                shm.forget_peer(info.pid)
        shm.trim(keep_bytes)

    def declare_dead(self, rank: int, reason: str) -> bool:
        """Fail ``rank`` now, as if its connection had ended: for deaths the bootstrap learns of first.

        A pod deleted by Kubernetes, a host whose machine vanished (no FIN ever
        comes): its calls fail with :class:`ActorDiedError` giving ``reason``,
        and its connection is closed. Returns False when the rank was not alive.
        """
        info = self.workers.get(rank)
        if info is None or info.error is not None or self.stopping:
            return False
        self._fail(info, ActorDiedError((rank,), info.pid, None, None, reason))
        try:
            info.conn.close(join=False)
        except Exception:  # pragma: no cover - already closed
            pass
        return True

    def close_connections(self, timeout: float = 2.0) -> None:
        for c in list(self._conns):
            c.close(join=False)


def stop_actors(addresses: Any, ranks: list[int], actor_id: int) -> None:
    """Drop actor ``actor_id`` on the workers of ``ranks`` (STOP_ACTOR; unreachable ranks skipped).

    Sent through this process's router, so an actor mesh handed to an actor
    can be stopped from there too.
    """
    router = get_router()
    plane = relayed(addresses)
    plan = None if plane is None else plane.plan(("stop", tuple(ranks)), ranks, addresses, router)
    if plan is not None and plane is not None:  # ranks of several hosts: once per host, through their relays
        plane.send(plan, P.STOP_ACTOR, actor_id, None, [], None)
        return
    for r in ranks:
        try:
            router.channel(addresses[r]).send(P.STOP_ACTOR, 0, 0, actor_id, 0)
        except Exception:
            pass


def wait_policy(workers: bool = True) -> None:
    """Check the waiting settings and set this process's, before any process starts.

    A bad ``MESHARRAY_CALLER_SPIN_US`` (and, for ``workers`` started from here
    with this environment, ``MESHARRAY_WORKER_SCHED`` or
    ``MESHARRAY_WORKER_SPIN_US``) is a ``ValueError`` here; this process then
    polls for its replies as ``MESHARRAY_CALLER_SPIN_US`` says
    (``transport.connection.set_reply_spin``).
    """
    if workers:
        _platform.worker_sched()
        _platform.worker_spin()
    set_reply_spin(_platform.caller_spin())
