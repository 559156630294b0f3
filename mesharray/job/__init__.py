"""``ma.job``: allocations of hosts that outlive the script — on this machine, on SLURM, on Kubernetes, on your machines.

A job is a specification (``LocalJob(meshes={"workers": 2})``) and, once
applied, an allocation: host agents that serve one controller at a time.
``job.state(cached_path=P)`` gives one :class:`~mesharray.HostMesh` per mesh
(``job.state().workers``) and writes the job file ``P`` (JSON, mode 0600);
the next script's ``state(cached_path=P)`` re-attaches to the same allocation
in seconds instead of queueing again. ``hosts.detach()`` leaves the
allocation to the next controller; ``job.kill()`` (or ``python -m mesharray
job kill``) ends it.

>>> import mesharray as ma
>>> sorted(ma.job.kinds())
['agents', 'kubernetes', 'local', 'slurm']

Modules:

- :mod:`.base` — :class:`Job` (apply, state, kill, status, dump), :class:`JobState`,
  :class:`JobStatus`, :func:`load`, the job file.
- :mod:`.local` — :class:`LocalJob`: agents on this machine (loopback addresses, own sessions).
- :mod:`.agents` — :class:`AgentsJob`: agents started by someone else, by address.
- :mod:`.slurm` — :class:`SlurmJob`: one agent per node of a SLURM job (or of the allocation it runs in).
- :mod:`.kubernetes` — :class:`KubernetesJob`: an Indexed Job of pods per mesh (over ``ma.k8s``).
- :mod:`.cli` — ``python -m mesharray job status|kill [PATH]``.
"""

from __future__ import annotations

from .agents import AgentsJob
from .base import DEFAULT_PATH, Job, JobState, JobStatus, kinds, load
from .kubernetes import KubernetesJob
from .local import LocalJob
from .slurm import SlurmJob

__all__ = ["Job", "JobState", "JobStatus", "LocalJob", "AgentsJob", "SlurmJob", "KubernetesJob", "load",
           "kinds", "DEFAULT_PATH"]
