"""Every actor class the tests share, in one module the workers import as ``tests.support.actors``.

A worker unpickles an actor class by reference (module and name), so it must import this
module under the name the controller did: the repository root is on ``sys.path`` in every
test process (pytest's ``pythonpath``), the local zygote and host agents get the
controller's ``sys.path``, and a test that runs a controller in a subprocess puts the root
on its ``PYTHONPATH``. Sections follow the suites that use them most; any test may use any.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import sys
import threading
import time

import numpy as np

import mesharray as ma


def die(how: str) -> None:
    """End (or stop) this worker process: ``exit`` (status 3), ``segv``, ``kill`` (SIGKILL) or ``stop`` (SIGSTOP)."""
    if how == "exit":
        os._exit(3)
    elif how == "segv":
        ctypes.string_at(0)
    elif how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        raise ValueError(f"die how? {how!r}; expected 'exit', 'segv', 'kill' or 'stop'")


# --------------------------------------------------------------------------- runtime, docs


class Counter(ma.Actor):
    """A counter (also the ``Counter`` of the docstring examples: tests/docs/test_doctests.py)."""

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
    def nbytes(self, data) -> int:
        return len(memoryview(data).cast("B"))

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
    def log_at(self, level: str, text: str) -> None:
        import logging

        logging.getLogger("probe").log(getattr(logging, level), text)

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
        die(how)

    @ma.endpoint
    def reply_then_exit(self, pid: int, others_sleep: float) -> str:
        """The process ``pid`` answers at once and exits 50 ms later; the others answer after ``others_sleep`` s."""
        if os.getpid() == pid:
            threading.Timer(0.05, os._exit, (0,)).start()
            return "bye"
        time.sleep(others_sleep)
        return "ok"


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


class Echo(ma.Actor):
    """Gives back what it is sent (the ``Echo`` of the docstring examples)."""

    @ma.endpoint
    def echo(self, x):
        return x


# --------------------------------------------------------------------------- faults


class Unpicklable:
    def __reduce__(self):
        raise TypeError("Unpicklable refuses to be pickled")


class Faulty(ma.Actor):
    """Misbehaves on purpose: dies, raises every kind of exception, returns what cannot be pickled."""

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
        die(how)

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


# --------------------------------------------------------------------------- many hosts, Kubernetes


class Where(ma.Actor):
    """Says where it runs (host id, global rank, pid); calls peers; owns and reads buffers."""

    def __init__(self) -> None:
        self.kept: dict = {}

    @ma.endpoint
    def where(self) -> tuple:
        ctx = ma.context()
        return os.environ.get("MESHARRAY_HOST_ID"), ctx.global_rank, os.getpid()

    @ma.endpoint
    def echo(self, x):
        return x

    @ma.endpoint
    def checksum(self, x: np.ndarray) -> float:
        return float(np.asarray(x, dtype=np.float64).sum())

    @ma.endpoint
    def call_peer(self, peers, rank: int) -> tuple:
        return peers.slice(hosts=rank // 2, procs=rank % 2).where.call_one().get(timeout=30)

    @ma.endpoint
    def make_buffer(self, n: int) -> ma.Buffer:
        data = np.arange(n, dtype=np.float32)
        self.kept["data"] = data
        return ma.Buffer(data)

    @ma.endpoint
    def read_buffer(self, buf: ma.Buffer) -> float:
        dst = np.empty(buf.nbytes // 4, dtype=np.float32)
        buf.read_into(dst).get(timeout=60)
        return float(dst.astype(np.float64).sum())

    @ma.endpoint
    def buffer_paths(self) -> dict:
        from mesharray.buffer import TRANSFERS

        return dict(TRANSFERS)

    @ma.endpoint
    def fail(self) -> None:
        raise ValueError("boom on purpose")


# --------------------------------------------------------------------------- telemetry

#: set in a process to end its Busy.hang_here_for_a_while loops early
release = threading.Event()


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
        while time.monotonic() < deadline and not release.is_set():
            time.sleep(0.01)


# --------------------------------------------------------------------------- distributed arrays


class BlockProbe(ma.Actor):
    @ma.endpoint
    def describe(self, block):
        # a distributed MeshArray argument arrives as this rank's own block
        return float(np.asarray(block).sum())

    @ma.endpoint
    def count(self):
        from mesharray.darray.worker import STORE

        return len(STORE.blocks)


class BlockKeeper(ma.Actor):
    """Keeps the local block it is given, as a user's actor may (a model's weights, a cache)."""

    def __init__(self):
        self.kept = None

    @ma.endpoint
    def keep(self, block):
        self.kept = block
        return float(self.kept[0])

    @ma.endpoint
    def first(self):
        return float(self.kept[0]), int(self.kept.ctypes.data)


class JobProbe(ma.Actor):
    """Says where it runs, what it sees of its environment, and imports what it is told to (tests/job)."""

    @ma.endpoint
    def where(self) -> tuple:
        return os.environ.get("MESHARRAY_HOST_ID"), ma.context().global_rank, os.getpid()

    @ma.endpoint
    def env(self, name: str) -> str | None:
        return os.environ.get(name)

    @ma.endpoint
    def cwd(self) -> str:
        return os.getcwd()

    @ma.endpoint
    def path0(self) -> str:
        return sys.path[0]

    @ma.endpoint
    def call(self, module: str, fn: str):
        import importlib

        return getattr(importlib.import_module(module), fn)()

    @ma.endpoint
    def read(self, rel: str) -> str:
        with open(rel) as f:
            return f.read()

    @ma.endpoint
    def make_buffer(self, n: int) -> ma.Buffer:
        self.data = np.arange(n, dtype=np.float32)
        return ma.Buffer(self.data)

    @ma.endpoint
    def read_buffer(self, buf: ma.Buffer) -> float:
        dst = np.empty(buf.nbytes // 4, dtype=np.float32)
        buf.read_into(dst).get(timeout=60)
        return float(dst.astype(np.float64).sum())
