"""Launched by bench_moves.py under ``mpirun -n 4``: time mpi4py Send/Recv, ranks 0, 1 -> 2, 3.

Usage: mpirun -n 4 python bench/_mpi_sendrecv.py REPS NBYTES
Rank 0 prints one JSON line {"sendrecv": median seconds (slowest rank)}.
"""

import json
import sys
import time

import numpy as np
from mpi4py import MPI


def main() -> None:
    comm = MPI.COMM_WORLD
    reps, nbytes = int(sys.argv[1]), int(sys.argv[2])
    buf = np.ones(nbytes // 4, dtype="float32") * comm.rank
    half = comm.size // 2
    times = []
    for i in range(reps + 1):
        comm.Barrier()
        t = time.perf_counter()
        if comm.rank < half:
            comm.Send(buf, dest=comm.rank + half)
        else:
            comm.Recv(buf, source=comm.rank - half)
        if i:
            times.append(time.perf_counter() - t)
    slowest = np.empty(len(times))
    comm.Reduce(np.array(times), slowest, op=MPI.MAX, root=0)
    if comm.rank == 0:
        print(json.dumps({"sendrecv": float(np.median(slowest))}), flush=True)


if __name__ == "__main__":
    main()
