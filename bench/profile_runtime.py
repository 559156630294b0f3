"""Per-call work of the actor runtime's round trips: Python calls, CPU time, wall time.

Wall time is noisy on a shared machine; CPU time per call (controller and
workers, idle rate subtracted) and Python-level calls per call (``sys.setprofile``
on both sides) move much less. Run from the repository root::

    python bench/profile_runtime.py

Instructions per call of the controller process (all its threads), with
valgrind: run the same script twice with different call counts and divide the
difference (workers run natively)::

    valgrind --tool=callgrind python bench/profile_runtime.py --calls 200 --only one
    valgrind --tool=callgrind python bench/profile_runtime.py --calls 1200 --only one
    # (collected_1200 - collected_200) / 1000 = instructions per call_one
"""

from __future__ import annotations

import argparse
import collections
import os
import resource
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import mesharray as ma  # noqa: E402


class Prof(ma.Actor):
    @ma.endpoint
    def noop(self):
        pass

    @ma.endpoint
    def pid(self):
        return os.getpid()

    @ma.endpoint
    def prof_on(self):
        counts = collections.Counter()
        Prof.counts = counts
        sys.setprofile(_hook(counts))  # this reader thread's next calls are counted

    @ma.endpoint
    def prof_off(self):
        sys.setprofile(None)
        return dict(Prof.counts)


def _hook(counts):
    def hook(frame, event, arg):
        if event == "call":
            counts["py"] += 1
        elif event == "c_call":
            counts["c"] += 1
    return hook


def _cpu(pids):
    import psutil

    r = resource.getrusage(resource.RUSAGE_SELF)
    w = sum(sum(psutil.Process(p).cpu_times()[:2]) for p in pids)
    return r.ru_utime + r.ru_stime, w


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=0, help="only run this many calls (for callgrind)")
    ap.add_argument("--only", choices=["one", "eight"], default="one")
    a = ap.parse_args(argv)
    with ma.proc_mesh(hosts=1, procs=8, forward_logs=False) as procs:
        actors = procs.spawn("prof", Prof)
        actors.noop.call().get()
        one = actors.slice(procs=0)
        ep, e8 = one.noop, actors.noop
        for _ in range(200):
            ep.call_one().get()
            e8.call().get()
        if a.calls:
            fn = (lambda: ep.call_one().get()) if a.only == "one" else (lambda: e8.call().get())
            for _ in range(a.calls):
                fn()
            return 0
        n = 200
        c = collections.Counter()
        sys.setprofile(_hook(c))
        for _ in range(n):
            ep.call_one().get()
        sys.setprofile(None)
        one.prof_on.call_one().get()
        for _ in range(n):
            ep.call_one().get()
        w = one.prof_off.call_one().get()
        print(f"call_one: controller {c['py'] / n:.1f} Python + {c['c'] / n:.1f} C calls, "
              f"worker {w.get('py', 0) / n:.1f} Python + {w.get('c', 0) / n:.1f} C calls")
        c = collections.Counter()
        sys.setprofile(_hook(c))
        for _ in range(n):
            e8.call().get()
        sys.setprofile(None)
        print(f"call() on 8: controller {c['py'] / n:.1f} Python + {c['c'] / n:.1f} C calls")
        pids = [int(p) for row in actors.pid.call().get().tolist() for p in row]
        c0, w0 = _cpu(pids)
        time.sleep(1.0)
        c1, w1 = _cpu(pids)
        idle_c, idle_w = c1 - c0, w1 - w0
        for name, k, fn in (("call_one", 4000, lambda: ep.call_one().get()),
                            ("call() on 8", 1000, lambda: e8.call().get())):
            best = None
            for _ in range(3):
                c0, w0 = _cpu(pids)
                t = time.perf_counter()
                for _ in range(k):
                    fn()
                wall = time.perf_counter() - t
                c1, w1 = _cpu(pids)
                v = ((c1 - c0 - idle_c * wall) / k * 1e6, (w1 - w0 - idle_w * wall) / k * 1e6, wall / k * 1e6)
                best = v if best is None or v[0] + v[1] < best[0] + best[1] else best
            print(f"{name}: CPU controller {best[0]:.1f} µs + workers {best[1]:.1f} µs per call "
                  f"(workers: 10 ms clock ticks), wall {best[2]:.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
