"""``SlurmJob``: one host agent per node of a SLURM job, found through the job's directory.

``apply()`` writes the job's secret (0600) into a directory of its own beside
the job file (``.mesharray/slurm-TOKEN/``), then submits a batch script
(``sbatch --parsable``) whose one step runs an agent on every node
(:mod:`mesharray.bootstrap.slurm`). ``state()`` waits for the job to run
(printing the scheduler's state and reason while it is queued), then for each
node's ready file, and attaches: host ids are the node names, hosts are laid
out in the order SLURM lists the nodes and split among the meshes in the
order they are given.

Run from inside an allocation (``SLURM_JOB_ID`` set: the script under
``sbatch`` or in ``salloc``), ``apply()`` submits nothing: it starts the
same step on the first nodes of that allocation (``srun --overlap``), and
``kill()`` ends that step, not the allocation.

The directory must be on a file system the nodes share with the machine that
submits (as the job's output usually is); the secret never appears on a
command line nor in the job's environment.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import sys
import time
from typing import Any, Sequence

from ..bootstrap import slurm as _slurm
from ..errors import BootstrapError
from .base import Job, JobStatus, check_meshes, job_dir

__all__ = ["SlurmJob"]

#: seconds for every agent to listen once the job runs
READY_TIMEOUT = 120.0


class SlurmJob(Job):
    """A SLURM job of host agents: ``SlurmJob(meshes={"workers": 2}).state().workers`` is a 2-node mesh.

    Parameters
    ----------
    meshes : dict of str to int
        Mesh name -> number of nodes; the job has their sum.
    partition : str, optional
        ``--partition`` (default: the cluster's).
    time_limit : str
        ``--time`` (``HH:MM:SS``, or any form ``sbatch`` takes).
    sbatch_args : sequence of str
        More ``sbatch`` options, e.g. ``("--gpus-per-node=8", "--account=proj")``.
    python : str, optional
        The interpreter on the nodes (default: this one's path, which the
        nodes share on most clusters); mesharray must be importable by it.
    exclusive : bool
        Whole nodes (``--exclusive``): the workers get every core and
        accelerator of a node.
    name : str
        The job's name in ``squeue``.

    Examples
    --------
    >>> job = ma.job.SlurmJob(meshes={"workers": 2}, time_limit="02:00:00")
    >>> hosts = job.state(cached_path=".mesharray/job.json").workers   # doctest: +SKIP
    >>> hosts.host_ids                                                 # doctest: +SKIP
    ['node1', 'node2']
    """

    kind = "slurm"

    def __init__(self, meshes: dict[str, int], partition: str | None = None, time_limit: str | None = "01:00:00",
                 sbatch_args: Sequence[str] = (), python: str | None = None, *, exclusive: bool = True,
                 name: str = "mesharray") -> None:
        super().__init__(check_meshes(meshes))
        if isinstance(sbatch_args, str) or not all(isinstance(a, str) for a in sbatch_args):
            raise TypeError(f"sbatch_args must be a sequence of str, got {sbatch_args!r}")
        for label, v in (("partition", partition), ("time_limit", time_limit), ("python", python)):
            if v is not None and not isinstance(v, str):
                raise TypeError(f"{label} must be a str, got {type(v).__name__}")
        self.partition = partition
        self.time_limit = time_limit
        self.sbatch_args = tuple(sbatch_args)
        self.python = python
        self.exclusive = bool(exclusive)
        self.name = name
        self._step: Any = None  # the srun of the agents' step, when this process started it in an allocation

    def _args(self) -> dict[str, Any]:
        return {"meshes": self._meshes, "partition": self.partition, "time_limit": self.time_limit,
                "sbatch_args": list(self.sbatch_args), "python": self.python, "exclusive": self.exclusive,
                "name": self.name}

    @property
    def nodes(self) -> int:
        return sum(self._meshes.values())

    def _create(self) -> None:
        assert self.path is not None
        secret = secrets.token_hex(32)
        d = os.path.join(job_dir(self.path), f"slurm-{secrets.token_hex(4)}")
        os.makedirs(d, mode=0o700)
        fd = os.open(os.path.join(d, "secret"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secret)
        python = self.python or sys.executable
        try:
            inside = os.environ.get("SLURM_JOB_ID")
            if inside:
                have = _slurm.expand_nodes(os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
                                           or "")
                if len(have) < self.nodes:
                    raise BootstrapError(f"this process runs in SLURM job {inside} of {len(have)} nodes {have}; "
                                         f"the job's meshes {self._meshes} need {self.nodes}")
                nodes = have[:self.nodes]
                self._step = _slurm.start_step(nodes, python, d)
                self._id = inside
                self._alloc = {"dir": d, "in_allocation": True, "nodes": nodes, "srun_pid": self._step.pid}
            else:
                script = _slurm.batch_script(self.nodes, python, d, name=self.name, time_limit=self.time_limit,
                                             partition=self.partition, exclusive=self.exclusive)
                self._id = _slurm.submit(script, self.sbatch_args)
                self._alloc = {"dir": d, "in_allocation": False}
        except BaseException:
            shutil.rmtree(d, ignore_errors=True)
            raise
        self._secret = secret

    # ------------------------------------------------------------------ waiting
    def _output_tail(self) -> str:
        d = self._alloc.get("dir", "")
        for name in (f"slurm-{self._id}.out", f"step-{os.getpid()}.out"):
            try:
                with open(os.path.join(d, name), errors="replace") as f:
                    text = f.read()[-1500:].strip()
                if text:
                    return f"; its output ({os.path.join(d, name)}): {text}"
            except OSError:
                pass
        return ""

    def _wait_nodes(self, deadline: float | None) -> list[str]:
        """The job's nodes once it runs; progress on stderr while it is queued."""
        if self._alloc.get("in_allocation") or self._alloc.get("nodes"):
            return list(self._alloc["nodes"])
        t0 = time.monotonic()
        shown, next_note = "", t0
        while True:
            info = _slurm.job_info(str(self._id))
            state = info["state"] if info else "gone"
            if info is not None and state in _slurm.RUNNING:
                nodes = _slurm.expand_nodes(info["nodes"])
                if len(nodes) != self.nodes:
                    raise BootstrapError(f"SLURM job {self._id} runs on {nodes}, not on {self.nodes} nodes")
                self._alloc["nodes"] = nodes
                if shown:
                    print(f"mesharray: SLURM job {self._id} RUNNING on {info['nodes']} "
                          f"({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
                return nodes
            if info is None or state in _slurm.ENDED:
                why = f"{state} ({info['reason']})" if info else "no longer known to squeue"
                raise BootstrapError(f"SLURM job {self._id} ended before its agents ran: {why}{self._output_tail()}")
            now = time.monotonic()
            said = f"{state} ({info['reason']})"
            if now - t0 >= 1.0 and (said != shown or now >= next_note):
                print(f"mesharray: SLURM job {self._id} {said}, waiting ({now - t0:.0f} s)", file=sys.stderr,
                      flush=True)
                shown, next_note = said, now + 30.0
            if deadline is not None and now >= deadline:
                raise BootstrapError(f"SLURM job {self._id} is still {said} after the timeout; it stays queued "
                                     f"(re-attach later with the same state(cached_path=...), or end it with "
                                     f"`python -m mesharray job kill {self.path}`)")
            time.sleep(0.2 if now - t0 < 5 else 1.0)

    def _wait_urls(self, deadline: float | None) -> dict[str, list[str]]:
        nodes = self._wait_nodes(deadline)
        d = self._alloc["dir"]
        ready_by = time.monotonic() + READY_TIMEOUT
        if deadline is not None:
            ready_by = min(ready_by, max(deadline, time.monotonic() + 5.0))
        urls: dict[str, str] = {}
        while True:
            for n in nodes:
                if n not in urls:
                    info = _slurm.read_ready(d, n)
                    if info is not None and str(info.get("job_id")) == str(self._id):
                        urls[n] = str(info["url"])
                        if info.get("step_id") is not None:
                            self._alloc["step_id"] = str(info["step_id"])
            if len(urls) == len(nodes):
                break
            if self._step is not None and self._step.poll() is not None:
                raise BootstrapError(f"the agents' step in SLURM job {self._id} exited with code "
                                     f"{self._step.returncode}{self._output_tail()}")
            if not self._alloc.get("in_allocation"):
                info = _slurm.job_info(str(self._id))
                if info is None or info["state"] in _slurm.ENDED:
                    state = f"{info['state']} ({info['reason']})" if info else "no longer known to squeue"
                    raise BootstrapError(f"SLURM job {self._id} ended while its agents started: {state}"
                                         f"{self._output_tail()}")
            if time.monotonic() > ready_by:
                missing = [n for n in nodes if n not in urls]
                raise BootstrapError(f"the agents of SLURM job {self._id} on {missing} did not start in time "
                                     f"(no ready file in {d}: is it on a file system the nodes share?)"
                                     f"{self._output_tail()}")
            time.sleep(0.05)
        if self._alloc.get("urls") != urls:
            self._alloc["urls"] = urls
            self._save()
        out: dict[str, list[str]] = {}
        i = 0
        for mesh, n in self._meshes.items():
            out[mesh] = [urls[node] for node in nodes[i:i + n]]
            i += n
        return out

    # ------------------------------------------------------------------ status, kill
    def _status(self) -> JobStatus:
        urls = self._alloc.get("urls") or {}
        hosts = [(n, urls.get(n, "")) for n in self._alloc.get("nodes", [])]
        info = _slurm.job_info(str(self._id))
        if info is None:
            return JobStatus(self.kind, self._id, "dead", "SLURM no longer knows the job (it ended)", hosts)
        said = f"{info['state']} ({info['reason']})"
        if info["state"] in _slurm.ENDED:
            end = f" at {info['end']}" if info.get("end") not in (None, "", "N/A", "Unknown") else ""
            return JobStatus(self.kind, self._id, "dead", f"{said}{end}", hosts)
        if info["state"] not in _slurm.RUNNING:
            return JobStatus(self.kind, self._id, "pending", said, hosts)
        if self._alloc.get("in_allocation"):
            step = self._alloc.get("step_id")
            if step is not None and not _slurm.step_alive(str(self._id), step):
                return JobStatus(self.kind, self._id, "dead", f"the agents' step {self._id}.{step} ended", hosts)
        nodes = self._alloc.get("nodes") or _slurm.expand_nodes(info["nodes"])
        ready = [n for n in nodes if _slurm.read_ready(self._alloc.get("dir", ""), n) is not None]
        if len(ready) < min(len(nodes), self.nodes):
            return JobStatus(self.kind, self._id, "starting", f"{said}; agents ready on {ready}",
                             hosts or [(n, "") for n in nodes])
        return JobStatus(self.kind, self._id, "running", said, hosts or [(n, "") for n in nodes])

    def _kill(self) -> None:
        job = str(self._id)
        if self._alloc.get("in_allocation"):
            step = self._alloc.get("step_id")
            if step is not None:
                _slurm.cancel(job, step)
            if self._step is not None:
                if self._step.poll() is None:
                    self._step.send_signal(signal.SIGTERM)
                try:
                    self._step.wait(30)
                except Exception:
                    self._step.kill()
                    self._step.wait()
            elif step is not None:
                deadline = time.monotonic() + 30.0
                while time.monotonic() < deadline and _slurm.step_alive(job, step):
                    time.sleep(0.1)
        else:
            _slurm.cancel(job)
            # until its processes are gone (COMPLETING: SLURM is ending them)
            deadline = time.monotonic() + 30.0
            while time.monotonic() < deadline:
                info = _slurm.job_info(job)
                if info is None or (info["state"] in _slurm.ENDED and info["state"] != "COMPLETING"):
                    break
                time.sleep(0.1)
        d = self._alloc.get("dir")
        if d and os.path.isdir(d):
            for name in os.listdir(d):  # the secret and the ready files; the output stays to be read
                if name == "secret" or name.endswith(".json"):
                    try:
                        os.unlink(os.path.join(d, name))
                    except OSError:
                        pass
