# The signature of an op's arguments: the key of the recipe caches (mesharray.elementwise.signature).
#
# The common cases in C: plain values, MeshArrays over a storage with a layout key, tuples,
# lists and dicts of those. Anything else goes to the Python rule it was given
# (signature_setup), which raises TypeError for what has no signature.

cdef object _sig_stored = None   # the MeshArray base class (mesharray.storage.StoredArray)
cdef object _sig_other = None    # the Python rule for the rest: other(obj, leaves)


def signature_setup(stored, other):
    """Give :func:`signature` the array base class and the Python rule for what it does not know."""
    global _sig_stored, _sig_other
    _sig_stored = stored
    _sig_other = other


def signature(obj, leaves):
    """A hashable signature of an op's argument (``leaves``: None for a ufunc's operands, whose plain
    values count by type only): a MeshArray by its mesh Shape, its storage's layout key and whether
    its blocks require grad (appended to ``leaves``), plain values by type and value, containers
    element by element (:func:`mesharray.elementwise.signature`, which this is)."""
    cdef type t = type(obj)
    if t is float or t is int or t is bool or t is str or obj is None or t is complex:
        return (t, obj) if leaves is not None else (t,)
    if isinstance(obj, _sig_stored):
        st = obj._storage
        lkey = getattr(st, "_lkey", None)  # (kept once known; the property works it out)
        if lkey is None:
            lkey = getattr(st, "lkey", None)
        if lkey is None:
            raise TypeError("no recipe for gathered arrays")
        if leaves is not None:
            leaves.append(obj)
        return (obj._shape, lkey, st.rg)
    if t is tuple or t is list:
        return (t, tuple([signature(x, leaves) for x in obj]))
    if t is dict:
        if not obj:
            return (dict, ())
        return (dict, tuple([(k, signature(v, leaves)) for k, v in (<dict>obj).items()]))
    return _sig_other(obj, leaves)


# --- an op's tail at the controller --------------------------------------------------------------
#
# What every op of a step runs once its recipe is found (mesharray.darray.dispatch): queue its
# instruction in the context's command buffer, mint its result's storage and array; and a
# storage's finalizer, which gives the block's reference back. These were two thirds of the
# Python steps the controller ran per op of a training step.
#
# The command buffer (``ctx._buf``: a list of ``(ranks, instructions)``) is changed only here,
# atomically: the GIL is held throughout, and no Python code runs between reading the buffer and
# appending to it. The entry a new run of ranks needs is made before the buffer is read (an
# allocation may start a garbage collection, and with it finalizers, which are Python code that
# may let another thread run). A flush (DataContext._send_buffer, under the context's lock) takes
# the whole buffer away in one assignment before it reads it, so a post needs no lock: it lands
# either in the buffer being taken or in the next one, never between. What a post must then run
# in Python (the flusher told of a new buffer, a flush of a full one, the wait at the bound) runs
# after the buffer is consistent, in methods of the context.

import sys as _sys
from time import perf_counter as _perf_counter

cdef object _post_trace = None   # the capture in progress (mesharray.darray.context.set_trace)
cdef object _array_cls = None    # MeshArray
cdef object _union = None        # mesharray.darray.autograd.union
cdef object _object_new = object.__new__
cdef object _is_finalizing = _sys.is_finalizing


def ops_setup(array_cls, union):
    """Give the op tail the array class its results are and the rule for their autograd dependencies."""
    global _array_cls, _union
    _array_cls = array_cls
    _union = union


def set_post_trace(trace):
    """Tell the op tail whether a capture is recording (``None``: none); its ops take the Python path."""
    global _post_trace
    _post_trace = trace


cdef int _queue(ctx, ranks, wire, Py_ssize_t n, key) except -1:
    # Append ``wire`` (one instruction, a tuple, or a list of them) for ``ranks``; ``n``: the ops it
    # stands for (0: one per instruction). ``key`` not None: only if it is in ``ctx.calls`` (a
    # recipe's function the ranks were given), else nothing and 0. 2 when it began the buffer, else 1.
    cdef list ops, buf
    cdef tuple last
    cdef Py_ssize_t nb
    cdef int code = 1
    if type(wire) is tuple:
        ops = [wire]
    else:
        ops = list(wire)
    entry = (ranks, ops)
    now = _perf_counter()
    nb = len(ops)
    # -- atomic from here (see above)
    if key is not None and key not in ctx.calls:
        return 0
    buf = ctx._buf
    if buf:
        last = buf[len(buf) - 1]
        r = last[0]
        if r is ranks or r == ranks:
            (<list>last[1]).extend(ops)
        else:
            buf.append(entry)
    else:
        buf.append(entry)
        code = 2
    ctx._last_post = now
    if code == 2:
        ctx._first_post = now
    ctx._buffered = ctx._buffered + nb
    ctx._unsynced = ctx._unsynced + (n if n else nb)
    return code


cdef int _after(ctx, int code, bint bound) except -1:
    if code == 2:
        ctx._queued_first()
    if ctx._buffered >= ctx._batch_ops:
        ctx.flush()
    if bound and ctx._unsynced > ctx._max_pending:
        ctx._catch_up()
    return 0


@cython.binding(True)
def post_wire(ctx, ranks, wire, Py_ssize_t n=0, bint bound=True):
    """``DataContext.post_wire(ranks, wire, n=0, bound=True)``: queue instructions in their wire form.

    ``wire``: one instruction (a tuple: a recipe's) or a list; ``ranks``: sorted, unique; ``n``: the
    ops they stand for where more than one each (a captured step's replay), as the bound of queued
    ops counts them; ``bound`` False: the caller applies the bound (``keep_bound``) once it has
    queued the other parts of the op (a move's receivers wait for its senders). A capture in
    progress records them (as well: the capture runs its ops once). The buffer goes out as one
    message per rank (``flush``) before this process waits on any reply, once it holds
    ``MESHARRAY_BATCH_OPS`` instructions, or from the flusher thread once the controller is idle.
    """
    if _post_trace is not None:
        _post_trace.record(ctx, ranks, [wire] if type(wire) is tuple else wire)
    _after(ctx, _queue(ctx, ranks, wire, n, None), bound)


cdef object _check_live(ctx):
    state = ctx._state
    if state.stopped or state.stopping:
        ctx.check_live()
    return None


def made_storage(cls, ctx, bid, ranks, local, dtype, engine, holders, collective, all_ranks, nbytes):
    """``DistributedStorage._made``: a storage of a block id just minted, from fields already in their
    types and counted (its only reference: the context counts it without a lookup)."""
    st = _object_new(cls)
    st.ctx = ctx
    st.bid = bid
    st.ranks = ranks
    st.holders = holders
    st._local = local
    st._dtype = dtype
    st.engine = engine
    st.collective = collective
    st.announced = None
    st._last_plan = None
    st._lkey = None
    st.rg = False
    st.deps = ()
    ctx._refs[bid] = 1
    st._nbytes = nbytes
    st._all = all_ranks  # (last: the finalizer gives the reference back only once this is set)
    return st


cdef object _make(res, ctx, bid, shape, operands):
    st = made_storage(res.cls, ctx, bid, res.R, res.local, res.dtype, res.engine, res.holders, res.collective,
                      res.all_ranks, res.nbytes)
    st._lkey = res.lkey
    if res.rg:
        st.rg = True
        st.deps = _union(*[o.deps for o in operands])
    a = _object_new(_array_cls)
    a._shape = res.shape if shape is None else shape
    a._storage = st
    a._last_reduce = None
    return a


@cython.binding(True)
def make_result(res, ctx, bid, shape=None, operands=()):
    """``_Result.make(ctx, bid, shape=None, operands=())``: a MeshArray over block ``bid`` of ``ctx``
    laid out as the recipe's result (on mesh ``shape``, if given); it depends on the mesh nodes of
    ``operands`` (storages) when it requires grad."""
    return _make(res, ctx, bid, shape, operands)


@cython.binding(True)
def apply_call(recipe, list leaves):
    """``ApplyRecipe.__call__(leaves)``: the op on each rank of the result (in place: on the operand
    ``recipe.inplace``, whose array it returns); while a capture records, ``ApplyRecipe.call_py``."""
    if _post_trace is not None:
        return recipe.call_py(leaves)
    cdef list sts = [x._storage for x in leaves]
    ctx = sts[0].ctx
    _check_live(ctx)
    ops = [("b", s.bid) for s in sts]
    inplace = recipe.inplace
    if inplace is None:
        bid = next(ctx._ids)
    else:
        x = sts[inplace]
        bid = x.bid
    key = recipe.key
    code = _queue(ctx, recipe.ranks, ("call", bid, key, ops), 0, key)
    if code == 0:
        recipe.post_new(ctx, bid, ops)  # (its function to the ranks first: under the context's lock)
    else:
        _after(ctx, code, True)
    if inplace is None:
        return _make(recipe.result, ctx, bid, None, sts)
    if recipe.rg:  # (x.requires_grad_(): x now requires grad)
        x.rg = True
        x.deps = _union(*[s.deps for s in sts])
    else:
        x.rg = False
        x.deps = ()
    return leaves[inplace]


@cython.binding(True)
def ufunc_call(recipe, list inputs):
    """``UfuncRecipe.__call__(inputs)``; in a capture, ``UfuncRecipe.call_py``."""
    if _post_trace is not None:
        return recipe.call_py(inputs)
    cdef list ops = [], sts = []
    ctx = inputs[recipe.lead]._storage.ctx
    _check_live(ctx)
    for x, k in zip(inputs, recipe.kinds):
        if k:
            st = x._storage
            ops.append(("b", st.bid))
            sts.append(st)
        else:
            ops.append(("v", x))
    bid = next(ctx._ids)
    _after(ctx, _queue(ctx, recipe.ranks, ("ew", bid, recipe.name, ops, recipe.extra), 0, None), True)
    return _make(recipe.result, ctx, bid, None, sts)


@cython.binding(True)
def decref(ctx, bid, ranks, nbytes=0):
    """``DataContext.decref(bid, ranks, nbytes=0)``: one reference to block ``bid`` less; at none, its
    free is pending for ``ranks`` (it rides on the next program, or the free timer sends it)."""
    cdef dict refs = ctx._refs
    n = refs.pop(bid, 0) - 1
    if n > 0:
        refs[bid] = n
        return
    if ctx._state.stopped or not ranks:
        return
    on = set(ranks)  # (before the pending set is read: see above)
    pending = ctx._pending
    pending[bid] = on
    nb = ctx._pending_bytes + nbytes
    ctx._pending_bytes = nb
    urgent = nb > ctx.FREE_BYTES or len(pending) > 512
    if urgent or not ctx._timer:
        ctx._timer = True
        ctx._schedule_frees(urgent)


@cython.binding(True)
def storage_del(st):
    """``DistributedStorage.__del__``: the controller's reference to the block, given back when the last
    array over it goes (not while the interpreter exits: no thread can start then, and the workers go
    with the controller)."""
    if _is_finalizing():
        return
    try:
        all_ranks = st._all
    except AttributeError:  # __init__ failed before it took the reference
        return
    decref(st.ctx, st.bid, all_ranks, st._nbytes)


def replace_last(posts, old, new):
    """Replace the instruction ``old`` (the object) by ``new`` in the command buffer of each ``(ctx,
    ranks)`` of ``posts``, if every one of those buffers ends with ``old`` queued for those ranks; else
    change nothing. True if replaced. Atomic, as a post is (a move merged into the move queued last:
    every participant's buffer changes, or none)."""
    cdef list buf
    for ctx, ranks in posts:
        buf = ctx._buf
        if not buf:
            return False
        last = buf[len(buf) - 1]
        ops = last[1]
        r = last[0]
        if ops[len(ops) - 1] is not old or not (r is ranks or r == ranks):
            return False
    for ctx, ranks in posts:
        buf = ctx._buf
        ops = buf[len(buf) - 1][1]
        ops[len(ops) - 1] = new
    return True


# --- an op's entry at the controller: its recipe found ---------------------------------------------
#
# MeshArray's operators, ``__array_ufunc__``, ``__torch_function__`` and ``__getattr__`` first look
# for the recipe of the call's signature (mesharray.array._RECIPES, keyed as there) and run it; on a
# miss, or for anything these do not know, they go on in Python exactly as before.

cdef object _recipes = None  # mesharray.array._RECIPES


def entry_setup(recipes):
    """Give the op entries the recipe table they look in (``mesharray.array._RECIPES``)."""
    global _recipes
    _recipes = recipes


cdef inline object _grad_mode():
    torch = _sys.modules.get("torch")  # (torch-engine results require grad under grad mode only)
    return True if torch is None else torch.is_grad_enabled()


cdef object _ufunc_fast(ufunc, tuple inputs):
    # The recipe's result for ``ufunc(*inputs)`` (no keywords) over MeshArrays and plain scalars,
    # or None: the key is _elementwise's, (ufunc, each input's signature, grad mode)
    cdef list sigs = []
    cdef type t
    for x in inputs:
        t = type(x)
        if t is float or t is int or t is bool or t is complex:
            sigs.append((t,))
        elif isinstance(x, _sig_stored):
            st = x._storage
            lkey = getattr(st, "_lkey", None)
            if lkey is None:
                return None  # (the Python path works it out, and keeps it)
            sigs.append((x._shape, lkey, st.rg))
        else:
            return None  # (an operand that may want the ufunc itself: the Python path asks it)
    recipe = _recipes.get((ufunc, tuple(sigs), _grad_mode()))
    if recipe is None:
        return None
    return recipe(list(inputs))


@cython.binding(True)
def array_ufunc(self, ufunc, method, *inputs, **kwargs):
    """``MeshArray.__array_ufunc__``: a call with a recipe, else ``MeshArray._array_ufunc``."""
    if not kwargs and method == "__call__":
        r = _ufunc_fast(ufunc, inputs)
        if r is not None:
            return r
    return self._array_ufunc(ufunc, method, *inputs, **kwargs)


def binary_operator(ufunc, fallback, bint reflected):
    """A MeshArray operator (``__add__``, ``__rmul__``, ...): ``ufunc`` through its recipe when there is
    one, else ``fallback(self, other)`` (NumPy's ``NDArrayOperatorsMixin`` method, which calls the ufunc)."""
    @cython.binding(True)
    def op(self, other):
        r = _ufunc_fast(ufunc, (other, self) if reflected else (self, other))
        if r is not None:
            return r
        return fallback(self, other)
    op.__name__ = fallback.__name__
    op.__qualname__ = fallback.__qualname__
    op.__doc__ = fallback.__doc__
    return op


def torch_function(cls, func, types, args=(), kwargs=None):
    """``MeshArray.__torch_function__`` (a classmethod): a call with a recipe, else
    ``MeshArray._torch_function``."""
    cdef list leaves = []
    try:
        key = (func, signature(args, leaves), signature(kwargs if kwargs else {}, leaves), _grad_mode())
        recipe = _recipes.get(key)
    except TypeError:
        recipe = None
    if recipe is not None:
        return recipe(leaves)
    return cls._torch_function(func, types, args, kwargs)


@cython.binding(True)
def array_getattr(self, str name):
    """``MeshArray.__getattr__``: a torch-engine array's Tensor attribute with a recipe (``x.grad``,
    ``x.detach``), else ``MeshArray._getattr``."""
    if not name.startswith("_"):
        st = self._storage
        lkey = getattr(st, "_lkey", None)
        if lkey is not None:
            recipe = _recipes.get((name, self._shape, lkey))
            if recipe is not None:
                return recipe([self])
    return self._getattr(name)


@cython.binding(True)
def array_getitem(self, key):
    """``MeshArray.__getitem__``: an index of ints (``a[0, 0, 0]``) into a layout indexed so before
    runs its recipe (keyed ``("[]", mesh Shape, layout key, requires grad, key)``), anything else
    ``MeshArray._getitem``."""
    cdef type t = type(key)
    if _post_trace is None and (t is int or t is tuple and all(type(k) is int for k in key)):
        st = self._storage
        lkey = getattr(st, "_lkey", None)
        if lkey is not None:
            recipe = _recipes.get(("[]", self._shape, lkey, st.rg, key))
            if recipe is not None:
                return recipe(self)
    return self._getitem(key)


# --- the pending frees, split by rank (DataContext: a flush, a wait's own message) ---------------

def frees_by_rank(dict pending):
    """``{rank: [block ids]}`` of the pending frees ``{block id: set of ranks}``, in the order freed."""
    cdef dict out = {}
    cdef list got
    for bid, rs in pending.items():
        for r in rs:
            got = out.get(r)
            if got is None:
                out[r] = [bid]
            else:
                got.append(bid)
    return out


def take_frees(dict pending, ranks):
    """The pending frees of blocks on ``ranks``, taken off ``pending`` for those ranks (a block whose
    every rank is taken leaves it)."""
    cdef list frees = [], gone = []
    cdef set mine = set(ranks)
    cdef set rs
    for bid, v in pending.items():
        rs = <set?>v
        if not rs.isdisjoint(mine):
            frees.append(bid)
            rs.difference_update(mine)
            if not rs:
                gone.append(bid)
    for bid in gone:
        del pending[bid]
    return frees
