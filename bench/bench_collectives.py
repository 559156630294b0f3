"""Reductions across ranks and one-sided Buffer reads, next to their peers, in one run.

One command prints the whole table (it launches ``mpirun`` and the gloo
processes itself)::

    python bench/bench_collectives.py                 # 2 and 4 ranks, 4 MiB and 64 MiB
    python bench/bench_collectives.py --ranks 2 --reps 5
    python bench/bench_collectives.py --tiny          # only the 8-byte table (~1 min)
    python bench/bench_collectives.py --interleave --ranks 2 --sizes 4 --rounds 7
                                                      # shm, mpi4py, shm slots in turn, ratios per round

Rows (float32 sum across ranks, per rank ``size`` bytes, median of ``reps``):

- ``shm``: mesharray's shared-memory backend alone (``ShmCollective.allreduce``
  in N spawned processes), as it runs by default (single copy, by
  cross-memory attach, from 256 KiB per rank);
- ``shm slots``: the same with ``single_copy_min=None``: every byte staged
  through the segment's slots (copy in, reduce, copy out), the algorithm
  before single copy. The two alternate in fresh processes, ``--rounds``
  times, and each is the median of its rounds;
- ``mesharray``: ``x.sum(axis="procs")`` on a distributed array issued from
  the controller, end to end (fire-and-forget to every rank, the shm
  collective in the workers, then a call to every rank to wait for it);
- ``mpi``: mpi4py ``Allreduce`` under ``mpirun`` (Open MPI's shared memory);
- ``gloo``: ``torch.distributed.all_reduce`` with the gloo backend.

Also: the 8-byte reduction from the controller, exactly
``x.sum(axis="procs").fetch()`` of a 0-d float64 block, with the control
messages it costs (``procs.stats()``), next to mpi4py's and gloo's 8-byte
all-reduce in the same run; ``Buffer.read_into`` of 64 MiB
between two processes, and the peak RSS of a 64 MiB transfer.

Under pytest (``make bench``) a small subset runs as pytest-benchmark cases.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
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

MiB = 1 << 20


# --- shm backend alone ---------------------------------------------------------------


def _shm_rank(rank, size, name, nbytes, reps, q, single_copy=True):
    from mesharray.collectives import ShmCollective

    g = ShmCollective(name, rank, size, timeout=120, **({} if single_copy else {"single_copy_min": None}))
    x = np.ones(nbytes // 4, dtype="float32")
    out = np.empty_like(x)
    g.allreduce(x, out)
    times = []
    for _ in range(reps):
        g.barrier()
        t = time.perf_counter()
        g.allreduce(x, out)
        times.append(time.perf_counter() - t)
    g.close()
    q.put((rank, times))


def bench_shm(size: int, nbytes: int, reps: int, single_copy: bool = True) -> float:
    from mesharray.collectives import unique_segment_name

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    name = unique_segment_name("bench")
    ps = [ctx.Process(target=_shm_rank, args=(r, size, name, nbytes, reps, q, single_copy)) for r in range(size)]
    for p in ps:
        p.start()
    res = [q.get(timeout=300) for _ in ps]
    for p in ps:
        p.join()
    # an op is done when its slowest rank is: per repetition, the max over ranks
    per = np.max(np.array([t for _, t in res]), axis=0)
    return float(np.median(per))


# --- mesharray end to end ---------------------------------------------------------------


def bench_mesharray(size: int, nbytes_list: list[int], reps: int) -> dict[int, float]:
    import mesharray as ma
    from mesharray.darray import data_context

    out = {}
    with ma.proc_mesh(hosts=1, procs=size) as procs:
        for nbytes in nbytes_list:
            x = procs.ones((max(1, nbytes // 4),), dtype="float32")
            everyone = data_context(procs).view(list(range(size)))
            # segments are made on first use; keep the result alive while asking about
            # it (a dropped array's free rides on the next message, ahead of the call)
            warm = x.sum(axis="procs")
            everyone.meta.call(warm._storage.bid).get()
            del warm
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                y = x.sum(axis="procs")  # fire-and-forget
                everyone.meta.call(y._storage.bid).get()  # every member done (ordered after it)
                times.append(time.perf_counter() - t)
            out[nbytes] = float(np.median(times))
    return out


def bench_tiny_fetch(size: int, reps: int) -> tuple[float, float, float]:
    """``x.sum(axis="procs").fetch()`` of a 0-d float64 block (8 B) on ``size`` ranks.

    Returns the median seconds per op, the control messages the controller sent
    per op (``calls`` + ``broadcasts`` of ``procs.stats()``) and, of those, the
    ones awaiting a reply (``calls``).
    """
    import mesharray as ma

    with ma.proc_mesh(procs=size) as procs:
        x = procs.full((), 2.0)
        for _ in range(20):  # segments made, code paths warm
            x.sum(axis="procs").fetch()
        s0 = procs.stats()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            x.sum(axis="procs").fetch()
            times.append(time.perf_counter() - t)
        s1 = procs.stats()
        msgs = (s1["calls"] + s1["broadcasts"] - s0["calls"] - s0["broadcasts"]) / reps
        return float(np.median(times)), msgs, (s1["calls"] - s0["calls"]) / reps


# --- mpi4py under mpirun -------------------------------------------------------------------


def bench_mpi(size: int, nbytes_list: list[int], reps: int) -> dict[int, float] | None:
    res = run_mpi("_mpi_allreduce.py", [reps, *nbytes_list], size)
    return None if res is None else {int(k): v for k, v in res.items()}


# --- torch.distributed gloo ------------------------------------------------------------------


def _gloo_rank(rank, port, size, nbytes_list, reps, q):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    res = {}
    for nbytes in nbytes_list:
        t_ = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
        dist.all_reduce(t_)
        times = []
        for _ in range(reps):
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(t_)
            times.append(time.perf_counter() - t)
        res[nbytes] = times
    dist.destroy_process_group()
    q.put((rank, res))


def bench_gloo(size: int, nbytes_list: list[int], reps: int) -> dict[int, float] | None:
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    res = spawn_ranks(_gloo_rank, size, size, nbytes_list, reps)
    return {n: float(np.median(np.max(np.array([r[n] for _, r in res]), axis=0))) for n in nbytes_list}


# --- Buffer.read_into ------------------------------------------------------------------------


def _buffer_owner(conn, nbytes):
    import pickle

    import mesharray as ma

    data = np.ones(nbytes, dtype=np.uint8)
    buf = ma.Buffer(data)
    conn.send(pickle.dumps(buf))
    conn.recv()
    buf.drop()


def bench_buffer(nbytes: int, reps: int) -> tuple[float, float]:
    """GB/s of read_into (warm destination), and the extra peak RSS of one read in copies."""
    import pickle

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_buffer_owner, args=(child, nbytes))
    p.start()
    buf = pickle.loads(parent.recv())
    rss0 = _hwm()
    dst = np.empty(nbytes, dtype=np.uint8)
    buf.read_into(dst).get()
    rss1 = _hwm()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        buf.read_into(dst).get()
        times.append(time.perf_counter() - t)
    parent.send("done")
    p.join()
    return nbytes / statistics.median(times) / 1e9, (rss1 - rss0) / nbytes


def _hwm() -> int:
    # peak resident set of this process so far (bytes)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _fetch_rss(nbytes, q):
    import mesharray as ma

    with ma.proc_mesh(hosts=1, procs=1) as procs:
        x = procs.ones((nbytes // 4,), dtype="float32")
        procs.ones((1,)).fetch()  # warm up the control path
        rss0 = _hwm()
        v = x.fetch().to_numpy()
        rss1 = _hwm()
        assert v.size == nbytes // 4
    q.put((rss1 - rss0) / nbytes)


def bench_fetch_rss(nbytes: int) -> float:
    """Peak RSS growth of the controller fetching a 64 MiB block, in copies of the block.

    1.0 is the floor (the fetched array itself); what the data plane adds on top
    is the rest.
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_fetch_rss, args=(nbytes, q))
    p.start()
    r = q.get(timeout=300)
    p.join()
    return r


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--sizes", type=int, nargs="*", default=[4, 64], help="MiB per rank")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of shm and shm slots")
    ap.add_argument("--tiny", action="store_true", help="only the 8-byte table")
    ap.add_argument("--interleave", action="store_true",
                    help="only the shm collective against MPI, taken in turn round after round")
    args = ap.parse_args(argv)
    if args.interleave:
        interleave(args.ranks, [s * MiB for s in args.sizes], args.rounds, args.reps)
        return
    sizes = [] if args.tiny else [s * MiB for s in args.sizes]
    if sizes:
        print("| ranks | MiB/rank | shm (ms) | shm slots (ms) | mesharray e2e (ms) | mpi4py Allreduce (ms) "
              "| gloo all_reduce (ms) | shm / mpi | mesharray / mpi | mesharray / gloo |")
        print("|---|---|---|---|---|---|---|---|---|---|")
    tiny = {}
    for n in args.ranks:
        ma_t = bench_mesharray(n, sizes, args.reps)
        ma_tiny = bench_tiny_fetch(n, 300)
        mpi_t = bench_mpi(n, sizes + [8], args.reps) or {}
        gloo_t = bench_gloo(n, sizes + [8], args.reps) or {}
        tiny[n] = (ma_tiny, mpi_t.get(8), gloo_t.get(8))
        for nb in sizes:
            pairs = [(bench_shm(n, nb, args.reps), bench_shm(n, nb, args.reps, single_copy=False))
                     for _ in range(args.rounds)]
            shm_t = float(np.median([a for a, _ in pairs]))
            slot_t = float(np.median([b for _, b in pairs]))
            m, g = mpi_t.get(nb), gloo_t.get(nb)
            nan = float("nan")
            print(f"| {n} | {nb // MiB} | {shm_t * 1e3:.2f} | {slot_t * 1e3:.2f} | {ma_t[nb] * 1e3:.2f} | "
                  f"{m * 1e3 if m else nan:.2f} | {g * 1e3 if g else nan:.2f} | {shm_t / m if m else nan:.2f} | "
                  f"{ma_t[nb] / m if m else nan:.2f} | {ma_t[nb] / g if g else nan:.2f} |")
    print()
    print("| ranks | 8 B: x.sum(axis='procs').fetch() from the controller (µs) | control messages / op "
          "(awaiting a reply) | mpi4py Allreduce (µs) | gloo all_reduce (µs) |")
    print("|---|---|---|---|---|")
    for n, ((a, msgs, calls), m, g) in tiny.items():
        print(f"| {n} | {a * 1e6:.0f} | {msgs:.0f} ({calls:.0f}) | {m * 1e6 if m else float('nan'):.1f} | "
              f"{g * 1e6 if g else float('nan'):.0f} |")
    if args.tiny:
        return
    print()
    gbs, copies = bench_buffer(64 * MiB, args.reps)
    print(f"Buffer.read_into 64 MiB between two processes: {gbs:.2f} GB/s (one-sided; "
          f"destination first-touch adds {copies:.2f} copies of RSS)")
    print(f"peak RSS growth of fetching a 64 MiB block to the controller: {bench_fetch_rss(64 * MiB):.2f} copies")


def interleave(ranks: list[int], sizes: list[int], rounds: int, reps: int) -> None:
    """Each round: the shm collective, mpi4py's Allreduce, the shm collective through its slots.

    On a shared machine the load moves between two runs taken a minute apart;
    taking the three in turn and dividing within each round is what makes
    ``shm / mpi`` comparable.
    """
    print(f"{rounds} rounds of (shm, mpi4py Allreduce, shm slots), {reps} repetitions each, median of "
          f"the rounds; ratios per round")
    print("| ranks | MiB/rank | shm (ms) | shm slots (ms) | mpi4py (ms) | shm / mpi per round | median | slots / mpi |")
    print("|---|---|---|---|---|---|---|---|")
    for n in ranks:
        for nb in sizes:
            rows = []
            for _ in range(rounds):
                a = bench_shm(n, nb, reps)
                m = (bench_mpi(n, [nb], reps) or {}).get(nb, float("nan"))
                b = bench_shm(n, nb, reps, single_copy=False)
                rows.append((a, b, m))
            x = np.array(rows) * 1e3
            per = x[:, 0] / x[:, 2]
            print(f"| {n} | {nb // MiB} | {np.median(x[:, 0]):.2f} | {np.median(x[:, 1]):.2f} | {np.median(x[:, 2]):.2f} "
                  f"| {' '.join(f'{v:.2f}' for v in per)} | {np.median(per):.2f} | {np.median(x[:, 1] / x[:, 2]):.2f} |")


# --- pytest-benchmark cases (make bench) ---------------------------------------------------------


def test_shm_allreduce_2x4mib(benchmark):
    benchmark.pedantic(bench_shm, args=(2, 4 * MiB, 5), rounds=1, iterations=1)


def test_buffer_read_64mib(benchmark):
    benchmark.pedantic(bench_buffer, args=(64 * MiB, 5), rounds=1, iterations=1)


if __name__ == "__main__":
    main()
