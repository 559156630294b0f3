"""The shared-memory group's single-copy allreduce: straight between the members' own buffers.

Large allreduces (``single_copy_min`` bytes per member and more: by default
1 MiB when every member can have a core of its own, 8 MiB when they share
cores) skip the segment's slots: each member publishes the addresses of its
``send`` and ``out`` with its arrival, and the data moves straight between
the members' own buffers with cross-memory attach
(``process_vm_readv``/``writev``, :func:`mesharray._core.reduce_remote`).
The message is cut into chunks that the members take one at a time from a
shared counter (compare and swap: the group's three counters are the one
place where several members write one word, always with atomic
read-modify-writes, still without locks): for a chunk it took, a member reads that
chunk of every peer's ``send`` (one copy), reduces it with its own into its
``out`` in rank order, and writes the reduced chunk, still in cache, into
every peer's ``out`` (one copy), then raises a shared *finished* counter. A
member returns once every chunk is finished: nobody reads its ``send`` or
writes its ``out`` after that, so there is no barrier at the end. Taking
chunks as they come rather than a fixed share means a member waiting for a
core, or one whose share would lie on costlier pages (a page that is not
huge costs twice as much to attach), holds nobody up. That is one barrier
and about 4 bytes of memory traffic per byte of the message on each of two
members, against two barriers and fourteen bytes through the slots. A chunk
that fails (a peer died: ``ESRCH``) is still counted, marks the round in a
shared *fault* word, and every member raises; before raising, a member waits
until no live peer still copies to or from its buffers.

Whether a group may do this is settled once, at the join: every member reads
a probe word out of every peer and the group takes the single-copy path only
if all reads worked everywhere (none under ``MESHARRAY_PORTABLE=1``, off
Linux, or where Yama/seccomp refuse), and at the largest threshold offered,
so that members never disagree on the algorithm. A member whose input failed
(``allreduce_checked(..., failed=True)``) takes the slot path with a stand-in
of one element; both paths open with the same arrival and status word, so the
group still agrees that nothing is reduced.

:class:`SingleCopy` holds these steps; :class:`~.shm.ShmCollective` takes it
as a base and decides, per allreduce, which path a message takes. The words
this path reads and writes are in the table of :mod:`._shm_layout`.
"""

from __future__ import annotations

import errno
import os
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _proc_stat
from .._core import atomic_load, atomic_store, buffer_address, reduce_remote, vm_copy, wait_flags
from ..errors import ActorDiedError, MeshArrayError
from ._shm_layout import ARRIVE, CMA, DONE, LINE, MAGIC, NFLAGS, PAGE, PID, round_up

__all__ = ["SingleCopy", "SINGLE_COPY_MIN", "SINGLE_COPY_MIN_SHARED_CORES"]

#: Bytes per member from which allreduce copies straight between the members' buffers,
#: when each member can have a core: below it the copies through the shared slots cost
#: no more than the cross-memory attach's system calls.
SINGLE_COPY_MIN = 1 << 20
#: The same when members outnumber the cores. Cross-memory attach pins every page it
#: copies, which costs several times the CPU of a memcpy: while the data fits in cache
#: and members queue for cores, the slots win. Both crossovers are measured, not derived:
#: ``docs/internals.md``, "Distributed arrays" (shared-memory collectives).
SINGLE_COPY_MIN_SHARED_CORES = 8 << 20
# scratch of the single-copy path, all sources together: a step of reduce_remote (read the
# peers' chunks, reduce, push the result) stays in L2, and its system calls are few and
# long (each costs microseconds: 512 KiB per source for 2 members)
_SCRATCH = 1 << 20
_POLL = 0.005  # seconds between liveness checks while a member waits for its peers to stop copying


class SingleCopy:
    """The single-copy steps of a shared-memory group (a base of :class:`~.shm.ShmCollective`).

    They use the group's segment and its synchronisation (``_flag``, ``_begin``,
    ``_wait``, ``_end``, ``_pid``, ``_check_alive``) and keep two pieces of
    state of their own: ``_chunks`` (chunks taken so far, the same count on
    every member: where the counters start) and ``_scratch``.
    """

    _chunks = 0
    _scratch: np.ndarray | None = None

    # what the group provides
    name: str
    rank: int
    size: int
    timeout: float
    global_ranks: tuple[int, ...]
    single_copy_min: int | None
    _base: int
    _all: list[int]
    _join_nap: float
    _broken: BaseException | None

    if TYPE_CHECKING:
        def _flag(self, kind: int, j: int) -> int: ...
        def _pid(self, j: int) -> int: ...
        def _begin(self, what: str) -> int: ...
        def _end(self, k: int) -> None: ...
        def _wait(self, kind: int, target: int, ranks: Any, what: str, base: int = 0, nap: float = 0.002,
                  word: int = 0) -> None: ...
        def _check_alive(self, look: Any, what: str, alive: Any = None) -> None: ...

    def _counter(self, i: int) -> int:
        # 0: chunks claimed, 1: chunks finished, 2: the last round a chunk failed in (each
        # on its own line: claims must not bounce the line the waiters poll)
        return self._base + PAGE + (self.size * NFLAGS + i) * LINE

    def _quiesce(self, k: int) -> None:
        """Before an error leaves round k: wait until no live peer touches our buffers any more.

        A peer may still be reading our ``send`` or writing our ``out`` in a
        chunk it took; the caller may free them once we raise. Each member
        sets ``done`` once its copies are over; dead peers copy nothing.
        """
        deadline = time.monotonic() + self.timeout
        while True:
            live = [j for j in self._all if j != self.rank and _proc_stat.alive(self._pid(j))]
            if wait_flags(self._flag(DONE, 0), LINE, live, k, _POLL) < 0 or time.monotonic() > deadline:
                return

    def _agree_single_copy(self, offer: int) -> int | None:
        """The group's single-copy threshold, the same on every member (None: slots only).

        Every member reads a word out of every peer (the kernel may refuse:
        Yama, seccomp, another user) and publishes whether all reads worked;
        single copy is on only if every member offered it and every read
        worked. One more barrier, once per group.
        """
        offers = [atomic_load(self._flag(PID, j) + 8) for j in range(self.size)]
        ok = offer >= 0 and min(offers) >= 0
        if ok:
            word = np.zeros(1, dtype=np.int64)
            for j in range(self.size):
                if j != self.rank:
                    err = vm_copy(False, self._pid(j), int(word.ctypes.data),
                                  atomic_load(self._flag(PID, j) + 16), 8)
                    if err or int(word[0]) != MAGIC:
                        ok = False
                        break
        line = self._flag(CMA, self.rank)
        atomic_store(line + 8, 1 if ok else 2)
        atomic_store(line, 1)
        self._wait(CMA, 1, range(self.size), "join", nap=self._join_nap)
        if all(atomic_load(self._flag(CMA, j) + 8) == 1 for j in range(self.size)):
            return max(offers)
        return None

    def _reduce_single_copy(self, send: np.ndarray, out: np.ndarray | None, src: int, dst: int, op: str,
                            kdt: str, checked: bool) -> list[int]:
        """Allreduce by cross-memory attach: one barrier in, a shared count of chunks out, no staging.

        Each member publishes its buffers' addresses with its arrival. Then the
        members take the message's chunks one at a time from a shared counter;
        for a chunk it took, a member reads the chunk of every peer's ``send``
        straight out of the peer (``process_vm_readv``), reduces it with its own
        into its ``out`` and writes the reduced chunk, still in cache, into every
        peer's ``out`` (``process_vm_writev``), then counts it finished. Taking
        chunks as they come, not a fixed share, is what keeps a member that is
        waiting for a core (members may outnumber cores) from holding up the
        rest. A member returns once every chunk is finished: nobody reads its
        ``send`` or writes its ``out`` after that.
        """
        assert out is not None
        if dst != src and dst < src + send.nbytes and src < dst + out.nbytes:
            # a partial overlap: the peers would read what this member already overwrote
            send = send.copy()
            src = buffer_address(send)[0]
        k = self._begin("reduction")
        line = self._flag(ARRIVE, self.rank)
        atomic_store(line + 8, 0)  # the status word of allreduce_checked: this input is fine
        atomic_store(line + 16, src)
        atomic_store(line + 24, dst)
        atomic_store(line + 32, send.nbytes)  # (with +40, the round: see below)
        atomic_store(line + 40, k)
        atomic_store(line, k)
        everyone = self._all
        self._wait(ARRIVE, k, everyone, "reduction")
        if checked:
            bad = [j for j in everyone if atomic_load(self._flag(ARRIVE, j) + 8) == k]
            if bad:
                self._end(k)
                return bad
        # Every peer must have published this round's buffers of this size: a member that
        # passed another size (or took the slot path with it) would have its own memory
        # written past its buffer. Everyone reads the same words after the arrival: all the
        # members on this path refuse alike, and the group stays in step.
        sizes = [atomic_load(self._flag(ARRIVE, j) + 32) if atomic_load(self._flag(ARRIVE, j) + 40) == k
                 else -1 for j in everyone]
        if any(n != send.nbytes for n in sizes):
            self._end(k)
            # (a member that published nothing this round took the slots: its message was smaller)
            said = [f"{n} bytes" if n >= 0 else f"under {self.single_copy_min} bytes" for n in sizes]
            raise ValueError(
                f"members of shared-memory group {self.name!r} passed different sizes to one allreduce ("
                + ", ".join(f"rank {self.global_ranks[j]}: {w}" for j, w in zip(everyone, said))
                + "); every member must pass the same shape and dtype"
            )
        me = self.rank
        srcs, pids, dests = [], [], []
        for j in everyone:
            peer = self._flag(ARRIVE, j)
            srcs.append(src if j == me else atomic_load(peer + 16))
            pids.append(0 if j == me else self._pid(j))
            dests.append(0 if j == me else atomic_load(peer + 24))
        # chunks of whole cache lines, at least one per member
        most = max(64 << 10, _SCRATCH // self.size // PAGE * PAGE)
        chunk = min(most, round_up(-(-send.nbytes // self.size), LINE))
        nchunks = -(-send.nbytes // chunk)
        base = self._chunks
        self._chunks = base + nchunks  # the same on every member: same sizes, same order
        if self._scratch is None:
            self._scratch = np.zeros(self.size * most, dtype=np.uint8)  # zeros: touched, no faults later
        failed, err = reduce_remote(dst, srcs, pids, dests, send.size, kdt, op,
                                    buffer_address(self._scratch, True)[0], chunk, self._counter(0), base, k)
        if failed >= 0:
            # who failed, with whom and why, for the peers' message (before done's release store)
            line = self._flag(DONE, me)
            atomic_store(line + 16, failed)
            atomic_store(line + 24, err)
            atomic_store(line + 8, k)
        self._end(k)  # done: this member no longer touches anybody's buffers
        try:
            if failed >= 0 and err == errno.ESRCH:
                raise ActorDiedError(ranks=[self.global_ranks[failed]], pid=pids[failed],
                                     reason=f"died during shared-memory reduction of group {self.name!r}")
            # every chunk finished: nobody reads our send or writes our out any more
            self._wait(0, base + nchunks, [0], "reduction", base=self._counter(1))
            if atomic_load(self._counter(2)) == k:
                self._quiesce(k)
                # a peer died while another took chunks from it
                self._check_alive(everyone, "reduction")
                if failed >= 0:
                    why = (f"rank {self.global_ranks[me]} could not copy to or from rank "
                           f"{self.global_ranks[failed]}: {os.strerror(err)} (errno {err})")
                else:
                    bad = [j for j in everyone if atomic_load(self._flag(DONE, j) + 8) == k]
                    # a peer whose memory was gone (ESRCH) died, though its process may not be a
                    # zombie yet for _check_alive: its address space goes early in its exit
                    gone = sorted({atomic_load(self._flag(DONE, j) + 16) for j in bad
                                   if atomic_load(self._flag(DONE, j) + 24) == errno.ESRCH})
                    if gone:
                        raise ActorDiedError(ranks=[self.global_ranks[j] for j in gone], pid=pids[gone[0]],
                                             reason=f"died during shared-memory reduction of group {self.name!r}")
                    why = f"rank(s) {[self.global_ranks[j] for j in bad]} could not copy their chunks"
                raise MeshArrayError(f"single-copy reduction of shared-memory group {self.name!r} failed: {why}")
        except BaseException as exc:
            self._quiesce(k)
            if self._broken is None:
                self._broken = exc
            raise
        return []
