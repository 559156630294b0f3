"""What a wake-up costs after the peer has been idle: a unix-socket ping-pong with an idle gap.

A forked child echoes one byte; before each ping the parent stays busy for ``gap``
microseconds, long enough for the child's CPU to go idle. On bare metal the round
trip barely moves with the gap. On a VM whose idle vCPUs halt at once (no guest
halt polling, e.g. ``haltpoll.guest_halt_poll_ns=0`` on the kernel command line;
nested virtualisation makes each exit dearer), waking a process on a halted vCPU
is an inter-processor interrupt through the hypervisor, paid on the critical path,
and the round trip grows with the gap. Any operation of the runtime that takes
longer than the gap pays that price for each wake-up in its chain (the sum over
a mesh axis has three: controller to workers, workers to each other, root to
controller); a back-to-back floor pays less of it.

Pinned to one core (``taskset -c 1``) nothing crosses vCPUs and the gap costs
almost nothing: compare the two to tell the machine's price from the software's.

Usage::

    python bench/wakeup_gap.py                 # both vCPUs
    taskset -c 1 python bench/wakeup_gap.py    # one core
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import time


def main(gaps: tuple[int, ...] = (0, 20, 50, 100, 200, 500), n: int = 2000) -> None:
    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        a.close()
        buf = bytearray(64)
        while b.recv_into(buf):
            b.send(b"y")
        os._exit(0)
    b.close()
    buf = bytearray(64)
    pc = time.perf_counter
    try:
        for gap in gaps:
            sends, rtts = [], []
            for _ in range(n):
                t = pc()
                while pc() - t < gap * 1e-6:
                    pass  # the parent stays busy; the child's vCPU goes idle
                t0 = pc()
                a.send(b"x")
                t1 = pc()
                a.recv_into(buf)
                t2 = pc()
                sends.append(t1 - t0)
                rtts.append(t2 - t0)
            print(f"idle gap {gap:4d} us: send() {statistics.median(sends) * 1e6:5.1f} us   "
                  f"round trip {statistics.median(rtts) * 1e6:5.1f} us")
    finally:
        a.close()
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main(tuple(int(g) for g in sys.argv[1:]) or (0, 20, 50, 100, 200, 500))
