"""procs.telemetry: SQL over what every rank recorded, Prometheus, traces, OTLP, stacks, logs, titles."""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import mesharray as ma
from tests.support.actors import Busy

pytestmark = pytest.mark.timeout(120)


def _until(fn, timeout=5.0, ok=bool):
    """Retry ``fn`` until ``ok(result)`` (ingestion is asynchronous); the last result."""
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if ok(v) or time.monotonic() > deadline:
            return v
        time.sleep(0.05)


@pytest.fixture(scope="module")
def mesh():
    procs = ma.proc_mesh(procs=4)
    busy = procs.spawn("busy", Busy)
    yield procs, busy
    procs.stop()


def test_messages_count_calls_per_endpoint_and_rank(mesh):
    procs, busy = mesh
    before = procs.telemetry.sql("SELECT count(*) AS n FROM messages WHERE endpoint = 'step'")[0]["n"]
    for _ in range(25):
        busy.step.call(1).get()
    rows = procs.telemetry.sql("SELECT rank, count(*) AS n, avg(duration_us) AS us, min(bytes_in) AS bi, "
                               "min(bytes_out) AS bo FROM messages WHERE actor = 'busy' AND endpoint = 'step' "
                               "GROUP BY rank ORDER BY rank")
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    assert sum(r["n"] for r in rows) == before + 100
    assert all(r["us"] > 0 and r["bi"] > 0 and r["bo"] > 0 for r in rows)
    assert rows.missing == []



def test_a_call_is_in_telemetry_as_soon_as_its_reply_is_back(mesh):
    # telemetry questions come on a connection of their own: the row of a call must be there
    # before its reply is written, or a query right after the reply can miss it
    procs, busy = mesh
    one = busy.slice(procs=2)

    def count() -> int:
        return procs.telemetry.sql("SELECT count(*) AS n FROM messages WHERE endpoint = 'step' AND rank = 2")[0]["n"]

    before = count()
    for i in range(1, 41):
        one.step.call_one(1).get()
        assert count() == before + i

def test_errors_are_kept_with_their_remote_traceback(mesh):
    procs, busy = mesh
    with pytest.raises(ma.ActorError):
        busy.slice(procs=2).boom.call_one().get()
    errs = procs.telemetry.sql("SELECT rank, actor, endpoint, type, message, traceback FROM errors "
                               "WHERE endpoint = 'boom'")
    assert len(errs) == 1 and errs[0]["rank"] == 2 and errs[0]["type"] == "KeyError"
    assert "raise KeyError" in errs[0]["traceback"]
    st = procs.telemetry.sql("SELECT status FROM messages WHERE endpoint = 'boom'")
    assert [r["status"] for r in st] == ["KeyError"]


def test_nested_calls_are_spans_of_one_trace(mesh):
    procs, busy = mesh
    assert busy.slice(procs=1).nested.call_one(busy, 3).get() == 11
    rows = procs.telemetry.sql(
        "SELECT c.name AS child, c.rank AS child_rank, p.name AS parent, p.rank AS parent_rank, "
        "c.trace_id = p.trace_id AS same_trace, p.parent_id IS NULL AS parent_is_root "
        "FROM spans c JOIN spans p ON c.parent_id = p.span_id WHERE p.name = 'busy.nested'")
    assert rows == [{"child": "busy.step", "child_rank": 3, "parent": "busy.nested", "parent_rank": 1,
                     "same_trace": 1, "parent_is_root": 1}]


def test_actors_processes_and_ranks_tables(mesh):
    procs, _ = mesh
    other = procs.spawn("short_lived", Busy)
    other.stop()
    tel = procs.telemetry
    ev = _until(lambda: tel.sql("SELECT event, count(*) AS n FROM actors WHERE actor = 'short_lived' "
                                "GROUP BY event ORDER BY event"),
                ok=lambda v: v == [{"event": "spawned", "n": 4}, {"event": "stopped", "n": 4}])
    assert ev == [{"event": "spawned", "n": 4}, {"event": "stopped", "n": 4}]  # (stop is fire-and-forget)
    p = tel.sql("SELECT rank, pid, rss_bytes, threads, fds FROM processes ORDER BY time DESC LIMIT 4")
    assert {r["rank"] for r in p} == {0, 1, 2, 3}
    assert all(r["rss_bytes"] > 1 << 20 and r["threads"] >= 2 and r["fds"] > 3 for r in p)
    assert {r["pid"] for r in p} == set(procs.pids)
    ranks = tel.sql("SELECT rank, state, label FROM ranks ORDER BY rank")
    assert [r["state"] for r in ranks] == ["idle"] * 4
    assert ranks[3]["label"] == "procs=3"


def test_a_busy_rank_shows_its_endpoint_and_its_stack(mesh):
    procs, busy = mesh
    fut = busy.slice(procs=2).hang_here_for_a_while.call_one(20.0)
    try:
        row = _until(lambda: procs.telemetry.sql("SELECT state, actor, endpoint FROM ranks WHERE rank = 2 AND "
                                                 "state = 'busy'"))
        assert row == [{"state": "busy", "actor": "busy", "endpoint": "hang_here_for_a_while"}]
        stacks = procs.stacks(timeout=10)
        assert set(stacks) == {0, 1, 2, 3}
        assert "hang_here_for_a_while" in stacks[2] and "hang_here_for_a_while" not in stacks[1]
    finally:
        procs.telemetry  # (keeps the mesh's telemetry open)
        from tests.support.actors import release

        release.set()  # (only in this process; the worker's loop ends at its deadline)
    with pytest.raises(TimeoutError):
        fut.get(timeout=0.01)


def test_prometheus_text_parses_and_counts(mesh):
    parser = pytest.importorskip("prometheus_client.parser", reason="prometheus_client (test extra) not installed")
    procs, busy = mesh
    busy.step.call(1).get()
    text = procs.telemetry.metrics()
    fams = {f.name: f for f in parser.text_string_to_metric_families(text)}
    calls = fams["mesharray_calls"]
    step = [s for s in calls.samples if s.labels.get("endpoint") == "step" and s.labels["status"] == "ok"]
    assert step and step[0].value >= 4
    hist = fams["mesharray_call_duration_seconds"]
    count = [s for s in hist.samples if s.name.endswith("_count") and s.labels["endpoint"] == "step"]
    assert count[0].value == step[0].value
    rss = fams["mesharray_process_resident_memory_bytes"]
    assert len(rss.samples) == 4 and all(s.value > 0 for s in rss.samples)
    up = fams["mesharray_rank_up"]
    assert sorted(s.value for s in up.samples) == [1, 1, 1, 1]


def test_trace_file_is_chrome_trace_json(mesh, tmp_path):
    procs, busy = mesh
    busy.step.call(1).get()
    n = procs.telemetry.trace(str(tmp_path / "t.json"), window=60)
    data = json.loads((tmp_path / "t.json").read_text())
    slices = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert n == len(data["traceEvents"]) and len(slices) >= 4
    assert {"name", "ts", "dur", "pid", "tid"} <= set(slices[0])
    assert any(e["name"] == "busy.step" for e in slices)


def test_otlp_export_reaches_a_collector(mesh):
    procs, busy = mesh
    got: dict[str, list] = {}

    class Collector(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            got.setdefault(self.path, []).append(json.loads(body))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        busy.say.call("otlp says hi").get()
        busy.step.call(1).get()
        n = procs.telemetry.export_otlp(f"http://127.0.0.1:{srv.server_address[1]}")
        assert set(got) == {"/v1/traces", "/v1/metrics", "/v1/logs"}
        spans = got["/v1/traces"][0]["resourceSpans"][0]["scopeSpans"][0]["spans"]
        assert len(spans) == n["spans"] and any(s["name"] == "busy.step" for s in spans)
        assert all(len(s["traceId"]) == 32 and len(s["spanId"]) == 16 for s in spans)
        logs = got["/v1/logs"][0]["resourceLogs"][0]["scopeLogs"][0]["logRecords"]
        assert any(r["body"]["stringValue"] == "otlp says hi" for r in logs)
    finally:
        srv.shutdown()
        srv.server_close()


def test_otlp_export_starts_by_itself_when_the_endpoint_is_set(monkeypatch):
    got: list = []

    class Collector(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            got.append((self.path, body))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{srv.server_address[1]}")
    monkeypatch.setenv("MESHARRAY_OTLP_INTERVAL", "0.3")
    procs = ma.proc_mesh(procs=2)
    try:
        procs.spawn("auto", Busy).step.call(1).get()

        def names():
            return [s["name"] for p, b in list(got) if p == "/v1/traces"
                    for s in b["resourceSpans"][0]["scopeSpans"][0]["spans"]]

        assert _until(lambda: names().count("auto.step") == 2, timeout=10)
        time.sleep(0.8)  # later rounds send only what is new: no span twice
        assert names().count("auto.step") == 2
    finally:
        procs.stop()
        srv.shutdown()
        srv.server_close()


def test_bad_sql_is_a_clear_error_and_the_mesh_lives(mesh):
    procs, busy = mesh
    with pytest.raises(ValueError, match="no such table: nope"):
        procs.telemetry.sql("SELECT * FROM nope")
    assert busy.slice(procs=0).step.call_one(1).get() == 2


def test_workers_carry_mesh_rank_and_actor_in_their_process_title(mesh):
    procs, _ = mesh
    with open(f"/proc/{procs.pids[3]}/comm") as f:
        comm = f.read().strip()
    assert comm.startswith("mesharray")


def test_a_dead_rank_is_reported_missing_and_the_rest_answer():
    procs = ma.proc_mesh(procs=3)
    try:
        b = procs.spawn("b", Busy)
        b.step.call(1).get()
        os.kill(procs.pids[1], 9)
        _until(lambda: procs.stats()["alive"] == 2)
        res = procs.telemetry.sql("SELECT DISTINCT rank FROM messages WHERE time > 0 ORDER BY rank")
        assert [m["rank"] for m in res.missing] == [1] and "dead" in res.missing[0]["why"]
        assert [r["rank"] for r in res] == [0, 2]
        died = procs.telemetry.sql("SELECT rank, event FROM actors WHERE event = 'died'")
        assert died == [{"rank": 1, "event": "died"}]
    finally:
        procs.stop()


def test_identical_lines_from_many_ranks_print_once(capsys):
    procs = ma.proc_mesh(procs=8)
    try:
        b = procs.spawn("b", Busy)
        b.say.call("hello from everyone").get()
        b.slice(procs=3).say.call_one("only three").get()
        rows = _until(lambda: len(procs.telemetry.sql("SELECT rank FROM logs WHERE text = 'hello from everyone'"))
                      == 8)
        assert rows
    finally:
        procs.stop()
    out = capsys.readouterr().out
    assert "[procs=0:8] hello from everyone" in out
    assert out.count("hello from everyone") == 1
    assert "[procs=3] only three" in out


def test_aggregation_can_be_switched_off(capsys, monkeypatch):
    monkeypatch.setenv("MESHARRAY_LOG_AGGREGATE", "0")
    procs = ma.proc_mesh(procs=4)
    try:
        procs.spawn("b", Busy).say.call("each of us").get()
        # (a line travels from the worker's pipe on its own: wait until all four arrived)
        assert _until(lambda: len(procs.telemetry.sql("SELECT rank FROM logs WHERE text = 'each of us'")) == 4)
    finally:
        procs.stop()
    out = capsys.readouterr().out
    assert out.count("each of us") == 4 and "[procs=2] each of us" in out
