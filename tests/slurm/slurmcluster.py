"""A two-node SLURM cluster on this machine, for the tests: munged, slurmctld and two slurmd.

Debian's ``slurm-wlm`` (and ``munge``), run as root: everything lives in one
directory (the configuration, munge's key and socket, the controller's
state, each node's spool, the logs), so nothing of a system installation is
touched. The nodes are ``node1`` and ``node2`` at ``NodeAddr`` 127.0.0.2 and
127.0.0.3, each ``slurmd -N NODE`` on a port of its own; both are this
machine (its CPUs, as ``slurmd -C`` reports them). ``SLURM_CONF`` points the
commands (``sbatch``, ``srun``, ``squeue``...) at it.

``make tools`` installs the packages with apt when they are missing (as
root); :func:`missing` says what is missing where they cannot be.

Run by hand: ``python tests/slurm/slurmcluster.py DIR`` starts one in DIR and
prints the ``export SLURM_CONF=...`` to use it; Ctrl-C stops it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")
NODES = (("node1", "127.0.0.2"), ("node2", "127.0.0.3"))


def missing() -> str | None:
    """Why no cluster can run here (None when it can)."""
    if not sys.platform.startswith("linux"):
        return "the SLURM tests run on Linux"
    if os.geteuid() != 0:
        return "the SLURM tests run slurmd as root (two nodes on one machine)"
    absent = [p for p in PROGRAMS if shutil.which(p) is None]
    if absent:
        return (f"SLURM is not installed ({', '.join(absent)} missing): `make tools` installs Debian's "
                f"slurm-wlm and munge as root")
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _hardware() -> str:
    """This machine's node description as slurmd sees it (``CPUs=2 Boards=1 ...``), memory left out."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30, check=True).stdout
    fields = out.splitlines()[0].split()
    return " ".join(f for f in fields if not f.startswith(("NodeName=", "RealMemory=", "UpTime=")))


class SlurmCluster:
    """``with SlurmCluster(directory) as c:`` a running two-node cluster; ``c.env`` is what its commands need."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.conf = os.path.join(self.root, "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        for k in [k for k in self.env if k.startswith(("SLURM_JOB", "SLURM_STEP", "SLURM_NODELIST"))]:
            del self.env[k]
        self.nodes = [n for n, _ in NODES]

    def _path(self, *p: str) -> str:
        return os.path.join(self.root, *p)

    def _run(self, *cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, env=self.env, check=check)

    def start(self) -> SlurmCluster:
        for d in ("munge", "state", "log", "spool"):
            os.makedirs(self._path(d), exist_ok=True)
        os.chmod(self._path("munge"), 0o700)
        key = self._path("munge", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        sock = self._path("munge", "socket")
        subprocess.run(["munged", "--force", f"--socket={sock}", f"--key-file={key}",
                        f"--log-file={self._path('munge', 'munged.log')}", f"--pid-file={self._path('munge', 'pid')}",
                        f"--seed-file={self._path('munge', 'seed')}"], check=True, timeout=30, capture_output=True)
        hw = _hardware()
        lines = [
            "ClusterName=mesharray-test",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            "AuthType=auth/munge",
            f"AuthInfo=socket={sock}",
            "CredType=cred/munge",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={self._path('state')}",
            f"SlurmdSpoolDir={self._path('spool', '%n')}",
            f"SlurmctldPidFile={self._path('slurmctld.pid')}",
            f"SlurmdPidFile={self._path('slurmd-%n.pid')}",
            f"SlurmctldLogFile={self._path('log', 'slurmctld.log')}",
            f"SlurmdLogFile={self._path('log', 'slurmd-%n.log')}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            "MpiDefault=none",
            "ReturnToService=2",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            "KillWait=5",
            "MinJobAge=300",
            "SlurmdTimeout=60",
        ]
        for name, addr in NODES:
            lines.append(f"NodeName={name} NodeAddr={addr} Port={_free_port()} {hw} State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")
        try:
            self._run("slurmctld", "-f", self.conf)
            for name in self.nodes:
                self._run("slurmd", "-f", self.conf, "-N", name)
            deadline = time.monotonic() + 60
            while True:
                out = self._run("sinfo", "--noheader", "--Node", "--format=%N %T", check=False).stdout.split()
                states = dict(zip(out[::2], out[1::2]))
                if all(states.get(n, "").rstrip("*") == "idle" for n in self.nodes):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the SLURM nodes did not come up: {states}; logs in {self._path('log')}")
                time.sleep(0.2)
        except BaseException:
            self.stop()
            raise
        return self

    def jobs(self) -> list[tuple[str, str]]:
        """``(job id, state)`` of every job SLURM still lists (ended ones too, for MinJobAge)."""
        out = self._run("squeue", "--states=all", "--noheader", "--format=%i %T", check=False).stdout.split()
        return list(zip(out[::2], out[1::2]))

    def live_jobs(self) -> list[str]:
        return [j for j, st in self.jobs() if st in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING")]

    def stop(self) -> None:
        """Cancel every job, stop the daemons (waiting for them), remove nothing of the directory but the socket."""
        if os.path.exists(self._path("slurmctld.pid")):
            self._run("scancel", "--user=root", check=False)
            deadline = time.monotonic() + 20
            while self.live_jobs() and time.monotonic() < deadline:
                time.sleep(0.2)
        pids = []
        for name in [*(f"slurmd-{n}.pid" for n in self.nodes), "slurmctld.pid", os.path.join("munge", "pid")]:
            try:
                with open(self._path(name)) as f:
                    pids.append(int(f.read().strip()))
            except (OSError, ValueError):
                continue
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 15
        for pid in pids:
            while _running(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _running(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


if __name__ == "__main__":
    why = missing()
    if why:
        sys.exit(why)
    with SlurmCluster(sys.argv[1] if len(sys.argv) > 1 else "/tmp/mesharray-slurm") as c:
        print(f"export SLURM_CONF={c.conf}", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
