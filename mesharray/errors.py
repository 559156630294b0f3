"""The one exception hierarchy of mesharray.

Argument mistakes use (subclasses of) the built-ins, so existing ``except``
clauses keep working: ``TypeError`` for a wrong type, ``ValueError`` for a wrong
value, ``IndexError`` for an index. Failures of the user's own code on a remote
actor (:class:`ActorError`) are kept apart from failures of the infrastructure
(:class:`SupervisionError` and its subclasses), as Monarch does.

Messages are lower-case and name the constraint and the values, e.g.
``mesh has no dimension 'gpu'; dimensions are ('hosts', 'procs')``.
"""

from __future__ import annotations

__all__ = [
    "BackpressureError",
    "CaptureError",
    "MeshArrayError",
    "MeshIndexError",
    "InvalidIndexError",
    "MeshShapeError",
    "DimensionError",
    "EngineUnavailableError",
    "SerializationError",
    "ActorError",
    "SupervisionError",
    "ActorDiedError",
    "MeshStoppedError",
    "BootstrapError",
    "TransportError",
    "ClosedTransportError",
    "BrokenTransportError",
    "BusyTransportError",
    "AuthenticationError",
    "FrameError",
    "MeshFailure",
]


class MeshArrayError(Exception):
    """Base class of every error mesharray raises on purpose."""


class MeshIndexError(MeshArrayError, IndexError):
    """An index that is out of range or malformed for a mesh or MeshArray."""


class InvalidIndexError(MeshIndexError, TypeError):
    """An index of a type nothing can be indexed with (a float, a str, an object).

    NumPy raises ``IndexError`` for these and Python's convention is ``TypeError``;
    this is both, so either ``except`` clause catches it.
    """


class MeshShapeError(MeshArrayError, ValueError):
    """Shapes that do not broadcast or do not fit together; names both shapes."""


class DimensionError(MeshArrayError, ValueError, IndexError):
    """A dimension name (or axis number) the mesh does not have.

    Like NumPy's ``AxisError`` it is both a ``ValueError`` and an ``IndexError``.
    The message is formatted lazily from the structured attributes.

    Attributes
    ----------
    dim : str or int
        The dimension that was asked for.
    dims : tuple of str
        The dimensions the mesh has.
    """

    def __init__(self, dim, dims=(), what: str = "mesh") -> None:
        super().__init__(dim, dims)
        self.dim = dim
        self.dims = tuple(dims)
        self.what = what

    def __str__(self) -> str:
        if isinstance(self.dim, int):
            return (
                f"axis {self.dim} is out of bounds for {self.what} of dimension "
                f"{len(self.dims)}; dimensions are {self.dims}"
            )
        return f"{self.what} has no dimension {self.dim!r}; dimensions are {self.dims}"


class EngineUnavailableError(MeshArrayError, ImportError):
    """A tensor engine whose package or device is missing; names the extra to install."""


class SerializationError(MeshArrayError, TypeError):
    """A value that cannot be pickled for sending; nothing was sent."""


class ActorError(MeshArrayError):
    """An exception raised by user code inside a remote actor.

    Attributes
    ----------
    exception : BaseException
        The original exception, with its type preserved (and its ``__cause__``
        chain when that could be pickled).
    rank : dict or None
        Coordinates of the actor that raised.
    traceback_text : str
        The remote traceback, formatted on the worker.
    """

    def __init__(self, exception: BaseException, rank=None, traceback_text: str = "",
                 actor: str = "", host: str = "", pid: int | None = None) -> None:
        super().__init__(exception, rank, traceback_text, actor, host, pid)
        self.exception = exception
        self.rank = rank
        self.traceback_text = traceback_text
        self.actor = actor
        self.host = host
        self.pid = pid

    @property
    def message(self) -> str:
        return str(self)

    def __str__(self) -> str:
        where = f"actor {self.actor!r}" if self.actor else "actor"
        if self.rank is not None:
            where += f" at {self._fmt_rank(self.rank)}"
        if self.host:
            where += f" on {self.host}"
        if self.pid is not None:
            where += f" (pid {self.pid})"
        text = f"{where} raised {type(self.exception).__name__}: {self.exception}"
        if self.traceback_text:
            text += "\n\nremote traceback:\n" + self.traceback_text.rstrip()
        return text

    @staticmethod
    def _fmt_rank(rank) -> str:
        if isinstance(rank, dict):
            return "{" + ", ".join(f"{k}={v}" for k, v in rank.items()) + "}"
        return str(rank)


class CaptureError(MeshArrayError, RuntimeError):
    """What a step captured by ``ma.function`` may not do: wait for a value inside it (a fetch,
    printing an array, ``procs.sync()``), or run ops on more than one process mesh; names the op."""


class SupervisionError(MeshArrayError, RuntimeError):
    """An infrastructure failure: a process died, hung, or a mesh was stopped."""


class ActorDiedError(SupervisionError):
    """The process hosting an actor is gone.

    Attributes
    ----------
    ranks : tuple of int
        Global ranks of the dead processes.
    pid : int or None
        Process id (of the first dead rank).
    exitcode : int or None
        Exit status when the process exited normally.
    signal : int or None
        Signal number when the process was killed by a signal.
    reason : str
        Free text, e.g. ``"no heartbeat for 5.0 s"``.
    """

    def __init__(self, ranks=(), pid=None, exitcode=None, signal=None, reason: str = "") -> None:
        super().__init__(ranks, pid, exitcode, signal, reason)
        self.ranks = tuple(ranks)
        self.pid = pid
        self.exitcode = exitcode
        self.signal = signal
        self.reason = reason

    def __str__(self) -> str:
        if self.ranks:
            label = "rank" if len(self.ranks) == 1 else "ranks"
            text = f"process of {label} {', '.join(map(str, self.ranks))}"
        else:  # a peer known by its address only (an actor calling another actor)
            text = "a peer process"
        if self.pid is not None:
            text += f" (pid {self.pid})"
        text += " died"
        if self.signal is not None:
            import signal as _signal

            try:
                name = _signal.Signals(self.signal).name
            except ValueError:
                name = str(self.signal)
            text += f": killed by signal {self.signal} ({name})"
        elif self.exitcode is not None:
            text += f": exit code {self.exitcode}"
        if self.reason:
            text += f" ({self.reason})"
        return text


class MeshStoppedError(SupervisionError):
    """A message was sent to a mesh that has been stopped."""


class BootstrapError(SupervisionError):
    """Processes failed to start or to join the mesh (e.g. missing ranks under mpirun)."""


class TransportError(MeshArrayError, ConnectionError):
    """Base class of connection-level errors."""


class ClosedTransportError(TransportError):
    """The connection was closed by this side; using it is a programming error."""


class BrokenTransportError(TransportError):
    """The peer or the network broke the connection; the cause is chained."""


class BusyTransportError(TransportError):
    """Concurrent misuse of a connection that allows one user at a time."""


class BackpressureError(TransportError):
    """Too many calls to one peer are waiting for their replies (``MESHARRAY_MAX_PENDING``).

    Raised instead of waiting when ``MESHARRAY_PENDING_FULL=raise``; by default
    a caller over the bound waits until replies come back.
    """


class AuthenticationError(TransportError):
    """The peer failed the HMAC challenge on the mesh secret."""


class FrameError(TransportError):
    """A malformed or oversized frame; the connection is dropped before allocation."""


class MeshFailure:
    """What an owner's ``__supervise__(self, failure)`` hook sees when a mesh fails.

    Attributes
    ----------
    mesh_name : str
        Name of the actor mesh (or ``"procs"`` for the process mesh).
    crashed_ranks : tuple of int
        Global ranks that failed.
    error : BaseException
        The error (usually :class:`ActorDiedError`).
    """

    __slots__ = ("mesh_name", "crashed_ranks", "error", "mesh")

    def __init__(self, mesh_name: str, crashed_ranks, error: BaseException, mesh=None) -> None:
        self.mesh_name = mesh_name
        self.crashed_ranks = tuple(crashed_ranks)
        self.error = error
        self.mesh = mesh

    def report(self) -> str:
        return f"mesh {self.mesh_name!r} failed: crashed_ranks={list(self.crashed_ranks)}: {self.error}"

    def __str__(self) -> str:
        return self.report()

    __repr__ = __str__
