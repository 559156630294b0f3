"""Unit tests of ``mesharray.Shape``: construction, attributes, indexing, reshaping, identity."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

from mesharray import DimensionError, MeshIndexError, Shape


@pytest.fixture
def s():
    return Shape({"hosts": 2, "procs": 4})


def np_ranks(sizes):
    return np.arange(int(np.prod(sizes, dtype=np.int64))).reshape(sizes)


# ---------------------------------------------------------------- construction


def test_dense_shape_attributes(s):
    assert s.names == ("hosts", "procs")
    assert s.sizes == (2, 4)
    assert s.strides == (4, 1)
    assert s.offset == 0
    assert s.ndim == 2
    assert s.size == len(s) == 8
    assert s.extent == {"hosts": 2, "procs": 4}
    assert list(s) == list(range(8))
    assert s.ranks().dtype == np.int64
    assert s.ranks().tolist() == list(range(8))


def test_keyword_constructor_equals_mapping(s):
    assert Shape(hosts=2, procs=4) == s
    assert Shape() == Shape({})
    assert Shape().size == 1 and Shape().ndim == 0 and Shape().ranks().tolist() == [0]


def test_ranks_is_a_fresh_array(s):
    r = s.ranks()
    r[0] = 99
    assert s.ranks()[0] == 0


@pytest.mark.parametrize(
    "args, exc, msg",
    [
        (({"a": -1},), ValueError, "size of dimension 'a' must be non-negative, got -1"),
        (({"a": 1.5},), TypeError, "size of dimension 'a' must be an int, not float"),
        (({1: 2},), TypeError, "dimension names must be str"),
        (({"": 2},), ValueError, "dimension names must be non-empty"),
        (([("a", 2)],), TypeError, "takes a mapping"),
    ],
)
def test_constructor_errors(args, exc, msg):
    with pytest.raises(exc, match=msg.replace("(", r"\(").replace(")", r"\)")):
        Shape(*args)


def test_constructor_mapping_and_keywords_is_an_error():
    with pytest.raises(TypeError, match="either as a mapping or as keywords"):
        Shape({"a": 2}, b=3)


def test_too_many_dims_is_an_error():
    with pytest.raises(ValueError, match="at most 32 dimensions"):
        Shape({f"d{i}": 1 for i in range(33)})


def test_from_view():
    v = Shape.from_view(("a", "b"), 11, (2, 3), (-5, 2))
    assert v.ranks().tolist() == [11, 13, 15, 6, 8, 10]
    assert v.offset == 11 and v.strides == (-5, 2) and v.sizes == (2, 3)
    with pytest.raises(ValueError, match="negative rank -1"):
        Shape.from_view(("a",), 1, (3,), (-1,))
    with pytest.raises(ValueError, match="same length"):
        Shape.from_view(("a",), 0, (3, 2), (1,))
    with pytest.raises(ValueError, match="duplicate dimension names"):
        Shape.from_view(("a", "a"), 0, (3, 2), (2, 1))


def test_from_ranks_normalises_to_strided():
    v = Shape.from_ranks(("a", "b"), (2, 2), [9, 7, 5, 3])
    assert v.strides == (-4, -2) and v.offset == 9
    assert v == Shape.from_view(("a", "b"), 9, (2, 2), (-4, -2))
    e = Shape.from_ranks(("a",), (3,), [7, 2, 5])
    assert e.strides is None
    assert e.ranks().tolist() == [7, 2, 5]
    assert e.offset == 7
    assert Shape.from_ranks(("a", "b"), (0, 3), []).size == 0


def test_from_ranks_errors():
    with pytest.raises(ValueError, match="3 ranks do not fill sizes"):
        Shape.from_ranks(("a",), (2,), [0, 1, 2])
    with pytest.raises(ValueError, match="non-negative"):
        Shape.from_ranks(("a",), (2,), [0, -1])
    with pytest.raises(TypeError, match="ranks must be integers"):
        Shape.from_ranks(("a",), (2,), [0.5, 1.0])


# ---------------------------------------------------------------- rank algebra


def test_rank_index_of_coordinates_rank_of(s):
    v = s[:, 1::2]
    assert v.ranks().tolist() == [1, 3, 5, 7]
    assert [v.rank(i) for i in range(4)] == [1, 3, 5, 7]
    assert v.rank(-1) == 7
    assert v.index_of(5) == 2
    assert v.coordinates(5) == {"hosts": 1, "procs": 0}
    assert v.rank_of({"hosts": 1, "procs": 1}) == 7
    assert v.rank_of((1, -1)) == 7
    assert v.rank_of([np.int64(0), 1]) == 3
    assert 3 in v and 2 not in v and "x" not in v


def test_rank_algebra_errors(s):
    v = s[:, 1::2]
    with pytest.raises(MeshIndexError, match="index 4 is out of bounds for a mesh of 4 ranks"):
        v.rank(4)
    with pytest.raises(ValueError, match="rank 2 is not in Shape"):
        v.index_of(2)
    with pytest.raises(ValueError, match="rank 2 is not in"):
        v.coordinates(2)
    with pytest.raises(TypeError, match="rank must be an int"):
        v.index_of(1.0)
    with pytest.raises(DimensionError, match="mesh has no dimension 'gpu'; dimensions are \\('hosts', 'procs'\\)"):
        v.rank_of({"gpu": 0, "hosts": 0, "procs": 0})
    with pytest.raises(ValueError, match="miss dimensions \\('procs',\\)"):
        v.rank_of({"hosts": 0})
    with pytest.raises(ValueError, match="3 coordinates given for a mesh of 2 dimensions"):
        v.rank_of((0, 0, 0))
    with pytest.raises(MeshIndexError, match="index 2 is out of bounds for axis 1 \\('procs'\\) with size 2"):
        v.rank_of((0, 2))
    with pytest.raises(TypeError, match="coordinate of 'hosts' must be an int"):
        v.rank_of((0.0, 0))
    with pytest.raises(TypeError, match="coordinates must be a dict or a sequence"):
        v.rank_of(3)


@pytest.mark.parametrize(
    "view",
    [
        lambda s: s[:, ::-1],
        lambda s: s[::-1, 1::2],
        lambda s: s[:, [3, 0, 3]],
        lambda s: s[None, :, 2],
        lambda s: s.transpose(),
        lambda s: Shape.from_view(("a", "b"), 2, (3, 3), (1, 1)),
    ],
)
def test_index_of_and_coordinates_round_trip(s, view):
    v = view(s)
    ranks = v.ranks().tolist()
    for pos, r in enumerate(ranks):
        first = ranks.index(r)
        assert v.index_of(r) == first
        assert v.rank_of(v.coordinates(r)) == r
        assert v.rank(pos) == r


# ---------------------------------------------------------------- indexing


def test_basic_indexing_stays_strided(s):
    v = s[1, ::-2]
    assert v.names == ("procs",)
    assert v.sizes == (2,) and v.strides == (-2,) and v.offset == 7
    assert v.ranks().tolist() == [7, 5]
    assert s[0].names == ("procs",)
    z = s[1, 2]
    assert z.ndim == 0 and z.size == 1 and z.names == () and z.ranks().tolist() == [6]
    assert s[...] == s and s[()] == s and s[:] == s


def test_views_of_views(s):
    v = s[:, ::-1][::-1, 1:][1]
    assert v.ranks().tolist() == np_ranks((2, 4))[:, ::-1][::-1, 1:][1].tolist()


def test_none_makes_named_size_one_dims(s):
    v = s[None, :, None]
    assert v.names == ("_0", "hosts", "_2", "procs")
    assert v.sizes == (1, 2, 1, 4)
    assert Shape(_0=2)[None].names == ("_0_", "_0")


def test_advanced_indexing_names(s):
    assert s[:, [0, 3]].names == ("hosts", "procs")
    assert s[[0, 1], [1, 2]].names == ("hosts_procs",)
    assert s[np.ones((2, 4), bool)].names == ("hosts_procs",)
    assert s[:, [[0, 1]]].names == ("hosts", "procs_0", "procs_1")
    assert s[1, [0, 2]].names == ("procs",)
    assert s[True].names == ("_0", "hosts", "procs")
    t = Shape(a=2, b=3, c=4)
    # separated advanced indices put their broadcast dim first, as NumPy does
    assert t[[0, 1], :, [0, 1]].names == ("a_c", "b")
    assert t[[0, 1], :, [0, 1]].ranks().tolist() == np_ranks((2, 3, 4))[[0, 1], :, [0, 1]].ravel().tolist()
    assert t[0, :, [1, 2]].names == ("c", "b")
    # a made name that clashes is made unique
    assert Shape(a=2, b=2, a_b=2)[[0], [0]].names == ("a_b_1", "a_b")


def test_advanced_result_is_explicit_unless_strided(s):
    assert s[:, [0, 3]].strides == (4, 3)
    e = s[:, [3, 0, 2]]
    assert e.strides is None
    assert e.ranks().tolist() == [3, 0, 2, 7, 4, 6]
    assert repr(e) == "Shape{hosts=2, procs=3; ranks=[3, 0, 2, 7, 4, 6]}"
    # basic indexing of an explicit view stays a view over the same ranks
    assert e[1, ::-1].ranks().tolist() == [6, 4, 7]
    assert e[:, 1:].ranks().tolist() == [0, 2, 4, 6]


def test_integer_likes(s):
    assert s[np.int64(1)] == s[1]
    assert s[np.array(1)] == s[1]
    assert s[np.intp(-1), np.uint8(2)] == s[1, 2]
    assert s[range(2)] == s


def test_named_indexing(s):
    assert s[{"procs": 1}] == s[:, 1]
    assert s.slice(procs=1, hosts=slice(0, 2)) == s[0:2, 1]
    assert s.slice(procs=[0, 2]) == s[:, [0, 2]]
    assert s.slice(hosts=np.array([False, True])) == s[[False, True]]
    assert s.slice() == s
    with pytest.raises(DimensionError, match="mesh has no dimension 'gpu'; dimensions are \\('hosts', 'procs'\\)"):
        s.slice(gpu=0)
    with pytest.raises(TypeError, match="must be an int, a slice"):
        s.slice(procs=None)


@pytest.mark.parametrize(
    "idx, msg",
    [
        (2, "index 2 is out of bounds for axis 0 ('hosts') with size 2"),
        ((0, -5), "index -5 is out of bounds for axis 1 ('procs') with size 4"),
        ((slice(None), [4]), "index 4 is out of bounds for axis 1 ('procs') with size 4"),
        ((0, 0, 0), "too many indices for mesh: mesh is 2-dimensional, but 3 were indexed"),
        ((Ellipsis, 0, Ellipsis), "an index can only have a single ellipsis ('...')"),
        (np.zeros(3, bool), "boolean index did not match indexed mesh along axis 0 ('hosts'); size of axis is 2 "
                            "but size of corresponding boolean axis is 3"),
        (([0, 1], [0, 1, 2]), "shape mismatch: indexing arrays could not be broadcast together"),
        (2**70, "index 1180591620717411303424 is out of bounds"),
    ],
)
def test_index_errors(s, idx, msg):
    with pytest.raises(IndexError) as info:
        s[idx]
    assert isinstance(info.value, MeshIndexError)
    assert msg in str(info.value)


def test_empty_sequences_are_integer_indices_but_empty_float_arrays_are_not(s):
    assert s[[]].sizes == (0, 4)
    assert s[[], []].sizes == (0,)
    assert s[[[]]].sizes == (1, 0, 4)
    with pytest.raises(IndexError, match="must be of integer"):
        s[np.array([])]


@pytest.mark.parametrize(
    "idx", [1.0, "procs", (0, "a"), [1.0], (0, object()), slice("a"), np.array(1.0), [slice(None), 0]]
)
def test_index_type_errors(s, idx):
    with pytest.raises(TypeError) as info:
        s[idx]
    # NumPy raises IndexError for most of these; ours is both
    if not isinstance(idx, slice):
        assert isinstance(info.value, IndexError)


# ---------------------------------------------------------------- reshaping


def test_rename(s):
    r = s.rename(procs="gpus")
    assert r.names == ("hosts", "gpus") and r.ranks().tolist() == s.ranks().tolist()
    assert s.rename(hosts="procs", procs="hosts").names == ("procs", "hosts")
    with pytest.raises(DimensionError, match="no dimension 'x'"):
        s.rename(x="y")
    with pytest.raises(ValueError, match="duplicate dimension names \\('procs',\\)"):
        s.rename(hosts="procs")


@pytest.mark.parametrize(
    "view",
    [
        lambda s: s,
        lambda s: s[:, ::2],
        lambda s: s[:, 1:3],
        lambda s: s[::-1, ::-1],
        lambda s: s[:, [3, 0]],
        lambda s: s.transpose(),
        lambda s: s[1],
        lambda s: s[0, 0],
        lambda s: s[:, 4:],
        lambda s: s[[True, False]][:, [2, 2]],
    ],
)
def test_flatten_any_view(s, view):
    v = view(s)
    f = v.flatten("all")
    assert f.names == ("all",)
    assert f.sizes == (v.size,)
    assert f.ranks().tolist() == v.ranks().tolist()


def test_flatten_keeps_strided_when_possible(s):
    assert s.flatten("x") == Shape(x=8)
    assert s[:, ::2].flatten("x").strides == (2,)
    assert s[:, 1:3].flatten("x").strides is None
    with pytest.raises(TypeError, match="must be a str"):
        s.flatten(1)


def test_split():
    m = Shape(hosts=2, gpus=8)
    v = m.split(gpus=("tp", "dp"), tp=2)
    assert v.names == ("hosts", "tp", "dp") and v.sizes == (2, 2, 4)
    assert v.ranks().tolist() == list(range(16))
    w = m.split(hosts=("a", "b"), gpus=("c", "d"), a=1, c=4)
    assert w.sizes == (1, 2, 4, 2)
    assert w.ranks().tolist() == list(range(16))
    # on a view, the split stays a view
    x = m[:, ::-2].split(gpus=("a", "b"), b=2)
    assert x.ranks().tolist() == np_ranks((2, 8))[:, ::-2].reshape(2, 2, 2).ravel().tolist()
    # the split dim's own name may be reused
    assert m.split(gpus=("gpus", "x"), x=2).names == ("hosts", "gpus", "x")


@pytest.mark.parametrize(
    "kwargs, exc, msg",
    [
        (dict(gpus=("a", "b"), a=3), ValueError, "dimension 'gpus' of size 8 cannot be split evenly by 3"),
        (dict(gpus=("a", "b", "c"), a=2), ValueError, "cannot infer the sizes of ('b', 'c')"),
        (dict(gpus=("a", "b"), a=2, z=3), ValueError, "sizes given for ('z',), which no split creates"),
        (dict(gpus=("a", "hosts"), a=2), ValueError, "duplicate dimension names ('hosts',)"),
        (dict(gpus=("a", "b"), a=2, b=2), ValueError, "has size 8 but the sizes of ('a', 'b') multiply to 4"),
        (dict(nope=("a", "b")), DimensionError, "no dimension 'nope'"),
        (dict(gpus="ab"), TypeError, "split() takes"),
    ],
)
def test_split_errors(kwargs, exc, msg):
    with pytest.raises(exc) as info:
        Shape(hosts=2, gpus=8).split(**kwargs)
    assert msg in str(info.value)


def test_transpose(s):
    t = Shape(a=2, b=3, c=4)
    ref = np_ranks((2, 3, 4))
    assert t.transpose().names == ("c", "b", "a")
    assert t.transpose().ranks().tolist() == ref.T.ravel().tolist()
    assert t.transpose("b", 0, -1).ranks().tolist() == ref.transpose(1, 0, 2).ravel().tolist()
    assert t.transpose(("c", "a", "b")) == t.transpose(2, 0, 1)
    assert s[:, [3, 0, 1]].transpose().ranks().tolist() == np_ranks((2, 4))[:, [3, 0, 1]].T.ravel().tolist()
    with pytest.raises(ValueError, match="axes don't match mesh"):
        t.transpose("a", "b")
    with pytest.raises(ValueError, match="repeated axis"):
        t.transpose("a", "a", 0)
    with pytest.raises(DimensionError, match="axis 3 is out of bounds for mesh of dimension 3"):
        t.transpose(0, 1, 3)
    with pytest.raises(TypeError, match="a dimension is a name"):
        t.transpose(0, 1, 2.0)


# ---------------------------------------------------------------- identity


def test_equality_is_by_layout_not_representation(s):
    assert s[:, [0, 1]] == s[:, 0:2]
    assert hash(s[:, [0, 1]]) == hash(s[:, 0:2])
    assert s[:, [3, 0]][:, ::-1] == s[:, [0, 3]]
    assert hash(s[:, [3, 0, 2]][:, ::-1]) == hash(s[:, [2, 0, 3]])
    assert s[:, ::-1] != s
    assert s != s.rename(hosts="h")
    assert s[0:1] == Shape.from_view(("hosts", "procs"), 0, (1, 4), (123, 1))
    assert s[:, 4:] == s[:, 3:3]
    assert (s == 3) is False
    assert len({s, Shape(hosts=2, procs=4), s[:, ::1]}) == 1


@pytest.mark.parametrize(
    "view",
    [lambda s: s, lambda s: s[::-1, 1::2], lambda s: s[:, [3, 0, 2]], lambda s: s[1, 2], lambda s: s[:, :0]],
)
def test_pickle_and_copy(s, view):
    v = view(s)
    for w in (pickle.loads(pickle.dumps(v)), copy.deepcopy(v), copy.copy(v)):
        assert w == v and hash(w) == hash(v)
        assert w.ranks().tolist() == v.ranks().tolist()
        assert w.names == v.names


def test_repr(s):
    assert repr(s) == "Shape{hosts=2, procs=4}"
    assert repr(s[:, 1::2]) == "Shape{hosts=2, procs=2; offset=1, strides=(4, 2)}"
    assert repr(s[1, 2]) == "Shape{offset=6}"
    assert repr(Shape()) == "Shape{}"
    assert repr(Shape(a=20)[[i % 3 for i in range(20)]]).endswith(", ...]}")


def test_docstring_examples_run():
    import doctest

    from mesharray import _core

    result = doctest.testmod(_core, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 20
    assert result.failed == 0


def test_repeated_basic_indexing_of_one_shape_keeps_names_right():
    t = Shape(a=2, b=3, c=4)
    seq = [(0,), (slice(None), 0), (0,), (Ellipsis, 1), (0, 0), (None, 0), (0,), (slice(None), 1, 1)]
    expected = [("b", "c"), ("a", "c"), ("b", "c"), ("a", "b"), ("c",), ("_0", "b", "c"), ("b", "c"), ("a",)]
    for _ in range(2):
        assert [t[i].names for i in seq] == expected
