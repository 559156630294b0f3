"""Functions run on each rank's blocks: NumPy functions (``__array_function__``), torch
functions and Tensor methods (``__torch_function__``), and attributes of torch blocks.

A call like ``torch.matmul(x, w)`` or ``np.concatenate([a, b], axis=-1)`` has
MeshArrays somewhere in its arguments (``leaves``, nested in lists, tuples and
dicts). The controller replaces each with a slot (:func:`mesharray.calls.template`),
and a :class:`BlockCall` — the function and the templated arguments, pickled
once with the program — runs on each rank with that rank's block for each
slot. Nothing here imports torch: the worker's blocks already
are tensors when they need to be, and NumPy operands sent by the controller
become tensors through the block's engine.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ..calls import Slot, fill

__all__ = ["BlockCall"]


class BlockCall:
    """``func(*args, **kwargs)`` with each slot filled by a block, on one rank.

    ``tensors``: NumPy operands (values the controller sent for gathered
    MeshArrays) become tensors first, as torch functions want. ``grad``: whether
    autograd records the call (the controller's ``torch.is_grad_enabled()`` when
    it was made: a ``with torch.no_grad():`` around it reaches the workers).
    """

    __slots__ = ("func", "args", "kwargs", "tensors", "grad", "backward", "_plain")

    def __init__(self, func: Any, args: Any, kwargs: dict, tensors: bool = False, grad: bool = True) -> None:
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.tensors = tensors
        self.grad = grad
        #: a ``backward()``: the worker buckets the reductions of the gradients it makes (darray.overlap)
        self.backward = getattr(func, "__name__", "") == "backward"
        # the values are the arguments, in order (``torch.relu(x)``, ``F.linear(x, w, b)``): no template to fill
        self._plain = (not kwargs and type(args) is tuple
                       and all(type(a) is Slot and a.i == i for i, a in enumerate(args)))

    def __call__(self, *values: Any) -> Any:
        if self.tensors:
            torch = sys.modules["torch"]  # (the worker holds torch blocks: torch is imported already)
            for v in values:
                if isinstance(v, (np.ndarray, np.generic)):
                    values = tuple(torch.from_numpy(np.array(v)) if isinstance(v, (np.ndarray, np.generic)) else v
                                   for v in values)
                    break
            if torch.is_grad_enabled() != self.grad:
                with torch.set_grad_enabled(self.grad):
                    return self.func(*fill(self.args, values), **fill(self.kwargs, values))
        if self._plain:
            return self.func(*values)
        return self.func(*fill(self.args, values), **fill(self.kwargs, values))

    def __reduce__(self) -> tuple:
        return (BlockCall, (self.func, self.args, self.kwargs, self.tensors, self.grad))

    def __repr__(self) -> str:
        return f"BlockCall({getattr(self.func, '__name__', self.func)!r})"
