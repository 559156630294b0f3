"""Calls whose arguments hold MeshArrays: the arguments as a template with slots.

``torch.cat([x, y], dim=-1)`` or ``np.einsum("ij,jk", a, b)`` may hold
MeshArrays anywhere in their arguments, nested in lists, tuples and dicts.
:func:`template` takes them out (the *leaves*, in order) and leaves a
:class:`Slot` in each place; :func:`fill` puts values back (a rank's blocks, or
meta tensors standing in for them). Distributed arrays send the template with
the function once, and each rank fills it with its own blocks.

>>> leaves = []
>>> t = template(([1, "a"], {"k": "b"}), lambda x: isinstance(x, str), leaves)
>>> t, leaves
(([1, Slot(i=0)], {'k': Slot(i=1)}), ['a', 'b'])
>>> fill(t, ["A", "B"])
([1, 'A'], {'k': 'B'})
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

__all__ = ["Slot", "fill", "template"]


class Slot(NamedTuple):
    """Where leaf ``i`` of a call's arguments goes."""

    i: int


def template(obj: Any, is_leaf: Callable[[Any], bool], leaves: list) -> Any:
    """``obj`` with every leaf replaced by a :class:`Slot` (leaves appended to ``leaves``, in order)."""
    if is_leaf(obj):
        leaves.append(obj)
        return Slot(len(leaves) - 1)
    if type(obj) in (list, tuple):
        return type(obj)(template(x, is_leaf, leaves) for x in obj)
    if type(obj) is dict:
        return {k: template(v, is_leaf, leaves) for k, v in obj.items()}
    return obj


def fill(obj: Any, values: Any) -> Any:
    """The inverse of :func:`template`: each :class:`Slot` replaced by ``values[slot.i]``."""
    if type(obj) is Slot:
        return values[obj.i]
    if type(obj) in (list, tuple):
        return type(obj)(fill(x, values) for x in obj)
    if type(obj) is dict:
        return {k: fill(v, values) for k, v in obj.items()}
    return obj
