# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled UCX data plane: a UCP worker per plane, driven from C (``_ucp_engine.h``).

Built by ``setup.py`` wherever the ``libucx`` wheel (the ``ucx`` extra) or a UCX
with headers is installed; :mod:`mesharray.transport.ucx` is the Python layer
(handshake, addresses, errors) over it. Every method here parses its arguments,
runs the C call with the GIL released, and turns the result code into one
exception in one place (:func:`_check`), as mpi4py does.

- :class:`Engine`: a UCP context and worker in multi-thread mode, plus a native
  progress thread that never takes the GIL and sleeps in ``epoll`` on the
  worker's event fd when idle. It answers Buffer requests of other processes
  (registered blocks: :meth:`Engine.register`) by itself.
- :class:`Link`: one side of a link: a receive id of its own, an endpoint to the
  peer's worker (:meth:`Link.connect`, after the handshake the Python layer runs),
  ``send`` / ``recv_into`` as an ordered byte stream over tag messages,
  Buffer transfers (:meth:`Link.buffer_served`, :meth:`Link.buffer_rma`) and
  :func:`ring_run`, the ring collectives' whole send/receive loop.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free
from libc.string cimport strlen

cdef extern from "_ucp_engine.h" nogil:
    ctypedef struct ma_engine:
        uint64_t served
        uint64_t progressed
    ctypedef struct ma_link:
        uint64_t recv_id
        uint64_t send_id
        int rma_native
        int error
        int fin
        int closed
    ctypedef struct ma_step:
        uint64_t addr
        uint64_t nbytes
        uint64_t flags
        uint64_t src
    int MA_ERRLEN
    int MA_OK, MA_DROPPED, MA_ECONN, MA_ETIMEOUT, MA_ECLOSED, MA_EINVAL, MA_ENOMEM
    int eng_enter(ma_engine *e)
    void eng_leave(ma_engine *e)
    ma_engine *ma_engine_new(int64_t grace_us, int64_t spin_us, int64_t srv_timeout_s, char *err)
    int ma_engine_address(ma_engine *e, char **out, size_t *length)
    void ma_engine_close(ma_engine *e)
    char *ma_engine_info(ma_engine *e)
    void ma_engine_free(ma_engine *e)
    ma_link *ma_link_new(ma_engine *e, uint32_t rand32, char *err)
    int ma_link_connect(ma_link *l, const void *addr, size_t length, uint64_t send_id, char *err)
    int ma_link_transports(ma_link *l, char *out, size_t outlen, int *native)
    int ma_link_send(ma_link *l, const void *buf, size_t n, int64_t timeout_ns, char *err)
    int ma_link_recv(ma_link *l, char *buf, size_t n, int64_t timeout_ns, char *err)
    void ma_link_close(ma_link *l, int64_t timeout_ns)
    void ma_link_release(ma_link *l)
    int ma_region_add(ma_engine *e, unsigned slot, void *addr, size_t length, int readonly, uint64_t token,
                      uint64_t *token_word, const uint8_t *secret, void **rkey, size_t *rkey_len, char *err)
    int ma_region_release(ma_engine *e, unsigned slot, int64_t timeout_ns)
    int ma_token_table(ma_engine *e, void *addr, size_t length, void **rkey, size_t *rkey_len, char *err)
    int ma_buffer_served(ma_link *l, int op, uint32_t slot, uint64_t token, const uint8_t *secret,
                         uint64_t offset, void *local, size_t n, int64_t timeout_ns, char *err)
    int ma_buffer_rma(ma_link *l, int op, uint64_t token, uint64_t token_addr, const void *token_rkey,
                      uint64_t raddr, const void *rkey_buf, void *local, size_t n, int64_t timeout_ns, char *err)
    int ma_ring_run(ma_link *right, ma_link *left, const ma_step *steps, size_t n, int dt, int op,
                    size_t chunk, int64_t timeout_ns, char *err)

cdef extern from "ucp/api/ucp.h" nogil:
    void ucp_get_version(unsigned *major, unsigned *minor, unsigned *release)
    void ucp_rkey_buffer_release(void *rkey_buffer)

__all__ = ["Engine", "Link", "ring_run", "version", "DROPPED", "STEP_SEND", "STEP_RECV", "STEP_REDUCE",
           "STEP_FORWARD", "DTYPES", "OPS"]

#: a Buffer transfer found the block dropped (``Link.buffer_served`` / ``buffer_rma``)
DROPPED = 1
STEP_SEND = 1
STEP_RECV = 2
STEP_REDUCE = 4
STEP_FORWARD = 8
#: dtype codes of :func:`ring_run`'s reductions (NumPy ``dtype.str`` in native byte order)
DTYPES = {"f4": 0, "f8": 1, "i1": 2, "i2": 3, "i4": 4, "i8": 5, "u1": 6, "u2": 7, "u4": 8, "u8": 9}
OPS = {"sum": 0, "prod": 1, "min": 2, "max": 3}


def version():
    """The UCX version this module runs with, as ``"major.minor.release"``."""
    cdef unsigned a, b, c
    ucp_get_version(&a, &b, &c)
    return f"{a}.{b}.{c}"


cdef str _text(const char *s):
    return s[:strlen(s)].decode("utf-8", "replace") if s is not NULL else ""


cdef int _check(int rc, char *err, str what) except -1:
    """Raise for a result code of the C layer: the one place errors are made."""
    if rc == MA_OK or rc == MA_DROPPED:
        return rc
    msg = _text(err) if err[0] else "failed"
    if rc == MA_ETIMEOUT:
        raise TimeoutError(f"{what}: {msg}")
    if rc == MA_EINVAL:
        raise ValueError(f"{what}: {msg}")
    if rc == MA_ENOMEM:
        raise MemoryError(f"{what}: {msg}")
    raise ConnectionError(f"{what}: {msg}")


cdef class Engine:
    """A UCP context + worker (multi-thread mode) and its native progress thread.

    Parameters
    ----------
    grace_us : int
        How long callers must have been quiet before the progress thread leads.
    spin_us : int
        How long a caller waiting for a small transfer polls before it sleeps.
    serve_timeout_s : int
        How long a served Buffer write waits for its bytes before it gives up.
    """

    cdef ma_engine *e
    cdef readonly bytes address
    cdef object __weakref__

    def __cinit__(self, long grace_us=2000, long spin_us=25, long serve_timeout_s=60):
        cdef char err[256]
        cdef char *addr = NULL
        cdef size_t n = 0
        err[0] = 0
        with nogil:
            self.e = ma_engine_new(grace_us, spin_us, serve_timeout_s, err)
        if self.e is NULL:
            raise OSError(f"cannot start UCX: {_text(err)}")
        if ma_engine_address(self.e, &addr, &n) != MA_OK:
            raise OSError("cannot read the UCX worker's address")
        self.address = addr[:n]
        free(addr)

    def __dealloc__(self):
        if self.e is not NULL:
            with nogil:
                ma_engine_free(self.e)
            self.e = NULL

    def close(self):
        """Stop the progress thread, close every link and unmap every block (idempotent)."""
        if self.e is not NULL:
            with nogil:
                ma_engine_close(self.e)

    @property
    def served(self):
        """Buffer requests of other processes this engine answered (in C)."""
        return self.e.served if self.e is not NULL else 0

    def resources(self):
        """The transports and devices UCX may use here, as ``["tcp/eth0", ...]`` (``ucp_context_print_info``)."""
        cdef ma_engine *e = self._enter()
        cdef char *text = NULL
        try:
            text = ma_engine_info(e)
            out = _text(text)
        finally:
            free(text)
            eng_leave(e)
        found = []
        for line in out.splitlines():
            if "resource" in line and "/" in line:
                parts = line.split()
                name = parts[len(parts) - 1]  # (wraparound is off in this module)
                if name not in found:
                    found.append(name)
        return found

    cdef ma_engine *_enter(self) except NULL:
        if self.e is NULL or not eng_enter(self.e):
            raise ConnectionError("the UCX data plane is closed")
        return self.e

    def new_link(self, uint32_t rand32):
        """A link slot with a receive id of its own (``rand32``: 32 random bits)."""
        cdef char err[256]
        cdef ma_engine *e = self._enter()
        err[0] = 0
        try:
            l = ma_link_new(e, rand32, err)
            if l is NULL:
                _check(MA_ECLOSED, err, "cannot open a UCX link")
            link = Link.__new__(Link)
            (<Link>link).l = l
            (<Link>link).engine = self
            return link
        finally:
            eng_leave(e)

    def register(self, unsigned slot, uint64_t addr, size_t nbytes, bint readonly, uint64_t token,
                 uint64_t token_word, bytes secret):
        """Map ``nbytes`` at ``addr`` (``ucp_mem_map``) under ``slot``; return its packed remote key.

        The engine answers requests for it (checking ``token``, ``*token_word`` and
        ``secret``) until :meth:`unregister`.
        """
        cdef char err[256]
        cdef void *rkey = NULL
        cdef size_t rlen = 0
        cdef const uint8_t *sec = secret
        cdef int rc
        if len(secret) != 16:
            raise ValueError(f"secret must be 16 bytes, got {len(secret)}")
        cdef ma_engine *e = self._enter()
        err[0] = 0
        try:
            with nogil:
                rc = ma_region_add(e, slot, <void *>addr, nbytes, readonly, token, <uint64_t *>token_word, sec,
                                   &rkey, &rlen, err)
            _check(rc, err, "cannot register the buffer with UCX")
            out = (<char *>rkey)[:rlen] if rkey is not NULL else b""
            if rkey is not NULL:
                ucp_rkey_buffer_release(rkey)
            return out
        finally:
            eng_leave(e)

    def unregister(self, unsigned slot, double timeout=5.0):
        """Stop serving ``slot``; unmap it once transfers in flight finished or failed.

        Returns False when transfers were still running after ``timeout`` s (the block is
        no longer served; call again before freeing its memory).
        """
        cdef int rc
        if self.e is NULL or not eng_enter(self.e):
            return True
        try:
            with nogil:
                rc = ma_region_release(self.e, slot, <int64_t>(timeout * 1e9))
            return rc == MA_OK
        finally:
            eng_leave(self.e)

    def token_table(self, uint64_t addr, size_t nbytes):
        """Map the owner's token table once; return its packed remote key (for RMA token checks)."""
        cdef char err[256]
        cdef void *rkey = NULL
        cdef size_t rlen = 0
        cdef int rc
        cdef ma_engine *e = self._enter()
        err[0] = 0
        try:
            with nogil:
                rc = ma_token_table(e, <void *>addr, nbytes, &rkey, &rlen, err)
            _check(rc, err, "cannot register the token table with UCX")
            out = (<char *>rkey)[:rlen]
            ucp_rkey_buffer_release(rkey)
            return out
        finally:
            eng_leave(e)


cdef class Link:
    """One side of a link: made by :meth:`Engine.new_link`, connected by :meth:`connect`."""

    cdef ma_link *l
    cdef Engine engine

    def __dealloc__(self):
        if self.l is not NULL and self.engine is not None and self.engine.e is not NULL:
            with nogil:
                ma_link_release(self.l)
        self.l = NULL

    @property
    def recv_id(self):
        """The id the peer tags this link's messages with (48 bits)."""
        return self.l.recv_id

    @property
    def rma_native(self):
        """Whether the endpoint has a transport that does RMA in hardware or the kernel."""
        return bool(self.l.rma_native)

    @property
    def broken(self):
        """Whether the link failed (UCX reported its peer gone) or was closed."""
        return bool(self.l.error or self.l.closed)

    @property
    def peer_closed(self):
        """Whether the peer closed its side."""
        return bool(self.l.fin)

    cdef ma_engine *_enter(self) except NULL:
        return self.engine._enter()

    def connect(self, bytes address, uint64_t send_id):
        """Create the endpoint to the peer worker at ``address``; its messages are tagged ``send_id``."""
        cdef char err[256]
        cdef const char *a = address
        cdef size_t n = len(address)
        cdef int rc
        cdef ma_engine *e = self._enter()
        err[0] = 0
        try:
            with nogil:
                rc = ma_link_connect(self.l, a, n, send_id, err)
            _check(rc, err, "cannot connect to the peer's UCX worker")
        finally:
            eng_leave(e)

    def transports(self):
        """The endpoint's transports as ``["tcp/eth0", ...]``."""
        cdef char out[1024]
        cdef int native = 0
        cdef ma_engine *e = self._enter()
        try:
            ma_link_transports(self.l, out, sizeof(out), &native)
            s = _text(out)
            return s.split(",") if s else []
        finally:
            eng_leave(e)

    # send and recv_into share their steps (the buffer held, the engine entered, the GIL released
    # around one C call), written out in each: the two differ in buffer flags, C call and error
    # word, and each reads alone as the C API it wraps
    def send(self, data, double timeout=60.0):
        """Send all of ``data`` as one message (GIL released until UCX is done with it)."""
        cdef Py_buffer view
        cdef char err[256]
        cdef int rc
        PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
        cdef ma_engine *e
        try:
            e = self._enter()
            err[0] = 0
            try:
                with nogil:
                    rc = ma_link_send(self.l, view.buf, <size_t>view.len, <int64_t>(timeout * 1e9), err)
                _check(rc, err, "send")
            finally:
                eng_leave(e)
        finally:
            PyBuffer_Release(&view)

    def recv_into(self, buf, double timeout=60.0):
        """Fill all of ``buf`` from the link's ordered byte stream."""
        cdef Py_buffer view
        cdef char err[256]
        cdef int rc
        PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE | PyBUF_WRITABLE)
        cdef ma_engine *e
        try:
            e = self._enter()
            err[0] = 0
            try:
                with nogil:
                    rc = ma_link_recv(self.l, <char *>view.buf, <size_t>view.len, <int64_t>(timeout * 1e9), err)
                _check(rc, err, "receive")
            finally:
                eng_leave(e)
        finally:
            PyBuffer_Release(&view)

    def buffer_served(self, int op, uint32_t slot, uint64_t token, bytes secret, uint64_t offset,
                      uint64_t local, size_t nbytes, double timeout=60.0):
        """A Buffer transfer the owner's engine serves: ``op`` 0 read into ``local``, 1 write, 2 drop.

        Returns 0, or :data:`DROPPED` when the owner no longer has the block.
        """
        cdef char err[256]
        cdef const uint8_t *sec = secret
        cdef int rc
        if len(secret) != 16:
            raise ValueError(f"secret must be 16 bytes, got {len(secret)}")
        if op not in (0, 1, 2):
            raise ValueError(f"op must be 0 (read), 1 (write) or 2 (drop), got {op}")
        cdef ma_engine *e = self._enter()
        err[0] = 0
        try:
            with nogil:
                rc = ma_buffer_served(self.l, op, slot, token, sec, offset, <void *>local, nbytes,
                                      <int64_t>(timeout * 1e9), err)
            return _check(rc, err, "buffer transfer")
        finally:
            eng_leave(e)

    def buffer_rma(self, int op, uint64_t token, uint64_t token_addr, bytes token_rkey, uint64_t raddr,
                   bytes rkey, uint64_t local, size_t nbytes, double timeout=60.0):
        """A one-sided Buffer transfer: get the owner's token word, then get/put (``ucp_get_nbx``/``ucp_put_nbx``)."""
        cdef char err[256]
        cdef const char *tk = token_rkey
        cdef const char *rk = rkey
        cdef int rc
        if op not in (0, 1, 2):
            raise ValueError(f"op must be 0 (read), 1 (write) or 2 (drop), got {op}")
        cdef ma_engine *e = self._enter()
        err[0] = 0
        try:
            with nogil:
                rc = ma_buffer_rma(self.l, op, token, token_addr, tk, raddr, rk, <void *>local, nbytes,
                                   <int64_t>(timeout * 1e9), err)
            return _check(rc, err, "buffer transfer")
        finally:
            eng_leave(e)

    def close(self, double timeout=2.0):
        """Send FIN after what was sent, flush and close the endpoint (at most ``timeout`` s, then force)."""
        if self.engine.e is NULL or not eng_enter(self.engine.e):
            return
        try:
            with nogil:
                ma_link_close(self.l, <int64_t>(timeout * 1e9))
        finally:
            eng_leave(self.engine.e)


def ring_run(Link right, Link left, const uint64_t[:, ::1] steps, int dtype, int op, size_t chunk,
             double timeout=60.0):
    """Run a ring plan in C: ``steps`` rows ``(address, nbytes, flags, source)`` (``STEP_*`` flags).

    Sends go on ``right``, receives come on ``left`` in order. A ``STEP_SEND`` step sends
    ``nbytes`` read at ``source``; a ``STEP_REDUCE`` receive (at most ``chunk`` bytes) writes
    ``source ⊕ received`` to ``address`` with ``op`` over ``dtype`` (codes of :data:`DTYPES`,
    :data:`OPS`; ``source`` may be ``address``); other receives land at ``address``;
    ``STEP_FORWARD`` sends ``address`` on once the step is complete. The caller keeps the memory
    alive and unchanged until this returns.
    """
    cdef char err[256]
    cdef int rc
    cdef size_t n = steps.shape[0]
    if steps.shape[1] != 4:
        raise ValueError(f"steps must have 4 columns, got {steps.shape[1]}")
    if right.engine is not left.engine:
        raise ValueError("the ring's links must belong to one plane")
    if not 0 <= dtype < 10 or not 0 <= op < 4:
        raise ValueError(f"bad dtype code {dtype} or op code {op}")
    cdef const ma_step *p = <const ma_step *>&steps[0, 0] if n else NULL
    cdef ma_engine *e = left._enter()
    err[0] = 0
    try:
        with nogil:
            rc = ma_ring_run(right.l, left.l, p, n, dtype, op, chunk, <int64_t>(timeout * 1e9), err)
        _check(rc, err, "ring collective")
    finally:
        eng_leave(e)
