"""The job tests run in a temporary working directory (the job file goes to .mesharray/ there) and must
leave no agent behind: a process whose command line names that directory fails the test (and is killed)."""

from __future__ import annotations

import os
import signal
import time

import pytest


def processes_naming(text: str) -> list[tuple[int, str]]:
    """``(pid, command line)`` of every live process whose command line contains ``text``."""
    out: list[tuple[int, str]] = []
    if not os.path.isdir("/proc"):
        return out
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    continue
        except OSError:
            continue
        if text in cmd:
            out.append((int(pid), cmd))
    return out


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """The test's working directory; after the test, no process may still name it."""
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    left = processes_naming(str(tmp_path))
    deadline = time.monotonic() + 5
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = processes_naming(str(tmp_path))
    for pid, _ in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"agents left behind: {left}"
