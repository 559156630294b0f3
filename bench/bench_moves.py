"""Moving a distributed array between two process meshes (``x.to_mesh(other)``), against its peers.

    python bench/bench_moves.py            # 64 MiB per rank, 2 ranks -> 2 ranks, median of 9

What is measured, in the same run, on one host:

- mesharray: ``y = x.to_mesh(b)`` for ``x`` of 64 MiB per rank on a 2-rank mesh
  ``a``, to the 2-rank mesh ``b`` (each block worker to worker, one copy), timed
  from the controller until both receivers hold their block (a one-element fetch
  of ``y`` waits for it);
- torch.distributed gloo, 4 processes: ``send``/``recv`` ranks 0, 1 -> 2, 3, and
  ``broadcast`` in the groups {0, 2} and {1, 3};
- mpi4py under ``mpirun -n 4``: ``Send``/``Recv`` ranks 0, 1 -> 2, 3 (Open MPI's
  shared memory);
- the weight-sync step of ``examples/rl_weight_sync.py`` at this size: mesharray
  ``to_mesh`` against torchmonarch's ``RDMABuffer.read_into`` by the generator
  actors, where torchmonarch runs (this interpreter when it has it, as after
  ``make bench``; else ``BENCH_MONARCH_PYTHON``, default ``/work/monarch-venv/bin/python``).

Figures are per rank: 64 MiB / time (each of the two transfers runs at once).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from _peers import run_mpi, spawn_ranks  # noqa: E402

MIB = 1 << 20


def _median(f, reps: int) -> float:
    f()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def bench_mesharray(nbytes: int, reps: int) -> float:
    import mesharray as ma

    with ma.proc_mesh(procs=2) as a, ma.proc_mesh(procs=2) as b:
        x = a.ones(nbytes // 4, dtype="float32") * (a.rank_array(dtype="float32") + 1)

        def move():
            y = x.to_mesh(b)
            np.asarray(y[..., :1].fetch())  # both receivers hold their block

        t = _median(move, reps)
        got = np.asarray(x.to_mesh(b).sum(axis=-1).fetch()).ravel()
        assert got.tolist() == [nbytes // 4, 2 * (nbytes // 4)], got
        return t


def _gloo_rank(rank, port, nbytes, reps, q):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    t_ = torch.ones(nbytes // 4, dtype=torch.float32) * rank
    res = {"sendrecv": [], "broadcast": []}
    for i in range(reps + 1):
        dist.barrier()
        t = time.perf_counter()
        if rank < 2:
            dist.send(t_, rank + 2)
        else:
            dist.recv(t_, rank - 2)
        if i:
            res["sendrecv"].append(time.perf_counter() - t)
    for i in range(reps + 1):
        dist.barrier()
        t = time.perf_counter()
        dist.broadcast(t_, src=rank % 2, group=pairs[rank % 2])
        if i:
            res["broadcast"].append(time.perf_counter() - t)
    dist.destroy_process_group()
    q.put(res)


def bench_gloo(nbytes: int, reps: int) -> dict | None:
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    res = spawn_ranks(_gloo_rank, 4, nbytes, reps)
    return {k: float(np.median(np.max(np.array([r[k] for r in res]), axis=0))) for k in ("sendrecv", "broadcast")}


def bench_mpi(nbytes: int, reps: int) -> float | None:
    res = run_mpi("_mpi_sendrecv.py", [reps, nbytes], 4)
    return None if res is None else float(res["sendrecv"])


def bench_monarch(nbytes: int, reps: int) -> float | str:
    import importlib.util

    python = os.environ.get("BENCH_MONARCH_PYTHON") or (
        sys.executable if importlib.util.find_spec("monarch") else "/work/monarch-venv/bin/python")
    if not os.path.exists(python):
        return f"no torchmonarch here (make bench installs it; or BENCH_MONARCH_PYTHON={python} is missing)"
    try:
        out = subprocess.run([python, os.path.join(HERE, "_monarch_rdma.py"), str(reps), str(nbytes)],
                             capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return "torchmonarch timed out"
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            return float(json.loads(line)["read_into"])
    return "torchmonarch failed: " + (out.stderr.strip().splitlines() or ["?"])[-1][:300]


def _gbps(nbytes: int, t: float | None) -> str:
    return "—" if not isinstance(t, float) else f"{nbytes / t / 1e9:.2f} GB/s ({t * 1e3:.1f} ms)"


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    nbytes = int(argv[0]) * MIB if argv else 64 * MIB
    reps = 9
    ours = bench_mesharray(nbytes, reps)
    gloo = bench_gloo(nbytes, reps) or {}
    mpi = bench_mpi(nbytes, reps)
    monarch = bench_monarch(nbytes, reps)
    print(f"| {nbytes // MIB} MiB per rank, 2 -> 2 ranks | per rank | mesharray / peer |")
    print("|---|---|---|")
    print(f"| mesharray `x.to_mesh(b)` | {_gbps(nbytes, ours)} | 1 |")
    for name, t in (("gloo send/recv", gloo.get("sendrecv")), ("gloo broadcast (pairs)", gloo.get("broadcast")),
                    ("mpi4py Send/Recv", mpi), ("torchmonarch RDMABuffer.read_into", monarch)):
        ratio = f"{ours / t:.2f}" if isinstance(t, float) else (t if isinstance(t, str) else "—")
        print(f"| {name} | {_gbps(nbytes, t) if isinstance(t, float) else '—'} | {ratio} |")


def test_to_mesh_64mib(benchmark):
    benchmark.pedantic(bench_mesharray, args=(64 * MIB, 3), rounds=1, iterations=1)


if __name__ == "__main__":
    main()
