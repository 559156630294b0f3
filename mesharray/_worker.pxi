# A rank's common instructions (mesharray.darray.worker.DataActor.run), compiled.
#
# The instructions of a training step that every rank runs most: a recipe's ``call`` turned back
# into the ``apply`` of its function (``expand_calls``), an ``apply`` or an ``ew`` whose operands
# are at hand (``fast_op``), the frees of torch blocks (``free_blocks``), and the gradient buckets'
# look-ahead over a program (``bucket_scan``, for darray.overlap.prepare). Each does exactly what
# the Python path does, and hands back to it what it does not know (None / False).

from cpython.unicode cimport PyUnicode_1BYTE_KIND, PyUnicode_DATA, PyUnicode_GET_LENGTH, PyUnicode_KIND
from libc.string cimport memcmp


def expand_calls(program, dict calls, dict plans, missing):
    """``DataActor._expand`` for a program without captured steps (no ``def``, ``undef``, ``replay``:
    None then, with nothing done): each ``call`` the ``apply`` of the function its key names
    (``missing(key)`` where none), ``defcall``/``uncall``/``defplan`` kept in ``calls`` and ``plans``."""
    cdef list out = []
    for item in program:
        code = item[0]
        if code == "def" or code == "undef" or code == "replay":
            return None
    for raw in program:
        code = raw[0]
        if code == "call":
            fn = calls.get(raw[2])
            out.append(("apply", raw[1], missing(raw[2]) if fn is None else fn, raw[3]))
        elif code == "defcall":
            calls[raw[1]] = raw[2]
        elif code == "uncall":
            calls.clear()
        elif code == "defplan":
            plans[raw[1]] = raw[2]
        else:
            out.append(raw)
    return out


cdef object _fast_operands(list ops, dict blocks):
    # the operands' values where all are blocks of this rank (made, not failed) or plain values
    cdef list vals = []
    for o in ops:
        tag = o[0]
        if tag == "b":
            v = blocks.get(o[1], _MISSING_BLOCK)
            if v is _MISSING_BLOCK:
                return None
            vals.append(v)
        elif tag == "v":
            vals.append(o[1])
        else:
            return None
    return vals


cdef object _MISSING_BLOCK = object()


def fast_op(raw, dict blocks, dict engines, dict failed):
    """``("apply", out, fn, operands)`` or ``("ew", out, name, operands, kwargs)`` run where its operands
    are at hand, as the worker's general path runs it (``darray.worker._fast_apply``). Returns None when
    it is not such a case (nothing done), True when its block is stored, the exception it raised
    (nothing stored: the caller keeps it as the block's failure), or ``(out, value, engine)`` for an
    apply whose value is not a block (the caller converts it)."""
    code = raw[0]
    out = raw[1]
    ops = raw[3]
    if type(ops) is not list or not ops:
        return None
    if code == "apply":
        if ops[0][0] != "b":
            return None
        vals = _fast_operands(ops, blocks)
        if vals is None:
            return None
        eng = engines.get(ops[0][1])
        if eng is None:
            return None
        try:
            r = raw[2](*vals)
            if not eng.is_block(r):
                return (out, r, eng)
        except BaseException as exc:
            return exc
    elif code == "ew":
        if raw[4]:
            return None
        if ops[0][0] == "b":
            first = ops[0][1]
        elif len(ops) >= 2 and ops[1][0] == "b":
            first = ops[1][1]
        else:
            return None
        vals = _fast_operands(ops, blocks)
        if vals is None:
            return None
        eng = engines.get(first)
        name = raw[2]
        if eng is None or eng.name == "numpy" or name == "matmul":
            return None
        try:
            r = eng.elementwise(name, *vals)
        except BaseException as exc:
            return exc
    else:
        return None
    blocks[out] = r
    engines[out] = eng
    if failed:
        failed.pop(out, None)
    return True


def free_blocks(store, list bids):
    """``BlockStore.free(bids)`` where no block is a NumPy array (whose memory the store may keep for
    reuse) and none failed; False, with nothing done, otherwise."""
    return _free_blocks(store.blocks, store.engines, store.failed, store.lazy, bids)


cdef bint _free_blocks(dict blocks, dict engines, dict failed, dict lazy, list bids) except -1:
    # free_blocks on the store's dicts themselves: PlanRunner holds them, so a member's free of the
    # last result looks up no attribute of the store (each lookup a cold type and instance dict)
    for b in bids:
        if isinstance(blocks.get(b), cnp.ndarray) or b in failed:
            return False
    for b in bids:
        if lazy:
            lazy.pop(b, None)
        blocks.pop(b, None)
        engines.pop(b, None)
    return True


def bucket_scan(list program, Py_ssize_t i, grad_of, barriers, plan_of, block_ids):
    """``darray.overlap.prepare``'s two passes over the program after the backward at ``program[i]``:
    the gradients it may bucket, as ``(plan, [(w, g, m, gi, mi, nbytes), ...])``, or None.

    First pass, up to the first code in ``barriers``: each ``g = grad_of(w)`` (an ``apply``) and each
    reduction of such a ``g`` (a ``plan``/``kplan`` that fetches nothing, with its input's size) by
    the first plan met (``plan_of(key)``: a ``kplan``'s bytes). Second pass: a gradient some other
    instruction reads or changes (named by more than its ``grad_of`` and its plan; ``block_ids(ins)``
    for codes other than ``apply``/``ew``), or whose parameter an apply changed before the gradient
    was read, is left out."""
    cdef dict made_at = {}, first_apply = {}, touched
    cdef list entries = [], kept
    cdef Py_ssize_t end = len(program), j
    plan = None
    for j in range(i + 1, end):
        ins = program[j]
        code = ins[0]
        if code in barriers:
            # another backward (an effect), a backward through mesh ops (effects, collectives, moves),
            # a wait's check: gradients may change or be read after it, so nothing beyond is bucketed
            end = j
            break
        if code == "apply":
            if ins[1] not in first_apply:
                first_apply[ins[1]] = j
            ops = ins[3]
            if ins[2] is grad_of and len(ops) == 1 and ops[0][0] == "b":
                made_at[ins[1]] = j
        elif (code == "plan" or code == "kplan") and not ins[4] and ins[2] in made_at and len(ins) > 5 and ins[5]:
            if code == "plan":
                this = ins[3]
            else:
                this = plan_of(ins[3]) if plan_of is not None else None
            if plan is None:
                plan = this
            if this is None or this != plan:
                continue
            gi = made_at[ins[2]]
            entries.append((program[gi][3][0][1], ins[2], ins[1], gi, j, ins[5]))
    if not entries or plan is None:
        return None
    # a gradient some other instruction reads or changes (g.mul_(0.5) before its reduction: named
    # by more than its grad_of and its plan), or a parameter changed in place before its gradient
    # is read, is left to the instructions (frees of the gradients come last: they are freed after
    # the buckets stored them)
    touched = {}
    for e in entries:
        touched[e[1]] = 0
    for j in range(i + 1, end):
        ins = program[j]
        code = ins[0]
        if code == "free":
            continue
        if (code == "apply" or code == "ew") and type(ins[3]) is list:
            b = ins[1]
            if b in touched:
                touched[b] = touched[b] + 1
            for o in ins[3]:
                if o[0] == "b" and o[1] in touched:
                    touched[o[1]] = touched[o[1]] + 1
            continue
        for b in block_ids(ins):
            if b in touched:
                touched[b] = touched[b] + 1
    kept = [e for e in entries if touched[e[1]] == 2 and first_apply.get(e[0], e[3]) >= e[3]]
    return plan, kept


# --- a small reduction's program on a member (free, plan by key, check) ----------------------------

cdef class Settled:
    """The ``done`` of a block that a small allreduce makes lazily (``darray.worker._settled``, which
    ``slow`` is): an outcome of ``[]`` stores ``res`` as block ``out`` if the store still awaits it
    (``lazy``); any other outcome (failed inputs, an error) goes to ``slow(out, res, eng, outcome)``."""

    cdef object out, res, eng, slow
    cdef dict lazy, blocks, engines, failed

    def __call__(self, outcome):
        if type(outcome) is list and not outcome:
            if self.lazy.pop(self.out, None) is None:
                return  # (freed meanwhile)
            self.blocks[self.out] = self.res
            self.engines[self.out] = self.eng
            self.failed.pop(self.out, None)
            return
        self.slow(self.out, self.res, self.eng, outcome)


cdef enum:  # (the codes of _plan_code)
    _PC_OTHER = 0
    _PC_FREE = 1
    _PC_CHECK = 2
    _PC_KPLAN = 3


cdef inline int _plan_code(code) noexcept:
    # an instruction's code among PlanRunner's three, read from the str's bytes: a program's codes
    # are fresh strs of its unpickling, so == would compare them through PyUnicode_Compare
    cdef Py_ssize_t n
    cdef const char* d
    if type(code) is not str or PyUnicode_KIND(code) != PyUnicode_1BYTE_KIND:
        return _PC_OTHER
    n = PyUnicode_GET_LENGTH(code)
    d = <const char*>PyUnicode_DATA(code)
    if n == 4 and memcmp(d, b"free", 4) == 0:
        return _PC_FREE
    if n == 5 and memcmp(d, b"check", 5) == 0:
        return _PC_CHECK
    if n == 5 and memcmp(d, b"kplan", 5) == 0:
        return _PC_KPLAN
    return _PC_OTHER


cdef class PlanRunner:
    """``DataActor.run`` of the program a small reduction sends every member but its roots:
    ``[("free", blocks), ("kplan", out, src, key, roots, nbytes), ("check", ranks)]``, in any
    number and order, compiled.

    :meth:`run` returns False (nothing done) unless every instruction is one of those three,
    this rank (:attr:`me`, None until the Python path knows it) is none of the plans' roots nor
    in a check's ranks, and each plan is known to be a small allreduce of a host round
    (``darray.worker._PLANS``'s state, with its ``lazy_target()``): then it runs them as ``run``
    would (a block that is not the plan's contiguous NumPy array goes to ``planned(me, out, src,
    plan, True)``, the Python path) and returns True (``run``'s result is None).

    Each member of a mesh runs one such program per small sum (1,023 of them for a sum over
    1,024 ranks), so its Python was most of a member's CPU per sum (``docs/internals.md``,
    "Many hosts": the host rounds)."""

    cdef object store, planned, settled
    cdef dict blocks, engines, failed, lazy, plans, cache
    cdef list last
    cdef public object me

    def __init__(self, store, dict plans, dict cache, list last, planned, settled):
        self.store = store
        self.blocks, self.engines, self.failed, self.lazy = store.blocks, store.engines, store.failed, store.lazy
        self.plans, self.cache, self.last = plans, cache, last
        self.planned, self.settled = planned, settled
        self.me = None

    cdef object _state(self, key):
        # a kplan's (plan bytes, state [fields, fast]) from its key; the last plan compared, not hashed
        plan = self.plans.get(key)
        if plan is None:
            return None
        last = self.last
        if plan is last[0] or plan == last[0]:
            return plan, last[1]
        st = self.cache.get(plan)
        if st is None:
            return None
        last[0] = plan
        last[1] = st
        return plan, st

    def run(self, list program):
        return self._run(program)

    cdef bint _run(self, list program) except -1:
        cdef Py_ssize_t n = len(program), i
        cdef list states = []
        cdef tuple fast
        cdef cnp.ndarray block
        cdef int kop
        me = self.me
        if me is None:
            return False
        for raw in program:
            kop = _plan_code(raw[0])
            if kop == _PC_FREE:
                continue
            if kop == _PC_CHECK:
                if me in raw[1]:
                    return False
                continue
            if kop != _PC_KPLAN or me in raw[4]:
                return False
            got = self._state(raw[3])
            if got is None:
                return False
            fast = (<tuple>got)[1][1]
            if fast is None or fast[6] is None:
                return False
            states.append(got)
        i = 0
        for raw in program:
            kop = _plan_code(raw[0])
            if kop == _PC_FREE:
                if not _free_blocks(self.blocks, self.engines, self.failed, self.lazy, raw[1]):
                    self.store.free(raw[1])
                continue
            if kop != _PC_KPLAN:
                continue
            plan, st = states[i]
            i += 1
            fast = st[1]
            out, src = raw[1], raw[2]
            if self.lazy and src in self.lazy:
                self.store.settle()
            g, op, dtype, eng, small, kdt, target = fast
            self.blocks.pop(out, None)
            obj = self.blocks.get(src)
            if type(obj) is not _np.ndarray or self.engines.get(src) is not eng:
                self.planned(me, out, src, plan, True)  # (the Python path: what it does with such a block)
                continue
            block = <cnp.ndarray>obj
            if (<object>cnp.PyArray_DESCR(block) is not dtype or not cnp.PyArray_IS_C_CONTIGUOUS(block)
                    or cnp.PyArray_NBYTES(block) > small):
                self.planned(me, out, src, plan, True)
                continue
            res = cnp.PyArray_EMPTY(cnp.PyArray_NDIM(block), cnp.PyArray_DIMS(block),
                                    cnp.PyArray_TYPE(block), 0)
            done = Settled.__new__(Settled)
            (<Settled>done).out, (<Settled>done).res, (<Settled>done).eng = out, res, eng
            (<Settled>done).slow = self.settled
            (<Settled>done).lazy, (<Settled>done).blocks = self.lazy, self.blocks
            (<Settled>done).engines, (<Settled>done).failed = self.engines, self.failed
            self.lazy[out] = g  # (first: another thread may finish the round at once)
            try:
                got = arrive_lazy(target, block, res, op, kdt, done)
            except BaseException as exc:
                self.lazy.pop(out, None)
                self.store.fail(out, exc)
                continue
            if got is not None:  # the result was in already: stored or failed now, as _planned does
                self.lazy.pop(out, None)
                if got:
                    self.lazy[out] = g  # (``settled`` takes the mark, then fails the block: InputFailed)
                    self.settled(out, res, eng, got)
                else:
                    self.blocks[out] = res
                    self.engines[out] = eng
                    self.failed.pop(out, None)
        return True


cdef class FastRun:
    """``DataActor.run`` as its instance's own attribute (what the worker's call path finds first):
    ``PlanRunner`` runs the program if it can, else ``slow(program)`` (the Python path). No Python
    frame runs between the call path and ``PlanRunner`` then, nor any lookup of the actor's
    attributes: a member of a sum over many ranks runs this once per sum, on cold caches."""

    cdef PlanRunner runner
    cdef object slow

    def __init__(self, PlanRunner runner not None, slow):
        self.runner, self.slow = runner, slow

    def __call__(self, program):
        if type(program) is list and self.runner._run(<list>program):
            return None
        return self.slow(program)
