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
