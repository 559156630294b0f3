"""Tensor engines: numpy and torch (cpu) fully; GPU engines skip naming the missing device."""

import subprocess
import sys

import numpy as np
import pytest

from mesharray.engines import Engine, available_engines, get_engine, register_engine, resolve_engine_name
from mesharray.errors import EngineUnavailableError

torch = pytest.importorskip("torch")


def _device_skip(kind):
    eng = None
    try:
        eng = get_engine(kind)
    except EngineUnavailableError as exc:
        pytest.skip(f"no {kind} device here: {exc}")
    return eng


DEVICES = ["cuda", "rocm", "mps", "xla"]
# every test below runs on each engine this machine has (GPU engines when a GPU is lent)
ENGINES = ["numpy", "torch"] + [k for k in DEVICES if k in available_engines()]


@pytest.fixture(params=ENGINES)
def eng(request):
    return get_engine(request.param)


@pytest.mark.parametrize("kind", DEVICES)
def test_device_engine(kind):
    eng = _device_skip(kind)
    assert eng.name == kind and eng.device != "cpu"
    x = eng.from_numpy(np.arange(4.0))
    assert eng.to_numpy(eng.reduce("sum", eng.elementwise("multiply", x, 2))) == 12.0


def test_engine_protocol(eng):
    assert isinstance(eng, Engine)
    assert eng.collective_backend in ("shm", "nccl", "gloo", "xla")


def test_allocation_and_host_round_trip(eng):
    for dtype in ("float32", "float64", "int32", "int64"):
        z = eng.zeros((2, 3), dtype)
        assert eng.shape_of(z) == (2, 3) and eng.dtype_of(z) == np.dtype(dtype)
        np.testing.assert_array_equal(eng.to_numpy(z), np.zeros((2, 3), dtype))
        np.testing.assert_array_equal(eng.to_numpy(eng.ones((4,), dtype)), np.ones(4, dtype))
        np.testing.assert_array_equal(eng.to_numpy(eng.full((2,), 7, dtype)), np.full(2, 7, dtype))
        np.testing.assert_array_equal(eng.to_numpy(eng.arange(5, dtype)), np.arange(5, dtype=dtype))
        assert eng.shape_of(eng.empty((3, 1), dtype)) == (3, 1)
    a = np.arange(12.0).reshape(3, 4)
    b = eng.from_numpy(a)
    assert eng.is_block(b) and not eng.is_block([1, 2])
    np.testing.assert_array_equal(eng.to_numpy(b), a)
    ro = np.arange(3.0)
    ro.flags.writeable = False
    np.testing.assert_array_equal(eng.to_numpy(eng.from_numpy(ro)), ro)


def test_rand_is_seeded_and_floating(eng):
    r1 = eng.to_numpy(eng.rand((100,), "float32", seed=3))
    r2 = eng.to_numpy(eng.rand((100,), "float32", seed=3))
    np.testing.assert_array_equal(r1, r2)
    assert r1.dtype == np.float32 and (r1 >= 0).all() and (r1 < 1).all()
    with pytest.raises(TypeError, match="rand needs a floating dtype"):
        eng.rand((2,), "int32")


@pytest.mark.parametrize("op,args", [
    ("add", (np.arange(6.0), 2.0)), ("subtract", (np.arange(6.0), np.ones(6))),
    ("multiply", (np.arange(6.0), 3)), ("true_divide", (np.arange(6.0), 4.0)),
    ("power", (np.arange(6.0), 2)), ("negative", (np.arange(6.0),)), ("sqrt", (np.arange(6.0),)),
    ("maximum", (np.arange(6.0), np.full(6, 2.5))), ("less", (np.arange(6.0), 3.0)),
    ("floor_divide", (np.arange(6), 4)), ("remainder", (np.arange(6), 4)), ("exp", (np.arange(3.0),)),
    ("absolute", (np.arange(-3.0, 3.0),)), ("equal", (np.arange(6), 2)),
])
def test_elementwise_matches_numpy(eng, op, args):
    blocks = [eng.from_numpy(a) if isinstance(a, np.ndarray) else a for a in args]
    got = eng.to_numpy(eng.elementwise(op, *blocks))
    np.testing.assert_allclose(got, getattr(np, op)(*args), rtol=1e-6)


def test_elementwise_rejects_unknown_op(eng):
    with pytest.raises(ValueError, match="unknown elementwise op 'frobnicate'"):
        eng.elementwise("frobnicate", eng.ones((2,), "float32"))


@pytest.mark.parametrize("op", ["sum", "prod", "min", "max", "mean", "std", "var", "argmax", "argmin", "any", "all"])
@pytest.mark.parametrize("axis", [None, 0, 1, (0, 1)])
@pytest.mark.parametrize("keepdims", [False, True])
def test_reductions_match_numpy(eng, op, axis, keepdims):
    a = np.random.default_rng(0).standard_normal((3, 4))
    if op in ("argmax", "argmin") and isinstance(axis, tuple):
        # NumPy refuses a tuple of axes with TypeError; every engine says so clearly
        with pytest.raises(TypeError, match=f"{op} takes one axis, got \\(0, 1\\)"):
            eng.reduce(op, eng.from_numpy(a), axis=axis, keepdims=keepdims)
        return
    got = eng.to_numpy(eng.reduce(op, eng.from_numpy(a), axis=axis, keepdims=keepdims))
    expected = getattr(np, op)(a, axis=axis, keepdims=keepdims)
    assert np.shape(got) == np.shape(expected)
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_matmul_astype_reshape_getitem(eng):
    a, b = np.arange(6.0).reshape(2, 3), np.arange(12.0).reshape(3, 4)
    np.testing.assert_allclose(eng.to_numpy(eng.matmul(eng.from_numpy(a), eng.from_numpy(b))), a @ b)
    c = eng.astype(eng.from_numpy(a), "int32")
    assert eng.dtype_of(c) == np.int32
    np.testing.assert_array_equal(eng.to_numpy(eng.reshape(eng.from_numpy(a), (3, 2))), a.reshape(3, 2))
    np.testing.assert_array_equal(eng.to_numpy(eng.getitem(eng.from_numpy(a), (slice(None), 1))), a[:, 1])


def test_host_view_and_dlpack(eng):
    a = np.arange(8, dtype="float32")
    blk = eng.from_numpy(a)
    hv = eng.host_view(blk)
    assert isinstance(hv, np.ndarray) and hv.flags.c_contiguous
    np.testing.assert_array_equal(hv, a)
    np.testing.assert_array_equal(eng.to_numpy(eng.from_dlpack(eng.to_dlpack(blk))), a)
    eng.synchronize()


def test_cpu_host_view_shares_memory():
    for name in ("numpy", "torch"):
        eng = get_engine(name)
        blk = eng.zeros((4,), "float64")
        eng.host_view(blk)[:] = 5
        assert eng.to_numpy(blk).tolist() == [5.0] * 4


def test_registry():
    assert resolve_engine_name("cpu") == "numpy"
    assert resolve_engine_name("torch:cpu") == "torch"
    assert get_engine("numpy") is get_engine("numpy")
    assert {"numpy", "torch"} <= set(available_engines())
    # on a machine without a GPU, auto is the numpy engine
    if not any(n in available_engines() for n in ("cuda", "rocm", "mps", "xla")):
        assert resolve_engine_name("auto") == "numpy"
    with pytest.raises(ValueError, match="unknown engine 'tpu9'"):
        get_engine("tpu9")
    with pytest.raises(TypeError, match="engine must be a str"):
        get_engine(3)
    register_engine("mine", lambda: get_engine("numpy"))
    assert get_engine("mine") is get_engine("numpy")
    with pytest.raises(TypeError, match="engine factory must be callable"):
        register_engine("bad", 3)


def test_missing_gpu_names_the_device():
    for kind, words in (("cuda", "cuda"), ("mps", "mps"), ("xla", "torch_xla")):
        if kind in available_engines():
            continue
        with pytest.raises(EngineUnavailableError, match=words):
            get_engine(kind)


def test_import_mesharray_does_not_import_torch_and_missing_torch_names_the_extra():
    code = (
        "import sys, mesharray, mesharray.engines, mesharray.collectives\n"
        "assert 'torch' not in sys.modules and 'mpi4py' not in sys.modules, sorted(sys.modules)\n"
        "sys.modules['torch'] = None\n"  # simulate torch not installed
        "from mesharray.engines import get_engine\n"
        "try:\n    get_engine('torch')\nexcept ImportError as e:\n    print(type(e).__name__, e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "EngineUnavailableError" in out.stdout and "pip install mesharray[torch]" in out.stdout


def test_large_numpy_blocks_start_on_a_huge_page_and_fill_as_numpy_does():
    from mesharray._core import buffer_address
    from mesharray.engines.numpy_engine import HUGE_PAGE, host_empty

    eng = get_engine("numpy")
    n = HUGE_PAGE // 4
    for make, want in [(lambda: eng.zeros((n,), "float32"), np.zeros(n, "float32")),
                       (lambda: eng.ones((2, n // 2), "float32"), np.ones((2, n // 2), "float32")),
                       (lambda: eng.full((n,), 7, "int32"), np.full(n, 7, "int32")),
                       (lambda: eng.empty((n + 3,), "float32"), None)]:
        a = make()
        assert buffer_address(a)[0] % HUGE_PAGE == 0 and a.flags.c_contiguous
        assert a.base is not None and a.base.nbytes == a.nbytes + HUGE_PAGE  # (what the block pool looks for)
        if want is not None:
            np.testing.assert_array_equal(a, want)
            assert a.dtype == want.dtype and a.shape == want.shape
    for dt in ("U4", "S8", "c16", [("a", "f4"), ("b", "i8")]):  # zeros: zero bytes, as np.zeros
        z = eng.zeros((n,), dt)
        assert buffer_address(z)[0] % HUGE_PAGE == 0 and (z == np.zeros(n, dt)).all()
    small = eng.full((2, 3), [1, 2, 3], "int8")  # what np.full does: the value broadcast, cast
    np.testing.assert_array_equal(small, np.full((2, 3), [1, 2, 3], "int8"))
    assert small.base is None
    objs = host_empty((HUGE_PAGE,), object)  # object slots: NumPy's own array, every one None
    assert objs.base is None and objs[0] is None and objs[-1] is None
    assert eng.full((n,), None, object)[5] is None
    assert eng.zeros((0, n), "float32").shape == (0, n) and eng.full((), 2.5, "float64") == 2.5
    assert host_empty((HUGE_PAGE,), ("f4", (3,))).shape == (HUGE_PAGE, 3)  # (a subarray dtype: NumPy's)
    with pytest.raises(ValueError, match="negative dimensions"):
        host_empty((-1, HUGE_PAGE), "f4")
