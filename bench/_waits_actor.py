"""The actor of ``shm_waits.py``, in a module of its own: workers import it by name."""

from __future__ import annotations

import time

import numpy as np

import mesharray as ma


class Waiter(ma.Actor):
    """One member of a shared-memory group made by hand, with one member late on purpose."""

    def __init__(self) -> None:
        self.group = None

    @ma.endpoint
    def join(self, name: str, pids: list, late: int, delay: float) -> None:
        from mesharray.collectives.shm import ShmCollective

        rank = ma.context().global_rank
        if rank == late:
            time.sleep(delay)
        self.group = ShmCollective(name, rank, len(pids), capacity=4096, peer_pids=pids)

    @ma.endpoint
    def reduce(self, late: int, delay: float) -> float:
        if ma.context().global_rank == late:
            time.sleep(delay)
        out = np.zeros(1)
        self.group.allreduce_checked(np.ones(1), out=out)
        return float(out[0])

    @ma.endpoint
    def close(self) -> None:
        self.group.close()
        self.group = None

    @ma.endpoint
    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)
