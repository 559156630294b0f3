"""Seeing what a mesh does: ``procs.telemetry`` — SQL, Prometheus, traces, OTLP, a live web view, stacks, ``top``.

Every worker records its calls, actors, errors and process samples
(:mod:`mesharray.runtime.recorder`); the controller keeps its workers' log
lines (:mod:`mesharray.runtime.logs`) and deaths. This package is the side a
user sees: it collects those records from every rank on demand and presents
them.

- :mod:`.collect` — :class:`Telemetry`, what ``procs.telemetry`` returns:
  collection from every rank over a connection of its own to each worker (a
  rank busy in a long call still answers), retention
  (``MESHARRAY_TELEMETRY_RETENTION`` seconds), thread stacks
  (``procs.stacks()``).
- :mod:`.tables` — the tables (``messages``, ``spans``, ``actors``, ``errors``,
  ``logs``, ``processes``, ``ranks``) as an in-memory SQLite database built per
  query, spans' parents and traces resolved; :class:`QueryResult`, whose
  ``.missing`` names the ranks (and hosts) that did not answer.
- :mod:`.exports` — the Prometheus text exposition, Chrome/Perfetto trace
  files, OTLP/JSON posted to an OpenTelemetry collector
  (``OTEL_EXPORTER_OTLP_ENDPOINT``).
- :mod:`.web` — the live web view (``Telemetry.serve``): an HTTP server of the
  page ``static/index.html`` (package data) and of ``api/state``,
  ``api/sql``, ``api/stacks`` and ``/metrics``.
- :mod:`.top` — ``python -m mesharray top URL``: the terminal view of a web
  view's ``api/state``.
- :mod:`.debug` — ``python -m mesharray debug [JOBFILE]``: the debugger's
  ``(ma-debug)`` console from another terminal (a notebook's controller).
"""

from __future__ import annotations

from ..runtime.logs import compress_labels  # noqa: F401  (re-exported)
from .collect import RETENTION, QueryResult, Telemetry
from .top import top_main  # noqa: F401  (python -m mesharray top)

__all__ = ["Telemetry", "QueryResult", "RETENTION"]
