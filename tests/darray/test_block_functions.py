"""torch functions, Tensor methods, autograd and NumPy functions on each rank's block, compared
with torch and NumPy in one process."""

from __future__ import annotations

import numpy as np
import pytest

import mesharray as ma
from tests.support.procs import mesh_fixture

torch = pytest.importorskip("torch")
F = torch.nn.functional

pytestmark = pytest.mark.timeout(120)


procs = mesh_fixture(hosts=2, procs=2)


def _np(x):
    return np.asarray(x.fetch())


def _per_block(fn, *arrays):
    """``fn`` of plain torch tensors, position by position: the one-process reference."""
    vals = [np.asarray(a) for a in arrays]
    lead = vals[0].shape[:2]
    out = [fn(*[torch.from_numpy(np.array(v[pos])) for v in vals]) for pos in np.ndindex(*lead)]
    if isinstance(out[0], tuple):
        return tuple(np.stack([o[i].detach().numpy() for o in out]).reshape(lead + tuple(out[0][i].shape))
                     for i in range(len(out[0])))
    return np.stack([o.detach().numpy() for o in out]).reshape(lead + tuple(out[0].shape))


def _dist(procs, shape, seed, dtype="float32"):
    rng = np.random.default_rng(seed)
    return procs.from_numpy(rng.standard_normal((2, 2) + shape).astype(dtype), engine="torch")


@pytest.mark.parametrize("name,fn", [
    ("relu", lambda x: torch.relu(x)),
    ("tanh", lambda x: torch.tanh(x)),
    ("softmax", lambda x: F.softmax(x, dim=-1)),
    ("gelu", lambda x: F.gelu(x)),
    ("layer_norm", lambda x: F.layer_norm(x, (4,))),
    ("transpose", lambda x: x.t()),
    ("sum_dim", lambda x: torch.sum(x, dim=-1)),
    ("cumsum", lambda x: torch.cumsum(x, dim=0)),
    ("cat", lambda x: torch.cat([x, x * 2], dim=-1)),
    ("stack", lambda x: torch.stack([x, x], dim=0)),
])
def test_unary_torch_functions_run_on_each_block(procs, name, fn):
    x = _dist(procs, (3, 4), 1)
    ref = _per_block(fn, x.fetch())
    got = fn(x)
    assert isinstance(got, ma.MeshArray) and type(got._storage).__name__ == "DistributedStorage"
    assert got.shape == ref.shape and got.dtype == ref.dtype  # known before anything ran
    np.testing.assert_allclose(_np(got), ref, rtol=1e-5, atol=1e-6)


def test_binary_functions_broadcast_mesh_dims(procs):
    x, w, b = _dist(procs, (3, 4), 2), _dist(procs, (4, 5), 3), _dist(procs, (5,), 4)
    np.testing.assert_allclose(_np(torch.matmul(x, w)), _per_block(torch.matmul, x.fetch(), w.fetch()), rtol=1e-5)
    lin = F.linear(x, torch.ones(2, 4))  # a plain tensor argument travels with the program
    np.testing.assert_allclose(_np(lin), _per_block(lambda t: F.linear(t, torch.ones(2, 4)), x.fetch()), rtol=1e-5)
    # one row of weights for every host: a size-1 mesh dim broadcasts (its blocks fan out)
    w0 = w[0:1]
    ref = _per_block(torch.matmul, x.fetch(), np.broadcast_to(np.asarray(w0.fetch()), (2, 2, 4, 5)))
    np.testing.assert_allclose(_np(torch.matmul(x, w0)), ref, rtol=1e-5)
    # operands on other ranks (a transposed layout) move first
    wt = w.transpose("procs", "hosts").rename(procs="hosts", hosts="procs")
    ref = _per_block(torch.matmul, x.fetch(), np.asarray(w.fetch()).transpose(1, 0, 2, 3))
    np.testing.assert_allclose(_np(torch.matmul(x, wt)), ref, rtol=1e-5)
    # gathered MeshArray operands: each rank gets its value
    g = ma.MeshArray(np.arange(4.0, dtype="float32").reshape(2, 2, 1), ["hosts", "procs"])
    np.testing.assert_allclose(_np(torch.add(b, g)), np.asarray(b.fetch()) + np.asarray(g))
    np.testing.assert_allclose(_np(torch.where(x > 0, x, torch.zeros(()))), np.maximum(_np(x), 0))


def test_several_outputs_and_shape_queries(procs):
    x = _dist(procs, (3, 4), 5)
    values, indices = torch.max(x, dim=-1)
    ref_v, ref_i = _per_block(lambda t: tuple(torch.max(t, dim=-1)), x.fetch())
    np.testing.assert_allclose(_np(values), ref_v)
    np.testing.assert_array_equal(_np(indices), ref_i)
    assert indices.dtype == np.int64
    assert x.dim() == 2 and x.numel() == 12  # each block's, known from shapes


def test_in_place_methods_change_the_blocks_where_they_live(procs):
    x = _dist(procs, (3,), 6)
    before = _np(x)
    assert x.add_(1.0) is x
    np.testing.assert_allclose(_np(x), before + 1)
    x.mul_(torch.tensor(2.0))
    np.testing.assert_allclose(_np(x), (before + 1) * 2)


def test_autograd_runs_in_the_workers(procs):
    x, w0 = _dist(procs, (6, 4), 7), _dist(procs, (4, 3), 8)
    w = w0.detach().requires_grad_()
    assert _np(w.requires_grad).all() and not _np(w0.requires_grad).any()
    loss = torch.mean(torch.tanh(torch.matmul(x, w)) ** 2)
    assert loss.shape == (2, 2)
    assert loss.backward() is None  # runs on every rank, waits, raises any rank's error
    grad = w.grad
    assert isinstance(grad, ma.MeshArray) and grad.shape == w.shape

    def ref(xt, wt):
        wt = wt.clone().requires_grad_()
        torch.mean(torch.tanh(xt @ wt) ** 2).backward()
        return wt.grad

    np.testing.assert_allclose(_np(grad), _per_block(ref, x.fetch(), w0.fetch()), rtol=1e-5, atol=1e-7)
    # gradients reduced across ranks (a collective), an update, and a new leaf
    w2 = (w - 0.1 * grad.mean(axis="procs", keepdims=True)).detach().requires_grad_()
    assert _np(w2.is_leaf).all()
    # no backward reached this one: its .grad raises where it is used
    with pytest.raises(ma.ActorError, match=r"\.grad is None"):
        w2.grad.fetch()


def test_failures_raise_at_the_controller_and_lose_nothing(procs):
    x = _dist(procs, (3, 4), 9)
    with pytest.raises(ma.ActorError, match="shapes cannot be multiplied|size mismatch|must match"):
        torch.matmul(x, x)
    np.testing.assert_allclose(_np(torch.relu(x)), np.maximum(_np(x), 0))


def test_gathered_arrays_run_per_position():
    a = ma.MeshArray(np.arange(12.0).reshape(2, 2, 3) - 5, ["hosts", "procs"])
    r = torch.relu(a)
    assert isinstance(r, ma.MeshArray) and r.names == ("hosts", "procs")
    np.testing.assert_array_equal(np.asarray(r), np.maximum(np.asarray(a), 0))


@pytest.mark.parametrize("name,fn", [
    ("concatenate", lambda a, b: np.concatenate([a, b], axis=-1)),
    ("concatenate_ax", lambda a, b: np.concatenate([a, b], axis=2)),
    ("stack", lambda a, b: np.stack([a, b], axis=-1)),
    ("where", lambda a, b: np.where(a > 0, a, b)),
    ("clip", lambda a, b: np.clip(a, -0.5, 0.5)),
    ("matmul", lambda a, b: np.matmul(a, np.swapaxes(b, -1, -2)) if isinstance(a, np.ndarray) else np.matmul(a, b.T)),
    ("round", lambda a, b: np.round(a, 2)),
])
def test_numpy_functions_run_on_each_block(procs, name, fn):
    rng = np.random.default_rng(10)
    av, bv = rng.standard_normal((2, 2, 3, 4)), rng.standard_normal((2, 2, 3, 4))
    a, b = procs.from_numpy(av), procs.from_numpy(bv)
    if name == "matmul":
        bt = procs.from_numpy(np.swapaxes(bv, -1, -2).copy())
        got, ref = np.matmul(a, bt), av @ np.swapaxes(bv, -1, -2)
    else:
        got, ref = fn(a, b), fn(av, bv)
    assert type(got._storage).__name__ == "DistributedStorage"  # computed where the blocks live
    assert got.shape == ref.shape
    np.testing.assert_allclose(_np(got), ref)


def test_einsum_and_dot_on_blocks_and_mesh_axes_gathered(procs):
    rng = np.random.default_rng(11)
    av, bv = rng.standard_normal((2, 2, 3, 4)), rng.standard_normal((2, 2, 4))
    a, b = procs.from_numpy(av), procs.from_numpy(bv)
    got = np.einsum("ij,j->i", a, b)  # subscripts over each block's axes
    assert type(got._storage).__name__ == "DistributedStorage"
    np.testing.assert_allclose(_np(got), np.einsum("hpij,hpj->hpi", av, bv))
    np.testing.assert_allclose(_np(np.dot(a, b)), np.einsum("hpij,hpj->hpi", av, bv))
    # along a mesh axis: NumPy's meaning on the whole array (gathered)
    np.testing.assert_allclose(np.asarray(np.concatenate([a, a], axis=0)), np.concatenate([av, av], axis=0))


@pytest.mark.parametrize("op", ["prod", "any", "all"])
def test_prod_any_all_over_mesh_axes_are_collectives(procs, op):
    x = procs.from_numpy(np.array([[[1.0, 0.0], [2.0, 1.0]], [[3.0, 1.0], [0.5, 0.0]]]))
    r = getattr(x, op)(axis="procs")
    assert type(r._storage).__name__ == "DistributedStorage"
    np.testing.assert_array_equal(_np(r), getattr(np.asarray(x.fetch()), op)(axis=1))


def test_no_grad_reaches_the_workers_and_in_place_failures_are_kept(procs):
    w = _dist(procs, (3,), 12).detach().requires_grad_()
    before = _np(w)
    with torch.no_grad():  # the optimizer's update, as in torch
        w.sub_(0.5)
    np.testing.assert_allclose(_np(w), before - 0.5)
    assert _np(w.requires_grad).all() and _np(w.is_leaf).all()
    # outside no_grad, torch refuses an in-place op on such a leaf: the error is kept as w's
    w.sub_(0.5)
    with pytest.raises(ma.ActorError, match="leaf Variable that requires grad"):
        w.fetch()


def test_plain_tensors_on_either_side(procs):
    x = _dist(procs, (3,), 13)
    b = torch.arange(3, dtype=torch.float32)
    np.testing.assert_allclose(_np(x + b), _np(x) + b.numpy())
    np.testing.assert_allclose(_np(b + x), _np(x) + b.numpy())
    np.testing.assert_allclose(_np(x * torch.tensor(2.0)), _np(x) * 2)


def test_to_mesh_needs_a_proc_mesh(procs):
    x = _dist(procs, (3,), 14)
    with pytest.raises(TypeError, match="to_mesh needs a ProcMesh"):
        x.to_mesh(None)
