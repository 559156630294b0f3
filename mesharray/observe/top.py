"""``python -m mesharray top URL``: a terminal table per rank, from a web view's ``api/state``.

Polls ``URL/api/state`` (the JSON the web view draws, :func:`~mesharray.observe.web.live_state`)
every ``--interval`` seconds over HTTP and redraws one line per rank: its
label, host, state (idle, busy, unresponsive, dead), the endpoint it is busy in,
calls per second and median latency over the last minute, resident memory.
It needs only the URL that ``procs.telemetry.serve()`` returned: it runs in
any process, on any machine that reaches that address.
``--once`` prints one table and exits (1 when the URL does not answer).
"""

from __future__ import annotations

import json
import time
import urllib.request

__all__ = ["top_main"]


def top_main(argv: list[str]) -> int:
    """``python -m mesharray top URL``: a live table per rank from a web view's ``api/state``."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m mesharray top", description="Live per-rank table of a mesh "
                                 "(the URL printed by procs.telemetry.serve()).")
    ap.add_argument("url")
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--once", action="store_true", help="print one table and exit")
    args = ap.parse_args(argv)
    base = args.url if args.url.endswith("/") else args.url + "/"
    while True:
        try:
            with urllib.request.urlopen(base + "api/state", timeout=10) as r:
                s = json.loads(r.read())
        except Exception as exc:
            print(f"mesharray top: cannot read {base}api/state: {exc}", flush=True)
            if args.once:
                return 1
            time.sleep(args.interval)
            continue
        lines = [f"mesharray top — mesh {s['mesh']} — {time.strftime('%H:%M:%S')} — {len(s['ranks'])} ranks",
                 f"{'RANK':<6}{'LABEL':<22}{'HOST':<14}{'STATE':<14}{'ENDPOINT':<28}{'CALLS/S':>9}{'P50 µs':>10}"
                 f"{'RSS MiB':>10}"]
        for k in s["ranks"]:
            ep = f"{k['actor']}.{k['endpoint']}" if k.get("endpoint") else "-"
            p50 = "-" if k["p50_us"] is None else f"{k['p50_us']:.1f}"
            rss = "-" if k["rss_mib"] is None else f"{k['rss_mib']:.1f}"
            lines.append(f"{k['rank']:<6}{k['label'][:21]:<22}{str(k['host'])[:13]:<14}{k['state']:<14}"
                         f"{ep[:27]:<28}{k['calls_per_s']:>9.1f}{p50:>10}{rss:>10}")
        if args.once:
            print("\n".join(lines), flush=True)
            return 0
        print("\x1b[H\x1b[2J" + "\n".join(lines), flush=True)
        time.sleep(args.interval)
