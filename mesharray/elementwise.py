"""Operations over several MeshArrays: how their operands line up, and which storage runs them.

:func:`broadcast_plan` decides, from shapes alone, the layout of an
elementwise result (a ufunc, an operator, ``np.where``, a torch function):
mesh dims align **by name** (a missing name broadcasts, equal names need
equal sizes or 1), local axes by NumPy's positional rules, and a plain
ndarray operand broadcasts against the result's full shape ``mesh sizes +
local shape``. The :class:`Plan` it returns says how each MeshArray operand
lines up (:meth:`Plan.layout`, :meth:`Plan.align`); the storage that
:func:`storage_class` picks runs the operation with it (see
:mod:`mesharray.storage`). :func:`blockwise_function` runs the NumPy
functions of :data:`BLOCKWISE` where a distributed array's blocks live.

Operands are told apart with ``isinstance(x, StoredArray)`` (the base of
``MeshArray``); this module never imports :mod:`mesharray.array`.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any

import numpy as np

from ._core import Shape, broadcast_shapes, signature, signature_setup
from .calls import template
from .errors import MeshShapeError
from .storage import GatheredStorage, StoredArray

__all__ = ["BLOCKWISE", "REDUCTION_FUNCTIONS", "SAME_SHAPE_FUNCTIONS", "Plan", "array_template", "blockwise_function",
           "broadcast_plan", "mesh_alignment", "signature", "storage_class"]

_SCALAR_TYPES = (bool, int, float, complex, np.generic)


def _local_shape(a: StoredArray) -> tuple[int, ...]:
    return a._storage.local_shape(a._shape.ndim)


class Plan:
    """Layout of an elementwise result, decided from shapes alone.

    Attributes
    ----------
    names : tuple of str
        Result mesh dims, in order.
    sizes : tuple of int
        Their sizes.
    shape : Shape
        The result's mesh Shape.
    local_shape : tuple of int
        The result's local shape (the broadcast of the operands' local shapes;
        empty for a generalized ufunc, whose blocks have the shape it makes).

    A plain (non-MeshArray) operand broadcasts positionally against
    ``sizes + local_shape``; :meth:`layout` says how a MeshArray operand does.
    """

    __slots__ = ("names", "sizes", "shape", "local_shape")

    def __init__(self, names: tuple[str, ...], sizes: tuple[int, ...], shape: Shape, local_shape: tuple[int, ...]) -> None:
        self.names = names
        self.sizes = sizes
        self.shape = shape
        self.local_shape = local_shape

    def layout(self, a: StoredArray, pad_local: bool = True) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """How ``a`` lines up with the result, from shapes alone: ``(perm, target)``.

        ``perm`` orders ``a``'s mesh axes as the result's names do (then its local
        axes); ``target`` is the shape, with size-1 axes inserted for the result's
        mesh dims ``a`` lacks (and, with ``pad_local``, for missing leading local
        axes), that broadcasts positionally against the result's full shape.
        """
        src = tuple(a._shape.names)
        m = len(src)
        local = a._storage.local_shape(m)
        present = [n for n in self.names if n in src]
        perm = tuple(src.index(n) for n in present) + tuple(range(m, m + len(local)))
        sizes = dict(zip(src, a._shape.sizes))
        pad = (len(self.local_shape) - len(local)) if pad_local else 0
        target = tuple(sizes.get(n, 1) for n in self.names) + (1,) * pad + local
        return perm, target

    def align(self, a: StoredArray, pad_local: bool = True) -> np.ndarray:
        """``a``'s values as a view broadcastable (positionally) to the result's full shape."""
        v = a._storage.to_numpy()
        if a._shape.names == self.names and (not pad_local or v.ndim - len(self.names) == len(self.local_shape)):
            return v
        perm, target = self.layout(a, pad_local)
        if perm != tuple(range(v.ndim)):
            v = v.transpose(perm)
        return v.reshape(target) if target != v.shape else v


def _signature_other(obj: Any, leaves: list | None) -> Any:
    # what the compiled signature leaves to Python: torch's small value types, a ufunc's NumPy scalar
    t = type(obj)
    if t.__module__ == "torch" and t.__name__ in ("dtype", "Size", "device", "layout", "memory_format"):
        return (t, obj)
    if leaves is None and isinstance(obj, np.floating):
        return (t,)
    raise TypeError(f"no signature for {t.__name__}")


#: ``signature(obj, leaves)``: a hashable signature of an op's argument (``leaves``: None for a
#: ufunc's operands, whose plain values count by type only): a MeshArray by its mesh Shape, its
#: storage's layout key and whether its blocks require grad (appended to ``leaves``), plain values
#: by type and value, containers element by element. TypeError for what has no signature (a
#: gathered MeshArray, a tensor, any other object). Compiled (``_core``): it runs once or more per op.
signature_setup(StoredArray, _signature_other)


def _fmt_mesh(a: StoredArray) -> str:
    return str(dict(zip(a._shape.names, a._shape.sizes)))


def broadcast_plan(inputs: list, out: tuple, per_element: bool = False) -> Plan:
    """The result layout of an elementwise op; ``per_element`` for a generalized ufunc.

    A generalized ufunc (``matmul``) maps local blocks to blocks of its own
    shape, so only the mesh dims are broadcast; its local shape is left empty.
    """
    # fast path: MeshArrays of one layout and scalars (``a + 1``, ``a * b`` on one mesh)
    first = None
    for x in (*out, *inputs):
        if isinstance(x, StoredArray):
            if first is None:
                first = x
            elif (x._shape.names != first._shape.names or x._shape.sizes != first._shape.sizes
                  or _local_shape(x) != _local_shape(first)):
                break
        elif not isinstance(x, _SCALAR_TYPES):
            break
    else:
        if first is not None:
            local = () if per_element else _local_shape(first)
            return Plan(first._shape.names, first._shape.sizes, first._shape, local)
    arrays = [x for x in inputs if isinstance(x, StoredArray)]
    outs = [x for x in out if isinstance(x, StoredArray)]
    names: list[str] = []
    for a in outs + arrays:
        for n in a._shape.names:
            if n not in names:
                names.append(n)
    every = outs + arrays
    try:
        sizes_by_name = broadcast_shapes(*[a._shape for a in arrays]) if arrays else {}
    except MeshShapeError as e:
        shapes = " and ".join(_fmt_mesh(a) for a in arrays)
        raise MeshShapeError(f"mesh dims {shapes} do not broadcast") from e
    sizes_by_name = dict(sizes_by_name)
    if per_element:
        sizes = tuple(sizes_by_name[n] for n in names)
        return Plan(tuple(names), sizes, _result_shape(every, names, sizes), ())
    try:
        local = tuple(np.broadcast_shapes(*[_local_shape(a) for a in arrays]))
    except ValueError:
        shapes = " and ".join(str(_local_shape(a)) for a in arrays)
        raise MeshShapeError(
            f"local shapes {shapes} do not broadcast (mesh dims {' and '.join(_fmt_mesh(a) for a in arrays)})"
        ) from None
    full = tuple(sizes_by_name.get(n, 1) for n in names) + local
    for x in inputs:
        if isinstance(x, StoredArray) or isinstance(x, (numbers.Number, np.generic)) or x is None:
            continue
        try:
            xshape = np.shape(x)
        except ValueError:  # a ragged sequence: NumPy treats it as an object scalar
            continue
        if len(xshape) > len(full):
            raise MeshShapeError(
                f"operand of shape {xshape} has more dims than the mesh array's shape {full} "
                f"(mesh dims {dict(zip(names, full))} and local shape {local})"
            )
        try:
            full = tuple(np.broadcast_shapes(full, xshape))
        except ValueError:
            raise MeshShapeError(
                f"operand of shape {xshape} does not broadcast against the mesh array's shape {full} "
                f"(mesh dims {dict(zip(names, full))} and local shape {local})"
            ) from None
    m = len(names)
    sizes = full[:m]
    local = full[m:]
    for o in outs:
        o_local = _local_shape(o)
        if (tuple(o._shape.names) != tuple(names[: o._shape.ndim]) or o._shape.ndim != m
                or tuple(o._shape.sizes) + o_local != full):
            raise MeshShapeError(
                f"output with mesh dims {_fmt_mesh(o)} and local shape {o_local} cannot hold a result "
                f"with mesh dims {dict(zip(names, sizes))} and local shape {local}"
            )
    return Plan(tuple(names), tuple(sizes), _result_shape(every, names, sizes), tuple(local))


def _result_shape(operands: list, names: list[str], sizes: tuple[int, ...]) -> Shape:
    """The Shape of the first operand having every result dim at full size, else a dense one."""
    want = dict(zip(names, sizes))
    for a in operands:
        if a._shape.ndim == len(names) and dict(zip(a._shape.names, a._shape.sizes)) == want:
            return a._shape if tuple(a._shape.names) == tuple(names) else a._shape.transpose(*names)
    return Shape(want)


def mesh_alignment(a: StoredArray, names: tuple[str, ...], sizes: tuple[int, ...]) -> np.ndarray:
    """For each position of a mesh ``names``/``sizes``: the flat position of ``a`` whose block goes there.

    By name when every mesh dim of ``a`` is one of ``names``, else positionally
    from the right; size-1 and missing dims broadcast (``MeshArray.to_mesh``).
    The result is read-only (worked out once per pair of mesh shapes).
    """
    pos = _alignment(tuple(a._shape.names), tuple(a._shape.sizes), tuple(names), tuple(sizes))
    if isinstance(pos, str):
        raise MeshShapeError(f"cannot place an array with mesh dims {_fmt_mesh(a)} on a mesh with dims "
                             f"{dict(zip(names, sizes))}: {pos}")
    return pos


@functools.lru_cache(maxsize=256)
def _alignment(src: tuple, ssz: tuple, names: tuple, sizes: tuple) -> np.ndarray | str:
    """:func:`mesh_alignment` of mesh dims ``src``/``ssz``: the positions, or why there are none."""
    pos = np.arange(math.prod(ssz), dtype=np.int64).reshape(ssz)
    if all(n in names for n in src):
        present = [n for n in names if n in src]
        pos = pos.transpose([src.index(n) for n in present])
        pos = pos.reshape(tuple(ssz[src.index(n)] if n in src else 1 for n in names))
    elif len(src) <= len(names):
        pos = pos.reshape((1,) * (len(names) - len(src)) + ssz)
    else:
        return "it has more dims, and not all of its dim names are the mesh's"
    for n, have, need in zip(names, pos.shape, sizes):
        if have not in (1, need):
            return f"dim {n!r} has size {have} here and {need} there (only size 1 broadcasts)"
    out = np.ascontiguousarray(np.broadcast_to(pos, sizes))
    out.setflags(write=False)
    return out


def storage_class(operands: Any) -> Any:
    """The storage that runs an operation on these operands.

    This is the single place where a distributed storage takes over: an operation
    with any distributed operand is run by that operand's storage class (which
    decides how to treat gathered operands next to it).
    """
    for x in operands:
        if isinstance(x, StoredArray) and type(x._storage) is not GatheredStorage:
            return type(x._storage)
    return GatheredStorage


def array_template(obj: Any, leaves: list) -> Any:
    """``obj`` with each MeshArray (in lists, tuples, dicts) replaced by a :class:`~mesharray.calls.Slot`."""
    return template(obj, _is_array, leaves)


def _is_array(x: Any) -> bool:
    return isinstance(x, StoredArray)


#: NumPy functions that dispatch to a MeshArray's reduction of that name (``np.sum(a, axis="procs")``)
REDUCTION_FUNCTIONS: dict[Any, str] = {
    np.sum: "sum",
    np.prod: "prod",
    np.mean: "mean",
    np.std: "std",
    np.var: "var",
    np.min: "min",
    np.max: "max",
    np.amin: "min",
    np.amax: "max",
    np.any: "any",
    np.all: "all",
    np.argmin: "argmin",
    np.argmax: "argmax",
}

#: NumPy functions whose same-shape result keeps the mesh (values computed elementwise)
SAME_SHAPE_FUNCTIONS = {np.round, np.around, np.clip, np.copy, np.nan_to_num, np.real, np.imag}

#: NumPy functions that run on each rank's block of a distributed array (local axes only)
BLOCKWISE: set = {np.concatenate, np.stack, np.where, np.clip, np.dot, np.matmul, np.einsum, np.round,
                   np.around, np.nan_to_num, np.copy, np.real, np.imag}


def blockwise_function(func: Any, args: Any, kwargs: Any) -> Any:
    """A NumPy function of distributed arrays run where their blocks live, or NotImplemented.

    Axis arguments count the whole shape, as everywhere on MeshArrays, and must
    name local axes (``np.concatenate([a, b], axis=-1)``); einsum's subscripts
    name each block's own axes. Anything else (an axis over mesh dims) is left
    to the gathered path.
    """
    leaves: list = []
    targs = array_template(tuple(args), leaves)
    tkwargs = array_template(dict(kwargs), leaves)
    if not leaves or storage_class(leaves) is GatheredStorage:
        return NotImplemented
    per_element = func in (np.dot, np.matmul, np.einsum, np.concatenate, np.stack)
    plan = broadcast_plan(leaves, (), per_element=per_element)
    m = len(plan.sizes)
    if func in (np.concatenate, np.stack):
        axis = tkwargs.pop("axis", targs[1] if len(targs) > 1 else 0)
        targs = targs[:1]
        if axis is None or not isinstance(axis, (numbers.Integral, np.integer)):
            return NotImplemented
        ndim = len(_local_shape(leaves[0]))
        nd = m + ndim if func is np.concatenate else m + ndim + 1
        axis = int(axis) + nd if axis < 0 else int(axis)
        if not m <= axis < nd:
            return NotImplemented  # along a mesh dim: gathered
        if any(len(_local_shape(x)) != ndim for x in leaves):
            raise MeshShapeError(f"{func.__name__}: local shapes {[_local_shape(x) for x in leaves]} differ in "
                                 f"their number of axes")
        tkwargs["axis"] = axis - m
    elif func is np.einsum:
        subs = targs[0]
        if not isinstance(subs, str):
            return NotImplemented
        inputs = subs.replace(" ", "").split("->")[0].split(",")
        if len(inputs) != len(leaves) or any(len(t.replace("...", "")) != len(_local_shape(x))
                                             for t, x in zip(inputs, leaves) if "..." not in t):
            return NotImplemented  # subscripts over the whole shape: gathered
    elif "axis" in tkwargs or "out" in tkwargs:
        return NotImplemented
    return type(leaves[0]._storage).array_function(func, plan, leaves, targs, tkwargs, per_element)


