"""The controller side of distributed arrays: one :class:`DataContext` per process mesh.

It spawns the system actors (:class:`~mesharray.darray.worker.DataActor`, one
per rank) on first use, mints block ids, counts the controller's references
to each block and batches the frees, sends programs fire-and-forget, runs the
calls that wait (fetch, meta), and caches the plans of reductions and
elementwise layouts so that a loop of small ops costs only its messages.
"""

from __future__ import annotations

import itertools
import os
import secrets
import socket
import sys
import threading
import time
import weakref
from time import perf_counter
from typing import Any, NoReturn, Sequence

import numpy as np

import mesharray.darray.instructions as I

from .._core import Shape, decref, frees_by_rank, post_wire, set_post_trace, take_frees
from ..actor import ActorMesh
from ..errors import ActorDiedError, ActorError, BackpressureError, MeshStoppedError, SerializationError
from ..proc import ProcMesh
from ..runtime.channel import PENDING_FULL, defer_flush, programs, sending_program
from ..transport.interrupt import guard
from .worker import DataActor, InputFailed, meta_dtype, unpack_small

__all__ = ["DataContext", "contexts", "data_context", "existing_context", "no_wait", "set_trace", "tracing"]

#: a command buffer holding this many instructions is sent at once
BATCH_OPS = int(os.environ.get("MESHARRAY_BATCH_OPS", "256"))
#: the command buffer goes when no op was queued for this long (s), or once its first op is this old
FLUSH_IDLE = int(os.environ.get("MESHARRAY_FLUSH_IDLE_US", "100")) * 1e-6
FLUSH_AGE = int(os.environ.get("MESHARRAY_FLUSH_MAX_US", "2000")) * 1e-6
#: ops queued without a wait on every rank before the controller waits for the ranks to catch up
MAX_PENDING = int(os.environ.get("MESHARRAY_MAX_PENDING", "65536"))
#: how many collectives' plans a context gives its ranks by key (more go by their bytes)
MAX_PLANS = 1024

#: the capture in progress (:mod:`.function`), if any: it records every op queued in its thread
_TRACE: Any = None


def set_trace(trace: Any) -> Any:
    """Install ``trace`` (``record(ctx, ranks, wire)``, ``refuse(what)``; None: none) and return the previous one."""
    global _TRACE
    old, _TRACE = _TRACE, trace
    set_post_trace(trace)  # (the compiled op tail: its ops take the Python path while one records)
    return old


def tracing() -> bool:
    """Whether a capture is recording the ops of this thread."""
    return _TRACE is not None and _TRACE.thread == threading.get_ident()


def no_wait(what: str) -> None:
    """In a capture (:func:`mesharray.function`), refuse ``what``, a wait for the ranks: a captured step
    replays without the controller, so no value may come back inside it."""
    if _TRACE is not None and _TRACE.thread == threading.get_ident():
        _TRACE.refuse(what)

_CONTEXTS: weakref.WeakKeyDictionary[ProcMesh, DataContext] = weakref.WeakKeyDictionary()
_CTX_LOCK = threading.Lock()


class _FreeTimer:
    """The one thread of this process that sends contexts' pending frees when their delay is up.

    One thread for all batches, not a ``threading.Timer`` per batch, which would start an
    OS thread every ``FREE_DELAY`` of a loop of small ops.
    Contexts are held weakly: a scheduled flush never keeps a mesh alive.
    """

    def __init__(self) -> None:
        # re-entrant: schedule() is reached from finalizers (a dropped array's decref), which a
        # garbage collection may run inside any locked section of this thread, this one's too
        self._cond = threading.Condition(threading.RLock())
        self._due: dict[int, tuple[float, weakref.ref]] = {}  # id(context) -> (deadline, context)
        self._thread: threading.Thread | None = None

    def schedule(self, ctx: "DataContext", delay: float) -> None:
        if sys.is_finalizing():
            # an array dropped while the interpreter exits: no thread can start now (Thread.start
            # would wait for it forever), and the workers go with the controller
            return
        with self._cond:
            had = self._due.get(id(ctx))
            if had is not None and had[1]() is ctx and had[0] <= time.monotonic() + delay:
                return
            self._due[id(ctx)] = (time.monotonic() + delay, weakref.ref(ctx))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="mesharray-frees", daemon=True)
                self._thread.start()
            self._cond.notify()

    def cancel(self, ctx: "DataContext") -> None:
        with self._cond:
            self._due.pop(id(ctx), None)

    def _loop(self) -> None:
        try:
            self._serve()
        finally:  # (nothing should end it; if anything does, the next schedule starts a new one)
            with self._cond:
                self._thread = None

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._due:
                    self._cond.wait()
                now = time.monotonic()
                try:
                    due = list(self._due.items())
                except RuntimeError:  # a finalizer scheduled a context while this copied: again
                    continue
                ready = [k for k, (t, _) in due if t <= now]
                if not ready:
                    self._cond.wait(min(t for _, (t, _) in due) - now)
                    continue
                refs = [e[1] for e in (self._due.pop(k, None) for k in ready) if e is not None]
            for ref in refs:
                ctx = ref()
                if ctx is not None:
                    try:
                        ctx.flush_frees()
                    except Exception:  # the mesh is going away: nothing to free there
                        pass

    def _after_fork(self) -> None:
        # threads do not survive fork: a child starts its own on first use
        self._cond = threading.Condition(threading.RLock())
        self._due = {}
        self._thread = None


_FREES = _FreeTimer()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_FREES._after_fork)


class DataContext:
    """Per process mesh: the system actors and the controller's block bookkeeping."""

    # Frees are batched: a loop of small ops would otherwise send one extra
    # message per temporary. Pending frees ride along with the next program sent
    # to their ranks, or go out after FREE_DELAY seconds, or at once when they
    # hold more than FREE_BYTES of blocks.
    FREE_DELAY = 0.02
    FREE_BYTES = 64 << 20

    def __init__(self, root: ProcMesh) -> None:
        self.mesh = root
        self._state = root._root  # the root mesh's shared state (stopped, stopping)
        self.shape = root.mesh_shape
        self.token = secrets.token_hex(4)
        # spawn is typed as returning the actor class (its endpoints, for the checker); it is an ActorMesh
        self.actors: ActorMesh = root.spawn("__mesharray_data__", DataActor, self.token)  # type: ignore[assignment]
        self._ids = itertools.count(1)
        self._next_base = 1 << 40  # (new_base: ids of replays)
        self._refs: dict[int, int] = {}
        # re-entrant: a garbage collection inside a locked section may run a finalizer
        self._lock = threading.RLock()
        self._pending: dict[int, set] = {}
        self._pending_bytes = 0
        self._timer = False  # a flush is scheduled (_FREES)
        self._views: dict[tuple, ActorMesh] = {}
        self._torch_init: str | None = None
        self._pids = dict(zip(root.mesh_shape, root.pids))
        # memory domain and data-plane address of each rank: groups that span hosts go hierarchical
        # (each domain one string object: a plan pickles it once, then refers to it)
        domains: dict = {}
        self._hosts = {r: (domains.setdefault(d, d), a) for r, (d, a) in zip(root.mesh_shape, root.host_info)}
        self._multi_host = len({h[0] for h in self._hosts.values()}) > 1
        self.plans: dict = {}  # DistributedStorage.reduce's plans by layout and request
        self.calls: set[int] = set()  # keys of the recipes' functions the ranks were given (dispatch.ApplyRecipe)
        self._plan_keys: dict[bytes, int] = {}  # collectives' plans the ranks were given, by content (_keyed_plans)
        # the command buffer: (ranks, wire instructions) in the order the ops were issued
        self._buf: list[tuple[list, list]] = []
        self._buffered = 0
        self._first_post = self._last_post = 0.0  # (perf_counter of the buffer's first and last op)
        self._undefs: list[int] = []  # captured steps whose programs the ranks may drop
        self._unsynced = 0  # instructions queued since the last wait on every rank (MAX_PENDING)
        self._batch_ops = BATCH_OPS  # (the compiled post reads these two here)
        self._max_pending = MAX_PENDING
        self.layouts: dict = {}  # elementwise result layouts by operand layouts
        #: the small move queued last, as (what it shares with moves it may merge with, its wire form)
        self.last_move: tuple | None = None

    @property
    def stopped(self) -> bool:
        return self.mesh.stopped

    def new_id(self) -> int:
        return next(self._ids)

    def new_base(self, n: int) -> int:
        """The first of ``n`` fresh block ids for a replay of a captured step (from a range of their own,
        far above :meth:`new_id`'s)."""
        with self._lock:
            base = self._next_base
            self._next_base += max(1, n)
        return base

    def keep_blocks(self, bids: list) -> Any:
        """Hold blocks ``bids`` (a captured step's arrays from outside it) until the returned handle goes."""
        for b in bids:
            self.incref(b)
        return _Kept(self, bids, tuple(self.shape))

    def pids(self, groups: list) -> dict:
        """Process ids of the ranks in ``groups`` (lets a collective notice a peer that never joins)."""
        return {r: self.pid(r) for g in groups for r in g}

    def pid(self, rank: int) -> int:
        """Process id of ``rank`` (0 when unknown)."""
        return int(self._pids.get(rank) or 0)

    def host(self, rank: int) -> tuple:
        """``(memory domain, data-plane address)`` of ``rank``."""
        return tuple(self._hosts[rank])

    def hosts(self, groups: list) -> dict | None:
        """``{rank: (memory domain, data-plane address)}`` for the ranks of ``groups``; ``None`` on one host.

        The address is only given for each group's host leaders (the first rank of each domain, in the
        group's order and in rank order): no one else's is used, and a plan over many ranks is sent
        with every operation.
        """
        if not self._multi_host:
            return None
        hosts = self._hosts
        out = {}
        for g in groups:
            first: set = set()
            for order in (g, sorted(g)):
                seen: set = set()
                for r in order:
                    d = hosts[r][0]
                    if d not in seen:
                        seen.add(d)
                        first.add(r)
            for r in g:
                out[r] = hosts[r] if r in first else (hosts[r][0], None)
        return out

    def torch_init_method(self) -> str:
        """Rendezvous address of torch.distributed for ``collective="torch"`` (rank 0 hosts the store)."""
        if self._torch_init is None:
            # rank 0 listens here; the port is free now, and the store binds it at init
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self._torch_init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        return self._torch_init

    def view(self, ranks: Sequence[int]) -> ActorMesh:
        """The system actors of ``ranks`` (a flat actor mesh over exactly those ranks)."""
        key = tuple(ranks)
        v = self._views.get(key)
        if v is None:
            if len(self._views) > 256:
                self._views.clear()
            v = self.actors.with_shape(Shape.from_ranks(("ranks",), (len(key),), np.asarray(key, dtype=np.int64)))
            self._views[key] = v
        return v

    def check_live(self) -> None:
        """Raise :class:`~mesharray.MeshStoppedError` once the process mesh was stopped."""
        state = self._state
        if not (state.stopped or state.stopping):  # (what ProcMesh.check_live tests, per op of a loop)
            return
        try:
            self.mesh.check_live()
        except MeshStoppedError as exc:
            raise MeshStoppedError(
                f"the process mesh of this distributed array was stopped ({self.mesh!r}); its blocks are gone"
            ) from exc

    def send(self, ranks: Sequence[int], program: list) -> None:
        """Fire-and-forget a program to ``ranks`` (ordered after earlier messages)."""
        self.check_live()
        if ranks:
            self.post(sorted(set(int(r) for r in ranks)), program)

    def post(self, ranks: list, program: list) -> None:
        """Queue ``program`` for ``ranks`` (sorted, unique) in the command buffer.

        The buffer goes out as one message per rank (:meth:`flush`) before this
        process waits on any reply, when it holds :data:`BATCH_OPS`
        instructions, or from the runtime's flusher thread once the controller is idle
        (:meth:`flush_idle`). A
        dead rank is not an error here: the blocks it should have made are
        missing, and whatever uses or fetches them raises
        :class:`~mesharray.ActorDiedError` (survivors of a collective with it
        notice its death in their wait).
        """
        self.post_wire(ranks, I.encode(program))

    #: ``post_wire(ranks, wire, n=0, bound=True)``: :meth:`post` of instructions already in their wire
    #: form: one (a tuple: a recipe's, see :mod:`.dispatch`) or a list; ``n``: the ops they stand for
    #: where more than one each (a captured step's replay), as the bound of queued ops counts them;
    #: ``bound`` False: the caller applies the bound (:meth:`keep_bound`) once it has queued the other
    #: parts of the op (a move's receivers wait for its senders). Compiled (``_core``: an op's tail),
    #: atomic under the GIL: the buffer needs no lock to take an op (a flush takes it whole).
    post_wire = post_wire

    def _queued_first(self) -> None:
        """The buffer took its first op: have it flushed before this process waits, or once idle (the
        compiled post's call; guarded: a Ctrl-C does not land between the op and this)."""
        defer_flush(self)

    def post_planned(self, ranks: list, program: list) -> None:
        """:meth:`post` of a program holding a collective's plan (:class:`~.instructions.Planned`): its
        bytes go to the ranks once, then its key (:meth:`_keyed_plans`)."""
        self.post_planned_wire(ranks, I.encode(program))

    def post_planned_wire(self, ranks: list, wire: list) -> None:
        """:meth:`post_planned` of a program in its wire form (a ``plan`` instruction's tuple)."""
        with self._lock:  # (another thread must not send the key before this defplan is queued)
            self.post_wire(ranks, self._keyed_plans(wire), len(wire), bound=False)
        self.keep_bound()

    def _keyed_plans(self, wire: list) -> list:
        """``wire`` with each ``plan`` instruction by key (the caller holds the lock and sends it next).

        A plan's bytes name every member's pid and host (about 20 KB at 1,024 ranks) and went with
        every reduction; now the first ``plan`` of each content is preceded by ``("defplan", key,
        bytes)`` and every one after is ``("kplan", out, src, key, roots, nbytes)``, whose bytes the
        data actor looks up where it runs it (``DataActor.run``). A plan always goes to the same
        ranks (its members are in its bytes), so a key given once is given to all that use it. Past
        :data:`MAX_PLANS` contents, new ones go by their bytes; a captured step records bytes.
        """
        if tracing():
            return wire
        keys = self._plan_keys
        out = []
        for ins in wire:
            if ins[0] == "plan":
                k = keys.get(ins[3])  # (a plan's bytes object is kept with its plan: hashed once)
                if k is None:
                    if len(keys) >= MAX_PLANS:
                        out.append(ins)
                        continue
                    k = keys[ins[3]] = len(keys) + 1
                    out.append(("defplan", k, ins[3]))
                ins = ("kplan", ins[1], ins[2], k, *ins[4:])
            out.append(ins)
        return out

    def keep_bound(self) -> None:
        """Wait for the ranks once more than ``MESHARRAY_MAX_PENDING`` ops are queued (:meth:`_catch_up`)."""
        if self._unsynced > self._max_pending:
            self._catch_up()

    def _catch_up(self) -> None:
        """More than ``MESHARRAY_MAX_PENDING`` ops queued since every rank last answered: wait for the
        ranks to run them (as a caller past the bound of calls in flight waits for replies)."""
        if _TRACE is not None:
            return  # (a capture runs its ops once; the bound holds for the calls that replay it)
        if PENDING_FULL == "raise":
            self._unsynced = 0
            raise BackpressureError(
                f"more than MESHARRAY_MAX_PENDING={self._max_pending} distributed-array ops are queued on "
                f"{self.mesh!r} without a wait; call procs.sync() (or fetch a value) now and then")
        self._unsynced = 0
        self.call(list(self.shape), [])

    def effect(self, ranks: list, ins: tuple) -> None:
        """Queue ``ins`` (wire form), an op run for its effect (``backward()``): its block is not kept, and
        its failure, if any, is raised by the next wait on each rank where it failed (:data:`CHECK`)."""
        self.post_wire(ranks, ("effect", ins))

    @staticmethod
    def checks(ranks: Sequence[int]) -> list:
        """What a wait's program ends with: ``ranks`` raise the first failure of their effects since their
        last wait (a rank a broadcast reaches cannot: its error would go nowhere)."""
        return [("check", tuple(ranks))]

    def flush_idle(self) -> None:
        """The flusher thread's turn: flush once no op came for ``MESHARRAY_FLUSH_IDLE_US`` (the controller
        went on to something else) or the buffer's first op is ``MESHARRAY_FLUSH_MAX_US`` old; else look again
        soon. A step issued op by op then reaches the ranks as one program, which lets them run it as one
        (a backward's reductions bucketed: :mod:`.overlap`)."""
        now = perf_counter()
        if self._buf and now - self._last_post < FLUSH_IDLE and now - self._first_post < FLUSH_AGE:
            defer_flush(self)
            return
        self.flush()

    def flush(self) -> None:
        """Send the command buffer and the pending frees: each rank its instructions in order, one
        message per rank.

        Ranks given the same instructions (every op of a data-parallel step
        goes to all of them) share one message, pickled once; frees go last
        (every op that used a freed block was queued before its free). Never
        raises: a rank that cannot be reached has its blocks missing.
        """
        self._flush(True)

    def _flush(self, frees: bool) -> None:
        """:meth:`flush`; ``frees`` False: the pending frees stay for the program sent next (they ride on it)."""
        with self._lock, sending_program():
            try:
                self._send_buffer(frees)
            finally:
                # (only now: a caller that found this buffer pending waits on the lock for these sends)
                programs.discard(self)

    def _send_buffer(self, with_frees: bool = True) -> None:
        # the frees are taken before the ops: another thread may queue ops and drop arrays meanwhile
        # (a post takes no lock), and a block's free is pending only after every op that used it was
        # queued, so those ops are in the buffer taken next, or were sent, never after their free
        pending: dict = {}
        if with_frees and self._pending:
            pending, self._pending, self._pending_bytes = self._pending, {}, 0
            if self._timer:  # (a decref from now on schedules anew)
                self._timer = False
                _FREES.cancel(self)
        undefs, self._undefs = self._undefs, []
        buf = self._buf
        if not buf and not undefs and not pending:
            return
        self._buf = []
        self._buffered = 0
        tail = [("undef", undefs)] if undefs else []  # (captured steps no record replays any more)
        try:
            if len(buf) == 1 and not undefs and (not pending or set().union(*pending.values()).issubset(buf[0][0])):
                ranks, wire = buf[0]  # (one message for all: the common case)
                if pending:
                    wire.append(("free", sorted(pending)))
                self._broadcast(ranks, wire)
                return
            # each rank's instructions, in order; ranks with the same entries share a message
            entries: dict[int, list[int]] = {r: [] for r in (self.shape if undefs else ())}
            for i, (ranks, _) in enumerate(buf):
                for r in ranks:
                    entries.setdefault(r, []).append(i)
            frees = frees_by_rank(pending)
            for r in frees:
                entries.setdefault(r, [])
            groups: dict[tuple, list[int]] = {}
            for r, idx in entries.items():
                groups.setdefault((tuple(idx), tuple(sorted(frees.get(r, ())))), []).append(r)
            for (idx, fr), ranks in groups.items():
                wire = []
                for i in idx:
                    wire.extend(buf[i][1])
                if fr:
                    wire.append(("free", list(fr)))
                self._broadcast(sorted(ranks), wire + tail)
        except (ActorDiedError, MeshStoppedError):  # the mesh is going away: nothing to run there
            pass

    def forget_program(self, fid: int) -> None:
        """A captured step's record is gone: its ranks may drop its program (with the next flush)."""
        self._undefs.append(fid)  # (from a finalizer: no lock, a list's append is atomic)

    def _broadcast(self, ranks: list, wire: list) -> None:
        try:
            self.view(ranks).run.broadcast(wire)
        except ActorDiedError:
            pass
        except SerializationError:
            self._each(ranks, wire)

    def _each(self, ranks: list, wire: list) -> None:
        """``wire`` one instruction a message, where an instruction cannot be pickled (``procs.apply`` of a
        function holding a lock): that one's block keeps the error, which its uses raise; the rest run."""
        run = self.view(ranks).run
        for ins in wire:
            try:
                run.broadcast([ins])
            except ActorDiedError:
                pass
            except SerializationError as exc:
                inner = ins[1] if ins[0] == "effect" else ins
                if len(inner) > 1 and type(inner[1]) is int:
                    run.broadcast([("fail", inner[1], SerializationError(str(exc)))])

    def call(self, ranks: Sequence[int], program: list) -> Any:
        """Run a program on ``ranks`` and wait for every rank.

        A rank that died, or a survivor whose collective saw a peer die, fails
        the call with :class:`~mesharray.ActorDiedError` naming the dead ranks.
        """
        self.check_live()
        no_wait("a wait on every rank (procs.sync())")
        ranks = sorted(set(int(r) for r in ranks))
        program = self.with_frees(ranks, program)  # (before the flush: see _send_buffer)
        self.flush()
        if len(ranks) == self.shape.size:
            self._unsynced = 0
        wire = I.encode(program) + self.checks(ranks)
        try:
            return ranks, self.view(ranks).run.call(wire).get()
        except ActorError as exc:
            if isinstance(exc.exception, ActorDiedError):
                raise exc.exception from exc
            raise

    def fetch(self, ranks: Sequence[int], bid: int, announced: dict | None = None) -> dict:
        """Each rank's block ``bid`` as a host array: ``{rank: ndarray}``.

        ``announced``: futures of values the ranks already sent back (no message
        for those). A block whose making failed raises that failure: the original exception
        (in :class:`~mesharray.ActorError`), or :class:`~mesharray.ActorDiedError`
        naming the dead ranks when a rank died (before or during a collective).
        """
        self.check_live()
        announced = announced or {}
        futs = [(r, announced.get(r) or self.call_one(r, self.with_frees([r], [I.Fetch(bid)]))) for r in ranks]
        out = {}
        for r, f in futs:
            try:
                out[r] = unpack_small(f.get())
            except BaseException as exc:
                self.raise_failure(exc, bid)
        return out

    def call_some(self, run: Any, members: list, reply: Sequence[int], wire: list) -> dict:
        """Run a program on ``members`` (sorted, unique), sent once for all (pending frees of
        any member go with it): a future of its result per rank of ``reply`` (those ranks
        answer; the others get it as a broadcast, a dead one skipped, as :meth:`post`).

        ``run``: the ``run`` endpoint of ``view(members)`` (a caller in a loop keeps it);
        ``wire``: the program in its wire form (:func:`~.instructions.encode`'s tuples).
        """
        no_wait("a reduction whose small result comes back with its program")
        with self._lock:  # (its plan's key, if it has one, goes after its defplan: see _keyed_plans)
            if self._pending:  # (the frees ride on this program, taken before the flush: see _send_buffer)
                frees = self._take_frees(members)
                if frees:
                    wire = [("free", frees), *wire]
            self._flush(False)  # (waits for a flush in flight too)
            wire = self._keyed_plans(wire) + self.checks(reply)  # (checks: only the ranks that answer)
            return (run or self.view(members).run)._call_some(reply, wire)

    def call_one(self, rank: int, program: list) -> Any:
        """Run ``program`` on ``rank``; a future of its result (a :class:`~.instructions.Fetch`'s block)."""
        no_wait("a fetch of a block's values")
        self.flush()  # (under the lock: also waits for a flush in flight, which this must not overtake)
        return self.view([rank]).run.call_one(I.encode(program) + self.checks([rank]))

    def meta(self, rank: int, bid: int) -> tuple[tuple, Any, bool]:
        """Local shape, dtype and whether it requires grad, of block ``bid`` on ``rank`` (raises the failure
        of its making)."""
        self.check_live()
        no_wait("a question for a rank about a result's shape (an op whose result shape only running it tells)")
        self.flush()
        local, dt, rg = self.view([rank]).meta.call_one(bid).get()
        return local, meta_dtype(dt), rg

    def raise_failure(self, exc: BaseException, bid: int, hops: int = 0) -> NoReturn:
        """Raise the failure of block ``bid`` that ``exc`` (a fetch's error) stands for: a dead rank's
        :class:`~mesharray.ActorDiedError`, or the original error a chain of :class:`InputFailed` leads to."""
        inner = exc.exception if isinstance(exc, ActorError) else None
        if isinstance(inner, ActorDiedError):
            raise inner from exc
        if isinstance(inner, InputFailed) and hops < 8:
            # a collective's (or move's) input failed on other ranks: their block holds the
            # original error (a move's sender may be in another mesh: its context follows it)
            owner = self if inner.token in (None, self.token) else next(
                (c for c in list(_CONTEXTS.values()) if c.token == inner.token), None)
            if owner is not None and not owner.stopped:
                try:
                    owner.call_one(inner.ranks[0], [I.Fetch(inner.bid)]).get()
                except BaseException as deeper:
                    owner.raise_failure(deeper, inner.bid, hops + 1)
        raise exc

    def incref(self, bid: int) -> None:
        with self._lock:
            self._refs[bid] = self._refs.get(bid, 0) + 1

    #: ``decref(bid, ranks, nbytes=0)``: one reference to block ``bid`` less; at none its free is
    #: pending for ``ranks`` (it rides on the next program to them, or goes after ``FREE_DELAY``, or at
    #: once past ``FREE_BYTES``). Compiled (``_core``: an op's tail), atomic under the GIL: finalizers
    #: call it, which a garbage collection may run inside any section of any thread.
    decref = decref

    def _schedule_frees(self, urgent: bool) -> None:
        # by the timer's thread, not here, even when it is urgent: a decref runs in finalizers,
        # which a garbage collection may run inside any section of this thread, a half-made
        # command buffer's too
        _FREES.schedule(self, 0.0 if urgent else self.FREE_DELAY)

    def with_frees(self, ranks: list, program: list, wired: bool = False) -> list:
        """``program`` followed by the pending frees of blocks on ``ranks`` (taken off the pending set).

        After it, not before: a block freed now was used only by ops issued
        before its last reference went, which are in ``program`` or already sent.
        ``wired``: ``program`` is in its wire form already.
        """
        if not self._pending:
            return program
        frees = self._take_frees(ranks)
        if not frees:
            return program
        return program + [("free", frees) if wired else I.Free(frees)]

    def _take_frees(self, ranks: list) -> list:
        """The pending frees of blocks on ``ranks``, taken off the pending set for those ranks."""
        with self._lock:
            frees = take_frees(self._pending, ranks)
            if not self._pending:
                self._pending_bytes = 0
        return frees

    def flush_frees(self) -> None:
        """Send every pending free now (with whatever the command buffer holds)."""
        if not self.mesh.stopped:
            self.flush()


class _Kept:
    """A hold on blocks of a context (:meth:`DataContext.keep_blocks`), given back when collected."""

    def __init__(self, ctx: DataContext, bids: list, ranks: tuple) -> None:
        self.ctx = ctx
        self.bids = bids
        self.ranks = ranks

    def __del__(self, _finalizing: Any = sys.is_finalizing) -> None:
        if not _finalizing():
            for b in self.bids:
                self.ctx.decref(b, self.ranks)


def data_context(procs: ProcMesh) -> DataContext:
    """The data context of ``procs``' root mesh (spawning its system actors on first use)."""
    root = procs.root_mesh
    ctx = _CONTEXTS.get(root)
    if ctx is None:
        with _CTX_LOCK:
            ctx = _CONTEXTS.get(root)
            if ctx is None:
                ctx = DataContext(root)
                _CONTEXTS[root] = ctx
                # the context holds its mesh (the key): drop it when the mesh stops, or
                # neither would ever be collected
                root.add_stop_callback(lambda: _forget(root))
    return ctx


def contexts() -> list[DataContext]:
    """The data contexts of this process's live process meshes."""
    return list(_CONTEXTS.values())


def existing_context(procs: ProcMesh) -> DataContext | None:
    """The data context of ``procs``' root mesh if one was made (arrays were), else None."""
    return _CONTEXTS.get(procs.root_mesh)


def _forget(root: ProcMesh) -> None:
    _CONTEXTS.pop(root, None)


# a Ctrl-C in the controller's thread never leaves a command buffer half taken or half sent
guard(DataContext.post, DataContext._queued_first, DataContext.flush, DataContext._flush, DataContext._send_buffer)
