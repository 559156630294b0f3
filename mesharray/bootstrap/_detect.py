"""Which launcher started this process, read from the environment alone.

Detection never imports mpi4py (or anything else heavy): it only looks at the
variables each launcher sets in every process it starts, so ``import mesharray``
and ``ma.proc_mesh()`` stay cheap when no MPI is around.

=====================  =====================================================
launcher               variables that identify it (rank / size)
=====================  =====================================================
Open MPI (``mpirun``)  ``OMPI_COMM_WORLD_RANK`` / ``OMPI_COMM_WORLD_SIZE``
MPICH, Intel MPI       ``PMI_RANK`` / ``PMI_SIZE`` (Hydra's ``mpiexec``);
                       Intel MPI when ``I_MPI_ROOT`` is also set
PMIx (``prun``, srun)  ``PMIX_RANK`` (size from Slurm when present)
Slurm ``srun``         ``SLURM_PROCID`` / ``SLURM_STEP_NUM_TASKS`` (or
                       ``SLURM_NTASKS``), only inside a job *step*
                       (``SLURM_STEP_ID``): an ``sbatch`` script itself is
                       not an MPI launch
=====================  =====================================================

The environment variable ``MESHARRAY_BOOTSTRAP`` (``local``, ``mpi`` or
``auto``) overrides what ``proc_mesh(bootstrap="auto")`` picks.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Mapping

__all__ = [
    "BOOTSTRAPS",
    "Launcher",
    "detect_launcher",
    "mpi4py_available",
    "resolve_bootstrap",
]

#: Names accepted by ``proc_mesh(bootstrap=...)``.
BOOTSTRAPS = ("auto", "local", "mpi")


@dataclass(frozen=True)
class Launcher:
    """What started this process, as far as the environment tells.

    Attributes
    ----------
    name : str
        ``"openmpi"``, ``"mpich"``, ``"intel-mpi"``, ``"pmix"`` or ``"slurm"``.
    rank, size : int or None
        This process's rank and the number of processes started, when the
        launcher says (PMIx alone does not put the size in the environment).
    local_rank, local_size : int or None
        The same on this host, when the launcher says.
    variables : tuple of str
        The environment variables that identified the launcher.
    """

    name: str
    rank: int | None
    size: int | None
    local_rank: int | None = None
    local_size: int | None = None
    variables: tuple[str, ...] = ()

    @property
    def is_mpi(self) -> bool:
        """True: every launcher detected here starts an MPI-capable world."""
        return True

    def describe(self) -> str:
        """One line for humans, e.g. ``openmpi: rank 1 of 4 (local 1 of 4)``."""
        text = f"{self.name}: rank {_fmt(self.rank)} of {_fmt(self.size)}"
        if self.local_rank is not None or self.local_size is not None:
            text += f" (local {_fmt(self.local_rank)} of {_fmt(self.local_size)})"
        return text


def _fmt(value: int | None) -> str:
    return "?" if value is None else str(value)


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name)
        if value is None or value == "":
            continue
        try:
            return int(value)
        except ValueError:
            # a launcher never writes a non-integer here; treat it as absent
            # rather than failing a plain `import` / `proc_mesh()`
            continue
    return None


def detect_launcher(environ: Mapping[str, str] | None = None) -> Launcher | None:
    """Return the MPI-style launcher that started this process, or None.

    Parameters
    ----------
    environ : mapping, optional
        The environment to read; ``os.environ`` by default.

    Returns
    -------
    Launcher or None
        None when no launcher variables are present (a plain ``python``).

    Examples
    --------
    >>> from mesharray.bootstrap._detect import detect_launcher
    >>> detect_launcher({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"}).describe()
    'openmpi: rank 1 of 4'
    >>> detect_launcher({}) is None
    True
    """
    env = os.environ if environ is None else environ
    # Open MPI first: under `sbatch` + `mpirun` the Slurm variables of the batch
    # step are inherited too, and only OMPI_* numbers the ranks right.
    if "OMPI_COMM_WORLD_SIZE" in env or "OMPI_COMM_WORLD_RANK" in env:
        return Launcher(
            "openmpi",
            _int(env, "OMPI_COMM_WORLD_RANK"),
            _int(env, "OMPI_COMM_WORLD_SIZE"),
            _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
            _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"),
            tuple(n for n in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE") if n in env),
        )
    if "PMI_RANK" in env or "PMI_SIZE" in env:
        name = "intel-mpi" if "I_MPI_ROOT" in env or "I_MPI_HYDRA_HOST_FILE" in env else "mpich"
        return Launcher(
            name,
            _int(env, "PMI_RANK"),
            _int(env, "PMI_SIZE"),
            _int(env, "MPI_LOCALRANKID"),
            _int(env, "MPI_LOCALNRANKS"),
            tuple(n for n in ("PMI_RANK", "PMI_SIZE") if n in env),
        )
    in_step = ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env) and "SLURM_PROCID" in env
    if "PMIX_RANK" in env:
        return Launcher(
            "pmix",
            _int(env, "PMIX_RANK"),
            _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") if in_step else None,
            _int(env, "SLURM_LOCALID") if in_step else None,
            None,
            ("PMIX_RANK",),
        )
    if in_step:
        return Launcher(
            "slurm",
            _int(env, "SLURM_PROCID"),
            _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"),
            _int(env, "SLURM_LOCALID"),
            None,
            tuple(n for n in ("SLURM_PROCID", "SLURM_STEP_ID", "SLURM_STEPID") if n in env),
        )
    return None


def mpi4py_available() -> bool:
    """True when mpi4py can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec("mpi4py") is not None
    except (ImportError, ValueError):
        return False


def resolve_bootstrap(bootstrap: str | None = "auto", environ: Mapping[str, str] | None = None) -> str:
    """Turn ``proc_mesh(bootstrap=...)`` into ``"local"`` or ``"mpi"``.

    ``"auto"`` (or None) honours ``MESHARRAY_BOOTSTRAP`` when set, else picks
    ``"mpi"`` when a launcher is detected and ``"local"`` otherwise.

    Parameters
    ----------
    bootstrap : str or None
        One of :data:`BOOTSTRAPS`, or None for ``"auto"``.
    environ : mapping, optional
        The environment to read; ``os.environ`` by default.

    Returns
    -------
    str
        ``"local"`` or ``"mpi"``.

    Examples
    --------
    >>> from mesharray.bootstrap._detect import resolve_bootstrap
    >>> resolve_bootstrap("auto", {"PMI_RANK": "0", "PMI_SIZE": "2"})
    'mpi'
    >>> resolve_bootstrap("auto", {})
    'local'
    """
    env = os.environ if environ is None else environ
    if bootstrap is None:
        bootstrap = "auto"
    if not isinstance(bootstrap, str):
        raise TypeError(f"bootstrap must be a str, not {type(bootstrap).__name__}")
    if bootstrap not in BOOTSTRAPS:
        raise ValueError(f"unknown bootstrap {bootstrap!r}; expected one of {BOOTSTRAPS}")
    if bootstrap == "auto":
        forced = env.get("MESHARRAY_BOOTSTRAP", "").strip().lower()
        if forced and forced != "auto":
            if forced not in BOOTSTRAPS:
                raise ValueError(
                    f"MESHARRAY_BOOTSTRAP={env['MESHARRAY_BOOTSTRAP']!r} is not a bootstrap; "
                    f"expected one of {BOOTSTRAPS}"
                )
            return forced
        return "mpi" if detect_launcher(env) is not None else "local"
    return bootstrap
