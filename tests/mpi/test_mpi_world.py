"""The MPI world as a ProcMesh, and its communicators, at any rank count.

Run under ``mpirun -n 1``, ``-n 2`` and ``-n 4`` by ``make test-mpi``; rank 0
runs these tests as the controller, every other rank serves (see conftest.py).
"""

from __future__ import annotations

import itertools
import os
import socket

import numpy as np
import pytest

import mesharray as ma

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]

_names = itertools.count()


def spawn(world, cls, *args):
    return world.spawn(f"{cls.__name__.lower()}{next(_names)}", cls, *args)


def _read_spin() -> float:
    from mesharray.transport import spin

    return spin._spin


class Probe(ma.Actor):
    """Reports where it runs and uses mesharray's MPI communicators."""

    @ma.endpoint
    def where(self):
        from mpi4py import MPI

        from mesharray.bootstrap import mpi

        return {
            "mpi_rank": MPI.COMM_WORLD.Get_rank(),
            "env_rank": os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK")),
            "world_rank": mpi.world_rank(),
            "global_rank": ma.context().global_rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "active": mpi.is_active(),
            "sched": os.sched_getscheduler(0) if hasattr(os, "sched_getscheduler") else None,
            "spin": _read_spin(),
        }

    @ma.endpoint
    def allreduce(self, value, ranks=None):
        from mesharray.bootstrap.mpi import mesh_comm

        comm = mesh_comm(ranks)
        return comm.allreduce(value), comm.Get_rank(), comm.Get_size()

    @ma.endpoint
    def sum_array(self, ranks):
        from mpi4py import MPI

        from mesharray.bootstrap.mpi import mesh_comm, world_rank

        comm = mesh_comm(ranks)
        send = np.full(1000, world_rank(), dtype=np.float64)
        recv = np.empty_like(send)
        comm.Allreduce(send, recv, op=MPI.SUM)
        return float(recv[0]), float(recv[-1])

    @ma.endpoint
    def cached(self, ranks):
        from mesharray.bootstrap.mpi import mesh_comm

        return mesh_comm(ranks) is mesh_comm(list(ranks))

    @ma.endpoint
    def comm_error(self, ranks):
        from mesharray.bootstrap.mpi import mesh_comm

        mesh_comm(ranks)

    @ma.endpoint
    def local_size(self):
        from mesharray.bootstrap.mpi import local_comm

        return local_comm().Get_size()

    @ma.endpoint
    def fail(self):
        raise KeyError("raised on purpose")


def _values(future_result):
    return list(np.asarray(future_result, dtype=object).ravel())


# --------------------------------------------------------------------------- the world


def test_world_is_every_mpi_rank_on_one_host(world, mpi_size):
    assert isinstance(world, ma.ProcMesh)
    assert len(world) == mpi_size
    # every rank of these CI jobs is on this host: one row of `procs`
    assert world.sizes == {"hosts": 1, "procs": mpi_size}
    assert list(world.mesh_shape.ranks()) == list(range(mpi_size))


def test_proc_mesh_again_returns_the_same_world(world, mpi_size):
    assert ma.proc_mesh() is world
    assert ma.proc_mesh(bootstrap="mpi") is world
    assert ma.proc_mesh(hosts=1, procs=mpi_size) is world
    with pytest.raises(ValueError, match=rf"proc_mesh\(procs={mpi_size + 1}\) does not match "
                                         rf"the MPI world of {mpi_size} ranks"):
        ma.proc_mesh(procs=mpi_size + 1)


def test_each_mesh_rank_is_its_mpi_rank(world, mpi_size):
    probes = spawn(world, Probe)
    got = _values(probes.where.call().get())
    assert [g["mpi_rank"] for g in got] == list(range(mpi_size))
    assert [g["world_rank"] for g in got] == list(range(mpi_size))
    assert [g["global_rank"] for g in got] == list(range(mpi_size))
    assert [g["env_rank"] for g in got] == [str(r) for r in range(mpi_size)]
    assert all(g["active"] for g in got)
    # rank 0's actors live in this (the controller's) process; the others in
    # their own processes
    assert got[0]["pid"] == os.getpid()
    assert len({g["pid"] for g in got}) == mpi_size


@pytest.mark.skipif(not hasattr(os, "sched_getscheduler"), reason="this system has no sched_getscheduler (macOS)")
def test_ranks_that_are_only_workers_run_in_the_workers_scheduling_class(world, mpi_size):
    from mesharray import _platform

    got = _values(spawn(world, Probe).where.call().get())
    batch = os.SCHED_BATCH if _platform.LINUX_NATIVE and _platform.worker_sched() == "batch" else os.SCHED_OTHER
    # rank 0's worker is a thread of the controller's process: the user's process keeps its class
    assert [g["sched"] for g in got] == [os.SCHED_OTHER] + [batch] * (mpi_size - 1)


def test_ranks_that_are_only_workers_poll_before_blocking(world, mpi_size):
    from mesharray import _platform

    got = _values(spawn(world, Probe).where.call().get())
    # as local workers (MESHARRAY_WORKER_SPIN_US); rank 0's worker thread lives in the user's
    # process, whose readers block at once
    assert [g["spin"] for g in got] == pytest.approx([0.0] + [_platform.worker_spin()] * (mpi_size - 1))


def test_actor_errors_cross_back_as_in_local_meshes(world, mpi_size):
    probes = spawn(world, Probe)
    last = probes.slice(procs=-1)
    with pytest.raises(ma.ActorError) as info:
        last.fail.call_one().get()
    assert isinstance(info.value.exception, KeyError)
    assert info.value.pid is not None


# --------------------------------------------------------------------------- communicators


def test_world_communicator_reduces_across_every_rank(world, mpi_size):
    probes = spawn(world, Probe)
    got = _values(probes.allreduce.call(1).get())
    assert got == [(mpi_size, r, mpi_size) for r in range(mpi_size)]
    sums = _values(probes.sum_array.call(list(range(mpi_size))).get())
    total = float(sum(range(mpi_size)))
    assert sums == [(total, total)] * mpi_size


def test_sliced_mesh_gets_its_own_communicator(world, mpi_size):
    probes = spawn(world, Probe)
    even = probes.slice(procs=slice(0, None, 2))
    ranks = [int(r) for r in even.mesh_shape.ranks()]
    assert ranks == list(range(0, mpi_size, 2))
    got = _values(even.allreduce.call(1, ranks).get())
    assert got == [(len(ranks), i, len(ranks)) for i in range(len(ranks))]
    assert all(_values(even.cached.call(ranks).get()))


def test_communicator_order_follows_the_rank_order(world, mpi_size):
    probes = spawn(world, Probe)
    backwards = list(reversed(range(mpi_size)))
    got = _values(probes.allreduce.call(0, backwards).get())
    # world rank r is communicator rank N-1-r
    assert [comm_rank for _, comm_rank, _ in got] == backwards


def test_communicator_of_a_single_rank(world, mpi_size):
    probes = spawn(world, Probe)
    last = mpi_size - 1
    assert probes.slice(procs=-1).allreduce.call_one(7, [last]).get() == (7, 0, 1)


def test_bad_rank_lists_are_rejected_on_the_worker(world, mpi_size):
    probes = spawn(world, Probe)
    first = probes.slice(procs=0)
    with pytest.raises(ma.ActorError) as info:
        first.comm_error.call_one([0, mpi_size]).get()
    assert isinstance(info.value.exception, ValueError)
    assert f"ranks [{mpi_size}] are not in the MPI world of size {mpi_size}" in str(info.value)
    with pytest.raises(ma.ActorError) as info:
        first.comm_error.call_one([0, 0]).get()
    assert "ranks must be distinct; [0] appear more than once" in str(info.value)
    if mpi_size > 1:
        with pytest.raises(ma.ActorError) as info:
            first.comm_error.call_one([1]).get()
        assert "this process (rank 0) is not in ranks [1]" in str(info.value)


def test_local_communicator_spans_this_host(world, mpi_size):
    probes = spawn(world, Probe)
    assert _values(probes.local_size.call().get()) == [mpi_size] * mpi_size


class Relay(ma.Actor):
    """Calls another actor mesh from inside a worker (peer-to-peer, not via rank 0)."""

    @ma.endpoint
    def ask(self, probes):
        got = probes.where.call().get()
        return [g["world_rank"] for g in np.asarray(got, dtype=object).ravel()]


def test_actors_call_each_other_across_mpi_ranks(world, mpi_size):
    probes = spawn(world, Probe)
    relays = spawn(world, Relay)
    got = _values(relays.ask.call(probes).get())
    assert got == [list(range(mpi_size))] * mpi_size
