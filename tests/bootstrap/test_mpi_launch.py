"""Whole MPI jobs launched from an ordinary test: how they end, and how fast.

Each test starts ``mpirun`` on a small script with a deadline (the harness
kills the whole tree on expiry), then checks the job's exit status and what
the ranks printed. These are the failure paths a user meets: a rank that
raises, a rank that never joins, a rank that dies, a missing mpi4py.
"""

from __future__ import annotations

import pytest

from tests.support.mpirun import clean_env, mpirun, script

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
        import mesharray as ma
        if MPI.COMM_WORLD.Get_rank() == 1:
            time.sleep(60)
        ma.proc_mesh(timeout=2.0)
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
        import mesharray as ma
        if MPI.COMM_WORLD.Get_rank() == 1:
            time.sleep(60)
        ma.proc_mesh()
    """)
    run = mpirun(2, [path], timeout=60, env=clean_env(MESHARRAY_BOOTSTRAP_TIMEOUT="1.5"))
    assert run.returncode != 0
    assert "did not join the mesh within 1.5 s" in run.stderr


def test_rank_that_dies_before_the_handshake_ends_the_job_nonzero(tmp_path):
    path = script(tmp_path, """
        import os
        from mpi4py import MPI
        import mesharray as ma
        if MPI.COMM_WORLD.Get_rank() == 1:
            os._exit(3)
        ma.proc_mesh(timeout=20.0)
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
        import mesharray as ma
        ma.proc_mesh()
    """)
    env = clean_env()
    env["PYTHONPATH"] = f"{hide}:{env['PYTHONPATH']}"
    run = mpirun(2, [path], timeout=60, env=env)
    assert run.returncode != 0
    assert "BootstrapError: the mpi bootstrap needs mpi4py, which cannot be imported " \
           "(launched by " in run.stderr
    assert "pip install 'mesharray[mpi]'" in run.stderr


# --------------------------------------------------------------------------- whole scripts


_TRAIN = """
    import os, sys
    import numpy as np
    import mesharray as ma

    class Counter(ma.Actor):
        def __init__(self, start):
            self.value = start

        @ma.endpoint
        def incr(self, by=1):
            self.value += by

        @ma.endpoint
        def get(self):
            return self.value

    print(f"before {os.environ.get('OMPI_COMM_WORLD_RANK', 'local')}", flush=True)
    procs = ma.proc_mesh()
    print(f"after {os.environ.get('OMPI_COMM_WORLD_RANK', 'local')} {procs.sizes}", flush=True)
    counters = procs.spawn("counters", Counter, 10)
    counters.incr.broadcast(2)
    print("values", np.asarray(counters.get.call().get()).ravel().tolist(), flush=True)

    def never():
        print("atexit ran", flush=True)

    import atexit
    atexit.register(never)
    try:
        pass
    finally:
        print("finally", flush=True)
"""


def test_the_same_script_runs_unchanged_under_mpirun(tmp_path):
    path = script(tmp_path, _TRAIN, "train.py")
    run = mpirun(3, [path], timeout=60)
    assert run.returncode == 0, run.output
    lines = run.stdout.splitlines()
    # every rank runs the script up to proc_mesh(); only rank 0 goes past it
    assert sorted(line for line in lines if line.startswith("before")) == [
        "before 0", "before 1", "before 2"]
    assert [line for line in lines if line.startswith("after")] == [
        "after 0 {'hosts': 1, 'procs': 3}"]
    assert "values [12, 12, 12]" in lines
    assert lines.count("finally") == 1 and lines.count("atexit ran") == 1


def test_a_worker_rank_dying_later_is_an_actor_died_error(tmp_path):
    # --enable-recovery keeps the other ranks alive after a death (Open MPI 5);
    # without it mpirun ends the whole job, as the bootstrap's docstring says
    path = script(tmp_path, """
        import os, time
        import numpy as np
        import mesharray as ma

        class Victim(ma.Actor):
            @ma.endpoint
            def pid(self):
                return os.getpid()

            @ma.endpoint
            def die(self):
                os._exit(9)

        procs = ma.proc_mesh()
        victims = procs.spawn("victims", Victim)
        last = victims.slice(procs=-1)
        t = time.monotonic()
        try:
            last.die.call_one().get(timeout=20)
        except ma.ActorDiedError as exc:
            print(f"died: {exc} after {time.monotonic() - t:.2f} s", flush=True)
        # the ranks that are left keep working
        alive = np.asarray(victims.slice(procs=slice(0, -1)).pid.call().get()).size
        print("alive", alive, flush=True)
    """)
    from mesharray.bootstrap.mpirun import _launcher_flavor, mpirun_command

    if _launcher_flavor(mpirun_command(1, ["x"])[0]) != "openmpi":
        pytest.skip("--enable-recovery is an Open MPI 5 option")
    run = mpirun(3, [path], timeout=60, extra=["--enable-recovery"])
    assert "died: process of rank 2" in run.stdout, run.output
    assert "alive 2" in run.stdout
    died = next(line for line in run.stdout.splitlines() if line.startswith("died"))
    assert float(died.split(" after ")[1].split()[0]) < 10.0
    # the job as a whole still reports the death, and ends (no MPI_Finalize
    # waiting on the dead rank)
    assert run.returncode != 0
    assert "ranks [2] died during the job; aborting the MPI job" in run.stderr


def test_control_traffic_over_tcp_when_told_the_address(tmp_path):
    # the multi-host path (TCP listeners on a routable address), on one host
    from mesharray.bootstrap.mpi import _route_ip

    try:
        address = _route_ip("192.0.2.1")   # TEST-NET-1: nothing is sent
    except OSError:
        address = "127.0.0.1"
    if address.startswith("127."):
        pytest.skip("no non-loopback interface on this machine")
    path = script(tmp_path, """
        import numpy as np
        import mesharray as ma

        class Rank(ma.Actor):
            @ma.endpoint
            def rank(self):
                return ma.context().global_rank

        procs = ma.proc_mesh()
        print("listener", procs._root.controller.address.split(":")[0], flush=True)
        print("ranks", np.asarray(procs.spawn("r", Rank).rank.call().get()).ravel().tolist())
    """)
    run = mpirun(2, [path], timeout=60, env=clean_env(MESHARRAY_MPI_HOST=address))
    assert run.returncode == 0, run.output
    assert "listener tcp" in run.stdout
    assert "ranks [0, 1]" in run.stdout


def test_plain_mpirun_script_that_raises_in_proc_mesh_ends_the_job(tmp_path):
    # not launched through `python -m mesharray`: the ValueError on rank 0 must
    # still end the job, whose other ranks wait for the controller
    path = script(tmp_path, """
        import mesharray as ma
        ma.proc_mesh(procs=4, timeout=10.0)
        print("unreachable")
    """)
    run = mpirun(3, [path], timeout=60)
    assert run.returncode != 0
    assert run.elapsed < 30, f"the job took {run.elapsed:.1f} s to end"
    assert "proc_mesh(procs=4) does not match the MPI world of 3 ranks" in run.stderr
    assert "unreachable" not in run.stdout
