"""std over a mesh axis: as collectives where the blocks live, vs gathering to the controller then NumPy.

    python bench/bench_spread.py            # 4 ranks, 1 and 16 MiB per rank, median of 7

``x.std(axis="procs").fetch()`` (two passes of shared-memory collectives, only
the result comes back) next to ``np.std(x.fetch(), axis=0)`` (every block to
the controller first), in the same run.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def run(ranks: int = 4, sizes_mib=(1, 16), reps: int = 7) -> list[tuple]:
    import mesharray as ma

    out = []
    with ma.proc_mesh(procs=ranks) as procs:
        for mib in sizes_mib:
            x = procs.arange((mib << 20) // 8, dtype="float64") * (procs.rank_array() + 1)
            x.std(axis="procs").fetch()  # groups made, code warm

            def dist(x=x):
                return np.asarray(x.std(axis="procs").fetch())

            def gathered(x=x):
                return np.asarray(x.fetch()).std(axis=1)[0]

            np.testing.assert_allclose(dist().ravel(), gathered().ravel(), rtol=1e-9)
            res = []
            for f in (dist, gathered):
                ts = []
                for _ in range(reps):
                    t = time.perf_counter()
                    f()
                    ts.append(time.perf_counter() - t)
                res.append(float(np.median(ts)))
            out.append((mib, *res))
    return out


def main() -> None:
    print("| MiB per rank (4 ranks) | x.std(axis='procs').fetch() | np.std(x.fetch()) | ratio |")
    print("|---|---|---|---|")
    for mib, d, g in run():
        print(f"| {mib} | {d * 1e3:.2f} ms | {g * 1e3:.2f} ms | {d / g:.2f} |")


def test_std_collective_vs_gather(benchmark):
    benchmark.pedantic(run, args=(4, (1,), 3), rounds=1, iterations=1)


if __name__ == "__main__":
    main()
