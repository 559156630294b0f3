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
collectives of a program do. A gradient no hook saw (not reached by this
backward) is left to the instructions themselves, on every rank alike.
"""

from __future__ import annotations

import os
import pickle
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

from .autograd import grad_of

__all__ = ["COUNTS", "Overlap", "prepare"]

#: a bucket this full goes to the communication thread; 0 turns the buckets off
BUCKET_BYTES = int(os.environ.get("MESHARRAY_BUCKET_BYTES", str(1 << 20)))
_OPS = ("sum", "mean")

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
    __slots__ = ("w", "g", "m", "gi", "mi", "grad", "result", "error")

    def __init__(self, w: int, g: int, m: int, gi: int, mi: int) -> None:
        self.w, self.g, self.m, self.gi, self.mi = w, g, m, gi, mi
        self.grad: Any = None
        self.result: Any = None
        self.error: BaseException | None = None


class Overlap:
    """The buckets of one ``backward``: hooks in, results out (see the module docstring)."""

    def __init__(self, group: Any, op: str, dtype: np.dtype, entries: list[_Entry], hooks: list) -> None:
        self.group = group
        self.op = op
        self.dtype = dtype
        self.entries = entries
        self.by_tensor: dict[int, _Entry] = {}
        self.hooks = hooks
        self.bucket: list[_Entry] = []
        self.bytes = 0
        self.seen = 0
        self.futures: list[tuple[list[_Entry], Future]] = []

    def on_grad(self, t: Any) -> None:
        e = self.by_tensor.get(id(t))
        if e is None or e.grad is not None:
            return
        e.grad = t.grad
        self.bucket.append(e)
        self.bytes += e.grad.numel() * e.grad.element_size()
        self.seen += 1
        if self.bytes >= BUCKET_BYTES or self.seen == len(self.entries):
            self._send()

    def _send(self) -> None:
        bucket, self.bucket, self.bytes = self.bucket, [], 0
        if bucket:
            COUNTS["buckets"] += 1
            COUNTS["grads"] += len(bucket)
            self.futures.append((bucket, _thread().submit(self._reduce, bucket)))

    def _reduce(self, bucket: list[_Entry]) -> list:
        hosts = [np.asarray(e.grad.detach().contiguous().numpy(), dtype=self.dtype).reshape(-1) for e in bucket]
        buf = np.concatenate(hosts) if len(hosts) > 1 else hosts[0].copy()
        out = np.empty_like(buf)
        failed = self.group.allreduce_checked(buf, out=out, op=self.op)
        if failed:
            raise RuntimeError(f"the gradients of ranks {failed} were missing in a bucket all-reduce")
        parts, off = [], 0
        for e, h in zip(bucket, hosts):
            parts.append(out[off:off + h.size].reshape(tuple(e.grad.shape)))
            off += h.size
        return parts

    def finish(self, store: Any, engine: Any) -> set[int]:
        """After the backward: store each bucketed ``g`` and ``m``; the instruction indices now done."""
        for h in self.hooks:
            h.remove()
        self._send()  # (a bucket not full when the last hook fired: the entries no hook saw stay out)
        done: set[int] = set()
        for bucket, fut in self.futures:
            try:
                parts = fut.result()
            except BaseException as exc:
                parts = None
                err = exc
            for i, e in enumerate(bucket):
                store.put(e.g, e.grad, engine)  # (what grad_of would have given)
                if parts is None:
                    store.fail(e.m, err)
                else:
                    store.put(e.m, engine.from_numpy(parts[i]), engine)
                done.update((e.gi, e.mi))
        return done


def prepare(program: list, i: int, get: Callable[[int], Any], group_of: Callable[[tuple, int], Any]) -> Overlap | None:
    """An :class:`Overlap` for the ``backward`` at ``program[i]``, or None when nothing follows it to bucket.

    ``get(bid)`` is a block of this rank (or raises); ``group_of(fields, src)``
    the shared-memory group of a reduction (``Planned`` fields), or None.
    """
    if BUCKET_BYTES <= 0:  # (MESHARRAY_BUCKET_BYTES=0: every reduction as the program says)
        return None
    made_at: dict[int, int] = {}
    entries: list[_Entry] = []
    plan = None
    for j in range(i + 1, len(program)):
        ins = program[j]
        code = ins[0]
        if code == "apply" and ins[2] is grad_of and len(ins[3]) == 1 and ins[3][0][0] == "b":
            made_at[ins[1]] = j
        elif code == "plan" and not ins[4] and ins[2] in made_at:
            if plan is None:
                plan = ins[3]
            if ins[3] != plan:
                continue
            gi = made_at[ins[2]]
            entries.append(_Entry(program[gi][3][0][1], ins[2], ins[1], gi, j))
        elif code == "apply" and getattr(ins[2], "backward", False):
            break  # (another backward: its gradients are its own)
    if len(entries) < 1 or plan is None:
        return None
    fields = pickle.loads(plan)  # (op, groups, backend, dtype, torch_init, pids, hosts)
    if fields[0] not in _OPS or fields[2] is not None:
        return None
    group = group_of(fields, entries[0].g)
    if group is None or not hasattr(group, "allreduce_checked"):
        return None
    try:
        tensors = [get(e.w) for e in entries]
    except BaseException:
        return None
    if not all(getattr(t, "requires_grad", False) and getattr(t, "is_leaf", False) for t in tensors):
        return None
    ov = Overlap(group, fields[0], np.dtype(fields[3]), entries, [])
    COUNTS["backwards"] += 1
    for e, t in zip(entries, tensors):
        ov.by_tensor[id(t)] = e
        ov.hooks.append(t.register_post_accumulate_grad_hook(ov.on_grad))
    return ov
