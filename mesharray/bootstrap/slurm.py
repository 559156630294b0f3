"""SLURM: host agents as the tasks of a job step, one per node, and the scheduler's view of a job.

Below :mod:`mesharray.proc` (``ma.job.SlurmJob`` is built on it); it calls
SLURM's commands (``sbatch``, ``srun``, ``squeue``, ``scontrol``,
``scancel``) and never a library.

- **The agents' step**: ``srun --ntasks-per-node=1 --whole ... python -c
  "...agent_main()" DIR`` runs :func:`agent_main` once per node. It names the
  host after the node (``SLURMD_NODENAME``), listens on the node's
  ``NodeAddr`` (``scontrol show node``) on a free port, reads the job's
  secret from ``DIR/secret`` (mode 0600: never on a command line, nor in the
  job's environment), writes ``DIR/NODE.json`` (``url``, ``host_id``,
  ``pid``, ``job_id``, ``step_id``) once it listens, and serves until SLURM
  ends the step (SIGTERM: its workers die with it). ``DIR`` is on a file
  system the nodes and the submitting machine share (the job's directory
  beside its job file, as ``sbatch`` output usually is).
- **Submitted**: :func:`batch_script` is a ``#!/bin/sh`` script that
  ``exec``\\ s that step over all the job's nodes; :func:`submit` passes it to
  ``sbatch --parsable`` on stdin.
- **Inside an allocation** (``SLURM_JOB_ID`` set): :func:`start_step` runs
  the same step with ``--overlap`` on some of the allocation's nodes, as a
  child of this process.
- **State**: :func:`job_info` (``squeue --states=all``), :func:`step_alive`,
  :func:`expand_nodes` (``scontrol show hostnames``), :func:`cancel`.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from typing import Any, Sequence

from ..errors import BootstrapError

__all__ = ["batch_script", "submit", "job_info", "expand_nodes", "cancel", "step_alive", "start_step",
           "agent_main", "agent_command", "read_ready", "PENDING", "RUNNING", "ENDED", "INSTALL_HINT"]

#: scheduler states of a job waiting for nodes
PENDING = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED", "RESV_DEL_HOLD",
                     "SPECIAL_EXIT", "STOPPED", "RESIZING", "SIGNALING", "STAGE_OUT", "CONFIGURING"})
#: a job whose nodes are allocated
RUNNING = frozenset({"RUNNING"})
#: a job that is over (COMPLETING: its processes are being ended)
ENDED = frozenset({"COMPLETING", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                   "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY", "REVOKED"})
INSTALL_HINT = "SLURM's commands (sbatch, srun, squeue, scontrol, scancel) must be on PATH"

_AGENT_CODE = "from mesharray.bootstrap.slurm import agent_main; agent_main()"


def _run(cmd: Sequence[str], timeout: float = 30.0, input: str | None = None,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    if shutil.which(cmd[0]) is None:
        raise BootstrapError(f"{cmd[0]} not found: {INSTALL_HINT}")
    try:
        return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, input=input, env=env)
    except subprocess.TimeoutExpired as exc:
        raise BootstrapError(f"{' '.join(cmd)} did not answer within {timeout:g} s") from exc


def agent_command(python: str, directory: str) -> list[str]:
    """The command each task of the agents' step runs (no secret in it)."""
    return [python, "-c", _AGENT_CODE, directory]


def batch_script(nodes: int, python: str, directory: str, *, name: str = "mesharray",
                 time_limit: str | None = None, partition: str | None = None, exclusive: bool = True) -> str:
    """The ``sbatch`` script of a job whose one step is a host agent on each of ``nodes`` nodes.

    Examples
    --------
    >>> print(batch_script(2, "/p/python", "/d", time_limit="01:00:00"))
    #!/bin/sh
    #SBATCH --job-name=mesharray
    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node=1
    #SBATCH --output=/d/slurm-%j.out
    #SBATCH --time=01:00:00
    #SBATCH --exclusive
    exec srun --ntasks-per-node=1 --whole --kill-on-bad-exit=0 /p/python -c 'from mesharray.bootstrap.slurm import agent_main; agent_main()' /d
    <BLANKLINE>
    """
    lines = ["#!/bin/sh", f"#SBATCH --job-name={name}", f"#SBATCH --nodes={int(nodes)}",
             "#SBATCH --ntasks-per-node=1", f"#SBATCH --output={os.path.join(directory, 'slurm-%j.out')}"]
    if time_limit:
        lines.append(f"#SBATCH --time={time_limit}")
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if exclusive:
        lines.append("#SBATCH --exclusive")
    step = ["srun", "--ntasks-per-node=1", "--whole", "--kill-on-bad-exit=0", *agent_command(python, directory)]
    lines.append("exec " + " ".join(shlex.quote(a) for a in step))
    return "\n".join(lines) + "\n"


def submit(script: str, sbatch_args: Sequence[str] = ()) -> str:
    """``sbatch --parsable [sbatch_args]`` with ``script`` on stdin; the job id."""
    out = _run(["sbatch", "--parsable", *sbatch_args], input=script)
    if out.returncode != 0:
        raise BootstrapError(f"sbatch refused the job: {out.stderr.strip() or out.stdout.strip()}")
    job_id = out.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise BootstrapError(f"sbatch answered {out.stdout.strip()!r}, not a job id")
    return job_id


def expand_nodes(nodelist: str) -> list[str]:
    """``node[1-3],gpu7`` -> ``["node1", "node2", "node3", "gpu7"]`` (``scontrol show hostnames``)."""
    if not nodelist or nodelist in ("(null)", "None"):
        return []
    out = _run(["scontrol", "show", "hostnames", nodelist])
    if out.returncode != 0:
        raise BootstrapError(f"scontrol show hostnames {nodelist}: {out.stderr.strip()}")
    return out.stdout.split()


def job_info(job_id: str) -> dict[str, Any] | None:
    """``{"state", "reason", "nodes", "start", "end"}`` of a job as ``squeue`` knows it; None once it forgot it."""
    out = _run(["squeue", "--jobs", str(job_id), "--states=all", "--noheader", "--format=%T|%r|%N|%S|%e"])
    if out.returncode != 0:
        if "Invalid job id" in out.stderr:
            return None
        raise BootstrapError(f"squeue --jobs {job_id}: {out.stderr.strip()}")
    line = out.stdout.strip().splitlines()
    if not line:
        return None
    state, reason, nodes, start, end = (line[0].split("|") + ["", "", "", "", ""])[:5]
    return {"state": state, "reason": reason, "nodes": nodes, "start": start, "end": end}


def step_alive(job_id: str, step_id: str) -> bool:
    """Whether step ``job_id.step_id`` still runs."""
    out = _run(["squeue", f"--steps={job_id}.{step_id}", "--noheader", "--format=%i"])
    return out.returncode == 0 and f"{job_id}.{step_id}" in out.stdout.split()


def cancel(job_id: str, step_id: str | None = None) -> None:
    """``scancel`` the job (or one of its steps): SIGTERM to its processes, SIGKILL after SLURM's KillWait."""
    target = str(job_id) if step_id is None else f"{job_id}.{step_id}"
    out = _run(["scancel", target])
    if out.returncode != 0 and "Invalid job id" not in out.stderr and "already completed" not in out.stderr:
        raise BootstrapError(f"scancel {target}: {out.stderr.strip()}")


def start_step(nodes: Sequence[str], python: str, directory: str) -> subprocess.Popen[bytes]:
    """Inside an allocation: the agents' step on ``nodes`` (``srun --overlap``), a child of this process."""
    if shutil.which("srun") is None:
        raise BootstrapError(f"srun not found: {INSTALL_HINT}")
    cmd = ["srun", "--overlap", "--whole", "--ntasks-per-node=1", "--kill-on-bad-exit=0",
           f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}", f"--nodelist={','.join(nodes)}",
           *agent_command(python, directory)]
    log = open(os.path.join(directory, f"step-{os.getpid()}.out"), "ab")
    try:
        # its own process group: a Ctrl-C at the terminal is for the script, not for the agents
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    finally:
        log.close()


def _node_addr(node: str) -> str | None:
    """The ``NodeAddr`` SLURM reaches ``node`` at (what other machines reach it at too)."""
    try:
        out = subprocess.run(["scontrol", "show", "node", "--oneliner", node], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for field in out.stdout.split():
        if field.startswith("NodeAddr="):
            return field.split("=", 1)[1] or None
    return None


def agent_main() -> None:
    """One task of the agents' step: a host agent named after its node (see the module's docstring)."""
    import logging
    import signal

    from .agent import HostAgent, write_ready_file

    directory = sys.argv[1]
    node = os.environ.get("SLURMD_NODENAME") or os.uname().nodename
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s mesharray host {node}: %(message)s")
    try:
        with open(os.path.join(directory, "secret"), "rb") as f:
            secret = f.read().strip()
        addr = _node_addr(node)
        listen = f"tcp://{addr}:0" if addr else "tcp://0.0.0.0:0"
        agent = HostAgent(listen, secret, host_id=node)
    except (BootstrapError, ValueError, OSError) as exc:
        print(f"mesharray host {node}: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *a: agent.request_stop())
    print(f"mesharray host {node} listening on {agent.url}", flush=True)
    write_ready_file(os.path.join(directory, f"{node}.json"), agent, job_id=os.environ.get("SLURM_JOB_ID"),
                     step_id=os.environ.get("SLURM_STEP_ID"))
    agent.serve_forever()


def read_ready(directory: str, node: str) -> dict[str, Any] | None:
    """The ready file of ``node``'s agent, or None while there is none."""
    try:
        with open(os.path.join(directory, f"{node}.json")) as f:
            return dict(json.load(f))
    except (OSError, ValueError):
        return None
