"""mesharray: a single-controller distributed runtime where a mesh of processes is an array.

>>> import mesharray as ma
>>> s = ma.Shape({"hosts": 2, "procs": 4})
>>> s[1, ::2].ranks().tolist()
[4, 6]

Heavy parts (the runtime, engines, MPI) are imported lazily on first use, so
``import mesharray`` never imports torch, mpi4py or UCX (``libucx``, the compiled ``_ucp``).

The public API is this module's namespace (``__all__``). The modules, bottom
to top (``docs/internals.md``, "Layers"):

- :mod:`._core` — compiled (Cython): the :class:`Shape` algebra, index parsing,
  broadcasting, reduction plans, the frame header codec, nogil kernels.
- :mod:`.errors` — the one exception hierarchy.
- :mod:`._platform`, :mod:`._proc_stat` — what differs between operating
  systems; the one ``/proc/<pid>/stat`` parser.
- :mod:`.calls` — arguments that hold MeshArrays, as a template with slots.
- :mod:`.mesh` — :class:`MeshTrait`: indexing, slicing and reshaping for
  every mesh-like object.
- :mod:`.array` — :class:`MeshArray` (its reductions: :mod:`.reductions`);
  :mod:`.storage` — the ``Storage`` protocol behind it and the gathered
  storage; :mod:`.elementwise` — how the operands of an operation line up,
  and which storage runs it; :mod:`.indexing` — an index split into its mesh
  part and its local part.
- :mod:`.transport`, :mod:`.engines`, :mod:`.collectives` — bytes, frames,
  sockets and data planes; tensor engines; collectives across ranks.
- :mod:`.runtime` — the actor runtime: controller, workers, channels, the caller.
- :mod:`.actor` — :class:`Actor`, :func:`endpoint`, :class:`ActorMesh` and the
  adverbs; :mod:`.buffer` — :class:`Buffer`, one-sided reads and writes.
- :mod:`.bootstrap` — how the processes of a mesh are started or found;
  :mod:`.observe` — ``procs.telemetry``.
- :mod:`.proc` — :class:`ProcMesh`, :class:`HostMesh`, :func:`proc_mesh`,
  :func:`attach`, :func:`this_host`; :mod:`.k8s` — ``ma.k8s``, meshes of
  Kubernetes pods; :mod:`.job` — ``ma.job``, allocations that outlive a script
  (local agents, SLURM, Kubernetes, your machines); :mod:`.spmd` — ``ma.spmd``,
  existing torchrun scripts run on a mesh.
- :mod:`.darray` — distributed arrays (blocks in the workers).
- :mod:`.__main__` — ``python -m mesharray``, the command line.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    ActorDiedError,
    ActorError,
    AuthenticationError,
    BackpressureError,
    BootstrapError,
    BrokenTransportError,
    BusyTransportError,
    CaptureError,
    ClosedTransportError,
    DimensionError,
    EngineUnavailableError,
    FrameError,
    InvalidIndexError,
    MeshArrayError,
    MeshFailure,
    MeshIndexError,
    MeshShapeError,
    MeshStoppedError,
    SerializationError,
    SupervisionError,
    TransportError,
)

if TYPE_CHECKING:  # what __getattr__ below returns, for type checkers and editors (keep in sync with _LAZY)
    # ("X as X": an explicit re-export)
    from . import job as job
    from . import k8s as k8s
    from . import spmd as spmd
    from ._core import Shape as Shape
    from ._core import broadcast_shapes as broadcast_shapes
    from ._core import reduction_plan as reduction_plan
    from .actor import Actor as Actor
    from .actor import ActorMesh as ActorMesh
    from .actor import Endpoint as Endpoint
    from .actor import Future as Future
    from .actor import context as context
    from .actor import current_rank as current_rank
    from .actor import current_size as current_size
    from .actor import endpoint as endpoint
    from .array import MeshArray as MeshArray
    from .buffer import Buffer as Buffer
    from .darray import all_to_all as all_to_all
    from .darray import allgather as allgather
    from .darray import broadcast_from as broadcast_from
    from .darray import reduce_scatter as reduce_scatter
    from .darray.function import function as function
    from .mesh import MeshTrait as MeshTrait
    from .proc import HostMesh as HostMesh
    from .proc import ProcMesh as ProcMesh
    from .proc import attach as attach
    from .proc import proc_mesh as proc_mesh
    from .proc import this_host as this_host

__version__ = "0.1.0"

# public name -> module that defines it (imported on first attribute access)
_LAZY = {
    "Shape": "mesharray._core",
    "broadcast_shapes": "mesharray._core",
    "reduction_plan": "mesharray._core",
    "MeshTrait": "mesharray.mesh",
    "MeshArray": "mesharray.array",
    "Actor": "mesharray.actor",
    "ActorMesh": "mesharray.actor",
    "Future": "mesharray.actor",
    "endpoint": "mesharray.actor",
    "context": "mesharray.actor",
    "current_rank": "mesharray.actor",
    "current_size": "mesharray.actor",
    "ProcMesh": "mesharray.proc",
    "proc_mesh": "mesharray.proc",
    "this_host": "mesharray.proc",
    "HostMesh": "mesharray.proc",
    "attach": "mesharray.proc",
    "Endpoint": "mesharray.actor",
    "Buffer": "mesharray.buffer",
    "allgather": "mesharray.darray",
    "broadcast_from": "mesharray.darray",
    "reduce_scatter": "mesharray.darray",
    "all_to_all": "mesharray.darray",
    "function": "mesharray.darray.function",
}

# submodules reached as attributes (``ma.k8s.attach(...)``), imported on first use
_SUBMODULES = {"k8s": "mesharray.k8s", "job": "mesharray.job", "spmd": "mesharray.spmd"}

# Modules whose objects can make distributed arrays (a ProcMesh's zeros, ones, ...):
# the first use of one also loads mesharray.darray, which installs itself into proc
# (it sits above proc, so proc never imports it).
_WIRES_ARRAYS = {"mesharray.proc", "mesharray.actor", "mesharray.array", "mesharray.buffer"}

__all__ = [
    "__version__",
    "ActorDiedError",
    "ActorError",
    "AuthenticationError",
    "BackpressureError",
    "BootstrapError",
    "CaptureError",
    "BrokenTransportError",
    "BusyTransportError",
    "ClosedTransportError",
    "DimensionError",
    "EngineUnavailableError",
    "FrameError",
    "InvalidIndexError",
    "MeshArrayError",
    "MeshFailure",
    "MeshIndexError",
    "MeshShapeError",
    "MeshStoppedError",
    "SerializationError",
    "SupervisionError",
    "TransportError",
    *_LAZY,
    *_SUBMODULES,
]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value = importlib.import_module(_SUBMODULES[name])
        importlib.import_module("mesharray.darray")
        globals()[name] = value
        return value
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mesharray' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    if module in _WIRES_ARRAYS:
        importlib.import_module("mesharray.darray")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
