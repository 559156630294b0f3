"""One controller, many ranks: 64, 256 and 1,024 ranks of 64 processes per host, in one run.

Sixteen host agents on 127.0.0.2..17 with host ids h0..h15 (``python -m
mesharray host``): processes of different host ids never share memory, so
this machine plays a cluster of sixteen hosts. The script attaches to all of
them once (each agent starts its zygote then), and for each size starts a
process mesh on the first ``size / 64`` hosts and measures:

- spawn + first call: ``spawn_procs`` of the mesh, ``spawn`` of an actor on
  every rank and the first ``call()`` to all of them, until its reply;
- ``call()`` to all, p50 wall, and the controller's CPU per ``call()`` (its
  process time over the calls; every thread counts), and that CPU against the
  64-rank mesh's (one host: the direct path);
- a 1-element ``x.sum().fetch()`` over all ranks, p50 (the first one, which
  makes the groups, apart, with a worker's CPU and page faults in it and the
  share of the machine's CPU spent in the kernel meanwhile);
- PSS per idle worker (``/proc/PID/smaps_rollup``), once spawned (an actor and
  its first call) and after the run (the calls and sums);
- SIGKILL of one rank → the error at a ``call()`` pending on every rank;
- "unresponsive" reports while the mesh idles (``--idle`` seconds) and over its
  whole run;
- what a worker's start cost it by the first call's reply (its CPU and page faults),
  and the machine's state before the spawn: the first touch of a page of fresh memory
  (:func:`fresh_page_us`: on this VM 0.1-0.3 us once memory is warm, up to 20 us after
  the host took it back), and the CPU the hypervisor stole during the spawn.

``--spawns N`` only spawns the largest mesh N times, each starting 2 s after the
previous one stopped (its workers still going away): spawn + first call each
time, and whether it failed (a start that the load slows must still succeed).

``--compare`` measures the same sizes again with ``MESHARRAY_RELAY=0`` (every
message from the controller to each rank, as before relays), in the same run.
``--ab-plans`` measures, in one mesh of each size, the 1-element sum with its
plan sent by its bytes every time and by key (``context.MAX_PLANS``), alternated
in rounds: separate runs on a loaded 2-core machine differ more than the two.
``--ab-recv`` measures ``call()`` and the sum in two meshes of each size alive together, one
waiting for messages the default way (a poll, then a non-blocking recv) and one
with a blocking recv (``MESHARRAY_RECV_WAIT=recv``), alternated in rounds.

    python bench/bench_scale.py                 # 64, 256, 1024 (a few minutes)
    python bench/bench_scale.py --sizes 64,256 --compare
    python bench/bench_scale.py --sizes 1024 --ab-plans
    python bench/bench_scale.py --sizes 1024 --spawns 4
    python bench/bench_scale.py --sizes 512 --ab-recv

On a machine with 2 cores the 1,024 processes share them; figures taken while
other jobs run say so (the load average is printed with them).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import mesharray as ma  # noqa: E402

SECRET = "bench-scale"
PER_HOST = 64


def start_agents(n: int) -> list[tuple[subprocess.Popen, str]]:
    env = dict(os.environ, MESHARRAY_SECRET=SECRET)
    out = []
    try:
        for i in range(n):
            # (run from this directory: ``-m`` puts the working directory first on the agent's path,
            # so that from a checkout's root its workers would run that checkout, whatever
            # PYTHONPATH names: an A/B of two trees would compare one with itself)
            p = subprocess.Popen([sys.executable, "-m", "mesharray", "host", "--listen", f"tcp://127.0.0.{2 + i}:0",
                                  "--host-id", f"h{i}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 text=True, env=env, start_new_session=True, cwd=HERE)
            out.append((p, ""))
            assert p.stdout is not None
            out[-1] = (p, p.stdout.readline().strip().rsplit(" ", 1)[1])
    except BaseException:
        stop_agents(out)
        raise
    return out


def stop_agents(agents) -> None:
    for p, _ in agents:
        if p.poll() is None:
            p.terminate()
    for p, _ in agents:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        if p.stdout:
            p.stdout.close()


def pss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def fresh_page_us(mib: int = 32) -> float:
    """Microseconds to first touch a page of fresh anonymous memory (``mib`` MiB of 4 KiB pages).

    The machine's state, printed with the figures: this VM's host takes back guest memory
    that has been free a while (free page reporting), and the guest pays a host fault when
    it touches such a page again. A spawn writes ~1,000 fresh pages per worker (its copies
    of the zygote's pages), so this cost moves every start-up figure.
    """
    import mmap

    n = mib << 20
    m = mmap.mmap(-1, n)
    a = np.frombuffer(m, dtype=np.uint8)
    t = time.perf_counter()
    a[::4096] = 1
    dt = time.perf_counter() - t
    del a
    m.close()
    return dt / (n // 4096) * 1e6


def steal_ticks() -> int:
    """The machine's CPU time stolen by the hypervisor so far (clock ticks, all CPUs; 0 if unknown)."""
    try:
        with open("/proc/stat") as f:
            return int(f.readline().split()[8])
    except (OSError, IndexError, ValueError):
        return 0


def machine_busy() -> tuple[float, float]:
    """The machine's busy CPU time so far and the part of it in the kernel (seconds, all CPUs)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(v) - v[3] - v[4]) / tick, (v[2] + v[5] + v[6]) / tick


def _bench_class() -> type:
    # (in a module of its own, which workers import by name as they would a user's: not the class of
    # __main__, which each would unpickle by value, nor this module, which imports more than they need)
    import importlib

    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    return importlib.import_module("_scale_actor").Bench


def start_costs(pids: list[int]) -> tuple[float, float]:
    """The mean CPU (ms, its live threads' ``schedstat``: the precise run time, which
    ``/proc/PID/stat`` rounds down to ticks) and minor page faults of the workers ``pids``."""
    rows = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                faults = int(f.read().rsplit(b")", 1)[1].split()[7])
            ns = 0
            for t in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                    ns += int(f.read().split()[0])
            rows.append((ns / 1e6, faults))
        except (OSError, IndexError, ValueError):
            pass
    cpu, faults = np.mean(rows, axis=0) if rows else (float("nan"),) * 2
    return float(cpu), float(faults)


def _mean_pss(pids: list[int]) -> float:
    sizes = [pss_mib(p) for p in pids]
    return float(np.mean([s for s in sizes if s is not None]))


def measure(hosts, nhosts: int, calls: int, sums: int, idle: float) -> dict:
    """The figures of one mesh of ``nhosts`` x 64 ranks (see the module docstring)."""
    res: dict = {"ranks": nhosts * PER_HOST, "fresh_page_us": fresh_page_us()}
    s0 = steal_ticks()
    t0 = time.perf_counter()
    c0 = time.process_time()
    procs = hosts[0:nhosts].spawn_procs(per_host={"procs": PER_HOST})
    try:
        b = procs.spawn("bench", _bench_class())
        b.noop.call().get(timeout=120)
        res["spawn_first_call_s"] = time.perf_counter() - t0
        res["spawn_ctl_cpu_s"] = time.process_time() - c0
        res["start_cpu_ms"], res["start_faults"] = start_costs(procs.pids)
        res["spawn_steal_pct"] = (steal_ticks() - s0) / os.sysconf("SC_CLK_TCK") / res["spawn_first_call_s"] / (
            os.cpu_count() or 1) * 100
        res["relays"] = procs._root.controller.plane is not None
        time.sleep(1.0)
        res["pss_spawned_mib"] = _mean_pss(procs.pids)
        for _ in range(5):
            b.noop.call().get(timeout=60)
        walls, cpus = [], []
        for _ in range(calls):
            c = time.process_time()
            w = time.perf_counter()
            b.noop.call().get(timeout=60)
            walls.append(time.perf_counter() - w)
            cpus.append(time.process_time() - c)
        res["call_p50_ms"] = float(np.median(walls)) * 1e3
        res["call_cpu_ms"] = float(np.mean(cpus)) * 1e3
        x = procs.ones(())
        cpu0, faults0 = start_costs(procs.pids)
        busy0 = machine_busy()
        w = time.perf_counter()
        assert float(x.sum().fetch()) == procs.size()
        res["sum_first_ms"] = (time.perf_counter() - w) * 1e3
        cpu1, faults1 = start_costs(procs.pids)
        busy1 = machine_busy()
        res["sum_first_cpu_ms"], res["sum_first_faults"] = cpu1 - cpu0, faults1 - faults0
        res["sum_first_kernel_pct"] = (busy1[1] - busy0[1]) / max(busy1[0] - busy0[0], 1e-9) * 100
        times = []
        for _ in range(sums):
            w = time.perf_counter()
            x.sum().fetch()
            times.append(time.perf_counter() - w)
        res["sum_p50_ms"] = float(np.median(times)) * 1e3
        del x
        before = procs.stats()["unresponsive"]
        time.sleep(idle)
        res["unresponsive_idle"] = procs.stats()["unresponsive"] - before
        res["pss_mib"] = _mean_pss(procs.pids)
        victim = procs.size() - 1
        fut = b.sleep.call(5.0)
        time.sleep(0.3)
        w = time.perf_counter()
        os.kill(procs.pids[victim], signal.SIGKILL)
        try:
            fut.get(timeout=30)
            res["kill_error_ms"] = float("nan")
        except ma.ActorDiedError:
            res["kill_error_ms"] = (time.perf_counter() - w) * 1e3
        res["unresponsive_run"] = procs.stats()["unresponsive"]
    finally:
        procs.stop()
    return res


def spawns(hosts, nhosts: int, n: int) -> list:
    """Spawn + first call of the mesh ``n`` times back to back (seconds, or the error of a failed start)."""
    out: list = []
    for _ in range(n):
        fresh = fresh_page_us()
        t0 = time.perf_counter()
        try:
            procs = hosts[0:nhosts].spawn_procs(per_host={"procs": PER_HOST})
        except (ma.MeshArrayError, TimeoutError) as exc:
            out.append(exc)
        else:
            try:
                procs.spawn("bench", _bench_class()).noop.call().get(timeout=120)
                out.append(time.perf_counter() - t0)
            except (ma.MeshArrayError, TimeoutError) as exc:
                out.append(exc)
            finally:
                procs.stop()
        print(f"{nhosts * PER_HOST} ranks, spawn {len(out)}: " +
              (f"{out[-1]:.2f} s" if isinstance(out[-1], float) else f"FAILED: {out[-1]}") +
              f" (a fresh page cost {fresh:.2f} us before it)", flush=True)
        time.sleep(2.0)
    return out


def ab_plans(hosts, nhosts: int, rounds: int = 6, sums: int = 8) -> dict:
    """The 1-element sum's p50 with its plan by its bytes and by key, alternated in one mesh (ms)."""
    from mesharray.darray import context as dctx
    from mesharray.darray import data_context

    procs = hosts[0:nhosts].spawn_procs(per_host={"procs": PER_HOST})
    keep = dctx.MAX_PLANS
    try:
        x = procs.ones(())
        for _ in range(3):
            float(x.sum().fetch())
        ctx = data_context(procs)
        times: dict = {"bytes": [], "key": []}
        for _ in range(rounds):
            for mode in times:
                ctx._plan_keys.clear()  # (given again, or sent by its bytes: the ranks need no telling)
                dctx.MAX_PLANS = 0 if mode == "bytes" else keep
                float(x.sum().fetch())
                for _ in range(sums):
                    w = time.perf_counter()
                    float(x.sum().fetch())
                    times[mode].append(time.perf_counter() - w)
    finally:
        dctx.MAX_PLANS = keep
        procs.stop()
    return {m: float(np.median(v)) * 1e3 for m, v in times.items()}


def ab_recv(hosts, nhosts: int, rounds: int = 6, calls: int = 100) -> dict:
    """``call()`` to all in two meshes of ``nhosts`` x 64 alive together, one whose processes wait for
    a message with a poll then a non-blocking recv (the default) and one with a blocking recv
    (``MESHARRAY_RECV_WAIT=recv``), alternated in rounds: the call's p50 (ms), a worker's CPU per
    call (us), the machine's busy CPU per call (ms) and a 1-element sum's p50 (ms), the median over
    the rounds of each."""
    meshes = {}
    try:
        for mode in ("recv", "poll"):
            procs = hosts[0:nhosts].spawn_procs(per_host={"procs": PER_HOST}, env={"MESHARRAY_RECV_WAIT": mode})
            b = procs.spawn("bench", _bench_class())
            for _ in range(10):
                b.noop.call().get(timeout=120)
            x = procs.ones(())
            float(x.sum().fetch())  # (the groups made)
            meshes[mode] = (procs, b, x)
        got: dict = {m: {"p50": [], "worker": [], "machine": [], "sum": []} for m in meshes}
        for r in range(rounds):
            for mode in (("recv", "poll") if r % 2 == 0 else ("poll", "recv")):
                procs, b, x = meshes[mode]
                c0, m0 = start_costs(procs.pids)[0], machine_busy()[0]
                walls = []
                for _ in range(calls):
                    w = time.perf_counter()
                    b.noop.call().get(timeout=60)
                    walls.append(time.perf_counter() - w)
                c1, m1 = start_costs(procs.pids)[0], machine_busy()[0]
                got[mode]["p50"].append(float(np.median(walls)) * 1e3)
                got[mode]["worker"].append((c1 - c0) / calls * 1e3)
                got[mode]["machine"].append((m1 - m0) / calls * 1e3)
                sums = []
                for _ in range(calls // 10):
                    w = time.perf_counter()
                    float(x.sum().fetch())
                    sums.append(time.perf_counter() - w)
                got[mode]["sum"].append(float(np.median(sums)) * 1e3)
    finally:
        for procs, _, _ in meshes.values():
            procs.stop()
    return {m: {k: float(np.median(v)) for k, v in d.items()} | {"rounds": d} for m, d in got.items()}


ROWS = [
    ("spawn + first call", "spawn_first_call_s", "{:.1f} s", "≤ 6 s at 1,024"),
    ("  the controller's CPU meanwhile", "spawn_ctl_cpu_s", "{:.2f} s", ""),
    ("  a worker's CPU by then", "start_cpu_ms", "{:.1f} ms", ""),
    ("  a worker's page faults by then", "start_faults", "{:.0f}", ""),
    ("  a fresh page's first touch before it (the VM's state)", "fresh_page_us", "{:.2f} us", ""),
    ("  CPU stolen by the hypervisor meanwhile", "spawn_steal_pct", "{:.1f} %", ""),
    ("`call()` to all, p50 wall", "call_p50_ms", "{:.1f} ms", "≤ 40 ms at 1,024"),
    ("controller CPU per `call()` to all", "call_cpu_ms", "{:.2f} ms", ""),
    ("  the same, against 64 ranks on one host", "cpu_ratio", "{:.2f}x", "≤ 2x"),
    ("1-element `x.sum().fetch()`, p50", "sum_p50_ms", "{:.1f} ms", "≤ 50 ms at 1,024"),
    ("  its first one (makes the groups)", "sum_first_ms", "{:.0f} ms", ""),
    ("  a worker's CPU and page faults in it", "sum_first_costs", "{}", ""),
    ("  the machine's CPU in the kernel meanwhile", "sum_first_kernel_pct", "{:.0f} %", ""),
    ("PSS per idle worker, spawned (an actor, one call)", "pss_spawned_mib", "{:.1f} MiB", "≤ 6 MiB"),
    ("  the same after the run (calls, sums, idle)", "pss_mib", "{:.1f} MiB", ""),
    ("SIGKILL of one rank → error at a pending `call()`", "kill_error_ms", "{:.0f} ms", "≤ 1 s"),
    ("\"unresponsive\" reports at idle / over the run", "unresponsive", "{}", "none"),
]


def table(results: list[dict]) -> str:
    base = next((r for r in results if r["ranks"] == PER_HOST and r.get("relays") is False), None)
    cols = []
    for r in results:
        r = dict(r)
        r["cpu_ratio"] = r["call_cpu_ms"] / base["call_cpu_ms"] if base else float("nan")
        r["unresponsive"] = f"{r['unresponsive_idle']} / {r['unresponsive_run']}"
        r["sum_first_costs"] = f"{r['sum_first_cpu_ms']:.1f} ms, {r['sum_first_faults']:.0f}"
        cols.append(r)
    head = ["measure"] + [f"{r['ranks']} ranks ({r['ranks'] // PER_HOST} host{'s' if r['ranks'] > PER_HOST else ''}"
                          f"{'' if r['relays'] or r['ranks'] == PER_HOST else ', no relays'})" for r in cols] + ["target"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, key, fmt, target in ROWS:
        lines.append("| " + " | ".join([label] + [fmt.format(r[key]) for r in cols] + [target]) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="64,256,1024", help="ranks per mesh, multiples of 64 (default 64,256,1024)")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--sums", type=int, default=15)
    ap.add_argument("--idle", type=float, default=5.0, help="seconds each mesh idles while reports are counted")
    ap.add_argument("--compare", action="store_true", help="every size again with MESHARRAY_RELAY=0")
    ap.add_argument("--ab-plans", action="store_true",
                    help="only the sum, its plan by its bytes against by key, alternated in one mesh per size")
    ap.add_argument("--ab-recv", action="store_true",
                    help="only call() and the sum, in two meshes of each size alive together (waits by poll, by "
                         "blocking recv), alternated in rounds")
    ap.add_argument("--spawns", type=int, default=0,
                    help="only spawn the largest mesh this many times back to back (2 s apart)")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if any(s % PER_HOST for s in sizes):
        raise SystemExit(f"sizes must be multiples of {PER_HOST}, got {sizes}")
    os.environ["MESHARRAY_SECRET"] = SECRET
    nhosts = max(sizes) // PER_HOST
    agents = start_agents(nhosts)
    results = []
    try:
        hosts = ma.attach([u for _, u in agents], transport="tcp", timeout=120)
        time.sleep(3.0)  # (the agents start their zygotes at the attach)
        if args.spawns:
            got = spawns(hosts, nhosts, args.spawns)
            ok = [g for g in got if isinstance(g, float)]
            print(f"{len(ok)} of {len(got)} started" + (f"; spawn + first call {min(ok):.2f}-{max(ok):.2f} s" if ok else ""))
            hosts.detach()
            return
        if args.ab_recv:
            for n in sizes:
                r = ab_recv(hosts, n // PER_HOST)
                for mode in ("recv", "poll"):
                    d = r[mode]
                    print(f"{n} ranks, waits by {mode}: call() p50 {d['p50']:.2f} ms, a worker's CPU per call "
                          f"{d['worker']:.1f} us, the machine's {d['machine']:.2f} ms; 1-element sum p50 "
                          f"{d['sum']:.1f} ms (medians of "
                          f"{len(d['rounds']['p50'])} rounds; p50 by round "
                          f"{', '.join(f'{x:.1f}' for x in d['rounds']['p50'])})", flush=True)
            hosts.detach()
            return
        if args.ab_plans:
            for n in sizes:
                r = ab_plans(hosts, n // PER_HOST)
                print(f"{n} ranks: 1-element sum p50, plan by its bytes {r['bytes']:.1f} ms, by key {r['key']:.1f} ms",
                      flush=True)
            hosts.detach()
            return
        for relays in ([True, False] if args.compare else [True]):
            os.environ["MESHARRAY_RELAY"] = "1" if relays else "0"
            for n in sizes:
                r = measure(hosts, n // PER_HOST, args.calls, args.sums, args.idle)
                results.append(r)
                print(f"{n} ranks{'' if relays else ' (no relays)'}: " +
                      ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()),
                      flush=True)
        hosts.detach()
    finally:
        stop_agents(agents)
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end (2 cores: the figures are this machine's, "
          f"with its other jobs)\n")
    print(table(results))


# --- pytest-benchmark case (make bench): a small mesh, the same path ---------------------------------


def test_call_to_all_of_4_hosts(benchmark):
    os.environ["MESHARRAY_SECRET"] = SECRET
    agents = start_agents(4)
    try:
        hosts = ma.attach([u for _, u in agents], transport="tcp", timeout=60)
        procs = hosts.spawn_procs(per_host={"procs": 8})
        b = procs.spawn("bench", _bench_class())
        b.noop.call().get(timeout=60)
        benchmark(lambda: b.noop.call().get(timeout=60))
        procs.stop()
        hosts.detach()
    finally:
        stop_agents(agents)


if __name__ == "__main__":
    main()
