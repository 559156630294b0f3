"""``loss.backward()`` for a loss that depends on ops across ranks: the reverse pass of :mod:`.autograd`.

Queued like every op (the controller waits for nothing): each rank's local
backward from its position of the loss, then each mesh node's reverse op in
reverse order of creation (see :mod:`.autograd` for the rules). Every step is
an instruction of :mod:`.instructions` the ranks already run (``Apply`` of the
functions in :mod:`.autograd`, ``Collective``, ``Move``); the temporary
gradient blocks are storages of the controller, freed when they go.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import mesharray.darray.instructions as I

from .autograd import MeshNode, accumulate, backward_with, grad_or_zeros, pairs_in_rounds
from .blockfn import BlockCall
from .placement import move_blocks

__all__ = ["mesh_backward"]


def _positions(st: Any) -> list[int]:
    return sorted(set(st.ranks.ravel().tolist()))


def _apply(like: Any, fn: Any, operands: list, ranks: list) -> Any:
    """A storage laid out as ``like`` holding ``fn(*operands)`` on ``ranks`` (a temporary gradient)."""
    ctx = like.ctx
    bid = ctx.new_id()
    ctx.post(ranks, [I.Apply(bid, fn, operands)])
    return type(like)(ctx, bid, like.ranks, like._local, like._dtype, like.engine, like.holders, like.collective,
                      _all_ranks=tuple(ranks))


def mesh_backward(loss: Any, call: Any, leaves: list) -> None:
    """Queue ``loss.backward()`` through the mesh nodes ``loss`` depends on (``call``: the backward's BlockCall)."""
    ctx = loss.ctx
    ops = [I.BlockRef(loss.bid)] + [I.BlockRef(x.storage.bid) for x in leaves[1:]]
    # the local graph may share parts with the graphs the nodes continue from: keep it
    call = BlockCall(call.func, call.args, {**call.kwargs, "retain_graph": True}, call.tensors, call.grad)
    # each position's rank seeds its own copy: a replicated loss is counted once
    ctx.effect(_positions(loss), I.encode([I.Apply(ctx.new_id(), call, ops)])[0])
    for node in sorted(loss.deps, key=lambda n: n.id, reverse=True):
        if node.kind == "reduce":
            _reverse_reduce(node)
        else:
            _reverse_move(node)


def _reverse_reduce(node: MeshNode) -> None:
    """Members all-reduce their copies' gradients; each continues from its input with the sum."""
    src = node.src
    out = node.out[0].view(src.ctx, node.out[1])
    members = sorted({r for g in node.groups for r in g})
    g0 = _apply(out, grad_or_zeros, [I.BlockRef(out.bid)], members)
    total = g0._send_collective([], g0.bid, "sum", [tuple(g) for g in node.groups], g0._dtype)
    ctx = src.ctx
    ctx.effect(_positions(src), I.encode([I.Apply(ctx.new_id(), backward_with,
                                                  [I.BlockRef(src.bid), I.BlockRef(total), I.Value(node.scale)])])[0],)
    ctx.post(members, [I.Free([total])])


def _reverse_move(node: MeshNode) -> None:
    """Each receiver sends its copy's gradient back; a sender sums what it gets, then continues from its block."""
    src = node.src
    ctx = src.ctx
    out = node.out[0].view(ctx, node.out[1])
    dsts = sorted({d for _, d in node.pairs})
    g = _apply(out, grad_or_zeros, [I.BlockRef(out.bid)], dsts)
    back: dict[int, list] = {}
    for rnd in pairs_in_rounds(node.pairs):
        ss = np.asarray([s for s, _ in rnd], dtype=np.int64)
        ds = np.asarray([d for _, d in rnd], dtype=np.int64)
        part = type(g)(ctx, g.bid, ds, g._local, g._dtype, g.engine, None, g.collective)  # (g's blocks, round's)
        moved = move_blocks(part, ds, ctx, ss)
        for s in ss.tolist():
            back.setdefault(s, []).append(moved)
    for s, parts in back.items():
        grad = parts[0] if len(parts) == 1 else _apply(parts[0], accumulate, [I.BlockRef(p.bid) for p in parts], [s])
        ctx.effect([s], I.encode([I.Apply(ctx.new_id(), backward_with,
                                          [I.BlockRef(src.bid), I.BlockRef(grad.bid), I.Value(1.0)])])[0],)
