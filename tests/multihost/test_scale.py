"""1,024 ranks from one controller: sixteen host agents (127.0.0.2..17, host ids s0..s15) with 64 processes each.

One mesh for the module: calls to all of them leave the controller once per host,
each rank keeps its order, a 1-element sum over all of them, the web view of 1,024
ranks in a headless browser, a killed rank, and memory per worker.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import numpy as np
import pytest
from mh_agents import SECRET, agents

import mesharray as ma
from mesharray.runtime.router import get_router
from tests.support.actors import Counter, Probe
from tests.support.browser import HEADLESS, chromium

pytestmark = pytest.mark.timeout(300)

HOSTS, PER_HOST = 16, 64


@pytest.fixture(scope="module")
def big():
    with agents(HOSTS, first_ip=2, prefix="s") as ags:
        hosts = ma.attach([a.url for a in ags], secret=SECRET, transport="tcp", timeout=60)
        try:
            procs = hosts.spawn_procs(per_host={"procs": PER_HOST}, timeout=240)
            try:
                yield procs, procs.spawn("counters", Counter), procs.spawn("probes", Probe)
            finally:
                procs.stop()
        finally:
            hosts.detach()


def test_a_call_to_1024_ranks_leaves_once_per_host(big):
    procs, _, probes = big
    assert procs.sizes == {"hosts": HOSTS, "procs": PER_HOST}
    router = get_router()
    calls = router.sent_calls
    got = np.asarray(probes.pid.call().get(timeout=120))
    assert router.sent_calls - calls == HOSTS
    assert got.shape == (HOSTS, PER_HOST) and sorted(got.ravel().tolist()) == sorted(procs.pids)
    # one host's ranks: the direct path
    calls = router.sent_calls
    assert np.asarray(probes[3].pid.call().get(timeout=60)).tolist() == procs.pids[3 * PER_HOST:4 * PER_HOST]
    assert router.sent_calls - calls == PER_HOST


def test_each_of_1024_ranks_keeps_the_controllers_order(big):
    _, counters, _ = big
    for i in range(3):
        counters.record.broadcast(i)  # relayed
        counters[i * 5, 7].record.call_one(100 + i).get(timeout=60)  # direct, right after
    got = np.asarray(counters.recorded.call().get(timeout=120), dtype=object)
    for h in range(HOSTS):
        for p in range(PER_HOST):
            want = [0, 1, 2]
            for i in range(3):
                if (h, p) == (i * 5, 7):
                    want.insert(want.index(i) + 1, 100 + i)
            assert list(got[h, p]) == want, (h, p)


def test_a_one_element_sum_over_1024_ranks(big):
    procs, _, _ = big
    x = procs.ones(())
    assert float(x.sum().fetch()) == HOSTS * PER_HOST
    t = time.monotonic()
    for _ in range(3):
        assert float(x.sum().fetch()) == HOSTS * PER_HOST
    per_sum = (time.monotonic() - t) / 3
    assert float((x * 2).sum().fetch()) == 2 * HOSTS * PER_HOST
    assert per_sum < 30  # (a bound against hangs; bench/bench_scale.py measures it)


def test_the_web_view_shows_1024_ranks_and_one_in_detail(big):
    browser = chromium()
    if browser is None:
        pytest.skip("no Chromium here (make test installs Debian's `chromium` when it runs as root with apt)")
    procs, _, _ = big
    url = procs.telemetry.serve(port=0)
    args = [browser, *HEADLESS,
            "--virtual-time-budget=5000", "--window-size=1400,1000", "--dump-dom"]
    dom = subprocess.run(args + [url + "#rank-1000"], capture_output=True, text=True, timeout=180).stdout
    cells = re.findall(r'class="rank (idle|busy|unresponsive|dead)[^"]*" data-rank="(\d+)"', dom)
    assert sorted(int(r) for _, r in cells) == list(range(HOSTS * PER_HOST)), dom[-2000:]
    rows = re.findall(r'<div class="host">s(\d+) <small>\(64\)</small></div>', dom)
    assert sorted(map(int, rows)) == list(range(HOSTS))
    info = dom[dom.index('class="rankinfo" data-rank="1000"'):]
    assert f"<td>pid</td><td>{procs.pids[1000]}</td>" in info and "<td>host</td><td>s15</td>" in info


def test_workers_stay_small(big):
    procs, _, _ = big
    pss = []
    for pid in procs.pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                pss.extend(int(line.split()[1]) / 1024 for line in f if line.startswith("Pss:"))
        except OSError:
            pass
    mean = float(np.mean(pss))
    print(f"PSS per worker: {mean:.1f} MiB (of {len(pss)})")
    assert mean < 12, mean


def test_a_killed_rank_fails_a_pending_call_to_1024_at_once(big):
    procs, _, probes = big
    victim = HOSTS * PER_HOST - 2
    fut = probes.sleep.call(2.5)
    time.sleep(0.5)
    t = time.monotonic()
    os.kill(procs.pids[victim], signal.SIGKILL)
    with pytest.raises(ma.ActorDiedError) as ei:
        fut.get(timeout=60)
    assert victim in ei.value.ranks
    assert time.monotonic() - t < 2.0  # (before the others' sleep ends; the bound is 1 s: bench/bench_scale.py)
    time.sleep(2.5)  # the others finish their sleep
    assert np.asarray(probes[0:15].pid.call().get(timeout=120)).shape == (15, PER_HOST)
