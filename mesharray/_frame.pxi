# _frame: see _core.pyx
#
# The fixed header of every frame of the wire protocol (transport/framing.py).
#
# 24 bytes, little-endian, no padding:
#
#   offset size field
#   0      2    magic   0x4D41 ("MA")
#   2      1    kind    message kind (runtime/protocol.py); 0 is invalid
#   3      1    flags   per-kind bits
#   4      4    length  number of payload bytes that follow the header
#   8      8    msg_id  call id / correlation id
#   16     4    target  actor id (calls) or status (replies)
#   20     4    view    id of the mesh view a call was sent to (0: none)
#
# The codec is pure: it packs and parses, and checks the magic and the length
# against a caller-given limit *before* the caller allocates anything for the
# payload. Policy (what a kind means, what to do on a bad frame) is Python's.
# ``dispatch_frames`` is a read's frame loop: it splits a receive buffer into
# frames and hands each to the caller's handler (a parser driving a callback;
# the reading and what a frame means stay with the Python caller).

from libc.string cimport memcpy
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.bytearray cimport PyByteArray_FromStringAndSize
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.ref cimport Py_INCREF
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t

FRAME_HEADER_SIZE = 24
FRAME_MAGIC = 0x4D41

cdef packed struct _FrameHeader:
    uint16_t magic
    uint8_t kind
    uint8_t flags
    uint32_t length
    uint64_t msg_id
    uint32_t target
    uint32_t view


cdef inline bytes _header(unsigned int kind, unsigned int flags, unsigned long long length,
                          unsigned long long msg_id, unsigned long long target, unsigned long long view):
    cdef _FrameHeader h
    if kind == 0 or kind > 255:
        raise ValueError(f"frame kind must be in 1..255, got {kind}")
    if flags > 255:
        raise ValueError(f"frame flags must be in 0..255, got {flags}")
    if length > 0xFFFFFFFF:
        raise ValueError(f"frame length must be below 4 GiB, got {length}")
    if target > 0xFFFFFFFF or view > 0xFFFFFFFF:
        raise ValueError(f"frame target/view must fit in 32 bits, got {target}/{view}")
    h.magic = FRAME_MAGIC
    h.kind = <uint8_t>kind
    h.flags = <uint8_t>flags
    h.length = <uint32_t>length
    h.msg_id = <uint64_t>msg_id
    h.target = <uint32_t>target
    h.view = <uint32_t>view
    return (<char*>&h)[:24]


def pack_header(unsigned int kind, unsigned int flags, unsigned long long length,
                unsigned long long msg_id=0, unsigned long long target=0,
                unsigned long long view=0):
    """Pack a frame header into 24 bytes.

    >>> from mesharray._core import pack_header, unpack_header
    >>> unpack_header(pack_header(1, 0, 5, 7, 2, 3), 1 << 20)
    (1, 0, 5, 7, 2, 3)
    """
    return _header(kind, flags, length, msg_id, target, view)


def pack_frame(unsigned int kind, unsigned int flags, unsigned long long msg_id, unsigned long long target,
               unsigned long long view, parts, Py_ssize_t small, unsigned long long limit):
    """Size a frame's payload and pack its header, in one call (the per-message path of every send).

    ``parts`` is the payload: a sequence of bytes-like objects. Returns ``(n, frame)``
    with ``n`` the payload's size in bytes and ``frame``:

    - ``None`` when ``n > limit`` (nothing packed: the caller reports it);
    - the header followed by the payload, joined, when ``n <= small``;
    - else the 24-byte header alone (the caller writes the parts after it).

    >>> from mesharray._core import pack_frame, unpack_header
    >>> n, frame = pack_frame(1, 0, 7, 2, 3, [b"ab", memoryview(b"cde")], 64, 1 << 20)
    >>> n, unpack_header(frame, 1 << 20), frame[24:]
    (5, (1, 0, 5, 7, 2, 3), b'abcde')
    >>> pack_frame(1, 0, 7, 2, 3, [b"ab", b"cde"], 4, 1 << 20)[1][24:]
    b''
    >>> pack_frame(1, 0, 7, 2, 3, [b"abcde"], 64, 4)
    (5, None)
    """
    return _pack_frame(kind, flags, msg_id, target, view, parts, small, limit)


cdef tuple _pack_frame(unsigned int kind, unsigned int flags, unsigned long long msg_id, unsigned long long target,
                       unsigned long long view, parts, Py_ssize_t small, unsigned long long limit):
    cdef Py_ssize_t n = 0, i, m, pos = 24
    parts = tuple(parts)  # (what is sized is what is copied; a no-op for a tuple)
    m = len(parts)
    cdef Py_buffer buf
    cdef bytes hdr, out
    cdef char* dst
    for i in range(m):
        p = parts[i]
        if type(p) is bytes:
            n += PyBytes_GET_SIZE(p)
        else:
            PyObject_GetBuffer(p, &buf, PyBUF_SIMPLE)
            n += buf.len
            PyBuffer_Release(&buf)
    if <unsigned long long>n > limit:
        return n, None
    hdr = _header(kind, flags, n, msg_id, target, view)
    if n > small:
        return n, hdr
    out = PyBytes_FromStringAndSize(NULL, 24 + n)
    dst = PyBytes_AS_STRING(out)
    memcpy(dst, PyBytes_AS_STRING(hdr), 24)
    for i in range(m):
        p = parts[i]
        if type(p) is bytes:
            if pos + PyBytes_GET_SIZE(p) > 24 + n:  # (parts that changed since they were sized)
                raise ValueError("a frame part changed size while it was packed")
            memcpy(dst + pos, PyBytes_AS_STRING(p), PyBytes_GET_SIZE(p))
            pos += PyBytes_GET_SIZE(p)
        else:
            PyObject_GetBuffer(p, &buf, PyBUF_SIMPLE)
            if pos + buf.len > 24 + n:  # (a part that grew since it was sized)
                PyBuffer_Release(&buf)
                raise ValueError("a frame part changed size while it was packed")
            memcpy(dst + pos, buf.buf, buf.len)
            pos += buf.len
            PyBuffer_Release(&buf)
    if pos != 24 + n:
        raise ValueError("a frame part changed size while it was packed")
    return n, out


def pack_calls(unsigned int kind, unsigned int flags, unsigned long long target, views, parts, tables,
               callbacks, next_id, Py_ssize_t small, unsigned long long limit):
    """The frames of one call to each of several peers, each registered under a fresh id: the sends of a ``call()``.

    For peer ``i``: its frame is :func:`pack_frame`'s with the id
    ``next_id()`` and the view ``views[i]``, and ``callbacks[i]`` is stored in
    ``tables[i]`` (that peer's calls in flight) under that id, before the
    frame exists for anyone to send. ``parts`` (the payload, the same for
    every peer) is copied once per peer and sized once. Returns ``(n,
    frames)`` with ``n`` the payload's size; ``frames`` is None, and nothing is
    registered, when ``n > small`` or ``n > limit`` (the caller sends such
    a payload its own way).

    >>> from mesharray._core import pack_calls, unpack_header
    >>> ids = iter([5, 6]).__next__
    >>> t0, t1 = {}, {}
    >>> n, frames = pack_calls(1, 1, 9, [3, 4], [b"ab", b"c"], [t0, t1], ["cb0", "cb1"], ids, 64, 1 << 20)
    >>> n, [unpack_header(f, 1 << 20) for f in frames], frames[1][24:], t0, t1
    (3, [(1, 1, 3, 5, 9, 3), (1, 1, 3, 6, 9, 4)], b'abc', {5: 'cb0'}, {6: 'cb1'})
    >>> pack_calls(1, 1, 9, [3], [b"abc"], [t0], ["cb"], ids, 2, 1 << 20)
    (3, None)
    """
    cdef Py_ssize_t n, i, count = len(views)
    cdef bytes one, frame
    cdef char* dst
    cdef unsigned long long msg_id
    cdef uint32_t view
    if len(tables) != count or len(callbacks) != count:
        raise ValueError(f"{count} views, {len(tables)} tables and {len(callbacks)} callbacks: one of each per peer")
    n, one = pack_frame(kind, flags, 0, target, 0, parts, small, limit)
    if one is None or n > small:
        return n, None
    frames = PyList_New(count)
    for i in range(count):
        msg_id = next_id()
        view = views[i]
        frame = PyBytes_FromStringAndSize(PyBytes_AS_STRING(one), 24 + n)
        dst = PyBytes_AS_STRING(frame)
        memcpy(dst + 8, &msg_id, 8)
        memcpy(dst + 20, &view, 4)
        (<dict?>tables[i])[msg_id] = callbacks[i]
        Py_INCREF(frame)
        PyList_SET_ITEM(frames, i, frame)
    return n, frames


def unpack_header(const unsigned char[::1] data not None, unsigned long long limit,
                  Py_ssize_t offset=0):
    """Parse the 24-byte header at ``data[offset:]``.

    Returns ``(kind, flags, length, msg_id, target, view)``. Raises ``ValueError``
    when fewer than 24 bytes are given, the magic is wrong, the kind is 0, or the
    length exceeds ``limit`` (checked before anyone allocates the payload).
    """
    cdef _FrameHeader h
    if offset < 0 or data.shape[0] - offset < 24:
        raise ValueError(f"frame header needs 24 bytes, got {max(0, data.shape[0] - offset)}")
    memcpy(&h, &data[offset], 24)
    if h.magic != FRAME_MAGIC:
        raise ValueError(f"bad frame magic 0x{h.magic:04x}; expected 0x{FRAME_MAGIC:04x}")
    if h.kind == 0:
        raise ValueError("bad frame kind 0")
    if h.length > limit:
        raise ValueError(f"frame length {h.length} exceeds the limit of {limit} bytes")
    return (h.kind, h.flags, h.length, h.msg_id, h.target, h.view)


def take_frame(data, Py_ssize_t start, Py_ssize_t end, unsigned long long limit):
    """The frame at ``data[start:end]`` (a reader's receive buffer), in one call: the per-frame path of every read.

    Returns ``None`` when fewer than 24 bytes are there, else ``(kind, flags,
    msg_id, target, view, payload, total)``: ``total`` is the frame's size with
    its header, and ``payload`` a ``bytearray`` copy of its bytes (``b""`` when
    it has none), or ``None`` when the frame is not all there yet. Raises
    ``ValueError`` for a bad header, as :func:`unpack_header` does (checked
    before anything is allocated).

    >>> from mesharray._core import pack_frame, take_frame
    >>> buf = bytearray(pack_frame(3, 1, 7, 2, 5, [b"abc"], 64, 1 << 20)[1] + b"xy")
    >>> take_frame(buf, 0, len(buf), 1 << 20)
    (3, 1, 7, 2, 5, bytearray(b'abc'), 27)
    >>> take_frame(buf, 0, 26, 1 << 20)[5] is None, take_frame(buf, 27, 29, 1 << 20)
    (True, None)
    """
    cdef _FrameHeader h
    cdef Py_buffer buf
    cdef Py_ssize_t total
    if start < 0 or end < start:
        raise ValueError(f"frame bounds {start}..{end}: not a range of a buffer")
    if end - start < 24:
        return None
    PyObject_GetBuffer(data, &buf, PyBUF_SIMPLE)
    try:
        if end > buf.len:
            raise ValueError(f"frame bounds {start}..{end} outside a buffer of {buf.len} bytes")
        memcpy(&h, <char*>buf.buf + start, 24)
        if h.magic != FRAME_MAGIC:
            raise ValueError(f"bad frame magic 0x{h.magic:04x}; expected 0x{FRAME_MAGIC:04x}")
        if h.kind == 0:
            raise ValueError("bad frame kind 0")
        if h.length > limit:
            raise ValueError(f"frame length {h.length} exceeds the limit of {limit} bytes")
        total = 24 + <Py_ssize_t>h.length
        if end - start < total:
            payload = None
        elif h.length == 0:
            payload = b""
        else:
            payload = PyByteArray_FromStringAndSize(<char*>buf.buf + start + 24, h.length)
    finally:
        PyBuffer_Release(&buf)
    return (h.kind, h.flags, h.msg_id, h.target, h.view, payload, total)


def dispatch_frames(handler, conn, data, Py_ssize_t start, Py_ssize_t end, unsigned long long limit,
                    bint more, clock, double budget, unsigned int route_kind=0, dict route=None,
                    list counts=None):
    """Hand every complete frame of ``data[start:end]`` to ``handler``, in order: the frame loop of every read.

    Each frame is checked as :func:`take_frame` checks it, then
    ``handler(conn, kind, flags, msg_id, target, view, payload)`` runs with a
    ``bytearray`` copy of its payload (``b""`` when it has none). ``more``:
    before each call, ``conn.more`` says whether another header is already
    there (a reader thread's replies cork only then). After a frame, once
    ``clock() - t0 > budget`` (``t0``: this call's start) while more frames
    follow, it stops early so that the caller can flush what the handlers
    corked (``clock=None``: never).

    ``route``: a frame of kind ``route_kind`` skips ``handler``: the callable
    that ``route`` holds under its ``msg_id`` is popped and called as
    ``callback(target, payload)`` (a frame whose ``msg_id`` is not there is
    dropped). A caller's replies go this way straight to their calls'
    callbacks: the table is the caller's calls in flight. ``counts`` (a list
    of two ints, or None): each routed frame adds 1 to ``counts[0]``, and to
    ``counts[1]`` too when its ``target`` is not 0 (a reply whose status is
    not OK).

    Returns ``(start, status, error)``: ``start`` is where the first frame not
    handed over begins; ``status`` is 0 when every complete frame went,
    -1 when it stopped early, and the frame's whole size when the next frame
    is incomplete and longer than ``data`` (the caller reads it into a buffer
    of its own); ``error`` is what a handler raised (``None``: nothing), and
    it stops at that frame, ``start`` already past it. A bad header raises
    ``ValueError`` (the frames before it were handed over).

    >>> from mesharray._core import pack_frame, dispatch_frames
    >>> buf = bytearray(pack_frame(3, 0, 7, 0, 0, [b"abc"], 64, 1 << 20)[1] * 2 + b"xy")
    >>> got = []
    >>> dispatch_frames(lambda c, *f: got.append(f), None, buf, 0, len(buf), 1 << 20, False, None, 0.0)
    (54, 0, None)
    >>> got
    [(3, 0, 7, 0, 0, bytearray(b'abc')), (3, 0, 7, 0, 0, bytearray(b'abc'))]
    >>> calls = {7: lambda target, payload: got.append((target, payload))}
    >>> dispatch_frames(None, None, buf, 0, len(buf), 1 << 20, False, None, 0.0, 3, calls)
    (54, 0, None)
    >>> got[2:], calls   # the first frame went to its callback; the second had none left
    ([(0, bytearray(b'abc'))], {})
    """
    cdef _FrameHeader h
    cdef Py_buffer buf
    cdef Py_ssize_t total
    cdef double t0 = 0.0
    if start < 0 or end < start:
        raise ValueError(f"frame bounds {start}..{end}: not a range of a buffer")
    if end - start < 24:
        return start, 0, None
    PyObject_GetBuffer(data, &buf, PyBUF_SIMPLE)
    try:
        if end > buf.len:
            raise ValueError(f"frame bounds {start}..{end} outside a buffer of {buf.len} bytes")
        if clock is not None:
            t0 = clock()
        while end - start >= 24:
            memcpy(&h, <char*>buf.buf + start, 24)
            if h.magic != FRAME_MAGIC:
                raise ValueError(f"bad frame magic 0x{h.magic:04x}; expected 0x{FRAME_MAGIC:04x}")
            if h.kind == 0:
                raise ValueError("bad frame kind 0")
            if h.length > limit:
                raise ValueError(f"frame length {h.length} exceeds the limit of {limit} bytes")
            total = 24 + <Py_ssize_t>h.length
            if end - start < total:
                return start, (total if total > buf.len else 0), None
            if h.length == 0:
                payload = b""
            else:
                payload = PyByteArray_FromStringAndSize(<char*>buf.buf + start + 24, h.length)
            start += total
            if route is not None and h.kind == route_kind:
                if counts is not None:
                    counts[0] += 1
                    if h.target != 0:
                        counts[1] += 1
                callback = route.pop(h.msg_id, None)
                if callback is not None:
                    try:
                        callback(h.target, payload)
                    except BaseException as exc:
                        return start, 0, exc
            else:
                try:
                    if isinstance(handler, FrameHandler):  # (a worker's or a relay's: no Python call)
                        (<FrameHandler>handler).frame(conn, h.kind, h.flags, h.msg_id, h.target, h.view, payload,
                                                    more and end - start >= 24)
                    else:
                        if more:
                            conn.more = end - start >= 24
                        handler(conn, h.kind, h.flags, h.msg_id, h.target, h.view, payload)
                except BaseException as exc:
                    return start, 0, exc
            if clock is not None and end - start >= 24 and clock() - t0 > budget:
                return start, -1, None
    finally:
        PyBuffer_Release(&buf)
    return start, 0, None
