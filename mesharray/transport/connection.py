"""Connections: one authenticated socket per peer pair and direction, with framing.

A :class:`Connection` is made of a socket that :func:`~.address.connect` or a
:class:`~.listener.Listener` handed over, already authenticated. It knows
nothing of the runtime.

Design, for latency:

- **Sending happens in the caller's thread**, under one lock per connection:
  no hop to an I/O thread or event loop. Small frames are joined and written
  with one ``send``; large ones with ``sendmsg`` (scatter/gather, no copy).
  Small frames may be *corked* (queued and written together later, see
  :meth:`Connection.send`).
- **A send never blocks on a slow peer.** Writes are non-blocking; what the
  socket does not take at once waits in the connection's *backlog*, which one
  :class:`~.poller.Writer` thread per process drains as the peer reads.
  Blocking in ``sendall`` would let one busy peer stall the sender, and with it every
  frame the sender still had for the others: a worker whose reader thread
  waits in a collective for a peer whose part of that collective is still in
  the sender's hands would then never be released (a deadlock across peers).
  A sender waits only for its *own* bytes: a large frame whose buffers it
  borrowed (they are not copied), or a backlog over :data:`BACKLOG_MAX`
  (backpressure), and meanwhile the writer keeps every other connection
  moving.
- Reading, two modes. **Thread mode** (:meth:`Connection.start`; workers'
  inbound connections, whose handlers run actor code): one reader thread per
  connection does blocking ``recv_into`` into a reused buffer, parses every
  complete frame in it and calls the handler inline for each. **Poll mode**
  (:meth:`Connection.start_polled`; callers' connections, whose handlers only
  resolve futures): one :class:`~.poller.Poller` thread per process reads them
  all, and a caller blocked on one reply reads its connection itself. Both
  modes use one reader (``Connection._read_some``: recv, parse, hand frames
  over), blocking in thread mode, non-blocking under the poller; either may
  poll its socket before it blocks (:mod:`.spin`).
- A frame longer than the receive buffer gets a buffer of its own, which
  grows as the bytes arrive (by at most 64 MiB at a time, see :func:`_grow`),
  so a header that lies about its length costs nothing; the length was checked
  against the limit (:data:`framing.max_frame_size`) before anything.
- A malformed header or an oversized length is a :class:`FrameError`: it is
  logged and the connection is dropped; the listener keeps serving others.
  A frame over the limit is refused at the *sender* too
  (:class:`SerializationError`, nothing written): the peer would drop the
  connection, and with it every call in flight on it.
- :meth:`Connection.inject` loses or delays one connection's frames, for
  fault tests; off by default, and free while off.
"""

from __future__ import annotations

import collections
import itertools
import logging
import mmap
import os
import select
import socket
import threading
import time

from .._core import dispatch_frames, pack_frame, take_frame
from ..errors import (
    BrokenTransportError,
    ClosedTransportError,
    FrameError,
    SerializationError,
    TransportError,
)
from . import _wire, framing
from ._wire import Beats  # (a worker's heartbeats, compiled: they write on a connection)
from .interrupt import blocking_read, guard, unwinding
from .poller import Poller, Writer, _poller_thread, default_poller, default_writer, read_all, socket_closed
from .sockio import shut
from .spin import _spin_poll, mirror

__all__ = ["Connection", "Beats", "BACKLOG_MAX", "SMALL_FRAME"]

log = logging.getLogger("mesharray.transport")

_RECV_BUF = 1 << 18
#: payloads up to this many bytes are copied into their frame and written in one ``send``
SMALL_FRAME = 1 << 14
_CORK_MAX = 1 << 16  # flush corked frames once this many bytes are queued
_CORK_AGE = 0.0005  # ... or once the oldest has waited this long while handling a batch
_clock = time.perf_counter  # (the clock of _out_t0)
# the spin settings (spin.set_read_spin, spin.set_reply_spin), tested on every read as
# globals of this module: mirror() makes the setters keep these copies
_spin = _reply_spin = 0.0
mirror(globals())
_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0x40)
#: bytes a connection may hold unwritten before its senders wait for the peer to read
#: (env ``MESHARRAY_SEND_BACKLOG``); they resume once half of it is written
BACKLOG_MAX = int(os.environ.get("MESHARRAY_SEND_BACKLOG", str(64 << 20)))
#: the payload buffer of a frame longer than the receive buffer grows as its bytes
#: arrive, by what it holds (at least _GROW_MIN, at most _GROW_MAX) at a time: a
#: header that lies about its length costs what arrived plus one such step, never
#: the length it claims
_GROW_MAX = 64 << 20
_GROW_MIN = 1 << 20


def _grow(payload: bytearray, length: int) -> None:
    """Make ``payload`` (of a frame of ``length`` bytes) longer by one bounded chunk.

    Zero-filled, as ``bytearray(length)`` was (``bytes(n)`` is calloc'd: its
    pages are the kernel's zero page until written), and ``realloc`` moves
    large buffers by remapping, not copying.
    """
    n = len(payload)
    payload += bytes(min(length - n, max(n, _GROW_MIN), _GROW_MAX))


class Connection(_wire.Wire):
    """One authenticated socket: thread-safe ``send``; frames go to ``handler``.

    ``handler(conn, kind, flags, msg_id, target, view, payload)`` runs in the
    reader thread; ``on_close(conn, exc)`` runs once when the connection ends
    (``exc`` is ``None`` for a clean EOF or a local close). The state of every
    message is in C fields of its base (:class:`._wire.Wire`), the rest in
    its instance dictionary.
    """

    dropped_out = 0  # frames lost on purpose (inject)
    dropped_in = 0
    # poll mode only (set by start_polled and Poller.add)
    _fd: int
    _big: tuple[bytearray, memoryview, int, int] | None
    _poll_exc: BaseException | None

    def __init__(self, sock: socket.socket, handler=None, on_close=None, name: str = "",
                 limit: int | None = None) -> None:
        self.sock = sock
        self.handler = handler
        self.on_close = on_close
        self.name = name
        self.limit = framing.max_frame_size if limit is None else limit
        self.same_host = sock.family == socket.AF_UNIX
        self._send_lock = threading.Lock()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.closed_error: BaseException | None = None
        self.poller: "Poller | None" = None  # the poller reading it (poll mode), else None
        self.bytes_out = 0
        self.frames_out = 0
        self.bytes_in = 0
        self._out: list = []  # corked frames
        self.corked_bytes = 0  # bytes of corked frames not written yet (read-only outside)
        self._out_t0 = 0.0
        #: set by the reader before each frame it hands over: more frames of the same read follow
        self.more = False
        # frames of kind _route_kind go to _route.pop(msg_id)(target, payload), not to the handler
        # (see route()); _faulty: send is replaced (inject(), the notebook's runtime.logs.sync_replies),
        # so write_frame must leave frames to it
        self._route_kind = 0
        self._route: dict | None = None
        self._route_counts: list | None = None
        self._faulty = False
        # written frames the socket has not taken yet (memoryviews, in order), drained
        # by the process's Writer; positions count every byte ever handed to the socket
        self._backlog: collections.deque = collections.deque()
        self._backlog_n = 0
        self._queued_pos = 0
        self._written_pos = 0
        self._write_error: BaseException | None = None
        self._writer: "Writer | None" = None  # set while the writer watches this connection
        self._wcond = threading.Condition(self._send_lock)
        if sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    # -- sending ---------------------------------------------------------
    def send(self, kind: int, flags: int = 0, msg_id: int = 0, target: int = 0, view: int = 0,
             parts=(), cork: bool = False) -> bool:
        """Send one frame; ``parts`` is a list of bytes-like objects (the payload).

        ``cork=True`` queues a small frame instead of writing it: queued frames
        go out in order, in one write, at the next :meth:`flush` or uncorked
        send, at :data:`_CORK_MAX` queued bytes, or when a thread-mode reader
        is about to block. Returns True when this frame started a queue, so
        that the caller can arrange the next :meth:`flush` (the runtime's
        channel does: it flushes before anyone blocks waiting for a reply).
        """
        # the payload's size and header, and for a small frame the frame itself, in one compiled call
        n, data = pack_frame(kind, flags, msg_id, target, view, parts, SMALL_FRAME, self.limit)
        if data is None:
            raise SerializationError(framing.too_large(n, self.limit))
        if self._closed:
            raise ClosedTransportError(f"connection {self.name} is closed")
        self.bytes_out += n + 24
        self.frames_out += 1
        try:
            if n <= SMALL_FRAME:
                with self._send_lock:
                    out = self._out
                    if cork:
                        out.append(data)
                        self.corked_bytes += len(data)
                        if len(out) == 1:
                            self._out_t0 = _clock()
                            return True
                        if self.corked_bytes >= _CORK_MAX:
                            self._flush_locked()  # ^C
                    elif out:
                        out.append(data)
                        self._flush_locked()  # ^C
                    else:
                        self._write_locked(data)  # ^C
                return False
            else:
                with self._send_lock:
                    if self._out:
                        self._flush_locked()  # ^C
                    self._write_parts_locked([data, *parts])  # ^C
                return False
        except TransportError:
            raise
        except OSError as exc:
            raise BrokenTransportError(f"connection {self.name} broke while sending: {exc}") from exc

    #: write a whole small frame now if nothing waits ahead of it, else False (compiled: :mod:`._wire`;
    #: no Python frame of its own, so a Ctrl-C waits for its guarded caller's next marked line: the
    #: lines that call it, and ``_read_polled``, must stay unmarked)
    write_frame = _wire.write_frame

    def route(self, kind: int, table: dict | None, counts: list | None = None) -> None:
        """Send frames of ``kind`` to callbacks instead of the handler: ``table.pop(msg_id)(target, payload)``.

        For a caller's replies (``table``: its calls in flight by message id,
        each a callback of the reply's status and payload): the reader hands a
        reply straight to its call's callback. A frame of that kind whose id is
        not in ``table`` is dropped. ``counts``: a list of two ints, counting
        the frames routed and those whose ``target`` (a reply's status) is not
        0. ``table=None`` sends every frame to the handler again. While
        :meth:`inject` loses incoming frames, every frame goes to its handler.
        """
        new = (kind if table is not None else 0, table, counts)
        if "_route_saved" in self.__dict__:  # inject() loses incoming frames: in effect once it stops
            self._route_saved = new
        else:
            self._route_kind, self._route, self._route_counts = new

    def _flush_locked(self) -> None:
        data = b"".join(self._out)
        self._out.clear()
        self.corked_bytes = 0
        self._write_locked(data)  # ^C

    def flush(self) -> None:
        """Write the queued (corked) frames now; errors are left to the reader to report."""
        if not self._out:
            return
        with self._send_lock:
            if self._out:
                try:
                    self._flush_locked()
                except OSError:
                    self._out.clear()
                    self.corked_bytes = 0

    # -- non-blocking writes (see the module docstring) ---------------------------
    def _write_locked(self, data: bytes) -> None:
        """Write ``data`` (owned: nobody changes it later) without blocking on the peer."""
        if self._write_error is not None:
            self._raise_write_error()
        if self._backlog:
            self._rest_locked(data, 0)  # ^C
            return
        try:
            sent = self.sock.send(data, _DONTWAIT)
        except (BlockingIOError, InterruptedError):
            sent = 0
        if sent != len(data):
            self._rest_locked(data, sent)  # ^C
        # (written at once: the queued and written positions would move alike, so neither moves)

    def _rest_locked(self, data: bytes, sent: int) -> None:
        """Queue what the socket did not take of ``data`` (its first ``sent`` bytes went) for the writer."""
        nb = len(data)
        self._queued_pos += nb
        self._written_pos += sent
        watching = bool(self._backlog)
        self._backlog.append(memoryview(data)[sent:] if sent else memoryview(data))
        self._backlog_n += nb - sent
        if not watching:
            self._watch_locked()
        if self._backlog_n > BACKLOG_MAX:
            self._wait_locked(lambda: self._backlog_n <= BACKLOG_MAX // 2)  # ^C

    def _write_parts_locked(self, parts) -> None:
        """Write a large frame whose buffers are borrowed: returns once the socket has them all."""
        if self._write_error is not None:
            self._raise_write_error()
        views = [memoryview(p).cast("B") if not isinstance(p, bytes) else memoryview(p) for p in parts]
        self._queued_pos += sum(v.nbytes for v in views)
        end = self._queued_pos
        if not self._backlog:
            self._send_views(views)
            if not views:
                return
            self._watch_locked()
        for v in views:
            self._backlog.append(v)
            self._backlog_n += v.nbytes
        # the caller may reuse its buffers once we return: wait for the writer (which
        # meanwhile keeps every other connection of this process moving)
        try:
            self._wait_locked(lambda: self._written_pos >= end)  # ^C
        except KeyboardInterrupt:
            self._own_backlog_locked(end)
            raise

    def _own_backlog_locked(self, end: int) -> None:
        """A sender interrupted while the writer writes its frame: the frame stays whole (the writer
        finishes it), and what is left of it is copied, since the caller may now change its buffers."""
        left = end - self._written_pos
        backlog = self._backlog
        for i in range(len(backlog)):
            if left <= 0:
                break
            v = backlog[i]
            left -= v.nbytes
            backlog[i] = memoryview(v.tobytes())

    def _send_views(self, views: list) -> None:
        """Write from the front of ``views`` until the socket would block (consumes ``views``)."""
        sock = self.sock
        while views:
            try:
                sent = sock.sendmsg(views[:512], (), _DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            self._written_pos += sent
            while sent:
                v = views[0]
                if sent >= v.nbytes:
                    sent -= v.nbytes
                    views.pop(0)
                else:
                    views[0] = v[sent:]
                    sent = 0

    def _drain_locked(self) -> bool:
        """The writer's part: write what the socket takes now; True once the backlog is empty."""
        backlog = self._backlog
        try:
            while backlog:
                chunk = list(itertools.islice(backlog, 512))
                before = sum(v.nbytes for v in chunk)
                self._send_views(chunk)
                done = before - sum(v.nbytes for v in chunk)
                self._backlog_n -= done
                while done:  # drop what the socket took from the front of the backlog
                    v = backlog[0]
                    if done >= v.nbytes:
                        done -= v.nbytes
                        backlog.popleft()
                    else:
                        backlog[0] = v[done:]
                        done = 0
                if chunk:
                    return False
        except OSError as exc:
            self._fail_writes_locked(BrokenTransportError(f"connection {self.name} broke while sending: {exc}"))
        finally:
            self._wcond.notify_all()
        return True

    def _fail_writes_locked(self, exc: BaseException) -> None:
        if self._write_error is None:
            self._write_error = exc
        self._backlog.clear()
        self._backlog_n = 0
        self._wcond.notify_all()

    def _raise_write_error(self):
        err = self._write_error
        assert err is not None
        raise type(err)(str(err)) from err

    def _watch_locked(self) -> None:
        if self._writer is None:
            w = default_writer()
            w.watch(self)
            self._writer = w

    def _wait_locked(self, ready) -> None:
        while not ready():
            if self._write_error is not None:
                self._raise_write_error()
            if self._closed:
                raise ClosedTransportError(f"connection {self.name} closed while sending")
            self._wcond.wait(0.5)  # ^C

    def drain(self, timeout: float | None = None) -> bool:
        """Write the corked frames and wait until the peer has taken everything written.

        Returns False if ``timeout`` seconds passed first, or the connection
        broke or closed with frames still unwritten.
        """
        self.flush()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._send_lock:
            while self._backlog and not self._closed and self._write_error is None:
                left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
                if left <= 0:
                    return False
                self._wcond.wait(left)
            return not self._backlog

    @property
    def backlog_bytes(self) -> int:
        """Bytes written by senders that the peer has not taken yet."""
        return self._backlog_n

    # -- fault injection (tests) ---------------------------------------------------
    def inject(self, drop_out=None, drop_in=None, delay: float = 0.0) -> None:
        """Lose or delay this connection's frames, for fault tests; ``inject()`` stops it.

        ``drop_out``: frames sent on this connection are counted and never
        written (the sender sees success); ``drop_in``: frames read from it are
        discarded before the handler sees them. Each is ``True`` (every frame)
        or a predicate ``f(kind) -> bool`` choosing the frames by kind (e.g.
        only ``CALL``: a lost request; only ``REPLY``: a lost reply). ``delay``:
        seconds the sending thread sleeps before each frame it sends.
        ``dropped_out`` / ``dropped_in`` count the frames lost.

        Free while off: it replaces this connection's ``send`` and handler
        (instance attributes), the class's code paths never test for it.
        """
        real = self.__dict__.get("_real_handler", self.handler)
        self.__dict__.pop("send", None)
        self.handler = real
        self.__dict__.pop("_real_handler", None)
        saved = self.__dict__.pop("_route_saved", None)
        if saved is not None:
            self._route_kind, self._route, self._route_counts = saved
        self._faulty = False
        if not (drop_out or drop_in or delay):
            return
        if drop_out or delay:
            send = Connection.send
            out = (lambda kind: True) if drop_out is True else drop_out

            def faulty_send(kind: int, flags: int = 0, msg_id: int = 0, target: int = 0, view: int = 0,
                            parts=(), cork: bool = False) -> bool:
                if delay:
                    time.sleep(delay)
                if out is not None and out(kind):
                    self.dropped_out += 1
                    return False
                return send(self, kind, flags, msg_id, target, view, parts, cork)

            self.send = faulty_send  # type: ignore[method-assign]
            self._faulty = True  # (write_frame leaves every frame to faulty_send)
        if drop_in:
            keep = (lambda kind: False) if drop_in is True else (lambda kind: not drop_in(kind))

            def faulty_handler(conn, kind, *rest) -> None:
                if keep(kind):
                    real(conn, kind, *rest)
                else:
                    self.dropped_in += 1

            self._real_handler = real
            self.handler = faulty_handler
            self._route_saved = (self._route_kind, self._route, self._route_counts)  # (to faulty_handler too)
            self._route_kind, self._route, self._route_counts = 0, None, None

    # -- receiving -------------------------------------------------------
    def start(self) -> None:
        """Start the reader thread."""
        self._init_reading()
        self._thread = threading.Thread(target=self._read_loop, name=f"mesharray-recv-{self.name}",
                                        daemon=True)
        self._thread.start()

    def _init_reading(self) -> None:
        # an anonymous mapping, not a bytearray: its pages are the kernel's zero page until a read
        # writes them, where bytearray zero-fills all 256 KiB at once (64 page faults for each
        # connection of each of a thousand workers, whose messages mostly fit the first page)
        self._buf = mmap.mmap(-1, _RECV_BUF)
        self._view = memoryview(self._buf)
        self._start = self._end = 0
        self._big = None  # (payload, its view, bytes read, length) of a frame longer than _buf; header in _big_hdr
        self._big_hdr: tuple = ()
        self._read_exc: BaseException | None = None

    def _read_loop(self) -> None:
        # thread mode: the reader, compiled (_wire.read_loop), blocking and looping inside
        # (its state stays in locals) until the connection ends
        try:
            _wire.read_loop(self)
        finally:
            self._reader_done()

    # -- poll mode: one thread reads many connections ---------------------------
    def start_polled(self, poller: "Poller | None" = None) -> None:
        """Let ``poller`` (default: the process's) read this connection instead of a thread.

        For connections whose handler never blocks (the caller side: replies
        resolve futures): one reader thread for all peers means one wake-up
        for the replies of a whole ``call()``.
        """
        self._init_reading()
        self._polled = threading.Event()
        self._rlock = threading.Lock()
        (poller or default_poller()).add(self)
        self._pollobj = select.poll()  # for callers that read with a deadline, or poll first
        self._pollobj.register(self._fd, select.POLLIN)
        self._wait_spin = [0, 0]  # (read_until's polling: see _spin_poll)

    def read_until(self, done, deadline: float | None) -> bool | None:
        """Read this (polled) connection in the calling thread until ``done()`` is true.

        Returns ``None`` at once if another thread is reading it; else whether
        the connection is still open. Stops at ``deadline``
        (``time.monotonic()``), or when the connection ends. It first polls
        for what comes (:func:`~.spin.set_reply_spin`); then, without a deadline, it
        blocks in ``recv`` itself (one syscall per reply, no ``poll``), and
        closing the connection wakes it. On return the connection
        is disarmed: the caller gives it back to the poller (``rearm``) or
        leaves it parked (``keep_parked``).
        """
        if not self._rlock.acquire(False):
            return None
        ok = True
        poller = self.poller
        assert poller is not None, "read_until is for a polled connection"
        if self not in poller._parked:
            poller.disarm(self)  # keep the poller thread asleep while we read
        try:
            p = self._pollobj
            if deadline is None:
                while not done():  # ^C
                    if _reply_spin and _spin_poll(p, self._wait_spin):  # ^C
                        ok = self._read_polled()
                    else:
                        ok = self._read_some(0)
                    if not ok:
                        break
            else:
                while not done():  # ^C
                    if ((_reply_spin and _spin_poll(p, self._wait_spin, deadline))  # ^C
                            or p.poll(int(max(0.0, deadline - time.monotonic()) * 1000))):  # ^C
                        ok = self._read_polled()
                        if not ok:
                            break
                    elif time.monotonic() >= deadline:  # ^C
                        break
        finally:
            # an ended connection is finished while its read lock is held: the poller
            # (or another caller) must not start reading buffers being released
            try:
                if not ok:
                    self._end_polled()
            finally:
                self._rlock.release()
        return ok

    #: :meth:`read_until` over several polled connections (the replies of one ``call()``), in the
    #: calling thread with one ``poll``: :func:`~.poller.read_all`
    read_all = staticmethod(read_all)

    def _read_some(self, flags: int = socket.MSG_DONTWAIT) -> bool:
        """One read: what is there (``flags=0``: block until something comes), every complete frame
        handed to the handler in order; False once the connection ended (the reason in ``_read_exc``).

        The general reader of a polled connection (a caller waiting for its reply, a frame too
        long for :meth:`_read_polled`) and of a reader thread's long frame (:func:`._wire.read_loop`
        reads the rest). A frame longer than the receive buffer gets a buffer of exactly its
        length (after the limit check) and is read into it over as many reads as it takes.
        """
        sock, view, big = self.sock, self._view, self._big
        start, end = self._start, self._end
        limit, cap = self.limit, len(self._buf)
        try:
            if big is not None:
                payload, pv, have, length = big
                if have == len(payload):  # it grows with the bytes, never ahead of them
                    pv.release()
                    _grow(payload, length)
                    pv = memoryview(payload)
                n = sock.recv_into(pv[have:], 0, flags)
                if n == 0:
                    raise EOFError
                self.bytes_in += n
                have += n
                if have < length:
                    big = (payload, pv, have, length)
                else:
                    big = None
                    pv.release()
                    self.handler(self, *self._big_hdr, payload)
                self._big = big
                return True
            n = sock.recv_into(view[end:], 0, flags)
            if n == 0:
                raise EOFError
            self.bytes_in += n
            end += n
            while True:
                # every complete frame to the handler (per read, not per connection: inject()
                # may swap it), its header checked and its payload copied out, in one call
                try:
                    start, status, err = dispatch_frames(self.handler, self, view, start, end, limit, False,
                                                         _clock, _CORK_AGE, self._route_kind, self._route,
                                                         self._route_counts)
                except ValueError as e:
                    raise FrameError(f"bad frame from {self.name}: {e}") from None
                if err is not None:
                    raise err  # (a handler's: start is past its frame)
                if self._out and _clock() - self._out_t0 > _CORK_AGE:
                    self.flush()  # frames corked while handling a long batch
                if status <= 0:
                    if status == 0:
                        break
                    continue  # stopped after _CORK_AGE to flush: the rest of the batch
                big = self._start_big(start, end, status)
                start = end = 0
                break
            if start == end:
                start = end = 0
            elif start and cap - end < 65536:
                view[0:end - start] = view[start:end]
                end -= start
                start = 0
            self._start, self._end, self._big = start, end, big
            return True
        except (BlockingIOError, InterruptedError):
            self._start, self._end, self._big = start, end, big
            return True
        except BaseException as e:
            self._big = big
            self._read_exc = self._read_error(e)
        return False

    #: :meth:`_read_some` of a polled connection that poll found readable: one non-blocking read,
    #: its frames handed over (compiled: :mod:`._wire`)
    _read_polled = _wire.read_polled

    def _start_big(self, start: int, end: int, length: int) -> tuple:
        """The state of a frame of ``length`` bytes, longer than the receive buffer, whose first
        ``end - start`` bytes are at ``start``: only what has arrived is kept (a header that lies about
        its length costs nothing: the buffer grows as the bytes come)."""
        head = take_frame(self._view, start, end, self.limit)
        assert head is not None  # (its header is there: dispatch_frames read it)
        self._big_hdr = head[:5]
        payload = bytearray(self._view[start + 24:end])
        return (payload, memoryview(payload), len(payload), length - 24)

    def _read_error(self, e: BaseException) -> BaseException | None:
        """Why a read ended the connection (None: an EOF, or a local close), from what it raised."""
        if isinstance(e, EOFError):
            return None
        if isinstance(e, FrameError):
            log.warning("%s; dropping the connection", e)
            return e
        if isinstance(e, OSError):
            return None if self._closed else BrokenTransportError(f"connection {self.name} broke: {e}")
        log.exception("reader of connection %s failed", self.name, exc_info=e)  # a bug in a handler: never silent
        return e

    def _reader_done(self) -> None:
        self._view.release()
        if self._big is not None:
            self._big[1].release()
            self._big = None
        self._finish(self._read_exc)

    def _end_polled(self) -> None:
        """Finish a polled connection that ended, in the thread holding its read lock."""
        if self.poller is not None:
            self.poller.discard(self)
        self._poll_done()

    def _poll_done(self) -> None:
        try:
            self._reader_done()
        finally:
            self._polled.set()

    def _finish(self, exc) -> None:
        self._closed = True
        if self.closed_error is None:
            self.closed_error = exc
        self._drop_backlog()
        socket_closed()  # read_all's and ReadSet's poll objects may name this fd: rebuild them
        try:
            self.sock.close()
        except OSError:
            pass
        cb, self.on_close = self.on_close, None  # the close handler runs once
        if cb is not None:
            try:
                cb(self, exc)
            except Exception:
                log.exception("close handler of %s failed", self.name)

    @property
    def closed(self) -> bool:
        return self._closed

    def _drop_backlog(self) -> None:
        # what the peer never took is lost with the connection; senders waiting on it wake
        w = self._writer
        if w is not None:
            w.unwatch(self)
        with self._send_lock:
            self._writer = None
            self._fail_writes_locked(ClosedTransportError(f"connection {self.name} is closed"))

    def close(self, join: bool = True) -> None:
        """Close the socket; the reader thread sees EOF and ends."""
        if not self._closed:
            self._closed = True
            self._drop_backlog()
            shut(self.sock)
        t = self._thread
        polled = getattr(self, "_polled", None)
        if polled is not None:
            if join and not polled.is_set() and threading.current_thread() is not _poller_thread():
                polled.wait(5.0)
            return
        if t is None:
            try:
                self.sock.close()
            except OSError:
                pass
            cb, self.on_close = self.on_close, None
            if cb is not None:
                cb(self, None)
        elif join and t is not threading.current_thread():
            t.join(5.0)


_wire.setup(_clock, _CORK_AGE, FrameError, BrokenTransportError, globals())

# a Ctrl-C in the caller's thread never cuts a frame nor loses bytes read (see .interrupt)
guard(Connection.send, Connection._flush_locked, Connection.flush, Connection._write_locked,
      Connection._rest_locked, Connection._write_parts_locked, Connection._own_backlog_locked,
      Connection._send_views, Connection._fail_writes_locked, Connection._watch_locked, Connection._wait_locked,
      Connection.read_until, Connection._read_some, Connection._start_big,
      Connection._read_error, Connection._reader_done, Connection._end_polled, Connection._poll_done,
      Connection._finish, Connection._drop_backlog, Connection.route)
blocking_read(Connection.read_until, lambda loc: loc["self"].sock if loc.get("deadline") is None else None)


def _after_interrupt(loc: dict) -> None:
    """A reader interrupted (at a marked line): the poller reads the reply nobody waits for now."""
    conn = loc["self"]
    if conn.poller is not None and not conn._closed:
        conn.poller.keep_parked(conn)  # (re-armed by its sweep once the reader let go of the read lock)


unwinding(Connection.read_until, _after_interrupt)
