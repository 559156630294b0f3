"""``DistributedStorage``: the storage of a ``MeshArray`` whose blocks live in the workers.

The controller keeps only metadata (a block id, the global rank holding each
mesh position, the local shape and dtype); the blocks live in the workers'
:class:`~mesharray.darray.worker.BlockStore`. :class:`~mesharray.MeshArray`
decides every layout and hands it over; this class turns each operation into
a program of :mod:`~mesharray.darray.instructions` for the ranks involved.

Operations that make blocks are sent fire-and-forget (ordered per sender, so
they pipeline like a stream); a failure is kept with the block it should have
made and raised when that block is used or fetched. Shapes and dtypes are
checked at the controller before anything is sent. Reductions over mesh axes
run one collective per group of :func:`~mesharray.reduction_plan`, also sent
fire-and-forget (planned once per layout and request); fetching the result asks
only the ranks that hold it (the group roots: one call for a 0-d result), and
since messages are ordered per rank it runs after the collective. The members of
a group first agree on whose input exists (on the shared-memory backend this
rides on the reduction's own arrival flags), so a rank whose input failed never
leaves its peers waiting; a failure is kept as the result block's and raised
by its fetch (or any later use): the original error, or
:class:`~mesharray.ActorDiedError` naming the ranks when a member died, which
the survivors notice in their wait instead of hanging.

Collective backend per group (chosen in the worker): MPI when the mesh was
launched under mpirun, else the built-in shared-memory backend (ranks on one
host); ``collective="torch"`` on the array asks for torch.distributed (gloo
on CPU, NCCL/RCCL on GPUs).

Blocks are freed on the workers when the last controller array using them is
garbage-collected (a fire-and-forget :class:`~mesharray.darray.instructions.Free`).
"""

from __future__ import annotations

import functools
import math
import operator
import os
import pickle
import sys
from typing import Any

import numpy as np

import mesharray.darray.instructions as I

from .._core import Shape, made_storage, storage_del
from ..array import MeshArray
from ..calls import Slot, fill
from ..engines import get_engine
from ..errors import EngineUnavailableError, MeshShapeError
from ..storage import GatheredStorage
from .autograd import MeshNode, grad_of, is_float, mark_leaf, union
from .backward import mesh_backward
from .blockfn import BlockCall
from .context import DataContext, data_context, no_wait, tracing
from .dispatch import ApplyRecipe, ItemRecipe, UfuncRecipe, layout_key, layout_of, plain_scalar, result_of
from .placement import groups_of, move_blocks, per_rank, placed, placement
from .worker import COLLECTIVE_OP, local_block, unpack_small

__all__ = ["DistributedStorage", "distributed"]

_REDUCE_NAMES = {"add.reduce": "sum", "multiply.reduce": "prod", "minimum.reduce": "min",
                 "maximum.reduce": "max", "sum": "sum", "prod": "prod", "min": "min", "max": "max",
                 "mean": "mean", "any": "any", "all": "all"}


@functools.lru_cache(maxsize=None)
def _prefers_nccl(engine: str) -> bool:
    try:
        return get_engine(engine).collective_backend == "nccl"
    except EngineUnavailableError:  # the controller has no such device: reduce through host memory
        return False


#: results of a reduction at most this large come back with the program's reply (no fetch message)
ANNOUNCE_BYTES = int(os.environ.get("MESHARRAY_ANNOUNCE_BYTES", "256"))


def distributed(a: Any) -> DistributedStorage | None:
    """The distributed storage of ``a`` if it is a distributed ``MeshArray``, else None."""
    if isinstance(a, MeshArray):
        st = a.storage
        if isinstance(st, DistributedStorage):
            return st
    return None


class DistributedStorage:
    """The :class:`~mesharray.storage.WorkerStorage` of a ``MeshArray`` whose blocks live in the workers.

    Attributes
    ----------
    ctx : DataContext
    bid : int
        Block id (the same on every rank holding a block of this array).
    ranks : numpy.ndarray of int64
        Global rank holding each mesh position (shape: the mesh sizes).
    holders : numpy.ndarray or None
        Ranks holding a copy of each position's block (``keepdims`` results of
        a reduction live on every member of their group), shape ``sizes + (H,)``.
    """

    kind = "distributed"
    __slots__ = ("ctx", "bid", "ranks", "holders", "_local", "_dtype", "engine", "collective", "announced",
                 "_all", "_nbytes", "_last_plan", "_lkey", "rg", "deps", "__weakref__")

    def __init__(self, ctx: DataContext, bid: int, ranks: np.ndarray, local_shape: tuple, dtype: Any,
                 engine: str, holders: np.ndarray | None = None, collective: str | None = None,
                 _all_ranks: tuple | None = None) -> None:
        self.ctx = ctx
        self.bid = bid
        self.ranks = np.asarray(ranks, dtype=np.int64)
        self.holders = holders
        self._local = tuple(int(x) for x in local_shape)
        self._dtype = np.dtype(dtype)
        self.engine = engine
        self.collective = collective
        #: futures of this block's value per rank, when the program that made it sent it back
        #: already (a tiny reduction: fetching it then costs no message)
        self.announced: dict | None = None
        self._last_plan: tuple | None = None  # (op, axes, keepdims, plan) of its last reduce
        self._lkey: int | None = None
        #: whether the blocks require grad (torch's rule, known at the controller) and the mesh nodes
        #: they depend on (see .autograd)
        self.rg = False
        self.deps: tuple = ()
        ctx.incref(bid)
        all_ranks = _all_ranks if _all_ranks is not None else tuple(sorted(
            set(self.ranks.ravel().tolist()) | (set(holders.ravel().tolist()) if holders is not None else set())))
        self._nbytes = math.prod(self._local) * self._dtype.itemsize * max(1, len(all_ranks))
        self._all = all_ranks  # (set last: __del__ gives back the reference only once it was taken)

    #: ``_made(ctx, bid, ranks, local, dtype, engine, holders, collective, all_ranks, nbytes)``: a storage
    #: from fields already in their types and counted (a recipe's result, a reduction plan's): what
    #: ``__init__`` makes, without converting them. Compiled (``_core``: an op's tail).
    _made: Any = classmethod(made_storage)

    #: the controller's reference to the block, given back when the last array over it goes (a
    #: finalizer, not a weakref.finalize: no registry entry to make and drop per array); not while
    #: the interpreter exits. Compiled (``_core``: an op's tail).
    __del__ = storage_del

    def _derive(self, bid: int, ranks: np.ndarray | None = None, local: tuple | None = None, dtype: Any = None,
                holders: Any = False) -> "DistributedStorage":
        """A storage of a local op's result on the same ranks (it requires grad as this one does)."""
        st = DistributedStorage(self.ctx, bid, self.ranks if ranks is None else ranks,
                                self._local if local is None else local,
                                self._dtype if dtype is None else dtype, self.engine,
                                self.holders if holders is False else holders, self.collective)
        if self.rg and is_float(st._dtype):
            st.rg, st.deps = True, self.deps
        return st

    def _unique(self) -> list[int]:
        """The ranks of the positions (where a fetch reads); ``_all`` also has the holders of copies."""
        return sorted(set(self.ranks.ravel().tolist()))

    # -- description
    def layout(self) -> Any:
        """What makes storages laid out as this one (:func:`~.dispatch.layout_of`)."""
        return layout_of(self)

    @property
    def lkey(self) -> int:
        """This storage's layout as a small int (:func:`~.dispatch.layout_key`): part of a recipe's signature."""
        k = self._lkey
        if k is None:
            k = self._lkey = layout_key(self)
        return k

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    def local_shape(self, mesh_ndim: int) -> tuple[int, ...]:
        return self._local

    def __reduce__(self):
        # an endpoint argument: the worker receives its own block
        return (local_block, (self.bid,))

    # -- whole values
    def to_numpy(self) -> np.ndarray:
        """Gather every position's block to the controller."""
        if tracing():
            no_wait("a fetch of a distributed array's values (np.asarray, float, printing, fetch())")
        ann = self.announced
        if ann is not None and len(ann) == 1 and self.ranks.size == 1:
            # a tiny result held by one root (a loss): its value came with the program's reply
            # (what ctx.fetch does for it, without the general case's bookkeeping)
            ctx = self.ctx
            ctx.check_live()
            shape = self.ranks.shape + self._local
            try:
                value = unpack_small(next(iter(ann.values())).get(), self._local, shape)
            except BaseException as exc:
                ctx.raise_failure(exc, self.bid)
            if value.shape != shape or value.dtype != self._dtype:
                value = np.asarray(value, dtype=self._dtype).reshape(shape)
            return value
        by_rank = self.ctx.fetch(self._unique(), self.bid, self.announced)
        if self.ranks.size == 1:
            # one block: hand it over as it arrived (no second copy at the controller)
            only = np.asarray(by_rank[int(self.ranks.reshape(-1)[0])], dtype=self._dtype)
            return only.reshape(self.ranks.shape + self._local)
        out = np.empty(self.ranks.shape + self._local, dtype=self._dtype)
        for pos in np.ndindex(*self.ranks.shape):
            out[pos] = by_rank[int(self.ranks[pos])]
        return out

    # -- layout changes (no data moves)
    def take(self, mesh_key: tuple, local_key: tuple, new_shape: Shape) -> "DistributedStorage":
        ranks = self.ranks[mesh_key + (Ellipsis,)] if mesh_key else self.ranks
        holders = self.holders[mesh_key + (Ellipsis,)] if (mesh_key and self.holders is not None) else self.holders
        ranks = np.asarray(ranks).reshape(tuple(new_shape.sizes))
        if holders is not None:
            holders = np.asarray(holders).reshape(tuple(new_shape.sizes) + (holders.shape[-1],))
        if not local_key:
            return self._derive(self.bid, ranks, holders=holders)
        local = np.empty(self._local, dtype=np.bool_)[local_key + (Ellipsis,)].shape
        bid = self.ctx.new_id()
        if ranks.size:
            self.ctx.send(np.unique(ranks).tolist(), [I.GetItem(bid, self.bid, local_key)])
        return self._derive(bid, ranks, local=local, holders=None)

    def relayout(self, old_shape: Shape, perm: tuple[int, ...] | None, new_shape: Shape) -> "DistributedStorage":
        ranks = self.ranks if perm is None else self.ranks.transpose(perm)
        holders = self.holders
        if holders is not None and perm is not None:
            holders = holders.transpose(perm + (holders.ndim - 1,))
        sizes = tuple(new_shape.sizes)
        return self._derive(self.bid, ranks.reshape(sizes),
                            holders=None if holders is None else holders.reshape(sizes + (holders.shape[-1],)))

    def setitem(self, key: tuple, value: Any) -> None:
        m = self.ranks.ndim
        mesh_key, local_key = key[:m], key[m:]
        sel = self.ranks[mesh_key + (Ellipsis,)] if mesh_key else self.ranks
        sel = np.asarray(sel)
        # every copy of a selected position changes (a held array: each holder keeps one)
        held = None
        if self.holders is not None:
            held = np.asarray(self.holders[mesh_key + (Ellipsis,)] if mesh_key else self.holders)
            held = held.reshape(sel.shape + (self.holders.shape[-1],))
        if isinstance(value, np.ndarray) and value.ndim > len(np.empty(self._local, bool)[local_key + (Ellipsis,)].shape):
            # one value per selected position
            vals = np.broadcast_to(value, sel.shape + value.shape[sel.ndim:]) if value.ndim >= sel.ndim else value
            per = {}
            for pos in np.ndindex(*sel.shape):
                for r in ([int(sel[pos])] if held is None else held[pos].tolist()):
                    per[int(r)] = np.array(vals[pos])
            arg: I.Operand = I.PerRank(per)
        else:
            arg = I.Value(value)
        ranks = np.unique(sel if held is None else np.concatenate([sel.reshape(-1), held.reshape(-1)])).tolist()
        self.ctx.send(ranks, [I.SetItem(self.bid, tuple(local_key), arg)])

    def reshape_local(self, mesh_ndim: int, local_shape: tuple[int, ...]) -> "DistributedStorage":
        bid = self.ctx.new_id()
        self.ctx.send(self._all, [I.Reshape(bid, self.bid, tuple(local_shape))])
        return self._derive(bid, local=tuple(local_shape))

    def astype(self, dtype: Any, copy: bool) -> "DistributedStorage":
        dt = np.dtype(dtype)
        if dt == self._dtype and not copy:
            return self
        bid = self.ctx.new_id()
        self.ctx.send(self._all, [I.AsType(bid, self.bid, dt.name)])
        return self._derive(bid, dtype=dt)

    def copy(self) -> "DistributedStorage":
        bid = self.ctx.new_id()
        self.ctx.send(self._all, [I.Copy(bid, self.bid)])
        return self._derive(bid)

    def positions(self, shape: Shape, axis: int) -> Any:
        """A distributed int64 array of ``shape``: each position's index along mesh ``axis`` (local axes of 1)."""
        vals: dict[int, int] = {}
        for pos in np.ndindex(*self.ranks.shape):
            r, v = int(self.ranks[pos]), pos[axis]
            if vals.setdefault(r, v) != v:
                raise ValueError(f"rank {r} holds positions {vals[r]} and {v} along axis {axis} of this view; "
                                 f"index it without repeating ranks first")
        ones = (1,) * len(self._local)
        bid = self.ctx.new_id()
        self.ctx.send(sorted(vals), [I.Put(bid, I.PerRank({r: np.full(ones, v, dtype=np.int64)
                                                          for r, v in vals.items()}), self.engine)])
        return MeshArray.from_storage(shape, DistributedStorage(self.ctx, bid, self.ranks, ones, np.int64,
                                                               self.engine, None, self.collective))

    # -- compute
    def reduce(self, op: str, func: Any, axes: tuple[int, ...] | None, keepdims: bool, kwargs: dict) -> Any:
        if kwargs:
            return self._gathered_reduce(op, func, axes, keepdims, kwargs)
        # Everything but the block ids depends only on the layout and the request:
        # planned once, so that a tiny reduction in a loop costs only its messages
        # (this storage keeps its last plan: a loss reduces the same array each step)
        last = self._last_plan
        if last is not None and last[0] == op and last[1] == axes and last[2] == keepdims:
            plan = last[3]
        else:
            key = (op, axes, keepdims, self.lkey)  # (the layout: ranks, holders, local shape, dtype, ...)
            plans = self.ctx.plans
            plan = plans.get(key)
            if plan is None:
                plan = self._reduce_plan(op, func, axes, keepdims)
                if len(plans) > 256:
                    plans.clear()
                plans[key] = plan
            self._last_plan = (op, axes, keepdims, plan)
        if plan is None:
            return self._gathered_reduce(op, func, axes, keepdims, kwargs)
        first, rdt_work, rdt, new_local, coll = plan
        ctx = self.ctx
        ctx.check_live()
        cur = self.bid
        program: list = []
        if first is not None:
            nb = ctx.new_id()
            program.append(first(nb, cur))
            cur = nb
        if coll is None:
            ctx.send(self._all, program)  # (every copy: the result keeps the holders)
            return self._derive(cur, local=new_local, dtype=rdt_work)
        members, ranks, holders, all_ranks, roots, planned, tiny, nbytes, run, _ = coll
        out = ctx.new_id()
        nbytes_in = math.prod(new_local) * rdt_work.itemsize  # (the collective's input block)
        if self.rg:
            res = self._reduce_with_grad(op, program, cur, out, plan)
            return res.astype(rdt, copy=True) if rdt_work != rdt else res  # (any/all ran as uint8 max/min)
        if tiny and not tracing():  # (a capture replays programs whose results stay where they are)
            # a tiny result (a loss, a norm): the ranks holding it send it back with the
            # program's reply, so fetching it costs no further message (one program for
            # all members, pickled once: only the holders fetch). The program goes in its
            # wire form (instructions.encode's), the collective's fields but the block ids
            # pickled once in the plan (Planned)
            wire = I.encode(program) if program else []
            wire.append(("plan", out, cur, planned, roots, nbytes_in))
            if cur != self.bid:
                wire.append(("free", [cur]))
            res = DistributedStorage._made(ctx, out, ranks, new_local, rdt_work, self.engine, holders,
                                           self.collective, all_ranks, nbytes)
            res.announced = ctx.call_some(run, members, roots, wire)
            return res
        wire = I.encode(program) if program else []
        wire.append(("plan", out, cur, planned, (), nbytes_in))  # (a Planned's wire form)
        if cur != self.bid:
            wire.append(("free", [cur]))
        res = DistributedStorage._made(ctx, out, ranks, new_local, rdt_work, self.engine, holders, self.collective,
                                       all_ranks, nbytes)
        lkeys = coll[9]  # (the result's layout key: the same for every result of the plan)
        if lkeys[0] is None:
            lkeys[0] = res.lkey
        else:
            res._lkey = lkeys[0]
        # fire-and-forget (see _send_collective); members are sorted and unique
        ctx.post_planned_wire(members, wire)
        if rdt_work != rdt:  # any/all computed as uint8 max/min
            res = res.astype(rdt, copy=True)
        return res

    def _reduce_with_grad(self, op: str, program: list, cur: int, out: int, plan: tuple) -> "DistributedStorage":
        """A reduction over mesh axes of blocks that require grad: a mesh node (see :mod:`.autograd`) whose
        result is a leaf requiring grad on every member; the local step's result stays for its backward."""
        first, rdt_work, rdt, new_local, coll = plan
        members, ranks, holders, all_ranks, roots, planned, tiny, nbytes, run, _ = coll
        ctx = self.ctx
        name = _REDUCE_NAMES.get(op)
        src: DistributedStorage = self
        if cur != self.bid:  # the local step's result: what the node's backward continues from
            src = self._derive(cur, local=new_local, dtype=rdt_work)
            src.rg, src.deps = True, self.deps
        program.append(I.Planned(out, cur, planned, (), math.prod(new_local) * rdt_work.itemsize))
        res = DistributedStorage(ctx, out, ranks, new_local, rdt_work, self.engine, holders, self.collective,
                                 _all_ranks=all_ranks)
        if name in ("sum", "mean") and is_float(rdt_work):
            groups = pickle.loads(planned)[1]  # (the collective's fields: op, groups, backend, ...)
            node = MeshNode("reduce", src, groups=groups, scale=1.0 / len(groups[0]) if name == "mean" else 1.0)
            node.result(res, layout_of(res))
            program.append(I.Apply(out, mark_leaf, [I.BlockRef(out)]))
            res.rg, res.deps = True, self.deps + (node,)
        ctx.post_planned(members, program)
        return res

    def _reduce_plan(self, op: str, func: Any, axes: tuple[int, ...] | None, keepdims: bool) -> tuple | None:
        """What ``reduce`` sends for this layout and request (None: reduce at the controller)."""
        m = self.ranks.ndim
        full = m + len(self._local)
        axes_t = tuple(range(full)) if axes is None else tuple(axes)
        name = _REDUCE_NAMES.get(op)
        mesh_axes = tuple(a for a in axes_t if a < m)
        local_axes = tuple(a - m for a in axes_t if a >= m)
        if name is None or (op.endswith(".reduce") and len(axes_t) != 1 and axes is not None):
            return None
        # the result dtype NumPy would give (sum of int32 -> int64, mean of ints -> float64)
        proxy = np.zeros((1,) * full, dtype=self._dtype)
        if op in ("argmin", "argmax"):
            return None
        rdt = np.asarray(func(proxy, axis=axes_t if len(axes_t) != 1 or not op.endswith(".reduce") else axes_t[0],
                              keepdims=keepdims)).dtype
        if mesh_axes and (rdt.kind not in "fiub" or (name in ("any", "all"))):
            if name in ("any", "all"):
                rdt_work = np.dtype(np.uint8)
            else:
                return None
        else:
            rdt_work = rdt
        new_local = tuple(s for i, s in enumerate(self._local) if i not in local_axes) if not keepdims else \
            tuple(1 if i in local_axes else s for i, s in enumerate(self._local))
        # the local part, as a maker of the instruction from (out, src)
        first = None
        if local_axes:
            first = _bind(I.Reduce, name, local_axes, keepdims, rdt_work.name)
        elif name in ("any", "all"):
            first = _truth  # (a cast to uint8 would make 0.5 false)
        elif rdt_work != self._dtype:
            first = _bind(I.AsType, rdt_work.name)
        if not mesh_axes:
            return first, rdt_work, rdt, new_local, None
        groups = groups_of(self.ranks, mesh_axes)
        if any(len(set(g)) != len(g) for g in groups):
            # a rank at several positions of one group (an advanced-index view): reduce here
            return None
        backend = self._backend(groups)
        kept = tuple(i for i in range(m) if i not in mesh_axes)
        sizes = tuple(self.ranks.shape[i] for i in kept)
        if keepdims:
            sizes = tuple(1 if i in mesh_axes else self.ranks.shape[i] for i in range(m))
        ranks = np.asarray([g[0] for g in groups], dtype=np.int64).reshape(sizes)
        holders = np.asarray(groups, dtype=np.int64).reshape(sizes + (len(groups[0]),))
        # shared by every result of this plan: nothing may write them in place
        ranks.setflags(write=False)
        holders.setflags(write=False)
        members = sorted({r for g in groups for r in g})
        groups_l = [list(g) for g in groups]
        ctx = self.ctx
        planned = pickle.dumps((COLLECTIVE_OP[name], groups_l, backend, rdt_work.name,
                                (ctx.torch_init_method(), ctx.shape.size) if backend == "torch" else (),
                                ctx.pids(groups), ctx.hosts(groups_l)), protocol=5)
        roots = tuple(sorted(set(ranks.ravel().tolist())))
        # (a keepdims result is kept for more ops, not fetched: it goes with them, in the command buffer)
        tiny = rdt_work == rdt and math.prod(new_local) * rdt.itemsize <= ANNOUNCE_BYTES and not keepdims
        nbytes = math.prod(new_local) * rdt_work.itemsize * len(members)  # (the result's, as __init__ counts it)
        run = ctx.view(members).run if tiny else None  # (the endpoint a tiny one's program goes to)
        coll = (members, ranks, holders, tuple(members), roots, planned, tiny, nbytes, run, [None])  # ([the result's lkey])
        return first, rdt_work, rdt, new_local, coll

    def _backend(self, groups: list) -> str | None:
        """The collective backend of a collective over ``groups`` (what ``Collective.backend`` says).

        The array's ``collective`` when given. Left None, the engine's
        preference: an engine that prefers NCCL/RCCL (GPU blocks) goes through
        torch.distributed when the groups cover the whole mesh, as
        torch.distributed needs; everything else through host memory (MPI
        under mpirun, else shared memory).
        """
        every = sorted(r for g in groups for r in g)
        covers = every == list(range(self.ctx.shape.size))
        if self.collective == "torch":
            if not covers:
                self._refuse_torch_groups(every)
            return "torch"
        if self.collective is None and covers and _prefers_nccl(self.engine):
            return "torch"
        return self.collective

    def _refuse_torch_groups(self, every: list) -> None:
        raise ValueError(
            f"collective='torch' reduces over groups that cover the whole mesh (torch.distributed "
            f"makes groups collectively over every rank); these groups cover ranks {every} of {self.ctx.shape.size}"
        )

    def _send_collective(self, program: list, cur: int, op: str, groups: list, dtype: np.dtype) -> int:
        """Append the collective ``op`` over ``groups`` to ``program``, run it and wait; the new block id."""
        out = self.ctx.new_id()
        backend = self._backend(groups)
        torch_init = (self.ctx.torch_init_method(), self.ctx.shape.size) if backend == "torch" else ()
        program.append(I.Collective(out, cur, op, [list(g) for g in groups], backend, dtype.name,
                                    torch_init, self.ctx.pids(groups), self.ctx.hosts(groups)))
        if cur != self.bid:
            program.append(I.Free([cur]))
        members = sorted({r for g in groups for r in g})
        # fire-and-forget like the elementwise programs: messages from this controller
        # are ordered per rank, so a later fetch of ``out`` runs after the collective;
        # a failure (a dead member included) is kept as ``out``'s and raised there
        self.ctx.send(members, program)
        return out

    def group_op(self, kind: str, mesh_axes: tuple[int, ...], arg: Any = None) -> "DistributedStorage":
        """allgather / broadcast / reduce_scatter inside each group of ``mesh_axes``; same mesh layout."""
        groups = groups_of(self.ranks, mesh_axes)
        if any(len(set(g)) != len(g) for g in groups):
            raise MeshShapeError("a rank appears at several positions of one group (an advanced-index view); "
                                 "collectives need each rank once per group")
        n = len(groups[0]) if groups else 1
        local = self._local
        if kind == "allgather":
            op, new_local = "allgather", (n,) + local
        elif kind == "broadcast":
            if not isinstance(arg, (int, np.integer)) or not -n <= arg < n:
                raise IndexError(f"root {arg!r} is out of range for groups of {n} ranks")
            op, new_local = f"broadcast:{int(arg) % n}", local
        else:
            if arg not in ("sum", "prod", "min", "max", "mean"):
                raise ValueError(f"unknown reduction op {arg!r}; expected 'sum', 'prod', 'min', 'max' or 'mean'")
            if not local or local[0] % n:
                raise MeshShapeError(
                    f"reduce_scatter splits the first local axis among the {n} ranks of each group; "
                    f"local shape {local} does not divide"
                )
            if arg == "mean" and self._dtype.kind != "f":
                raise TypeError(f"op 'mean' needs a floating dtype, got {self._dtype}; astype first")
            op, new_local = f"reduce_scatter:{arg}", (local[0] // n,) + local[1:]
        out = self._send_collective([], self.bid, op, groups, self._dtype)
        return self._derive(out, local=new_local, holders=None)

    def roll(self, axis: int, shift: int, mesh_ndim: int) -> "DistributedStorage":
        """``np.roll`` along ``axis`` of the full shape: a mesh axis moves blocks, a local one rolls each block."""
        if axis >= mesh_ndim:
            bid = self.ctx.new_id()
            self.ctx.send(self._unique(), [I.Apply(bid, _roll_local, [I.BlockRef(self.bid), I.Value(shift),
                                                                       I.Value(axis - mesh_ndim)])])
            return self._derive(bid, holders=None)
        return self.roll_mesh(axis, shift)

    def roll_mesh(self, axis: int, shift: int) -> "DistributedStorage":
        """Position ``j`` along mesh ``axis`` gets the block of position ``j - shift`` (mod the axis' size).

        Each block moves once, worker to worker, to the rank that needs it (a
        :func:`move_blocks` whose sources are the ranks rolled); the controller
        sends only the plan.
        """
        n = self.ranks.shape[axis]
        if n <= 1 or shift % n == 0:
            return self.copy()
        return move_blocks(self, np.roll(self.ranks, shift, axis=axis), self.ctx, self.ranks)

    def to_mesh(self, idx: np.ndarray, procs: Any) -> "DistributedStorage":
        """The blocks of positions ``idx`` (flat, one per position of ``procs``) on ``procs``' ranks."""
        dst = np.asarray(procs.mesh_shape.ranks(), dtype=np.int64).reshape(idx.shape)
        return move_blocks(self, self.ranks.reshape(-1)[idx], data_context(procs), dst)

    # -- functions on each rank's blocks ----------------------------------------------------

    @staticmethod
    def blockwise(what: str, call: Any, plan: Any, leaves: list, meta: tuple | None, per_element: bool = True,
                  effect: bool = False, into: int | None = None) -> "DistributedStorage | None":
        """``call(*blocks of leaves)`` on each rank of the result layout ``plan``: a new storage.

        ``meta``: the result's ``(local shape, dtype)`` when the controller could
        tell it (the program is then sent fire-and-forget); None asks one rank
        after running (which raises the call's error). ``effect``: an op run for
        its effect (``backward()``), queued like the others; returns None, and its
        failure, if any, is raised by the next wait on those ranks.
        ``into``: make the result under this existing block id (an in-place
        method on that array's blocks); returns None.
        Operands on other ranks move there first; gathered MeshArrays travel
        with the program, one value per rank.
        """
        dist = [x for x in leaves if distributed(x) is not None]
        first, R, pos_of, ranks, moved, holders = placed(what, plan, dist, per_element)
        ctx = first.ctx
        m = len(plan.sizes)
        operands: list[I.Operand] = []
        for x in leaves:
            st = distributed(x)
            if st is not None:
                operands.append(I.BlockRef(moved.get(id(x), st).bid))
            else:
                operands.append(I.PerRank(per_rank(plan.align(x, pad_local=not per_element), pos_of, m)))
        bid = ctx.new_id() if into is None else into
        if effect:
            ctx.effect(ranks, I.encode([I.Apply(bid, call, operands)])[0])
            return None
        ctx.send(ranks, [I.Apply(bid, call, operands)])
        if into is not None:
            return None
        if meta is None:  # (asked of a rank: whether it requires grad too)
            local, dt, rg = ctx.meta(ranks[0], bid)
        else:
            local, dt, rg = meta[0], meta[1], False
        st = DistributedStorage(ctx, bid, R, tuple(local), dt, first.engine, holders, first.collective,
                                _all_ranks=tuple(ranks))
        if rg:
            _requires(st, True, leaves)
        return st

    def pick(self, i: int, meta: tuple) -> "DistributedStorage":
        """Output ``i`` of blocks that hold several (a function returning a tuple)."""
        bid = self.ctx.new_id()
        self.ctx.send(self._unique(), [I.Apply(bid, operator.itemgetter(i), [I.BlockRef(self.bid)])])
        return self._derive(bid, local=tuple(meta[0]), dtype=meta[1], holders=None)

    @staticmethod
    def torch_function(func: Any, plan: Any, leaves: list, args: Any, kwargs: dict) -> Any:
        """``func`` (a torch function, a Tensor method, ``torch.nn.functional.*``) on each rank's blocks.

        ``args``/``kwargs`` are templates (:func:`~.blockfn.template`) over
        ``leaves``. The result's shape and dtype come from running ``func`` on
        torch's *meta* device at the controller (nothing computed, nothing
        waited for); where that cannot tell, one rank is asked. A function
        returning several tensors gives a tuple of arrays; an in-place method
        (``x.add_(y)``, ``x.requires_grad_()``) changes the blocks where they
        live and returns ``x``; ``backward()`` runs on every rank, queued like the
        rest (its failure is raised by the next wait: a fetch, ``procs.sync()``).
        """
        import torch

        from ..engines.torch_engine import numpy_dtype, torch_dtype

        name = getattr(func, "__name__", "")
        call = BlockCall(func, args, kwargs, tensors=True, grad=torch.is_grad_enabled())
        if name == "backward":
            loss = distributed(leaves[0]) if leaves else None
            if loss is not None and loss.deps:
                mesh_backward(loss, call, leaves)
            else:
                DistributedStorage.blockwise(name, call, plan, leaves, None, effect=True)
            return None
        grads = tuple(_rg(x) for x in leaves)
        res: Any = _NO_META
        # what func gives on torch's meta device depends only on the call's shapes, dtypes and
        # other arguments: run once per such call (a step of a loop repeats its calls exactly)
        try:
            key: Any = (func, _frozen(args), _frozen(kwargs), tuple((x.local_shape, x.dtype) for x in leaves),
                        call.grad, grads)
        except TypeError:  # an argument that is not a plain value (a tensor): run it every time
            key = None
        cached = _META.get(key, _NO_META) if key is not None else _NO_META
        if cached is not _NO_META:
            res = cached
        else:
            try:
                metas = [torch.empty(x.local_shape, dtype=torch_dtype(x.dtype), device="meta", requires_grad=g)
                         for x, g in zip(leaves, grads)]
                with torch.set_grad_enabled(call.grad):
                    res = func(*fill(args, metas), **fill(kwargs, metas))
            except Exception:
                pass
            if key is not None:
                if len(_META) >= 4096:
                    _META.clear()
                _META[key] = res
        first = args[0] if isinstance(args, tuple) and args else None
        if (name.endswith("_") and not name.startswith("_") and type(first) is Slot
                and distributed(leaves[first.i]) is not None):
            x = leaves[first.i]
            # made under x's own block id: the blocks change where they live, and a failure
            # (a leaf that requires grad, shapes that do not broadcast) becomes x's, raised
            # by its next use or fetch, as any fire-and-forget op's
            DistributedStorage.blockwise(name, call, plan, leaves, (x.local_shape, x.dtype), into=x.storage.bid)
            if isinstance(res, torch.Tensor):  # (x.requires_grad_(): x now requires grad)
                _requires(x.storage, res.requires_grad, leaves)
            return x
        if isinstance(res, torch.Tensor) and res.dtype != torch.bfloat16:
            one = DistributedStorage.blockwise(name, call, plan, leaves, (tuple(res.shape), numpy_dtype(res.dtype)))
            assert one is not None  # (meta given, no into=: a new storage)
            _requires(one, res.requires_grad, leaves)
            return MeshArray.from_storage(plan.shape, one)
        if (isinstance(res, (tuple, list)) and res and all(isinstance(t, torch.Tensor) for t in res)
                and not any(t.dtype == torch.bfloat16 for t in res)):
            both = DistributedStorage.blockwise(name, call, plan, leaves, ((), np.dtype(object)))
            assert both is not None
            outs = []
            for i, t in enumerate(res):
                part = both.pick(i, (tuple(t.shape), numpy_dtype(t.dtype)))
                _requires(part, t.requires_grad, leaves)
                outs.append(MeshArray.from_storage(plan.shape, part))
            try:
                return type(res)(outs)  # torch.return_types.max(values, indices) and friends
            except TypeError:
                return tuple(outs)
        if isinstance(res, (int, torch.Size, torch.dtype)) and not isinstance(res, bool):
            return res  # known from shapes alone: the same on every rank (x.dim(), x.size())
        # not known without running: run it, and ask
        st = DistributedStorage.blockwise(name, call, plan, leaves, None)
        assert st is not None
        return _host_or_array(plan.shape, st)

    def torch_attr(self, array: Any, name: str, plan: Any) -> Any:
        """``array.name`` for a torch-engine array: a Tensor method bound to it, or a property's value per rank."""
        if self.engine not in _TORCH_ENGINES:
            raise AttributeError(f"'MeshArray' object has no attribute {name!r}")
        import torch

        attr = getattr(torch.Tensor, name, None)
        if attr is None:
            raise AttributeError(f"'MeshArray' object has no attribute {name!r} (nor has torch.Tensor)")
        if callable(attr):
            return functools.partial(_tensor_method, attr, array)
        if name == "requires_grad":  # known at the controller (torch's rule, followed op by op)
            return MeshArray.from_storage(plan.shape, GatheredStorage(np.full(tuple(plan.sizes), self.rg)))
        meta = None
        if name == "grad":
            # known without asking: the gradient is shaped like its tensor (None raises where used)
            meta = (array.local_shape, array.dtype)
            get: Any = grad_of
            rg = False
        else:
            get = operator.attrgetter(name)
            rg = None
            try:
                from ..engines.torch_engine import numpy_dtype, torch_dtype

                value = getattr(torch.empty(array.local_shape, dtype=torch_dtype(array.dtype), device="meta",
                                            requires_grad=self.rg), name)
                if isinstance(value, torch.Tensor) and value.dtype != torch.bfloat16:
                    meta = (tuple(value.shape), numpy_dtype(value.dtype))  # x.T, x.mT, x.data, x.real
                    rg = value.requires_grad
            except Exception:
                pass
        st = DistributedStorage.blockwise(name, get, plan, [array], meta)
        assert st is not None
        if name != "grad" and rg is not None:
            _requires(st, rg, [array])
        return _host_or_array(plan.shape, st)

    # -- recipes: repeating an op of the same signature (see .dispatch) -----------------------

    @staticmethod
    def _recipe_ranks(what: str, plan: Any, leaves: list, per_element: bool) -> list | None:
        """Where an op over ``leaves`` runs, when every operand is distributed in one process mesh and
        already where the result is computed (nothing moves): the ranks; else None."""
        dist = [distributed(x) for x in leaves]
        if not dist or dist[0] is None:
            return None
        ctx = dist[0].ctx
        if any(st is None or st.ctx is not ctx for st in dist):
            return None
        _, _, _, ranks, moves, _ = placement(what, plan, leaves, per_element)
        return None if moves else ranks

    @staticmethod
    def torch_recipe(func: Any, plan: Any, leaves: list, args: Any, kwargs: dict, value: Any) -> Any:
        """A recipe repeating :meth:`torch_function` for calls of this signature, or None."""
        import torch

        name = getattr(func, "__name__", "")
        if name == "backward" or not leaves:
            return None
        ranks = DistributedStorage._recipe_ranks(name, plan, leaves, True)
        if ranks is None:
            return None
        call = BlockCall(func, args, kwargs, tensors=True, grad=torch.is_grad_enabled())
        first = args[0] if isinstance(args, tuple) and args else None
        if name.endswith("_") and not name.startswith("_") and type(first) is Slot:
            if value is not leaves[first.i]:
                return None
            return ApplyRecipe(call, None, ranks, inplace=first.i, rg=leaves[first.i].storage.rg)
        try:
            key = (func, _frozen(args), _frozen(kwargs), tuple((x.local_shape, x.dtype) for x in leaves), call.grad,
                   tuple(_rg(x) for x in leaves))
        except TypeError:
            return None
        meta = _META.get(key)
        if not isinstance(meta, torch.Tensor) or meta.dtype == torch.bfloat16:
            return None  # (the result's shape came from a rank, or it is not one tensor)
        res = result_of(value, plan.shape, ranks)
        return None if res is None else ApplyRecipe(call, res, ranks)

    @staticmethod
    def item_recipe(array: Any, local_key: tuple, value: Any) -> Any:
        """A recipe repeating :meth:`take` for an index of ints into arrays laid out as ``array`` (the
        value: ``array[key]``, its local part ``local_key``), or None."""
        st = value._storage if isinstance(value, MeshArray) else None
        src = array._storage
        if not isinstance(st, DistributedStorage) or st.ctx is not src.ctx or not local_key or st.bid == src.bid \
                or not st.ranks.size:
            return None  # (a view of the same block, or no block: planned each time, cheaply)
        return ItemRecipe(value.mesh_shape, np.unique(st.ranks).tolist(), local_key, layout_of(st))

    @staticmethod
    def attr_recipe(array: Any, name: str, plan: Any, value: Any) -> Any:
        """A recipe repeating :meth:`torch_attr` for this attribute of arrays of this signature, or None."""
        if isinstance(value, functools.partial):  # a Tensor method: bound to each array anew
            method = value.args[0]
            return lambda leaves: functools.partial(_tensor_method, method, leaves[0])
        if name != "grad" and not isinstance(value, MeshArray):
            return None
        ranks = DistributedStorage._recipe_ranks(name, plan, [array], True)
        res = None if ranks is None else result_of(value, plan.shape, ranks)
        if ranks is None or res is None:
            return None
        return ApplyRecipe(grad_of if name == "grad" else operator.attrgetter(name), res, ranks)

    @staticmethod
    def ufunc_recipe(ufunc: np.ufunc, plan: Any, inputs: list, kwargs: dict, value: Any) -> Any:
        """A recipe repeating :meth:`elementwise` for calls of this signature (no ``out=``/``where=``), or None."""
        if ufunc.signature is not None or ufunc.nout != 1 or "out" in kwargs or "where" in kwargs:
            return None
        kinds = tuple(distributed(x) is not None for x in inputs)
        dist = [x for x, k in zip(inputs, kinds) if k]
        # a Python int cannot change the dtype of floating blocks, nor overflow them
        ints = all(x.dtype.kind in "fc" for x in dist)
        if not dist or not all(k or plain_scalar(x) or (ints and type(x) is int) for x, k in zip(inputs, kinds)):
            return None
        ranks = DistributedStorage._recipe_ranks(ufunc.__name__, plan, dist, False)
        res = None if ranks is None else result_of(value, plan.shape, ranks)
        return None if res is None else UfuncRecipe(ufunc.__name__, kinds, dict(kwargs), res)

    @staticmethod
    def array_function(func: Any, plan: Any, leaves: list, args: Any, kwargs: dict, per_element: bool) -> Any:
        """NumPy function ``func`` on each rank's blocks (``args``/``kwargs``: templates over ``leaves``)."""
        call = BlockCall(func, args, kwargs)
        # the result's shape and dtype from NumPy on zero-stride stand-ins of the blocks
        proxies = [_proxy(x.dtype, x.local_shape) for x in leaves]
        with np.errstate(all="ignore"):
            res = np.asarray(func(*fill(args, proxies), **fill(kwargs, proxies)))
        st = DistributedStorage.blockwise(getattr(func, "__name__", "function"), call, plan, leaves,
                                          (res.shape, res.dtype), per_element)
        assert st is not None  # (meta given, no into=: a new storage)
        return MeshArray.from_storage(plan.shape, st)

    def _gathered_reduce(self, op: str, func: Any, axes: Any, keepdims: bool, kwargs: dict) -> Any:
        return GatheredStorage(self.to_numpy()).reduce(op, func, axes, keepdims, kwargs)

    @staticmethod
    def elementwise(ufunc: np.ufunc, plan: Any, inputs: list, kwargs: dict) -> tuple:
        if kwargs.get("out") is not None or kwargs.get("where") is not None:
            raise TypeError(f"{ufunc.__name__} of distributed arrays does not take out= or where=; assign the result instead")
        if ufunc.nout != 1:
            raise TypeError(f"{ufunc.__name__} has {ufunc.nout} outputs; distributed arrays support one")
        extra = {k: v for k, v in kwargs.items() if k not in ("out", "where")}
        dist = [x for x in inputs if distributed(x) is not None]
        per_element = ufunc.signature is not None
        sizes = tuple(plan.sizes)
        first, R, pos_of, ranks, moved, holders = placed(ufunc.__name__, plan, dist, per_element)
        ctx = first.ctx
        operands: list[I.Operand] = []
        proxies = []
        for x in inputs:
            st = distributed(x)
            if st is not None:
                st = moved.get(id(x), st)
                operands.append(I.BlockRef(st.bid))
                proxies.append(_proxy(st._dtype, x.local_shape) if per_element else _sample(st._dtype))
            elif isinstance(x, MeshArray):
                aligned = plan.align(x, pad_local=not per_element)
                operands.append(I.PerRank(per_rank(aligned, pos_of, len(sizes))))
                proxies.append(_proxy(x.dtype, aligned.shape[len(sizes):]))
            elif isinstance(x, np.ndarray) and x.ndim > len(plan.local_shape) and not per_element:
                m = len(sizes)
                full = x.reshape((1,) * (m + len(plan.local_shape) - x.ndim) + x.shape)
                operands.append(I.PerRank(per_rank(full, pos_of, m)))
                proxies.append(_proxy(x.dtype, full.shape[m:]))
            else:
                operands.append(I.Value(x))
                proxies.append(_host_proxy(x))
        # result dtype and local shape, from NumPy on empty proxies (nothing is computed at size 0)
        with np.errstate(all="ignore"):
            if per_element:
                local, dt = _matmul_meta(proxies)
            else:
                dt = ufunc(*[p if not isinstance(p, np.ndarray) else p.reshape(-1)[:1] if p.size else np.zeros(1, p.dtype) for p in proxies], **extra).dtype
                local = tuple(plan.local_shape)
        bid = ctx.new_id()
        ctx.send(ranks, [I.Elementwise(bid, ufunc.__name__, operands, extra)])
        res = DistributedStorage(ctx, bid, R, local, dt, first.engine, holders, first.collective,
                                 _all_ranks=tuple(ranks))
        if first.engine in _TORCH_ENGINES and is_float(dt) and _grad_enabled():
            # torch's rule for the op the engine runs on tensors: it requires grad if an operand does
            moved_or = [moved.get(id(x), distributed(x)) for x in dist]
            if any(st.rg for st in moved_or):
                res.rg, res.deps = True, union(*[st.deps for st in moved_or])
        return (res,)


_SAMPLES: dict = {}


def _sample(dtype: np.dtype) -> np.ndarray:
    # one element of ``dtype``: what NumPy needs to tell a ufunc's result dtype
    a = _SAMPLES.get(dtype)
    if a is None:
        a = _SAMPLES[dtype] = np.zeros(1, dtype=dtype)
    return a


def _proxy(dtype: Any, shape: tuple) -> np.ndarray:
    # a zero-stride array of the right dtype and shape (no memory for big blocks)
    base = np.zeros(1, dtype=dtype)
    return np.lib.stride_tricks.as_strided(base, shape=tuple(shape), strides=(0,) * len(shape))


def _matmul_meta(proxies: list) -> tuple[tuple, np.dtype]:
    a, b = (np.asarray(p) for p in proxies[:2])
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError("matmul: input operand does not have enough dimensions")
    a2 = a.shape if a.ndim > 1 else (1,) + a.shape
    b2 = b.shape if b.ndim > 1 else b.shape + (1,)
    if a2[-1] != b2[-2]:
        raise MeshShapeError(f"matmul: local shapes {a.shape} and {b.shape} do not match in their core dimension")
    batch = np.broadcast_shapes(a2[:-2], b2[:-2])
    out = batch + (a2[-2],) * (a.ndim > 1) + (b2[-1],) * (b.ndim > 1)
    dt = np.result_type(a.dtype, b.dtype)
    return tuple(out), dt


def _roll_local(block: Any, shift: int, axis: int) -> Any:
    return np.roll(np.asarray(block), shift, axis=axis)


def _host_proxy(x: Any) -> Any:
    """What NumPy sees of a plain operand when it works out a result dtype (a torch tensor: its array)."""
    if isinstance(x, np.ndarray) or not hasattr(x, "__array__"):
        return x
    try:
        return np.asarray(x.detach() if hasattr(x, "detach") else x)
    except Exception:
        return x


_NO_META = object()
#: torch functions' results on the meta device, by call (see torch_function)
_META: dict = {}
_PLAIN = (int, float, bool, str, type(None), Slot, complex)


def _frozen(obj: Any) -> Any:
    """A hashable stand-in of a call's arguments that equals another only for the same call; TypeError
    for anything but plain values (numbers, strings, slots, torch dtypes and sizes, and containers of
    them): a tensor hashes by identity, which a new tensor may reuse."""
    t = type(obj)
    if t in _PLAIN:
        return (t, obj)
    if t is tuple or t is list:
        return (t, tuple(_frozen(x) for x in obj))
    if t is dict:
        return (t, tuple((k, _frozen(v)) for k, v in obj.items()))
    mod = t.__module__
    if mod == "torch" and t.__name__ in ("dtype", "Size", "device", "layout", "memory_format"):
        return (t, obj)
    raise TypeError(f"not a plain value: {t.__name__}")
#: engines whose blocks are torch tensors
_TORCH_ENGINES = ("torch", "cuda", "rocm", "mps", "xla")


def _tensor_method(method: Any, array: Any, *args: Any, **kwargs: Any) -> Any:
    # x.detach(), x.backward(), x.relu(): the method through torch's dispatch, with x first
    return type(array).__torch_function__(method, (type(array),), (array,) + args, kwargs)


def _rg(x: Any) -> bool:
    """Whether operand ``x``'s blocks require grad (a distributed array's, as the controller knows it)."""
    st = distributed(x)
    return st is not None and st.rg


def _requires(st: DistributedStorage, rg: bool, operands: list) -> None:
    """``st`` (an op's result) requires grad as torch says; then it depends on its operands' mesh nodes."""
    if rg:
        st.rg = True
        st.deps = union(*[d.deps for d in map(distributed, operands) if d is not None])
    else:
        st.rg, st.deps = False, ()


def _grad_enabled() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and torch.is_grad_enabled()


def _host_or_array(shape: Shape, st: DistributedStorage) -> Any:
    """A result asked of the ranks: None when every rank's was None, host values when not numbers, else the array."""
    a = MeshArray.from_storage(shape, st)
    if st.dtype.kind not in "biufc":
        values = a.fetch()
        if all(v is None for v in np.asarray(values).reshape(-1)):
            return None
        return values
    return a


def _truth(out: int, src: int) -> I.Elementwise:
    """``src != 0``: the local step of any/all over mesh axes only."""
    return I.Elementwise(out, "not_equal", [I.BlockRef(src), I.Value(0)], {})


def _bind(cls: Any, *rest: Any) -> Any:
    """A maker of ``cls(out, src, *rest)`` (the local step of a reduction plan)."""
    return lambda out, src: cls(out, src, *rest)
