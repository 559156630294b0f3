"""Process meshes: construction, views, stop semantics, logs, stats."""

from __future__ import annotations

import asyncio
import time

import pytest

import mesharray as ma
from tests.support.actors import Counter, Probe

pytestmark = pytest.mark.timeout(60)


def test_proc_mesh_is_a_mesh_trait_of_views(procs):
    assert isinstance(procs, ma.MeshTrait) and isinstance(procs, ma.ProcMesh)
    assert procs.sizes == {"hosts": 1, "procs": 4} and len(procs) == 4
    v = procs[0, 1:3]
    assert v.sizes == {"procs": 2} and v.pids == procs.pids[1:3]
    assert procs.slice(procs=-1).pids == [procs.pids[3]]
    assert "ProcMesh" in repr(procs)


def test_bad_arguments():
    with pytest.raises(ValueError, match="procs must be >= 1, got 0"):
        ma.proc_mesh(hosts=1, procs=0)
    with pytest.raises(TypeError, match="procs must be an int"):
        ma.proc_mesh(hosts=1, procs=2.0)


def test_spawn_needs_an_actor_class(procs):
    with pytest.raises(TypeError, match="subclass of mesharray.Actor"):
        procs.spawn("x", object)


def test_this_host_spawn_procs_and_with_block():
    with ma.this_host().spawn_procs(per_host={"procs": 2}) as procs:
        assert procs.sizes == {"hosts": 1, "procs": 2}
        c = procs.spawn("c", Counter, 1)
        assert c.get.call().get(timeout=10).tolist() == [[1, 1]]
    assert procs.stopped


def test_async_with_stops():
    async def main():
        async with ma.proc_mesh(hosts=1, procs=2) as procs:
            c = procs.spawn("c", Counter, 2)
            v = await c.get.call()
        return procs, v

    procs, v = asyncio.run(main())
    assert procs.stopped and v.tolist() == [[2, 2]]


def test_two_dimensional_local_mesh():
    with ma.proc_mesh(hosts=2, procs=2) as procs:
        p = procs.spawn("p", Probe)
        out = p[:, 1].where.call().get(timeout=10).tolist()
        assert [o["rank"] for o in out] == [{"hosts": 0, "procs": 1}, {"hosts": 1, "procs": 1}]
        assert [o["message_rank"] for o in out] == [{"hosts": 0}, {"hosts": 1}]


def test_worker_output_is_forwarded_with_rank_prefix(procs, probes, capsys):
    probes.slice(procs=2).say.call_one("hello from two").get(timeout=10)
    probes.slice(procs=1).log.call_one("careful").get(timeout=10)
    deadline = time.monotonic() + 5
    out = err = ""
    while time.monotonic() < deadline:
        cap = capsys.readouterr()
        out += cap.out
        err += cap.err
        if "[procs=2] hello from two" in out and "careful" in err:
            break
        time.sleep(0.02)
    assert "[procs=2] hello from two" in out
    assert "[procs=1] WARNING probe: careful" in err


def test_forwarding_can_be_switched_off(capsys):
    with ma.proc_mesh(hosts=1, procs=1, forward_logs=False) as procs:
        procs.spawn("p", Probe).say.call_one("quiet").get(timeout=10)
        time.sleep(0.2)
    assert "[procs=0]" not in capsys.readouterr().out


def test_stats(procs, probes):
    before = procs.stats()
    probes.echo.call(1).get(timeout=10)
    probes.echo.broadcast(1)
    with pytest.raises(ma.ActorError):
        probes.slice(procs=0).fail.call_one().get(timeout=10)
    s = procs.stats()
    assert s["workers"] == 4 and s["alive"] == 4 and s["spawns"] >= 1
    assert s["calls"] - before["calls"] == 5 and s["broadcasts"] - before["broadcasts"] == 4
    assert s["replies"] - before["replies"] == 5 and s["errors"] - before["errors"] == 1


def test_a_connection_accepted_while_the_mesh_stops_is_closed():
    # a worker still starting when its mesh stops may connect after stop() closed every
    # connection: it is closed at once, not kept open by a channel nobody closes (an unclosed
    # socket a later garbage collection would have found)
    import socket

    procs = ma.proc_mesh(procs=1)
    ctl = procs._root.controller
    procs.stop()
    a, b = socket.socketpair()
    try:
        ctl._on_socket(a)
        assert a.fileno() == -1
        assert not ctl._conns
        assert b.recv(1) == b""  # the peer sees the end
    finally:
        a.close()
        b.close()
