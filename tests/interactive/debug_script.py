"""Driven through a pty by test_debugger.py: actors that call breakpoint(), a controller with a terminal."""

import sys
import time

import mesharray as ma


class Stepper(ma.Actor):
    @ma.endpoint
    def work(self, base: int) -> int:
        x = base + ma.current_rank()["procs"]
        breakpoint()
        y = x * 10
        return y


    @ma.endpoint
    def echo(self, x):
        return x


if __name__ == "__main__":
    if sys.argv[1] == "paused":  # a rank paused longer than the heartbeat timeout, with kill_unresponsive
        procs = ma.proc_mesh(hosts=1, procs=1, heartbeat_timeout=1.0, heartbeat_interval=0.2,
                             kill_unresponsive=True)
        s = procs.spawn("stepper", Stepper)
        fut = s.work.call(5)
        while not procs.stats()["paused_now"]:
            time.sleep(0.1)
        try:
            s.echo.call_one(1).get(timeout=3.0)  # queued behind the paused call
        except TimeoutError as exc:
            print("TIMEOUT", exc, flush=True)
        st = procs.stats()
        print(f"STATE unresponsive={st['unresponsive_now']} paused={st['paused_now']} deaths={st['deaths']}",
              flush=True)
        out = fut.get(timeout=120)
    else:
        procs = ma.proc_mesh(hosts=1, procs=int(sys.argv[1]))
        s = procs.spawn("stepper", Stepper)
        print("CALLING", flush=True)
        out = s.work.call(5).get(timeout=120)
    print("RESULT", out.tolist(), flush=True)
    print("STATS", procs.stats()["deaths"], procs.stats()["paused_now"], flush=True)
    procs.stop()
