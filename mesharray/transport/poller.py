"""The process's I/O threads for connections, and a caller reading several connections itself.

- :class:`Poller` — one thread per process that reads every *polled*
  connection (:meth:`Connection.start_polled
  <mesharray.transport.connection.Connection.start_polled>`: the callers'
  connections, whose handlers only resolve futures). Each connection is armed
  one-shot and has a read lock; a caller waiting for its reply disarms
  (*parks*) its connection and reads it in its own thread.
- :class:`Writer` — one thread per process that finishes the writes the
  peers' sockets could not take at once (a connection's backlog).
- :func:`read_all` and :class:`ReadSet` — a caller reading the replies of a
  ``call()`` from several polled connections with one ``poll``, in its own
  thread (``ReadSet``: the set-up done once, for a loop of calls).

Both threads wait on a :class:`~mesharray.transport.readiness.ReadinessSet`
(``epoll``, or a selector). They start on first use and again after a fork
(:func:`default_poller`, :func:`default_writer`). Nothing here imports
:mod:`.connection`: it works on the connections it is given.
"""

from __future__ import annotations

import select
import threading
import time
from itertools import repeat
from typing import TYPE_CHECKING

from ..errors import ClosedTransportError
from . import _wire
from .interrupt import guard, unwinding
from .readiness import READ, WRITE, readiness_set
from .spin import _spin_poll, mirror

if TYPE_CHECKING:
    from .connection import Connection

__all__ = ["Poller", "ReadSet", "Writer", "default_poller", "default_writer", "read_all", "PARK_MAX"]

#: seconds a connection parked for a caller may stay unread before the poller reads it again
PARK_MAX = 0.05
# the caller's reply spin (spin.set_reply_spin), tested before every wait as a global of this module
_reply_spin = 0.0
mirror(globals())
#: read_all's poll objects: tuple of fds -> (poll, _sockets_closed when made, its polling's state)
_polls: dict = {}
_sockets_closed = 0  # sockets closed by connections so far (their fds may be reused: see socket_closed)


def socket_closed() -> None:
    """A connection closed its socket: the poll objects kept here may name its fd, which the
    next socket may reuse, so they are made again before their next use."""
    global _sockets_closed
    _sockets_closed += 1


def read_all(conns, done, deadline: float | None) -> list | None:
    """:meth:`~mesharray.transport.connection.Connection.read_until` over several polled connections
    (the replies of one ``call()``); it is ``Connection.read_all``.

    The calling thread reads them all (one ``poll`` for the lot, no hand-off
    to the poller thread). Returns ``None`` at once, reading nothing, if
    another thread is reading any of them; else the connections that
    ended. The others are left disarmed, as by ``read_until``.
    """
    held: list[Connection] = []
    for c in conns:
        if not c._rlock.acquire(False):
            for h in held:
                h._rlock.release()
            return None
        held.append(c)
    try:
        # one poll object per set of fds, kept: a call() loop on one mesh registers its
        # fds once (rebuilt once any socket closed: fds are reused). It holds fds only,
        # never connections: a cache must not keep dead connections and their buffers
        key = tuple(c._fd for c in held)
        cached = _polls.get(key)
        if cached is None or cached[1] != _sockets_closed:
            if len(_polls) >= 64:
                _polls.clear()
            cached = _polls[key] = (_poll_of(held), _sockets_closed, [0, 0])  # (+ its polling's state)
        return _read_held(held, cached[0], {c._fd: c for c in held}, done, deadline, spin=cached[2])  # ^C
    finally:
        for c in held:
            c._rlock.release()


def _poll_of(conns) -> select.poll:
    p = select.poll()
    for c in conns:
        p.register(c._fd, select.POLLIN)
    return p


def _read_held(held: list | tuple, p, by_fd: dict, done, deadline: float | None, parked: bool = False,
               spin: list | None = None) -> list:
    """The loop of :func:`read_all` over polled connections whose read locks the caller
    holds: read what comes until ``done()``; the connections that ended (finished here).
    ``parked``: the caller knows them all parked (no poller reads them meanwhile). ``spin``:
    the caller's polling state (:func:`_spin_poll`), kept from one wait to the next."""
    if spin is None:
        spin = [0, 0]
    ended: list[Connection] = []
    finished: list[Connection] = []
    try:
        if not parked:
            for c in held:
                poller = c.poller
                assert poller is not None, "read_all is for polled connections"
                if c not in poller._parked:
                    poller.disarm(c)
        while not done() and by_fd:  # ^C
            ready = ((_reply_spin and _spin_poll(p, spin, deadline))  # ^C
                     or p.poll(None if deadline is None else int(max(0.0, deadline - time.monotonic()) * 1000)))  # ^C
            for fd, _ in ready:
                c = by_fd.get(fd)
                if c is not None and not c._read_polled():
                    ended.append(c)
                    del by_fd[fd]
                    p.unregister(fd)
                    # finished now, under its read lock (see read_until), not after the
                    # loop: its close handler fails the calls waiting on it, which is
                    # what done() may be waiting for while the others' frames
                    # (heartbeats) keep this loop going
                    finished.append(c)
                    c._end_polled()
            if not ready and deadline is not None and time.monotonic() >= deadline:  # ^C
                break
    finally:
        for c in ended:
            if c not in finished:  # (an error between its end and finishing it above)
                c._end_polled()
    return ended


class ReadSet:
    """Polled connections that one caller reads together again and again: what
    :func:`read_all` sets up on every call (the poll object, the table of
    fds), set up once. For the replies of a ``call()`` on one mesh, in a loop.

    It holds its connections, so its owner must not keep it past them: the
    runtime's ``Fanout`` that owns one is dropped once the router's channel
    table changes (a peer dead, a mesh stopped), at that endpoint's next
    ``call()``. A closed socket anywhere in the process makes it set up again
    (fds are reused).
    """

    __slots__ = ("conns", "_locks", "_poll", "_fds", "_at", "_parked", "_set", "_spin")

    def __init__(self, conns) -> None:
        self.conns = tuple(conns)
        self._locks = tuple(c._rlock for c in self.conns)
        self._poll: select.poll | None = None
        self._fds: dict = {}
        self._at = -1
        pollers = {c.poller for c in self.conns}
        # (one poller for all, the process's: whether all are parked is one set comparison)
        self._parked = pollers.pop()._parked if len(pollers) == 1 and None not in pollers else None
        self._set = frozenset(self.conns)
        self._spin = [0, 0]  # (its polling before each wait: see _spin_poll)

    def read(self, done, deadline: float | None) -> list | None:
        """:func:`read_all` of these connections: ``None`` at once if another thread
        reads any of them, else the connections that ended."""
        locks = self._locks
        for i, lock in enumerate(locks):
            if not lock.acquire(False):
                for held in locks[:i]:
                    held.release()
                return None
        try:
            p = self._poll
            if p is None or self._at != _sockets_closed:
                self._at = _sockets_closed
                p = self._poll = _poll_of(self.conns)
                self._fds = {c._fd: c for c in self.conns}
            parked = self._parked
            ended = _read_held(self.conns, p, self._fds, done, deadline,  # ^C
                               parked is not None and parked.keys() >= self._set, self._spin)  # ^C
            if ended:
                self._poll = None  # (taken out of both: set up again next time)
            return ended
        finally:
            for lock in locks:
                lock.release()


class Poller:
    """One thread that reads many connections (epoll, or a selector: :mod:`.readiness`); see
    :meth:`Connection.start_polled <mesharray.transport.connection.Connection.start_polled>`.

    Each connection is armed one-shot and has a read lock. Whoever holds the
    lock reads: normally the poller thread, but a caller blocked on the reply
    of a single call reads its connection itself (``Connection.read_until``),
    which saves one thread wake-up per round trip; the lock holder re-arms the
    connection when done.
    """

    def __init__(self) -> None:
        self._readiness = readiness_set(READ, oneshot=True)
        self._conns: dict[int, Connection] = {}
        # connections disarmed by a caller about to wait for its reply (see park())
        self._parked: dict[Connection, float] = {}
        self._timeout = -1.0  # PARK_MAX while anything is parked
        self._sweep_lock = threading.Lock()
        self.thread = threading.Thread(target=self._loop, name="mesharray-poller", daemon=True)
        self.thread.start()

    def add(self, conn: Connection) -> None:
        fd = conn.sock.fileno()
        conn.poller = self
        conn._fd = fd
        self._conns[fd] = conn
        self._readiness.register(fd)

    def park(self, conn: Connection, now: float = 0.0) -> None:
        """Disarm ``conn`` *before* a call is sent on it whose caller will likely read the reply.

        ``now``: ``time.monotonic()`` if the caller has it (one clock read per ``call()``).

        Disarming only once the caller waits would race with the reply: on a
        busy machine the poller thread often won, and its hand-off cost a
        thread wake-up. A parked connection is re-armed by whoever reads it,
        by :meth:`Future.done`/callbacks, or by the poller itself after at most
        ~2 x ``PARK_MAX`` (heartbeats and deaths are noticed late by that much).
        """
        parked = self._parked
        if conn in parked:  # still disarmed since its last call: no syscall
            parked[conn] = now or time.monotonic()
            return
        # disarmed first, then marked: a thread that re-arms it in between (the poller ending a
        # read of it) leaves it armed and parked, read by the poller; the other order could leave
        # it disarmed and not parked, which nobody reads
        try:
            self._readiness.disarm(conn._fd)
        except (OSError, ValueError):
            pass
        parked[conn] = now or time.monotonic()
        self._start_sweeping()

    def park_all(self, conns, now: float) -> None:
        """:meth:`park` for several connections (one clock read): only those not parked yet cost a syscall."""
        parked = self._parked
        fresh = [c for c in conns if c not in parked]
        for conn in fresh:  # (disarmed before they are marked: see park)
            try:
                self._readiness.disarm(conn._fd)
            except (OSError, ValueError):
                pass
        parked.update(zip(conns, repeat(now)))
        if fresh:
            self._start_sweeping()

    def is_parked(self, conn: Connection) -> bool:
        """Whether ``conn`` is parked (disarmed for a caller that may read it)."""
        return conn in self._parked

    def keep_parked(self, conn: Connection) -> None:
        """A reader is done with ``conn`` (disarmed) and nothing is pending on it: leave it so.

        The next call parks it again without a syscall; if none comes within
        ``PARK_MAX`` the poller re-arms it (heartbeats, logs, EOF).
        """
        self._parked[conn] = time.monotonic()
        self._start_sweeping()

    def keep_parked_all(self, conns) -> None:
        """:meth:`keep_parked` for several connections (one clock read, one sweep check)."""
        self._parked.update(zip(conns, repeat(time.monotonic())))
        self._start_sweeping()

    def _start_sweeping(self) -> None:
        # the poller sleeps without a timeout while nothing is parked: wake it so
        # that it starts looking at the clock (once per burst of calls, not per call)
        if self._timeout >= 0:  # (sweeping already: read without the lock, checked again under it)
            return
        with self._sweep_lock:
            if self._timeout < 0:
                self._timeout = PARK_MAX
                self._readiness.wake()

    def unpark(self, conn: Connection) -> None:
        """Re-arm a parked connection (no-op if it is not parked)."""
        if self._parked.pop(conn, None) is not None:
            self.rearm(conn)

    def rearm(self, conn: Connection) -> None:
        self._parked.pop(conn, None)
        try:
            self._readiness.arm(conn._fd)
        except (OSError, ValueError):
            pass

    def disarm(self, conn: Connection) -> None:
        try:
            self._readiness.disarm(conn._fd)
        except (OSError, ValueError):
            pass

    def discard(self, conn: Connection) -> None:
        self._parked.pop(conn, None)
        if self._conns.get(conn._fd) is conn:
            del self._conns[conn._fd]
            try:
                self._readiness.unregister(conn._fd)
            except (OSError, ValueError):
                pass

    def _loop(self) -> None:
        parked = self._parked
        while True:
            events = self._readiness.poll(self._timeout)
            if parked:
                now = time.monotonic()
                for conn, t in list(parked.items()):
                    if now - t > PARK_MAX and conn._rlock.acquire(False):
                        # nobody came to read it: take it back (a reader re-arms it itself)
                        try:
                            self.unpark(conn)
                        finally:
                            conn._rlock.release()
            if not parked and self._timeout >= 0:
                with self._sweep_lock:  # (a park checks the timeout under this lock too)
                    if not parked:  # idle again: sleep until an event or the next park
                        self._timeout = -1.0
                        if parked:  # a park that read the old timeout without the lock (_start_sweeping)
                            self._timeout = PARK_MAX
            if events:
                _wire.poll_events(self, events)  # (each read under its read lock, re-armed: compiled)


class Writer:
    """One thread that finishes the writes the peers' sockets could not take at once.

    A connection whose socket buffer is full keeps the rest of its frames in
    its backlog (see ``Connection._write_locked``) and is watched here
    (level-triggered write readiness, :mod:`.readiness`) until the backlog is empty, so a
    sender never blocks on one slow peer while it has frames for the others.
    """

    def __init__(self) -> None:
        self._readiness = readiness_set(WRITE)
        self._conns: dict[int, Connection] = {}
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._loop, name="mesharray-writer", daemon=True)
        self.thread.start()

    def watch(self, conn: Connection) -> None:
        """Start draining ``conn`` (its send lock is held by the caller)."""
        try:
            fd = conn.sock.fileno()
            if fd < 0:
                raise OSError("socket is closed")
            with self._lock:
                self._conns[fd] = conn
                self._readiness.register(fd)
        except (OSError, ValueError) as exc:
            conn._fail_writes_locked(ClosedTransportError(f"connection {conn.name} is closed: {exc}"))

    def unwatch(self, conn: Connection) -> None:
        """Stop draining ``conn`` (its backlog is empty, or it is closing)."""
        with self._lock:  # a handful of entries: only connections with a backlog
            for fd, c in list(self._conns.items()):
                if c is conn:
                    del self._conns[fd]
                    try:
                        self._readiness.unregister(fd)
                    except (OSError, ValueError):
                        pass

    def _loop(self) -> None:
        while True:
            events = self._readiness.poll(None)
            for fd in events:
                conn = self._conns.get(fd)
                if conn is None:
                    continue
                with conn._send_lock:
                    if conn._writer is not self:
                        continue
                    if conn._drain_locked():
                        conn._writer = None
                        self.unwatch(conn)


_threads: dict = {}  # class -> the process's one instance (Poller, Writer)
_threads_lock = threading.Lock()


def _process_thread(cls):
    """The process's one ``cls`` (an object owning a thread): started on first use, again after fork."""
    obj = _threads.get(cls)
    if obj is None or not obj.thread.is_alive():
        with _threads_lock:
            obj = _threads.get(cls)
            if obj is None or not obj.thread.is_alive():
                obj = _threads[cls] = cls()
    return obj


def default_poller() -> Poller:
    """The process's poller (started on first use, recreated after fork)."""
    return _process_thread(Poller)


def default_writer() -> Writer:
    """The process's writer thread (started on first use, recreated after fork)."""
    return _process_thread(Writer)


def _poller_thread():
    p = _threads.get(Poller)
    return p.thread if p is not None else None


def _after_interrupt(loc: dict) -> None:
    """A reader of several connections interrupted (at a marked line): the poller reads the replies
    nobody waits for now, once the reader let go of their read locks (its sweep of parked connections)."""
    conns = [c for c in loc["by_fd"].values() if c.poller is not None]
    if conns:
        conns[0].poller.keep_parked_all(conns)


unwinding(_read_held, _after_interrupt)

# a Ctrl-C in the caller's thread never leaves a connection disarmed and unread (see .interrupt)
guard(read_all, _read_held, ReadSet.read, Poller.park, Poller.park_all, Poller.keep_parked, Poller.keep_parked_all,
      Poller._start_sweeping, Poller.unpark, Poller.rearm, Poller.disarm, Poller.discard, Writer.watch, Writer.unwatch)
