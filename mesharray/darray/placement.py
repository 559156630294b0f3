"""Where distributed ops run: the ranks computing each position of a result, and blocks moved there.

An elementwise op, a torch function or ``apply`` over distributed operands
computes each result position on one rank (and on every holder of a copy,
for operands held by a group: a keepdims reduction's result). The layout of
the result depends only on the operands' layouts: :func:`placement` works it
out once per layout and keeps it in the context (``ctx.layouts``). Operands
whose blocks are on other ranks (or another process mesh) move there first,
worker to worker (:func:`move_blocks`: a :class:`~.instructions.Move`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

import mesharray.darray.instructions as I

from .._core import Shape, reduction_plan, replace_last
from ..errors import MeshShapeError
from .autograd import MeshNode, mark_leaf
from .context import DataContext, tracing
from .dispatch import layout_of

__all__ = ["groups_of", "move_blocks", "placed", "placement", "per_rank"]


def groups_of(ranks: np.ndarray, mesh_axes: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The groups of :func:`~mesharray.reduction_plan` over ``mesh_axes`` of a rank layout.

    ``ranks`` holds the global rank of each mesh position (it may repeat a rank:
    an advanced-index view); each group's members are in row-major order of the
    reduced axes, its first member the group's root.
    """
    names = tuple(f"d{i}" for i in range(ranks.ndim))
    shape = Shape.from_ranks(names, tuple(ranks.shape), np.ascontiguousarray(ranks, dtype=np.int64).reshape(-1))
    groups, _ = reduction_plan(shape, tuple(names[a] for a in mesh_axes))
    return [tuple(row) for row in groups.tolist()]


def move_blocks(src: Any, src_ranks: np.ndarray, ctx: DataContext, dst_ranks: np.ndarray) -> Any:
    """A new array over ``ctx``'s ranks ``dst_ranks``: position ``p`` gets the block of ``src`` on ``src_ranks[p]``.

    The blocks travel worker to worker (:class:`~.instructions.Move`): each
    sending rank's block goes to every rank that needs it in one broadcast of
    its own group (a block wanted by many ranks fans out once); a rank that
    already holds its block copies it. The controller sends only the plan.
    """
    sctx = src.ctx
    sctx.check_live()
    ctx.check_live()
    src_ranks = np.asarray(src_ranks, dtype=np.int64)
    dst_ranks = np.asarray(dst_ranks, dtype=np.int64)
    key = ("move", id(ctx), src_ranks.tobytes(), dst_ranks.shape, dst_ranks.tobytes())
    plan = sctx.layouts.get(key)
    if plan is None:
        if len(sctx.layouts) > 256:
            sctx.layouts.clear()
        plan = sctx.layouts[key] = _move_plan(sctx, ctx, src_ranks, dst_ranks)
    fields, spans, posts, receivers, pairs, dst = plan
    out = ctx.new_id()
    groups, copies, ids, pids, hosts, mpi, token = fields
    ins = I.Move(out, src.bid, groups, copies, ids, src._local, src._dtype.str, src.engine, pids, hosts, mpi, token)
    _post_move(posts, ins, spans)
    res = type(src)(ctx, out, dst, src._local, src._dtype, src.engine, None, src.collective)
    same = ctx is sctx
    if same and src.rg and receivers:
        # autograd through the move (see .autograd): each moved block a leaf on its receiver,
        # whose gradient goes back to its sender; copies stay in their rank's own graph
        node = MeshNode("move", src, pairs=list(pairs))
        node.result(res, layout_of(res))
        sctx.send(receivers, [I.Apply(out, mark_leaf, [I.BlockRef(out)])])
        res.rg, res.deps = True, src.deps + (node,)
    elif same and src.rg:
        res.rg, res.deps = True, src.deps
    return res


#: the most moves merged into one instruction (their blocks, at most INLINE_MOVE bytes each, share a
#: broadcast through the group's shared memory, 4 MiB)
MERGE_MOVES = 32


def _move_plan(sctx: DataContext, ctx: DataContext, src_ranks: np.ndarray, dst_ranks: np.ndarray) -> tuple:
    """What a move from ``sctx``'s ranks ``src_ranks`` to ``ctx``'s ``dst_ranks`` sends, whichever blocks
    it moves (kept per layout in ``sctx.layouts``): ``(fields, spans, posts, receivers, pairs, dst)``,
    ``fields`` the :class:`~.instructions.Move` fields other than the block's."""
    flat_s = src_ranks.reshape(-1).tolist()
    flat_d = dst_ranks.reshape(-1).tolist()
    if len(set(flat_d)) != len(flat_d):
        raise MeshShapeError(f"a move needs one position per destination rank; ranks {flat_d} repeat")
    same = ctx is sctx
    off = 0 if same else sctx.shape.size
    ids: dict = {}
    if not same:
        ids = {(sctx.token, r): r for r in set(flat_s)}
        ids.update({(ctx.token, r): r + off for r in set(flat_d)})
    by_src: dict[int, list[int]] = {}
    copies: list[int] = []
    for s, d in zip(flat_s, flat_d):
        if same and s == d:
            copies.append(s)
        else:
            by_src.setdefault(s, []).append(d + off)
    groups = [[s] + sorted(ds) for s, ds in sorted(by_src.items())]
    pids = {s: sctx.pid(s) for s in set(flat_s)}
    hosts = {s: sctx.host(s) for s in set(flat_s)}
    for d in flat_d:
        pids[d + off] = ctx.pid(d)
        hosts[d + off] = ctx.host(d)
    spans = len({h[0] for h in hosts.values()}) > 1
    token = sctx.token + "m" if same else f"{sctx.token}{ctx.token}"
    senders = sorted({g[0] for g in groups} | set(copies))
    receivers = sorted({d - off for g in groups for d in g[1:]})
    posts = [(sctx, sorted(set(senders) | set(receivers)))] if same else \
        [(c, rs) for c, rs in ((sctx, senders), (ctx, receivers)) if rs]
    dst = dst_ranks.copy()
    dst.setflags(write=False)
    pairs = tuple((s, d) for s, d in zip(flat_s, flat_d) if s != d)
    return (groups, copies, ids, pids, hosts if spans else None, same, token), spans, posts, receivers, pairs, dst


def _post_move(posts: list, ins: I.Move, spans: bool) -> None:
    """Queue move ``ins`` for each ``(context, ranks)`` of ``posts``, merged into the move queued last
    (an :class:`~.instructions.Moves`) where it can be: every one of those buffers still ends with that
    move, for the same ranks, the two share groups, participants and token, and the blocks are small
    and on one host (the workers then send them in one broadcast). The decision is made here, once,
    so that every participant runs the same sequence of moves."""
    wire = I.encode([ins])[0]
    small = not spans and math.prod(ins.shape) * np.dtype(ins.dtype).itemsize <= I.INLINE_MOVE
    ctxs = [c for c, _ in posts]
    locked = sorted(ctxs, key=id)  # (both buffers change together, or neither; always locked in one
    for c in locked:  # order, so that a move the other way in another thread cannot deadlock with this one)
        c._lock.acquire()
    try:
        key = (ins.groups, ins.copies, ins.ids, ins.pids, ins.mpi, ins.token) if small and not tracing() else None
        last = ctxs[0].last_move
        prev = last[1] if last is not None else None
        merged = ("moves", (prev[1] if prev[0] == "moves" else [prev]) + [wire]) if (
            key is not None and prev is not None and last[0] == key and all(c.last_move is last for c in ctxs)
            and (prev[0] == "move" or len(prev[1]) < MERGE_MOVES)) else None
        # (every buffer still ends with that move, or none changes: other threads queue ops without the lock)
        if merged is not None and replace_last(posts, prev, merged):
            wire = merged
        else:
            for c, rs in posts:
                c.post_wire(rs, wire, bound=False)
        mark = None if key is None else (key, wire)  # (one object: the same move queued in every buffer)
        for c in ctxs:
            c.last_move = mark
    finally:
        for c in reversed(locked):
            c._lock.release()
    # (only now: a wait for the senders needs the receivers' part queued too)
    for c in ctxs:
        c.keep_bound()


def placed(what: str, plan: Any, dist: list, per_element: bool) -> tuple:
    """Where a blockwise result is computed, with the operands' blocks moved there:
    ``(first, R, pos_of, ranks, moved, holders)`` (``moved``: storages by ``id`` of the operand)."""
    lead, R, pos_of, ranks, moves, holders = placement(what, plan, dist, per_element)
    first = dist[lead].storage
    # operands whose blocks are elsewhere (other ranks, or another process mesh) travel to
    # the ranks computing the result first, worker to worker
    moved = {id(dist[i]): move_blocks(dist[i].storage, src_ranks, first.ctx, R) for i, src_ranks in moves}
    return first, R, pos_of, ranks, moved, holders


def placement(what: str, plan: Any, dist: list, per_element: bool) -> tuple:
    """:func:`_ew_layout`, worked out once per layout of the operands (kept in ``ctx.layouts``)."""
    sizes = tuple(plan.sizes)
    # Where each result position is computed depends only on the operands' layouts:
    # worked out once per layout (a loop of `a * 2 + b` then costs only its messages)
    parts: list = [what, sizes, tuple(plan.names), per_element]
    for x in dist:
        st = x.storage
        parts.append((tuple(x.names), st.ranks.shape, st.ranks.tobytes(), x.local_shape,
                      None if st.holders is None else (st.holders.shape, st.holders.tobytes()),
                      id(st.ctx)))
    key = tuple(parts)
    layouts = dist[0].storage.ctx.layouts
    layout = layouts.get(key)
    if layout is None:
        if len(layouts) > 256:
            layouts.clear()
        layout = layouts[key] = _ew_layout(what, plan, dist, per_element, sizes)
    return layout


def _ew_layout(what: str, plan: Any, dist: list, per_element: bool, sizes: tuple) -> tuple:
    """Which rank computes each position of an elementwise result: ``(lead, R, pos_of, ranks, moves, holders)``.

    The result lives where the first operand with every result position (else
    the first operand) lives: ``dist[lead]``'s process mesh, ranks ``R``
    (shared by every result of this layout: read-only). ``moves`` lists the
    operands whose block for some position is on another rank (or another
    process mesh), with the rank holding each position's block: those blocks
    move to ``R`` first. Raises :class:`MeshShapeError` when a rank would have
    to compute two positions (an operand broadcast along a mesh dim).
    """
    laid = []
    for x in dist:
        perm, target = plan.layout(x, pad_local=not per_element)
        st = x.storage
        mperm = perm[: st.ranks.ndim]
        r = st.ranks.transpose(mperm).reshape(target[: len(sizes)])
        h = None
        if st.holders is not None:
            h = st.holders.transpose(mperm + (st.holders.ndim - 1,)).reshape(target[: len(sizes)] + (st.holders.shape[-1],))
        laid.append((x, r, h))
    lead = next((i for i, t in enumerate(laid) if t[1].shape == sizes), 0)
    ctx = laid[lead][0].storage.ctx
    R = np.broadcast_to(laid[lead][1], sizes)
    if R.size and len(np.unique(R)) != R.size:
        raise MeshShapeError(
            f"the result of {what} would need several blocks on one rank "
            f"(a distributed operand broadcast along mesh dims {dict(zip(plan.names, sizes))}); "
            "fetch it or reduce with keepdims=True first"
        )
    moves = []
    for i, (x, r, h) in enumerate(laid):
        rb = np.broadcast_to(r, sizes)
        ok = rb == R
        if h is not None:
            hb = np.broadcast_to(h, sizes + (h.shape[-1],))
            ok = ok | (hb == R[..., None]).any(-1)
        if x.storage.ctx is not ctx or not ok.all():
            moves.append((i, np.ascontiguousarray(rb)))
    R = np.asarray(R, dtype=np.int64).copy()
    R.setflags(write=False)
    pos_of = {int(R[p]): p for p in np.ndindex(*sizes)}
    holders = _replicas(laid, sizes, R, moves)
    if holders is not None:
        # every operand is held, the same way, by the members of a group (a keepdims reduction's
        # result): each holder computes its copy, and the result stays held the same way
        for p in np.ndindex(*sizes):
            for h in holders[p].tolist():
                pos_of[int(h)] = p
    return lead, R, pos_of, sorted(pos_of), moves, holders


def _replicas(laid: list, sizes: tuple, R: np.ndarray, moves: list) -> np.ndarray | None:
    """The holders shared by every operand of an elementwise op (each position's block held by the same
    ranks, no rank holding two positions), or None: then only ``R`` computes the result."""
    if moves or not laid or any(h is None for _, _, h in laid):
        return None
    h0 = np.broadcast_to(laid[0][2], sizes + (laid[0][2].shape[-1],))
    for _, _, h in laid[1:]:
        if h.shape[-1] != h0.shape[-1] or not (np.broadcast_to(h, h0.shape) == h0).all():
            return None
    flat = h0.reshape(-1)
    if len(np.unique(flat)) != flat.size:
        return None
    out = np.ascontiguousarray(h0, dtype=np.int64)
    out.setflags(write=False)
    return out


def per_rank(values: np.ndarray, pos_of: dict, m: int) -> dict:
    """Each rank's slice of host ``values`` (mesh axes first, size-1 axes broadcast)."""
    return {rank: np.array(values[tuple(pi if s > 1 else 0 for pi, s in zip(p, values.shape[:m]))])
            for rank, p in pos_of.items()}
