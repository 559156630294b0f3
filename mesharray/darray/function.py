"""``ma.function``: capture a step of distributed-array ops once, replay it as one message per rank.

``step = ma.function(train_step)``; the first call of ``step(*args)`` runs
``train_step`` as usual and *records* every op it queues (in the thread that
calls it): Python control flow runs at that time, as in ``torch.jit.trace``.
The record is kept by the call's *signature*: for each distributed
``MeshArray`` argument its mesh Shape and layout (which ranks hold it, local
shape, dtype, engine), and every other argument by value. A later call of the
same signature *replays* it: every rank gets one small instruction (the
record's id, a fresh range of block ids, the argument arrays' block ids) and
runs the recorded program on its blocks, as it ran the first time; the
controller sends nothing else and plans nothing, and wraps the results in
MeshArrays of the recorded layouts. A call of another signature records
again.

How a record becomes a program: the ops' instructions are kept in their wire
form with every block id made during the capture replaced by its index
(``("i", k)``: block ``base + k`` of a replay) and every argument's by its
position (``("a", j)``), other ids (arrays the step uses from outside, which
the record keeps alive) as they are. Each rank receives its part of the
program once (``("def", id, program, temps)``); a replay runs it with the ids
filled in and frees the blocks of the step that are not among its results.

What cannot be captured raises at the first call, naming it: a value fetched
inside the step (``float(loss)``, ``np.asarray(x)``, printing), anything else
that waits for the ranks (``procs.sync()``, an op whose result's shape only
running it tells), and ops on more than one process mesh. Actor calls made
inside the step are not part of the record (they run at the first call
only). A call whose arguments have no signature (a gathered MeshArray, a
tensor) runs the function as it is, every time.
"""

from __future__ import annotations

import functools
import itertools
import sys
import threading
import traceback
from typing import Any, Callable

from ..array import MeshArray
from ..elementwise import signature
from ..errors import CaptureError
from .context import DataContext, set_trace
from .instructions import map_ids

__all__ = ["Function", "function"]

_fids = itertools.count(1).__next__


class _Trace:
    """Records the ops queued in one thread while a function is captured."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.thread = threading.get_ident()
        self.entries: list[tuple[DataContext, list, list]] = []
        self.refused: str | None = None

    def record(self, ctx: DataContext, ranks: list, wire: list) -> None:
        if threading.get_ident() == self.thread:
            self.entries.append((ctx, list(ranks), list(wire)))

    def refuse(self, what: str) -> None:
        where = _user_frame()
        raise CaptureError(f"ma.function {self.name}: {what} inside the captured step{where}; a captured "
                           f"step runs on the ranks without the controller, so nothing inside it may wait for "
                           f"a value: return the array and fetch it after the call")


def _user_frame() -> str:
    """`` (file:line)`` of the innermost frame outside mesharray and torch, where the user's code waited."""
    for fs in reversed(traceback.extract_stack()):
        f = fs.filename.replace("\\", "/")
        if "/mesharray/" not in f and "/torch/" not in f and "/numpy/" not in f:
            return f" ({fs.filename}:{fs.lineno})"
    return ""


class _Record:
    """One captured signature: the program each rank runs, and the layout of the results."""

    def __init__(self, ctx: DataContext, fid: int, ranks: list, n: int, args: list, outputs: Any,
                 keep: list) -> None:
        self.ctx = ctx
        self.fid = fid
        self.ranks = ranks  # every rank the program runs on
        self.n = n  # block ids a replay makes
        self.outputs = outputs  # the result's structure: ("i", k, layout), ("a", j), ("c", value)
        self.keep = keep  # arrays from outside the step that the program uses (kept alive)

    def replay(self, args: list) -> Any:
        ctx = self.ctx
        ctx.check_live()
        base = ctx.new_base(self.n)
        ctx.post_wire(self.ranks, ("replay", self.fid, base, [a._storage.bid for a in args]))
        return _build(self.outputs, ctx, base, args)


def _build(spec: Any, ctx: DataContext, base: int, args: list) -> Any:
    kind = spec[0]
    if kind == "i":
        _, k, shape, res = spec
        return res.make(ctx, base + k, shape)
    if kind == "a":
        return args[spec[1]]
    if kind == "c":
        return spec[1]
    _, t, items = spec  # ("t", type, items): a tuple, list or dict of results
    if t is dict:
        return {key: _build(v, ctx, base, args) for key, v in items}
    vals = [_build(v, ctx, base, args) for v in items]
    return vals if t is list else tuple(vals) if t is tuple else t(*vals)


class Function:
    """A function whose distributed-array ops are captured at its first call and replayed after.

    Made by :func:`function` (``ma.function``); see the module docstring for
    the mechanism. ``records`` counts the signatures captured so far.
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self._records: dict[Any, _Record] = {}
        self._lock = threading.Lock()
        functools.update_wrapper(self, fn)

    @property
    def records(self) -> int:
        return len(self._records)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves: list = []
        try:
            torch = sys.modules.get("torch")
            key = (signature(args, leaves), signature(kwargs, leaves),
                   torch.is_grad_enabled() if torch is not None else True)
        except TypeError:  # an argument with no signature: nothing to replay it by
            return self.fn(*args, **kwargs)
        rec = self._records.get(key)
        if rec is not None and not rec.ctx.stopped:
            return rec.replay(leaves)
        value, rec = self._capture(args, kwargs, leaves)
        if rec is not None:
            with self._lock:
                if len(self._records) >= 64:
                    self._records.clear()
                self._records[key] = rec
        return value

    def _capture(self, args: tuple, kwargs: dict, leaves: list) -> tuple[Any, _Record | None]:
        name = getattr(self.fn, "__qualname__", repr(self.fn))
        ctxs = {id(a._storage.ctx): a._storage.ctx for a in leaves}
        starts = {k: ctx.new_id() for k, ctx in ctxs.items()}  # (ids are minted in order: the step's follow)
        trace = _Trace(name)
        old = set_trace(trace)
        try:
            value = self.fn(*args, **kwargs)
        finally:
            set_trace(old)
        used = {id(c): c for c, _, _ in trace.entries}
        if not used:
            return value, None  # nothing distributed ran: nothing to replay
        if len(used) > 1 or (ctxs and set(used) != set(ctxs) and not set(used) <= set(ctxs)):
            raise CaptureError(f"ma.function {name}: the step ran ops on {len(used)} process meshes; a captured "
                               f"step runs on one (call it without ma.function, or split it)")
        ctx = next(iter(used.values()))
        start = starts.get(id(ctx))
        if start is None:
            start = min(_first_id(trace.entries))
        end = ctx.new_id()
        args_of: dict[int, int] = {}
        for j, a in enumerate(leaves):
            if a._storage.ctx is ctx:
                args_of.setdefault(a._storage.bid, j)
        outside: set[int] = set()

        def sym(b: Any) -> Any:
            if type(b) is int:
                if start <= b < end:
                    return ("i", b - start)
                j = args_of.get(b)
                if j is not None:
                    return ("a", j)
                outside.add(b)
            return b

        program = [(ranks, [map_ids(ins, sym) for ins in wire]) for _, ranks, wire in trace.entries]
        outputs = _outputs(value, ctx, start, end, args)
        made = {spec[1] for spec in _walk(outputs) if spec[0] == "i"}
        temps = [("i", k) for k in range(end - start) if k not in made]
        # each rank its part of the program, once; ranks given the same share one message
        by_rank: dict[int, list[int]] = {}
        for i, (ranks, _) in enumerate(program):
            for r in ranks:
                by_rank.setdefault(r, []).append(i)
        groups: dict[tuple, list[int]] = {}
        for r, mine in by_rank.items():
            groups.setdefault(tuple(mine), []).append(r)
        fid = _fids()
        for part, rs in groups.items():
            ctx.post_wire(sorted(rs), ("def", fid, [w for i in part for w in program[i][1]], temps))
        keep = ctx.keep_blocks(sorted(outside))
        return value, _Record(ctx, fid, sorted(by_rank), end - start, leaves, outputs, keep)


def _first_id(entries: list) -> list:
    ids = []
    for _, _, wire in entries:
        for ins in wire:
            map_ids(ins, lambda b: ids.append(b) if type(b) is int else None)
    return ids or [0]


def _outputs(value: Any, ctx: DataContext, start: int, end: int, args: tuple) -> Any:
    """The structure of a step's result: what a replay builds (see :func:`_build`)."""
    if isinstance(value, MeshArray):
        st: Any = value._storage
        if getattr(st, "ctx", None) is ctx and start <= st.bid < end:
            return ("i", st.bid - start, value._shape, st.layout())
        for j, a in enumerate(args):
            if value is a:
                return ("a", j)
        return ("c", value)
    t = type(value)
    if t in (tuple, list) or (isinstance(value, tuple) and hasattr(value, "_fields")):
        return ("t", t, [_outputs(v, ctx, start, end, args) for v in value])
    if t is dict:
        return ("t", dict, [(k, _outputs(v, ctx, start, end, args)) for k, v in value.items()])
    return ("c", value)


def _walk(spec: Any) -> Any:
    if spec[0] == "t":
        for v in spec[2]:
            yield from _walk(v[1] if spec[1] is dict else v)
    else:
        yield spec


def function(fn: Callable[..., Any]) -> Function:
    """Capture ``fn``'s distributed-array ops at its first call; replay them as one message per rank after.

    ``step = ma.function(train_step)`` (or ``@ma.function``): the first call of
    a signature (the meshes, shapes, dtypes and layouts of its MeshArray
    arguments, its other arguments' values) runs ``fn`` and records its ops;
    later calls of that signature replay the record with the new arrays,
    with no planning and one small message per rank. Python control flow
    runs at the first call only, as in ``torch.jit.trace``: a step whose ops
    depend on values must not be captured. Inside the step nothing may wait
    for a value (``float(loss)``, printing an array, ``procs.sync()``): that
    raises :class:`~mesharray.CaptureError` naming it. The
    result is a new MeshArray per call, laid out as at the first call.

    Examples
    --------
    >>> step = ma.function(lambda w, x: w - 0.1 * (w * x))
    >>> w, x = procs.ones((3,)), procs.full((3,), 2.0)   # doctest: +SKIP
    >>> for _ in range(3):                              # doctest: +SKIP
    ...     w = step(w, x)                              # recorded at the first call, replayed after
    >>> w.fetch()[0, 0].tolist(), step.records          # doctest: +SKIP
    ([0.512, 0.512, 0.512], 1)
    """
    if not callable(fn):
        raise TypeError(f"ma.function needs a callable, got {type(fn).__name__}")
    return Function(fn)
