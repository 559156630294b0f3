"""Actors that misbehave on purpose, for the fault suite (tests/faults)."""

from __future__ import annotations

import ctypes
import os
import signal
import time

import mesharray as ma


class Unpicklable:
    def __reduce__(self):
        raise TypeError("Unpicklable refuses to be pickled")


class Faulty(ma.Actor):
    def __init__(self, fail_on_rank: int | None = None) -> None:
        rank = ma.current_rank()
        if fail_on_rank is not None and rank.get("procs") == fail_on_rank:
            raise ValueError(f"constructor refused on rank {rank}")
        self.seen: list[int] = []

    @ma.endpoint
    def pid(self) -> int:
        return os.getpid()

    @ma.endpoint
    def echo(self, x):
        return x

    @ma.endpoint
    def make(self, n: int) -> bytes:
        return b"x" * n

    @ma.endpoint
    def length(self, x) -> int:
        return len(x)

    @ma.endpoint
    def record(self, i: int) -> None:
        self.seen.append(i)

    @ma.endpoint
    def recorded(self) -> list:
        return self.seen

    @ma.endpoint
    def sleep(self, s: float) -> float:
        time.sleep(s)
        return s

    @ma.endpoint
    def die(self, how: str) -> None:
        if how == "exit":
            os._exit(3)
        elif how == "segv":
            ctypes.string_at(0)
        elif how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)

    @ma.endpoint
    def unpicklable(self):
        return Unpicklable()

    @ma.endpoint
    def raise_(self, kind: str):
        if kind == "chained":
            try:
                raise KeyError("inner")
            except KeyError as e:
                raise RuntimeError("outer") from e
        if kind == "keyboard":
            raise KeyboardInterrupt("interrupted in an endpoint")
        if kind == "systemexit":
            raise SystemExit(4)
        if kind == "memory":
            raise MemoryError("no room")
        if kind == "alloc":
            return bytearray(1 << 62)  # the allocation itself fails
        raise ValueError(kind)


class Napper(ma.Actor):
    """Async endpoints run on the worker's event loop: a long nap leaves the reader free."""

    @ma.endpoint
    async def nap(self, s: float) -> float:
        import asyncio

        await asyncio.sleep(s)
        return s


class GilHog(ma.Actor):
    """Holds the GIL in one C call (a regex that backtracks) for seconds."""

    @ma.endpoint
    def hog(self, n: int = 27) -> bool:
        import re

        return re.match(r"(a+)+$", "a" * n + "b") is None

    @ma.endpoint
    def pid(self) -> int:
        return os.getpid()

    @ma.endpoint
    def stop_self(self) -> None:
        os.kill(os.getpid(), signal.SIGSTOP)


class Slow(ma.Actor):
    """Takes its time over every message: a fast sender must be held back, not the process killed."""

    def __init__(self) -> None:
        self.n = 0

    @ma.endpoint
    def take(self, payload: bytes) -> int:
        time.sleep(0.0002)
        self.n += 1
        return len(payload)

    @ma.endpoint
    def count(self) -> int:
        return self.n
