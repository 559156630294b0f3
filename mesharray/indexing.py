"""A NumPy index over a MeshArray's axes (mesh axes first, then local ones), split into its two parts.

The index is classified by the compiled classifier that ``Shape`` indexing
uses (``_core.classify_index``: the same checks, errors and messages), then
cut where the mesh axes end: the mesh part selects ranks, the local part
indexes each rank's block. A MeshArray used as an index (a mask) gives its
values, its mesh dims put in the indexed array's order.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._core import classify_index
from .errors import MeshIndexError

__all__ = ["is_full_slice", "is_advanced", "split_key"]


def is_full_slice(k: Any) -> bool:
    return isinstance(k, slice) and k.start is None and k.stop is None and k.step is None


def is_advanced(k: Any) -> bool:
    return isinstance(k, np.ndarray)


def split_key(key: Any, mesh_ndim: int, local_ndim: int, a: Any) -> tuple[tuple, tuple]:
    """Split a NumPy index over ``mesh + local`` axes into the mesh part and the local part.

    Classified by the compiled classifier that ``Shape`` indexing uses (the same
    checks, errors and messages). Array-likes become ndarrays (integer or
    boolean); ``...`` is expanded, so each part is explicit. ``None`` (and
    scalar booleans) after the last mesh axis go to the local part.
    """
    arr = type(a)  # (a MeshArray: this module is below mesharray.array)
    if isinstance(key, arr) or (isinstance(key, tuple) and any(isinstance(k, arr) for k in key)):
        parts = key if isinstance(key, tuple) else (key,)
        key = tuple(_mask_values(k, a) if isinstance(k, arr) else k for k in parts)
    items, kinds, consumed = classify_index(key, mesh_ndim + local_ndim, "array")
    items = [np.asarray(k, dtype=np.intp) if kind == "a" else k for k, kind in zip(items, kinds)]
    ellipsis_at = kinds.index("e") if "e" in kinds else -1
    fill = [slice(None)] * (mesh_ndim + local_ndim - consumed)
    if ellipsis_at >= 0:
        items[ellipsis_at : ellipsis_at + 1] = fill
    else:
        items.extend(fill)
    mesh_key: list[Any] = []
    local_key: list[Any] = []
    axis = 0
    for k in items:
        width = k.ndim if isinstance(k, np.ndarray) and k.dtype == np.bool_ else (
            0 if k is None or isinstance(k, (bool, np.bool_)) else 1
        )
        if width == 0:
            (mesh_key if axis < mesh_ndim else local_key).append(k)
        elif axis + width <= mesh_ndim:
            mesh_key.append(k)
        elif axis >= mesh_ndim:
            local_key.append(k)
        else:
            raise MeshIndexError(
                f"a boolean index of {width} dims at axis {axis} spans both mesh axes "
                f"(the first {mesh_ndim}) and local axes; index them separately"
            )
        axis += width
    if any(is_advanced(k) for k in mesh_key) and any(is_advanced(k) for k in local_key):
        raise MeshIndexError(
            "advanced (array) indices on both mesh axes and local axes cannot be combined "
            "in one index; index the mesh axes and the local axes in two steps"
        )
    return tuple(mesh_key), tuple(local_key)


def _mask_values(k: Any, a: Any) -> np.ndarray:
    """A MeshArray used as an index: its values, with its mesh dims put in ``a``'s order."""
    if set(k._shape.names) == set(a._shape.names) and k._shape.names != a._shape.names:
        k = k.transpose(*a._shape.names)
    return k._values()
