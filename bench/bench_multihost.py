"""Across two host ids on this machine: calls, Buffer reads and an allreduce, next to their peers, in one run.

Two host agents (``python -m mesharray host``) on 127.0.0.2 and 127.0.0.3
with host ids ``h0`` and ``h1``: processes of different host ids never share
memory, so everything between them takes the network path (TCP control, the
data plane, the ring between host leaders) — over loopback, on 2 cores.

    python bench/bench_multihost.py              # the whole table (~1 min)
    python bench/bench_multihost.py --reps 5

Rows:

- ``call_one`` no-op p50 to a process of the other host, next to the same call
  on a local mesh (same host: unix socket) in the same run;
- ``Buffer.read_into`` of 64 MiB by an actor of the other host (the stream path,
  several TCP connections at once), next to Monarch's RDMA-over-TCP fallback
  figure (PEERS.md; torchmonarch's RDMABuffer needs its own RDMA build here);
- allreduce of 64 MiB float32 over 2 hosts x 1 process: ``x.sum(axis="hosts")``
  end to end from the controller, the ring alone (two processes, ``TcpPlane``
  links), mpi4py ``Allreduce`` under ``mpirun -n 2 --mca btl self,tcp`` (Open
  MPI over TCP, its shared memory switched off) and gloo ``all_reduce``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)
from _peers import run_mpi  # noqa: E402

MiB = 1 << 20
SECRET = "bench-multihost"


# --- agents ------------------------------------------------------------------------------


def start_agents(n: int = 2) -> list[tuple[subprocess.Popen, str]]:
    env = dict(os.environ, MESHARRAY_SECRET=SECRET)
    out = []
    for i in range(n):
        p = subprocess.Popen([sys.executable, "-m", "mesharray", "host", "--listen", f"tcp://127.0.0.{2 + i}:0",
                              "--host-id", f"h{i}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             env=env)
        assert p.stdout is not None
        out.append((p, p.stdout.readline().strip().rsplit(" ", 1)[1]))
    return out


def stop_agents(agents) -> None:
    for p, _ in agents:
        p.terminate()
    for p, _ in agents:
        p.wait(10)
        if p.stdout:
            p.stdout.close()


def _actor_class():
    import mesharray as ma

    class Bench(ma.Actor):
        @ma.endpoint
        def noop(self) -> None:
            return None

        @ma.endpoint
        def own(self, nbytes: int):
            self.data = np.ones(nbytes, dtype=np.uint8)
            return ma.Buffer(self.data)

        @ma.endpoint
        def read(self, buf, reps: int) -> list:
            dst = np.empty(buf.nbytes, dtype=np.uint8)
            buf.read_into(dst).get()
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                buf.read_into(dst).get()
                times.append(time.perf_counter() - t)
            return times

    return Bench


def _call_p50(actor, reps: int) -> float:
    for _ in range(200):
        actor.noop.call_one().get()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        actor.noop.call_one().get()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def _e2e_allreduce(procs, nbytes: int, reps: int, axis: str) -> float:
    from mesharray.darray import data_context

    x = procs.ones((nbytes // 4,), dtype="float32")
    everyone = data_context(procs).view(list(range(procs.size())))
    warm = x.sum(axis=axis)
    everyone.meta.call(warm._storage.bid).get()
    del warm
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        y = x.sum(axis=axis)
        everyone.meta.call(y._storage.bid).get()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def bench_attached(reps: int, calls: int) -> dict:
    import mesharray as ma

    os.environ["MESHARRAY_SECRET"] = SECRET
    agents = start_agents(2)
    res: dict = {}
    try:
        hosts = ma.attach([u for _, u in agents], transport="tcp")
        procs = hosts.spawn_procs(per_host={"procs": 1})
        b = procs.spawn("bench", _actor_class())
        res["call_one_remote"] = _call_p50(b.slice(hosts=1, procs=0), calls)
        buf = b.slice(hosts=0, procs=0).own.call_one(64 * MiB).get()
        t = b.slice(hosts=1, procs=0).read.call_one(buf, reps).get()
        res["buffer_gbs"] = 64 * MiB / float(np.median(t)) / 1e9
        res["allreduce_e2e"] = _e2e_allreduce(procs, 64 * MiB, reps, "hosts")
        procs.stop()
        hosts.detach()
    finally:
        stop_agents(agents)
    with ma.proc_mesh(procs=2) as local:
        b = local.spawn("bench", _actor_class())
        res["call_one_local"] = _call_p50(b.slice(procs=1), calls)
    return res


# --- the ring alone -----------------------------------------------------------------------------


def _ring_rank(rank: int, nbytes: int, reps: int, addrs, q) -> None:
    from mesharray.collectives.ring import RingCollective
    from mesharray.transport.dataplane import Rendezvous, TcpPlane

    rv = Rendezvous()
    plane = TcpPlane(b"k" * 32, f"127.0.0.{2 + rank}", rv.put)
    addrs[rank] = plane.address
    while len(addrs) < 2:
        time.sleep(0.01)
    right = plane.connect(addrs[1 - rank], f"r{rank}".encode())
    left = rv.take(f"r{1 - rank}".encode(), 30)
    g = RingCollective(rank, 2, right, left)
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
    plane.close()
    q.put((rank, times))


def bench_ring(nbytes: int, reps: int) -> float:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with ctx.Manager() as m:
        addrs = m.dict()
        ps = [ctx.Process(target=_ring_rank, args=(r, nbytes, reps, addrs, q)) for r in range(2)]
        for p in ps:
            p.start()
        res = [q.get(timeout=300) for _ in ps]
        for p in ps:
            p.join()
    return float(np.median(np.max(np.array([t for _, t in res]), axis=0)))


# --- peers --------------------------------------------------------------------------------------


def bench_mpi_tcp(nbytes: int, reps: int) -> float | None:
    res = run_mpi("_mpi_allreduce.py", [reps, nbytes], 2, ("--bind-to", "none", "--mca", "btl", "self,tcp"))
    return None if res is None else float(res[str(nbytes)])


def bench_gloo(nbytes: int, reps: int) -> float | None:
    from bench_collectives import bench_gloo as gloo

    r = gloo(2, [nbytes], reps)
    return None if r is None else r[nbytes]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args(argv)
    a = bench_attached(args.reps, args.calls)
    ring = bench_ring(64 * MiB, args.reps)
    mpi = bench_mpi_tcp(64 * MiB, args.reps)
    gloo = bench_gloo(64 * MiB, args.reps)
    nan = float("nan")
    best = min(x for x in (mpi, gloo) if x) if (mpi or gloo) else None
    print("| what | mesharray, across host ids | peer (same run) | ratio |")
    print("|---|---|---|---|")
    print(f"| call_one no-op p50 | {a['call_one_remote'] * 1e6:.1f} µs | same call on a local mesh "
          f"{a['call_one_local'] * 1e6:.1f} µs | {a['call_one_remote'] / a['call_one_local']:.2f} |")
    print(f"| Buffer.read_into 64 MiB, other host (TCP streams) | {a['buffer_gbs']:.2f} GB/s | Monarch RDMABuffer "
          f"TCP fallback 0.55 GB/s (PEERS.md) | {a['buffer_gbs'] / 0.55:.1f}x |")
    print(f"| allreduce 64 MiB fp32, 2 hosts x 1 proc, x.sum(axis='hosts') end to end | {a['allreduce_e2e'] * 1e3:.1f} ms "
          f"| MPI (btl tcp) {mpi * 1e3 if mpi else nan:.1f} ms; gloo {gloo * 1e3 if gloo else nan:.1f} ms | "
          f"{a['allreduce_e2e'] / best if best else nan:.2f} of the faster |")
    print(f"| same, the ring alone (2 processes, TcpPlane) | {ring * 1e3:.1f} ms | | "
          f"{ring / best if best else nan:.2f} of the faster |")


# --- pytest-benchmark cases (make bench) ----------------------------------------------------------


def test_ring_allreduce_64mib(benchmark):
    benchmark.pedantic(bench_ring, args=(64 * MiB, 3), rounds=1, iterations=1)


if __name__ == "__main__":
    main()
