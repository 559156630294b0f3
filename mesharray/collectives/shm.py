"""The built-in shared-memory collective backend, for ranks on one host.

N processes map one POSIX shared-memory segment (named by the caller) made of
a control area, one *slot* per rank and a result area. Every operation runs in
numbered *rounds* (a message larger than a slot is cut into several rounds);
each rank only ever writes its own flags (single writer, so plain atomic
loads and stores with acquire/release ordering suffice — no locks, no futex):

- ``arrive[r] = k``  rank r has written its slot for round k;
- ``reduced[r] = k`` rank r has reduced its share of round k into the result area;
- ``done[r] = k``    rank r no longer reads anybody's slot or the result area of round k.

A rank starts round k only once every rank is done with round k-1, so slots
and the result area are reused without copies or page faults (the segment is
mapped once, at the group's creation, and pre-faulted). An allreduce is a
reduce-scatter into the result area (each rank reduces 1/N of the elements
with the nogil kernels of ``_core``) followed by an allgather of the result
area — two barriers per round; small messages skip the second barrier (every
rank reduces everything itself). Large allreduces (``single_copy_min`` bytes
per member and more) skip the slots: the members copy straight between their
own buffers with cross-memory attach (:mod:`._single_copy`, a base of the
group's class). Every word of the segment is drawn in :mod:`._shm_layout`.

Waiting spins, then yields the core for ``MESHARRAY_SPIN_US`` (ranks may
outnumber cores), then naps an eighth of the time waited so far (a peer far
behind costs no core; ``_core.set_spin``), and returns to Python every few
milliseconds to check that the peers it waits for are alive: a dead peer fails the operation on every survivor with
:class:`~mesharray.errors.ActorDiedError` instead of hanging it.

A group whose members outnumber the cores (any member's view of its own
CPUs, agreed at the join) does its small allreduces as *host rounds* instead
(``_core.host_round``): one barrier whose waiters sleep on a futex, the last
member to arrive reducing for everyone and waking them. Spinning members
there take the cores that the members they wait for need: with 64 members on
2 cores each round cost every member's time slices. Such members also join on
a futex (the last one in raises a word in the segment's first page), and check
on each other less often the more members share a CPU (up to 4x): N members
each checking N peers is N² per host, paid on the CPUs of the members waited
for. A group that spans hosts
(:class:`~.hier.HierCollective`) uses the same round for its host's part, its
leader combining the hosts' partial results (:mod:`.tree`). Both kinds of
round share the group's sequence, so they may follow each other in any order.
A member that needs the result only later (a distributed array's rank that
does not send it back) may leave a host round once it arrived
(:meth:`ShmCollective.small_allreduce_lazy`) and finish it at the group's next
operation, or sooner (:meth:`ShmCollective.settle`): it then wakes once per
reduction, for the message that starts it, not a second time for the result.
A host round's state and steps are compiled in the group's base class,
``_core.HostRounds`` (every member of a host runs them for every small
reduction); this module keeps the rest and the rounds' rare branches.
"""

from __future__ import annotations

import mmap
import os
import pickle
import secrets
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from .. import _platform, _proc_stat
from .._core import (
    HostRounds,
    arrive_lazy,
    atomic_load,
    atomic_store,
    buffer_address,
    copy_bytes,
    fetch_add,
    publish_word,
    reduce_addresses,
    set_spin,
    small_round,
    wait_flags,
    wait_word,
)
from ..errors import ActorDiedError, MeshArrayError, SupervisionError
from ..transport import cma
from ._args import as_contiguous, check_out, scatter_part_shape
from ._shm_layout import ALL_JOINED, ARRIVE, DONE, HOST_WORDS, JOINED, LINE, MAGIC, NFLAGS, PAGE, PID, REDUCED, round_up
from ._single_copy import SINGLE_COPY_MIN, SINGLE_COPY_MIN_SHARED_CORES, SingleCopy

# how long a waiter yields its core before it naps (_core.set_spin)
set_spin(float(os.environ.get("MESHARRAY_SPIN_US", "50")) * 1e-6)

__all__ = ["ShmCollective", "unique_segment_name", "REDUCE_OPS", "SINGLE_COPY_MIN", "SINGLE_COPY_MIN_SHARED_CORES"]

REDUCE_OPS = ("sum", "prod", "min", "max", "mean")

_SMALL = 64 * 1024  # bytes under which every rank reduces the whole round itself
_POLL = 0.005  # seconds between liveness checks while waiting
#: seconds a sleeping member of a host round sleeps before it checks on the members that have not
#: arrived (every member, each _HOST_ALL-th time): a sleeper costs nothing, but a check costs syscalls
_HOST_POLL = 0.05
_HOST_ALL = 20

_DTYPES = {np.dtype(t): np.dtype(t).name for t in (
    "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")}


def unique_segment_name(prefix: str = "mesharray") -> str:
    """A fresh segment name that no other job on this host uses.

    Examples
    --------
    >>> unique_segment_name("job").startswith("job-")
    True
    """
    return f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}"


class ShmCollective(HostRounds, SingleCopy):
    """A group of ``size`` processes on one host doing collectives through shared memory.

    Every member constructs it with the same ``name``, ``size`` and
    ``capacity`` and its own ``rank``; the constructor returns once every member
    has attached (then the name is unlinked, so nothing is left in ``/dev/shm``
    even if a member crashes later). Members must call the same collectives in
    the same order with matching shapes and dtypes.

    Parameters
    ----------
    name : str
        Segment name shared by the members (see :func:`unique_segment_name`).
    rank, size : int
        This member's index in ``0..size-1`` and the number of members.
    capacity : int
        Bytes per slot; larger messages are pipelined through it in rounds.
    timeout : float
        Seconds an operation (or the join) may wait for a live peer before it
        raises ``TimeoutError``. A dead peer is detected within milliseconds.
    global_ranks : sequence of int, optional
        The members' global ranks, used in error messages (default: 0..size-1).
    peer_pids : sequence of int, optional
        The members' process ids when the caller knows them (a runtime does):
        a member that dies before it even attaches is then detected during
        the join too, instead of after ``timeout``.
    single_copy_min : int, "auto" or None
        Bytes per member from which :meth:`allreduce` reads and writes the
        peers' own buffers (cross-memory attach) instead of staging through
        the segment; ``None`` never does; ``"auto"``: :data:`SINGLE_COPY_MIN`,
        or :data:`SINGLE_COPY_MIN_SHARED_CORES` when the members outnumber
        this process's cores. The members agree on it at the join (the
        largest wins; ``None`` anywhere, a refusal of the kernel, or
        ``MESHARRAY_PORTABLE=1`` turn it off for the whole group).

    Examples
    --------
    A group of one (more members are separate processes):

    >>> import numpy as np
    >>> g = ShmCollective(unique_segment_name(), rank=0, size=1)
    >>> g.allreduce(np.arange(3.0)).tolist()
    [0.0, 1.0, 2.0]
    >>> g.close()
    """

    def __init__(self, name: str, rank: int, size: int, capacity: int = 4 << 20,
                 timeout: float = 60.0, global_ranks: Sequence[int] | None = None,
                 peer_pids: Sequence[int] | None = None, single_copy_min: int | str | None = "auto") -> None:
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"segment name must be a non-empty str without '/', got {name!r}")
        for label, v in (("rank", rank), ("size", size), ("capacity", capacity)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
                raise TypeError(f"{label} must be an int, got {type(v).__name__}")
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if not 0 <= rank < size:
            raise ValueError(f"rank must be in [0, {size}), got {rank}")
        if capacity < LINE:
            raise ValueError(f"capacity must be >= {LINE} bytes, got {capacity}")
        if single_copy_min == "auto":
            single_copy_min = SINGLE_COPY_MIN if size <= _platform.usable_cpus() else SINGLE_COPY_MIN_SHARED_CORES
        elif single_copy_min is not None:
            if not isinstance(single_copy_min, (int, np.integer)) or isinstance(single_copy_min, bool):
                raise TypeError(f"single_copy_min must be an int, 'auto' or None, got {single_copy_min!r}")
            if single_copy_min < 0:
                raise ValueError(f"single_copy_min must be >= 0 bytes, 'auto' or None, got {single_copy_min}")
        self.name = name
        self.rank = int(rank)
        self.size = int(size)
        self.capacity = round_up(int(capacity), LINE)
        self.timeout = float(timeout)
        self.global_ranks = tuple(int(r) for r in (global_ranks if global_ranks is not None else range(size)))
        self._peer_pids = tuple(int(p) for p in peer_pids) if peer_pids is not None else (0,) * self.size
        if len(self._peer_pids) != self.size:
            raise ValueError(f"peer_pids has {len(self._peer_pids)} entries for a group of size {size}")
        if len(self.global_ranks) != self.size:
            raise ValueError(f"global_ranks has {len(self.global_ranks)} entries for a group of size {size}")
        self._created = False
        self._seq = 0
        self._broken: BaseException | None = None
        self._closed = False
        # the per-rank flags, then the group's three counters of single-copy reductions
        self._ctrl = round_up(PAGE + (self.size * NFLAGS + 3 + HOST_WORDS + self.size) * LINE, PAGE)
        self._hr = 0  # host rounds so far (the same count on every member)
        #: this member's peers outnumber its CPUs: its waits sleep rather than spin (_wait_sleeping)
        self._crowded = self.size > _platform.usable_cpus()
        #: the longest nap of a member waiting for the group's creation (the segment, the join): many
        #: members on few CPUs (a host of 64 ranks on 2) nap longer, or their looks take the CPUs the
        #: members they wait for need
        self._join_nap = min(0.05, 0.002 * max(1.0, self.size / _platform.usable_cpus()))
        self._last_host = 0  # the sequence number of this member's last host round
        #: a host round this member arrived at and left before its result was in (:meth:`settle`)
        self._pending: tuple | None = None
        self._settling = threading.Lock()
        self._futex = _platform.LINUX_NATIVE  # (a host round's sleepers sleep on a futex, else nap)
        # how often a crowded waiter checks on its peers: each of N members checking N is N² a host,
        # so a host of many members a CPU checks less often (x1 up to 16 members a CPU, x4 at most)
        slow = min(4.0, max(1.0, self.size / _platform.usable_cpus() / 16))
        #: seconds between a crowded waiter's signals 0 to the first member it waits for, and its
        #: reads of the ``/proc/PID/stat`` of those it waits for (zombies)
        self._check_every, self._check_all_every = 0.1 * slow, 1.0 * slow
        self._host_poll, self._host_all = _HOST_POLL * slow, _HOST_ALL
        self.sleepy = False  # small allreduces are host rounds (agreed at the join)
        #: every member has a CPU more than the group has members (agreed at the join): a member's
        #: thread may reduce while its others compute (the gradient buckets, darray.overlap)
        self.spare_cpu = False
        self._chunks = 0  # chunks of single-copy reductions so far: where the counters start
        self._slot_bytes = round_up(self.capacity, PAGE)
        self._nbytes = self._ctrl + (self.size + 1) * self._slot_bytes
        # where the name lives, for messages: a file in /dev/shm on Linux, a shm_open name elsewhere
        self._path = f"/dev/shm/{name}" if _platform.LINUX_NATIVE else f"shm_open('/{name}')"
        self._mm: mmap.mmap | None = None
        self._arr: np.ndarray | None = None
        self._joined = False  # set once the join finished (close then marks this member as left)
        # what this member offers; after the join, what the group agreed (None: slots only)
        self.single_copy_min: int | None = None if single_copy_min is None else int(single_copy_min)
        self._scratch: np.ndarray | None = None
        self._open()
        self._join()

    # --- segment lifecycle -----------------------------------------------------------

    def _open(self) -> None:
        deadline = time.monotonic() + self.timeout
        looks = 0
        nap = 0.0005
        if self.rank == 0:
            try:
                fd = _platform.shm_open(self.name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                raise FileExistsError(
                    f"shared-memory segment {self.name!r} already exists; another group uses "
                    f"the name, or a crashed job left it behind (remove {self._path})"
                ) from None
            self._created = True
            try:
                os.ftruncate(fd, self._nbytes)
                mm = mmap.mmap(fd, self._nbytes)
            finally:
                os.close(fd)
        else:
            while True:
                try:
                    fd = _platform.shm_open(self.name, os.O_RDWR)
                except FileNotFoundError:
                    fd = -1
                if fd >= 0:
                    try:
                        # one fstat: rank 0 creates the file empty and sizes it next, so a
                        # second look could see the size change between two reads of it
                        have = os.fstat(fd).st_size
                        if have == self._nbytes:
                            mm = mmap.mmap(fd, self._nbytes)
                            break
                        if have > 0:
                            raise ValueError(
                                f"segment {self.name!r} has {have} bytes but this member "
                                f"expects {self._nbytes}: members disagree on size or capacity"
                            )
                    finally:
                        os.close(fd)
                # Any dead member dooms the group, not only its creator: rank 0 may have
                # created the segment, seen that member dead during the join and
                # unlinked the name before this (late) member looked for it; the name
                # then never appears again, and waiting out the timeout here would
                # hold this worker's reader thread past the next collective's join. (Checked
                # every 20 looks: reading /proc/PID/stat of peers busy mapping memory is slow,
                # and sixty-three members looking at sixty-three peers every millisecond were
                # most of a large group's creation)
                looks += 1
                dead = [] if looks % 20 else [
                    j for j in range(self.size)
                    if j != self.rank and self._peer_pids[j] and not _proc_stat.alive(self._peer_pids[j])]
                if dead:
                    raise ActorDiedError(
                        ranks=[self.global_ranks[j] for j in dead], pid=self._peer_pids[dead[0]],
                        reason=(f"died before creating shared-memory group {self.name!r}" if dead[0] == 0
                                else f"died before joining shared-memory group {self.name!r}"),
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"shared-memory segment {self.name!r} did not appear within {self.timeout} s "
                        f"(rank 0 of the group never created it)"
                    )
                time.sleep(nap)
                nap = min(nap * 2, self._join_nap)
        self._mm = mm
        self._arr = np.frombuffer(mm, dtype=np.uint8)
        self._base = int(self._arr.ctypes.data)
        self._slots = [self._arr[self._slot_off(j):self._slot_off(j) + self.capacity] for j in range(self.size)]
        self._result = self._arr[self._slot_off(self.size):self._slot_off(self.size) + self.capacity]
        self._slot_addr = [self._base + self._slot_off(j) for j in range(self.size)]
        self._res_addr = self._base + self._slot_off(self.size)
        self._all = list(range(self.size))
        self._flags_at = self._flag(ARRIVE, 0)  # the first flag line (small_round's ``flags``)
        self._hctl = self._base + PAGE + (self.size * NFLAGS + 3) * LINE  # (host_round's ``ctl``)
        self._done_at = self._flag(DONE, self.rank)
        self._bad: np.ndarray | None = None  # small_round's failed-member bytes (made on first use)
        if self.rank == 0:
            atomic_store(self._base, MAGIC)
        else:
            while atomic_load(self._base) != MAGIC:
                if self._peer_pids[0] and not _proc_stat.alive(self._peer_pids[0]):
                    self.close()
                    raise ActorDiedError(ranks=[self.global_ranks[0]], pid=self._peer_pids[0],
                                         reason=f"died while creating shared-memory group {self.name!r}")
                if time.monotonic() > deadline:
                    self.close()
                    raise TimeoutError(f"shared-memory segment {self.name!r} was never initialised by rank 0")
                time.sleep(nap)
                nap = min(nap * 2, self._join_nap)
        self._faulted = False  # our slot and our share of the result area pre-faulted (see _prefault)

    def _prefault(self) -> None:
        # pre-fault our slot and our share of the result area before the first large reduction:
        # page faults during it would otherwise halve its bandwidth. Not before: a group that
        # only reduces small messages (a loss, a norm) touches a page of each, not megabytes
        self._faulted = True
        self._slots[self.rank][::PAGE] = 0
        lo, hi = self._share(self.capacity, self.rank)
        self._result[lo:hi:PAGE] = 0

    def _slot_off(self, j: int) -> int:
        return self._ctrl + j * self._slot_bytes

    def _flag(self, kind: int, j: int) -> int:
        return self._base + PAGE + (kind * self.size + j) * LINE

    def _join(self) -> None:
        # what this member offers for single-copy reductions rides on the pid's line:
        # +8 the threshold (-1: none), +16 the address of a probe word to read
        offer = -1
        if self.single_copy_min is not None and self.size > 1 and _platform.LINUX_NATIVE:
            cma.allow_attach()
            offer = self.single_copy_min
        self._probe = np.array([MAGIC], dtype=np.int64)
        line = self._flag(PID, self.rank)
        atomic_store(line + 8, offer)
        atomic_store(line + 16, int(self._probe.ctypes.data))
        # +24: whether this member has fewer CPUs than the group has members (host rounds, if any does)
        atomic_store(line + 24, 1 if self.size > _platform.usable_cpus() else 0)
        atomic_store(line + 40, _platform.usable_cpus())  # +40: its CPUs (spare_cpu; +32 is its leaving)
        atomic_store(line, os.getpid())
        if fetch_add(self._base + JOINED, 1) == self.size - 1:  # the last one in wakes the sleepers
            publish_word(self._base + ALL_JOINED, 1, self._futex)
        try:
            self._wait(PID, 1, range(self.size), "join", nap=self._join_nap, word=self._base + ALL_JOINED)
            self.sleepy = self.size > 1 and any(atomic_load(self._flag(PID, j) + 24) for j in range(self.size))
            self.spare_cpu = all(atomic_load(self._flag(PID, j) + 40) > self.size for j in range(self.size))
            self.single_copy_min = self._agree_single_copy(offer)
            self._joined = True
        except BaseException:
            # a failed join leaves nothing behind: no name in /dev/shm, no mapping
            self.close()
            raise
        if self.rank == 0:
            self._unlink()

    def _unlink(self) -> None:
        if not self._created:
            return
        try:
            _platform.shm_unlink(self.name)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unmap the segment (idempotent); the group cannot be used afterwards."""
        if self._closed:
            return
        self._closed = True
        self._pending = None  # (its result is nobody's now)
        if self._arr is not None and self._joined:
            # +32 of the pid's line: this member left the group on purpose; a peer that
            # finds its process gone later names it as having left, not as dead
            atomic_store(self._flag(PID, self.rank) + 32, 1)
        self._unlink()
        self._slots = []
        self._scratch = None
        self._result = None  # type: ignore[assignment]  # closed: the views go with the mapping
        self._arr = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a caller still holds a view; the mapping goes with it
                pass
            self._mm = None

    def __enter__(self) -> "ShmCollective":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            if hasattr(self, "_closed"):
                self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"ShmCollective(name={self.name!r}, rank={self.rank}, size={self.size}, capacity={self.capacity})"

    # --- synchronisation ---------------------------------------------------------------

    def _wait(self, kind: int, target: int, ranks, what: str, base: int = 0, nap: float = 0.002,
              word: int = 0) -> None:
        """Wait until flag ``kind`` of every rank in ``ranks`` is ``>= target``, checking the peers' lives.

        With ``base``, wait for the one word at that address instead (``ranks`` is ``[0]``); ``nap``:
        the longest sleep between looks of a crowded member; ``word``: a word raised to 1 once
        every flag is there, which a crowded member sleeps on (:meth:`_wait_sleeping`).
        """
        stride = LINE
        if base:
            stride = 0
        else:
            base = self._flag(kind, 0)
        if self._crowded:
            self._wait_sleeping(base, stride, list(ranks), target, what, nap, word)
            return
        pending = wait_flags(base, stride, ranks, target, _POLL)
        if pending < 0:
            return
        ranks = list(ranks)
        deadline = time.monotonic() + self.timeout
        while True:
            pending = wait_flags(base, stride, ranks, target, _POLL)
            if pending < 0:
                return
            self._check_alive(self._all, what)
            self._check_leader()
            if time.monotonic() > deadline:
                whom = "the other members" if stride == 0 else f"rank {self.global_ranks[pending]}"
                timeout = TimeoutError(
                    f"shared-memory {what} timed out after {self.timeout} s waiting for {whom} "
                    f"of group {self.name!r}"
                )
                self._broken = timeout
                raise timeout
            ranks = ranks[ranks.index(pending):]

    def _wait_sleeping(self, base: int, stride: int, ranks: list, target: int, what: str,
                       nap: float = 0.002, word: int = 0) -> None:
        """:meth:`_wait` for a member whose peers outnumber its cores: it looks, then sleeps (0.1 ms,
        doubling up to ``nap``: 2 ms, longer while the group is made), instead of spinning and
        yielding in a core its peers need; with a ``word`` that the last flag's writer raises, it
        sleeps on that word (a futex) until its next check instead. A look reads the flags from
        the first member not in yet, so a member's looks cost O(members) in all, not each; it
        checks that the first member it waits for exists every 0.1 s, and that every member it
        waits for lives (not a zombie) every second (``_check_every``, ``_check_all_every``:
        longer on a host of many members a CPU)."""
        now = time.monotonic()
        deadline = now + self.timeout
        check, check_all = now + self._check_every, now + self._check_all_every
        word = word if self._futex else 0
        pause = 0.0001
        i, n = 0, len(ranks)  # ranks[:i] have arrived (flags only grow: a look starts at the first not in)
        while True:
            while i < n and atomic_load(base + ranks[i] * stride) >= target:
                i += 1
            if i == n:
                return
            now = time.monotonic()
            if now >= check:
                check = now + self._check_every
                if now >= check_all:  # zombies too (reading /proc/PID/stat of a busy peer is slow): of
                    # every member it waits for (one already in holds nobody up here), or of all
                    check_all = now + self._check_all_every
                    self._check_alive(ranks[i:] if stride else self._all, what)
                else:  # the first member it waits for, with a signal 0 (the others' turn comes as it
                    # arrives, or at the check of every member: N members signalling N each, ten times a
                    # second, took the CPUs of a crowded host from the members they waited for)
                    self._check_alive(ranks[i:i + 1] if stride else self._all, what, _proc_stat.exists)
                self._check_leader()
                if now > deadline:
                    whom = "the other members" if stride == 0 else f"rank {self.global_ranks[ranks[i]]}"
                    timeout = TimeoutError(f"shared-memory {what} timed out after {self.timeout} s waiting for "
                                           f"{whom} of group {self.name!r}")
                    self._broken = timeout
                    raise timeout
            if word:
                wait_word(word, 1, check - now, True)
            else:
                time.sleep(pause)
                pause = min(pause * 2, nap)

    def _pid(self, j: int) -> int:
        return atomic_load(self._flag(PID, j)) or self._peer_pids[j]

    def _check_alive(self, look, what: str, alive=None) -> None:
        """Raise (and break the group) when a member of ``look`` other than this one is gone.

        A member that closed the group and exited is not dead: it is named as having
        left (:class:`~mesharray.errors.SupervisionError`); only members whose processes
        ended without closing are named in the :class:`~mesharray.errors.ActorDiedError`.
        """
        alive = alive or _proc_stat.alive
        gone = [j for j in look if j != self.rank and not alive(self._pid(j))]
        if not gone:
            return
        dead = [j for j in gone if not atomic_load(self._flag(PID, j) + 32)]
        err: BaseException
        if dead:
            err = ActorDiedError(ranks=[self.global_ranks[j] for j in dead], pid=self._pid(dead[0]),
                                 reason=f"died during shared-memory {what} of group {self.name!r}")
        else:
            err = SupervisionError(f"rank(s) {[self.global_ranks[j] for j in gone]} closed shared-memory "
                                   f"group {self.name!r} and exited during its {what}")
        self._broken = err
        raise err

    def _begin(self, what: str) -> int:
        if self._pending is not None:
            self.settle()
        if self._closed:
            raise MeshArrayError(f"shared-memory group {self.name!r} is closed")
        broken = self._broken
        if isinstance(broken, ActorDiedError):
            # the same death, named again for every later use of the group
            raise ActorDiedError(ranks=broken.ranks, pid=broken.pid,
                                 reason=f"died earlier; shared-memory group {self.name!r} is broken") from broken
        if broken is not None:
            raise SupervisionError(
                f"shared-memory group {self.name!r} is broken by an earlier failure: {self._broken}"
            )
        k = self._seq + 1
        if k > 1:
            self._wait(DONE, k - 1, self._all, what)
        self._seq = k
        return k

    def _end(self, k: int) -> None:
        atomic_store(self._flag(DONE, self.rank), k)

    def _share(self, count: int, j: int) -> tuple[int, int]:
        # element range [lo, hi) of `count` that rank j reduces, split evenly
        per, extra = divmod(count, self.size)
        lo = j * per + min(j, extra)
        return lo, lo + per + (1 if j < extra else 0)

    # --- argument checks -----------------------------------------------------------------

    _as_array = staticmethod(as_contiguous)

    @staticmethod
    def _out(out: Any, shape: tuple, dtype: np.dtype) -> np.ndarray:
        return check_out(out, shape, dtype)

    @staticmethod
    def _kernel_dtype(dtype: np.dtype, op: str) -> str:
        if op not in REDUCE_OPS:
            raise ValueError(f"unknown reduction op {op!r}; expected one of {REDUCE_OPS}")
        name = _DTYPES.get(dtype)
        if name is None:
            raise TypeError(f"shared-memory reductions support {sorted(set(_DTYPES.values()))}; got {dtype}")
        if op == "mean" and dtype.kind != "f":
            raise TypeError(f"op 'mean' needs a floating dtype, got {dtype}; cast first")
        return name

    # --- collectives ---------------------------------------------------------------------

    def barrier(self) -> None:
        """Return once every member has entered the barrier."""
        k = self._begin("barrier")
        atomic_store(self._flag(ARRIVE, self.rank), k)
        self._wait(ARRIVE, k, range(self.size), "barrier")
        self._end(k)

    def allreduce(self, send: Any, out: Any = None, op: str = "sum") -> np.ndarray:
        """Reduce ``send`` elementwise across members; every member gets the result.

        ``out`` may be ``send`` (in place). Floating sums are bit-identical to
        ``np.sum(np.stack(all_sends), axis=0)`` (members added in rank order).
        """
        send = self._as_array(send, "send")
        kdt = self._kernel_dtype(send.dtype, op)
        out = self._out(out, send.shape, send.dtype)
        self._reduce_rounds(send, out, "sum" if op == "mean" else op, kdt, root=None)
        if op == "mean":
            np.divide(out, self.size, out=out)
        return out

    def reduce(self, send: Any, out: Any = None, op: str = "sum", root: int = 0) -> np.ndarray | None:
        """Reduce ``send`` across members into ``out`` on ``root``; others get ``None``."""
        send = self._as_array(send, "send")
        kdt = self._kernel_dtype(send.dtype, op)
        self._check_root(root)
        if self.rank == root:
            out = self._out(out, send.shape, send.dtype)
        else:
            out = None
        self._reduce_rounds(send, out, "sum" if op == "mean" else op, kdt, root=root)
        if op == "mean" and out is not None:
            np.divide(out, self.size, out=out)
        return out

    def _check_root(self, root: int) -> None:
        if not isinstance(root, (int, np.integer)) or not 0 <= root < self.size:
            raise ValueError(f"root must be a rank in [0, {self.size}), got {root!r}")

    def allreduce_checked(self, send: Any, out: Any = None, op: str = "sum", failed: bool = False) -> list[int]:
        """:meth:`allreduce` that first agrees on whether every member has its input.

        A member whose input failed passes ``failed=True`` (its ``send`` and ``out``
        are not used) and still takes part, so that no peer waits on it. The agreement
        rides on the first round's arrival flags (no extra round).

        Returns
        -------
        list of int
            Global ranks whose input failed; when not empty nothing was reduced.

        Examples
        --------
        >>> import numpy as np
        >>> from mesharray.collectives import ShmCollective, unique_segment_name
        >>> with ShmCollective(unique_segment_name(), 0, 1) as g:
        ...     out = np.zeros(2)
        ...     g.allreduce_checked(np.ones(2), out), out.tolist()
        ([], [1.0, 1.0])
        """
        send = self._as_array(send, "send")
        kdt = self._kernel_dtype(send.dtype, op)
        out = self._out(out, send.shape, send.dtype) if not failed else None
        if self.sleepy:
            # one host round first, whatever the size (a member whose input failed cannot know it):
            # the whole reduction when small, else the agreement alone, then the slot rounds
            small = send.nbytes <= self.small_bytes
            if small or failed:
                code, idx = self._host_round(send, out, op, kdt, bool(failed))
            else:
                code, idx = self._host_round(np.zeros(1, np.uint8), None, "max", "uint8", False)
            if code:
                return [self.global_ranks[j] for j in idx]
            if small:
                if op == "mean" and out is not None:
                    np.divide(out, self.size, out=out)
                return []
        checked: bool | None = None if self.sleepy else bool(failed)  # (sleepy: agreed in the host round)
        bad = self._reduce_rounds(send, out, "sum" if op == "mean" else op, kdt, root=None, failed=checked)
        if not bad and op == "mean":
            np.divide(out, self.size, out=out)
        return [self.global_ranks[j] for j in bad]

    def small_allreduce_checked(self, send: np.ndarray, out: np.ndarray, op: str) -> list[int]:
        """:meth:`allreduce_checked` of a C-contiguous ``send`` of at most :attr:`small_bytes` bytes
        into a writable C-contiguous ``out`` of its shape and dtype, as one compiled call
        (``_core.small_round``).

        For a caller that runs one reduction plan in a loop (the workers of a distributed
        array); members on this path and on :meth:`allreduce_checked` take part in the same
        rounds.
        """
        kdt = self._kernel_dtype(send.dtype, op)
        if out.dtype != send.dtype or out.shape != send.shape or not (
                send.flags.c_contiguous and out.flags.c_contiguous):
            raise ValueError(f"out must be a C-contiguous array of send's shape {send.shape} and dtype "
                             f"{send.dtype}, and so must send; got out {out.shape} {out.dtype}")
        if send.nbytes > self.small_bytes:
            raise ValueError(f"small_allreduce_checked takes at most {self.small_bytes} bytes, got {send.nbytes}")
        return self.small_allreduce_prechecked(send, out, op, kdt)

    def small_allreduce_prechecked(self, send: np.ndarray, out: np.ndarray, op: str, kdt: str) -> list[int]:
        """:meth:`small_allreduce_checked` for a caller that made its checks itself, once for many
        calls (a reduction plan): ``send`` and ``out`` C-contiguous, of one shape and dtype, at most
        :attr:`small_bytes`; ``kdt`` the dtype's kernel name (``_kernel_dtype``, which checked ``op``)."""
        if self.sleepy:
            return self._finish_small(out, op, *self._host_round(send, out, op, kdt, False))
        # both addresses (a read-only out raises here) before the round is taken
        src, nb = buffer_address(send)
        dst = buffer_address(out, True)[0]
        bad = self._bad
        if bad is None:
            bad = self._bad = np.zeros(self.size, dtype=np.uint8)
        kop = "sum" if op == "mean" else op
        k = self._begin_small()
        code = small_round(self._flags_at, self.size, self.rank, k, src, nb, dst, self._slot_addr, send.size, kdt,
                           kop, False, 0, _POLL, bad)
        while code < 0:  # a wait ran past _POLL: check that the member waited for lives, then go on
            j = -code - 1
            if j < self.size:
                self._wait(DONE, k - 1, self._all[j:], "reduction")
                start = 1
            else:
                self._wait(ARRIVE, k, self._all[j - self.size:], "reduction")
                start = 2
            code = small_round(self._flags_at, self.size, self.rank, k, src, nb, dst, self._slot_addr, send.size,
                               kdt, kop, False, start, _POLL, bad)
        if code:
            return [self.global_ranks[j] for j in self._all if bad[j]]
        if op == "mean":
            np.divide(out, self.size, out=out)
        return []

    def small_allreduce_lazy(self, send: np.ndarray, out: np.ndarray, op: str, kdt: str,
                             done: Callable[[Any], None]) -> list[int] | None:
        """:meth:`small_allreduce_prechecked` for a member that needs the result later, if at all.

        In a host round (:attr:`sleepy`) the member arrives and returns None at once unless the
        result is in already; the round is finished by :meth:`settle`, which the group's next
        operation runs first, and ``done`` then gets what :meth:`small_allreduce_prechecked`
        would have returned (``[]``: ``out`` holds the result) or the error it would have
        raised. A member of many on few CPUs thus wakes once per reduction (for the message
        that starts it), not twice. Other groups run :meth:`small_allreduce_prechecked`.
        """
        target = self.lazy_target()
        if target is None:
            return self.small_allreduce_prechecked(send, out, op, kdt)
        return arrive_lazy(target, send, out, op, kdt, done)

    def lazy_target(self) -> tuple | None:
        """Where :meth:`small_allreduce_lazy` arrives (``_core.arrive_lazy``'s ``target``): ``(this group,
        False, its finish)`` in a host round (:attr:`sleepy`), else None. Fixed once the group joined."""
        return (self, False, self._finish_small) if self.sleepy else None

    def _finish_small(self, out: np.ndarray, op: str, code: int, bad_idx: list[int]) -> list[int]:
        if code:
            return [self.global_ranks[j] for j in bad_idx]
        if op == "mean":
            np.divide(out, self.size, out=out)
        return []

    @property
    def small_bytes(self) -> int:
        """The largest message :meth:`small_allreduce_checked` takes (one round, every member reducing it all)."""
        return min(_SMALL, self.capacity)

    # --- host rounds (see the module docstring) -----------------------------------------

    def _wait_round(self, k: int) -> None:
        # a host round after slot round k (HostRounds._host_round): nobody may still read the
        # slots or the result area
        self._wait(DONE, k, self._all, "reduction")

    def _host_failed_round(self, k: int) -> tuple[int, list[int]]:
        """The end of host round ``k`` (sequence number) whose inputs failed (``_host_round``'s code 1):
        ``(1, the failed members' indices)``, or raise the leader's error (:meth:`host_fail`)."""
        if atomic_load(self._hctl + 192) < 0:  # the leader's cross-host step failed (host_fail)
            self._last_host = k
            atomic_store(self._done_at, k)
            err = self._broken = self._leader_error()
            raise err
        bad = self._host_failed()
        self._last_host = k
        atomic_store(self._done_at, k)  # (for a slot round that may come next)
        return 1, bad

    def _host_failed(self) -> list[int]:
        assert self._arr is not None
        n = min(atomic_load(self._hctl + 192), self.capacity // 4)
        off = self._slot_off(self.size)
        return np.frombuffer(self._arr, dtype=np.uint32, count=n, offset=off).tolist()

    def host_partial(self, nbytes: int) -> tuple[memoryview | None, list[int]]:
        """After a host round that returned 2: the host's partial result (``nbytes``), or None and the
        indices of this host's members whose input failed."""
        bad = self._host_failed() if atomic_load(self._hctl + 192) else []
        if bad:
            return None, bad
        return self._result[:nbytes].data, []

    def host_publish(self, result: np.ndarray | None, failed: list[int]) -> None:
        """The leader's end of a host round that returned 2: the group's result (or the group indices
        of the failed inputs) for the host's members, who wake and copy it."""
        if failed:
            n = min(len(failed), self.capacity // 4)
            np.frombuffer(self._result, dtype=np.uint32, count=n)[:] = failed[:n]
            atomic_store(self._hctl + 192, len(failed))
        else:
            assert result is not None
            atomic_store(self._hctl + 192, 0)
            flat = result.reshape(-1).view(np.uint8)
            self._result[:flat.nbytes] = flat
        publish_word(self._hctl + 128, self._hr, self._futex)
        atomic_store(self._flag(DONE, self.rank), self._seq)

    def host_fail(self, err: BaseException) -> None:
        """The leader's end of a host round that returned 2 when its step across hosts raised ``err``:
        the members wake and raise it too, at once (not at the group's timeout); the group is broken.
        Also after a large allreduce's ring failed: members waiting for the leader's broadcast of
        the result find it at their next check of the peers' lives (:meth:`_check_leader`).

        The error travels pickled in the result area (its length in the first 8 bytes), the
        fourth control word set to -1.
        """
        data = b""
        try:
            data = pickle.dumps(err)
        except Exception:
            pass
        if not data or len(data) + 8 > self.capacity:
            data = pickle.dumps(SupervisionError(
                f"the host's leader (rank {self.global_ranks[self.rank]}) failed in its step across hosts: "
                f"{type(err).__name__}: {err}"[:max(0, self.capacity // 2 - 200)]))
        res = self._result
        res[:8] = np.frombuffer(np.int64(len(data)).tobytes(), dtype=np.uint8)
        res[8:8 + len(data)] = np.frombuffer(data, dtype=np.uint8)
        atomic_store(self._hctl + 192, -1)
        publish_word(self._hctl + 128, self._hr, self._futex)
        atomic_store(self._flag(DONE, self.rank), self._seq)
        self._broken = err

    def _check_leader(self) -> None:
        """Raise the error the host's leader published with :meth:`host_fail`, if it did: a member
        waiting in a later round of the same operation (the broadcast of a large allreduce's result
        after the leader's ring failed) stops at once, not at the group's timeout."""
        if atomic_load(self._hctl + 192) < 0:
            err = self._broken = self._leader_error()
            raise err

    def _leader_error(self) -> BaseException:
        """The error the leader published with :meth:`host_fail`."""
        res = self._result
        n = int(np.frombuffer(res[:8].tobytes(), dtype=np.int64)[0])
        try:
            err = pickle.loads(res[8:8 + n].tobytes())
        except Exception as exc:  # pragma: no cover - the leader pickled it itself
            err = SupervisionError(f"the host's leader failed in its step across hosts (its error: {exc})")
        return err if isinstance(err, BaseException) else SupervisionError(str(err))

    def _check_host(self, r: int, everyone: bool, deadline: float) -> None:
        """A host round's wait ran out: the members it may wait for must be alive (raises when one is not).

        Each time, the members not arrived yet must exist (a signal 0 each); every
        ``_HOST_ALL``-th time (``everyone``), every member must be alive and no zombie
        (``/proc/PID/stat``: tens of microseconds a member, too much for every sleeper of
        a host of many ranks twenty times a second).
        """
        if everyone:
            self._check_alive([j for j in self._all if j != self.rank], "reduction")
        else:
            look = [j for j in self._all if j != self.rank and atomic_load(self._hctl + 256 + j * 64) < r]
            self._check_alive(look, "reduction", _proc_stat.exists)
        if time.monotonic() > deadline:
            err2 = TimeoutError(f"shared-memory reduction timed out after {self.timeout} s waiting for the other "
                                f"members of group {self.name!r}")
            self._broken = err2
            raise err2

    def _begin_small(self) -> int:
        # _begin without its wait for the previous round (small_round waits for it)
        if self._pending is not None:
            self.settle()
        if self._closed or self._broken is not None:
            self._begin("reduction")  # raises the group's error
        k = self._seq = self._seq + 1
        return k

    def _reduce_rounds(self, send: np.ndarray, out: np.ndarray | None, op: str, kdt: str, root: int | None,
                       failed: bool | None = None) -> list[int]:
        isz = send.dtype.itemsize
        src, total_bytes = buffer_address(send)
        dst = buffer_address(out, True)[0] if out is not None else 0
        if (root is None and not failed and self.single_copy_min is not None
                and total_bytes >= max(self.single_copy_min, 1)):
            # a member whose input failed takes the slot path with a 1-element send: both
            # paths start with the same arrival (flag and status word), so it stays in step
            return self._reduce_single_copy(send, out, src, dst, op, kdt, checked=failed is not None)
        total = send.size
        per_round = max(1, self.capacity // isz)
        slot_addrs = self._slot_addr
        mine = slot_addrs[self.rank]
        everyone = self._all
        start = 0
        while True:
            count = min(per_round, total - start)
            nb = count * isz
            off = start * isz
            k = self._begin("reduction")
            if not self._faulted and nb > _SMALL:
                self._prefault()  # (once every member is done with the round before: nobody reads these bytes)
            if failed is not None and start == 0:
                # the status word sits after the arrival flag in its line: written
                # before the (release) store of the flag, read after the (acquire) wait
                atomic_store(self._flag(ARRIVE, self.rank) + 8, k if failed else 0)
                if not failed:
                    copy_bytes(mine, src + off, nb)
                atomic_store(self._flag(ARRIVE, self.rank), k)
                self._wait(ARRIVE, k, everyone, "reduction")
                bad = [j for j in everyone if atomic_load(self._flag(ARRIVE, j) + 8) == k]
                if bad:
                    self._end(k)
                    return bad
            else:
                copy_bytes(mine, src + off, nb)
                atomic_store(self._flag(ARRIVE, self.rank), k)
                self._wait(ARRIVE, k, everyone, "reduction")
            if nb <= _SMALL or self.size == 1:
                if dst:
                    # every member reduces the whole (small) round itself: one barrier
                    reduce_addresses(dst + off, slot_addrs, count, kdt, op)
            else:
                lo, hi = self._share(count, self.rank)
                if hi > lo:
                    reduce_addresses(self._res_addr + lo * isz, [a + lo * isz for a in slot_addrs], hi - lo, kdt, op)
                atomic_store(self._flag(REDUCED, self.rank), k)
                if dst:
                    self._wait(REDUCED, k, everyone, "reduction")
                    copy_bytes(dst + off, self._res_addr, nb)
            self._end(k)
            start += count
            if start >= total:
                return []

    def broadcast(self, buf: Any, root: int = 0) -> np.ndarray:
        """Copy ``buf`` of ``root`` into ``buf`` of every member (in place); returns ``buf``."""
        buf = self._as_array(buf, "buf")
        self._check_root(root)
        if self.rank != root and not buf.flags.writeable:
            raise ValueError("buf is read-only")
        data = buf.reshape(-1).view(np.uint8)
        total = data.size
        start = 0
        while True:
            nb = min(self.capacity, total - start)
            k = self._begin("broadcast")
            if self.rank == root:
                self._slots[root][:nb] = data[start:start + nb]
                atomic_store(self._flag(ARRIVE, self.rank), k)
            else:
                atomic_store(self._flag(ARRIVE, self.rank), k)
                self._wait(ARRIVE, k, [root], "broadcast")
                data[start:start + nb] = self._slots[root][:nb]
            self._end(k)
            start += nb
            if start >= total:
                return buf

    def allgather(self, send: Any, out: Any = None) -> np.ndarray:
        """Gather every member's ``send`` into ``out`` of shape ``(size, *send.shape)`` on every member."""
        send = self._as_array(send, "send")
        out = self._out(out, (self.size,) + send.shape, send.dtype)
        src = send.reshape(-1).view(np.uint8)
        dst = out.reshape(self.size, -1).view(np.uint8)
        total = src.size
        start = 0
        while True:
            nb = min(self.capacity, total - start)
            k = self._begin("allgather")
            self._slots[self.rank][:nb] = src[start:start + nb]
            atomic_store(self._flag(ARRIVE, self.rank), k)
            self._wait(ARRIVE, k, range(self.size), "allgather")
            for j in range(self.size):
                dst[j, start:start + nb] = self._slots[j][:nb]
            self._end(k)
            start += nb
            if start >= total:
                return out

    def reduce_scatter(self, send: Any, out: Any = None, op: str = "sum") -> np.ndarray:
        """Reduce ``send`` across members and give member r the r-th of ``size`` equal parts.

        ``send`` has shape ``(size, *rest)`` (or a 1-D length divisible by
        ``size``); ``out`` gets shape ``rest`` (or ``len // size``).
        """
        send = self._as_array(send, "send")
        kdt = self._kernel_dtype(send.dtype, op)
        part_shape = scatter_part_shape(send.shape, self.size)
        out = self._out(out, part_shape, send.dtype)
        kop = "sum" if op == "mean" else op
        isz = send.dtype.itemsize
        part = send.size // self.size
        src = send.reshape(self.size, part)
        dst = out.reshape(-1)
        per_round = max(1, self.capacity // isz // self.size)
        slot_addrs = [self._base + self._slot_off(j) for j in range(self.size)]
        start = 0
        while True:
            count = min(per_round, part - start)
            k = self._begin("reduce_scatter")
            # slot layout of one round: size pieces of `count` elements, piece j for member j
            mine = self._slots[self.rank][:count * self.size * isz].view(send.dtype).reshape(self.size, count)
            mine[...] = src[:, start:start + count]
            atomic_store(self._flag(ARRIVE, self.rank), k)
            self._wait(ARRIVE, k, range(self.size), "reduce_scatter")
            if count:
                off = self.rank * count * isz
                reduce_addresses(int(dst[start:].ctypes.data), [a + off for a in slot_addrs], count, kdt, kop)
            self._end(k)
            start += count
            if start >= part:
                break
        if op == "mean":
            np.divide(out, self.size, out=out)
        return out
