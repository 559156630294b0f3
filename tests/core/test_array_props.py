"""Property tests of MeshArray against NumPy on the underlying values.

- arithmetic: ufuncs between MeshArrays whose mesh dims are reordered, missing
  or size 1, with local shapes that broadcast; the oracle loops over the
  result's mesh coordinates and applies NumPy to the two elements.
- reductions: every reduction x every axis form (int, negative int, name,
  tuple of either, None) x keepdims, against NumPy with the same int axes.
- indexing: generated keys of every kind against ``values[key]``, and the
  result's mesh Shape holds exactly the ranks whose values it holds.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mesharray as ma
from mesharray.array import MeshArray

SETTINGS = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NAMES = ("a", "b", "c", "d")


# -- arithmetic ----------------------------------------------------------------------------


@st.composite
def mesh_pair(draw):
    """Two MeshArrays whose mesh dims broadcast by name and local shapes broadcast by position."""
    k = draw(st.integers(1, 3))
    names = draw(st.permutations(NAMES).map(lambda p: p[:k]))
    sizes = {n: draw(st.integers(1, 3)) for n in names}
    local = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))

    def operand():
        mine = draw(st.lists(st.sampled_from(names), unique=True, max_size=k))
        mine = draw(st.permutations(mine)) if mine else []
        msizes = [draw(st.sampled_from([sizes[n], 1])) for n in mine]
        nloc = draw(st.integers(0, len(local)))
        lshape = tuple(draw(st.sampled_from([s, 1])) for s in local[len(local) - nloc:])
        values = draw(st.integers(-5, 5).flatmap(
            lambda seed: st.just(np.random.default_rng(seed + 5).integers(-9, 10, size=tuple(msizes) + lshape))))
        return MeshArray(values, list(mine))

    return operand(), operand()


def element(a: MeshArray, coords: dict[str, int]) -> np.ndarray:
    key = tuple(coords[n] if a.mesh_sizes[n] > 1 else 0 for n in a.names)
    return np.asarray(a.to_numpy()[key])


def check_binary(op, a: MeshArray, b: MeshArray) -> None:
    r = op(a, b)
    if not isinstance(r, MeshArray):  # no axis left: a scalar, as NumPy gives
        assert a.ndim == 0 or b.ndim == 0 or (not a.names and not b.names)
        assert r == op(a.to_numpy(), b.to_numpy())
        return
    expected_names = list(a.names) + [n for n in b.names if n not in a.names]
    assert list(r.names) == expected_names
    sizes = {n: max(x.mesh_sizes.get(n, 1) for x in (a, b)) for n in expected_names}
    assert r.mesh_sizes == sizes
    assert r.local_shape == np.broadcast_shapes(a.local_shape, b.local_shape)
    values = r.to_numpy()
    for pos in itertools.product(*(range(s) for s in sizes.values())):
        coords = dict(zip(expected_names, pos))
        want = op(element(a, coords), element(b, coords))
        np.testing.assert_array_equal(values[pos], want)


BINARY = [
    lambda x, y: x + y,
    lambda x, y: x - y,
    lambda x, y: x * y,
    lambda x, y: x < y,
    lambda x, y: x == y,
    np.maximum,
    lambda x, y: np.add(x, y, dtype="float32"),
]


@SETTINGS
@given(pair=mesh_pair(), op=st.sampled_from(BINARY))
def test_binary_ufuncs_align_by_name(pair, op):
    check_binary(op, *pair)


@SETTINGS
@given(pair=mesh_pair())
def test_binary_is_symmetric_up_to_names(pair):
    a, b = pair
    ab, ba = a + b, b * 1 + a
    if isinstance(ab, MeshArray):
        np.testing.assert_array_equal(ab.to_numpy(), ba.transpose(*ab.names).to_numpy())


@SETTINGS
@given(pair=mesh_pair(), scalar=st.integers(-3, 3) | st.floats(-2, 2, allow_nan=False))
def test_scalar_and_unary_ops_are_numpy_on_values(pair, scalar):
    a, _ = pair
    v = a.to_numpy()
    for got, want in [
        (a + scalar, v + scalar),
        (scalar * a, scalar * v),
        (-a, -v),
        (abs(a), abs(v)),
        (np.exp(a), np.exp(v)),
        (a >= scalar, v >= scalar),
    ]:
        got_v = np.asarray(got)
        assert got_v.dtype == want.dtype
        np.testing.assert_array_equal(got_v, want)
        if isinstance(got, MeshArray):
            assert got.names == a.names and got.mesh_shape == a.mesh_shape


@SETTINGS
@given(pair=mesh_pair(), data=st.data())
def test_plain_array_operand_broadcasts_numpy_style(pair, data):
    a, _ = pair
    shape = a.shape
    n = data.draw(st.integers(0, len(shape)))
    xshape = tuple(data.draw(st.sampled_from([s, 1])) for s in shape[len(shape) - n:])
    x = np.arange(int(np.prod(xshape)), dtype=np.int64).reshape(xshape)
    got = a + x
    want = a.to_numpy() + x
    np.testing.assert_array_equal(np.asarray(got), want)
    got2 = x - a
    np.testing.assert_array_equal(np.asarray(got2), x - a.to_numpy())


@SETTINGS
@given(pair=mesh_pair())
def test_inplace_matches_out_of_place(pair):
    a, b = pair
    r = a + b
    if not isinstance(r, MeshArray) or r.names != a.names or r.shape != a.shape:
        return
    c = a.copy()
    c += b
    np.testing.assert_array_equal(c.to_numpy(), r.to_numpy())


# -- reductions ----------------------------------------------------------------------------

REDUCTIONS = ["sum", "mean", "min", "max", "prod", "any", "all", "std", "var", "argmin", "argmax"]


@st.composite
def array_and_axis(draw):
    k = draw(st.integers(0, 3))
    names = list(NAMES[:k])
    sizes = [draw(st.integers(1, 3)) for _ in names]
    local = draw(st.lists(st.integers(1, 3), max_size=2))
    shape = tuple(sizes) + tuple(local)
    rng = np.random.default_rng(draw(st.integers(0, 1000)))
    values = rng.integers(-4, 5, size=shape).astype(draw(st.sampled_from(["int64", "float64"])))
    a = MeshArray(values, names)
    ndim = len(shape)
    form = draw(st.sampled_from(["none", "int", "neg", "name", "tuple"]))
    if form == "none" or ndim == 0:
        return a, None, None
    if form == "int":
        i = draw(st.integers(0, ndim - 1))
        return a, i, i
    if form == "neg":
        i = draw(st.integers(-ndim, -1))
        return a, i, i
    if form == "name" and names:
        i = draw(st.integers(0, k - 1))
        return a, names[i], i
    axes = draw(st.lists(st.integers(0, ndim - 1), unique=True, max_size=ndim))
    spelled = tuple(
        names[i] if i < k and draw(st.booleans()) else (i - ndim if draw(st.booleans()) else i) for i in axes
    )
    return a, spelled, tuple(axes)


@SETTINGS
@given(case=array_and_axis(), op=st.sampled_from(REDUCTIONS), keepdims=st.booleans())
def test_reductions_match_numpy(case, op, keepdims):
    a, axis, np_axis = case
    if op in ("argmin", "argmax") and isinstance(np_axis, tuple):
        with pytest.raises(TypeError, match="one axis"):
            getattr(a, op)(axis=axis, keepdims=keepdims)
        return
    want = getattr(np, op)(a.to_numpy(), axis=np_axis, keepdims=keepdims)
    got = getattr(a, op)(axis=axis, keepdims=keepdims)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12)
    assert np.asarray(got).dtype == np.asarray(want).dtype
    # through NumPy's own functions too
    np.testing.assert_allclose(np.asarray(getattr(np, op)(a, axis=axis, keepdims=keepdims)), want, rtol=1e-12)
    # names: reduced mesh dims go away unless keepdims
    if np_axis is None:
        reduced = set(range(a.ndim))
    else:
        reduced = {i % a.ndim for i in (np_axis if isinstance(np_axis, tuple) else (np_axis,))}
    kept = [n for i, n in enumerate(a.names) if keepdims or i not in reduced]
    if isinstance(got, MeshArray):
        assert list(got.names) == kept
        # the result's ranks are the first rank of each reduced group
        key = tuple((slice(0, 1) if keepdims else 0) if i in reduced else slice(None) for i in range(a.mesh_ndim))
        assert got.mesh_shape == a.mesh_shape[key]
    else:
        assert not kept and (a.local_ndim == 0 or reduced >= set(range(a.mesh_ndim, a.ndim)))


# -- indexing ------------------------------------------------------------------------------


@st.composite
def index_for(draw, shape: tuple[int, ...], allow_advanced: bool):
    """One NumPy index entry per axis (some left out, maybe an ellipsis or None)."""
    items: list = []
    for size in shape:
        kinds = ["int", "slice", "full"] + (["array", "mask"] if allow_advanced else [])
        kind = draw(st.sampled_from(kinds))
        if kind == "int":
            items.append(draw(st.integers(-size, size - 1)))
        elif kind == "slice":
            start = draw(st.none() | st.integers(-size - 1, size + 1))
            stop = draw(st.none() | st.integers(-size - 1, size + 1))
            step = draw(st.none() | st.sampled_from([1, 2, -1, -2, 3]))
            items.append(slice(start, stop, step))
        elif kind == "full":
            items.append(slice(None))
        elif kind == "array":
            items.append(draw(st.lists(st.integers(-size, size - 1), min_size=1, max_size=3)))
        else:
            items.append(np.array(draw(st.lists(st.booleans(), min_size=size, max_size=size))))
        if draw(st.integers(0, 9)) == 0:
            items.append(None)
    return items


@st.composite
def indexed_array(draw):
    k = draw(st.integers(1, 3))
    names = list(NAMES[:k])
    sizes = [draw(st.integers(1, 4)) for _ in names]
    local = draw(st.lists(st.integers(1, 3), max_size=2))
    shape_ = ma.Shape(dict(zip(names, sizes)))
    # views of views: start from a strided view of a bigger mesh
    if draw(st.booleans()):
        big = ma.Shape(dict(zip(names, [2 * s for s in sizes])))
        shape_ = big[tuple(slice(None, None, 2) for _ in names)]
    # each element holds its own global rank (times 1000) plus a local counter
    ranks = shape_.ranks().reshape(sizes)
    lsize = int(np.prod(local))
    values = ranks.reshape(tuple(sizes) + (1,) * len(local)) * 1000 + np.arange(lsize).reshape(local)
    a = MeshArray(values, mesh_shape=shape_)
    where = draw(st.sampled_from(["mesh", "local", "none"]))
    mesh_items = draw(index_for(tuple(sizes), allow_advanced=where == "mesh"))
    local_items = draw(index_for(tuple(local), allow_advanced=where == "local"))
    # MeshArray indexes the mesh part, then each element: NumPy's rule that gathers ints
    # and arrays separated by slices in front applies within each part. Keep keys
    # where that equals NumPy on the whole array (across-part cases: test_array.py).
    if where == "mesh":
        local_items = [slice(None) if isinstance(x, int) else x for x in local_items]
    if where == "local":
        mesh_items = [slice(None) if isinstance(x, int) else x for x in mesh_items]
        local_items = [slice(None) if isinstance(x, int) else x for x in local_items]
        seen = False
        for i, it in enumerate(local_items):
            if isinstance(it, (list, np.ndarray)):
                if seen:
                    local_items[i] = slice(None)
                seen = True
    key = mesh_items + local_items
    cut = draw(st.integers(0, len(key)))
    if draw(st.booleans()) and all(not isinstance(x, (list, np.ndarray)) for x in key[cut:]):
        key = key[:cut] + [Ellipsis]  # an ellipsis standing for the trailing basic entries
    elif draw(st.booleans()):
        key = key[:cut] if all(isinstance(x, slice) and x == slice(None) for x in key[cut:]) else key
    return a, tuple(key), len(local)


@SETTINGS
@given(case=indexed_array())
def test_indexing_matches_numpy_and_shape(case):
    a, key, _ = case
    v = a.to_numpy()
    try:
        want = v[key]
    except IndexError as e:
        with pytest.raises(IndexError):
            a[key]
        del e
        return
    got = a[key]
    if not isinstance(got, MeshArray):
        assert np.ndim(want) == 0 and got == want
        return
    np.testing.assert_array_equal(got.to_numpy(), want)
    # the mesh Shape and the values agree: every element holds its own rank
    if got.size:
        markers = got.to_numpy().reshape(got.mesh_shape.sizes + (-1,)) // 1000
        np.testing.assert_array_equal(markers.min(axis=-1).ravel(), got.mesh_shape.ranks())
        np.testing.assert_array_equal(markers.max(axis=-1).ravel(), got.mesh_shape.ranks())
    assert got.names == got.mesh_shape.names
    assert len(set(got.names)) == len(got.names)


@SETTINGS
@given(case=indexed_array())
def test_named_indexing_matches_positional(case):
    a, key, _ = case
    k = a.mesh_ndim
    mesh_key = [x for x in key if x is not None and x is not Ellipsis][:k]
    if len(mesh_key) < k or any(isinstance(x, (list, np.ndarray)) for x in mesh_key):
        return
    named = dict(zip(a.names, mesh_key))
    try:
        want = a[tuple(mesh_key)]
    except IndexError:
        with pytest.raises(IndexError):
            a.slice(**named)
        return
    got = a.slice(**named)
    got2 = a[named]
    for g in (got, got2):
        if isinstance(want, MeshArray):
            assert g.mesh_shape == want.mesh_shape
            np.testing.assert_array_equal(g.to_numpy(), want.to_numpy())
        else:
            assert g == want
