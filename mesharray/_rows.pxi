# _rows: see _core.pyx
#
# A process's telemetry rows of the calls it handled (``runtime.recorder.Recorder.rows``) in
# C: one struct per call in a ring that grows by doubling, instead of a list of 9-tuples.
# The call path (``_serve.pxi``) pushes a row without making any Python object; Python
# appends tuples and reads tuples back, as from a list. As a tuple and five ints, a row
# was ~300 bytes of fresh objects on every call of every rank; as a struct it is 72 bytes
# of a buffer that is reused once the oldest rows are dropped.

from cpython.ref cimport PyObject, Py_XINCREF, Py_XDECREF

cdef struct _CallRow:
    long long start   # wall-clock ns
    long long dur     # ns
    long long caller  # pid
    long long msg_id
    long long nin     # bytes in
    long long nout    # bytes out
    PyObject* actor
    PyObject* endpoint
    PyObject* status


cdef class CallRows:
    """Call rows ``(wall start ns, duration ns, actor, endpoint, caller pid, msg id, bytes in,
    bytes out, status)``, oldest first, as a list of tuples would hold them: ``append(row)``,
    ``len``, an index or a slice (tuples; a slice's step 1), iteration, and ``del rows[:n]``
    (the oldest ``n``: the only deletion a recorder makes). The numeric fields are 64-bit ints.

    ``offset``: the wall clock minus the monotonic clock (ns), which the recorder keeps here too
    (the call path's rows start at a monotonic read plus it).
    """

    cdef _CallRow* _buf
    cdef Py_ssize_t _cap, _head, _n
    cdef public long long offset

    def __dealloc__(self):
        cdef Py_ssize_t i
        for i in range(self._n):
            self._clear(&self._buf[(self._head + i) % self._cap])
        free(self._buf)

    cdef inline void _clear(self, _CallRow* r) noexcept:
        Py_XDECREF(r.actor)
        Py_XDECREF(r.endpoint)
        Py_XDECREF(r.status)

    cdef int _grow(self) except -1:
        cdef Py_ssize_t cap = max(64, self._cap * 2), i
        cdef _CallRow* buf = <_CallRow*>malloc(cap * sizeof(_CallRow))
        if buf == NULL:
            raise MemoryError()
        for i in range(self._n):
            buf[i] = self._buf[(self._head + i) % self._cap]
        free(self._buf)
        self._buf, self._cap, self._head = buf, cap, 0
        return 0

    cdef int push(self, long long start, long long dur, object actor, object endpoint, long long caller,
                  long long msg_id, long long nin, long long nout, object status) except -1:
        cdef _CallRow* r
        if self._n == self._cap:
            self._grow()
        r = &self._buf[(self._head + self._n) % self._cap]
        r.start, r.dur, r.caller, r.msg_id, r.nin, r.nout = start, dur, caller, msg_id, nin, nout
        r.actor, r.endpoint, r.status = <PyObject*>actor, <PyObject*>endpoint, <PyObject*>status
        Py_XINCREF(r.actor)
        Py_XINCREF(r.endpoint)
        Py_XINCREF(r.status)
        self._n += 1
        return 0

    def append(self, tuple row):
        """Add ``row`` (the nine fields above) as the newest."""
        if len(row) != 9:
            raise ValueError(f"a call row has 9 fields, got {len(row)}: {row!r}")
        try:
            self.push(row[0], row[1], row[2], row[3], row[4], row[5], row[6], row[7], row[8])
        except (TypeError, OverflowError) as exc:
            raise TypeError(f"a call row's fields 0, 1 and 4 to 7 are 64-bit ints; got {row!r} ({exc})") from None

    def __len__(self):
        return self._n

    cdef tuple _row(self, Py_ssize_t i):
        cdef _CallRow* r = &self._buf[(self._head + i) % self._cap]
        return (r.start, r.dur, <object>r.actor, <object>r.endpoint, r.caller, r.msg_id, r.nin, r.nout,
                <object>r.status)

    def __getitem__(self, key):
        cdef Py_ssize_t i, start, stop, step
        if isinstance(key, slice):
            start, stop, step = key.indices(self._n)
            if step != 1:
                raise ValueError("call rows take slices of step 1")
            return [self._row(i) for i in range(start, max(start, stop))]
        i = key
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"call row {key} out of range (rows: {self._n})")
        return self._row(i)

    def __iter__(self):
        return iter(self[:])

    def __delitem__(self, key):
        cdef Py_ssize_t start, stop, step, i
        if not isinstance(key, slice):
            raise TypeError("call rows are dropped oldest first: del rows[:n]")
        start, stop, step = key.indices(self._n)
        if start != 0 or step != 1:
            raise ValueError("call rows are dropped oldest first: del rows[:n]")
        for i in range(max(0, stop)):
            self._clear(&self._buf[self._head])
            self._head = (self._head + 1) % self._cap
            self._n -= 1
