"""``MeshArray``: a NumPy-like array whose leading axes are the dims of a mesh.

A ``MeshArray`` of ``mesh_ndim`` named mesh dims and a local shape has NumPy
shape ``mesh sizes + local shape``: one position per rank along the mesh axes,
and each rank's own element (a scalar or a block) along the trailing *local*
axes. It is what ``endpoint.call()`` returns (the gathered results of every
actor) and what distributed data looks like.

>>> import numpy as np
>>> import mesharray as ma
>>> a = ma.MeshArray(np.arange(8).reshape(2, 4), ["hosts", "procs"])
>>> a
MeshArray(hosts=2, procs=4, dtype=int64)
[[0 1 2 3]
 [4 5 6 7]]
>>> (a * 10 + 1).sum(axis="procs").tolist()
[64, 224]
>>> a.slice(procs=-1).tolist()
[3, 7]
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

from ._core import Shape, array_getattr, array_getitem, array_ufunc, binary_operator, entry_setup, torch_function
from .calls import fill
from .elementwise import (
    BLOCKWISE,
    REDUCTION_FUNCTIONS,
    SAME_SHAPE_FUNCTIONS,
    Plan,
    array_template,
    blockwise_function,
    broadcast_plan,
    mesh_alignment,
    signature,
    storage_class,
)
from .errors import DimensionError, MeshShapeError
from .indexing import is_advanced, is_full_slice, split_key
from .mesh import MeshTrait, mesh_size
from .reductions import Reductions, no_out, normalize_axes, single_axis
from .storage import GatheredStorage, Storage, StoredArray, WorkerStorage

__all__ = ["GatheredStorage", "MeshArray"]


def _wrap(shape: Shape, storage: Storage) -> Any:
    """A MeshArray, or the bare element when there is no axis left (as NumPy gives a scalar)."""
    if shape.ndim == 0 and type(storage) is GatheredStorage and storage.array.ndim == 0:
        return storage.array[()]
    return MeshArray._from_parts(shape, storage)


class MeshArray(Reductions, NDArrayOperatorsMixin, MeshTrait, StoredArray):
    """A NumPy-like array whose leading ``mesh_ndim`` axes are named mesh dims.

    ``MeshArray(values, names)`` wraps ``values`` (anything ``numpy.asarray``
    takes): its leading ``len(names)`` axes are the mesh dims and its trailing
    axes are each element's own (*local*) shape. ``shape``, ``size``, ``ndim``,
    ``len()`` and iteration have NumPy's meaning over ``mesh sizes + local
    shape``; ``mesh_shape`` is the :class:`~mesharray.Shape` over global ranks
    that the mesh axes came from (dense over the sizes when you build one
    yourself; the actor mesh's ranks when it is the result of a call).

    Parameters
    ----------
    values : array_like
        The values; not copied when already an ndarray.
    names : str or sequence of str, optional
        Names of the leading mesh dims. Optional when ``mesh_shape`` is given.
    mesh_shape : Shape, optional
        The Shape of the mesh axes (its sizes must match the leading axes).

    Notes
    -----
    **Indexing.** ``a[key]`` follows NumPy over the whole shape: the leading
    entries index the mesh axes (resolved by ``Shape``, so the result keeps the
    global ranks it came from and advanced indices name new dims by Shape's
    rule), the rest index every element's local axes. ``None`` placed after all
    mesh axes adds a *local* axis. The mesh part is applied first, then the
    local part to each element, so NumPy's rule that moves advanced-index dims
    in front (ints and arrays separated by a slice) applies within each part,
    never across: ``a[:, [0, 2], :, 1]`` keeps the mesh dims first. Advanced
    (array) indices may select mesh axes or local axes but not both in one key
    (index in two steps). By name:
    ``a.slice(procs=1)`` or ``a[{"procs": 1}]``. A result with no mesh dims and
    a scalar element is that element (a NumPy scalar, or the Python object of
    an object array), as NumPy returns a scalar; with local axes left it stays
    a 0-d-mesh MeshArray.

    **Arithmetic** (every ufunc, and every operator through it). Between
    MeshArrays, mesh dims align **by name** — a missing name broadcasts, equal
    names need equal sizes (or 1) — and local axes align by NumPy's positional
    rules. The result's names are the first operand's, then the new names of
    the others in order. A plain ndarray (or list) operand broadcasts NumPy-style
    against the result's full shape ``mesh sizes + local shape``, so it meets the
    local axes when its ndim is at most the local ndim — exactly what
    ``np.asarray(a) + x`` does; it may not have more dims than that shape.
    Generalized ufuncs (``@``/``np.matmul``) apply per element: plain operands are
    local operands. The result keeps the mesh Shape of the first MeshArray
    operand that has all its dims at full size, else a dense Shape.
    Mismatches raise :class:`~mesharray.MeshShapeError` naming both shapes.

    **Reductions** (``sum mean min max prod any all argmin argmax std var``, also
    as ``np.sum(a, axis="procs")``) take ``axis`` as an int (over the whole
    shape), a mesh dim name, a tuple of either, or None. Reducing a mesh axis
    removes its name (``keepdims`` keeps it with size 1); the result's Shape holds
    the first rank of each reduced group (the root of ``reduction_plan``).

    **Storage.** Values live in ``self._storage``, a
    :class:`~mesharray.storage.Storage`: a ``GatheredStorage`` (one ndarray at
    the controller) or a distributed storage (blocks in the workers,
    :mod:`mesharray.darray`). MeshArray only decides layouts (names, Shapes,
    axes, the broadcasting plans of :mod:`mesharray.elementwise`) and touches
    values only through the storage.

    Examples
    --------
    >>> import numpy as np
    >>> import mesharray as ma
    >>> a = ma.MeshArray(np.ones((2, 3), dtype="float32"), ["procs"])
    >>> a
    MeshArray(procs=2, local=(3,), dtype=float32)
    [[1. 1. 1.]
     [1. 1. 1.]]
    >>> a.shape, a.mesh_sizes, a.local_shape
    ((2, 3), {'procs': 2}, (3,))
    >>> b = ma.MeshArray([10, 20], "procs")
    >>> (a + b).tolist()
    [[11.0, 11.0, 11.0], [21.0, 21.0, 21.0]]
    >>> a.sum(axis="procs").tolist()
    [2.0, 2.0, 2.0]
    """

    __slots__ = ("_last_reduce", "__weakref__")  # (_shape and _storage: StoredArray's)
    # ndarray operands defer to us (ndarray + MeshArray -> MeshArray.__radd__)
    __array_priority__ = 20

    def __init__(self, values: Any, names: str | Sequence[str] | None = None, *, mesh_shape: Shape | None = None) -> None:
        if isinstance(values, MeshArray):
            values = values._values()
        array = np.asarray(values)
        if mesh_shape is not None:
            if not isinstance(mesh_shape, Shape):
                raise TypeError(f"mesh_shape must be a Shape, got {type(mesh_shape).__name__}")
            if names is not None and tuple(_as_names(names)) != tuple(mesh_shape.names):
                raise ValueError(f"names {tuple(_as_names(names))} differ from the names of mesh_shape {tuple(mesh_shape.names)}")
            shape = mesh_shape
            k = shape.ndim
            if array.ndim < k or tuple(array.shape[:k]) != tuple(shape.sizes):
                raise MeshShapeError(
                    f"values of shape {array.shape} do not fit mesh {dict(zip(shape.names, shape.sizes))}: "
                    f"the leading axes must have sizes {tuple(shape.sizes)}"
                )
        else:
            if names is None:
                raise TypeError("MeshArray() needs names (or a mesh_shape) for the leading mesh axes")
            names = _as_names(names)
            if len(names) > array.ndim:
                raise ValueError(
                    f"{len(names)} mesh dim names {tuple(names)} for values of only {array.ndim} dims (shape {array.shape})"
                )
            shape = Shape(dict(_unique_names(names, array.shape)))
        self._shape = shape
        self._storage = GatheredStorage(array)
        #: (axis, keepdims, (axes, result Shape)) of its last reduction (its Shape never changes)
        self._last_reduce: tuple | None = None

    # -- construction ---------------------------------------------------------------

    @classmethod
    def from_storage(cls, shape: Shape, storage: Storage) -> MeshArray:
        """A MeshArray over mesh ``shape`` whose values are held by ``storage``.

        For storage implementations (``GatheredStorage``, the distributed
        storage of :mod:`mesharray.darray`): ``storage`` implements
        :class:`~mesharray.storage.Storage`.
        """
        self = object.__new__(cls)
        self._shape = shape
        self._storage = storage
        self._last_reduce = None
        return self

    _from_parts = from_storage

    @property
    def storage(self) -> Storage:
        """What holds the values: a ``GatheredStorage`` (at the controller) or a distributed storage."""
        return self._storage

    @classmethod
    def from_results(cls, mesh_shape: Shape, values: Sequence[Any]) -> MeshArray:
        """Gathered results of a call, one per rank in row-major order of ``mesh_shape``.

        Numbers and bools become a numeric array of the mesh's shape; NumPy arrays
        of one shape and dtype are stacked (their axes become local axes); any
        other mix becomes an object array holding the values as they are.

        Examples
        --------
        >>> import numpy as np
        >>> import mesharray as ma
        >>> s = ma.Shape({"hosts": 1, "procs": 2})
        >>> ma.MeshArray.from_results(s, [1, 2]).dtype
        dtype('int64')
        >>> ma.MeshArray.from_results(s, [np.zeros(3), np.ones(3)]).shape
        (1, 2, 3)
        >>> ma.MeshArray.from_results(s, ["a", {"b": 1}]).tolist()
        [['a', {'b': 1}]]
        """
        if not isinstance(mesh_shape, Shape):
            raise TypeError(f"mesh_shape must be a Shape, got {type(mesh_shape).__name__}")
        if len(values) == 1 and mesh_shape.size == 1 and type(values[0]) in _NUMBER_TYPES:
            # one actor's number (``call()`` on a one-actor view) without the general path
            one = np.array(values[0])
            return cls._from_parts(mesh_shape, GatheredStorage(one.reshape(tuple(mesh_shape.sizes))))
        values = list(values)
        n = mesh_shape.size
        if len(values) != n:
            raise ValueError(f"{len(values)} values for a mesh of {n} ranks {mesh_shape!r}")
        sizes = tuple(mesh_shape.sizes)
        if all(map(_IS_NONE, values)):  # every endpoint returned None (the common no-result call)
            return cls._from_parts(mesh_shape, GatheredStorage(np.empty(sizes, dtype=object)))
        array: np.ndarray | None = None
        if values and all(type(v) in _NUMBER_TYPES or isinstance(v, (np.number, np.bool_)) for v in values):
            array = np.array(values)
            if array.ndim != 1:  # pragma: no cover - numbers always give a 1-d array
                array = None
        elif values and all(type(v) is np.ndarray for v in values):
            first = values[0]
            if all(v.shape == first.shape and v.dtype == first.dtype for v in values):
                array = np.stack(values)
        if array is None:
            array = np.empty(n, dtype=object)
            for i, v in enumerate(values):
                array[i] = v
        return cls._from_parts(mesh_shape, GatheredStorage(array.reshape(sizes + array.shape[1:])))

    # -- MeshTrait hooks --------------------------------------------------------------

    @property
    def _mesh_shape(self) -> Shape:
        return self._shape

    def _with_mesh_shape(self, shape: Shape) -> MeshArray:
        # rename / flatten / split: the same elements in the same row-major order
        if shape.size != self._shape.size:
            raise MeshShapeError(
                f"a mesh of {shape.size} ranks {shape!r} cannot hold the {self._shape.size} "
                f"elements of {self._shape!r}"
            )
        storage = self._storage.relayout(self._shape, None, shape)
        return MeshArray._from_parts(shape, storage)

    # -- description ------------------------------------------------------------------

    def _values(self) -> np.ndarray:
        return self._storage.to_numpy()

    @property
    def mesh_ndim(self) -> int:
        """Number of mesh dims (the leading axes)."""
        return self._shape.ndim

    @property
    def mesh_sizes(self) -> dict[str, int]:
        """``{name: size}`` of the mesh dims."""
        return dict(zip(self._shape.names, self._shape.sizes))

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of each element (the trailing axes)."""
        return tuple(self._storage.local_shape(self._shape.ndim))

    @property
    def local_ndim(self) -> int:
        """Number of local axes."""
        return len(self.local_shape)

    @property
    def shape(self) -> tuple[int, ...]:
        """NumPy shape: mesh sizes then local shape."""
        return tuple(self._shape.sizes) + self.local_shape

    @property
    def ndim(self) -> int:
        """NumPy ndim: ``mesh_ndim + local_ndim``."""
        return self._shape.ndim + self.local_ndim

    @property
    def size(self) -> int:  # type: ignore[override]
        """NumPy size: the number of scalar elements (``mesh_size() * prod(local_shape)``)."""
        return math.prod(self.shape)

    def mesh_size(self, dims: str | tuple[str, ...] | None = None) -> int:
        """Number of mesh positions: in total, along one dim, or over several dims.

        (``MeshTrait.size`` under another name, since ``size`` has NumPy's meaning here.)

        Examples
        --------
        >>> import numpy as np
        >>> import mesharray as ma
        >>> a = ma.MeshArray(np.zeros((2, 4, 3)), ["hosts", "procs"])
        >>> a.mesh_size(), a.mesh_size("procs"), a.size
        (8, 4, 24)
        """
        return mesh_size(self._shape, dims)

    @property
    def dtype(self) -> np.dtype:
        """The dtype of the values (``object`` for arbitrary Python values)."""
        return self._storage.dtype

    def __len__(self) -> int:
        """Size of the first axis (NumPy's meaning)."""
        shape = self.shape
        if not shape:
            raise TypeError("len() of unsized object")
        return shape[0]

    def __iter__(self) -> Iterator[Any]:
        """Sub-arrays (or elements) along the first axis (NumPy's meaning)."""
        for i in range(len(self)):
            yield self[i]

    def __bool__(self) -> bool:
        return bool(self._values())

    def __float__(self) -> float:
        """``float(a)`` of a one-element array (NumPy's rule; gathers a distributed one).

        >>> import mesharray as ma
        >>> float(ma.MeshArray([2.5], ["procs"]).sum())
        2.5
        """
        return float(self._values())

    def __int__(self) -> int:
        return int(self._values())

    def __complex__(self) -> complex:
        return complex(self._values())

    # -- conversion ------------------------------------------------------------------

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        v = self._values()
        if dtype is not None and np.dtype(dtype) != v.dtype:
            if copy is False:
                raise ValueError(f"cannot convert a MeshArray of dtype {v.dtype} to {np.dtype(dtype)} without a copy")
            return v.astype(dtype)
        return v.copy() if copy else v

    def to_numpy(self, copy: bool = False) -> np.ndarray:
        """The values as an ndarray of shape ``self.shape`` (shared unless ``copy``).

        Examples
        --------
        >>> import mesharray as ma
        >>> ma.MeshArray([[1, 2], [3, 4]], ["procs"]).to_numpy().shape
        (2, 2)
        """
        v = self._values()
        return v.copy() if copy else v

    def fetch(self) -> MeshArray:
        """The values brought to the controller: a gathered MeshArray (itself if already gathered).

        Examples
        --------
        >>> import mesharray as ma
        >>> ma.MeshArray([1, 2], ["procs"]).fetch().tolist()
        [1, 2]
        """
        if self._storage.kind == "gathered":
            return self
        return MeshArray._from_parts(self._shape, GatheredStorage(self._storage.to_numpy()))

    def tolist(self) -> Any:
        """Nested Python lists (Python scalars as leaves), like ``ndarray.tolist``."""
        return self._values().tolist()

    def astype(self, dtype: Any, copy: bool = True) -> MeshArray:
        """A MeshArray of another dtype (same mesh Shape)."""
        return MeshArray._from_parts(self._shape, self._storage.astype(dtype, copy))

    def copy(self) -> MeshArray:
        """A MeshArray with its own copy of the values (the Shape is immutable)."""
        return MeshArray._from_parts(self._shape, self._storage.copy())

    def __copy__(self) -> MeshArray:
        return self.copy()

    def __deepcopy__(self, memo: dict) -> MeshArray:
        import copy as _copy

        return MeshArray._from_parts(self._shape, GatheredStorage(_copy.deepcopy(self._values(), memo)))

    def __reduce__(self) -> str | tuple[Any, ...]:
        if self._storage.kind != "gathered":
            # sent to an endpoint, a distributed array arrives as the worker's own block
            return self._storage.__reduce__()
        return (_rebuild, (self._shape, self._values()))

    def reshape_local(self, *shape: Any) -> MeshArray:
        """Reshape each element's local axes (``-1`` infers one size); the mesh is unchanged.

        Examples
        --------
        >>> import numpy as np
        >>> import mesharray as ma
        >>> ma.MeshArray(np.zeros((2, 6)), ["procs"]).reshape_local(2, 3).shape
        (2, 2, 3)
        """
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        local = self.local_shape
        new_local = _infer_shape(local, shape)
        return MeshArray._from_parts(self._shape, self._storage.reshape_local(self._shape.ndim, new_local))

    # -- Monarch ValueMesh-style access ------------------------------------------------

    def item(self, *args: Any, **coords: Any) -> Any:
        """One element: by mesh coordinates (``a.item(hosts=0, procs=3)``) or NumPy-style.

        With keywords, every mesh dim must be given; the result is the element
        (a Python scalar, the stored object, or the local block as an ndarray).
        Without keywords it is ``ndarray.item(*args)``: a Python scalar.

        Examples
        --------
        >>> import numpy as np
        >>> import mesharray as ma
        >>> a = ma.MeshArray(np.arange(8).reshape(2, 4), ["hosts", "procs"])
        >>> a.item(hosts=1, procs=2)
        6
        >>> a[0, 1:2].item()
        1
        """
        if coords:
            if args:
                raise TypeError("item() takes either mesh coordinates by name or positions, not both")
            names = tuple(self._shape.names)
            for n in coords:
                if n not in names:
                    raise DimensionError(n, names)
            missing = tuple(n for n in names if n not in coords)
            if missing:
                raise ValueError(
                    f"item() needs a coordinate for every mesh dimension; missing {missing}; dimensions are {names}"
                )
            key = tuple(coords[n] for n in names)
            for n, k in zip(names, key):
                if not isinstance(k, (numbers.Integral, np.integer)) or isinstance(k, (bool, np.bool_)):
                    raise TypeError(f"coordinate {n}={k!r} must be an int")
            return _to_item(self[key])
        return self._values().item(*args)

    def items(self) -> Iterator[tuple[dict[str, int], Any]]:
        """``(coordinates, element)`` pairs in row-major order of the mesh.

        Examples
        --------
        >>> import mesharray as ma
        >>> list(ma.MeshArray([5, 6], ["procs"]).items())
        [({'procs': 0}, 5), ({'procs': 1}, 6)]
        """
        names = tuple(self._shape.names)
        v = self._values()
        for coords in np.ndindex(*self._shape.sizes):
            yield dict(zip(names, coords)), _to_item(v[coords])

    def values(self) -> list[Any]:
        """The elements in row-major order of the mesh (as :meth:`item` gives them)."""
        return [value for _, value in self.items()]

    # -- indexing ------------------------------------------------------------------------

    if TYPE_CHECKING:
        def __getitem__(self, key: Any) -> Any: ...
    else:
        #: ``__getitem__(key)``: NumPy indexing over mesh axes then local axes; a dict selects mesh dims by
        #: name. An index of ints repeated on arrays laid out alike runs its recipe (compiled: ``_core``'s
        #: op entries), anything else :meth:`_getitem`
        __getitem__ = array_getitem

    def _getitem(self, key: Any) -> Any:
        """NumPy indexing over mesh axes then local axes; a dict selects mesh dims by name."""
        if isinstance(key, dict):
            return self.slice(**key)
        mesh_key, local_key = split_key(key, self._shape.ndim, self.local_ndim, self)
        value = self._take(mesh_key, local_key)
        if type(key) is int or type(key) is tuple and all(type(k) is int for k in key):
            st: Any = self._storage
            maker = getattr(st, "item_recipe", None)  # (a distributed storage's: laid out by a key)
            if maker is not None:
                _keep_recipe(("[]", self._shape, st.lkey, st.rg, key), maker, self, local_key, value)
        return value

    def slice(self, **dims: Any) -> Any:
        """Select mesh dims by name: ``a.slice(procs=1, hosts=slice(0, 2))``.

        Each selector indexes its dim as a positional index would (an int removes
        the dim, a slice keeps it, arrays select like NumPy).

        Examples
        --------
        >>> import numpy as np
        >>> import mesharray as ma
        >>> a = ma.MeshArray(np.arange(8).reshape(2, 4), ["hosts", "procs"])
        >>> a.slice(procs=slice(None, None, -1), hosts=1).tolist()
        [7, 6, 5, 4]
        """
        mesh_key, local_key = split_key(self._named_key(dims), self._shape.ndim, self.local_ndim, self)
        return self._take(mesh_key, local_key)

    def _named_key(self, dims: dict) -> tuple:
        """``{name: selector}`` as the positional key over the mesh axes."""
        names = tuple(self._shape.names)
        key: list[Any] = [slice(None)] * len(names)
        for name, sel in dims.items():
            if name not in names:
                raise DimensionError(name, names)
            key[names.index(name)] = sel
        return tuple(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        """``a[key] = value`` in place, with the selection :meth:`__getitem__` makes.

        A MeshArray value aligns by name with the selection's mesh dims (and its
        local axes by position); other values broadcast NumPy-style. Keys mixing
        array indices in one part (mesh or local) with ints or arrays in the other,
        or several array indices on the local axes, are refused: NumPy would lay
        those out differently from the selection.

        Examples
        --------
        >>> import numpy as np
        >>> import mesharray as ma
        >>> a = ma.MeshArray(np.zeros((2, 3), dtype=int), ["hosts", "procs"])
        >>> a[{"procs": 1}] = 7
        >>> a[1, ::2] = ma.MeshArray([5, 6], ["procs"])
        >>> a.tolist()
        [[0, 7, 0], [5, 7, 6]]
        """
        if isinstance(key, dict):
            key = self._named_key(key)
        mesh_key, local_key = split_key(key, self._shape.ndim, self.local_ndim, self)
        mesh_adv = any(is_advanced(k) for k in mesh_key)
        local_adv = [k for k in local_key if is_advanced(k)]
        local_int = any(isinstance(k, int) for k in local_key)
        if (mesh_adv and (local_int or local_adv)) or (
            local_adv and (len(local_adv) > 1 or local_int or any(isinstance(k, int) for k in mesh_key))
        ):
            raise IndexError(
                "this key mixes array indices with ints or arrays in a way NumPy lays out differently "
                "from a MeshArray selection; assign through a selection made in two steps"
            )
        if isinstance(value, MeshArray):
            target = self._shape[mesh_key] if mesh_key else self._shape
            extra = [n for n in value.names if n not in target.names]
            if extra:
                raise MeshShapeError(
                    f"value with mesh dims {value.mesh_sizes} does not fit a selection with mesh dims "
                    f"{dict(zip(target.names, target.sizes))}"
                )
            # the selection's local shape, from a zero-stride stand-in (no allocation)
            stand_in = np.broadcast_to(np.empty((), dtype=np.bool_), self.local_shape)
            local = stand_in[local_key + (Ellipsis,)].shape if local_key else self.local_shape
            plan = Plan(tuple(target.names), tuple(target.sizes), target, tuple(local))
            value = plan.align(value, pad_local=len(value.local_shape) <= len(local))
        self._storage.setitem(mesh_key + local_key, value)

    def _take(self, mesh_key: tuple, local_key: tuple) -> Any:
        if mesh_key and not all(is_full_slice(k) for k in mesh_key):
            shape = self._shape[mesh_key]
        else:
            shape, mesh_key = self._shape, ()
        if all(is_full_slice(k) for k in local_key):
            local_key = ()
        storage = self._storage.take(mesh_key, local_key, shape)
        return _wrap(shape, storage)

    def transpose(self, *dims: str | int) -> MeshArray:
        """The mesh dims reordered (names or mesh axis numbers; none reverses them).

        Local axes stay where they are.

        Examples
        --------
        >>> import numpy as np
        >>> import mesharray as ma
        >>> a = ma.MeshArray(np.arange(6).reshape(2, 3), ["hosts", "procs"])
        >>> a.transpose("procs", "hosts").shape
        (3, 2)
        """
        names = tuple(self._shape.names)
        new = self._shape.transpose(*dims)
        perm = tuple(names.index(n) for n in new.names)
        return MeshArray._from_parts(new, self._storage.relayout(self._shape, perm, new))

    # -- ufuncs ----------------------------------------------------------------------------

    #: ``__array_ufunc__(ufunc, method, *inputs, **kwargs)``: a call whose signature has a recipe runs it
    #: (compiled: ``_core``'s op entries), anything else :meth:`_array_ufunc`
    __array_ufunc__ = array_ufunc

    # the arithmetic operators NumPy's mixin gives, each through its ufunc's recipe when there is one
    # (the mixin's method otherwise, which calls the ufunc: the same result, NumPy's dispatch skipped)
    __add__ = binary_operator(np.add, NDArrayOperatorsMixin.__add__, False)
    __radd__ = binary_operator(np.add, NDArrayOperatorsMixin.__radd__, True)
    __sub__ = binary_operator(np.subtract, NDArrayOperatorsMixin.__sub__, False)
    __rsub__ = binary_operator(np.subtract, NDArrayOperatorsMixin.__rsub__, True)
    __mul__ = binary_operator(np.multiply, NDArrayOperatorsMixin.__mul__, False)
    __rmul__ = binary_operator(np.multiply, NDArrayOperatorsMixin.__rmul__, True)
    __truediv__ = binary_operator(np.true_divide, NDArrayOperatorsMixin.__truediv__, False)
    __rtruediv__ = binary_operator(np.true_divide, NDArrayOperatorsMixin.__rtruediv__, True)
    __pow__ = binary_operator(np.power, NDArrayOperatorsMixin.__pow__, False)
    __rpow__ = binary_operator(np.power, NDArrayOperatorsMixin.__rpow__, True)

    def _array_ufunc(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        for x in inputs + tuple(kwargs.get("out", ())):
            if not isinstance(x, MeshArray) and _defers(x):
                return NotImplemented
        if method == "reduce":
            if len(inputs) != 1 or not isinstance(inputs[0], MeshArray):
                return NotImplemented
            a = inputs[0]
            axis = kwargs.pop("axis", 0)
            keepdims = kwargs.pop("keepdims", False)
            no_out(kwargs.pop("out", None), f"{ufunc.__name__}.reduce")
            return a._reduce(f"{ufunc.__name__}.reduce", ufunc.reduce, axis, keepdims, kwargs)
        if method != "__call__":
            return NotImplemented
        return _elementwise(ufunc, list(inputs), kwargs)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        method = REDUCTION_FUNCTIONS.get(func)
        if method is not None and args and isinstance(args[0], MeshArray):
            return getattr(args[0], method)(*args[1:], **kwargs)
        if func in BLOCKWISE:
            done = blockwise_function(func, args, kwargs)
            if done is not NotImplemented:
                return done
        if func is np.where and len(args) == 3 and not kwargs:
            # np.where(cond, x, y) is elementwise: operands broadcast as a ufunc's do
            plan = broadcast_plan(list(args), ())
            aligned = [plan.align(x) if isinstance(x, MeshArray) else x for x in args]
            return _wrap(plan.shape, GatheredStorage(np.asarray(np.where(*aligned))))
        if func in SAME_SHAPE_FUNCTIONS and args and isinstance(args[0], MeshArray):
            a = args[0]
            result = func(a._values(), *_plain(args[1:]), **_plain(kwargs))
            if isinstance(result, np.ndarray) and result.shape == a.shape:
                return MeshArray._from_parts(a._shape, GatheredStorage(result))
            return result
        # Anything else sees the plain values and returns plain NumPy results.
        return func(*_plain(args), **_plain(kwargs))

    # -- torch -----------------------------------------------------------------------------

    #: ``__torch_function__(func, types, args=(), kwargs=None)``: a call whose signature has a recipe runs
    #: it (compiled: ``_core``'s op entries), anything else :meth:`_torch_function`
    __torch_function__ = classmethod(torch_function)

    @classmethod
    def _torch_function(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        """torch functions, ``Tensor`` methods and ``torch.nn.functional`` on each rank's block.

        ``torch.relu(x)``, ``torch.matmul(x, w)``, ``F.softmax(x, dim=-1)``,
        ``x.detach()``, ``loss.backward()``: for a distributed array the
        function runs on each rank's block where it lives (its ``dim``
        arguments count the block's own axes), with mesh dims broadcast like
        NumPy's; blocks may require grad, and ``x.grad`` is a MeshArray. For a
        gathered array it runs on each position's element at the controller.
        """
        kwargs = kwargs or {}
        leaves: list = []
        try:  # a call of a signature seen before: its recipe (see _RECIPES)
            key: Any = (func, signature(args, leaves), signature(kwargs, leaves),
                        sys.modules["torch"].is_grad_enabled())
            recipe = _RECIPES.get(key)
        except TypeError:
            key = recipe = None
        if recipe is not None:
            return recipe(leaves)
        leaves = []
        targs = array_template(args, leaves)
        tkwargs = array_template(kwargs, leaves)
        plan = broadcast_plan(leaves, (), per_element=True)
        storage_cls = storage_class(leaves)
        if storage_cls is GatheredStorage:
            return _torch_gathered(func, plan, leaves, targs, tkwargs)
        value = storage_cls.torch_function(func, plan, leaves, targs, tkwargs)
        if key is not None:
            _keep_recipe(key, getattr(storage_cls, "torch_recipe", None), func, plan, leaves, targs, tkwargs, value)
        return value

    #: ``__getattr__(name)``: a Tensor attribute whose recipe is known runs it (compiled: ``_core``'s
    #: op entries), anything else :meth:`_getattr`
    if TYPE_CHECKING:
        def __getattr__(self, name: str) -> Any: ...
    else:
        __getattr__ = array_getattr

    def _getattr(self, name: str) -> Any:
        # only what normal lookup did not find: a torch-engine array's Tensor methods and properties
        if name.startswith("_"):
            raise AttributeError(f"'MeshArray' object has no attribute {name!r}")
        try:
            st = object.__getattribute__(self, "_storage")
        except AttributeError:
            raise AttributeError(f"'MeshArray' object has no attribute {name!r}") from None
        attr = getattr(st, "torch_attr", None)
        if attr is None:
            raise AttributeError(f"'MeshArray' object has no attribute {name!r}")
        key = (name, self._shape, st.lkey)
        recipe = _RECIPES.get(key)
        if recipe is not None:
            return recipe([self])
        plan = broadcast_plan([self], (), per_element=True)
        value = attr(self, name, plan)
        _keep_recipe(key, getattr(st, "attr_recipe", None), self, name, plan, value)
        return value

    #: a reduction's result (:class:`~.reductions.Reductions`): ``_wrap`` itself, no call between
    _result = staticmethod(_wrap)

    def roll(self, shift: int, axis: Any = None) -> MeshArray:
        """Elements shifted by ``shift`` along ``axis`` (NumPy's ``np.roll``); ``axis`` may be a mesh dim.

        Along a mesh dim of a distributed array the blocks move between the
        workers (position ``j`` gets the block of position ``j - shift``, wrapping
        around) and the controller sends only the plan; along a local axis each
        block is rolled where it lives. ``axis=None`` rolls the flattened values
        (gathered first, as NumPy defines it on the whole array).

        Examples
        --------
        >>> import mesharray as ma
        >>> ma.MeshArray([[0, 1, 2]], ["hosts", "procs"]).roll(1, axis="procs").tolist()
        [[2, 0, 1]]
        """
        if not isinstance(shift, (numbers.Integral, np.integer)) or isinstance(shift, bool):
            raise TypeError(f"roll takes one integer shift, got {shift!r}")
        st = self._storage
        if axis is not None and st.kind == "distributed":
            i = normalize_axes(single_axis(axis, "roll"), self)[0]
            return MeshArray.from_storage(self._shape, cast(WorkerStorage, st).roll(i, int(shift), self._shape.ndim))
        values = self.to_numpy()
        if axis is None:
            return MeshArray.from_storage(self._shape, GatheredStorage(np.roll(values, int(shift))))
        i = normalize_axes(single_axis(axis, "roll"), self)[0]
        return MeshArray.from_storage(self._shape, GatheredStorage(np.roll(values, int(shift), axis=i)))

    def to_mesh(self, procs: Any) -> MeshArray:
        """This array on the processes of ``procs`` (a ``ProcMesh``, or a slice of one).

        Position ``p`` of ``procs`` gets the block at the same coordinates here:
        mesh dims line up by name when every dim of this array is a dim of
        ``procs``, else positionally from the right (NumPy's rule), and a dim
        of size 1 (or a missing one) is broadcast — ``w[0:1].to_mesh(procs)``
        sends one block to every rank. The result has ``procs``' mesh dims and
        this array's local shape.

        A distributed array's blocks travel worker to worker (on a host one copy
        straight between the two processes, across hosts on the data plane);
        the controller sends only the plan. A gathered array is scattered from
        the controller. It works between disjoint process meshes (a trainer
        mesh and a generator mesh) as well as within one (a pipeline stage:
        ``acts[0].to_mesh(procs[1])``).

        Examples
        --------
        >>> trainers = ma.proc_mesh(procs=2); generators = ma.proc_mesh(procs=2)   # doctest: +SKIP
        >>> w = trainers.arange(3) + trainers.rank_array()                       # doctest: +SKIP
        >>> w.to_mesh(generators).fetch().tolist()                               # doctest: +SKIP
        [[[0, 1, 2], [1, 2, 3]]]
        >>> trainers.stop(); generators.stop()                                    # doctest: +SKIP
        """
        if not (hasattr(procs, "from_numpy") and isinstance(getattr(procs, "mesh_shape", None), Shape)):
            raise TypeError(f"to_mesh needs a ProcMesh (or a slice of one), got {type(procs).__name__}")
        dst = procs.mesh_shape
        idx = mesh_alignment(self, tuple(dst.names), tuple(dst.sizes))
        if self._storage.kind == "distributed":
            return MeshArray.from_storage(dst, cast(WorkerStorage, self._storage).to_mesh(idx, procs))
        local = self.local_shape
        values = self._values().reshape((-1,) + local)[idx.reshape(-1)]
        return procs.from_numpy(values.reshape(idx.shape + local))

    # -- display ----------------------------------------------------------------------------

    def __repr__(self) -> str:
        parts = [f"{n}={s}" for n, s in zip(self._shape.names, self._shape.sizes)]
        if self.local_shape:
            parts.append(f"local={self.local_shape}")
        parts.append(f"dtype={self.dtype}")
        head = f"MeshArray({', '.join(parts)})"
        if self._storage.kind != "gathered":
            return head + f" [{self._storage.kind}]"
        return head + "\n" + np.array2string(self._values(), separator=" ")

    def __str__(self) -> str:
        # Printing must not gather: a distributed array may be gigabytes spread
        # over many workers. Its str is its repr; fetch() shows the values.
        if self._storage.kind != "gathered":
            return repr(self) + " (fetch() to see the values)"
        return str(self._values())


# -----------------------------------------------------------------------------------
# helpers
# -----------------------------------------------------------------------------------

_NUMBER_TYPES = (bool, int, float, complex)
_IS_NONE = functools.partial(operator.is_, None)  # identity only: ``==`` on an ndarray is elementwise


def _rebuild(shape: Shape, values: np.ndarray) -> MeshArray:
    return MeshArray._from_parts(shape, GatheredStorage(values))


def _as_names(names: Any) -> list[str]:
    if isinstance(names, str):
        return [names]
    try:
        names = list(names)
    except TypeError:
        raise TypeError(f"names must be a str or a sequence of str, got {type(names).__name__}") from None
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"mesh dim names must be str, got {type(n).__name__}: {n!r}")
    return names


def _unique_names(names: list[str], shape: tuple[int, ...]) -> list[tuple[str, int]]:
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate mesh dim names in {tuple(names)}")
    return list(zip(names, shape))


def _to_item(x: Any) -> Any:
    """An element as Monarch's ValueMesh gives it: a Python scalar, the object, or a block."""
    if isinstance(x, MeshArray):
        return x.to_numpy()
    if isinstance(x, np.generic):
        return x.item()
    return x


def _defers(x: Any) -> bool:
    """Whether ``x`` wants to handle the ufunc itself (an array type NumPy does not own)."""
    if isinstance(x, (np.ndarray, np.generic)):
        return False
    return hasattr(type(x), "__array_ufunc__")


def _plain(x: Any) -> Any:
    if isinstance(x, MeshArray):
        return x._values()
    if isinstance(x, tuple):
        return tuple(_plain(v) for v in x)
    if isinstance(x, list):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def _infer_shape(old: tuple[int, ...], new: Sequence[Any]) -> tuple[int, ...]:
    """``new`` with its one ``-1`` inferred, checked to hold as many elements as ``old``."""
    for x in new:
        if not isinstance(x, (numbers.Integral, np.integer)) or isinstance(x, (bool, np.bool_)):
            raise TypeError(f"shape entries must be ints, got {type(x).__name__}: {x!r}")
    dims = [int(x) for x in new]
    total = math.prod(old)
    unknown = [i for i, x in enumerate(dims) if x == -1]
    known = math.prod(x for x in dims if x != -1)
    if len(unknown) > 1 or any(x < -1 for x in dims):
        raise ValueError(f"invalid local shape {tuple(dims)}: at most one -1 and no other negative size")
    if unknown and known and total % known == 0:
        dims[unknown[0]] = total // known
    if unknown and dims[unknown[0]] == -1 or math.prod(dims) != total:
        raise MeshShapeError(f"cannot reshape local shape {tuple(old)} into {tuple(int(x) for x in new)}")
    return tuple(dims)


# -- operations whose results become MeshArrays -------------------------------------------


def _elementwise(ufunc: np.ufunc, inputs: list, kwargs: dict) -> Any:
    if not kwargs:  # a call of a signature seen before: its recipe (see _RECIPES)
        try:
            torch = sys.modules.get("torch")  # (torch-engine results require grad under grad mode only)
            key: Any = (ufunc, tuple([signature(x, None) for x in inputs]), torch is None or torch.is_grad_enabled())
            recipe = _RECIPES.get(key)
        except TypeError:
            key = recipe = None
        if recipe is not None:
            return recipe(inputs)
        return _elementwise_planned(ufunc, inputs, kwargs, key)
    return _elementwise_planned(ufunc, inputs, kwargs)


def _elementwise_planned(ufunc: np.ufunc, inputs: list, kwargs: dict, key: Any = None) -> Any:
    out = kwargs.pop("out", ())
    if out is None:
        out = ()
    where = kwargs.get("where")
    plan = broadcast_plan(inputs + ([where] if isinstance(where, MeshArray) else []), tuple(out),
                          ufunc.signature is not None)
    storage_cls = storage_class(inputs + list(out))
    if out:
        kwargs["out"] = tuple(out)
    results = storage_cls.elementwise(ufunc, plan, inputs, kwargs)
    if key is not None and len(results) == 1:
        _keep_recipe(key, getattr(storage_cls, "ufunc_recipe", None), ufunc, plan, inputs, kwargs,
                     _wrap(plan.shape, results[0]))
    wrapped = []
    for i, r in enumerate(results):
        if out and out[i] is not None:
            # written in place: give back what the caller passed (NumPy returns `out`)
            wrapped.append(out[i])
        else:
            wrapped.append(_wrap(plan.shape, r))
    return wrapped[0] if len(wrapped) == 1 else tuple(wrapped)


#: recipes by call signature: what a storage class (the distributed one, :mod:`mesharray.darray.dispatch`)
#: gave for repeating an op whose operands are laid out the same way, without planning it again
_RECIPES: dict = {}
entry_setup(_RECIPES)
def _keep_recipe(key: Any, maker: Any, *args: Any) -> None:
    """Keep what ``maker(*args)`` gives (None: the op cannot be repeated from its signature) under ``key``."""
    if maker is None:
        return
    recipe = maker(*args)
    if recipe is not None:
        if len(_RECIPES) >= 4096:
            _RECIPES.clear()
        _RECIPES[key] = recipe


def _torch_gathered(func: Any, plan: Plan, leaves: list, args: Any, kwargs: dict) -> Any:
    """A torch function over gathered MeshArrays: run on each position's elements, results stacked."""
    import torch  # torch called us: it is imported

    sizes = tuple(plan.sizes)
    aligned = [np.broadcast_to(plan.align(x, pad_local=False), sizes + x.local_shape) for x in leaves]
    results = []
    for pos in np.ndindex(*sizes):
        vals = [torch.as_tensor(np.array(a[pos])) for a in aligned]
        results.append(func(*fill(args, vals), **fill(kwargs, vals)))
    if results and all(isinstance(r, torch.Tensor) for r in results):
        return _wrap(plan.shape, GatheredStorage(
            np.stack([r.detach().cpu().numpy() for r in results]).reshape(sizes + tuple(results[0].shape))))
    return MeshArray.from_results(plan.shape, results)

