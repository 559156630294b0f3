"""MeshTrait: every method of the mixin, on the smallest concrete mesh (a Shape and a tag)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import mesharray as ma
from mesharray.mesh import MeshTrait


class Tagged(MeshTrait):
    """A mesh-like object carrying a payload that views must share (like a controller)."""

    def __init__(self, shape: ma.Shape, payload: object) -> None:
        self._shape = shape
        self.payload = payload

    @property
    def _mesh_shape(self) -> ma.Shape:
        return self._shape

    def _with_mesh_shape(self, shape: ma.Shape) -> Tagged:
        return Tagged(shape, self.payload)


@pytest.fixture
def mesh() -> Tagged:
    return Tagged(ma.Shape({"hosts": 2, "procs": 4}), payload=object())


def ranks(m: MeshTrait) -> list[int]:
    return m.mesh_shape.ranks().tolist()


GRID = np.arange(8).reshape(2, 4)


def test_attributes(mesh):
    assert mesh.names == ("hosts", "procs")
    assert mesh.sizes == {"hosts": 2, "procs": 4}
    assert mesh.ndim == 2
    assert mesh.shape == (2, 4)
    assert len(mesh) == 8
    assert isinstance(mesh.mesh_shape, ma.Shape)
    assert mesh.mesh_shape == ma.Shape({"hosts": 2, "procs": 4})


@pytest.mark.parametrize(
    "key",
    [0, -1, (0, 1), (1, slice(1, 3)), (slice(None), slice(None, None, -1)), (Ellipsis, 2),
     ([0, 1], [1, 2]), (slice(None), [3, 0]), np.array([True, False]), (None, 1)],
    ids=repr,
)
def test_getitem_positional_is_numpy(mesh, key):
    view = mesh[key]
    assert isinstance(view, Tagged)
    assert view.payload is mesh.payload  # a view shares everything but its Shape
    assert ranks(view) == GRID[key].ravel().tolist()
    assert view.shape == GRID[key].shape
    assert view.mesh_shape == mesh.mesh_shape[key]


def test_getitem_by_name(mesh):
    assert ranks(mesh[{"procs": 1}]) == [1, 5]
    assert mesh[{"procs": 1}].names == ("hosts",)
    assert ranks(mesh[{"hosts": -1, "procs": slice(None, None, 2)}]) == [4, 6]


def test_slice(mesh):
    assert ranks(mesh.slice(procs=-1)) == [3, 7]
    v = mesh.slice(hosts=slice(0, 2), procs=slice(1, None, 2))
    assert v.sizes == {"hosts": 2, "procs": 2}
    assert ranks(v) == [1, 3, 5, 7]
    assert mesh.slice().mesh_shape == mesh.mesh_shape
    # slices compose relative to the view, over global ranks
    assert ranks(mesh.slice(hosts=1).slice(procs=slice(1, 3))) == [5, 6]


def test_rename_flatten_split_transpose(mesh):
    r = mesh.rename(procs="gpus")
    assert r.names == ("hosts", "gpus") and ranks(r) == list(range(8))
    f = mesh[:, ::2].flatten("r")  # a sparse view flattens too
    assert f.sizes == {"r": 4} and ranks(f) == [0, 2, 4, 6]
    s = mesh.split(procs=("a", "b"), b=2)
    assert s.sizes == {"hosts": 2, "a": 2, "b": 2} and ranks(s) == list(range(8))
    t = mesh.transpose("procs", "hosts")
    assert t.sizes == {"procs": 4, "hosts": 2}
    assert ranks(t) == GRID.T.ravel().tolist()
    assert ranks(mesh.transpose()) == GRID.T.ravel().tolist()
    for view in (r, f, s, t):
        assert view.payload is mesh.payload


def test_size(mesh):
    assert mesh.size() == 8
    assert mesh.size("procs") == 4
    assert mesh.size(("hosts", "procs")) == 8
    assert mesh.size(["procs"]) == 4
    assert mesh.size(()) == 1
    assert mesh[0].size() == 4


def test_size_unknown_dim(mesh):
    with pytest.raises(ma.DimensionError, match=r"mesh has no dimension 'gpus'; dimensions are \('hosts', 'procs'\)"):
        mesh.size("gpus")
    with pytest.raises(ma.DimensionError):
        mesh.size(("hosts", "gpus"))
    with pytest.raises(ValueError):  # DimensionError is a ValueError (and an IndexError)
        mesh.size("gpus")
    with pytest.raises(TypeError, match="size"):
        mesh.size(3)
    with pytest.raises(TypeError, match="must be str"):
        mesh.size(("hosts", 1))


def test_iter_gives_0d_views_in_row_major_order(mesh):
    views = list(mesh)
    assert len(views) == 8
    assert [v.ndim for v in views] == [0] * 8
    assert [ranks(v) for v in views] == [[r] for r in range(8)]
    assert all(v.payload is mesh.payload for v in views)
    # over a strided view: the global ranks of the view, in its order
    assert [ranks(v)[0] for v in mesh[:, ::-2]] == [3, 1, 7, 5]


def test_zero_d_mesh(mesh):
    point = mesh[1, 2]
    assert point.ndim == 0 and point.shape == () and len(point) == 1
    assert point.sizes == {} and point.size() == 1
    assert ranks(point) == [6]
    assert [ranks(v) for v in point] == [[6]]


def test_index_errors_come_from_shape(mesh):
    with pytest.raises(IndexError, match="out of bounds"):
        mesh[2]
    with pytest.raises(IndexError, match="too many indices"):
        mesh[0, 0, 0]
    with pytest.raises(ma.DimensionError, match="'gpus'"):
        mesh.slice(gpus=0)
    with pytest.raises(ma.DimensionError):
        mesh[{"gpus": 0}]
    with pytest.raises(TypeError):
        mesh[1.5]


def test_hooks_are_required():
    class Bare(MeshTrait):
        pass

    with pytest.raises(NotImplementedError, match="_mesh_shape"):
        Bare().names
    with pytest.raises(NotImplementedError, match="_with_mesh_shape"):
        Bare()._with_mesh_shape(ma.Shape(procs=1))


def test_views_pickle_through_their_shape(mesh):
    view = mesh[1, ::2]
    assert pickle.loads(pickle.dumps(view.mesh_shape)) == view.mesh_shape
