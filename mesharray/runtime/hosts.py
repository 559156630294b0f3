"""The controller's fan-out through the hosts: :class:`HostPlane`, one per process mesh whose hosts have relays.

A process mesh started by host agents on several hosts has one relay process
per host (:mod:`.relay`). A message from the controller to ranks of two hosts
or more — ``call()``, ``broadcast()``, the runtime's one-program-for-all
messages (``call_some``), ``ProcMesh.spawn``, an actor mesh's stop — leaves
the controller once per host: one ``RELAY`` frame to each host's relay, naming
the host's ranks it is for, pickled once for all. The relay sends it on to those
ranks and answers a call once, with every rank's reply (``GATHERED``).
``call_one`` and messages to the ranks of one host keep the direct path (the
worker's own connection to the controller), and so do ``stream()`` and code
running inside actors.

Plans. What a message to a set of ranks needs — each host's relay, the
targets' bytes, the positions of the replies, the ranks known dead — is
computed once per set of ranks (a mesh view) and kept until a channel table
changes (:attr:`Router.gen <mesharray.runtime.router.Router.gen>`, a death) or
a relay is lost: a call in a loop costs one frame per host and one decode per
gathered reply.

Order. A rank receives the controller's frames on two connections; per-sender
order holds across them through fences. The plane counts, per rank, the
relayed frames sent to it (``rsent``) and the direct ones (``dsent``) of the
kinds a rank must keep in order (calls, spawns, actor stops, the stop). A
direct frame sent after relayed frames the rank may not have handled yet is
preceded by ``FENCE(rsent)`` on the direct connection; relayed frames sent
after direct frames are preceded, through the relay, by ``FENCE(dsent)``. The
rank handles a frame only once it has handled that many frames of the other
connection (:mod:`mesharray.runtime.worker`). Counting and fences happen under
one lock, so the fences follow one total order and never wait on each other.
A fence is only sent when the path changes, so a loop on one path sends none.

Failures. A rank's death is the controller's to report (its direct
connection's end and exit status, as without relays): a relay that finds a
rank gone answers ``DIED`` for it, and the caller gets the controller's
:class:`~mesharray.ActorDiedError` for that rank (at once, or when the
controller learns of the death). When the controller records a death it tells
the rank's relay (``GONE``), which answers that rank's part of each call in
flight at once: the reply the rank sent before it went (a rank may reply, then
exit), else ``DIED``; the call does not wait for the host's other ranks (a
relay that is stopped answers when it resumes). A relay that dies takes its
host's ranks with it (they exit when their relay connection ends): the
controller declares them dead at once, naming the relay
(:meth:`HostPlane.relay_lost`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from ..errors import ActorDiedError
from . import protocol as P
from .channel import Channel, Fanout, next_id
from .context import current

__all__ = ["Addresses", "HostPlane", "COUNTED"]

#: the kinds of frames a rank keeps in the controller's order across its two connections
COUNTED = frozenset((P.CALL, P.SPAWN, P.STOP_ACTOR, P.STOP))


class Addresses(list):
    """The worker address of each global rank of a root process mesh, and the mesh's :class:`HostPlane`.

    A ``list`` (a restarted rank's new address is written in place, and every
    actor mesh sharing the list sees it); ``plane`` is ``None`` for a mesh
    without relays.
    """

    __slots__ = ("plane",)

    def __init__(self, addresses: Sequence[str], plane: HostPlane | None = None) -> None:
        super().__init__(addresses)
        self.plane = plane

    def __reduce__(self) -> tuple:
        return (list, (list(self),))  # an actor mesh sent to an actor: a plain list there (no relaying inside actors)


class _Direct:
    """A worker's direct channel's hook into the plane's counts (``Channel.fence``)."""

    __slots__ = ("plane", "rank")

    def __init__(self, plane: HostPlane, rank: int) -> None:
        self.plane = plane
        self.rank = rank

    def before(self, chan: Channel) -> None:
        """Before a counted frame on ``chan``: take the plane's lock (held until :meth:`after`), and send the
        fence the frame needs if relayed frames went out since the last.

        The lock is held over the frame's send: a frame is counted in the order it goes out, and no other
        thread's relayed frame (sent under the same lock, with its fences) comes between the count and the
        frame. A caller calls :meth:`after` whatever happens to its send.
        """
        plane, r = self.plane, self.rank
        plane.lock.acquire()
        try:
            k = int(plane.rsent[r])
            if k != plane.rfenced[r]:
                plane.rfenced[r] = k
                try:
                    chan.conn.send(P.FENCE, 0, k, 0, 0)
                except ConnectionError:
                    pass  # dead: the frame's own send says so
        except BaseException:
            plane.lock.release()
            raise

    def after(self, sent: bool = True) -> None:
        """After the counted frame: count it if it ``sent`` (a frame that could not go is not), release the lock."""
        plane, r = self.plane, self.rank
        try:
            if sent:
                plane.dsent[r] += 1
                plane.ddirty[plane.host_of[r]].add(r)
        finally:
            plane.lock.release()


class _HostPart:
    """One host's part of a plan: its relay, the targets' bytes, where each reply goes."""

    __slots__ = ("host", "relay", "ranks", "rankset", "index", "head", "idx", "answers", "mask", "pos")

    def __init__(self, host: int, relay: Channel, ranks: list[int], index: list[int], reply: list[bool] | None):
        self.mask = reply  # which targets reply to a call (None: all)
        self.answers = len(ranks) if reply is None else sum(reply)
        self.host = host
        self.relay = relay
        self.ranks = ranks  # the targets, in the frame's order
        self.rankset = frozenset(ranks)
        self.pos = {r: i for i, r in enumerate(ranks)}
        self.index = index  # index[pos]: the target's position in the message's own list of ranks
        self.head = P.pack_targets(ranks, reply)
        self.idx = np.asarray(ranks, dtype=np.int64)


class _Plan:
    """A message's fan-out to a set of ranks: per host, what goes to its relay (see the module docstring)."""

    __slots__ = ("parts", "dead", "idx", "relays", "gen", "_reader")

    def __init__(self, parts: list[_HostPart], dead: list[tuple[int, BaseException, bool]], gen: tuple) -> None:
        self._reader: Fanout | None = None
        self.parts = parts
        self.dead = dead  # (position, death error, whether it answers) of targets already known dead
        self.idx = np.concatenate([p.idx for p in parts]) if parts else np.zeros(0, np.int64)
        self.relays = tuple(p.relay for p in parts)
        self.gen = gen

    def reader(self) -> Fanout:
        """What a caller reads the gathered replies with (its poll set made once, kept with the plan)."""
        if self._reader is None:
            self._reader = Fanout(self.relays, [0] * len(self.relays))
        return self._reader


class _HostCall:
    """The reply callback of one host's part of a relayed call: splits the gathered replies."""

    __slots__ = ("plane", "part", "reply", "many", "mid", "early")

    def __init__(self, plane: HostPlane, part: _HostPart, reply: Callable[[int, int, Any], None],
                 many: Callable[[list[int], Any], None] | None = None, mid: int = 0) -> None:
        self.plane = plane
        self.part = part
        self.mid = mid
        self.reply = reply  # reply(position in the message's ranks, status, payload)
        self.many = many  # many(positions, payload): the same OK reply of all of them
        self.early: set[int] | None = None  # positions answered before the host's reply (GONE)

    def __call__(self, status: int, payload: Any) -> None:
        part, reply, plane = self.part, self.reply, self.plane
        index = part.index
        plane.inflight[part.host].pop(self.mid, None)
        early = self.early
        if status == P.GATHERED:
            c = plane.counters
            view = memoryview(payload)
            many = self.many
            one = P.uniform_gathered(view) if many is not None else None
            if many is not None and one is not None:  # every target answered OK alike (None, mostly): decoded once
                if early:
                    index = [i for pos, i in enumerate(index) if pos not in early]
                if c is not None:
                    c.tally[0] += len(index)
                many(index, one)
                return
            entries = P.unpack_gathered(view)
            if early:
                entries = [e for e in entries if e[0] not in early]
            self._deliver(entries)
            return
        # the relay is gone (DIED, its error): every target's own death error, once the controller has it
        mask = part.mask
        for pos, r in enumerate(part.ranks):
            if (mask is None or mask[pos]) and not (early and pos in early):
                plane.when_dead(r, index[pos], reply)

    def _deliver(self, entries: list) -> None:
        part, reply, plane = self.part, self.reply, self.plane
        index = part.index
        c = plane.counters
        if c is not None:
            tally = c.tally
            tally[0] += len(entries)
            tally[1] += sum(1 for e in entries if e[1] != P.OK)
        for pos, st, pl in entries:
            if st == P.DIED:
                plane.when_dead(part.ranks[pos], index[pos], reply)
            else:
                reply(index[pos], st, pl)

    def gone(self, payload: Any) -> None:
        """A rank's part, ahead of the host's reply (the relay's ``GONE``): delivered now, skipped in that reply."""
        entries = P.unpack_gathered(memoryview(payload))
        early = self.early
        if early is None:
            early = self.early = set()
        entries = [e for e in entries if e[0] not in early]
        early.update(e[0] for e in entries)
        self._deliver(entries)


class HostPlane:
    """Relayed messages of one process mesh (see the module docstring).

    ``host_of[r]``: the host index of global rank ``r``; ``relays[h]``: the
    channel to host ``h``'s relay; ``host_ids[h]``: its name; ``death_of(r)``:
    the controller's death error of rank ``r`` (None while alive);
    ``counters``: the mesh's :class:`~.counters.Counters` (replies, errors).
    """

    def __init__(self, host_of: Sequence[int], relays: list[Channel], host_ids: list[str],
                 death_of: Callable[[int], BaseException | None], counters: Any = None) -> None:
        self.n = len(host_of)
        self.host_of = list(host_of)
        self.relays = list(relays)
        self.host_ids = list(host_ids)
        self.ranks_of: list[list[int]] = [[] for _ in self.relays]
        for r, h in enumerate(self.host_of):
            self.ranks_of[h].append(r)
        self.death_of = death_of
        self.counters = counters
        self.lock = threading.RLock()  # (reentrant: a fan-out holds it once per direct channel, see _Direct)
        self.rsent = np.zeros(self.n, dtype=np.int64)
        self.rfenced = np.zeros(self.n, dtype=np.int64)
        self.dsent = [0] * self.n
        self.dfenced = [0] * self.n
        self.ddirty: list[set[int]] = [set() for _ in self.relays]
        self.lost: dict[int, BaseException] = {}  # host -> why its relay is gone
        self.gen = 0  # bumped when a relay is lost
        self._plans: dict[Any, _Plan] = {}
        self._waiters: dict[int, list] = {}  # rank -> reply callbacks waiting for its death error
        #: per host, its relayed calls in flight (msg id -> reply callback): a rank's death answers
        #: its part of them at once, not when the rest of its host has answered
        self.inflight: list[dict[int, _HostCall]] = [{} for _ in self.relays]
        for h, chan in enumerate(self.relays):
            chan.peer["ranks"] = tuple(self.ranks_of[h])

    # -- the direct path's side ----------------------------------------------------------
    def attach(self, rank: int, chan: Channel) -> None:
        """Count ``chan`` (rank ``rank``'s direct channel) in the order of the rank's frames."""
        chan.fence = _Direct(self, rank)

    # -- plans --------------------------------------------------------------------------
    def plan(self, key: Any, ranks: Iterable[int], addresses: Sequence[str], router: Any,
             reply: Sequence[bool] | None = None) -> _Plan | None:
        """The fan-out of a message to ``ranks`` (kept under ``key``), or None when they are on one host.

        ``ranks`` is read only when no plan is kept (a ``Shape`` will do).

        ``reply[i]``: whether ``ranks[i]`` answers (None: all do, or none for a broadcast).
        """
        gen = (router.gen, self.gen)
        plan = self._plans.get(key)
        if plan is not None and plan.gen == gen:
            return plan
        host_of = self.host_of
        ranks = list(ranks)
        if len({host_of[r] for r in ranks}) < 2:
            return None
        dead: list[tuple[int, BaseException, bool]] = []
        per: dict[int, tuple[list[int], list[int], list[bool]]] = {}
        deadmap = router.dead
        for i, r in enumerate(ranks):
            err = deadmap.get(addresses[r])
            h = host_of[r]
            if err is None and h in self.lost:
                err = self.death_of(r) or self.lost[h]
            if err is not None:
                dead.append((i, err, reply is None or bool(reply[i])))
                continue
            rs, ix, rp = per.setdefault(h, ([], [], []))
            rs.append(r)
            ix.append(i)
            rp.append(True if reply is None else bool(reply[i]))
        parts = [_HostPart(h, self.relays[h], rs, ix, None if reply is None or all(rp) else rp)
                 for h, (rs, ix, rp) in sorted(per.items())]
        plan = _Plan(parts, dead, gen)
        if len(self._plans) > 256:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    # -- sending ------------------------------------------------------------------------
    def send(self, plan: _Plan, kind: int, target: int, shape: Any, parts: list,
             reply: Callable[[int, int, Any], None] | None, park: bool = False,
             many: Callable[[list[int], Any], None] | None = None) -> None:
        """One ``RELAY`` frame per host of ``plan``: ``kind`` (CALL, SPAWN, STOP_ACTOR) with payload ``parts``.

        ``reply(i, status, payload)`` gets the reply of the plan's ``ranks[i]``
        (a death as ``DIED`` and the rank's death error); None: a broadcast.
        ``many(positions, payload)``, if given, gets a host's replies that are
        all ``OK`` and alike at once (decoded once: a ``call()`` of a no-op).
        ``shape``: the view the frames refer to (None: none). ``park``: the
        caller reads the replies itself (see :meth:`Channel.call`).
        Raises the error of a frame that cannot be sent at all (over the
        frame limit); a relay that is gone answers for its ranks.
        """
        flags = kind << 4
        now = time.monotonic() if park else 0.0
        mid = next_id() if reply is not None else 0
        sent: list[_HostPart] = []
        with self.lock:
            try:
                for part in plan.parts:
                    relay = part.relay
                    self._fences(part)
                    try:
                        vid = 0 if shape is None else relay.views_out.get(shape) or relay.view_id(shape)
                        if reply is None or not part.answers:
                            relay.post(P.RELAY, target, vid, [part.head, *parts], flags=flags)
                        else:
                            hc = self.inflight[part.host][mid] = _HostCall(self, part, reply, many, mid)
                            relay.call(P.RELAY, target, vid, [part.head, *parts], hc, park, now,
                                       flags=flags | P.F_REPLY, msg_id=mid)
                    except ActorDiedError:  # the relay is gone: its ranks answer as dead
                        if reply is not None and part.answers:
                            _HostCall(self, part, reply)(P.DIED, self.lost.get(part.host) or ActorDiedError(
                                ranks=part.ranks, reason=f"the relay of host {self.host_ids[part.host]} is gone"))
                        continue
                    sent.append(part)
            finally:
                if len(sent) == len(plan.parts):
                    if len(plan.idx):
                        self.rsent[plan.idx] += 1
                else:
                    for part in sent:
                        self.rsent[part.idx] += 1
        if reply is not None:
            for i, err, answers in plan.dead:
                if answers:
                    reply(i, P.DIED, err)

    def _fences(self, part: _HostPart) -> None:
        # relayed frames after direct ones to the same ranks: the relay makes each wait for them
        d = self.ddirty[part.host]
        if not d:
            return
        hit = d & part.rankset
        if not hit:
            return
        d -= hit
        relay = part.relay
        for r in hit:
            k = self.dsent[r]
            if k != self.dfenced[r]:
                self.dfenced[r] = k
                try:
                    relay.send(P.FENCE, 0, k, r)
                except ConnectionError:
                    pass  # the relay is gone: the frame's send says so

    # -- deaths -------------------------------------------------------------------------
    def when_dead(self, rank: int, i: int, reply: Callable[[int, int, Any], None]) -> None:
        """``reply(i, DIED, error)`` with the controller's death error of ``rank``, now or once it has it."""
        err = self.death_of(rank)
        if err is None:
            with self.lock:
                err = self.death_of(rank)
                if err is None:
                    self._waiters.setdefault(rank, []).append((i, reply))
                    return
        reply(i, P.DIED, err)

    def died(self, rank: int, err: BaseException) -> None:
        """The controller recorded ``rank``'s death: answer the relayed calls that wait for it.

        Its host's relay is told (``GONE``): it answers the rank's part of each call in
        flight at once (:meth:`gone`), with the reply the rank sent before it went if it
        did, else ``DIED``, so a call neither waits for the host's other ranks nor loses a
        reply that was on its way.
        """
        h = self.host_of[rank]
        with self.lock:
            waiting = self._waiters.pop(rank, ())
            if h not in self.lost:
                try:
                    self.relays[h].send(P.GONE, 0, 0, rank)
                except (ConnectionError, ActorDiedError):
                    pass  # the relay is gone too: relay_lost answers for its ranks
        for i, reply in waiting:
            reply(i, P.DIED, err)

    def gone(self, host: int, mid: int, payload: Any) -> None:
        """Host ``host``'s relay answered a dead rank's part of call ``mid`` (see :meth:`died`)."""
        hc = self.inflight[host].get(mid)
        if hc is not None:
            hc.gone(payload)

    def relay_lost(self, host: int, err: BaseException) -> list[int]:
        """Host ``host``'s relay is gone: later messages skip its ranks; returns them (the caller declares them dead)."""
        with self.lock:
            self.lost[host] = err
            self.gen += 1
            self._plans.clear()
        return list(self.ranks_of[host])


def relayed(addresses: Any) -> HostPlane | None:
    """The plane of the mesh whose ``addresses`` these are, when the caller may relay (code outside actors)."""
    plane = getattr(addresses, "plane", None)
    if plane is None or current.get() is not None:
        return None
    return plane
