# cython: language_level=3
# cython: boundscheck=False, wraparound=False, initializedcheck=False
# cython: embedsignature=True, binding=True
"""mesharray.transport._wire — a connection's two per-message steps, compiled.

The transport's I/O stays in :mod:`.connection`; these are two of its methods,
bound there (``Connection._read_polled``, ``Connection.write_frame``), written
here because every call's reply and every relayed frame runs them and their
Python was most of a round trip's interpreter time (``_core`` holds no I/O:
this module is the transport's own):

- :func:`read_polled`: one non-blocking ``recv`` of a polled connection into
  its receive buffer, then its complete frames handed over by
  :func:`mesharray._core.dispatch_frames`;
- :func:`write_frame`: a whole small frame written now with one non-blocking
  ``send``, or ``False`` so that the caller goes through ``Connection.send``.

Everything unusual goes back to the connection's Python: a frame longer than
the receive buffer (``_read_some``, ``_start_big``), what the socket did not
take (``_rest_locked``: the backlog and its writer), and every failure
(``_read_error``). They hold no Python frame of their own, so a Ctrl-C lands
in the guarded caller (:mod:`.interrupt`), which waits for a marked line as
before.
"""

from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_WRITABLE
from libc.errno cimport errno
from libc.string cimport memmove, strerror

cdef extern from "<sys/types.h>":
    ctypedef long ssize_t

cdef extern from "<sys/socket.h>" nogil:
    ssize_t c_recv "recv" (int fd, void* buf, size_t n, int flags)
    ssize_t c_send "send" (int fd, const void* buf, size_t n, int flags)
    enum: MSG_DONTWAIT

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

from mesharray._core import dispatch_frames as _dispatch_frames

__all__ = ["read_polled", "write_frame", "setup"]

cdef object _clock = None
cdef double _cork_age = 0.0
cdef object _FrameError = RuntimeError
cdef object _Broken = RuntimeError


def setup(clock, double cork_age, frame_error, broken_transport_error):
    """What :mod:`.connection` gives this module once: its clock and cork age (``_clock``,
    ``_CORK_AGE``), and the errors it raises (``FrameError``, ``BrokenTransportError``)."""
    global _clock, _cork_age, _FrameError, _Broken
    _clock = clock
    _cork_age = cork_age
    _FrameError = frame_error
    _Broken = broken_transport_error


cdef inline object _os_error(int err):
    return OSError(err, strerror(err).decode("utf-8", "replace"))


def read_polled(conn):
    """``Connection._read_polled``: one non-blocking read of a polled connection that poll found
    readable, its complete frames handed over; False once the connection ended (its reason in
    ``conn._read_exc``).

    The steps of ``Connection._read_some`` for the common case of a caller reading its
    replies; a frame longer than the receive buffer in progress goes to ``_read_some``.
    """
    cdef Py_buffer buf
    cdef Py_ssize_t start, end, cap
    cdef ssize_t got
    cdef int fd, err = 0
    cdef Py_ssize_t status = 0  # (a frame's whole size when it is longer than the buffer: up to 4 GiB)
    cdef bint held = False
    if conn._big is not None:
        return conn._read_some()
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
                conn.flush()  # (frames corked by the handlers or the caller: out within the cork age)
            if status != -1:
                break  # (-1: it stopped after the cork age of a long batch, to flush: the rest)
        if status:  # (> 0: a frame longer than the receive buffer)
            conn._big = conn._start_big(start, end, status)
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
        conn._read_exc = conn._read_error(exc)
        return False
    finally:
        if held:
            PyBuffer_Release(&buf)
    conn._start = start
    conn._end = end
    return True


def write_frame(conn, bytes frame not None):
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
    cdef Py_ssize_t n = len(frame)
    cdef const char* p = frame
    cdef ssize_t sent
    cdef int fd, err = 0
    lock = conn._send_lock
    lock.acquire()
    try:
        if conn._out or conn._backlog or conn._closed or conn._faulty or conn._write_error is not None:
            return False
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
            conn._rest_locked(frame, sent)
    finally:
        lock.release()
    conn.bytes_out += n
    conn.frames_out += 1
    return True
