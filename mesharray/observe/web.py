"""The live web view: an HTTP server of one page and a JSON API, what ``Telemetry.serve`` starts.

A ``ThreadingHTTPServer`` (daemon threads, bound to 127.0.0.1 by default)
serves, per GET:

- ``/`` (or ``/index.html``): the page ``static/index.html`` (shipped as
  package data), its ``__MESH__`` placeholders replaced by the mesh's name; its
  script polls ``api/state`` every second and draws the ranks (a grid, one row
  per host and one cell per rank coloured by its state, 1,024 ranks on one
  screen; a cell links to ``#rank-N``, whose details it shows), endpoints,
  errors and logs;
- ``api/state``: :func:`live_state` as JSON (what ``python -m mesharray top``
  polls too);
- ``api/sql?q=QUERY``: ``Telemetry.sql`` as ``{"rows", "missing"}`` or
  ``{"error"}``;
- ``api/stacks`` (``?rank=N``, repeatable: those ranks only): ``Telemetry.stacks``;
- ``/metrics``: ``Telemetry.metrics`` (the Prometheus text exposition).

A request that fails (a stopped mesh, a dead rank) answers 500 with the error
and the server keeps serving; ``Telemetry.close`` shuts it down.
"""

from __future__ import annotations

import html
import json
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import TYPE_CHECKING, Any

import numpy as np

from .tables import rank_rows

if TYPE_CHECKING:
    from .collect import Telemetry

__all__ = ["Server", "index_page", "live_state"]


def index_page(mesh: str) -> bytes:
    """The web view's page (``static/index.html``) for the mesh named ``mesh``."""
    text = (resources.files("mesharray.observe") / "static" / "index.html").read_text(encoding="utf-8")
    return text.replace("__MESH__", html.escape(mesh)).encode()


def live_state(tel: Telemetry, window: float) -> dict:
    """``api/state`` from what ``tel`` collected: ranks, per-endpoint figures of the last ``window`` s, errors, logs."""
    now = time.time_ns()
    cutoff = now - int(window * 1e9)
    with tel.lock:
        rows = [r for r in tel.store["messages"] if r[3] >= cutoff]
        errors = tel.store["errors"][-20:]
    per_rank: dict[int, list] = {}
    per_ep: dict[tuple, list] = {}
    for r in rows:
        per_rank.setdefault(r[0], []).append(r[4])
        per_ep.setdefault((r[5], r[6]), []).append((r[4], r[11]))
    ranks = []
    shape = tel.controller.workers
    for rank, label, host, pid, state, actor, ep, busy in rank_rows(tel):
        durs = per_rank.get(rank, [])
        st = tel.state.get(rank, {})
        proc = st.get("process")
        ranks.append({"rank": rank, "label": label, "host": host, "pid": pid, "state": state,
                      "actor": actor, "endpoint": ep, "busy_s": round(busy, 3),
                      "calls_per_s": round(len(durs) / window, 2),
                      "p50_us": round(float(np.median(durs)) / 1e3, 1) if durs else None,
                      "rss_mib": round(proc[2] / 2**20, 1) if proc else None})
    endpoints = []
    for (actor, ep), v in sorted(per_ep.items()):
        d = np.array([x[0] for x in v], dtype=np.float64) / 1e3
        endpoints.append({"actor": actor, "endpoint": ep, "calls": len(v),
                          "calls_per_s": round(len(v) / window, 2),
                          "p50_us": round(float(np.percentile(d, 50)), 1),
                          "p99_us": round(float(np.percentile(d, 99)), 1),
                          "errors": sum(1 for x in v if x[1] != "ok")})
    logs = [{"time": t, "rank": r, "label": lab, "stream": s, "level": lv, "text": tx}
            for t, r, lab, s, lv, tx in tel.controller.sink.rows()[-300:]]
    dims = {}
    if shape:
        dims = {"size": len(shape)}
    return {"mesh": tel.name, "time": now / 1e9, "window_s": window, "dims": dims, "ranks": ranks,
            "endpoints": endpoints, "logs": logs,
            "errors": [{"time": e[3] / 1e9, "rank": e[0], "host": e[1], "actor": e[4], "endpoint": e[5],
                        "type": e[6], "message": e[7], "traceback": e[8]} for e in errors]}


class Server:
    """One web view of ``tel``: the HTTP server on ``host:port`` (0: any free port), its thread and its ``url``."""

    def __init__(self, tel: Telemetry, host: str, port: int) -> None:
        tel_ref = tel
        page = index_page(tel.name)

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                url = urllib.parse.urlparse(self.path)
                q = urllib.parse.parse_qs(url.query)
                try:
                    if url.path in ("/", "/index.html"):
                        self._send(200, page, "text/html; charset=utf-8")
                    elif url.path == "/api/state":
                        self._send(200, json.dumps(tel_ref.state_json()).encode(), "application/json")
                    elif url.path == "/api/sql":
                        try:
                            res = tel_ref.sql(q.get("q", [""])[0])
                            body: dict[str, Any] = {"rows": list(res), "missing": res.missing}
                        except ValueError as exc:
                            body = {"error": str(exc)}
                        self._send(200, json.dumps(body, default=str).encode(), "application/json")
                    elif url.path == "/api/stacks":
                        only = [int(r) for r in q.get("rank", [])] or None
                        self._send(200, json.dumps(tel_ref.stacks(ranks=only)).encode(), "application/json")
                    elif url.path == "/metrics":
                        self._send(200, tel_ref.metrics().encode(), "text/plain; version=0.0.4; charset=utf-8")
                    else:
                        self._send(404, b"not found\n", "text/plain")
                except Exception as exc:  # a stopped mesh, a dead rank: say so, keep serving
                    self._send(500, f"{type(exc).__name__}: {exc}\n".encode(), "text/plain")

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        h, p = self.httpd.server_address[:2]
        self.url = f"http://{h!s}:{p}/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="mesharray-telemetry-http",
                                       daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(2.0)
