"""Collectives between hosts over data-plane links: a pipelined ring.

``RingCollective`` joins ``size`` members (one per host: the host leaders of
:class:`~mesharray.collectives.hier.HierCollective`) in a ring: member ``i``
sends to ``i + 1`` on one link and receives from ``i - 1`` on another
(:mod:`mesharray.transport.dataplane`: TCP, or UCX).

Allreduce is the bandwidth-optimal ring: the message is cut into ``size``
segments; ``size - 1`` reduce-scatter steps leave each member with one fully
reduced segment, ``size - 1`` allgather steps pass those around. Every step
after the first sends exactly the segment the previous step received, so the
steps are *pipelined in chunks* (:data:`CHUNK`): a chunk is reduced as soon as
it arrives and handed to the sending thread at once, so the send of step
``s + 1`` overlaps the receive of step ``s`` and the link never idles while a
whole segment is reduced. Each member moves ``2 (size - 1) / size`` of the
message each way — for two hosts, the whole message once each way. The
member's own data is read where it lies: its segment is sent from ``send``
and each received chunk is reduced with ``send``'s into ``out``, so ``send``
is never copied into ``out`` first.

Sends run in one thread per group (blocking sends release the GIL); receives
and reductions in the caller's. A peer that goes away fails the operation
with :class:`~mesharray.errors.ActorDiedError` naming it, never a hang.

Over the UCX plane (links with a ``ring_run`` method: :mod:`mesharray.transport.ucx`)
the whole loop runs in compiled code instead: the same steps, chunks and order
are written as a table ``(address, nbytes, flags, source)`` that one C call
executes (posting sends and receives, reducing each fragment as it lands in
UCX's receive segment, forwarding each chunk),
without the GIL and without a thread hand-off per chunk. Reductions of the
dtypes of ``ucx.RING_DTYPES`` (floats and integers of 1 to 8 bytes, native byte
order) run there; others take the Python loop.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import numpy as np

from .._core import buffer_address
from ..errors import ActorDiedError
from ..transport.dataplane import Link
from ._args import as_contiguous, check_out, split_mean

__all__ = ["RingCollective", "CHUNK", "UFUNCS"]

#: bytes per pipelined chunk
CHUNK = 1 << 20
UFUNCS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}
# the flags of a compiled ring step (transport.ucx / _ucp.ring_run)
_SEND, _RECV, _REDUCE, _FORWARD = 1, 2, 4, 8


class RingCollective:
    """A ring of ``size`` members; ``right`` is the link to member ``rank + 1``, ``left`` from ``rank - 1``.

    With ``size == 1`` no links are needed (every operation is a copy).
    ``peers`` names the neighbours in error messages.
    """

    def __init__(self, rank: int, size: int, right: Link | None, left: Link | None,
                 peers: tuple[str, str] = ("", "")) -> None:
        if size > 1 and (right is None or left is None):
            raise ValueError("a ring of more than one member needs both links")
        self.rank, self.size = rank, size
        self.right, self.left, self.peers = right, left, peers  # (the links to rank + 1 and rank - 1)
        self._q: queue.Queue = queue.Queue()
        self._err: BaseException | None = None
        self._thread: threading.Thread | None = None
        # the compiled loop: both links of one UCX plane (their own ring_run)
        self._native = (size > 1 and type(right) is type(left) and callable(getattr(right, "ring_run", None)))
        #: operations the compiled loop ran (tests and benchmarks read it)
        self.native_runs = 0
        if size > 1 and not self._native:
            self._start_sender()

    def _start_sender(self) -> None:
        self._thread = threading.Thread(target=self._send_loop, name="mesharray-ring-send", daemon=True)
        self._thread.start()

    # -- the sending thread ------------------------------------------------------------
    def _send_loop(self) -> None:
        assert self.right is not None
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                if self._err is None:
                    self.right.send(item)
            except BaseException as exc:
                self._err = exc
            finally:
                self._q.task_done()

    def _send(self, view: memoryview) -> None:
        if view.nbytes:
            if self._thread is None:  # (compiled links, a dtype their loop does not reduce)
                self._start_sender()
            self._q.put(view)

    def _recv(self, view: memoryview) -> None:
        if not view.nbytes:
            return
        assert self.left is not None
        try:
            self.left.recv_into(view)
        except (ConnectionError, OSError) as exc:
            raise self._died("receiving from", self.peers[1], exc) from exc

    def _finish(self) -> None:
        self._q.join()  # the caller may reuse ``out`` once every send is done
        if self._err is not None:
            err, self._err = self._err, None
            raise self._died("sending to", self.peers[0], err) from err

    def _died(self, what: str, peer: str, exc: BaseException) -> ActorDiedError:
        return ActorDiedError(reason=f"ring collective member {self.rank}/{self.size}: the link {what} "
                                     f"{peer or 'a neighbour'} broke ({exc})")

    # -- collectives -----------------------------------------------------------------
    def _segments(self, count: int) -> list[tuple[int, int]]:
        base, extra = divmod(count, self.size)
        out, start = [], 0
        for j in range(self.size):
            n = base + (j < extra)
            out.append((start, start + n))
            start += n
        return out

    def allreduce(self, send: Any, out: Any = None, op: str = "sum") -> np.ndarray:
        """Reduce ``send`` elementwise over the ring; every member gets the result in ``out``."""
        send = as_contiguous(send, "send")
        out = check_out(out, send.shape, send.dtype)
        kop, mean = split_mean(op, send.dtype)
        ufunc = UFUNCS.get(kop)
        if ufunc is None:
            raise ValueError(f"unknown reduction op {op!r}; expected one of {(*UFUNCS, 'mean')}")
        if self.size == 1:
            if out is not send:
                np.copyto(out, send)
        elif out is send or not np.may_share_memory(out, send):
            # fused: the own segment is sent from ``send``, each received one reduced from ``send`` into
            # ``out``, so ``send`` is never copied into ``out`` first (one pass over the message less)
            self._allreduce(out.reshape(-1), ufunc, send.reshape(-1))
        else:  # (partly overlapping: copy first, then reduce in place)
            np.copyto(out, send)
            self._allreduce(out.reshape(-1), ufunc, out.reshape(-1))
        if mean:
            np.divide(out, self.size, out=out)
        return out

    def _run_native(self, rows: list[tuple[int, int, int, int]], dtype: str = "u1", op: str = "sum") -> None:
        steps = np.array(rows, dtype=np.uint64).reshape(-1, 4)
        try:
            self.right.ring_run(self.left, steps, dtype, op, CHUNK)  # type: ignore[union-attr]
        except (ConnectionError, OSError) as exc:
            raise self._died("exchanging with", f"{self.peers[0]}/{self.peers[1]}".strip("/"), exc) from exc
        self.native_runs += 1

    def _allreduce(self, flat: np.ndarray, ufunc: np.ufunc, own: np.ndarray) -> None:
        """Reduce into ``flat`` over the ring, this member's contribution read from ``own`` (``flat`` or unaliased)."""
        L, i = self.size, self.rank
        code = flat.dtype.str[1:]
        if self._native and flat.dtype.isnative and code in _native_dtypes(self.right):
            op = next(k for k, v in UFUNCS.items() if v is ufunc)
            self._run_native(self._allreduce_plan(flat, own), code, op)
            return
        seg = self._segments(flat.size)
        step = max(1, CHUNK // max(1, flat.itemsize))
        raw, src = flat.view(np.uint8).data, own.view(np.uint8).data
        isz = flat.itemsize
        tmp = np.empty(min(step, max(e - s for s, e in seg)), dtype=flat.dtype)
        tmp_b = tmp.view(np.uint8).data

        def chunks(j: int):
            s, e = seg[j % L]
            for a in range(s, e, step):
                yield a, min(a + step, e)

        for a, b in chunks(i):  # the first step sends this member's own segment as it is
            self._send(src[a * isz:b * isz])
        received = [((i - 1 - s) % L, True) for s in range(L - 1)] + [((i - s) % L, False) for s in range(L - 1)]
        try:
            for k, (j, reduce) in enumerate(received):
                last = k == len(received) - 1
                for a, b in chunks(j):
                    n = b - a
                    if reduce:
                        self._recv(tmp_b[:n * isz])
                        ufunc(own[a:b], tmp[:n], out=flat[a:b])
                    else:
                        self._recv(raw[a * isz:b * isz])
                    if not last:
                        self._send(raw[a * isz:b * isz])
        finally:
            self._finish()

    def _allreduce_plan(self, flat: np.ndarray, own: np.ndarray) -> list[tuple[int, int, int, int]]:
        """The steps of :meth:`_allreduce`, in its order, as ``(address, nbytes, flags, source)`` rows.

        A step that sends reads ``source``; a reducing receive writes ``source ⊕ received`` to
        ``address``; other steps have ``source == address``.
        """
        L, i = self.size, self.rank
        seg = self._segments(flat.size)
        isz = flat.itemsize
        step = max(1, CHUNK // max(1, isz))
        base = buffer_address(flat, True)[0] if flat.size else 0
        obase = base if own is flat else (buffer_address(own, False)[0] if own.size else 0)
        rows = []
        s, e = seg[i]
        rows += [(base + a * isz, (min(a + step, e) - a) * isz, _SEND, obase + a * isz) for a in range(s, e, step)]
        received = [((i - 1 - k) % L, True) for k in range(L - 1)] + [((i - k) % L, False) for k in range(L - 1)]
        for k, (j, reduce) in enumerate(received):
            flags = _RECV | (_REDUCE if reduce else 0) | (0 if k == len(received) - 1 else _FORWARD)
            s, e = seg[j]
            rows += [(base + a * isz, (min(a + step, e) - a) * isz, flags, (obase if reduce else base) + a * isz)
                     for a in range(s, e, step)]
        return rows

    def broadcast(self, buf: Any, root: int = 0) -> np.ndarray:
        """Copy ``buf`` of member ``root`` into ``buf`` of every member (pipelined along the ring)."""
        buf = as_contiguous(buf, "buf")
        if not 0 <= root < self.size:
            raise ValueError(f"root must be a member in [0, {self.size}), got {root!r}")
        if self.size == 1:
            return buf
        raw = buf.reshape(-1).view(np.uint8).data
        last = (root - 1) % self.size  # the member that does not forward
        if self._native:
            base = buffer_address(raw, self.rank != root)[0] if raw.nbytes else 0  # (the root only reads)
            flags = _SEND if self.rank == root else (_RECV | (0 if self.rank == last else _FORWARD))
            self._run_native([(base + a, min(CHUNK, raw.nbytes - a), flags, base + a)
                              for a in range(0, raw.nbytes, CHUNK)])
            return buf
        try:
            for a in range(0, raw.nbytes, CHUNK):
                part = raw[a:a + CHUNK]
                if self.rank != root:
                    self._recv(part)
                if self.rank != last:
                    self._send(part)
        finally:
            self._finish()
        return buf

    def allgather_bytes(self, parts: list[memoryview]) -> None:
        """Member ``j`` fills ``parts[j]`` (any sizes, known to all); afterwards every member has all of them."""
        L, i = self.size, self.rank
        if L == 1:
            return
        if self._native:
            def row(j: int, flags: int) -> list[tuple[int, int, int, int]]:
                n = memoryview(parts[j]).nbytes
                a = buffer_address(parts[j], True)[0]
                return [(a, n, flags, a)] if n else []
            rows = row(i, _SEND)
            for s in range(L - 1):
                rows += row((i - 1 - s) % L, _RECV | (_FORWARD if s < L - 2 else 0))
            self._run_native(rows)
            return
        try:
            self._send(parts[i])
            for s in range(L - 1):
                j = (i - 1 - s) % L
                self._recv(parts[j])
                if s < L - 2:
                    self._send(parts[j])
        finally:
            self._finish()

    def allgather(self, send: Any, out: Any = None) -> np.ndarray:
        """Every member's ``send`` in ``out`` of shape ``(size, *send.shape)``."""
        send = as_contiguous(send, "send")
        out = check_out(out, (self.size,) + send.shape, send.dtype)
        out[self.rank] = send
        self.allgather_bytes([out[j].reshape(-1).view(np.uint8).data for j in range(self.size)])
        return out

    def barrier(self) -> None:
        self.allreduce(np.zeros(1, dtype=np.int32))

    def close(self) -> None:
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(2.0)
            self._thread = None
        for link in (self.right, self.left):
            if link is not None:
                link.close()

    def __repr__(self) -> str:
        return f"RingCollective(rank={self.rank}, size={self.size})"


def _native_dtypes(link: Any) -> frozenset:
    """The reductions a link's compiled loop supports (``dtype.str`` without the byte order)."""
    return getattr(link, "ring_dtypes", frozenset())
