"""MeshArray (gathered storage): construction, NumPy-like behaviour, names, errors, object arrays.

Property tests against NumPy as the oracle are in test_array_props.py.
"""

from __future__ import annotations

import contextlib
import copy
import fractions
import io
import pathlib
import pickle
import runpy

import numpy as np
import pytest

import mesharray as ma
from mesharray.array import MeshArray


@pytest.fixture
def grid() -> MeshArray:
    return MeshArray(np.arange(8).reshape(2, 4), ["hosts", "procs"])


@pytest.fixture
def blocks() -> MeshArray:
    return MeshArray(np.arange(24, dtype="float32").reshape(2, 4, 3), ["hosts", "procs"])


# -- construction ------------------------------------------------------------------------


def test_constructor_describes_the_layout(blocks):
    assert blocks.names == ("hosts", "procs")
    assert blocks.mesh_ndim == 2
    assert blocks.mesh_sizes == {"hosts": 2, "procs": 4}
    assert blocks.local_shape == (3,)
    assert blocks.local_ndim == 1
    assert blocks.shape == (2, 4, 3)
    assert blocks.ndim == 3
    assert blocks.size == 24
    assert blocks.mesh_size() == 8 and blocks.mesh_size("procs") == 4
    assert blocks.dtype == np.float32
    assert blocks.mesh_shape == ma.Shape({"hosts": 2, "procs": 4})
    assert len(blocks) == 2


def test_constructor_forms():
    assert MeshArray([1, 2, 3], "procs").names == ("procs",)
    assert MeshArray(np.zeros((2, 3)), ("procs",)).local_shape == (3,)
    assert MeshArray(5, []).shape == ()
    s = ma.Shape({"hosts": 4})[1::2]
    a = MeshArray([7, 9], mesh_shape=s)
    assert a.mesh_shape is s and a.names == ("hosts",)
    # values are wrapped, not copied
    v = np.zeros(4)
    assert np.shares_memory(MeshArray(v, ["procs"]).to_numpy(), v)


def test_constructor_errors():
    with pytest.raises(ValueError, match=r"2 mesh dim names \('a', 'b'\) for values of only 1 dims"):
        MeshArray([1, 2], ["a", "b"])
    with pytest.raises(ValueError, match="duplicate"):
        MeshArray(np.zeros((2, 2)), ["a", "a"])
    with pytest.raises(TypeError, match="names"):
        MeshArray([1, 2], [3])
    with pytest.raises(TypeError, match="needs names"):
        MeshArray([1, 2])
    with pytest.raises(ma.MeshShapeError, match=r"do not fit mesh \{'procs': 3\}"):
        MeshArray([1, 2], mesh_shape=ma.Shape(procs=3))
    with pytest.raises(ValueError, match="differ"):
        MeshArray([1, 2], ["hosts"], mesh_shape=ma.Shape(procs=2))
    with pytest.raises(TypeError, match="must be a Shape"):
        MeshArray([1, 2], mesh_shape={"procs": 2})


# -- from_results ------------------------------------------------------------------------


def test_from_results_numbers():
    s = ma.Shape({"hosts": 2, "procs": 2})
    a = MeshArray.from_results(s, [1, 2, 3, 4])
    assert a.dtype == np.int64 and a.shape == (2, 2)
    assert a.tolist() == [[1, 2], [3, 4]]
    assert a.mesh_shape is s
    assert MeshArray.from_results(s, [1, 2.5, 3, 4]).dtype == np.float64
    assert MeshArray.from_results(s, [True, False, True, True]).dtype == np.bool_
    assert MeshArray.from_results(s, [np.float32(1)] * 4).dtype == np.float32


def test_from_results_arrays_are_stacked():
    s = ma.Shape({"procs": 3})
    a = MeshArray.from_results(s, [np.full((2, 2), i, dtype="int32") for i in range(3)])
    assert a.shape == (3, 2, 2) and a.local_shape == (2, 2) and a.dtype == np.int32
    assert a.item(procs=2).tolist() == [[2, 2], [2, 2]]


def test_from_results_mixed_become_objects():
    s = ma.Shape({"procs": 3})
    # arrays of different shapes, or dtypes, stay whole objects
    a = MeshArray.from_results(s, [np.zeros(2), np.zeros(3), np.zeros(2)])
    assert a.dtype == object and a.shape == (3,)
    assert a.item(procs=1).shape == (3,)
    b = MeshArray.from_results(s, [np.zeros(2, "f4"), np.zeros(2, "f8"), np.zeros(2, "f4")])
    assert b.dtype == object
    c = MeshArray.from_results(s, ["x", None, {"k": [1, 2]}])
    assert c.dtype == object
    assert c.values() == ["x", None, {"k": [1, 2]}]
    # lists are values, not nested axes
    d = MeshArray.from_results(s, [[1, 2], [3, 4], [5, 6]])
    assert d.shape == (3,) and d.item(procs=0) == [1, 2]
    assert d[0] == [1, 2] and d[-1] == [5, 6]
    assert d[1:].tolist() == [[3, 4], [5, 6]]
    # an object array with local axes: elements stay elements
    o = np.empty((2, 2), dtype=object)
    for i in range(2):
        for j in range(2):
            o[i, j] = [i, j]
    m = MeshArray(o, ["procs"])
    assert m.local_shape == (2,) and m[1, 0] == [1, 0]
    assert m[:, 1].tolist() == [[0, 1], [1, 1]]
    # numbers NumPy cannot hold become objects too, exact
    e = MeshArray.from_results(s, [fractions.Fraction(1, 3)] * 3)
    assert e.dtype == object and e.sum() == 1


def test_from_results_over_a_view_keeps_global_ranks():
    view = ma.Shape({"hosts": 2, "procs": 4})[:, 1::2]
    a = MeshArray.from_results(view, [10, 20, 30, 40])
    assert a.mesh_shape.ranks().tolist() == [1, 3, 5, 7]
    assert a[1].mesh_shape.ranks().tolist() == [5, 7]
    assert a.sum(axis="procs").mesh_shape.ranks().tolist() == [1, 5]


def test_from_results_errors():
    with pytest.raises(ValueError, match="3 values for a mesh of 4 ranks"):
        MeshArray.from_results(ma.Shape(procs=4), [1, 2, 3])
    with pytest.raises(TypeError, match="must be a Shape"):
        MeshArray.from_results({"procs": 2}, [1, 2])


def test_from_results_empty_and_zero_d():
    a = MeshArray.from_results(ma.Shape({"procs": 4})[3], ["only"])
    assert a.shape == () and a.values() == ["only"]
    assert a.item() == "only"


# -- ValueMesh-style access --------------------------------------------------------------


def test_item_by_coordinates(grid, blocks):
    assert grid.item(hosts=1, procs=2) == 6
    assert type(grid.item(hosts=1, procs=2)) is int
    assert blocks.item(hosts=0, procs=1).tolist() == [3.0, 4.0, 5.0]
    assert grid.item(hosts=-1, procs=-1) == 7
    assert grid[0, 1:2].item() == 1
    assert grid.item(5) == 5


def test_item_errors(grid):
    with pytest.raises(ValueError, match=r"missing \('procs',\)"):
        grid.item(hosts=0)
    with pytest.raises(ma.DimensionError, match="'gpus'"):
        grid.item(hosts=0, procs=0, gpus=0)
    with pytest.raises(IndexError, match="out of bounds"):
        grid.item(hosts=2, procs=0)
    with pytest.raises(TypeError, match="must be an int"):
        grid.item(hosts=slice(None), procs=0)
    with pytest.raises(ValueError, match="size 1"):
        grid.item()


def test_items_values_tolist(grid):
    assert list(grid[:, 1:3].items()) == [
        ({"hosts": 0, "procs": 0}, 1),
        ({"hosts": 0, "procs": 1}, 2),
        ({"hosts": 1, "procs": 0}, 5),
        ({"hosts": 1, "procs": 1}, 6),
    ]
    assert grid.values() == list(range(8))
    assert grid.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_numpy_conversion(grid):
    assert np.asarray(grid) is grid.to_numpy()
    assert np.array_equal(np.array(grid), np.arange(8).reshape(2, 4))
    assert np.asarray(grid, dtype="float32").dtype == np.float32
    assert not np.shares_memory(grid.to_numpy(copy=True), grid.to_numpy())
    with pytest.raises(ValueError, match="without a copy"):
        np.asarray(grid, dtype="float32", copy=False)


def test_len_iter_bool_numpy_meaning(grid, blocks):
    assert len(grid) == 2
    rows = list(grid)
    assert [r.names for r in rows] == [("procs",), ("procs",)]
    assert rows[1].tolist() == [4, 5, 6, 7]
    assert [x for x in grid[0]] == [0, 1, 2, 3]  # 0-d mesh, scalar element -> the element
    assert [b.shape for b in blocks[0]] == [(3,)] * 4  # 0-d mesh with a local block stays an array
    with pytest.raises(TypeError, match="unsized"):
        len(MeshArray(3, []))
    assert bool(MeshArray([1], ["p"]))
    with pytest.raises(ValueError, match="ambiguous"):
        bool(grid)


def test_astype_copy_reshape_local(blocks):
    b = blocks.astype("int64")
    assert b.dtype == np.int64 and b.mesh_shape == blocks.mesh_shape
    c = blocks.copy()
    c += 1
    assert blocks.item(hosts=0, procs=0)[0] == 0 and c.item(hosts=0, procs=0)[0] == 1
    r = MeshArray(np.zeros((2, 6)), ["procs"]).reshape_local(2, 3)
    assert r.shape == (2, 2, 3) and r.names == ("procs",)
    assert MeshArray(np.zeros((2, 6)), ["procs"]).reshape_local((3, -1)).local_shape == (3, 2)
    assert MeshArray(np.zeros(2), ["procs"]).reshape_local(1, 1).shape == (2, 1, 1)
    with pytest.raises(ma.MeshShapeError, match=r"cannot reshape local shape \(3,\) into \(2, 2\)"):
        blocks.reshape_local(2, 2)


def test_copy_deepcopy_pickle(blocks):
    view = blocks[:, 1::2]
    for clone in (copy.copy(view), copy.deepcopy(view), pickle.loads(pickle.dumps(view))):
        assert isinstance(clone, MeshArray)
        assert clone.mesh_shape == view.mesh_shape
        assert np.array_equal(clone, view)
        assert not np.shares_memory(clone.to_numpy(), blocks.to_numpy())


def test_repr_shows_names():
    a = MeshArray(np.zeros((4, 3), dtype="float32"), ["procs"])
    assert repr(a) == (
        "MeshArray(procs=4, local=(3,), dtype=float32)\n"
        "[[0. 0. 0.]\n [0. 0. 0.]\n [0. 0. 0.]\n [0. 0. 0.]]"
    )
    assert repr(MeshArray([1, 2], ["procs"])) == "MeshArray(procs=2, dtype=int64)\n[1 2]"
    assert str(MeshArray([1, 2], ["procs"])) == "[1 2]"
    assert repr(MeshArray(np.zeros(2), [])).startswith("MeshArray(local=(2,), dtype=float64)")


# -- indexing ------------------------------------------------------------------------------


def test_indexing_mesh_then_local(blocks):
    v = blocks[1, 1:3]
    assert v.names == ("procs",) and v.shape == (2, 3)
    assert v.mesh_shape.ranks().tolist() == [5, 6]
    assert np.array_equal(v, blocks.to_numpy()[1, 1:3])
    w = blocks[:, ::-1, 0]
    assert w.names == ("hosts", "procs") and w.local_shape == ()
    assert w.mesh_shape.ranks().tolist() == [3, 2, 1, 0, 7, 6, 5, 4]
    assert np.array_equal(w, blocks.to_numpy()[:, ::-1, 0])
    assert blocks[..., 2].local_shape == ()
    assert blocks[0, 0, 0] == 0.0 and isinstance(blocks[0, 0, 0], np.float32)


def test_basic_indexing_gives_views(blocks):
    v = blocks[0]
    v += 100
    assert blocks.item(hosts=0, procs=0)[0] == 100


def test_advanced_indexing_mesh_dims(grid):
    a = grid[[0, 1], [1, 2]]
    assert a.tolist() == [1, 6]
    assert a.mesh_shape.ranks().tolist() == [1, 6]
    assert a.names == ma.Shape({"hosts": 2, "procs": 4})[[0, 1], [1, 2]].names
    mask = np.array([True, False, True, False])
    m = grid[:, mask]
    assert m.names == ("hosts", "procs") and m.tolist() == [[0, 2], [4, 6]]
    assert m.mesh_shape.ranks().tolist() == [0, 2, 4, 6]
    assert grid[grid > 5].tolist() == [6, 7]  # a MeshArray mask over every mesh axis


def test_advanced_indexing_local_axes_is_per_element():
    values = np.arange(2 * 3 * 4 * 5).reshape(2, 3, 4, 5)
    a = MeshArray(values, ["procs"])
    r = a[:, [0, 2], :, [1, 3]]  # non-adjacent advanced indices on the local axes
    # NumPy puts them first *within each element*
    expected = np.stack([values[i][[0, 2], :, [1, 3]] for i in range(2)])
    assert r.names == ("procs",)
    assert np.array_equal(r, expected)
    assert np.array_equal(a[:, :, [1, 0]], values[:, :, [1, 0]])


def test_mesh_part_and_local_part_are_indexed_separately():
    # NumPy would gather the int on a local axis with the mesh array index and put
    # both in front; a MeshArray indexes the mesh, then each element.
    values = np.arange(2 * 3 * 4 * 5).reshape(2, 3, 4, 5)
    a = MeshArray(values, ["hosts", "procs"])
    r = a[:, [0, 2], :, 1]
    assert r.names == ("hosts", "procs") and r.shape == (2, 2, 4)
    assert np.array_equal(r, values[:, [0, 2]][..., 1])
    s = a[0, :, [1, 3]]
    assert s.names == ("procs",) and s.shape == (3, 2, 5)
    assert np.array_equal(s, np.stack([values[0, i][[1, 3]] for i in range(3)]))


def test_none_after_the_mesh_axes_is_local(grid):
    assert grid[..., None].local_shape == (1,)
    assert grid[:, :, None].names == ("hosts", "procs")
    n = grid[None]
    assert n.ndim == 3 and n.mesh_ndim == 3 and n.names[1:] == ("hosts", "procs")


def test_named_indexing(grid, blocks):
    assert grid.slice(procs=1).tolist() == [1, 5]
    assert grid[{"procs": 1}].tolist() == [1, 5]
    assert grid.slice(procs=-1, hosts=0) == 3
    assert blocks.slice(hosts=1).shape == (4, 3)
    assert grid.slice(procs=[3, 0]).tolist() == [[3, 0], [7, 4]]
    assert grid.slice().mesh_shape == grid.mesh_shape
    with pytest.raises(ma.DimensionError, match=r"mesh has no dimension 'gpus'; dimensions are \('hosts', 'procs'\)"):
        grid.slice(gpus=0)


def test_indexing_errors(blocks):
    with pytest.raises(IndexError, match="too many indices for array: array is 3-dimensional, but 4 were indexed"):
        blocks[0, 0, 0, 0]
    with pytest.raises(IndexError, match="out of bounds"):
        blocks[2]
    with pytest.raises(IndexError, match="out of bounds"):
        blocks[0, 0, 3]
    with pytest.raises(IndexError, match="single ellipsis"):
        blocks[..., ...]
    with pytest.raises(IndexError, match="valid indices"):
        blocks[1.5]
    with pytest.raises(TypeError, match="valid indices"):
        blocks["procs"]
    with pytest.raises(IndexError, match="integer"):
        blocks[np.array([0.5])]
    with pytest.raises(IndexError, match="both mesh axes and local axes"):
        blocks[[0, 1], 0, [0, 1]]
    with pytest.raises(IndexError, match="spans both mesh axes"):
        MeshArray(np.zeros((2, 2)), ["procs"])[np.ones((2, 2), bool)]


def test_setitem(grid, blocks):
    g = grid.copy()
    g[0] = 9
    g[{"procs": -1}] = -1
    assert g.tolist() == [[9, 9, 9, -1], [4, 5, 6, -1]]
    g[:, [0, 2]] = MeshArray([100, 200], ["hosts"])  # aligned by name, broadcast over procs
    assert g.tolist() == [[100, 9, 100, -1], [200, 5, 200, -1]]
    g[grid > 5] = 0
    assert g.tolist()[1] == [200, 5, 0, 0]
    b = blocks.copy()
    b[..., 0] = MeshArray(np.arange(8).reshape(4, 2), ["procs", "hosts"])  # reordered names
    assert np.array_equal(b.to_numpy()[..., 0], np.arange(8).reshape(4, 2).T)
    b[:, :, [0, 2]] = np.array([7, 8])
    assert b.item(hosts=1, procs=3).tolist() == [7.0, 22.0, 8.0]
    with pytest.raises(IndexError, match="two steps"):
        b[[0, 1], 0, 0] = 1
    with pytest.raises(ma.MeshShapeError, match="does not fit"):
        b[0] = MeshArray([1, 2], ["hosts"])
    with pytest.raises(ma.DimensionError):
        b[{"gpus": 0}] = 1


def test_mesh_reshapes_move_values(grid, blocks):
    f = grid.flatten("r")
    assert f.names == ("r",) and f.tolist() == list(range(8))
    fv = grid[:, ::2].flatten("r")
    assert fv.tolist() == [0, 2, 4, 6] and fv.mesh_shape.ranks().tolist() == [0, 2, 4, 6]
    s = blocks.split(procs=("a", "b"), b=2)
    assert s.shape == (2, 2, 2, 3) and np.array_equal(s, blocks.to_numpy().reshape(2, 2, 2, 3))
    r = grid.rename(procs="gpus")
    assert r.names == ("hosts", "gpus") and r.tolist() == grid.tolist()
    t = blocks.transpose("procs", "hosts")
    assert t.shape == (4, 2, 3)
    assert np.array_equal(t, blocks.to_numpy().transpose(1, 0, 2))
    assert t.mesh_shape.ranks().tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert blocks.transpose().names == ("procs", "hosts")
    with pytest.raises(ma.MeshShapeError, match="cannot hold"):
        grid._with_mesh_shape(ma.Shape(procs=3))


# -- arithmetic --------------------------------------------------------------------------


def test_arithmetic_with_scalars(grid):
    assert (grid + 1).tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert (2 * grid).names == ("hosts", "procs")
    assert (grid - 1).mesh_shape == grid.mesh_shape
    assert (-grid).tolist()[0] == [0, -1, -2, -3]
    assert abs(-grid).tolist() == grid.tolist()
    assert (grid ** 2).tolist()[1] == [16, 25, 36, 49]
    assert (grid // 3).dtype == np.int64 and (grid / 2).dtype == np.float64
    assert (10 - grid).tolist()[0] == [10, 9, 8, 7]
    assert np.sqrt(grid).dtype == np.float64
    assert (grid + np.float32(1)).dtype == (grid.to_numpy() + np.float32(1)).dtype
    q, r = divmod(grid, 3)
    assert q.tolist() == (grid.to_numpy() // 3).tolist() and r.names == grid.names


def test_comparisons_are_elementwise(grid):
    eq = grid == 3
    assert isinstance(eq, MeshArray) and eq.dtype == np.bool_
    assert eq.tolist() == [[False, False, False, True], [False] * 4]
    assert (grid != grid).any() == False  # noqa: E712 - a NumPy bool
    assert (grid < 2).sum() == 2
    assert np.maximum(grid, 5).tolist()[0] == [5, 5, 5, 5]
    with pytest.raises(TypeError, match="unhashable"):
        hash(grid)


def test_mesh_dims_align_by_name(grid):
    col = MeshArray([100, 200, 300, 400], ["procs"])
    r = grid + col
    assert r.names == ("hosts", "procs")
    assert r.tolist() == [[100, 201, 302, 403], [104, 205, 306, 407]]
    assert r.mesh_shape == grid.mesh_shape
    r2 = col + grid  # first operand's names first, then the others'
    assert r2.names == ("procs", "hosts")
    assert np.array_equal(r2, r.to_numpy().T)
    t = grid.transpose("procs", "hosts")
    assert (grid + t).tolist() == (2 * grid).tolist()  # reordered names align
    outer = MeshArray([1, 2], ["x"]) * MeshArray([10, 20, 30], ["y"])
    assert outer.names == ("x", "y") and outer.tolist() == [[10, 20, 30], [20, 40, 60]]
    assert outer.mesh_shape == ma.Shape({"x": 2, "y": 3})


def test_result_keeps_the_ranks_of_the_full_operand():
    view = ma.Shape({"hosts": 2, "procs": 4})[:, 2:]
    a = MeshArray.from_results(view, [1, 2, 3, 4])
    b = MeshArray([10, 20], ["procs"])
    assert (b + a).mesh_shape.ranks().tolist() == view.transpose("procs", "hosts").ranks().tolist()
    assert (a + b).mesh_shape is view


def test_local_dims_align_positionally(blocks):
    per_rank = MeshArray(np.arange(8).reshape(2, 4), ["hosts", "procs"])
    r = blocks * per_rank  # a scalar per rank scales that rank's block
    assert np.array_equal(r, blocks.to_numpy() * np.arange(8).reshape(2, 4, 1))
    r2 = blocks + np.array([1, 2, 3])  # a plain array meets the local axes
    assert np.array_equal(r2, blocks.to_numpy() + [1, 2, 3])
    r3 = per_rank + np.arange(4)  # ... NumPy-style against the full shape
    assert np.array_equal(r3, per_rank.to_numpy() + np.arange(4))
    column = MeshArray(np.ones((2, 4, 1)), ["hosts", "procs"])
    assert (column + np.arange(5)).shape == (2, 4, 5)
    # a size-1 mesh dim stretched by a plain array: no operand has those ranks -> dense Shape
    one = MeshArray.from_results(ma.Shape(procs=8)[5:6], [7])
    grown = one + np.arange(4)
    assert grown.mesh_sizes == {"procs": 4} and grown.mesh_shape == ma.Shape(procs=4)
    assert grown.tolist() == [7, 8, 9, 10]


def test_broadcast_errors_name_both_shapes(grid, blocks):
    with pytest.raises(ma.MeshShapeError, match=r"mesh dims \{'hosts': 2, 'procs': 4\} and \{'procs': 3\} do not broadcast"):
        grid + MeshArray([1, 2, 3], ["procs"])
    with pytest.raises(ma.MeshShapeError, match=r"local shapes \(3,\) and \(2,\) do not broadcast"):
        blocks + MeshArray(np.zeros((2, 4, 2)), ["hosts", "procs"])
    with pytest.raises(ma.MeshShapeError, match=r"operand of shape \(5,\) does not broadcast"):
        blocks + np.ones(5)
    with pytest.raises(ma.MeshShapeError, match="more dims"):
        grid + np.ones((1, 1, 1))
    with pytest.raises(ValueError):  # MeshShapeError is a ValueError
        grid + MeshArray([1, 2, 3], ["procs"])


def test_inplace_ops(grid):
    g = grid.copy()
    g += 1
    assert g.tolist()[0] == [1, 2, 3, 4]
    g *= MeshArray([1, 0, 1, 0], ["procs"])
    assert g.tolist()[1] == [5, 0, 7, 0]
    with pytest.raises(TypeError, match="same_kind"):  # NumPy's casting rule
        g += 0.5
    with pytest.raises(ma.MeshShapeError, match="cannot hold"):
        g += MeshArray([1, 2], ["extra"])
    f = grid.astype("float64")
    np.multiply(f, 2, out=f)
    assert f.tolist()[0] == [0.0, 2.0, 4.0, 6.0]


def test_ufunc_kwargs_and_ndarray_on_the_left(grid):
    r = np.add(grid, 1, where=grid.to_numpy() > 3, out=np.zeros((2, 4), dtype=np.int64))
    assert isinstance(r, np.ndarray) and r.tolist() == [[0, 0, 0, 0], [5, 6, 7, 8]]
    left = np.ones((2, 4), dtype=np.int64) + grid
    assert isinstance(left, MeshArray) and left.names == ("hosts", "procs")
    assert np.add(grid, 1, dtype="float32").dtype == np.float32


def test_matmul_applies_per_element():
    a = MeshArray(np.arange(12.0).reshape(2, 2, 3), ["procs"])
    w = np.arange(6.0).reshape(3, 2)
    r = a @ w
    assert r.names == ("procs",) and r.local_shape == (2, 2)
    assert np.array_equal(r, np.stack([a.to_numpy()[i] @ w for i in range(2)]))
    v = MeshArray(np.ones((2, 3)), ["procs"])
    assert np.array_equal(a @ v, np.stack([a.to_numpy()[i] @ np.ones(3) for i in range(2)]))


def test_unknown_array_types_get_the_chance_to_handle_it(grid):
    class Other:
        __array_ufunc__ = None

        def __radd__(self, other):
            return "other"

    assert grid + Other() == "other"


# -- reductions ------------------------------------------------------------------------


def test_reductions_by_name(blocks):
    s = blocks.sum(axis="procs")
    assert s.names == ("hosts",) and s.shape == (2, 3)
    assert np.array_equal(s, blocks.to_numpy().sum(axis=1))
    assert blocks.sum(axis=("hosts", "procs")).names == ()
    assert blocks.sum(axis=("hosts", -1)).shape == (4,)
    k = blocks.mean(axis="hosts", keepdims=True)
    assert k.names == ("hosts", "procs") and k.shape == (1, 4, 3)
    assert k.mesh_shape.ranks().tolist() == [0, 1, 2, 3]
    assert blocks.max() == 23 and blocks.min() == 0
    assert blocks.argmax(axis="procs").tolist() == [[3, 3, 3]] * 2
    assert blocks.std(axis=2, ddof=1).shape == (2, 4)
    assert np.sum(blocks, axis="procs").names == ("hosts",)
    assert np.mean(blocks, "hosts").shape == (4, 3)
    assert np.max(blocks, axis=("procs",)).shape == (2, 3)
    assert np.add.reduce(blocks, axis="hosts").shape == (4, 3)
    assert np.add.reduce(blocks).shape == (4, 3)  # a ufunc reduces axis 0 by default


def test_reduced_shape_remembers_group_roots():
    s = ma.Shape({"hosts": 2, "procs": 4})
    a = MeshArray.from_results(s, list(range(8)))
    groups, result = ma.reduction_plan(s, ("hosts",))
    r = a.sum(axis="hosts")
    assert r.mesh_shape == result
    assert r.tolist() == [int(a.to_numpy().ravel()[g].sum()) for g in groups]


def test_reduction_errors(blocks):
    with pytest.raises(ma.DimensionError, match=r"mesh has no dimension 'gpus'"):
        blocks.sum(axis="gpus")
    with pytest.raises(ma.DimensionError, match="axis 3 is out of bounds for array of dimension 3"):
        blocks.sum(axis=3)
    with pytest.raises(IndexError):  # DimensionError is an IndexError too, like NumPy's AxisError
        blocks.sum(axis=-4)
    with pytest.raises(ValueError, match="duplicate value in 'axis'"):
        blocks.sum(axis=("procs", 1))
    with pytest.raises(TypeError, match="axis must be"):
        blocks.sum(axis=1.0)
    with pytest.raises(TypeError, match="one axis"):
        blocks.argmax(axis=("procs", "hosts"))
    with pytest.raises(TypeError, match="out="):
        blocks.sum(out=np.zeros(3))


def test_where_aligns_by_name(grid):
    col = MeshArray([1, 0, 1, 0], ["procs"]).astype(bool)
    r = np.where(col, grid, -grid.transpose())
    assert r.names == ("procs", "hosts")
    assert r.tolist() == [[0, 4], [-1, -5], [2, 6], [-3, -7]]
    assert np.where(grid > 3, 1, 0).tolist() == [[0, 0, 0, 0], [1, 1, 1, 1]]


def test_other_numpy_functions_see_plain_values(blocks):
    assert np.round(blocks / 3, 1).names == ("hosts", "procs")
    assert np.clip(blocks, 1, 5).max() == 5
    c = np.concatenate([blocks, blocks])
    assert type(c) is np.ndarray and c.shape == (4, 4, 3)
    assert np.shape(blocks) == (2, 4, 3)
    assert np.allclose(blocks, blocks.to_numpy())


def test_empty_mesh_dims(grid):
    e = grid[:, 0:0]
    assert e.shape == (2, 0) and e.values() == [] and list(e.items()) == []
    assert e.sum(axis="procs").tolist() == [0, 0]
    assert e.sum(axis="procs", keepdims=True).shape == (2, 1)
    assert e.sum(axis="hosts").shape == (0,)
    assert (e + 1).shape == (2, 0)
    assert MeshArray.from_results(ma.Shape(procs=0), []).shape == (0,)


def test_zero_d_mesh_with_local_axes():
    z = MeshArray(np.arange(3), [])
    assert z.names == () and z.mesh_ndim == 0 and z.shape == (3,)
    assert (z + z).tolist() == [0, 2, 4]
    assert z.sum() == 3 and z[1] == 1
    assert len(z) == 3


# -- object arrays ----------------------------------------------------------------------


def test_object_arrays():
    s = ma.Shape({"hosts": 2, "procs": 2})
    a = MeshArray.from_results(s, ["a", "bb", "ccc", "dddd"])
    assert a.slice(hosts=1).tolist() == ["ccc", "dddd"]
    assert a[0, 1] == "bb"
    assert (a + "!").tolist() == [["a!", "bb!"], ["ccc!", "dddd!"]]
    assert a.sum(axis="procs").tolist() == ["abb", "cccdddd"]
    nums = MeshArray.from_results(s, [1, 2**80, 3, 4])  # too large for int64
    assert nums.dtype == object and nums.sum() == 2**80 + 8
    assert nums.max() == 2**80
    assert list(nums.items())[1] == ({"hosts": 0, "procs": 1}, 2**80)
    dicts = MeshArray.from_results(s, [{"r": i} for i in range(4)])
    assert [d["r"] for d in dicts.values()] == [0, 1, 2, 3]
    assert dicts.transpose().item(hosts=0, procs=1) == {"r": 1}
    with pytest.raises(TypeError):
        dicts + 1


def test_shapes_example_runs():
    """examples/shapes.py (what `make demo` shows before the runtime exists) runs and prints."""
    path = pathlib.Path(__file__).parents[2] / "examples" / "shapes.py"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        runpy.run_path(str(path), run_name="__main__")
    text = out.getvalue()
    assert "s[0, 1:3].ranks()" in text and "[1, 2]" in text
    assert "MeshArray(hosts=2, dtype=int64)" in text


@pytest.mark.parametrize("module", ["mesharray.array", "mesharray.reductions", "mesharray.mesh", "mesharray.storage"])
def test_docstring_examples_run(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("key, kind", [
    ((Ellipsis, Ellipsis), ma.MeshIndexError),
    ((0, 0, 0, 0), ma.MeshIndexError),
    (1.5, ma.InvalidIndexError),
    ("procs", ma.InvalidIndexError),
    ([1.5], ma.InvalidIndexError),
])
def test_meshes_and_arrays_classify_an_index_alike(key, kind):
    # one compiled classifier behind Shape and MeshArray indexing: the same error types
    shape = ma.Shape(hosts=2, procs=3)
    arr = ma.MeshArray(np.zeros((2, 3, 4)), names=("hosts", "procs"))
    with pytest.raises(kind):
        shape[key if key != (0, 0, 0, 0) else (0, 0, 0)]
    with pytest.raises(kind):
        arr[key]
