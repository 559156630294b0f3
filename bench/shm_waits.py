"""What waiting costs the members of a crowded shared-memory group: CPU per waiting member per second.

A local mesh of 64 processes (on a 2-core machine: 32 members a CPU, so every
wait sleeps, ``ShmCollective._wait_sleeping`` and the host rounds' futex) makes
a group by hand, with its last member ``--delay`` seconds late, then runs one
1-element reduction with the same member late again. The other 63 wait; their
CPU over the wait (``/proc/PID/stat``, every thread) is divided by the wait and
by the members. For scale, the same members asleep in an endpoint.

At 1,024 ranks (16 hosts of 64) every member waits like this while the first sum
makes the groups: a cost per member-second that 1,024 members pay at once takes
the CPUs from the members they wait for.

    python bench/shm_waits.py            # 3 rounds, a member 4 s late

To compare with another commit, build it in a worktree and run this script from
outside both checkouts with ``PYTHONPATH`` pointing at each, alternating.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import mesharray as ma  # noqa: E402

HZ = os.sysconf("SC_CLK_TCK")


def _cpu(pids: list[int]) -> float:
    total = 0
    for p in pids:
        with open(f"/proc/{p}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / HZ


def _per_member_second(pids: list[int], members: int, run) -> float:
    """ms of CPU per member per second of ``run()``."""
    c0, t0 = _cpu(pids), time.perf_counter()
    run()
    return (_cpu(pids) - c0) / (time.perf_counter() - t0) / members * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--procs", type=int, default=64)
    ap.add_argument("--delay", type=float, default=4.0, help="seconds the last member is late")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    import importlib

    waiter = importlib.import_module("_waits_actor").Waiter
    n, late = args.procs, args.procs - 1
    procs = ma.proc_mesh(procs=n)
    out: dict[str, list[float]] = {"join": [], "reduction": [], "asleep": []}
    try:
        w = procs.spawn("waiter", waiter)
        pids = list(procs.pids)
        for i in range(args.rounds):
            name = f"ma-waits-{os.getpid()}-{i}"
            out["join"].append(_per_member_second(pids, n - 1, lambda name=name: w.join.call(name, pids, late, args.delay).get(timeout=120)))
            out["reduction"].append(_per_member_second(pids, n - 1, lambda: w.reduce.call(late, args.delay).get(timeout=120)))
            w.close.call().get(timeout=60)
            out["asleep"].append(_per_member_second(pids, n, lambda: w.sleep.call(args.delay).get(timeout=120)))
            print(", ".join(f"{k} {v[-1]:.2f}" for k, v in out.items()) + " ms of CPU per member per s", flush=True)
    finally:
        procs.stop()
    print(f"\n{n} members on {os.cpu_count()} CPUs, median of {args.rounds}: " +
          ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in out.items()) + " ms per member per s")


if __name__ == "__main__":
    main()
