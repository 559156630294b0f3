"""Distributed storage of ``MeshArray``: each rank's block lives in its worker.

The controller keeps only metadata (a block id, the global rank holding each
mesh position, the local shape and dtype); the blocks live in a built-in
system actor, :class:`_DataActor`, spawned once per process mesh, which keeps
them by id on the mesh's tensor engine, runs elementwise operations,
reductions, ``astype``/``reshape``/indexing of local axes and ``matmul`` on
them, and takes part in collectives across ranks.

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
garbage-collected (a fire-and-forget ``free``).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import secrets
import threading
import weakref
from typing import Any, Sequence

import numpy as np

from ._core import Shape
from .actor import Actor, endpoint
from .errors import MeshArrayError, MeshShapeError

__all__ = ["DistributedStorage", "data_context"]

# ---------------------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------------------

# this worker's blocks by id (module-global so that a distributed MeshArray passed
# to an endpoint on this worker unpickles to its local block)
_BLOCKS: dict[int, Any] = {}
_FAILED: dict[int, BaseException] = {}
# failures of freed blocks, the most recent few (an intermediate of a chain of
# reductions is freed before the controller follows the chain to its original)
_FREED_FAILED: dict[int, BaseException] = {}
_GROUPS: dict[tuple, Any] = {}


_POOL: dict[int, list] = {}
_POOL_MIN = 1 << 20  # only large blocks are worth recycling
_POOL_PER_SIZE = 4


def _pool_take(shape: tuple, dtype: np.dtype) -> np.ndarray:
    nbytes = math.prod(shape) * dtype.itemsize
    free = _POOL.get(nbytes)
    if free:
        return free.pop().view(dtype).reshape(shape)
    return np.empty(shape, dtype=dtype)


def _pool_give(block: Any) -> None:
    # a freed NumPy block that owns its memory (nobody else can see it: views were
    # never handed out beyond this worker's endpoints) is kept for reuse
    if not isinstance(block, np.ndarray) or block.nbytes < _POOL_MIN:
        return
    base = block if block.base is None else block.base
    if not isinstance(base, np.ndarray) or base.base is not None or base.nbytes != block.nbytes:
        return
    import sys

    if sys.getrefcount(base) > 4:  # still referenced elsewhere (an endpoint kept it)
        return
    free = _POOL.setdefault(block.nbytes, [])
    if len(free) < _POOL_PER_SIZE:
        free.append(base.reshape(-1).view(np.uint8))


def _engine_for(block: Any):
    from .engines import get_engine

    if isinstance(block, np.ndarray) or np.isscalar(block):
        return get_engine("numpy")
    dev = getattr(block, "device", None)
    kind = getattr(dev, "type", "cpu")
    if kind == "cpu":
        return get_engine("torch")
    if kind == "cuda":
        import torch

        return get_engine("rocm" if getattr(torch.version, "hip", None) else "cuda")
    return get_engine(kind)


def _block(bid: int) -> Any:
    if bid in _FAILED:
        # the op that should have made this block failed: its original exception
        # (type and traceback) is what the controller sees, wrapped in ActorError
        raise _FAILED[bid]
    if bid in _FREED_FAILED and bid not in _BLOCKS:
        raise _FREED_FAILED[bid]
    try:
        return _BLOCKS[bid]
    except KeyError:
        raise MeshArrayError(f"block {bid} is not on this worker (freed, or never made here)") from None


def local_block(bid: int) -> Any:
    """The block ``bid`` of this worker (what an endpoint receives for a distributed array)."""
    return _block(bid)


def _arg(a: Any, rank: int) -> Any:
    tag = a[0]
    if tag == "b":
        return _block(a[1])
    if tag == "r":  # a value per rank
        return a[1][rank]
    return a[1]


def _torch_group(members: tuple[int, ...], me: int, torch_init: tuple):
    import torch.distributed as dist

    from .collectives.torch_dist import TorchCollective

    init_method, world, all_groups, kind = torch_init
    if not dist.is_initialized():
        dist.init_process_group("nccl" if kind in ("cuda", "rocm") else "gloo", init_method=init_method,
                                rank=me, world_size=world)
    # new_group is collective over the whole world: every rank makes every group, in order
    for grp in all_groups:
        key = (tuple(grp), "torch")
        if key not in _GROUPS:
            pg = dist.new_group(list(grp)) if len(grp) < world else None
            _GROUPS[key] = TorchCollective(group=pg)
    return _GROUPS[(members, "torch")]


def _group(members: tuple[int, ...], me: int, token: str, backend: str | None, torch_init: tuple = (),
           pids: Sequence[int] | None = None):
    key = (members, backend)
    g = _GROUPS.get(key)
    if g is not None:
        return g
    if backend == "torch":
        g = _torch_group(members, me, torch_init)
    else:
        mpi = None
        if backend in (None, "mpi"):
            try:
                from .bootstrap import mpi as _mpi  # the MPI helper's communicators

                mpi = _mpi if _mpi.is_active() else None
            except Exception:
                mpi = None
        if mpi is not None:
            from .collectives.mpi import MpiCollective

            g = MpiCollective(mpi.mesh_comm(list(members)))
        else:
            from .collectives.shm import ShmCollective

            digest = hashlib.sha1(repr(members).encode()).hexdigest()[:12]
            g = ShmCollective(f"ma-{token}-{digest}", members.index(me), len(members),
                              timeout=float(os.environ.get("MESHARRAY_COLLECTIVE_TIMEOUT", "60")),
                              global_ranks=members, peer_pids=pids)
    _GROUPS[key] = g
    return g


class _DataActor(Actor):
    """The system actor holding this worker's blocks of distributed arrays."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.rank: int | None = None

    def _me(self) -> int:
        if self.rank is None:
            from .actor import context

            self.rank = int(context().global_rank)
        return self.rank

    @endpoint
    def meta(self, bid: int) -> tuple:
        """Local shape and dtype of block ``bid`` (raises its failure if it could not be made)."""
        b = _block(bid)
        eng = _engine_for(b)
        return tuple(eng.shape_of(b)), eng.dtype_of(b)

    @endpoint
    def run(self, program: list) -> Any:
        """Run instructions in order; returns the result of the last ``fetch``/``coll`` if any."""
        me = self._me()
        result = None
        for ins in program:
            op, out = ins[0], ins[1]
            try:
                if op == "fetch":
                    result = _pack_small(_host(_block(out)))
                    continue
                if op == "free":
                    for b in out:
                        _pool_give(_BLOCKS.pop(b, None))
                        exc = _FAILED.pop(b, None)
                        if exc is not None:
                            # a later result's _InputFailed may still point here
                            _FREED_FAILED[b] = exc
                            while len(_FREED_FAILED) > 64:
                                del _FREED_FAILED[next(iter(_FREED_FAILED))]
                    continue
                if op == "coll":
                    result = self._collective(me, *ins[1:])
                    continue
                if op == "setitem":
                    _setitem(_block(out), ins[2], _arg(ins[3], me))
                    continue
                _BLOCKS[out] = _execute(op, ins[2:], me)
                _FAILED.pop(out, None)
            except BaseException as exc:
                if op in ("fetch", "coll", "setitem"):
                    raise
                _BLOCKS.pop(out, None)
                _FAILED[out] = exc
        return result

    def _collective(self, me: int, out: int, src: int, op: str, groups: list, backend: str | None,
                    dtype: str, torch_init: tuple = (), pids: dict | None = None) -> None:
        # Sent fire-and-forget: any failure is kept as the failure of block ``out``
        # (raised by the next fetch/use of it), never raised out of the program.
        _BLOCKS.pop(out, None)
        try:
            self._collective_inner(me, out, src, op, groups, backend, dtype, torch_init, pids)
            _FAILED.pop(out, None)
        except BaseException as exc:
            _BLOCKS.pop(out, None)
            _FAILED[out] = exc

    def _collective_inner(self, me: int, out: int, src: int, op: str, groups: list, backend: str | None,
                          dtype: str, torch_init: tuple, pids: dict | None) -> None:
        members = next(tuple(g) for g in groups if me in g)
        n = len(members)
        try:
            block = _block(src)
            eng = _engine_for(block)
            if eng.dtype_of(block) != np.dtype(dtype):
                block = eng.astype(block, dtype)
            local_err = None
        except BaseException as exc:  # this rank's input failed: its peers must still hear of it
            local_err, eng = exc, None
        if backend == "torch":
            g = _group(members, me, self.token, backend,
                       torch_init[:2] + ([list(x) for x in groups], eng.name if eng else "torch") if torch_init else ())
        else:
            g = _GROUPS.get((members, backend)) or _group(
                members, me, self.token, backend, pids=[int((pids or {}).get(r) or 0) for r in members])
        kind, _, arg = op.partition(":")
        fused = n > 1 and kind in _COLLECTIVE_OP and hasattr(g, "allreduce_checked")
        if fused:
            # shared memory: the agreement rides on the reduction's own arrival flags
            if local_err is not None:
                g.allreduce_checked(np.zeros(1, dtype=dtype), op=op, failed=True)
                raise local_err
            host = np.asarray(eng.host_view(block), order="C")
            res = _pool_take(host.shape, host.dtype)
            failed = g.allreduce_checked(host, out=res, op=op)
            if failed:
                raise _InputFailed(failed, out)
            _BLOCKS[out] = eng.from_numpy(res) if eng.name != "numpy" else res
            return
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
                raise _InputFailed(failed, out)
        if local_err is not None:
            raise local_err
        # op: a reduction ("sum", ...) for allreduce, or "allgather", "broadcast:ROOT",
        # "reduce_scatter:OP"
        if backend == "torch":
            x = np.asarray(block, order="C") if isinstance(block, np.ndarray) else block.contiguous()
            if kind == "allgather":
                res = g.allgather(x)
            elif kind == "broadcast":
                res = g.broadcast(x.copy() if isinstance(x, np.ndarray) else x.clone(), root=int(arg))
            elif kind == "reduce_scatter":
                res = g.reduce_scatter(x.reshape(n, -1), op=arg).reshape((x.shape[0] // n,) + tuple(x.shape[1:]))
            else:
                res = g.allreduce(x, op=op)
        else:
            host = np.asarray(eng.host_view(block), order="C")
            # results go into recycled buffers: fresh 64 MiB allocations page-fault on
            # every first touch, which halves the bandwidth of a collective
            if kind == "allgather":
                res = _pool_take((n,) + host.shape, host.dtype)
                if n == 1:
                    res[0] = host
                else:
                    g.allgather(host, out=res)
            elif kind == "broadcast":
                res = _pool_take(host.shape, host.dtype)
                res[...] = host
                if n > 1:
                    g.broadcast(res, root=int(arg))
            elif kind == "reduce_scatter":
                res = _pool_take((host.shape[0] // n,) + host.shape[1:], host.dtype)
                if n == 1:
                    res[...] = host
                else:
                    g.reduce_scatter(host.reshape(n, -1), out=res, op=arg)
            else:
                res = _pool_take(host.shape, host.dtype)
                if n == 1:
                    res[...] = host
                else:
                    g.allreduce(host, out=res, op=op)
            res = eng.from_numpy(res) if eng.name != "numpy" else res
        _BLOCKS[out] = res


class _InputFailed(MeshArrayError):
    """Kept by the members of a collective whose input failed on other ranks.

    The controller, on meeting it, asks ``ranks[0]`` for its block ``bid``,
    which raises the original failure (or the next link of a chain of them).
    """

    def __init__(self, ranks: Sequence[int], bid: int) -> None:
        self.ranks = [int(r) for r in ranks]
        self.bid = int(bid)
        super().__init__(f"the input of this collective failed on rank(s) {self.ranks}")

    def __reduce__(self):
        return (_InputFailed, (self.ranks, self.bid))


#: host blocks below this many bytes travel as (dtype, shape, bytes): pickling an ndarray
#: costs ~20 us a side, which is most of a small fetch's CPU time
_SMALL_FETCH = 1 << 16


def _pack_small(a: np.ndarray) -> Any:
    if a.nbytes < _SMALL_FETCH and a.dtype.kind in "biufcmM":
        return (a.dtype.str, a.shape, a.tobytes())
    return a


def _unpack_small(v: Any) -> np.ndarray:
    if type(v) is tuple:
        dt, shape, raw = v
        return np.frombuffer(raw, dtype=dt).reshape(shape).copy()  # writable, like an unpickled array
    return np.asarray(v)


def _host(block: Any) -> np.ndarray:
    if isinstance(block, np.ndarray):
        return block
    return _engine_for(block).to_numpy(block)


def _setitem(block: Any, key: tuple, value: Any) -> None:
    if not isinstance(block, np.ndarray) and isinstance(value, np.ndarray):
        value = _engine_for(block).from_numpy(value)
    block[key] = value


def _execute(op: str, args: tuple, me: int) -> Any:
    from .engines import get_engine

    if op == "new":
        kind, shape, dtype, engine, extra = args
        eng = get_engine(engine)
        if kind == "full":
            return eng.full(shape, extra, dtype)
        if kind == "rand":
            return eng.rand(shape, dtype, seed=None if extra is None else extra + me)
        if kind == "rank":
            return eng.full(shape, me, dtype)
        if kind == "arange":
            return eng.reshape(eng.arange(math.prod(shape), dtype), shape)
        return getattr(eng, kind)(shape, dtype)
    if op == "put":
        value, engine = args
        return get_engine(engine).from_numpy(_arg(value, me))
    if op == "ew":
        name, operands, kwargs = args
        vals = [_arg(a, me) for a in operands]
        blocks = [v for v, a in zip(vals, operands) if a[0] == "b"]
        eng = _engine_for(blocks[0]) if blocks else get_engine("numpy")
        if name == "matmul":
            return eng.matmul(*vals)
        if eng.name == "numpy":
            return np.asarray(getattr(np, name)(*vals, **kwargs))
        return eng.elementwise(name, *vals)
    if op == "apply":
        fn, operands = args
        return fn(*[_arg(a, me) for a in operands])
    src = _block(args[0])
    eng = _engine_for(src)
    if op == "reduce":
        rop, axes, keepdims, dtype = args[1:]
        r = eng.reduce(rop, src, axis=axes, keepdims=keepdims)
        if not eng.is_block(r):
            r = eng.from_numpy(np.asarray(r))
        return eng.astype(r, dtype) if dtype is not None else r
    if op == "astype":
        return eng.astype(src, args[1])
    if op == "reshape":
        return eng.reshape(src, args[1])
    if op == "getitem":
        r = eng.getitem(src, args[1])
        return r.copy() if isinstance(r, np.ndarray) else r.clone()
    if op == "copy":
        return src.copy() if isinstance(src, np.ndarray) else src.clone()
    raise ValueError(f"unknown block instruction {op!r}")


# ---------------------------------------------------------------------------------------
# controller side
# ---------------------------------------------------------------------------------------

_CONTEXTS: "weakref.WeakKeyDictionary[Any, _DataContext]" = weakref.WeakKeyDictionary()
_CTX_LOCK = threading.Lock()


class _DataContext:
    """Per process mesh: the system actors and the controller's block bookkeeping."""

    def __init__(self, procs: Any) -> None:
        from .proc import ProcMesh

        root = procs._root
        self.root = root
        self.shape = root.shape
        self.token = secrets.token_hex(4)
        self.actors = ProcMesh(root, root.shape).spawn("__mesharray_data__", _DataActor, self.token)
        self._ids = itertools.count(1)
        self._refs: dict[int, int] = {}
        # re-entrant: a garbage collection inside a locked section may run a finalizer
        self._lock = threading.RLock()
        self._pending: dict[int, set] = {}
        self._pending_bytes = 0
        self._timer: threading.Timer | None = None
        self._views: dict[tuple, Any] = {}
        self._torch_init: str | None = None
        self.plans: dict = {}  # DistributedStorage.reduce's plans by layout and request
        self.layouts: dict = {}  # elementwise result layouts by operand layouts

    def new_id(self) -> int:
        return next(self._ids)

    def pids(self, groups: list) -> dict:
        """Process ids of the ranks in ``groups`` (lets a collective notice a peer that never joins)."""
        workers = getattr(self.root.controller, "workers", {})
        out = {}
        for g in groups:
            for r in g:
                try:
                    out[r] = int(workers[r].pid or 0)
                except (KeyError, IndexError, AttributeError, TypeError):
                    out[r] = 0
        return out

    def torch_init_method(self) -> str:
        """Rendezvous address of torch.distributed for ``collective="torch"`` (rank 0 hosts the store)."""
        if self._torch_init is None:
            import socket

            # rank 0 listens here; the port is free now, and the store binds it at init
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self._torch_init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        return self._torch_init

    def view(self, ranks: Sequence[int]):
        """The system actors of ``ranks`` (a flat actor mesh over exactly those ranks)."""
        key = tuple(ranks)
        v = self._views.get(key)
        if v is None:
            if len(self._views) > 256:
                self._views.clear()
            v = self.actors._with_mesh_shape(Shape.from_ranks(("ranks",), (len(key),), np.asarray(key, dtype=np.int64)))
            self._views[key] = v
        return v

    def send(self, ranks: Sequence[int], program: list) -> None:
        """Fire-and-forget a program to ``ranks`` (ordered after earlier messages)."""
        if ranks:
            ranks = sorted(set(int(r) for r in ranks))
            self.post(ranks, self._with_frees(ranks, program))

    def post(self, ranks: list, program: list) -> None:
        """Broadcast ``program`` to ``ranks`` (sorted, unique), past any dead rank.

        A dead rank is not an error here: the blocks it should have made are
        missing, and whatever uses or fetches them raises
        :class:`~mesharray.ActorDiedError` (survivors of a collective with it
        notice its death in their wait).
        """
        from .errors import ActorDiedError

        try:
            self.view(ranks).run.broadcast(program)
        except ActorDiedError:
            pass

    def call(self, ranks: Sequence[int], program: list) -> Any:
        """Run a program on ``ranks`` and wait for every rank.

        A rank that died, or a survivor whose collective saw a peer die, fails
        the call with :class:`~mesharray.ActorDiedError` naming the dead ranks.
        """
        from .errors import ActorDiedError, ActorError

        ranks = sorted(set(int(r) for r in ranks))
        try:
            return ranks, self.view(ranks).run.call(self._with_frees(ranks, program)).get()
        except ActorError as exc:
            if isinstance(exc.exception, ActorDiedError):
                raise exc.exception from exc
            raise

    def fetch(self, ranks: Sequence[int], bid: int) -> dict:
        """Each rank's block ``bid`` as a host array: ``{rank: ndarray}``.

        A block whose making failed raises that failure: the original exception
        (in :class:`~mesharray.ActorError`), or :class:`~mesharray.ActorDiedError`
        naming the dead ranks when a rank died (before or during a collective).
        """
        futs = [(r, self.view([r]).run.call_one([("fetch", bid)])) for r in ranks]
        out = {}
        for r, f in futs:
            try:
                out[r] = _unpack_small(f.get())
            except BaseException as exc:
                self._raise_failure(exc, bid)
        return out

    def _raise_failure(self, exc: BaseException, bid: int, hops: int = 0) -> None:
        from .errors import ActorDiedError, ActorError

        inner = getattr(exc, "exception", None) if isinstance(exc, ActorError) else None
        if isinstance(inner, ActorDiedError):
            raise inner from exc
        if isinstance(inner, _InputFailed) and hops < 8:
            # a collective's input failed on other ranks: their block holds the original error
            try:
                self.view([inner.ranks[0]]).run.call_one([("fetch", inner.bid)]).get()
            except BaseException as deeper:
                self._raise_failure(deeper, inner.bid, hops + 1)
        raise exc

    def incref(self, bid: int) -> None:
        with self._lock:
            self._refs[bid] = self._refs.get(bid, 0) + 1

    # Frees are batched: a loop of small ops would otherwise send one extra
    # message per temporary. Pending frees ride along with the next program sent
    # to their ranks, or go out after _FREE_DELAY seconds, or at once when they
    # hold more than _FREE_BYTES of blocks.
    _FREE_DELAY = 0.02
    _FREE_BYTES = 64 << 20

    def decref(self, bid: int, ranks: tuple, nbytes: int = 0) -> None:
        with self._lock:
            n = self._refs.get(bid, 0) - 1
            if n > 0:
                self._refs[bid] = n
                return
            self._refs.pop(bid, None)
            if self.root.stopped or not ranks:
                return
            self._pending[bid] = set(ranks)
            self._pending_bytes += nbytes
            now = self._pending_bytes > self._FREE_BYTES or len(self._pending) > 512
            if not now and self._timer is None:
                self._timer = threading.Timer(self._FREE_DELAY, self.flush_frees)
                self._timer.daemon = True
                self._timer.start()
        if now:
            self.flush_frees()

    def _with_frees(self, ranks: list, program: list) -> list:
        if not self._pending:
            return program
        mine = set(ranks)
        frees = []
        with self._lock:
            for bid, rs in list(self._pending.items()):
                if rs & mine:
                    frees.append(bid)
                    rs -= mine
                    if not rs:
                        del self._pending[bid]
            if not self._pending:
                self._pending_bytes = 0
        return [("free", frees)] + program if frees else program

    def flush_frees(self) -> None:
        """Send every pending free now."""
        with self._lock:
            pending, self._pending, self._pending_bytes = self._pending, {}, 0
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        if not pending or self.root.stopped:
            return
        by_rank: dict[int, list] = {}
        for bid, rs in pending.items():
            for r in rs:
                by_rank.setdefault(r, []).append(bid)
        try:
            bids = sorted({b for v in by_rank.values() for b in v})
            self.view(sorted(by_rank)).run.broadcast([("free", bids)])
        except Exception:  # the mesh is going away (or a rank died): nothing to free there
            pass


def data_context(procs: Any) -> _DataContext:
    """The data context of ``procs``' root mesh (spawning its system actors on first use)."""
    root = procs._root
    ctx = _CONTEXTS.get(root)
    if ctx is None:
        with _CTX_LOCK:
            ctx = _CONTEXTS.get(root)
            if ctx is None:
                ctx = _DataContext(procs)
                _CONTEXTS[root] = ctx
    return ctx


def _resolve_block(bid: int) -> Any:
    return local_block(bid)


_REDUCE_NAMES = {"add.reduce": "sum", "multiply.reduce": "prod", "minimum.reduce": "min",
                 "maximum.reduce": "max", "sum": "sum", "prod": "prod", "min": "min", "max": "max",
                 "mean": "mean", "any": "any", "all": "all"}
_COLLECTIVE_OP = {"sum": "sum", "prod": "prod", "min": "min", "max": "max", "mean": "mean",
                  "any": "max", "all": "min"}


class DistributedStorage:
    """The storage protocol of ``MeshArray`` (see ``array._Gathered``) over blocks in workers.

    Attributes
    ----------
    ctx : _DataContext
    bid : int
        Block id (the same on every rank holding a block of this array).
    ranks : numpy.ndarray of int64
        Global rank holding each mesh position (shape: the mesh sizes).
    holders : numpy.ndarray or None
        Ranks holding a copy of each position's block (``keepdims`` results of
        a reduction live on every member of their group), shape ``sizes + (H,)``.
    """

    kind = "distributed"
    __slots__ = ("ctx", "bid", "ranks", "holders", "_local", "_dtype", "engine", "collective", "__weakref__")

    def __init__(self, ctx: _DataContext, bid: int, ranks: np.ndarray, local_shape: tuple, dtype: Any,
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
        ctx.incref(bid)
        all_ranks = _all_ranks if _all_ranks is not None else tuple(sorted(
            set(self.ranks.ravel().tolist()) | (set(holders.ravel().tolist()) if holders is not None else set())))
        nbytes = math.prod(self._local) * self._dtype.itemsize * max(1, len(all_ranks))
        weakref.finalize(self, ctx.decref, bid, all_ranks, nbytes)

    def _derive(self, bid: int, ranks: np.ndarray | None = None, local: tuple | None = None, dtype: Any = None,
                holders: Any = False) -> "DistributedStorage":
        return DistributedStorage(self.ctx, bid, self.ranks if ranks is None else ranks,
                                  self._local if local is None else local,
                                  self._dtype if dtype is None else dtype, self.engine,
                                  self.holders if holders is False else holders, self.collective)

    def _unique(self) -> list[int]:
        return sorted(set(self.ranks.ravel().tolist()))

    # -- description
    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    def local_shape(self, mesh_ndim: int) -> tuple[int, ...]:
        return self._local

    def __reduce__(self):
        # an endpoint argument: the worker receives its own block
        return (_resolve_block, (self.bid,))

    # -- whole values
    def to_numpy(self) -> np.ndarray:
        """Gather every position's block to the controller."""
        by_rank = self.ctx.fetch(self._unique(), self.bid)
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
            self.ctx.send(np.unique(ranks).tolist(), [("getitem", bid, self.bid, local_key)])
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
        if isinstance(value, np.ndarray) and value.ndim > len(np.empty(self._local, bool)[local_key + (Ellipsis,)].shape):
            # one value per selected position
            vals = np.broadcast_to(value, sel.shape + value.shape[sel.ndim:]) if value.ndim >= sel.ndim else value
            per = {}
            for pos in np.ndindex(*sel.shape):
                per[int(sel[pos])] = np.array(vals[pos])
            arg = ("r", per)
        else:
            arg = ("v", value)
        self.ctx.send(np.unique(sel).tolist(), [("setitem", self.bid, tuple(local_key), arg)])

    def reshape_local(self, mesh_ndim: int, local_shape: tuple[int, ...]) -> "DistributedStorage":
        bid = self.ctx.new_id()
        self.ctx.send(self._unique(), [("reshape", bid, self.bid, tuple(local_shape))])
        return self._derive(bid, local=tuple(local_shape))

    def astype(self, dtype: Any, copy: bool) -> "DistributedStorage":
        dt = np.dtype(dtype)
        if dt == self._dtype and not copy:
            return self
        bid = self.ctx.new_id()
        self.ctx.send(self._unique(), [("astype", bid, self.bid, dt.name)])
        return self._derive(bid, dtype=dt)

    def copy(self) -> "DistributedStorage":
        bid = self.ctx.new_id()
        self.ctx.send(self._unique(), [("copy", bid, self.bid)])
        return self._derive(bid)

    # -- compute
    def reduce(self, op: str, func: Any, axes: tuple[int, ...] | None, keepdims: bool, kwargs: dict) -> Any:
        if kwargs:
            return self._gathered_reduce(op, func, axes, keepdims, kwargs)
        # Everything but the block ids depends only on the layout and the request:
        # planned once, so that a tiny reduction in a loop costs only its messages.
        key = (op, axes, keepdims, self.ranks.shape, self.ranks.tobytes(), self._local, self._dtype,
               self.collective, self.engine)
        plans = self.ctx.plans
        plan = plans.get(key)
        if plan is None:
            plan = self._reduce_plan(op, func, axes, keepdims)
            if len(plans) > 256:
                plans.clear()
            plans[key] = plan
        if plan is None:
            return self._gathered_reduce(op, func, axes, keepdims, kwargs)
        first, rdt_work, rdt, new_local, coll = plan
        ctx = self.ctx
        cur = self.bid
        program = []
        if first is not None:
            nb = ctx.new_id()
            program.append((first[0], nb, cur) + first[1:])
            cur = nb
        if coll is None:
            ctx.send(self._unique(), program)
            return self._derive(cur, local=new_local, dtype=rdt_work)
        coll_op, groups_l, members, ranks, holders, all_ranks, pids, rdt_name = coll
        out = ctx.new_id()
        program.append(("coll", out, cur, coll_op, groups_l, self.collective, rdt_name,
                        (ctx.torch_init_method(), ctx.shape.size) if self.collective == "torch" else (), pids))
        if cur != self.bid:
            program.append(("free", [cur]))
        # fire-and-forget (see _send_collective); members are sorted and unique
        ctx.post(members, ctx._with_frees(members, program))
        res = DistributedStorage(ctx, out, ranks, new_local, rdt_work, self.engine, holders, self.collective,
                                 _all_ranks=all_ranks)
        if rdt_work != rdt:  # any/all computed as uint8 max/min
            res = res.astype(rdt, copy=True)
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
        first = None
        if local_axes:
            first = ("reduce", name, local_axes, keepdims, rdt_work.name)
        elif rdt_work != self._dtype:
            first = ("astype", rdt_work.name)
        if not mesh_axes:
            return first, rdt_work, rdt, new_local, None
        groups, roots = self._plan(mesh_axes)
        if any(len(set(g)) != len(g) for g in groups):
            # a rank at several positions of one group (an advanced-index view): reduce here
            return None
        if self.collective == "torch":
            self._check_torch_groups(groups)
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
        coll = (_COLLECTIVE_OP[name], [list(g) for g in groups], members, ranks, holders, tuple(members),
                self.ctx.pids(groups), rdt_work.name)
        return first, rdt_work, rdt, new_local, coll

    def _check_torch_groups(self, groups: list) -> None:
        world = self.ctx.shape.size
        every = sorted(r for g in groups for r in g)
        if every != list(range(world)):
            raise ValueError(
                f"collective='torch' reduces over groups that cover the whole mesh (torch.distributed "
                f"makes groups collectively over every rank); these groups cover ranks {every} of {world}"
            )

    def _send_collective(self, program: list, cur: int, op: str, groups: list, dtype: np.dtype) -> int:
        """Append the collective ``op`` over ``groups`` to ``program``, run it and wait; the new block id."""
        out = self.ctx.new_id()
        torch_init = ()
        if self.collective == "torch":
            self._check_torch_groups(groups)
            torch_init = (self.ctx.torch_init_method(), self.ctx.shape.size)
        program.append(("coll", out, cur, op, [list(g) for g in groups],
                        self.collective, dtype.name, torch_init, self.ctx.pids(groups)))
        if cur != self.bid:
            program.append(("free", [cur]))
        members = sorted({r for g in groups for r in g})
        # fire-and-forget like the elementwise programs: messages from this controller
        # are ordered per rank, so a later fetch of ``out`` runs after the collective;
        # a failure (a dead member included) is kept as ``out``'s and raised there
        self.ctx.send(members, program)
        return out

    def group_op(self, kind: str, mesh_axes: tuple[int, ...], arg: Any = None) -> "DistributedStorage":
        """allgather / broadcast / reduce_scatter inside each group of ``mesh_axes``; same mesh layout."""
        groups, _ = self._plan(mesh_axes)
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

    def _plan(self, mesh_axes: tuple[int, ...]) -> tuple[list[tuple[int, ...]], list[int]]:
        # the groups of reduction_plan, computed on this storage's rank layout
        m = self.ranks.ndim
        kept = [i for i in range(m) if i not in mesh_axes]
        r = self.ranks.transpose(kept + list(mesh_axes))
        g = r.reshape(-1, math.prod(self.ranks.shape[i] for i in mesh_axes) if mesh_axes else 1)
        groups = [tuple(int(x) for x in row) for row in g]
        return groups, [row[0] for row in groups]

    def _gathered_reduce(self, op: str, func: Any, axes: Any, keepdims: bool, kwargs: dict) -> Any:
        from .array import _Gathered

        return _Gathered(self.to_numpy()).reduce(op, func, axes, keepdims, kwargs)

    @staticmethod
    def elementwise(ufunc: np.ufunc, plan: Any, inputs: list, kwargs: dict) -> tuple:
        from .array import MeshArray

        if kwargs.get("out") is not None or kwargs.get("where") is not None:
            raise TypeError(f"{ufunc.__name__} of distributed arrays does not take out= or where=; assign the result instead")
        if ufunc.nout != 1:
            raise TypeError(f"{ufunc.__name__} has {ufunc.nout} outputs; distributed arrays support one")
        extra = {k: v for k, v in kwargs.items() if k not in ("out", "where")}
        dist = [x for x in inputs if isinstance(x, MeshArray) and isinstance(x._storage, DistributedStorage)]
        first = dist[0]._storage
        ctx = first.ctx
        per_element = ufunc.signature is not None
        sizes = tuple(plan.sizes)
        # Where each result position is computed depends only on the operands' layouts:
        # worked out once per layout (a loop of `a * 2 + b` then costs only its messages)
        key = [ufunc.__name__, sizes, tuple(plan.names), per_element]
        for x in dist:
            st = x._storage
            key.append((tuple(x._shape.names), st.ranks.shape, st.ranks.tobytes(), x.local_shape,
                        None if st.holders is None else (st.holders.shape, st.holders.tobytes())))
        key = tuple(key)
        for x in dist:
            if x._storage.ctx is not ctx:
                raise MeshShapeError("distributed operands belong to different process meshes")
        layout = ctx.layouts.get(key)
        if layout is None:
            if len(ctx.layouts) > 256:
                ctx.layouts.clear()
            layout = ctx.layouts[key] = _ew_layout(ufunc, plan, dist, per_element, sizes)
        R, pos_of, ranks = layout
        operands = []
        proxies = []
        for x in inputs:
            if isinstance(x, MeshArray) and isinstance(x._storage, DistributedStorage):
                st = x._storage
                operands.append(("b", st.bid))
                proxies.append(_proxy(st._dtype, x.local_shape) if per_element else _sample(st._dtype))
            elif isinstance(x, MeshArray):
                aligned = plan.align(x, pad_local=not per_element)
                m = len(sizes)
                per = {}
                for rank, p in pos_of.items():
                    idx = tuple(pi if s > 1 else 0 for pi, s in zip(p, aligned.shape[:m]))
                    per[rank] = np.array(aligned[idx])
                operands.append(("r", per))
                proxies.append(_proxy(x.dtype, aligned.shape[m:]))
            elif isinstance(x, np.ndarray) and x.ndim > len(plan.local_shape) and not per_element:
                m = len(sizes)
                full = x.reshape((1,) * (m + len(plan.local_shape) - x.ndim) + x.shape)
                per = {}
                for rank, p in pos_of.items():
                    idx = tuple(pi if s > 1 else 0 for pi, s in zip(p, full.shape[:m]))
                    per[rank] = np.array(full[idx])
                operands.append(("r", per))
                proxies.append(_proxy(x.dtype, full.shape[m:]))
            else:
                operands.append(("v", x))
                proxies.append(x)
        # result dtype and local shape, from NumPy on empty proxies (nothing is computed at size 0)
        with np.errstate(all="ignore"):
            if per_element:
                local, dt = _matmul_meta(proxies)
            else:
                dt = ufunc(*[p if not isinstance(p, np.ndarray) else p.reshape(-1)[:1] if p.size else np.zeros(1, p.dtype) for p in proxies], **extra).dtype
                local = tuple(plan.local_shape)
        bid = ctx.new_id()
        ctx.send(ranks, [("ew", bid, ufunc.__name__, operands, extra)])
        return (DistributedStorage(ctx, bid, R, local, dt, first.engine, None, first.collective,
                                   _all_ranks=tuple(ranks)),)


def _ew_layout(ufunc: np.ufunc, plan: Any, dist: list, per_element: bool, sizes: tuple) -> tuple:
    """Which rank computes each position of an elementwise result: ``(R, pos_of, ranks)``.

    Raises :class:`MeshShapeError` when the distributed operands' blocks for a
    position are not on one rank, or a rank would have to compute two positions.
    ``R`` is shared by every result of this layout (read-only).
    """
    laid = []
    for x in dist:
        perm, target = plan.layout(x, pad_local=not per_element)
        st = x._storage
        mperm = perm[: st.ranks.ndim]
        r = st.ranks.transpose(mperm).reshape(target[: len(sizes)])
        h = None
        if st.holders is not None:
            h = st.holders.transpose(mperm + (st.holders.ndim - 1,)).reshape(target[: len(sizes)] + (st.holders.shape[-1],))
        laid.append((x, r, h))
    lead = next((t for t in laid if t[1].shape == sizes), laid[0])
    R = np.broadcast_to(lead[1], sizes)
    for x, r, h in laid:
        rb = np.broadcast_to(r, sizes)
        ok = rb == R
        if h is not None:
            hb = np.broadcast_to(h, sizes + (h.shape[-1],))
            ok = ok | (hb == R[..., None]).any(-1)
        if not ok.all():
            raise MeshShapeError(
                f"distributed operands of {ufunc.__name__} live on different ranks for some positions "
                f"(mesh dims {dict(zip(plan.names, sizes))}); reduce or fetch one of them first"
            )
    if R.size and len(np.unique(R)) != R.size:
        raise MeshShapeError(
            f"the result of {ufunc.__name__} would need several blocks on one rank "
            f"(a distributed operand broadcast along mesh dims {dict(zip(plan.names, sizes))}); "
            "fetch it or reduce with keepdims=True first"
        )
    R = np.asarray(R, dtype=np.int64).copy()
    R.setflags(write=False)
    pos_of = {int(R[p]): p for p in np.ndindex(*sizes)}
    return R, pos_of, sorted(pos_of)


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


# ---------------------------------------------------------------------------------------
# making distributed arrays (used by ArrayFactory)
# ---------------------------------------------------------------------------------------


def make(procs: Any, kind: str, local_shape: tuple, dtype: Any, engine: str, extra: Any = None,
         collective: str | None = None):
    from .array import MeshArray
    from .engines import resolve_engine_name

    ctx = data_context(procs)
    shape = procs._mesh_shape
    ranks = np.asarray(shape.ranks(), dtype=np.int64).reshape(tuple(shape.sizes))
    engine = resolve_engine_name(engine)
    bid = ctx.new_id()
    ctx.send(ranks.ravel().tolist(), [("new", bid, kind, tuple(local_shape), np.dtype(dtype).name, engine, extra)])
    st = DistributedStorage(ctx, bid, ranks, tuple(local_shape), dtype, engine, None, collective)
    return MeshArray._from_parts(shape, st)


def scatter(procs: Any, arr: np.ndarray, engine: str, collective: str | None = None):
    from .array import MeshArray
    from .engines import resolve_engine_name

    ctx = data_context(procs)
    shape = procs._mesh_shape
    sizes = tuple(shape.sizes)
    if arr.shape[: len(sizes)] != sizes:
        raise MeshShapeError(
            f"from_numpy needs an array whose leading axes are the mesh sizes {dict(zip(shape.names, sizes))}; "
            f"got shape {arr.shape}"
        )
    engine = resolve_engine_name(engine)
    ranks = np.asarray(shape.ranks(), dtype=np.int64).reshape(sizes)
    bid = ctx.new_id()
    futs = []
    for pos in np.ndindex(*sizes):
        r = int(ranks[pos])
        futs.append(ctx.view([r]).run.call_one([("put", bid, ("v", np.asarray(arr[pos], order="C")), engine)]))
    for f in futs:
        f.get()
    st = DistributedStorage(ctx, bid, ranks, arr.shape[len(sizes):], arr.dtype, engine, None, collective)
    return MeshArray._from_parts(shape, st)


def apply(procs: Any, fn: Any, arrays: Sequence[Any]):
    """Run ``fn`` on each rank's blocks of ``arrays``; the results form a new distributed array."""
    from .array import MeshArray

    dist = [a for a in arrays if isinstance(a, MeshArray) and isinstance(a._storage, DistributedStorage)]
    if not dist:
        raise TypeError("apply needs at least one distributed MeshArray")
    st0 = dist[0]._storage
    for a in dist[1:]:
        st = a._storage
        if st.ranks.shape != st0.ranks.shape or not (st.ranks == st0.ranks).all():
            raise MeshShapeError(
                f"apply needs distributed arrays on the same ranks; got mesh dims {dist[0].mesh_sizes} and {a.mesh_sizes}"
            )
    operands = [("b", a._storage.bid) if isinstance(a, MeshArray) and isinstance(a._storage, DistributedStorage)
                else ("v", a) for a in arrays]
    ctx = st0.ctx
    bid = ctx.new_id()
    ranks = st0._unique()
    ctx.send(ranks, [("apply", bid, fn, operands)])
    # the result's local shape and dtype are known only after running: ask one rank
    # (this also raises the error of a failing fn)
    local, dtype = ctx.view(ranks[:1]).meta.call_one(bid).get()
    shape = dist[0]._shape
    return MeshArray._from_parts(shape, DistributedStorage(ctx, bid, st0.ranks.copy(), tuple(local), dtype,
                                                           st0.engine, None, st0.collective))


# ---------------------------------------------------------------------------------------
# collectives over mesh dims of distributed arrays (public: mesharray.allgather, ...)
# ---------------------------------------------------------------------------------------


def _group_op(a: Any, dims: Any, kind: str, arg: Any):
    from .array import MeshArray
    from .errors import DimensionError

    if not isinstance(a, MeshArray) or not isinstance(a._storage, DistributedStorage):
        raise TypeError(f"{kind} needs a distributed MeshArray (made by a ProcMesh), got {type(a).__name__}")
    names = tuple(a._shape.names)
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
    st = a._storage.group_op(kind, tuple(sorted(set(axes))), arg)
    return MeshArray._from_parts(a._shape, st)
