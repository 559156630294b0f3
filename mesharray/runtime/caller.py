"""The caller side of actor calls: the send loops of an endpoint and the decoding of replies.

``mesharray.actor`` is the API (``Endpoint.call``, ``call_one``, ``choose``,
``stream``, ``broadcast``); everything that speaks the wire protocol for it
lives here, one :class:`Caller` per endpoint of an actor mesh:

- **Sending.** Arguments are pickled once per call (``framing.dumps``); a call
  without arguments reuses its payload, packed once per endpoint. Three paths:
  ``call_one``/``choose`` and ``call()`` on one actor write one frame through
  :meth:`Channel.call <mesharray.runtime.channel.Channel.call>` (the latency
  path); ``call()`` on many actors in a loop goes through a
  :class:`~mesharray.runtime.channel.Fanout` kept per mesh view until the
  router's channel table changes (``Router.gen``); everything else (a first
  contact, a dead peer, a large payload, code inside an actor, ``stream``,
  ``broadcast``) takes :meth:`Router.send_many
  <mesharray.runtime.router.Router.send_many>`, the one general send loop.
  A mesh whose hosts have relays sends ``call()``, ``broadcast()`` and
  :meth:`Caller.call_some` to ranks of several hosts once per host instead
  (:class:`~mesharray.runtime.hosts.HostPlane`: one frame per host, one
  gathered reply per host); ``call_one``, ``stream`` and messages to the ranks
  of one host keep the direct paths above.
- **Replies.** A reply is ``(status, payload)``: ``OK`` with a pickled value,
  ``ERR`` with a pickled error record that becomes an
  :class:`~mesharray.ActorError` (original exception, its ``__cause__`` /
  ``__context__`` chain, remote traceback, rank, host, pid), or ``DIED`` with
  the death error itself. :func:`future_callback` completes one future with
  one reply; :class:`Gather` collects the replies of a ``call()`` into a
  :class:`~mesharray.MeshArray` laid out on the mesh view's dims.
- **Reading in the caller's thread.** Futures of calls whose connections are
  polled know their channel(s) (``reply_on``): ``get()`` parks them and reads
  the replies itself instead of waiting for the poller thread to wake it.

A caller holds the actor mesh's list of worker addresses (shared with the
process mesh: a restarted rank's new address is seen at once), the actor id
and the endpoint's name.
"""

from __future__ import annotations

import itertools
import queue
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from itertools import islice, repeat
from typing import TYPE_CHECKING, Any

from ..array import MeshArray
from ..errors import ActorDiedError, ActorError, SerializationError
from ..transport import framing
from . import protocol as P
from .channel import Channel, Fanout, flush_all, flush_programs, programs
from .context import current
from .future import Future, is_done, new_future, reply_on, set_exception, set_result
from .hosts import HostPlane
from .router import get_router

if TYPE_CHECKING:  # pragma: no cover
    from .._core import Shape

__all__ = ["Caller", "Gather", "future_callback", "outcome"]


# --------------------------------------------------------------------------- replies
def _actor_error(rec: dict) -> ActorError:
    exc = rec["exc"]
    cur = exc
    for e, is_cause in rec.get("chain", ()):
        if is_cause:
            cur.__cause__ = e
        else:
            cur.__context__ = e
        cur = e
    return ActorError(exc, rank=rec.get("rank"), traceback_text=rec.get("tb", ""), actor=rec.get("actor", ""),
                      host=rec.get("host", ""), pid=rec.get("pid"))


_NONE_REPLY = b"".join(framing.encode(framing.dumps(None)))  # what a worker sends for ``None``


def outcome(status: int, payload: Any) -> tuple[Any, BaseException | None]:
    """(value, exception) of one reply."""
    if status == P.OK:
        if payload == _NONE_REPLY:
            return None, None
        try:
            return framing.decode(payload), None
        except Exception as exc:
            return None, SerializationError(f"cannot unpickle a reply: {type(exc).__name__}: {exc}")
    if status == P.ERR:
        try:
            return None, _actor_error(framing.decode(payload))
        except Exception as exc:
            return None, SerializationError(f"cannot unpickle a remote error: {type(exc).__name__}: {exc}")
    return None, payload  # DIED: payload is the error


def future_callback(fut: Future[Any]) -> Callable[[int, Any], None]:
    """The reply callback (``cb(status, payload)``) that completes ``fut`` with one reply's outcome."""
    def cb(status: int, payload: Any) -> None:
        value, exc = outcome(status, payload)
        if exc is None:
            set_result(fut, value)
        else:
            set_exception(fut, exc)
    return cb


class Gather:
    """Collects the replies of a ``call()``; ``next()`` on a count is atomic under the GIL,
    so the reader threads of different ranks need no lock."""

    __slots__ = ("fut", "values", "n", "count", "shape", "counter")

    def __init__(self, fut: Future[MeshArray], n: int, shape: Shape) -> None:
        self.fut = fut
        self.values = [None] * n
        self.n = n
        self.counter = itertools.count(1)
        self.count = self.counter.__next__
        self.shape = shape

    def reply(self, i: int, status: int, payload: Any) -> None:
        """Rank ``i``'s reply (bound per rank with ``partial``: the callbacks of a call)."""
        if status == P.OK and payload == _NONE_REPLY:  # (what outcome does first, inlined)
            value, exc = None, None
        else:
            value, exc = outcome(status, payload)
        if exc is not None:
            set_exception(self.fut, exc)
            return
        self.values[i] = value
        if self.count() == self.n:
            self.finish()

    def many(self, indices: Sequence[int], payload: Any) -> None:
        """The same ``OK`` reply of every rank in ``indices`` (a host's gathered replies, all alike)."""
        value, exc = outcome(P.OK, payload)
        if exc is not None:
            set_exception(self.fut, exc)
            return
        values = self.values
        for i in indices:
            values[i] = value
        if len(indices) > 1:  # (the count moved on by all but one, at C speed)
            deque(islice(self.counter, len(indices) - 1), maxlen=0)
        if indices and self.count() == self.n:
            self.finish()

    def finish(self) -> None:
        """Complete the future with the gathered values (at once for a call to no actor)."""
        if is_done(self.fut):
            return
        try:
            set_result(self.fut, MeshArray.from_results(self.shape, self.values))
        except Exception as exc:
            set_exception(self.fut, exc)


def _gather_one(fut: Future[MeshArray], shape: Shape) -> Callable[[int, Any], None]:
    """The reply callback of ``call()`` on one actor: :class:`Gather` of one, without its count."""
    def cb(status: int, payload: Any) -> None:
        value, exc = outcome(status, payload)
        if exc is None:
            try:
                value = MeshArray.from_results(shape, [value])
            except Exception as e:
                exc = e
        if exc is None:
            set_result(fut, value)
        else:
            set_exception(fut, exc)
    return cb


# --------------------------------------------------------------------------- sending
_NO_ARGS = framing.dumps(((), {}))
_NO_ARGS_BYTES = b"".join(framing.encode(_NO_ARGS))


class Caller:
    """The send loops of one endpoint of one actor mesh (``mesh.method`` makes one, kept with it).

    ``addresses[r]`` is the worker of global rank ``r`` (the process mesh's
    list, shared); ``actor_id`` the actor mesh's id on every worker; ``name``
    the endpoint's. Each adverb takes the mesh view (``shape``) it is called
    on; the caller keeps, per view, what a call in a loop reuses (the
    :class:`Fanout` of ``call()``, the channels of :meth:`call_some`).
    """

    __slots__ = ("addresses", "actor_id", "method", "noargs", "some", "fan", "plane")

    def __init__(self, addresses: Sequence[Any], actor_id: int, name: str) -> None:
        self.addresses = addresses
        #: the mesh's fan-out through its hosts' relays (None: none; see runtime.hosts)
        self.plane: HostPlane | None = getattr(addresses, "plane", None)
        self.actor_id = actor_id
        self.method = P.encode_method(name)
        self.noargs = [self.method + _NO_ARGS_BYTES]  # the whole payload of a call without arguments
        self.some: list | None = None  # call_some's ranks (and channels) for its last (shape, reply)
        self.fan: tuple | None = None  # call()'s (shape, router, router.gen, Fanout) for its last shape

    def send(self, ranks: Any, shape: Shape, args: tuple[Any, ...], kwargs: dict[str, Any],
             cbs: Any, park: bool = False, p: framing.Payload | None = None) -> list[Channel | None]:
        """Pickle once, then send one CALL per rank (``cbs[i]`` gets rank i's reply; ``None``: a broadcast).

        ``p``: ``(args, kwargs)`` already pickled. Returns the channels used
        (``None`` for a rank that could not be reached).
        """
        if programs:  # (array ops queued before this message go first: see runtime.channel.defer_flush)
            flush_programs()
        if p is not None:
            plain = None
        elif args or kwargs:
            p = framing.dumps((args, kwargs))
            plain = None
        else:
            p, plain = _NO_ARGS, self.noargs
        if cbs is None and self.plane is not None and current.get() is None:  # a broadcast: through the relays
            plan = self.plane.plan(shape, ranks, self.addresses, get_router())
            if plan is not None:
                self.plane.send(plan, P.CALL, self.actor_id, shape, plain or [self.method, *framing.encode(p)], None)
                if plan.dead:
                    raise plan.dead[0][1]
                return [None] * len(ranks)
        return get_router().send_many(self.addresses, ranks, P.CALL, self.actor_id, shape, p,
                                      self.method, plain, cbs, park)

    def call(self, shape: Shape, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Future[MeshArray]:
        """Call every actor of ``shape``; a future of the gathered :class:`~mesharray.MeshArray`."""
        if programs:
            flush_programs()
        fut: Future[MeshArray] = new_future()
        if shape.size == 1:  # one actor: call_one's latency path, gathered into a MeshArray
            reply_on(fut, self.send_one(shape.rank(0), shape, args, kwargs, _gather_one(fut, shape)))
            return fut
        p = None
        if args or kwargs:
            p = framing.dumps((args, kwargs))
            parts = None if p.big else [self.method, *framing.encode(p)]
        else:
            parts = self.noargs
        if self.plane is not None and current.get() is None:  # ranks of several hosts: through their relays
            plan = self.plane.plan(shape, shape, self.addresses, get_router())
            if plan is not None:
                g = Gather(fut, shape.size, shape)
                if parts is None:
                    assert p is not None
                    parts = [self.method, *framing.encode(p)]
                self.plane.send(plan, P.CALL, self.actor_id, shape, parts, g.reply, True, g.many)
                if plan.relays:
                    reply_on(fut, plan.reader())  # get() reads the gathered replies in its own thread
                return fut
        fan = self.fan
        if parts is not None:
            router = get_router()
            if fan is None or fan[0] is not shape or fan[1] is not router or fan[2] != router.gen \
                    or current.get() is not None:
                fan = self._fanout(shape, router)
            if fan is not None:  # the lean path of a call() in a loop: every peer known and polled
                fanout: Fanout = fan[3]
                n = len(fanout.chans)
                g = Gather(fut, n, shape)
                fanout.call(P.CALL, self.actor_id, parts, list(map(partial, repeat(g.reply), range(n))))
                reply_on(fut, fanout)  # get() reads the replies in its own thread
                return fut
        ranks = list(shape)
        g = Gather(fut, len(ranks), shape)
        cbs = list(map(partial, repeat(g.reply), range(len(ranks))))
        if not ranks:
            g.finish()
            return fut
        chans = self.send(ranks, shape, args, kwargs, cbs, park=True, p=p)
        for c in chans:
            if c is None or not c.polled:
                break
        else:  # all polled: get() reads the replies in its own thread
            reply_on(fut, tuple(chans))
        return fut

    def _fanout(self, shape: Shape, router: Any) -> tuple | None:
        """``call()``'s :class:`Fanout` to every actor of ``shape`` (kept in ``fan`` until the router's
        channel table changes), or None: the general path (a peer not connected yet, dead, or read
        by a thread of its own; code inside an actor, whose calls record telemetry links)."""
        self.fan = None  # (an old one must not keep dead channels and their buffers)
        if current.get() is not None or shape.size == 0:
            return None
        gen = router.gen  # (read first: a change while we look makes the next call look again)
        chans = router.polled_channels(self.addresses, list(shape))
        if chans is None:
            return None
        try:
            vids = [ch.views_out.get(shape) or ch.view_id(shape) for ch in chans]
        except ActorDiedError:
            return None
        fan = self.fan = (shape, router, gen, Fanout(chans, vids))
        return fan

    def send_one(self, rank: int, shape: Shape, args: tuple[Any, ...], kwargs: dict[str, Any],
                 cb: Callable[[int, Any], None]) -> Channel | None:
        """The latency path of ``call_one``/``choose``: one rank, small arguments.

        Returns the channel the reply comes on when the caller may read it
        itself (a polled connection), else None.
        """
        if programs:
            flush_programs()
        if args or kwargs:
            p = framing.dumps((args, kwargs))
            if p.big:
                chan = get_router().send_many(self.addresses, (rank,), P.CALL, self.actor_id, shape, p,
                                              self.method, None, (cb,))[0]
                return chan if chan is not None and chan.polled else None
            parts = [self.method, *framing.encode(p)]
        else:
            parts = self.noargs
        try:
            chan = get_router().channel(self.addresses[rank])
            vid = chan.view_id(shape)
        except Exception as exc:
            cb(P.DIED, exc)
            return None
        polled = chan.polled
        chan.call(P.CALL, self.actor_id, vid, parts, cb, polled)
        return chan if polled else None

    def call_one(self, rank: int, shape: Shape, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Future[Any]:
        """Call the actor of ``rank`` (on the view ``shape``); a future of its value."""
        fut = new_future()
        reply_on(fut, self.send_one(rank, shape, args, kwargs, future_callback(fut)))
        return fut

    def stream(self, shape: Shape, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[Future[Any]]:
        """Call every actor of ``shape`` now; an iterator of their futures in completion order."""
        ranks = list(shape)
        done: queue.SimpleQueue = queue.SimpleQueue()
        futs = [new_future() for _ in ranks]
        for f in futs:
            f.add_done_callback(done.put)
        self.send(ranks, shape, args, kwargs, [future_callback(f) for f in futs])

        n = len(ranks)

        def gen() -> Iterator[Future[Any]]:
            for _ in range(n):
                flush_all()
                yield done.get()
        return gen()

    def broadcast(self, shape: Shape, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Send to every actor of ``shape`` without a reply (a dead one skipped, then its error raised)."""
        self.send(list(shape), shape, args, kwargs, None)

    def call_some(self, shape: Shape, reply: Sequence[int], *args: Any) -> dict[int, Future[Any]]:
        """One message to every actor of ``shape``, pickled once: a call to the ranks in ``reply`` (a
        future of each one's value, by rank) and a broadcast to the others (a dead one skipped).

        For the runtime's own one-program-for-all messages (a tiny reduction whose result's
        holders answer with it, in a loop); the futures are read in the caller's thread, as
        ``call_one``'s.
        """
        some = self.some
        if some is None or some[0] is not shape or some[1] != reply:
            ranks = list(shape)
            missing = set(reply) - set(ranks)
            if missing:
                raise ValueError(f"ranks {sorted(missing)} to answer are not among the actors' ranks {ranks}")
            want = set(reply)
            some = self.some = [shape, reply, ranks, [r in want for r in ranks], None]
        _, _, ranks, wants, kept = some
        p = framing.dumps((args, {}))
        router = get_router()
        if self.plane is not None and current.get() is None:  # ranks of several hosts: through their relays
            plan = self.plane.plan((shape, reply), ranks, self.addresses, router, wants)
            if plan is not None:
                rfuts: dict[int, Future[Any]] = {}
                answers: list = [None] * len(ranks)
                for i, (r, w) in enumerate(zip(ranks, wants)):
                    if w:
                        f = rfuts[r] = new_future()
                        answers[i] = future_callback(f)
                        if plan.relays:
                            reply_on(f, plan.relays)

                def answer(i: int, status: int, payload: Any) -> None:
                    answers[i](status, payload)
                self.plane.send(plan, P.CALL, self.actor_id, shape, [self.method, *framing.encode(p)], answer)
                return rfuts
        if p.big:
            chans = None
        elif kept is not None and kept[0] is router and kept[1] == router.gen and current.get() is None:
            chans = kept[2]  # the channels of the last op: no table changed since
        else:
            gen = router.gen  # (read first: a change while we look makes the next op look again)
            chans = router.polled_channels(self.addresses, ranks)
            some[4] = (router, gen, chans) if chans is not None and current.get() is None else None
        futs: dict[int, Future[Any]] = {}
        if chans is None:  # the general path: a first contact, a dead peer, a large program
            cbs: list[Callable[[int, Any], None] | None] = []
            for r, w in zip(ranks, wants):
                if w:
                    f = futs[r] = new_future()
                    cbs.append(future_callback(f))
                else:
                    cbs.append(None)
            sent = self.send(ranks, shape, args, {}, cbs, park=True)
            for r, c in zip(ranks, sent):
                if r in futs and c is not None and c.polled:
                    reply_on(futs[r], c)
            return futs
        # every peer reachable on a polled connection: the send loop of send_many, without
        # its other cases (~200 bytecodes an op of a tiny reduction)
        parts = [self.method, *framing.encode(p)]
        target = self.actor_id
        now = time.monotonic()
        for r, w, chan in zip(ranks, wants, chans):
            try:
                vid = chan.views_out.get(shape) or chan.view_id(shape)
                if w:
                    f = futs[r] = new_future()
                    chan.call(P.CALL, target, vid, parts, future_callback(f), True, now)
                    reply_on(f, chan)  # get() reads the reply in its own thread
                else:  # (not corked: the caller waits on a reply next, see Channel.post)
                    chan.post(P.CALL, target, vid, parts, False)
            except ActorDiedError as exc:  # the peer died under us: a caller hears of it, a broadcast skips it
                if w:
                    if r not in futs:
                        futs[r] = new_future()
                    future_callback(futs[r])(P.DIED, exc)
        return futs
