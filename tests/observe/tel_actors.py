"""Actors of the telemetry tests."""

from __future__ import annotations

import threading
import time

import mesharray as ma

_release = threading.Event()


class Busy(ma.Actor):
    @ma.endpoint
    def step(self, x: int = 0) -> int:
        return x + 1

    @ma.endpoint
    def nested(self, peers, rank: int) -> int:
        return peers.slice(procs=rank).step.call_one(10).get(timeout=30)

    @ma.endpoint
    def boom(self) -> None:
        raise KeyError("nope")

    @ma.endpoint
    def say(self, text: str) -> None:
        print(text, flush=True)

    @ma.endpoint
    def hang_here_for_a_while(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not _release.is_set():
            time.sleep(0.01)
