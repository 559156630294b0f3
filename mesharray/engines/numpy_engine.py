"""The NumPy engine: blocks are ``numpy.ndarray`` in host memory (no torch needed)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .._core import buffer_address

__all__ = ["NumpyEngine", "ELEMENTWISE_OPS", "REDUCTIONS", "HUGE_PAGE", "host_empty"]

#: host blocks of at least this many bytes start on a multiple of it (:func:`host_empty`)
HUGE_PAGE = 2 << 20

# ufunc names the engines agree on (what MeshArray's operators map to)
ELEMENTWISE_OPS = frozenset({
    "add", "subtract", "multiply", "true_divide", "divide", "floor_divide", "remainder", "mod",
    "power", "negative", "positive", "absolute", "abs", "sqrt", "exp", "log", "log1p", "expm1",
    "sin", "cos", "tan", "tanh", "sign", "square", "reciprocal", "maximum", "minimum",
    "equal", "not_equal", "less", "less_equal", "greater", "greater_equal",
    "logical_and", "logical_or", "logical_not", "logical_xor",
    "bitwise_and", "bitwise_or", "bitwise_xor", "invert", "left_shift", "right_shift",
    "floor", "ceil", "trunc", "rint", "arctan2", "hypot", "fmod", "isnan", "isinf", "isfinite",
    "where", "clip",
})
REDUCTIONS = frozenset({"sum", "prod", "min", "max", "mean", "any", "all", "argmin", "argmax", "std", "var"})


def host_empty(shape: Sequence[int], dtype: Any, zeros: bool = False) -> np.ndarray:
    """An uninitialised C-contiguous host array; one of :data:`HUGE_PAGE` bytes or more starts on a multiple of it.

    NumPy asks Linux for transparent huge pages on the allocations of 4 MiB and
    more that it makes (``madvise``), but only the 2 MiB pages lying wholly
    inside the allocation get one, and malloc's large blocks start just past a
    page boundary: a 4 MiB array got one huge page of its two. Starting the
    array on the boundary (allocating ``HUGE_PAGE`` bytes more, never touched)
    gives it all of them: fewer TLB misses for the kernels, and fewer pages for
    cross-memory attach to pin (``docs/internals.md``, "Distributed arrays").
    Elsewhere the alignment costs nothing but the untouched slack. The
    array's ``base`` is that allocation (``HUGE_PAGE`` bytes longer): the
    worker's block pool recognises it by that. ``zeros``: what ``np.zeros``
    gives (zero bytes, from calloc: pages taken as they are first written).
    Object and subarray dtypes, and shapes NumPy refuses, are NumPy's own.
    """
    dt = np.dtype(dtype)
    shape = tuple(shape)
    nbytes = dt.itemsize
    for n in shape:
        nbytes *= n
    make = np.zeros if zeros else np.empty
    # (object slots must start as None; a subarray dtype adds axes; a bad shape: NumPy's error)
    if nbytes < HUGE_PAGE or dt.hasobject or dt.subdtype is not None or any(n < 0 for n in shape):
        return make(shape, dtype=dt)
    try:
        raw = make(nbytes + HUGE_PAGE, dtype=np.uint8)
    except ValueError:  # (too large to index: NumPy says so in its words)
        return make(shape, dtype=dt)
    off = -buffer_address(raw)[0] % HUGE_PAGE
    return raw[off:off + nbytes].view(dt).reshape(shape)


def _check_op(op: str) -> None:
    if op not in ELEMENTWISE_OPS:
        raise ValueError(f"unknown elementwise op {op!r}; expected a NumPy ufunc name such as 'add'")


class NumpyEngine:
    """Blocks are NumPy arrays on the CPU; collectives go through shared memory.

    Examples
    --------
    >>> eng = NumpyEngine()
    >>> eng.elementwise("add", eng.ones((2,), "int64"), 2).tolist()
    [3, 3]
    """

    name = "numpy"
    device = "cpu"
    collective_backend = "shm"

    def __repr__(self) -> str:
        return "NumpyEngine(device='cpu')"

    def __reduce__(self):
        return (NumpyEngine, ())

    # allocation
    # (large blocks on huge pages: see host_empty)
    def empty(self, shape: Sequence[int], dtype: Any) -> np.ndarray:
        return host_empty(shape, dtype)

    def zeros(self, shape: Sequence[int], dtype: Any) -> np.ndarray:
        return host_empty(shape, dtype, zeros=True)

    def ones(self, shape: Sequence[int], dtype: Any) -> np.ndarray:
        return self.full(shape, 1, dtype)

    def full(self, shape: Sequence[int], value: Any, dtype: Any) -> np.ndarray:
        a = host_empty(shape, dtype)
        np.copyto(a, value, casting="unsafe")  # (what np.full does)
        return a

    def arange(self, n: int, dtype: Any) -> np.ndarray:
        return np.arange(n, dtype=np.dtype(dtype))

    def rand(self, shape: Sequence[int], dtype: Any, seed: int | None = None) -> np.ndarray:
        dt = np.dtype(dtype)
        rng = np.random.default_rng(seed)
        if dt.kind == "f":
            return rng.random(tuple(shape), dtype=dt if dt in (np.float32, np.float64) else np.float64).astype(dt, copy=False)
        raise TypeError(f"rand needs a floating dtype, got {dt}")

    # host transfer
    def from_numpy(self, array: Any) -> np.ndarray:
        return np.asarray(array, order="C")

    def to_numpy(self, block: Any) -> np.ndarray:
        return np.asarray(block)

    def is_block(self, obj: Any) -> bool:
        return isinstance(obj, np.ndarray)

    def dtype_of(self, block: Any) -> np.dtype:
        return np.asarray(block).dtype

    def shape_of(self, block: Any) -> tuple:
        return tuple(np.shape(block))

    # compute
    def elementwise(self, op: str, *args: Any) -> Any:
        _check_op(op)
        if op == "where":
            return np.where(*args)
        if op == "clip":
            return np.clip(*args)
        if op == "reciprocal":
            return np.reciprocal(*args)
        return getattr(np, op)(*args)

    def reduce(self, op: str, block: Any, axis: Any = None, keepdims: bool = False) -> Any:
        if op not in REDUCTIONS:
            raise ValueError(f"unknown reduction {op!r}; expected one of {sorted(REDUCTIONS)}")
        fn = getattr(np, op)
        if op in ("argmin", "argmax") and isinstance(axis, tuple):
            raise TypeError(f"{op} takes one axis, got {axis}")
        return np.asarray(fn(block, axis=axis, keepdims=keepdims))

    def matmul(self, a: Any, b: Any) -> np.ndarray:
        return np.matmul(a, b)

    def astype(self, block: Any, dtype: Any) -> np.ndarray:
        return np.asarray(block).astype(np.dtype(dtype))

    def reshape(self, block: Any, shape: Sequence[int]) -> np.ndarray:
        return np.reshape(block, tuple(shape))

    def getitem(self, block: Any, index: Any) -> np.ndarray:
        return np.asarray(np.asarray(block)[index])

    # export
    def host_view(self, block: Any) -> np.ndarray:
        """A C-contiguous host array sharing memory with ``block`` when possible."""
        return np.asarray(block, order="C")

    def to_dlpack(self, block: Any) -> Any:
        # np.ndarray implements __dlpack__ itself; consumers call from_dlpack on it
        return np.asarray(block, order="C")

    def from_dlpack(self, obj: Any) -> np.ndarray:
        return np.from_dlpack(obj)

    def synchronize(self) -> None:
        return None
