"""How long workers' readers poll before blocking (``MESHARRAY_WORKER_SPIN_US``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import mesharray as ma
from mesharray import _platform

pytestmark = pytest.mark.timeout(90)


class Spin(ma.Actor):
    @ma.endpoint
    def spin(self) -> float:
        from mesharray.transport import connection

        return connection._spin

    @ma.endpoint
    def cpu(self) -> float:
        t = os.times()
        return t.user + t.system

    @ma.endpoint
    def noop(self) -> None:
        return None


def test_workers_poll_100_us_by_default_where_they_have_cores(procs):
    got = procs.spawn("spin", Spin).spin.call().get(timeout=60).to_numpy()
    want = 100e-6 if _platform.usable_cpus() > 1 else 0.0
    assert [float(v) for v in np.asarray(got).ravel()] == pytest.approx([want] * len(procs))


def test_idle_workers_stop_polling(procs):
    spinners = procs.spawn("idle", Spin)
    one = spinners.slice(procs=0)
    for _ in range(2000):  # a loop of calls: the reader polls between them
        one.noop.call_one().get(timeout=30)
    time.sleep(0.2)
    before = float(one.cpu.call_one().get(timeout=30))
    time.sleep(1.0)
    used = float(one.cpu.call_one().get(timeout=30)) - before
    assert used < 0.05, f"an idle worker used {used * 1000:.0f} ms of CPU in 1 s"


def test_zero_blocks_at_once_and_one_cpu_never_polls():
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import mesharray as ma
        from mesharray import _platform
        from test_worker_spin import Spin
        with ma.proc_mesh(procs=2) as procs:
            print([float(v) for v in procs.spawn("s", Spin).spin.call().get(timeout=60).to_numpy().ravel()])
        if hasattr(os, "sched_setaffinity"):
            del os.environ["MESHARRAY_WORKER_SPIN_US"]
            os.sched_setaffinity(0, {{min(os.sched_getaffinity(0))}})
            print(_platform.worker_spin())
    """)
    env = {**os.environ, "MESHARRAY_WORKER_SPIN_US": "0"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=80)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "[0.0, 0.0]"
    if hasattr(os, "sched_setaffinity"):
        assert lines[1] == "0.0"  # (a process bound to one CPU: nothing can come while it polls)


@pytest.mark.parametrize("bad", ["fast", "-5", "inf", "nan"])
def test_a_bad_value_is_an_error_before_any_process_starts(monkeypatch, bad):
    monkeypatch.setenv("MESHARRAY_WORKER_SPIN_US", bad)
    with pytest.raises(ValueError, match=f"MESHARRAY_WORKER_SPIN_US must be a number of microseconds >= 0, "
                                         f"got '{bad}'"):
        ma.proc_mesh(procs=2)
    monkeypatch.setenv("MESHARRAY_WORKER_SPIN_US", " 250 ")
    assert _platform.worker_spin() == pytest.approx(250e-6 if _platform.usable_cpus() > 1 else 0.0)
