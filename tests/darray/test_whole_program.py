"""Whole programs from the controller: queued ops, no waits, captured steps, autograd through the mesh.

Each behaviour a user relies on, against torch (or NumPy) in one process where
there is a value to compare.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import mesharray as ma
from mesharray.darray import context as dctx
from mesharray.darray import data_context
from tests.support.procs import mesh_fixture

torch = pytest.importorskip("torch")
F = torch.nn.functional

pytestmark = pytest.mark.timeout(180)


procs = mesh_fixture(procs=2)


def _np(x):
    return np.asarray(x.fetch())


def _mlp(x, w1, b1, w2, b2):
    return F.linear(torch.relu(F.linear(x, w1, b1)), w2, b2)


def _problem(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 8, 4)).astype("float32")
    y = rng.standard_normal((2, 8, 3)).astype("float32")
    ps = [rng.standard_normal((5, 4)).astype("float32"), np.zeros(5, "float32"),
          rng.standard_normal((3, 5)).astype("float32"), np.zeros(3, "float32")]
    return x, y, ps


def _replicated(procs, p):
    return procs.from_numpy(np.broadcast_to(p, (1, 2) + p.shape).copy(), engine="torch").requires_grad_()


def _step(xs, ys, *ws):
    loss = torch.mean((_mlp(xs, *ws) - ys) ** 2)
    loss.backward()
    return [(w - 0.1 * w.grad.mean(axis="procs", keepdims=True)).detach().requires_grad_() for w in ws]


def _reference(steps):
    """The same data-parallel steps in one process: the mean of the two shards' gradients."""
    x, y, ps = _problem()
    ws = [torch.tensor(p, requires_grad=True) for p in ps]
    for _ in range(steps):
        grads = []
        for i in range(2):
            loss = torch.mean((_mlp(torch.tensor(x[i]), *ws) - torch.tensor(y[i])) ** 2)
            grads.append(torch.autograd.grad(loss, ws))
        ws = [(w - 0.1 * (g0 + g1) / 2).detach().requires_grad_() for w, g0, g1 in zip(ws, *grads)]
    return [w.detach().numpy() for w in ws]


def _in_threads(body, n: int = 2) -> None:
    """``body(k)`` in ``n`` threads at once; raises what any of them raised."""
    import threading

    errors: list = []

    def run(k: int) -> None:
        try:
            body(k)
        except BaseException as exc:
            errors.append(exc)

    ts = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors


# --- ops are queued: one message per rank for many ops, nothing waited for -----------------


def test_a_run_of_ops_goes_as_one_message_per_rank(procs):
    x = procs.ones((4,), dtype="float32")
    _np(x)
    before = procs.stats()["broadcasts"]
    y = x
    for _ in range(50):
        y = y * 1.5 + 1.0
    got = _np(y)
    sent = procs.stats()["broadcasts"] - before
    want = np.ones(4, dtype="float32")
    for _ in range(50):
        want = want * 1.5 + 1.0
    assert np.allclose(got, want)
    assert sent <= 10, f"100 ops sent {sent} messages"


def test_backward_returns_without_waiting_for_the_ranks(procs):
    from tests.support.actors import Probe

    w = procs.from_numpy(np.ones((1, 2, 3), "float32"), engine="torch").requires_grad_()
    loss = torch.mean(w * w)
    busy = procs.spawn("busy", Probe)
    busy.sleep.broadcast(1.0)  # each rank busy for a second: its programs run after
    t0 = time.perf_counter()
    loss.backward()
    assert time.perf_counter() - t0 < 0.5
    assert np.allclose(_np(w.grad), 2 / 3)
    assert time.perf_counter() - t0 >= 0.9  # (the gradient came once the ranks were free)


def test_a_failed_backward_raises_at_the_next_wait_and_the_mesh_goes_on(procs):
    w = procs.from_numpy(np.ones((1, 2, 3), "float32"), engine="torch")  # no requires_grad_()
    loss = torch.mean(w * w)
    loss.backward()  # queued: nothing raised here
    with pytest.raises(ma.ActorError, match="does not require grad") as info:
        procs.sync()
    assert "mesharray: in the distributed op" in info.value.traceback_text  # the op is named
    assert np.allclose(_np(loss), 1.0)  # the mesh keeps working
    procs.sync()


def test_an_op_that_fails_on_the_ranks_raises_where_a_value_is_waited_for(procs):
    x = procs.from_numpy(-np.ones((1, 2, 2, 2), "float32"), engine="torch")  # not positive definite
    chol = torch.linalg.cholesky(x)  # shapes are fine: queued, fails on the ranks
    y = chol * 2 + 1  # depends on it: raises the same error instead of running
    with pytest.raises(ma.ActorError, match="cholesky|positive-definite|factorization") as first:
        _np(y)
    with pytest.raises(ma.ActorError) as again:
        _np(chol)
    assert type(first.value.exception) is type(again.value.exception)
    assert np.allclose(_np(x + 1), 0)  # the mesh keeps working


def test_queued_ops_are_bounded(procs, monkeypatch):
    x = procs.ones((2,), dtype="float32")
    ctx = data_context(procs)
    monkeypatch.setattr(ctx, "_max_pending", 20)  # (MESHARRAY_MAX_PENDING=20)
    calls = procs.stats()["calls"]
    for _ in range(100):
        x = x + 1
    assert procs.stats()["calls"] - calls >= 2 * 4  # the controller waited for the ranks to catch up
    assert ctx._unsynced <= 21
    assert np.allclose(_np(x), 101)


# --- captured steps ---------------------------------------------------------------------


def test_a_captured_step_replays_with_the_same_weights_as_op_by_op(procs):
    x, y, ps = _problem()
    xs, ys = procs.from_numpy(x[None], engine="torch"), procs.from_numpy(y[None], engine="torch")
    eager = [_replicated(procs, p) for p in ps]
    captured = [_replicated(procs, p) for p in ps]
    step = ma.function(_step)
    sent = []
    for _ in range(5):
        eager = _step(xs, ys, *eager)
        before = procs.stats()["broadcasts"]
        captured = step(xs, ys, *captured)
        procs.sync()
        sent.append(procs.stats()["broadcasts"] - before)
    assert step.records == 1
    assert max(sent[1:]) <= 2  # a replay: one message per rank (the two ranks share it)
    want = _reference(5)
    for e, c, w in zip(eager, captured, want):
        assert np.allclose(_np(e)[0, 0], w, atol=1e-5)
        assert np.array_equal(_np(e), _np(c))


class _Buckets(ma.Actor):
    @ma.endpoint
    def counts(self) -> dict:
        from mesharray.darray.overlap import COUNTS

        return dict(COUNTS)


@pytest.mark.parametrize("capture", [False, True], ids=["op by op", "captured"])
def test_gradient_reductions_go_in_buckets_started_during_backward(capture):
    # (a mesh of its own: the flush policy decides what one program holds, and nothing else runs here)
    x, y, ps = _problem()
    with ma.proc_mesh(procs=2) as p:
        xs, ys = p.from_numpy(x[None], engine="torch"), p.from_numpy(y[None], engine="torch")
        ws = [_replicated(p, q) for q in ps]
        step = ma.function(_step) if capture else _step
        counter = p.spawn("buckets", _Buckets)
        for _ in range(3):
            ws = step(xs, ys, *ws)
            p.sync()
        counts = counter.counts.call().get(timeout=30)[0, 0]
        assert counts["backwards"] >= 2 and counts["grads"] >= 2 * len(ps)
        assert counts["buckets"] < counts["grads"]  # the 4 gradients of a step went as fewer all-reduces
        want = _reference(3)
        for w, r in zip(ws, want):
            assert np.allclose(_np(w)[0, 0], r, atol=1e-5)


def _pin_to_one_cpu(pids):
    # every thread of each worker (new ones inherit it): the members then have no CPU to spare
    cpu = min(os.sched_getaffinity(0))
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(tid), {cpu})


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity (Linux) to pin workers")
@pytest.mark.parametrize("bucket_bytes", [None, "1048576"], ids=["default", "MESHARRAY_BUCKET_BYTES set"])
def test_members_without_a_cpu_to_spare_reduce_their_gradients_in_one_bucket(bucket_bytes, monkeypatch):
    # three gradients of 600 KB: in 1 MiB buckets, two all-reduces during the backward; where the
    # members have no CPU beside their own, one after it (a reducing thread would only take turns
    # with the backward), unless the user set the buckets' size
    monkeypatch.setattr(dctx, "FLUSH_IDLE", 30.0)  # (one program: the backward, then the reductions, even
    monkeypatch.setattr(dctx, "FLUSH_AGE", 30.0)  # when a loaded machine pauses the controller mid-step)
    rng = np.random.default_rng(3)
    W = [rng.standard_normal((1, 2, 150_000)).astype("float32") for _ in range(3)]
    env = {} if bucket_bytes is None else {"MESHARRAY_BUCKET_BYTES": bucket_bytes}
    with ma.proc_mesh(procs=2, env=env) as p:
        _pin_to_one_cpu(p.pids)
        ws = [p.from_numpy(w, engine="torch").requires_grad_() for w in W]
        for _ in range(2):
            loss = sum(((w * w).sum(axis=-1) for w in ws), start=0.0)
            loss.backward()
            ms = [w.grad.mean(axis="procs", keepdims=True) for w in ws]
            ws = [(w - 0.5 * m).detach().requires_grad_() for w, m in zip(ws, ms)]
            p.sync()
        for w, w0 in zip(ws, W):
            want = w0 - 0.5 * np.broadcast_to((2 * w0).mean(axis=1, keepdims=True), w0.shape)
            want = want - 0.5 * np.broadcast_to((2 * want).mean(axis=1, keepdims=True), w0.shape)
            np.testing.assert_allclose(_np(w), want, rtol=1e-5, atol=1e-5)
        counts = p.spawn("buckets", _Buckets).counts.call().get(timeout=30)[0, 0]
        assert counts["backwards"] == 2 and counts["grads"] == 6
        assert counts["buckets"] == (2 if bucket_bytes is None else 4)


def test_a_captured_step_records_again_for_another_shape(procs):
    step = ma.function(lambda a, b: torch.relu(a * b + 1))
    for n in (3, 3, 5, 5):
        a = procs.from_numpy(np.full((1, 2, n), -2.0, "float32"), engine="torch")
        b = procs.from_numpy(np.full((1, 2, n), 0.25, "float32"), engine="torch")
        assert np.allclose(_np(step(a, b)), 0.5)
    assert step.records == 2


def test_a_value_fetched_inside_a_captured_step_is_an_error_naming_it(procs):
    def step(a):
        b = a * 2
        print(float(_np(b).sum()))  # a wait inside the step
        return b

    f = ma.function(step)
    a = procs.ones((2,), dtype="float32")
    with pytest.raises(ma.CaptureError, match=r"fetch.*test_whole_program\.py:\d+"):
        f(a)
    assert np.allclose(_np(a * 3), 3)  # the mesh works on


def test_a_captured_step_on_two_meshes_is_refused():
    with ma.proc_mesh(procs=1) as p1, ma.proc_mesh(procs=1) as p2:
        f = ma.function(lambda a, b: (a + 1, b + 1))
        with pytest.raises(ma.CaptureError, match="2 process meshes"):
            f(p1.ones((2,)), p2.ones((2,)))


def test_arrays_the_step_uses_from_outside_stay_alive(procs):
    import gc

    held = {"c": procs.full((2,), 3.0, dtype="float32")}
    step = ma.function(lambda a: a * held["c"])
    a = procs.ones((2,), dtype="float32")
    step(a)
    held.clear()
    gc.collect()
    data_context(procs).flush()
    assert np.allclose(_np(step(a)), 3.0)


# --- autograd through the mesh -------------------------------------------------------------


@pytest.fixture(scope="module")
def four():
    mesh = ma.proc_mesh(procs=4)
    yield mesh
    mesh.stop()


W = (np.arange(12, dtype="float32").reshape(1, 4, 3) / 7)
RANK = np.arange(4, dtype="float32").reshape(1, 4, 1)


def _leaf(four):
    return four.from_numpy(W, engine="torch").requires_grad_()


def _torch_grad(fn):
    t = torch.tensor(W, requires_grad=True)
    fn(t).backward()
    return t.grad.numpy()


@pytest.mark.parametrize("name,mesh_fn,torch_fn", [
    ("sum over all axes", lambda w, r: (w * r * w).sum(),
     lambda t: (t * torch.tensor(RANK) * t).sum()),
    ("mean over procs", lambda w, r: ((w - w.mean(axis="procs", keepdims=True)) ** 2).sum(),
     lambda t: ((t - t.mean(dim=1, keepdim=True)) ** 2).sum()),
    ("sum over procs, then local", lambda w, r: torch.sum(torch.tanh(w.sum(axis="procs")) * 2.0),
     lambda t: torch.sum(torch.tanh(t.sum(dim=1)) * 2.0) * 1.0),
    ("roll", lambda w, r: (w.roll(1, axis="procs") * r).sum(),
     lambda t: (torch.roll(t, 1, dims=1) * torch.tensor(RANK)).sum()),
    ("operands on other ranks", lambda w, r: (w[:, 0:2] * w[:, 2:4]).sum(),
     lambda t: (t[:, 0:2] * t[:, 2:4]).sum()),
    ("to_mesh fanning out", None, lambda t: (t[:, 1:2] * torch.tensor(RANK)).sum() + (t * t).sum()),
])
def test_backward_through_mesh_ops_matches_torch(four, name, mesh_fn, torch_fn):
    w = _leaf(four)
    r = four.rank_array(dtype="float32", engine="torch")
    if mesh_fn is None:  # (one block to every rank of the mesh; every position used, as torch's grad has all)
        loss = (w[:, 1:2].to_mesh(four) * r).sum() + (w * w).sum()
    else:
        loss = mesh_fn(w, r)
    loss.backward()
    got = _np(w.grad)
    want = _torch_grad(torch_fn)
    assert np.allclose(got, want, atol=1e-5), f"{name}: {got} != {want}"


def test_requires_grad_is_known_without_asking_the_ranks(four):
    w = _leaf(four)
    assert w.storage.rg and not (w.detach()).storage.rg
    ones = four.ones((3,), dtype="float32", engine="torch")
    assert (w * 2).storage.rg and (ones * w).storage.rg and not ones.storage.rg and not (ones * w).detach().storage.rg
    with torch.no_grad():
        assert not (w * 2).storage.rg


# --- what review found (each failed before its fix) -------------------------------------------


def test_moves_to_another_stage_keep_every_participant_in_step(procs):
    p0, p1 = procs.slice(procs=0), procs.slice(procs=1)
    a = p0.from_numpy(np.ones((1, 4), "float32"), engine="torch").requires_grad_()
    b = p0.from_numpy(np.full((1, 4), 2.0, "float32"), engine="torch").requires_grad_()
    for _ in range(3):
        a1 = a.to_mesh(p1)
        c = a + 1  # an op on the sender between the moves
        b1 = b.to_mesh(p1)
        assert np.allclose(_np(b1), 2.0) and np.allclose(_np(a1), 1.0) and np.allclose(_np(c), 2.0)


def test_buckets_leave_a_backward_through_mesh_ops_to_the_program(procs):
    W = np.arange(6, dtype="float32").reshape(1, 2, 3)
    for _ in range(2):
        w = procs.from_numpy(W, engine="torch").requires_grad_()
        loss = (w * w.sum(axis="procs", keepdims=True)).sum(axis=-1)  # one loss per rank, through a reduction
        loss.backward()
        got = _np(w.grad.mean(axis="procs", keepdims=True))
        t = torch.tensor(W, requires_grad=True)
        (t * t.sum(dim=1, keepdim=True)).sum().backward()
        assert np.allclose(got[0, 0], t.grad.numpy().mean(axis=1)[0])


@pytest.mark.parametrize("bucket_bytes", [None, "64"], ids=["one bucket", "a bucket per gradient"])
def test_a_parameter_the_backward_misses_keeps_its_earlier_gradient_in_the_buckets(bucket_bytes, monkeypatch):
    # torch keeps a gradient until it is zeroed: a second backward that does not reach w2 leaves w2.grad
    # as the first made it, and its reduction (bucketed with w1's) reads that, as op by op it would
    monkeypatch.setattr(dctx, "FLUSH_IDLE", 30.0)  # (one program: the backward, then the reductions)
    monkeypatch.setattr(dctx, "FLUSH_AGE", 30.0)
    env = {} if bucket_bytes is None else {"MESHARRAY_BUCKET_BYTES": bucket_bytes}
    W1, W2 = np.arange(6, dtype="float32").reshape(1, 2, 3), np.full((1, 2, 3), 0.5, "float32")
    with ma.proc_mesh(procs=2, env=env) as p:
        w1 = p.from_numpy(W1, engine="torch").requires_grad_()
        w2 = p.from_numpy(W2, engine="torch").requires_grad_()
        ((w1 * w1).sum(axis=-1) + (w2 * w2).sum(axis=-1)).backward()
        (w1 * 3.0).sum(axis=-1).backward()  # (w2 not reached)
        m1, m2 = (w.grad.mean(axis="procs", keepdims=True) for w in (w1, w2))
        assert np.allclose(_np(m1)[0, 0], (2 * W1 + 3).mean(axis=1)[0])
        assert np.allclose(_np(m2)[0, 0], (2 * W2).mean(axis=1)[0])
        counts = p.spawn("buckets", _Buckets).counts.call().get(timeout=30)[0, 0]
        assert counts["grads"] >= 2  # (both reductions went in buckets)


def test_a_second_backward_through_a_node_counts_only_its_own_gradient(four):
    w = _leaf(four)
    s = (w * w).sum(axis="procs")
    s.sum().backward()
    (s * 3.0).sum().backward()
    assert np.allclose(_np(w.grad), 8 * W)


def test_captured_steps_replay_by_what_was_passed(procs):
    a = procs.full((3,), 1.0, dtype="float32")
    b = procs.full((3,), 10.0, dtype="float32")
    f = ma.function(lambda x, y: x * 2 + y)
    assert np.allclose(_np(f(a, a)), 3.0) and np.allclose(_np(f(a, b)), 12.0)  # the same array twice
    outside = procs.full((3,), 5.0, dtype="float32")
    g = ma.function(lambda s: outside * s)  # no array argument
    assert np.allclose(_np(g(2.0)), 10.0) and np.allclose(_np(g(2.0)), 10.0)
    h = ma.function(lambda x: (x + 1, x.rename(procs="p")))  # a view of an argument
    h(a)
    assert np.allclose(_np(h(b)[1]), 10.0)
    inner = ma.function(lambda x: x + 1)
    outer = ma.function(lambda x: inner(x) * 2)
    with pytest.raises(ma.CaptureError, match="another step"):
        outer(a)
    w = procs.from_numpy(np.ones((1, 2, 3), "float32"), engine="torch").requires_grad_()
    with pytest.raises(ma.CaptureError, match="backward"):
        ma.function(lambda v: (v * v).sum(axis="procs").sum())(w)


def test_a_failed_op_in_a_batch_loses_none_of_the_others(procs):
    x = procs.from_numpy(np.ones((1, 2, 3), "float32"), engine="torch")
    w = procs.from_numpy(np.ones((1, 2, 3), "float32"), engine="torch").requires_grad_()
    y = x + 1.0
    w[:, :, 0] = 5.0  # in place on a leaf that requires grad: torch refuses, on the ranks
    z = x + 2.0
    assert np.allclose(_np(y), 2.0) and np.allclose(_np(z), 3.0)
    with pytest.raises(ma.ActorError, match="leaf Variable|in-place"):
        _np(w)
    import threading

    lock = threading.Lock()
    with pytest.raises(ma.SerializationError):
        procs.apply(lambda b: (lock, b)[1], x)  # raised at once, as before; nothing else is lost
    assert np.allclose(_np(y + z), 5.0)


def test_an_assignment_reaches_every_copy_of_a_held_array(procs):
    w = procs.from_numpy(np.array([1.0, 3.0]).reshape(1, 2, 1))
    m = w.mean(axis="procs", keepdims=True) * 1.0  # held by both ranks
    m[...] = 0.0
    assert _np(w - m).ravel().tolist() == [1.0, 3.0]


def test_any_over_procs_of_an_array_that_requires_grad_is_bool(four):
    w = _leaf(four)
    assert w.any(axis="procs").dtype == np.bool_


def test_a_worker_keeps_no_backward_effects_for_ranks_never_waited_on(procs):
    w = procs.from_numpy(np.ones((1, 2, 3), "float32"), engine="torch").requires_grad_()
    before = data_context(procs)._refs.copy()
    for _ in range(50):
        loss = torch.mean(w * w)
        loss.backward()
        _np(w.grad[0, 0])  # a wait on rank 0 only
    procs.sync()
    assert not hasattr(data_context(procs), "_effects")
    assert len(data_context(procs)._refs) <= len(before) + 4


# --- a recipe's function travels once -------------------------------------------------------


def _pickled_calls(monkeypatch):
    """The BlockCalls pickled from now on (each the function of an op sent in full)."""
    from mesharray.darray.blockfn import BlockCall

    seen: list = []
    orig = BlockCall.__reduce__
    monkeypatch.setattr(BlockCall, "__reduce__", lambda self: (seen.append(self), orig(self))[1])
    return seen


def test_a_loop_of_torch_ops_sends_each_function_once(procs, monkeypatch):
    x, y, ps = _problem()
    xs, ys = procs.from_numpy(x[None], engine="torch"), procs.from_numpy(y[None], engine="torch")
    ws = [_replicated(procs, p) for p in ps]
    for _ in range(2):  # (the first call of each signature plans it; the second makes its recipe)
        ws = _step(xs, ys, *ws)
    _np(ws[0])
    seen = _pickled_calls(monkeypatch)
    for _ in range(3):
        ws = _step(xs, ys, *ws)
    got = [_np(w)[0, 0] for w in ws]
    # the recipes' functions went the first time (defcall), then only by key: what is pickled
    # after that is each step's backward (an effect, sent as it is)
    names = [getattr(c.func, "__name__", "") for c in seen]
    assert names.count("backward") == 3
    assert len(names) - names.count("backward") <= 12, names  # each recipe's function at most once
    assert all(np.allclose(g, w, atol=1e-5) for g, w in zip(got, _reference(5)))


def test_ranks_that_drop_the_recipes_functions_are_given_them_again(procs, monkeypatch):
    from mesharray.darray import dispatch

    monkeypatch.setattr(dispatch, "MAX_CALLS", 3)  # (every few new functions: uncall, then defcall again)
    ctx = data_context(procs)
    x, y, ps = _problem()
    # (a batch of 7, not 8: new signatures, so new recipes, whatever ran on this mesh before)
    xs, ys = procs.from_numpy(x[None, :, :7], engine="torch"), procs.from_numpy(y[None, :, :7], engine="torch")
    ws = [_replicated(procs, p) for p in ps]
    for _ in range(5):  # (recipes from the second step on, each dropped and given again)
        ws = _step(xs, ys, *ws)
    assert len(ctx.calls) <= 3
    got = [_np(w)[0, 0] for w in ws]
    want = [torch.tensor(p, requires_grad=True) for p in ps]
    for _ in range(5):
        grads = [torch.autograd.grad(torch.mean((_mlp(torch.tensor(x[i, :7]), *want) - torch.tensor(y[i, :7])) ** 2),
                                     want) for i in range(2)]
        want = [(w - 0.1 * (g0 + g1) / 2).detach().requires_grad_() for w, g0, g1 in zip(want, *grads)]
    assert all(np.allclose(g, w.detach().numpy(), atol=1e-5) for g, w in zip(got, want))


def test_ops_from_two_threads_find_every_function_they_use_defined(procs):
    a = procs.from_numpy(np.ones((1, 2, 5), "float32"), engine="torch")
    want = torch.ones(5)
    for _ in range(200):
        want = torch.tanh(torch.relu(want)) + 0.5

    def loop(k: int) -> None:
        y = a
        for _ in range(200):  # (both threads make the same recipes: one defines, both use)
            y = torch.tanh(torch.relu(y)) + 0.5
        assert np.allclose(_np(y), want.numpy()), k

    _in_threads(loop)


def test_ops_queued_while_other_threads_flush_are_each_sent_once_in_order(procs):
    # a post takes no lock (the compiled op tail): it must land in the buffer being taken or in the
    # next one, never be lost nor sent twice, while other threads flush (each sync sends the buffer)
    base = [procs.from_numpy(np.full((1, 2, 3), float(k), "float32"), engine="torch") for k in range(4)]

    def loop(k: int) -> None:
        y = base[k]
        for i in range(150):
            y = torch.relu(y) + 1.0  # (two ops a turn; a thread of two syncs now and then)
            if k % 2 and i % 7 == 0:
                procs.sync()
        assert np.allclose(_np(y), k + 150.0), (k, _np(y))

    _in_threads(loop, 4)


def test_a_gradient_changed_before_its_reduction_is_reduced_as_changed(monkeypatch):
    # g = w.grad; g.mul_(0.5) before g's reduction: the buckets leave g to the program (a bucket
    # reduces a gradient as autograd made it); a parameter changed in place before its gradient is
    # read is left to it too; the third parameter's gradient, untouched, still goes in a bucket
    monkeypatch.setattr(dctx, "FLUSH_IDLE", 30.0)  # (one program: the backward, then the reductions)
    monkeypatch.setattr(dctx, "FLUSH_AGE", 30.0)
    xs = np.arange(6, dtype="float32").reshape(2, 3)
    with ma.proc_mesh(procs=2) as p:
        x = p.from_numpy(xs[None], engine="torch")
        w, v, u = (p.from_numpy(np.ones((1, 2, 3), "float32"), engine="torch").requires_grad_() for _ in range(3))
        torch.sum(w * x + v * x * 2.0 + u * x * 4.0).backward()
        g = w.grad
        g.mul_(0.5)
        with torch.no_grad():
            v.mul_(3.0)
        m, n, k = (a.mean(axis="procs", keepdims=True) for a in (g, v.grad, u.grad))
        assert np.allclose(_np(m)[0, 0], 0.5 * xs.mean(axis=0))
        assert np.allclose(_np(n)[0, 0], 2.0 * xs.mean(axis=0))
        assert np.allclose(_np(k)[0, 0], 4.0 * xs.mean(axis=0))
        assert np.allclose(_np(v)[0], 3.0)
        counts = p.spawn("buckets", _Buckets).counts.call().get(timeout=30)[0, 0]
        assert counts["backwards"] == 1 and counts["grads"] == 1  # (u's alone)


# --- a collective's plan travels once ---------------------------------------------------------


def _keyed(monkeypatch):
    """Every instruction list the context keys from now on (see DataContext._keyed_plans)."""
    seen: list = []
    orig = dctx.DataContext._keyed_plans
    monkeypatch.setattr(dctx.DataContext, "_keyed_plans", lambda self, wire: seen.append(orig(self, wire)) or seen[-1])
    return seen


def test_a_reduction_in_a_loop_sends_its_plan_once(procs, monkeypatch):
    x = procs.from_numpy(np.arange(8, dtype="float64").reshape(1, 2, 4))
    seen = _keyed(monkeypatch)
    for _ in range(5):
        assert float(x.sum().fetch()) == 28.0  # (a tiny result: its program is a call)
        assert np.allclose(_np(x.sum(axis="procs", keepdims=True))[0, 0], [4, 6, 8, 10])  # (queued)
    codes = [ins[0] for wire in seen for ins in wire]
    assert codes.count("plan") == 0 and codes.count("kplan") == 10
    assert codes.count("defplan") <= 2  # (each of the two plans once, unless an earlier test gave it)


def test_plans_past_the_bound_go_by_their_bytes(procs, monkeypatch):
    ctx = data_context(procs)
    monkeypatch.setattr(dctx, "MAX_PLANS", len(ctx._plan_keys))  # (the plans given so far keep their keys)
    x = procs.from_numpy(np.arange(6, dtype="int16").reshape(1, 2, 3))
    seen = _keyed(monkeypatch)
    assert [int(x.min().fetch()) for _ in range(3)] == [0] * 3  # (a plan of its own: int16 min)
    codes = [ins[0] for wire in seen for ins in wire]
    assert codes.count("plan") == 3 and "defplan" not in codes


def test_reductions_from_two_threads_find_their_plans_defined(procs):
    x = procs.from_numpy(np.full((1, 2, 5), 1.0, dtype="float32"))

    def loop(k: int) -> None:
        for _ in range(40):  # (a plan of this test's own, float32 prod: one thread gives it, both use its key)
            assert float((x * float(k + 1)).prod().fetch()) == float(k + 1) ** 10

    _in_threads(loop)
