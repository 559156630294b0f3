"""Process meshes: ``ProcMesh``, ``proc_mesh()`` and ``this_host()``.

A :class:`ProcMesh` is a :class:`~mesharray.MeshTrait` over worker processes:
``procs[0, 1:3]`` and ``procs.slice(procs=-1)`` are views over the same
processes, not new ones. All views of one mesh share one *root*: the
:class:`~mesharray.runtime.controller.Controller` that adopted the workers and
the bootstrap that started them.

Stopping (``stop()``, leaving a ``with`` / ``async with`` block) stops the
root, whichever view it is called on: every worker exits, calls in flight fail
with :class:`~mesharray.MeshStoppedError`. Stopping twice is harmless;
spawning on a stopped mesh raises :class:`~mesharray.MeshStoppedError`.

Supervision: pass ``owner=`` to :func:`proc_mesh`; if the owner has a
``__supervise__(self, failure)`` method, it is called (from a runtime thread)
with a :class:`~mesharray.MeshFailure` for each actor mesh that loses a rank
(or, when no actors were spawned, for the process mesh itself).
"""

from __future__ import annotations

import itertools
import logging
import numbers
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, Protocol, TypeVar, overload

import numpy as np

from ._core import Shape
from .actor import Actor, ActorMesh, endpoints_of
from .array import MeshArray
from .bootstrap import local as _local
from .bootstrap import mpi as _mpi
from .bootstrap import resolve_bootstrap
from .bootstrap.launch import Launch
from .errors import BootstrapError, MeshFailure, MeshStoppedError
from .mesh import MeshTrait
from .observe import Telemetry
from .runtime.controller import Controller, wait_policy

__all__ = ["ProcMesh", "proc_mesh", "this_host", "attach", "HostMesh", "install_array_factory"]

_actor_ids = itertools.count(1).__next__
log = logging.getLogger("mesharray.proc")

#: bytes of free shared-memory segments a stopped mesh leaves mapped for the next one
_SHM_KEEP = int(os.environ.get("MESHARRAY_SHM_KEEP", str(64 << 20)))

_A = TypeVar("_A", bound=Actor)
_P = ParamSpec("_P")


class ArrayFactory(Protocol):
    """What makes the distributed arrays of ``ProcMesh.zeros`` and friends.

    Distributed arrays live in a layer above process meshes
    (:mod:`mesharray.darray`), which installs itself here with
    :func:`install_array_factory` when imported; ``import mesharray`` does so
    on the first use of a process mesh.
    """

    def make(self, procs: ProcMesh, kind: str, local_shape: tuple[int, ...], dtype: np.dtype, engine: str,
             extra: Any = None, collective: str | None = None) -> MeshArray: ...
    def scatter(self, procs: ProcMesh, arr: np.ndarray, engine: str, collective: str | None = None) -> MeshArray: ...
    def apply(self, procs: ProcMesh, fn: Callable[..., Any], arrays: Sequence[Any]) -> MeshArray: ...
    def sync(self, procs: ProcMesh) -> None: ...


_array_factory: ArrayFactory | None = None


def install_array_factory(factory: ArrayFactory) -> None:
    """Install what ``ProcMesh.zeros``, ``ones``, ... and ``apply`` run (:mod:`mesharray.darray` does)."""
    global _array_factory
    _array_factory = factory


def _factory() -> ArrayFactory:
    if _array_factory is None:
        raise RuntimeError(
            "distributed arrays are not loaded: import mesharray.darray (the `import mesharray` facade "
            "does so on first use of ma.proc_mesh and friends) before making arrays on a ProcMesh"
        )
    return _array_factory


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


_malloc_trim: Any = None


def _return_freed_memory() -> None:
    """Give the memory a stopped mesh freed back to the system (glibc keeps freed heap pages).

    Without it the controller's RSS grows with every mesh started and stopped,
    although nothing is alive any more (the soak test measures it).
    """
    global _malloc_trim
    if _malloc_trim is None:
        _malloc_trim = False
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                _malloc_trim = ctypes.CDLL(None).malloc_trim
            except (OSError, AttributeError):  # not glibc (musl, ...)
                pass
    if _malloc_trim:
        _malloc_trim(0)


class _Spawned:
    """An actor mesh as spawned: what a restart of one of its ranks re-runs."""

    __slots__ = ("actor_id", "payload", "shape", "max_restarts", "used", "system")

    def __init__(self, actor_id: int, payload: Any, shape: Shape, max_restarts: int, system: bool) -> None:
        self.actor_id = actor_id
        self.payload = payload  # the SPAWN message: (name, class, args, kwargs, shape), pickled
        self.shape = shape
        self.max_restarts = max_restarts
        self.used: dict[int, int] = {}  # restarts per rank so far
        self.system = system


class _Root:
    """What all views of one process mesh share."""

    def __init__(self, controller: Controller, shape: Shape, bootstrap: Any = None, owner: Any = None) -> None:
        self.controller = controller
        self.mesh: ProcMesh | None = None  # the root mesh (set by ProcMesh._from_controller)
        self.shape = shape
        self.bootstrap = bootstrap
        self.owner = owner
        # a list: a restarted rank gets a new address, which every actor mesh (sharing
        # this list) then uses
        self.addresses = controller.addresses(shape.size)
        self.actor_meshes: list[ActorMesh] = []
        self.spawned: list[_Spawned] = []  # what to re-run on a restarted rank
        self.restarts = 0
        self.restarting: set[int] = set()
        self.stopped = False
        self.stopping = False
        self.on_stop: list[Callable[[], None]] = []
        self.telemetry: Telemetry | None = None
        self._lock = threading.Lock()
        for r in range(shape.size):
            coords = shape.coordinates(r)
            shown = {k: v for k, v in coords.items() if shape.extent[k] > 1} or {shape.names[-1]: coords[shape.names[-1]]}
            controller.labels[r] = ",".join(f"{k}={v}" for k, v in shown.items())
        controller.on_failure.append(self._on_failure)

    def _on_failure(self, failure: MeshFailure) -> None:
        # runs in a thread of its own (see Controller._fail): it may wait for a restart
        sup = getattr(self.owner, "__supervise__", None)
        if sup is not None:
            hit = [m for m in self.actor_meshes if any(r in failure.crashed_ranks for r in m.mesh_shape)]
            if not hit:
                sup(failure)
            for m in hit:
                sup(MeshFailure(m.name, failure.crashed_ranks, failure.error, m))
        for rank in failure.crashed_ranks:
            self._maybe_restart(rank)

    def _maybe_restart(self, rank: int) -> None:
        """Start ``rank`` again and re-run its actors' constructors, if every actor mesh on it may restart.

        A process holds the actors of every mesh spawned over its rank: it is
        restarted only when each of them (system actors aside) has restarts
        left on that rank; otherwise the rank stays dead and calls to it raise
        ``ActorDiedError``.
        """
        launch = self.bootstrap
        if self.stopping or self.stopped or not isinstance(launch, Launch) or not launch.can_restart:
            return
        on_rank = [s for s in self.spawned if rank in s.shape]
        user = [s for s in on_rank if not s.system]
        with self._lock:
            # the budget is spent before trying, so a constructor that kills its new
            # process spends it too; one restart of a rank at a time
            if (self.stopping or self.stopped or not user or rank in self.restarting or any(s.system for s in on_rank)
                    or any(s.used.get(rank, 0) >= s.max_restarts for s in user)):
                return
            self.restarting.add(rank)
            for s in user:
                s.used[rank] = s.used.get(rank, 0) + 1
        old = self.controller.workers.get(rank)
        try:
            launch.restart(rank)
            info = self.controller.adopt_one(rank, old.pid if old is not None else None)
            # re-run the constructors on the new process before anyone can call it there
            addresses = list(self.addresses)
            addresses[rank] = info.address
            for s in on_rank:
                self.controller.respawn(addresses, rank, s.actor_id, s.payload, timeout=60)
            self.addresses[rank] = info.address
            self.restarts += 1
        except MeshStoppedError:
            pass  # stopped while restarting: nothing to report
        except Exception:
            if not self.stopping:
                log.exception("restarting rank %d failed; it stays dead", rank)
        finally:
            with self._lock:
                self.restarting.discard(rank)

    def stop(self) -> None:
        # the lock is held for the whole stop: a second caller returns once it is done
        callbacks: list[Callable[[], None]] = []
        with self._lock:
            if self.stopped:
                return
            self.stopping = True
            try:
                self.controller.stop()
            finally:
                if self.bootstrap is not None:
                    self.bootstrap.close()
                # the workers' addresses, the segments we mapped of theirs, and ours that
                # carried this mesh's messages (a few are kept for the next mesh)
                self.controller.release(self.addresses, _SHM_KEEP)
                _return_freed_memory()
                self.stopped = True
                callbacks, self.on_stop = self.on_stop, []
        for fn in callbacks:  # outside the lock: a callback may look at the mesh
            try:
                fn()
            except Exception:
                log.exception("a stop callback of the process mesh raised")


class ProcMesh(MeshTrait):
    """A mesh of worker processes (or a view of one).

    Made by :func:`proc_mesh` or ``this_host().spawn_procs(...)``. Index and
    slice it like a NumPy array; spawn actors on it with :meth:`spawn`; make
    distributed arrays on it with :meth:`zeros`, :meth:`ones`, :meth:`full`,
    :meth:`arange`, :meth:`rand`, :meth:`rank_array`, :meth:`from_numpy`
    (each takes the *local* shape, each rank's block; the array's shape is
    ``mesh sizes + local shape``; ``engine`` is a tensor engine name such as
    ``"numpy"``, ``"torch"``, ``"cuda"``, or ``"auto"``; ``collective`` is the
    backend of reductions across ranks: None for the engine's preference, or
    ``"torch"`` for torch.distributed).

    Examples
    --------
    >>> import mesharray as ma
    >>> with ma.proc_mesh(hosts=1, procs=4) as procs:   # doctest: +SKIP
    ...     procs[0, 1:3].sizes
    {'procs': 2}
    """

    def __init__(self, root: _Root, shape: Shape) -> None:
        self._root = root
        self._shape = shape

    @classmethod
    def _from_controller(cls, controller: Controller, shape: Shape, bootstrap: Any = None,
                         owner: Any = None) -> ProcMesh:
        """A root mesh over the workers ``controller`` adopted (ranks ``0..shape.size-1``).

        ``bootstrap.close()`` is called after the workers were stopped.
        """
        root = _Root(controller, shape, bootstrap, owner)
        root.mesh = cls(root, shape)
        if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            root.mesh.telemetry.start_otlp_export()  # spans, metrics and logs to the collector, every 10 s
        return root.mesh

    @classmethod
    def _from_launch(cls, launch: Launch, owner: Any = None) -> ProcMesh:
        """The root mesh of what a bootstrap launched (the same mesh for the same launch)."""
        if launch.mesh is None:
            launch.mesh = cls._from_controller(launch.controller, launch.shape, launch, owner)
        return launch.mesh

    @property
    def root_mesh(self) -> ProcMesh:
        """The whole mesh this one is a view of (itself when it is not a view)."""
        root = self._root
        assert root.mesh is not None
        return root.mesh

    @property
    def _mesh_shape(self) -> Shape:
        return self._shape

    def _with_mesh_shape(self, shape: Shape) -> ProcMesh:
        return ProcMesh(self._root, shape)

    @property
    def stopped(self) -> bool:
        """Whether the mesh has been stopped."""
        return self._root.stopped

    @property
    def pids(self) -> list[int]:
        """Process ids of this view's workers, in row-major order."""
        w = self._root.controller.workers
        return [w[r].pid for r in self._shape]

    @property
    def host_ids(self) -> list[str]:
        """The host id of each of this view's workers, in row-major order."""
        w = self._root.controller.workers
        return [w[r].hello.get("host_id") or w[r].host for r in self._shape]

    @property
    def host_info(self) -> list[tuple[str | None, str | None]]:
        """``(memory domain, data-plane address)`` of each worker: equal domains share memory."""
        w = self._root.controller.workers
        return [(w[r].hello.get("domain"), w[r].hello.get("data")) for r in self._shape]

    @overload
    def spawn(self, name: str, actor_class: Callable[_P, _A], *args: _P.args, **kwargs: _P.kwargs) -> _A: ...
    @overload
    def spawn(self, name: str, actor_class: type[_A], *args: Any, max_restarts: int, **kwargs: Any) -> _A: ...

    # the implementation takes max_restarts out of the constructor's keywords, which
    # the first overload's ParamSpec cannot express
    def spawn(self, name: str, actor_class: Any, *args: Any,  # type: ignore[misc]
              max_restarts: int = 0, **kwargs: Any) -> Any:
        """Construct ``actor_class(*args, **kwargs)`` on every process of this (view of the) mesh.

        Returns an :class:`~mesharray.ActorMesh` with this mesh's dims. For a
        type checker the result is an ``actor_class`` (as in Monarch): so the
        mesh's endpoints keep their types, ``mesh.typo`` is an error, and the
        constructor's arguments are checked (see :mod:`mesharray.actor`). Raises
        :class:`~mesharray.ActorError` if a constructor raises (for the first
        failing rank), :class:`~mesharray.MeshStoppedError` on a stopped mesh.

        ``max_restarts=k``: when the process of one of its ranks dies, a new
        process is started for that rank and the constructor runs again there
        (at most ``k`` times per rank; the local bootstrap only). Calls in
        flight at the death, and calls made before the restart is done, raise
        :class:`~mesharray.ActorDiedError`; so do all calls once the budget is
        spent. A rank is restarted only when every actor mesh on it allows it.

        Examples
        --------
        >>> counters = procs.spawn("counters", Counter, 0)   # doctest: +SKIP
        """
        if not isinstance(name, str):
            raise TypeError(f"actor mesh name must be a str, got {type(name).__name__}")
        if not (isinstance(actor_class, type) and issubclass(actor_class, Actor)):
            raise TypeError(f"spawn needs a subclass of mesharray.Actor, got {actor_class!r}")
        if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
            raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
        root = self._root
        if root.stopped or root.stopping:
            raise MeshStoppedError("ProcMesh has already been stopped; cannot spawn actors on it")
        if max_restarts and not (isinstance(root.bootstrap, Launch) and root.bootstrap.can_restart):
            raise ValueError("max_restarts needs a bootstrap that can start a rank's process again "
                             "(the local one); this mesh's cannot (under mpirun a rank cannot be restarted)")
        actor_id = _actor_ids()
        p, futs = root.controller.spawn(root.addresses, list(self._shape), actor_id, name, actor_class, args,
                                        kwargs, self._shape)
        for fut in futs:
            fut.get()  # the first failing rank raises ActorError (or ActorDiedError)
        root.controller.counters.spawns += 1
        mesh = ActorMesh(name, actor_id, actor_class.__qualname__, endpoints_of(actor_class),
                         self._shape, root.addresses, self)
        root.actor_meshes.append(mesh)
        # what a restart re-runs (kept only when asked for: it holds the constructor's arguments)
        root.spawned.append(_Spawned(actor_id, p if max_restarts else None, self._shape, max_restarts,
                                     name.startswith("__mesharray")))
        return mesh  # an ActorMesh, typed (by the overloads) as its actor class: see mesharray.actor

    # -- distributed arrays (made by mesharray.darray; see install_array_factory) ----------

    def add_stop_callback(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once, when the mesh stops (for layers above that keep per-mesh state).

        Called at once when the mesh is already stopped.
        """
        root = self._root
        with root._lock:
            if not root.stopped:
                root.on_stop.append(fn)
                return
        fn()

    def check_live(self) -> None:
        """Raise :class:`~mesharray.MeshStoppedError` if the mesh is stopped or stopping."""
        if self._root.stopped or self._root.stopping:
            raise MeshStoppedError(f"{self!r} has been stopped; start a new mesh with proc_mesh()")

    def _make(self, kind: str, shape: Any, dtype: Any, engine: str, extra: Any = None,
              collective: str | None = None) -> MeshArray:
        self.check_live()
        return _factory().make(self, kind, _local_shape(shape), _dtype(dtype), engine, extra, collective)

    def zeros(self, shape: Any = (), dtype: Any = "float64", *, engine: str = "numpy",
              collective: str | None = None) -> MeshArray:
        """A distributed array of zeros with local shape ``shape``.

        >>> procs.zeros((3,)).shape      # doctest: +SKIP
        (1, 4, 3)
        """
        return self._make("zeros", shape, dtype, engine, None, collective)

    def ones(self, shape: Any = (), dtype: Any = "float64", *, engine: str = "numpy",
             collective: str | None = None) -> MeshArray:
        """A distributed array of ones.

        >>> procs.ones(2, dtype="int32").fetch().tolist()   # doctest: +SKIP
        [[[1, 1], [1, 1], [1, 1], [1, 1]]]
        """
        return self._make("ones", shape, dtype, engine, None, collective)

    def empty(self, shape: Any = (), dtype: Any = "float64", *, engine: str = "numpy",
              collective: str | None = None) -> MeshArray:
        """A distributed array whose blocks are allocated but not initialised.

        >>> procs.empty((1 << 20,), "float32")   # doctest: +SKIP
        MeshArray(hosts=1, procs=4, local=(1048576,), dtype=float32) [distributed]
        """
        return self._make("empty", shape, dtype, engine, None, collective)

    def full(self, shape: Any, fill_value: Any, dtype: Any = None, *, engine: str = "numpy",
             collective: str | None = None) -> MeshArray:
        """A distributed array filled with ``fill_value``.

        >>> procs.full((2,), 7).fetch().tolist()   # doctest: +SKIP
        [[[7, 7], [7, 7], [7, 7], [7, 7]]]
        """
        if dtype is None:
            dtype = np.asarray(fill_value).dtype
        if not np.isscalar(fill_value):
            raise TypeError(f"fill_value must be a scalar, got {type(fill_value).__name__}")
        return self._make("full", shape, dtype, engine, fill_value, collective)

    def arange(self, shape: Any, dtype: Any = "int64", *, engine: str = "numpy",
               collective: str | None = None) -> MeshArray:
        """Each rank's block is ``arange(prod(shape)).reshape(shape)``.

        >>> procs.arange(3).fetch().tolist()   # doctest: +SKIP
        [[[0, 1, 2], [0, 1, 2], [0, 1, 2], [0, 1, 2]]]
        """
        return self._make("arange", shape, dtype, engine, None, collective)

    def rand(self, shape: Any = (), dtype: Any = "float64", *, seed: int | None = None, engine: str = "numpy",
             collective: str | None = None) -> MeshArray:
        """Uniform [0, 1) blocks; with ``seed``, rank r draws from ``seed + r`` (reproducible).

        >>> procs.rand((2,), seed=0)   # doctest: +SKIP
        MeshArray(hosts=1, procs=4, local=(2,), dtype=float64) [distributed]
        """
        dt = _dtype(dtype)
        if dt.kind != "f":
            raise TypeError(f"rand needs a floating dtype, got {dt}")
        return self._make("rand", shape, dt, engine, seed, collective)

    def rank_array(self, dtype: Any = "int64", *, engine: str = "numpy", collective: str | None = None) -> MeshArray:
        """Each rank's global rank, as a distributed array with no local axes.

        >>> procs.rank_array().fetch().tolist()   # doctest: +SKIP
        [[0, 1, 2, 3]]
        """
        return self._make("rank", (), dtype, engine, None, collective)

    def from_numpy(self, array: Any, *, engine: str = "numpy", collective: str | None = None) -> MeshArray:
        """Scatter ``array``: its leading axes are the mesh dims, the rest each rank's block.

        >>> procs.from_numpy(np.arange(8).reshape(1, 4, 2)).fetch().tolist()   # doctest: +SKIP
        [[[0, 1], [2, 3], [4, 5], [6, 7]]]
        """
        self.check_live()
        return _factory().scatter(self, np.asarray(array), engine, collective)

    def apply(self, fn: Callable[..., Any], *arrays: Any) -> MeshArray:
        """Run ``fn(*blocks)`` on each rank with its blocks of ``arrays``; a new distributed array.

        Non-distributed arguments are passed as they are.

        >>> procs.apply(lambda x: x[::-1], procs.arange(3)).fetch().tolist()   # doctest: +SKIP
        [[[2, 1, 0], [2, 1, 0], [2, 1, 0], [2, 1, 0]]]
        """
        if not callable(fn):
            raise TypeError(f"apply needs a callable, got {type(fn).__name__}")
        self.check_live()
        return _factory().apply(self, fn, arrays)

    def sync(self) -> None:
        """Wait until every rank ran the distributed-array ops queued so far; raise the first failure.

        Ops on distributed arrays are queued and sent without waiting (see
        :mod:`mesharray.darray`): a value you fetch waits for what it needs,
        and this waits for everything, on every rank of the mesh. A failure of
        an op that makes no array (``loss.backward()``) raises here, as at any
        later wait on its ranks, as :class:`~mesharray.ActorError`.

        >>> procs.sync()   # doctest: +SKIP
        """
        self.check_live()
        if _array_factory is not None:
            _array_factory.sync(self)

    # -- lifetime ---------------------------------------------------------------------

    def stop(self) -> None:
        """Stop every process of the mesh (the whole root, also when called on a view).

        Stopping twice is harmless.
        """
        self._root.stop()

    @property
    def telemetry(self) -> Telemetry:
        """What the whole mesh does: ``sql(...)``, ``metrics()``, ``trace(path)``, ``serve()``, ``stacks()``.

        See :mod:`mesharray.observe`. One per root mesh, whichever view asks;
        closed when the mesh stops.

        >>> procs.telemetry.sql("SELECT endpoint, count(*) AS n FROM messages GROUP BY endpoint")  # doctest: +SKIP
        """
        root = self._root
        with root._lock:
            if root.telemetry is None:
                if root.stopped:
                    raise MeshStoppedError("the mesh was stopped: its telemetry is gone")
                root.telemetry = Telemetry(root.controller, root.controller.labels, root.controller.name)
                root.on_stop.append(root.telemetry.close)
            return root.telemetry

    def stacks(self, timeout: float = 5.0, native: bool = False) -> dict[int, str]:
        """The Python thread stacks of every rank of this view (what a hung call is doing).

        Asked on a connection of its own, so a rank busy in a long call answers
        too. ``{rank: text}``; a rank that cannot answer gets the reason.
        ``native=True`` adds ``py-spy dump --native`` where py-spy is installed.
        """
        every = self.telemetry.stacks(timeout, native)
        return {r: every.get(r, "<not in the mesh>") for r in self._shape}

    def logging(self, stream: bool = True, aggregate_window: float | None = 0.25,
                level: int | str | None = None) -> None:
        """How this mesh's worker output reaches the controller, changed at run time.

        Parameters
        ----------
        stream : bool
            Print the output of this view's ranks here (rank-prefixed). False:
            not printed, still kept in ``procs.telemetry``'s ``logs`` table.
        aggregate_window : float or None
            Seconds during which identical lines of several ranks are joined into
            one (``[procs=0:8] step done``), for the whole root mesh; ``0`` or
            ``None`` prints every line as it comes.
        level : int or str, optional
            The level of the ``logging`` root logger in this view's workers
            (``logging.DEBUG``, ``"WARNING"``, ...); None leaves it as it is.

        Until this is called, ``MESHARRAY_LOG_AGGREGATE`` and ``MESHARRAY_LOG_WINDOW``
        decide (aggregated over 0.25 s), and workers log at ``INFO``.

        Examples
        --------
        >>> import logging
        >>> procs.logging(stream=True, aggregate_window=1.0, level=logging.WARNING)   # doctest: +SKIP
        >>> procs[0, 1:].logging(stream=False)   # ranks 1.. keep quiet here  # doctest: +SKIP
        """
        if not isinstance(stream, bool):
            raise TypeError(f"stream must be a bool, got {type(stream).__name__}")
        if aggregate_window is not None and (isinstance(aggregate_window, bool)
                                             or not isinstance(aggregate_window, (int, float))):
            raise TypeError(f"aggregate_window must be a number of seconds or None, got {aggregate_window!r}")
        if aggregate_window is not None and not aggregate_window >= 0:
            raise ValueError(f"aggregate_window must be >= 0 seconds, got {aggregate_window}")
        if level is not None:
            import logging as _logging

            if isinstance(level, str):
                if not isinstance(_logging.getLevelName(level.upper()), int):
                    raise ValueError(f"unknown logging level {level!r}; levels are DEBUG, INFO, WARNING, ERROR, "
                                     f"CRITICAL")
                level = level.upper()
            elif isinstance(level, bool) or not isinstance(level, int):
                raise TypeError(f"level must be a logging level (int or name), got {level!r}")
        self.check_live()
        c = self._root.controller
        ranks = list(self._shape)
        sink = c.sink
        if stream:
            sink.muted.difference_update(ranks)
        else:
            sink.muted.update(ranks)
        sink.show()  # (what waits goes out under the old window)
        sink.window = float(aggregate_window or 0.0)
        sink.aggregate = sink.window > 0
        if level is not None:
            c.set_log_level(ranks, level)

    def stats(self) -> dict:
        """Runtime counters.

        Of this mesh: ``replies`` (and ``errors`` among them), ``spawns``,
        ``deaths``, ``log_bytes`` forwarded, ``workers`` and how many are
        ``alive``, ``unresponsive_now`` and ``paused_now`` (in the debugger).
        Of this process, all meshes together: ``calls`` sent expecting a reply
        and ``broadcasts``.
        """
        c = self._root.controller
        d = c.counters.as_dict()
        d["calls"] = c.router.sent_calls
        d["broadcasts"] = c.router.sent_oneway
        d["restarts"] = self._root.restarts
        d["unresponsive_now"] = sum(1 for w in c.workers.values() if w.alive and w.unresponsive_since is not None)
        d["paused_now"] = sum(1 for w in c.workers.values() if w.alive and w.paused)
        d["workers"] = len(c.workers)
        d["alive"] = sum(1 for w in c.workers.values() if w.alive)
        return d

    def __enter__(self) -> "ProcMesh":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    async def __aenter__(self) -> "ProcMesh":
        return self

    async def __aexit__(self, *exc) -> None:
        import asyncio

        await asyncio.to_thread(self.stop)

    def __repr__(self) -> str:
        sizes = ", ".join(f"{k}={v}" for k, v in self._shape.extent.items())
        state = " stopped" if self._root.stopped else ""
        return f"<ProcMesh {{{sizes}}}{state}>"


def proc_mesh(hosts: int | None = None, procs: int | None = None, *, bootstrap: str = "auto",
              forward_logs: bool = True, heartbeat_timeout: float = 5.0,
              heartbeat_interval: float = 0.5, timeout: float | None = None, owner=None,
              name: str = "procs", kill_unresponsive: bool = False, env: dict[str, str] | None = None,
              python: str | None = None) -> ProcMesh:
    """Start ``hosts * procs`` worker processes on this host; a mesh with dims ``(hosts, procs)``.

    The ``local`` bootstrap: workers are forked from a zygote (a clean process
    that imported the worker's modules once), so 16 of them start in a few
    hundred milliseconds. ``hosts > 1`` lays several groups out as if they were
    hosts (all on this machine).

    Under a launcher (``mpirun -n N python script.py``; ``bootstrap="auto"``
    detects it, ``bootstrap="mpi"`` asks for it) the same call returns the MPI
    world instead — see :mod:`mesharray.bootstrap.mpi`: rank 0 gets the mesh,
    ranks 1..N-1 serve inside this call and never return from it.

    Parameters
    ----------
    hosts, procs : int, optional
        Mesh sizes (default 1 each; under MPI the topology decides and given
        sizes must match it).
    bootstrap : {"auto", "local", "mpi"}
        How the processes are found: ``auto`` is ``mpi`` under a launcher
        (or ``$MESHARRAY_BOOTSTRAP``), else ``local``.
    forward_logs : bool
        Print workers' stdout/stderr/logging here, prefixed with their rank.
    heartbeat_timeout : float
        A worker whose heartbeats stop this long (seconds) is reported
        unresponsive (a warning; ``stats()["unresponsive"]``), not killed: an
        endpoint holding the GIL, or a stopped process, is alive. Deaths are
        seen from the process itself (its connection closes, its exit status).
    heartbeat_interval : float
        Seconds between a worker's heartbeats.
    timeout : float, optional
        How long to wait for the workers to join (default 60 s; 30 s under MPI).
    owner : object, optional
        Its ``__supervise__(failure)`` method, if any, sees each :class:`~mesharray.MeshFailure`.
    name : str
        Name used in failure reports.
    kill_unresponsive : bool
        Kill a worker unresponsive for ``heartbeat_timeout``: its calls then
        fail with :class:`~mesharray.ActorDiedError` (a hung-process policy).
    env : dict of str, optional
        Environment variables set in every worker (on top of this process's).
    python : str, optional
        The workers' interpreter (default: this one's). It keeps its own
        ``sys.path`` (its standard library and ``site-packages``), with this
        script's own directories in front; mesharray must be importable by it.

    Examples
    --------
    >>> import mesharray as ma
    >>> procs = ma.proc_mesh(hosts=1, procs=2)   # doctest: +SKIP
    >>> procs.sizes                               # doctest: +SKIP
    {'hosts': 1, 'procs': 2}
    >>> procs.stop()                              # doctest: +SKIP
    """
    return _proc_mesh(hosts, procs, bootstrap=bootstrap, forward_logs=forward_logs,
                      heartbeat_timeout=heartbeat_timeout, heartbeat_interval=heartbeat_interval, timeout=timeout,
                      owner=owner, name=name, kill_unresponsive=kill_unresponsive, env=env, python=python)


def _proc_mesh(hosts: int | None, procs: int | None, *, bootstrap: str, forward_logs: bool,
               heartbeat_timeout: float, heartbeat_interval: float, timeout: float | None, owner: Any, name: str,
               kill_unresponsive: bool, env: dict[str, str] | None, python: str | None,
               workspace: str | None = None) -> ProcMesh:
    """:func:`proc_mesh`, whose local processes may use a ``workspace`` first (``this_host().sync_workspace``)."""
    wait_policy()
    env = _check_env(env)
    if resolve_bootstrap(bootstrap) == "mpi":
        if env or python is not None:
            raise ValueError("env= and python= need processes started by mesharray; under MPI the launcher "
                             "started them (set the environment and interpreter on the mpirun command line)")
        launch = _mpi.bootstrap(hosts=hosts, procs=procs, timeout=timeout, name=name,
                                heartbeat_timeout=heartbeat_timeout, heartbeat_interval=heartbeat_interval,
                                kill_unresponsive=kill_unresponsive)
    else:
        launch = _local.launch(1 if hosts is None else hosts, 1 if procs is None else procs,
                               forward_logs=forward_logs, timeout=60.0 if timeout is None else timeout,
                               heartbeat_timeout=heartbeat_timeout, heartbeat_interval=heartbeat_interval,
                               name=name, kill_unresponsive=kill_unresponsive, env=env, python=python,
                               **_local_workspace(workspace))
    return ProcMesh._from_launch(launch, owner)


def _check_env(env: Any) -> dict[str, str]:
    """``env`` checked: a dict of variable names to str values (``{}`` for None)."""
    if env is None:
        return {}
    if not isinstance(env, dict):
        raise TypeError(f"env must be a dict of str to str, got {type(env).__name__}")
    for k, v in env.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"env must map str to str, got {k!r}: {type(v).__name__}")
        if not k or "=" in k or "\0" in k or "\0" in v:
            raise ValueError(f"env: {k!r} is not a valid environment variable name (or its value holds a NUL)")
    return dict(env)


def _local_workspace(path: str | None) -> dict[str, Any]:
    """The keywords of a local launch whose processes use ``path`` first (``this_host().sync_workspace``)."""
    return {} if path is None else {"cwd": path, "sys_path_first": [path]}


class _Hosts:
    """What all views of one attached host mesh share: the agents and the meshes started on them."""

    def __init__(self, agents: list[Any], data_plane: str) -> None:
        self.agents = agents
        self.data_plane = data_plane
        self.meshes: list[ProcMesh] = []
        self.detached = False
        self.lock = threading.Lock()
        self.on_detach: list[Callable[[], None]] = []
        self.per_host: dict[str, int] | None = None


class HostMesh(MeshTrait):
    """Hosts a script can start processes on: a mesh with the dim ``hosts``.

    ``ma.attach([...])`` gives the hosts of running host agents
    (``python -m mesharray host``); ``ma.this_host()`` is this machine, a
    one-host mesh that starts its processes locally. Index and slice it like
    any mesh (``hosts[0:2]``, ``hosts.slice(hosts=-1)``); :meth:`spawn_procs`
    starts a :class:`ProcMesh` on the hosts of the view.
    """

    def __init__(self, shape: Shape | None = None, hosts: _Hosts | None = None) -> None:
        self._shape = Shape({"hosts": 1}) if shape is None else shape
        self._hosts = hosts
        self._workspace: str | None = None  # this_host(): the directory sync_workspace named

    @property
    def _mesh_shape(self) -> Shape:
        return self._shape

    def _with_mesh_shape(self, shape: Shape) -> HostMesh:
        return HostMesh(shape, self._hosts)

    @property
    def host_ids(self) -> list[str]:
        """The host id of each host of this view (``this_host()``: this machine's name)."""
        if self._hosts is None:
            return [os.uname().nodename]
        return [self._hosts.agents[r].host_id for r in self._shape]

    @property
    def addresses(self) -> list[str]:
        """The agents' addresses (``tcp://HOST:PORT``) of this view's hosts."""
        if self._hosts is None:
            return []
        return [self._hosts.agents[r].url for r in self._shape]

    def spawn_procs(self, per_host: dict | None = None, *, name: str = "procs", timeout: float | None = None,
                    env: dict[str, str] | None = None, python: str | None = None, **kwargs: Any) -> ProcMesh:
        """Start processes on every host of this view: ``hosts.spawn_procs(per_host={"procs": 8})``.

        The result has dims ``{"hosts": H, "procs": N}`` (``per_host`` names
        one dim and its size; its name becomes the second dim's; without it,
        the hosts' default — ``--procs-per-host`` of a Kubernetes mesh — else
        one process per host). ``env`` sets variables in every process it
        starts, on every host (they travel on the authenticated connection to
        the agents, never on a command line); ``python`` picks the processes'
        interpreter (a path valid on every host; it keeps its own
        ``sys.path``, with the script's own directories in front). After
        :meth:`sync_workspace`, the copy goes first on ``sys.path`` and is the
        processes' working directory. Other keywords are those of
        :func:`proc_mesh` (``heartbeat_timeout``, ``forward_logs``,
        ``owner``, ``kill_unresponsive``).

        >>> import mesharray as ma
        >>> procs = ma.this_host().spawn_procs(per_host={"procs": 2}, env={"OMP_NUM_THREADS": "1"})   # doctest: +SKIP
        """
        env = _check_env(env)
        if per_host is None and self._hosts is not None:
            per_host = self._hosts.per_host
        per_host = dict(per_host or {"procs": 1})
        if len(per_host) != 1:
            raise ValueError(f"per_host names one dimension and its size, got {per_host!r}")
        (dim, n), = per_host.items()
        if not isinstance(dim, str) or dim == "hosts":
            raise ValueError(f"per_host's dimension must be a name other than 'hosts', got {dim!r}")
        if self._hosts is None:
            kw: dict[str, Any] = dict(bootstrap="auto", forward_logs=True, heartbeat_timeout=5.0,
                                      heartbeat_interval=0.5, owner=None, kill_unresponsive=False)
            unknown = set(kwargs) - set(kw)
            if unknown:
                raise TypeError(f"spawn_procs() got unexpected keyword arguments {sorted(unknown)}")
            kw.update(kwargs)
            mesh = _proc_mesh(1, n, name=name, timeout=timeout, env=env, python=python, workspace=self._workspace,
                              **kw)
            return mesh if dim == "procs" else mesh.rename(procs=dim)
        from .bootstrap import remote as _remote

        h = self._hosts
        owner = kwargs.pop("owner", None)
        with h.lock:
            if h.detached:
                raise MeshStoppedError("these hosts were detached; attach again to start processes on them")
            launch = _remote.launch([h.agents[r] for r in self._shape], n, name=name,
                                    timeout=60.0 if timeout is None else timeout, data_plane=h.data_plane,
                                    dim=dim, env=env, python=python, **kwargs)
            mesh = ProcMesh._from_launch(launch, owner)
            h.meshes.append(mesh)
        return mesh

    def sync_workspace(self, path: str = ".", *, timeout: float = 300.0) -> dict[str, dict[str, int]]:
        """Copy the directory tree at ``path`` to every host of this view, for the processes spawned afterwards.

        Each host keeps its copy in its agent's own directory (it lives as
        long as the agent, across controllers); a later sync sends only the
        files whose content changed and deletes the copies of files the tree
        no longer has. Left out: ``.git``, ``__pycache__``, ``.mesharray``,
        virtual environments and what the tree's ``.gitignore`` files list;
        nothing outside the tree is read (a symbolic link is followed only to
        a target inside it). Processes that :meth:`spawn_procs` starts
        afterwards have the copy first on ``sys.path`` and as their working
        directory, so code that is not installed on the hosts imports there;
        processes already running keep what they imported.

        On ``this_host()`` nothing is copied: its processes use ``path`` itself.

        Returns
        -------
        dict
            Per host id: ``files`` (in the tree), ``copied``, ``bytes`` (sent)
            and ``deleted``.

        Raises
        ------
        BootstrapError
            A host could not write its copy (the message names the host and file).

        Examples
        --------
        >>> hosts = ma.job.LocalJob(meshes={"workers": 2}).state().workers   # doctest: +SKIP
        >>> hosts.sync_workspace(".")                                        # doctest: +SKIP
        {'workers-0': {'files': 12, 'copied': 12, 'bytes': 40960, 'deleted': 0}, ...}
        """
        root = os.path.abspath(os.fspath(path))
        if not os.path.isdir(root):
            raise NotADirectoryError(f"sync_workspace: {path!r} is not a directory")
        h = self._hosts
        if h is None:
            from .bootstrap.workspace import scan

            self._workspace = root
            n = len(scan(root))
            return {self.host_ids[0]: {"files": n, "copied": 0, "bytes": 0, "deleted": 0}}
        from .bootstrap import remote as _remote

        with h.lock:
            if h.detached:
                raise MeshStoppedError("these hosts were detached; attach again to sync a workspace to them")
            agents = [h.agents[r] for r in self._shape]
        return _remote.sync_workspace(agents, root, timeout=timeout)

    def detach(self) -> None:
        """Stop the process meshes started on these hosts and let the agents serve another controller.

        Whichever view it is called on, it detaches every host of the mesh
        ``attach`` returned. Detaching twice is harmless.
        """
        h = self._hosts
        if h is None:
            return
        with h.lock:
            if h.detached:
                return
            h.detached = True
            meshes, h.meshes = h.meshes, []
            callbacks, h.on_detach = h.on_detach, []
        for m in meshes:
            m.stop()
        for a in h.agents:
            a.close()
        for fn in callbacks:  # after the agents were let go: a callback may delete the hosts themselves
            try:
                fn()
            except Exception:
                log.exception("a detach callback of the host mesh raised")

    def add_detach_callback(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once, after the mesh detached (for layers above that own the hosts, e.g. ``ma.k8s``).

        Called at once when it is already detached.
        """
        h = self._hosts
        if h is not None:
            with h.lock:
                if not h.detached:
                    h.on_detach.append(fn)
                    return
        fn()

    def lose_host(self, index: int, reason: str) -> list[int]:
        """Declare host ``index`` (of the attached mesh) gone: its ranks fail now with ``ActorDiedError(reason)``.

        For what learns of a lost host before its connections do (``ma.k8s``
        watches its pods: a pod deleted or failed). The agent is let go too.
        Returns the global ranks declared dead, mesh by mesh.
        """
        h = self._hosts
        if h is None:
            raise ValueError("this_host() has no attached hosts to lose")
        agent = h.agents[index]
        with h.lock:
            meshes = list(h.meshes)
        dead: list[int] = []
        for m in meshes:
            root = m._root
            for rank, host in zip(m._shape, m.host_ids):
                if host == agent.host_id and root.controller.declare_dead(rank, reason):
                    dead.append(rank)
        agent.close()
        return dead

    def set_default_per_host(self, per_host: dict[str, int] | None) -> None:
        """What :meth:`spawn_procs` starts on each host when given no ``per_host`` (e.g. ``{"procs": 8}``)."""
        if self._hosts is not None:
            self._hosts.per_host = None if per_host is None else dict(per_host)

    @property
    def detached(self) -> bool:
        return self._hosts is not None and self._hosts.detached

    def __enter__(self) -> HostMesh:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    def __repr__(self) -> str:
        if self._hosts is None:
            return f"<HostMesh {os.uname().nodename}>"
        state = " detached" if self._hosts.detached else ""
        return f"<HostMesh {{hosts={self._shape.size}}} {', '.join(self.host_ids)}{state}>"


def this_host() -> HostMesh:
    """This machine, as a host mesh of one host.

    >>> import mesharray as ma
    >>> ma.this_host()   # doctest: +ELLIPSIS
    <HostMesh ...>
    """
    return HostMesh()


def attach(addresses: Sequence[str], *, secret: str | bytes | None = None, timeout: float = 30.0,
           transport: str | None = None) -> HostMesh:
    """Attach to running host agents: a :class:`HostMesh` with dims ``{"hosts": len(addresses)}``.

    Each machine runs ``MESHARRAY_SECRET=... python -m mesharray host --listen tcp://0.0.0.0:26600``;
    the script attaches to all of them, then starts processes with
    :meth:`HostMesh.spawn_procs`. Hosts are laid out in the order given.

    Parameters
    ----------
    addresses : list of str
        The agents' addresses, ``tcp://HOST:PORT`` (as each agent printed it).
    secret : str or bytes, optional
        The agents' secret (default ``MESHARRAY_SECRET``).
    timeout : float
        Seconds to wait for every agent to answer (agents still starting are retried).
    transport : {"auto", "shm", "tcp", "ucx"}, optional
        The data plane between hosts (default ``MESHARRAY_DATA_PLANE``, else
        ``auto``: UCX where there is an RDMA device and the UCX plane loads, else TCP). Processes of one
        host always share memory.

    Raises
    ------
    AuthenticationError
        An agent refused the secret.
    BootstrapError
        No secret, an agent already serving another controller, or agents not
        reached within ``timeout`` (named in the message).

    Examples
    --------
    >>> hosts = ma.attach(["tcp://node1:26600", "tcp://node2:26600"])   # doctest: +SKIP
    >>> procs = hosts.spawn_procs(per_host={"procs": 8})                 # doctest: +SKIP
    >>> procs.sizes                                                      # doctest: +SKIP
    {'hosts': 2, 'procs': 8}
    >>> procs.stop(); hosts.detach()                                     # doctest: +SKIP
    """
    from .bootstrap import agent as _agent
    from .bootstrap import remote as _remote

    if isinstance(addresses, str):
        addresses = [addresses]
    addresses = list(addresses)
    if not addresses:
        raise ValueError("attach needs at least one host agent address")
    for a in addresses:
        _agent.parse_url(a)  # a malformed address fails here, naming it
    if len(set(addresses)) != len(addresses):
        dup = sorted({a for a in addresses if addresses.count(a) > 1})
        raise ValueError(f"host agent addresses repeat: {dup}; each agent serves one controller once")
    key = _agent.secret_from_env(secret)
    if key is None:
        raise BootstrapError("attach needs the agents' secret: set MESHARRAY_SECRET (as on the agents) or "
                             "pass secret=")
    kind = _remote.plane_kind(transport)
    wait_policy(workers=False)  # (the agents' workers get the agents' environment, not this one)
    agents = _remote.attach_agents(addresses, key, timeout=timeout)
    return HostMesh(Shape({"hosts": len(agents)}), _Hosts(agents, kind))
