"""The per-process call recorder, without processes: bounded rows, aggregates that count every call."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mesharray.runtime import recorder
from mesharray.runtime.recorder import BUCKETS, Recorder


def _row(i: int, dur_ns: int, status: str = "ok") -> tuple:
    return (i, dur_ns, "actor", "ping", 1, i, 40, 36, status)


@pytest.fixture
def small_cap(monkeypatch):
    monkeypatch.setattr(recorder, "MAX_ROWS", 640)
    return 640


def test_rows_stay_bounded_in_small_steps_and_the_list_object_stays(small_cap):
    rec = Recorder()
    rows = rec.rows  # the worker appends to this very list
    durations = [3_000, 20_000, 40_000, 200_000, 7_000_000, 30_000_000_000]  # the last past every bucket
    n = 5 * small_cap + 7
    for i in range(n):
        rec.call(_row(i, durations[i % len(durations)], "ok" if i % 5 else "ValueError"))
        # never more than the cap, and a trim drops a 32nd of it, not half
        assert len(rows) <= small_cap
        assert len(rows) >= min(i + 1, small_cap - small_cap // 32)
    assert rec.rows is rows
    # absolute indices: a reader that asked before keeps its place
    assert rec.rows_base + len(rows) == n
    snap = rec.snapshot({"messages": n - 3})
    assert [r[0] for r in snap["messages"]] == [n - 3, n - 2, n - 1]
    # every call is counted once, whether its row was dropped or is still kept
    agg = rec.aggregates()
    assert sum(a[0] for a in agg.values()) == n
    ok = agg[("actor", "ping", "ok")]
    want = [0] * len(BUCKETS)
    for i in range(n):
        if i % 5:
            d = durations[i % len(durations)] / 1e9
            hit = [j for j, le in enumerate(BUCKETS) if d <= le]
            if hit:
                want[hit[0]] += 1  # one bucket per call, not cumulative; none past the last bound
    assert ok[4:] == want
    assert ok[0] == sum(1 for i in range(n) if i % 5)
    assert ok[2] == 40 * ok[0] and ok[3] == 36 * ok[0]


def test_aggregates_between_trims_count_each_row_once(small_cap):
    rec = Recorder()
    for i in range(small_cap):
        rec.call(_row(i, 1_000))
    assert rec.aggregates()[("actor", "ping", "ok")][0] == small_cap  # folded, still kept
    for i in range(small_cap, small_cap + 100):
        rec.call(_row(i, 1_000))  # a trim now drops rows that were folded already
    assert rec.aggregates()[("actor", "ping", "ok")][0] == small_cap + 100


def test_call_rows_read_like_the_list_of_tuples_they_replace():
    from mesharray._core import CallRows

    rows, ref = CallRows(), []
    for i in range(300):  # (past the ring's first growths, with the oldest dropped in between)
        r = _row(i, 1000 + i, "ok" if i % 3 else "KeyError")
        rows.append(r)
        ref.append(r)
        if i % 97 == 96:
            del rows[:40]
            del ref[:40]
    assert len(rows) == len(ref) and list(rows) == ref
    assert rows[0] == ref[0] and rows[-1] == ref[-1] and rows[10:20] == ref[10:20] and rows[-3:] == ref[-3:]
    with pytest.raises(IndexError, match="out of range"):
        rows[len(ref)]
    with pytest.raises(ValueError, match="9 fields"):
        rows.append((1, 2))
    with pytest.raises(TypeError, match="64-bit ints"):
        rows.append((1, "2", "a", "e", 1, 2, 3, 4, "ok"))
    with pytest.raises(ValueError, match="oldest first"):
        del rows[5:]
    assert list(rows) == ref  # (a refused row or deletion changes nothing)


_COUNTS = """
import os
from mesharray.runtime import recorder

def listed():
    return len(os.listdir("/proc/self/fd")) - 1  # (less the listing's own descriptor)

_, _, rss, threads, fds = recorder.process_sample()
assert fds == listed() and threads == 1, (fds, listed(), threads)
with open("/proc/self/statm", "rb") as f:
    assert abs(rss - int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")) < 16 << 20
r, w = os.pipe()
assert recorder.process_sample()[4] == fds + 2 == listed()
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc (Linux)")
def test_a_process_sample_counts_open_descriptors_and_resident_memory():
    # (in a process of its own: this one's other threads open and close descriptors meanwhile)
    r = subprocess.run([sys.executable, "-c", _COUNTS], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(not hasattr(os, "fork") or not os.path.exists("/proc/self/statm"), reason="forks, reads /proc")
def test_a_forked_child_samples_its_own_memory_and_a_lost_descriptor_is_opened_again():
    recorder.process_sample()
    pid = os.fork()
    if pid == 0:  # (the child: its own statm, not its parent's through the inherited descriptor)
        ok = recorder._statm is None
        recorder.process_sample()
        ok = ok and recorder._statm is not None and recorder._statm[0] == os.getpid()
        os._exit(0 if ok else 1)
    assert os.waitpid(pid, 0)[1] == 0
    fd = recorder._statm[1]
    os.close(fd)  # (someone else closed it)
    assert recorder.process_sample()[2] > 0 and recorder._statm is not None
