"""What a worker's start pays before any of its own code: a zygote's fork, and threads in a fresh fork.

This process imports what an agent's zygote imports (``bootstrap.local._zygote_main``:
NumPy, cloudpickle, the actor and worker modules) and freezes the garbage collector as
it does, then measures:

- a fork, in the parent (the zygote's side): wall and CPU per fork, 64 forks in a row
  whose children stay until all are made (their pages stay shared, as a mesh's do);
- N threads started in a fresh fork (a worker starts five): the child's CPU and minor page
  faults, median of eight forks, for N = 1, 2 and 5.

Run::

    python bench/fork_costs.py

No peer: these are the floor under ``scale_costs.py start`` (a whole worker's start).
"""

from __future__ import annotations

import gc
import os
import resource
import statistics
import threading
import time

import cloudpickle  # noqa: F401
import numpy  # noqa: F401

from mesharray import actor  # noqa: F401
from mesharray.runtime import relay, worker  # noqa: F401


def _anon_kib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return -1


def forks(n: int = 64) -> tuple[float, float]:
    """Wall and CPU ms per fork in the parent."""
    r, w = os.pipe()
    pids = []
    t, c = time.perf_counter(), time.process_time()
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            os.close(w)
            os.read(r, 1)  # (until every fork is made)
            os._exit(0)
        pids.append(pid)
    dt, dc = time.perf_counter() - t, time.process_time() - c
    os.close(r)
    os.close(w)
    for p in pids:
        os.waitpid(p, 0)
    return dt / n * 1e3, dc / n * 1e3


def threads(n: int, forks: int = 8) -> tuple[float, float]:
    """Median CPU ms and minor page faults of starting ``n`` threads in a fresh fork."""
    got = []
    for _ in range(forks):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            f0, c0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time()
            ev = threading.Event()
            for _ in range(n):
                threading.Thread(target=ev.wait, daemon=True).start()
            f1, c1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time()
            os.write(w, f"{(c1 - c0) * 1e3} {f1 - f0}".encode())
            os._exit(0)
        os.close(w)
        ms, faults = os.read(r, 100).split()
        os.close(r)
        os.waitpid(pid, 0)
        got.append((float(ms), int(faults)))
    return statistics.median(g[0] for g in got), statistics.median(g[1] for g in got)


def main() -> None:
    gc.collect()
    gc.freeze()
    wall, cpu = forks()
    print(f"zygote-like process, {_anon_kib() / 1024:.1f} MiB anonymous: a fork {wall:.3f} ms wall, "
          f"{cpu:.3f} ms CPU in the parent")
    for n in (1, 2, 5):
        ms, faults = threads(n)
        print(f"{n} thread(s) started in a fresh fork: {ms:.2f} ms CPU, {faults:.0f} minor faults (median of 8)")


if __name__ == "__main__":
    main()
