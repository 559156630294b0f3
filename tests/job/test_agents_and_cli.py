"""``AgentsJob`` (agents started by hand) and the ``python -m mesharray job`` command line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import mesharray as ma

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="127.0.0.x addresses: Linux")]

ROOT = str(Path(__file__).resolve().parents[2])
SECRET = "agents-job-test-secret"


def _cli(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ if env is None else env, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "mesharray", *args], cwd=cwd, env=e, capture_output=True,
                          text=True, timeout=60)


class _Agent:
    def __init__(self, ip: str, host_id: str) -> None:
        env = dict(os.environ, MESHARRAY_SECRET=SECRET)
        self.proc = subprocess.Popen([sys.executable, "-m", "mesharray", "host", "--listen", f"tcp://{ip}:0",
                                      "--host-id", host_id], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env=env, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        assert line.startswith("mesharray host listening on "), line
        self.url = line.rsplit(" ", 1)[1]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(15)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def test_agents_job_attaches_reattaches_and_leaves_the_agents_running(workdir, monkeypatch):
    monkeypatch.delenv("MESHARRAY_SECRET", raising=False)
    with pytest.raises(ma.BootstrapError, match="needs the agents' secret"):
        ma.job.AgentsJob(meshes={"workers": ["tcp://127.0.0.1:1"]}).apply()
    agents = [_Agent("127.0.0.31", "a0"), _Agent("127.0.0.32", "a1")]
    try:
        job = ma.job.AgentsJob(meshes={"workers": [a.url for a in agents]}, secret=SECRET)
        hosts = job.state(cached_path="agents.json").workers
        assert hosts.host_ids == ["a0", "a1"] and hosts.addresses == [a.url for a in agents]
        procs = hosts.spawn_procs(per_host={"procs": 1})
        procs.stop()
        hosts.detach()
        # a new process re-attaches with what the job file keeps (no MESHARRAY_SECRET there either)
        env = {k: v for k, v in os.environ.items() if k != "MESHARRAY_SECRET"}
        code = "import mesharray as ma; h = ma.job.load('agents.json').state().workers; print(h.host_ids); h.detach()"
        out = subprocess.run([sys.executable, "-c", code], cwd=workdir, env=dict(env, PYTHONPATH=ROOT),
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.strip() == "['a0', 'a1']", out.stderr[-2000:]
        st = _cli("job", "status", "agents.json", cwd=workdir, env=env)
        assert st.returncode == 0 and "kind:  agents" in st.stdout and "state: running" in st.stdout, st
        # kill forgets the job; the agents are not its to stop
        assert _cli("job", "kill", "agents.json", cwd=workdir).returncode == 0
        assert not (workdir / "agents.json").exists() and all(a.proc.poll() is None for a in agents)
        # an agent gone: the saved job is dead
        job = ma.job.AgentsJob(meshes={"workers": [a.url for a in agents]}, secret=SECRET)
        job.state(cached_path="agents.json").detach()
        agents[1].stop()
        st = _cli("job", "status", "agents.json", cwd=workdir)
        assert st.returncode == 1 and "state: dead" in st.stdout and agents[1].url in st.stdout
        with pytest.raises(ma.BootstrapError, match="is dead: agents not answering"):
            ma.job.load("agents.json").state()
        job.kill()
    finally:
        for a in agents:
            if a.proc.poll() is None:
                a.stop()


def test_job_command_line(workdir):
    usage = _cli("job", cwd=workdir)
    assert usage.returncode == 2 and "usage: python -m mesharray job {status,kill} [PATH]" in usage.stderr
    bad = _cli("job", "frob", cwd=workdir)
    assert bad.returncode == 2 and "unknown arguments ['frob']" in bad.stderr
    assert _cli("job", "kill", cwd=workdir).returncode == 1
    (workdir / "broken.json").write_text("[]")
    st = _cli("job", "status", "broken.json", cwd=workdir)
    assert st.returncode == 1 and "not a mesharray job file" in st.stderr
    assert "job status|kill" in _cli("--help", cwd=workdir).stdout
    # a script named like the subcommand still runs, with `run`
    (workdir / "job").write_text("import sys; print('the script ran', sys.argv[1:])\n")
    ran = _cli("run", "job", "status", cwd=workdir)
    assert ran.returncode == 0 and ran.stdout.strip() == "the script ran ['status']"
