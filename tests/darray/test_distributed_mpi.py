"""Distributed arrays under mpirun reduce through MPI (mpi4py's buffer API)."""

import os
import shutil
import subprocess
import sys

import pytest

mpi_boot = pytest.importorskip("mesharray.bootstrap.mpi", reason="needs the MPI bootstrap")
if not hasattr(mpi_boot, "mesh_comm"):
    pytest.skip("the MPI bootstrap has no mesh_comm", allow_module_level=True)
pytest.importorskip("mpi4py")
if shutil.which("mpirun") is None:
    pytest.skip("no mpirun on PATH", allow_module_level=True)


@pytest.mark.timeout(120)
def test_sum_over_procs_uses_mpi_under_mpirun():
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    cmd = ["mpirun", "--oversubscribe", "-n", "3", sys.executable, os.path.join(here, "_mpi_distributed.py")]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=110, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "OK 3 ['MpiCollective']" in out.stdout
