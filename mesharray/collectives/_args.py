"""Argument checks shared by the collective backends, so the same mistake gets the same error."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["as_contiguous", "check_out", "scatter_part_shape", "split_mean"]


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


def split_mean(op: str, dtype: np.dtype) -> tuple[str, bool]:
    """``(op to reduce with, whether to divide by the member count after)``: a ``mean`` is a sum, then a division.

    TypeError for ``mean`` over a dtype that is not floating (the division would truncate).
    """
    mean = op == "mean"
    if mean and dtype.kind != "f":
        raise TypeError(f"op 'mean' needs a floating dtype, got {dtype}; cast first")
    return ("sum" if mean else op), mean


def scatter_part_shape(shape: tuple, size: int) -> tuple:
    """The shape of each member's part of a ``reduce_scatter`` of ``send.shape == shape`` over ``size`` members.

    ``(size, *rest)`` gives ``rest``; any other shape whose size ``size`` divides, ``(n // size,)``.
    """
    if len(shape) > 1 and shape[0] == size:
        return tuple(shape[1:])
    n = math.prod(shape)
    if n % size == 0:
        return (n // size,)
    raise ValueError(f"reduce_scatter needs send of shape ({size}, ...) or a size divisible by {size}; "
                     f"got shape {tuple(shape)}")
