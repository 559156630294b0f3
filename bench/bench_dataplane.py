"""The network data plane: TCP (built in) and UCX (``ucxx``) links side by side, in one run.

Two processes on this machine: this one opens a link to a spawned server
process's plane and measures

- the 8-byte round trip (``send`` 8 B, ``recv_into`` 8 B; the server echoes);
- a 64 MiB one-way transfer (``send`` 64 MiB, then ``recv_into`` the server's
  8-byte acknowledgement, sent once it has received every byte), as GB/s.

Both planes run in the same run, alternating, so the ratio is what to read
(the absolute figures move with the machine's load). UCX cases are skipped
without ``ucxx`` (``make test-ucx`` or ``pip install 'mesharray[ucx]'``)::

    python bench/bench_dataplane.py                  # the table: p50/p90 RTT, GB/s, ratios
    python bench/bench_dataplane.py --rounds 5000 --big-rounds 20
    python -m pytest bench/bench_dataplane.py -q -p no:cacheprovider --benchmark-only \\
        --benchmark-columns=min,median,mean,max,rounds

UCX runs with the defaults :func:`mesharray.transport.ucx.ucx_defaults` sets
(``UCX_TLS=tcp`` without RDMA hardware, 4 MiB TCP segments); links between
two processes of one machine go through the loopback interface either way.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

SECRET = b"bench-data-plane-secret-32-bytes"
BIG = 64 << 20
KINDS = ("tcp", "ucx")


def ucx_available() -> tuple[bool, str]:
    from mesharray.transport.dataplane import ucx_status

    return ucx_status()


def make_plane(kind: str, on_link):
    if kind == "tcp":
        from mesharray.transport.dataplane import TcpPlane

        return TcpPlane(SECRET, "127.0.0.1", on_link)
    from mesharray.transport.ucx import UcxPlane

    return UcxPlane(SECRET, "127.0.0.1", on_link)


# --- the server process -------------------------------------------------------------------
def _serve(link, tag: bytes) -> None:
    """``b"echo"``: echo 8-byte messages; ``b"sink:N"``: receive N bytes, answer 8; until the link ends."""
    try:
        if tag == b"echo":
            buf = bytearray(8)
            view = memoryview(buf)
            while True:
                link.recv_into(view)
                link.send(buf)
        elif tag.startswith(b"sink:"):
            sink = np.empty(int(tag[5:]), np.uint8)  # allocated once: every round reuses warm pages
            view = memoryview(sink)
            ack = b"received"
            while True:
                link.recv_into(view)
                link.send(ack)
    except ConnectionError:
        pass
    finally:
        link.close()


def _server(kind: str, out, stop) -> None:
    plane = make_plane(kind, _serve)
    out.put(plane.address)
    stop.get()
    plane.close()


class Server:
    """A spawned process with a plane of ``kind`` that serves echo and sink links."""

    def __init__(self, kind: str) -> None:
        ctx = mp.get_context("spawn")
        self.out, self.stop_q = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_server, args=(kind, self.out, self.stop_q), daemon=True)
        self.proc.start()
        try:
            self.address = self.out.get(timeout=60)
        except queue.Empty:
            self.close()
            raise TimeoutError(f"the {kind} server did not start in 60 s") from None
        self.kind = kind
        self.plane = make_plane(kind, lambda link, tag: None)

    def link(self, tag: bytes):
        return self.plane.connect(self.address, tag, timeout=30)

    def close(self) -> None:
        if getattr(self, "plane", None) is not None:
            self.plane.close()
        if self.proc.is_alive():
            self.stop_q.put("stop")
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


# --- measurements -------------------------------------------------------------------------
def round_trip(link):
    buf = bytearray(8)
    view = memoryview(buf)

    def once():
        link.send(buf)
        link.recv_into(view)
    return once


def one_way(link, data):
    ack = memoryview(bytearray(8))

    def once():
        link.send(data)
        link.recv_into(ack)
    return once


def timed(fn, rounds: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3000, help="8-byte round trips per plane (after 300 warm-up)")
    ap.add_argument("--big-rounds", type=int, default=10, help="64 MiB transfers per plane (after 2 warm-up)")
    ap.add_argument("--passes", type=int, default=2, help="alternate the planes this many times")
    args = ap.parse_args(argv)
    ok, why = ucx_available()
    kinds = KINDS if ok else ("tcp",)
    if not ok:
        print(f"UCX skipped: {why}")
    data = np.ones(BIG, np.uint8)
    rtt: dict[str, list[float]] = {k: [] for k in kinds}
    big: dict[str, list[float]] = {k: [] for k in kinds}
    servers = {k: Server(k) for k in kinds}
    try:
        # one link at a time: a second link's waiting thread would make the server hand
        # each completion from one thread to another (see mesharray.transport.ucx)
        for _ in range(args.passes):
            for k in kinds:
                link = servers[k].link(b"echo")
                rtt[k] += timed(round_trip(link), args.rounds, 300)
                link.close()
                link = servers[k].link(b"sink:%d" % BIG)
                big[k] += timed(one_way(link, data), args.big_rounds, 2)
                link.close()
    finally:
        for s in servers.values():
            s.close()
    print(f"load average {os.getloadavg()[0]:.2f}; {args.passes} alternating passes per plane")
    print(f"{'plane':<6} {'8 B RTT p50':>12} {'p10':>9} {'p90':>9} {'64 MiB GB/s (median)':>21} {'min':>6} {'max':>6}")
    for k in kinds:
        r = sorted(rtt[k])
        gbs = sorted(BIG / t / 1e9 for t in big[k])
        print(f"{k:<6} {statistics.median(r) * 1e6:10.1f} us {r[len(r) // 10] * 1e6:6.1f} us {r[9 * len(r) // 10] * 1e6:6.1f} us"
              f" {statistics.median(gbs):21.2f} {gbs[0]:6.2f} {gbs[-1]:6.2f}")
    if "ucx" in kinds:
        rr = statistics.median(rtt["ucx"]) / statistics.median(rtt["tcp"])
        br = statistics.median(big["tcp"]) / statistics.median(big["ucx"])
        print(f"ucx / tcp: RTT x{rr:.2f} (lower is better), 64 MiB bandwidth x{br:.2f} (higher is better)")


# --- pytest-benchmark cases (make bench) ----------------------------------------------------
@pytest.fixture(scope="module", params=KINDS)
def server(request):
    if request.param == "ucx":
        ok, why = ucx_available()
        if not ok:
            pytest.skip(f"UCX data plane unavailable: {why}")
    s = Server(request.param)
    yield s
    s.close()


def test_round_trip_8b(benchmark, server):
    benchmark.group = "data plane: 8-byte round trip between two processes"
    if server.kind == "tcp":
        benchmark.extra_info.update(baseline=True, label="tcp")
    link = server.link(b"echo")
    benchmark.pedantic(round_trip(link), rounds=3000, iterations=1, warmup_rounds=300)
    link.close()


def test_one_way_64mib(benchmark, server):
    benchmark.group = "data plane: 64 MiB one way between two processes"
    if server.kind == "tcp":
        benchmark.extra_info.update(baseline=True, label="tcp")
    link = server.link(b"sink:%d" % BIG)
    data = np.ones(BIG, np.uint8)
    benchmark.pedantic(one_way(link, data), rounds=10, iterations=1, warmup_rounds=2)
    benchmark.extra_info["GB/s (median)"] = round(BIG / benchmark.stats.stats.median / 1e9, 2)
    link.close()


if __name__ == "__main__":
    main()
