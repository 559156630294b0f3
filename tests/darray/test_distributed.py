"""Distributed MeshArrays: blocks in real worker processes, ops on the workers, collectives."""

import gc
import os
import signal
import time

import numpy as np
import pytest

import mesharray as ma
from mesharray.darray import data_context
from mesharray.errors import ActorDiedError, MeshShapeError
from tests.support.procs import mesh_fixture

proc_mod = pytest.importorskip("mesharray.proc", reason="needs the runtime (ProcMesh)")
if not hasattr(proc_mod.ProcMesh, "zeros"):
    pytest.skip("ProcMesh does not inherit ArrayFactory yet", allow_module_level=True)

pytestmark = pytest.mark.timeout(120)


procs = mesh_fixture(hosts=2, procs=2)


def _np(a):
    return np.asarray(a)


def test_factories(procs):
    assert procs.zeros((3,)).shape == (2, 2, 3)
    np.testing.assert_array_equal(_np(procs.zeros((3,), "int32")), np.zeros((2, 2, 3), "int32"))
    np.testing.assert_array_equal(_np(procs.ones((2,), "float32")), np.ones((2, 2, 2), "float32"))
    np.testing.assert_array_equal(_np(procs.full((2,), 7)), np.full((2, 2, 2), 7))
    np.testing.assert_array_equal(_np(procs.arange((2, 3))), np.broadcast_to(np.arange(6).reshape(2, 3), (2, 2, 2, 3)))
    assert procs.empty((5,), "float32").dtype == np.float32
    np.testing.assert_array_equal(_np(procs.rank_array()), np.arange(4).reshape(2, 2))
    r1, r2 = _np(procs.rand((4,), seed=1)), _np(procs.rand((4,), seed=1))
    np.testing.assert_array_equal(r1, r2)
    assert not np.array_equal(r1[0, 0], r1[0, 1])  # ranks draw different streams
    src = np.arange(24.0).reshape(2, 2, 6)
    a = procs.from_numpy(src)
    assert a.names == ("hosts", "procs") and a.local_shape == (6,)
    np.testing.assert_array_equal(_np(a), src)
    assert "distributed" in repr(a)
    with pytest.raises(MeshShapeError, match="leading axes are the mesh sizes"):
        procs.from_numpy(np.zeros((3, 2)))
    with pytest.raises(TypeError, match="rand needs a floating dtype"):
        procs.rand((2,), "int32")
    with pytest.raises(TypeError, match="local shape entries must be ints"):
        procs.zeros((2.5,))
    with pytest.raises(ValueError, match="unknown engine 'gpu9'"):
        procs.zeros((2,), engine="gpu9")


def test_elementwise_matches_numpy(procs):
    src = np.arange(24.0).reshape(2, 2, 6)
    a = procs.from_numpy(src)
    b = procs.from_numpy(src[::-1].copy() + 1)
    g = ma.MeshArray(np.array([10.0, 20.0]), ["procs"])  # gathered, broadcast over hosts
    bn = src[::-1] + 1
    np.testing.assert_allclose(_np(a * 2 + b), src * 2 + bn)
    np.testing.assert_allclose(_np(np.sqrt(a) - b / 3), np.sqrt(src) - bn / 3)
    np.testing.assert_allclose(_np(a + g), src + np.array([10.0, 20.0])[None, :, None])
    np.testing.assert_allclose(_np(a * np.arange(6.0)), src * np.arange(6.0))
    np.testing.assert_array_equal(_np(a > 5), src > 5)
    np.testing.assert_array_equal(_np(-a), -src)
    np.testing.assert_allclose(_np(a + procs.rank_array()), src + np.arange(4.0).reshape(2, 2, 1))
    c = (a * 2).astype("int32")
    assert c.dtype == np.int32
    np.testing.assert_array_equal(_np(c), (src * 2).astype("int32"))


def test_local_ops_and_views(procs):
    src = np.arange(24.0).reshape(2, 2, 6)
    a = procs.from_numpy(src)
    np.testing.assert_array_equal(_np(a.reshape_local(2, 3)), src.reshape(2, 2, 2, 3))
    np.testing.assert_array_equal(_np(a[..., 1:4]), src[..., 1:4])
    v = a[1]  # view over hosts=1: no data moves
    assert v.shape == (2, 6)
    np.testing.assert_array_equal(_np(v), src[1])
    np.testing.assert_array_equal(_np(a.slice(procs=-1)), src[:, -1])
    np.testing.assert_array_equal(_np(a.transpose("procs", "hosts")), src.transpose(1, 0, 2))
    m = procs.from_numpy(np.arange(2 * 2 * 6 * 2.0).reshape(2, 2, 6, 2))
    np.testing.assert_allclose(_np(a.reshape_local(1, 6) @ m), src.reshape(2, 2, 1, 6) @ _np(m))
    w = np.ones((6, 3))
    np.testing.assert_allclose(_np(a @ w), src @ w)
    a2 = a.copy()
    a2[..., 0] = -1.0
    assert _np(a2)[..., 0].tolist() == [[-1.0, -1.0], [-1.0, -1.0]]
    assert _np(a)[0, 0, 0] == 0.0


@pytest.mark.parametrize("op", ["sum", "prod", "min", "max", "mean"])
@pytest.mark.parametrize("axis", ["procs", "hosts", ("hosts", "procs"), -1, ("procs", -1), None])
def test_reductions_match_numpy(procs, op, axis):
    src = (np.arange(24.0).reshape(2, 2, 6) % 7) + 1
    a = procs.from_numpy(src)
    got = getattr(a, op)(axis=axis)
    ax = {"procs": 1, "hosts": 0, -1: -1}
    nax = None if axis is None else (tuple(ax[x] for x in axis) if isinstance(axis, tuple) else ax[axis])
    np.testing.assert_allclose(_np(got), getattr(np, op)(src, axis=nax), rtol=1e-12)


def test_integer_and_bool_reductions_keep_numpy_dtypes(procs):
    a = procs.from_numpy(np.arange(8, dtype="int32").reshape(2, 2, 2))
    s = a.sum(axis="procs")
    assert s.dtype == np.sum(np.zeros(2, "int32")).dtype
    np.testing.assert_array_equal(_np(s), np.arange(8, dtype="int32").reshape(2, 2, 2).sum(axis=1))
    assert a.mean(axis="procs").dtype == np.float64
    b = a > 3
    np.testing.assert_array_equal(_np(b.any(axis="procs")), _np(b).any(axis=1))
    np.testing.assert_array_equal(_np(b.all(axis="hosts")), _np(b).all(axis=0))


def test_keepdims_result_lives_on_every_member(procs):
    src = np.arange(24.0).reshape(2, 2, 6)
    a = procs.from_numpy(src)
    m = a.mean(axis="procs", keepdims=True)
    assert m.shape == (2, 1, 6)
    centered = a - m  # broadcast back over procs: every member holds the mean
    np.testing.assert_allclose(_np(centered), src - src.mean(axis=1, keepdims=True))
    np.testing.assert_allclose(_np(a.sum(keepdims=True)), src.sum(keepdims=True))


def test_mismatches_raise_before_sending(procs):
    a = procs.zeros((3,))
    with pytest.raises(MeshShapeError, match="do not broadcast"):
        a + procs.zeros((4,))
    with pytest.raises(MeshShapeError, match="several blocks on one rank"):
        a[0:1, :] + a[:, 0:1]  # no operand has every position: no rank layout to compute in
    # different ranks for the same position: the blocks move (tests/darray/test_moves.py)
    np.testing.assert_array_equal(_np(a[0] + a[1].reshape_local(1, 3)), np.zeros((2, 1, 3)))
    with pytest.raises(MeshShapeError, match="core dimension"):
        a @ np.ones((4, 2))


def test_apply_and_endpoint_receives_local_block(procs):
    a = procs.from_numpy(np.arange(8.0).reshape(2, 2, 2))
    r = procs.apply(lambda x, k: x[::-1] * k, a, 10)
    assert r.local_shape == (2,) and r.dtype == np.float64
    np.testing.assert_array_equal(_np(r), np.arange(8.0).reshape(2, 2, 2)[..., ::-1] * 10)
    from tests.support.actors import BlockProbe

    probes = procs.spawn("probes", BlockProbe)
    got = probes.describe.call(a).get()
    assert _np(got).tolist() == [[1.0, 5.0], [9.0, 13.0]]  # each rank summed its own block


def test_blocks_freed_when_controller_array_is_collected(procs):
    from tests.support.actors import BlockProbe

    probes = procs.spawn("counter", BlockProbe)
    gc.collect()

    # frees of earlier tests' arrays would otherwise ride along with x's program
    data_context(procs).flush_frees()
    before = _np(probes.count.call().get()).tolist()
    x = procs.ones((1000,))
    y = x * 2 + 1
    during = _np(probes.count.call().get())
    assert (during >= np.asarray(before) + 2).all()
    del x, y
    gc.collect()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        after = _np(probes.count.call().get()).tolist()
        if after == before:
            break
        time.sleep(0.05)
    assert after == before


@pytest.mark.timeout(60)
def test_worker_death_during_reduction_raises_actor_died():
    with ma.proc_mesh(hosts=1, procs=3) as procs:
        a = procs.ones((4,))
        np.testing.assert_array_equal(_np(a.sum(axis="procs")), [[3.0] * 4])  # groups made
        os.kill(procs.pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(ActorDiedError) as info:
            a.sum(axis="procs").fetch()
        assert 1 in info.value.ranks
        assert time.monotonic() - t0 < 10



@pytest.mark.timeout(60)
@pytest.mark.parametrize("victim", [0, 2], ids=["root", "member"])
def test_death_in_a_loop_of_tiny_reductions_raises_actor_died(victim):
    # a loss in a training loop: the plan, the channels and the per-op fast path are warm when a rank
    # dies; the result's root (rank 0, which answers) or a member that only takes part
    with ma.proc_mesh(hosts=1, procs=3) as procs:
        x = procs.full((), 1.0)
        for _ in range(30):
            assert _np(x.sum(axis="procs")).tolist() == [3.0]
        os.kill(procs.pids[victim], signal.SIGKILL)
        t0 = time.monotonic()
        for _ in range(3):  # and every later op, without hanging
            with pytest.raises(ActorDiedError) as info:
                x.sum(axis="procs").fetch()
            assert victim in info.value.ranks
        assert time.monotonic() - t0 < 15


@pytest.mark.timeout(90)
def test_a_script_that_exits_holding_arrays_of_a_running_mesh_ends(tmp_path):
    # a user's script that never stops its mesh: the arrays it still holds are dropped while the
    # interpreter exits, when no thread can start (their frees must not try to start one)
    import subprocess
    import sys

    script = tmp_path / "leave.py"
    script.write_text(
        "import mesharray as ma\n"
        "procs = ma.proc_mesh(procs=2)\n"
        "x = procs.full((), 2.0)\n"
        "losses = [x.sum(axis='procs') for _ in range(5)]\n"
        "y = x + 1\n"
        "print(*procs.pids, float(losses[0].fetch().to_numpy().reshape(-1)[0]))\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    *pids, value = out.stdout.split()
    assert float(value) == 4.0
    deadline = time.monotonic() + 10
    while any(_alive(int(p)) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(int(p)) for p in pids), "workers outlived their controller"


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone but for its parent's wait
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"

def test_fetch_returns_gathered(procs):
    a = procs.arange((3,))
    f = a.fetch()
    assert "distributed" not in repr(f) and f.names == a.names
    np.testing.assert_array_equal(f.to_numpy(), _np(a))


def test_printing_does_not_gather(procs):
    x = procs.ones((1 << 16,), dtype="float32")
    before = procs.stats()["replies"]
    text = str(x)
    assert text.startswith("MeshArray(hosts=2, procs=2, local=(65536,)") and "fetch()" in text
    assert repr(x) in text
    assert procs.stats()["replies"] == before  # nothing came back from the workers


def test_torch_engine_blocks(procs):
    pytest.importorskip("torch")
    a = procs.arange((4,), "float32", engine="torch")
    b = (a * 2 + procs.rank_array(engine="torch")).sum(axis="procs")
    expected = (np.arange(4.0) * 2)[None, None] * 1 + np.arange(4.0).reshape(2, 2, 1)
    np.testing.assert_allclose(_np(b), expected.sum(axis=1))
    assert _np(a.mean(axis=-1)).tolist() == [[1.5, 1.5], [1.5, 1.5]]


@pytest.mark.timeout(90)
def test_torch_distributed_gloo_backend():
    pytest.importorskip("torch")
    with ma.proc_mesh(hosts=1, procs=2) as procs:
        src = np.arange(8.0).reshape(1, 2, 4)
        a = procs.from_numpy(src, engine="torch", collective="torch")
        np.testing.assert_allclose(_np(a.sum(axis="procs")), src.sum(axis=1))
        np.testing.assert_allclose(_np(a.max(axis=("hosts", "procs"))), src.max(axis=(0, 1)))
        with pytest.raises(ValueError, match="cover the whole mesh"):
            a[:, :1].sum(axis="procs")


@pytest.mark.timeout(60)
def test_rank_dead_before_its_first_collective_does_not_block_survivors():
    with ma.proc_mesh(hosts=1, procs=3) as procs:
        a = procs.ones((4,))
        np.asarray(a)  # blocks exist; no collective group made yet
        os.kill(procs.pids[2], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(ActorDiedError) as info:
            a.sum(axis="procs").fetch()
        assert 2 in info.value.ranks
        # the survivors left their (never completed) group at once: they serve a view without rank 2
        np.testing.assert_array_equal(_np(a[:, :2].sum(axis="procs")), [[2.0] * 4])
        assert time.monotonic() - t0 < 10
        # the creator of the failed group removed its segment (this mesh's: other jobs
        # on the host may have groups of the same ranks)
        mine = f"ma-{data_context(procs).token}-{_digest((0, 1, 2))}"
        assert mine not in os.listdir("/dev/shm")


def _digest(members):
    import hashlib

    return hashlib.sha1(repr(members).encode()).hexdigest()[:12]


@pytest.mark.timeout(60)
def test_group_creator_dead_before_creating_fails_fast():
    with ma.proc_mesh(hosts=1, procs=3) as procs:
        a = procs.ones((4,))
        np.asarray(a)
        os.kill(procs.pids[0], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(ActorDiedError) as info:
            a.sum(axis="procs").fetch()
        assert 0 in info.value.ranks
        np.testing.assert_array_equal(_np(a[:, 1:].sum(axis="procs")), [[2.0] * 4])
        assert time.monotonic() - t0 < 10


def _boom(x):
    raise ZeroDivisionError("no way")


def test_remote_failure_is_raised_with_its_type(procs):
    a = procs.ones((2,))
    with pytest.raises(ma.ActorError) as info:
        procs.apply(_boom, a)
    assert isinstance(info.value.exception, ZeroDivisionError)
    assert "no way" in str(info.value) and "_boom" in info.value.traceback_text


def test_allgather_broadcast_reduce_scatter_over_mesh_dims(procs):
    src = np.arange(16.0).reshape(2, 2, 4)
    a = procs.from_numpy(src)
    g = ma.allgather(a, "procs")
    assert g.shape == (2, 2, 2, 4)
    for h in range(2):
        for p in range(2):
            np.testing.assert_array_equal(_np(g)[h, p], src[h])
    g2 = ma.allgather(a, ("hosts", "procs"))
    np.testing.assert_array_equal(_np(g2)[1, 0], src.reshape(4, 4))
    b = ma.broadcast_from(a, "hosts", root=-1)
    np.testing.assert_array_equal(_np(b), np.broadcast_to(src[1:], src.shape))
    r = ma.reduce_scatter(a, "procs")
    assert r.local_shape == (2,)
    s = src.sum(axis=1)  # (hosts, 4)
    np.testing.assert_array_equal(_np(r), np.stack([s[:, :2], s[:, 2:]], axis=1))
    np.testing.assert_allclose(_np(ma.reduce_scatter(a, "hosts", op="mean")),
                               np.stack([src.mean(axis=0)[:, :2], src.mean(axis=0)[:, 2:]], axis=0))
    with pytest.raises(MeshShapeError, match="does not divide"):
        ma.reduce_scatter(procs.ones((3,)), "procs")
    with pytest.raises(IndexError, match="root 5 is out of range"):
        ma.broadcast_from(a, "procs", root=5)
    with pytest.raises(ma.DimensionError, match="no dimension 'gpus'"):
        ma.allgather(a, "gpus")
    with pytest.raises(TypeError, match="needs a distributed MeshArray"):
        ma.allgather(ma.MeshArray(np.arange(2), ["procs"]), "procs")


def _fail_on_rank_one(x):
    if float(np.asarray(x).reshape(-1)[0]) == 1.0:
        raise ZeroDivisionError("rank one says no")
    return x


@pytest.mark.timeout(90)
def test_ranks_that_send_no_result_back_hold_a_tiny_reductions_result_all_the_same():
    # a tiny reduction's members other than its root leave their host round before the result is
    # in (more members than CPUs: here each worker sees one CPU); they take it in at their next op
    # that reads it, and a failure of the reduction reaches them as well
    with ma.proc_mesh(hosts=1, procs=3) as procs:
        if hasattr(os, "sched_setaffinity"):
            cpu = min(os.sched_getaffinity(0))
            for pid in procs.pids:
                os.sched_setaffinity(pid, {cpu})
        r = procs.rank_array().astype("float64")
        for i in range(10):
            assert _np((r + i).sum(axis="procs")).tolist() == [3.0 + 3 * i]
            s = (r * i).sum(axis="procs", keepdims=True)
            np.testing.assert_array_equal(_np(r + s), [[3.0 * i, 1 + 3.0 * i, 2 + 3.0 * i]])
        m = r.mean(axis="procs", keepdims=True)
        np.testing.assert_array_equal(_np(r - m), [[-1.0, 0.0, 1.0]])
        bad = procs.apply(_fail_on_rank_one, r)
        s = bad.sum(axis="procs", keepdims=True)
        with pytest.raises(ma.ActorError) as info:
            (r + s)[:, 2].fetch()  # rank 2 did not fail: it holds the reduction's failure
        assert isinstance(info.value.exception, ZeroDivisionError) and "rank one says no" in str(info.value)
        del s
        for _ in range(3):  # the groups go on
            assert _np(r.sum(axis="procs")).tolist() == [3.0]


def test_a_tiny_reduction_sends_one_message_per_rank_and_fetch_sends_none():
    with ma.proc_mesh(procs=2) as procs:
        x = procs.full((), 2.0)
        assert np.asarray(x.sum(axis="procs").fetch()).ravel().tolist() == [4.0]
        s0 = procs.stats()
        t = time.perf_counter()
        y = x.sum(axis="procs")
        assert time.perf_counter() - t < 0.5  # nothing waited for
        s1 = procs.stats()
        # the group's root gets the program as a call (its reply announces the value), the other
        # rank a broadcast; fetching then costs no message
        assert (s1["calls"] - s0["calls"], s1["broadcasts"] - s0["broadcasts"]) == (1, 1)
        assert np.asarray(y.fetch()).ravel().tolist() == [4.0]
        s2 = procs.stats()
        assert (s2["calls"], s2["broadcasts"]) == (s1["calls"], s1["broadcasts"])


def test_a_tiny_reduction_right_after_another_op_writes_all_its_frames_at_once(monkeypatch):
    # the caller waits on the root's reply next: the broadcast to the other rank must not be
    # corked as part of a burst (the wait would flush it anyway; corked, it only woke the
    # flusher thread, a thread switch per op of a loss in a training loop)
    from mesharray.runtime import channel

    monkeypatch.setattr(channel, "_BURST", 1.0)  # every broadcast counts as part of a burst
    with ma.proc_mesh(procs=2) as procs:
        x = procs.full((), 2.0)
        for _ in range(5):
            z = x + 1.0  # a broadcast to both ranks (corked: a burst), just before the reduction's
            channel.flush_all()
            loss = z.sum(axis="procs")
            assert not channel.dirty
            assert np.asarray(loss.fetch()).ravel().tolist() == [6.0]


def test_tiny_reductions_with_several_roots_in_a_loop_free_what_they_drop(procs):
    # one program for all members, sent once: each group's root answers with its value,
    # and the frees of dropped results (held by the roots only) reach their holders
    from tests.support.actors import BlockProbe

    probes = procs.spawn("tiny_loop", BlockProbe)
    x = procs.rank_array().astype("float64")
    gc.collect()
    data_context(procs).flush_frees()
    before = _np(probes.count.call().get()).tolist()
    for i in range(60):
        y = (x + i).sum(axis="procs")  # roots: one per host
        np.testing.assert_array_equal(_np(y), [1.0 + 2 * i, 5.0 + 2 * i])
        del y
    gc.collect()
    data_context(procs).flush_frees()
    assert _np(probes.count.call().get()).tolist() == before
    # the other mesh dim: roots are the first host's ranks
    np.testing.assert_array_equal(_np(x.sum(axis="hosts")), [2.0, 4.0])


def test_a_large_reduction_is_fire_and_forget_and_fetch_asks_only_the_root():
    with ma.proc_mesh(procs=2) as procs:
        x = procs.ones((1000,))
        s0 = procs.stats()
        y = x.sum(axis="procs")
        s1 = procs.stats()
        assert s1["calls"] == s0["calls"]  # nothing waited for
        assert np.asarray(y.fetch()).ravel().tolist() == [2.0] * 1000
        s2 = procs.stats()
        assert s2["calls"] - s1["calls"] == 1  # one call_one, to the group's root


def test_input_failing_on_one_rank_surfaces_at_fetch_as_the_original_error(procs):
    r = procs.rank_array().astype("float64")
    bad = procs.apply(_fail_on_rank_one, r)  # rank 0 made its block, rank 1 failed
    s = (bad * 2).sum(axis="procs")  # fire-and-forget: rank 0 must not wait on rank 1
    t0 = time.monotonic()
    with pytest.raises(ma.ActorError) as info:
        s.fetch()
    assert isinstance(info.value.exception, ZeroDivisionError) and "rank one says no" in str(info.value)
    # a later reduction of the failed result raises it too
    with pytest.raises(ma.ActorError) as info:
        np.asarray(s.sum(axis="hosts"))
    assert isinstance(info.value.exception, ZeroDivisionError)
    # through a freed intermediate result too
    mid = procs.apply(_fail_on_rank_one, r).sum(axis="procs")
    z = mid.sum(axis="hosts")
    del mid
    gc.collect()
    from mesharray.darray import data_context

    data_context(procs).flush_frees()  # the intermediate is gone from the workers
    with pytest.raises(ma.ActorError) as info:
        np.asarray(z)
    assert isinstance(info.value.exception, ZeroDivisionError)
    assert time.monotonic() - t0 < 10
    # the groups are still usable afterwards
    np.testing.assert_array_equal(_np(r.sum(axis="procs")), [1.0, 5.0])


def test_a_tiny_reduction_in_a_loop_whose_input_fails_on_one_rank_raises_the_original(procs):
    # after a few rounds the plan runs on the workers' prepared path (its group cached, one
    # compiled round); a rank whose input failed takes the general path and its peers
    # must still agree that nothing was reduced, and the next rounds must still add up
    r = procs.rank_array().astype("float64")
    for i in range(5):
        np.testing.assert_array_equal(_np((r + i).sum(axis="procs")), [1.0 + 2 * i, 5.0 + 2 * i])
    bad = procs.apply(_fail_on_rank_one, r)  # same layout and dtype: the same plan
    with pytest.raises(ma.ActorError) as info:
        bad.sum(axis="procs").fetch()
    assert isinstance(info.value.exception, ZeroDivisionError) and "rank one says no" in str(info.value)
    for i in range(5):
        np.testing.assert_array_equal(_np((r * i).sum(axis="procs")), [1.0 * i, 5.0 * i])
        np.testing.assert_array_equal(_np((r * i).mean(axis="procs")), [0.5 * i, 2.5 * i])


def test_failing_tiny_reductions_free_their_intermediate_blocks(procs):
    # the failure of a tiny result is raised on its holder after the rest of its program
    # ran: the frees that come after the collective (the local reduction's intermediate)
    from tests.support.actors import BlockProbe

    probes = procs.spawn("tiny_fail", BlockProbe)
    x = procs.rank_array().astype("float64") + procs.zeros((3,))
    bad = procs.apply(_fail_on_rank_one, x)
    gc.collect()
    data_context(procs).flush_frees()
    before = _np(probes.count.call().get()).tolist()
    for _ in range(20):
        with pytest.raises(ma.ActorError):
            bad.sum().fetch()  # a local sum (an intermediate block), then a collective
    gc.collect()
    data_context(procs).flush_frees()
    assert _np(probes.count.call().get()).tolist() == before


@pytest.mark.timeout(60)
def test_worker_death_before_fire_and_forget_reduction_raises_at_fetch():
    with ma.proc_mesh(procs=2) as procs:
        x = procs.full((), 2.0)
        assert np.asarray(x.sum(axis="procs").fetch()).ravel().tolist() == [4.0]
        os.kill(procs.pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        y = x.sum(axis="procs")  # the survivor (the root) sees its peer die in the collective
        with pytest.raises(ActorDiedError) as info:
            y.fetch()
        assert info.value.ranks == [1] or 1 in info.value.ranks
        assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("dtype", ["float64", "float32", "int8", "uint16", "bool", "complex64", "datetime64[s]"])
def test_small_fetched_values_are_writable_arrays_of_their_dtype(procs, dtype):
    src = np.arange(2 * 2 * 3).reshape(2, 2, 3).astype(dtype)
    a = procs.from_numpy(src)
    got = _np(a)
    assert got.dtype == np.dtype(dtype) and got.shape == (2, 2, 3)
    np.testing.assert_array_equal(got, src)
    one = _np(a[0, 1])  # one block: handed over as it arrived
    assert one.flags.writeable and one.dtype == np.dtype(dtype) and one.shape == (3,)
    one[...] = src[0, 0]  # the caller owns what it fetched
    if np.dtype(dtype).kind == "f":
        s = _np(a.sum(axis=("hosts", "procs")))
        assert s.flags.writeable and s.shape == (3,)
        np.testing.assert_allclose(s, src.sum(axis=(0, 1)))


def test_elementwise_layouts_are_reused_per_operand_layout_not_confused(procs):
    src = np.arange(2 * 2 * 2.0).reshape(2, 2, 2)
    a = procs.from_numpy(src)
    for _ in range(3):  # the second and third go through the cached layouts
        np.testing.assert_array_equal(_np(a[:, 0:1] + 1), src[:, 0:1] + 1)
        np.testing.assert_array_equal(_np(a[:, 1:2] + 1), src[:, 1:2] + 1)
        np.testing.assert_array_equal(_np(a[::-1] * a[::-1]), src[::-1] ** 2)
        # operands on different ranks: the second's blocks move to the first's ranks
        np.testing.assert_array_equal(_np(a[:, 0:1] + a[:, 1:2]), src[:, 0:1] + src[:, 1:2])
        np.testing.assert_array_equal(_np(a[:, 1:2] - a[:, 0:1]), src[:, 1:2] - src[:, 0:1])
    other = ma.proc_mesh(hosts=2, procs=2)
    try:
        b = other.from_numpy(src)
        for _ in range(2):  # another process mesh's blocks move too (the layout is not confused with a's own)
            np.testing.assert_array_equal(_np(a + b), src * 2)
            np.testing.assert_array_equal(_np(a + a), src * 2)
    finally:
        other.stop()


def test_a_block_an_actor_kept_is_never_reused_for_another_result(procs):
    # the worker recycles the memory of large freed blocks for the results of collectives;
    # a block that an endpoint still holds must not be among them (it was: its values
    # changed under the actor once the controller dropped the array)
    from tests.support.actors import BlockKeeper

    keepers = procs.spawn("keepers", BlockKeeper)
    n = (2 << 20) // 8  # over the pool's 1 MiB minimum
    a = procs.full((n,), 1.0) * 2  # (NumPy's own allocation on each rank)
    assert _np(keepers.keep.call(a).get()).tolist() == [[2.0, 2.0], [2.0, 2.0]]
    del a
    gc.collect()
    data_context(procs).flush_frees()
    for k in range(3):  # results of the same size, made after the free
        y = procs.full((n,), 5.0 + k).sum(axis="procs")
        assert float(_np(y)[0, 0]) == 2 * (5.0 + k)
        del y
        gc.collect()
        data_context(procs).flush_frees()
    got = _np(keepers.first.call().get())
    assert [[v[0] for v in row] for row in got.tolist()] == [[2.0, 2.0], [2.0, 2.0]]
