"""The reductions of a ``MeshArray`` (``sum``, ``mean``, ``var``, ``argmax``, ...), a mixin of it.

Each takes NumPy's signature and hands the work to the array's storage
(``Storage.reduce``: a gathered array reduces its values here; a distributed
one runs the reduction where its blocks live, as collectives over the mesh
axes and a local reduction of each block). What is computed once per request
is kept: the axes and the result's mesh ``Shape`` depend only on the array's
``Shape``, its ``ndim`` and the request (``_REDUCED``), so a loss reduced in a
loop looks them up. ``var`` and ``std`` of a distributed array combine each
block's mean and squared deviations (Chan et al.), and ``argmin``/``argmax``
along a mesh axis run as two collectives; neither moves blocks to the
controller.
"""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ._core import Shape
from .errors import DimensionError
from .storage import Storage, WorkerStorage

if TYPE_CHECKING:
    from .array import MeshArray

__all__ = ["Reductions", "no_out", "normalize_axes", "single_axis"]


class Reductions:
    """``MeshArray``'s reductions: what its storage computes, with NumPy's signatures.

    Its methods read the array's ``_shape``, ``_storage`` and ``_last_reduce``
    and return through ``_result`` (a ``MeshArray``, or the bare element when no
    axis is left).
    """

    __slots__ = ()

    if TYPE_CHECKING:  # (MeshArray's: what these methods read)
        _shape: Shape
        _storage: Storage
        _last_reduce: tuple | None

        @property
        def ndim(self) -> int: ...
        @property
        def local_ndim(self) -> int: ...
        @property
        def dtype(self) -> np.dtype: ...
        @property
        def shape(self) -> tuple[int, ...]: ...
        def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray: ...
        def astype(self, dtype: Any, copy: bool = True) -> MeshArray: ...
        def _result(self, shape: Shape, storage: Storage) -> Any: ...

    def _reduce(self, op: str, func: Any, axis: Any, keepdims: bool, kwargs: dict) -> Any:
        keepdims = bool(keepdims)
        last = self._last_reduce
        if last is not None and last[0] is axis and last[1] is keepdims:
            hit = last[2]  # the same request on the same array (a loss in a loop; the same axis object)
        else:
            # the axes and the result's mesh Shape depend only on the Shape, ndim and the request:
            # a reduction in a loop (a loss) looks them up (an axis of exactly str, int or a tuple
            # of those: True == 1 must still be refused, and lists are not hashable)
            t = type(axis)
            key = (self._shape, self.ndim, axis, keepdims) if axis is None or t is str or t is int or (
                t is tuple and all(type(a) is str or type(a) is int for a in axis)) else None
            hit = _REDUCED.get(key) if key is not None else None
            if hit is None:
                axes = normalize_axes(axis, self)
                m = self._shape.ndim
                reduced_mesh = range(m) if axes is None else [i for i in axes if i < m]
                hit = (axes, self._reduced_shape(set(reduced_mesh), keepdims))
                if key is not None:
                    if len(_REDUCED) >= 512:
                        _REDUCED.clear()
                    _REDUCED[key] = hit
            if key is not None:
                self._last_reduce = (axis, keepdims, hit)  # type: ignore[misc]  # (a slot of MeshArray)
        storage = self._storage.reduce(op, func, hit[0], keepdims, kwargs)
        return self._result(hit[1], storage)

    def _reduced_shape(self, mesh_axes: set[int], keepdims: bool) -> Shape:
        if not mesh_axes:
            return self._shape
        sizes = tuple(self._shape.sizes)
        if any(sizes[i] == 0 for i in mesh_axes):
            # an empty group has no first rank to stand for it
            names = tuple(self._shape.names)
            kept = [(n, 1 if i in mesh_axes else s) for i, (n, s) in enumerate(zip(names, sizes)) if keepdims or i not in mesh_axes]
            return Shape(dict(kept))
        key = tuple((slice(0, 1) if keepdims else 0) if i in mesh_axes else slice(None) for i in range(len(sizes)))
        return self._shape[key]

    def sum(self, axis: Any = None, dtype: Any = None, out: Any = None, keepdims: bool = False, **kwargs: Any) -> Any:
        """Sum over ``axis`` (int, mesh dim name, tuple of either, or None for all).

        Examples
        --------
        >>> import numpy as np
        >>> import mesharray as ma
        >>> a = ma.MeshArray(np.arange(8).reshape(2, 4), ["hosts", "procs"])
        >>> a.sum(axis="procs").tolist(), a.sum()
        ([6, 22], np.int64(28))
        """
        no_out(out, "sum")
        return self._reduce("sum", np.sum, axis, keepdims, kwargs if dtype is None else _kw(kwargs, dtype=dtype))

    def prod(self, axis: Any = None, dtype: Any = None, out: Any = None, keepdims: bool = False, **kwargs: Any) -> Any:
        """Product over ``axis`` (see :meth:`sum`)."""
        no_out(out, "prod")
        return self._reduce("prod", np.prod, axis, keepdims, kwargs if dtype is None else _kw(kwargs, dtype=dtype))

    def mean(self, axis: Any = None, dtype: Any = None, out: Any = None, keepdims: bool = False, **kwargs: Any) -> Any:
        """Arithmetic mean over ``axis`` (see :meth:`sum`)."""
        no_out(out, "mean")
        return self._reduce("mean", np.mean, axis, keepdims, kwargs if dtype is None else _kw(kwargs, dtype=dtype))

    def std(self, axis: Any = None, dtype: Any = None, out: Any = None, ddof: float = 0, keepdims: bool = False, **kwargs: Any) -> Any:
        """Standard deviation over ``axis`` (``ddof`` as NumPy; see :meth:`var`)."""
        no_out(out, "std")
        if self._storage.kind == "distributed" and not kwargs and dtype is None:
            return np.sqrt(self._spread(axis, ddof, keepdims))
        return self._reduce("std", np.std, axis, keepdims, _kw(kwargs, dtype=dtype, ddof=ddof or None))

    def var(self, axis: Any = None, dtype: Any = None, out: Any = None, ddof: float = 0, keepdims: bool = False, **kwargs: Any) -> Any:
        """Variance over ``axis`` (``ddof`` as NumPy; see :meth:`sum`).

        On a distributed array it is computed where the blocks live: each rank
        reduces its block to its mean and sum of squared deviations, and the
        parts combine as Chan et al. do (two collectives over the mesh axes:
        the mean, then the deviations from it; numerically stable, unlike
        ``E[x²] − E[x]²``); nothing but the result reaches the controller.

        Examples
        --------
        >>> import numpy as np
        >>> import mesharray as ma
        >>> a = ma.MeshArray(np.array([[1.0, 3.0], [2.0, 6.0]]), ["hosts", "procs"])
        >>> a.var(axis="procs").tolist(), float(a.std())
        ([1.0, 4.0], 1.8708286933869707)
        """
        no_out(out, "var")
        if self._storage.kind == "distributed" and not kwargs and dtype is None:
            return self._spread(axis, ddof, keepdims)
        return self._reduce("var", np.var, axis, keepdims, _kw(kwargs, dtype=dtype, ddof=ddof or None))

    def _spread(self, axis: Any, ddof: float, keepdims: bool) -> Any:
        """The variance of a distributed array, computed where its blocks live (see :meth:`var`).

        Chan, Golub and LeVeque's combination of parts: each block's mean and
        sum of squared deviations ``M2`` over its local axes (no message), then
        ``M2 = Σ M2ₚ + Σ nₚ (meanₚ − mean)²`` over the mesh axes, where the
        mean is itself a collective; every subtraction comes before a square.
        """
        x = self if self.dtype.kind in "fc" else self.astype("float64")
        axes = normalize_axes(axis, x)
        full = tuple(range(x.ndim)) if axes is None else axes
        m = self._shape.ndim
        mesh_axes = tuple(i for i in full if i < m)
        local_axes = tuple(i for i in full if i >= m)
        n = math.prod(x.shape[i] for i in full)
        n_part = math.prod(x.shape[i] for i in local_axes)
        if local_axes:
            mean_p = x.mean(axis=local_axes, keepdims=True)  # each block's own: no message
            m2_p = _abs2(x - mean_p).sum(axis=local_axes, keepdims=True)
        else:
            mean_p, m2_p = x, None
        if mesh_axes:
            dev = _abs2(mean_p - mean_p.mean(axis=mesh_axes, keepdims=True)) * n_part
            m2_p = dev if m2_p is None else m2_p + dev
        assert m2_p is not None
        ss = m2_p.sum(axis=full, keepdims=keepdims)  # (local axes are of size 1 by now)
        return ss / (n - ddof) if n - ddof > 0 else ss * np.nan

    # min, max, any and all (like prod and mean above): one method per NumPy reduction with
    # NumPy's signature, written out for autodoc, type checkers and readers; _reduce does the work
    def min(self, axis: Any = None, out: Any = None, keepdims: bool = False, **kwargs: Any) -> Any:
        """Minimum over ``axis`` (see :meth:`sum`)."""
        no_out(out, "min")
        return self._reduce("min", np.min, axis, keepdims, kwargs)

    def max(self, axis: Any = None, out: Any = None, keepdims: bool = False, **kwargs: Any) -> Any:
        """Maximum over ``axis`` (see :meth:`sum`)."""
        no_out(out, "max")
        return self._reduce("max", np.max, axis, keepdims, kwargs)

    def any(self, axis: Any = None, out: Any = None, keepdims: bool = False, **kwargs: Any) -> Any:
        """Whether any element is true, over ``axis`` (see :meth:`sum`)."""
        no_out(out, "any")
        return self._reduce("any", np.any, axis, keepdims, kwargs)

    def all(self, axis: Any = None, out: Any = None, keepdims: bool = False, **kwargs: Any) -> Any:
        """Whether all elements are true, over ``axis`` (see :meth:`sum`)."""
        no_out(out, "all")
        return self._reduce("all", np.all, axis, keepdims, kwargs)

    def argmin(self, axis: Any = None, out: Any = None, *, keepdims: bool = False) -> Any:
        """Index of the minimum along one ``axis`` (int or name), or of the flattened array.

        Examples
        --------
        >>> import mesharray as ma
        >>> ma.MeshArray([[3, 1], [0, 2]], ["hosts", "procs"]).argmin(axis="procs").tolist()
        [1, 0]
        """
        no_out(out, "argmin")
        ax = single_axis(axis, "argmin")
        if self._storage.kind == "distributed" and ax is not None:
            i = normalize_axes(ax, self)[0]  # type: ignore[index]
            if i < self._shape.ndim:
                return self._arg_along_mesh(i, "min", keepdims)
        return self._reduce("argmin", np.argmin, ax, keepdims, {})

    def argmax(self, axis: Any = None, out: Any = None, *, keepdims: bool = False) -> Any:
        """Index of the maximum along one ``axis`` (int or name), or of the flattened array.

        Along a mesh axis of a distributed array it runs as collectives where the
        blocks live (the extreme value, then the lowest position holding it:
        NumPy's first-occurrence rule); nothing but the indices reaches the controller.
        """
        no_out(out, "argmax")
        ax = single_axis(axis, "argmax")
        if self._storage.kind == "distributed" and ax is not None:
            i = normalize_axes(ax, self)[0]  # type: ignore[index]
            if i < self._shape.ndim:
                return self._arg_along_mesh(i, "max", keepdims)
        return self._reduce("argmax", np.argmax, ax, keepdims, {})


    def _arg_along_mesh(self, axis: int, kind: str, keepdims: bool) -> Any:
        """argmin/argmax along mesh axis ``axis`` of a distributed array, as collectives."""
        best = self.min(axis=axis, keepdims=True) if kind == "min" else self.max(axis=axis, keepdims=True)
        n = self._shape.sizes[axis]
        # each position's index along ``axis``, as a distributed array of this one's mesh
        pos = cast(WorkerStorage, self._storage).positions(self._shape, axis)
        if self.dtype.kind == "f":
            # NumPy's rule: the first NaN wins (NaN != NaN marks those positions)
            hit = np.logical_or(np.equal(self, best), np.not_equal(self, self))
        else:
            hit = np.equal(self, best)
        # the position where it hits, else n: the smallest is the first occurrence
        cand = (pos - n) * hit.astype("int64") + n
        return cand.min(axis=axis, keepdims=keepdims)


# -- helpers ------------------------------------------------------------------------------

def _abs2(x: Any) -> Any:
    """``|x|²`` (``x * x`` for reals)."""
    return np.square(np.abs(x)) if x.dtype.kind == "c" else x * x


def _kw(kwargs: dict, **extra: Any) -> dict:
    out = dict(kwargs)
    for k, v in extra.items():
        if v is not None:
            out[k] = v
    return out


def no_out(out: Any, what: str) -> None:
    if out is not None:
        raise TypeError(f"{what}() of a MeshArray does not take out=; assign the result instead")


def single_axis(axis: Any, what: str) -> Any:
    if isinstance(axis, (tuple, list)):
        raise TypeError(f"{what}() takes one axis (an int or a mesh dim name) or None, got {axis!r}")
    return axis


def _axis_labels(a: Reductions) -> tuple:
    return tuple(a._shape.names) + tuple(f"local:{i}" for i in range(a.local_ndim))


#: (mesh Shape, ndim, axis, keepdims) -> (the axes of normalize_axes, the reduced mesh Shape)
_REDUCED: dict[tuple, tuple] = {}


def normalize_axes(axis: Any, a: Reductions) -> tuple[int, ...] | None:
    """``axis`` (int, name, tuple/list of either, or None) as sorted axes of the full shape."""
    if axis is None:
        return None
    single = not isinstance(axis, (tuple, list))
    items = (axis,) if single else tuple(axis)
    names = tuple(a._shape.names)
    ndim = a.ndim
    out = []
    for ax in items:
        if isinstance(ax, str):
            if ax not in names:
                raise DimensionError(ax, names)
            i = names.index(ax)
        elif isinstance(ax, (numbers.Integral, np.integer)) and not isinstance(ax, (bool, np.bool_)):
            i = int(ax)
            if not -ndim <= i < ndim:
                raise DimensionError(i, _axis_labels(a), what="array")
            i %= ndim
        else:
            raise TypeError(f"axis must be an int, a mesh dim name or a tuple of them, got {type(ax).__name__}: {ax!r}")
        out.append(i)
    if len(set(out)) != len(out):
        raise ValueError(f"duplicate value in 'axis': {axis!r}")
    if single:
        return (out[0],)
    return tuple(sorted(out))
