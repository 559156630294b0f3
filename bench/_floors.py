"""What the machine allows: raw Python unix-socket round trips with forked children.

The floor a runtime's call is measured against in the same run (``bench/bench_runtime.py``,
``bench/ab.py``): no framing, no pickling, no runtime, one 64-byte message each way.

- ``socket_floor(1)``: send to one child, read its answer (``call_one``'s floor);
- ``socket_floor(k)``: send to ``k`` children, read the ``k`` answers in one ``poll`` loop
  (the floor of a ``call()`` to ``k`` processes);
- ``socket_floor(k, split=True)``: the same over one socketpair per direction, where nobody
  sleeps on the socket whose buffer space a read frees (no write-space wake-ups).

``python bench/_floors.py [ROUNDS]`` prints both, interleaved, for 1, 2 and 8 children.
"""

from __future__ import annotations

import os
import select
import socket
import statistics
import time


def _batch() -> None:
    """Put a child in the scheduling class mesharray's workers run in (``MESHARRAY_WORKER_SCHED``)."""
    if hasattr(os, "SCHED_BATCH") and os.environ.get("MESHARRAY_WORKER_SCHED", "").strip().lower() != "normal":
        try:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        except OSError:
            pass


def fork_children(k: int, serve) -> tuple[list, list]:
    """``k`` forked children, one socketpair each; child ``j`` runs ``serve(j, its socket)`` and exits.

    The children run in the workers' scheduling class (``SCHED_BATCH`` on Linux unless
    ``MESHARRAY_WORKER_SCHED=normal``): a woken child does not preempt the parent.
    """
    socks: list = []
    pids: list = []
    for j in range(k):
        a, b = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            try:
                _batch()
                a.close()
                for s in socks:
                    s.close()
                serve(j, b)
            finally:
                os._exit(0)  # (a child never goes on into its parent's code, whatever happened)
        b.close()
        socks.append(a)
        pids.append(pid)
    return socks, pids


def poll_of(socks: list) -> tuple:
    """One poll object over the parent's sockets, and the socket of each fd."""
    p = select.poll()
    for s in socks:
        p.register(s.fileno(), select.POLLIN)
    return p, {s.fileno(): s for s in socks}


def reap(socks: list, pids: list, ts: list) -> float:
    """Close the children's sockets, wait for them; the median round trip (after 200 warm-up) in µs."""
    for s in socks:
        s.close()
    for pid in pids:
        os.waitpid(pid, 0)
    return statistics.median(ts[200:]) * 1e6


def _echo(j: int, b: socket.socket) -> None:
    buf = bytearray(256)
    while b.recv_into(buf):
        b.send(buf[:64])


def socket_floor(k: int = 1, n: int = 3000, split: bool = False) -> float:
    """p50 µs of sending 64 bytes to ``k`` echoing children and reading every answer.

    ``split``: each child answers on a second socketpair (one per direction).
    """
    if split:
        back = [socket.socketpair() for _ in range(k)]

        def serve(j: int, b: socket.socket) -> None:
            for i, (r, w) in enumerate(back):
                r.close()
                if i != j:
                    w.close()
            buf, out = bytearray(256), back[j][1]
            while b.recv_into(buf):
                out.send(buf[:64])

        socks, pids = fork_children(k, serve)
        for _, w in back:
            w.close()
        replies = [r for r, _ in back]
    else:
        socks, pids = fork_children(k, _echo)
        replies = socks
    p, by_fd = poll_of(replies)
    buf, msg, ts = bytearray(256), b"x" * 64, []
    for _ in range(n):
        t = time.perf_counter()
        if k == 1:
            socks[0].send(msg)
            replies[0].recv_into(buf)
        else:
            for s in socks:
                s.send(msg)
            left = k
            while left:
                for fd, _ in p.poll():
                    by_fd[fd].recv_into(buf)
                    left -= 1
        ts.append(time.perf_counter() - t)
    if split:
        for r in replies:
            r.close()
    return reap(socks, pids, ts)


if __name__ == "__main__":
    import sys

    for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
        print("  ".join(f"{k} {'split' if sp else 'one'}: {socket_floor(k, 2000, sp):6.1f} µs"
                        for k in (1, 2, 8) for sp in (False, True)), flush=True)
