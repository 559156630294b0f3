"""Launch small scripts under mpirun from an ordinary pytest test.

Every launch has a deadline; on expiry the whole process tree is killed and
the test fails with what the ranks printed, so a test can fail but never hang
or leave a rank behind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Variables a launcher sets in its ranks: a launch from inside a launched
# process must not inherit them (nested mpirun gets confused).
_LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "PRTE_", "MPI_LOCAL", "SLURM_", "HYDRA_")


@dataclass
class Launch:
    returncode: int
    stdout: str
    stderr: str
    elapsed: float

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def require_mpi() -> None:
    from mesharray.bootstrap.mpirun import find_mpirun

    if find_mpirun() is None:
        pytest.skip("no mpirun/mpiexec beside python or on PATH (pip install 'mesharray[mpi]')")
    try:
        import importlib.util

        if importlib.util.find_spec("mpi4py") is None:
            raise ImportError
    except ImportError:
        pytest.skip("mpi4py is not installed (pip install 'mesharray[mpi]')")


def _kill_tree(pid: int) -> None:
    import psutil

    try:
        parent = psutil.Process(pid)
        procs = parent.children(recursive=True) + [parent]
    except psutil.Error:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=5)


def mpirun(n: int, argv: Sequence[str], *, timeout: float = 60.0, extra: Sequence[str] = (),
           env: dict[str, str] | None = None) -> Launch:
    """Run ``python argv...`` on ``n`` ranks; return its status and output."""
    require_mpi()
    from mesharray.bootstrap.mpirun import mpirun_command

    cmd = mpirun_command(n, [sys.executable, *argv], extra=extra)
    env = dict(env or clean_env())
    # Open MPI's shared-memory segments outlive jobs that are aborted or
    # killed (which these tests do on purpose): keep them in a directory that
    # is removed afterwards instead of /dev/shm
    shm_dir = tempfile.mkdtemp(prefix="mesharray-mpi-shm-")
    env.setdefault("OMPI_MCA_btl_sm_backing_directory", shm_dir)
    start = time.monotonic()
    try:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            out, err = proc.communicate()
            pytest.fail(f"{' '.join(cmd)} did not finish within {timeout} s\n--- stdout\n{out}\n"
                        f"--- stderr\n{err}")
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    return Launch(proc.returncode, out, err, time.monotonic() - start)


def script(tmp_path: Path, text: str, name: str = "script.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)
