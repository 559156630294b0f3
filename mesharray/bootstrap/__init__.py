"""Bootstraps: how the processes of a mesh are started or found.

Internal: users choose a bootstrap with ``ma.proc_mesh(bootstrap=...)`` (or the
launcher it detects); the modules here are not public API.

- :mod:`.local` — worker processes on this host, forked from a zygote (the default).
- :mod:`.mpi`   — the world of an ``mpirun``-launched script, through mpi4py
  (``proc_mesh(bootstrap="auto")`` picks it when
  :func:`~mesharray.bootstrap._detect.detect_launcher` sees a launcher).

A bootstrap starts (or finds) the workers, each running
:func:`mesharray.runtime.worker.run_worker`, and lets a
:class:`mesharray.runtime.controller.Controller` adopt them; it may give the
controller ``exit_status`` and ``kill`` hooks. Every bootstrap returns a
:class:`~mesharray.bootstrap.launch.Launch` (controller, mesh layout, close),
of which :mod:`mesharray.proc` makes the ``ProcMesh``; no bootstrap imports
``proc``. Internal: users call ``ma.proc_mesh()``.
"""

from ._detect import Launcher, detect_launcher, resolve_bootstrap

__all__ = ["Launcher", "detect_launcher", "launch", "local", "mpi", "resolve_bootstrap"]
