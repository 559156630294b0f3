"""Gradient reductions that start while ``backward()`` still runs, in buckets (the worker's side).

The pattern of a data-parallel step, as the ranks receive it in one program::

    apply   backward(loss)                 # the local backward pass
    apply   g1 = w1.grad                   # then, per parameter:
    plan    m1 = mean of g1 over the ranks #   a reduction over mesh axes
    ...     (the update of w1)
    apply   g2 = w2.grad
    plan    m2 = mean of g2 over the ranks
    ...

Before a rank runs the ``backward``, :func:`prepare` looks ahead in the
program for ``g = w.grad`` followed by a reduction of ``g`` whose group is a
shared-memory one, and registers a hook on each such ``w``
(``register_post_accumulate_grad_hook``). As each gradient is accumulated,
the hook puts it into the current *bucket*; a bucket of
``MESHARRAY_BUCKET_BYTES`` (default 1 MiB), or the last one, goes to the
process's communication thread, which all-reduces its gradients as one
buffer while autograd goes on with the rest. After the ``backward``,
:meth:`Overlap.finish` waits for the buckets and stores every ``g`` and ``m``
they made; the program then skips those two instructions.

Every member of a group runs the same program, its hooks fire in the same
order (the same graph), so the buckets and their all-reduces match, as the
collectives of a program do. A gradient no hook saw is, at ``finish``, the
parameter's ``.grad`` as the instructions would have read it (an earlier
backward's, when this one did not reach the parameter; none: the bucket fails
on this rank). When every gradient fits one bucket no hook is registered at
all: that bucket is reduced at ``finish`` whatever the hooks would say, with
the group's compiled small round when it is small enough. A group whose
members have no CPU to spare has one bucket too (:func:`_bucket_bytes`).
"""

from __future__ import annotations

import os
import pickle
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

from .._core import bucket_scan
from ..engines import get_engine
from ..errors import MeshArrayError
from .autograd import grad_of
from .instructions import InputFailed, block_ids

__all__ = ["COUNTS", "Overlap", "prepare"]

#: a bucket this full goes to the communication thread; 0 turns the buckets off. Where it is not set, a
#: group with no CPU to spare beside its members reduces all in one bucket (:func:`_bucket_bytes`)
_BUCKET_SET = os.environ.get("MESHARRAY_BUCKET_BYTES")
BUCKET_BYTES = int(_BUCKET_SET or str(1 << 20))
_OPS = ("sum", "mean")
#: instructions a look-ahead stops at (see prepare)
_BARRIERS = frozenset(("effect", "coll", "move", "moves", "check", "def", "replay"))

#: the fields of the reductions' plans, by their bytes (a step's reductions share one plan)
_PLAN_FIELDS: dict[bytes, tuple] = {}

#: what this process bucketed: backward passes, buckets sent, gradients in them
COUNTS = {"backwards": 0, "buckets": 0, "grads": 0}

_comm: ThreadPoolExecutor | None = None
_comm_lock = threading.Lock()


def _thread() -> ThreadPoolExecutor:
    global _comm
    if _comm is None:
        with _comm_lock:
            if _comm is None:
                _comm = ThreadPoolExecutor(1, thread_name_prefix="mesharray-buckets")
    return _comm


class _Entry:
    __slots__ = ("w", "g", "m", "gi", "mi", "nbytes", "grad", "bucket")

    def __init__(self, w: int, g: int, m: int, gi: int, mi: int, nbytes: int) -> None:
        self.w, self.g, self.m, self.gi, self.mi, self.nbytes = w, g, m, gi, mi, nbytes
        self.grad: Any = None
        self.bucket = 0


class Overlap:
    """The buckets of one ``backward``: hooks in, results out (see the module docstring).

    Buckets are cut from the program alone (its reductions' sizes, last
    parameter first, as DDP orders them), so every member has the same ones
    whatever happens on it; they are all-reduced strictly in order, each once
    its gradients are all in. A bucket this rank cannot fill (its backward
    failed, or did not reach a parameter) still takes its turn, as a failed
    input, so its peers never wait for it: they keep an ``InputFailed`` naming
    this rank, whose own blocks keep the failure.
    """

    def __init__(self, group: Any, op: str, dtype: np.dtype, entries: list[_Entry], engine: Any,
                 bucket_bytes: int = 0) -> None:
        self.group = group
        self.op = op
        self.dtype = dtype
        self.entries = entries
        self.engine = engine
        self.by_tensor: dict[int, _Entry] = {}
        self.hooks: list = []
        self.buckets: list[list[_Entry]] = []
        limit = bucket_bytes or BUCKET_BYTES
        size = limit
        for e in reversed(entries):
            if size >= limit:
                self.buckets.append([])
                size = 0
            e.bucket = len(self.buckets) - 1
            self.buckets[-1].append(e)
            size += e.nbytes
        self.missing = [len(b) for b in self.buckets]
        self.next = 0  # the next bucket to send
        self.futures: list[tuple[list[_Entry], Any]] = []  # (bucket, Future, or the call to make here)
        self.params: list[tuple[Any, _Entry]] = []  # (the parameter, its entry)

    def watch(self, t: Any, e: _Entry) -> None:
        """Follow parameter ``t``'s gradient: a hook sends each bucket once its gradients are all in. With
        one bucket there is no hook: it is reduced at :meth:`finish` whatever a hook would say."""
        self.params.append((t, e))
        if len(self.buckets) > 1:
            self.by_tensor[id(t)] = e
            self.hooks.append(t.register_post_accumulate_grad_hook(self.on_grad))

    def on_grad(self, t: Any) -> None:
        e = self.by_tensor.get(id(t))
        if e is None or e.grad is not None:
            return
        e.grad = t.grad
        self.missing[e.bucket] -= 1
        while self.next < len(self.buckets) and not self.missing[self.next]:
            self._send(self.next, False)
            self.next += 1

    def _send(self, k: int, failed: bool) -> None:
        bucket = self.buckets[k]
        COUNTS["buckets"] += 1
        COUNTS["grads"] += len(bucket)
        if k == len(self.buckets) - 1:
            # the last bucket: the backward is all but done; it runs in this thread at finish, after
            # the others (a small model's only bucket never waits for a thread to wake)
            self.futures.append((bucket, (self._reduce, bucket, failed)))
        else:
            self.futures.append((bucket, _thread().submit(self._reduce, bucket, failed)))

    def _reduce(self, bucket: list[_Entry], failed: bool) -> list | list[int]:
        if failed:
            return self.group.allreduce_checked(np.zeros(1, self.dtype), op=self.op, failed=True)
        hosts = [np.asarray(self.engine.host_view(e.grad), dtype=self.dtype).reshape(-1) for e in bucket]
        buf = np.concatenate(hosts) if len(hosts) > 1 else hosts[0].copy()
        out = np.empty_like(buf)
        g = self.group
        small = getattr(g, "small_allreduce_checked", None)  # (a shared-memory group's; not one across hosts)
        if small is not None and buf.nbytes <= g.small_bytes:  # (one compiled round; peers on either path meet)
            missing = small(buf, out, self.op)
        else:
            missing = g.allreduce_checked(buf, out=out, op=self.op)
        if missing:
            return missing
        parts, off = [], 0
        for e, h in zip(bucket, hosts):
            parts.append(out[off:off + h.size].reshape(tuple(e.grad.shape)))
            off += h.size
        return parts

    def finish(self, store: Any, error: BaseException | None) -> set[int]:
        """After the backward (``error``: its failure, if any): send the buckets not sent yet (as failed ones
        on this rank where a gradient is missing), store each bucketed ``g`` and ``m``, or their failures;
        the instruction indices now done."""
        for h in self.hooks:
            h.remove()
        if error is None:
            # a gradient no hook saw is the parameter's ``.grad`` as the program would read it: one this
            # backward did not reach may hold an earlier backward's (torch accumulates until zeroed)
            for t, e in self.params:
                if e.grad is None and t.grad is not None:
                    e.grad = t.grad
                    self.missing[e.bucket] -= 1
        while self.next < len(self.buckets):
            self._send(self.next, self.missing[self.next] > 0)
            self.next += 1
        eng = self.engine
        done: set[int] = set()
        for bucket, fut in self.futures:
            got: Any
            try:
                # the bucket's parts, or the ranks whose gradients were missing
                got = fut[0](*fut[1:]) if type(fut) is tuple else fut.result()
            except BaseException as exc:  # (the group broke: a member died)
                got = exc
            here = error or MeshArrayError("no gradient reached a parameter of this bucket in this backward")
            for i, e in enumerate(bucket):
                done.update((e.gi, e.mi))
                if e.grad is not None:
                    store.put(e.g, e.grad, eng)  # (what grad_of would have given)
                else:
                    store.fail(e.g, here)
                if isinstance(got, BaseException):
                    store.fail(e.m, got)
                elif got and type(got[0]) is int:  # missing on some ranks: here (the failure), or elsewhere
                    failed_here = any(x.grad is None for x in bucket)
                    store.fail(e.m, here if failed_here else InputFailed(list(got), e.m))
                else:
                    store.put(e.m, eng.from_numpy(got[i]), eng)
        return done


def _bucket_bytes(group: Any) -> int:
    """How full a bucket of ``group``'s gradients goes: :data:`BUCKET_BYTES`, or, unless
    ``MESHARRAY_BUCKET_BYTES`` says so, no limit (one bucket, reduced after the backward) for
    a shared-memory group whose members have no CPU to spare (``spare_cpu``, which they
    agreed at its join: every member must cut the same buckets). A bucket reduced during
    the backward needs a CPU for the communication thread: without one, the thread and the
    backward of every member take turns on the same CPUs, and the reduction's rendezvous
    waits for their time slices. A group across hosts keeps the buckets: its hosts may differ."""
    if _BUCKET_SET or getattr(group, "spare_cpu", True):
        return BUCKET_BYTES
    return 1 << 62


def prepare(program: list, i: int, get: Callable[[int], Any], group_of: Callable[[tuple, int], Any],
            engine_of: Callable[[int], Any], plan_of: Callable[[Any], Any] | None = None) -> Overlap | None:
    """An :class:`Overlap` for the ``backward`` at ``program[i]``, or None when nothing follows it to bucket.

    Whether there are buckets, and which, depends on the program alone (every
    member decides the same): ``g = w.grad`` followed by a reduction of ``g``
    (sum or mean, no fetch, one plan for all, a shared-memory group), with
    nothing else naming ``g`` in between and ``w`` not changed in place before
    it, up to the first instruction past which gradients may change or be read
    (an effect, a collective, a move, a wait's check). ``get(bid)`` is a block
    of this rank (or raises), ``engine_of(bid)`` its engine, ``group_of(fields,
    src)`` the group of a reduction (``Planned`` fields), or None; ``plan_of(key)`` the bytes of
    a plan sent by its key (``kplan``), or None.
    """
    if BUCKET_BYTES <= 0:  # (MESHARRAY_BUCKET_BYTES=0: every reduction as the program says)
        return None
    # the two passes over the program, compiled (_core.bucket_scan: what the docstring says)
    scanned = bucket_scan(program, i, grad_of, _BARRIERS, plan_of, block_ids)
    if scanned is None:
        return None
    plan, found = scanned
    if not found:
        return None
    entries = [_Entry(*e) for e in found]
    fields = _PLAN_FIELDS.get(plan)
    if fields is None:
        if len(_PLAN_FIELDS) > 64:
            _PLAN_FIELDS.clear()
        fields = _PLAN_FIELDS[plan] = pickle.loads(plan)  # (op, groups, backend, dtype, torch_init, pids, hosts)
    if fields[0] not in _OPS or fields[2] is not None:
        return None
    group = group_of(fields, entries[0].g)
    if group is None or not hasattr(group, "allreduce_checked"):
        return None
    ov = Overlap(group, fields[0], np.dtype(fields[3]), entries, None, _bucket_bytes(group))
    COUNTS["backwards"] += 1
    for e in entries:
        try:  # (a parameter this rank lacks, or that is no leaf requiring grad: its bucket fails here)
            t = get(e.w)
            if ov.engine is None:
                ov.engine = engine_of(e.w)
            if getattr(t, "requires_grad", False) and getattr(t, "is_leaf", False):
                ov.watch(t, e)
        except BaseException:
            pass
    if ov.engine is None:
        ov.engine = get_engine("torch")
    return ov
