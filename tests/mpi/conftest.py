"""How tests/mpi run: the same pytest command on every rank of an MPI job.

``mpirun -n N python -m pytest tests/mpi`` starts pytest on every rank. While
pytest configures itself, this conftest calls the MPI bootstrap:

* ranks 1..N-1 become workers right there and never come back — they run no
  test and print nothing of pytest's; they serve until rank 0's pytest ends,
  then finalize MPI and exit 0;
* rank 0 gets the MPI world as a ProcMesh and runs every test as the
  controller; its exit status (pytest's) is the job's.

So the tests are ordinary single-controller tests over the ``world`` fixture,
written to pass at any rank count (``mpirun -n 1``, ``-n 2``, ``-n 4``).
Outside a launcher they are skipped: run them with ``make test-mpi``.
"""

from __future__ import annotations

import pytest

from mesharray.bootstrap._detect import detect_launcher

UNDER_MPI = detect_launcher() is not None

_world = None


def pytest_configure(config):
    global _world
    if not UNDER_MPI:
        return
    import mesharray as ma

    # ranks 1..N-1 never return from this call
    _world = ma.proc_mesh(bootstrap="mpi")


def pytest_unconfigure(config):
    global _world
    if _world is not None:
        # stop the workers while pytest is still here to report a hang
        _world.stop()
        _world = None


def pytest_collection_modifyitems(config, items):
    if UNDER_MPI:
        return
    skip = pytest.mark.skip(reason="tests/mpi run under mpirun on every rank: make test-mpi")
    for item in items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def world():
    """The MPI world as a ProcMesh (rank 0 is this process)."""
    return _world


@pytest.fixture(scope="session")
def mpi_size():
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_size()
