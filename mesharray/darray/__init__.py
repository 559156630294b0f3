"""Distributed arrays: ``MeshArray`` storage whose blocks live in the workers.

The package sits above process meshes (``ProcMesh`` never imports it) and is
built of:

- :mod:`~mesharray.darray.instructions`: the instruction schema both sides share;
- :mod:`~mesharray.darray.worker`: the worker's block store and the executor
  (the system actor ``DataActor``);
- :mod:`~mesharray.darray.context`: the controller's per-mesh context (system
  actors, block ids, references and frees, the command buffer that queues ops
  and sends them as one program per rank, the waits);
- :mod:`~mesharray.darray.storage`: ``DistributedStorage``, which plans each
  ``MeshArray`` operation into a program (reductions through
  :func:`~mesharray.reduction_plan`);
- :mod:`~mesharray.darray.factory`: making arrays (``ProcMesh.zeros`` and
  friends run these) and the collectives over mesh dims;
- :mod:`~mesharray.darray.blockfn`: functions run on each rank's blocks (NumPy's
  ``__array_function__``, torch's ``__torch_function__``, torch attributes);
- :mod:`~mesharray.darray.placement`: where an op runs (the ranks of each result
  position, holders of copies) and blocks moved there first;
- :mod:`~mesharray.darray.dispatch`: recipes, an op of a signature seen before
  repeated without planning it again;
- :mod:`~mesharray.darray.function`: ``ma.function``, a step captured once and
  replayed as one message per rank;
- :mod:`~mesharray.darray.autograd` and :mod:`~mesharray.darray.backward`:
  autograd through the ops that cross ranks (mesh nodes, and their reverse pass);
- :mod:`~mesharray.darray.overlap`: the worker's buckets, gradient reductions
  started while ``backward()`` runs.

Importing this package installs the factory into :mod:`mesharray.proc`
(``import mesharray`` does so on the first use of a process mesh), and names
its worker side among the modules zygotes import before they fork
(:data:`mesharray.bootstrap.local.PRELOAD`).
"""

from __future__ import annotations

from .. import proc as _proc
from ..bootstrap import local as _local
from . import factory
from .context import DataContext, data_context
from .factory import all_to_all, allgather, broadcast_from, reduce_scatter
from .storage import DistributedStorage
from .worker import local_block

__all__ = [
    "DataContext",
    "DistributedStorage",
    "all_to_all",
    "allgather",
    "broadcast_from",
    "data_context",
    "local_block",
    "reduce_scatter",
]

_proc.install_array_factory(factory)
if __name__ + ".worker" not in _local.PRELOAD:  # (zygotes import the worker side once, before they fork)
    _local.PRELOAD.append(__name__ + ".worker")
