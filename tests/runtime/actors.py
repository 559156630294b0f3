"""Actor classes shared by the runtime tests (imported by reference in the workers)."""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import time

import numpy as np

import mesharray as ma


class Counter(ma.Actor):
    def __init__(self, start: int = 0) -> None:
        self.value = start
        self.seen: list = []

    @ma.endpoint
    def incr(self, by: int = 1) -> None:
        self.value += by

    @ma.endpoint
    def get(self) -> int:
        return self.value

    @ma.endpoint
    def record(self, i: int) -> None:
        self.seen.append(i)

    @ma.endpoint
    def recorded(self) -> list:
        out, self.seen = self.seen, []
        return out


class Probe(ma.Actor):
    def __init__(self, tag: str = "") -> None:
        self.tag = tag

    @ma.endpoint
    def where(self) -> dict:
        ctx = ma.context()
        return {"rank": ma.current_rank(), "size": ma.current_size(), "message_rank": ctx.message_rank,
                "pid": os.getpid(), "tag": self.tag}

    @ma.endpoint
    def echo(self, x):
        return x

    @ma.endpoint
    def double(self, a: np.ndarray) -> np.ndarray:
        return a * 2

    @ma.endpoint
    def sleep(self, s: float, value=None):
        time.sleep(s)
        return value

    @ma.endpoint
    def rank_sleep(self, unit: float) -> int:
        r = ma.current_rank()["procs"]
        time.sleep(unit * r)
        return r

    @ma.endpoint
    def fail(self, msg: str = "boom"):
        raise ValueError(msg)

    @ma.endpoint
    def fail_chained(self):
        try:
            {}["missing"]
        except KeyError as exc:
            raise RuntimeError("outer") from exc

    @ma.endpoint
    def lock(self):
        import threading

        return threading.Lock()

    @ma.endpoint
    def say(self, text: str) -> None:
        print(text, flush=True)

    @ma.endpoint
    def log(self, text: str) -> None:
        import logging

        logging.getLogger("probe").warning(text)

    @ma.endpoint
    def call_peer(self, mesh, method: str, *args):
        return getattr(mesh, method).call(*args).get(timeout=10).tolist()

    @ma.endpoint
    def pid(self) -> int:
        return os.getpid()

    @ma.endpoint
    def wait_for_file(self, path: str, limit: float = 20.0) -> bool:
        # blocks this actor's reader thread until another rank makes `path`
        deadline = time.monotonic() + limit
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    @ma.endpoint
    def make_file(self, path: str) -> None:
        open(path, "w").close()

    @ma.endpoint
    def die(self, how: str) -> None:
        if how == "exit":
            os._exit(3)
        elif how == "segv":
            ctypes.string_at(0)
        elif how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif how == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)


class AsyncActor(ma.Actor):
    def __init__(self) -> None:
        self.log: list = []

    @ma.endpoint
    async def nap(self, s: float, tag):
        self.log.append(("start", tag))
        await asyncio.sleep(s)
        self.log.append(("end", tag))
        return tag

    @ma.endpoint(concurrent=True)
    async def cnap(self, s: float, tag):
        await asyncio.sleep(s)
        return tag

    @ma.endpoint
    def events(self) -> list:
        return list(self.log)

    @ma.endpoint
    async def where(self) -> dict:
        return {"rank": ma.current_rank(), "message_rank": ma.context().message_rank}

    @ma.endpoint
    async def ask(self, mesh, method: str):
        return (await getattr(mesh, method).call()).tolist()

    @ma.endpoint
    async def fail(self):
        await asyncio.sleep(0)
        raise KeyError("async boom")


class BadInit(ma.Actor):
    def __init__(self, bad_rank: int) -> None:
        if ma.current_rank()["procs"] == bad_rank:
            raise ZeroDivisionError("constructor failed")

    @ma.endpoint
    def ok(self) -> bool:
        return True


class Owner:
    """An owner with a ``__supervise__`` hook."""

    def __init__(self) -> None:
        self.failures: list = []

    def __supervise__(self, failure) -> None:
        self.failures.append(failure)


class TorchProbe(ma.Actor):
    """Endpoints that look at torch tensors in the worker (torch is imported only by what it receives)."""

    @ma.endpoint
    def has_module(self, name: str) -> bool:
        import sys

        return name in sys.modules

    @ma.endpoint
    def echo(self, x):
        return x

    @ma.endpoint
    def plus1(self, t):
        return t + 1

    @ma.endpoint
    def describe(self, t) -> tuple:
        return type(t).__name__, str(t.dtype), tuple(t.shape), t.stride(), t.requires_grad, t.is_contiguous()
