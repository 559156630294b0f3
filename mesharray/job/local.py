"""``LocalJob``: host agents on this machine, one per host, each its own "host" (loopback address, host id).

Each agent is a ``python -m mesharray host`` process started in a session of
its own (a Ctrl-C at the terminal does not reach it) and not a child of the
script (it outlives it): a ``/bin/sh`` started for it runs it in the
background and exits at once. It listens on a loopback address of its own
(127.0.0.2, 127.0.0.3, ... on Linux, where all of 127/8 is loopback;
127.0.0.1 elsewhere) on a free port, with host id ``MESH-INDEX``, so that
hosts never share memory, as on separate machines. It takes the job's secret
from its environment, writes its address to a ready file (0600) in the job's
directory beside the job file, and logs there. ``kill()`` sends each agent
SIGTERM (its workers die with it), then SIGKILL after 10 s.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

from .. import _proc_stat
from ..errors import BootstrapError
from .base import Job, JobStatus, check_meshes, job_dir

__all__ = ["LocalJob"]


def _loopback(i: int) -> str:
    if not sys.platform.startswith("linux"):
        return "127.0.0.1"
    return f"127.0.{i // 250}.{2 + i % 250}"


def _alive(pid: int, start: int) -> bool:
    st = _proc_stat.state(pid)
    return st is not None and st not in (b"Z", b"X") and (not start or _proc_stat.start_time(pid) == start)


def start_detached(cmd: list[str], env: dict[str, str], log_path: str, cwd: str | None = None) -> int:
    """Run ``cmd`` in a new session, not as a child of this process, its output appended to ``log_path``; its pid."""
    out = subprocess.run(["/bin/sh", "-c", '"$@" </dev/null >>"$0" 2>&1 & echo $!', log_path, *cmd], env=env,
                         start_new_session=True, close_fds=True, cwd=cwd, stdout=subprocess.PIPE, text=True,
                         timeout=30, check=True)
    return int(out.stdout.strip())


class LocalJob(Job):
    """Host agents on this machine: ``LocalJob(meshes={"workers": 2}).state().workers`` is a 2-host mesh.

    Parameters
    ----------
    meshes : dict of str to int
        Mesh name -> number of hosts (one agent each).
    python : str, optional
        The agents' interpreter (and so their processes'; default: this one).

    Examples
    --------
    >>> job = ma.job.LocalJob(meshes={"workers": 2})
    >>> hosts = job.state(cached_path=".mesharray/job.json").workers   # doctest: +SKIP
    >>> hosts.host_ids                                                 # doctest: +SKIP
    ['workers-0', 'workers-1']
    >>> job.kill()                                                     # doctest: +SKIP
    """

    kind = "local"

    def __init__(self, meshes: dict[str, int], *, python: str | None = None) -> None:
        super().__init__(check_meshes(meshes))
        if python is not None and not isinstance(python, str):
            raise TypeError(f"python must be a path (str), got {type(python).__name__}")
        self.python = python

    def _args(self) -> dict[str, Any]:
        return {"meshes": self._meshes, "python": self.python}

    def _dir(self) -> str:
        assert self.path is not None and self._id is not None
        return os.path.join(job_dir(self.path), f"local-{self._id}")

    def _create(self) -> None:
        self._id = secrets.token_hex(4)
        self._secret = secrets.token_hex(32)
        d = self._dir()
        os.makedirs(d, mode=0o700, exist_ok=True)
        env = dict(os.environ, MESHARRAY_SECRET=self._secret, PYTHONUNBUFFERED="1")
        python = self.python or sys.executable
        hosts: dict[str, list[dict[str, Any]]] = {}
        i = 0
        for mesh, n in self._meshes.items():
            hosts[mesh] = []
            for k in range(n):
                hid = f"{mesh}-{k}"
                ready = os.path.join(d, f"{hid}.json")
                cmd = [python, "-m", "mesharray", "host", "--listen", f"tcp://{_loopback(i)}:0", "--host-id", hid,
                       "--ready-file", ready]
                pid = start_detached(cmd, env, os.path.join(d, f"{hid}.log"))
                hosts[mesh].append({"host_id": hid, "ready": ready, "pid": pid,
                                    "start": _proc_stat.start_time(pid)})
                i += 1
        self._alloc = {"dir": d, "hosts": hosts}
        try:
            self._read_ready(time.monotonic() + 60.0)
        except BaseException:
            self._kill()
            raise

    def _read_ready(self, deadline: float) -> None:
        """Wait for every agent's ready file; record its address, pid and start time."""
        import json

        for hs in self._alloc["hosts"].values():
            for h in hs:
                while "url" not in h:
                    try:
                        with open(h["ready"]) as f:
                            info = json.load(f)
                        h.update(url=info["url"], pid=int(info["pid"]),
                                 start=_proc_stat.start_time(int(info["pid"])))
                        break
                    except (OSError, ValueError, KeyError):
                        pass
                    died = not _alive(h["pid"], h["start"])
                    if died or time.monotonic() > deadline:
                        log = os.path.join(self._alloc["dir"], f"{h['host_id']}.log")
                        try:
                            with open(log) as f:
                                tail = f.read()[-2000:]
                        except OSError:
                            tail = ""
                        why = "exited" if died else "did not start within 60 s"
                        raise BootstrapError(f"the local agent {h['host_id']} {why}; its log {log}: "
                                             f"{tail.strip() or '(empty)'}")
                    time.sleep(0.02)

    def _wait_urls(self, deadline: float | None) -> dict[str, list[str]]:
        return {mesh: [h["url"] for h in hs] for mesh, hs in self._alloc["hosts"].items()}

    def _status(self) -> JobStatus:
        hosts, dead = [], []
        for hs in self._alloc.get("hosts", {}).values():
            for h in hs:
                hosts.append((h["host_id"], h.get("url", "")))
                if "pid" not in h or not _alive(h["pid"], h.get("start", 0)):
                    dead.append(f"{h['host_id']} (pid {h.get('pid')})")
        if dead:
            return JobStatus(self.kind, self._id, "dead", f"agents gone: {', '.join(dead)}", hosts)
        return JobStatus(self.kind, self._id, "running", f"{len(hosts)} agents", hosts)

    def _kill(self) -> None:
        live = [(h["pid"], h.get("start", 0)) for hs in self._alloc.get("hosts", {}).values() for h in hs
                if "pid" in h and _alive(h["pid"], h.get("start", 0))]
        for pid, _ in live:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and any(_alive(p, s) for p, s in live):
            time.sleep(0.02)
        for pid, start in live:
            if _alive(pid, start):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        d = self._alloc.get("dir")
        if d:
            shutil.rmtree(d, ignore_errors=True)
