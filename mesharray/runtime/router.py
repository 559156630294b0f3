"""Sending calls to actors — one :class:`Router` per process.

Both the controller and every worker (for actor→actor calls) send through the
process's router. Peers are keyed by the *address* of the worker that hosts
the actor (ranks are per mesh, addresses are unique); their
:class:`~mesharray.runtime.channel.Channel` is opened lazily, except on the
controller, which registers the channels its workers opened to it during
adoption. Replies come back on the channel that carried the call.

:meth:`Router.send_many` is the one per-rank send loop: endpoints (``call()``,
``stream()``, ``broadcast()``), ``ProcMesh.spawn`` and, through endpoints,
distributed arrays use it; ``call_one``/``choose`` take its one-rank shortcut
(:meth:`Channel.call` directly). When a channel ends, every pending callback
gets its death error (for the controller: :class:`ActorDiedError` with the
exit status), and later sends to that address fail at once with the same error.
"""

from __future__ import annotations

import os
import pickle
import threading
import time

from .._proc_stat import state as _proc_state
from ..errors import ActorDiedError, MeshStoppedError
from ..transport import framing, shm
from ..transport.address import connect
from . import protocol as P
from .channel import Channel, flush_all, next_id, sent
from .context import current

__all__ = ["Router", "get_router", "set_secret", "next_id", "flush_all"]


class Router:
    """Outbound calls of one process."""

    def __init__(self, secret: bytes) -> None:
        self.secret = secret
        self.channels: dict[str, Channel] = {}
        self.peer_channels: dict[str, Channel] = {}  # used by code running inside actors
        self.dead: dict[str, BaseException] = {}
        self.stopped: set[str] = set()  # addresses of stopped meshes' workers (never reused: pid + random)
        self._lock = threading.Lock()
        self.identity: dict = {"role": "peer", "pid": os.getpid()}
        #: bumped (under the lock) whenever a channel is added to or dropped from the tables: a
        #: caller that keeps channels it looked up (a call in a loop) knows them still current
        self.gen = 0

    @property
    def sent_calls(self) -> int:
        """Frames that expect a reply (calls, spawns) sent by this process."""
        return sent.calls

    @property
    def sent_oneway(self) -> int:
        """Broadcasts sent by this process."""
        return sent.oneway

    # -- channels -----------------------------------------------------------
    def register(self, address: str, chan: Channel) -> None:
        """Use ``chan`` (already started) for ``address``."""
        with self._lock:
            self.channels[address] = chan
            self.dead.pop(address, None)
            self.gen += 1

    def channel(self, address: str) -> Channel:
        """The channel to send on to ``address``, opened on first use.

        Code running inside an actor gets channels of its own (to the
        worker's listener), never the ones the controller registered: when a
        worker runs in the controller's process (rank 0 under MPI), a call from
        an actor must not queue behind the very endpoint that makes it.
        """
        table = self.channels if current.get() is None else self.peer_channels
        chan = table.get(address)
        if chan is not None:
            return chan
        err = self.dead.get(address)
        if err is not None:
            raise err
        if address in self.stopped:
            raise MeshStoppedError(f"the process at {address} belongs to a mesh that was stopped")
        with self._lock:
            chan = table.get(address)
            if chan is not None:
                return chan
            try:
                sock = connect(address, self.secret)
                try:  # (a peer gone right after the handshake: its socket closed here, not left to gc)
                    chan = Channel(sock, on_close=self._on_close, name=address)
                    chan.peer["address"] = address
                    chan.send(P.HELLO, parts=[pickle.dumps(self.identity)])
                    chan.start(polled=True)
                except BaseException:
                    sock.close()
                    raise
            except (OSError, ConnectionError) as exc:
                raise ActorDiedError(reason=f"cannot connect to {address}: {exc}") from exc
            table[address] = chan
            self.gen += 1
            return chan

    def _on_close(self, chan: Channel, exc) -> None:
        self.mark_dead(chan.peer.get("address", chan.name), chan, chan.lost())

    def mark_dead(self, address: str, chan: Channel | None, err: BaseException) -> None:
        """Fail every pending call on ``address`` and every later send with ``err``."""
        with self._lock:
            self.dead[address] = err
            chans = {c for c in (chan, self.channels.pop(address, None), self.peer_channels.pop(address, None))
                     if c is not None}
            self.gen += 1
        for c in chans:
            c.fail(err)
            if c is not chan:
                c.close(join=False)
        # the dead never clear their busy bytes in our shared-memory segments: free them,
        # and unmap the segments it sent us - once it is really gone (a process whose
        # connection merely dropped may still view those bytes)
        pid = getattr(err, "pid", None)
        if pid is not None and _gone(pid):
            shm.release_peer(address, pid)

    def forget(self, address: str) -> None:
        """A stopped mesh's worker: drop its channels; later sends raise MeshStoppedError."""
        with self._lock:
            self.dead.pop(address, None)
            self.stopped.add(address)
            chans = [self.channels.pop(address, None), self.peer_channels.pop(address, None)]
            self.gen += 1
        for chan in chans:
            if chan is not None:
                chan.close(join=False)

    def polled_channels(self, addresses, ranks) -> list | None:
        """The open channels to ``ranks`` when each one has a polled connection (its replies can be
        read by the caller), else ``None``: the fast path of a call's per-op loop, which falls back
        to :meth:`send_many` for anything else (a first contact, a dead peer, thread mode)."""
        table = self.channels if current.get() is None else self.peer_channels  # (as in channel())
        get = table.get
        chans = []
        for r in ranks:
            c = get(addresses[r])
            if c is None or not c.polled:
                return None
            chans.append(c)
        return chans

    # -- the send loop --------------------------------------------------------------
    def send_many(self, addresses, ranks, kind: int, target: int, shape, p, head: bytes = b"",
                  plain=None, cbs=None, park: bool = False) -> list:
        """Send one frame per rank: ``head + encoded(p)`` (``p`` pickled once, by ``framing.dumps``).

        ``addresses[r]`` is rank r's worker; ``shape`` the view the frames
        refer to (defined per channel on first use; ``None``: no view);
        ``plain`` the whole payload when it is already encoded. ``cbs[i]``
        gets the reply of ``ranks[i]`` (an unreachable or dead rank fails it);
        ``cbs[i] = None`` sends that rank the frame without a reply (a dead
        rank skipped); ``cbs=None`` sends without replies to all (a
        broadcast: every live peer gets it, then the first death error is
        raised). ``park``: the caller will
        read the replies itself (see :meth:`Channel.call`). Large buffers of
        ``p`` to same-host peers go through one shared-memory segment.
        Returns the channels used (``None`` for a rank that could not be reached).
        """
        chans: list[Channel | None] = []
        dead = None
        table = self.channels if current.get() is None else self.peer_channels  # (as in channel())
        get = table.get
        polled = park
        for i, r in enumerate(ranks):
            a = addresses[r]
            c = get(a)
            if c is None:
                try:
                    c = self.channel(a)
                except Exception as exc:
                    chans.append(None)
                    polled = False
                    cb = None if cbs is None else cbs[i]
                    if cb is not None:
                        cb(P.DIED, exc)
                    elif not isinstance(exc, ActorDiedError):
                        raise
                    elif cbs is None:
                        dead = dead or exc
                    continue
            chans.append(c)
            if polled and not c.polled:
                polled = False
        # park: the caller reads the replies itself, when every channel is a polled one
        now = time.monotonic() if polled else 0.0
        seg = placed = None
        if plain is None:
            if not p.big:
                plain = [head, *framing.encode(p)] if head else framing.encode(p)
            elif shm.available() and all(c is not None and c.conn.same_host for c in chans):
                seg, placed = framing.write_shm(p, len(chans), tuple(addresses[r] for r in ranks))
        for i, chan in enumerate(chans):
            if chan is None:
                continue
            if plain is not None:
                parts = plain
            elif seg is not None:
                parts = [head, *framing.encode(p, seg=seg, placed=placed, slot=i)]
            else:
                parts = [head, *framing.encode(p)]
            cb = None if cbs is None else cbs[i]
            try:
                vid = 0 if shape is None else chan.views_out.get(shape) or chan.view_id(shape)
                if cb is None:
                    chan.post(kind, target, vid, parts)
                else:
                    chan.call(kind, target, vid, parts, cb, polled, now)
            except ActorDiedError as exc:  # the peer died under us (a call's fails its callback)
                if cbs is None:
                    dead = dead or exc
                elif cb is not None:
                    cb(P.DIED, exc)
        if dead is not None:
            raise dead
        return chans


_router: Router | None = None
_router_lock = threading.Lock()


def set_secret(secret: bytes) -> Router:
    """Install the process's router for ``secret`` (workers call this at start)."""
    global _router
    with _router_lock:
        if _router is None or _router.secret != secret:
            _router = Router(secret)
        return _router


def get_router() -> Router:
    """The process's router; in a controller process, created with a fresh job secret."""
    global _router
    r = _router
    if r is None:
        with _router_lock:
            if _router is None:
                from ..transport.auth import new_secret

                _router = Router(new_secret())
            r = _router
    return r


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (no such process, or a zombie): its memory is free."""
    st = _proc_state(pid)
    return st is None or st in (b"Z", b"X")
