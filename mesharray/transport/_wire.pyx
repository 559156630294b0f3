# cython: language_level=3
# cython: boundscheck=False, wraparound=False, initializedcheck=False
# cython: embedsignature=True, binding=True
"""mesharray.transport._wire — a connection's per-message steps, compiled.

The transport's I/O stays in :mod:`.connection`; these are three of its methods,
bound there (``Connection._read_polled``, ``Connection.write_frame``,
``Connection._read_loop``), written here because every call, its reply and
every relayed frame run them and their Python was most of a round trip's
interpreter time (``_core`` holds no I/O: this module is the transport's own):

- :func:`read_polled`: one non-blocking ``recv`` of a polled connection into
  its receive buffer, then its complete frames handed over by
  :func:`mesharray._core.dispatch_frames` (:func:`poll_events`: the poller
  thread's round of them);
- :func:`write_frame`: a whole small frame written now with one non-blocking
  ``send``, or ``False`` so that the caller goes through ``Connection.send``;
- :func:`read_loop`: a reader thread's loop (thread mode): a ``recv`` without
  the GIL, polled first for the read spin (:func:`spin_recv`,
  :mod:`.spin`), the frames handed over, what the handlers corked flushed
  before the next blocking read, until the connection ends.

Everything unusual goes back to the connection's Python: a frame longer than
the receive buffer (``_read_some``, ``_start_big``), what the socket did not
take (``_rest_locked``: the backlog and its writer), and every failure
(``_read_error``). They hold no Python frame of their own, so a Ctrl-C lands
in the guarded caller (:mod:`.interrupt`), which waits for a marked line as
before (a reader thread is never the main thread: it gets none).
"""

from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_WRITABLE

from libc.errno cimport errno, EINTR
from libc.string cimport memmove, strerror

cdef extern from *:
    """
    /* a heartbeat's time into the relay's slot: one relaxed atomic store (aligned: Beats.slot checks) */
    static inline void mesharray_store_double(char *p, double v) { __atomic_store((double *)p, &v, __ATOMIC_RELAXED); }
    """
    void _store_double "mesharray_store_double" (char* p, double v) nogil

cdef extern from "pythread.h":
    ctypedef void* PyThread_type_lock
    ctypedef enum PyLockStatus:
        PY_LOCK_FAILURE, PY_LOCK_ACQUIRED, PY_LOCK_INTR
    PyThread_type_lock PyThread_allocate_lock()
    void PyThread_free_lock(PyThread_type_lock)
    int PyThread_acquire_lock(PyThread_type_lock, int waitflag) nogil
    PyLockStatus PyThread_acquire_lock_timed(PyThread_type_lock, long long microseconds, int intr_flag) nogil
    void PyThread_release_lock(PyThread_type_lock) nogil

cdef extern from "<sys/types.h>":
    ctypedef long ssize_t

cdef extern from "<sys/socket.h>" nogil:
    ssize_t c_recv "recv" (int fd, void* buf, size_t n, int flags)
    ssize_t c_send "send" (int fd, const void* buf, size_t n, int flags)
    enum: MSG_DONTWAIT

cdef extern from "<poll.h>" nogil:
    struct pollfd:
        int fd
        short events
        short revents
    int c_poll "poll" (pollfd* fds, unsigned long nfds, int timeout)
    enum: POLLIN

cdef extern from "<sched.h>" nogil:
    int sched_yield()

cdef extern from "<time.h>" nogil:
    struct timespec:
        long tv_sec
        long tv_nsec
    int clock_gettime(int clk, timespec* ts)
    enum: CLOCK_MONOTONIC

cdef extern from *:
    """
    #include <errno.h>
    /* nothing to read or no room to write now, or a signal: try again later (EWOULDBLOCK may equal EAGAIN) */
    static int mesharray_again(int err) { return err == EAGAIN || err == EWOULDBLOCK || err == EINTR; }
    #ifndef MSG_NOSIGNAL
    #define MSG_NOSIGNAL 0  /* (macOS: SIGPIPE is ignored by Python anyway) */
    #endif
    """
    enum: MSG_NOSIGNAL
    bint _again "mesharray_again" (int err) nogil

import os as _os

from mesharray._core import dispatch_frames as _dispatch_frames

__all__ = ["Wire", "read_polled", "poll_events", "write_frame", "read_loop", "spin_recv", "setup", "Beats"]


cimport cython


@cython.auto_pickle(False)
cdef class Wire:
    """The base of :class:`~.connection.Connection`: the state every message reads or writes, as C
    fields. The compiled steps below use them without an attribute lookup (each lookup of a
    Python attribute costs a walk of the type's dictionaries, slow once a thousand other processes
    have run on the CPU); Python reads and sets them as attributes, as before. The rest of a
    connection's state lives in its instance dictionary."""

    cdef public object sock
    cdef public object name
    cdef public object handler
    #: the largest frame this connection reads or writes
    cdef public unsigned long long limit
    #: set by the reader before each frame it hands over: more frames of the same read follow
    cdef public bint more
    cdef public long long bytes_in
    cdef public long long bytes_out
    cdef public long long frames_out
    cdef public list _out              # corked frames
    cdef public double _out_t0         # when the first of them was corked
    cdef public object _backlog        # written frames the socket has not taken yet (a deque)
    cdef public bint _closed
    cdef public bint _faulty           # send is replaced (inject, sync_replies): write_frame leaves frames to it
    cdef public object _write_error
    cdef object _lock, _acquire, _release  # (the send lock and its methods, looked up once)
    cdef object _rl, _racquire, _rrelease  # (a polled connection's read lock and its methods)
    #: a polled connection's descriptor (Poller.add; -1 until then)
    cdef public int _fd
    cdef public unsigned int _route_kind
    cdef public object _route
    cdef public object _route_counts
    cdef public object _big            # a frame longer than the receive buffer, in progress
    cdef public object _view           # the receive buffer's memoryview
    cdef public Py_ssize_t _start      # its frames not handed over yet: _view[_start:_end]
    cdef public Py_ssize_t _end
    cdef public object _read_exc       # why the reader ended

    def __cinit__(self):
        self._fd = -1

    @property
    def _rlock(self):
        """A polled connection's read lock: whoever holds it reads (the poller, or a waiting caller)."""
        return self._rl

    @_rlock.setter
    def _rlock(self, value):
        self._rl, self._racquire, self._rrelease = value, value.acquire, value.release

    @property
    def _send_lock(self):
        """The lock of the connection's writes (sends, flushes, the backlog)."""
        return self._lock

    @_send_lock.setter
    def _send_lock(self, value):
        self._lock, self._acquire, self._release = value, value.acquire, value.release


cdef object _clock = None
cdef double _cork_age = 0.0
cdef object _FrameError = RuntimeError
cdef object _Broken = RuntimeError
cdef dict _settings = {"_spin": 0.0}  # (the globals of .connection: its copy of the read spin)


def setup(clock, double cork_age, frame_error, broken_transport_error, dict settings):
    """What :mod:`.connection` gives this module once: its clock and cork age (``_clock``,
    ``_CORK_AGE``), the errors it raises (``FrameError``, ``BrokenTransportError``) and its
    globals, whose ``_spin`` (the read spin, kept by :func:`.spin.mirror`) each read tests."""
    global _clock, _cork_age, _FrameError, _Broken, _settings
    _clock = clock
    _cork_age = cork_age
    _FrameError = frame_error
    _Broken = broken_transport_error
    _settings = settings


cdef inline double _now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <double>ts.tv_sec + <double>ts.tv_nsec * 1e-9


# MESHARRAY_RECV_WAIT=recv: always the single blocking recv (_recv_wait), for an A/B in one run
# (bench/bench_scale.py --ab-recv); read once, by each process as it imports this module
cdef bint _POLL_FIRST = _os.environ.get("MESHARRAY_RECV_WAIT", "poll") != "recv"


cdef ssize_t _recv_wait(int fd, char* buf, size_t n, int timeout_ms, int* err, bint poll_first) noexcept nogil:
    # a blocking recv (timeout_ms < 0: no timeout); a signal retries. -2: the timeout passed.
    # ``poll_first``: a poll for input, then a non-blocking recv, not one blocking recv. A thread
    # asleep in recv on a unix socket wakes each time the peer reads a message that this process
    # wrote to it (the kernel's "write space" wake-up, when the peer frees it, takes every sleeper
    # of the socket), finds nothing and sleeps again: after a reply, a second context switch per
    # call for a worker, and on its relay the wake-up of each of its ranks. A poll's wait takes
    # only the events it asked for, for one more system call: read_loop asks for it when its
    # connection sent frames since its last wait. (A socket shut down wakes a poll as it woke the
    # recv: the recv then returns 0.)
    cdef ssize_t got
    cdef pollfd p
    cdef int r
    if timeout_ms < 0 and not (poll_first and _POLL_FIRST):
        while True:
            got = c_recv(fd, buf, n, 0)
            if got >= 0:
                return got
            err[0] = errno
            if err[0] == EINTR:
                continue
            if not _again(err[0]):
                return -1
            break  # (a non-blocking socket: poll below)
    while True:
        p.fd = fd
        p.events = POLLIN
        p.revents = 0
        r = c_poll(&p, 1, timeout_ms)
        if r == 0:
            return -2
        if r < 0:
            err[0] = errno
            if err[0] == EINTR:
                continue
            return -1
        got = c_recv(fd, buf, n, MSG_DONTWAIT)
        if got >= 0:
            return got
        err[0] = errno
        if not _again(err[0]):
            return -1


cdef ssize_t _spin_recv(int fd, char* buf, size_t n, double spin, int* skip, int* backoff, int timeout_ms,
                        int* err, bint poll_first) noexcept nogil:
    # the read spin (spin.set_read_spin): poll without waiting for up to ``spin`` seconds, yielding
    # the CPU between tries, then block; after a spin that found nothing, the next 1, 2, 4 ... 64
    # reads block at once, and a message found while polling resets that
    cdef ssize_t got
    cdef double deadline
    if spin <= 0.0:
        return _recv_wait(fd, buf, n, timeout_ms, err, poll_first)
    if skip[0]:
        skip[0] -= 1
        return _recv_wait(fd, buf, n, timeout_ms, err, poll_first)
    deadline = _now() + spin
    while True:
        got = c_recv(fd, buf, n, MSG_DONTWAIT)
        if got >= 0:
            backoff[0] = 0
            return got
        err[0] = errno
        if not _again(err[0]):
            return -1
        if _now() > deadline:
            break
        sched_yield()  # (a thread that wants this CPU runs: see spin.set_read_spin)
    backoff[0] = min(64, 2 * backoff[0] if backoff[0] else 1)
    skip[0] = backoff[0]
    return _recv_wait(fd, buf, n, timeout_ms, err, poll_first)


def spin_recv(sock, buf, double spin, list state not None, bint poll_first=True):
    """One read of a reader thread (:func:`read_loop`'s): ``sock.recv_into(buf)`` polled first for
    up to ``spin`` seconds (:func:`.spin.set_read_spin`). ``state``: ``[reads left to block at once,
    back-off]``, updated; ``poll_first``: block in a poll for input, not in the recv (see
    ``_recv_wait``). Returns what ``recv`` returned (0: the peer closed)."""
    cdef Py_buffer b
    cdef int skip = state[0], backoff = state[1], err = 0, fd = sock.fileno()
    cdef ssize_t got
    PyObject_GetBuffer(buf, &b, PyBUF_WRITABLE)
    try:
        with nogil:
            got = _spin_recv(fd, <char*>b.buf, <size_t>b.len, spin, &skip, &backoff, -1, &err, poll_first)
    finally:
        PyBuffer_Release(&b)
    state[0] = skip
    state[1] = backoff
    if got < 0:
        raise _os_error(err)
    return got


cdef inline object _os_error(int err):
    return OSError(err, strerror(err).decode("utf-8", "replace"))


def read_polled(Wire conn):
    """``Connection._read_polled``: one non-blocking read of a polled connection that poll found
    readable, its complete frames handed over; False once the connection ended (its reason in
    ``conn._read_exc``).

    The steps of ``Connection._read_some`` for the common case of a caller reading its
    replies; a frame longer than the receive buffer in progress goes to ``_read_some``.
    """
    return _read_polled(conn)


def poll_events(poller, events):
    """``Poller._loop``'s round: each connection of ``events`` (the descriptors found readable) that
    nobody else reads (its read lock free) read by :func:`read_polled` under that lock, then armed
    again; one that ended is dropped from ``poller`` and finished, under the lock too."""
    cdef dict conns = poller._conns
    cdef dict parked = poller._parked
    cdef Wire conn
    cdef bint ok
    arm = None
    for fd in events:
        got = conns.get(fd)
        if got is None:  # discarded by a caller that saw it end
            continue
        conn = <Wire?>got
        if not conn._racquire(False):
            continue  # a caller is reading it; it re-arms when done
        try:
            ok = _read_polled(conn)
            if not ok:  # finished under its read lock (see Connection.read_until)
                poller.discard(conn)
                (<object>conn)._poll_done()
        finally:
            conn._rrelease()
        if ok:  # (Poller.rearm)
            parked.pop(conn, None)
            if arm is None:
                arm = poller._readiness.arm
            try:
                arm(conn._fd)
            except (OSError, ValueError):
                pass


cdef object _read_polled(Wire conn):
    cdef Py_buffer buf
    cdef Py_ssize_t start, end, cap
    cdef ssize_t got
    cdef int fd, err = 0
    cdef Py_ssize_t status = 0  # (a frame's whole size when it is longer than the buffer: up to 4 GiB)
    cdef bint held = False
    c = <object>conn  # (its Python methods)
    if conn._big is not None:
        return c._read_some()
    view = conn._view
    start = conn._start
    end = conn._end
    fd = conn.sock.fileno()  # (-1 once closed: EBADF, as the socket's own recv_into; never a stale number)
    try:
        PyObject_GetBuffer(view, &buf, PyBUF_WRITABLE)  # (a released view: ValueError, handled below)
        held = True
        cap = buf.len
        with nogil:
            got = c_recv(fd, <char*>buf.buf + end, <size_t>(cap - end), MSG_DONTWAIT)
            if got < 0:
                err = errno
        if got < 0:
            if _again(err):
                return True  # (nothing there after all: start and end are as they were)
            raise _os_error(err)
        if got == 0:
            raise EOFError
        conn.bytes_in += got
        end += got
        while True:
            try:
                start, status, e = _dispatch_frames(conn.handler, conn, view, start, end, conn.limit, False,
                                                    _clock, _cork_age, conn._route_kind, conn._route,
                                                    conn._route_counts)
            except ValueError as ve:
                raise _FrameError(f"bad frame from {conn.name}: {ve}") from None
            if e is not None:
                raise e  # (a handler's: start is past its frame)
            if conn._out and _clock() - conn._out_t0 > _cork_age:
                c.flush()  # (frames corked by the handlers or the caller: out within the cork age)
            if status != -1:
                break  # (-1: it stopped after the cork age of a long batch, to flush: the rest)
        if status:  # (> 0: a frame longer than the receive buffer)
            conn._big = c._start_big(start, end, status)
            start = end = 0
        elif start == end:
            start = end = 0
        elif start and cap - end < 65536:
            memmove(buf.buf, <char*>buf.buf + start, <size_t>(end - start))
            end -= start
            start = 0
    except BaseException as exc:
        conn._start = start
        conn._end = end
        conn._read_exc = c._read_error(exc)
        return False
    finally:
        if held:
            PyBuffer_Release(&buf)
    conn._start = start
    conn._end = end
    return True


def write_frame(Wire conn, bytes frame not None):
    """``Connection.write_frame``: write a whole small frame now if nothing waits ahead of it;
    False, having done nothing, otherwise.

    The lean path of a caller sending to many peers at once (a ``call()``, a relay's
    forward): ``frame`` is packed by :func:`~mesharray._core.pack_calls` (or
    :func:`~mesharray._core.pack_frame`), its payload at most ``SMALL_FRAME`` bytes and
    under the connection's limit. False when frames are corked or unwritten on the
    connection, when it is closed or failed, or while ``inject`` is on: the caller then
    sends with ``Connection.send``, which handles all of those. What the socket does not
    take at once goes to the backlog, as with ``send``.
    """
    return _write_frame(conn, frame) == 1


cdef int _write_frame(Wire conn, bytes frame) except -1:
    cdef Py_ssize_t n = len(frame)
    cdef const char* p = frame
    cdef ssize_t sent
    cdef int fd, err = 0
    conn._acquire()
    try:
        if conn._out or conn._backlog or conn._closed or conn._faulty or conn._write_error is not None:
            return 0
        fd = conn.sock.fileno()
        with nogil:
            sent = c_send(fd, p, <size_t>n, MSG_DONTWAIT | MSG_NOSIGNAL)
            if sent < 0:
                err = errno
        if sent < 0:
            if _again(err):
                sent = 0
            else:
                exc = _os_error(err)
                raise _Broken(f"connection {conn.name} broke while sending: {exc}") from exc
        if sent != n:
            (<object>conn)._rest_locked(frame, sent)
    finally:
        conn._release()
    conn.bytes_out += n
    conn.frames_out += 1
    return 1


def read_loop(Wire conn):
    """``Connection._read_loop``: the reader thread of a connection in thread mode, until it ends; the
    reason is left in ``conn._read_exc`` (None: an EOF or a local close).

    Each read is one ``recv`` without the GIL (polled first for the read spin, :func:`spin_recv`'s
    rules; the spin is read from the connection module on every read, so a new setting takes
    effect at once); its complete frames go to ``conn.handler`` (``conn.more`` set before each:
    whether more of this read follows, so that a reply corks only then); what the handlers corked
    is flushed once the batch is handed over (or at the cork age within a long batch), before the
    next blocking read. A frame longer than the receive buffer is read by ``Connection._read_some``.
    Only this thread reads and closes the socket, so its descriptor stays valid until this returns.
    """
    cdef Py_buffer buf
    cdef Py_ssize_t start, end, cap, status = 0
    cdef ssize_t got
    cdef int fd, err = 0, skip = 0, backoff = 0, timeout_ms = -1
    cdef double spin
    cdef bint held = False, poll_first
    cdef long long sent = conn.frames_out  # (frames this connection sent by its last wait)
    c = <object>conn  # (its Python methods)
    view = conn._view
    start = conn._start
    end = conn._end
    limit = conn.limit
    sock = conn.sock
    fd = sock.fileno()
    timeout = sock.gettimeout()
    if timeout is not None:
        timeout_ms = max(0, <int>(timeout * 1000.0))
    try:
        PyObject_GetBuffer(view, &buf, PyBUF_WRITABLE)
        held = True
        cap = buf.len
        while True:
            if conn._big is not None:  # (only when a frame was too long for the buffer: see below)
                conn._start = conn._end = 0
                if not c._read_some(0):
                    return  # (the reason is in _read_exc)
                if conn._big is None and conn._out:
                    c.flush()  # the reply to a large frame: out now, not at the flusher's next round
                continue
            spin = _settings["_spin"]
            # sent frames since the last wait (a reply): the peer's reads of them would wake a recv
            poll_first = conn.frames_out != sent
            sent = conn.frames_out
            with nogil:
                got = _spin_recv(fd, <char*>buf.buf + end, <size_t>(cap - end), spin, &skip, &backoff, timeout_ms,
                                 &err, poll_first)
            if got < 0:
                if got == -2:
                    raise TimeoutError("timed out")
                raise _os_error(err)
            if got == 0:
                raise EOFError
            conn.bytes_in += got
            end += got
            while True:
                # every complete frame to the handler (read per batch: inject() may swap it)
                try:
                    start, status, e = _dispatch_frames(conn.handler, conn, view, start, end, limit, True, _clock,
                                                        _cork_age, conn._route_kind, conn._route, conn._route_counts)
                except ValueError as ve:
                    raise _FrameError(f"bad frame from {conn.name}: {ve}") from None
                if e is not None:
                    raise e  # (a handler's: start is past its frame)
                if conn._out and _clock() - conn._out_t0 > _cork_age:
                    c.flush()  # frames corked while handling a long batch
                if status == -1:
                    continue  # stopped after the cork age to flush: the rest of the batch
                if status:  # (> 0: a frame longer than the receive buffer)
                    conn._big = c._start_big(start, end, status)
                    start = end = 0
                break
            if start == end:
                start = end = 0
            elif start and cap - end < 65536:
                memmove(buf.buf, <char*>buf.buf + start, <size_t>(end - start))
                end -= start
                start = 0
            if conn._out:
                c.flush()  # replies queued while handling this batch
    except BaseException as exc:
        conn._read_exc = c._read_error(exc)
    finally:
        if held:
            PyBuffer_Release(&buf)


cdef class Beats:
    """A worker's heartbeats, its heartbeat thread's loop compiled (``Worker.heartbeat_loop`` runs
    :meth:`run`): every ``interval`` seconds the thread takes the GIL, which is what a beat proves
    (a rank whose interpreter is stuck stops beating), and writes the time of ``clock``
    (``time.monotonic``) into the relay's slot (:meth:`slot`: a native double, what the relay
    reads with ``BEAT_SLOT``), else the heartbeat ``frame`` on the connection of :meth:`to`
    with :func:`write_frame` (through its ``fallback``, ``send()``, when frames wait ahead of
    it); every ``sample_every`` beats it calls ``sample`` (the recorder's process sample; None:
    none).

    Between beats the thread waits without the GIL on a lock of its own, held from the start,
    which :meth:`stop` releases: the loop ends at once. A beat into a slot runs no Python (the
    heartbeat threads of a thousand idle ranks wake twice a second each).
    """

    cdef PyThread_type_lock _lock
    cdef bint _stopped
    cdef char* _slot
    cdef Py_buffer _buf
    cdef bint _has_buf
    cdef object _mm
    cdef Wire conn
    cdef bytes frame
    cdef object fallback
    cdef object clock
    cdef object sample
    cdef double _interval
    cdef int _every

    def __cinit__(self):
        self._lock = PyThread_allocate_lock()
        if self._lock == NULL:
            raise MemoryError("no lock for the heartbeats")
        PyThread_acquire_lock(self._lock, 1)

    def __init__(self, clock, double interval, sample=None, int sample_every=4):
        self.clock, self.sample = clock, sample
        self.interval, self.sample_every = interval, sample_every

    @property
    def interval(self):
        """Seconds between beats (a new value applies from the next wait)."""
        return self._interval

    @interval.setter
    def interval(self, double value):
        if not (0 < value < 1e9):  # (also NaN and infinity: the wait is a C integer of microseconds)
            raise ValueError(f"heartbeat interval must be > 0 and finite seconds, got {value}")
        self._interval = value

    @property
    def sample_every(self):
        """Beats between two calls of ``sample``."""
        return self._every

    @sample_every.setter
    def sample_every(self, int value):
        if value < 1:
            raise ValueError(f"heartbeats between two samples must be >= 1, got {value}")
        self._every = value

    def __dealloc__(self):
        if self._has_buf:
            PyBuffer_Release(&self._buf)
        if self._lock != NULL:
            if not self._stopped:
                PyThread_release_lock(self._lock)
            PyThread_free_lock(self._lock)

    def to(self, Wire conn not None, bytes frame not None, fallback):
        """Beat as ``frame`` on ``conn`` (``fallback()`` sends one when it cannot be written now)."""
        self.conn, self.frame, self.fallback = conn, frame, fallback

    def slot(self, mm, Py_ssize_t offset):
        """Beat into ``mm`` (a writable buffer: the relay's segment) at ``offset`` from now on."""
        cdef Py_buffer buf
        PyObject_GetBuffer(mm, &buf, PyBUF_WRITABLE)
        if (offset < 0 or offset > buf.len - <Py_ssize_t>sizeof(double)
                or (<size_t>buf.buf + <size_t>offset) % sizeof(double)):
            n = buf.len
            PyBuffer_Release(&buf)
            raise ValueError(f"heartbeat slot at offset {offset} is not an aligned double within a segment of "
                             f"{n} bytes")
        if self._has_buf:
            self._slot = NULL
            PyBuffer_Release(&self._buf)
        self._buf, self._has_buf, self._mm = buf, True, mm
        self._slot = <char*>buf.buf + offset

    def stop(self):
        """End :meth:`run` (at once, from any thread; again: nothing)."""
        if not self._stopped:
            self._stopped = True
            PyThread_release_lock(self._lock)

    def run(self):
        """Beat until :meth:`stop` (returns then), or until the connection breaks (returns at the
        ``ConnectionError``); an error of ``sample`` ends it too, raised."""
        cdef PyLockStatus got
        cdef long long us
        cdef double t
        cdef int beats = 0
        while True:
            us = max(1, <long long>(self._interval * 1e6))
            with nogil:
                got = PyThread_acquire_lock_timed(self._lock, us, 0)
            if got == PY_LOCK_ACQUIRED:
                PyThread_release_lock(self._lock)  # (free again: a later run ends at once too)
                return
            if self._slot != NULL:
                t = self.clock()
                _store_double(self._slot, t)  # (one atomic store: the relay never reads it torn)
            elif self.conn is not None:
                try:
                    if not _write_frame(self.conn, self.frame):
                        self.fallback()
                except ConnectionError:
                    return
            beats += 1
            if self.sample is not None and beats >= self._every:
                beats = 0
                self.sample()
