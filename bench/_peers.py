"""Running the peers' helper scripts: ``mpirun`` of a script that prints one JSON line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run_mpi(script: str, args: list, n: int, mca: tuple = ()) -> dict | None:
    """``mpirun -n N python bench/SCRIPT ARGS...``; the JSON line rank 0 printed (None without mpirun).

    ``mca``: extra ``mpirun`` options (``("--bind-to", "none", "--mca", "btl", "self,tcp")``).
    """
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        return None
    cmd = [mpirun, "--oversubscribe", *mca, "-n", str(n)]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    cmd += [sys.executable, os.path.join(HERE, script), *map(str, args)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return None
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            return json.loads(line)
    print("mpirun failed:", out.stderr[-2000:], file=sys.stderr)
    return None


def spawn_ranks(target, n: int, *args) -> list:
    """Run ``target(rank, port, *args, queue)`` in ``n`` fresh processes; what each put on the queue.

    ``port`` is a free loopback port for a rendezvous (torch.distributed's ``tcp://``).
    """
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=target, args=(r, port, *args, q)) for r in range(n)]
    for p in ps:
        p.start()
    res = [q.get(timeout=600) for _ in ps]
    for p in ps:
        p.join()
    return res
