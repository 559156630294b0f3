"""std/var and argmin/argmax over mesh axes of distributed arrays run as collectives and equal NumPy."""

from __future__ import annotations

import numpy as np
import pytest

import mesharray as ma
from tests.support.procs import mesh_fixture

pytestmark = pytest.mark.timeout(120)


procs = mesh_fixture(hosts=2, procs=3)



@pytest.mark.parametrize("axis", ["procs", "hosts", None, ("hosts", "procs"), 2, ("procs", 2)])
@pytest.mark.parametrize("ddof", [0, 1])
def test_var_and_std_equal_numpy_without_gathering(procs, axis, ddof):
    x = (procs.arange(4, dtype="float64") * 7.5 + procs.rank_array() * 3.25) % 5 + 1e6  # a large offset
    ref = np.asarray(x.fetch())
    idx = {"hosts": 0, "procs": 1}
    np_axis = None if axis is None else (tuple(idx.get(a, a) for a in axis) if isinstance(axis, tuple)
                                          else idx.get(axis, axis))
    v, s = x.var(axis=axis, ddof=ddof), x.std(axis=axis, ddof=ddof)
    assert type(v._storage).__name__ == "DistributedStorage"  # computed where the blocks live
    np.testing.assert_allclose(np.asarray(v.fetch()), ref.var(axis=np_axis, ddof=ddof), rtol=1e-9)
    np.testing.assert_allclose(np.asarray(s.fetch()), ref.std(axis=np_axis, ddof=ddof), rtol=1e-9)


def test_var_of_ints_is_float_and_keepdims(procs):
    x = procs.rank_array() * 2
    ref = np.asarray(x.fetch())
    v = x.var(axis="procs", keepdims=True)
    got = np.asarray(v.fetch())
    assert got.dtype == np.float64 and got.shape == ref.var(axis=1, keepdims=True).shape
    np.testing.assert_allclose(got, ref.var(axis=1, keepdims=True))


@pytest.mark.parametrize("axis", ["procs", "hosts", 0, 1])
def test_argmin_argmax_along_a_mesh_axis_equal_numpy(procs, axis):
    x = (procs.arange(5, dtype="float64") * 3 + procs.rank_array() * 2) % 4  # many ties
    ref = np.asarray(x.fetch())
    i = {"hosts": 0, "procs": 1}.get(axis, axis)
    am, aM = x.argmin(axis=axis), x.argmax(axis=axis)
    assert type(am._storage).__name__ == "DistributedStorage"
    np.testing.assert_array_equal(np.asarray(am.fetch()), ref.argmin(axis=i))  # ties: the first, as NumPy
    np.testing.assert_array_equal(np.asarray(aM.fetch()), ref.argmax(axis=i))
    np.testing.assert_array_equal(np.asarray(x.argmin(axis=axis, keepdims=True).fetch()),
                                  ref.argmin(axis=i, keepdims=True))


def test_argmin_with_nan_and_inf_follows_numpy(procs):
    x = procs.arange(3, dtype="float64") + procs.rank_array()
    bad = x / (procs.rank_array() - 4)  # rank 4: x / 0 = inf
    ref = np.asarray(bad.fetch())
    np.testing.assert_array_equal(np.asarray(bad.argmax(axis="procs").fetch()), ref.argmax(axis=1))
    withnan = bad - bad  # inf - inf = nan on rank 4
    ref = np.asarray(withnan.fetch())
    np.testing.assert_array_equal(np.asarray(withnan.argmin(axis="procs").fetch()), ref.argmin(axis=1))


@pytest.mark.parametrize("dim", ["procs", "hosts"])
def test_all_to_all_is_mpi_alltoall(procs, dim):
    x = procs.arange(6) + 10 * procs.rank_array()
    ref = np.asarray(x.fetch())
    got = np.asarray(ma.all_to_all(x, dim).fetch())
    n = 3 if dim == "procs" else 2
    k = 6 // n
    want = np.empty_like(ref)
    for a in range(ref.shape[0]):
        for b in range(ref.shape[1]):
            j = b if dim == "procs" else a
            members = [ref[a, i] for i in range(3)] if dim == "procs" else [ref[i, b] for i in range(2)]
            want[a, b] = np.concatenate([m[j * k:(j + 1) * k] for m in members])
    np.testing.assert_array_equal(got, want)


def test_all_to_all_refuses_blocks_it_cannot_cut(procs):
    with pytest.raises(ValueError, match="multiple of 3"):
        ma.all_to_all(procs.arange(4), "procs")
    with pytest.raises(TypeError, match="one mesh dim"):
        ma.all_to_all(procs.arange(6), ("hosts", "procs"))


@pytest.mark.parametrize("axis, np_axis", [("procs", 1), ("hosts", 0), (2, 2), (-1, 2)])
@pytest.mark.parametrize("shift", [1, -1, 2, 7])
def test_roll_equals_numpy_and_moves_blocks_between_workers(procs, axis, np_axis, shift):
    x = procs.arange(4) + 10 * procs.rank_array()
    ref = np.asarray(x.fetch())
    y = x.roll(shift, axis=axis)
    assert type(y._storage).__name__ == "DistributedStorage"  # the blocks stayed in the workers
    np.testing.assert_array_equal(np.asarray(y.fetch()), np.roll(ref, shift, axis=np_axis))


def test_roll_of_gathered_values_and_of_everything(procs):
    a = ma.MeshArray(np.arange(6).reshape(2, 3), ["hosts", "procs"])
    np.testing.assert_array_equal(a.roll(1, axis="procs").to_numpy(), np.roll(np.arange(6).reshape(2, 3), 1, 1))
    x = procs.arange(2) + 10 * procs.rank_array()
    np.testing.assert_array_equal(np.asarray(x.roll(3).fetch()), np.roll(np.asarray(x.fetch()), 3))
    with pytest.raises(TypeError, match="one integer shift"):
        x.roll(1.5, axis="procs")


@pytest.mark.parametrize("dtype", ["float32", "complex128"])
def test_var_of_float32_and_complex_follow_numpy(procs, dtype):
    x = ((procs.arange(6, dtype="float64") - 2.5) * (procs.rank_array() + 1)).astype(dtype)
    if dtype == "complex128":
        x = x * (1 + 2j) + 3j
    ref = np.asarray(x.fetch())
    for axis in ("procs", None, ("hosts", 2)):
        np_axis = {"procs": 1, None: None}.get(axis, (0, 2)) if not isinstance(axis, tuple) else (0, 2)
        v = x.var(axis=axis)
        assert np.asarray(v.fetch()).dtype == ref.var(axis=np_axis).dtype
        np.testing.assert_allclose(np.asarray(v.fetch()), ref.var(axis=np_axis), rtol=1e-5)


def test_var_is_stable_with_a_large_offset(procs):
    # E[x^2] - E[x]^2 would lose every digit here; the pairwise combination keeps them
    x = procs.arange(8, dtype="float64") * 1e-3 + procs.rank_array() * 1e-3 + 1e6
    ref = np.asarray(x.fetch())
    naive = (ref ** 2).mean(axis=(0, 1)) - ref.mean(axis=(0, 1)) ** 2
    assert not np.allclose(naive, ref.var(axis=(0, 1)), rtol=1e-3)  # the textbook formula fails here
    np.testing.assert_allclose(np.asarray(x.var(axis=("hosts", "procs")).fetch()),
                               ref.var(axis=(0, 1)), rtol=1e-5)
    np.testing.assert_allclose(float(np.asarray(x.std().fetch())), ref.std(), rtol=1e-5)
