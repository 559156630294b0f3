"""Bootstraps: how the processes of a mesh are started or found.

Internal: users choose a bootstrap with ``ma.proc_mesh(bootstrap=...)`` (or the
launcher it detects), ``ma.attach``, ``ma.k8s`` or ``ma.job``; the modules here
are not public API.

- :mod:`.launch`  — :class:`~mesharray.bootstrap.launch.Launch`, what every
  bootstrap returns, and the wait for a worker's exit report that the local
  and agent bootstraps share.
- :mod:`.local`   — worker processes on this host, forked from a zygote (the default).
- :mod:`.mpi`     — the world of an ``mpirun``-launched script, through mpi4py:
  what runs inside each rank (the handshake, serving, aborts).
- :mod:`.mpirun`  — the launching side: which ``mpirun``, and the command line
  that starts ``n`` ranks.
- :mod:`._detect` — which launcher started this process, from the environment
  alone (``proc_mesh(bootstrap="auto")`` picks ``mpi`` when it sees one).
- :mod:`.agent`   — host agents (``python -m mesharray host``): one per machine,
  starting workers for one controller at a time.
- :mod:`.remote`  — the controller's side of host agents: attach to them and
  start a process mesh across them (``ma.attach``).
- :mod:`.k8s`     — Kubernetes (a package): manifests, their YAML, the API
  client, pod discovery and the ``k8s manifest`` CLI, below ``ma.k8s``.
- :mod:`.slurm`   — SLURM: the step of one host agent per node, the batch
  script that runs it, and the scheduler's view of a job, below ``ma.job.SlurmJob``.
- :mod:`.workspace` — a controller's directory tree copied to host agents
  (``HostMesh.sync_workspace``): what is copied, and each agent's copy.

A bootstrap starts (or finds) the workers, each running
:func:`mesharray.runtime.worker.run_worker`, and lets a
:class:`mesharray.runtime.controller.Controller` adopt them; it may give the
controller ``exit_status`` and ``kill`` hooks. Every bootstrap returns a
:class:`~mesharray.bootstrap.launch.Launch` (controller, mesh layout, close),
of which :mod:`mesharray.proc` makes the ``ProcMesh``; no bootstrap imports
``proc``.
"""

from ._detect import Launcher, detect_launcher, resolve_bootstrap

__all__ = ["Launcher", "detect_launcher", "launch", "local", "mpi", "resolve_bootstrap"]
