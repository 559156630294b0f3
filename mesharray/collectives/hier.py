"""Hierarchical collectives for a group that spans hosts: shared memory inside a host, a ring between hosts.

The members of a group are split by host (their *memory domain*). On each
host the members form a shared-memory group (:class:`~.shm.ShmCollective`)
whose first member — the lowest rank — is the host's *leader*; the leaders
form a :class:`~.ring.RingCollective` over the network data plane. An
allreduce is: reduce to the leader in shared memory, allreduce among the
leaders over the ring (pipelined in chunks), broadcast from the leader in
shared memory. Only one process per host touches the network, and each host
sends and receives the message about once (two hosts) — the hierarchy MPI
and NCCL use, with no MPI and no torch needed.

Small messages (:attr:`HierCollective.small_bytes`) take another way, whose
cost is latency, not bandwidth: one *host round* of the host's shared-memory
group (its members sleep until the host's partial result is in; see
:mod:`.shm`), then recursive doubling among the leaders (:mod:`.tree`:
``log2(hosts)`` exchanges instead of the ring's ``2 (hosts - 1)`` steps), then
the leader publishes the result to its host's members, who wake and copy it.
The agreement on failed inputs (:meth:`HierCollective.allreduce_checked`)
rides on the same round. A leader whose step across hosts fails publishes its
error instead of the result (:meth:`.shm.ShmCollective.host_fail`): its host's
members raise it at once rather than at the group's timeout. A leader whose host's
reduction fails on a death still takes its turn in the ring, whose one extra
element says so (:meth:`HierCollective._leader_allreduce`): every host then
fails at once, naming the dead rank. The ring and the tree are made when first used, by
every leader at the same point of the group's program.

Results equal NumPy's up to floating-point association: partial sums are
formed per host first, then between hosts.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .._core import arrive_lazy
from ..errors import ActorDiedError, SupervisionError
from ._args import as_contiguous, check_out, scatter_part_shape, split_mean
from .ring import RingCollective
from .shm import _SMALL, ShmCollective
from .tree import TreeCollective

__all__ = ["HierCollective"]

#: per reduction op, the values of the ring's last element (:meth:`HierCollective._leader_allreduce`)
#: for a host whose reduction went well and for one whose failed: any failed one decides the result
_FLAGS = {"sum": (0, 1), "max": (0, 1), "min": (1, 0), "prod": (1, 0)}


class HierCollective:
    """One member's view of a group spread over hosts.

    Parameters
    ----------
    members : tuple of int
        The group's global ranks, in group order (member ``j`` is ``members[j]``).
    me : int
        This process's global rank.
    domains : list
        ``domains[j]``: member ``j``'s memory domain (equal: same host).
    local : ShmCollective or None
        The shared-memory group of this host's members (``None`` when alone on its host).
    ring : RingCollective or None
        The ring of host leaders, ordered by host of first appearance (leaders only).
    make_ring, make_tree : callable, optional
        Make the ring, or the :class:`~.tree.TreeCollective` of the leaders, when
        first needed (leaders only; every leader makes it at the same collective).
    """

    def __init__(self, members: tuple[int, ...], me: int, domains: list, local: ShmCollective | None,
                 ring: RingCollective | None, make_ring: Callable[[], RingCollective] | None = None,
                 make_tree: Callable[[], TreeCollective] | None = None) -> None:
        self.members = members
        self.rank = members.index(me)
        self.size = len(members)
        self.domains = domains
        at: dict = {}  # domain -> its host's index (one pass: every member of a large mesh makes this)
        #: member indices of each host, hosts in order of first appearance
        self.hosts: list[list[int]] = []
        for j, d in enumerate(domains):
            k = at.get(d)
            if k is None:
                k = at[d] = len(self.hosts)
                self.hosts.append([])
            self.hosts[k].append(j)
        self.host = at[domains[self.rank]]
        self.local_members = self.hosts[self.host]
        self.is_leader = self.local_members[0] == self.rank
        self.local = local
        self.ring = ring
        self._make_ring = make_ring
        self._make_tree = make_tree
        self.tree: TreeCollective | None = None
        if self.is_leader and ring is None and make_ring is None and len(self.hosts) > 1:
            raise ValueError("a host leader needs the ring of leaders")

    def _ring(self) -> RingCollective:
        if self.ring is None:
            assert self._make_ring is not None
            self.ring = self._make_ring()
        return self.ring

    # -- building blocks -----------------------------------------------------------
    def _local_bcast(self, buf: np.ndarray, root: int = 0) -> None:
        if self.local is not None:
            self.local.broadcast(buf, root=root)

    # -- collectives ---------------------------------------------------------------
    def allreduce(self, send: Any, out: Any = None, op: str = "sum") -> np.ndarray:
        """Reduce ``send`` elementwise over every member (all hosts); every member gets the result."""
        send = as_contiguous(send, "send")
        out = check_out(out, send.shape, send.dtype)
        kop, mean = split_mean(op, send.dtype)
        if self.is_leader and len(self.hosts) > 1:
            self._leader_allreduce(send, out, kop)
        elif self.local is not None:
            self.local.reduce(send, out=out if self.is_leader else None, op=kop, root=0)
        else:  # (a group of one)
            np.copyto(out, send)
        self._local_bcast(out)
        if mean:
            np.divide(out, self.size, out=out)
        return out

    def _leader_allreduce(self, send: np.ndarray, out: np.ndarray, kop: str) -> None:
        """A leader's part of :meth:`allreduce` across hosts: its host's reduction, then the ring of leaders.

        The ring carries one element more than the message: whether the leader's host reduction
        failed (a member died). A leader whose host reduction failed still takes its turn in the
        ring (the other leaders would wait a minute for it, at the links' timeout), then every
        leader sees the flag: they learn the dead members from one another over the tree, tell
        their hosts' members (:meth:`~.shm.ShmCollective.host_fail`) and raise, at once.
        """
        n = send.size
        buf = np.empty(n + 1, send.dtype)
        part = buf[:n].reshape(send.shape)
        died: BaseException | None = None
        if self.local is not None:
            try:
                self.local.reduce(send, out=part, op=kop, root=0)
            except Exception as exc:
                died = exc
        else:  # (alone on its host)
            np.copyto(part, send)
        ok, failed = _FLAGS[kop]
        buf[n] = failed if died is not None else ok
        try:
            self._ring().allreduce(buf, out=buf, op=kop)
            if buf[n] == ok:
                np.copyto(out, part)
                return
            dead = self._dead_of(died) if isinstance(died, ActorDiedError) else []
            _, dead = self._tree_of_leaders().allreduce(np.zeros(1, np.uint8), dead, "max")
            if died is None and dead:
                died = ActorDiedError(ranks=[self.members[j] for j in dead],
                                      reason=f"died during an allreduce across hosts (group of {self.size})")
            elif died is None:  # (another host's reduction failed, but not on a death: a timeout)
                died = SupervisionError(f"another host's leader failed in its host's part of an allreduce across "
                                        f"hosts (group of {self.size}); its error is raised there")
        except BaseException as exc:
            if died is None:
                died = exc
        if self.local is not None:  # (its members wait for its broadcast of the result)
            self.local.host_fail(died)
        raise died

    def _dead_of(self, exc: BaseException) -> list[int]:
        # the member indices a failure of this host's step names (all its other members if none)
        ranks = getattr(exc, "ranks", None) or ()
        return [self.members.index(r) for r in ranks if r in self.members] or [
            j for j in self.local_members if j != self.rank]

    # -- small messages: a host round, then the tree (see the module docstring) -------------
    @property
    def small_bytes(self) -> int:
        """The largest message that takes the latency path (:meth:`small_allreduce_prechecked`)."""
        return self.local.small_bytes if self.local is not None else _SMALL

    _kernel_dtype = staticmethod(ShmCollective._kernel_dtype)

    def allreduce_checked(self, send: Any, out: Any = None, op: str = "sum", failed: bool = False) -> list[int]:
        """:meth:`allreduce` that first agrees on whether every member has its input (as
        :meth:`ShmCollective.allreduce_checked <.shm.ShmCollective.allreduce_checked>`): the global
        ranks whose input failed (nothing reduced then), else ``[]`` with the result in ``out``."""
        send = as_contiguous(send, "send")
        kdt = self._kernel_dtype(send.dtype, op)
        out = check_out(out, send.shape, send.dtype) if not failed else None
        if send.nbytes <= self.small_bytes:
            return self._small(send, out, op, kdt, bool(failed))
        bad = self._small(np.zeros(1, np.uint8), None, "max", "uint8", bool(failed))  # (the agreement alone)
        if bad:
            return bad
        self.allreduce(send, out=out, op=op)
        return []

    def small_allreduce_prechecked(self, send: np.ndarray, out: np.ndarray, op: str, kdt: str) -> list[int]:
        """A small allreduce for a caller that made its checks once (a reduction plan): ``send`` and
        ``out`` C-contiguous, of one shape and dtype, at most :attr:`small_bytes`; ``kdt`` the dtype's
        kernel name. Returns the global ranks whose input failed (none here: the caller has it)."""
        return self._small(send, out, op, kdt, False)

    def small_allreduce_lazy(self, send: np.ndarray, out: np.ndarray, op: str, kdt: str,
                             done: Callable[[Any], None]) -> list[int] | None:
        """:meth:`small_allreduce_prechecked` for a member that needs the result later, if at all: a
        member other than a leader of several hosts arrives at its host round and returns None, the
        round finished by :meth:`settle` (:meth:`ShmCollective.small_allreduce_lazy
        <.shm.ShmCollective.small_allreduce_lazy>`); a leader combines the hosts as ever."""
        target = self.lazy_target()
        if target is None:
            return self._small(send, out, op, kdt, False)
        return arrive_lazy(target, send, out, op, kdt, done)

    def lazy_target(self) -> tuple | None:
        """Where :meth:`small_allreduce_lazy` arrives (``_core.arrive_lazy``'s ``target``): ``(the host's
        group, whether the group spans hosts, this group's finish)``; None for a leader of several
        hosts (it combines the hosts at once) or a member alone on its host."""
        local = self.local
        cross = len(self.hosts) > 1
        if local is None or (cross and self.is_leader):
            return None
        return (local, cross, self._finish)

    def _finish(self, out: np.ndarray | None, op: str, code: int, bad: list[int]) -> list[int]:
        # a host round's end for a member that is not a leader of several hosts (code 0 or 1)
        if code == 1:  # (group indices when the leader published them, else this host's)
            return [self.members[j if len(self.hosts) > 1 else self.local_members[j]] for j in bad]
        if op == "mean" and out is not None:
            np.divide(out, self.size, out=out)
        return []

    def settle(self) -> None:
        """Finish this member's pending host round, if any (:meth:`.shm.ShmCollective.settle`)."""
        if self.local is not None:
            self.local.settle()

    def _tree_of_leaders(self) -> TreeCollective:
        if self.tree is None:
            assert self._make_tree is not None, "a host leader needs the tree of leaders"
            self.tree = self._make_tree()
        return self.tree

    def _dead_across(self, exc: ActorDiedError, op: str, began: bool) -> None:
        """A leader whose host round failed on a death (now, or one that broke its host's group
        before): the other hosts' leaders wait for it in the tree, so it takes part with the dead
        members as failed inputs (they fail at once, naming them, not at the links' timeout of a
        minute), and tells its host's members the same if the round began. The caller raises ``exc``."""
        dead = self._dead_of(exc)
        try:
            self._tree_of_leaders().allreduce(None, dead, op)
        except BaseException:  # (a link that broke too: its partners see that themselves)
            pass
        if began and self.local is not None:
            self.local.host_publish(None, dead)

    def _small(self, send: np.ndarray, out: np.ndarray | None, op: str, kdt: str, failed: bool) -> list[int]:
        cross = len(self.hosts) > 1
        local = self.local
        result: np.ndarray | None
        if local is not None:
            began = local._hr
            try:
                code, bad = local._host_round(send, out, op, kdt, failed, cross=cross, leader=self.is_leader)
            except ActorDiedError as exc:
                if cross and self.is_leader:
                    self._dead_across(exc, op, local._hr > began)
                raise
            if code < 2:
                return self._finish(out, op, code, bad)
            partial, lbad = local.host_partial(send.nbytes)
            gbad = [self.local_members[j] for j in lbad]
            result = None if partial is None else np.frombuffer(partial, dtype=send.dtype).reshape(send.shape).copy()
        else:  # alone on this host
            gbad = [self.rank] if failed else []
            result = None if failed else send.copy()
        if cross:
            try:
                result, gbad = self._tree_of_leaders().allreduce(result, gbad, op)
            except BaseException as exc:
                if local is not None:  # (the leader: its members wait for its publication)
                    local.host_fail(exc)
                raise
        if local is not None and self.is_leader:
            local.host_publish(result, gbad)
        if gbad:
            return [self.members[j] for j in gbad]
        assert result is not None
        if out is not None:
            np.copyto(out, result.reshape(out.shape))
            if op == "mean":
                np.divide(out, self.size, out=out)
        return []

    def reduce(self, send: Any, out: Any = None, op: str = "sum", root: int = 0) -> np.ndarray | None:
        """Reduce over every member; member ``root`` gets the result, the others ``None``."""
        if not 0 <= root < self.size:
            raise ValueError(f"root must be a member in [0, {self.size}), got {root!r}")
        res = self.allreduce(send, out=out if self.rank == root else None, op=op)
        return res if self.rank == root else None

    def broadcast(self, buf: Any, root: int = 0) -> np.ndarray:
        """Copy member ``root``'s ``buf`` into every member's ``buf`` (in place)."""
        buf = as_contiguous(buf, "buf")
        if not 0 <= root < self.size:
            raise ValueError(f"root must be a member in [0, {self.size}), got {root!r}")
        root_host = next(h for h, ms in enumerate(self.hosts) if root in ms)
        if self.host == root_host and self.local is not None:
            # the root's host first: its leader then holds the data
            self.local.broadcast(buf, root=self.local_members.index(root))
        if self.is_leader and len(self.hosts) > 1:
            self._ring().broadcast(buf, root=root_host)
        if self.host != root_host:
            self._local_bcast(buf)
        return buf

    def allgather(self, send: Any, out: Any = None) -> np.ndarray:
        """Every member's ``send`` in ``out`` of shape ``(size, *send.shape)``, in member order."""
        send = as_contiguous(send, "send")
        out = check_out(out, (self.size,) + send.shape, send.dtype)
        rows = out.reshape(self.size, -1)
        nl = len(self.local_members)
        if self.local is not None:
            mine = self.local.allgather(send)  # (nl, ...) in this host's member order
        else:
            mine = send.reshape((1,) + send.shape)
        for k, j in enumerate(self.local_members):
            rows[j] = mine[k].reshape(-1)
        if self.is_leader and len(self.hosts) > 1:
            # each leader contributes its host's rows, packed; then scatter them into member order
            packed = [np.empty((len(ms), rows.shape[1]), dtype=rows.dtype) for ms in self.hosts]
            packed[self.host][...] = mine.reshape(nl, -1)
            self._ring().allgather_bytes([p.reshape(-1).view(np.uint8).data for p in packed])
            for ms, p in zip(self.hosts, packed):
                rows[ms] = p
        self._local_bcast(out)
        return out

    def reduce_scatter(self, send: Any, out: Any = None, op: str = "sum") -> np.ndarray:
        """Reduce ``send`` (shape ``(size, ...)``) over every member; member ``j`` gets part ``j``."""
        send = as_contiguous(send, "send")
        part_shape = scatter_part_shape(send.shape, self.size)
        full = self.allreduce(send, op=op)
        out = check_out(out, part_shape, send.dtype)
        out.reshape(-1)[...] = full.reshape(self.size, -1)[self.rank]
        return out

    def barrier(self) -> None:
        self.allreduce(np.zeros(1, dtype=np.int32))

    def close(self) -> None:
        # the shared-memory and ring groups are shared with other groups (cached by the caller)
        pass

    def __repr__(self) -> str:
        return (f"HierCollective(member {self.rank} of {self.size}, host {self.host} of {len(self.hosts)}, "
                f"leader={self.is_leader})")
