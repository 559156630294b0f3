"""Property tests: ``Shape`` indexing is NumPy indexing, with NumPy as the oracle.

For generated shapes (up to 5 dims, sizes 1-6) and generated indices of every
kind (ints, negative ints, slices with any step, ``...``, ``None``, integer
arrays of any dims, boolean masks incl. 0-d, and their mixes, valid or not):
``Shape(...)[idx].ranks()`` equals ``np.arange(n).reshape(sizes)[idx].ravel()``,
the result's sizes equal NumPy's result shape, and when NumPy raises, Shape
raises an exception of the same built-in type.
"""

from __future__ import annotations

import pickle

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mesharray import Shape, reduction_plan

# Deterministic and side-effect free (no .hypothesis directory), fast enough for CI.
PROPS = settings(
    derandomize=True, database=None, deadline=None, max_examples=400,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SMALL = settings(PROPS, max_examples=200)

NAMES = ("hosts", "procs", "gpus", "x", "y")

sizes_st = st.lists(st.integers(1, 6), min_size=0, max_size=5).map(tuple)


def make(sizes):
    return Shape(dict(zip(NAMES, sizes)))


def oracle(sizes):
    return np.arange(int(np.prod(sizes, dtype=np.int64))).reshape(sizes)


@st.composite
def item_for(draw, n, valid=True):
    """One index item for a dim of size ``n`` (``n`` None: no dim left)."""
    m = n or 1
    lo, hi = (-m, m - 1) if valid else (-m - 2, m + 1)
    kinds = ["int", "slice", "slice", "none", "ellipsis", "array", "mask", "bool0"]
    if not valid:
        kinds += ["junk"]
    kind = draw(st.sampled_from(kinds))
    if kind == "int":
        return draw(st.integers(lo, hi))
    if kind == "slice":
        bound = st.none() | st.integers(-m - 2, m + 2)
        step = st.none() | st.integers(-4, 4).filter(bool)
        return slice(draw(bound), draw(bound), draw(step))
    if kind == "none":
        return None
    if kind == "ellipsis":
        return Ellipsis
    if kind == "array":
        shape = draw(st.lists(st.integers(0, 3), min_size=1, max_size=2).map(tuple))
        arr = np.array(draw(st.lists(st.integers(lo, hi), min_size=int(np.prod(shape)),
                                     max_size=int(np.prod(shape)))), dtype=np.int64).reshape(shape)
        return arr.tolist() if draw(st.booleans()) else arr
    if kind == "mask":
        k = draw(st.integers(0 if valid else 1, m + (0 if valid else 1)))
        return np.array(draw(st.lists(st.booleans(), min_size=k, max_size=k)), dtype=bool) if k else np.zeros(m, bool)
    if kind == "bool0":
        return draw(st.sampled_from([True, False, np.True_, np.bool_(False)]))
    return draw(st.sampled_from([1.5, "a", [0.5], np.float64(1.0)]))


@st.composite
def index_for(draw, sizes, valid=True):
    """An index for ``sizes``: a tuple (or a bare item) that mostly fits the dims."""
    n_items = draw(st.integers(0, len(sizes) + (1 if valid else 2)))
    items = []
    d = 0
    has_ellipsis = False
    for _ in range(n_items):
        item = draw(item_for(sizes[d] if d < len(sizes) else None, valid))
        if item is Ellipsis:
            if has_ellipsis and valid:
                continue
            has_ellipsis = True
        elif isinstance(item, np.ndarray) and item.dtype == bool and item.ndim == 1 and valid:
            # a mask must match the dims it consumes; widen it to several dims sometimes
            if d >= len(sizes):
                continue
            k = draw(st.integers(1, max(1, min(2, len(sizes) - d))))
            shape = sizes[d:d + k]
            item = np.array(draw(st.lists(st.booleans(), min_size=int(np.prod(shape)),
                                          max_size=int(np.prod(shape)))), bool).reshape(shape)
            d += k
            items.append(item)
            continue
        if not (item is None or item is Ellipsis or isinstance(item, (bool, np.bool_))):
            if valid and d >= len(sizes):
                continue
            d += 1
        items.append(item)
    if len(items) == 1 and draw(st.booleans()):
        return items[0]
    return tuple(items)


def _kind(item):
    if item is None:
        return "none"
    if item is Ellipsis:
        return "ell"
    if isinstance(item, slice):
        return "slice"
    if isinstance(item, (bool, np.bool_)):
        return "bool0"
    a = np.asarray(item)
    if a.dtype == bool:
        return "bool0" if a.ndim == 0 else "mask"
    return "int" if a.ndim == 0 else "array"


def expected_names(names, idx, ndim_out):
    """A small independent oracle of the documented naming and placement rules.

    Returns one entry per result dim: an input name (must match exactly), or
    ("made", prefix) for a dim whose name is made (must start with prefix).
    """
    items = list(idx) if isinstance(idx, tuple) else [idx]
    kinds = [_kind(i) for i in items]
    fancy = {"array", "mask", "bool0"}
    any_fancy = any(k in fancy for k in kinds)
    consumed = sum(1 if k in ("int", "slice", "array") else np.ndim(i) if k == "mask" else 0
                   for i, k in zip(items, kinds))
    basic, src, first_adv, adv_pos = [], [], None, []
    d = 0
    for pos, (item, k) in enumerate(zip(items, kinds)):
        if k in fancy or (k == "int" and any_fancy):
            adv_pos.append(pos)
            if first_adv is None:
                first_adv = len(basic)
        if k == "slice":
            basic.append(names[d]); d += 1
        elif k == "none":
            basic.append(("made", "_"))
        elif k == "ell":
            for _ in range(len(names) - consumed):
                basic.append(names[d]); d += 1
        elif k == "int":
            d += 1
        elif k == "array":
            src.append(names[d]); d += 1
        elif k == "mask":
            src.extend(names[d:d + np.ndim(item)]); d += np.ndim(item)
    basic += list(names[d:])
    if not any_fancy:
        return basic
    contiguous = adv_pos == list(range(adv_pos[0], adv_pos[-1] + 1))
    at = first_adv if contiguous else 0
    nb = ndim_out - len(basic)
    prefix = "_".join(src) if src else "_"
    return basic[:at] + [("made", prefix)] * nb + basic[at:]


def check_names(sizes, idx, got):
    for want, have in zip(expected_names(NAMES[:len(sizes)], idx, got.ndim), got.names, strict=True):
        if isinstance(want, tuple):
            assert have.startswith(want[1]), (idx, got.names)
        else:
            assert have == want, (idx, got.names)


def check_same(sizes, idx, shape=None, ref=None):
    shape = make(sizes) if shape is None else shape
    ref = oracle(sizes) if ref is None else ref
    try:
        expected = ref[idx]
        np_error = None
    except Exception as e:  # noqa: BLE001 - the oracle's exception type is the point
        np_error = e
    try:
        got = shape[idx]
        error = None
    except Exception as e:  # noqa: BLE001
        error = e
    if np_error is not None:
        assert error is not None, f"NumPy raised {np_error!r} for {idx!r}, Shape gave {got!r}"
        assert isinstance(error, type(np_error)), f"{idx!r}: NumPy {np_error!r}, Shape {error!r}"
        return None
    assert error is None, f"Shape raised {error!r} for {idx!r}; NumPy gave shape {np.shape(expected)}"
    expected = np.asarray(expected)
    assert got.sizes == expected.shape, (idx, got, expected.shape)
    assert got.ranks().tolist() == expected.ravel().tolist(), (idx, got)
    assert len(set(got.names)) == got.ndim
    assert got.size == expected.size == len(got)
    return got, expected


@PROPS
@given(st.data())
def test_indexing_matches_numpy(data):
    sizes = data.draw(sizes_st)
    idx = data.draw(index_for(sizes, valid=True))
    out = check_same(sizes, idx)
    if out is not None:  # "valid" items can still clash (e.g. arrays that do not broadcast)
        check_names(sizes, idx, out[0])


@PROPS
@given(st.data())
def test_bad_indices_raise_numpys_exception_types(data):
    sizes = data.draw(sizes_st)
    idx = data.draw(index_for(sizes, valid=False))
    check_same(sizes, idx)


@SMALL
@given(st.data())
def test_views_of_views_match_numpy(data):
    sizes = data.draw(sizes_st)
    first = data.draw(index_for(sizes))
    out = check_same(sizes, first)
    if out is None:
        return
    view, expected = out
    second = data.draw(index_for(view.sizes))
    check_same(view.sizes, second, shape=view, ref=expected)


@SMALL
@given(st.data())
def test_named_index_matches_positional(data):
    sizes = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=4).map(tuple))
    s = make(sizes)
    named = {}
    for d, name in enumerate(s.names):
        if data.draw(st.booleans()):
            n = sizes[d]
            named[name] = data.draw(st.integers(-n, n - 1) | st.builds(
                slice, st.none() | st.integers(-n, n), st.none() | st.integers(-n, n),
                st.none() | st.integers(-3, 3).filter(bool)))
    positional = tuple(named.get(name, slice(None)) for name in s.names)
    assert s.slice(**named) == s[positional] == s[named]


views = st.data()


@st.composite
def a_view(draw):
    sizes = draw(sizes_st)
    idx = draw(index_for(sizes))
    try:
        v = make(sizes)[idx]
    except IndexError:
        v = make(sizes)
    return v


@SMALL
@given(a_view())
def test_flatten_transpose_pickle_on_any_view(v):
    ranks = v.ranks()
    assert v.flatten("all").ranks().tolist() == ranks.tolist()
    perm = list(range(v.ndim))[::-1]
    assert v.transpose().ranks().tolist() == ranks.reshape(v.sizes).transpose(perm).ravel().tolist()
    w = pickle.loads(pickle.dumps(v))
    assert w == v and hash(w) == hash(v) and w.names == v.names
    assert Shape.from_ranks(v.names, v.sizes, ranks) == v
    for pos in range(min(v.size, 20)):
        r = int(ranks[pos])
        assert v.rank(pos) == r
        assert ranks[v.index_of(r)] == r
        assert v.rank_of(v.coordinates(r)) == r


@SMALL
@given(a_view(), st.data())
def test_reduction_plan_on_any_view(v, data):
    if v.ndim == 0 or 0 in v.sizes:
        return
    axes = data.draw(st.sets(st.integers(0, v.ndim - 1), min_size=1))
    groups, result = reduction_plan(v, tuple(v.names[a] for a in axes))
    keep = [d for d in range(v.ndim) if d not in axes]
    arr = v.ranks().reshape(v.sizes)
    expected = np.transpose(arr, keep + sorted(axes)).reshape(groups.shape[0], -1)
    np.testing.assert_array_equal(groups, expected)
    assert result.sizes == tuple(v.sizes[d] for d in keep)
    assert result.ranks().tolist() == groups[:, 0].tolist()


@SMALL
@given(st.data())
def test_split_matches_numpy_reshape(data):
    sizes = data.draw(st.lists(st.sampled_from([1, 2, 4, 6]), min_size=1, max_size=3).map(tuple))
    s = make(sizes)[data.draw(index_for(sizes))] if data.draw(st.booleans()) else make(sizes)
    if s.ndim == 0:
        return
    d = data.draw(st.integers(0, s.ndim - 1))
    n = s.sizes[d]
    k = data.draw(st.sampled_from([f for f in range(1, n + 1) if n % f == 0] or [1]))
    name = s.names[d]
    t = s.split(**{name: ("p_new", "q_new"), "q_new": k})
    expected = s.ranks().reshape(s.sizes).reshape(s.sizes[:d] + (n // k if k else 0, k) + s.sizes[d + 1:])
    assert t.sizes == expected.shape
    assert t.ranks().tolist() == expected.ravel().tolist()


@SMALL
@given(st.data())
def test_mixed_advanced_indices_are_placed_as_numpy_places_them(data):
    # Dense in the cases that decide placement: several advanced indices
    # (arrays, masks, ints) with slices, None and ... between them or not.
    sizes = data.draw(st.lists(st.integers(1, 5), min_size=2, max_size=5).map(tuple))
    items, d = [], 0
    while d < len(sizes):
        kind = data.draw(st.sampled_from(["int", "array", "array", "slice", "none", "mask"]))
        n = sizes[d]
        if kind == "int":
            items.append(data.draw(st.integers(-n, n - 1))); d += 1
        elif kind == "array":
            items.append(np.array(data.draw(st.lists(st.integers(-n, n - 1), min_size=2, max_size=2)))); d += 1
        elif kind == "mask":
            m = np.zeros(n, bool)
            m[data.draw(st.integers(0, n - 1))] = True
            items.append(m); d += 1
        elif kind == "slice":
            items.append(slice(None, None, data.draw(st.sampled_from([1, -1, 2])))); d += 1
        else:
            items.append(None)
    if data.draw(st.booleans()):
        items.insert(data.draw(st.integers(0, len(items))), Ellipsis)
    idx = tuple(items)
    out = check_same(sizes, idx)
    if out is not None:
        check_names(sizes, idx, out[0])
