"""Run under mpirun by test_distributed_mpi.py: a distributed sum on the MPI world."""

import numpy as np

import mesharray as ma


class Kinds(ma.Actor):
    @ma.endpoint
    def kinds(self):
        from mesharray.darray.worker import STORE

        return sorted({type(g).__name__ for g in STORE.groups.values()})


procs = ma.proc_mesh()
if procs is not None:  # rank 0: the controller; the other ranks only serve
    with procs:
        x = procs.ones((1000,), dtype="float32")
        y = (x * procs.rank_array() + 1).sum(axis="procs")
        n = procs.mesh_shape.size
        assert np.asarray(y).reshape(-1).tolist() == [n * (n + 1) / 2] * 1000, np.asarray(y)
        kinds = np.asarray(procs.spawn("kinds", Kinds).kinds.call().get(), dtype=object).reshape(-1).tolist()
        print("OK", n, sorted({k for ks in kinds for k in ks}), flush=True)
