"""Whole MPI jobs launched from an ordinary test: how they end, and how fast.

Each test starts ``mpirun`` on a small script with a deadline (the harness
kills the whole tree on expiry), then checks the job's exit status and what
the ranks printed. These are the failure paths a user meets: a rank that
raises, a rank that never joins, a rank that dies, a missing mpi4py.
"""

from __future__ import annotations

import pytest

from _mpirun_harness import clean_env, mpirun, script

pytestmark = pytest.mark.timeout(120)


def test_exception_on_rank_1_aborts_the_whole_job_quickly(tmp_path):
    path = script(tmp_path, """
        import time
        from mpi4py import MPI
        if MPI.COMM_WORLD.Get_rank() == 1:
            raise ZeroDivisionError("rank 1 failed on purpose")
        time.sleep(60)          # without the abort, ranks 0 and 2 would wait here
    """)
    run = mpirun(3, ["-m", "mesharray", path], timeout=60)
    assert run.returncode != 0
    assert run.elapsed < 30, f"the job took {run.elapsed:.1f} s to end"
    assert "ZeroDivisionError: rank 1 failed on purpose" in run.stderr
    assert 'script.py", line 5' in run.stderr   # the user's frame is in the traceback


def test_nonzero_sys_exit_on_one_rank_aborts_the_job(tmp_path):
    path = script(tmp_path, """
        import sys, time
        from mpi4py import MPI
        if MPI.COMM_WORLD.Get_rank() == 1:
            sys.exit(4)
        time.sleep(60)
    """)
    run = mpirun(2, ["-m", "mesharray", path], timeout=60)
    assert run.returncode != 0
    assert run.elapsed < 30


def test_a_script_that_succeeds_exits_zero_on_every_rank(tmp_path):
    path = script(tmp_path, """
        import sys
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        total = comm.allreduce(comm.Get_rank())
        print(f"rank {comm.Get_rank()} argv={sys.argv[1:]} total={total}")
    """)
    run = mpirun(2, ["-m", "mesharray", path, "a", "b"], timeout=60)
    assert run.returncode == 0, run.output
    assert sorted(line for line in run.stdout.splitlines() if line.startswith("rank")) == [
        "rank 0 argv=['a', 'b'] total=1",
        "rank 1 argv=['a', 'b'] total=1",
    ]


def test_rank_that_never_joins_gives_bootstrap_error_and_nonzero_exit(tmp_path):
    # rank 1 is alive but never reaches proc_mesh(): the launcher cannot see
    # anything wrong, only the controller's deadline can
    path = script(tmp_path, """
        import time
        from mpi4py import MPI
        from mesharray.bootstrap.mpi import bootstrap
        if MPI.COMM_WORLD.Get_rank() == 1:
            time.sleep(60)
        bootstrap(timeout=2.0)
        print("unreachable")
    """)
    run = mpirun(3, [path], timeout=60)
    assert run.returncode != 0
    assert run.elapsed < 30, f"the job took {run.elapsed:.1f} s to end"
    assert "mesharray.errors.BootstrapError: ranks [1] of the MPI world of 3 did not join " \
           "the mesh within 2 s" in run.stderr
    assert "ranks [0, 2] joined" in run.stderr
    assert "unreachable" not in run.stdout


def test_bootstrap_timeout_comes_from_the_environment(tmp_path):
    path = script(tmp_path, """
        import time
        from mpi4py import MPI
        from mesharray.bootstrap.mpi import bootstrap
        if MPI.COMM_WORLD.Get_rank() == 1:
            time.sleep(60)
        bootstrap()
    """)
    run = mpirun(2, [path], timeout=60, env=clean_env(MESHARRAY_BOOTSTRAP_TIMEOUT="1.5"))
    assert run.returncode != 0
    assert "did not join the mesh within 1.5 s" in run.stderr


def test_rank_that_dies_before_the_handshake_ends_the_job_nonzero(tmp_path):
    path = script(tmp_path, """
        import os
        from mpi4py import MPI
        from mesharray.bootstrap.mpi import bootstrap
        if MPI.COMM_WORLD.Get_rank() == 1:
            os._exit(3)
        bootstrap(timeout=20.0)
    """)
    run = mpirun(2, [path], timeout=60)
    assert run.returncode != 0
    # the launcher notices the death at once; nobody waits for the 20 s deadline
    assert run.elapsed < 15, f"the job took {run.elapsed:.1f} s to end"


def test_missing_mpi4py_under_mpirun_names_the_extra(tmp_path):
    # a sitecustomize that hides mpi4py in every rank, as if it were not installed
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['mpi4py'] = None\n")
    path = script(tmp_path, """
        from mesharray.bootstrap.mpi import bootstrap
        bootstrap()
    """)
    env = clean_env()
    env["PYTHONPATH"] = f"{hide}:{env['PYTHONPATH']}"
    run = mpirun(2, [path], timeout=60, env=env)
    assert run.returncode != 0
    assert "BootstrapError: the mpi bootstrap needs mpi4py, which cannot be imported " \
           "(launched by " in run.stderr
    assert "pip install 'mesharray[mpi]'" in run.stderr
