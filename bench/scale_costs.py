"""Where the CPU of a many-host mesh goes, process by process: a worker's start, a ``call()`` to all, rest.

``bench_scale.py`` gives the wall times; this gives the CPU behind them, from
``/proc`` (every thread's ``schedstat``, page faults from ``stat``), so that two
trees can be compared on a noisy machine by what each process spent:

- ``start``: per worker, from fork to the first call's reply: CPU, minor page
  faults, threads;
- ``calls``: per ``call()`` to all ranks, the relays', the workers' and the
  controller's CPU (per rank for the first two), and the p50 wall time;
- ``sums``: the same per 1-element ``x.sum().fetch()`` over all ranks;
- ``idle``: with the mesh at rest, a worker's heartbeat thread's CPU per beat and
  the share of one core the workers, the relays and the whole machine use.

Sixteen agents as in ``bench_scale.py`` (``--hosts``, 64 processes each)::

    python bench/scale_costs.py start --hosts 4
    python bench/scale_costs.py calls --hosts 16 --seconds 8
    python bench/scale_costs.py sums --hosts 16 --seconds 8
    python bench/scale_costs.py idle --hosts 16 --seconds 8

To compare with another commit, build it in a worktree and run this script with
``PYTHONPATH`` pointing there, alternating the two.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_scale as bs  # noqa: E402

import mesharray as ma  # noqa: E402

HZ = os.sysconf("SC_CLK_TCK")


class Probe(ma.Actor):
    @ma.endpoint
    def noop(self) -> None:
        return None

    @ma.endpoint
    def heartbeat_tid(self) -> int:
        import threading

        return next(t.native_id for t in threading.enumerate() if t.name == "mesharray-heartbeat")


def _cpu(pid: int, tid: int | None = None) -> float:
    """Seconds of CPU of ``pid``'s live threads (or of thread ``tid`` alone)."""
    tids = [str(tid)] if tid is not None else os.listdir(f"/proc/{pid}/task")
    total = 0
    for t in tids:
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:
            pass
    return total / 1e9


def _faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def _machine() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (v[0] + v[1] + v[2]) / HZ


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/children") as f:
                out += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return out


def _relays(agents, workers: set[int]) -> list[int]:
    zygotes = [c for p, _ in agents for c in _children(p.pid)]
    return [c for z in zygotes for c in _children(z) if c not in workers]


def start(procs, b) -> str:
    pids = list(procs.pids)
    cpu = [_cpu(p) * 1e3 for p in pids]
    faults = [_faults(p) for p in pids]
    threads = [len(os.listdir(f"/proc/{p}/task")) for p in pids]
    return (f"per worker, fork to first reply: CPU {statistics.median(cpu):.2f} ms (median), "
            f"minor faults {statistics.median(faults):.0f}, threads {statistics.median(threads):.0f}")


def _per_op(what: str, op, procs, agents, seconds: float) -> str:
    """The p50 wall of ``op`` and the relays', workers' and controller's CPU per run of it."""
    workers = set(procs.pids)
    relays = _relays(agents, workers)
    for _ in range(50):
        op()
    r0, w0, c0 = sum(map(_cpu, relays)), sum(map(_cpu, workers)), time.process_time()
    walls = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        t = time.perf_counter()
        op()
        walls.append(time.perf_counter() - t)
    r1, w1, c1 = sum(map(_cpu, relays)), sum(map(_cpu, workers)), time.process_time()
    n, ranks = len(walls), len(workers)
    return (f"per {what}: p50 {statistics.median(walls) * 1e3:.1f} ms; relays "
            f"{(r1 - r0) / n / ranks * 1e6:.1f} us/rank, workers {(w1 - w0) / n / ranks * 1e6:.1f} us/rank, "
            f"controller {(c1 - c0) / n * 1e3:.2f} ms ({n} runs)")


def calls(procs, b, agents, seconds: float) -> str:
    return _per_op("call() to all", lambda: b.noop.call().get(timeout=60), procs, agents, seconds)


def sums(procs, agents, seconds: float) -> str:
    x = procs.ones(())
    return _per_op("1-element sum", lambda: float(x.sum().fetch()), procs, agents, seconds)


def idle(procs, b, agents, seconds: float) -> str:
    pids = list(procs.pids)
    tids = [int(t) for t in b.heartbeat_tid.call().get(timeout=60).to_numpy().ravel()]
    relays = _relays(agents, set(pids))
    time.sleep(2.0)
    h0 = [_cpu(p, t) for p, t in zip(pids, tids)]
    r0, w0, m0 = sum(map(_cpu, relays)), sum(map(_cpu, pids)), _machine()
    time.sleep(seconds)
    h1 = [_cpu(p, t) for p, t in zip(pids, tids)]
    r1, w1, m1 = sum(map(_cpu, relays)), sum(map(_cpu, pids)), _machine()
    beats = seconds / 0.5  # (the default heartbeat_interval)
    per_beat = statistics.median((y - x) / beats * 1e6 for x, y in zip(h0, h1))
    return (f"at rest for {seconds:g} s: a heartbeat {per_beat:.1f} us of its thread (median); share of one "
            f"core: workers {(w1 - w0) / seconds * 100:.1f} %, relays {(r1 - r0) / seconds * 100:.1f} %, "
            f"the machine {(m1 - m0) / seconds * 100:.1f} % (of {os.cpu_count() * 100} %)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["start", "calls", "sums", "idle"])
    ap.add_argument("--hosts", type=int, default=16, help="agents of 64 processes each")
    ap.add_argument("--seconds", type=float, default=8.0)
    args = ap.parse_args(argv)
    os.environ["MESHARRAY_SECRET"] = bs.SECRET
    agents = bs.start_agents(args.hosts)
    try:
        hosts = ma.attach([u for _, u in agents], transport="tcp", timeout=120)
        time.sleep(3.0)  # (the agents start their zygotes at the attach)
        t0 = time.perf_counter()
        procs = hosts[0:args.hosts].spawn_procs(per_host={"procs": bs.PER_HOST})
        b = procs.spawn("probe", Probe)
        b.noop.call().get(timeout=120)
        spawn = time.perf_counter() - t0
        try:
            if args.what == "start":
                out = start(procs, b)
            elif args.what == "calls":
                out = calls(procs, b, agents, args.seconds)
            elif args.what == "sums":
                out = sums(procs, agents, args.seconds)
            else:
                out = idle(procs, b, agents, args.seconds)
            print(f"{args.hosts * bs.PER_HOST} ranks (spawn + first call {spawn:.2f} s): {out}")
        finally:
            procs.stop()
    finally:
        bs.stop_agents(agents)


if __name__ == "__main__":
    main()
