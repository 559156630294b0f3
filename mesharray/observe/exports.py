"""Exports of the collected telemetry: Prometheus text, Chrome/Perfetto traces, OTLP/JSON.

- :func:`prometheus_text` (``/metrics`` of the web view): per-(actor, endpoint,
  status) call counters, latency histograms and byte counters summed over the
  ranks' folded aggregates (:meth:`~mesharray.runtime.recorder.Recorder.aggregates`,
  buckets :data:`~mesharray.runtime.recorder.BUCKETS`); each rank's last process
  sample as gauges; ``mesharray_rank_up`` from the controller's view of each worker.
- :func:`write_chrome_trace`: the Trace Event format, one process per rank and
  one complete (``X``) event per call, for https://ui.perfetto.dev or
  chrome://tracing.
- :func:`post_otlp`: OTLP's HTTP/JSON encoding (``/v1/traces``, ``/v1/metrics``,
  ``/v1/logs``), posted with ``urllib``, so any OpenTelemetry collector takes it
  without an SDK. It is incremental: spans and log lines newer than
  ``Telemetry.exported_until`` go, and that mark moves before the posts (a
  collector that is down loses that round, never gets it twice); the call
  counters are cumulative and go whole.
"""

from __future__ import annotations

import json
import time
import urllib.request
from typing import TYPE_CHECKING, Any

from ..runtime.recorder import BUCKETS

if TYPE_CHECKING:
    from .collect import Telemetry

__all__ = ["prometheus_text", "write_chrome_trace", "post_otlp"]


def prometheus_text(tel: Telemetry) -> str:
    """The Prometheus text exposition of what ``tel`` collected (its folded aggregates, last samples, liveness)."""
    lines = [
        "# HELP mesharray_calls_total Calls handled by actors.",
        "# TYPE mesharray_calls_total counter",
    ]
    hist: list[str] = ["# HELP mesharray_call_duration_seconds Time actors spent handling calls.",
                       "# TYPE mesharray_call_duration_seconds histogram"]
    byts: list[str] = ["# HELP mesharray_call_bytes_total Bytes of calls (in) and replies (out).",
                       "# TYPE mesharray_call_bytes_total counter"]
    total: dict[tuple, list] = {}
    with tel.lock:
        for agg in tel.aggregates.values():
            for key, a in agg.items():
                t = total.setdefault(key, [0, 0.0, 0, 0] + [0] * len(BUCKETS))
                for i, v in enumerate(a):
                    t[i] += v
        procs = dict(tel.state)
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
            gauges.append(f'{metric}{{mesh="{_esc(tel.name)}",rank="{rank}",host="{_esc(str(st["host"]))}"}} '
                          f'{st["process"][idx]}')
    states = ["# HELP mesharray_rank_up Whether a rank's process is alive (1) or dead (0).",
              "# TYPE mesharray_rank_up gauge"]
    for rank, info in sorted(tel.controller.workers.items()):
        states.append(f'mesharray_rank_up{{mesh="{_esc(tel.name)}",rank="{rank}"}} {int(info.alive)}')
    return "\n".join(lines + hist + byts + gauges + states) + "\n"


def write_chrome_trace(tel: Telemetry, path: str, window: float | None) -> int:
    """Write the calls of the last ``window`` seconds (None: all kept) to ``path``; the number of events."""
    cutoff = 0 if window is None else time.time_ns() - int(window * 1e9)
    events: list[dict] = []
    with tel.lock:
        rows = [r for r in tel.store["messages"] if r[3] >= cutoff]
    for rank in sorted({r[0] for r in rows}):
        events.append({"name": "process_name", "ph": "M", "pid": rank,
                       "args": {"name": f"{tel.labels.get(rank, rank)}"}})
    for rank, host, pid, w0, dur, actor, ep, caller, mid, bin_, bout, status in rows:
        events.append({"name": f"{actor}.{ep}", "cat": actor, "ph": "X", "ts": w0 / 1e3, "dur": dur / 1e3,
                       "pid": rank, "tid": pid,
                       "args": {"status": status, "bytes_in": bin_, "bytes_out": bout,
                                "span": f"{caller:x}-{mid:x}", "host": host}})
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return len(events)


def post_otlp(tel: Telemetry, endpoint: str, timeout: float) -> dict[str, int]:
    """POST what ``tel`` recorded since its last export to ``endpoint``; how many records of each kind went."""
    db = tel.database()
    since = tel.exported_until
    try:
        spans = db.execute("SELECT span_id, parent_id, trace_id, name, rank, host, start, duration_us, status "
                           "FROM spans WHERE start > ?", (since,)).fetchall()
        logs = db.execute("SELECT time, rank, label, stream, level, text FROM logs WHERE time > ?",
                          (since,)).fetchall()
    finally:
        db.close()
    tel.exported_until = max([since] + [r[6] for r in spans] + [r[0] for r in logs])
    resource = {"attributes": [_kv("service.name", "mesharray"), _kv("mesharray.mesh", tel.name)]}
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
    with tel.lock:
        for rank, agg in tel.aggregates.items():
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
