"""Launched by bench_collectives.py under mpirun: time mpi4py Allreduce (float32 sum).

Usage: mpirun -n N python bench/_mpi_allreduce.py REPS NBYTES...
Rank 0 prints one JSON line {nbytes: median seconds (max over ranks)}.
"""

import json
import sys
import time

import numpy as np
from mpi4py import MPI


def main() -> None:
    comm = MPI.COMM_WORLD
    reps = int(sys.argv[1])
    out = {}
    for nbytes in map(int, sys.argv[2:]):
        x = np.ones(max(1, nbytes // 4), dtype="float32")
        y = np.empty_like(x)
        comm.Allreduce(x, y)
        times = []
        r = reps if nbytes > 1024 else max(reps, 1000)
        for _ in range(r):
            comm.Barrier()
            t = time.perf_counter()
            comm.Allreduce(x, y)
            times.append(time.perf_counter() - t)
        slowest = np.empty(len(times))
        comm.Reduce(np.array(times), slowest, op=MPI.MAX, root=0)
        if comm.rank == 0:
            out[nbytes] = float(np.median(slowest))
    if comm.rank == 0:
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
