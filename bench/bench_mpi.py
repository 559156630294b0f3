"""Runtime benchmarks under mpirun, next to the same figures on a local mesh.

One command prints the whole table (it launches ``mpirun`` itself)::

    python bench/bench_mpi.py                 # local + mpirun -n 2 and -n 4
    python bench/bench_mpi.py --sizes 2 --rounds 500

or measure one launch directly (rank 0 prints one JSON line)::

    mpirun -n 4 python bench/bench_mpi.py

Figures (all on a no-op endpoint, inputs built outside the timed region):

* ``rtt_p50_us`` / ``rtt_p99_us``: ``call_one`` round trip to the *last* rank
  (a separate worker process under both bootstraps);
* ``rtt0_p50_us``: the same to rank 0 (under MPI it is a thread of the
  controller's own process; under the local bootstrap another process);
* ``call_all_p50_us``: ``call()`` to every rank and wait for the MeshArray;
* ``pipelined_per_s``: 5,000 ``call_one`` sent back to back, then all awaited;
* ``broadcast_per_s``: fire-and-forget ``broadcast()`` to one actor, ended by
  one ``call_one`` (messages are ordered, so it has seen them all);
* ``spawn_ms``: bootstrap until the mesh is ready (local: start processes;
  MPI: the handshake of already-started ranks, from the first rank's start).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mesharray as ma  # noqa: E402
from mesharray.bootstrap._detect import detect_launcher  # noqa: E402

_MARK = "BENCH_JSON "


class Echo(ma.Actor):
    def __init__(self) -> None:
        self.n = 0

    @ma.endpoint
    def noop(self) -> None:
        return None

    @ma.endpoint
    def bump(self) -> None:
        self.n += 1

    @ma.endpoint
    def count(self) -> int:
        return self.n


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(mesh, rounds: int) -> dict:
    echo = mesh.spawn("echo", Echo)
    n = len(mesh)
    last = echo.slice(procs=-1) if "procs" in mesh.sizes else echo[-1]
    first = echo.slice(procs=0) if mesh.ndim == 1 else echo[0, 0]
    out: dict = {"ranks": n}
    for label, target in (("rtt", last), ("rtt0", first)):
        ep = target.noop
        for _ in range(min(200, rounds)):
            ep.call_one().get()
        samples = []
        for _ in range(rounds):
            t = time.perf_counter_ns()
            ep.call_one().get()
            samples.append((time.perf_counter_ns() - t) / 1e3)
        out[f"{label}_p50_us"] = round(_pct(samples, 0.5), 1)
        out[f"{label}_p99_us"] = round(_pct(samples, 0.99), 1)
    samples = []
    for _ in range(max(50, rounds // 4)):
        t = time.perf_counter_ns()
        echo.noop.call().get()
        samples.append((time.perf_counter_ns() - t) / 1e3)
    out["call_all_p50_us"] = round(_pct(samples, 0.5), 1)
    calls = 5000
    t = time.perf_counter()
    futures = [last.noop.call_one() for _ in range(calls)]
    for f in futures:
        f.get()
    out["pipelined_per_s"] = round(calls / (time.perf_counter() - t))
    msgs = 20000
    t = time.perf_counter()
    for _ in range(msgs):
        last.bump.broadcast()
    got = last.count.call_one().get()
    out["broadcast_per_s"] = round(msgs / (time.perf_counter() - t))
    assert got == msgs, f"broadcast lost messages: {got} of {msgs}"
    return out


def _under_launcher(rounds: int) -> None:
    t = time.perf_counter()
    mesh = ma.proc_mesh()  # ranks 1..N-1 serve inside this call
    spawn_ms = (time.perf_counter() - t) * 1e3
    figures = measure(mesh, rounds)
    figures["spawn_ms"] = round(spawn_ms, 1)
    figures["bootstrap"] = "mpi"
    print(_MARK + json.dumps(figures), flush=True)


def _local(n: int, rounds: int) -> dict:
    t = time.perf_counter()
    mesh = ma.proc_mesh(hosts=1, procs=n, bootstrap="local")
    spawn_ms = (time.perf_counter() - t) * 1e3
    try:
        figures = measure(mesh, rounds)
    finally:
        stop = getattr(mesh, "stop", None)
        if stop is not None:
            result = stop()
            if hasattr(result, "get"):
                result.get()
    figures["spawn_ms"] = round(spawn_ms, 1)
    figures["bootstrap"] = "local"
    return figures


def _mpirun(n: int, rounds: int) -> dict:
    from mesharray.bootstrap.mpirun import mpirun_command

    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    cmd = mpirun_command(n, [sys.executable, os.path.abspath(__file__), "--rounds", str(rounds)])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    for line in out.stdout.splitlines():
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK):])
    raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode} without figures:\n"
                       f"{out.stdout}\n{out.stderr}")


_COLUMNS = [("rtt_p50_us", "call_one p50 (µs)"), ("rtt_p99_us", "p99 (µs)"),
            ("rtt0_p50_us", "rank 0 p50 (µs)"), ("call_all_p50_us", "call() all p50 (µs)"),
            ("pipelined_per_s", "pipelined calls/s"), ("broadcast_per_s", "broadcast msg/s"),
            ("spawn_ms", "mesh ready (ms)")]


def table(rows: list[dict]) -> str:
    head = "| bootstrap | ranks | " + " | ".join(t for _, t in _COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(_COLUMNS) + 2)]
    for row in rows:
        cells = " | ".join(str(row.get(k, "")) for k, _ in _COLUMNS)
        lines.append(f"| {row['bootstrap']} | {row['ranks']} | {cells} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args(argv)
    if detect_launcher() is not None:
        _under_launcher(args.rounds)
        return
    rows = []
    for n in args.sizes:
        rows.append(_local(n, args.rounds))
        rows.append(_mpirun(n, args.rounds))
    print(table(rows))


if __name__ == "__main__":
    main()
