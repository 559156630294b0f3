"""``ma.spmd.run`` on a local mesh and across the two hosts of a ``LocalJob``: the DDP example ends with torchrun's
weights, each rank sees torchrun's environment, the processes are as before afterwards, failures end the run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import mesharray as ma

pytestmark = pytest.mark.timeout(180)

ROOT = str(Path(__file__).resolve().parents[2])
ENVDUMP = str(Path(__file__).resolve().parent / "scripts" / "envdump.py")


class Probe(ma.Actor):
    """What a script could have changed in its process."""

    @ma.endpoint
    def state(self) -> dict:
        import signal

        main = sys.modules["__main__"]
        out = {"environ": dict(os.environ), "argv": list(sys.argv), "path": list(sys.path), "cwd": os.getcwd(),
               "main": (id(main), getattr(main, "__file__", None)), "sigterm": repr(signal.getsignal(signal.SIGTERM)),
               "pg": None}
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_initialized():
            out["pg"] = (id(dist.group.WORLD), dist.get_rank(), dist.get_world_size())
        return out


def _records(d: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in d.glob("rank*.json")}


def test_ddp_on_a_local_mesh_ends_with_torchruns_weights_and_leaves_the_processes_as_before(torchrun_ddp, tmp_path,
                                                                                            capsys):
    procs = ma.proc_mesh(procs=2)
    try:
        # the mesh's own reductions over torch.distributed: a default group exists in every worker already
        x = procs.ones((3,), dtype="float32", engine="torch", collective="torch")
        assert np.asarray(x.sum(axis="procs").fetch()).tolist() == [[2.0] * 3]
        probe = procs.spawn("probe", Probe)
        before = probe.state.call().get(timeout=60)
        assert before[0, 0]["pg"] is not None

        codes = ma.spmd.run(procs, torchrun_ddp.script, args=torchrun_ddp.args)
        assert isinstance(codes, ma.MeshArray) and codes.sizes == {"hosts": 1, "procs": 2}
        assert np.asarray(codes).tolist() == [[0, 0]]

        after = probe.state.call().get(timeout=60)
        for i in range(2):
            b, a = before[0, i], after[0, i]
            assert a == b, {k: (b[k], a[k]) for k in b if a[k] != b[k]}
        # the mesh's group serves its reductions again, and a second run (env dump) starts afresh
        assert np.asarray((x * 2).sum(axis="procs").fetch()).tolist() == [[4.0] * 3]
        codes = ma.spmd.run(procs[:, ::-1], ENVDUMP, [str(tmp_path), "a b"], env={"SPMD_TEST_VAR": "given"})
        assert np.asarray(codes).tolist() == [[0, 0]]
        rec = _records(tmp_path)
        # a view runs in its own order: procs=1 is RANK 0 here
        assert rec[0]["pid"] == procs.pids[1] and rec[1]["pid"] == procs.pids[0]
        for rank in (0, 1):
            env = rec[rank]["env"]
            assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"],
                    env["ROLE_RANK"], env["ROLE_WORLD_SIZE"], env["GROUP_WORLD_SIZE"]) == \
                (str(rank), str(rank), "2", "2", "0", str(rank), "2", "1")
            assert env["SPMD_TEST_VAR"] == "given" and env["MASTER_ADDR"] == "127.0.0.1"
            assert rec[rank]["argv"] == [ENVDUMP, str(tmp_path), "a b"] and rec[rank]["name"] == "__main__"
        assert probe.state.call().get(timeout=60)[0, 0]["environ"] == before[0, 0]["environ"]
    finally:
        procs.stop()
    assert torchrun_ddp.digest_of(capsys.readouterr().out) == torchrun_ddp.digest


def test_exit_codes_and_failures(tmp_path):
    with ma.proc_mesh(procs=2) as procs:
        # sys.exit(3) on rank 0, 0 on rank 1: both ended by themselves, the mesh serves on
        codes = ma.spmd.run(procs, ENVDUMP, [str(tmp_path), "--exit", "3"])
        assert np.asarray(codes).tolist() == [[3, 0]]
        assert procs.spawn("probe", Probe).state.call().get(timeout=30)[0, 1]["argv"] != [ENVDUMP]

        # rank 1 raises while rank 0 sleeps: the error is raised, rank 0 ended, the mesh stopped
        t = time.monotonic()
        with pytest.raises(ma.ActorError) as info:
            ma.spmd.run(procs, ENVDUMP, [str(tmp_path), "--raise", "--sleep", "60"])
        assert time.monotonic() - t < 30
        assert isinstance(info.value.exception, ValueError) and "rank 1 raised on purpose" in str(info.value)
        assert 'envdump.py", line' in info.value.traceback_text
        assert procs.stopped
        with pytest.raises(ma.MeshStoppedError):
            procs.spawn("probe", Probe)

    with ma.proc_mesh(procs=2) as procs:
        # os._exit(5) on rank 1: its status; rank 0 ended (-15, as torchrun's SIGTERM); the mesh stopped
        codes = ma.spmd.run(procs, ENVDUMP, [str(tmp_path), "--os-exit", "5", "--sleep", "60"])
        assert np.asarray(codes).tolist() == [[ma.spmd.ENDED, 5]] and ma.spmd.ENDED == -15
        assert procs.stopped

    with ma.proc_mesh(procs=1) as procs:
        with pytest.raises(ma.ActorError, match="script not found on host"):
            ma.spmd.run(procs, str(tmp_path / "missing.py"))
        with pytest.raises(TypeError, match="args must be a sequence of str"):
            ma.spmd.run(procs, ENVDUMP, args="--exit 3")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LocalJob's 127.0.0.x addresses: Linux")
def test_two_hosts_of_a_local_job_from_the_workspace_and_by_the_cli(torchrun_ddp, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(ENVDUMP, src / "envdump.py")
    shutil.copy(torchrun_ddp.script, src / "ddp_train.py")
    out = tmp_path / "out"
    out.mkdir()
    job = ma.job.LocalJob(meshes={"workers": 2})
    try:
        hosts = job.state(cached_path=".mesharray/job.json").workers
        hosts.sync_workspace(str(src))
        procs = hosts.spawn_procs(per_host={"procs": 1})
        codes = ma.spmd.run(procs, str(src / "envdump.py"), [str(out)])
        assert np.asarray(codes).tolist() == [[0], [0]]
        rec = _records(out)
        for rank in (0, 1):
            env = rec[rank]["env"]
            assert (env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"], env["LOCAL_WORLD_SIZE"], env["WORLD_SIZE"],
                    env["GROUP_WORLD_SIZE"]) == (str(rank), "0", str(rank), "1", "2", "2")
            assert env["OMP_NUM_THREADS"] == os.environ.get("OMP_NUM_THREADS")  # one process per host: torchrun's
            # run from the host's copy of the workspace, not from src/
            assert rec[rank]["file"].endswith("/envdump.py") and not rec[rank]["file"].startswith(str(src))
        assert rec[0]["env"]["MASTER_ADDR"] == rec[1]["env"]["MASTER_ADDR"] == hosts.addresses[0][6:].rsplit(":")[0]
        procs.stop()
        hosts.detach()

        # the CLI on the same job: torchrun's weights across the two hosts
        r = subprocess.run([sys.executable, "-m", "mesharray", "torchrun", "--job", ".mesharray/job.json",
                            "--nnodes", "2", "--nproc-per-node", "1", "--workspace", str(src),
                            str(src / "ddp_train.py"), *torchrun_ddp.args],
                           env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=150)
        assert r.returncode == 0, r.stdout + r.stderr
        assert torchrun_ddp.digest_of(r.stdout) == torchrun_ddp.digest
        assert "[hosts=0] step   0  loss" in r.stdout
        assert job.status().state == "running"  # the CLI detached: the allocation stays
    finally:
        job.kill()
