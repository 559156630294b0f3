"""The segment of a shared-memory group, word by word: one table for :mod:`.shm` and :mod:`._single_copy`.

Every word is 8 bytes, read and written with ``_core.atomic_load``/``atomic_store``
(or ``fetch_add``/``publish_word`` where noted); every group of words that one
member writes sits on a cache line of its own (``LINE``), so that no member's
stores bounce a line its peers poll. ``N`` is the group's size, ``r`` a member.

===========================================  ==================================================
offset from the segment's start              what
===========================================  ==================================================
0                                            ``MAGIC``, stored by rank 0 once the segment is
                                             sized and mapped (the others wait for it)
``JOINED``                                   members in (``fetch_add`` by each at its join)
``ALL_JOINED``                               1, raised by the last member in (crowded members
                                             sleep on it: a futex)
``flag(kind, r)`` =                          the flag line ``kind`` of member ``r``:
``PAGE + (kind * N + r) * LINE``

- ``ARRIVE``                                 +0 the round whose input ``r`` wrote; +8 the round
                                             its input failed in (``allreduce_checked``);
                                             single copy: +16 ``send``'s address, +24 ``out``'s,
                                             +32 ``send``'s bytes, +40 the round of those three
- ``REDUCED``                                +0 the round whose share ``r`` reduced
- ``DONE``                                   +0 the last round ``r`` is done with; +8 the round
                                             in which a chunk of ``r`` failed (single copy),
                                             +16 the member it could not copy to or from,
                                             +24 the ``errno`` (``ESRCH``: that member died)
- ``PID``                                    +0 the pid (written last: ``r`` joined); +8 its
                                             single-copy offer (-1: none); +16 the address of
                                             its probe word; +24 1 if it has fewer CPUs than
                                             the group has members; +32 1 once it left on
                                             purpose (``close``); +40 its CPUs
- ``CMA``                                    +0 1 once +8 holds ``r``'s verdict on the probe
                                             reads (1: all worked, 2: one failed)
``counter(i)`` =                             single copy's counters (several writers, always
``PAGE + (N * NFLAGS + i) * LINE``           read-modify-writes): 0 chunks claimed, 1 chunks
                                             finished, 2 the last round a chunk failed in
``hctl`` =                                   a host round's words (``_core.host_round``): +0
``PAGE + (N * NFLAGS + 3) * LINE``           arrivals, +64 the host partial's round, +128 the
                                             result's round, +192 failed inputs (-1: the
                                             leader's error, pickled in the result area);
                                             +256 + r * 64 the last round ``r`` arrived at
``ctrl`` = the above, rounded up to a page   one slot per member (``slot_bytes`` each), then
                                             the result area
===========================================  ==================================================
"""

from __future__ import annotations

__all__ = ["MAGIC", "PAGE", "LINE", "JOINED", "ALL_JOINED", "ARRIVE", "REDUCED", "DONE", "PID", "CMA",
           "NFLAGS", "HOST_WORDS", "round_up"]

MAGIC = 0x4D41534852454431  # "MASHRED1"
PAGE = 4096
LINE = 64
JOINED, ALL_JOINED = 1 * LINE, 2 * LINE
# the flag lines of each member
ARRIVE, REDUCED, DONE, PID, CMA = 0, 1, 2, 3, 4
NFLAGS = 5
# a host round's lines before its members' own
HOST_WORDS = 4


def round_up(n: int, to: int) -> int:
    """``n`` rounded up to a multiple of ``to``.

    >>> round_up(65, 64)
    128
    """
    return (n + to - 1) // to * to
