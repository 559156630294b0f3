"""Interpreter instructions per op of the 8-byte sum, in each process (load-independent).

``x.sum(axis="procs").fetch()`` of a 0-d float64 block on 2 ranks, in a loop: a
``sys.settrace`` opcode counter in the controller's thread, and in each worker's
reader thread (where the system actors' calls run) through a probe actor that
installs the same counter there. The counts do not depend on the machine's load,
so a change to the control path can be judged by them where timings are noisy.

Usage::

    python bench/opcount.py [--ops 500] [--top 0]
    python bench/opcount.py --call8 [--ops 500] [--top 0]   # a no-op call() to 8 actors: controller, a worker
    python bench/opcount.py --call-one [--ops 500] [--top 0] # a no-op call_one(): controller, the worker
"""

from __future__ import annotations

import argparse
import collections
import sys

import numpy as np

import mesharray as ma


def _counter(ops: collections.Counter):
    def trace(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            code = frame.f_code
            ops[f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_name}"] += 1
        return trace
    return trace


class Probe(ma.Actor):
    """Counts the bytecodes its worker's reader thread runs between install and report."""

    @ma.endpoint
    def install(self) -> None:
        self.ops: collections.Counter = collections.Counter()
        trace = _counter(self.ops)
        sys.settrace(trace)  # this thread: the one that runs the system actors' calls too
        frame = sys._getframe(1)
        while frame is not None:  # and the frames already running it (the reader's loop)
            frame.f_trace = trace
            frame.f_trace_opcodes = True
            frame = frame.f_back

    @ma.endpoint
    def report(self) -> dict:
        sys.settrace(None)
        frame = sys._getframe(1)
        while frame is not None:
            frame.f_trace = None
            frame = frame.f_back
        return dict(self.ops)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", type=int, default=500)
    ap.add_argument("--top", type=int, default=0, help="also list each process's N costliest functions")
    ap.add_argument("--call8", action="store_true",
                    help="count a no-op call() to 8 actors (the controller and one worker) instead of the sum")
    ap.add_argument("--call-one", action="store_true", help="the same for a no-op call_one() to one of them")
    args = ap.parse_args(argv)
    n = args.ops
    if args.call8 or args.call_one:
        call8(n, args.top, one=args.call_one)
        return
    with ma.proc_mesh(procs=2) as procs:
        x = procs.full((), 2.0)
        for _ in range(300):  # plans, groups, channels: warm
            x.sum(axis="procs").fetch()
        probe = procs.spawn("opcount_probe", Probe)
        probe.install.call().get()
        mine: collections.Counter = collections.Counter()
        sys.settrace(_counter(mine))
        for _ in range(n):
            x.sum(axis="procs").fetch()
        sys.settrace(None)
        theirs = np.asarray(probe.report.call().get().tolist(), dtype=object).reshape(-1)
    rows = [("controller", mine), ("root worker (rank 0, answers)", theirs[0]), ("other worker (rank 1)", theirs[1])]
    print("| process | bytecodes / op |")
    print("|---|---|")
    for name, ops in rows:
        print(f"| {name} | {sum(ops.values()) / n:,.0f} |")
    for name, ops in rows if args.top else ():
        print(f"\n{name}:")
        for k, v in collections.Counter(ops).most_common(args.top):
            print(f"  {v / n:7.1f}  {k}")


class _Noop(ma.Actor):
    @ma.endpoint
    def ping(self) -> None:
        return None


def call8(n: int, top: int, one: bool = False) -> None:
    """Bytecodes per ``call().get()`` of a no-op endpoint on 8 actors (``one``: per ``call_one().get()``
    to the first): the controller's thread, and the reader thread of one worker (rank 0; each of
    the 8 runs the same). Under the tracer a reply comes late: the caller's polling
    (``MESHARRAY_CALLER_SPIN_US``) finds nothing and it blocks, so the count is that path's."""
    with ma.proc_mesh(procs=8) as procs:
        a = procs.spawn("opcount_noop", _Noop)
        call = a.slice(procs=0).ping.call_one if one else a.ping.call
        for _ in range(300):  # channels, views, the endpoint's Fanout: warm
            call().get()
        probe = procs.spawn("opcount_probe", Probe)
        probe.install.call().get()
        mine: collections.Counter = collections.Counter()
        sys.settrace(_counter(mine))
        for _ in range(n):
            call().get()
        sys.settrace(None)
        theirs = np.asarray(probe.report.call().get().tolist(), dtype=object).reshape(-1)[0]
    what = "call_one()" if one else "call() to 8"
    for name, ops in (("controller", mine), ("worker (rank 0)", theirs)):
        print(f"{name} bytecodes per {what}: {sum(ops.values()) / n:,.0f}")
        for k, v in collections.Counter(ops).most_common(top):
            print(f"  {v / n:7.1f}  {k}")


if __name__ == "__main__":
    main()
