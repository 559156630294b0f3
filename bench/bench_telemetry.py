"""Telemetry on vs off: call_one p50 and broadcasts/s, side by side, in alternating fresh processes.

    python bench/bench_telemetry.py            # 6 rounds of each, pinned to one core when taskset exists

Telemetry is on by default (``MESHARRAY_TELEMETRY=1``); the issue's bar is
call_one p50 with it on at most 1.1x off. Each round runs one fresh process
per setting (a 2-process mesh, 500 warm-up calls, then 5000 timed calls and
20000 broadcasts), alternating, so both see the same machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

_CODE = r"""
import json, time, numpy as np, mesharray as ma

class A(ma.Actor):
    @ma.endpoint
    def noop(self):
        return None

with ma.proc_mesh(procs=2) as procs:
    a = procs.spawn("a", A).slice(procs=1)
    for _ in range(500):
        a.noop.call_one().get()
    ts = []
    for _ in range(5000):
        t = time.perf_counter()
        a.noop.call_one().get()
        ts.append(time.perf_counter() - t)
    n = 20000
    t = time.perf_counter()
    for _ in range(n):
        a.noop.broadcast()
    a.noop.call_one().get()
    bps = n / (time.perf_counter() - t)
    print(json.dumps({"p50": float(np.median(ts)), "bps": bps}))
"""


def run(flag: str) -> dict:
    cmd = [sys.executable, "-c", _CODE]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", "1", *cmd]
    env = dict(os.environ, MESHARRAY_TELEMETRY=flag, PYTHONPATH=ROOT)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(rounds: int = 6) -> None:
    res: dict[str, list] = {"0": [], "1": []}
    for _ in range(rounds):
        for flag in ("0", "1"):
            res[flag].append(run(flag))
    p50 = {k: float(np.median([r["p50"] for r in v])) * 1e6 for k, v in res.items()}
    bps = {k: float(np.median([r["bps"] for r in v])) for k, v in res.items()}
    print("| figure | telemetry off | telemetry on | on/off |")
    print("|---|---|---|---|")
    print(f"| call_one no-op p50 | {p50['0']:.1f} µs | {p50['1']:.1f} µs | {p50['1'] / p50['0']:.3f} |")
    print(f"| broadcast to one actor | {bps['0'] / 1e3:.1f}k/s | {bps['1'] / 1e3:.1f}k/s | {bps['1'] / bps['0']:.3f} |")


def test_telemetry_overhead(benchmark):
    benchmark.pedantic(main, args=(2,), rounds=1, iterations=1)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 6)
