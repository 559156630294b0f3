"""How long workers' readers poll before blocking (``MESHARRAY_WORKER_SPIN_US``), and callers
waiting for their replies (``MESHARRAY_CALLER_SPIN_US``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import mesharray as ma
from mesharray import _platform

pytestmark = pytest.mark.timeout(90)


class Spin(ma.Actor):
    @ma.endpoint
    def spin(self) -> float:
        from mesharray.transport import spin as policy

        return policy._spin

    @ma.endpoint
    def cpu(self) -> float:
        t = os.times()
        return t.user + t.system

    @ma.endpoint
    def noop(self) -> None:
        return None

    @ma.endpoint
    def nap(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


def test_workers_poll_100_us_by_default_where_they_have_cores(procs):
    got = procs.spawn("spin", Spin).spin.call().get(timeout=60).to_numpy()
    # 100 µs unless the machine says otherwise (one CPU, a CPU quota, the variable set)
    want = _platform.worker_spin()
    assert [float(v) for v in np.asarray(got).ravel()] == pytest.approx([want] * len(procs))


def test_idle_workers_use_next_to_no_cpu(procs):
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


def _tree(tmp_path, cgroup: str, files: dict[str, str]):
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    fs = tmp_path / "fs"
    for rel, text in files.items():
        (fs / rel).parent.mkdir(parents=True, exist_ok=True)
        (fs / rel).write_text(text)
    return str(proc), str(fs)


@pytest.mark.parametrize("cgroup, files, want", [
    # cgroup v2: the process's cpu.max, or the smallest over its ancestors
    ("0::/pod/c1\n", {"pod/c1/cpu.max": "150000 100000\n"}, 1.5),
    ("0::/pod/c1\n", {"pod/c1/cpu.max": "max 100000\n", "pod/cpu.max": "50000 100000\n"}, 0.5),
    ("0::/pod/c1\n", {"pod/c1/cpu.max": "max 100000\n"}, None),
    # a namespaced cgroup: /proc says "/", the mount is the container's own subtree
    ("0::/\n", {"cpu.max": "200000 100000\n"}, 2.0),
    # cgroup v1, the cpu controller on its own or with cpuacct
    ("4:memory:/x\n2:cpu,cpuacct:/job\n", {"cpu,cpuacct/job/cpu.cfs_quota_us": "250000\n",
                                            "cpu,cpuacct/job/cpu.cfs_period_us": "100000\n"}, 2.5),
    ("1:cpu:/job\n", {"cpu/job/cpu.cfs_quota_us": "-1\n", "cpu/job/cpu.cfs_period_us": "100000\n"}, None),
    ("1:cpu:/job\n", {}, None),  # nothing readable: no quota
    # a mount of a subtree without a cgroup namespace: the longest tail of the path found there
    ("0::/kubepods/pod1/c1\n", {"pod1/c1/cpu.max": "max 100000\n", "pod1/cpu.max": "300000 100000\n"}, 3.0),
    # malformed lines and files are no quota, never an error
    ("\ngarbage\n0::/x\n", {"x/cpu.max": "\n"}, None),
    ("1:cpu:/j\n", {"cpu/j/cpu.cfs_quota_us": "lots\n", "cpu/j/cpu.cfs_period_us": "0\n"}, None),
])
def test_cpu_quota_reads_the_cgroup_limit(tmp_path, cgroup, files, want):
    proc, fs = _tree(tmp_path, cgroup, files)
    assert _platform.cpu_quota(proc, fs) == (pytest.approx(want) if want is not None else None)


def test_under_a_cpu_quota_workers_poll_only_when_asked(monkeypatch):
    monkeypatch.setattr(_platform, "cpu_quota", lambda *a: 4.0)
    monkeypatch.setattr(_platform, "usable_cpus", lambda: 8)
    assert _platform.worker_spin("") == 0.0  # the quota would count the polling
    assert _platform.worker_spin("100") == pytest.approx(100e-6)  # (set: honoured)
    monkeypatch.setattr(_platform, "cpu_quota", lambda *a: None)
    assert _platform.worker_spin("") == pytest.approx(100e-6)
    monkeypatch.setattr(_platform, "usable_cpus", lambda: 1)
    assert _platform.worker_spin("100") == 0.0


@pytest.mark.skipif(not os.access("/sys/fs/cgroup/cpu", os.W_OK), reason="no writable cgroup v1 cpu hierarchy "
                    "(needs root; the parser itself is tested above)")
def test_a_real_cgroup_quota_turns_polling_off(tmp_path):
    d = f"/sys/fs/cgroup/cpu/mesharray-test-{os.getpid()}"
    os.mkdir(d)
    try:
        with open(f"{d}/cpu.cfs_quota_us", "w") as f:
            f.write("150000")
        code = ("import os, sys; open(sys.argv[1] + '/cgroup.procs', 'w').write(str(os.getpid())); "
                "from mesharray import _platform as p; print(p.cpu_quota(), p.worker_spin(''))")
        out = subprocess.run([sys.executable, "-c", code, d], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["1.5", "0.0"]
    finally:
        os.rmdir(d)  # (its only process has exited)


def test_the_controller_polls_for_its_replies_50_us_by_default(procs):
    from mesharray.transport import spin as policy

    # set by proc_mesh(): 50 µs unless the machine says otherwise (one CPU, a CPU quota, the variable)
    assert policy._reply_spin == pytest.approx(_platform.caller_spin())
    assert _platform.caller_spin("") == pytest.approx(50e-6 if _platform.usable_cpus() > 1
                                                      and _platform.cpu_quota() is None else 0.0)


@pytest.mark.parametrize("bad", ["fast", "-5", "inf"])
def test_a_bad_caller_spin_is_an_error_before_any_process_starts(monkeypatch, bad):
    monkeypatch.setenv("MESHARRAY_CALLER_SPIN_US", bad)
    with pytest.raises(ValueError, match=f"MESHARRAY_CALLER_SPIN_US must be a number of microseconds >= 0, "
                                         f"got '{bad}'"):
        ma.proc_mesh(procs=2)


def test_a_caller_of_long_calls_hardly_polls(procs):
    # polling is for replies that come within microseconds: a caller waiting out long calls,
    # one at a time and 8 at once, spends next to no CPU doing it
    nappers = procs.spawn("nappers", Spin)
    one = nappers.slice(procs=0)
    one.noop.call_one().get(timeout=30)
    t = time.thread_time()
    for _ in range(5):
        assert one.nap.call_one(0.1).get() == 0.1
        assert one.nap.call_one(0.05).get(timeout=30) == 0.05  # (the deadline's path)
    for _ in range(3):
        nappers.nap.call(0.1).get(timeout=30)
    used = time.thread_time() - t
    assert used < 0.05, f"waiting 1.05 s for replies took {used * 1000:.0f} ms of the caller's CPU"


def test_a_caller_whose_polling_finds_nothing_backs_off(procs):
    # with a long polling set here (20 ms), waits of 60 ms each: polling every wait would
    # take 12 x 20 ms of the caller's CPU; backing off (the next 1, 2, 4 ... waits block at
    # once) polls in 4 of the 12
    from mesharray.transport import spin as policy

    one = procs.spawn("backoff", Spin).slice(procs=0)
    one.noop.call_one().get(timeout=30)
    saved = policy._reply_spin
    try:
        policy.set_reply_spin(0.02)
        t = time.thread_time()
        for _ in range(12):
            assert one.nap.call_one(0.06).get() == 0.06
        used = time.thread_time() - t
    finally:
        policy.set_reply_spin(saved)
    assert used < 0.16, f"12 waits of 60 ms took {used * 1000:.0f} ms of the caller's CPU (240 without back-off)"


def test_a_caller_that_polls_still_hears_of_a_death_at_once():
    # a reply that never comes: the rank's death ends the wait, whether it comes while the
    # caller polls (a long polling set here) or once it blocks; a deadline is kept while polling
    from mesharray.transport import spin as policy

    with ma.proc_mesh(procs=2) as mesh:
        spin = mesh.spawn("s", Spin)
        victim = spin.slice(procs=1)
        victim.noop.call_one().get(timeout=30)
        saved = policy._reply_spin
        try:
            policy.set_reply_spin(5.0)
            t = time.monotonic()
            with pytest.raises(TimeoutError):
                victim.nap.call_one(1.0).get(timeout=0.05)  # (polling, then its deadline)
            assert time.monotonic() - t < 0.5
            victim.noop.call_one().get(timeout=30)  # (the nap's reply comes first: drained)
            fut = victim.nap.call_one(30.0)
            killer = threading.Timer(0.3, os.kill, (mesh.pids[1], signal.SIGKILL))
            killer.start()
            t = time.monotonic()
            with pytest.raises(ma.ActorDiedError):
                fut.get()  # dies 0.3 s into 5 s of polling
            assert time.monotonic() - t < 3
            killer.join()
        finally:
            policy.set_reply_spin(saved)
        assert spin.slice(procs=0).noop.call_one().get(timeout=30) is None
