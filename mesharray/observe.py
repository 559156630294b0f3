"""Seeing what a mesh does: ``procs.telemetry`` — SQL, Prometheus, traces, a live web view, stacks.

Every worker records its calls, actors, errors and process samples
(:mod:`mesharray.runtime.recorder`); the controller records its workers' log
lines and deaths. :class:`Telemetry` collects from every rank on demand — over
a connection of its own to each worker, so a rank busy in a long call still
answers — and keeps what it collected for ``MESHARRAY_TELEMETRY_RETENTION``
seconds (600).

- :meth:`Telemetry.sql` loads the tables into an in-memory SQLite database and
  runs a query; rows come back as dicts, with ``.missing`` naming the ranks
  (and hosts) that did not answer.
- :meth:`Telemetry.metrics` is the Prometheus text exposition;
  :meth:`Telemetry.trace` writes a Chrome/Perfetto trace file;
  :meth:`Telemetry.export_otlp` posts spans, metrics and logs as OTLP/JSON to an
  OpenTelemetry collector (``OTEL_EXPORTER_OTLP_ENDPOINT``).
- :meth:`Telemetry.serve` starts the live web view (and ``/metrics``);
  ``python -m mesharray top URL`` is the terminal view of the same data.
- :meth:`Telemetry.stacks` (``procs.stacks()``): every rank's Python thread stacks.

Tables (columns)::

    messages  time, rank, host, pid, actor, endpoint, duration_us, bytes_in, bytes_out, status,
              span_id, parent_id, trace_id, caller_pid
    spans     span_id, parent_id, trace_id, name, rank, host, start, duration_us, status   (a view)
    actors    time, rank, host, actor, event, detail       (event: spawned, spawn_failed, stopped, died)
    errors    time, rank, host, actor, endpoint, type, message, traceback
    logs      time, rank, label, stream, level, text
    processes time, rank, host, pid, cpu_s, rss_bytes, threads, fds
    ranks     rank, label, host, pid, state, actor, endpoint, busy_s   (now: idle, busy, unresponsive, dead)

``time``/``start`` are Unix seconds; a span id is ``"<caller pid>-<msg id>"``;
a call made from inside an actor has the call being handled as its parent, and
every span of one tree shares its root's ``trace_id``.
"""

from __future__ import annotations

import html
import json
import logging
import os
import pickle
import sqlite3
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

from .runtime.caller import future_callback
from .runtime import protocol as P
from .runtime.channel import Channel
from .runtime.controller import Controller
from .runtime.future import Future, new_future
from .runtime.recorder import BUCKETS
from .telemetry import compress_labels  # noqa: F401  (re-exported)
from .transport.connection import connect

__all__ = ["Telemetry", "QueryResult", "RETENTION"]

log = logging.getLogger("mesharray.telemetry")

RETENTION = float(os.environ.get("MESHARRAY_TELEMETRY_RETENTION", "600"))
_MAX_KEEP = 500_000  # rows per table kept at the controller


class QueryResult(list):
    """Rows (dicts) of a telemetry query; ``missing`` lists the ranks that did not answer and why."""

    missing: list[dict]

    def __init__(self, rows: list, missing: list[dict]) -> None:
        super().__init__(rows)
        self.missing = missing

    @property
    def missing_hosts(self) -> list[str]:
        return sorted({m["host"] for m in self.missing if m.get("host")})


class _Link:
    """A dedicated connection to one worker for telemetry requests."""

    def __init__(self, address: str, secret: bytes, identity: dict) -> None:
        sock = connect(address, secret, timeout=3.0)
        try:  # (a worker gone right after the handshake: its socket closed here, not left to gc)
            self.chan = Channel(sock, name=f"telemetry {address}")
            self.chan.send(P.HELLO, parts=[pickle.dumps(identity)])
            self.chan.start(polled=True)
        except BaseException:
            sock.close()
            raise

    def ask(self, req: dict) -> Future[Any]:
        fut: Future[Any] = new_future()
        self.chan.call(P.INTROSPECT, 0, 0, [pickle.dumps(req)], future_callback(fut))
        return fut

    def close(self) -> None:
        self.chan.close(join=False)


class Telemetry:
    """Telemetry of one process mesh (``procs.telemetry``); see the module docstring."""

    def __init__(self, controller: Controller, labels: dict[int, str], name: str) -> None:
        self.controller = controller
        self.labels = labels
        self.name = name
        self._links: dict[int, _Link] = {}
        self._next: dict[int, dict] = {}
        self._lock = threading.RLock()
        self.store: dict[str, list] = {k: [] for k in ("messages", "links", "actors", "errors", "samples")}
        self.state: dict[int, dict] = {}
        self.aggregates: dict[int, dict] = {}
        self._server: _Server | None = None
        self._closed = False
        self._exported_until = 0.0  # unix time of the newest span or log line sent to OTLP

    # -- collection -----------------------------------------------------------------
    def _link(self, rank: int) -> _Link:
        link = self._links.get(rank)
        if link is None or link.chan.closed:
            info = self.controller.workers[rank]
            link = self._links[rank] = _Link(info.address, self.controller.secret,
                                             {"role": "telemetry", "pid": os.getpid()})
        return link

    def _ask_all(self, req_of, timeout: float) -> tuple[dict[int, Any], list[dict]]:
        answers: dict[int, Any] = {}
        missing: list[dict] = []
        futs = {}
        for rank, info in sorted(self.controller.workers.items()):
            host = info.hello.get("host_id") or info.host
            if not info.alive:
                missing.append({"rank": rank, "host": host, "why": f"dead: {info.error}"})
                continue
            try:
                futs[rank] = (self._link(rank).ask(req_of(rank)), host)
            except Exception as exc:
                missing.append({"rank": rank, "host": host, "why": f"unreachable: {exc}"})
        deadline = time.monotonic() + timeout
        for rank, (fut, host) in futs.items():
            try:
                answers[rank] = fut.get(timeout=max(0.01, deadline - time.monotonic()))
            except BaseException as exc:
                missing.append({"rank": rank, "host": host, "why": f"{type(exc).__name__}: {exc}"})
                link = self._links.pop(rank, None)
                if link is not None:
                    link.close()
        return answers, missing

    def collect(self, timeout: float = 3.0, agg: bool = False) -> list[dict]:
        """Fetch what every rank recorded since the last collection; returns the ranks that did not answer."""
        with self._lock:
            if self._closed:
                raise RuntimeError("telemetry of a stopped mesh")
            answers, missing = self._ask_all(
                lambda r: {"what": "snapshot", "since": self._next.get(r), "agg": agg}, timeout)
            for rank, a in answers.items():
                self._next[rank] = a["next"]
                host, pid = a.get("host"), a["pid"]
                for row in a["messages"]:
                    self.store["messages"].append((rank, host, pid) + tuple(row))
                for name in ("links", "actors", "errors", "samples"):
                    self.store[name].extend((rank, host, pid) + tuple(x) for x in a[name])
                self.state[rank] = {"now": a["now"], "current": a["current"], "process": a["process"],
                                    "host": host, "pid": pid}
                if a.get("aggregates") is not None:
                    self.aggregates[rank] = a["aggregates"]
            cutoff = time.time_ns() - int(RETENTION * 1e9)
            for name, rows in self.store.items():
                if rows and (rows[0][3] < cutoff or len(rows) > _MAX_KEEP):
                    keep = [r for r in rows if r[3] >= cutoff][-_MAX_KEEP:]
                    self.store[name] = keep
            return missing

    # -- tables ------------------------------------------------------------------
    def _spans(self) -> dict[tuple[int, int], tuple[int, int]]:
        return {(r[6], r[7]): (r[4], r[5]) for r in self.store["links"]}

    def _rank_rows(self) -> list[tuple]:
        out = []
        now = time.time_ns()
        for rank, info in sorted(self.controller.workers.items()):
            st = self.state.get(rank, {})
            cur = st.get("current") or []
            actor = endpoint = None
            busy = 0.0
            if not info.alive:
                state = "dead"
            elif info.unresponsive_since is not None:
                state = "unresponsive"
            elif cur:
                state = "busy"
                actor, endpoint, t0 = min(cur, key=lambda c: c[2])
                busy = max(0.0, (now - t0) / 1e9)
            else:
                state = "idle"
            out.append((rank, self.labels.get(rank, f"rank={rank}"), info.hello.get("host_id") or info.host,
                        info.pid, state, actor, endpoint, busy))
        return out

    def database(self) -> sqlite3.Connection:
        """An in-memory SQLite database of everything collected (after collecting)."""
        db = sqlite3.connect(":memory:", check_same_thread=False)
        db.executescript("""
            CREATE TABLE messages (time REAL, rank INT, host TEXT, pid INT, actor TEXT, endpoint TEXT,
                duration_us REAL, bytes_in INT, bytes_out INT, status TEXT, span_id TEXT, parent_id TEXT,
                trace_id TEXT, caller_pid INT);
            CREATE VIEW spans AS SELECT span_id, parent_id, trace_id, actor || '.' || endpoint AS name, rank, host,
                time AS start, duration_us, status FROM messages;
            CREATE TABLE actors (time REAL, rank INT, host TEXT, actor TEXT, event TEXT, detail TEXT);
            CREATE TABLE errors (time REAL, rank INT, host TEXT, actor TEXT, endpoint TEXT, type TEXT,
                message TEXT, traceback TEXT);
            CREATE TABLE logs (time REAL, rank INT, label TEXT, stream TEXT, level TEXT, text TEXT);
            CREATE TABLE processes (time REAL, rank INT, host TEXT, pid INT, cpu_s REAL, rss_bytes INT,
                threads INT, fds INT);
            CREATE TABLE ranks (rank INT, label TEXT, host TEXT, pid INT, state TEXT, actor TEXT, endpoint TEXT,
                busy_s REAL);
        """)
        parents = self._spans()

        def sid(pid: int, mid: int) -> str:
            return f"{pid:x}-{mid:x}"

        def trace(pid: int, mid: int) -> str:
            key = (pid, mid)
            for _ in range(64):
                up = parents.get(key)
                if up is None:
                    break
                key = up
            return sid(*key)

        msgs = []
        for rank, host, pid, w0, dur, actor, ep, caller, mid, bin_, bout, status in self.store["messages"]:
            parent = parents.get((caller, mid))
            msgs.append((w0 / 1e9, rank, host, pid, actor, ep, dur / 1e3, bin_, bout, status, sid(caller, mid),
                         sid(*parent) if parent else None, trace(caller, mid), caller))
        db.executemany("INSERT INTO messages VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)", msgs)
        db.executemany("INSERT INTO actors VALUES (?,?,?,?,?,?)",
                       [(t / 1e9, rank, host, name, ev, detail) for rank, host, _, t, name, ev, detail
                        in self.store["actors"]] + self._deaths())
        db.executemany("INSERT INTO errors VALUES (?,?,?,?,?,?,?,?)",
                       [(t / 1e9, rank, host, a, ep, ty, msg, tb) for rank, host, _, t, a, ep, ty, msg, tb
                        in self.store["errors"]])
        db.executemany("INSERT INTO logs VALUES (?,?,?,?,?,?)", self.controller.sink.rows())
        db.executemany("INSERT INTO processes VALUES (?,?,?,?,?,?,?,?)",
                       [(t / 1e9, rank, host, pid, cpu, rss, th, fds) for rank, host, pid, t, cpu, rss, th, fds
                        in self.store["samples"]]
                       + [(st["process"][0] / 1e9, rank, st["host"], st["pid"], *st["process"][1:])
                          for rank, st in self.state.items()])
        db.executemany("INSERT INTO ranks VALUES (?,?,?,?,?,?,?,?)", self._rank_rows())
        return db

    def _deaths(self) -> list[tuple]:
        out = []
        for rank, info in self.controller.workers.items():
            if info.error is not None:
                out.append((info.died_at or time.time(), rank, info.hello.get("host_id") or info.host,
                            "*", "died", str(info.error)[:500]))
        return out

    def sql(self, query: str, params: tuple | dict = (), timeout: float = 3.0) -> QueryResult:
        """Run ``query`` over the tables (collected from every rank first); rows as dicts.

        >>> procs.telemetry.sql("SELECT endpoint, count(*) AS n FROM messages GROUP BY endpoint")  # doctest: +SKIP
        [{'endpoint': 'step', 'n': 400}]
        """
        missing = self.collect(timeout)
        with self._lock:
            db = self.database()
        try:
            cur = db.execute(query, params)
            cols = [d[0] for d in cur.description or ()]
            rows = [dict(zip(cols, r)) for r in cur.fetchall()]
        except sqlite3.Error as exc:
            raise ValueError(f"telemetry query failed: {exc}; query: {query!r}") from None
        finally:
            db.close()
        return QueryResult(rows, missing)

    # -- stacks ------------------------------------------------------------------
    def stacks(self, timeout: float = 5.0, native: bool = False) -> dict[int, str]:
        """Each live rank's Python thread stacks (a rank that does not answer within ``timeout`` says why).

        ``native=True``: where ``py-spy`` is installed on a rank's host, its
        ``py-spy dump --native`` of the rank (C frames too) is added.
        """
        with self._lock:
            answers, missing = self._ask_all(lambda r: {"what": "stacks", "native": native}, timeout)
        out = {rank: a["stacks"] for rank, a in answers.items()}
        for m in missing:
            out[m["rank"]] = f"<no stacks: {m['why']}>"
        return dict(sorted(out.items()))

    # -- Prometheus ----------------------------------------------------------------
    def metrics(self, timeout: float = 3.0) -> str:
        """The Prometheus text exposition (``/metrics`` of :meth:`serve`)."""
        self.collect(timeout, agg=True)
        lines = [
            "# HELP mesharray_calls_total Calls handled by actors.",
            "# TYPE mesharray_calls_total counter",
        ]
        hist: list[str] = ["# HELP mesharray_call_duration_seconds Time actors spent handling calls.",
                           "# TYPE mesharray_call_duration_seconds histogram"]
        byts: list[str] = ["# HELP mesharray_call_bytes_total Bytes of calls (in) and replies (out).",
                           "# TYPE mesharray_call_bytes_total counter"]
        total: dict[tuple, list] = {}
        with self._lock:
            for agg in self.aggregates.values():
                for key, a in agg.items():
                    t = total.setdefault(key, [0, 0.0, 0, 0] + [0] * len(BUCKETS))
                    for i, v in enumerate(a):
                        t[i] += v
            procs = dict(self.state)
        for (actor, ep, status), a in sorted(total.items()):
            lab = f'actor="{_esc(actor)}",endpoint="{_esc(ep)}"'
            lines.append(f'mesharray_calls_total{{{lab},status="{_esc(status)}"}} {a[0]}')
            byts.append(f'mesharray_call_bytes_total{{{lab},direction="in"}} {a[2]}')
            byts.append(f'mesharray_call_bytes_total{{{lab},direction="out"}} {a[3]}')
            cum = 0
            for le, c in zip(BUCKETS, a[4:]):
                cum += c
                hist.append(f'mesharray_call_duration_seconds_bucket{{{lab},status="{_esc(status)}",le="{le:g}"}} {cum}')
            hist.append(f'mesharray_call_duration_seconds_bucket{{{lab},status="{_esc(status)}",le="+Inf"}} {a[0]}')
            hist.append(f'mesharray_call_duration_seconds_sum{{{lab},status="{_esc(status)}"}} {a[1]:.9g}')
            hist.append(f'mesharray_call_duration_seconds_count{{{lab},status="{_esc(status)}"}} {a[0]}')
        gauges = []
        for metric, idx, help_ in (("mesharray_process_cpu_seconds_total", 1, "CPU time of a worker process."),
                                   ("mesharray_process_resident_memory_bytes", 2, "Resident memory of a worker."),
                                   ("mesharray_process_threads", 3, "Threads of a worker process."),
                                   ("mesharray_process_open_fds", 4, "Open file descriptors of a worker.")):
            kind = "counter" if metric.endswith("_total") else "gauge"
            gauges += [f"# HELP {metric} {help_}", f"# TYPE {metric} {kind}"]
            for rank, st in sorted(procs.items()):
                gauges.append(f'{metric}{{mesh="{_esc(self.name)}",rank="{rank}",host="{_esc(str(st["host"]))}"}} '
                              f'{st["process"][idx]}')
        states = ["# HELP mesharray_rank_up Whether a rank's process is alive (1) or dead (0).",
                  "# TYPE mesharray_rank_up gauge"]
        for rank, info in sorted(self.controller.workers.items()):
            states.append(f'mesharray_rank_up{{mesh="{_esc(self.name)}",rank="{rank}"}} {int(info.alive)}')
        return "\n".join(lines + hist + byts + gauges + states) + "\n"

    # -- traces ----------------------------------------------------------------------
    def trace(self, path: str, window: float | None = None) -> int:
        """Write the calls of the last ``window`` seconds (default: all kept) as a Chrome/Perfetto trace.

        Open it in https://ui.perfetto.dev or chrome://tracing: one process per
        rank, one slice per call. Returns the number of events written.
        """
        self.collect()
        cutoff = 0 if window is None else time.time_ns() - int(window * 1e9)
        events: list[dict] = []
        with self._lock:
            rows = [r for r in self.store["messages"] if r[3] >= cutoff]
        for rank in sorted({r[0] for r in rows}):
            events.append({"name": "process_name", "ph": "M", "pid": rank,
                           "args": {"name": f"{self.labels.get(rank, rank)}"}})
        for rank, host, pid, w0, dur, actor, ep, caller, mid, bin_, bout, status in rows:
            events.append({"name": f"{actor}.{ep}", "cat": actor, "ph": "X", "ts": w0 / 1e3, "dur": dur / 1e3,
                           "pid": rank, "tid": pid,
                           "args": {"status": status, "bytes_in": bin_, "bytes_out": bout,
                                    "span": f"{caller:x}-{mid:x}", "host": host}})
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
        return len(events)

    # -- OpenTelemetry -----------------------------------------------------------------
    def start_otlp_export(self, endpoint: str | None = None, interval: float | None = None) -> None:
        """Export to an OTLP collector every ``interval`` s (``MESHARRAY_OTLP_INTERVAL``, 10) until the mesh stops.

        Started by itself for every mesh when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set.
        Each round sends what was recorded since the last one.
        """
        every = float(os.environ.get("MESHARRAY_OTLP_INTERVAL", "10")) if interval is None else interval

        def loop() -> None:
            while not self._closed:
                time.sleep(every)
                if self._closed:
                    return
                try:
                    self.export_otlp(endpoint)
                except Exception as exc:  # a collector that is down costs that round only
                    log.warning("OTLP export to %s failed: %s", endpoint or os.environ.get(
                        "OTEL_EXPORTER_OTLP_ENDPOINT"), exc)

        threading.Thread(target=loop, name="mesharray-otlp", daemon=True).start()

    def export_otlp(self, endpoint: str | None = None, timeout: float = 5.0) -> dict[str, int]:
        """POST spans, metrics and logs as OTLP/JSON to ``endpoint`` (default ``OTEL_EXPORTER_OTLP_ENDPOINT``).

        Uses OTLP's HTTP/JSON encoding (``/v1/traces``, ``/v1/metrics``, ``/v1/logs``),
        which every OpenTelemetry collector accepts; no SDK needed. Sends what
        was recorded since the last export; returns how many records of each
        kind were sent (metrics are cumulative counters, sent whole).
        """
        endpoint = (endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "").rstrip("/")
        if not endpoint:
            raise ValueError("no OTLP endpoint: pass one or set OTEL_EXPORTER_OTLP_ENDPOINT")
        self.collect(agg=True)
        db = self.database()
        since = self._exported_until
        try:
            spans = db.execute("SELECT span_id, parent_id, trace_id, name, rank, host, start, duration_us, status "
                               "FROM spans WHERE start > ?", (since,)).fetchall()
            logs = db.execute("SELECT time, rank, label, stream, level, text FROM logs WHERE time > ?",
                              (since,)).fetchall()
        finally:
            db.close()
        self._exported_until = max([since] + [r[6] for r in spans] + [r[0] for r in logs])
        resource = {"attributes": [_kv("service.name", "mesharray"), _kv("mesharray.mesh", self.name)]}
        otlp_spans = []
        for sid, parent, tid, name, rank, host, start, dur, status in spans:
            s = {"traceId": _hexid(tid, 32), "spanId": _hexid(sid, 16), "name": name, "kind": 2,
                 "startTimeUnixNano": str(int(start * 1e9)), "endTimeUnixNano": str(int(start * 1e9 + dur * 1e3)),
                 "attributes": [_kv("mesharray.rank", rank), _kv("mesharray.host", host or "")],
                 "status": {"code": 1 if status == "ok" else 2, "message": "" if status == "ok" else status}}
            if parent:
                s["parentSpanId"] = _hexid(parent, 16)
            otlp_spans.append(s)
        now = str(time.time_ns())
        points = []
        with self._lock:
            for rank, agg in self.aggregates.items():
                for (actor, ep, status), a in agg.items():
                    points.append({"attributes": [_kv("actor", actor), _kv("endpoint", ep), _kv("status", status),
                                                  _kv("rank", rank)],
                                   "timeUnixNano": now, "asInt": str(a[0])})
        metrics = [{"name": "mesharray_calls_total", "sum": {"dataPoints": points, "aggregationTemporality": 2,
                                                             "isMonotonic": True}}]
        records = [{"timeUnixNano": str(int(t * 1e9)), "severityText": level or "", "body": {"stringValue": text},
                    "attributes": [_kv("mesharray.rank", rank), _kv("mesharray.label", label),
                                   _kv("mesharray.stream", stream)]}
                   for t, rank, label, stream, level, text in logs]
        scope = {"name": "mesharray"}
        _post(f"{endpoint}/v1/traces", {"resourceSpans": [{"resource": resource, "scopeSpans": [
            {"scope": scope, "spans": otlp_spans}]}]}, timeout)
        _post(f"{endpoint}/v1/metrics", {"resourceMetrics": [{"resource": resource, "scopeMetrics": [
            {"scope": scope, "metrics": metrics}]}]}, timeout)
        _post(f"{endpoint}/v1/logs", {"resourceLogs": [{"resource": resource, "scopeLogs": [
            {"scope": scope, "logRecords": records}]}]}, timeout)
        return {"spans": len(otlp_spans), "metric_points": len(points), "logs": len(records)}

    # -- the web view ------------------------------------------------------------------
    def serve(self, port: int = 0, host: str = "127.0.0.1") -> str:
        """Start (once) the live web view; returns its URL (``/metrics`` is the Prometheus endpoint)."""
        with self._lock:
            if self._server is None:
                self._server = _Server(self, host, port)
            return self._server.url

    def state_json(self, window: float = 60.0) -> dict:
        """What the web view and ``top`` show: ranks, per-endpoint figures, recent errors and logs."""
        self.collect()
        now = time.time_ns()
        cutoff = now - int(window * 1e9)
        with self._lock:
            rows = [r for r in self.store["messages"] if r[3] >= cutoff]
            errors = self.store["errors"][-20:]
        per_rank: dict[int, list] = {}
        per_ep: dict[tuple, list] = {}
        for r in rows:
            per_rank.setdefault(r[0], []).append(r[4])
            per_ep.setdefault((r[5], r[6]), []).append((r[4], r[11]))
        ranks = []
        shape = self.controller.workers
        for rank, label, host, pid, state, actor, ep, busy in self._rank_rows():
            durs = per_rank.get(rank, [])
            st = self.state.get(rank, {})
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
                for t, r, lab, s, lv, tx in self.controller.sink.rows()[-300:]]
        dims = {}
        if shape:
            dims = {"size": len(shape)}
        return {"mesh": self.name, "time": now / 1e9, "window_s": window, "dims": dims, "ranks": ranks,
                "endpoints": endpoints, "logs": logs,
                "errors": [{"time": e[3] / 1e9, "rank": e[0], "host": e[1], "actor": e[4], "endpoint": e[5],
                            "type": e[6], "message": e[7], "traceback": e[8]} for e in errors]}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            links, self._links = list(self._links.values()), {}
            server, self._server = self._server, None
        for link in links:
            link.close()
        if server is not None:
            server.close()


def _esc(s: str) -> str:
    return str(s).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _kv(key: str, value: Any) -> dict:
    if isinstance(value, bool):
        return {"key": key, "value": {"boolValue": value}}
    if isinstance(value, int):
        return {"key": key, "value": {"intValue": str(value)}}
    return {"key": key, "value": {"stringValue": str(value)}}


def _hexid(sid: str | None, width: int) -> str:
    """A span id ``"pid-msg"`` as the fixed-width hex OTLP wants."""
    pid, _, mid = (sid or "0-0").partition("-")
    return (pid.rjust(width // 2, "0") + mid.rjust(width // 2, "0"))[-width:]


def _post(url: str, body: dict, timeout: float) -> None:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        r.read()


# --------------------------------------------------------------------------- web view
_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>mesharray · __MESH__</title>
<style>
 body{font:14px system-ui,sans-serif;margin:16px;background:#fafafa;color:#222}
 h1{font-size:18px} h2{font-size:15px;margin:18px 0 6px}
 #grid{display:flex;flex-wrap:wrap;gap:6px}
 .rank{width:118px;padding:6px;border-radius:6px;color:#fff;font-size:12px;overflow:hidden;word-break:break-all}
 .idle{background:#4a8f4a}.busy{background:#d08a1a}.unresponsive{background:#9a3fb0}.dead{background:#b03a3a}
 table{border-collapse:collapse;font-size:13px} td,th{border-bottom:1px solid #ddd;padding:3px 8px;text-align:left}
 pre{background:#fff;border:1px solid #ddd;padding:6px;max-height:260px;overflow:auto;font-size:12px}
 .legend span{display:inline-block;padding:2px 8px;border-radius:4px;color:#fff;margin-right:6px}
 textarea{width:100%;height:48px;font:13px monospace}
</style></head><body>
<h1>mesharray mesh <b>__MESH__</b> <small id="time"></small></h1>
<div class="legend"><span class="idle">idle</span><span class="busy">busy</span>
<span class="unresponsive">unresponsive</span><span class="dead">dead</span></div>
<h2>Ranks</h2><div id="grid"></div>
<h2>Endpoints (last minute)</h2><table id="eps"><thead><tr><th>actor</th><th>endpoint</th><th>calls</th>
<th>calls/s</th><th>p50 µs</th><th>p99 µs</th><th>errors</th><th>p50 over time</th></tr></thead><tbody></tbody></table>
<h2>Recent errors</h2><div id="errors"></div>
<h2>Logs <select id="logrank"><option value="">all ranks</option></select></h2><pre id="logs"></pre>
<h2>SQL</h2><textarea id="q">SELECT actor, endpoint, count(*) AS n, avg(duration_us) AS avg_us FROM messages GROUP BY actor, endpoint</textarea>
<button id="run">Run</button> <button id="stacks">Stacks of every rank</button><pre id="out"></pre>
<script>
const hist = {};
function esc(s){return String(s==null?"":s).replace(/[&<>]/g,c=>({"&":"&amp;","<":"&lt;",">":"&gt;"}[c]))}
async function tick(){
  const r = await fetch("api/state"); const s = await r.json();
  document.getElementById("time").textContent = new Date(s.time*1000).toLocaleTimeString();
  document.getElementById("grid").innerHTML = s.ranks.map(k =>
    `<div class="rank ${k.state}" data-rank="${k.rank}" title="pid ${k.pid} on ${esc(k.host)}">`+
    `<b>${esc(k.label)}</b><br>${k.state}${k.endpoint?": "+esc(k.actor)+"."+esc(k.endpoint):""}`+
    `<br>${k.calls_per_s}/s p50 ${k.p50_us==null?"-":k.p50_us+"µs"}<br>${k.rss_mib==null?"":k.rss_mib+" MiB"}</div>`).join("");
  const sel = document.getElementById("logrank");
  if (sel.options.length == 1) s.ranks.forEach(k => { const o=document.createElement("option"); o.value=k.rank; o.textContent=k.label; sel.appendChild(o); });
  document.querySelector("#eps tbody").innerHTML = s.endpoints.map(e => {
    const key = e.actor+"."+e.endpoint; (hist[key] = hist[key] || []).push(e.p50_us); if (hist[key].length>60) hist[key].shift();
    const h = hist[key], mx = Math.max(...h, 1);
    const pts = h.map((v,i)=>`${i*2},${20-19*v/mx}`).join(" ");
    return `<tr><td>${esc(e.actor)}</td><td>${esc(e.endpoint)}</td><td>${e.calls}</td><td>${e.calls_per_s}</td>`+
      `<td>${e.p50_us}</td><td>${e.p99_us}</td><td>${e.errors}</td>` +
      `<td><svg width="120" height="20"><polyline fill="none" stroke="#36c" points="${pts}"/></svg></td></tr>`}).join("");
  document.getElementById("errors").innerHTML = s.errors.slice().reverse().map(e =>
    `<details><summary>rank ${e.rank} ${esc(e.actor)}.${esc(e.endpoint)}: <b>${esc(e.type)}</b> ` +
    `${esc(e.message)}</summary><pre>${esc(e.traceback)}</pre></details>`).join("") || "none";
  const want = sel.value;
  document.getElementById("logs").textContent = s.logs.filter(l => want==="" || String(l.rank)===want)
     .map(l => `[${l.label}] ${l.text}`).join("\\n");
}
document.getElementById("run").onclick = async () => {
  const r = await fetch("api/sql?q="+encodeURIComponent(document.getElementById("q").value));
  document.getElementById("out").textContent = JSON.stringify(await r.json(), null, 1);
};
document.getElementById("stacks").onclick = async () => {
  const r = await fetch("api/stacks"); const s = await r.json();
  document.getElementById("out").textContent = Object.entries(s).map(([k,v]) => `== rank ${k}\\n${v}`).join("\\n");
};
document.getElementById("logrank").onchange = tick;
tick(); setInterval(tick, 1000);
</script></body></html>
"""


class _Server:
    def __init__(self, tel: Telemetry, host: str, port: int) -> None:
        tel_ref = tel

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
                        self._send(200, _PAGE.replace("__MESH__", html.escape(tel_ref.name)).encode(),
                                   "text/html; charset=utf-8")
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
                        self._send(200, json.dumps(tel_ref.stacks()).encode(), "application/json")
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
