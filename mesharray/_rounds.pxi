# _rounds: see _core.pyx
#
# A shared-memory group's host rounds (``_host_round`` in _kernels.pxi: the small
# allreduce of a host's many members, who sleep instead of spinning) with the group's
# per-round state in C fields. ``HostRounds`` is the base class of
# ``mesharray.collectives.shm.ShmCollective``; the Python keeps everything else (the
# segment, the join, the slot rounds, every error and its message) and the rare
# branches of a round (a wait that ran past its poll, a failed input, a broken
# group), which these methods call back.
#
# Why compiled: every member of a host takes part in every small reduction of its
# mesh (a 1-element sum over 1,024 ranks is 1,024 of them). As Python, a member's
# arrival and its settling of the round before were ~270 bytecodes, most of them
# lookups of the group's attributes in instance dictionaries that the host's other
# members had pushed out of the caches (docs/internals.md, "Many hosts": the host rounds).


from time import monotonic as _monotonic


cdef class HostRounds:
    """The host rounds of a shared-memory group, their state in C fields (the base of
    :class:`~mesharray.collectives.shm.ShmCollective`, which sets the fields).

    Fields (attributes to Python): ``rank``, ``size``, ``capacity`` (bytes per
    slot), ``timeout``; ``_seq`` (the group's operations so far), ``_hr`` (its host
    rounds), ``_last_host`` (the ``_seq`` of this member's last host round);
    ``_hctl`` (the round's control words), ``_res_addr`` (the result area),
    ``_done_at`` (this member's done flag), ``_slot_addr`` (the members' slot
    addresses, a list); ``_closed``, ``_broken``; ``_pending`` (a round left before
    its result was in), ``_settling`` (the lock of settling it); ``_futex``;
    ``_host_poll`` and ``_host_all`` (how long a sleeper waits before it checks on
    its peers, and every how many checks it checks them all).

    The subclass provides ``_begin(what)`` (raises the group's error),
    ``_wait_round(k)`` (a slot round ``k`` before: every member done with it),
    ``_check_host(r, everyone, deadline)`` and ``_host_failed_round(k)`` (the end of
    a round whose inputs failed: ``(1, failed member indices)``, or raises the
    leader's error).
    """

    cdef public Py_ssize_t rank, size, capacity
    cdef public double timeout, _host_poll
    cdef public long _host_all
    cdef public long long _seq, _hr, _last_host
    cdef public uintptr_t _hctl, _res_addr, _done_at
    cdef public bint _closed, _futex
    cdef public object _broken, _pending, _slot_addr
    cdef object _lock, _lock_acquire, _lock_release, _lock_locked  # (_settling and its bound methods)
    cdef void** _ptrs  # _slot_addr as C pointers (built once per list)
    cdef object _ptrs_of

    @property
    def _settling(self):
        return self._lock

    @_settling.setter
    def _settling(self, lock):
        # its methods looked up once: settle runs on every small operation of a member
        self._lock = lock
        self._lock_acquire, self._lock_release, self._lock_locked = lock.acquire, lock.release, lock.locked

    def __dealloc__(self):
        free(self._ptrs)

    cdef void** _slot_ptrs(self) except NULL:
        cdef list addrs = self._slot_addr
        cdef Py_ssize_t j, n = len(addrs)
        if self._ptrs != NULL and self._ptrs_of is addrs:
            return self._ptrs
        if n != self.size:
            raise ValueError(f"rank {self.rank} and {n} slots do not fit a group of size {self.size}")
        free(self._ptrs)
        self._ptrs = <void**>malloc(max(n, 1) * sizeof(void*))
        if self._ptrs == NULL:
            raise MemoryError()
        for j in range(n):
            self._ptrs[j] = <void*><uintptr_t>addrs[j]
        self._ptrs_of = addrs
        return self._ptrs

    cdef int _round(self, long long r, uintptr_t src, Py_ssize_t nbytes, uintptr_t dst, Py_ssize_t count,
                    int dcode, int opc, bint failed, int stage, bint cross, bint leader, double wait) except -2:
        # one call of _host_round: without the GIL when it may sleep
        cdef void** ptrs = self._slot_ptrs()
        cdef uintptr_t ctl = self._hctl, res = self._res_addr
        cdef Py_ssize_t size = self.size, rank = self.rank, cap = self.capacity
        cdef bint futex = self._futex
        cdef int code
        if wait <= 0.0:
            return _host_round(ctl, size, rank, r, src, nbytes, dst, ptrs, res, cap, count, dcode, opc, failed,
                               stage, cross, leader, 0.0, futex)
        with nogil:
            code = _host_round(ctl, size, rank, r, src, nbytes, dst, ptrs, res, cap, count, dcode, opc, failed,
                               stage, cross, leader, wait, futex)
        return code

    cdef tuple _done_round(self, int code, long long k):
        # the end of host round k (the group's sequence number) that returned code >= 0
        if code == 1:
            return self._host_failed_round(k)
        self._last_host = k
        if code != 2:
            _ma_store_release(<long long*>self._done_at, k)  # (for a slot round that may come next)
        return code, []

    def _host_round(self, send, out, str op, str kdt, bint failed, bint cross=False, bint leader=False,
                    lazy=None):
        """One host round: ``(code, failed member indices)``.

        Code 0: the result is in ``out``; 1: inputs failed (their indices); 2
        (``cross`` and ``leader``): the host's partial result is in the result
        area (``host_partial``), and this member must ``host_publish`` the
        group's; -1 (``lazy``, not a leader of ``cross``): the member arrived and
        the result is not in yet, the round is pending (:meth:`settle`, which
        hands ``lazy = (out, op, done, finish)``'s ``done`` the outcome
        ``finish(out, op, code, bad)``, which must be ``[]`` for code 0 and an op
        other than ``"mean"``: it is not called then). ``send`` C-contiguous, of at most
        ``small_bytes`` bytes; ``kdt`` its kernel dtype.
        """
        return self._arrive(send, out, op, kdt, failed, cross, leader, lazy)

    cdef tuple _arrive(self, send, out, str op, str kdt, bint failed, bint cross, bint leader, lazy):
        cdef Py_buffer view
        cdef uintptr_t src = 0, dst = 0
        cdef Py_ssize_t nb = 0, count = 0
        cdef long long k, r
        cdef int code, stage = 0, dcode, opc
        cdef long polls = 0
        cdef double deadline
        dcode = _kernel_dtype_code(kdt)
        kop = "sum" if op == "mean" else op
        opc = _op_code(kop)
        if not failed:
            PyObject_GetBuffer(send, &view, PyBUF_ANY_CONTIGUOUS)
            src, nb, count = <uintptr_t>view.buf, view.len, view.len // max(view.itemsize, 1)
            PyBuffer_Release(&view)
            if nb > self.capacity:
                raise ValueError(f"{nb} bytes do not fit a group with {self.capacity}-byte slots")
        if out is not None:
            PyObject_GetBuffer(out, &view, PyBUF_ANY_CONTIGUOUS | PyBUF_WRITABLE)
            dst = <uintptr_t>view.buf
            PyBuffer_Release(&view)
        if self._pending is not None:
            self._settle_pending()
        if self._closed or self._broken is not None:
            self._begin("reduction")  # raises the group's error
        k = self._seq + 1
        if k > 1 and self._last_host != k - 1:
            self._wait_round(k - 1)  # (a slot round before: nobody may still read the slots or the result)
        self._seq = k
        self._hr += 1
        r = self._hr
        deadline = _monotonic() + self.timeout  # (the clock _check_host reads)
        while True:
            code = self._round(r, src, nb, dst, count, dcode, opc, failed, stage, cross, leader,
                               0.0 if lazy is not None else self._host_poll)
            if code >= 0:
                break
            if lazy is not None:
                self._pending = (k, r, dst, nb, count, dcode, opc, cross, lazy)
                return -1, []
            stage = 1
            polls += 1
            self._check_host(r, polls % max(self._host_all, 1) == 0, deadline)
        return self._done_round(code, k)

    def settle(self):
        """Finish the host round this member left pending (``_host_round(..., lazy=...)``), if any:
        wait until its result is published, copy it, mark the round done, and hand the outcome to
        the round's ``done``. Also the first step of every operation of the group: a member arrives
        at a round only once it no longer reads the round before."""
        self._settle_pending()

    cdef _settle_pending(self):
        # settle without a lookup of the method (on a Python subclass: its type's MRO and its
        # instance's dict); the lock: a worker's actor threads may read the block while its program runs
        if self._pending is None and not self._lock_locked():
            return  # (nothing pending, and nobody settling it: a settler sets _pending to None first)
        self._lock_acquire()
        try:
            p = self._pending
            if p is None:
                return
            self._pending = None
            self._settle(<tuple>p)
        finally:
            self._lock_release()

    cdef _settle(self, tuple p):
        cdef long long k = p[0], r = p[1]
        cdef uintptr_t dst = p[2]
        cdef Py_ssize_t nb = p[3], count = p[4]
        cdef int dcode = p[5], opc = p[6], code
        cdef bint cross = p[7]
        cdef long polls = 0
        cdef double deadline = 0.0
        out, op, done, finish = p[8]
        try:
            code = self._round(r, 0, nb, dst, count, dcode, opc, False, 1, cross, False, 0.0)  # (in already?)
            if code < 0:
                deadline = _monotonic() + self.timeout
            while code < 0:
                code = self._round(r, 0, nb, dst, count, dcode, opc, False, 1, cross, False, self._host_poll)
                if code >= 0:
                    break
                polls += 1
                self._check_host(r, polls % max(self._host_all, 1) == 0, deadline)
            code, bad = self._done_round(code, k)
            # (every finish returns [] for a result in, unless it divides a mean)
            outcome = [] if code == 0 and op != "mean" else finish(out, op, code, bad)
        except BaseException as exc:
            done(exc)
            return
        done(outcome)


cdef object _hr_type = None  # the type of arrive_lazy's last group (a subclass of HostRounds)


def arrive_lazy(tuple target, send, out, str op, str kdt, done):
    """A small allreduce's host round for a member that needs the result later, if at all
    (``small_allreduce_lazy`` of ``ShmCollective`` and ``HierCollective``): it arrives and
    returns None, the round left pending until ``settle`` hands ``done`` its outcome, unless the
    result is in already (then the outcome: ``[]``, or the failed inputs' ranks).
    ``target``: the group's ``lazy_target()``, ``(host rounds, across hosts, finish)``."""
    global _hr_type
    cdef HostRounds g
    t = target[0]
    if type(t) is _hr_type:  # (the group's type checked before: not its MRO walked again)
        g = <HostRounds>t
    else:
        g = t
        _hr_type = type(t)
    finish = target[2]
    code, bad = g._arrive(send, out, op, kdt, False, target[1], False, (out, op, done, finish))
    return None if code < 0 else finish(out, op, code, bad)
