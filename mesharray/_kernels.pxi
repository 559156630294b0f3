# _kernels: see _core.pyx
#
# nogil elementwise reduction kernels over contiguous numeric buffers, and the
# few atomic primitives the shared-memory collectives synchronise with.
#
# Why raw pointers and not typed memoryviews: a reduction reads N sources at
# once (one per rank's slot of a shared segment) and N is only known at run
# time; a C array of pointers keeps the inner loop free of Python objects.
# The loop is blocked so that the destination block stays in L1 while each
# source streams through it once: dst = s0 op s1, then dst op= s2, ... which is
# exactly the order ``np.add.reduce(np.stack(srcs), axis=0)`` uses, so float
# results match NumPy bit for bit.

from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_ANY_CONTIGUOUS, PyBUF_FORMAT, PyBUF_WRITABLE
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy

cdef extern from *:
    """
    #include <errno.h>
    #include <stddef.h>
    #include <stdint.h>
    #if defined(__linux__)
    #include <sys/uio.h>
    #endif
    /* Copy n bytes between `local` here and `remote` in process `pid` (process_vm_writev
       when `write`, else process_vm_readv), looping over partial transfers. 0 or an errno;
       ENOSYS off Linux. */
    static int _ma_vm_copy(int write, int pid, char *local, uintptr_t remote, size_t n) {
    #if defined(__linux__)
        while (n > 0) {
            struct iovec l, r;
            ssize_t got;
            l.iov_base = local;
            l.iov_len = n;
            r.iov_base = (void *)remote;
            r.iov_len = n;
            got = write ? process_vm_writev(pid, &l, 1, &r, 1, 0) : process_vm_readv(pid, &l, 1, &r, 1, 0);
            if (got < 0) {
                if (errno == EINTR) continue;
                return errno;
            }
            if (got == 0) return EIO;
            local += got;
            remote += (uintptr_t)got;
            n -= (size_t)got;
        }
        return 0;
    #else
        (void)write; (void)pid; (void)local; (void)remote; (void)n;
        return ENOSYS;
    #endif
    }
    """
    int _ma_vm_copy(int write, int pid, char *local, uintptr_t remote, size_t n) nogil

cdef extern from "<sched.h>" nogil:
    int sched_yield()

cdef extern from "<time.h>" nogil:
    ctypedef long time_t
    struct timespec:
        time_t tv_sec
        long tv_nsec
    int clock_gettime(int clk_id, timespec *tp)
    int nanosleep(const timespec *req, timespec *rem)
    enum: CLOCK_MONOTONIC

cdef extern from *:
    """
    static inline long long _ma_load_acquire(const long long *p) {
        return __atomic_load_n(p, __ATOMIC_ACQUIRE);
    }
    static inline void _ma_store_release(long long *p, long long v) {
        __atomic_store_n(p, v, __ATOMIC_RELEASE);
    }
    /* claim the next of the chunks [.., end) of a shared counter: its value, or -1 when none is left */
    static inline long long _ma_claim(long long *p, long long end) {
        long long c = __atomic_load_n(p, __ATOMIC_ACQUIRE);
        while (c < end) {
            if (__atomic_compare_exchange_n(p, &c, c + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
                return c;
        }
        return -1;
    }
    static inline void _ma_add_release(long long *p, long long v) {
        __atomic_fetch_add(p, v, __ATOMIC_RELEASE);
    }
    """
    long long _ma_load_acquire(const long long *p) nogil
    void _ma_store_release(long long *p, long long v) nogil
    long long _ma_claim(long long *p, long long end) nogil
    void _ma_add_release(long long *p, long long v) nogil

ctypedef fused _num_t:
    float
    double
    int8_t
    int16_t
    int32_t
    int64_t
    uint8_t
    uint16_t
    uint32_t
    uint64_t

# operation codes, in the order of REDUCE_OPS
cdef enum:
    _OP_SUM = 0
    _OP_PROD = 1
    _OP_MIN = 2
    _OP_MAX = 3

REDUCE_OPS = ("sum", "prod", "min", "max")
"""The reduction operations the kernels implement."""

_KERNEL_DTYPES = {
    "f": 0, "d": 1, "b": 2, "h": 3, "i": 4, "q": 5, "B": 6, "H": 7, "I": 8, "Q": 9,
}
# 'l'/'L' are 64-bit on LP64 Linux/macOS (the platforms we build for)
_KERNEL_DTYPES["l"] = 5
_KERNEL_DTYPES["L"] = 9
_KERNEL_DTYPES["?"] = -1  # bool: reported as unsupported with a clear error

_KERNEL_DTYPE_NAMES = ("float32", "float64", "int8", "int16", "int32", "int64",
                       "uint8", "uint16", "uint32", "uint64")
cdef dict _KERNEL_DTYPE_CODES = {name: i for i, name in enumerate(_KERNEL_DTYPE_NAMES)}


cdef int _kernel_dtype_code(str kdt) except -1:
    # a kernel dtype's index in _KERNEL_DTYPE_NAMES (the reduction kernels' dtype code)
    code = _KERNEL_DTYPE_CODES.get(kdt)
    if code is None:
        raise TypeError(f"reduction kernels support {', '.join(_KERNEL_DTYPE_NAMES)}; got {kdt!r}")
    return code

DEF _BLOCK = 2048


cdef inline void _combine(_num_t* dst, const _num_t* src, Py_ssize_t n, int op) noexcept nogil:
    cdef Py_ssize_t i
    cdef _num_t a, b
    if op == _OP_SUM:
        for i in range(n):
            dst[i] = dst[i] + src[i]
    elif op == _OP_PROD:
        for i in range(n):
            dst[i] = dst[i] * src[i]
    elif op == _OP_MIN:
        if _num_t is float or _num_t is double:
            for i in range(n):
                a = dst[i]
                b = src[i]
                # a != a propagates NaN as np.minimum does
                dst[i] = a if (a < b or a != a) else b
        else:
            for i in range(n):
                a = dst[i]
                b = src[i]
                dst[i] = a if a < b else b
    else:
        if _num_t is float or _num_t is double:
            for i in range(n):
                a = dst[i]
                b = src[i]
                dst[i] = a if (a > b or a != a) else b
        else:
            for i in range(n):
                a = dst[i]
                b = src[i]
                dst[i] = a if a > b else b


cdef void _reduce_typed(_num_t* dst, _num_t** srcs, int nsrc, Py_ssize_t n, int op) noexcept nogil:
    cdef Py_ssize_t start, m
    cdef int k
    start = 0
    while start < n:
        m = n - start
        if m > _BLOCK:
            m = _BLOCK
        if dst + start != srcs[0] + start:
            memcpy(dst + start, srcs[0] + start, m * sizeof(_num_t))
        for k in range(1, nsrc):
            _combine(dst + start, srcs[k] + start, m, op)
        start += m


cdef void _reduce_dispatch(int code, void* dst, void** srcs, int nsrc, Py_ssize_t n, int op) noexcept nogil:
    if code == 0:
        _reduce_typed[float](<float*>dst, <float**>srcs, nsrc, n, op)
    elif code == 1:
        _reduce_typed[double](<double*>dst, <double**>srcs, nsrc, n, op)
    elif code == 2:
        _reduce_typed[int8_t](<int8_t*>dst, <int8_t**>srcs, nsrc, n, op)
    elif code == 3:
        _reduce_typed[int16_t](<int16_t*>dst, <int16_t**>srcs, nsrc, n, op)
    elif code == 4:
        _reduce_typed[int32_t](<int32_t*>dst, <int32_t**>srcs, nsrc, n, op)
    elif code == 5:
        _reduce_typed[int64_t](<int64_t*>dst, <int64_t**>srcs, nsrc, n, op)
    elif code == 6:
        _reduce_typed[uint8_t](<uint8_t*>dst, <uint8_t**>srcs, nsrc, n, op)
    elif code == 7:
        _reduce_typed[uint16_t](<uint16_t*>dst, <uint16_t**>srcs, nsrc, n, op)
    elif code == 8:
        _reduce_typed[uint32_t](<uint32_t*>dst, <uint32_t**>srcs, nsrc, n, op)
    else:
        _reduce_typed[uint64_t](<uint64_t*>dst, <uint64_t**>srcs, nsrc, n, op)


cdef int _op_code(str op) except -1:
    if op == "sum":
        return _OP_SUM
    if op == "prod":
        return _OP_PROD
    if op == "min":
        return _OP_MIN
    if op == "max":
        return _OP_MAX
    raise ValueError(f"unknown reduction op {op!r}; expected one of {REDUCE_OPS}")


cdef int _format_code(Py_buffer* view) except -2:
    fmt = (view.format or b"B").decode("ascii").lstrip("@=<")
    code = _KERNEL_DTYPES.get(fmt)
    if code is None or code < 0 or len(fmt) != 1:
        raise TypeError(
            f"reduction kernels support {', '.join(_KERNEL_DTYPE_NAMES)}; got buffer format {fmt!r}"
        )
    return code


def reduce_buffers(out, inputs, str op="sum"):
    """Reduce contiguous buffers elementwise into ``out``: ``out = inputs[0] op inputs[1] op ...``.

    The loop runs without the GIL. ``out`` may be one of the inputs (in-place).

    Parameters
    ----------
    out : writable buffer
        C- or F-contiguous destination (a NumPy array, a ``memoryview`` of shared
        memory, ...), with the same format and size as every input.
    inputs : sequence of buffers
        One or more contiguous sources of the same format and size.
    op : {"sum", "prod", "min", "max"}
        ``min``/``max`` propagate NaN as ``np.minimum``/``np.maximum`` do.

    Returns
    -------
    out

    Examples
    --------
    >>> import numpy as np
    >>> from mesharray._core import reduce_buffers
    >>> a, b = np.arange(4.0), np.ones(4)
    >>> reduce_buffers(np.empty(4), [a, b, b], "sum").tolist()
    [2.0, 3.0, 4.0, 5.0]
    """
    cdef int opc = _op_code(op)
    cdef Py_buffer dview
    cdef Py_buffer* views = NULL
    cdef void** ptrs = NULL
    cdef int nsrc, k, got = 0, code
    cdef Py_ssize_t n
    srcs = list(inputs)
    nsrc = len(srcs)
    if nsrc == 0:
        raise ValueError("reduce_buffers needs at least one input buffer")
    PyObject_GetBuffer(out, &dview, PyBUF_ANY_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE)
    try:
        code = _format_code(&dview)
        n = dview.len // dview.itemsize
        views = <Py_buffer*>malloc(nsrc * sizeof(Py_buffer))
        ptrs = <void**>malloc(nsrc * sizeof(void*))
        if views == NULL or ptrs == NULL:
            raise MemoryError()
        for k in range(nsrc):
            PyObject_GetBuffer(srcs[k], &views[k], PyBUF_ANY_CONTIGUOUS | PyBUF_FORMAT)
            got += 1
            if _format_code(&views[k]) != code:
                raise TypeError(
                    f"input {k} has buffer format {views[k].format.decode()!r}, "
                    f"the output has {dview.format.decode()!r}"
                )
            if views[k].len != dview.len:
                raise ValueError(
                    f"input {k} has {views[k].len} bytes, the output has {dview.len}"
                )
            ptrs[k] = views[k].buf
        with nogil:
            _reduce_dispatch(code, dview.buf, ptrs, nsrc, n, opc)
    finally:
        for k in range(got):
            PyBuffer_Release(&views[k])
        free(views)
        free(ptrs)
        PyBuffer_Release(&dview)
    return out


def reduce_addresses(uintptr_t out, srcs, Py_ssize_t count, str dtype, str op="sum"):
    """Like :func:`reduce_buffers` over raw addresses (for memory a caller has pinned).

    The caller guarantees that ``out`` and every address in ``srcs`` point to at
    least ``count`` contiguous elements of ``dtype`` that stay alive for the call.
    Used by the shared-memory collectives, whose slots live in one mapping.
    """
    cdef int opc = _op_code(op)
    cdef int nsrc = len(srcs), k, code
    cdef void** ptrs
    if dtype not in _KERNEL_DTYPE_NAMES:
        raise TypeError(f"reduction kernels support {', '.join(_KERNEL_DTYPE_NAMES)}; got {dtype!r}")
    if nsrc == 0:
        raise ValueError("reduce_addresses needs at least one source address")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    code = _KERNEL_DTYPE_NAMES.index(dtype)
    ptrs = <void**>malloc(nsrc * sizeof(void*))
    if ptrs == NULL:
        raise MemoryError()
    try:
        for k in range(nsrc):
            ptrs[k] = <void*><uintptr_t>srcs[k]
        with nogil:
            _reduce_dispatch(code, <void*>out, ptrs, nsrc, count, opc)
    finally:
        free(ptrs)


# --- atomics for the shared-memory collectives --------------------------------

cdef inline double _now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


# How a waiter that has spun 64 times waits on: it yields its core for the first _spin_s
# seconds of the wait (a peer that is about to arrive is seen at once), then naps, each nap
# an eighth of the time waited so far (20 us to 1 ms). A peer that is far behind (a generator
# waiting for a trainer's whole backward pass) then costs no core, while a wait is lengthened
# by at most an eighth: on a machine with fewer cores than processes, a spinner that only
# yields still takes its share of a core from the peers it waits for.
cdef double _spin_s = 50e-6


def set_spin(double seconds):
    """Set how long a waiter yields before it naps (``MESHARRAY_SPIN_US``); the old value."""
    global _spin_s
    old = _spin_s
    _spin_s = seconds
    return old


cdef inline bint _relax(double* since, double deadline) noexcept nogil:
    # one pause of a waiter past its first 64 spins; True once ``deadline`` passed
    cdef double now = _now(), waited, nap
    cdef timespec ts
    if since[0] == 0.0:
        since[0] = now
    waited = now - since[0]
    if waited < _spin_s:
        sched_yield()
    else:
        nap = waited * 0.125
        if nap < 20e-6:
            nap = 20e-6
        elif nap > 1e-3:
            nap = 1e-3
        if nap > deadline - now:
            nap = deadline - now
        if nap > 0:
            ts.tv_sec = 0
            ts.tv_nsec = <long>(nap * 1e9)
            nanosleep(&ts, NULL)
    return now > deadline


def atomic_load(uintptr_t addr):
    """Load the 8-byte integer at ``addr`` with acquire ordering."""
    return _ma_load_acquire(<long long*>addr)


def atomic_store(uintptr_t addr, long long value):
    """Store ``value`` into the 8-byte integer at ``addr`` with release ordering.

    Everything this process wrote before (slot data) is visible to a process
    that then reads the flag with :func:`atomic_load` / :func:`wait_flags`.
    """
    _ma_store_release(<long long*>addr, value)


def wait_flags(uintptr_t base, Py_ssize_t stride, indices, long long target, double seconds):
    """Spin (then yield) until every flag ``base + i*stride`` for ``i`` in ``indices`` is ``>= target``.

    Waits at most ``seconds`` without the GIL, so that the caller regains control
    regularly to check whether its peers are still alive (a dead peer never
    hangs its survivors).

    Returns
    -------
    int
        -1 when every flag reached ``target``; else the first index still short.
    """
    cdef Py_ssize_t n = len(indices), k, spins = 0
    cdef Py_ssize_t* idx = <Py_ssize_t*>malloc((n if n > 0 else 1) * sizeof(Py_ssize_t))
    cdef Py_ssize_t pending = -1
    cdef double deadline, since = 0.0
    if idx == NULL:
        raise MemoryError()
    try:
        for k in range(n):
            idx[k] = indices[k]
        with nogil:
            deadline = _now() + seconds
            k = 0
            while k < n:
                if _ma_load_acquire(<long long*>(base + idx[k] * stride)) >= target:
                    k += 1
                    continue
                spins += 1
                # then give the core to the peer we wait for (ranks may outnumber cores)
                if spins > 64 and _relax(&since, deadline):
                    pending = idx[k]
                    break
        return pending
    finally:
        free(idx)


def buffer_address(obj, bint writable=False):
    """Address and byte length of a contiguous buffer: ``(address, nbytes)``.

    Much cheaper than ``ndarray.ctypes.data``; the caller keeps ``obj`` alive
    while it uses the address.
    """
    cdef Py_buffer view
    cdef int flags = PyBUF_ANY_CONTIGUOUS | (PyBUF_WRITABLE if writable else 0)
    PyObject_GetBuffer(obj, &view, flags)
    try:
        return <uintptr_t>view.buf, view.len
    finally:
        PyBuffer_Release(&view)


def copy_bytes(uintptr_t dst, uintptr_t src, Py_ssize_t nbytes):
    """``memcpy(dst, src, nbytes)`` between raw addresses, without the GIL for large copies."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if nbytes < 65536:
        memcpy(<void*>dst, <const void*>src, nbytes)
    else:
        with nogil:
            memcpy(<void*>dst, <const void*>src, nbytes)


# --- single-copy reductions between processes (cross-memory attach) -----------


def vm_copy(bint write, int pid, uintptr_t local, uintptr_t remote, Py_ssize_t nbytes):
    """Copy ``nbytes`` between ``local`` here and ``remote`` in process ``pid``, without the GIL.

    ``process_vm_writev`` (local -> remote) when ``write``, else
    ``process_vm_readv``; no shared mapping and no code of ``pid`` runs.

    Returns
    -------
    int
        0, or the ``errno`` of the failure (``ENOSYS`` off Linux): the caller
        decides what a refusal means, this kernel has no policy.
    """
    cdef int err
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    with nogil:
        err = _ma_vm_copy(write, pid, <char*>local, remote, <size_t>nbytes)
    return err


def reduce_remote(uintptr_t out, srcs, pids, dests, Py_ssize_t count, str dtype, str op,
                  uintptr_t scratch, Py_ssize_t chunk, uintptr_t counters=0, long long base=0,
                  long long mark=1):
    """Reduce elements read from several processes into ``out``, pushing the result back out.

    The ``count`` elements are cut into chunks of ``chunk`` bytes. Without
    ``counters`` this call does them all. With it, ``counters`` is the
    address of three shared 8-byte words, 64 bytes apart: *claimed* and
    *finished*, which start at ``base``, and *fault*. The call takes chunk
    after chunk by raising *claimed* (compare and swap, so it never passes
    ``base`` + the number of chunks) and raises *finished* (release) once a
    chunk is reduced and pushed. Every member calling it with the same
    counters shares the work as it comes: a member that got no core, or hit
    costlier pages (pages that are not huge cost twice as much to attach),
    simply does fewer chunks. A chunk that fails stores ``mark`` into
    *fault* and is counted as finished all the same, so that nobody waits
    for it forever; the chunks this call takes after a failure are counted,
    not done. Source ``j`` lies at address ``srcs[j]`` of process
    ``pids[j]`` (0: this process). Chunk by chunk, without the GIL: the remote sources are read
    into ``scratch`` (``process_vm_readv``, one copy), reduced in the order
    of ``srcs`` (``out = srcs[0] op srcs[1] op ...``, so floats match NumPy bit
    for bit), and the reduced chunk, still in cache, is written to
    ``dests[j]`` of every remote process whose ``dests[j]`` is not 0
    (``process_vm_writev``). A chunk is small enough for its sources and its
    result to stay in cache between the read, the reduction and the write.

    The caller guarantees the addresses span ``count`` elements of ``dtype``
    and stay valid for the call, and that ``scratch`` holds ``len(srcs) *
    chunk`` bytes. A local source may be ``out`` itself (in place).

    Returns
    -------
    tuple of int
        ``(-1, 0)`` when done, else ``(j, errno)``: the first member whose
        memory could not be read or written, and why. Without ``counters``
        the chunks before the failing one are done and the rest not; with
        them, the failure is in *fault* for the peers to see.
    """
    cdef int opc = _op_code(op)
    cdef int nsrc = len(srcs), j, code, err = 0, bad = -1
    cdef Py_ssize_t isz, step, start, m, cb
    cdef long long nchunks, c
    cdef long long* claim = <long long*>counters
    cdef long long* finished = <long long*>(counters + 64)
    cdef long long* fault = <long long*>(counters + 128)
    cdef void** ptrs = NULL
    cdef uintptr_t* rsrc = NULL
    cdef uintptr_t* rdst = NULL
    cdef int* rpid = NULL
    cdef char* tmp
    cdef uintptr_t p, o
    if dtype not in _KERNEL_DTYPE_NAMES:
        raise TypeError(f"reduction kernels support {', '.join(_KERNEL_DTYPE_NAMES)}; got {dtype!r}")
    if nsrc == 0:
        raise ValueError("reduce_remote needs at least one source address")
    if len(pids) != nsrc or len(dests) != nsrc:
        raise ValueError(f"reduce_remote needs one pid and one destination per source; got {nsrc} sources, "
                         f"{len(pids)} pids, {len(dests)} destinations")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    code = _KERNEL_DTYPE_NAMES.index(dtype)
    isz = (4, 8, 1, 2, 4, 8, 1, 2, 4, 8)[code]
    if chunk < isz:
        raise ValueError(f"chunk must be >= the item size {isz}, got {chunk}")
    step = chunk // isz
    cb = step * isz
    ptrs = <void**>malloc(nsrc * sizeof(void*))
    rsrc = <uintptr_t*>malloc(nsrc * sizeof(uintptr_t))
    rdst = <uintptr_t*>malloc(nsrc * sizeof(uintptr_t))
    rpid = <int*>malloc(nsrc * sizeof(int))
    try:
        if ptrs == NULL or rsrc == NULL or rdst == NULL or rpid == NULL:
            raise MemoryError()
        for j in range(nsrc):
            rsrc[j] = srcs[j]
            rdst[j] = dests[j]
            rpid[j] = pids[j]
        nchunks = (count + step - 1) // step
        c = -1
        with nogil:
            while True:
                if counters:
                    c = _ma_claim(claim, base + nchunks)
                    if c < 0:
                        break
                    c -= base
                else:
                    c += 1
                    if c >= nchunks:
                        break
                start = c * step
                if bad >= 0:
                    # this member failed already: the chunks it takes are counted, not done
                    _ma_add_release(finished, 1)
                    continue
                m = count - start
                if m > step:
                    m = step
                o = out + start * isz
                for j in range(nsrc):
                    tmp = <char*>scratch + j * cb
                    p = rsrc[j] + start * isz
                    if rpid[j] != 0:
                        err = _ma_vm_copy(0, rpid[j], tmp, p, m * isz)
                        if err != 0:
                            bad = j
                            break
                        ptrs[j] = tmp
                    elif j > 0 and p == o:
                        # in place: the kernel first copies source 0 over out, which is this source
                        memcpy(tmp, <void*>p, m * isz)
                        ptrs[j] = tmp
                    else:
                        ptrs[j] = <void*>p
                if bad < 0:
                    _reduce_dispatch(code, <void*>o, ptrs, nsrc, m, opc)
                    for j in range(nsrc):
                        if rpid[j] != 0 and rdst[j] != 0:
                            err = _ma_vm_copy(1, rpid[j], <char*>o, rdst[j] + start * isz, m * isz)
                            if err != 0:
                                bad = j
                                break
                if counters:
                    if bad >= 0:
                        _ma_store_release(fault, mark)
                    _ma_add_release(finished, 1)
                elif bad >= 0:
                    break
        if bad >= 0:
            return (bad, err)
        return (-1, 0)
    finally:
        free(ptrs)
        free(rsrc)
        free(rdst)
        free(rpid)


# --- one small round of a shared-memory allreduce, in one call --------------------
#
# What ShmCollective._reduce_rounds does for a message that fits one round below its
# small-message size (every member reduces everything itself), with the same flags in
# the same order, so members on this path and on the Python one interoperate. A tiny
# reduction in a loop (a loss, a norm) spent most of its collective time in the Python
# of those steps (~15 calls a round); here they are one call without the GIL.

cdef inline Py_ssize_t _wait_all(uintptr_t base, Py_ssize_t n, long long target, double seconds) noexcept nogil:
    # the flags base + j*64 of j in 0..n-1: -1 once all reached target, else the first
    # index still short after ``seconds`` (the caller checks that member is alive)
    cdef Py_ssize_t j = 0, spins = 0
    cdef double deadline = _now() + seconds, since = 0.0
    while j < n:
        if _ma_load_acquire(<long long*>(base + j * 64)) >= target:
            j += 1
            continue
        spins += 1
        if spins > 64 and _relax(&since, deadline):
            return j
    return -1


cdef Py_ssize_t _small_round(uintptr_t flags, Py_ssize_t size, Py_ssize_t rank, long long k, uintptr_t src,
                             Py_ssize_t nbytes, uintptr_t dst, void** ptrs, Py_ssize_t count, int code, int opc,
                             bint failed, int start, double seconds, uint8_t* bad_out) noexcept nogil:
    cdef uintptr_t arrive = flags, done = flags + 2 * size * 64
    cdef Py_ssize_t j, r
    cdef int bad = 0
    cdef uint8_t b
    if start <= 0 and k > 1:
        r = _wait_all(done, size, k - 1, seconds)
        if r >= 0:
            return -(1 + r)
    if start <= 1:
        _ma_store_release(<long long*>(arrive + rank * 64 + 8), k if failed else 0)
        if not failed:
            memcpy(ptrs[rank], <const void*>src, nbytes)
        _ma_store_release(<long long*>(arrive + rank * 64), k)
        r = _wait_all(arrive, size, k, seconds)
        if r >= 0:
            return -(1 + size + r)
    # who failed is read before "done": once it is set, a member may start round k + 1
    # and overwrite its status word
    for j in range(size):
        b = _ma_load_acquire(<long long*>(arrive + j * 64 + 8)) == k
        bad_out[j] = b
        if b:
            bad = 1
    if not bad and dst != 0:
        _reduce_dispatch(code, <void*>dst, ptrs, <int>size, count, opc)
    _ma_store_release(<long long*>(done + rank * 64), k)
    return bad


def small_round(uintptr_t flags, Py_ssize_t size, Py_ssize_t rank, long long k, uintptr_t src,
                Py_ssize_t nbytes, uintptr_t dst, slots, Py_ssize_t count, str dtype, str op,
                bint failed, int start, double seconds, uint8_t[::1] bad not None):
    """Round ``k`` of a small allreduce among the ``size`` members of a shared-memory group.

    ``flags`` is the address of the group's first flag line (64-byte lines: arrival
    flags of members 0..size-1, then "reduced", then "done"; a member's status word
    follows its arrival flag), ``slots`` the members' slot addresses. Steps: wait
    until every member is done with round ``k - 1``; publish this member's status
    (``failed``) and, unless failed, copy ``nbytes`` from ``src`` into its slot; set
    its arrival flag; wait for every arrival; unless a member's input failed, reduce
    the ``count`` elements of every slot into ``dst`` (0: no output); set "done".

    ``start``: 0 from the beginning, 1 after the wait for round ``k - 1``, 2 after the
    wait for the arrivals (a caller resuming after a wait it finished itself).
    ``bad`` (``size`` bytes) gets 1 for each member whose input failed this round.

    Returns
    -------
    int
        0: reduced; 1: some member's input failed (nothing reduced, ``bad`` says who, "done" set);
        ``-(1 + j)``: member ``j`` was not done with round ``k - 1`` after ``seconds``;
        ``-(1 + size + j)``: member ``j`` had not arrived after ``seconds`` (resume with
        ``start`` 1 or 2 once the wait is over).
    """
    cdef int opc = _op_code(op)
    cdef int code
    cdef Py_ssize_t j, r
    cdef void* stack_ptrs[64]
    cdef void** ptrs = stack_ptrs
    if dtype not in _KERNEL_DTYPE_NAMES:
        raise TypeError(f"reduction kernels support {', '.join(_KERNEL_DTYPE_NAMES)}; got {dtype!r}")
    if not 0 <= rank < size or len(slots) != size or bad.shape[0] != size:
        raise ValueError(f"rank {rank}, {len(slots)} slots and {bad.shape[0]} status bytes do not fit a group "
                         f"of size {size}")
    code = _KERNEL_DTYPE_NAMES.index(dtype)
    if size > 64:
        ptrs = <void**>malloc(size * sizeof(void*))
        if ptrs == NULL:
            raise MemoryError()
    try:
        for j in range(size):
            ptrs[j] = <void*><uintptr_t>slots[j]
        with nogil:
            r = _small_round(flags, size, rank, k, src, nbytes, dst, ptrs, count, code, opc, failed, start, seconds,
                             &bad[0])
        return r
    finally:
        if ptrs != stack_ptrs:
            free(ptrs)


# --- a small allreduce round for groups whose members outnumber the cores ---------
#
# Spinning (even with sched_yield) is how the rounds above wait: right when each member
# has a core, wrong when sixty-four members share two, where the spinners take the cores
# the members they wait for need. A *host round* has one barrier, and its waiters sleep
# on a futex: every member copies its input into its slot and adds one to a shared
# counter; the member whose addition completes the round (the last to arrive) reduces
# every slot into the result area and wakes the others, which copy the result out. With
# ``cross`` (a group that spans hosts) the last arriver publishes the host's partial
# result instead, and wakes the host's leader, which combines it with the other hosts'
# (Python: collectives.tree) and publishes the final one. The slots of round r+1 are
# written only by members done with round r (they saw its result), and the result area
# only by the last arriver of round r+1 (everyone has arrived, so has read round r's):
# no second barrier.

cdef extern from *:
    """
    #if defined(__linux__)
    #include <linux/futex.h>
    #include <sys/syscall.h>
    #include <unistd.h>
    #endif
    /* Sleep while the low 32 bits of the word at p equal those of v, at most `seconds`:
       a futex on Linux (the word lies in shared memory: shared between processes),
       a 50 us sleep elsewhere or without `futex`. */
    static void _ma_sleep_on(long long *p, long long v, double seconds, int futex) {
        struct timespec ts;
        if (seconds <= 0) return;
    #if defined(__linux__)
        if (futex) {
            ts.tv_sec = (time_t)seconds;
            ts.tv_nsec = (long)((seconds - (double)ts.tv_sec) * 1e9);
            syscall(SYS_futex, (int *)p, FUTEX_WAIT, (int)v, &ts, NULL, 0);
            return;
        }
    #endif
        (void)p; (void)v; (void)futex;
        ts.tv_sec = 0;
        ts.tv_nsec = seconds < 50e-6 ? (long)(seconds * 1e9) : 50000;
        nanosleep(&ts, NULL);
    }
    static void _ma_wake_all(long long *p, int futex) {
    #if defined(__linux__)
        if (futex) syscall(SYS_futex, (int *)p, FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0);
    #endif
        (void)p; (void)futex;
    }
    static inline long long _ma_fetch_add(long long *p, long long v) {
        return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL);
    }
    """
    void _ma_sleep_on(long long *p, long long v, double seconds, int futex) nogil
    void _ma_wake_all(long long *p, int futex) nogil
    long long _ma_fetch_add(long long *p, long long v) nogil


cdef inline int _sleep_until(long long* p, long long target, double seconds, bint futex) noexcept nogil:
    # until *p >= target: a few loads, then sleep on the word; 0 once there, -1 after ``seconds``
    cdef double deadline = _now() + seconds
    cdef double left
    cdef long long v
    cdef int spins = 0
    while True:
        v = _ma_load_acquire(p)
        if v >= target:
            return 0
        if spins < 16:
            spins += 1
            continue
        left = deadline - _now()
        if left <= 0:
            return -1
        _ma_sleep_on(p, v, left, futex)


def publish_word(uintptr_t addr, long long value, bint futex):
    """Store ``value`` at the 8-byte word ``addr`` (release) and wake every process sleeping on it."""
    _ma_store_release(<long long*>addr, value)
    _ma_wake_all(<long long*>addr, futex)


def fetch_add(uintptr_t addr, long long value):
    """Add ``value`` to the 8-byte word at ``addr`` (one atomic read-modify-write); return the old value."""
    return _ma_fetch_add(<long long*>addr, value)


def wait_word(uintptr_t addr, long long target, double seconds, bint futex):
    """Sleep without the GIL until the 8-byte word at ``addr`` is ``>= target`` (0), or for
    ``seconds`` (-1); :func:`publish_word` wakes the sleepers. With ``futex`` a sleep on the word
    (Linux), else naps of 50 us."""
    cdef int code
    with nogil:
        code = _sleep_until(<long long*>addr, target, seconds, futex)
    return code


cdef int _host_round(uintptr_t ctl, Py_ssize_t size, Py_ssize_t rank, long long r, uintptr_t src,
                     Py_ssize_t nbytes, uintptr_t dst, void** ptrs, uintptr_t result, Py_ssize_t capacity,
                     Py_ssize_t count, int code, int opc, bint failed, int stage, bint cross, bint leader,
                     double seconds, bint futex) noexcept nogil:
    cdef Py_ssize_t j, nbad
    cdef long long old
    cdef long long* cnt = <long long*>ctl
    cdef long long* hgen = <long long*>(ctl + 64)
    cdef long long* gen = <long long*>(ctl + 128)
    cdef long long* nbad_word = <long long*>(ctl + 192)
    cdef uintptr_t lines = ctl + 256
    cdef uint32_t* idx
    if stage <= 0:
        _ma_store_release(<long long*>(lines + rank * 64 + 8), r if failed else 0)
        if not failed:
            memcpy(ptrs[rank], <const void*>src, nbytes)
        _ma_store_release(<long long*>(lines + rank * 64), r)
        old = _ma_fetch_add(cnt, 1)
        if old + 1 == r * size:  # the last to arrive: reduce and publish
            nbad = 0
            idx = <uint32_t*>result
            for j in range(size):
                if _ma_load_acquire(<long long*>(lines + j * 64 + 8)) == r:
                    if (nbad + 1) * 4 <= capacity:
                        idx[nbad] = <uint32_t>j
                    nbad += 1
            _ma_store_release(nbad_word, nbad)
            if nbad == 0 and count > 0:
                _reduce_dispatch(code, <void*>result, ptrs, <int>size, count, opc)
            if cross:
                _ma_store_release(hgen, r)
                _ma_wake_all(hgen, futex)
            else:
                _ma_store_release(gen, r)
                _ma_wake_all(gen, futex)
    if cross and leader:
        if _sleep_until(hgen, r, seconds, futex) < 0:
            return -1
        return 2
    if _sleep_until(gen, r, seconds, futex) < 0:
        return -1
    if _ma_load_acquire(nbad_word) != 0:
        return 1
    if dst != 0:
        memcpy(<void*>dst, <const void*>result, nbytes)
    return 0


def host_round(uintptr_t ctl, Py_ssize_t size, Py_ssize_t rank, long long r, uintptr_t src, Py_ssize_t nbytes,
               uintptr_t dst, slots, uintptr_t result, Py_ssize_t capacity, Py_ssize_t count, str dtype, str op,
               bint failed, int stage, bint cross, bint leader, double seconds, bint futex):
    """Host round ``r`` of a small allreduce among the ``size`` members of a shared-memory group.

    ``ctl``: the round's control words, 64 bytes apart: the arrival counter, the
    host partial's round, the result's round, the number of failed inputs; then one
    line per member (its last round, its status). ``slots``: the members' slot
    addresses; ``result``: the result area (``capacity`` bytes). The member copies
    ``nbytes`` from ``src`` into its slot (unless ``failed``) and arrives; the last
    to arrive reduces the ``count`` elements of every slot into the result area (or,
    when an input failed, writes the failed members' indices there as uint32) and
    publishes: the host partial with ``cross``, the result without. ``stage`` 1
    resumes after the arrival (a wait that timed out).

    Returns
    -------
    int
        0: the result is in ``dst``; 1: inputs failed (their count is the fourth
        control word, their indices at ``result``); 2 (``cross`` and ``leader``): the
        host's partial (or its failures) is in the result area, to be combined with
        the other hosts' and published (:func:`publish_word` on the third word);
        -1: not there after ``seconds`` (resume with ``stage`` 1 once the peers are
        known alive).
    """
    cdef int opc = _op_code(op)
    cdef int code, ret
    cdef Py_ssize_t j
    cdef void* stack_ptrs[64]
    cdef void** ptrs = stack_ptrs
    if dtype not in _KERNEL_DTYPE_NAMES:
        raise TypeError(f"reduction kernels support {', '.join(_KERNEL_DTYPE_NAMES)}; got {dtype!r}")
    if not 0 <= rank < size or len(slots) != size or nbytes > capacity:
        raise ValueError(f"rank {rank}, {len(slots)} slots and {nbytes} bytes do not fit a group of size {size} "
                         f"with {capacity}-byte slots")
    code = _KERNEL_DTYPE_NAMES.index(dtype)
    if size > 64:
        ptrs = <void**>malloc(size * sizeof(void*))
        if ptrs == NULL:
            raise MemoryError()
    try:
        for j in range(size):
            ptrs[j] = <void*><uintptr_t>slots[j]
        with nogil:
            ret = _host_round(ctl, size, rank, r, src, nbytes, dst, ptrs, result, capacity, count, code, opc, failed,
                              stage, cross, leader, seconds, futex)
        return ret
    finally:
        if ptrs != stack_ptrs:
            free(ptrs)
