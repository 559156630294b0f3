"""Collection: :class:`Telemetry`, what ``procs.telemetry`` returns (one per root mesh).

:meth:`Telemetry.collect` asks every live worker, at once, for what it recorded
since the indices it last returned (an ``INTROSPECT`` frame; the worker's
:mod:`~mesharray.runtime.recorder` answers), and waits for the answers under
one deadline. Each question goes over a :class:`~mesharray.runtime.channel.Channel`
of its own to that worker, opened on first use and kept, not over the
controller's connection: a rank busy in a long sync call holds that
connection's reader, not this one, and still answers. A dead rank, one that
cannot be reached and one that does not answer in time come back in the
``missing`` list (a channel that got no answer is closed, and a new one opened
at the next question).

On a mesh whose hosts have relays (:mod:`mesharray.runtime.relay`) the
question goes once per host instead: to the host's relay, which asks each of
its ranks over connections of its own (the same way, for the same reason) and
answers once for the host, with what came within the deadline; the ranks it
could not reach or that did not answer come back in ``missing`` with its word
for why.

The controller keeps what it collected in :attr:`Telemetry.store` for
``MESHARRAY_TELEMETRY_RETENTION`` seconds (600), and at most ``_MAX_KEEP`` rows
per table; each rank's last process sample and current calls are in
:attr:`Telemetry.state`, its folded per-endpoint counters in
:attr:`Telemetry.aggregates`. The rest reads these under :attr:`Telemetry.lock`:
:meth:`~Telemetry.sql` (:mod:`.tables`), :meth:`~Telemetry.metrics`,
:meth:`~Telemetry.trace`, :meth:`~Telemetry.export_otlp` (:mod:`.exports`),
:meth:`~Telemetry.serve` and :meth:`~Telemetry.state_json` (:mod:`.web`).
:meth:`Telemetry.stacks` asks every rank for its thread stacks the same way.
"""

from __future__ import annotations

import logging
import os
import pickle
import sqlite3
import threading
import time
from typing import Any

from ..runtime import protocol as P
from ..runtime.caller import future_callback, outcome
from ..runtime.channel import Channel
from ..runtime.controller import Controller
from ..runtime.future import Future, new_future, set_exception, set_result
from ..transport.address import connect
from .exports import post_otlp, prometheus_text, write_chrome_trace
from .tables import QueryResult, build_database, run_query
from .web import Server, live_state

__all__ = ["Telemetry", "QueryResult", "RETENTION"]

log = logging.getLogger("mesharray.telemetry")

RETENTION = float(os.environ.get("MESHARRAY_TELEMETRY_RETENTION", "600"))
_MAX_KEEP = 500_000  # rows per table kept at the controller


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
    """Telemetry of one process mesh (``procs.telemetry``): SQL, Prometheus, traces, OTLP, a web view, stacks.

    Its queries, exports and views collect from every rank first (see the
    module docstring). ``controller``, ``labels`` (rank -> coordinates label)
    and ``name`` are the mesh's; ``store``, ``state`` and ``aggregates`` hold
    what was collected, guarded by ``lock``.
    """

    def __init__(self, controller: Controller, labels: dict[int, str], name: str) -> None:
        self.controller, self.labels, self.name = controller, labels, name
        self._links: dict[int, _Link] = {}
        self._next: dict[int, dict] = {}
        self.lock = threading.RLock()
        self.store: dict[str, list] = {k: [] for k in ("messages", "links", "actors", "errors", "samples")}
        self.state: dict[int, dict] = {}
        self.aggregates: dict[int, dict] = {}
        self._server: Server | None = None
        self._closed = False
        self.exported_until = 0.0  # unix time of the newest span or log line sent to OTLP

    # -- collection -----------------------------------------------------------------
    def _link(self, rank: int) -> _Link:
        link = self._links.get(rank)
        if link is None or link.chan.closed:
            info = self.controller.workers[rank]
            link = self._links[rank] = _Link(info.address, self.controller.secret,
                                             {"role": "telemetry", "pid": os.getpid()})
        return link

    def _ask_relay(self, host: int, per_rank: dict[int, Any], timeout: float) -> Future[Any]:
        """Ask host ``host``'s relay for every rank in ``per_rank`` (their requests): a future of the
        relay's gathered answers, ``[(position in per_rank, status, payload)]``."""
        plane = self.controller.plane
        assert plane is not None
        fut: Future[Any] = new_future()

        def cb(status: int, payload: Any) -> None:
            if status == P.GATHERED:
                set_result(fut, [(pos, st, bytes(pl)) for pos, st, pl in P.unpack_gathered(memoryview(payload))])
            else:
                set_exception(fut, payload if isinstance(payload, BaseException) else RuntimeError(str(payload)))
        plane.relays[host].call(P.INTROSPECT, 0, 0, [pickle.dumps({"per_rank": per_rank, "timeout": timeout})], cb)
        return fut

    def _ask_all(self, req_of, timeout: float, only: list[int] | None = None) -> tuple[dict[int, Any], list[dict]]:
        answers: dict[int, Any] = {}
        missing: list[dict] = []
        futs = {}
        plane = self.controller.plane
        per_host: dict[int, dict[int, Any]] = {}
        names: dict[int, str] = {}
        for rank, info in sorted(self.controller.workers.items()):
            if only is not None and rank not in only:
                continue
            host = names[rank] = info.hello.get("host_id") or info.host
            if not info.alive:
                missing.append({"rank": rank, "host": host, "why": f"dead: {info.error}"})
                continue
            if plane is not None and plane.host_of[rank] not in plane.lost:  # once per host, through its relay
                per_host.setdefault(plane.host_of[rank], {})[rank] = req_of(rank)
                continue
            try:
                futs[rank] = (self._link(rank).ask(req_of(rank)), host)
            except Exception as exc:
                missing.append({"rank": rank, "host": host, "why": f"unreachable: {exc}"})
        hosts = {}
        for h, per_rank in per_host.items():
            try:
                hosts[h] = (self._ask_relay(h, per_rank, timeout), list(per_rank))
            except Exception as exc:
                missing.extend({"rank": r, "host": names[r], "why": f"unreachable: {exc}"} for r in per_rank)
        deadline = time.monotonic() + timeout
        for rank, (fut, host) in futs.items():
            try:
                answers[rank] = fut.get(timeout=max(0.01, deadline - time.monotonic()))
            except BaseException as exc:
                missing.append({"rank": rank, "host": host, "why": f"{type(exc).__name__}: {exc}"})
                link = self._links.pop(rank, None)
                if link is not None:
                    link.close()
        for fut, ranks in hosts.values():
            try:  # (the relay answers by the deadline, with what it has then)
                entries = fut.get(timeout=max(0.01, deadline - time.monotonic()) + 2.0)
            except BaseException as exc:
                missing.extend({"rank": r, "host": names[r], "why": f"{type(exc).__name__}: {exc}"} for r in ranks)
                continue
            for pos, st, pl in entries:
                r = ranks[pos]
                if st == P.DIED:
                    missing.append({"rank": r, "host": names[r], "why": pl.decode(errors="replace") or "gone"})
                    continue
                value, exc2 = outcome(st, pl)
                if exc2 is not None:
                    missing.append({"rank": r, "host": names[r], "why": f"{type(exc2).__name__}: {exc2}"})
                else:
                    answers[r] = value
        missing.sort(key=lambda m: m["rank"])
        return answers, missing

    def collect(self, timeout: float = 3.0, agg: bool = False) -> list[dict]:
        """Fetch what every rank recorded since the last collection; returns the ranks that did not answer."""
        with self.lock:
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
    def database(self) -> sqlite3.Connection:
        """An in-memory SQLite database of everything collected (after collecting); see :mod:`.tables`."""
        return build_database(self)

    def sql(self, query: str, params: tuple | dict = (), timeout: float = 3.0) -> QueryResult:
        """Run ``query`` over the tables (collected from every rank first); rows as dicts.

        >>> procs.telemetry.sql("SELECT endpoint, count(*) AS n FROM messages GROUP BY endpoint")  # doctest: +SKIP
        [{'endpoint': 'step', 'n': 400}]
        """
        missing = self.collect(timeout)
        with self.lock:
            db = self.database()
        return run_query(db, query, params, missing)

    # -- stacks ------------------------------------------------------------------
    def stacks(self, timeout: float = 5.0, native: bool = False, ranks: list[int] | None = None) -> dict[int, str]:
        """Each live rank's Python thread stacks (a rank that does not answer within ``timeout`` says why).

        ``native=True``: where ``py-spy`` is installed on a rank's host, its
        ``py-spy dump --native`` of the rank (C frames too) is added. ``ranks``:
        those ranks only.
        """
        with self.lock:
            answers, missing = self._ask_all(lambda r: {"what": "stacks", "native": native}, timeout, ranks)
        out = {rank: a["stacks"] for rank, a in answers.items()}
        for m in missing:
            out[m["rank"]] = f"<no stacks: {m['why']}>"
        return dict(sorted(out.items()))

    # -- exports ---------------------------------------------------------------------
    def metrics(self, timeout: float = 3.0) -> str:
        """The Prometheus text exposition (``/metrics`` of :meth:`serve`)."""
        self.collect(timeout, agg=True)
        return prometheus_text(self)

    def trace(self, path: str, window: float | None = None) -> int:
        """Write the calls of the last ``window`` seconds (default: all kept) as a Chrome/Perfetto trace.

        Open it in https://ui.perfetto.dev or chrome://tracing: one process per
        rank, one slice per call. Returns the number of events written.
        """
        self.collect()
        return write_chrome_trace(self, path, window)

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
        return post_otlp(self, endpoint, timeout)

    # -- the web view ------------------------------------------------------------------
    def serve(self, port: int = 0, host: str = "127.0.0.1") -> str:
        """Start (once) the live web view; returns its URL (``/metrics`` is the Prometheus endpoint)."""
        with self.lock:
            if self._server is None:
                self._server = Server(self, host, port)
            return self._server.url

    def state_json(self, window: float = 60.0) -> dict:
        """What the web view and ``top`` show: ranks, per-endpoint figures, recent errors and logs."""
        self.collect()
        return live_state(self, window)

    def close(self) -> None:
        with self.lock:
            self._closed = True
            links, self._links = list(self._links.values()), {}
            server, self._server = self._server, None
        for link in links:
            link.close()
        if server is not None:
            server.close()
