# A worker's call path (mesharray.runtime.worker.Worker), and a relay's gathering of its ranks'
# replies (mesharray.runtime.relay.Relay), compiled.
#
# Every call and broadcast a rank serves runs this: its reader's frame loop (dispatch_frames)
# hands each frame of a connection to that connection's CallServer, which routes it and runs a
# call to a synchronous actor (serve_sync) inline, as Worker._frame did in Python. The cases it
# does not handle go back to the worker's Python (Worker._frame: a missing or failed actor, an
# async one; the channel's _on_frame: every kind but CALL; the worker's methods for a failure,
# a reply that is not None, a broadcast's error told at the next call). A relay's connections to
# its ranks have a RelayReplies: each reply goes into its call's Gathering, and the last one
# answers the controller (the relay's Python); relay_forward is its loop over the ranks of a
# relayed frame. No I/O here: the reply
# goes through the connection's own methods (write_frame, send). serve_setup gives this part
# the worker module's constants and telemetry tables once, at its import.

from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE
from cpython.contextvars cimport PyContextVar_Set, PyContextVar_Reset
from libc.string cimport memcmp

cdef extern from "pythread.h":
    unsigned long _thread_ident "PyThread_get_thread_ident" ()

cdef object _sv_decode = None        # framing.decode
from pickle import loads as _sv_loads
cdef dict _sv_names = None           # u8 n + method name -> name (worker._names)
cdef object _sv_last_name = None      # (its key, name) of the last call's method
cdef object _sv_slot_type = None      # the type of an actor's slot (a subclass of ActorSlot), once checked
cdef bytes _sv_no_args = b""         # the pickled payload of a call without arguments
cdef object _sv_empty_ok = None      # the parts of a reply of None
cdef Py_ssize_t _sv_empty_ok_bytes = 0
cdef object _sv_current = None       # the ContextVar of the running actor's Context
cdef object _sv_clock_ns = None      # time.perf_counter_ns
cdef object _sv_rec = None           # the Recorder (trim)
cdef dict _sv_running = None         # REC.current: thread id -> the call it runs
cdef CallRows _sv_rows = None        # REC.rows
cdef Py_ssize_t _sv_max_rows = 0
cdef bint _sv_record = False         # telemetry on (MESHARRAY_TELEMETRY)
cdef tuple _sv_send_errors = ()      # what a reply's send raises that the worker reports
cdef Py_ssize_t _sv_small = 0        # SMALL_FRAME: a reply written whole by write_frame
cdef object _sv_write_frame = None   # transport._wire.write_frame (Connection.write_frame)
cdef unsigned int _sv_CALL = 0, _sv_REPLY = 0, _sv_OK = 0, _sv_FENCE = 0, _sv_F_REPLY = 0
cdef frozenset _sv_counted = frozenset()


def serve_setup(dict kinds, counted, decode, dict names, bytes no_args, empty_ok, Py_ssize_t empty_ok_bytes,
                current, clock_ns, rec, bint record, Py_ssize_t max_rows, send_errors, Py_ssize_t small,
                write_frame):
    """What :mod:`mesharray.runtime.worker` gives this part once: the frame kinds and flag it
    routes by (``kinds``: CALL, REPLY, OK, FENCE, F_REPLY), the kinds a fence counts, the payload
    decoder, its method-name cache, the no-arguments payload, the reply of None (parts and frame
    size), the actors' ContextVar, the clock, the recorder and whether it records, the errors of
    a reply's send it reports, and the largest payload written whole."""
    global _sv_decode, _sv_names, _sv_no_args, _sv_empty_ok, _sv_empty_ok_bytes, _sv_current, _sv_clock_ns
    global _sv_rec, _sv_running, _sv_rows, _sv_max_rows, _sv_record, _sv_send_errors, _sv_small, _sv_write_frame
    global _sv_CALL, _sv_REPLY, _sv_OK, _sv_FENCE, _sv_F_REPLY, _sv_counted
    _sv_CALL, _sv_REPLY, _sv_OK = kinds["CALL"], kinds["REPLY"], kinds["OK"]
    _sv_FENCE, _sv_F_REPLY = kinds["FENCE"], kinds["F_REPLY"]
    _sv_counted = frozenset(counted)
    _sv_decode, _sv_names, _sv_no_args = decode, names, no_args
    _sv_empty_ok, _sv_empty_ok_bytes = empty_ok, empty_ok_bytes
    _sv_current, _sv_clock_ns = current, clock_ns
    _sv_rec, _sv_record = rec, record
    _sv_running, _sv_rows, _sv_max_rows = rec.current, rec.rows, max_rows
    _sv_send_errors, _sv_small, _sv_write_frame = tuple(send_errors), small, write_frame


cdef class ActorSlot:
    """One actor hosted by a worker: the base of ``runtime.worker._Slot``, its fields in C so that
    the call path reads them without attribute lookups (``_Slot.__init__`` sets them)."""

    cdef public object actor_id
    cdef public object name
    cdef public object obj
    cdef public object shape
    cdef object _lock, _acquire, _release  # (the lock's methods, looked up once)
    cdef public bint is_async
    cdef public object failure          # the error record when the constructor raised
    cdef public object queue            # the asyncio.Queue of an async actor
    cdef public object concurrent
    cdef public object endpoints
    cdef public object ctx              # its Context (one per actor: sync endpoints never overlap)
    cdef public dict bound              # endpoint name -> bound method
    cdef public dict broadcast_error    # sender -> the error of a broadcast, told at its next call

    @property
    def lock(self):
        """The actor's lock: its synchronous endpoints run one at a time, whoever sends."""
        return self._lock

    @lock.setter
    def lock(self, value):
        self._lock, self._acquire, self._release = value, value.acquire, value.release


cdef class CallOrder:
    """The base of ``runtime.worker._Order``: the counted frames handled from the controller's
    connection (``direct``) and the relay's (``relayed``) of a rank with a relay, and how many
    readers wait at a fence (``waiting``, on ``cond``), in C fields."""

    cdef public long long direct
    cdef public long long relayed
    cdef public long long waiting
    cdef public object cond


cdef class FrameHandler:
    """A compiled connection handler: :func:`dispatch_frames` calls its ``frame`` without a Python call."""

    cdef int frame(self, conn, unsigned int kind, unsigned int flags, unsigned long long msg_id,
                   unsigned long long target, unsigned long long view, payload, bint more) except -1:
        return 0


cdef class Gathering:
    """The replies of one relayed call that a relay still waits for: the base of
    ``runtime.relay._Gather`` (C fields: :class:`RelayReplies` fills them per reply)."""

    cdef public dict pos          # rank -> its position among the frame's targets (the ranks that answer)
    cdef public list entries      # (position, status, payload) of each reply in
    cdef public Py_ssize_t left   # replies still to come
    cdef public Py_ssize_t count  # replies in all
    cdef public double deadline   # (telemetry requests: when the rest count as not answered)


cdef class RelayReplies(FrameHandler):
    """The handler of a relay's connections to its ranks: a ``REPLY`` goes into its call's
    :class:`Gathering` (by ``relay.gathers[msg_id]``, the rank by ``relay.rank_of[conn]``), and
    the last one of a call is answered at once (``relay._answer``); every other frame goes to
    ``relay._on_worker_frame``. What ``Relay._on_worker_frame`` did for a reply, compiled."""

    cdef readonly object relay
    cdef dict gathers
    cdef dict rank_of
    cdef object other
    cdef object answer

    def __init__(self, relay):
        self.relay = relay
        self.gathers = relay.gathers
        self.rank_of = relay.rank_of
        self.other = relay._on_worker_frame
        self.answer = relay._answer

    def __call__(self, conn, kind, flags, msg_id, target, view, payload):
        self.frame(conn, kind, flags, msg_id, target, view, payload, conn.more)

    cdef int frame(self, conn, unsigned int kind, unsigned int flags, unsigned long long msg_id,
                   unsigned long long target, unsigned long long view, payload, bint more) except -1:
        cdef Gathering g
        if kind != _sv_REPLY:
            conn.more = more
            self.other(conn, kind, flags, msg_id, target, view, payload)
            return 0
        found = self.gathers.get(msg_id)
        rank = self.rank_of.get(conn)
        if found is None or rank is None:
            return 0
        g = <Gathering?>found
        pos = g.pos.get(rank)
        if pos is None:
            return 0
        g.entries.append((pos, target, payload))
        g.left -= 1
        if g.left == 0:
            del self.gathers[msg_id]
            self.answer(msg_id, g)
        return 0


cdef void _sv_note_slot_type(t) noexcept:
    global _sv_slot_type
    _sv_slot_type = t


cdef class CallServer(FrameHandler):
    """The handler of one of a worker's connections: a call to a synchronous actor runs here (what
    :func:`serve_sync` does), a ``FENCE`` waits in ``Worker._await``, anything else goes to
    ``Worker._frame`` (a call it does not run) or the channel. ``counted``: 0 for a connection
    outside the fences, 1 for the controller's connection and 2 for the relay's of a rank with a
    relay, whose calls, spawns, actor stops and stop each count in the worker's ``order`` (see
    ``runtime.worker._Order``).

    Called as any handler (``server(conn, kind, flags, msg_id, target, view, payload)``);
    :func:`dispatch_frames` calls it without a Python call.
    """

    cdef readonly object worker
    cdef readonly object chan
    cdef readonly int counted
    cdef dict actors
    cdef dict peer
    cdef dict views_in    # (the channel's: the view shapes its VIEW frames defined)
    cdef object on_frame
    cdef CallOrder order

    def __init__(self, worker, chan, int counted=0):
        if counted not in (0, 1, 2):
            raise ValueError(f"counted must be 0 (not counted), 1 (direct) or 2 (relayed), got {counted}")
        self.worker = worker
        self.chan = chan
        self.counted = counted
        self.actors = worker.actors
        self.peer = chan.peer
        self.views_in = chan.views_in
        self.on_frame = chan._on_frame
        self.order = worker.order

    def __call__(self, conn, kind, flags, msg_id, target, view, payload):
        self.frame(conn, kind, flags, msg_id, target, view, payload, conn.more)

    cdef int frame(self, conn, unsigned int kind, unsigned int flags, unsigned long long msg_id,
                   unsigned long long target, unsigned long long view, payload, bint more) except -1:
        # ``more``: other frames of the same read follow (a reader thread's reply corks only then);
        # set as ``conn.more`` for the Python paths, which read it there
        cdef ActorSlot slot = None
        cdef CallOrder o
        if kind == _sv_FENCE and self.counted:
            self.worker._await(self.counted == 1, msg_id)  # (a fence waits for the other path's frames)
            return 0
        if kind == _sv_CALL:
            found = self.actors.get(target)
            if found is not None:
                if type(found) is _sv_slot_type:  # (the type checked before: not its MRO walked again)
                    slot = <ActorSlot>found
                else:
                    slot = <ActorSlot?>found
                    _sv_note_slot_type(type(found))
            if slot is None or slot.failure is not None or slot.is_async:
                conn.more = more
                self.worker._frame(self.chan, conn, kind, flags, msg_id, target, view, payload)
            else:
                _serve(self.worker, self.chan, conn, slot, flags, msg_id, view, payload, more, self.peer,
                       self.views_in)
        else:
            conn.more = more
            self.on_frame(conn, kind, flags, msg_id, target, view, payload)
        if self.counted and kind in _sv_counted:
            o = self.order
            if self.counted == 2:
                o.relayed += 1
            else:
                o.direct += 1
            if o.waiting:
                (<object>o).wake()
        return 0


def serve_sync(worker, chan, conn, ActorSlot slot not None, unsigned int flags, unsigned long long msg_id,
               unsigned long long view, payload):
    """A call (or broadcast) of channel ``chan`` (its connection ``conn``) to the synchronous actor of
    ``slot``, run here under the actor's lock: ``Worker._frame``'s per-message path. With telemetry, a
    row per call (``runtime.recorder``) and the call in ``REC.current`` while it runs; the reply of a
    call (``flags & F_REPLY``) goes back on ``conn``, written at once unless more frames of the same
    read follow (``conn.more``: corked then)."""
    _serve(worker, chan, conn, slot, flags, msg_id, view, payload, conn.more, chan.peer, chan.views_in)


cdef inline object _sv_args(payload, const unsigned char* p, Py_ssize_t size, Py_ssize_t at):
    # a call's (args, kwargs) from its payload at ``at``: framing.decode, whose common case (no
    # out-of-band buffers: the prefix's second field 0) is read here, the pickle loaded in place
    cdef Py_ssize_t plen
    if size - at >= 8 and p[at + 4] == 0 and p[at + 5] == 0:
        plen = p[at] | (p[at + 1] << 8) | (p[at + 2] << 16) | (<Py_ssize_t>p[at + 3] << 24)
        if at + 8 + plen <= size:
            return _sv_loads(memoryview(payload)[at + 8:at + 8 + plen])
    return _sv_decode(memoryview(payload)[at:])


cdef _serve(worker, chan, conn, ActorSlot slot, unsigned int flags, unsigned long long msg_id,
            unsigned long long view, payload, bint more, dict peer, dict views_in):
    global _sv_last_name
    cdef bint reply = (flags & _sv_F_REPLY) != 0
    cdef const unsigned char* p = <const unsigned char*>PyByteArray_AS_STRING(payload)
    cdef Py_ssize_t size = PyByteArray_GET_SIZE(payload)
    cdef Py_ssize_t n, out = 0
    cdef unsigned long tid = 0
    cdef long long t0 = 0, caller = 0
    cdef bint ok = True
    if size < 1 or size < 1 + p[0]:
        raise ValueError(f"call payload of {size} bytes has no method name")
    n = p[0]
    last = _sv_last_name  # (the method of the last call: a loop calls one, and its name needs no bytes made)
    if last is not None and PyBytes_GET_SIZE((<tuple>last)[0]) == 1 + n and memcmp(
            PyBytes_AS_STRING((<tuple>last)[0]), p, 1 + n) == 0:
        method = (<tuple>last)[1]
    else:
        key = PyBytes_FromStringAndSize(<const char*>p, 1 + n)
        method = _sv_names.get(key)
        if method is None:
            method = key[1:].decode()
            _sv_names[key] = method
        _sv_last_name = (key, method)
    vshape = views_in.get(view) if view else None
    result = None
    status = "ok"
    parts = None
    if _sv_record:
        tid = _thread_ident()
        t0 = _sv_clock_ns()
        caller = peer.get("pid") or 0
        _sv_running[tid] = (slot.name, method, t0, caller, msg_id)
    try:
        slot._acquire()
        try:
            if reply and slot.broadcast_error and worker._tell_broadcast_error(chan, msg_id, slot):
                return
            ctx = slot.ctx  # one per actor: sync endpoints of an actor never overlap
            ctx._view = vshape
            token = PyContextVar_Set(_sv_current, ctx)
            try:
                fn = slot.bound.get(method) or worker._endpoint(slot, method)
                if size - 1 - n == len(_sv_no_args) and memcmp(p + 1 + n, <const char*>_sv_no_args,
                                                                size - 1 - n) == 0:
                    result = fn()  # no arguments: nothing to unpickle
                else:
                    args, kwargs = _sv_args(payload, p, size, 1 + n)
                    result = fn(*args, **kwargs)
            except BaseException as exc:
                ok = False
                worker._fail(chan, msg_id, reply, slot, exc, method)
                status = type(exc).__name__
            finally:
                PyContextVar_Reset(_sv_current, token)
        finally:
            slot._release()
        if reply and ok:
            if result is None:
                parts, out = _sv_empty_ok, _sv_empty_ok_bytes
            else:
                parts = worker._reply_parts(chan, msg_id, slot, method, result)
                if parts is not None and _sv_record:
                    out = 24 + sum(map(len, parts))
    finally:
        if _sv_record:
            _sv_running.pop(tid, None)
    if _sv_record:
        # the row before the reply goes out: a caller that reads telemetry once it has its reply
        # finds it, even through another connection of this worker (a nested call's caller)
        _sv_rows.push(t0 + _sv_rows.offset, <long long>_sv_clock_ns() - t0, slot.name, method, caller, msg_id,
                      size, out, status)
    if parts is not None:
        try:
            if more:  # corked: more frames of this read follow, and the reader flushes after them
                conn.send(_sv_REPLY, 0, msg_id, _sv_OK, 0, parts, True)
            else:
                n, frame = _pack_frame(_sv_REPLY, 0, msg_id, _sv_OK, 0, parts, _sv_small, conn.limit)
                if frame is None or n > _sv_small or not _sv_write_frame(conn, frame):
                    conn.send(_sv_REPLY, 0, msg_id, _sv_OK, 0, parts, False)
        except _sv_send_errors as exc:
            worker._reply_failed(chan, msg_id, slot, method, result, exc)
    if _sv_record and len(_sv_rows) > _sv_max_rows:
        _sv_rec.trim()


cdef object _SV_UNSET = object()


def relay_forward(relay, list ranks, mask, unsigned int inner, bint reply, unsigned long long msg_id,
                  unsigned long long target, unsigned long long view, body, Gathering g):
    """``Relay._relay``'s loop: the frame of kind ``inner`` (payload ``body``) to each of ``ranks``
    that joined, with ``F_REPLY`` where ``reply`` and the ``mask`` (None: all) ask for a reply.
    A small frame is packed once per flag and written whole (``write_frame``), else sent; a rank
    not joined or gone goes to ``relay._absent``, a view a rank has not seen yet is defined by
    ``relay._define_view`` first; a rank whose connection broke is answered by its close handler."""
    cdef dict workers = relay.workers
    cdef dict defined = relay.defined
    cdef Py_ssize_t i, m, n = len(ranks)
    cdef unsigned int f
    frame_reply = frame_plain = _SV_UNSET
    parts = [body]
    for i in range(n):
        r = ranks[i]
        f = _sv_F_REPLY if reply and (mask is None or mask[i]) else 0
        w = workers.get(r)
        if w is None:
            relay._absent(i, r, inner, f, msg_id, target, view, body, g)
            continue
        if view and view not in defined[w]:
            relay._define_view(w, view)
        frame = frame_reply if f else frame_plain
        if frame is _SV_UNSET:
            m, packed = _pack_frame(inner, f, msg_id, target, view, parts, _sv_small, w.limit)
            # (a large frame's is its header alone: it goes through send, with its payload)
            frame = packed if packed is not None and m <= _sv_small else None
            if f:
                frame_reply = frame
            else:
                frame_plain = frame
        try:
            if frame is None or not _sv_write_frame(w, frame):
                w.send(inner, f, msg_id, target, view, parts)
        except ConnectionError:
            pass  # gone: its close handler answers for it
