"""Process meshes: ``ProcMesh``, ``proc_mesh()`` and ``this_host()``.

A :class:`ProcMesh` is a :class:`~mesharray.MeshTrait` over worker processes:
``procs[0, 1:3]`` and ``procs.slice(procs=-1)`` are views over the same
processes, not new ones. All views of one mesh share one *root*: the
:class:`~mesharray.runtime.controller.Controller` that adopted the workers and
the bootstrap that started them.

Stopping (``stop()``, leaving a ``with`` / ``async with`` block) stops the
root, whichever view it is called on: every worker exits, calls in flight fail
with :class:`~mesharray.MeshStoppedError`. Stopping twice is harmless;
spawning on a stopped mesh raises ``RuntimeError``.

Supervision: pass ``owner=`` to :func:`proc_mesh`; if the owner has a
``__supervise__(self, failure)`` method, it is called (from a runtime thread)
with a :class:`~mesharray.MeshFailure` for each actor mesh that loses a rank
(or, when no actors were spawned, for the process mesh itself).
"""

from __future__ import annotations

import itertools
import os
import threading
from typing import Any

from ._core import Shape
from .actor import Actor, ActorMesh
from .errors import ActorError, MeshFailure
from .mesh import MeshTrait
from .runtime import protocol as P
from .runtime.controller import Controller
from .runtime.future import Future
from .transport import framing

try:  # the data helper's factory methods (zeros, ones, ...) when present
    from ._array_factory import ArrayFactory as _ArrayFactory

    _BASES: tuple = (_ArrayFactory, MeshTrait)
except ImportError:  # pragma: no cover - depends on what is merged
    _BASES = (MeshTrait,)

__all__ = ["ProcMesh", "proc_mesh", "this_host", "HostMesh"]

_actor_ids = itertools.count(1).__next__


class _Root:
    """What all views of one process mesh share."""

    def __init__(self, controller: Controller, shape: Shape, bootstrap=None, owner=None) -> None:
        self.controller = controller
        self.shape = shape
        self.bootstrap = bootstrap
        self.owner = owner
        self.addresses = tuple(controller.workers[r].address for r in range(shape.size))
        self.actor_meshes: list[ActorMesh] = []
        self.stopped = False
        self.stopping = False
        self._lock = threading.Lock()
        for r in range(shape.size):
            coords = shape.coordinates(r)
            shown = {k: v for k, v in coords.items() if shape.extent[k] > 1} or {shape.names[-1]: coords[shape.names[-1]]}
            controller.labels[r] = ",".join(f"{k}={v}" for k, v in shown.items())
        controller.on_failure.append(self._on_failure)

    def _on_failure(self, failure: MeshFailure) -> None:
        sup = getattr(self.owner, "__supervise__", None)
        if sup is None:
            return
        hit = [m for m in self.actor_meshes if any(r in failure.crashed_ranks for r in m._shape)]
        if not hit:
            sup(failure)
        for m in hit:
            sup(MeshFailure(m.name, failure.crashed_ranks, failure.error, m))

    def stop(self) -> None:
        # the lock is held for the whole stop: a second caller returns once it is done
        with self._lock:
            if self.stopped:
                return
            self.stopping = True
            try:
                self.controller.stop()
            finally:
                if self.bootstrap is not None:
                    self.bootstrap.close()
                for a in self.addresses:
                    self.controller.router.forget(a)
                self.stopped = True


class ProcMesh(*_BASES):
    """A mesh of worker processes (or a view of one).

    Made by :func:`proc_mesh` or ``this_host().spawn_procs(...)``. Index and
    slice it like a NumPy array; spawn actors on it with :meth:`spawn`.

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
    def _from_controller(cls, controller: Controller, shape: Shape, bootstrap=None, owner=None) -> "ProcMesh":
        """A root mesh over the workers ``controller`` adopted (ranks ``0..shape.size-1``).

        For bootstraps: ``bootstrap.close()`` is called after the workers were
        stopped.
        """
        return cls(_Root(controller, shape, bootstrap, owner), shape)

    @property
    def _mesh_shape(self) -> Shape:
        return self._shape

    def _with_mesh_shape(self, shape: Shape) -> "ProcMesh":
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

    def spawn(self, name: str, actor_class: type, *args: Any, **kwargs: Any) -> ActorMesh:
        """Construct ``actor_class(*args, **kwargs)`` on every process of this (view of the) mesh.

        Returns an :class:`~mesharray.ActorMesh` with this mesh's dims. Raises
        :class:`~mesharray.ActorError` if a constructor raises (for the first
        failing rank), ``RuntimeError`` on a stopped mesh.

        Examples
        --------
        >>> counters = procs.spawn("counters", Counter, 0)   # doctest: +SKIP
        """
        if not isinstance(name, str):
            raise TypeError(f"actor mesh name must be a str, got {type(name).__name__}")
        if not (isinstance(actor_class, type) and issubclass(actor_class, Actor)):
            raise TypeError(f"spawn needs a subclass of mesharray.Actor, got {actor_class!r}")
        root = self._root
        if root.stopped or root.stopping:
            raise RuntimeError("ProcMesh has already been stopped; cannot spawn actors on it")
        actor_id = _actor_ids()
        p = framing.dumps((name, actor_class, args, kwargs, self._shape))
        from .actor import future_callback

        ranks = list(self._shape)
        futs = [Future._new() for _ in ranks]
        # the endpoints' send loop: one SPAWN per rank, no view; a rank that cannot be
        # reached fails its future
        root.controller.router.send_many(root.addresses, ranks, P.SPAWN, actor_id, None, p,
                                         cbs=[future_callback(f) for f in futs])
        for fut in futs:
            fut.get()  # the first failing rank raises ActorError (or ActorDiedError)
        root.controller.counters.spawns += 1
        mesh = ActorMesh(name, actor_id, actor_class.__qualname__, dict(actor_class._mesharray_endpoints),
                         self._shape, root.addresses, self)
        root.actor_meshes.append(mesh)
        return mesh

    def stop(self) -> None:
        """Stop every process of the mesh (the whole root, also when called on a view).

        Stopping twice is harmless.
        """
        self._root.stop()

    def stats(self) -> dict:
        """Runtime counters.

        Of this mesh: ``replies`` (and ``errors`` among them), ``spawns``,
        ``deaths``, ``log_bytes`` forwarded, ``workers`` and how many are
        ``alive``. Of this process, all meshes together: ``calls`` sent
        expecting a reply and ``broadcasts``.
        """
        c = self._root.controller
        d = c.counters.as_dict()
        d["calls"] = c.router.sent_calls
        d["broadcasts"] = c.router.sent_oneway
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
              name: str = "procs") -> ProcMesh:
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
        A worker silent this long (seconds) is declared hung and killed.
    heartbeat_interval : float
        Seconds between a worker's heartbeats.
    timeout : float, optional
        How long to wait for the workers to join (default 60 s; 30 s under MPI).
    owner : object, optional
        Its ``__supervise__(failure)`` method, if any, sees each :class:`~mesharray.MeshFailure`.
    name : str
        Name used in failure reports.

    Examples
    --------
    >>> import mesharray as ma
    >>> procs = ma.proc_mesh(hosts=1, procs=2)   # doctest: +SKIP
    >>> procs.sizes                               # doctest: +SKIP
    {'hosts': 1, 'procs': 2}
    >>> procs.stop()                              # doctest: +SKIP
    """
    from .bootstrap._detect import resolve_bootstrap

    if resolve_bootstrap(bootstrap) == "mpi":
        from .bootstrap import mpi

        return mpi.bootstrap(hosts=hosts, procs=procs, timeout=timeout, owner=owner, name=name,
                             heartbeat_timeout=heartbeat_timeout, heartbeat_interval=heartbeat_interval)
    hosts = 1 if hosts is None else hosts
    procs = 1 if procs is None else procs
    timeout = 60.0 if timeout is None else timeout
    for label, v in (("hosts", hosts), ("procs", procs)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{label} must be an int, got {type(v).__name__}")
        if v < 1:
            raise ValueError(f"{label} must be >= 1, got {v}")
    from .bootstrap.local import start_local

    shape = Shape({"hosts": hosts, "procs": procs})
    ctl = Controller(heartbeat_timeout=heartbeat_timeout, heartbeat_interval=heartbeat_interval, name=name)
    for r in range(shape.size):  # labels before the workers start printing
        c = shape.coordinates(r)
        ctl.labels[r] = f"hosts={c['hosts']},procs={c['procs']}" if hosts > 1 else f"procs={c['procs']}"
    boot = start_local(ctl, shape.size, forward_logs=forward_logs, timeout=timeout)
    return ProcMesh._from_controller(ctl, shape, boot, owner)


class HostMesh:
    """The hosts a script can start processes on; ``this_host()`` is this machine."""

    def spawn_procs(self, per_host: dict | None = None, **kwargs: Any) -> ProcMesh:
        """Monarch's spelling: ``this_host().spawn_procs(per_host={"procs": N})``.

        >>> import mesharray as ma
        >>> procs = ma.this_host().spawn_procs(per_host={"procs": 2})   # doctest: +SKIP
        """
        per_host = dict(per_host or {"procs": 1})
        if set(per_host) - {"procs"}:
            raise ValueError(f"per_host supports the dimension 'procs' only, got {sorted(per_host)}")
        return proc_mesh(hosts=1, procs=per_host.get("procs", 1), **kwargs)

    def __repr__(self) -> str:
        return f"<HostMesh {os.uname().nodename}>"


def this_host() -> HostMesh:
    """This machine, as a host mesh of one host.

    >>> import mesharray as ma
    >>> ma.this_host()   # doctest: +ELLIPSIS
    <HostMesh ...>
    """
    return HostMesh()
