"""Collectives across ranks behind one interface, with three backends.

Public: actors may make and use groups directly (the names in ``__all__``);
the backend modules' other names are internal.

- ``shm`` (:mod:`.shm`): built in; ranks on one host share a segment
  (:class:`ShmCollective`), whose words are drawn in :mod:`._shm_layout`; its
  large allreduces copy straight between the members' buffers
  (:mod:`._single_copy`).
- ``mpi`` (:mod:`.mpi`): mpi4py's buffer API on a communicator, when launched
  under mpirun (:class:`MpiCollective`); :mod:`.mpi_comms` makes mesharray's
  communicators inside the workers of an MPI mesh.
- ``torch`` (:mod:`.torch_dist`): ``torch.distributed`` (gloo on CPU,
  NCCL/RCCL on GPUs) for torch engines (:class:`TorchCollective`).

Across hosts, :mod:`.hier` composes them: shared memory inside a host, and a
pipelined ring between the hosts' leaders over data-plane links (:mod:`.ring`)
for large messages, recursive doubling among the leaders (:mod:`.tree`) for
small ones.
:mod:`._args` holds the argument checks the backends share, so the same mistake
gets the same error.

Every backend offers ``allreduce``, ``reduce``, ``broadcast``, ``allgather``,
``reduce_scatter`` and ``barrier`` with the same signatures (NumPy arrays in
and out for ``shm``/``mpi``; tensors or arrays for ``torch``), reduction ops
``"sum"``, ``"prod"``, ``"min"``, ``"max"``, ``"mean"``. mpi4py and torch are
imported only when their backend is used.

>>> import numpy as np
>>> from mesharray.collectives import new_group, unique_segment_name
>>> g = new_group("shm", name=unique_segment_name(), rank=0, size=1)
>>> g.allreduce(np.ones(2, "float32"), op="max").tolist()
[1.0, 1.0]
>>> g.close()
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from .shm import REDUCE_OPS, ShmCollective, unique_segment_name

__all__ = [
    "BACKENDS",
    "Collective",
    "REDUCE_OPS",
    "ShmCollective",
    "MpiCollective",
    "TorchCollective",
    "new_group",
    "unique_segment_name",
]

BACKENDS = ("shm", "mpi", "torch")


@runtime_checkable
class Collective(Protocol):
    """The interface every collective backend implements."""

    rank: int
    size: int

    def allreduce(self, send: Any, out: Any = None, op: str = "sum") -> Any: ...
    def reduce(self, send: Any, out: Any = None, op: str = "sum", root: int = 0) -> Any: ...
    def broadcast(self, buf: Any, root: int = 0) -> Any: ...
    def allgather(self, send: Any, out: Any = None) -> Any: ...
    def reduce_scatter(self, send: Any, out: Any = None, op: str = "sum") -> Any: ...
    def barrier(self) -> None: ...
    def close(self) -> None: ...


def __getattr__(name: str) -> Any:
    # the mpi and torch backends import their (heavy) packages: load on demand
    if name == "MpiCollective":
        from .mpi import MpiCollective

        return MpiCollective
    if name == "TorchCollective":
        from .torch_dist import TorchCollective

        return TorchCollective
    raise AttributeError(f"module 'mesharray.collectives' has no attribute {name!r}")


def new_group(backend: str, **kwargs: Any) -> Collective:
    """Make a collective group with ``backend`` (``"shm"``, ``"mpi"`` or ``"torch"``).

    Keyword arguments go to the backend's constructor: ``ShmCollective(name,
    rank, size, ...)``, ``MpiCollective(comm)``, ``TorchCollective(group=None)``.

    Examples
    --------
    >>> g = new_group("shm", name=unique_segment_name(), rank=0, size=1)
    >>> g.size
    1
    >>> g.close()
    """
    if backend == "shm":
        return ShmCollective(**kwargs)
    if backend == "mpi":
        from .mpi import MpiCollective

        return MpiCollective(**kwargs)
    if backend in ("torch", "gloo", "nccl", "rccl"):
        from .torch_dist import TorchCollective

        return TorchCollective(**kwargs)
    raise ValueError(f"unknown collective backend {backend!r}; expected one of {BACKENDS}")
