"""Autograd through the mesh: ``backward()`` across the ops that cross ranks.

Each rank's torch autograd records the ops on its own blocks. What it cannot
see are the ops that cross ranks: a reduction over mesh axes (a collective)
and a move of blocks between ranks (``roll`` over a mesh axis, ``to_mesh``
within a process mesh, an elementwise operand on another rank). For those
the controller keeps a :class:`MeshNode` whenever their input requires grad:

- the result's blocks are made leaves that require grad on the ranks holding
  them, so the local graphs downstream of the op end there and accumulate
  the result's gradient in its ``.grad``;
- the result's storage carries the node in ``deps`` (the mesh nodes it
  depends on, transitively; ops propagate the union of their operands').

``loss.backward()`` on an array with ``deps`` runs each rank's local backward
from its position of ``loss`` (one copy of a replicated result, so that
gradients summed over copies count it once), then, in reverse order of
creation, each node's reverse op:

- a **reduction** (sum, mean over mesh axes; every member holds a copy of the
  result): the members all-reduce (sum) their copies' gradients — a copy that
  got none gives zeros — and each continues its local backward from its
  input with that gradient (divided by the group's size for a mean): the
  gradient of a sum is the broadcast of the upstream gradient;
- a **move** (position ``p`` got the block of position ``q``): each receiving
  rank sends its copy's gradient back to the rank it came from (a block sent
  to several ranks gets the sum), which continues its local backward from the
  block it sent.

Each step is an op like any other (queued, fire-and-forget); a failure is
raised by the next wait. Only float blocks of torch engines take part. Not
covered: other reductions over mesh axes (min, max, prod, std ...), the
collectives of :func:`mesharray.allgather` and friends, moves to another
process mesh (their results do not require grad), and captured steps
(:func:`mesharray.function`) returning arrays with mesh nodes.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

__all__ = ["MeshNode", "union", "grad_of", "grad_or_zeros", "backward_with", "accumulate"]

_ids = itertools.count(1).__next__


class MeshNode:
    """An op that crossed ranks on an input that requires grad: what its reverse needs.

    ``kind`` is ``"reduce"`` (``groups``: the reduction's groups of global
    ranks; ``scale``: 1, or ``1/n`` for a mean) or ``"move"`` (``pairs``:
    ``(source rank, destination rank)`` per moved position). ``src`` is the
    input's storage (kept alive, as autograd keeps saved tensors), ``out`` the
    result's.
    """

    __slots__ = ("id", "kind", "src", "out", "keep", "groups", "scale", "pairs")

    def __init__(self, kind: str, src: Any, groups: list | None = None, scale: float = 1.0,
                 pairs: list | None = None) -> None:
        self.id = _ids()
        self.kind = kind
        self.src = src
        self.out: Any = None  # the result's layout (dispatch.layout_of) and block id: see result()
        self.keep: Any = None  # the hold on the result's block (not the storage: it holds this node)
        self.groups: list = groups or []
        self.scale = scale
        self.pairs: list = pairs or []

    def result(self, st: Any, layout: Any) -> None:
        """The node's result is storage ``st`` (``layout``: :func:`~.dispatch.layout_of` of it); the node holds
        its block, not the storage, whose ``deps`` hold the node (no reference cycle to wait on the
        collector for)."""
        self.out = (layout, st.bid)
        self.keep = st.ctx.keep_blocks([st.bid])

    def __repr__(self) -> str:
        return f"<MeshNode {self.id} {self.kind}>"


def union(*deps: tuple) -> tuple:
    """The mesh nodes of several operands, each once, in order of creation."""
    nonempty = [d for d in deps if d]
    if not nonempty:
        return ()
    if len(nonempty) == 1:
        return nonempty[0]
    seen: dict[int, MeshNode] = {}
    for d in nonempty:
        for n in d:
            seen[n.id] = n
    return tuple(seen[k] for k in sorted(seen))


# -- run on the workers (by reference in the programs) ---------------------------------------


def grad_of(t: Any) -> Any:
    """``t.grad`` (``x.grad`` of a torch-engine array); raises where no backward reached a block."""
    g = t.grad
    if g is None:
        raise RuntimeError("this block's .grad is None: no backward() reached it (does it require grad? "
                           "x.requires_grad_() on a leaf before the forward pass)")
    return g


def grad_or_zeros(t: Any) -> Any:
    """``t``'s accumulated gradient, taken (a later backward through the same node sends only its own),
    or zeros shaped like ``t`` when none reached it."""
    import torch

    g = t.grad
    if g is None:
        return torch.zeros_like(t, requires_grad=False)
    t.grad = None
    return g.detach()


def zeros_like(t: Any) -> Any:
    """Zeros shaped like ``t``, detached (a member's share of a gradient it does not hold)."""
    import torch

    return torch.zeros_like(t, requires_grad=False)


def accumulate(*gs: Any) -> Any:
    """The sum of the gradients a block sent to several ranks got back."""
    total = gs[0]
    for g in gs[1:]:
        total = total + g
    return total


def backward_with(src: Any, g: Any, scale: float = 1.0) -> None:
    """Continue ``src``'s local backward with gradient ``g`` (times ``scale``)."""
    if getattr(src, "requires_grad", False):
        src.backward(g if scale == 1.0 else g * scale, retain_graph=True)
    return None


def mark_leaf(t: Any) -> Any:
    """The result of an op that crossed ranks: a leaf that requires grad, where its input did."""
    if not t.requires_grad:
        t.requires_grad_()
    return t


def pairs_in_rounds(pairs: list) -> list[list]:
    """``(src, dst)`` pairs split into rounds in which each ``src`` appears once (a block fanned out to
    several ranks gets their gradients back one round at a time)."""
    rounds: list[list] = []
    count: dict[int, int] = {}
    for s, d in pairs:
        i = count.get(s, 0)
        count[s] = i + 1
        if i == len(rounds):
            rounds.append([])
        rounds[i].append((s, d))
    return rounds


def is_float(dtype: np.dtype) -> bool:
    return dtype.kind in "fc"
