"""The network data plane: TCP (built in) and UCX (compiled, over UCP) side by side, in one run.

Two processes on this machine: this one opens a link to a spawned server
process's plane and measures

- the 8-byte round trip (``send`` 8 B, ``recv_into`` 8 B; the server echoes);
- a 64 MiB one-way transfer (``send`` 64 MiB, then ``recv_into`` the server's
  8-byte acknowledgement, sent once it has received every byte), as GB/s.

With ``--full`` (what bench/README.md's table comes from), in the same run:

- ``ucx_perftest`` (from the libucx wheel) between two processes: ``tag_bw``,
  ``ucp_put_bw`` and ``ucp_get`` at 64 MiB, UCX's own ceiling on this machine,
  in its default wait mode (``-E poll``: both processes spin), and ``tag_bw``
  in ``-E sleep`` too (they sleep in ``ucp_worker_wait``, as the planes do: on
  a loaded 2-core machine spinning costs perftest more than it gains; the
  one-sided tests hang in that mode, UCX's software RMA over TCP needing the
  target to progress);
- ``Buffer.read_into`` of 64 MiB across two host ids (``MESHARRAY_HOST_ID``):
  an owner with a UCX process plane (served by its UCX engine) and one without
  (the TCP stream path), read by this process;
- the same read while the owner's Python holds the GIL for 3 s;
- a 64 MiB float32 ring allreduce between two processes over each plane.

Every UCX process of the run (perftest and planes) uses ``UCX_TLS=tcp,self``
and 512 KiB TCP segments (what ucx_defaults() sets), so that two host ids on one machine talk over TCP as
two hosts would, never over shared memory. The ratios are what to read (the
absolute figures move with the machine's load). UCX cases are skipped without
the plane (``make test-ucx`` or ``pip install 'mesharray[ucx]'``)::

    python bench/bench_dataplane.py                  # the planes: p50/p90 RTT, GB/s, ratios
    python bench/bench_dataplane.py --full           # + perftest, Buffer reads, allreduce
    python -m pytest bench/bench_dataplane.py -q -p no:cacheprovider --benchmark-only \\
        --benchmark-columns=min,median,mean,max,rounds
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
# two host ids on one machine talk as two hosts would: UCX over TCP, never shared memory
UCX_ENV = {"UCX_TLS": "tcp,self", "UCX_TCP_RX_SEG_SIZE": "512k", "UCX_TCP_TX_SEG_SIZE": "512k",
           "UCX_WARN_UNUSED_ENV_VARS": "n"}
for _k, _v in UCX_ENV.items():
    os.environ.setdefault(_k, _v)


def ucx_available() -> tuple[bool, str]:
    from mesharray.transport.dataplane import ucx_status

    return ucx_status()


def make_plane(kind: str, on_link):
    if kind == "tcp":
        from mesharray.transport.dataplane import TcpPlane

        return TcpPlane(SECRET, "127.0.0.1", on_link)
    from mesharray.transport.ucx import UcxPlane

    return UcxPlane(SECRET, "127.0.0.1", on_link)  # (UCX_ENV above: tcp,self, 512 KiB segments)


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


# --- ucx_perftest ---------------------------------------------------------------------------
def perftest(test: str, size: int = BIG, iters: int = 20, mode: str = "poll") -> float:
    """GB/s of ``ucx_perftest -t test -s size -E mode`` between two processes on this machine (UCX_ENV).

    ``mode``: ``poll`` (perftest's default: both processes spin in ``ucp_worker_progress``)
    or ``sleep`` (they wait in ``ucp_worker_wait``, as mesharray's planes do).
    """
    import socket
    import subprocess

    import libucx

    root = os.path.dirname(libucx.__file__)
    exe = os.path.join(root, "bin", "ucx_perftest")
    env = dict(os.environ, LD_LIBRARY_PATH=os.path.join(root, "lib"), **{k: os.environ[k] for k in UCX_ENV})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([exe, "-p", str(port), "-E", mode], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        for _ in range(50):  # the server listens after its UCX init
            time.sleep(0.1)
            out = subprocess.run([exe, "127.0.0.1", "-p", str(port), "-t", test, "-s", str(size), "-n", str(iters),
                                  "-w", "2", "-E", mode], env=env, capture_output=True, text=True, timeout=300)
            if out.returncode == 0:
                break
        else:
            raise RuntimeError(f"ucx_perftest {test} failed: {out.stderr[-500:]}")
    finally:
        server.kill()
        server.wait()
    final = next(line for line in out.stdout.splitlines() if line.startswith("Final:"))
    mb_per_s = float(final.split()[-3])  # overall bandwidth, MB/s (2**20 bytes)
    return mb_per_s * (1 << 20) / 1e9


# --- Buffer reads across host ids ---------------------------------------------------------------
def _hold_gil(seconds: float) -> None:
    """Hold the GIL for about ``seconds``: one C call (``sum`` over a range), no switch interval."""
    t = time.perf_counter()
    sum(range(2_000_000))
    per = (time.perf_counter() - t) / 2_000_000
    sum(range(int(seconds / per)))


def _buffer_owner(kind: str, out, cmds) -> None:
    import pickle

    os.environ["MESHARRAY_HOST_ID"] = f"bench-owner-{kind}"
    from mesharray.buffer import Buffer
    from mesharray.transport.dataplane import start_process_plane

    if kind == "ucx":
        start_process_plane(SECRET, "127.0.0.1", "ucx")
    block = np.ones(BIG, np.uint8)
    buf = Buffer(block)
    out.put(pickle.dumps(buf))
    while True:
        cmd = cmds.get()
        if cmd == "stop":
            return
        out.put("holding")
        time.sleep(0.2)  # (the queue's feeder thread needs the GIL to send that)
        _hold_gil(cmd)


def buffer_reads(rounds: int) -> dict[str, list[float]]:
    """GB/s of 64 MiB ``read_into`` from a UCX-plane owner and a TCP-stream owner, and the latency
    of one read while each owner's Python holds the GIL for 3 s (keys ``gil-ucx``, ``gil-tcp``, s)."""
    import pickle

    from mesharray.transport.dataplane import start_process_plane

    os.environ["MESHARRAY_HOST_ID"] = "bench-reader"
    start_process_plane(SECRET, "127.0.0.1", "ucx")
    ctx = mp.get_context("spawn")
    owners, bufs = {}, {}
    for kind in KINDS:
        out, cmds = ctx.Queue(), ctx.Queue()
        proc = ctx.Process(target=_buffer_owner, args=(kind, out, cmds), daemon=True)
        proc.start()
        owners[kind] = (proc, out, cmds)
        bufs[kind] = pickle.loads(out.get(timeout=60))
    dst = np.empty(BIG, np.uint8)
    res: dict[str, list[float]] = {k: [] for k in KINDS}
    try:
        for kind in KINDS:
            for _ in range(2):
                bufs[kind].read_into(dst).get()
        for _ in range(rounds):
            for kind in KINDS:
                t = time.perf_counter()
                bufs[kind].read_into(dst).get()
                res[kind].append(BIG / (time.perf_counter() - t) / 1e9)
        for kind in KINDS:
            _, out, cmds = owners[kind]
            cmds.put(3.0)
            out.get(timeout=60)
            time.sleep(0.2)
            t = time.perf_counter()
            bufs[kind].read_into(dst).get()
            res[f"gil-{kind}"] = [time.perf_counter() - t]
            time.sleep(3.2)
    finally:
        for proc, _, cmds in owners.values():
            cmds.put("stop")
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    return res


# --- ring allreduce between two processes -------------------------------------------------------
def _ring_member(kind: str, rank: int, out, cmds, rounds: int) -> None:
    from mesharray.collectives.ring import RingCollective
    from mesharray.transport.dataplane import Rendezvous

    rdv = Rendezvous()
    plane = make_plane(kind, rdv.put)
    out.put(plane.address)
    right = plane.connect(cmds.get(), b"ring/%d" % rank, timeout=30)
    left = rdv.take(b"ring/%d" % (1 - rank), timeout=30)
    ring = RingCollective(rank, 2, right, left)
    x = np.ones(BIG // 4, np.float32)
    res = np.empty_like(x)
    times = []
    for i in range(rounds + 2):
        ring.barrier()
        t = time.perf_counter()
        ring.allreduce(x, out=res)
        if i >= 2:
            times.append(time.perf_counter() - t)
    out.put((times, ring.native_runs))
    cmds.get()
    ring.close()
    plane.close()


def ring_allreduce(kind: str, rounds: int) -> tuple[list[float], int]:
    """Seconds of each 64 MiB float32 allreduce (member 0) over two processes' planes of ``kind``."""
    ctx = mp.get_context("spawn")
    qs = [(ctx.Queue(), ctx.Queue()) for _ in range(2)]
    procs = [ctx.Process(target=_ring_member, args=(kind, r, qs[r][0], qs[r][1], rounds), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        addrs = [q[0].get(timeout=60) for q in qs]
        qs[0][1].put(addrs[1])
        qs[1][1].put(addrs[0])
        times, native = qs[0][0].get(timeout=300)
        qs[1][0].get(timeout=300)
        for q in qs:
            q[1].put("stop")
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return times, native


def full(args) -> None:
    """The issue-34 table: perftest, planes, Buffer reads and the allreduce, in one run."""
    load0 = os.getloadavg()[0]
    modes = ("poll", "sleep")
    tags: dict[str, list[float]] = {m: [perftest("tag_bw", mode=m)] for m in modes}
    # (one-sided tests in sleep mode hang: UCX's software RMA over TCP needs the target to progress)
    pt = {t: perftest(t, mode="poll") for t in ("ucp_put_bw", "ucp_get")}
    reads = buffer_reads(args.big_rounds)
    for m in modes:
        tags[m].append(perftest("tag_bw", mode=m))
    rings: dict[str, list[float]] = {k: [] for k in KINDS}
    natives = {}
    for _ in range(args.passes):
        for k in KINDS:
            times, natives[k] = ring_allreduce(k, args.ring_rounds)
            rings[k] += times
    for m in modes:
        tags[m].append(perftest("tag_bw", mode=m))
    med = statistics.median
    tag = {m: med(tags[m]) for m in modes}  # before, between and after the reads: the load moves
    print(f"load average {load0:.2f} -> {os.getloadavg()[0]:.2f}; UCX_TLS={os.environ['UCX_TLS']}")
    for m in modes:
        print(f"ucx_perftest 64 MiB, -E {m:<5}: tag_bw {tag[m]:.2f} GB/s (median of "
              f"{', '.join(f'{t:.2f}' for t in tags[m])})")
    print(f"ucx_perftest 64 MiB, -E poll : ucp_put_bw {pt['ucp_put_bw']:.2f} GB/s, ucp_get {pt['ucp_get']:.2f} GB/s")
    for k in KINDS:
        r = sorted(reads[k])
        print(f"Buffer.read_into 64 MiB across host ids, owner {'UCX plane' if k == 'ucx' else 'TCP stream':<10}: "
              f"median {med(r):.2f} GB/s (min {r[0]:.2f}, max {r[-1]:.2f}) = {med(r) / tag['poll']:.2f}x perftest "
              f"tag_bw (poll), {med(r) / tag['sleep']:.2f}x (sleep)")
    print(f"a read while the owner holds the GIL for 3 s: UCX {reads['gil-ucx'][0]:.3f} s, "
          f"TCP stream {reads['gil-tcp'][0]:.3f} s")
    for k in KINDS:
        r = sorted(rings[k])
        print(f"64 MiB float32 allreduce, 2 processes, {k} plane: median {med(r) * 1e3:.1f} ms "
              f"(min {r[0] * 1e3:.1f}, max {r[-1] * 1e3:.1f}; compiled loop runs {natives[k]})")
    print(f"allreduce UCX / TCP: {med(rings['ucx']) / med(rings['tcp']):.2f}x (lower is better)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3000, help="8-byte round trips per plane (after 300 warm-up)")
    ap.add_argument("--big-rounds", type=int, default=10, help="64 MiB transfers per plane (after 2 warm-up)")
    ap.add_argument("--passes", type=int, default=2, help="alternate the planes this many times")
    ap.add_argument("--full", action="store_true", help="also perftest, Buffer reads and the allreduce")
    ap.add_argument("--ring-rounds", type=int, default=10, help="allreduces per plane and pass (--full)")
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
    if args.full and "ucx" in kinds:
        full(args)


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
