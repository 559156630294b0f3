"""Connections and listeners: one authenticated socket per peer pair and direction.

Addresses are strings: ``"unix:@name"`` (same host, the default on Linux: an
abstract socket, so a killed process leaves no file behind), ``"unix:/path"``
(same host elsewhere; unix sockets have ~60% of TCP's loopback latency) or
``"tcp:host:port"`` (other hosts; listeners bind 127.0.0.1 unless told
otherwise).

Design, for latency:

- **Sending happens in the caller's thread**, under one lock per connection:
  no hop to an I/O thread or event loop. Small frames are joined and written
  with one ``send``; large ones with ``sendmsg`` (scatter/gather, no copy).
  Small frames may be *corked* (queued and written together later, see
  :meth:`Connection.send`).
- **A send never blocks on a slow peer.** Writes are non-blocking; what the
  socket does not take at once waits in the connection's *backlog*, which one
  :class:`Writer` thread per process drains as the peer reads. Blocking in
  ``sendall`` would let one busy peer stall the sender, and with it every
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
  resolve futures): one :class:`Poller` thread per process reads them all, and
  a caller blocked on one reply reads its connection itself. Both modes use
  one reader (``Connection._read_some``: recv, parse, hand frames over),
  blocking in thread mode, non-blocking under the poller.
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
import os
import select
import selectors
import socket
import struct
import threading
import time
from itertools import repeat

from .. import _platform
from .._core import dispatch_frames, pack_frame, take_frame
from ..errors import (
    AuthenticationError,
    BrokenTransportError,
    ClosedTransportError,
    FrameError,
    SerializationError,
    TransportError,
)
from . import auth, framing
from .hostid import memory_domain
from .readiness import READ, WRITE, readiness_set

__all__ = ["Connection", "Listener", "Poller", "ReadSet", "Writer", "connect", "default_poller", "default_writer",
           "parse_address", "dual_address", "peer_uid", "set_read_spin", "set_reply_spin", "BACKLOG_MAX", "MAX_HANDSHAKES",
           "SMALL_FRAME"]

log = logging.getLogger("mesharray.transport")

_RECV_BUF = 1 << 18
#: seconds a connection parked for a caller may stay unread before the poller reads it again
PARK_MAX = 0.05
#: payloads up to this many bytes are copied into their frame and written in one ``send``
SMALL_FRAME = 1 << 14
_CORK_MAX = 1 << 16  # flush corked frames once this many bytes are queued
_CORK_AGE = 0.0005  # ... or once the oldest has waited this long while handling a batch
_clock = time.perf_counter  # (the clock of _out_t0)
#: how long a reader thread polls its socket before it blocks in ``recv`` (seconds; see set_read_spin)
_spin = 0.0
#: how long a caller waiting for a reply polls before it blocks (seconds; see set_reply_spin)
_reply_spin = 0.0
_yield = getattr(os, "sched_yield", lambda: time.sleep(0))
_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0x40)
#: bytes a connection may hold unwritten before its senders wait for the peer to read
#: (env ``MESHARRAY_SEND_BACKLOG``); they resume once half of it is written
BACKLOG_MAX = int(os.environ.get("MESHARRAY_SEND_BACKLOG", str(64 << 20)))
#: connections a listener may hold unauthenticated at once (env ``MESHARRAY_MAX_HANDSHAKES``);
#: one more closes the oldest of them
MAX_HANDSHAKES = int(os.environ.get("MESHARRAY_MAX_HANDSHAKES", "128"))
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


def dual_address(tcp: str, unix: str, domain: str) -> str:
    """One address for a process that listens on TCP (for other hosts) and on a unix socket (for its own).

    ``connect`` takes the unix socket when the caller is in the same memory
    domain (:func:`~mesharray.transport.hostid.memory_domain`: same host, same
    host id), so large payloads between them keep the shared-memory path;
    everyone else connects over TCP.

    Examples
    --------
    >>> a = dual_address("tcp:10.0.0.7:4000", "unix:@w1", "abcd")
    >>> a
    'tcp:10.0.0.7:4000;unix:@w1;dom=abcd'
    >>> parse_address(a)[1]
    ('10.0.0.7', 4000)
    """
    return f"{tcp};{unix};dom={domain}"


def _split_dual(address: str) -> tuple[str, str | None, str | None]:
    tcp, _, rest = address.partition(";")
    unix, _, dom = rest.partition(";")
    return tcp, unix or None, dom[4:] if dom.startswith("dom=") else None


def parse_address(address: str):
    """Split an address string into ``(family, sockaddr)`` (the TCP part of a :func:`dual_address`)."""
    if not isinstance(address, str):
        raise TypeError(f"address must be a str, got {type(address).__name__}")
    if ";" in address:
        address = _split_dual(address)[0]
    if address.startswith("unix:@"):  # Linux abstract namespace: no file, nothing to leak
        return socket.AF_UNIX, "\0" + address[6:]
    if address.startswith("unix:"):
        return socket.AF_UNIX, address[5:]
    if address.startswith("tcp:"):
        host, _, port = address[4:].rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"bad tcp address {address!r}; expected 'tcp:host:port'")
        return socket.AF_INET, (host.strip("[]"), int(port))
    raise ValueError(f"bad address {address!r}; expected 'unix:PATH' or 'tcp:HOST:PORT'")


def set_reply_spin(seconds: float) -> None:
    """Make this process's callers poll for their replies for up to ``seconds`` before blocking.

    A thread waiting for the reply of a call (:meth:`Connection.read_until`,
    :meth:`Connection.read_all`, :class:`ReadSet`) tries ``poll`` without
    waiting, yielding the CPU between tries, and blocks once nothing came
    within ``seconds``; after a wait whose polling found nothing, its next 1,
    2, 4 ... 64 waits block at once (a caller of long calls hardly polls). A
    reply that comes while it polls needs no wake-up of the caller: on a
    virtual machine whose idle CPUs halt, with the workers polling too, a
    no-op ``call_one`` took 11.1 µs against 25.9 (bench/README.md, "Ninth
    pass"). ``0`` (the default) blocks at once; the
    controller's ``proc_mesh``/``attach`` set ``MESHARRAY_CALLER_SPIN_US``
    (:func:`~mesharray._platform.caller_spin`).
    """
    global _reply_spin
    if not seconds >= 0:
        raise ValueError(f"reply spin must be >= 0 seconds, got {seconds!r}")
    _reply_spin = float(seconds)


def _spin_poll(p, state: list, deadline: float | None = None) -> list:
    """A waiting caller's polling (:func:`set_reply_spin`): what ``p.poll(0)`` found ready, or
    ``[]`` (block). ``state``: the waiter's ``[waits left to block at once, back-off]``;
    ``deadline`` (``time.monotonic()``): the wait's, which the polling never passes."""
    if state[0]:
        state[0] -= 1
        return []
    spin = _reply_spin if deadline is None else min(_reply_spin, deadline - time.monotonic())
    end = _clock() + spin
    while True:
        ready = p.poll(0)
        if ready:
            state[1] = 0
            return ready
        if _clock() > end:
            break
        _yield()  # (a thread that wants this CPU runs: see set_read_spin)
    state[0] = state[1] = min(64, 2 * state[1] or 1)
    return ready


def set_read_spin(seconds: float) -> None:
    """Make this process's reader threads poll their sockets for up to ``seconds`` before blocking.

    After a read, a thread-mode reader (:meth:`Connection.start`) tries its
    socket without waiting, yielding the CPU between tries (so that any thread
    that wants it runs), and blocks in ``recv`` once nothing came within
    ``seconds``; it then blocks at once for its next 1, 2, 4 ... 64 reads, and
    polls every read again once a message comes while it polls: it polls in a
    loop of messages, hardly ever when idle. A message that comes while it
    polls needs no wake-up: on a virtual machine whose idle CPUs halt, waking
    one costs the sender ~15 µs and the reader ~30 µs (bench/README.md,
    "Seventh pass"). Readers sharing a core poll in turns, which keeps that
    core awake through a ``call()`` to all of them: it stopped at the first
    yield that another thread took over 20 µs, until the ninth pass, and a
    ``call()`` to 8 actors on 2 cores took 134.1 µs against 94.1 (the first
    of 8 workers ran ~45 µs after its message, its core waking from a halt;
    bench/README.md, "Ninth pass"). ``0`` (the default) blocks at once.
    """
    global _spin
    if not seconds >= 0:
        raise ValueError(f"read spin must be >= 0 seconds, got {seconds!r}")
    _spin = float(seconds)


class Connection:
    """One authenticated socket: thread-safe ``send``; frames go to ``handler``.

    ``handler(conn, kind, flags, msg_id, target, view, payload)`` runs in the
    reader thread; ``on_close(conn, exc)`` runs once when the connection ends
    (``exc`` is ``None`` for a clean EOF or a local close).
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
        # (see route()); _faulty: inject() replaced send, so write_frame must leave frames to it
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
                            self._flush_locked()
                    elif out:
                        out.append(data)
                        self._flush_locked()
                    else:
                        self._write_locked(data)
                return False
            else:
                with self._send_lock:
                    if self._out:
                        self._flush_locked()
                    self._write_parts_locked([data, *parts])
                return False
        except TransportError:
            raise
        except OSError as exc:
            raise BrokenTransportError(f"connection {self.name} broke while sending: {exc}") from exc

    def write_frame(self, frame: bytes) -> bool:
        """Write a whole small frame now if nothing waits ahead of it; False, having done nothing, otherwise.

        The lean path of a caller sending to many peers at once (a ``call()``):
        ``frame`` is packed by :func:`~mesharray._core.pack_calls` (or
        :func:`~mesharray._core.pack_frame`), its payload at most
        :data:`SMALL_FRAME` bytes and under this connection's limit. False when
        frames are corked or unwritten on this connection, when it is closed
        or failed, or while :meth:`inject` is on: the caller then sends with
        :meth:`send`, which handles all of those. What the socket does not
        take at once goes to the backlog, as with :meth:`send`.
        """
        with self._send_lock:
            if self._out or self._backlog or self._closed or self._faulty or self._write_error is not None:
                return False
            try:
                sent = self.sock.send(frame, _DONTWAIT)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                raise BrokenTransportError(f"connection {self.name} broke while sending: {exc}") from exc
            if sent != len(frame):
                self._rest_locked(frame, sent)
        self.bytes_out += len(frame)
        self.frames_out += 1
        return True

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
        self._write_locked(data)

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
            self._rest_locked(data, 0)
            return
        try:
            sent = self.sock.send(data, _DONTWAIT)
        except (BlockingIOError, InterruptedError):
            sent = 0
        if sent != len(data):
            self._rest_locked(data, sent)
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
            self._wait_locked(lambda: self._backlog_n <= BACKLOG_MAX // 2)

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
        self._wait_locked(lambda: self._written_pos >= end)

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
            self._wcond.wait(0.5)

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
        self._buf = bytearray(_RECV_BUF)
        self._view = memoryview(self._buf)
        self._start = self._end = 0
        self._big = None  # (payload, its view, bytes read, length) of a frame longer than _buf; header in _big_hdr
        self._big_hdr: tuple = ()
        self._read_exc: BaseException | None = None
        self._spin_skip = self._spin_backoff = 0  # (_spin_recv's backing off)

    def _read_loop(self) -> None:
        # thread mode: the same reader as poll mode, blocking, looping inside (its state
        # stays in locals) until the connection ends
        try:
            self._read_some(0, True)
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
        for what comes (:func:`set_reply_spin`); then, without a deadline, it
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
                while not done():
                    if _reply_spin and _spin_poll(p, self._wait_spin):
                        ok = self._read_polled()
                    else:
                        ok = self._read_some(0)
                    if not ok:
                        break
            else:
                while not done():
                    if ((_reply_spin and _spin_poll(p, self._wait_spin, deadline))
                            or p.poll(int(max(0.0, deadline - time.monotonic()) * 1000))):
                        ok = self._read_polled()
                        if not ok:
                            break
                    elif time.monotonic() >= deadline:
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

    @staticmethod
    def read_all(conns, done, deadline: float | None) -> list | None:
        """:meth:`read_until` over several polled connections (the replies of one ``call()``).

        The calling thread reads them all (one ``poll`` for the lot, no hand-off
        to the poller thread). Returns ``None`` at once, reading nothing, if
        another thread is reading any of them; else the connections that
        ended. The others are left disarmed, as by :meth:`read_until`.
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
            return _read_held(held, cached[0], {c._fd: c for c in held}, done, deadline, spin=cached[2])
        finally:
            for c in held:
                c._rlock.release()

    def _spin_recv(self, sock: socket.socket, buf) -> int:
        """``sock.recv_into(buf)`` for a reader thread, polled first (:func:`set_read_spin`)."""
        if self._spin_skip:
            self._spin_skip -= 1
            return sock.recv_into(buf, 0, 0)
        deadline = _clock() + _spin
        while True:
            try:
                n = sock.recv_into(buf, 0, _DONTWAIT)
            except BlockingIOError:
                pass
            else:
                self._spin_backoff = 0
                return n
            if _clock() > deadline:
                break
            _yield()
        self._spin_skip = self._spin_backoff = min(64, 2 * self._spin_backoff or 1)
        return sock.recv_into(buf, 0, 0)

    def _read_some(self, flags: int = socket.MSG_DONTWAIT, loop: bool = False) -> bool:
        """The reader of both modes: read what is there, hand every complete frame to the
        handler in order; False once the connection ended (the reason in ``_read_exc``).

        ``flags=0``: block until something comes (thread mode, or a caller
        waiting for its reply). ``loop=True`` (thread mode): go on reading
        until the connection ends, flushing what the handlers corked (replies)
        before blocking again. A frame longer than the receive buffer gets a
        buffer of exactly its length (after the limit check) and is read into
        it over as many reads as it takes.
        """
        sock, view, big = self.sock, self._view, self._big
        start, end = self._start, self._end
        limit, cap = self.limit, len(self._buf)
        try:
            while True:
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
                    if not loop:
                        self._big = big
                        return True
                    if big is None and self._out:
                        self.flush()  # the reply to a large frame: out now, not at the flusher's next round
                    continue
                if loop and _spin:
                    n = self._spin_recv(sock, view[end:])
                else:
                    n = sock.recv_into(view[end:], 0, flags)
                if n == 0:
                    raise EOFError
                self.bytes_in += n
                end += n
                while True:
                    # every complete frame to the handler (per read, not per connection: inject()
                    # may swap it), its header checked and its payload copied out, in one call.
                    # A reader thread's handlers learn whether more of this read follows
                    # (conn.more: a reply corks only then, a lone call's is written at once)
                    try:
                        start, status, err = dispatch_frames(self.handler, self, view, start, end, limit, loop,
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
                if not loop:
                    self._start, self._end, self._big = start, end, big
                    return True
                if self._out:
                    self.flush()  # replies queued while handling this batch
        except (BlockingIOError, InterruptedError):
            self._start, self._end, self._big = start, end, big
            return True
        except BaseException as e:
            self._big = big
            self._read_exc = self._read_error(e)
        return False

    def _read_polled(self) -> bool:
        """:meth:`_read_some` of a polled connection that poll found readable: one non-blocking read.

        The same steps, for the common case of a caller reading its replies
        (no frame longer than the buffer in progress: that one goes to
        :meth:`_read_some`), with fewer steps in Python.
        """
        if self._big is not None:
            return self._read_some()
        view, start, end = self._view, self._start, self._end
        try:
            n = self.sock.recv_into(view[end:], 0, _DONTWAIT)
            if not n:
                raise EOFError
            self.bytes_in += n
            end += n
            while True:  # (_read_some's dispatch step, inline here: one Python call less per read)
                try:
                    start, status, err = dispatch_frames(self.handler, self, view, start, end, self.limit, False,
                                                         _clock, _CORK_AGE, self._route_kind, self._route,
                                                         self._route_counts)
                except ValueError as e:
                    raise FrameError(f"bad frame from {self.name}: {e}") from None
                if err is not None:
                    raise err  # (a handler's: start is past its frame)
                if self._out and _clock() - self._out_t0 > _CORK_AGE:
                    self.flush()  # (frames corked by the handlers or the caller: out within _CORK_AGE)
                if status != -1:
                    break  # (-1: it stopped after _CORK_AGE of a long batch, to flush: the rest)
            if status:  # (> 0: a frame longer than the receive buffer)
                self._big = self._start_big(start, end, status)
                start = end = 0
            elif start == end:
                start = end = 0
            elif start and len(self._buf) - end < 65536:
                view[0:end - start] = view[start:end]
                end -= start
                start = 0
        except (BlockingIOError, InterruptedError):
            pass
        except BaseException as e:
            self._start, self._end = start, end
            self._read_exc = self._read_error(e)
            return False
        self._start, self._end = start, end
        return True

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
        global _sockets_closed
        self._closed = True
        if self.closed_error is None:
            self.closed_error = exc
        self._drop_backlog()
        _sockets_closed += 1  # read_all's cached poll objects may name this fd: rebuild them
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
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
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


def _poll_of(conns) -> select.poll:
    p = select.poll()
    for c in conns:
        p.register(c._fd, select.POLLIN)
    return p


def _read_held(held: list | tuple, p, by_fd: dict, done, deadline: float | None, parked: bool = False,
               spin: list | None = None) -> list:
    """The loop of :meth:`Connection.read_all` over polled connections whose read locks the caller
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
        while not done() and by_fd:
            ready = ((_reply_spin and _spin_poll(p, spin, deadline))
                     or p.poll(None if deadline is None else int(max(0.0, deadline - time.monotonic()) * 1000)))
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
            if not ready and deadline is not None and time.monotonic() >= deadline:
                break
    finally:
        for c in ended:
            if c not in finished:  # (an error between its end and finishing it above)
                c._end_polled()
    return ended


class ReadSet:
    """Polled connections that one caller reads together again and again: what
    :meth:`Connection.read_all` sets up on every call (the poll object, the table of
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
        """:meth:`Connection.read_all` of these connections: ``None`` at once if another thread
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
            ended = _read_held(self.conns, p, self._fds, done, deadline,
                               parked is not None and parked.keys() >= self._set, self._spin)
            if ended:
                self._poll = None  # (taken out of both: set up again next time)
            return ended
        finally:
            for lock in locks:
                lock.release()


class Poller:
    """One thread that reads many connections (epoll, or a selector: :mod:`.readiness`); see :meth:`Connection.start_polled`.

    Each connection is armed one-shot and has a read lock. Whoever holds the
    lock reads: normally the poller thread, but a caller blocked on the reply
    of a single call reads its connection itself (:meth:`Connection.read_until`),
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
            for fd in events:
                got = self._conns.get(fd)
                if got is None:  # discarded by a caller that saw it end
                    continue
                conn = got
                if not conn._rlock.acquire(False):
                    continue  # a caller is reading it; it re-arms when done
                try:
                    ok = conn._read_polled()
                    if not ok:  # finished under its read lock (see read_until)
                        self.discard(conn)
                        conn._poll_done()
                finally:
                    conn._rlock.release()
                if ok:
                    self.rearm(conn)


class Writer:
    """One thread that finishes the writes the peers' sockets could not take at once.

    A connection whose socket buffer is full keeps the rest of its frames in
    its backlog (see :meth:`Connection._write_locked`) and is watched here
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
#: Connection.read_all's poll objects: tuple of fds -> (poll, _sockets_closed when made, its polling's state)
_polls: dict = {}
_sockets_closed = 0  # sockets closed by Connection._finish so far (their fds may be reused)
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


def connect(address: str, secret: bytes, timeout: float = 10.0) -> socket.socket:
    """Open and authenticate a socket to ``address`` (raises :class:`AuthenticationError`)."""
    if ";" in address:
        tcp, unix, dom = _split_dual(address)
        if unix and dom == memory_domain():
            try:
                return connect(unix, secret, timeout)
            except OSError:
                pass  # (another network namespace with the same memory: TCP still reaches it)
        address = tcp
    family, sockaddr = parse_address(address)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(sockaddr)
        auth.client_handshake(sock, secret)
    except BaseException:
        sock.close()
        raise
    return sock


class Listener:
    """Accepts connections on a unix or TCP address; authenticates each one.

    ``on_connection(sock)`` receives every authenticated socket (a blocking
    socket, in the listener's thread: it must return quickly). One thread per
    listener accepts and runs every pending handshake without blocking (a
    selector), so that peers cannot exhaust it:

    - a unix-socket peer of another uid (``SO_PEERCRED``; root excepted) is
      closed before the handshake: abstract sockets have no file permissions;
    - each peer has ``handshake_timeout`` seconds (:data:`auth.HANDSHAKE_TIMEOUT`,
      env ``MESHARRAY_HANDSHAKE_TIMEOUT``) for the *whole* exchange, however
      it trickles its bytes in;
    - at most ``max_handshakes`` (:data:`MAX_HANDSHAKES`, env
      ``MESHARRAY_MAX_HANDSHAKES``) handshakes are pending at once: a new
      connection beyond that closes the oldest pending one (an idle socket,
      most likely; a real peer answers in microseconds);
    - a peer that fails the challenge, or stays silent, is logged and dropped,
      and no exception (not even a failed ``accept`` or ``on_connection``)
      ends the thread: it logs and keeps accepting.

    A TCP listener binds loopback by default; one bound elsewhere needs a
    secret (``ValueError`` without), and one bound to every interface
    (``0.0.0.0``, ``::``, ``""``) warns (``RuntimeWarning``).
    """

    def __init__(self, secret: bytes, on_connection, kind: str = "unix", host: str = "127.0.0.1",
                 path: str | None = None, port: int = 0, handshake_timeout: float | None = None,
                 max_handshakes: int | None = None) -> None:
        if kind == "tcp":
            _check_bind(host, secret)
        self.secret = secret
        self.on_connection = on_connection
        self.refused = 0
        self.handshake_timeout = auth.HANDSHAKE_TIMEOUT if handshake_timeout is None else handshake_timeout
        self.max_handshakes = MAX_HANDSHAKES if max_handshakes is None else max(1, max_handshakes)
        self._path: str | None = None
        if kind == "unix":
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            if path is None and _platform.abstract_sockets():
                # abstract socket: no file is left behind by a killed process; no file
                # permissions either, hence the peer's uid check and the HMAC challenge
                name = f"mesharray-{os.getpid()}-{os.urandom(6).hex()}"
                self.sock.bind("\0" + name)
                self.address = "unix:@" + name
            else:
                # default: a socket file in this user's 0700 runtime directory (only this user
                # reaches it; a killed process's file is swept by the next one)
                self._dir = os.path.dirname(path) if path is not None else None
                if path is None:
                    path = _platform.socket_file("l")
                self.sock.bind(path)
                self.address = "unix:" + path
                self._path = path
        elif kind == "tcp":
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind((host, port))
            h, p = self.sock.getsockname()[:2]
            self.address = f"tcp:{h}:{p}"
        else:
            raise ValueError(f"listener kind must be 'unix' or 'tcp', got {kind!r}")
        self.sock.listen(512)
        self.sock.setblocking(False)
        # unauthenticated sockets, oldest first (so also in order of their deadlines)
        self._pending: dict[socket.socket, auth.ServerHandshake] = {}
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self.sock, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._evicted = 0
        self._t_evict_log = 0.0
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="mesharray-accept", daemon=True)
        self._thread.start()

    # -- the listener's thread ----------------------------------------------------
    def _loop(self) -> None:
        while not self._closed:
            try:
                self._step()
            except BaseException:  # nothing may end the thread: every later peer would time out
                if self._closed:
                    break
                log.exception("listener %s: unexpected error; still accepting", self.address)
                time.sleep(0.01)
        for s in list(self._pending):
            s.close()
        self._pending.clear()
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()

    def _step(self) -> None:
        timeout = None
        if self._pending:
            first = next(iter(self._pending.values()))
            timeout = max(0.0, first.deadline - time.monotonic())
        for key, _ in self._sel.select(timeout):
            obj = key.fileobj
            if obj is self.sock:
                self._accept()
            elif obj is self._wake_r:
                try:
                    self._wake_r.recv(64)
                except OSError:
                    pass
            else:
                self._advance(obj)  # type: ignore[arg-type]  # a pending socket
        now = time.monotonic()
        while self._pending:  # deadlines passed (the oldest first)
            s, hs = next(iter(self._pending.items()))
            if hs.deadline > now:
                break
            got = len(hs.buf)
            self._refuse(s, f"handshake not finished within {self.handshake_timeout:g} s "
                            f"({got} of {auth.CLIENT_MSG} bytes received; MESHARRAY_HANDSHAKE_TIMEOUT)")

    def _accept(self) -> None:
        for _ in range(64):  # a batch, then the pending handshakes get their turn
            if self._closed:
                return
            try:
                s, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if self._closed:
                    return
                # out of descriptors or memory: the kernel keeps the connection queued
                # (listen backlog); retry shortly rather than spin, and never stop accepting
                log.warning("listener %s: accept failed (%s); retrying", self.address, exc)
                time.sleep(0.05)
                return
            try:
                self._admit(s)
            except Exception as exc:
                self._pending.pop(s, None)
                self.refused += 1
                log.warning("refused a connection on %s: %s", self.address, exc)
                try:
                    self._sel.unregister(s)
                except (KeyError, ValueError):
                    pass
                s.close()

    def _admit(self, s: socket.socket) -> None:
        if s.family == socket.AF_UNIX:
            uid = peer_uid(s)
            if uid is not None and uid != os.geteuid() and uid != 0:
                self.refused += 1
                log.warning("refused a connection on %s from uid %d (this process runs as uid %d)",
                            self.address, uid, os.geteuid())
                s.close()
                return
        s.setblocking(False)
        hs = auth.ServerHandshake(self.secret, time.monotonic() + self.handshake_timeout)
        if s.send(hs.hello) != len(hs.hello):  # a fresh socket takes 36 bytes at once
            raise BrokenTransportError("peer does not take the handshake's first message")
        if len(self._pending) >= self.max_handshakes:
            self._evict()
        self._pending[s] = hs
        self._sel.register(s, selectors.EVENT_READ)

    def _evict(self) -> None:
        oldest = next(iter(self._pending))
        self._refuse(oldest, None)
        self._evicted += 1
        now = time.monotonic()
        if now - self._t_evict_log > 1.0:  # a flood of idle sockets: one line a second, not one each
            self._t_evict_log = now
            log.warning("listener %s: over %d pending handshakes (MESHARRAY_MAX_HANDSHAKES); closed the "
                        "oldest (%d so far)", self.address, self.max_handshakes, self._evicted)

    def _advance(self, s: socket.socket) -> None:
        hs = self._pending.get(s)
        if hs is None:
            return
        try:
            data = s.recv(auth.CLIENT_MSG - len(hs.buf))
            if not data:
                raise BrokenTransportError("peer closed the connection during the handshake")
            answer = hs.feed(data)
        except (BlockingIOError, InterruptedError):
            return
        except (AuthenticationError, OSError, BrokenTransportError) as exc:
            self._refuse(s, str(exc))
            return
        if answer is None:
            return
        del self._pending[s]
        self._sel.unregister(s)
        try:
            if s.send(answer) != len(answer):
                raise BrokenTransportError("peer does not take the handshake's answer")
            s.setblocking(True)
        except OSError as exc:
            self.refused += 1
            log.warning("refused a connection on %s: %s", self.address, exc)
            s.close()
            return
        try:
            self.on_connection(s)
        except Exception:
            log.exception("connection handler failed on %s", self.address)
            s.close()

    def _refuse(self, s: socket.socket, why: str | None) -> None:
        self._pending.pop(s, None)
        try:
            self._sel.unregister(s)
        except (KeyError, ValueError):
            pass
        s.close()
        self.refused += 1
        if why is not None:
            log.warning("refused a connection on %s: %s", self.address, why)

    @property
    def pending_handshakes(self) -> int:
        """Connections accepted and not yet authenticated."""
        return len(self._pending)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()  # new peers are refused from now on
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(2.0)
        if self._path is not None:
            try:
                os.unlink(self._path)
                if self._dir is not None:
                    os.rmdir(self._dir)
            except OSError:
                pass


_PEERCRED = struct.Struct("3i")  # pid, uid, gid


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of a unix socket (``None`` where the OS does not say)."""
    opt = getattr(socket, "SO_PEERCRED", None)
    if opt is None:
        return None
    try:
        _, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, opt, _PEERCRED.size))
    except OSError:
        return None
    return uid


def _check_bind(host: str, secret: bytes) -> None:
    """Refuse a TCP listener reachable from other hosts without a secret; warn for all interfaces."""
    import ipaddress

    wildcard = host in ("", "0.0.0.0", "::")
    try:
        loopback = not wildcard and (host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback)
    except ValueError:  # a host name: it may resolve to any interface
        loopback = False
    if loopback:
        return
    if not secret:
        raise ValueError(f"refusing to listen on {host or 'every interface'!r} without a secret: other hosts "
                         f"could connect; give a secret, or bind 127.0.0.1")
    if wildcard:
        import warnings

        warnings.warn(f"listening on every interface ({host or '0.0.0.0'!r}): any host that reaches the port can "
                      f"try the handshake (the job secret still protects it); bind the one interface the "
                      f"peers use instead", RuntimeWarning, stacklevel=3)
