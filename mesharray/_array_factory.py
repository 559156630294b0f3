"""``ArrayFactory``: the methods a ``ProcMesh`` inherits to make distributed ``MeshArray``s.

Each method makes an array whose leading axes are the mesh's dims and whose
per-rank blocks live in the workers (on the tensor engine ``engine``). See
``mesharray/_distributed.py`` for how the blocks are kept and computed on.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

__all__ = ["ArrayFactory", "allgather", "broadcast_from", "reduce_scatter"]


def _local_shape(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, (numbers.Integral, np.integer)) and not isinstance(shape, bool):
        shape = (int(shape),)
    if not isinstance(shape, (tuple, list)):
        raise TypeError(f"local shape must be an int or a tuple of ints, got {type(shape).__name__}")
    out = []
    for s in shape:
        if not isinstance(s, (numbers.Integral, np.integer)) or isinstance(s, bool):
            raise TypeError(f"local shape entries must be ints, got {type(s).__name__}: {s!r}")
        if s < 0:
            raise ValueError(f"local shape entries must be >= 0, got {tuple(shape)}")
        out.append(int(s))
    return tuple(out)


def _dtype(dtype: Any) -> np.dtype:
    try:
        return np.dtype(dtype)
    except TypeError:
        raise TypeError(f"data type {dtype!r} not understood") from None


class ArrayFactory:
    """Makers of distributed arrays over the ranks of this (view of a) process mesh.

    Every method takes the *local* shape (each rank's block); the array's shape
    is ``mesh sizes + local shape``. ``engine`` is a tensor engine name
    (``"numpy"``, ``"torch"``, ``"cuda"``, ...; ``"auto"`` picks the best
    device of each worker). ``collective`` chooses the backend of reductions
    across ranks: ``None`` (MPI under mpirun, else shared memory) or
    ``"torch"`` (torch.distributed, for torch engines).

    Examples
    --------
    >>> import mesharray as ma
    >>> with ma.proc_mesh(hosts=1, procs=2) as procs:            # doctest: +SKIP
    ...     x = procs.ones((4,), dtype="float32")
    ...     (x * procs.rank_array() + 1).sum(axis="procs").fetch().tolist()
    [[3.0, 3.0, 3.0, 3.0]]
    """

    def _make(self, kind: str, shape: Any, dtype: Any, engine: str, extra: Any = None,
              collective: str | None = None):
        from ._distributed import make

        return make(self, kind, _local_shape(shape), _dtype(dtype), engine, extra, collective)

    def zeros(self, shape: Any = (), dtype: Any = "float64", *, engine: str = "numpy", collective: str | None = None):
        """A distributed array of zeros with local shape ``shape``.

        >>> procs.zeros((3,)).shape      # doctest: +SKIP
        (1, 4, 3)
        """
        return self._make("zeros", shape, dtype, engine, None, collective)

    def ones(self, shape: Any = (), dtype: Any = "float64", *, engine: str = "numpy", collective: str | None = None):
        """A distributed array of ones.

        >>> procs.ones(2, dtype="int32").fetch().tolist()   # doctest: +SKIP
        """
        return self._make("ones", shape, dtype, engine, None, collective)

    def empty(self, shape: Any = (), dtype: Any = "float64", *, engine: str = "numpy", collective: str | None = None):
        """A distributed array whose blocks are allocated but not initialised.

        >>> procs.empty((1 << 20,), "float32")   # doctest: +SKIP
        """
        return self._make("empty", shape, dtype, engine, None, collective)

    def full(self, shape: Any, fill_value: Any, dtype: Any = None, *, engine: str = "numpy",
             collective: str | None = None):
        """A distributed array filled with ``fill_value``.

        >>> procs.full((2,), 7).fetch()   # doctest: +SKIP
        """
        if dtype is None:
            dtype = np.asarray(fill_value).dtype
        if not np.isscalar(fill_value):
            raise TypeError(f"fill_value must be a scalar, got {type(fill_value).__name__}")
        return self._make("full", shape, dtype, engine, fill_value, collective)

    def arange(self, shape: Any, dtype: Any = "int64", *, engine: str = "numpy", collective: str | None = None):
        """Each rank's block is ``arange(prod(shape)).reshape(shape)``.

        >>> procs.arange(3).fetch()   # doctest: +SKIP
        """
        return self._make("arange", shape, dtype, engine, None, collective)

    def rand(self, shape: Any = (), dtype: Any = "float64", *, seed: int | None = None, engine: str = "numpy",
             collective: str | None = None):
        """Uniform [0, 1) blocks; with ``seed``, rank r draws from ``seed + r`` (reproducible).

        >>> procs.rand((2,), seed=0)   # doctest: +SKIP
        """
        dt = _dtype(dtype)
        if dt.kind != "f":
            raise TypeError(f"rand needs a floating dtype, got {dt}")
        return self._make("rand", shape, dt, engine, seed, collective)

    def rank_array(self, dtype: Any = "int64", *, engine: str = "numpy", collective: str | None = None):
        """Each rank's global rank, as a distributed array with no local axes.

        >>> procs.rank_array().fetch().tolist()   # doctest: +SKIP
        [[0, 1, 2, 3]]
        """
        return self._make("rank", (), dtype, engine, None, collective)

    def from_numpy(self, array: Any, *, engine: str = "numpy", collective: str | None = None):
        """Scatter ``array``: its leading axes are the mesh dims, the rest each rank's block.

        >>> procs.from_numpy(np.arange(8).reshape(1, 4, 2))   # doctest: +SKIP
        """
        from ._distributed import scatter

        arr = np.asarray(array)
        return scatter(self, arr, engine, collective)

    def apply(self, fn: Any, *arrays: Any):
        """Run ``fn(*blocks)`` on each rank with its blocks of ``arrays``; a new distributed array.

        Non-distributed arguments are passed as they are.

        >>> procs.apply(lambda x: x[::-1], procs.arange(3))   # doctest: +SKIP
        """
        if not callable(fn):
            raise TypeError(f"apply needs a callable, got {type(fn).__name__}")
        from ._distributed import apply

        return apply(self, fn, arrays)


# --- collectives over mesh dims of distributed arrays (mesharray.allgather, ...) ---------


def allgather(a: Any, dims: Any):
    """Every rank gets the blocks of all ranks of its group over mesh ``dims``, stacked.

    The result keeps ``a``'s mesh dims; its local shape is
    ``(group size,) + a.local_shape`` (members in row-major order of ``dims``).
    Runs one allgather per group of ``reduction_plan(a's shape, dims)``.

    Examples
    --------
    >>> import mesharray as ma
    >>> ma.allgather(procs.rank_array(), "procs").fetch().tolist()   # doctest: +SKIP
    [[[0, 1], [0, 1]]]
    """
    from ._distributed import _group_op

    return _group_op(a, dims, "allgather", None)


def broadcast_from(a: Any, dims: Any, root: int = 0):
    """Every rank gets the block of member ``root`` (negative counts from the end) of its group over ``dims``.

    Examples
    --------
    >>> import mesharray as ma
    >>> ma.broadcast_from(procs.rank_array(), "procs", root=1).fetch().tolist()   # doctest: +SKIP
    [[1, 1]]
    """
    from ._distributed import _group_op

    return _group_op(a, dims, "broadcast", root)


def reduce_scatter(a: Any, dims: Any, op: str = "sum"):
    """Reduce across each group over mesh ``dims``; member i keeps the i-th part of the first local axis.

    Examples
    --------
    >>> import mesharray as ma
    >>> ma.reduce_scatter(procs.ones((4,)), "procs").local_shape   # doctest: +SKIP
    (2,)
    """
    from ._distributed import _group_op

    return _group_op(a, dims, "reduce_scatter", op)


for _fn in (allgather, broadcast_from, reduce_scatter):
    _fn.__module__ = "mesharray"  # public as mesharray.<name> (this module is internal)
del _fn
