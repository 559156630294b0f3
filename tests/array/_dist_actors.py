import numpy as np

import mesharray as ma


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
