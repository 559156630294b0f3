"""``SlurmJob`` on a real (two-node, one-machine) SLURM cluster: submit, compute, sync, re-attach, status and
kill, a queued job, a lost node, a dead cached job, and the controller running inside its own allocation."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import mesharray as ma
from tests.support.actors import JobProbe

pytestmark = pytest.mark.timeout(180)

HERE = str(Path(__file__).resolve().parent)
ROOT = str(Path(__file__).resolve().parents[2])


class Node(JobProbe):  # (its Buffer endpoints; where and version are its own)
    @ma.endpoint
    def where(self) -> tuple:
        return os.environ.get("MESHARRAY_HOST_ID"), os.environ.get("SLURM_TEST_VAR"), os.getpid()

    @ma.endpoint
    def version(self) -> str:
        import slurm_ws_mod  # only in the synced workspace

        return slurm_ws_mod.VERSION


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE]))


def _cli(*args: str, cwd: Path | str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mesharray", *args], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=90)


@pytest.fixture(scope="module")
def slurm_job(slurm, tmp_path_factory):
    """A 2-node job, submitted once for the module (not exclusive: a core per node stays free for others)."""
    d = tmp_path_factory.mktemp("slurmjob")
    job = ma.job.SlurmJob(meshes={"workers": 2}, exclusive=False, time_limit="00:30:00")
    t = time.monotonic()
    job.state(cached_path=str(d / "job.json"))
    took = time.monotonic() - t
    print(f"SlurmJob submit to attached: {took:.2f} s")
    yield job, d
    job_id = job.id
    job.kill()
    assert job_id not in slurm.live_jobs()


def test_submitted_job_gives_the_nodes_as_hosts_that_compute_sync_and_take_env(slurm_job, slurm_dir, capsys):
    job, _ = slurm_job
    hosts = job.state().workers
    assert hosts.host_ids == ["node1", "node2"]
    assert [a.split("//")[1].rsplit(":", 1)[0] for a in hosts.addresses] == ["127.0.0.2", "127.0.0.3"]
    t = time.monotonic()
    procs = hosts.spawn_procs(per_host={"procs": 2}, env={"SLURM_TEST_VAR": "on every node"})
    with capsys.disabled():
        print(f"\nspawn_procs of 2x2 on SLURM: {time.monotonic() - t:.2f} s")
    try:
        n = procs.spawn("n", Node)
        got = np.asarray(n.where.call().get(timeout=30))
        assert [[got[h, p][0] for p in range(2)] for h in range(2)] == [["node1"] * 2, ["node2"] * 2]
        assert {got[h, p][1] for h in range(2) for p in range(2)} == {"on every node"}
        x = procs.ones((8,)) * procs.rank_array()
        np.testing.assert_array_equal(np.asarray(x.sum(axis="hosts").fetch())[:, 0], [2.0, 4.0])
        assert float(np.asarray(x.sum().fetch())) == 8 * sum(range(4))
        buf = n[0, 0].make_buffer.call_one(1 << 18).get(timeout=30)
        assert n[1, 1].read_buffer.call_one(buf).get(timeout=60) == float(np.arange(1 << 18).sum())
    finally:
        procs.stop()

    # code follows: the tree is copied to every node, the original deleted, then changed and synced again
    proj = slurm_dir / "proj"
    proj.mkdir()
    (proj / "slurm_ws_mod.py").write_text("VERSION = 'one'\n")
    (proj / "big.bin").write_bytes(os.urandom(3 << 20))
    assert hosts.sync_workspace(proj)["node2"]["copied"] == 2
    shutil.rmtree(proj)
    with hosts.spawn_procs(per_host={"procs": 1}) as procs:
        assert list(np.asarray(procs.spawn("n", Node).version.call().get(timeout=30)).ravel()) == ["one", "one"]
    proj.mkdir()
    (proj / "slurm_ws_mod.py").write_text("VERSION = 'two'\n")
    again = hosts.sync_workspace(str(proj))
    assert again["node1"] == {"files": 1, "copied": 1, "bytes": 16, "deleted": 1}
    with hosts.spawn_procs(per_host={"procs": 1}) as procs:
        assert list(np.asarray(procs.spawn("n", Node).version.call().get(timeout=30)).ravel()) == ["two", "two"]
    hosts.detach()


REATTACH = """
import json, time
import mesharray as ma
t = time.monotonic()
job = ma.job.SlurmJob(meshes={"workers": 2}, exclusive=False, time_limit="00:30:00")
hosts = job.state(cached_path=%r).workers
took = time.monotonic() - t
t = time.monotonic()
procs = hosts.spawn_procs(per_host={"procs": 2})
spawn = time.monotonic() - t
print(json.dumps({"id": job.id, "took": took, "spawn": spawn, "hosts": hosts.host_ids}))
procs.stop(); hosts.detach()
"""


def test_a_new_process_reattaches_in_seconds_without_a_new_allocation(slurm_job, slurm_dir, slurm, capsys):
    job, d = slurm_job
    jobs = slurm.jobs()
    out = subprocess.run([sys.executable, "-c", REATTACH % str(d / "job.json")], cwd=slurm_dir, env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["id"] == job.id and got["hosts"] == ["node1", "node2"]
    assert slurm.jobs() == jobs  # nothing submitted
    assert got["took"] < 5, got
    with capsys.disabled():
        print(f"\nre-attach from a new process: {got['took']:.2f} s; spawn_procs 2x2 after it: {got['spawn']:.2f} s")


def test_a_torchrun_script_across_the_nodes_ends_with_torchruns_weights(slurm_job, slurm_dir, torchrun_ddp, capsys):
    job, _ = slurm_job
    hosts = job.state().workers
    try:
        procs = hosts.spawn_procs(per_host={"procs": 1})
        codes = ma.spmd.run(procs, torchrun_ddp.script, args=torchrun_ddp.args)  # GROUP_RANK 0 and 1: node1, node2
        assert np.asarray(codes).tolist() == [[0], [0]]
        procs.stop()
    finally:
        hosts.detach()
    assert torchrun_ddp.digest_of(capsys.readouterr().out) == torchrun_ddp.digest


def test_status_and_a_queued_job_that_times_out_then_is_killed(slurm_job, slurm_dir, capfd):
    job, d = slurm_job
    st = _cli("job", "status", str(d / "job.json"), cwd=slurm_dir)
    assert st.returncode == 0, st.stderr
    assert "kind:  slurm" in st.stdout and f"id:    {job.id}" in st.stdout and "state: running" in st.stdout
    assert "node1 tcp://127.0.0.2:" in st.stdout and "node2 tcp://127.0.0.3:" in st.stdout
    # whole nodes while the module's job holds a core of each: it waits in the queue
    waits = ma.job.SlurmJob(meshes={"workers": 2}, name="waits")
    t = time.monotonic()
    with pytest.raises(ma.BootstrapError, match=r"SLURM job (\d+) is still PENDING \(\w+\) after the timeout"):
        waits.state(cached_path="waits.json", timeout=2)
    assert time.monotonic() - t < 10
    assert f"mesharray: SLURM job {waits.id} PENDING (" in capfd.readouterr().err  # the progress line
    st = _cli("job", "status", "waits.json", cwd=slurm_dir)
    assert st.returncode == 0 and "state: pending" in st.stdout, st
    killed = _cli("job", "kill", "waits.json", cwd=slurm_dir)
    assert killed.returncode == 0, killed.stderr
    st = _cli("job", "status", "waits.json", cwd=slurm_dir)
    assert st.returncode == 1 and "no job file" in st.stderr


def test_a_lost_node_fails_its_ranks_naming_it_and_the_dead_job_is_replaced(slurm_dir, slurm, caplog):
    job = ma.job.SlurmJob(meshes={"workers": 2}, exclusive=False, time_limit="00:30:00")
    hosts = job.state(cached_path="lost.json").workers
    replaced = None
    try:
        procs = hosts.spawn_procs(per_host={"procs": 1})
        n = procs.spawn("n", Node)
        n.where.call().get(timeout=30)
        with open(Path(job._alloc["dir"]) / "node2.json") as f:
            os.kill(int(json.load(f)["pid"]), signal.SIGKILL)  # node2's agent dies
        t = time.monotonic()
        with pytest.raises(ma.ActorDiedError, match="host node2 is lost") as ei:
            while time.monotonic() - t < 10:
                n[1, 0].where.call_one().get(timeout=10)
                time.sleep(0.02)
        assert ei.value.ranks == (1,)
        assert n[0, 0].where.call_one().get(timeout=10)[0] == "node1"
        procs.stop()
        hosts.detach()
        # the next script's cached job: still RUNNING for SLURM, but its agents do not all answer
        replaced = ma.job.SlurmJob(meshes={"workers": 2}, exclusive=False, time_limit="00:30:00")
        with caplog.at_level(logging.WARNING, logger="mesharray.job"):
            again = replaced.state(cached_path="lost.json").workers
        said = [r.getMessage() for r in caplog.records if "is dead" in r.getMessage()]
        assert len(said) == 1 and f"slurm job {job.id} of lost.json" in said[0] and "do not answer" in said[0]
        assert replaced.id != job.id and again.host_ids == ["node1", "node2"]
        assert job.id not in slurm.live_jobs()  # what was left of it was cancelled
        again.detach()
    finally:
        if replaced is not None:
            replaced.kill()
        job.kill()


CONTROLLER = """
import os
import numpy as np
import mesharray as ma
job = ma.job.SlurmJob(meshes={"workers": 2})
hosts = job.state().workers
procs = hosts.spawn_procs(per_host={"procs": 2})
x = procs.ones((4,)) * procs.rank_array()
print("RESULT", job.id, os.environ["SLURM_JOB_ID"], hosts.host_ids, float(np.asarray(x.sum().fetch())), flush=True)
procs.stop()
job.kill()
print("KILLED", job.status().state, flush=True)
"""


def test_the_controller_under_sbatch_uses_its_own_allocation(slurm_dir, slurm):
    (slurm_dir / "ctl.py").write_text(CONTROLLER)
    (slurm_dir / "ctl.sh").write_text(textwrap.dedent(f"""\
        #!/bin/sh
        #SBATCH --nodes=2
        #SBATCH --output={slurm_dir}/ctl-%j.out
        cd {slurm_dir}
        exec {sys.executable} ctl.py
        """))
    before = {j for j, _ in slurm.jobs()}
    out = subprocess.run(["sbatch", "--parsable", "ctl.sh"], cwd=slurm_dir, env=_env(), capture_output=True,
                         text=True, timeout=30, check=True)
    ctl = out.stdout.strip()
    deadline = time.monotonic() + 120
    while ctl in slurm.live_jobs() and time.monotonic() < deadline:
        time.sleep(0.2)
    text = (slurm_dir / f"ctl-{ctl}.out").read_text()
    assert f"RESULT {ctl} {ctl} ['node1', 'node2'] {4.0 * sum(range(4))}" in text, text
    assert "KILLED dead" in text, text
    assert {j for j, _ in slurm.jobs()} - before == {ctl}  # nothing else was submitted
    assert dict(slurm.jobs())[ctl] == "COMPLETED", text
