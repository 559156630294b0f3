"""``LocalJob``: agents on this machine that outlive the script; the job file; re-attach; status and kill."""

from __future__ import annotations

import json
import logging
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from job_util import processes_naming

import mesharray as ma
from tests.support.actors import JobProbe as Probe
from tests.support.procs import gone

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="127.0.0.x addresses: Linux")]

HERE = str(Path(__file__).resolve().parent)
ROOT = str(Path(__file__).resolve().parents[2])


def _python(code: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE]))
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "mesharray", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=60)


def _agent_pids(job) -> list[int]:
    return [h["pid"] for hs in job._alloc["hosts"].values() for h in hs]


REATTACH = """
import json, time
import mesharray as ma
t = time.monotonic()
job = ma.job.LocalJob(meshes={"workers": 2})
hosts = job.state(cached_path=".mesharray/job.json").workers
took = time.monotonic() - t
procs = hosts.spawn_procs(per_host={"procs": 1})
from tests.support.actors import JobProbe as Probe
import numpy as np
ids = [v[0] for v in np.asarray(procs.spawn("p", Probe).where.call().get(timeout=30)).ravel()]
print(json.dumps({"id": job.id, "took": took, "ids": ids}))
procs.stop(); hosts.detach()
"""


def test_a_local_job_outlives_its_script_and_is_found_again(workdir):
    job = ma.job.LocalJob(meshes={"workers": 2})
    hosts = job.state(cached_path=".mesharray/job.json").workers
    path = workdir / ".mesharray" / "job.json"
    try:
        assert hosts.sizes == {"hosts": 2} and hosts.host_ids == ["workers-0", "workers-1"]
        ips = [a.split("//")[1].rsplit(":", 1)[0] for a in hosts.addresses]
        assert len(set(ips)) == 2 and all(ip.startswith("127.") for ip in ips)
        # the job file: JSON, 0600, in a 0700 directory; the secret is on no command line
        rec = json.loads(path.read_text())
        assert rec["kind"] == "local" and rec["id"] == job.id and rec["args"]["meshes"] == {"workers": 2}
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        agents = _agent_pids(job)
        for pid in agents:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert rec["secret"].encode() not in f.read()
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            # not a child of this script, and in a session of its own (a Ctrl-C here does not reach it)
            assert ppid != os.getpid() and os.getsid(pid) != os.getsid(0) and os.getpgid(pid) != os.getpgid(0)

        procs = hosts.spawn_procs(per_host={"procs": 2}, env={"JOB_TEST_VAR": "set on every host"})
        p = procs.spawn("p", Probe)
        where = p.where.call().get(timeout=30)
        assert [[where[h, i][0] for i in range(2)] for h in range(2)] == [["workers-0"] * 2, ["workers-1"] * 2]
        assert set(np.asarray(p.env.call("JOB_TEST_VAR").get(timeout=30)).ravel()) == {"set on every host"}
        x = procs.ones((4,)) * procs.rank_array()
        assert float(np.asarray(x.sum().fetch())) == 4 * sum(range(4))
        buf = p[0, 0].make_buffer.call_one(1 << 16).get(timeout=30)
        assert p[1, 0].read_buffer.call_one(buf).get(timeout=30) == float(np.arange(1 << 16).sum())

        # while attached here, another controller is refused (the agents serve one at a time)
        busy = _python("import mesharray as ma; ma.job.load('.mesharray/job.json').state()", workdir)
        assert busy.returncode != 0 and "already serves" in busy.stderr, busy.stderr[-2000:]

        procs.stop()
        hosts.detach()
        assert job.status().state == "running"  # detach leaves the allocation

        # a new process re-attaches: same job, same agents, no new allocation
        out = _python(REATTACH, workdir)
        assert out.returncode == 0, out.stderr[-3000:]
        again = json.loads(out.stdout.splitlines()[-1])
        assert again["id"] == job.id and again["ids"] == ["workers-0", "workers-1"]
        assert again["took"] < 5, again
        assert _agent_pids(ma.job.load(path)) == agents and not any(gone(p) for p in agents)

        st = _cli("job", "status", cwd=workdir)
        assert st.returncode == 0, st.stderr
        assert "kind:  local" in st.stdout and f"id:    {job.id}" in st.stdout and "state: running" in st.stdout
        assert "workers-0 tcp://127." in st.stdout and "workers-1 tcp://127." in st.stdout
        # and this process attaches again too (state() after a detach)
        assert job.state().workers.host_ids == ["workers-0", "workers-1"]
        job.state().detach()
    except BaseException:
        job.kill()
        raise
    killed = _cli("job", "kill", ".mesharray/job.json", cwd=workdir)
    assert killed.returncode == 0, killed.stderr
    assert all(gone(p) for p in agents)
    assert not path.exists() and not processes_naming(str(workdir))
    st = _cli("job", "status", cwd=workdir)
    assert st.returncode == 1 and "no job file" in st.stderr
    job.kill()  # the allocation is already gone: nothing to do


def test_a_dead_cached_job_is_reported_and_replaced(workdir, caplog):
    first = ma.job.LocalJob(meshes={"workers": 2})
    first.state(cached_path="jobs/a.json").detach()
    pids = _agent_pids(first)
    os.kill(pids[1], signal.SIGKILL)
    assert _cli("job", "status", "jobs/a.json", cwd=workdir).returncode == 1
    # the saved job re-attaches only to a live allocation
    with pytest.raises(ma.BootstrapError, match=f"the local job {first.id} .* is dead: agents gone: workers-1"):
        ma.job.load("jobs/a.json").state()
    second = ma.job.LocalJob(meshes={"workers": 2})
    with caplog.at_level(logging.WARNING, logger="mesharray.job"):
        hosts = second.state(cached_path="jobs/a.json").workers
    try:
        said = [r.getMessage() for r in caplog.records if "is dead" in r.getMessage()]
        assert len(said) == 1 and first.id in said[0] and "workers-1" in said[0] and "started" in said[0], said
        assert second.id != first.id and hosts.host_ids == ["workers-0", "workers-1"]
        assert gone(pids[0])  # what was left of the dead job was ended
        assert json.loads((workdir / "jobs" / "a.json").read_text())["id"] == second.id
    finally:
        second.kill()


def test_the_job_file_of_a_live_job_is_never_overwritten(workdir, caplog):
    job = ma.job.LocalJob(meshes={"workers": 1})
    job.state()  # the default job file
    try:
        assert (workdir / ".mesharray" / "job.json").exists()
        with pytest.raises(ma.BootstrapError, match=f"holds the running local job {job.id}"):
            ma.job.LocalJob(meshes={"workers": 1}).apply()
        # other arguments under state(cached_path=...): the cached job is ended and replaced
        other = ma.job.LocalJob(meshes={"workers": 1, "extra": 1})
        with caplog.at_level(logging.WARNING, logger="mesharray.job"):
            st = other.state(cached_path=".mesharray/job.json")
        assert st.workers.host_ids == ["workers-0"] and st.extra.host_ids == ["extra-0"]
        assert any("other arguments; ending it" in r.getMessage() for r in caplog.records)
        assert job.status().state == "dead"
        with pytest.raises(AttributeError, match=r"no mesh 'nope'; its meshes are \['extra', 'workers'\]"):
            st.nope
        other.kill()
    finally:
        job.kill()


def test_bad_meshes_are_refused():
    with pytest.raises(TypeError, match="non-empty dict"):
        ma.job.LocalJob(meshes=[2])
    with pytest.raises(ValueError, match="mesh 'workers' must have an int >= 1"):
        ma.job.LocalJob(meshes={"workers": 0})
    with pytest.raises(ValueError, match="mesh name 'detach' must be a Python identifier"):
        ma.job.LocalJob(meshes={"detach": 1})
    with pytest.raises(ValueError, match="bad host agent address"):
        ma.job.AgentsJob(meshes={"workers": ["http://x:1"]})


def test_load_refuses_what_is_not_a_job_file(tmp_path):
    p = tmp_path / "job.json"
    p.write_text("{not json")
    with pytest.raises(ValueError, match="is not a job file"):
        ma.job.load(p)
    p.write_text(json.dumps({"mesharray_job": 1, "kind": "pbs", "args": {}}))
    with pytest.raises(ValueError, match=r"unknown job kind 'pbs'; known kinds are \['agents', 'kubernetes', 'local'"):
        ma.job.load(p)
    with pytest.raises(FileNotFoundError):
        ma.job.load(tmp_path / "none.json")


RACE = """
import mesharray as ma
job = ma.job.LocalJob(meshes={"workers": 1})
try:
    job.state(cached_path="race.json").detach()
except ma.BootstrapError as exc:  # the other script is attached right now
    assert "already serves" in str(exc), exc
print(job.id)
"""


def test_two_scripts_started_together_share_one_allocation(workdir):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE]))
    runs = [subprocess.Popen([sys.executable, "-c", RACE], cwd=workdir, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [r.communicate(timeout=60) for r in runs]
    try:
        assert all(r.returncode == 0 for r in runs), [o[1][-2000:] for o in outs]
        ids = {o[0].strip() for o in outs}
        assert len(ids) == 1 and len(list(workdir.glob("local-*"))) == 1, (ids, list(workdir.iterdir()))
    finally:
        ma.job.load(workdir / "race.json").kill()
