"""Same-host data plane: large out-of-band pickle-5 buffers in shared memory.

A control frame never carries a large buffer between two processes of one
host. The sender copies the buffer once into a *segment* — an anonymous
``memfd`` mapped in its own address space — and the frame carries only a small
descriptor ``(pid, fd, serial, slot, offset, length)``. The receiver opens the
segment through ``/proc/<pid>/fd/<fd>`` (same user, no name in ``/dev/shm``, so
nothing can leak when a process is killed) — or, where there is no ``/proc``
(macOS; ``MESHARRAY_PORTABLE=1``), gets the descriptor from the sender over a
unix socket (:mod:`.fdpass`, ``SCM_RIGHTS``) — maps it once and keeps the mapping,
and hands pickle a *zero-copy* view: the NumPy array it unpickles lives in the
segment.

Segments are reused, because page faults on fresh memory halve the bandwidth
(PEERS.md). Every segment has one busy byte per receiver ("slot"); the sender
sets the bytes of the receivers of a message, and each receiver clears its byte
when the last object that views the message is garbage-collected (a
``weakref.finalize`` on a per-message exporter). A segment whose bytes are all
clear is free for the sender's next message. Receivers map each segment once
(cache keyed by pid, fd and serial), so the second message through a segment
costs no page faults on either side.

Layout of a segment::

    0      8 bytes  serial (u64, checked by the receiver)
    8      4 bytes  number of slots of the current message
    64     1 byte per slot: busy flags (at most 4032 slots)
    64+2016  1 byte per slot: "sent back" flags (see below)
    4096   data: the message's buffers, each 64-byte aligned

Sending a view back: an actor that returns (part of) an array it received
does not copy it again. The reply names the owner's own segment, and the
receiver-side "back" flag of that slot, set by the actor before replying,
keeps the segment busy until the owner's objects that view the returned data
are collected. Only one such return per message and receiver is in flight at a
time; a second one is copied.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import weakref

import numpy as np

from .. import _platform
from .._core import buffer_address
from . import fdpass

__all__ = ["SegmentPool", "pool", "attach", "back_reference", "available", "forget_peer", "release_peer", "trim",
           "DATA_OFFSET", "MAX_SLOTS"]

DATA_OFFSET = 4096
FLAGS_OFFSET = 64
MAX_SLOTS = (DATA_OFFSET - FLAGS_OFFSET) // 2  # receivers of one message
BACK = MAX_SLOTS  # flag BACK + k: receiver k sent a view of the message back to the owner
MIN_SEGMENT = 1 << 20


def _align(n: int, a: int = 64) -> int:
    return (n + a - 1) & ~(a - 1)


def _available() -> bool:
    if _platform.memfd_via_proc():
        return True
    if not fdpass.available():
        return False
    try:
        _platform.runtime_dir()
    except OSError:
        return False
    return True


_AVAILABLE: bool | None = None


def available() -> bool:
    """Whether segments can be shared with peers here (memfd + /proc, or fd passing); else buffers go inline."""
    global _AVAILABLE
    if _AVAILABLE is None:
        _AVAILABLE = _available()
    return _AVAILABLE


class _Segment:
    __slots__ = ("fd", "size", "mm", "serial", "flags", "nslots", "receivers")

    def __init__(self, size: int, serial: int) -> None:
        self.fd = _platform.anonymous_shm(f"mesharray-{serial}")
        os.ftruncate(self.fd, size)
        self.size = size
        self.mm = mmap.mmap(self.fd, size)
        self.serial = serial
        struct.pack_into("<Q", self.mm, 0, serial)
        self.flags = np.frombuffer(self.mm, np.uint8, 2 * MAX_SLOTS, FLAGS_OFFSET)
        self.nslots = 0
        self.receivers: tuple = ()  # who holds each slot of the current message (a key per slot)

    def free(self) -> bool:
        n = self.nslots
        return n == 0 or not (self.flags[:n].any() or self.flags[BACK:BACK + n].any())


class SegmentPool:
    """The sending side: a process-wide pool of reusable segments."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._segments: list[_Segment] = []
        self._serial = (os.getpid() << 20) & 0xFFFFFFFFFFFF
        self.pid = os.getpid()
        self._server: fdpass.FdServer | None = None  # serves our descriptors where peers have no /proc

    def _lookup(self, fd: int, serial: int) -> int | None:
        with self._lock:
            seg = self.find(fd, serial)
            return None if seg is None else seg.fd

    def write(self, buffers, nslots: int, receivers: tuple = ()):
        """Copy ``buffers`` into a free segment reserved for ``nslots`` receivers.

        ``receivers`` names the receiver of each slot (any hashable key: an
        address, a pid): :meth:`release_peer` frees the slots of a receiver
        that died, which never clears its busy byte itself.
        Returns ``(segment, [(offset, length), ...])``.
        """
        if nslots > MAX_SLOTS:
            raise ValueError(f"a shared-memory message has at most {MAX_SLOTS} receivers, got {nslots}")
        sizes = [memoryview(b).nbytes for b in buffers]
        need = DATA_OFFSET + sum(_align(n) for n in sizes)
        with self._lock:
            seg = None
            for s in self._segments:
                if s.size >= need and s.free():
                    if seg is None or s.size < seg.size:
                        seg = s
            if seg is None:
                if self._server is None and not _platform.memfd_via_proc():
                    self._server = fdpass.FdServer(self._lookup)
                size = max(MIN_SEGMENT, 1 << (need - 1).bit_length())
                self._serial += 1
                seg = _Segment(size, self._serial)
                self._segments.append(seg)
            seg.flags[:nslots] = 1
            seg.nslots = nslots
            seg.receivers = tuple(receivers)
            struct.pack_into("<I", seg.mm, 8, nslots)
        placed = []
        off = DATA_OFFSET
        mv = memoryview(seg.mm)
        try:
            for b, n in zip(buffers, sizes):
                src = memoryview(b)
                if not src.contiguous:
                    raise BufferError("out-of-band buffer is not contiguous")
                mv[off:off + n] = src.cast("B") if src.ndim != 1 or src.format != "B" else src
                placed.append((off, n))
                off += _align(n)
        finally:
            mv.release()
        return seg, placed

    def release_peer(self, key) -> int:
        """Free the slots a dead receiver ``key`` holds (busy and sent-back bytes); how many."""
        n = 0
        with self._lock:
            for s in self._segments:
                for slot, who in enumerate(s.receivers):
                    if who == key and (s.flags[slot] or s.flags[BACK + slot]):
                        s.flags[slot] = 0
                        s.flags[BACK + slot] = 0
                        n += 1
        return n

    def trim(self, keep_bytes: int = 0) -> int:
        """Unmap and close free segments beyond ``keep_bytes`` of free ones (the smallest kept); bytes released."""
        released = 0
        with self._lock:
            kept = 0
            keep: list[_Segment] = []
            for s in sorted(self._segments, key=lambda s: s.size):
                if not s.free() or kept + s.size <= keep_bytes:
                    keep.append(s)
                    kept += s.size if s.free() else 0
                    continue
                del s.flags  # our own view of the flags pins the mapping
                try:
                    s.mm.close()
                except BufferError:  # a local view of it is alive: keep it
                    s.flags = np.frombuffer(s.mm, np.uint8, 2 * MAX_SLOTS, FLAGS_OFFSET)
                    keep.append(s)
                    continue
                os.close(s.fd)
                released += s.size
            self._segments = keep
        return released

    def find(self, fd: int, serial: int):
        for s in self._segments:
            if s.fd == fd and s.serial == serial:
                return s
        return None

    def close(self) -> None:
        with self._lock:
            if self._server is not None:
                self._server.close()
                self._server = None
            for s in self._segments:
                del s.flags  # our own view of the flags pins the mapping
                try:
                    s.mm.close()
                except BufferError:
                    pass  # a local view still exists; the mapping dies with the process
                os.close(s.fd)
            self._segments.clear()


_pool: SegmentPool | None = None
_pool_lock = threading.Lock()


def pool() -> SegmentPool:
    """The pool of this process (recreated after fork)."""
    global _pool
    p = _pool
    if p is None or p.pid != os.getpid():
        with _pool_lock:
            if _pool is None or _pool.pid != os.getpid():
                _pool = SegmentPool()
            p = _pool
    return p


_maps: dict[tuple[int, int, int], mmap.mmap] = {}
_maps_lock = threading.Lock()
# (pid, fd, serial) -> [base address, size, slot of the latest message attached]
_attached: dict[tuple[int, int, int], list] = {}


def _addr(buf) -> int:
    return buffer_address(buf)[0]


def _mapping(pid: int, fd: int, serial: int) -> mmap.mmap:
    key = (pid, fd, serial)
    mm = _maps.get(key)
    if mm is not None:
        return mm
    if pid == os.getpid():  # our own segment coming back: use our own mapping
        seg = pool().find(fd, serial)
        if seg is None:
            raise OSError(f"no shared-memory segment {fd}/{serial} in this process")
        _maps[key] = seg.mm
        return seg.mm
    with _maps_lock:
        mm = _maps.get(key)
        if mm is None:
            if _platform.memfd_via_proc():
                f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
            else:
                f = fdpass.request(pid, fd, serial)
            try:
                mm = mmap.mmap(f, 0)
            finally:
                os.close(f)
            (got,) = struct.unpack_from("<Q", mm, 0)
            if got != serial:
                mm.close()
                raise OSError(f"shared-memory segment {pid}/{fd} has serial {got}, expected {serial}")
            _maps[key] = mm
    return mm


def _release(mm: mmap.mmap, slot: int) -> None:
    try:
        mm[FLAGS_OFFSET + slot] = 0
    except (ValueError, IndexError):  # mapping already closed at interpreter exit
        pass


def attach(pid: int, fd: int, serial: int, slot: int, spans):
    """Receiving side: zero-copy writable views of one message's buffers.

    The views keep the segment's slot busy until the last object that uses
    them is collected.
    """
    mm = _mapping(pid, fd, serial)
    owner = np.frombuffer(mm, np.uint8)  # per-message exporter: its death frees the slot
    weakref.finalize(owner, _release, mm, slot)
    if pid != os.getpid():
        rec = _attached.get((pid, fd, serial))
        if rec is None:
            _attached[(pid, fd, serial)] = [owner.ctypes.data, len(mm), slot, mm]
        else:
            rec[2] = slot
    mv = memoryview(owner)  # type: ignore[arg-type]  # ndarray is a buffer; numpy's stub says so from 3.12
    return [mv[o:o + n] for o, n in spans]


def forget_peer(pid: int) -> None:
    """Drop the mappings of a dead process's segments (those no live object views)."""
    with _maps_lock:
        for key in [k for k in _maps if k[0] == pid]:
            mm = _maps.pop(key)
            _attached.pop(key, None)
            try:
                mm.close()
            except BufferError:  # still viewed by a received array: it dies with that array
                pass


def release_peer(key, pid: int | None = None) -> None:
    """A peer died: free the slots of our segments it held (``key``, and its ``pid``), forget its segments."""
    p = _pool
    if p is not None and p.pid == os.getpid():
        p.release_peer(key)
        if pid is not None:
            p.release_peer(pid)
    if pid is not None:
        forget_peer(pid)


def trim(keep_bytes: int = 0) -> int:
    """Close this process's free segments beyond ``keep_bytes`` (after a mesh stops)."""
    p = _pool
    if p is None or p.pid != os.getpid():
        return 0
    return p.trim(keep_bytes)


def back_reference(buf, dest_pid: int):
    """If ``buf`` lies in a segment of ``dest_pid`` that we received, reserve a back slot.

    Returns ``(fd, serial, back_slot, offset, length)``, or ``None`` when the
    buffer must be copied (not in such a segment, or its back slot still busy
    from an earlier return). The owner clears the back slot when its own views
    of the returned data die, so the segment is not reused under them.
    """
    if not _attached:
        return None
    mv = memoryview(buf)
    n = mv.nbytes
    addr = _addr(mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv)
    for (pid, fd, serial), (base, size, slot, mm) in list(_attached.items()):
        if pid != dest_pid or not (base + DATA_OFFSET <= addr and addr + n <= base + size):
            continue
        back = BACK + slot
        if slot >= MAX_SLOTS or mm[FLAGS_OFFSET + slot] == 0 or mm[FLAGS_OFFSET + back] != 0:
            return None  # not (or no longer) held by us, or a previous return still alive
        mm[FLAGS_OFFSET + back] = 1
        return fd, serial, back, addr - base, n
    return None
