"""Bootstraps: how the processes of a ProcMesh are started or found.

``local`` spawns worker processes on this host (the default); ``mpi`` adopts the
world of an ``mpirun``/``mpiexec``/``srun`` launch through mpi4py. Which one
``proc_mesh(bootstrap="auto")`` uses is decided by
:func:`mesharray.bootstrap._detect.resolve_bootstrap` from the environment alone.
"""

__all__: list[str] = []
