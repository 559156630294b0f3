"""``ma.attach`` and ``HostMesh.spawn_procs`` across host agents: what works on a local mesh works here."""

from __future__ import annotations

import time

import numpy as np
import pytest
from mh_agents import SECRET

import mesharray as ma
from tests.support.actors import Where

pytestmark = pytest.mark.timeout(120)


def test_attach_gives_a_host_mesh(cluster, two_agents):
    hosts, procs = cluster
    assert isinstance(hosts, ma.HostMesh)
    assert hosts.sizes == {"hosts": 2}
    assert hosts.host_ids == ["h0", "h1"]
    assert hosts.addresses == [a.url for a in two_agents]
    assert procs.sizes == {"hosts": 2, "procs": 2}
    assert procs.host_ids == ["h0", "h0", "h1", "h1"]
    assert hosts[1].host_ids == ["h1"]
    assert "h0, h1" in repr(hosts)


def test_actors_run_on_their_hosts(cluster):
    _, procs = cluster
    w = procs.spawn("where", Where)
    got = w.where.call().get(timeout=30)
    assert got.shape == (2, 2)
    assert [[got[h, p][0] for p in range(2)] for h in range(2)] == [["h0", "h0"], ["h1", "h1"]]
    assert [got[h, p][1] for h in range(2) for p in range(2)] == [0, 1, 2, 3]
    # slicing, named and positional, and call_one on one actor of the second host
    assert w.slice(hosts=1, procs=0).where.call_one().get(timeout=30)[:2] == ("h1", 2)
    assert w[1, 1].where.call_one().get(timeout=30)[1] == 3
    # remote exceptions keep their type
    with pytest.raises(ma.ActorError) as ei:
        w[0, 0].fail.call_one().get(timeout=30)
    assert isinstance(ei.value.exception, ValueError)
    # and the mesh keeps working
    assert w.where.call().get(timeout=30).shape == (2, 2)
    w.stop()


def test_actor_to_actor_calls_cross_hosts(cluster):
    _, procs = cluster
    w = procs.spawn("peers", Where)
    # the actor at (hosts=0, procs=0) calls the one on rank 3 (host h1), and back
    assert w[0, 0].call_peer.call_one(w, 3).get(timeout=30)[:2] == ("h1", 3)
    assert w[1, 1].call_peer.call_one(w, 0).get(timeout=30)[:2] == ("h0", 0)
    w.stop()


def test_large_arguments_and_replies_cross_hosts(cluster):
    _, procs = cluster
    w = procs.spawn("big", Where)
    x = np.random.default_rng(0).random(2 << 20)  # 16 MiB
    assert w[1, 0].checksum.call_one(x).get(timeout=60) == pytest.approx(x.sum())
    back = w[1, 1].echo.call_one(x).get(timeout=60)
    np.testing.assert_array_equal(back, x)
    w.stop()


def test_buffer_reads_across_hosts(cluster):
    _, procs = cluster
    w = procs.spawn("buffers", Where)
    n = 4 << 20  # 16 MiB: read over several TCP streams at once
    buf = w[0, 0].make_buffer.call_one(n).get(timeout=30)
    want = float(np.arange(n, dtype=np.float32).astype(np.float64).sum())
    # an actor on the other host reads it (the stream path: different host ids never share memory)
    assert w[1, 0].read_buffer.call_one(buf).get(timeout=60) == want
    # the same host reads it too, and so does the controller
    assert w[0, 1].read_buffer.call_one(buf).get(timeout=60) == want
    dst = np.empty(n, dtype=np.float32)
    buf.read_into(dst).get(timeout=60)
    np.testing.assert_array_equal(dst, np.arange(n, dtype=np.float32))
    w.stop()


@pytest.mark.parametrize("axis", ["hosts", "procs", None])
def test_reductions_across_hosts_equal_numpy(cluster, axis):
    _, procs = cluster
    x = procs.arange(6, dtype="float64") * (procs.rank_array() + 1)
    ref = np.asarray(x.fetch())
    assert ref.shape == (2, 2, 6)
    got = np.asarray((x.sum() if axis is None else x.sum(axis=axis)).fetch())
    want = ref.sum() if axis is None else ref.sum(axis=("hosts", "procs").index(axis))
    np.testing.assert_allclose(got, want)
    np.testing.assert_allclose(np.asarray(x.mean(axis="procs").fetch()), ref.mean(axis=1))
    np.testing.assert_allclose(np.asarray(x.max(axis="hosts").fetch()), ref.max(axis=0))
    np.testing.assert_allclose(np.asarray(x.min().fetch()), ref.min())


def test_group_collectives_across_hosts(cluster):
    _, procs = cluster
    x = procs.ones((4,), dtype="float32") * procs.rank_array()
    ref = np.asarray(x.fetch())
    g = ma.allgather(x, "hosts")
    np.testing.assert_array_equal(np.asarray(g.fetch())[0, 1], ref[:, 1])
    b = ma.broadcast_from(x, "hosts", root=1)
    np.testing.assert_array_equal(np.asarray(b.fetch())[0], ref[1])
    y = procs.ones((4,), dtype="float32") * (procs.rank_array() + 1)
    rs = ma.reduce_scatter(y, "hosts")
    yref = np.asarray(y.fetch()).sum(axis=0)  # (procs, 4) summed over hosts
    got = np.asarray(rs.fetch())
    np.testing.assert_array_equal(got[0], yref[:, :2])
    np.testing.assert_array_equal(got[1], yref[:, 2:])


def test_torch_cpu_engine_reduces_across_hosts(cluster):
    pytest.importorskip("torch", reason="the torch engine needs torch (pip install 'mesharray[torch]')")
    _, procs = cluster
    x = procs.ones((3,), dtype="float32", engine="torch") * (procs.rank_array() + 1)
    got = np.asarray(x.sum(axis="hosts").fetch())
    np.testing.assert_array_equal(got, np.array([[4.0] * 3, [6.0] * 3]))  # (procs, local)
    assert float(x.mean().fetch()) == pytest.approx(2.5)


def test_a_training_step_reduces_its_gradients_across_hosts(cluster):
    # the backward's gradients go in a bucket reduced over both hosts (a group across hosts), as torch
    # would have them on the gathered data
    torch = pytest.importorskip("torch", reason="the torch engine needs torch (pip install 'mesharray[torch]')")
    _, procs = cluster
    W = np.arange(6, dtype="float32").reshape(1, 1, 2, 3) / 5
    X = np.arange(4 * 5 * 2, dtype="float32").reshape(2, 2, 5, 2) / 9
    xs = procs.from_numpy(X, engine="torch")
    for _ in range(2):
        w = procs.from_numpy(np.broadcast_to(W, (2, 2, 2, 3)).copy(), engine="torch").requires_grad_()
        torch.mean(torch.tanh(torch.matmul(xs, w)) ** 2).backward()
        got = np.asarray(w.grad.mean(axis=("hosts", "procs"), keepdims=True).fetch())
    t = torch.tensor(W[0, 0], requires_grad=True)
    sum(torch.mean(torch.tanh(torch.tensor(X[h, p]) @ t) ** 2) for h in range(2) for p in range(2)).backward()
    np.testing.assert_allclose(got[0, 0], t.grad.numpy() / 4, rtol=1e-5, atol=1e-7)


def test_large_reduction_across_hosts(cluster):
    _, procs = cluster
    x = procs.ones((1 << 21,), dtype="float32") * (procs.rank_array() + 1)  # 8 MiB per rank
    got = np.asarray(x.sum(axis="hosts").fetch())
    assert got.shape == (2, 1 << 21)
    assert (got[0] == 4).all() and (got[1] == 6).all()
    total = np.asarray(x.sum().fetch())
    assert float(total) == pytest.approx(10 * (1 << 21))


def test_blocks_move_across_hosts(cluster):
    _, procs = cluster
    x = procs.arange(1 << 18, dtype="float32") + procs.rank_array(dtype="float32") * 1000  # 1 MiB per rank
    ref = np.asarray(x.fetch())
    # host 0's blocks to host 1's ranks (a pipeline stage across hosts), and back
    there = x[0].to_mesh(procs[1])
    np.testing.assert_array_equal(np.asarray(there.fetch()), ref[0])
    np.testing.assert_array_equal(np.asarray(there.to_mesh(procs[0]).fetch()), ref[0])
    # operands on different hosts: the blocks move over the data plane first
    np.testing.assert_array_equal(np.asarray((x[0] + x[1]).fetch()), ref[0] + ref[1])
    # one block fanned out to every rank of both hosts
    np.testing.assert_array_equal(np.asarray(x[1:2, 0:1].to_mesh(procs).fetch()), np.broadcast_to(ref[1, 0], ref.shape))
    np.testing.assert_array_equal(np.asarray(x.roll(1, axis="hosts").fetch()), ref[::-1])


def test_host_mesh_slices_start_processes_on_their_hosts(two_agents, cluster):
    hosts, _ = cluster
    # the cluster's agents serve that controller: a second mesh on a slice of them
    procs = hosts[1:].spawn_procs(per_host={"gpus": 3})
    try:
        assert procs.sizes == {"hosts": 1, "gpus": 3}
        assert procs.host_ids == ["h1"] * 3
        w = procs.spawn("w", Where)
        assert [v[0] for v in np.asarray(w.where.call().get(timeout=30)).ravel()] == ["h1"] * 3
    finally:
        procs.stop()


def test_this_host_is_a_one_host_mesh():
    h = ma.this_host()
    assert isinstance(h, ma.HostMesh) and h.sizes == {"hosts": 1}
    procs = h.spawn_procs(per_host={"procs": 2})
    try:
        assert procs.sizes == {"hosts": 1, "procs": 2}
    finally:
        procs.stop()
    h.detach()  # nothing to detach: harmless


def test_spawn_procs_rejects_bad_per_host(cluster):
    hosts, _ = cluster
    with pytest.raises(ValueError, match="one dimension"):
        hosts.spawn_procs(per_host={"procs": 2, "gpus": 2})
    with pytest.raises(ValueError, match="other than 'hosts'"):
        hosts.spawn_procs(per_host={"hosts": 2})
    with pytest.raises(ValueError, match="procs per host"):
        hosts.spawn_procs(per_host={"procs": 0})


def test_same_script_runs_on_a_local_mesh_and_on_attached_hosts(cluster):
    """One function, two meshes of the same shape: the same answers."""
    _, remote = cluster

    def workload(procs):
        w = procs.spawn("same", Where)
        ranks = [v[1] for v in np.asarray(w.where.call().get(timeout=30)).ravel()]
        x = procs.ones((3,), dtype="float64") * (procs.rank_array() + 1)
        out = (ranks, np.asarray(x.sum(axis="hosts").fetch()).tolist(), float(np.asarray(x.sum().fetch())))
        w.stop()
        return out

    local = ma.proc_mesh(hosts=2, procs=2)
    try:
        assert workload(local) == workload(remote)
    finally:
        local.stop()


def test_detach_stops_meshes_and_frees_the_agents(two_agents):
    # (runs after the module's cluster fixture was set up: use fresh agents)
    from mh_agents import agents

    with agents(2, first_ip=4, prefix="d") as ags:
        hosts = ma.attach([a.url for a in ags], secret=SECRET)
        procs = hosts.spawn_procs(per_host={"procs": 1})
        hosts.detach()
        assert procs.stopped and hosts.detached
        with pytest.raises(ma.MeshStoppedError):
            hosts.spawn_procs(per_host={"procs": 1})
        # the agents serve the next controller at once
        t = time.monotonic()
        again = ma.attach([a.url for a in ags], secret=SECRET, timeout=10)
        assert time.monotonic() - t < 5
        again.detach()


def test_telemetry_across_hosts(cluster):
    _, procs = cluster
    w = procs.spawn("seen", Where)
    w.where.call().get(timeout=30)
    rows = procs.telemetry.sql("SELECT host, count(*) AS n FROM messages WHERE actor = 'seen' GROUP BY host "
                               "ORDER BY host")
    assert rows == [{"host": "h0", "n": 2}, {"host": "h1", "n": 2}] and rows.missing == []
    stacks = procs.stacks()
    assert sorted(stacks) == [0, 1, 2, 3] and all("Thread" in s for s in stacks.values())
    w.stop()


def test_the_multihost_example_runs():
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, os.path.join(root, "examples", "multihost.py")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "sum of everything: 10485760.0 (numpy: 10485760.0 )" in r.stdout
    assert "sum over hosts, first element per proc: [4.0, 6.0]" in r.stdout


def test_the_readme_many_machines_block_runs(two_agents, cluster):
    """The README's script, with this machine's agents for node1 and node2 (after the cluster detached)."""
    import os
    import pathlib
    import re
    import subprocess
    import sys

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if "ma.attach" in b)
    hosts, procs = cluster
    procs.stop()
    hosts.detach()  # the agents serve one controller at a time: let the README's script have them
    code = block.replace('"tcp://node1:26600"', repr(two_agents[0].url)).replace(
        '"tcp://node2:26600"', repr(two_agents[1].url))
    assert code != block
    env = dict(os.environ, MESHARRAY_SECRET=SECRET)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100, env=env)
    assert r.returncode == 0, r.stderr[-3000:]


def test_collectives_across_hosts_over_ucx(two_agents, cluster):
    """The same reductions with the UCX data plane between the host leaders (the `ucx` extra)."""
    from mesharray.transport.dataplane import ucx_status

    ok, why = ucx_status()
    if not ok:
        pytest.skip(f"UCX data plane unavailable: {why}")
    hosts, procs = cluster
    procs.stop()
    hosts.detach()  # (the module's cluster is done with; the agents serve one controller at a time)
    hosts = ma.attach([a.url for a in two_agents], secret=SECRET, transport="ucx")
    procs = hosts.spawn_procs(per_host={"procs": 2})
    try:
        assert {k for _, k in procs.host_info} and all(
            w.hello.get("data_kind") == "ucx" for w in procs._root.controller.workers.values())
        x = procs.arange(5000, dtype="float64") * (procs.rank_array() + 1)
        ref = np.asarray(x.fetch())
        np.testing.assert_allclose(np.asarray(x.sum(axis="hosts").fetch()), ref.sum(axis=0))
        np.testing.assert_allclose(np.asarray(x.sum().fetch()), ref.sum())
        b = ma.broadcast_from(x, "hosts", root=1)
        np.testing.assert_array_equal(np.asarray(b.fetch())[0], ref[1])
        # Buffer between hosts goes over the UCX plane too, when both ends have one
        w = procs.spawn("ucxbuf", Where)
        n = 1 << 20
        buf = w[0, 0].make_buffer.call_one(n).get(timeout=30)
        before = w[1, 0].buffer_paths.call_one().get(timeout=30)
        assert w[1, 0].read_buffer.call_one(buf).get(timeout=60) == float(np.arange(n, dtype=np.float64).sum())
        after = w[1, 0].buffer_paths.call_one().get(timeout=30)
        assert after["plane"] == before["plane"] + 1 and after["stream"] == before["stream"]
    finally:
        procs.stop()
        hosts.detach()
