"""The nogil reduction kernels of _core against NumPy as the oracle."""

import errno
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesharray import _platform
from mesharray._core import (
    REDUCE_OPS,
    buffer_address,
    copy_bytes,
    reduce_addresses,
    reduce_buffers,
    reduce_remote,
    vm_copy,
)

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


# --- cross-memory attach kernels (this process plays the peers: its own pid) ------------

def _cma_works() -> bool:
    word = np.zeros(2, dtype=np.int64)
    return vm_copy(False, os.getpid(), buffer_address(word, True)[0], buffer_address(word)[0] + 8, 8) == 0


needs_cma = pytest.mark.skipif(not _platform.LINUX_NATIVE or not _cma_works(),
                               reason="cross-memory attach needs Linux (and not MESHARRAY_PORTABLE), and the kernel's leave")


@needs_cma
def test_vm_copy_both_ways_and_errors():
    src = np.arange(300_000, dtype="uint8")
    dst = np.zeros_like(src)
    me = os.getpid()
    assert vm_copy(False, me, buffer_address(dst, True)[0], buffer_address(src)[0], src.nbytes) == 0
    np.testing.assert_array_equal(dst, src)
    dst[:] = 0
    assert vm_copy(True, me, buffer_address(src)[0], buffer_address(dst, True)[0], src.nbytes) == 0
    np.testing.assert_array_equal(dst, src)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert vm_copy(False, gone.pid, buffer_address(dst, True)[0], buffer_address(src)[0], 8) == errno.ESRCH
    assert vm_copy(False, me, buffer_address(dst, True)[0], 8, 8) == errno.EFAULT
    with pytest.raises(ValueError, match="nbytes must be >= 0, got -1"):
        vm_copy(False, me, 0, 0, -1)


@needs_cma
@pytest.mark.parametrize("dtype", ["float32", "float64", "int8", "uint64"])
@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce_remote_pulls_reduces_and_pushes(dtype, op):
    # member 1 of 3 owns source 1 and outs[1]; the "peers" are this process's own memory,
    # read and written by pid through cross-memory attach
    n, chunk = 10_007, 1024  # a last chunk that is not full
    srcs = _inputs(dtype, 3, n, seed=7)
    outs = [np.zeros(n, dtype) for _ in range(3)]
    scratch = np.zeros(3 * chunk, np.uint8)
    me = os.getpid()
    got = reduce_remote(buffer_address(outs[1], True)[0], [buffer_address(s)[0] for s in srcs], [me, 0, me],
                        [buffer_address(outs[0], True)[0], 0, buffer_address(outs[2], True)[0]],
                        n, dtype, op, buffer_address(scratch, True)[0], chunk)
    assert got == (-1, 0)
    expected = NP_OPS[op].reduce(np.stack(srcs), axis=0, dtype=np.dtype(dtype))
    for out in outs:
        np.testing.assert_array_equal(out, expected)


@needs_cma
def test_reduce_remote_takes_chunks_from_shared_counters():
    n, chunk, base = 10_000, 800, 1000  # 100 float64 per chunk: 100 chunks
    a, b = np.arange(n, dtype="float64"), np.ones(n)
    out = np.zeros(n)
    counters = np.zeros(3 * 8, dtype=np.int64)  # claimed, finished, fault: 64 bytes apart
    counters[[0, 8]] = base
    counters[0] += 30  # another member took chunks 0..29 (and is still at them)
    scratch = np.zeros(2 * chunk, np.uint8)
    got = reduce_remote(buffer_address(out, True)[0], [buffer_address(a)[0], buffer_address(b)[0]],
                        [0, os.getpid()], [0, 0], n, "float64", "sum", buffer_address(scratch, True)[0],
                        chunk, buffer_address(counters, True)[0], base, 5)
    assert got == (-1, 0)
    assert counters[0] == base + 100 and counters[8] == base + 70 and counters[16] == 0
    np.testing.assert_array_equal(out[:3000], 0)  # not this call's chunks
    np.testing.assert_array_equal(out[3000:], a[3000:] + 1)
    # a failing source: the chunks are counted all the same, and the fault word is marked
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    counters[[0, 8]] = base
    got = reduce_remote(buffer_address(out, True)[0], [buffer_address(a)[0], buffer_address(b)[0]],
                        [0, gone.pid], [0, 0], n, "float64", "sum", buffer_address(scratch, True)[0],
                        chunk, buffer_address(counters, True)[0], base, 5)
    assert got == (1, errno.ESRCH)
    assert counters[0] == counters[8] == base + 100 and counters[16] == 5


@needs_cma
def test_reduce_remote_in_place_and_errors():
    a, b = np.arange(5000.0), np.ones(5000)
    want = a + b
    scratch = np.zeros(2 * 4096, np.uint8)
    addr = [buffer_address(a, True)[0], buffer_address(b)[0]]
    # out is source 1: it must be read before the kernel copies source 0 over it
    assert reduce_remote(addr[0], [addr[1], addr[0]], [os.getpid(), 0], [0, 0], 5000, "float64", "sum",
                         buffer_address(scratch, True)[0], 4096) == (-1, 0)
    np.testing.assert_array_equal(a, want)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert reduce_remote(addr[0], addr, [0, gone.pid], [0, 0], 5000, "float64", "sum",
                         buffer_address(scratch, True)[0], 4096) == (1, errno.ESRCH)
    with pytest.raises(ValueError, match="one pid and one destination per source; got 2 sources, 1 pids"):
        reduce_remote(0, [0, 0], [0], [0, 0], 1, "float64", "sum", 0, 4096)
    with pytest.raises(ValueError, match="chunk must be >= the item size 8, got 4"):
        reduce_remote(0, [0], [0], [0], 1, "float64", "sum", 0, 4)
