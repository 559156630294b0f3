"""Making distributed arrays, and the collectives over their mesh dims.

:func:`make`, :func:`scatter` and :func:`apply` are what ``ProcMesh.zeros``,
``ones``, ``full``, ``arange``, ``rand``, ``rank_array``, ``from_numpy`` and
``apply`` run (this package installs them into :mod:`mesharray.proc` when it
is imported: distributed arrays sit above process meshes, so ``proc`` never
imports them). :func:`allgather`, :func:`broadcast_from` and
:func:`reduce_scatter` are public as ``mesharray.allgather`` and so on.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

import mesharray.darray.instructions as I

from ..array import MeshArray
from ..engines import resolve_engine_name
from ..errors import DimensionError, MeshShapeError
from ..proc import ProcMesh
from ..transport import framing
from .context import data_context, existing_context
from .placement import move_blocks
from .storage import DistributedStorage, distributed

__all__ = ["allgather", "apply", "broadcast_from", "make", "reduce_scatter", "scatter", "sync"]


def _ranks(procs: ProcMesh) -> np.ndarray:
    shape = procs.mesh_shape
    return np.asarray(shape.ranks(), dtype=np.int64).reshape(tuple(shape.sizes))


def make(procs: ProcMesh, kind: str, local_shape: tuple[int, ...], dtype: np.dtype, engine: str,
         extra: Any = None, collective: str | None = None) -> MeshArray:
    """A new distributed array over ``procs``: each rank makes its block (``kind``: see :class:`~.instructions.New`)."""
    ctx = data_context(procs)
    ranks = _ranks(procs)
    engine = resolve_engine_name(engine)
    bid = ctx.new_id()
    ctx.send(ranks.ravel().tolist(), [I.New(bid, kind, tuple(local_shape), np.dtype(dtype).name, engine, extra)])
    st = DistributedStorage(ctx, bid, ranks, tuple(local_shape), dtype, engine, None,
                            collective)
    return MeshArray.from_storage(procs.mesh_shape, st)


def scatter(procs: ProcMesh, arr: np.ndarray, engine: str, collective: str | None = None) -> MeshArray:
    """``arr``'s leading axes are the mesh dims: each rank gets its block (waits until every rank has it)."""
    ctx = data_context(procs)
    shape = procs.mesh_shape
    sizes = tuple(shape.sizes)
    if arr.shape[: len(sizes)] != sizes:
        raise MeshShapeError(
            f"from_numpy needs an array whose leading axes are the mesh sizes {dict(zip(shape.names, sizes))}; "
            f"got shape {arr.shape}"
        )
    engine = resolve_engine_name(engine)
    ranks = _ranks(procs)
    bid = ctx.new_id()
    futs = []
    for pos in np.ndindex(*sizes):
        r = int(ranks[pos])
        put = I.Put(bid, I.Value(np.asarray(arr[pos], order="C")), engine)
        futs.append(ctx.call_one(r, [put]))
    for f in futs:
        f.get()
    st = DistributedStorage(ctx, bid, ranks, arr.shape[len(sizes):], arr.dtype, engine, None,
                            collective)
    return MeshArray.from_storage(shape, st)


def apply(procs: ProcMesh, fn: Callable[..., Any], arrays: Sequence[Any]) -> MeshArray:
    """Run ``fn`` on each rank's blocks of ``arrays``; the results form a new distributed array."""
    dist = [a for a in arrays if distributed(a) is not None]
    if not dist:
        raise TypeError("apply needs at least one distributed MeshArray")
    st0 = dist[0].storage
    if procs is not None:
        # the mesh it was called on decides where fn runs: the blocks move there if elsewhere
        ctx, where, shape = data_context(procs), _ranks(procs), procs.mesh_shape
    else:
        ctx, where, shape = st0.ctx, st0.ranks, dist[0].mesh_shape
    moved: dict = {}
    for a in dist:
        st = a.storage
        if st.ranks.shape != where.shape:
            raise MeshShapeError(
                f"apply needs distributed arrays of the mesh layout it runs on ({dict(zip(shape.names, shape.sizes))}); "
                f"got mesh dims {a.mesh_sizes}"
            )
        if st.ctx is not ctx or not (st.ranks == where).all():
            # its blocks are on other ranks (or another process mesh): they move first
            moved[id(a)] = move_blocks(st, st.ranks, ctx, where)
    operands: list[I.Operand] = []
    for a in arrays:
        st = moved.get(id(a), distributed(a))
        operands.append(I.BlockRef(st.bid) if st is not None else I.Value(a))
    framing.dumps((fn, [o for o in operands if isinstance(o, I.Value)]))  # (SerializationError here, not later)
    bid = ctx.new_id()
    ranks = sorted(set(where.ravel().tolist()))
    ctx.send(ranks, [I.Apply(bid, fn, operands)])
    # the result's local shape and dtype are known only after running: ask one rank
    # (this also raises the error of a failing fn)
    local, dtype, rg = ctx.meta(ranks[0], bid)
    st = DistributedStorage(ctx, bid, np.array(where, dtype=np.int64), tuple(local), dtype, st0.engine, None,
                            st0.collective)
    st.rg = rg  # (what fn gave; gradients through it stay in each rank's graph)
    return MeshArray.from_storage(shape, st)


def sync(procs: ProcMesh) -> None:
    """Wait until every rank of ``procs``' mesh ran the ops queued so far (raising the first failure of
    an op that made no block); nothing to wait for when no array was ever made on it."""
    ctx = existing_context(procs)
    if ctx is not None:
        ctx.call(list(ctx.shape), [])


# -- collectives over mesh dims ---------------------------------------------------------


def _group_op(a: Any, dims: Any, kind: str, arg: Any) -> MeshArray:
    st = distributed(a)
    if st is None:
        raise TypeError(f"{kind} needs a distributed MeshArray (made by a ProcMesh), got {type(a).__name__}")
    names = tuple(a.names)
    items = (dims,) if isinstance(dims, (str, int, np.integer)) else tuple(dims)
    axes = []
    for d in items:
        if isinstance(d, str):
            if d not in names:
                raise DimensionError(d, names)
            axes.append(names.index(d))
        elif isinstance(d, (int, np.integer)) and not isinstance(d, bool) and -len(names) <= d < len(names):
            axes.append(int(d) % len(names))
        else:
            raise DimensionError(d, names)
    return MeshArray.from_storage(a.mesh_shape, st.group_op(kind, tuple(sorted(set(axes))), arg))


def allgather(a: MeshArray, dims: Any) -> MeshArray:
    """Every rank gets the blocks of all ranks of its group over mesh ``dims``, stacked.

    The result keeps ``a``'s mesh dims; its local shape is
    ``(group size,) + a.local_shape`` (members in row-major order of ``dims``).
    Runs one allgather per group of ``reduction_plan(a's shape, dims)``.

    Examples
    --------
    >>> import mesharray as ma
    >>> with ma.proc_mesh(procs=2) as procs:
    ...     ma.allgather(procs.rank_array(), "procs").fetch().tolist()
    [[[0, 1], [0, 1]]]
    """
    return _group_op(a, dims, "allgather", None)


def broadcast_from(a: MeshArray, dims: Any, root: int = 0) -> MeshArray:
    """Every rank gets the block of member ``root`` (negative counts from the end) of its group over ``dims``.

    Examples
    --------
    >>> import mesharray as ma
    >>> with ma.proc_mesh(procs=2) as procs:
    ...     ma.broadcast_from(procs.rank_array(), "procs", root=1).fetch().tolist()
    [[1, 1]]
    """
    return _group_op(a, dims, "broadcast", root)


def reduce_scatter(a: MeshArray, dims: Any, op: str = "sum") -> MeshArray:
    """Reduce across each group over mesh ``dims``; member i keeps the i-th part of the first local axis.

    Examples
    --------
    >>> import mesharray as ma
    >>> with ma.proc_mesh(procs=2) as procs:
    ...     ma.reduce_scatter(procs.ones((4,)), "procs").fetch().tolist()
    [[[2.0, 2.0], [2.0, 2.0]]]
    """
    return _group_op(a, dims, "reduce_scatter", op)


def all_to_all(a: MeshArray, dim: Any) -> MeshArray:
    """Member ``j`` of each group over mesh ``dim`` gets the ``j``-th of ``n`` parts of every member's block.

    Each block's first local axis (a multiple of the group size ``n``) is cut
    into ``n`` equal parts; the result's block on member ``j`` is the
    concatenation, in member order, of part ``j`` of every member — MPI's
    ``Alltoall``. Data moves between the workers (an allgather of the group,
    then each rank keeps its parts); nothing passes through the controller.

    Examples
    --------
    >>> import mesharray as ma
    >>> with ma.proc_mesh(procs=2) as procs:
    ...     x = procs.arange(4) + 10 * procs.rank_array()
    ...     ma.all_to_all(x, "procs").fetch().tolist()
    [[[0, 1, 10, 11], [2, 3, 12, 13]]]
    """
    st = distributed(a)
    if st is None:
        raise TypeError(f"all_to_all needs a distributed MeshArray (made by a ProcMesh), got {type(a).__name__}")
    if isinstance(dim, (tuple, list)):
        raise TypeError(f"all_to_all takes one mesh dim (a name or an int), got {dim!r}")
    names = tuple(a.names)
    if isinstance(dim, str):
        if dim not in names:
            raise DimensionError(dim, names)
        axis = names.index(dim)
    elif isinstance(dim, (int, np.integer)) and not isinstance(dim, bool) and -len(names) <= dim < len(names):
        axis = int(dim) % len(names)
    else:
        raise DimensionError(dim, names)
    n = a.mesh_shape.sizes[axis]
    local = a.local_shape
    if not local or local[0] % n:
        raise ValueError(f"all_to_all over {names[axis]!r} (size {n}) needs blocks whose first local axis is a "
                         f"multiple of {n}; the local shape is {local}")
    gathered = allgather(a, axis)
    pos = st.positions(a.mesh_shape, axis)
    return apply(None, _keep_my_parts, [gathered, pos, n])  # type: ignore[arg-type]


def _keep_my_parts(blocks: Any, pos: Any, n: int) -> Any:
    """On member ``p``: part ``p`` of each member's block, concatenated (``blocks``: the group's, stacked)."""
    p = int(np.asarray(pos).reshape(-1)[0])
    k = blocks.shape[1] // n
    part = blocks[:, p * k:(p + 1) * k]
    return part.reshape((n * k,) + tuple(blocks.shape[2:]))


for _fn in (allgather, broadcast_from, reduce_scatter, all_to_all):
    _fn.__module__ = "mesharray"  # public as mesharray.<name> (this package is internal)
del _fn
