"""The job tests run in a temporary working directory (the job file goes to .mesharray/ there) and must
leave no agent behind: a process whose command line names that directory fails the test (and is killed)."""

from __future__ import annotations

import os
import signal
import time

import pytest
from job_util import processes_naming


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
