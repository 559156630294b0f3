"""``python -m mesharray torchrun``: torchrun's flags, the same weights as torchrun, torchrun's environment, a failing
rank, Ctrl-C."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mesharray.spmd.cli import main

pytestmark = pytest.mark.timeout(180)

ROOT = str(Path(__file__).resolve().parents[2])
ENVDUMP = str(Path(__file__).resolve().parent / "scripts" / "envdump.py")


def _cli(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT, SPMD_TEST_VAR="from the shell")
    return subprocess.run([sys.executable, "-m", "mesharray", "torchrun", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, **kw)


def _records(d: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in d.glob("rank*.json")}


@pytest.mark.parametrize("flags, why", [
    (["--node-rank", "1"], "run it once, not once per node"),
    (["--rdzv-backend=c10d", "--rdzv-endpoint", "h:29400"], "there is no rendezvous to configure"),
    (["--rdzv_id", "x"], "there is no rendezvous"),
    (["--nnodes", "1:4"], "elastic membership is not"),
    (["--max-restarts", "3"], "restarts are not"),
    (["--no-python"], "not a Python script"),
    (["--tee", "3"], "output comes to this terminal"),
    (["--nnodes", "2"], "needs hosts: --job PATH"),
    (["--job", "j.json", "--hosts", "tcp://a:1"], "give one"),
    (["--hosts", "tcp://a:1", "--nproc-per-node", "gpu"], "give a number"),
    (["--bogus"], "unrecognized arguments"),
])
def test_flags_it_cannot_honour_are_refused_saying_why(flags, why, capsys):
    assert main([*flags, "train.py"]) == 2
    err = capsys.readouterr().err
    assert why in err and err.startswith("python -m mesharray torchrun: ")


def test_a_missing_script_is_status_2(capsys):
    assert main(["--nproc-per-node", "2", "/nonexistent/train.py"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_ddp_script_ends_with_torchruns_weights(torchrun_ddp):
    r = _cli("--standalone", "--nproc-per-node", "2", "--max-restarts", "0", "--monitor-interval", "1",
             torchrun_ddp.script, *torchrun_ddp.args)
    assert r.returncode == 0, r.stdout + r.stderr
    assert torchrun_ddp.digest_of(r.stdout) == torchrun_ddp.digest
    assert "[procs=0] step   0  loss" in r.stdout  # rank-prefixed, as actors' output


def test_each_rank_sees_torchruns_environment(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    (tmp_path / "t").mkdir()
    (tmp_path / "m").mkdir()
    env = dict(os.environ, SPMD_TEST_VAR="from the shell")
    env.pop("OMP_NUM_THREADS", None)
    r = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", ENVDUMP, str(tmp_path / "t"), "x"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    m = subprocess.run([sys.executable, "-m", "mesharray", "torchrun", "--standalone", "--nproc-per-node", "2",
                        ENVDUMP, str(tmp_path / "m"), "x"], env=dict(env, PYTHONPATH=ROOT), capture_output=True,
                       text=True, timeout=120)
    assert m.returncode == 0, m.stderr
    theirs, ours = _records(tmp_path / "t"), _records(tmp_path / "m")
    assert sorted(theirs) == sorted(ours) == [0, 1]
    # per run (a free port, a fresh id) or how the store is hosted: rank 0 hosts it here, the agent under torchrun
    differ = {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE"}
    for rank in (0, 1):
        t, o = theirs[rank], ours[rank]
        assert {k: v for k, v in o["env"].items() if k not in differ} == \
               {k: v for k, v in t["env"].items() if k not in differ}, rank
        assert o["env"]["OMP_NUM_THREADS"] == "1" and o["env"]["SPMD_TEST_VAR"] == "from the shell"
        assert o["env"]["TORCHELASTIC_USE_AGENT_STORE"] == "False" and o["env"]["MASTER_ADDR"] == "127.0.0.1"
        assert (t["argv"], o["argv"]) == ([ENVDUMP, str(tmp_path / "t"), "x"], [ENVDUMP, str(tmp_path / "m"), "x"])
        assert o["name"] == t["name"] == "__main__" and o["file"] == ENVDUMP
    assert ours[0]["env"]["MASTER_PORT"] == ours[1]["env"]["MASTER_PORT"] != ""
    assert ours[0]["env"]["TORCHELASTIC_RUN_ID"] == ours[1]["env"]["TORCHELASTIC_RUN_ID"]


def test_a_rank_raising_ends_the_others_within_seconds(tmp_path):
    t = time.monotonic()
    r = _cli("--nproc-per-node", "2", ENVDUMP, str(tmp_path), "--raise", "--sleep", "60")
    took = time.monotonic() - t
    assert r.returncode == 1, r.stdout + r.stderr
    assert took < 30, took  # rank 0 sleeps 60 s: it was ended
    lines = r.stderr.splitlines()
    assert "[procs=1] ValueError: rank 1 raised on purpose" in lines
    assert "[procs=1] Traceback (most recent call last):" in lines
    assert not any("mesharray/" in ln for ln in lines if ln.startswith("[procs=1]   File"))  # the script's frames
    assert lines[-1].startswith("mesharray torchrun: rank 1 (procs=1) failed (ValueError: rank 1 raised on purpose); "
                                "ended the 1 rank(s) still running; exit status 1")


def test_exit_status_is_the_failing_ranks(tmp_path):
    r = _cli("--nproc-per-node", "2", ENVDUMP, str(tmp_path), "--exit", "3", "--sleep", "60")
    assert r.returncode == 3, r.stdout + r.stderr
    assert "[procs=0] exited with code 3" in r.stderr.splitlines()


def test_ctrl_c_ends_every_rank(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.Popen([sys.executable, "-m", "mesharray", "torchrun", "--nproc-per-node", "2", ENVDUMP,
                          str(tmp_path), "--sleep", "60"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        deadline = time.monotonic() + 60
        while len(_records(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [rec["pid"] for rec in _records(tmp_path).values()]
        assert len(pids) == 2
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=30)
    finally:
        p.kill()
        p.wait()
    assert p.returncode == 130, err
    assert "interrupted; every rank was ended" in err
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.parametrize("module", ["mesharray.spmd.cli", "mesharray.spmd.launch"])
def test_docstring_examples(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0
