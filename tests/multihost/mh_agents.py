"""Host agents for the multi-host tests: real ``python -m mesharray host`` processes on 127.0.0.x."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from contextlib import contextmanager

from tests.support.procs import wait_until  # noqa: F401 (the multihost tests import it from here)

SECRET = "multihost-test-secret"


class Agent:
    """One running ``python -m mesharray host`` process."""

    def __init__(self, ip: str, host_id: str, secret: str | None = SECRET, extra: list[str] | None = None,
                 env: dict | None = None, netns: str | None = None, wait: bool = True) -> None:
        e = dict(os.environ)
        e.pop("MESHARRAY_SECRET", None)
        if secret is not None:
            e["MESHARRAY_SECRET"] = secret
        e.update(env or {})
        cmd = [sys.executable, "-m", "mesharray", "host", "--listen", f"tcp://{ip}:0", "--host-id", host_id,
               *(extra or [])]
        if netns is not None:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        self.host_id = host_id
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e,
                                     start_new_session=True)
        self.url = ""
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Read the agent's first line (its address); an agent that did not start is stopped and named."""
        host_id = self.host_id
        line = _readline(self.proc, 30)
        if not line.startswith("mesharray host listening on "):
            err = self.stop()
            raise RuntimeError(f"host agent {host_id} did not start: {line!r} {err}")
        self.url = line.rsplit(" ", 1)[1]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        try:
            os.kill(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def signal_host(self, sig: int) -> None:
        """``sig`` to every process of this host: the agent and all it started (the workers' zygote
        runs in a session of its own, so the agent's process group is not enough)."""
        for pid in [self.proc.pid, *_descendants(self.proc.pid)]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def stop(self) -> str:
        left = _descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:  # whatever the agent's session left (it kills its own workers; this is the backstop)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in left:  # and the workers' zygote's session
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        err = self.proc.stderr.read() if self.proc.stderr else ""
        for f in (self.proc.stdout, self.proc.stderr):
            if f:
                f.close()
        return err


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), ()):
            out.append(c)
            todo.append(c)
    return out


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    import selectors

    sel = selectors.DefaultSelector()
    assert proc.stdout is not None
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        return ""
    return proc.stdout.readline().strip()


@contextmanager
def agents(n: int, first_ip: int = 2, prefix: str = "h", **kw):
    started: list[Agent] = []
    try:
        for i in range(n):  # (all started, then each one's address read: they start side by side)
            started.append(Agent(f"127.0.0.{first_ip + i}", f"{prefix}{i}", wait=False, **kw))
        for a in started:
            a.wait_ready()
        yield started
    finally:
        for a in started:
            a.stop()
