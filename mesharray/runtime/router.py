"""Sending calls to actors and resolving their replies — one :class:`Router` per process.

Both the controller and every worker (for actor→actor calls) send through the
process's router. Connections are keyed by the *address* of the worker that
hosts the actor (ranks are per mesh, addresses are unique) and opened lazily,
except on the controller, which registers the connections its workers opened
to it during adoption. Replies come back on the connection that carried the
call and are resolved in that connection's reader thread.

Each connection keeps its ``pending`` calls (``msg_id -> callback``): when it
ends, every pending callback gets the connection's death error (for the
controller: :class:`ActorDiedError` with the exit status), and later sends to
that address fail at once with the same error.
"""

from __future__ import annotations

import itertools
import os
import pickle
import threading
import time

from ..errors import ActorDiedError, BrokenTransportError, ClosedTransportError
from ..transport import framing
from ..transport.connection import Connection, connect
from . import protocol as P
from .context import current

__all__ = ["Router", "get_router", "set_secret", "next_id", "flush_all"]

next_id = itertools.count(1).__next__

#: a broadcast this soon after the previous one on its connection is corked (a burst)
_BURST = 100e-6


class Router:
    """Outbound calls of one process."""

    def __init__(self, secret: bytes) -> None:
        self.secret = secret
        self.conns: dict[str, Connection] = {}
        self.peer_conns: dict[str, Connection] = {}  # used by code running inside actors
        self.dead: dict[str, BaseException] = {}
        self.sent_calls = 0  # frames that expect a reply (calls, spawns), this process
        self.sent_oneway = 0  # broadcasts, this process
        self._lock = threading.Lock()
        self._view_lock = threading.Lock()
        self.identity: dict = {"role": "peer", "pid": os.getpid()}

    # -- connections ------------------------------------------------------
    def register(self, address: str, conn: Connection) -> None:
        """Use ``conn`` (already started, its handler forwarding REPLY to :meth:`on_reply`)."""
        with self._lock:
            self.conns[address] = conn
            self.dead.pop(address, None)

    def connection(self, address: str) -> Connection:
        """The connection to send on to ``address``, opened on first use.

        Code running inside an actor gets connections of its own (to the
        worker's listener), never the ones the controller registered: when a
        worker runs in the controller's process (rank 0 under MPI), a call from
        an actor must not queue behind the very endpoint that makes it.
        """
        table = self.conns if current.get() is None else self.peer_conns
        conn = table.get(address)
        if conn is not None:
            return conn
        err = self.dead.get(address)
        if err is not None:
            raise err
        with self._lock:
            conn = table.get(address)
            if conn is not None:
                return conn
            try:
                sock = connect(address, self.secret)
            except (OSError, ConnectionError) as exc:
                raise ActorDiedError(reason=f"cannot connect to {address}: {exc}") from exc
            conn = Connection(sock, handler=self._on_frame, on_close=self._on_close, name=address)
            conn.peer["address"] = address
            conn.send(P.HELLO, parts=[pickle.dumps(self.identity)])
            conn.start_polled()
            table[address] = conn
            return conn

    def _on_frame(self, conn, kind, flags, msg_id, target, view, payload) -> None:
        if kind == P.REPLY:
            self.on_reply(conn, msg_id, target, payload)

    def _on_close(self, conn, exc) -> None:
        self.mark_dead(conn.peer.get("address", conn.name), conn, _lost(conn))

    def mark_dead(self, address: str, conn: Connection | None, err: BaseException) -> None:
        """Fail every pending call on ``address`` and every later send with ``err``."""
        with self._lock:
            self.dead[address] = err
            conns = {c for c in (conn, self.conns.pop(address, None), self.peer_conns.pop(address, None))
                     if c is not None}
        for c in conns:
            c.died = err
            pending = c.pending
            while pending:
                try:
                    _, cb = pending.popitem()
                except KeyError:
                    break
                cb(P.DIED, err)
            if c is not conn:
                c.close(join=False)

    def forget(self, address: str) -> None:
        with self._lock:
            self.dead.pop(address, None)
            conns = [self.conns.pop(address, None), self.peer_conns.pop(address, None)]
        for conn in conns:
            if conn is not None:
                conn.close(join=False)

    # -- calls ------------------------------------------------------------
    def on_reply(self, conn, msg_id, status, payload) -> None:
        cb = conn.pending.pop(msg_id, None)
        if cb is not None:
            cb(status, payload)

    def view_id(self, conn: Connection, shape) -> int:
        """The id of ``shape`` on ``conn``, defining it on first use (before any call uses it)."""
        vid = conn.views_out.get(shape)
        if vid is None:
            with self._view_lock:
                vid = conn.views_out.get(shape)
                if vid is None:
                    vid = len(conn.views_out) + 1
                    try:
                        conn.send(P.VIEW, 0, 0, vid, 0, [pickle.dumps(shape, protocol=5)])
                    except (BrokenTransportError, ClosedTransportError) as exc:
                        raise (conn.died or _lost(conn)) from exc
                    conn.views_out[shape] = vid
        return vid

    def send(self, conn: Connection, kind: int, target: int, view: int, parts, cb, park: bool = False) -> None:
        """Send one frame; ``cb(status, payload_or_error)`` gets the reply (``None``: no reply).

        Frames are corked (written later, many per write) when nobody can be
        waiting on them yet: broadcasts that follow another within
        :data:`_BURST` seconds, and calls while earlier calls on the connection
        are still in flight (pipelining). A lone call or broadcast goes out at
        once. Corked frames are flushed before any wait (:func:`flush_all`) and
        by a flusher thread within ~0.2 ms.

        ``park=True``: the caller will likely read the reply itself (its future
        knows the connection): a lone call disarms the poller thread for this
        connection before it is written (``Poller.park``), so that the poller
        cannot win the race for the reply.
        """
        if conn.on_cork is None:
            conn.on_cork = _mark_dirty
        if cb is None:
            # a broadcast is corked only inside a burst of them: a lone one goes out at
            # once, which spares the flusher thread's wake-up (~20 us of this thread's
            # CPU and a context switch) when nothing else follows it soon
            now = time.perf_counter()
            cork = bool(conn._out) or now - conn.t_oneway < _BURST
            conn.t_oneway = now
            try:
                conn.send(kind, 0, 0, target, view, parts, cork=cork)
            except (BrokenTransportError, ClosedTransportError) as exc:
                # the peer went away and its close handler has not run yet: the same
                # error every later send will get, not a transport detail
                raise (conn.died or _lost(conn)) from exc
            self.sent_oneway += 1
            return
        self.sent_calls += 1
        mid = next_id()
        cork = bool(conn.pending) or bool(conn._out)
        if park and not cork:
            conn._poller.park(conn)
        conn.pending[mid] = cb
        try:
            conn.send(kind, P.F_REPLY, mid, target, view, parts, cork=cork)
        except (BrokenTransportError, ClosedTransportError):
            pass  # the close handler fails the pending call with the death error
        err = conn.died
        if err is not None:
            c = conn.pending.pop(mid, None)
            if c is not None:
                c(P.DIED, err)


def _lost(conn: Connection) -> ActorDiedError:
    """The error of a peer whose connection ended before its close handler said why."""
    return ActorDiedError(ranks=conn.peer.get("ranks", ()), pid=conn.peer.get("pid"),
                          reason=f"connection to {conn.peer.get('address', conn.name)} lost")


_dirty: set = set()
_dirty_lock = threading.Lock()
_flush_wake = threading.Event()
_flusher: threading.Thread | None = None


def _mark_dirty(conn: Connection) -> None:
    global _flusher
    with _dirty_lock:
        _dirty.add(conn)
        if _flusher is None or _flusher.ident is not None and not _flusher.is_alive():
            _flusher = threading.Thread(target=_flush_loop, name="mesharray-flusher", daemon=True)
            _flusher.start()
    _flush_wake.set()


def flush_all() -> None:
    """Write every corked frame of this process now (called before blocking on a reply)."""
    if not _dirty:
        return
    with _dirty_lock:
        conns = list(_dirty)
        _dirty.clear()
    for c in conns:
        c.flush()


def _flush_loop() -> None:
    while True:
        _flush_wake.wait()
        _flush_wake.clear()
        time.sleep(0.0002)  # let a burst of sends accumulate
        flush_all()


_router: Router | None = None
_router_lock = threading.Lock()


def set_secret(secret: bytes) -> Router:
    """Install the process's router for ``secret`` (workers call this at start)."""
    global _router
    with _router_lock:
        if _router is None or _router.secret != secret:
            _router = Router(secret)
        return _router


def get_router() -> Router:
    """The process's router; in a controller process, created with a fresh job secret."""
    global _router
    r = _router
    if r is None:
        with _router_lock:
            if _router is None:
                from ..transport.auth import new_secret

                _router = Router(new_secret())
            r = _router
    return r
