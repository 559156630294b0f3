"""Small allreduces between hosts: recursive doubling among the host leaders, over data-plane links.

The pipelined ring (:mod:`.ring`) moves a large message at the links' bandwidth
but takes ``2 (size - 1)`` steps one after the other: for a few bytes over
sixteen hosts that is thirty round trips of latency. Recursive doubling takes
``log2(size)`` steps: in step ``s`` member ``i`` swaps its partial result with
member ``i XOR 2**s`` and both reduce the two, so after the last step every
member holds the whole reduction. With a size that is not a power of two, the
members past the largest power of two first hand their partial to a partner
below it and get the result back at the end. Both members of a pair reduce the
same two operands, so every member ends with the same bits.

A message carries the group indices of members whose input failed (a union,
so every member learns of every failure) and, when there are none, the
partial result. A link that breaks fails the operation with
:class:`~mesharray.errors.ActorDiedError` naming the peer.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np

from ..errors import ActorDiedError
from ..transport.dataplane import Link, process_plane, rendezvous
from .ring import UFUNCS

__all__ = ["TreeCollective", "leader_tree"]

_HEAD = struct.Struct("<II")  # failed members, payload bytes


class TreeCollective:
    """Member ``rank`` of ``size`` (one per host); ``links[j]``: the link to member ``j`` (the partners only).

    ``names[j]`` names member ``j`` in errors; ``ranks[j]``, when given, is its global rank (the
    :class:`~mesharray.errors.ActorDiedError` of a link that broke names it).
    """

    def __init__(self, rank: int, size: int, links: dict[int, Link], names: dict[int, str],
                 ranks: dict[int, int] | None = None) -> None:
        self.rank = rank
        self.size = size
        self.links = links
        self.names = names
        self.ranks = ranks or {}

    @staticmethod
    def partners(rank: int, size: int) -> list[int]:
        """The members ``rank`` exchanges with, in order (see the module docstring).

        >>> TreeCollective.partners(0, 8), TreeCollective.partners(5, 6), TreeCollective.partners(1, 6)
        ([1, 2, 4], [1], [5, 0, 3, 5])
        """
        p = 1
        while p * 2 <= size:
            p *= 2
        if rank >= p:
            return [rank - p]
        out = []
        if rank + p < size:
            out.append(rank + p)
        s = 1
        while s < p:
            out.append(rank ^ s)
            s *= 2
        if rank + p < size:
            out.append(rank + p)
        return out

    def _swap(self, j: int, data: bytes | None, failed: set[int], nbytes: int,
              give: bool = True, take: bool = True) -> tuple[bytes | None, set[int]]:
        link = self.links[j]
        try:
            if give:
                bad = sorted(failed)
                body = struct.pack(f"<{len(bad)}I", *bad) + (b"" if bad or data is None else data)
                link.send(_HEAD.pack(len(bad), len(body) - 4 * len(bad)) + body)
            if not take:
                return None, set()
            head = bytearray(_HEAD.size)
            link.recv_into(memoryview(head))
            nbad, n = _HEAD.unpack(head)
            body2 = bytearray(4 * nbad + n)
            if body2:
                link.recv_into(memoryview(body2))
        except (OSError, EOFError, ConnectionError, TimeoutError) as exc:
            who = self.ranks.get(j)
            if isinstance(exc, TimeoutError) or isinstance(exc.__cause__, TimeoutError):
                who = None  # (silent for the links' timeout: alive maybe, so not named as dead)
            raise ActorDiedError(ranks=() if who is None else (who,),
                                 reason=f"the link to {self.names.get(j, j)} broke during a small reduction "
                                        f"between hosts: {exc}") from exc
        got = set(struct.unpack_from(f"<{nbad}I", body2, 0)) if nbad else set()
        return (bytes(body2[4 * nbad:]) if n else None), got

    def allreduce(self, data: np.ndarray | None, failed: list[int], op: str) -> tuple[np.ndarray | None, list[int]]:
        """Reduce ``data`` (this host's partial; None when ``failed`` names members whose input failed)
        with every member's: ``(result, [])``, or ``(None, every failed member)``."""
        kop = "sum" if op == "mean" else op
        ufunc = UFUNCS[kop]
        dtype, shape = (data.dtype, data.shape) if data is not None else (None, None)
        acc = None if data is None else np.ascontiguousarray(data).copy()
        bad = set(failed)
        size, rank = self.size, self.rank
        p = 1
        while p * 2 <= size:
            p *= 2
        nbytes = 0 if acc is None else acc.nbytes

        def merge(other: bytes | None, got: set[int]) -> None:
            nonlocal acc
            bad.update(got)
            if bad:
                acc = None
            elif other is not None and acc is not None:
                ufunc(acc, np.frombuffer(other, dtype=acc.dtype).reshape(acc.shape), out=acc)

        if rank >= p:  # hand the partial to rank - p, get the result back
            self._swap(rank - p, None if acc is None else acc.tobytes(), bad, nbytes, take=False)
            other, got = self._swap(rank - p, None, set(), nbytes, give=False)
            bad = got
            if bad:
                return None, sorted(bad)
            assert other is not None and dtype is not None
            return np.frombuffer(other, dtype=dtype).reshape(shape).copy(), []
        if rank + p < size:
            other, got = self._swap(rank + p, None, set(), nbytes, give=False)
            merge(other, got)
        s = 1
        while s < p:
            other, got = self._swap(rank ^ s, None if acc is None else acc.tobytes(), bad, nbytes)
            merge(other, got)
            s *= 2
        if rank + p < size:
            self._swap(rank + p, None if acc is None else acc.tobytes(), bad, nbytes, take=False)
        return (None, sorted(bad)) if bad else (acc, [])

    def close(self) -> None:
        for link in self.links.values():
            try:
                link.close()
            except Exception:
                pass


def leader_tree(leaders: tuple[int, ...], me: int, token: str, addresses: dict[int, str],
                timeout: float) -> TreeCollective:
    """This host leader's member of the tree of ``leaders`` (global ranks), over the process's data plane.

    ``addresses[r]``: rank r's data-plane address. Every leader calls it at the
    same point of its program: it opens the links to its partners of higher
    index and takes those of lower index as they come (no order to wait on).
    """
    plane = process_plane()
    if plane is None:
        raise ActorDiedError(reason=f"rank {me} has no data plane: a group spanning hosts needs workers started by "
                                    f"host agents (ma.attach)")
    n, i = len(leaders), leaders.index(me)
    digest = hashlib.sha1(repr(leaders).encode()).hexdigest()[:12]

    def tag(a: int, b: int) -> bytes:
        return f"tree/{token}/{digest}/{a}/{b}".encode()

    partners = sorted(set(TreeCollective.partners(i, n)))
    links: dict[int, Link] = {}
    try:
        for j in partners:
            if j > i:
                links[j] = plane.connect(addresses[leaders[j]], tag(i, j), timeout=timeout)
        for j in partners:
            if j < i:
                try:
                    links[j] = rendezvous().take(tag(j, i), timeout)
                except TimeoutError as exc:
                    raise ActorDiedError(ranks=(leaders[j],), reason=(
                        f"rank {leaders[j]} did not open its link to rank {me} within {timeout:g} s")) from exc
    except BaseException:
        for link in links.values():
            link.close()
        raise
    return TreeCollective(i, n, links, {j: f"rank {leaders[j]}" for j in partners}, {j: leaders[j] for j in partners})
