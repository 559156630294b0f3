"""Run a function in N real processes (spawn context) under one deadline; never hang."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
import traceback


def _entry(fn, rank, size, args, q):
    try:
        q.put((rank, "ok", fn(rank, size, *args)))
    except BaseException as exc:  # forward the child's traceback to the test
        q.put((rank, "err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_ranks(fn, size, *args, timeout=60.0, expect_exit=None):
    """Run ``fn(rank, size, *args)`` in ``size`` spawned processes; return results by rank.

    Children that do not report by the deadline are killed and the call raises.
    ``expect_exit`` names ranks allowed to die without reporting.
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(fn, r, size, args, q), daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    want = size - len(expect_exit or ())
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < want:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"ranks {sorted(set(range(size)) - set(results) - set(errors))} did not report in {timeout} s")
            try:
                rank, kind, value = q.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            (results if kind == "ok" else errors)[rank] = value
    finally:
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        q.close()
        q.join_thread()
    if errors:
        raise AssertionError("\n".join(f"rank {r}: {e}" for r, e in sorted(errors.items())))
    return [results.get(r) for r in range(size)]
