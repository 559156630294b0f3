"""Actors of the job tests (importable by the workers: tests/job is on the controller's sys.path)."""

from __future__ import annotations

import os
import sys

import numpy as np

import mesharray as ma


class Probe(ma.Actor):
    """Says where it runs, what it sees of its environment, and imports what it is told to."""

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
