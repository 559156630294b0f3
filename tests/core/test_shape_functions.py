"""``broadcast_shapes`` and ``reduction_plan``, checked against NumPy."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from mesharray import DimensionError, MeshShapeError, Shape, broadcast_shapes, reduction_plan


def test_broadcast_by_name():
    assert broadcast_shapes({"hosts": 2}, Shape(hosts=1, procs=4)) == {"hosts": 2, "procs": 4}
    assert broadcast_shapes(Shape(procs=4), {"hosts": 2}) == {"procs": 4, "hosts": 2}
    assert broadcast_shapes({"a": 1}, {"a": 1}) == {"a": 1}
    assert broadcast_shapes({"a": 1}, {"a": 0}) == {"a": 0}
    assert broadcast_shapes({"a": 3}, {"a": 1}, {"a": 3}) == {"a": 3}
    assert broadcast_shapes() == {}
    assert broadcast_shapes(Shape(a=2, b=3)[:, 0]) == {"a": 2}


def test_broadcast_mismatch_names_both_shapes():
    with pytest.raises(MeshShapeError) as info:
        broadcast_shapes({"hosts": 2, "procs": 4}, {"procs": 3})
    assert str(info.value) == (
        "shapes {hosts=2, procs=4} and {procs=3} do not broadcast: dimension 'procs' has sizes 4 and 3"
    )
    assert isinstance(info.value, ValueError)


def test_broadcast_bad_input():
    with pytest.raises(TypeError, match="expected a Shape or a mapping"):
        broadcast_shapes([("a", 2)])
    with pytest.raises(TypeError, match="size of dimension 'a' must be an int"):
        broadcast_shapes({"a": 2.0})
    with pytest.raises(ValueError, match="must be non-negative"):
        broadcast_shapes({"a": -1})


def test_broadcast_agrees_with_numpy_when_names_align():
    for sizes_a, sizes_b in itertools.product(itertools.product([1, 3], repeat=2), repeat=2):
        names = ("x", "y")
        got = broadcast_shapes(dict(zip(names, sizes_a)), dict(zip(names, sizes_b)))
        assert tuple(got.values()) == np.broadcast_shapes(sizes_a, sizes_b)


def _np_groups(sizes, axes):
    arr = np.arange(int(np.prod(sizes))).reshape(sizes)
    keep = [d for d in range(len(sizes)) if d not in axes]
    m = int(np.prod([sizes[a] for a in axes]))
    return np.transpose(arr, keep + sorted(axes)).reshape(-1, m)


@pytest.mark.parametrize("sizes", [(2, 3), (2, 3, 4), (1, 5, 2), (3,)])
def test_reduction_plan_against_numpy(sizes):
    names = tuple("abcd"[: len(sizes)])
    s = Shape(dict(zip(names, sizes)))
    for k in range(len(sizes) + 1):
        for axes in itertools.combinations(range(len(sizes)), k):
            groups, result = reduction_plan(s, tuple(names[a] for a in axes))
            assert groups.dtype == np.int64
            np.testing.assert_array_equal(groups, _np_groups(sizes, list(axes)))
            assert result.names == tuple(n for i, n in enumerate(names) if i not in axes)
            assert [result.rank(g) for g in range(result.size)] == groups[:, 0].tolist()


def test_reduction_plan_on_views_and_axes():
    s = Shape(hosts=2, procs=4)
    v = s[::-1, [3, 1, 0]]
    groups, result = reduction_plan(v, ("procs",))
    assert groups.tolist() == [[7, 5, 4], [3, 1, 0]]
    assert result.ranks().tolist() == [7, 3]
    g2, r2 = reduction_plan(v, -1)
    np.testing.assert_array_equal(g2, groups)
    assert r2 == result
    # reducing over everything: one group, a 0-d result rooted at the first rank
    g3, r3 = reduction_plan(v, (0, 1))
    assert g3.tolist() == [v.ranks().tolist()]
    assert r3.ndim == 0 and r3.ranks().tolist() == [7]
    # the order the dims are named in does not change the member order
    np.testing.assert_array_equal(reduction_plan(s, ("procs", "hosts"))[0], reduction_plan(s, ("hosts", "procs"))[0])
    # reducing over nothing: one group per rank
    g4, r4 = reduction_plan(s, ())
    assert g4.tolist() == [[r] for r in range(8)] and r4 == s


def test_reduction_plan_errors():
    s = Shape(hosts=2, procs=4)
    with pytest.raises(DimensionError, match="mesh has no dimension 'gpu'"):
        reduction_plan(s, "gpu")
    with pytest.raises(DimensionError, match="axis 2 is out of bounds"):
        reduction_plan(s, 2)
    with pytest.raises(ValueError, match="duplicate dimension"):
        reduction_plan(s, ("procs", 1))
    with pytest.raises(ValueError, match="of size 0"):
        reduction_plan(s[:, :0], "procs")
    with pytest.raises(TypeError):
        reduction_plan({"a": 2}, "a")
