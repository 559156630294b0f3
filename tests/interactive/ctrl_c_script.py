"""Driven through a pty by test_terminal.py: a Ctrl-C typed while the script waits for a call."""

import os
import sys
import time

import mesharray as ma


class Sleeper(ma.Actor):
    @ma.endpoint
    def hang(self, s: float) -> str:
        time.sleep(s)
        return "late"

    @ma.endpoint
    def echo(self, x):
        return x


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


if __name__ == "__main__":
    mode = sys.argv[1]
    job = None
    if mode == "job":  # hosts of a LocalJob: agents in sessions of their own
        job = ma.job.LocalJob(meshes={"w": 1})
        procs = job.state(cached_path=sys.argv[2]).w.spawn_procs(per_host={"procs": 2})
    else:
        procs = ma.proc_mesh(hosts=1, procs=2)
    s = procs.spawn("s", Sleeper)
    pids = procs.pids
    s.echo.call(0).get(timeout=60)
    print("READY", flush=True)
    t0 = time.monotonic()
    try:
        if mode == "call":
            s.hang.call(6).get()
        else:
            s.slice(procs=0).hang.call_one(6).get()
    except KeyboardInterrupt:
        print(f"INTERRUPTED after {time.monotonic() - t0:.1f} s", flush=True)
    print("NEXT", s.slice(procs=1).echo.call_one(41).get(timeout=60) + 1 if mode != "call" else
          s.echo.call(42).get(timeout=60).tolist(), flush=True)
    st = procs.stats()
    print("ALIVE", all(alive(p) for p in pids) if job is None else "remote", st["deaths"], st["alive"], flush=True)
    procs.stop()
    if job is not None:
        job.kill()
    print("DONE", flush=True)
