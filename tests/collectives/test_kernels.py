"""The nogil reduction kernels of _core against NumPy as the oracle."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesharray._core import REDUCE_OPS, buffer_address, copy_bytes, reduce_addresses, reduce_buffers

DTYPES = ["float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
NP_OPS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


def _inputs(dtype, nsrc, n, seed=0):
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt.kind == "f":
        return [rng.standard_normal(n).astype(dt) for _ in range(nsrc)]
    info = np.iinfo(dt)
    return [rng.integers(max(info.min, -50), min(info.max, 50), n, endpoint=True).astype(dt) for _ in range(nsrc)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("nsrc", [1, 2, 3, 5])
def test_matches_numpy_reduce_over_stacked_sources(dtype, op, nsrc):
    srcs = _inputs(dtype, nsrc, 5000)  # > one block of the blocked loop
    out = reduce_buffers(np.empty(5000, dtype), srcs, op)
    expected = NP_OPS[op].reduce(np.stack(srcs), axis=0, dtype=np.dtype(dtype))
    # floats: same association order as NumPy's axis-0 reduction, so bit-identical
    np.testing.assert_array_equal(out, expected)


@given(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=1, max_size=40),
       st.sampled_from(REDUCE_OPS))
@settings(max_examples=60, deadline=None)
def test_nan_and_inf_follow_numpy(values, op):
    a = np.array(values, dtype="float32")
    b = a[::-1].copy()
    with np.errstate(all="ignore"):
        expected = NP_OPS[op](a, b)
    np.testing.assert_array_equal(reduce_buffers(np.empty_like(a), [a, b], op), expected)


def test_in_place_and_empty():
    a = np.arange(4, dtype="int64")
    reduce_buffers(a, [a, np.ones(4, "int64")], "sum")
    assert a.tolist() == [1, 2, 3, 4]
    e = np.empty(0, "float32")
    assert reduce_buffers(e, [e, e]).size == 0


def test_integer_overflow_wraps_like_numpy():
    a = np.array([120, -120], dtype="int8")
    np.testing.assert_array_equal(reduce_buffers(np.empty(2, "int8"), [a, a]), np.add(a, a))


def test_reduce_addresses_on_raw_memory():
    srcs = _inputs("float64", 3, 1000, seed=3)
    out = np.empty(1000)
    reduce_addresses(buffer_address(out, True)[0], [buffer_address(s)[0] for s in srcs], 1000, "float64", "max")
    np.testing.assert_array_equal(out, np.maximum.reduce(srcs))


def test_copy_bytes():
    src = np.arange(100000, dtype="uint8")
    dst = np.zeros_like(src)
    copy_bytes(buffer_address(dst, True)[0], buffer_address(src)[0], src.nbytes)
    np.testing.assert_array_equal(dst, src)
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        copy_bytes(0, 0, -1)


def test_bad_arguments():
    a = np.ones(3, "float32")
    with pytest.raises(ValueError, match="unknown reduction op 'avg'"):
        reduce_buffers(np.empty(3, "float32"), [a], "avg")
    with pytest.raises(TypeError, match="input 1 has buffer format"):
        reduce_buffers(np.empty(3, "float32"), [a, np.ones(3, "float64")])
    with pytest.raises(ValueError, match="input 0 has 8 bytes, the output has 12"):
        reduce_buffers(np.empty(3, "float32"), [np.ones(2, "float32")])
    with pytest.raises(TypeError, match="got buffer format '\\?'"):
        reduce_buffers(np.empty(3, bool), [np.ones(3, bool)])
    with pytest.raises(TypeError, match="got buffer format"):
        reduce_buffers(np.empty(3, "complex64"), [np.ones(3, "complex64")])
    with pytest.raises(ValueError, match="at least one input"):
        reduce_buffers(np.empty(3, "float32"), [])
    with pytest.raises(ValueError):
        reduce_buffers(np.ones(3, "float32")[::2], [a[::2]])
    ro = np.ones(3, "float32")
    ro.flags.writeable = False
    with pytest.raises(ValueError):
        reduce_buffers(ro, [a])
    with pytest.raises(TypeError, match="got 'float16'"):
        reduce_addresses(0, [0], 0, "float16")
