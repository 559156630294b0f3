"""The telemetry tables: what was collected, as an in-memory SQLite database.

:func:`build_database` makes a fresh ``sqlite3`` database per query from
:attr:`Telemetry.store <mesharray.observe.collect.Telemetry.store>` (the rows
collected from the workers), the controller's log lines
(:class:`~mesharray.runtime.logs.LogSink`) and its view of each worker (alive,
unresponsive, died). Times become Unix seconds and durations microseconds.

Spans need no bytes on the wire: a call's span id is ``"<caller pid>-<msg id>"``
(hex), which both ends know. A call made while handling another one is
recorded by its caller as a *link* to the call being handled; the parent of
each span and the root of its tree (its ``trace_id``) are resolved here from
those links, following at most 64 of them.

Tables (columns)::

    messages  time, rank, host, pid, actor, endpoint, duration_us, bytes_in, bytes_out, status,
              span_id, parent_id, trace_id, caller_pid
    spans     span_id, parent_id, trace_id, name, rank, host, start, duration_us, status   (a view)
    actors    time, rank, host, actor, event, detail       (event: spawned, spawn_failed, stopped, died)
    errors    time, rank, host, actor, endpoint, type, message, traceback
    logs      time, rank, label, stream, level, text
    processes time, rank, host, pid, cpu_s, rss_bytes, threads, fds
    ranks     rank, label, host, pid, state, actor, endpoint, busy_s   (now: idle, busy, unresponsive, dead)
"""

from __future__ import annotations

import sqlite3
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .collect import Telemetry

__all__ = ["QueryResult", "SCHEMA", "build_database", "run_query", "rank_rows"]

SCHEMA = """
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
"""


class QueryResult(list):
    """Rows (dicts) of a telemetry query; ``missing`` lists the ranks that did not answer and why."""

    missing: list[dict]

    def __init__(self, rows: list, missing: list[dict]) -> None:
        super().__init__(rows)
        self.missing = missing

    @property
    def missing_hosts(self) -> list[str]:
        return sorted({m["host"] for m in self.missing if m.get("host")})


def rank_rows(tel: Telemetry) -> list[tuple]:
    """The ``ranks`` table: each worker's state now, and what it is busy in (from the last collection)."""
    out = []
    now = time.time_ns()
    for rank, info in sorted(tel.controller.workers.items()):
        st = tel.state.get(rank, {})
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
        out.append((rank, tel.labels.get(rank, f"rank={rank}"), info.hello.get("host_id") or info.host,
                    info.pid, state, actor, endpoint, busy))
    return out


def _deaths(tel: Telemetry) -> list[tuple]:
    out = []
    for rank, info in tel.controller.workers.items():
        if info.error is not None:
            out.append((info.died_at or time.time(), rank, info.hello.get("host_id") or info.host,
                        "*", "died", str(info.error)[:500]))
    return out


def build_database(tel: Telemetry) -> sqlite3.Connection:
    """An in-memory SQLite database of everything ``tel`` collected (the caller holds ``tel.lock``)."""
    db = sqlite3.connect(":memory:", check_same_thread=False)
    db.executescript(SCHEMA)
    # (caller pid, msg id) of a call -> that of the call its caller was handling
    parents = {(r[6], r[7]): (r[4], r[5]) for r in tel.store["links"]}

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
    for rank, host, pid, w0, dur, actor, ep, caller, mid, bin_, bout, status in tel.store["messages"]:
        parent = parents.get((caller, mid))
        msgs.append((w0 / 1e9, rank, host, pid, actor, ep, dur / 1e3, bin_, bout, status, sid(caller, mid),
                     sid(*parent) if parent else None, trace(caller, mid), caller))
    db.executemany("INSERT INTO messages VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)", msgs)
    db.executemany("INSERT INTO actors VALUES (?,?,?,?,?,?)",
                   [(t / 1e9, rank, host, name, ev, detail) for rank, host, _, t, name, ev, detail
                    in tel.store["actors"]] + _deaths(tel))
    db.executemany("INSERT INTO errors VALUES (?,?,?,?,?,?,?,?)",
                   [(t / 1e9, rank, host, a, ep, ty, msg, tb) for rank, host, _, t, a, ep, ty, msg, tb
                    in tel.store["errors"]])
    db.executemany("INSERT INTO logs VALUES (?,?,?,?,?,?)", tel.controller.sink.rows())
    db.executemany("INSERT INTO processes VALUES (?,?,?,?,?,?,?,?)",
                   [(t / 1e9, rank, host, pid, cpu, rss, th, fds) for rank, host, pid, t, cpu, rss, th, fds
                    in tel.store["samples"]]
                   + [(st["process"][0] / 1e9, rank, st["host"], st["pid"], *st["process"][1:])
                      for rank, st in tel.state.items()])
    db.executemany("INSERT INTO ranks VALUES (?,?,?,?,?,?,?,?)", rank_rows(tel))
    return db


def run_query(db: sqlite3.Connection, query: str, params: tuple | dict, missing: list[dict]) -> QueryResult:
    """Run ``query`` on ``db`` and close it; rows as dicts (an SQL error is a ``ValueError`` naming the query)."""
    try:
        cur = db.execute(query, params)
        cols = [d[0] for d in cur.description or ()]
        rows = [dict(zip(cols, r)) for r in cur.fetchall()]
    except sqlite3.Error as exc:
        raise ValueError(f"telemetry query failed: {exc}; query: {query!r}") from None
    finally:
        db.close()
    return QueryResult(rows, missing)
