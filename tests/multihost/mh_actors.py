"""Actors of the multi-host tests (importable by the workers: tests/multihost is on sys.path)."""

from __future__ import annotations

import os

import numpy as np

import mesharray as ma


class Where(ma.Actor):
    """Says where it runs; calls peers; owns and reads buffers."""

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
    def fail(self) -> None:
        raise ValueError("boom on purpose")
