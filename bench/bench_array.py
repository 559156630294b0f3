"""Elementwise work on a distributed array next to the same NumPy op in one process.

    python bench/bench_array.py            # a * 2 + b on 4 ranks x 16 MiB float32

The distributed op is sent fire-and-forget to the 4 workers; the timing ends
when every worker has finished it (a reply from each, ordered after the op).
NumPy runs the same op on a (4, 4M) float32 array in this process. The ratio is
the overhead of doing it on the mesh (on a 2-core machine, 4 workers share
2 cores, so the parallel speedup a real machine gives is not visible here).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(HERE))

MiB = 1 << 20


def bench_distributed(ranks: int, nbytes: int, reps: int) -> float:
    import mesharray as ma
    from mesharray.darray import data_context

    with ma.proc_mesh(hosts=1, procs=ranks) as procs:
        a = procs.rand((nbytes // 4,), "float32", seed=0)
        b = procs.rand((nbytes // 4,), "float32", seed=1)
        ctx = data_context(procs)
        everyone = ctx.view(list(range(ranks)))
        times = []
        for _ in range(reps + 1):
            t = time.perf_counter()
            c = a * 2 + b
            everyone.meta.call(c._storage.bid).get()  # waits for every worker's op
            times.append(time.perf_counter() - t)
            del c
        return statistics.median(times[1:])


def bench_numpy(ranks: int, nbytes: int, reps: int) -> float:
    rng = np.random.default_rng(0)
    a = rng.random((ranks, nbytes // 4), dtype=np.float32)
    b = rng.random((ranks, nbytes // 4), dtype=np.float32)
    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        c = a * 2 + b
        times.append(time.perf_counter() - t)
        del c
    return statistics.median(times[1:])


def main() -> None:
    ranks, nbytes, reps = 4, 16 * MiB, 10
    d = bench_distributed(ranks, nbytes, reps)
    n = bench_numpy(ranks, nbytes, reps)
    print("| op | shape | mesharray (ms) | NumPy one process (ms) | ratio |")
    print("|---|---|---|---|---|")
    print(f"| a * 2 + b | {ranks} ranks x 16 MiB float32 | {d * 1e3:.1f} | {n * 1e3:.1f} | {d / n:.2f} |")


def test_elementwise_4x16mib(benchmark):
    benchmark.pedantic(bench_distributed, args=(4, 16 * MiB, 3), rounds=1, iterations=1)


if __name__ == "__main__":
    main()
