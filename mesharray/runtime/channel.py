"""The runtime's state per peer: one :class:`Channel` per connection.

A :class:`~mesharray.transport.connection.Connection` is a socket with framing
and nothing else (frames out, frames in, the write backlog, close). What the
runtime keeps per peer lives here:

- the calls in flight (``pending``: ``msg_id -> callback``) and their reply
  resolution (REPLY frames never reach the owner's handler);
- the mesh views defined on the connection (``views_out`` by the sender,
  ``views_in`` by the receiver: VIEW frames);
- who the peer is (``peer``: rank, pid, address, ...) and, once it is known
  dead, the error every later send gets (``died``);
- the corking *policy* (when a frame may wait: :meth:`Channel.call`,
  :meth:`Channel.post`), the set of connections with corked frames and the
  flusher thread (:func:`flush_all`); the connection only queues and writes;
- *parking* and reading replies in the caller's thread (:meth:`Channel.wait`,
  :meth:`Channel.wait_all`, used by ``Future``).

The channel sorts incoming frames: REPLY to the pending call, VIEW to
``views_in``, CALL to ``on_call(channel, flags, msg_id, target, view,
payload)`` when given (a worker's actors: one dispatch level, as before the
channel existed), everything else to ``handler(channel, kind, flags, msg_id,
target, view, payload)``; ``on_close(channel, exc)`` runs once.
"""

from __future__ import annotations

import itertools
import os
import pickle
import threading
import time
from operator import attrgetter
from threading import get_ident
from typing import Any

from .._core import pack_calls, unpack_header
from ..errors import ActorDiedError, BackpressureError, BrokenTransportError, ClosedTransportError
from ..transport.connection import SMALL_FRAME, Connection
from ..transport.interrupt import guard
from ..transport.poller import ReadSet
from . import protocol as P
from .recorder import REC, SPAN

_current = REC.current

__all__ = ["Channel", "Fanout", "defer_flush", "flush_all", "flush_programs", "programs", "sending_program", "dirty",
           "next_id", "sent"]

next_id = itertools.count(1).__next__
_pid = os.getpid

#: a broadcast this soon after the previous one on its channel is corked (a burst)
_BURST = 100e-6

_CALL, _REPLY, _VIEW, _F_REPLY, _DIED, _OK = P.CALL, P.REPLY, P.VIEW, P.F_REPLY, P.DIED, P.OK
_COUNTED = (P.CALL, P.SPAWN, P.STOP_ACTOR, P.STOP)  # (runtime.hosts.COUNTED: what Channel.send fences)
_SendErrors = (BrokenTransportError, ClosedTransportError)
_died_of = attrgetter("died")

#: calls to one peer that may await their replies at once; a caller past it waits
#: for replies (or gets BackpressureError with MESHARRAY_PENDING_FULL=raise)
MAX_PENDING = int(os.environ.get("MESHARRAY_MAX_PENDING", "65536"))
PENDING_FULL = os.environ.get("MESHARRAY_PENDING_FULL", "wait")
_view_lock = threading.Lock()


class _Sent:
    """Frames sent by this process: ``calls`` (expecting a reply: calls, spawns), ``oneway`` (broadcasts)."""

    __slots__ = ("calls", "oneway")

    def __init__(self) -> None:
        self.calls = 0
        self.oneway = 0


sent = _Sent()


class Channel:
    """One connection to a peer, with the runtime's state about that peer.

    ``Channel(sock, handler, on_close, name)`` wraps ``sock`` in a
    :class:`Connection`; :meth:`start` starts reading it (``polled=True``: the
    process's poller, for the caller side whose handler only resolves
    replies; else a reader thread of its own, for the side that runs actors).
    """

    __slots__ = ("conn", "handler", "on_call", "on_close", "pending", "views_out", "views_in", "peer", "died",
                 "t_oneway", "polled", "counters", "fence", "__weakref__")

    def __init__(self, sock, handler=None, on_close=None, name: str = "", counters=None,
                 on_call=None) -> None:
        self.handler = handler
        self.on_call = on_call
        self.on_close = on_close
        self.pending: dict = {}
        self.views_out: dict = {}
        self.views_in: dict = {}
        self.peer: dict = {}
        self.died: BaseException | None = None
        self.t_oneway = 0.0
        self.polled = False  # True once read by the poller (callers may park and read it)
        self.counters = counters  # counters.Counters (replies, errors) or None
        #: a controller's direct channel to a rank whose host has a relay: the hook that keeps the rank's
        #: frames in order across both paths (``before(chan)``/``after()`` a counted frame; runtime.hosts)
        self.fence: Any = None
        self.conn = Connection(sock, handler=self._on_frame, on_close=self._on_conn_close, name=name)
        # a reply goes from the reader straight to its call's callback (and is counted), as _on_frame would
        self.conn.route(_REPLY, self.pending, None if counters is None else counters.tally)

    # -- the connection's side ------------------------------------------------
    def start(self, polled: bool = False) -> None:
        if polled:
            self.conn.start_polled()
            self.polled = True
        else:
            self.conn.start()

    def _on_frame(self, conn, kind, flags, msg_id, target, view, payload) -> None:
        if kind == _CALL:
            oc = self.on_call
            if oc is not None:
                oc(self, flags, msg_id, target, view, payload)
                return
        elif kind == _REPLY:
            c = self.counters
            if c is not None:  # (a routed reply is counted by the reader: see Connection.route)
                tally = c.tally
                tally[0] += 1
                if target != _OK:
                    tally[1] += 1
            cb = self.pending.pop(msg_id, None)
            if cb is not None:
                cb(target, payload)
            return
        elif kind == _VIEW:
            self.views_in[target] = pickle.loads(payload)
            return
        h = self.handler
        if h is not None:
            h(self, kind, flags, msg_id, target, view, payload)

    def _on_conn_close(self, conn, exc) -> None:
        cb, self.on_close = self.on_close, None
        if cb is not None:
            cb(self, exc)

    @property
    def name(self) -> str:
        return self.conn.name

    @name.setter
    def name(self, value: str) -> None:
        self.conn.name = value

    @property
    def closed(self) -> bool:
        return self.conn.closed

    def send(self, kind: int, flags: int = 0, msg_id: int = 0, target: int = 0, view: int = 0,
             parts=(), cork: bool = False) -> None:
        """One frame as is (control frames: HELLO, STOP, LOG, ...); ``cork``: see :meth:`Connection.send`."""
        f = self.fence
        if f is not None and kind in _COUNTED:
            f.before(self)
            ok = False
            try:
                if self.conn.send(kind, flags, msg_id, target, view, parts, cork):
                    _mark_dirty(self.conn)
                ok = True
            finally:
                f.after(ok)
            return
        if self.conn.send(kind, flags, msg_id, target, view, parts, cork):
            _mark_dirty(self.conn)

    def close(self, join: bool = True) -> None:
        self.conn.close(join)

    def lost(self) -> ActorDiedError:
        """The error of a peer whose connection ended before its close handler said why."""
        peer = self.peer
        return ActorDiedError(ranks=peer.get("ranks", ()), pid=peer.get("pid"),
                              reason=f"connection to {peer.get('address', self.conn.name)} lost")

    def fail(self, err: BaseException) -> None:
        """The peer is dead: every pending call gets ``err``, and so does every later send."""
        self.died = err
        pending = self.pending
        while pending:
            try:
                _, cb = pending.popitem()
            except KeyError:
                break
            cb(_DIED, err)

    # -- sending ----------------------------------------------------------------
    def view_id(self, shape) -> int:
        """The id of ``shape`` on this channel, defining it on first use (before any call uses it)."""
        vid = self.views_out.get(shape)
        if vid is None:
            with _view_lock:
                vid = self.views_out.get(shape)
                if vid is None:
                    vid = len(self.views_out) + 1
                    try:
                        self.conn.send(P.VIEW, 0, 0, vid, 0, [pickle.dumps(shape, protocol=5)])
                    except _SendErrors as exc:
                        raise (self.died or self.lost()) from exc
                    self.views_out[shape] = vid
        return vid

    def call(self, kind: int, target: int, view: int, parts, cb, park: bool = False, now: float = 0.0,
             flags: int = _F_REPLY, msg_id: int = 0) -> None:
        """Send one frame whose reply goes to ``cb(status, payload_or_error)``.

        Corked (written later, many per write) while earlier calls on this
        channel are in flight (pipelining); a lone call goes out at once.
        Corked frames are flushed before any wait (:func:`flush_all`) and by a
        flusher thread within ~0.2 ms.

        ``park=True``: the caller will likely read the reply itself (its
        future knows the channel): a lone call disarms the poller thread for
        this connection before it is written (``Poller.park``), so that the
        poller cannot win the race for the reply (``now``: ``time.monotonic()``
        if the caller has it, for a ``call()`` to many). A dead peer fails ``cb``
        (never raises). ``msg_id``: the frame's id, if the caller took one (:func:`next_id`).
        """
        sent.calls += 1
        mid = msg_id or next_id()
        span = SPAN.get() or _current.get(get_ident())
        if span is not None:  # a call made while handling one: the child span's parent (telemetry)
            REC.links.append((time.time_ns(), span[-2], span[-1], _pid(), mid))
        conn = self.conn
        pending = self.pending
        if len(pending) >= MAX_PENDING:
            self._backpressure()  # ^C
        cork = bool(pending) or conn.corked_bytes > 0
        if park and not cork:
            poller = conn.poller
            assert poller is not None  # parking is for polled connections
            poller.park(conn, now)
        pending[mid] = cb
        f = self.fence
        if f is not None:
            f.before(self)
        ok = False
        try:
            if conn.send(kind, flags, mid, target, view, parts, cork):  # ^C
                _mark_dirty(conn)
            ok = True
        except _SendErrors:
            pass  # the close handler fails the pending call with the death error
        except BaseException:  # nothing was sent (a frame over the limit), or a Ctrl-C: the caller gets the error
            pending.pop(mid, None)  # (an interrupted call may still run: its reply is dropped)
            if conn.corked_bytes:
                _mark_dirty(conn)
            raise
        finally:
            if f is not None:
                f.after(ok)
        err = self.died
        if err is not None:
            c = pending.pop(mid, None)
            if c is not None:
                c(_DIED, err)

    def _backpressure(self) -> None:
        # MAX_PENDING calls to this peer await replies: wait for some (reading them here
        # when this thread can), or raise if asked to; what is corked goes out first,
        # else its replies could never come
        if PENDING_FULL == "raise":
            raise BackpressureError(
                f"{len(self.pending)} calls to {self.conn.name} await their replies, the bound "
                f"MESHARRAY_MAX_PENDING={MAX_PENDING}; wait on some futures first")
        flush_all()
        low = MAX_PENDING * 9 // 10
        while len(self.pending) >= low and self.died is None:
            if not self.wait(lambda: len(self.pending) < low, time.monotonic() + 0.05):
                time.sleep(0.001)  # another thread reads this connection: let it

    def post(self, kind: int, target: int, view: int, parts, burst: bool = True, flags: int = 0) -> None:
        """Send one frame without a reply (a broadcast); raises the death error of a dead peer.

        Corked only inside a burst (within :data:`_BURST` of the previous one):
        a lone broadcast goes out at once, which spares the flusher thread's
        wake-up when nothing follows it soon. ``burst=False``: corked only behind
        frames already corked, for a sender about to wait on a reply (its wait
        would flush the frame anyway; corking it would only wake the flusher). ``flags``: the frame's.
        """
        conn = self.conn
        now = time.perf_counter()
        cork = conn.corked_bytes > 0 or (burst and now - self.t_oneway < _BURST)
        self.t_oneway = now
        f = self.fence
        if f is not None:
            f.before(self)
        ok = False  # (the steps of call's send, written out again: this is the per-message path)
        try:
            if conn.send(kind, flags, 0, target, view, parts, cork):  # ^C
                _mark_dirty(conn)
            ok = True
        except _SendErrors as exc:
            # the peer went away and its close handler has not run yet: the same
            # error every later send will get, not a transport detail
            raise (self.died or self.lost()) from exc
        except KeyboardInterrupt:
            if conn.corked_bytes:
                _mark_dirty(conn)
            raise
        finally:
            if f is not None:
                f.after(ok)
        sent.oneway += 1

    # -- reading replies in the caller's thread -----------------------------------
    def wait(self, done, deadline: float | None) -> bool:
        """Read replies in this thread until ``done()`` (or ``deadline``); False if another thread reads."""
        conn = self.conn
        ok = conn.read_until(done, deadline)  # ^C
        if ok is None:
            return False
        if ok:
            poller = conn.poller
            assert poller is not None
            if self.pending:
                poller.rearm(conn)  # replies nobody reads here: the poller's job
            else:
                poller.keep_parked(conn)  # saves two epoll_ctl per call in a call loop
        return True

    @staticmethod
    def wait_all(chans, done, deadline: float | None) -> bool:
        """:meth:`wait` over several channels (the replies of one ``call()``), one ``poll`` for all."""
        if len(chans) == 1:  # one actor: a blocking read, as call_one's (no poll object, no poll syscall)
            return chans[0].wait(done, deadline)  # ^C
        ended = Connection.read_all([ch.conn for ch in chans], done, deadline)  # ^C
        if ended is None:
            return False
        _after_read(chans, ended)
        return True

    def unpark(self) -> None:
        """Give the connection back to the poller thread now (nobody may come to read it)."""
        conn = self.conn
        p = conn.poller
        if p is not None and p.is_parked(conn):
            p.unpark(conn)

    def __repr__(self) -> str:
        return f"<Channel {self.conn.name} pending={len(self.pending)}>"


def _after_read(chans, ended: list) -> None:
    # a caller read these channels' replies itself: those with calls still in flight go back
    # to the poller, the others stay parked for the next call (no epoll_ctl in a call loop)
    idle = []
    for ch in chans:
        c = ch.conn
        if ended and c in ended:
            continue
        if ch.pending:
            c.poller.rearm(c)
        else:
            idle.append(c)
    if idle:
        idle[0].poller.keep_parked_all(idle)  # (the process's one poller)


class Fanout:
    """One frame to each of several channels, and their replies read by the caller: a ``call()`` on many actors.

    Made once for a set of polled channels (the actor layer keeps one per
    endpoint and mesh view, until the process's channel table changes) and
    then used for call after call: :meth:`call` packs every channel's frame and
    registers every call in one compiled step (``_core.pack_calls``) and
    writes each frame at once, and the future's ``get()`` reads every reply in
    its own thread through :meth:`wait` (one ``ReadSet``, set up once).
    Everything but that common case goes through :meth:`Channel.call` as
    before: a channel with calls in flight (its frame is corked behind them),
    a dead peer, a large payload; a connection with unwritten frames, or with
    faults injected, gets its frame through :meth:`Connection.send`.

    It is for code outside actors only: a call made while handling one
    records a telemetry link (:meth:`Channel.call`), which this path does not.
    """

    __slots__ = ("chans", "vids", "_conns", "_pendings", "_limit", "_reads", "_fences")

    def __init__(self, chans, vids) -> None:
        self.chans = tuple(chans)
        # channels to ranks of hosts with relays: their frames are counted (runtime.hosts)
        self._fences = tuple(ch.fence for ch in self.chans) if any(ch.fence for ch in self.chans) else None
        self.vids = tuple(vids)  # the view id of each channel's frames
        self._conns = tuple(ch.conn for ch in self.chans)
        self._pendings = tuple(ch.pending for ch in self.chans)
        self._limit = min(c.limit for c in self._conns)
        self._reads = ReadSet(self._conns)

    def call(self, kind: int, target: int, parts, cbs) -> None:
        """:meth:`Channel.call` on every channel, parked (``cbs[i]`` gets ``chans[i]``'s reply)."""
        chans = self.chans
        now = time.monotonic()
        # the common case: no call in flight on any of them (else a frame corks behind them), none dead
        if not any(map(len, self._pendings)) and not any(map(_died_of, chans)):
            conns = self._conns
            conns[0].poller.park_all(conns, now)  # (before any frame goes: the poller must not read the replies)
            fences = self._fences
            if fences is not None:
                held = 0
                try:
                    for f, chan in zip(fences, chans):
                        f.before(chan)
                        held += 1
                except BaseException:
                    for f in fences[:held]:
                        f.after(False)
                    raise
            ok = False
            try:
                _, frames = pack_calls(kind, _F_REPLY, target, self.vids, parts, self._pendings, cbs, next_id,
                                       SMALL_FRAME, self._limit)
                if frames is not None:
                    i = 0
                    try:
                        for conn, frame in zip(conns, frames):
                            try:
                                if not conn.write_frame(frame):
                                    self._send(conn, kind, target, frame, parts)
                            except _SendErrors:
                                pass  # the close handler fails the pending call with the death error
                            i += 1
                    except BaseException:  # (an interrupt, no thread for the writer): no call left unsent
                        for frame, pending in zip(frames[i:], self._pendings[i:]):
                            pending.pop(unpack_header(frame, len(frame))[3], None)
                        raise
                    ok = True
            finally:
                if fences is not None:  # (counted in the order they went, with the plane's lock held)
                    for f in fences:
                        f.after(ok)
            if frames is not None:
                sent.calls += len(frames)
                if any(map(_died_of, chans)):  # (died before its call was pending: nobody failed it)
                    for chan in chans:
                        if chan.died is not None:
                            self._died(chan)
                return
        for chan, vid, cb in zip(chans, self.vids, cbs):  # the general path, rank by rank
            chan.call(kind, target, vid, parts, cb, True, now)  # ^C

    @staticmethod
    def _send(conn: Connection, kind: int, target: int, frame: bytes, parts) -> None:
        # the frame's call through Connection.send (backlogged or corked frames ahead, faults injected)
        _, flags, _, mid, _, view = unpack_header(frame, len(frame))
        conn.send(kind, flags, mid, target, view, parts)

    def _died(self, chan: Channel) -> None:
        err = chan.died
        for mid, cb in list(chan.pending.items()):
            if chan.pending.pop(mid, None) is not None:
                cb(_DIED, err)

    def wait(self, done, deadline: float | None) -> bool:
        """:meth:`Channel.wait_all` on these channels."""
        ended = self._reads.read(done, deadline)  # ^C
        if ended is None:
            return False
        if ended or any(map(len, self._pendings)):
            _after_read(self.chans, ended)
        else:  # (what _after_read does when every call has its reply: all stay parked)
            conns = self._conns
            conns[0].poller.keep_parked_all(conns)
        return True

    def unpark(self) -> None:
        """:meth:`Channel.unpark` on every channel."""
        for ch in self.chans:
            ch.unpark()

    def __repr__(self) -> str:
        return f"<Fanout of {len(self.chans)} channels>"


# -- corked frames: flushed before any wait, or by the flusher thread ------------------
#: connections that may hold corked frames (read-only outside: ``if dirty: flush_all()``)
dirty: set = set()
_dirty = dirty
_dirty_lock = threading.Lock()
_flush_wake = threading.Event()
_flusher: threading.Thread | None = None


def _mark_dirty(conn: Any) -> None:
    global _flusher
    with _dirty_lock:
        _dirty.add(conn)
        if _flusher is None or _flusher.ident is not None and not _flusher.is_alive():
            _flusher = threading.Thread(target=_flush_loop, name="mesharray-flusher", daemon=True)
            _flusher.start()
    _flush_wake.set()


#: command buffers holding ops not sent yet (see defer_flush): sent before any other message of this
#: process, which must not overtake them (read-only outside: ``if programs: flush_programs()``)
programs: set = set()


_sending = threading.local()


class sending_program:
    """``with sending_program():`` around a command buffer's own sends: no other buffer is flushed from
    inside them (two buffers flushed by two threads, each from inside the other's, would wait on each
    other's locks)."""

    __slots__ = ()

    def __enter__(self) -> None:
        _sending.on = True

    def __exit__(self, *exc: Any) -> None:
        _sending.on = False


def flush_programs() -> None:
    """Send every command buffer now: what a caller does before a message of its own (an actor call
    after array ops must find their blocks made)."""
    if not programs or getattr(_sending, "on", False):
        return
    with _dirty_lock:
        objs = list(programs)
        programs.clear()
    for obj in objs:
        obj.flush()


def defer_flush(obj: Any) -> None:
    """Have ``obj.flush()`` run before this process next waits on a reply (:func:`flush_all`), or by
    the flusher thread (which looks every 0.2 ms), whichever comes first: for layers above that batch what they
    send (the distributed arrays' command buffers) as connections batch corked frames. The flusher
    calls ``obj.flush_idle()`` instead where it has one, which may flush or defer itself again.
    Also before any message a caller of this process sends (:func:`flush_programs`)."""
    programs.add(obj)
    _mark_dirty(obj)


def flush_all(background: bool = False) -> None:
    """Write every corked frame of this process now (called before blocking on a reply).

    What a flush sends may cork frames again (a command buffer's programs): those go too.
    ``background``: the flusher thread's pass, in which an object with a ``flush_idle()``
    (a command buffer) decides itself whether to go now (see :func:`defer_flush`).
    """
    for _ in range(4):
        if not _dirty:
            return
        with _dirty_lock:
            conns = list(_dirty)
            _dirty.clear()
        for c in conns:
            if background:
                getattr(c, "flush_idle", c.flush)()
            else:
                c.flush()
        if background:
            return


def _flush_loop() -> None:
    while True:
        _flush_wake.wait()
        _flush_wake.clear()
        time.sleep(0.0002)  # let a burst of sends accumulate
        flush_all(background=True)


# a Ctrl-C in the caller's thread never loses a frame nor a call's bookkeeping (see transport.interrupt)
guard(Channel.call, Channel.post, Channel.wait, Channel.wait_all, Channel.fail, Channel.view_id, Channel.unpark,
      _after_read, Fanout.call, Fanout.wait, Fanout._died, _mark_dirty, flush_all, flush_programs)
