"""The scheduling class of worker processes (``MESHARRAY_WORKER_SCHED``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import mesharray as ma
from mesharray import _platform

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(not hasattr(os, "sched_getscheduler"), reason="this system has no sched_getscheduler "
                       "(macOS): workers keep its default scheduling"),
]

_CHILD = "import os; print(os.sched_getscheduler(0))"


def flat(nested) -> list[tuple]:
    """The (worker, child) pairs of a gathered call, in rank order."""
    if isinstance(nested, tuple):
        return [nested]
    return [t for x in nested for t in flat(x)]


class Sched(ma.Actor):
    @ma.endpoint
    def classes(self) -> tuple[int, int]:
        """This worker's class (the thread its calls run in) and that of a process it starts."""
        child = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=30, check=True)
        return os.sched_getscheduler(0), int(child.stdout)


def test_workers_and_the_processes_they_start_run_in_sched_batch(procs):
    got = procs.spawn("sched", Sched).classes.call().get(timeout=60)
    # batch on Linux; the portable paths (MESHARRAY_PORTABLE, as macOS) leave the default
    mine = os.SCHED_BATCH if _platform.LINUX_NATIVE else os.SCHED_OTHER
    assert flat(got.tolist()) == [(mine, mine)] * len(procs)  # (Linux keeps SCHED_BATCH across fork)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the controller keeps its own


def test_normal_keeps_the_default_class():
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import mesharray as ma
        from test_sched import Sched, flat
        with ma.proc_mesh(procs=2) as procs:
            print(flat(procs.spawn("s", Sched).classes.call().get(timeout=60).tolist()))
    """)
    env = {**os.environ, "MESHARRAY_WORKER_SCHED": "normal"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=80)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == str([(os.SCHED_OTHER, os.SCHED_OTHER)] * 2)


def test_a_bad_value_is_an_error_before_any_process_starts(monkeypatch):
    monkeypatch.setenv("MESHARRAY_WORKER_SCHED", "fifo")
    with pytest.raises(ValueError, match="MESHARRAY_WORKER_SCHED must be 'batch' or 'normal', got 'fifo'"):
        ma.proc_mesh(procs=2)
    monkeypatch.setenv("MESHARRAY_WORKER_SCHED", " Normal ")
    assert _platform.worker_sched() == "normal"  # (case and spaces do not matter)
