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
        # blocks move between ranks over MPI (a ring exchange, a fan-out of one block)
        r = procs.arange(5, dtype="float64") + procs.rank_array() * 10
        ref = np.asarray(r.fetch())
        assert (np.asarray(r.roll(1, axis="procs").fetch()) == np.roll(ref, 1, axis=1)).all()
        fan = r.slice(procs=slice(n - 1, n)).to_mesh(procs)
        assert (np.asarray(fan.fetch()) == np.broadcast_to(ref[:, -1:], ref.shape)).all()
        kinds = np.asarray(procs.spawn("kinds", Kinds).kinds.call().get(), dtype=object).reshape(-1).tolist()
        print("OK", n, sorted({k for ks in kinds for k in ks}), flush=True)
