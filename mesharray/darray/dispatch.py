"""Recipes: the controller's per-call-signature plans of distributed ops, so a loop of ops costs little.

The first time an op runs with a given *signature* — the function (a torch
function, a Tensor method or attribute, a ufunc), its plain arguments, and for
each distributed operand its mesh Shape and its *layout key* (:func:`layout_key`:
which ranks hold which position, holders of copies, local shape, dtype,
engine, collective backend, process mesh) — :class:`~.storage.DistributedStorage`
plans it the general way (broadcasting, where it runs, the result's shape
and dtype on torch's meta device or from NumPy's rules). Where that plan
needs nothing but the operands' block ids to be repeated (every operand
already on the rank computing its position, one result), it is kept as a
*recipe*: a callable that mints the result's block id, queues one
instruction in the context's command buffer and wraps the result. The
:class:`~mesharray.MeshArray` side keeps recipes by signature (see
``MeshArray.__torch_function__``) and runs them on later calls.

Everything a recipe holds depends only on its signature, never on a
particular array or process mesh: the context comes from the operands.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from .._core import apply_call, make_result, ops_setup, ufunc_call
from ..array import MeshArray
from .autograd import union
from .context import tracing

__all__ = ["ApplyRecipe", "ItemRecipe", "UfuncRecipe", "layout_key", "layout_of", "result_of", "plain_scalar"]

_KEYS: dict[tuple, int] = {}
_next_key = itertools.count(1).__next__


def layout_key(st: Any) -> int:
    """A small int naming ``st``'s layout (equal for storages laid out alike in one process mesh).

    Ints are never reused: a table grown too large is cleared, and a layout
    seen again gets a new number (a recipe cache miss, never a wrong hit).
    """
    h = st.holders
    key = (id(st.ctx), st.ranks.shape, st.ranks.tobytes(), None if h is None else (h.shape, h.tobytes()),
           st._local, st._dtype.str, st.engine, st.collective)
    k = _KEYS.get(key)
    if k is None:
        if len(_KEYS) >= 8192:
            _KEYS.clear()
        k = _KEYS[key] = _next_key()
    return k


class _Result:
    """What a recipe's result is, known from its signature: the block's layout and type."""

    __slots__ = ("cls", "ranks", "R", "holders", "local", "dtype", "engine", "collective", "all_ranks", "nbytes",
                 "shape", "lkey", "rg")

    def __init__(self, st: Any, shape: Any, ranks: list) -> None:
        self.cls = type(st)
        self.ranks = ranks  # where the instruction runs (positions and holders of copies)
        self.R = st.ranks
        self.holders = st.holders
        self.local = st._local
        self.dtype = st._dtype
        self.engine = st.engine
        self.collective = st.collective
        self.all_ranks = st._all
        self.nbytes = st._nbytes
        self.shape = shape
        self.lkey = st.lkey
        self.rg = st.rg  # (the signature holds whether each operand requires grad: so does the result)

    def view(self, ctx: Any, bid: int) -> Any:
        """A storage, laid out as this result, over block ``bid`` that exists already (a reference more)."""
        return self.cls(ctx, bid, self.R, self.local, self.dtype, self.engine, self.holders, self.collective,
                        _all_ranks=self.all_ranks)

    #: ``make(ctx, bid, shape=None, operands=())``: a MeshArray over block ``bid`` of ``ctx`` laid out as
    #: this result (on mesh ``shape``, if given); it depends on the mesh nodes of ``operands``
    #: (storages) when it requires grad. Compiled (``_core``: an op's tail).
    make = make_result


#: how many recipes' functions a context's ranks keep before it tells them to drop them all
MAX_CALLS = 8192
_next_call = itertools.count(1).__next__


class ApplyRecipe:
    """``call(*blocks)`` on each rank of the result (a torch function, method or attribute).

    ``inplace``: the index of the operand whose blocks the call changes in place
    (``x.requires_grad_()``): its own block id is the instruction's, and the
    call returns that operand.

    The function (a :class:`~.blockfn.BlockCall`: a torch function or method and
    its templated arguments) is pickled once per process mesh, not once per op:
    the first call sends ``("defcall", key, fn)`` before ``("call", out, key,
    operands)``, later calls only the key, and each rank's data actor keeps the
    function by its key (pickling a torch function or method by reference
    costs more than the rest of a small op's instruction, on both sides). A
    context that gave its ranks :data:`MAX_CALLS` keys has them drop all
    (``uncall``) and gives them anew as they are used. A captured step
    (:mod:`.function`) records the function itself: its program stands alone.
    """

    __slots__ = ("call", "result", "inplace", "ranks", "rg", "key")

    def __init__(self, call: Any, result: _Result | None, ranks: list, inplace: int | None = None,
                 rg: bool = False) -> None:
        self.call = call
        self.result = result
        self.ranks = ranks
        self.inplace = inplace
        self.rg = rg  # (in place: whether the operand requires grad after the call)
        self.key = _next_call()

    def _post(self, ctx: Any, bid: int, ops: list) -> None:
        if tracing():
            ctx.post_wire(self.ranks, ("apply", bid, self.call, ops))
            return
        self.post_new(ctx, bid, ops)

    def post_new(self, ctx: Any, bid: int, ops: list) -> None:
        """Queue the call, its function first where the ranks were not given it yet."""
        key = self.key
        with ctx._lock:  # (another thread's op must not find the key given before its defcall is queued)
            if key in ctx.calls:
                ctx.post_wire(self.ranks, ("call", bid, key, ops), bound=False)
            else:
                if len(ctx.calls) >= MAX_CALLS:
                    ctx.calls.clear()
                    ctx.post_wire(list(ctx.shape), ("uncall",), bound=False)
                ctx.post_wire(self.ranks, [("defcall", key, self.call), ("call", bid, key, ops)], 1, bound=False)
                ctx.calls.add(key)
        ctx.keep_bound()  # (without the lock: it may wait for the ranks)

    #: ``__call__(leaves)``: the common case compiled (``_core``: an op's tail), the rest :meth:`call_py`
    __call__ = apply_call

    def call_py(self, leaves: list) -> Any:
        """The op, in Python: in place, or while a capture records."""
        sts = [x._storage for x in leaves]
        ctx = sts[0].ctx
        ctx.check_live()
        ops = [("b", s.bid) for s in sts]
        if self.inplace is not None:
            x = sts[self.inplace]
            self._post(ctx, x.bid, ops)
            if self.rg:  # (x.requires_grad_(): x now requires grad)
                x.rg, x.deps = True, union(*[s.deps for s in sts])
            else:
                x.rg, x.deps = False, ()
            return leaves[self.inplace]
        res = self.result
        assert res is not None
        bid = ctx.new_id()
        self._post(ctx, bid, ops)
        return res.make(ctx, bid, None, sts)


class UfuncRecipe:
    """``numpy.<name>`` (or the engine's op) over distributed operands and plain scalars.

    ``kinds[i]`` is True for a distributed operand (its block), False for a
    scalar (sent as it is: its type is part of the signature, its value not).
    """

    __slots__ = ("name", "kinds", "extra", "result", "ranks", "lead")

    def __init__(self, name: str, kinds: tuple, extra: dict, result: _Result) -> None:
        self.name = name
        self.kinds = kinds
        self.extra = extra
        self.result = result
        self.ranks = result.ranks
        self.lead = kinds.index(True)

    #: ``__call__(inputs)``: compiled (``_core``: an op's tail); :meth:`call_py` while a capture records
    __call__ = ufunc_call

    def call_py(self, inputs: list) -> Any:
        """The op, in Python (a capture records it)."""
        ctx = inputs[self.lead]._storage.ctx
        ctx.check_live()
        ops = [("b", x._storage.bid) if k else ("v", x) for x, k in zip(inputs, self.kinds)]
        bid = ctx.new_id()
        ctx.post_wire(self.ranks, ("ew", bid, self.name, ops, self.extra))
        res = self.result
        if res.rg:
            return res.make(ctx, bid, None, [x._storage for x, k in zip(inputs, self.kinds) if k])
        return res.make(ctx, bid)


class ItemRecipe:
    """``a[i, j, ...]`` (ints, some over local axes) on each rank holding a selected position: a new
    block, ``src[local_key]`` there (a loss or one weight fetched each step)."""

    __slots__ = ("shape", "ranks", "local_key", "result")

    def __init__(self, shape: Any, ranks: list, local_key: tuple, result: _Result) -> None:
        self.shape = shape  # the result's mesh Shape
        self.ranks = ranks
        self.local_key = local_key
        self.result = result

    def __call__(self, array: Any) -> Any:
        st = array._storage
        ctx = st.ctx
        ctx.check_live()
        bid = ctx.new_id()
        ctx.post_wire(self.ranks, ("getitem", bid, st.bid, self.local_key))  # (a GetItem's wire form)
        return self.result.make(ctx, bid, self.shape, [st])


ops_setup(MeshArray, union)


def layout_of(st: Any) -> _Result:
    """What makes storages laid out as ``st`` (a captured step's results: see :mod:`.function`)."""
    return _Result(st, None, sorted(st._all))


def result_of(value: Any, shape: Any, ranks: list) -> _Result | None:
    """The :class:`_Result` of an op's value when it is one new distributed block, else None."""
    if not isinstance(value, MeshArray) or value.mesh_shape is not shape:
        return None
    st = value.storage
    if getattr(st, "announced", 1) is not None or not hasattr(st, "lkey"):
        return None
    return _Result(st, shape, ranks)


def plain_scalar(x: Any) -> bool:
    """A scalar whose value never changes a ufunc's result dtype (NumPy 2's weak Python scalars)."""
    return type(x) is float or type(x) is bool or (isinstance(x, np.floating) and type(x) is not np.longdouble)
