"""Launcher detection, bootstrap choice and the MPI bootstrap's plain-Python parts.

Nothing here starts MPI: these run in the ordinary (non-mpirun) test session.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from mesharray.bootstrap._detect import Launcher, detect_launcher, resolve_bootstrap
from mesharray.bootstrap.mpi import (
    bootstrap,
    is_active,
    local_comm,
    mesh_comm,
    mesh_layout,
    world_comm,
)
from mesharray.bootstrap.mpirun import mpirun_command
from mesharray.errors import BootstrapError
from tests.support.mpirun import ROOT, clean_env

# --------------------------------------------------------------------------- detection


def test_no_launcher_in_a_plain_process():
    assert detect_launcher({"PATH": "/usr/bin", "HOME": "/root"}) is None


def test_open_mpi_is_detected_with_ranks_and_local_ranks():
    env = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    launcher = detect_launcher(env)
    assert launcher == Launcher("openmpi", 2, 4, 0, 2,
                                ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"))
    assert launcher.describe() == "openmpi: rank 2 of 4 (local 0 of 2)"


def test_mpich_hydra_and_intel_mpi_are_told_apart():
    env = {"PMI_RANK": "1", "PMI_SIZE": "3", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "3"}
    assert detect_launcher(env).name == "mpich"
    assert (detect_launcher(env).rank, detect_launcher(env).size) == (1, 3)
    assert detect_launcher({**env, "I_MPI_ROOT": "/opt/intel/mpi"}).name == "intel-mpi"


def test_pmix_takes_its_size_from_the_slurm_step():
    launcher = detect_launcher({"PMIX_RANK": "5", "SLURM_PROCID": "5", "SLURM_STEP_ID": "0",
                                "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1"})
    assert (launcher.name, launcher.rank, launcher.size, launcher.local_rank) == ("pmix", 5, 8, 1)
    alone = detect_launcher({"PMIX_RANK": "0"})
    assert (alone.name, alone.rank, alone.size) == ("pmix", 0, None)
    assert alone.describe() == "pmix: rank 0 of ?"


def test_srun_step_is_detected_but_an_sbatch_script_is_not():
    step = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "3", "SLURM_STEP_ID": "0",
            "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "3"}
    launcher = detect_launcher(step)
    assert (launcher.name, launcher.rank, launcher.size, launcher.local_rank) == ("slurm", 3, 4, 3)
    batch = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "16"}
    assert detect_launcher(batch) is None


def test_open_mpi_wins_over_inherited_slurm_variables():
    env = {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "1",
           "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8"}
    assert (detect_launcher(env).name, detect_launcher(env).rank) == ("openmpi", 3)


def test_garbled_numbers_read_as_unknown_rather_than_failing():
    launcher = detect_launcher({"OMPI_COMM_WORLD_RANK": "x", "OMPI_COMM_WORLD_SIZE": ""})
    assert (launcher.name, launcher.rank, launcher.size) == ("openmpi", None, None)


def test_detection_reads_os_environ_by_default(monkeypatch):
    for key in list(__import__("os").environ):
        if key.startswith(("OMPI_", "PMI", "SLURM_")):
            monkeypatch.delenv(key)
    assert detect_launcher() is None
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv("PMI_SIZE", "2")
    assert detect_launcher().name == "mpich"


# --------------------------------------------------------------------------- bootstrap choice


def test_auto_picks_mpi_under_a_launcher_and_local_otherwise():
    assert resolve_bootstrap("auto", {"OMPI_COMM_WORLD_SIZE": "2"}) == "mpi"
    assert resolve_bootstrap(None, {}) == "local"
    assert resolve_bootstrap("local", {"OMPI_COMM_WORLD_SIZE": "2"}) == "local"
    assert resolve_bootstrap("mpi", {}) == "mpi"


def test_mesharray_bootstrap_variable_overrides_auto():
    env = {"OMPI_COMM_WORLD_SIZE": "2", "MESHARRAY_BOOTSTRAP": "local"}
    assert resolve_bootstrap("auto", env) == "local"
    assert resolve_bootstrap("auto", {"MESHARRAY_BOOTSTRAP": "MPI"}) == "mpi"
    assert resolve_bootstrap("auto", {"MESHARRAY_BOOTSTRAP": "auto"}) == "local"
    # an explicit argument is what the user asked for: the variable does not override it
    assert resolve_bootstrap("mpi", {"MESHARRAY_BOOTSTRAP": "local"}) == "mpi"


def test_bad_bootstrap_names_and_types_are_rejected():
    with pytest.raises(ValueError, match=r"unknown bootstrap 'slurm'; expected one of"):
        resolve_bootstrap("slurm", {})
    with pytest.raises(TypeError, match="bootstrap must be a str, not int"):
        resolve_bootstrap(1, {})
    with pytest.raises(ValueError, match=r"MESHARRAY_BOOTSTRAP='k9s' is not a bootstrap"):
        resolve_bootstrap("auto", {"MESHARRAY_BOOTSTRAP": "k9s"})


# --------------------------------------------------------------------------- topology


@pytest.mark.parametrize(
    "node_of, expected",
    [
        ([0], (("hosts", "procs"), (1, 1), (0,))),
        ([0, 0, 0, 0], (("hosts", "procs"), (1, 4), (0, 1, 2, 3))),
        ([0, 0, 2, 2], (("hosts", "procs"), (2, 2), (0, 1, 2, 3))),
        # round-robin (--map-by node): hosts still rows, ranks are not contiguous
        ([0, 1, 0, 1, 0, 1], (("hosts", "procs"), (2, 3), (0, 2, 4, 1, 3, 5))),
        ([0, 0, 0, 3], (("procs",), (4,), (0, 1, 2, 3))),
        ([0, 1, 1], (("procs",), (3,), (0, 1, 2))),
    ],
)
def test_mesh_layout_is_hosts_by_procs_when_hosts_are_even(node_of, expected):
    assert mesh_layout(node_of) == expected


def test_mesh_layout_needs_a_rank():
    with pytest.raises(ValueError, match="at least one rank"):
        mesh_layout([])


# --------------------------------------------------------------------------- outside a mesh


def test_communicators_outside_an_mpi_mesh_say_why():
    assert is_active() is False
    for get in (world_comm, local_comm, lambda: mesh_comm([0])):
        with pytest.raises(BootstrapError, match=r"no MPI mesh in this process.*bootstrap='mpi'"):
            get()


def test_bootstrap_validates_arguments_before_touching_mpi(monkeypatch):
    monkeypatch.delenv("MESHARRAY_BOOTSTRAP_TIMEOUT", raising=False)
    with pytest.raises(ValueError, match="timeout must be > 0 seconds; got 0"):
        bootstrap(timeout=0)
    with pytest.raises(TypeError, match="timeout must be a number of seconds, not str"):
        bootstrap(timeout="5")
    with pytest.raises(TypeError, match="procs must be an int, not float"):
        bootstrap(procs=2.0)
    monkeypatch.setenv("MESHARRAY_BOOTSTRAP_TIMEOUT", "soon")
    with pytest.raises(ValueError, match=r"MESHARRAY_BOOTSTRAP_TIMEOUT must be a number.*'soon'"):
        bootstrap()


def test_mpirun_command_adds_what_open_mpi_needs():
    from mesharray.bootstrap.mpirun import find_mpirun

    if find_mpirun() is None:
        pytest.skip("no mpirun beside python or on PATH (pip install 'mesharray[mpi]')")
    cmd = mpirun_command(3, ["python", "x.py"], extra=["--enable-recovery"])
    assert cmd[-5:] == ["--enable-recovery", "-n", "3", "python", "x.py"]
    from mesharray.bootstrap.mpirun import _launcher_flavor

    if _launcher_flavor(cmd[0]) == "openmpi":
        assert "--oversubscribe" in cmd
        assert ("--allow-run-as-root" in cmd) == (__import__("os").geteuid() == 0)
        assert "--oversubscribe" not in mpirun_command(1, ["x"], oversubscribe=False)


def test_find_mpirun_honours_the_mpirun_variable(monkeypatch):
    from mesharray.bootstrap.mpirun import find_mpirun

    monkeypatch.setenv("MPIRUN", "/opt/mpi/bin/mpiexec")
    assert find_mpirun() == "/opt/mpi/bin/mpiexec"
    # a launcher that is not Open MPI gets no Open MPI options
    cmd = mpirun_command(2, ["python"], mpirun="/bin/true")
    assert cmd == ["/bin/true", "-n", "2", "python"]


def test_mpirun_command_rejects_bad_counts():
    with pytest.raises(ValueError, match="n must be >= 1; got 0"):
        mpirun_command(0, ["python"])
    with pytest.raises(TypeError, match="n must be an int, not str"):
        mpirun_command("2", ["python"])


# --------------------------------------------------------------------------- optional mpi4py


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=clean_env(**env),
                          capture_output=True, text=True, timeout=60)


def test_import_mesharray_never_imports_mpi4py():
    out = _python(
        "import sys, mesharray, mesharray.bootstrap.mpi, mesharray.bootstrap.mpirun, mesharray.bootstrap._detect, "
        "mesharray.__main__\n"
        "mesharray.bootstrap._detect.resolve_bootstrap('auto')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mpi4py', 'torch', 'ucxx')))",
        OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="2",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_missing_mpi4py_under_a_launcher_names_the_extra():
    # sys.modules[name] = None makes every `import mpi4py` fail, as if not installed
    out = _python(
        "import sys; sys.modules['mpi4py'] = None\n"
        "from mesharray.bootstrap.mpi import import_mpi\n"
        "import_mpi()",
        OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="2",
    )
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("mesharray.errors.BootstrapError: the mpi bootstrap needs mpi4py")
    assert "launched by openmpi: rank 1 of 2" in last
    assert "pip install 'mesharray[mpi]'" in last


def test_controller_listens_on_loopback_only_when_every_rank_is_local(monkeypatch):
    import socket

    from mesharray.bootstrap import mpi

    monkeypatch.delenv("MESHARRAY_MPI_HOST", raising=False)
    monkeypatch.setattr(socket, "gethostname", lambda: "node-a")
    assert mpi._listen_host(["node-a", "node-a"]) == "127.0.0.1"
    monkeypatch.setenv("MESHARRAY_MPI_HOST", "10.1.2.3")
    assert mpi._listen_host(["node-a", "node-b"]) == "10.1.2.3"
    monkeypatch.delenv("MESHARRAY_MPI_HOST")

    def resolve(name):
        if name == "node-a":
            return "127.0.1.1"      # what /etc/hosts says on many clusters
        raise socket.gaierror(f"unknown host {name}")

    monkeypatch.setattr(socket, "gethostbyname", resolve)
    with pytest.raises(BootstrapError, match=r"cannot find an address of 'node-a' that ranks on "
                                             r"\['node-b'\] can reach.*MESHARRAY_MPI_HOST"):
        mpi._listen_host(["node-a", "node-b"])
