"""The worker side of distributed arrays: the block store and the program executor.

Each worker process keeps one :class:`BlockStore` (process-wide, so that a
distributed ``MeshArray`` passed to an endpoint on this worker unpickles to
its local block through :func:`local_block`) and runs the programs of
:mod:`~mesharray.darray.instructions` in the system actor :class:`DataActor`,
spawned once per process mesh by the controller.

Every block is kept with the engine that made it, so an operation never has to
guess an engine from a block's type.
"""

from __future__ import annotations

import hashlib
import math
import os
import pickle
import sys
from functools import partial
from typing import Any, Callable

import numpy as np

import mesharray.darray.instructions as I
from mesharray.darray.instructions import InputFailed

from .._core import FastRun, PlanRunner, expand_calls, fast_op, free_blocks
from ..actor import Actor, context, endpoint
from ..collectives import new_group
from ..collectives.hier import HierCollective
from ..collectives.ring import RingCollective
from ..collectives.shm import ShmCollective
from ..collectives.tree import leader_tree
from ..engines import Engine, get_engine
from ..engines.numpy_engine import HUGE_PAGE, host_empty
from ..errors import ActorDiedError, MeshArrayError
from ..transport import cma
from ..transport.dataplane import process_plane, rendezvous
from .blockfn import BlockCall
from .overlap import prepare

__all__ = ["BlockStore", "DataActor", "InputFailed", "STORE", "local_block", "meta_dtype", "pack_small",
           "unpack_small"]

#: what a mesh-axis reduction runs as a collective (any/all: max/min over uint8)
COLLECTIVE_OP = {"sum": "sum", "prod": "prod", "min": "min", "max": "max", "mean": "mean",
                 "any": "max", "all": "min"}

#: the codes expanded before a program runs: a captured step's definition and replays, a
#: recipe's call by its key (``("call", out, key, operands)``, defined once per rank by
#: ``("defcall", key, fn)``: see :class:`mesharray.darray.dispatch.ApplyRecipe`), and the
#: definition of a collective's plan by its key (``defplan``: see
#: :meth:`mesharray.darray.context.DataContext._keyed_plans`); a plan by its key (``kplan``)
#: is looked up where it runs (a tiny reduction's program is no more than that)
_CAPTURED = frozenset(("def", "replay", "undef", "call", "defcall", "uncall", "defplan"))

#: Planned instructions' plans, by their bytes: [the Collective's fields after out and src,
#: (group, op, dtype, engine, small bytes, kernel dtype, lazy target) once the plan is known to
#: run in shared memory (see DataActor._planned; _core.PlanRunner reads them too)]
_PLANS: dict[bytes, list] = {}
_LAST_PLAN: list = [b"", None]  # the last plan's bytes and state: a loop of one reduction compares, not hashes
_SHM_OPS = frozenset(("sum", "prod", "min", "max", "mean"))

#: host blocks below this many bytes travel as (dtype, shape, bytes): pickling an ndarray
#: runs more Python on each side than the rest of a small fetch (``docs/internals.md``,
#: "Distributed arrays")
SMALL_FETCH = 1 << 16


#: program instructions that read no block, run while a reduction may still be making one
_KEEPS_LAZY = frozenset(("free", "plan", "kplan", "check", "fail"))


def _settled(out: int, res: np.ndarray, eng: Engine, outcome: Any) -> None:
    # the end of a small allreduce that made block ``out`` lazily (DataActor._planned): ``outcome``
    # is the failed ranks (none: ``res`` holds the result) or the error; nothing if out was freed
    if STORE.lazy.pop(out, None) is None:
        return
    if isinstance(outcome, BaseException):
        STORE.fail(out, outcome)
    elif outcome:
        STORE.fail(out, InputFailed(outcome, out))
    else:
        STORE.put(out, res, eng)


class BlockStore:
    """This worker's blocks by id, the engine of each, and the failures of blocks that could not be made."""

    #: only large blocks are worth recycling, a few per size
    POOL_MIN = 1 << 20
    POOL_PER_SIZE = 4
    #: failures of freed blocks kept (an intermediate of a chain of reductions is
    #: freed before the controller follows the chain to its original)
    FREED_FAILED = 64

    def __init__(self) -> None:
        self.blocks: dict[int, Any] = {}
        self.engines: dict[int, Engine] = {}
        self.failed: dict[int, BaseException] = {}
        self.freed_failed: dict[int, BaseException] = {}
        self.groups: dict[tuple, Any] = {}
        self._pool: dict[int, list] = {}
        #: blocks a small allreduce is still making (this member left its host round before the
        #: result was in: see DataActor._planned), each with its group
        self.lazy: dict[int, Any] = {}

    def settle(self) -> None:
        """Finish the reductions still making blocks (:attr:`lazy`): their blocks are in (or failed)."""
        for g in dict.fromkeys(list(self.lazy.values())):  # (a copy first: an actor's thread may add)
            g.settle()  # (each round's end takes its block out of lazy)

    def get(self, bid: int) -> Any:
        """Block ``bid``; raises the failure of the op that should have made it."""
        if self.lazy and bid in self.lazy:
            self.settle()
        failed = self.failed.get(bid)
        if failed is not None:
            # its original exception (type and traceback) is what the controller sees
            raise failed
        try:
            return self.blocks[bid]
        except KeyError:
            if bid in self.freed_failed:
                raise self.freed_failed[bid] from None
            raise MeshArrayError(f"block {bid} is not on this worker (freed, or never made here)") from None

    def engine(self, bid: int) -> Engine:
        self.get(bid)
        return self.engines[bid]

    def put(self, bid: int, block: Any, eng: Engine) -> None:
        self.blocks[bid] = block
        self.engines[bid] = eng
        self.failed.pop(bid, None)

    def fail(self, bid: int, exc: BaseException) -> None:
        self.blocks.pop(bid, None)
        self.engines.pop(bid, None)
        self.failed[bid] = exc

    def free(self, bids: list) -> None:
        if free_blocks(self, bids):  # (the common case, compiled: torch blocks, none failed)
            return
        lazy = self.lazy
        for b in bids:
            if lazy:
                lazy.pop(b, None)
            self._recycle(self.blocks.pop(b, None))
            self.engines.pop(b, None)
            exc = self.failed.pop(b, None)
            if exc is not None:
                # a later result's InputFailed may still point here
                self.freed_failed[b] = exc
                while len(self.freed_failed) > self.FREED_FAILED:
                    del self.freed_failed[next(iter(self.freed_failed))]

    def take(self, shape: tuple, dtype: np.dtype) -> np.ndarray:
        """An uninitialised host array, recycled when one of its size was freed.

        Fresh 64 MiB allocations page-fault on every first touch, which halves
        the bandwidth of a collective writing into them.
        """
        nbytes = math.prod(shape) * dtype.itemsize
        free = self._pool.get(nbytes)
        if free:
            return free.pop().view(dtype).reshape(shape)
        return host_empty(shape, dtype)

    def _recycle(self, block: Any) -> None:
        # a freed NumPy block whose memory nobody else can see (views were never handed
        # out beyond this worker's endpoints, and none of them kept one) is kept for reuse
        if not isinstance(block, np.ndarray) or block.nbytes < self.POOL_MIN:
            return
        held, viewed = _refs(block)  # (first: no local of this frame holds its base yet)
        base = block.base
        lone = _LONE_OWNER if base is None else _LONE_VIEW
        if held > lone[0] or viewed > lone[1]:  # an endpoint kept it, or a view of its memory
            return
        if base is None:  # it owns its memory
            mem = block
        else:
            if not isinstance(base, np.ndarray) or base.base is not None:
                return
            if base.nbytes != block.nbytes and not (base.nbytes == block.nbytes + HUGE_PAGE
                                                    and block.flags.c_contiguous):
                return  # (a part of a larger array; the one larger owner taken: host_empty's allocation)
            mem = block if base.nbytes != block.nbytes else base
        free = self._pool.setdefault(block.nbytes, [])
        if len(free) < self.POOL_PER_SIZE:
            free.append(mem.reshape(-1).view(np.uint8))


def _refs(block: np.ndarray) -> tuple[int, int]:
    """The references to ``block`` and to its base (0 without one), as :meth:`BlockStore._recycle` counts them."""
    base = block.base
    return sys.getrefcount(block), 0 if base is None else sys.getrefcount(base)


def _refs_alone(block: np.ndarray) -> tuple[int, int]:
    # (shaped as _recycle's call of _refs, given a value nobody else holds)
    return _refs(block)


#: what _refs gives in _recycle for a block that owns its memory, and for a view whose owner
#: only it holds, when nobody else holds either: measured, not assumed (CPython's counts
#: differ between versions: 3.14 borrows references that 3.11 takes)
_LONE_OWNER = _refs_alone(np.empty(1))
_LONE_VIEW = _refs_alone(np.empty(2)[:1])


#: this worker process's blocks
STORE = BlockStore()


def local_block(bid: int) -> Any:
    """The block ``bid`` of this worker (what an endpoint receives for a distributed array)."""
    return STORE.get(bid)


def pack_small(a: np.ndarray) -> Any:
    """A fetched host block as it travels: ``(dtype, shape, bytes)`` when small, else the array."""
    if a.nbytes < SMALL_FETCH and a.dtype.kind in "biufcmM":
        return (a.dtype.str, a.shape, a.tobytes())
    return a


_DTYPES: dict[str, np.dtype] = {}


def meta_dtype(dt: Any) -> np.dtype:
    """The dtype of a :meth:`DataActor.meta` reply."""
    d = _DTYPES.get(dt) if type(dt) is str else dt
    if d is None:
        d = _DTYPES[dt] = np.dtype(dt)
    return d


def unpack_small(v: Any, block_shape: tuple | None = None, as_shape: tuple | None = None) -> np.ndarray:
    """The inverse of :func:`pack_small` (a writable array, like an unpickled one).

    ``as_shape``: the caller's shape for it, used when the block has ``block_shape`` (the
    same elements: a fetched block with the mesh's axes of one position added).
    """
    if type(v) is tuple:
        dt, shape, raw = v
        d = _DTYPES.get(dt)
        if d is None:  # (parsing a dtype string costs more than the rest of a tiny fetch)
            d = _DTYPES[dt] = np.dtype(dt)
        if as_shape is not None and shape == block_shape:
            shape = as_shape
        return np.ndarray(shape, d, bytearray(raw))  # (one copy, into a buffer of its own: no frombuffer + copy)
    return np.asarray(v)


def _operand(a: tuple, rank: int) -> Any:
    # a wire operand (see instructions.encode): ("b", bid), ("r", {rank: value}), ("v", value)
    tag = a[0]
    if tag == "b":
        return STORE.get(a[1])
    if tag == "r":
        return a[1][rank]
    return a[1]


def _first_block(operands: list) -> int | None:
    return next((a[1] for a in operands if a[0] == "b"), None)


def _host(eng: Engine, block: Any) -> np.ndarray:
    return block if isinstance(block, np.ndarray) else eng.to_numpy(block)


def _clone(block: Any) -> Any:
    return block.copy() if isinstance(block, np.ndarray) else block.clone()


# -- instructions that make a block: each returns (block, engine) ---------------------


def _new(ins: I.New, me: int) -> tuple[Any, Engine]:
    eng = get_engine(ins.engine)
    kind, shape, dtype = ins.kind, ins.shape, ins.dtype
    if kind == "full":
        return eng.full(shape, ins.extra, dtype), eng
    if kind == "rand":
        return eng.rand(shape, dtype, seed=None if ins.extra is None else ins.extra + me), eng
    if kind == "rank":
        return eng.full(shape, me, dtype), eng
    if kind == "arange":
        return eng.reshape(eng.arange(math.prod(shape), dtype), shape), eng
    if kind in ("zeros", "ones", "empty"):
        return getattr(eng, kind)(shape, dtype), eng
    raise ValueError(f"unknown kind of new block {kind!r}")


def _put(ins: I.Put, me: int) -> tuple[Any, Engine]:
    eng = get_engine(ins.engine)
    return eng.from_numpy(_operand(ins.value, me)), eng


def _elementwise(ins: I.Elementwise, me: int) -> tuple[Any, Engine]:
    vals = [_operand(a, me) for a in ins.operands]
    first = _first_block(ins.operands)
    eng = STORE.engine(first) if first is not None else get_engine("numpy")
    if ins.name == "matmul":
        return eng.matmul(*vals), eng
    if eng.name == "numpy":
        return np.asarray(getattr(np, ins.name)(*vals, **ins.kwargs)), eng
    return eng.elementwise(ins.name, *vals), eng


def _apply(ins: I.Apply, me: int) -> tuple[Any, Engine]:
    first = _first_block(ins.operands)
    eng = STORE.engine(first) if first is not None else get_engine("numpy")
    return _applied(ins.fn(*[_operand(a, me) for a in ins.operands]), eng)


def _applied(r: Any, eng: Engine) -> tuple[Any, Engine]:
    """What an apply's result ``r`` is kept as: a block of ``eng``, several, or a host value."""
    if eng.is_block(r):
        return r, eng
    if type(r) in (tuple, list) or type(r).__module__ == "torch.return_types":
        if r and all(eng.is_block(x) for x in r):
            # several outputs (``torch.max(x, dim)``): kept together, taken apart by the next instructions
            return tuple(r), eng
    a = np.asarray(r)
    if a.dtype.kind in "biufc":
        return eng.from_numpy(a), eng
    return a, get_engine("numpy")  # None, or objects: host values


def _stored(out, r, eng) -> None:
    """``r`` (of engine ``eng``) kept as block ``out``, in place of a failure an earlier run left there."""
    STORE.blocks[out] = r
    STORE.engines[out] = eng
    if STORE.failed:
        STORE.failed.pop(out, None)


def _missing_call(key: int) -> Callable[..., Any]:
    """What a ``call`` of a key this rank was never given runs: it raises, naming the key (a bug, not a user error)."""
    def missing(*_: Any) -> Any:
        raise MeshArrayError(f"recipe call {key} is not defined on this rank (its defcall never came)")
    return missing


def _fast_apply(raw: tuple, me: int, got: Any = None) -> bool:
    """``("apply", out, fn, operands)`` whose operands are at hand (blocks, plain values), run as
    :func:`_apply` runs it, without decoding the instruction, or ``("ew", out, name, operands,
    kwargs)`` on torch blocks with a fast op (see ``TorchEngine.elementwise``); False (nothing done)
    when it is not such a case. The common case compiled (``_core.fast_op``, whose answer ``got``
    is, if the caller ran it); here, what it hands back: a failure (kept as the block's, as the
    general path keeps it) or a value to convert."""
    if got is None:
        got = fast_op(raw, STORE.blocks, STORE.engines, STORE.failed)
    if got is True:
        return True
    if got is None:
        return False
    try:
        if isinstance(got, BaseException):
            raise got
        out, r, eng = got
        r, eng = _applied(r, eng)
    except BaseException as exc:
        _name_op(exc, I.decode(raw), me)
        STORE.fail(raw[1], exc)
    else:
        _stored(out, r, eng)
    return True


def _reduce(ins: I.Reduce, me: int) -> tuple[Any, Engine]:
    src, eng = STORE.get(ins.src), STORE.engine(ins.src)
    r = eng.reduce(ins.op, src, axis=ins.axes, keepdims=ins.keepdims)
    if not eng.is_block(r):
        r = eng.from_numpy(np.asarray(r))
    return (eng.astype(r, ins.dtype) if ins.dtype is not None else r), eng


def _astype(ins: I.AsType, me: int) -> tuple[Any, Engine]:
    eng = STORE.engine(ins.src)
    return eng.astype(STORE.get(ins.src), ins.dtype), eng


def _reshape(ins: I.Reshape, me: int) -> tuple[Any, Engine]:
    eng = STORE.engine(ins.src)
    return eng.reshape(STORE.get(ins.src), ins.shape), eng


def _getitem(ins: I.GetItem, me: int) -> tuple[Any, Engine]:
    eng = STORE.engine(ins.src)
    return _clone(eng.getitem(STORE.get(ins.src), ins.key)), eng


def _copy(ins: I.Copy, me: int) -> tuple[Any, Engine]:
    return _clone(STORE.get(ins.src)), STORE.engine(ins.src)


_MAKERS: dict[type, Callable[[Any, int], tuple[Any, Engine]]] = {
    I.New: _new, I.Put: _put, I.Elementwise: _elementwise, I.Apply: _apply, I.Reduce: _reduce,
    I.AsType: _astype, I.Reshape: _reshape, I.GetItem: _getitem, I.Copy: _copy,
}


def _setitem(ins: I.SetItem, me: int) -> None:
    block, eng = STORE.get(ins.block), STORE.engine(ins.block)
    value = _operand(ins.value, me)
    if not isinstance(block, np.ndarray) and isinstance(value, np.ndarray):
        value = eng.from_numpy(value)
    block[ins.key] = value


# -- collectives -----------------------------------------------------------------------


def _torch_group(members: tuple[int, ...], me: int, init_method: str, world: int, all_groups: list,
                 kind: str) -> Any:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if kind in ("cuda", "rocm") else "gloo", init_method=init_method,
                                rank=me, world_size=world)
    # new_group is collective over the whole world: every rank makes every group, in order
    for grp in all_groups:
        key = (tuple(grp), "torch")
        if key not in STORE.groups:
            pg = dist.new_group(list(grp)) if len(grp) < world else None
            STORE.groups[key] = new_group("torch", group=pg)
    return STORE.groups[(members, "torch")]


def _host_group(members: tuple[int, ...], me: int, token: str, pids: list[int]) -> Any:
    """MPI when this mesh was launched under mpirun, else shared memory among the members."""
    from ..collectives import mpi_comms

    if mpi_comms.is_active():
        return new_group("mpi", comm=mpi_comms.mesh_comm(list(members)))
    digest = hashlib.sha1(repr(members).encode()).hexdigest()[:12]
    return new_group("shm", name=f"ma-{token}-{digest}", rank=members.index(me), size=len(members),
                     timeout=float(os.environ.get("MESHARRAY_COLLECTIVE_TIMEOUT", "60")),
                     global_ranks=members, peer_pids=pids)


def _cached(key: tuple, make: Any) -> Any:
    g = STORE.groups.get(key)
    if g is None:
        g = STORE.groups[key] = make()
    return g


def _hier_group(members: tuple[int, ...], me: int, token: str, pids: dict, hosts: dict) -> Any:
    """A group spanning hosts: shared memory among this host's members, a ring of host leaders."""
    domains = [hosts[r][0] for r in members]
    mine = hosts[me][0]
    local_members = tuple(r for r, d in zip(members, domains) if d == mine)
    local = None
    if len(local_members) > 1:
        local = _cached((local_members, None),
                        lambda: _host_group(local_members, me, token, [int(pids.get(r) or 0) for r in local_members]))
    leaders: list[int] = []
    seen: set = set()
    for r, d in zip(members, domains):
        if d not in seen:
            seen.add(d)
            leaders.append(r)
    if me not in leaders:
        return HierCollective(members, me, domains, local, None)
    # (made when first used: every leader reaches that collective; a loop of small ones never makes a ring)
    timeout = float(os.environ.get("MESHARRAY_COLLECTIVE_TIMEOUT", "60"))
    key = tuple(leaders)
    return HierCollective(
        members, me, domains, local, STORE.groups.get((key, "ring")),
        make_ring=lambda: _cached((key, "ring"), lambda: _ring_group(key, me, token, hosts)),
        make_tree=lambda: _cached((key, "tree"), lambda: leader_tree(key, me, token, {r: hosts[r][1] for r in key},
                                                                     timeout)))


def _ring_group(leaders: tuple[int, ...], me: int, token: str, hosts: dict) -> RingCollective:
    plane = process_plane()
    if plane is None:
        raise MeshArrayError(f"rank {me} has no data plane: a group spanning hosts needs workers started by "
                             f"host agents (ma.attach)")
    n, i = len(leaders), leaders.index(me)
    digest = hashlib.sha1(repr(leaders).encode()).hexdigest()[:12]
    timeout = float(os.environ.get("MESHARRAY_COLLECTIVE_TIMEOUT", "60"))

    def tag(k: int) -> bytes:
        return f"ring/{token}/{digest}/{k}".encode()

    right_rank, left_rank = leaders[(i + 1) % n], leaders[(i - 1) % n]
    right = plane.connect(hosts[right_rank][1], tag(i), timeout=timeout)
    try:
        left = rendezvous().take(tag((i - 1) % n), timeout)
    except TimeoutError as exc:
        right.close()
        raise ActorDiedError(ranks=(left_rank,), reason=f"rank {left_rank} did not open its ring link to rank "
                                                        f"{me} within {timeout:g} s") from exc
    return RingCollective(i, n, right, left, peers=(f"rank {right_rank}", f"rank {left_rank}"))


def _move_group_of(order: tuple[int, ...], me: int, ins: I.Move) -> Any:
    """The group a move's participants ``order`` (sorted) share: shared memory on one host, hierarchical
    across hosts, MPI under mpirun (cached by participants and the move's token)."""
    pids = ins.pids or {}
    hosts = ins.hosts
    g = STORE.groups.get((order, "move", ins.token))
    if g is None:
        if hosts and len({hosts[r][0] for r in order}) > 1:
            g = _hier_group(order, me, ins.token, pids, hosts)
        elif ins.mpi:
            g = _host_group(order, me, ins.token, [int(pids.get(r) or 0) for r in order])
        else:
            digest = hashlib.sha1(repr(order).encode()).hexdigest()[:12]
            g = new_group("shm", name=f"ma-{ins.token}-{digest}", rank=order.index(me), size=len(order),
                          timeout=float(os.environ.get("MESHARRAY_COLLECTIVE_TIMEOUT", "60")),
                          global_ranks=order, peer_pids=[int(pids.get(r) or 0) for r in order])
        STORE.groups[(order, "move", ins.token)] = g
    return g


def _move_group(members: tuple[int, ...], me: int, ins: I.Move, token: str) -> tuple[Any, Engine] | None:
    """Send (``me`` first in ``members``) or receive one block of a move; the received block.

    The sender broadcasts a header: whether its block exists, and where it
    lies in its memory. On one host each receiver then copies the block
    straight out of the sender's memory (cross-memory attach, one copy), and
    everyone agrees it is done (the sender keeps the block untouched till
    then); where the kernel refuses that, or across hosts (a ring of host
    leaders) or under MPI, the block is broadcast through the group itself.
    """
    root = members[0]
    order = tuple(sorted(members))
    ri = order.index(root)
    g = _move_group_of(order, me, ins)
    eng = get_engine(ins.engine)
    dtype = np.dtype(ins.dtype)
    # the header: 1 (the block follows), 0 (the sender's block failed: its own error
    # stays with it), -1 (sending failed: a message follows); then where the block lies
    hdr = np.zeros(4, dtype=np.int64)
    host = None
    local_err = None
    if me == root:
        try:
            block, eng = STORE.get(ins.src), STORE.engine(ins.src)
        except BaseException as exc:
            local_err = exc
        else:
            try:
                host = np.asarray(eng.host_view(block), order="C")
                if host.dtype != dtype:
                    host = host.astype(dtype)
                if host.shape != tuple(ins.shape):
                    raise MeshArrayError(f"block {ins.src} has local shape {host.shape}; the move expected "
                                         f"{tuple(ins.shape)}")
                cma.allow_attach()
                hdr[:] = (1, os.getpid(), host.ctypes.data, host.nbytes)
            except BaseException as exc:
                local_err = exc
                hdr[0] = -1
    g.broadcast(hdr, root=ri)
    if hdr[0] != 1:
        ids = ins.ids or {}
        src_rank = next((r for (_t, r), i in ids.items() if i == root), root)
        if hdr[0] == -1:
            msg = np.zeros(1024, dtype=np.uint8)
            if local_err is not None:
                text = f"{type(local_err).__name__}: {local_err}".encode()[:1024]
                msg[:len(text)] = np.frombuffer(text, dtype=np.uint8)
            g.broadcast(msg, root=ri)
            if local_err is not None:
                raise local_err
            raise MeshArrayError(f"rank {src_rank} could not send its block: "
                                 f"{msg.tobytes().rstrip(bytes(1)).decode(errors='replace')}")
        if local_err is not None:
            raise local_err
        src_tok = next((t for (t, _r), i in ids.items() if i == root), None)
        raise InputFailed([src_rank], ins.src, src_tok if src_tok != token else None)
    res = STORE.take(tuple(ins.shape), dtype) if host is None else host
    if isinstance(g, ShmCollective):
        need = np.zeros(len(order), dtype=np.int32)
        if me != root and res.nbytes:
            try:
                cma.transfer(False, int(hdr[1]), res.ctypes.data, int(hdr[2]), int(hdr[3]))
            except cma.CmaDenied:
                need[order.index(me)] = 1
        # also the barrier that keeps the sender's block in place until every reader is done
        if np.asarray(g.allreduce(need, op="max")).any():
            g.broadcast(res, root=ri)
    else:
        g.broadcast(res, root=ri)
    if me == root:
        return None
    return (eng.from_numpy(res) if eng.name != "numpy" else res), eng


def _small(items: list[I.Move], g: Any) -> bool:
    """Whether ``items`` (moves of one group) travel as :func:`_move_small`: small blocks on one host."""
    return isinstance(g, ShmCollective) and all(_nbytes(m) <= I.INLINE_MOVE for m in items) and \
        _small_layout([_nbytes(m) for m in items])[1] <= g.capacity


def _small_layout(sizes: list[int]) -> tuple[list[int], int]:
    """Where each block starts in :func:`_move_small`'s broadcast (after a status word each, every block
    at a multiple of 64 bytes, so that a received block is aligned for any dtype), and its length."""
    offs, off = [], 8 * len(sizes)
    for n in sizes:
        off = -(-off // 64) * 64
        offs.append(off)
        off += n
    return offs, off


def _nbytes(m: I.Move) -> int:
    return math.prod(m.shape) * np.dtype(m.dtype).itemsize


def _move_small(members: tuple[int, ...], me: int, items: list[I.Move], token: str) -> list | None:
    """Send (``me`` first in ``members``) or receive the small blocks of moves ``items`` in one broadcast;
    the received blocks, each a ``(block, engine)`` or the exception that stands for it.

    The sender puts a status word per block (1: it follows; 0: the sender's
    block failed, its own error stays with it; -1: sending failed, a message
    follows) and the blocks themselves into one broadcast through the group's
    shared memory, and goes on at once: nobody reads its memory afterwards,
    so no closing barrier (the next op of the group waits until the receivers
    copied this one out). Moves of one step to the same ranks (the weights of
    a model) are merged by the controller into one instruction, so they cost
    one such broadcast.
    """
    root = members[0]
    ri = tuple(sorted(members)).index(root)
    g = _move_group_of(tuple(sorted(members)), me, items[0])
    n = len(items)
    sizes = [_nbytes(m) for m in items]
    offs, total = _small_layout(sizes)
    wire = np.zeros(total + 64, dtype=np.uint8)  # (its start moved to a multiple of 64 bytes below)
    wire = wire[-wire.ctypes.data % 64:][:total]
    status = wire[:8 * n].view(np.int64)
    errors: list = [None] * n
    if me == root:
        for j, m in enumerate(items):
            off = offs[j]
            try:
                block, eng = STORE.get(m.src), STORE.engine(m.src)
            except BaseException as exc:
                errors[j] = exc
            else:
                try:
                    host = np.asarray(eng.host_view(block), order="C")
                    if host.dtype != np.dtype(m.dtype):
                        host = host.astype(m.dtype)
                    if host.shape != tuple(m.shape):
                        raise MeshArrayError(f"block {m.src} has local shape {host.shape}; the move expected "
                                             f"{tuple(m.shape)}")
                    wire[off:off + sizes[j]] = host.reshape(-1).view(np.uint8)
                    status[j] = 1
                except BaseException as exc:
                    errors[j] = exc
                    status[j] = -1
    g.broadcast(wire, root=ri)
    texts = {}
    for j in range(n):
        if status[j] == -1:  # (every participant sees the same status words: the same broadcasts follow)
            msg = np.zeros(1024, dtype=np.uint8)
            if errors[j] is not None:
                text = f"{type(errors[j]).__name__}: {errors[j]}".encode()[:1024]
                msg[:len(text)] = np.frombuffer(text, dtype=np.uint8)
            g.broadcast(msg, root=ri)
            texts[j] = msg.tobytes().rstrip(bytes(1)).decode(errors="replace")
    if me == root:
        return None
    ids = items[0].ids or {}
    src_rank = next((r for (_t, r), i in ids.items() if i == root), root)
    src_tok = next((t for (t, _r), i in ids.items() if i == root), None)
    got: list = []
    for j, m in enumerate(items):
        off = offs[j]
        if status[j] == 1:
            eng = get_engine(m.engine)
            res = wire[off:off + sizes[j]].view(np.dtype(m.dtype)).reshape(tuple(m.shape))
            got.append(((eng.from_numpy(res) if eng.name != "numpy" else res), eng))
        elif status[j] == -1:
            got.append(MeshArrayError(f"rank {src_rank} could not send its block: {texts[j]}"))
        else:
            got.append(InputFailed([src_rank], m.src, src_tok if src_tok != token else None))
    return got


def _name_op(exc: BaseException, ins: Any, me: int) -> None:
    """Say in ``exc`` which op failed (once: ops that use the failed block raise the same exception)."""
    notes = getattr(exc, "__notes__", ())
    if any(n.startswith("mesharray: ") for n in notes):
        return
    what = ins.fn if isinstance(ins, I.Apply) else getattr(ins, "name", None) or type(ins).__name__
    block = getattr(ins, "out", getattr(ins, "block", None))
    exc.add_note(f"mesharray: in the distributed op {what!r} (block {block}) on rank {me}")


class DataActor(Actor):
    """The system actor holding this worker's blocks of distributed arrays."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.rank: int | None = None
        self.funcs: dict[int, tuple[list, list]] = {}  # captured steps by id: (program, temporaries)
        self.calls: dict[int, Any] = {}  # recipes' functions by key (``defcall``)
        self.plans: dict[int, bytes] = {}  # collectives' plans by key (``defplan``)
        #: the first failure of an effect (backward()) since this rank's last wait: raised there
        self.unreported: BaseException | None = None
        #: a member's program of a small reduction (frees, plans by key, checks), compiled
        self._runner = PlanRunner(STORE, self.plans, _PLANS, _LAST_PLAN, self._planned, _settled)
        # the endpoint as the worker's call path finds it (this instance's attribute first): compiled
        self.__dict__["run"] = FastRun(self._runner, self._run_program)

    def _me(self) -> int:
        if self.rank is None:
            self.rank = self._runner.me = int(context().global_rank)
        return self.rank

    @endpoint
    def meta(self, bid: int) -> tuple:
        """Local shape, dtype and whether it requires grad, of block ``bid`` (raises its failure if it could
        not be made).

        The dtype as its string where that names it exactly (:func:`meta_dtype` turns it back):
        pickling a ``numpy.dtype`` runs its ``__reduce__`` in Python, several times the cost of
        the rest of the reply when its code paths are out of the caches (right after a large
        collective), where a string is copied as bytes.
        """
        b, eng = STORE.get(bid), STORE.engine(bid)
        dt = eng.dtype_of(b)
        return tuple(eng.shape_of(b)), (dt.str if dt.kind in "biufcmM" else dt), bool(getattr(b, "requires_grad", False))

    @endpoint
    def run(self, program: list) -> Any:
        """Run instructions in order; returns the result of the last :class:`Fetch`, or of a
        :class:`Planned`'s fetch (taken after the rest of the program), if any.

        Nothing an instruction raises stops the program (the ops after it, a collective
        peers wait in, its frees still run): an op that makes a block keeps its failure as
        the block's; a fetch that fails, or anything else unexpected, is raised once the
        whole program ran; an *effect* (``("effect", ins)``: ``backward()``) that fails
        keeps its failure for the next wait on this rank (``("check", ranks)``).
        """
        if self._runner.run(program):  # (a member's part of a small reduction: _core.PlanRunner)
            return None
        return self._run_program(program)

    def _run_program(self, program: list) -> Any:
        # run's Python path (its instance's FastRun calls it when PlanRunner does not run the program)
        me = self._me()
        for raw in program:
            if raw[0] in _CAPTURED:  # (a captured step's definition or replay: see darray.function)
                program = expand_calls(program, self.calls, self.plans, _missing_call) or self._expand(program)
                break
        result = None
        fetch = None
        failed: BaseException | None = None  # raised once the whole program ran
        made: np.ndarray | None = None  # the fast path's block (a Planned's result, when it ran there)
        done: set[int] | None = None  # instructions a backward's buckets already ran (see .overlap)
        blocks, engines, failures = STORE.blocks, STORE.engines, STORE.failed
        for idx, raw in enumerate(program):
            if done is not None and idx in done:
                continue
            code = raw[0]
            if STORE.lazy and code not in _KEEPS_LAZY:  # (an op that may read a block still being made)
                STORE.settle()
            if code == "apply" or code == "ew":
                if code == "apply" and type(raw[2]) is BlockCall and raw[2].backward:
                    done = self._backward(program, idx, me, done)
                    continue
                got = fast_op(raw, blocks, engines, failures)  # (the common case, compiled: _fast_apply)
                if got is True:
                    continue
                if got is not None:
                    _fast_apply(raw, me, got)
                    continue
            if code == "kplan" or code == "plan":  # (a reduction in a loop: first, undecoded)
                out, src, plan, ranks = raw[1:5]
                if code == "kplan":
                    plan = self.plans.get(plan)
                    if plan is None:  # (a bug, not a user error: its peers' collective times out)
                        STORE.fail(out, MeshArrayError(f"plan {raw[3]} is not defined on this rank "
                                                       f"(its defplan never came)"))
                        continue
                made = self._planned(me, out, src, plan, me not in ranks)
                if me in ranks:
                    fetch = out  # after the rest of the program (its frees), which a failed out must not skip
                continue
            if code == "free":
                STORE.free(raw[1])
                continue
            if code == "fail-replay":
                failed = failed or MeshArrayError(f"captured step {raw[1]} is not defined on rank {me}")
                continue
            if code == "fail":  # (an op the controller could not send: its block keeps why)
                STORE.fail(raw[1], raw[2])
                continue
            if code == "effect":
                inner = raw[1]
                if inner[0] == "apply" and type(inner[2]) is BlockCall and inner[2].backward:
                    done = self._backward(program, idx, me, done, inner)
                else:
                    self._effect(inner, me)
                self._effect_done(inner[1])
                continue
            if code == "check":
                # the first failure of this rank's effects since its last wait, raised once the
                # whole program ran (raising here would skip what follows: a collective peers wait in)
                if me in raw[1] and self.unreported is not None:
                    failed = failed or self.unreported
                    self.unreported = None
                continue
            try:
                ins = I.decode(raw)
                t = type(ins)
                make = _MAKERS.get(t)
                if make is not None:
                    try:
                        block, eng = make(ins, me)
                    except BaseException as exc:
                        _name_op(exc, ins, me)
                        STORE.fail(ins.out, exc)
                    else:
                        STORE.put(ins.out, block, eng)
                elif t is I.Fetch:
                    if not ins.ranks or me in ins.ranks:
                        bid = ins.block
                        result = pack_small(_host(STORE.engine(bid), STORE.get(bid)))
                elif t is I.Free:
                    STORE.free(ins.blocks)
                elif t is I.Collective:
                    self._collective(me, ins)
                elif t is I.Move:
                    self._move(me, ins)
                elif t is I.Moves:
                    self._move(me, [I.decode(m) for m in ins.moves])
                elif t is I.SetItem:
                    try:
                        _setitem(ins, me)
                    except BaseException as exc:  # (the block is as it was; its uses raise this)
                        _name_op(exc, ins, me)
                        STORE.fail(ins.block, exc)
                else:
                    raise TypeError(f"not a distributed-array instruction: {ins!r}")
            except BaseException as exc:
                failed = failed or exc
        if failed is not None:
            raise failed
        if fetch is not None:
            if made is not None and STORE.blocks.get(fetch) is made:
                return pack_small(STORE.blocks[fetch])  # the host block the fast path just made and stored
            result = pack_small(_host(STORE.engine(fetch), STORE.get(fetch)))
        return result

    def _effect(self, raw: tuple, me: int) -> None:
        """An op run for its effect (its block, if any, is not kept): see :meth:`_effect_done`."""
        if not (raw[0] == "apply" and _fast_apply(raw, me)):
            ins = I.decode(raw)
            try:
                block, eng = _MAKERS[type(ins)](ins, me)
            except BaseException as exc:
                _name_op(exc, ins, me)
                STORE.fail(ins.out, exc)
            else:
                STORE.put(ins.out, block, eng)

    def _effect_done(self, out: int) -> None:
        """After an effect: its failure kept for this rank's next wait, its block dropped."""
        exc = STORE.failed.pop(out, None)
        STORE.blocks.pop(out, None)
        STORE.engines.pop(out, None)
        if exc is not None and self.unreported is None:
            self.unreported = exc

    def _backward(self, program: list, idx: int, me: int, done: set[int] | None,
                  raw: tuple | None = None) -> set[int] | None:
        """Run the backward at ``program[idx]`` (``raw``: the apply, when that is an effect wrapping it), its
        gradients' reductions bucketed and started while it runs where the program reduces them next
        (:mod:`.overlap`); the instructions that did."""
        if raw is None:
            raw = program[idx]

        def group_of(fields: tuple, src: int) -> Any:
            ins = I.Collective(0, src, *fields)
            members = next((tuple(g) for g in ins.groups if me in g), None)
            if members is None or len(members) < 2:
                return None
            return self._group(members, me, ins, None)

        try:
            ov = prepare(program, idx, STORE.get, group_of, STORE.engine, self.plans.get)
        except BaseException:  # (anything odd: the instructions run one by one, as written)
            ov = None
        ins = I.decode(raw)
        error = None
        try:
            block, eng = _apply(ins, me)
        except BaseException as exc:
            _name_op(exc, ins, me)
            STORE.fail(ins.out, exc)
            error = exc
        else:
            STORE.put(ins.out, block, eng)
        if ov is None:
            return done
        more = ov.finish(STORE, error)
        return more if done is None else done | more

    def _expand(self, program: list) -> list:
        """``program`` with each captured step's replay replaced by the step's instructions, its ids
        filled in and its temporaries freed at its end; definitions kept (by id) for later replays;
        each ``call`` an ``apply`` of the function its key names (kept by ``defcall``), plans kept
        by their keys (``defplan``: each ``kplan`` is looked up where it runs)."""
        out: list = []
        calls = self.calls
        for raw in program:
            code = raw[0]
            if code == "call":
                fn = calls.get(raw[2])
                out.append(("apply", raw[1], _missing_call(raw[2]) if fn is None else fn, raw[3]))
            elif code == "defcall":
                calls[raw[1]] = raw[2]
            elif code == "uncall":
                calls.clear()
            elif code == "defplan":
                self.plans[raw[1]] = raw[2]
            elif code == "def":
                _, fid, prog, temps = raw
                self.funcs[fid] = (prog, temps)
            elif code == "undef":
                for fid in raw[1]:
                    self.funcs.pop(fid, None)
            elif code == "replay":
                _, fid, base, args = raw
                got = self.funcs.get(fid)
                if got is None:  # (never defined here: the controller sent its definition elsewhere)
                    out.append(("fail-replay", fid))
                    continue
                prog, temps = got
                out.extend(I.remap(prog, base, args))
                if temps:
                    out.append(("free", [base + t[1] for t in temps]))
            else:
                out.append(raw)
        return out

    def _collective(self, me: int, ins: I.Collective) -> None:
        # Sent fire-and-forget: any failure is kept as the failure of block ``out``
        # (raised by the next fetch/use of it), never raised out of the program.
        STORE.blocks.pop(ins.out, None)
        try:
            block, eng = self._collective_inner(me, ins)
        except BaseException as exc:
            STORE.fail(ins.out, exc)
        else:
            STORE.put(ins.out, block, eng)

    def _planned(self, me: int, out: int, src: int, plan: bytes, later: bool = False) -> np.ndarray | None:
        """A :class:`~.instructions.Planned` collective: the plan's bytes are unpickled once; once
        its group is known to be shared memory, an allreduce of a contiguous NumPy block goes
        straight to the group (what :meth:`_collective_inner` would do, without deciding it again).

        ``later``: this rank does not send ``out`` back. A small allreduce then may leave its
        host round before the result is in (``small_allreduce_lazy``): ``out`` is in
        :attr:`BlockStore.lazy` until the group's next operation, or an op of this rank that may
        read it (``run``, :meth:`BlockStore.get`), finishes the round.
        """
        if STORE.lazy and src in STORE.lazy:
            STORE.settle()
        last = _LAST_PLAN
        if plan == last[0]:  # (a memcmp: hashing a plan of many ranks' hosts for the dict cost more)
            st = last[1]
        else:
            st = _PLANS.get(plan)
            if st is None:
                if len(_PLANS) >= 256:
                    _PLANS.clear()
                st = _PLANS[plan] = [pickle.loads(plan), None]
            last[0], last[1] = plan, st
        fast: tuple[ShmCollective | HierCollective, str, np.dtype, Engine, int, str, tuple | None] | None = st[1]
        if fast is not None:
            g, op, dtype, eng, small, kdt, _target = fast
            blocks = STORE.blocks
            blocks.pop(out, None)
            block = blocks.get(src)
            if (type(block) is np.ndarray and block.dtype == dtype and block.flags.c_contiguous
                    and STORE.engines.get(src) is eng):
                try:
                    if block.nbytes <= small:  # (checked here: the plan's dtype and op, a contiguous block)
                        res = np.empty(block.shape, dtype)  # (far below the pool's sizes)
                        if later:
                            STORE.lazy[out] = g  # (first: another thread may finish the round at once)
                            failed = g.small_allreduce_lazy(block, res, op, kdt, partial(_settled, out, res, eng))
                            if failed is None:
                                return None
                            STORE.lazy.pop(out, None)
                        else:
                            failed = g.small_allreduce_prechecked(block, res, op, kdt)
                    else:
                        res = STORE.take(block.shape, dtype)
                        failed = g.allreduce_checked(block, out=res, op=op)
                except BaseException as exc:
                    STORE.lazy.pop(out, None)
                    STORE.fail(out, exc)
                    return None
                if failed:
                    STORE.fail(out, InputFailed(failed, out))
                    return None
                STORE.put(out, res, eng)
                return res  # (a NumPy block: the caller may send it back as it is)
        ins = I.Collective(out, src, *st[0])
        self._collective(me, ins)
        if fast is None and ins.op in _SHM_OPS and ins.backend is None:
            # the group the generic path just used: shared memory, more than one member
            members = next(tuple(m) for m in ins.groups if me in m)
            grp = STORE.groups.get((members, None))
            if isinstance(grp, (ShmCollective, HierCollective)) and grp.size > 1:
                dtype = np.dtype(ins.dtype)
                try:
                    kdt = grp._kernel_dtype(dtype, ins.op)
                except (TypeError, ValueError):  # no kernel for it: the general path, which says so
                    return None
                # (the names interned: the compiled path compares them with its own by identity)
                st[1] = (grp, sys.intern(ins.op), dtype, get_engine("numpy"), grp.small_bytes, sys.intern(kdt),
                         grp.lazy_target())
        return None

    def _move(self, me: int, ins: I.Move | list[I.Move]) -> None:
        """This process's part of a move, or of moves the controller merged (a list sharing their groups):
        its sends and its receive, in the move's order."""
        items = ins if isinstance(ins, list) else [ins]
        first = items[0]
        me = first.ids.get((self.token, me), me) if first.ids else me
        if me in first.copies or any(me in g[1:] for g in first.groups):
            # (only a process making ``out`` may touch that id: a sender in another
            # process mesh has ids of its own, maybe the same number)
            for m in items:
                STORE.blocks.pop(m.out, None)
        if me in first.copies:
            for m in items:
                try:
                    STORE.put(m.out, _clone(STORE.get(m.src)), STORE.engine(m.src))
                except BaseException as exc:
                    STORE.fail(m.out, exc)
        for g in first.groups:
            if me not in g:
                continue
            members = tuple(g)
            try:
                small = _small(items, _move_group_of(tuple(sorted(members)), me, first))
                if small:
                    got = _move_small(members, me, items, self.token)
            except BaseException as exc:
                if me != g[0]:  # a sender makes no block: its own failure stays with its src
                    for m in items:
                        STORE.fail(m.out, exc)
                continue
            if small:
                for m, one in zip(items, got or ()):
                    if isinstance(one, BaseException):
                        STORE.fail(m.out, one)
                    else:
                        STORE.put(m.out, *one)
                continue
            for m in items:
                try:
                    one = _move_group(members, me, m, self.token)
                except BaseException as exc:
                    if me != g[0]:
                        STORE.fail(m.out, exc)
                    continue
                if one is not None:
                    STORE.put(m.out, *one)

    def _group(self, members: tuple[int, ...], me: int, ins: I.Collective, eng: Engine | None) -> Any:
        g = STORE.groups.get((members, ins.backend))
        if g is not None:
            return g
        if ins.backend == "torch":
            init_method, world = ins.torch_init
            g = _torch_group(members, me, init_method, world, [list(x) for x in ins.groups],
                             eng.name if eng else "torch")
        elif ins.hosts and len({ins.hosts[r][0] for r in members}) > 1:
            g = _hier_group(members, me, self.token, ins.pids or {}, ins.hosts)
        else:
            g = _host_group(members, me, self.token, [int((ins.pids or {}).get(r) or 0) for r in members])
        STORE.groups[(members, ins.backend)] = g
        return g

    def _collective_inner(self, me: int, ins: I.Collective) -> tuple[Any, Engine]:
        members = next(tuple(g) for g in ins.groups if me in g)
        n = len(members)
        dtype, op = ins.dtype, ins.op
        eng: Engine | None
        try:
            block, eng = STORE.get(ins.src), STORE.engine(ins.src)
            if eng.dtype_of(block) != np.dtype(dtype):
                block = eng.astype(block, dtype)
            local_err = None
        except BaseException as exc:  # this rank's input failed: its peers must still hear of it
            local_err, eng, block = exc, None, None
        g = self._group(members, me, ins, eng)
        kind, _, arg = op.partition(":")
        if n > 1 and kind in COLLECTIVE_OP and hasattr(g, "allreduce_checked"):
            # shared memory: the agreement rides on the reduction's own arrival flags
            if local_err is not None:
                g.allreduce_checked(np.zeros(1, dtype=dtype), op=op, failed=True)
                raise local_err
            assert eng is not None
            host = np.asarray(eng.host_view(block), order="C")
            res = STORE.take(host.shape, host.dtype)
            failed = g.allreduce_checked(host, out=res, op=op)
            if failed:
                raise InputFailed(failed, ins.out)
            return (eng.from_numpy(res) if eng.name != "numpy" else res), eng
        if n > 1:
            # Agree on whether every member's input exists before moving data: a member
            # that skipped the collective would leave its peers waiting on it.
            mine = np.zeros(n, dtype=np.int32)
            mine[members.index(me)] = local_err is not None
            flags = np.asarray(g.allreduce(mine, op="max")).reshape(-1)
            failed = [members[j] for j in range(n) if flags[j]]
            if failed:
                if local_err is not None:
                    raise local_err
                raise InputFailed(failed, ins.out)
        if local_err is not None:
            raise local_err
        assert eng is not None
        if ins.backend == "torch":
            x = np.asarray(block, order="C") if isinstance(block, np.ndarray) else block.contiguous()
            if kind == "allgather":
                res = g.allgather(x)
            elif kind == "broadcast":
                res = g.broadcast(_clone(x), root=int(arg))
            elif kind == "reduce_scatter":
                res = g.reduce_scatter(x.reshape(n, -1), op=arg).reshape((x.shape[0] // n,) + tuple(x.shape[1:]))
            else:
                res = g.allreduce(x, op=op)
            return res, eng
        host = np.asarray(eng.host_view(block), order="C")
        if kind == "allgather":
            res = STORE.take((n,) + host.shape, host.dtype)
            if n == 1:
                res[0] = host
            else:
                g.allgather(host, out=res)
        elif kind == "broadcast":
            res = STORE.take(host.shape, host.dtype)
            res[...] = host
            if n > 1:
                g.broadcast(res, root=int(arg))
        elif kind == "reduce_scatter":
            res = STORE.take((host.shape[0] // n,) + host.shape[1:], host.dtype)
            if n == 1:
                res[...] = host
            else:
                g.reduce_scatter(host.reshape(n, -1), out=res, op=arg)
        else:
            res = STORE.take(host.shape, host.dtype)
            if n == 1:
                res[...] = host
            else:
                g.allreduce(host, out=res, op=op)
        return (eng.from_numpy(res) if eng.name != "numpy" else res), eng
