"""Shape indexing against NumPy's ``arr[idx]`` and torchmonarch's ``Shape.at/select``.

One pytest-benchmark group per scenario; NumPy (indexing an int array of the
same shape) is each group's baseline, so the summary shows Shape's and
Monarch's ratio to it.  Monarch's Rust ``Shape`` has no step slices, no
negative indices and no advanced indexing: those cases are skipped with the
reason.  Run: ``python -m pytest bench/bench_core.py --benchmark-only``.
"""

from __future__ import annotations

import numpy as np
import pytest

from mesharray import Shape

try:
    from monarch._rust_bindings.monarch_hyperactor.shape import Shape as MonarchShape
    from monarch._rust_bindings.monarch_hyperactor.shape import Slice as MonarchSlice
except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
    MonarchShape = None
    MONARCH_MISSING = f"torchmonarch is not importable here ({type(exc).__name__}: {exc})"
else:
    MONARCH_MISSING = ""

NAMES = ("hosts", "gpus", "x", "y")
SIZES = (4, 5, 6, 7)


def _shape():
    return Shape(dict(zip(NAMES, SIZES)))


def _array():
    return np.arange(int(np.prod(SIZES))).reshape(SIZES)


def _monarch():
    if MonarchShape is None:
        pytest.skip(MONARCH_MISSING)
    strides = [int(np.prod(SIZES[i + 1:])) for i in range(len(SIZES))]
    return MonarchShape(list(NAMES), MonarchSlice(offset=0, sizes=list(SIZES), strides=strides))


# scenario -> (index for Shape and NumPy, Monarch call or a reason it has none)
SCENARIOS = {
    "int": ((0,), lambda m: m.at("hosts", 0)),
    "int_negative": ((slice(None), -1), "monarch's Shape.at takes no negative index"),
    "slice": ((slice(None), slice(1, 4)), lambda m: m.select("gpus", slice(1, 4))),
    "slice_step": ((slice(None), slice(1, 5, 2)), "monarch's Shape.select has no step ('nonrectangular shape')"),
    "mixed": ((1, slice(2, 5), Ellipsis, 6), lambda m: m.at("hosts", 1).select("gpus", slice(2, 5)).at("y", 6)),
    "mixed_step": ((1, slice(2, 5, 2), Ellipsis, -1), "monarch has no step slices or negative indices"),
    "advanced": ((slice(None), [0, 2, 4]), "monarch's Shape has no advanced (array) indexing"),
    "mask": ((slice(None), np.array([True, False, True, False, True])), "monarch's Shape has no boolean masks"),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("impl", ["mesharray", "numpy", "monarch"])
def test_index(benchmark, scenario, impl):
    idx, monarch_call = SCENARIOS[scenario]
    benchmark.group = f"index {scenario}: {idx!r}"
    if impl == "mesharray":
        s = _shape()
        benchmark(s.__getitem__, idx)
    elif impl == "numpy":
        a = _array()
        benchmark.extra_info.update(baseline=True, label="numpy")
        benchmark(a.__getitem__, idx)
    else:
        if isinstance(monarch_call, str):
            pytest.skip(monarch_call)
        m = _monarch()
        benchmark(monarch_call, m)


@pytest.mark.parametrize("impl", ["mesharray", "numpy", "monarch"])
def test_named_slice(benchmark, impl):
    benchmark.group = "named: .slice(gpus=1, x=slice(0, 3))"
    if impl == "mesharray":
        s = _shape()
        benchmark(lambda: s.slice(gpus=1, x=slice(0, 3)))
    elif impl == "numpy":
        a = _array()
        benchmark.extra_info.update(baseline=True, label="numpy")
        benchmark(lambda: a[:, 1, 0:3])
    else:
        m = _monarch()
        benchmark(lambda: m.at("gpus", 1).select("x", slice(0, 3)))


BIG = (100, 100, 100)  # 1,000,000 ranks


@pytest.mark.parametrize(
    "idx",
    [(slice(None),), (slice(None), slice(None, None, -1)), (slice(None), slice(None), slice(None, None, 2))],
    ids=["all", "reversed", "step2"],
)
@pytest.mark.parametrize("impl", ["mesharray", "numpy", "monarch"])
def test_ranks_1m(benchmark, impl, idx):
    benchmark.group = f"ranks() of a 1M-rank view {idx!r}"
    n = int(np.prod(BIG))
    if impl == "mesharray":
        v = Shape(dict(zip(NAMES, BIG)))[idx]
        benchmark(v.ranks)
    elif impl == "numpy":
        benchmark.extra_info.update(baseline=True, label="numpy")
        benchmark(lambda: np.arange(n).reshape(BIG)[idx].ravel())
    else:
        if any(isinstance(i, slice) and i.step not in (None, 1) for i in idx):
            pytest.skip("monarch's Shape.select has no step ('nonrectangular shape')")
        if MonarchShape is None:
            pytest.skip(MONARCH_MISSING)
        m = MonarchShape(list(NAMES[:3]), MonarchSlice(offset=0, sizes=list(BIG), strides=[10000, 100, 1]))
        benchmark(m.ranks)
