"""What holds a ``MeshArray``'s values: the ``Storage`` protocol, and the gathered storage.

A :class:`~mesharray.MeshArray` is a mesh :class:`~mesharray.Shape` and a
storage. The array decides every layout (which Shape, which axes, how
operands broadcast) and hands it over; a storage only moves or computes
values, and every method that makes values returns a new storage (never a
MeshArray). Two storages implement the protocol:

- :class:`GatheredStorage` (here): one ndarray at the controller, mesh axes
  first, local axes last — the result of ``call()``, or ``MeshArray(values, names)``.
- ``DistributedStorage`` (:mod:`mesharray.darray.storage`): each rank's block
  lives in its worker; it also implements :class:`WorkerStorage`.

:class:`StoredArray` is the base of ``MeshArray``: the pair (Shape, storage)
that storages and elementwise plans (:mod:`mesharray.elementwise`) see of
an operand, so that they tell a MeshArray from a plain operand without
importing :mod:`mesharray.array`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ._core import Shape
from .errors import MeshShapeError

if TYPE_CHECKING:  # pragma: no cover
    from .elementwise import Plan

__all__ = ["GatheredStorage", "Storage", "StoredArray", "WorkerStorage"]


class Storage(Protocol):
    """What a storage behind a ``MeshArray`` provides.

    ``mesh_ndim`` is the number of mesh axes; "full shape" means mesh sizes
    then local shape.
    """

    @property
    def kind(self) -> str:
        """``"gathered"`` (values at the controller) or ``"distributed"`` (blocks in the workers)."""

    @property
    def dtype(self) -> np.dtype: ...

    def local_shape(self, mesh_ndim: int) -> tuple[int, ...]:
        """The shape of each element (the trailing, local axes)."""

    def to_numpy(self) -> np.ndarray:
        """The values as one ndarray of the full shape (a distributed storage gathers)."""

    def take(self, mesh_key: tuple, local_key: tuple, new_shape: Shape) -> Storage:
        """NumPy indexing: ``mesh_key`` on the mesh axes, then ``local_key`` on each element.

        ``mesh_key`` is explicit (no ``...``) and its result is the Shape
        ``new_shape``; an empty key leaves its part as it is.
        """

    def relayout(self, old_shape: Shape, perm: tuple[int, ...] | None, new_shape: Shape) -> Storage:
        """The same elements over ``new_shape``: mesh axes permuted by ``perm`` (None: kept), then reshaped row-major.

        What rename, flatten, split and transpose do; blocks that live at ranks need not move.
        """

    def setitem(self, key: tuple, value: Any) -> None:
        """``values[key] = value`` in place.

        ``key`` is a NumPy key over the full shape whose NumPy meaning equals the
        MeshArray's; ``value`` is an ndarray or scalar already aligned to the
        selection's layout.
        """

    def reshape_local(self, mesh_ndim: int, local_shape: tuple[int, ...]) -> Storage:
        """Each element reshaped to ``local_shape`` (same number of values)."""

    def astype(self, dtype: Any, copy: bool) -> Storage: ...

    def copy(self) -> Storage: ...

    def reduce(self, op: str, func: Any, axes: tuple[int, ...] | None, keepdims: bool, kwargs: dict) -> Storage:
        """Reduction ``op`` over ``axes`` of the full shape (None: all).

        ``func`` is the NumPy function for one ndarray; ``argmin``/``argmax``
        get one axis.
        """

    @staticmethod
    def elementwise(ufunc: np.ufunc, plan: Plan, inputs: list, kwargs: dict) -> tuple[Storage, ...]:
        """``ufunc`` over ``inputs`` (MeshArrays and plain operands) broadcast as ``plan`` says.

        Called on the class that :func:`~mesharray.elementwise.storage_class`
        picks for the operands; ``kwargs["out"]``, when present, holds the
        outputs to write into (MeshArrays with the result's layout, or
        ndarrays). One storage per output of the ufunc.
        """


class WorkerStorage(Storage, Protocol):
    """What a storage whose blocks live in the workers (``kind == "distributed"``) also provides.

    ``MeshArray`` calls these only on such a storage, to run an operation
    where the blocks are instead of gathering them.
    """

    def roll(self, axis: int, shift: int, mesh_ndim: int) -> Storage:
        """``np.roll`` along one axis of the full shape: blocks move between workers along a mesh axis."""

    def to_mesh(self, idx: np.ndarray, procs: Any) -> Storage:
        """The blocks on the processes of ``procs``: position ``p`` there gets the block at flat position ``idx[p]``."""

    def positions(self, shape: Shape, axis: int) -> Any:
        """A distributed MeshArray of ``shape``: each position's index along mesh ``axis``."""

    def torch_attr(self, array: Any, name: str, plan: Plan) -> Any:
        """Tensor attribute or method ``name`` of each block of ``array`` (``x.grad``, ``x.backward``)."""

    @staticmethod
    def torch_function(func: Any, plan: Plan, leaves: list, args: Any, kwargs: dict) -> Any:
        """A torch function on each rank's blocks; ``args``/``kwargs`` are templates over ``leaves``."""

    @staticmethod
    def array_function(func: Any, plan: Plan, leaves: list, args: Any, kwargs: dict, per_element: bool) -> Any:
        """A NumPy function on each rank's blocks; ``args``/``kwargs`` are templates over ``leaves``."""


class StoredArray:
    """A mesh Shape and the storage of its values: what storages and plans see of a ``MeshArray``.

    :class:`~mesharray.MeshArray` is its one subclass. The modules below
    :mod:`mesharray.array` tell a MeshArray operand from a plain one with
    ``isinstance(x, StoredArray)`` and read only these two attributes
    (the values are ``x._storage.to_numpy()``, the local shape
    ``x._storage.local_shape(x._shape.ndim)``).
    """

    __slots__ = ("_shape", "_storage")

    _shape: Shape
    _storage: Storage


class GatheredStorage:
    """Values held at the controller: one ndarray, mesh axes first, local axes last.

    The :class:`Storage` of every MeshArray that is not distributed.

    Examples
    --------
    >>> import numpy as np
    >>> import mesharray as ma
    >>> st = GatheredStorage(np.arange(6).reshape(2, 3))
    >>> st.local_shape(1), st.relayout(ma.Shape(procs=2), None, ma.Shape(a=1, b=2)).to_numpy().shape
    ((3,), (1, 2, 3))
    """

    __slots__ = ("array",)
    kind = "gathered"

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    # -- description
    @property
    def dtype(self) -> np.dtype:
        return self.array.dtype

    def local_shape(self, mesh_ndim: int) -> tuple[int, ...]:
        return self.array.shape[mesh_ndim:]

    # -- whole values
    def to_numpy(self) -> np.ndarray:
        return self.array

    # -- layout changes
    def take(self, mesh_key: tuple, local_key: tuple, new_shape: Shape) -> GatheredStorage:
        # a trailing ``...`` keeps every result an ndarray (an object element that
        # is itself a list must stay an element, not become axes)
        v = self.array[mesh_key + (Ellipsis,)] if mesh_key else self.array
        if local_key:
            m = new_shape.ndim
            if any(isinstance(k, np.ndarray) for k in local_key):
                # NumPy would move non-adjacent advanced-index dims in front of *all*
                # axes; put the mesh axes last so they land in front of the local ones.
                v = np.moveaxis(v, tuple(range(m)), tuple(range(-m, 0)))
                v = v[local_key + (Ellipsis,)]
                v = np.moveaxis(v, tuple(range(-m, 0)), tuple(range(m)))
            else:
                v = v[(slice(None),) * m + local_key + (Ellipsis,)]
        return GatheredStorage(v)

    def relayout(self, old_shape: Shape, perm: tuple[int, ...] | None, new_shape: Shape) -> GatheredStorage:
        v = self.array
        m = old_shape.ndim
        local = v.shape[m:]
        if perm is not None:
            v = v.transpose(perm + tuple(range(m, v.ndim)))
        return GatheredStorage(v.reshape(tuple(new_shape.sizes) + local))

    def setitem(self, key: tuple, value: Any) -> None:
        self.array[key] = value

    def reshape_local(self, mesh_ndim: int, local_shape: tuple[int, ...]) -> GatheredStorage:
        v = self.array
        return GatheredStorage(v.reshape(v.shape[:mesh_ndim] + tuple(local_shape)))

    def astype(self, dtype: Any, copy: bool) -> GatheredStorage:
        return GatheredStorage(self.array.astype(dtype, copy=copy))

    def copy(self) -> GatheredStorage:
        return GatheredStorage(self.array.copy())

    # -- compute
    def reduce(self, op: str, func: Any, axes: tuple[int, ...] | None, keepdims: bool, kwargs: dict) -> GatheredStorage:
        if op in ("argmin", "argmax") and axes is not None:
            r = func(self.array, axis=axes[0], keepdims=keepdims, **kwargs)
        else:
            r = func(self.array, axis=axes, keepdims=keepdims, **kwargs)
        return GatheredStorage(np.asarray(r))

    @staticmethod
    def elementwise(ufunc: np.ufunc, plan: Plan, inputs: list, kwargs: dict) -> tuple[GatheredStorage, ...]:
        if ufunc.signature is not None:
            return tuple(GatheredStorage(r) for r in _gufunc_per_element(ufunc, plan, inputs, kwargs))
        args = [plan.align(x) if isinstance(x, StoredArray) else x for x in inputs]
        if isinstance(kwargs.get("where"), StoredArray):
            kwargs = dict(kwargs, where=plan.align(kwargs["where"]))
        if "out" in kwargs:  # the plan checked that MeshArray outputs have the result's layout
            kwargs = dict(kwargs, out=tuple(o._storage.to_numpy() if isinstance(o, StoredArray) else o
                                            for o in kwargs["out"]))
        out = ufunc(*args, **kwargs)
        return tuple(GatheredStorage(np.asarray(r)) for r in (out if isinstance(out, tuple) else (out,)))


def _gufunc_per_element(ufunc: np.ufunc, plan: Plan, inputs: list, kwargs: dict) -> tuple[np.ndarray, ...]:
    """A generalized ufunc (``matmul``...) applied to each element's local block."""
    if kwargs.get("out") is not None:
        raise TypeError(f"{ufunc.__name__} of MeshArrays does not take out=; assign the result instead")
    aligned = [plan.align(x, pad_local=False) if isinstance(x, StoredArray) else x for x in inputs]
    m = len(plan.names)
    results: list[list[Any]] = []
    for pos in np.ndindex(*plan.sizes):
        args = []
        for x, orig in zip(aligned, inputs):
            if isinstance(orig, StoredArray):
                args.append(x[tuple(p if s > 1 else 0 for p, s in zip(pos, x.shape[:m]))])
            else:
                args.append(x)
        r = ufunc(*args, **kwargs)
        r = r if isinstance(r, tuple) else (r,)
        if not results:
            results = [[] for _ in r]
        for acc, ri in zip(results, r):
            acc.append(np.asarray(ri))
    if not results:  # an empty mesh: run once on empty blocks to learn the result dtype
        raise MeshShapeError(f"{ufunc.__name__} over an empty mesh {dict(zip(plan.names, plan.sizes))}")
    out = []
    for acc in results:
        stacked = np.stack(acc)
        out.append(stacked.reshape(plan.sizes + stacked.shape[1:]))
    return tuple(out)
