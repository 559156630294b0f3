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
from .context import DataContext, contexts, set_trace, tracing
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
    """One captured signature: the program each rank runs, and the layout of the results.

    When the record goes (its function is collected, or keeps too many), the ranks drop its program.
    """

    def __init__(self, ctx: DataContext, fid: int, ranks: list, n: int, args: list, outputs: Any,
                 keep: list) -> None:
        self.ctx = ctx
        self.fid = fid
        self.ranks = ranks  # every rank the program runs on
        self.n = n  # block ids a replay makes
        self.outputs = outputs  # the result's structure: ("i", k, layout), ("a", j), ("c", value)
        self.keep = keep  # arrays from outside the step that the program uses (kept alive)

    def __del__(self, _finalizing: Any = sys.is_finalizing) -> None:
        if not _finalizing():
            self.ctx.forget_program(self.fid)

    def replay(self, args: list) -> Any:
        ctx = self.ctx
        ctx.check_live()
        base = ctx.new_base(self.n)
        ctx.post_wire(self.ranks, ("replay", self.fid, base, [a.storage.bid for a in args]), self.n)
        return _build(self.outputs, ctx, base, args)


def _build(spec: Any, ctx: DataContext, base: int, args: list) -> Any:
    kind = spec[0]
    if kind == "i":
        _, k, shape, res = spec
        return res.make(ctx, base + k, shape)
    if kind == "a":
        return args[spec[1]]
    if kind == "v":
        _, j, shape, res = spec
        return MeshArray.from_storage(shape, res.view(ctx, args[j].storage.bid))
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
        if tracing():
            raise CaptureError(f"ma.function {getattr(self.fn, '__qualname__', self.fn)!s}: called while another step is being captured; "
                               f"a captured step cannot hold another (call the inner function itself)")
        leaves: list = []
        try:
            torch = sys.modules.get("torch")
            key: tuple = (signature(args, leaves), signature(kwargs, leaves),
                          torch.is_grad_enabled() if torch is not None else True)
        except TypeError:  # an argument with no signature: nothing to replay it by
            return self.fn(*args, **kwargs)
        # the same array passed twice replays as the same array twice: part of the signature
        first: dict[int, int] = {}
        key += (tuple(first.setdefault(id(a.storage), j) for j, a in enumerate(leaves)),)
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
        ctxs = {id(a.storage.ctx): a.storage.ctx for a in leaves}
        # every context's next id: ids are minted in order, so the step's own come after (a context
        # made inside the step has only those: its ids start at 1)
        starts = {id(ctx): ctx.new_id() for ctx in contexts()}
        trace = _Trace(name)
        old = set_trace(trace)
        try:
            value = self.fn(*args, **kwargs)
        finally:
            set_trace(old)
        used = {id(c): c for c, _, _ in trace.entries}
        if not used:
            return value, None  # nothing distributed ran: nothing to replay
        meshes = {**ctxs, **used}
        if len(meshes) > 1:
            raise CaptureError(f"ma.function {name}: the step's arrays and ops are on {len(meshes)} process "
                               f"meshes; a captured step runs on one (call it without ma.function, or split it)")
        ctx = next(iter(used.values()))
        start = starts.get(id(ctx), 1)
        end = ctx.new_id()
        args_of: dict[int, int] = {}
        for j, a in enumerate(leaves):
            args_of.setdefault(a.storage.bid, j)
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
        outputs = _outputs(value, ctx, start, end, leaves, args_of, name)
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


def _outputs(value: Any, ctx: DataContext, start: int, end: int, leaves: list, args_of: dict, name: str) -> Any:
    """The structure of a step's result: what a replay builds (see :func:`_build`)."""
    if isinstance(value, MeshArray):
        st: Any = value.storage
        if getattr(st, "deps", ()):
            raise CaptureError(f"ma.function {name}: the step returns an array whose gradient goes through ops "
                               f"across ranks (a reduction over mesh dims, a move); a replay cannot keep that "
                               f"graph: call backward() inside the step")
        for j, a in enumerate(leaves):
            if value is a:
                return ("a", j)
        if getattr(st, "ctx", None) is ctx:
            if start <= st.bid < end:
                return ("i", st.bid - start, value.mesh_shape, st.layout())
            arg = args_of.get(st.bid)
            if arg is not None:  # a view of an argument (renamed, a mesh slice): the new argument's block
                return ("v", arg, value.mesh_shape, st.layout())
        return ("c", value)
    t = type(value)
    if t in (tuple, list) or (isinstance(value, tuple) and hasattr(value, "_fields")):
        return ("t", t, [_outputs(v, ctx, start, end, leaves, args_of, name) for v in value])
    if t is dict:
        return ("t", dict, [(k, _outputs(v, ctx, start, end, leaves, args_of, name)) for k, v in value.items()])
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
