"""Soak: calls, broadcasts, reductions and Buffer reads in a loop while workers are killed.

Each round starts a mesh of 4 workers, runs every kind of traffic, SIGKILLs one
worker in the middle (its calls must fail with ``ActorDiedError``, the others'
must succeed), then stops the mesh and starts the next one. At the end the
controller's RSS, open fds and threads must be flat against a warmed-up
baseline: nothing accumulates per mesh, per death or per message.

``make test`` runs it for a few seconds; ``make soak`` for 60 s
(``MESHARRAY_SOAK_SECONDS``).
"""

from __future__ import annotations

import gc
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

import mesharray as ma

SECONDS = float(os.environ.get("MESHARRAY_SOAK_SECONDS", "6"))
pytestmark = pytest.mark.timeout(SECONDS * 3 + 120)


class Worker(ma.Actor):
    def __init__(self) -> None:
        self.n = 0
        self.data = np.arange(1 << 16, dtype="float32")
        self.buf = ma.Buffer(self.data)

    @ma.endpoint
    def pid(self) -> int:
        return os.getpid()

    @ma.endpoint
    def bump(self) -> None:
        self.n += 1

    @ma.endpoint
    def count(self) -> int:
        return self.n

    @ma.endpoint
    def echo(self, x):
        return x

    @ma.endpoint
    def buffer(self) -> ma.Buffer:
        return self.buf

    @ma.endpoint
    def big(self, a: np.ndarray) -> np.ndarray:
        return a + 1  # 1 MiB each way: through shared memory, both directions


def _round(rng: random.Random) -> None:
    with ma.proc_mesh(procs=4, forward_logs=False) as procs:
        w = procs.spawn("w", Worker)
        pids = np.asarray(w.pid.call().get(timeout=20)).ravel().tolist()
        bufs = np.asarray(w.buffer.call().get(timeout=20)).ravel().tolist()
        x = procs.ones((1 << 12,), dtype="float32")
        dst = np.empty(1 << 16, dtype="float32")
        victim = rng.randrange(4)
        for i in range(40):
            try:
                w.bump.broadcast()  # reaches every live actor, then reports a dead one
            except ma.ActorDiedError as e:
                assert e.ranks == (victim,) and i > 20
            if i == 20:
                os.kill(pids[victim], signal.SIGKILL)
            for r in range(4):
                try:
                    assert w.slice(procs=r).echo.call_one(i).get(timeout=20) == i
                    bufs[r].read_into(dst).get(timeout=20)
                    assert dst[5] == 5.0
                except ma.ActorDiedError:
                    assert r == victim and i >= 20
            if i == 10:
                out = w.big.call(np.zeros(1 << 18, dtype="float32")).get(timeout=20)
                assert float(np.asarray(out)[0, 0, 0]) == 1.0  # mesh dims (hosts, procs), then the block
            try:
                s = x.sum(axis="procs").fetch()
                assert s[0, 0] == 4.0
            except ma.ActorDiedError:
                assert i >= 20
        alive = [r for r in range(4) if r != victim]
        counts = [w.slice(procs=r).count.call_one().get(timeout=20) for r in alive]
        assert counts == [40] * 3


def _usage() -> tuple[float, int, int]:
    gc.collect()
    me = psutil.Process()
    return me.memory_info().rss / 2**20, me.num_fds(), threading.active_count()


def soak(seconds: float) -> dict:
    """Warm up, then run rounds for ``seconds``; the controller's usage before and after."""
    rng = random.Random(7)
    for _ in range(2):  # warm up: first-use allocations, caches, pools
        _round(rng)
    rss0, fds0, threads0 = _usage()
    rounds = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end or rounds < 2:
        _round(rng)
        rounds += 1
    time.sleep(0.5)  # late frees and exiting threads
    rss1, fds1, threads1 = _usage()
    return {"rounds": rounds, "rss": [rss0, rss1], "fds": [fds0, fds1], "threads": [threads0, threads1]}


def test_soak_controller_resources_stay_flat():
    # in a process of its own, as a user's script runs: pytest's captured output and
    # log records would grow with the rounds and hide what the controller does
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, __file__, str(SECONDS)], capture_output=True, text=True, env=env,
                         timeout=SECONDS * 3 + 120)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    (rss0, rss1), (fds0, fds1), (threads0, threads1) = r["rss"], r["fds"], r["threads"]
    rounds = r["rounds"]
    print(f"soak: {rounds} rounds; RSS {rss0:.0f} -> {rss1:.0f} MiB, fds {fds0} -> {fds1}, "
          f"threads {threads0} -> {threads1}")
    assert fds1 <= fds0 + 2, f"fds grew from {fds0} to {fds1} over {rounds} rounds"
    assert threads1 <= threads0 + 2, f"threads grew from {threads0} to {threads1} over {rounds} rounds"
    assert rss1 <= rss0 + 40, f"RSS grew from {rss0:.0f} to {rss1:.0f} MiB over {rounds} rounds"


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.CRITICAL)  # the deaths are on purpose
    print(json.dumps(soak(float(sys.argv[1]))))
