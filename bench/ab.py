"""Before/after on one machine in one run: the control-path figures of two checkouts, interleaved.

Each round runs every checkout once, in a fresh process (``PYTHONPATH`` = that
checkout, its compiled core built in place), in alternating order; the table
gives each figure's median over the rounds and the ratio after/before, so a
noisy machine moves both columns alike. Measures, with the public API only:

- ``socket_p50_us``: the floor: a raw Python unix-socket ping-pong with a forked child.
- ``fanout2_p50_us``, ``fanout8_p50_us``: the floor of a ``call()`` to 2 and 8 processes:
  the same, with 2 and 8 children, 64 bytes sent to each, one ``poll`` loop for the replies.
- ``c_socket_p50_us``, ``c_fanout2_p50_us``, ``c_fanout8_p50_us``: the same three floors with
  no interpreter (``bench/_floor.c``, built with ``cc`` when there is one; measured once per
  round and given to both columns): what the kernel and the machine's wake-ups cost alone.
- ``pyrt1_p50_us``, ``pyrt8_p50_us``: the floor of a *runtime* in Python on both sides: forked
  children that read a frame, parse its header with ``_core.unpack_header``, unpickle the
  arguments, call a function, pickle the result and send it back in a frame; the parent frames
  and pickles a call to 1 or 8 of them and reads every reply in one ``poll`` loop. What any
  design that runs Python per message in the caller and the callee costs at least here.
- ``pyrt_sum_p50_us``: the same with the message pattern of the 8-byte sum: two children get a
  call, meet in shared memory (arrival flags and the reduction with ``_core``'s kernels), and
  only the first one replies, with the sum.
- ``call_one_p50_us``: no-op ``call_one().get()`` to one actor of an 8-process mesh.
- ``call1_p50_us``: ``call().get()`` on the same one-actor slice.
- ``call8_p50_us``: ``call().get()`` on 8 actors (8 processes).
- ``broadcast_per_s``: 5,000 ``broadcast()`` to one actor, then one call to sync.
- ``sum8b_p50_us``: ``x.sum(axis="procs").fetch()`` of a 0-d float64 block on 2 ranks.

Usage (the "before" checkout built with ``python setup.py build_ext --inplace``)::

    git worktree add /tmp/before <commit> && (cd /tmp/before && python setup.py build_ext --inplace)
    python bench/ab.py /tmp/before . --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = r'''
import json, os, pickle, statistics, sys, time
import numpy as np
import mesharray as ma

class Noop(ma.Actor):
    @ma.endpoint
    def ping(self):
        return None

def p50(f, n):
    ts = []
    for _ in range(n):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6

# the raw-socket floors, and the forking helpers the runtime floors below share (bench/_floors.py,
# from the directory of this ab.py: the same floor code measures both checkouts)
sys.path.append(os.environ["AB_BENCH_DIR"])
from _floors import fork_children, poll_of as _poll_of, reap as _reap, socket_floor

def _child_loop(b, body):
    # the least a Python runtime does per message: read a frame, parse its header with the
    # compiled codec, unpickle the arguments, call, pickle the result, frame and send it
    from mesharray._core import pack_header, unpack_header
    buf = bytearray(4096)
    view = memoryview(buf)
    loads, dumps = pickle.loads, pickle.dumps
    while True:
        n = b.recv_into(buf)
        if not n:
            return
        kind, flags, length, msg_id, target, vw = unpack_header(view, 1 << 20, 0)
        res = body(*loads(buf[24:24 + length]))
        if res is not _NO_REPLY:
            out = dumps(res, protocol=5)
            b.send(pack_header(2, 0, len(out), msg_id, 0, 0) + out)

_NO_REPLY = object()

def pyrt_floor(k, n=3000, sum_pattern=False):
    # k forked children running _child_loop; the parent frames and pickles a call to each and
    # reads every reply with one poll loop: the floor of call() to k in Python on both sides.
    # sum_pattern (k=2): the message pattern of the 8-byte x.sum(axis=...).fetch(): both
    # children get a call, meet in shared memory (arrival flags and the reduction with the
    # compiled kernels of mesharray._core), and only the first one replies with the sum.
    import mmap
    from mesharray._core import atomic_load, atomic_store, pack_header, reduce_addresses, unpack_header, wait_flags
    seg = mmap.mmap(-1, 4096 * 4)
    base = np.frombuffer(seg, dtype=np.uint8).ctypes.data
    flags_at, slots = base, [base + 4096 + 64 * j for j in range(k)]
    def serve(j, b):
        if sum_pattern:
            seq = [0]
            mine = np.frombuffer(seg, dtype=np.float64, count=1, offset=4096 + 64 * j)
            res = np.empty(1)
            rbuf = res.ctypes.data

            def body(value, j=j, mine=mine, res=res, rbuf=rbuf, seq=seq):  # (locals: the floor's speed)
                seq[0] += 1
                mine[0] = value
                atomic_store(flags_at + 64 * j, seq[0])
                wait_flags(flags_at, 64, range(k), seq[0], 1.0)
                reduce_addresses(rbuf, slots, 1, "float64", "sum")
                return float(res[0]) if j == 0 else _NO_REPLY
        else:
            def body():
                return None
        _child_loop(b, body)

    socks, pids = fork_children(k, serve)
    p, by_fd = _poll_of(socks)
    buf, ts = bytearray(4096), []
    view = memoryview(buf)
    expect = 1 if sum_pattern else k
    for i in range(n):
        t = time.perf_counter()
        payload = pickle.dumps((2.0,) if sum_pattern else (), protocol=5)
        for s in socks:
            s.send(pack_header(1, 1, len(payload), i + 1, 0, 0) + payload)
        left = expect
        while left:
            for fd, _ in p.poll():
                by_fd[fd].recv_into(buf)
                kind, flags, length, msg_id, target, vw = unpack_header(view, 1 << 20, 0)
                pickle.loads(buf[24:24 + length])
                left -= 1
        ts.append(time.perf_counter() - t)
    return _reap(socks, pids, ts)

out = {"socket_p50_us": socket_floor(), "fanout2_p50_us": socket_floor(2), "fanout8_p50_us": socket_floor(8, 1500),
       "pyrt1_p50_us": pyrt_floor(1), "pyrt8_p50_us": pyrt_floor(8, 1500),
       "pyrt_sum_p50_us": pyrt_floor(2, sum_pattern=True)}
with ma.proc_mesh(procs=8) as procs:
    a = procs.spawn("noop", Noop)
    one = a.slice(procs=1)
    for _ in range(200):
        one.ping.call_one().get(); one.ping.call().get(); a.ping.call().get()
    out["call_one_p50_us"] = p50(lambda: one.ping.call_one().get(), 3000)
    out["call1_p50_us"] = p50(lambda: one.ping.call().get(), 3000)
    out["call8_p50_us"] = p50(lambda: a.ping.call().get(), 600)
    t = time.perf_counter()
    for _ in range(5000):
        one.ping.broadcast()
    one.ping.call_one().get()
    out["broadcast_per_s"] = 5000 / (time.perf_counter() - t)
with ma.proc_mesh(procs=2) as procs:
    x = procs.full((), 2.0)
    for _ in range(50):
        x.sum(axis="procs").fetch()
    out["sum8b_p50_us"] = p50(lambda: x.sum(axis="procs").fetch(), 600)
print("AB-JSON " + json.dumps(out))
'''


#: each figure against the raw-socket floor of the same message pattern (ratios per round)
FLOORS = [("call_one_p50_us", "socket_p50_us"), ("call1_p50_us", "socket_p50_us"),
          ("call8_p50_us", "fanout8_p50_us"), ("sum8b_p50_us", "fanout2_p50_us"),
          ("call8_p50_us", "c_fanout8_p50_us"), ("sum8b_p50_us", "c_fanout2_p50_us"),
          ("call_one_p50_us", "pyrt1_p50_us"), ("call8_p50_us", "pyrt8_p50_us"),
          ("sum8b_p50_us", "pyrt_sum_p50_us")]


def build_c_floor(tmp: str) -> str | None:
    """``bench/_floor.c`` compiled into ``tmp``; None without a C compiler (the C floors are left out)."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None
    exe = os.path.join(tmp, "floor")
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_floor.c")
    r = subprocess.run([cc, "-O2", "-o", exe, src], capture_output=True, text=True)
    return exe if r.returncode == 0 else None


def c_floors(exe: str) -> dict:
    out = {}
    for key, k, n in (("c_socket_p50_us", 1, 3000), ("c_fanout2_p50_us", 2, 3000), ("c_fanout8_p50_us", 8, 1500)):
        r = subprocess.run([exe, str(k), str(n)], capture_output=True, text=True, timeout=120, check=True)
        out[key] = float(r.stdout.strip())
    return out


def run(checkout: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(checkout),
           "AB_BENCH_DIR": os.path.dirname(os.path.abspath(__file__))}
    r = subprocess.run([sys.executable, "-c", CHILD], cwd=checkout, env=env, capture_output=True, text=True,
                       timeout=300)
    for line in r.stdout.splitlines():
        if line.startswith("AB-JSON "):
            return json.loads(line[8:])
    raise RuntimeError(f"{checkout}: no figures\n{r.stdout}\n{r.stderr}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="mesharray-ab-") as tmp:
        exe = build_c_floor(tmp)
        for i in range(args.rounds):
            order = [("before", args.before), ("after", args.after)]
            floors = c_floors(exe) if exe else {}
            for name, path in order if i % 2 == 0 else order[::-1]:
                runs[name].append({**floors, **run(path)})
            print(f"round {i + 1}/{args.rounds} done", file=sys.stderr)
    print(f"| figure | before | after | after/before |  ({args.rounds} interleaved rounds, medians)")
    print("|---|---|---|---|")
    for key in runs["before"][0]:
        b = statistics.median(r[key] for r in runs["before"])
        a = statistics.median(r[key] for r in runs["after"])
        print(f"| {key} | {b:.1f} | {a:.1f} | {a / b:.2f} |")
    print()
    print("| figure / its floor in the same run | before | after |")
    print("|---|---|---|")
    for key, floor in FLOORS:
        if floor not in runs["before"][0]:
            continue
        b = statistics.median(r[key] / r[floor] for r in runs["before"])
        a = statistics.median(r[key] / r[floor] for r in runs["after"])
        print(f"| {key} / {floor} | {b:.2f} | {a:.2f} |")


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"({time.time() - t0:.0f} s)", file=sys.stderr)
