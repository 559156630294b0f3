"""Argument checks shared by the collective backends, so the same mistake gets the same error."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["as_contiguous", "check_out"]


def as_contiguous(x: Any, label: str) -> np.ndarray:
    """``x`` as a C-contiguous NumPy array; TypeError for a non-buffer, ValueError if strided."""
    if not isinstance(x, np.ndarray):
        if hasattr(x, "__array_interface__") or hasattr(x, "__array__") or isinstance(x, memoryview):
            x = np.asarray(x)
        else:
            raise TypeError(f"{label} must be a NumPy array or a buffer, got {type(x).__name__}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{label} must be C-contiguous")
    return x


def check_out(out: Any, shape: tuple, dtype: np.dtype) -> np.ndarray:
    """The destination of a collective: a fresh array, or ``out`` checked for dtype, size and writability."""
    if out is None:
        return np.empty(shape, dtype=dtype)
    out = as_contiguous(out, "out")
    if out.dtype != dtype or out.size != math.prod(shape):
        raise ValueError(f"out has dtype {out.dtype} and {out.size} elements; expected {dtype} and shape {shape}")
    if not out.flags.writeable:
        raise ValueError("out is read-only")
    return out
