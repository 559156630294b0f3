"""Property tests: distributed arrays over random views of a mesh equal NumPy on the gathered values.

Views are random selections of the mesh's dims (steps, reversals, single
positions, transposes), so operands are uneven slices of the mesh, broadcast
along dims, or live on different ranks; every reduction over every kind of
axis, elementwise ops between two views (the blocks move where needed), and
moves to another view are checked against NumPy in this process.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mesharray as ma
from tests.support.procs import mesh_fixture

pytestmark = pytest.mark.timeout(300)

PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
                 derandomize=True)


procs = mesh_fixture(hosts=2, procs=3)


def _np(x):
    return np.asarray(x.fetch())


@st.composite
def views(draw, names=("hosts", "procs"), sizes=(2, 3)):
    """A key over the mesh dims: a slice (any step, maybe reversed) per dim, at least one position each."""
    key = []
    for n in sizes:
        start = draw(st.integers(0, n - 1))
        step = draw(st.sampled_from([1, 2, -1]))
        stop = draw(st.integers(start + 1, n)) if step > 0 else None
        key.append(slice(start, stop, step))
    return tuple(key)


def _make(procs, local, dtype, seed):
    x = procs.arange(local or (), dtype="float64") if local else procs.rank_array(dtype="float64")
    x = (x * 0.37 + procs.rank_array(dtype="float64") * 1.3 + seed) % 5 - 2  # mixed signs, some ties
    return x.astype(dtype)


LOCALS = st.sampled_from([(), (3,), (2, 2)])
DTYPES = st.sampled_from(["float64", "float32", "int64"])
REDUCTIONS = ["sum", "prod", "mean", "min", "max", "any", "all", "std", "var", "argmin", "argmax"]


@PROPS
@given(key=views(), local=LOCALS, dtype=DTYPES, op=st.sampled_from(REDUCTIONS), data=st.data())
def test_reductions_equal_numpy(procs, key, local, dtype, op, data):
    x = _make(procs, local, dtype, 1)[key]
    ref = np.asarray(x.fetch())
    nd = ref.ndim
    if op in ("argmin", "argmax"):
        axis = data.draw(st.sampled_from([None, "hosts", "procs"] + list(range(2, nd))))
    else:
        axis = data.draw(st.sampled_from([None, "hosts", "procs", ("hosts", "procs"), ("procs",) + tuple(range(2, nd))]
                                         + list(range(2, nd))))
    idx = {"hosts": 0, "procs": 1}
    np_axis = tuple(idx.get(a, a) for a in axis) if isinstance(axis, tuple) else idx.get(axis, axis)
    keepdims = data.draw(st.booleans())
    got = getattr(x, op)(axis=axis, keepdims=keepdims)
    want = getattr(ref, op)(axis=np_axis, keepdims=keepdims)
    got = np.asarray(got.fetch() if isinstance(got, ma.MeshArray) else got)
    assert got.shape == np.shape(want)
    np.testing.assert_allclose(got, want, rtol=1e-4 if dtype == "float32" else 1e-9, atol=1e-5)


@PROPS
@given(k1=views(), k2=views(), local=LOCALS, op=st.sampled_from(["add", "multiply", "maximum", "subtract"]),
       data=st.data())
def test_elementwise_between_views_equal_numpy(procs, k1, k2, local, op, data):
    a = _make(procs, local, "float64", 2)
    b = _make(procs, local, "float64", 3)
    x, y = a[k1], b[k2]
    # make y broadcastable against x: size-1 where the sizes differ (its blocks fan out)
    ky = tuple(slice(0, 1) if sy != sx else slice(None) for sx, sy in zip(x.shape[:2], y.shape[:2]))
    y = y[ky]
    if data.draw(st.booleans()):
        y = y.transpose("procs", "hosts")  # names line up whatever the order
    got = getattr(np, op)(x, y)
    want = getattr(np, op)(np.asarray(x.fetch()), np.asarray(y.transpose("hosts", "procs").fetch()))
    np.testing.assert_allclose(_np(got), want)


@PROPS
@given(k1=views(), k2=views(), local=LOCALS, dtype=DTYPES)
def test_moves_between_views_equal_numpy(procs, k1, k2, local, dtype):
    x = _make(procs, local, dtype, 4)[k1]
    target = procs[k2]
    ref = np.asarray(x.fetch())
    sizes = tuple(target.sizes.values())
    if any(s not in (1, t) for s, t in zip(ref.shape[:2], sizes)):
        with pytest.raises(ma.MeshShapeError, match="only size 1 broadcasts"):
            x.to_mesh(target)
        return
    got = x.to_mesh(target)
    assert got.mesh_shape == target.mesh_shape
    np.testing.assert_array_equal(_np(got), np.broadcast_to(ref, sizes + ref.shape[2:]))
