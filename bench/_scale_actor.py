"""The actor of ``bench_scale.py``, in a module of its own: workers import it by name, and nothing else with it."""

from __future__ import annotations

import time

import mesharray as ma


class Bench(ma.Actor):
    @ma.endpoint
    def noop(self) -> None:
        return None

    @ma.endpoint
    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)
