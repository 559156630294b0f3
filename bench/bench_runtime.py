"""Actor-runtime benchmarks: mesharray against torchmonarch 0.7.0, same machine, same run.

Run the comparison table (each system in its own subprocess, so that one
cannot disturb the other)::

    python bench/bench_runtime.py            # both systems, a table with ratios
    python bench/bench_runtime.py --quick    # fewer rounds
    python bench/bench_runtime.py --system mesharray --json   # one system, raw JSON

torchmonarch 0.7.0 needs cloudpickle >= 2.2; where the environment has an
older one, install a newer one aside and point ``BENCH_PEER_PYTHONPATH`` at it
(only the peer's subprocess sees it)::

    pip install --target /tmp/peer-deps "cloudpickle>=3"
    BENCH_PEER_PYTHONPATH=/tmp/peer-deps python bench/bench_runtime.py

``pytest bench --benchmark-only`` runs the mesharray cases through
pytest-benchmark as well. torchmonarch is never a dependency of mesharray: if
it does not import, its column says why.

Cases (what each figure is):

- ``call_one_p50_us`` / ``call_one_p99_us``: no-op ``call_one().get()`` round trip to one actor.
- ``call8_p50_us``: ``call().get()`` on 8 actors (8 processes), median.
- ``pipelined_per_s``: 5,000 ``call_one()`` sent back to back, then all awaited.
- ``broadcast_per_s``: 5,000 ``broadcast()`` to one actor, then one call to sync.
- ``spawn16_s``: start 16 processes, spawn an actor on each, first ``call()`` answered.
- ``kill_to_error_s``: SIGKILL a worker with a call pending; time until the caller
  sees the error.
- ``rt16mib_gbps``: 16 MiB float32 array sent to an actor and returned; 16 MiB / round trip.
- ``rt16mib_new_gbps``: the same, but the actor returns ``x + 1`` (a new array).
- ``rt16mib_torch_gbps``: a 16 MiB CPU float32 ``torch.Tensor`` sent to an actor and returned.
- ``call_vs_size_us``: ``call().get()`` median on 1, 2, 4, 8, 16, 32 actors.
- ``socket_p50_us`` / ``fanout8_p50_us``: the machine's floor in the same run (``bench/_floors.py``):
  a raw Python unix-socket round trip of 64 bytes with one forked child, and with 8 (answers
  read in one ``poll`` loop); the table gives ``call_one`` and ``call()`` on 8 against them.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MIB16 = 4 << 20  # float32 elements in 16 MiB
if ROOT not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, ROOT)
if HERE not in sys.path:  # (bench/_floors.py)
    sys.path.insert(0, HERE)


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _rt(ep, x, rounds: int) -> float:
    """GB/s of a 16 MiB round trip through ``ep`` (16 MiB / median round trip)."""
    ep.call_one(x).get()
    ts = []
    for _ in range(rounds):
        t = time.perf_counter()
        y = ep.call_one(x).get()
        ts.append(time.perf_counter() - t)
        del y
    return (MIB16 * 4) / statistics.median(ts) / 1e9


def _torch_rt(ep, rounds: int):
    """GB/s of a 16 MiB CPU float32 torch tensor round trip (the actor returns it); None without torch."""
    try:
        import torch
    except ImportError:
        return None
    xt = torch.ones(MIB16, dtype=torch.float32)
    y = ep.call_one(xt).get()
    if not torch.equal(y, xt):
        raise AssertionError("the tensor came back changed")
    return _rt(ep, xt, rounds)


# --------------------------------------------------------------------------- mesharray
def _ma_actor():
    import mesharray as ma

    class Bench(ma.Actor):
        @ma.endpoint
        def noop(self):
            return None

        @ma.endpoint
        def echo(self, x):
            return x

        @ma.endpoint
        def plus1(self, x):
            return x + 1

        @ma.endpoint
        def pid(self):
            return os.getpid()

        @ma.endpoint
        def sleep(self, s):
            time.sleep(s)

    return ma, Bench


def run_mesharray(quick: bool) -> dict:
    ma, Bench = _ma_actor()
    n_lat = 1000 if quick else 3000
    out: dict = {}
    # spawn 16 + first call, measured first while the machine is least warm
    t0 = time.perf_counter()
    procs = ma.proc_mesh(hosts=1, procs=16, forward_logs=False)
    a = procs.spawn("b", Bench)
    a.noop.call().get()
    out["spawn16_s"] = time.perf_counter() - t0
    try:
        one = a.slice(procs=0)
        ep = one.noop
        for _ in range(200):
            ep.call_one().get()
        ts = []
        for _ in range(n_lat):
            t = time.perf_counter()
            ep.call_one().get()
            ts.append(time.perf_counter() - t)
        out["call_one_p50_us"] = _pct(ts, 0.5) * 1e6
        out["call_one_p99_us"] = _pct(ts, 0.99) * 1e6
        eight = a[0, :8].noop
        ts = []
        for _ in range(n_lat // 3):
            t = time.perf_counter()
            eight.call().get()
            ts.append(time.perf_counter() - t)
        out["call8_p50_us"] = _pct(ts, 0.5) * 1e6
        n = 5000
        best = 0.0
        for _ in range(3):
            t = time.perf_counter()
            futs = [ep.call_one() for _ in range(n)]
            for f in futs:
                f.get()
            best = max(best, n / (time.perf_counter() - t))
        out["pipelined_per_s"] = best
        best = 0.0
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(n):
                ep.broadcast()
            ep.call_one().get()
            best = max(best, n / (time.perf_counter() - t))
        out["broadcast_per_s"] = best
        x = np.ones(MIB16, dtype=np.float32)
        echo = one.echo
        echo.call_one(x).get()
        ts = []
        for _ in range(5 if quick else 20):
            t = time.perf_counter()
            y = echo.call_one(x).get()
            ts.append(time.perf_counter() - t)
            del y
        out["rt16mib_gbps"] = (MIB16 * 4) / statistics.median(ts) / 1e9
        out["rt16mib_new_gbps"] = _rt(one.plus1, x, 5 if quick else 20)
        out["rt16mib_torch_gbps"] = _torch_rt(echo, 5 if quick else 20)
        sizes = {}
        for k in (1, 2, 4, 8, 16):
            e = a[0, :k].noop
            ts = []
            for _ in range(100 if quick else 300):
                t = time.perf_counter()
                e.call().get()
                ts.append(time.perf_counter() - t)
            sizes[k] = _pct(ts, 0.5) * 1e6
    finally:
        procs.stop()
    with ma.proc_mesh(hosts=1, procs=32, forward_logs=False) as p32:
        e = p32.spawn("b", Bench).noop
        e.call().get()
        ts = []
        for _ in range(100 if quick else 300):
            t = time.perf_counter()
            e.call().get()
            ts.append(time.perf_counter() - t)
        sizes[32] = _pct(ts, 0.5) * 1e6
    out["call_vs_size_us"] = sizes
    # SIGKILL -> error at a pending caller
    lat = []
    for _ in range(3):
        with ma.proc_mesh(hosts=1, procs=2, forward_logs=False) as p:
            b = p.spawn("b", Bench).slice(procs=1)
            pid = b.pid.call_one().get()
            fut = b.sleep.call_one(60)
            time.sleep(0.05)
            t = time.perf_counter()
            os.kill(pid, signal.SIGKILL)
            try:
                fut.get(timeout=30)
            except ma.ActorDiedError:
                pass
            lat.append(time.perf_counter() - t)
    out["kill_to_error_s"] = statistics.median(lat)
    # what the machine allows, in the same run: raw Python socket round trips (bench/_floors.py)
    from _floors import socket_floor

    out["socket_p50_us"] = socket_floor(1, 1000 if quick else 3000)
    out["fanout8_p50_us"] = socket_floor(8, 600 if quick else 1500)
    return out


# --------------------------------------------------------------------------- torchmonarch
MONARCH_ACTOR = '''
import os, time
from monarch.actor import Actor, endpoint


class Bench(Actor):
    @endpoint
    def noop(self):
        return None

    @endpoint
    def echo(self, x):
        return x

    @endpoint
    def plus1(self, x):
        return x + 1

    @endpoint
    def pid(self):
        return os.getpid()

    @endpoint
    def sleep(self, s):
        time.sleep(s)
'''


def run_monarch(quick: bool) -> dict:
    import tempfile

    d = tempfile.mkdtemp(prefix="bench-monarch-")
    with open(os.path.join(d, "monarch_bench_actor.py"), "w") as f:
        f.write(MONARCH_ACTOR)
    sys.path.insert(0, d)
    os.environ["PYTHONPATH"] = d + os.pathsep + os.environ.get("PYTHONPATH", "")
    import cloudpickle

    if not hasattr(cloudpickle.cloudpickle, "_function_getstate"):
        raise RuntimeError(f"torchmonarch 0.7.0 needs cloudpickle >= 2.2 (this environment has "
                           f"{cloudpickle.__version__}); point BENCH_PEER_PYTHONPATH at a newer one")
    from monarch.actor import this_host
    from monarch_bench_actor import Bench

    n_lat = 300 if quick else 1000
    out: dict = {}
    t0 = time.perf_counter()
    procs = this_host().spawn_procs(per_host={"procs": 16})
    a = procs.spawn("b", Bench)
    a.noop.call().get()
    out["spawn16_s"] = time.perf_counter() - t0
    one = a.slice(procs=0)
    ep = one.noop
    for _ in range(50):
        ep.call_one().get()
    ts = []
    for _ in range(n_lat):
        t = time.perf_counter()
        ep.call_one().get()
        ts.append(time.perf_counter() - t)
    out["call_one_p50_us"] = _pct(ts, 0.5) * 1e6
    out["call_one_p99_us"] = _pct(ts, 0.99) * 1e6
    eight = a.slice(procs=slice(0, 8)).noop
    ts = []
    for _ in range(n_lat // 3):
        t = time.perf_counter()
        eight.call().get()
        ts.append(time.perf_counter() - t)
    out["call8_p50_us"] = _pct(ts, 0.5) * 1e6
    n = 2000 if quick else 5000
    t = time.perf_counter()
    futs = [ep.call_one() for _ in range(n)]
    for f in futs:
        f.get()
    out["pipelined_per_s"] = n / (time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(n):
        ep.broadcast()
    ep.call_one().get()
    out["broadcast_per_s"] = n / (time.perf_counter() - t)
    x = np.ones(MIB16, dtype=np.float32)
    one.echo.call_one(x).get()
    ts = []
    for _ in range(5 if quick else 10):
        t = time.perf_counter()
        one.echo.call_one(x).get()
        ts.append(time.perf_counter() - t)
    out["rt16mib_gbps"] = (MIB16 * 4) / statistics.median(ts) / 1e9
    out["rt16mib_new_gbps"] = _rt(one.plus1, x, 5 if quick else 10)
    out["rt16mib_torch_gbps"] = _torch_rt(one.echo, 5 if quick else 10)
    sizes = {}
    for k in (1, 2, 4, 8, 16):
        e = a.slice(procs=slice(0, k)).noop
        ts = []
        for _ in range(50 if quick else 100):
            t = time.perf_counter()
            e.call().get()
            ts.append(time.perf_counter() - t)
        sizes[k] = _pct(ts, 0.5) * 1e6
    out["call_vs_size_us"] = sizes
    # SIGKILL -> error at a pending caller (Monarch polls; cap the wait at 30 s). Its
    # default fault hook would raise KeyboardInterrupt in the main thread: record it instead.
    import monarch.actor as mactor

    hook_at: list = []
    mactor.unhandled_fault_hook = lambda failure: hook_at.append(time.perf_counter())
    b = a.slice(procs=1)
    pid = b.pid.call_one().get()
    fut = b.sleep.call_one(60)
    time.sleep(0.05)
    t = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    try:
        fut.get(timeout=30)
        end = time.perf_counter()
    except TimeoutError:
        end = float("inf")
    except BaseException:
        end = time.perf_counter()
    if hook_at:
        end = min(end, hook_at[0])
    out["kill_to_error_s"] = end - t
    os._exit(_emit(out))  # Monarch's runtime may not shut down cleanly after a death


def _emit(out: dict) -> int:
    sys.stdout.write("BENCH-JSON " + json.dumps(out) + "\n")
    sys.stdout.flush()
    return 0


# --------------------------------------------------------------------------- driver
ROWS = [
    ("call_one no-op round trip, p50", "call_one_p50_us", "µs", False),
    ("call_one no-op round trip, p99", "call_one_p99_us", "µs", False),
    ("call() on 8 actors, p50", "call8_p50_us", "µs", False),
    ("pipelined call_one (5,000)", "pipelined_per_s", "calls/s", True),
    ("broadcast to one actor (5,000)", "broadcast_per_s", "msg/s", True),
    ("spawn 16 procs + first call", "spawn16_s", "s", False),
    ("SIGKILL -> error at pending caller", "kill_to_error_s", "s", False),
    ("16 MiB round trip (actor returns its argument)", "rt16mib_gbps", "GB/s", True),
    ("16 MiB round trip (actor returns x + 1)", "rt16mib_new_gbps", "GB/s", True),
    ("16 MiB CPU torch tensor round trip (echo)", "rt16mib_torch_gbps", "GB/s", True),
]


def _child(system: str, quick: bool) -> dict | str:
    cmd = [sys.executable, os.path.abspath(__file__), "--system", system, "--json"] + (["--quick"] if quick else [])
    path = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    if system == "monarch" and os.environ.get("BENCH_PEER_PYTHONPATH"):
        # packages only the peer needs (e.g. a newer cloudpickle), kept out of mesharray's run
        path = os.environ["BENCH_PEER_PYTHONPATH"] + os.pathsep + path
    env = dict(os.environ, PYTHONPATH=path)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return "timed out after 600 s"
    for line in r.stdout.splitlines():
        if line.startswith("BENCH-JSON "):
            return json.loads(line[len("BENCH-JSON "):])
    tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
    return "failed: " + " | ".join(tail)


def _fmt(v, unit):
    if v is None:
        return "—"
    if v == float("inf"):
        return "> 30 s"
    if unit == "s":
        return f"{v:.3f} s"
    if unit == "GB/s":
        return f"{v:.2f} GB/s"
    if unit in ("calls/s", "msg/s"):
        return f"{v / 1000:.1f}k/s"
    return f"{v:.0f} µs"


def table(ours: dict, peer) -> str:
    lines = ["| case | mesharray | torchmonarch 0.7.0 | ratio (better = >1) |", "|---|---|---|---|"]
    for label, key, unit, higher in ROWS:
        a = ours.get(key)
        b = peer.get(key) if isinstance(peer, dict) else None
        if a and b and b != float("inf"):
            ratio = f"{(a / b if higher else b / a):.1f}×"
        elif b == float("inf"):
            ratio = "> " + f"{30 / a:.0f}×"
        else:
            ratio = "—"
        lines.append(f"| {label} | {_fmt(a, unit)} | {_fmt(b, unit)} | {ratio} |")
    lines.append("")
    lines.append("| call() latency vs mesh size | " + " | ".join(str(k) for k in (1, 2, 4, 8, 16, 32)) + " |")
    lines.append("|---" * 7 + "|")
    for name, res in (("mesharray", ours), ("torchmonarch", peer)):
        s = res.get("call_vs_size_us", {}) if isinstance(res, dict) else {}
        s = {int(k): v for k, v in s.items()}
        lines.append(f"| {name} | " + " | ".join(f"{s[k]:.0f} µs" if k in s else "—" for k in (1, 2, 4, 8, 16, 32)) + " |")
    if ours.get("socket_p50_us"):
        lines.append("")
        lines.append("| the machine's floor, same run: raw Python unix-socket round trips (bench/_floors.py) "
                     "| p50 | mesharray / floor |")
        lines.append("|---|---|---|")
        for label, key, what in (("64 B to one forked child and back", "socket_p50_us", "call_one_p50_us"),
                                 ("64 B to 8 forked children, the 8 answers read in one poll loop",
                                  "fanout8_p50_us", "call8_p50_us")):
            floor, mine = ours[key], ours.get(what)
            ratio = f"{what.split('_p50')[0]}: {mine / floor:.2f}×" if mine else "—"
            lines.append(f"| {label} | {floor:.1f} µs | {ratio} |")
    if not isinstance(peer, dict):
        lines.append("")
        lines.append(f"torchmonarch skipped: {peer}")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", choices=["mesharray", "monarch", "both"], default="both")
    ap.add_argument("--json", action="store_true", help="print one system's raw figures")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.json:
        if args.system == "mesharray":
            return _emit(run_mesharray(args.quick))
        try:
            import monarch.actor  # noqa: F401
        except Exception as exc:  # pragma: no cover - depends on the bench environment
            print(f"torchmonarch does not import: {exc}", file=sys.stderr)
            return 1
        run_monarch(args.quick)
        return 0
    ours = _child("mesharray", args.quick)
    if not isinstance(ours, dict):
        print("mesharray", ours, file=sys.stderr)
        return 1
    peer = _child("monarch", args.quick) if args.system == "both" else "not requested"
    print(table(ours, peer))
    return 0


# --------------------------------------------------------------------------- pytest-benchmark
try:
    import pytest
except ImportError:  # pragma: no cover
    pytest = None

if pytest is not None:
    @pytest.fixture(scope="module")
    def bench_mesh():
        ma, Bench = _ma_actor()
        procs = ma.proc_mesh(hosts=1, procs=8, forward_logs=False)
        a = procs.spawn("b", Bench)
        yield a
        procs.stop()

    def test_call_one_noop(benchmark, bench_mesh):
        ep = bench_mesh.slice(procs=0).noop
        benchmark(lambda: ep.call_one().get())

    def test_call_8_actors(benchmark, bench_mesh):
        ep = bench_mesh.noop
        benchmark(lambda: ep.call().get())

    def test_round_trip_16mib(benchmark, bench_mesh):
        x = np.ones(MIB16, dtype=np.float32)
        ep = bench_mesh.slice(procs=0).echo
        benchmark(lambda: ep.call_one(x).get())


if __name__ == "__main__":
    sys.exit(main())
