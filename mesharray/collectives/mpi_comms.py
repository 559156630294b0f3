"""mesharray's MPI communicators, for collectives inside the workers of an MPI mesh.

The MPI bootstrap (:mod:`mesharray.bootstrap.mpi`) calls :func:`install` on
every rank once the world has joined; from then on, in any process of that
mesh (inside an actor, or the data plane's MPI collectives):

- :func:`world_comm`: a ``Dup`` of ``COMM_WORLD`` (communicator rank i == global rank i);
- :func:`local_comm`: this host's ranks (``COMM_TYPE_SHARED``);
- :func:`mesh_comm`: a sub-communicator over given ranks, cached per rank tuple;
- :func:`is_active`, :func:`world_rank`, :func:`world_size`.

Outside an MPI mesh they raise :class:`~mesharray.BootstrapError` (and
:func:`is_active` is False). mpi4py is never imported here: the bootstrap
hands its ``MPI`` module to :func:`install`.
"""

from __future__ import annotations

import threading
import zlib
from typing import Any, Iterable

from ..errors import BootstrapError

__all__ = [
    "install",
    "is_active",
    "local_comm",
    "mesh_comm",
    "release",
    "world_comm",
    "world_rank",
    "world_size",
]


class _Comms:
    """mesharray's communicators in this process (one per process, made by :func:`install`)."""

    def __init__(self, MPI: Any, world: Any, local: Any, node_of: tuple[int, ...]) -> None:
        self.MPI = MPI
        self.world = world
        self.local = local
        self.node_of = node_of
        self.rank: int = world.Get_rank()
        self.size: int = world.Get_size()
        self.comms: dict[tuple[int, ...], Any] = {}
        self.lock = threading.Lock()
        self.creating: dict[tuple[int, ...], threading.Lock] = {}

    def free(self) -> None:
        """Drop mesharray's communicators (MPI_Finalize releases them).

        Not ``MPI_Comm_free``: it is collective by the standard, and a member
        that died (under ``mpirun --enable-recovery``) would make it hang.
        """
        with self.lock:
            self.comms.clear()
        self.local = self.world = None


_comms: _Comms | None = None


def _require_state() -> _Comms:
    state = _comms
    if state is None or state.world is None:
        raise BootstrapError(
            "no MPI mesh in this process: MPI communicators of a mesh exist only in the "
            "processes of a mesh made by proc_mesh(bootstrap='mpi') under mpirun"
        )
    return state


def is_active() -> bool:
    """True in a process that is part of a mesh made by the MPI bootstrap.

    Examples
    --------
    >>> from mesharray.collectives.mpi_comms import is_active
    >>> is_active()     # a plain python process
    False
    """
    state = _comms
    return state is not None and state.world is not None


def world_rank() -> int:
    """This process's MPI world rank (= its global rank in the mesh)."""
    return _require_state().rank


def world_size() -> int:
    """The number of ranks of the MPI world (= of the root mesh)."""
    return _require_state().size


def world_comm() -> Any:
    """mesharray's communicator over the whole world (a ``Dup`` of ``COMM_WORLD``).

    Its rank ``i`` is world rank ``i``. Messages on it never match the user's
    messages on ``COMM_WORLD``.

    Examples
    --------
    >>> from mesharray.collectives.mpi_comms import world_comm
    >>> world_comm().allreduce(1)        # doctest: +SKIP
    4
    """
    return _require_state().world


def local_comm() -> Any:
    """mesharray's communicator over this host's ranks (``COMM_TYPE_SHARED`` split)."""
    return _require_state().local


def _normalize_ranks(ranks: Any, size: int) -> tuple[int, ...]:
    if hasattr(ranks, "mesh_shape"):  # a ProcMesh / ActorMesh / MeshArray
        ranks = ranks.mesh_shape
    if hasattr(ranks, "ranks") and callable(ranks.ranks):  # a Shape
        ranks = ranks.ranks()
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable):
        raise TypeError(
            f"ranks must be an iterable of ints, a Shape or a mesh, not {type(ranks).__name__}"
        )
    out = []
    for r in ranks:
        try:
            out.append(int(r.__index__()))
        except AttributeError:
            raise TypeError(f"ranks must be ints; got {type(r).__name__} {r!r}") from None
    if not out:
        raise ValueError("ranks is empty; a communicator needs at least one rank")
    bad = [r for r in out if not 0 <= r < size]
    if bad:
        raise ValueError(f"ranks {bad} are not in the MPI world of size {size}")
    if len(set(out)) != len(out):
        dup = sorted({r for r in out if out.count(r) > 1})
        raise ValueError(f"ranks must be distinct; {dup} appear more than once")
    return tuple(out)


def mesh_comm(ranks: Any = None) -> Any:
    """An MPI communicator over the given mesh ranks, for collectives inside workers.

    Call it in a process of an MPI-bootstrapped mesh (inside an actor, or the
    data plane's MPI collectives). Communicator rank ``i`` is ``ranks[i]``, so
    the order of ``ranks`` is the order of the result (a transposed mesh gives
    its own communicator). Sub-communicators are made with
    ``MPI_Comm_create_group`` — collective over the members only, so a sliced
    mesh never needs the other ranks — and cached per rank tuple for the life
    of the process: the second call is a dictionary lookup.

    Like any MPI collective, the *first* call for a given rank tuple must be
    made by every member, and members that create several communicators must
    create them in the same order.

    Parameters
    ----------
    ranks : iterable of int, Shape, mesh, or None
        The world ranks (a mesh's global ranks), in communicator order; a
        ``Shape`` or a mesh-like object (anything with ``mesh_shape``) uses its
        ranks in row-major order. None means the whole world (:func:`world_comm`).

    Returns
    -------
    mpi4py.MPI.Intracomm
        Owned by mesharray; do not ``Free`` it.

    Raises
    ------
    BootstrapError
        This process is not part of an MPI-bootstrapped mesh.
    TypeError
        ``ranks`` is not made of ints.
    ValueError
        A rank is outside the world, repeated, or this process is not among them.

    Examples
    --------
    Inside an actor of a mesh launched with ``mpirun -n 4``:

    >>> from mesharray.collectives.mpi_comms import mesh_comm
    >>> comm = mesh_comm([1, 3])            # doctest: +SKIP
    >>> comm.allreduce(comm.Get_rank())     # doctest: +SKIP
    1
    """
    state = _require_state()
    if ranks is None:
        return state.world
    key = _normalize_ranks(ranks, state.size)
    if key == tuple(range(state.size)):
        return state.world
    if state.rank not in key:
        raise ValueError(
            f"this process (rank {state.rank}) is not in ranks {list(key)}; only members "
            f"of a communicator can create or use it"
        )
    with state.lock:
        comm = state.comms.get(key)
        if comm is not None:
            return comm
        creating = state.creating.setdefault(key, threading.Lock())
    # Creation blocks until every member joins: hold only this key's lock, so a
    # thread using an already-made communicator is never stuck behind it.
    with creating:
        with state.lock:
            comm = state.comms.get(key)
            if comm is not None:
                return comm
        MPI = state.MPI
        world_group = state.world.Get_group()
        try:
            group = world_group.Incl(list(key))
        finally:
            world_group.Free()
        try:
            # tag: concurrent creations of different groups must not match each
            # other's internal messages; TAG_UB is at least 32767 by the standard
            comm = state.world.Create_group(group, tag=zlib.crc32(repr(key).encode()) % 32768)
        finally:
            group.Free()
        assert comm != MPI.COMM_NULL  # we checked membership above
        _prepare(MPI, comm)
        with state.lock:
            state.comms[key] = comm
            state.creating.pop(key, None)
        return comm


def _prepare(MPI: Any, comm: Any) -> Any:
    """Make mpi4py's hidden per-communicator context now, while every member is here.

    mpi4py's object reductions (``comm.allreduce(obj)``, ``reduce``, ``scan``)
    duplicate the communicator on first use, and do so *holding the GIL*. On
    rank 0 actors run in a thread of the controller's process: a first
    ``allreduce`` there would freeze the controller until the other ranks
    arrive — which may need the controller to send them their call. Creating
    that context together with the communicator, while all members are in the
    creation collective anyway, makes later calls release the GIL as usual.
    """
    make = getattr(MPI, "_commctx_intra", None)
    if make is not None:
        make(comm)
    return comm


def install(MPI: Any) -> tuple[int, ...]:
    """Collective over the world: make mesharray's own communicators in this process.

    Called by the MPI bootstrap on every rank once every rank has joined.
    Returns the topology: for each world rank, the lowest world rank on its
    node (a ``COMM_TYPE_SHARED`` split).
    """
    global _comms
    world = _prepare(MPI, MPI.COMM_WORLD.Dup())
    local = _prepare(MPI, world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank()))
    leader = local.allreduce(world.Get_rank(), op=MPI.MIN)
    node_of = tuple(world.allgather(leader))
    _comms = _Comms(MPI, world, local, node_of)
    return node_of


def release() -> None:
    """Drop mesharray's communicators (before ``MPI_Finalize``, which frees them)."""
    comms = _comms
    if comms is not None:
        comms.free()
