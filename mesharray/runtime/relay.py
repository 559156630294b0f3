"""The relay: one process per host of a process mesh that spans hosts, between the controller and that host's ranks.

A message to many ranks leaves the controller once per host instead of once
per rank (:mod:`.hosts` is the controller's side): the controller sends one
``RELAY`` frame to each host's relay, which sends the inner frame (a call, a
broadcast, a spawn, an actor's stop) on to the host's ranks that it names,
and answers a call with one ``REPLY`` holding every rank's reply (status
``GATHERED``, :func:`~.protocol.pack_gathered`). The host agent's zygote forks
the relay before the mesh's workers (:mod:`mesharray.bootstrap.local`), so it
runs the mesh's interpreter and environment; each worker connects to it after
its controller (a unix socket) and:

- receives relayed frames on that connection (its own reader thread); replies
  to relayed calls go back on it, in the frame (no shared memory: the relay
  passes them on to another host);
- sends its heartbeats to the relay, which watches them and reports the host
  in one ``BEAT`` frame per heartbeat interval: the ranks whose heartbeats are
  late and for how long (the controller applies ``heartbeat_timeout`` and
  ``kill_unresponsive`` as for a direct heartbeat); a pause of the relay itself
  (its loop woke late) is not blamed on the workers, as at the controller.
  Where shared memory is a ``memfd`` opened through ``/proc`` (Linux), a
  heartbeat is the rank's ``time.monotonic()`` written into its 8-byte slot of
  one segment of the relay (``CONFIG`` names it after the rank's ``HELLO``),
  which the relay reads once per interval: no frame and no wake-up of the relay
  per heartbeat (at 1,024 ranks, 2,048 a second);
- exits when the relay's connection ends, as when its controller's does: a
  relay that dies takes its host's ranks with it, and the controller reports
  them dead at once (:meth:`.hosts.HostPlane.relay_lost`).

Order. Frames of the controller to a rank now take two paths, the direct
connection and the relay; a rank handles them in the order the controller
sent them through ``FENCE`` frames (see :mod:`.hosts`): a direct frame sent
after relayed ones is preceded by ``FENCE(n)`` (wait until n relayed frames
were handled), and the relay sends a rank ``FENCE(n)`` when the controller
asks (``FENCE`` with ``target=rank``) before relayed frames that follow
direct ones.

Telemetry (``INTROSPECT``): the relay asks each of its ranks over a connection
of its own (not the one that carries calls: a rank busy in a call still
answers) and answers the controller once for the host, with what came within
the request's deadline.

Everything runs in the process's poller thread (:mod:`mesharray.transport.poller`);
the main thread sends the beats and ends the deadlines of telemetry requests.
"""

from __future__ import annotations

import logging
import mmap
import os
import pickle
import sys
import threading
import time

from .. import _platform
from .._core import Gathering, RelayReplies, relay_forward
from ..transport.address import connect
from ..transport.connection import Connection
from ..transport.listener import Listener
from . import protocol as P

__all__ = ["Relay", "run_relay"]

log = logging.getLogger("mesharray.relay")

_COUNTED = (P.CALL, P.SPAWN, P.STOP_ACTOR)


class _Gather(Gathering):
    """The replies of one relayed call (or telemetry request) that the relay still waits for (its
    fields: :class:`~mesharray._core.Gathering`'s, which the compiled handler of the ranks'
    replies fills)."""

    __slots__ = ()

    def __init__(self, pos: dict[int, int], deadline: float = 0.0) -> None:
        self.pos = pos  # rank -> its position among the frame's targets (the ranks that answer)
        self.entries: list = []
        self.left = self.count = len(pos)
        self.deadline = deadline


class Relay:
    """The relay of one host of one process mesh (see the module docstring).

    ``ranks`` are the global ranks of this host; ``controller`` the controller's
    address; ``secret`` the job secret (workers and controller authenticate
    with it); ``host`` the host's index in the mesh, ``host_id`` its name.
    """

    def __init__(self, controller: str, secret: bytes, ranks: list[int], host: int, host_id: str) -> None:
        self.secret = secret
        self.ranks = list(ranks)
        self.host = host
        self.host_id = host_id
        self.workers: dict[int, Connection] = {}
        self.gone: set[int] = set()  # ranks the controller declared dead (GONE)
        self.rank_of: dict[Connection, int] = {}
        self.addresses: dict[int, str] = {}
        self.waiting: dict[int, list] = {}  # frames for ranks that have not joined yet
        self.views: dict[int, bytes] = {}  # the controller's view id -> pickled Shape
        self.defined: dict[Connection, set] = {}
        self.gathers: dict[int, _Gather] = {}
        self.asks: dict[int, tuple] = {}  # telemetry: msg id -> (_Gather, the controller's msg id)
        self.links: dict[int, Connection] = {}  # telemetry connections, by rank
        self._links_lock = threading.Lock()
        self.link_rank: dict[Connection, int] = {}
        self._asks_lock = threading.Lock()  # (asks: the poller thread and the main thread's deadlines)
        self.last_seen: dict[int, float] = {}
        self._slots: dict[int, int] = {}  # rank -> its heartbeat slot's offset in _beats
        self._beats: mmap.mmap | None = None
        self._beats_fd = -1
        if _platform.memfd_via_proc():
            try:
                size = P.BEAT_SLOT.size * max(1, len(self.ranks))
                fd = os.memfd_create("mesharray-beats", os.MFD_CLOEXEC)
                try:
                    os.ftruncate(fd, size)
                    self._beats = mmap.mmap(fd, size)
                except BaseException:
                    os.close(fd)
                    raise
                self._beats_fd = fd  # (open while the relay lives: its ranks open it through /proc)
                self._slots = {r: P.BEAT_SLOT.size * i for i, r in enumerate(self.ranks)}
            except OSError:  # (no segment: heartbeats come as frames)
                self._beats = None
        self.interval = 0.5
        self.done = threading.Event()
        self._ids = iter(range(1, 1 << 62)).__next__
        self._replies = RelayReplies(self)
        self.listener = Listener(secret, self._on_socket, kind="unix")
        self.address = self.listener.address
        self.ctl = Connection(connect(controller, secret), handler=self._on_ctl_frame, on_close=self._on_ctl_close,
                              name="controller")
        self.ctl.start_polled()
        hello = {"role": "relay", "host": host, "host_id": host_id, "ranks": self.ranks, "pid": os.getpid(),
                 "address": self.address}
        self.ctl.send(P.HELLO, parts=[pickle.dumps(hello)])

    # -- workers ---------------------------------------------------------------------
    def _on_socket(self, sock) -> None:
        # replies gathered in compiled code (RelayReplies), every other frame by _on_worker_frame
        conn = Connection(sock, handler=self._replies, on_close=self._on_worker_close, name="worker")
        conn.same_host = False  # (what it sends on goes to another host: no shared memory)
        conn.start_polled()

    def _on_worker_frame(self, conn: Connection, kind, flags, msg_id, target, view, payload) -> None:
        """A rank's frame other than a reply (:class:`~mesharray._core.RelayReplies` gathers those)."""
        if kind == P.HEARTBEAT:
            rank = self.rank_of.get(conn)
            if rank is not None:
                self.last_seen[rank] = time.monotonic()
        elif kind == P.HELLO:
            hello = pickle.loads(payload)
            rank = int(hello["rank"])
            self.gone.discard(rank)  # (a process joining as this rank is a live one)
            self.rank_of[conn] = rank
            self.workers[rank] = conn
            self.defined[conn] = set()
            self.addresses[rank] = hello.get("address", "")
            self.last_seen[rank] = time.monotonic()
            off = self._slots.get(rank)
            if off is not None:  # its heartbeats from now on: into its slot (see the module docstring)
                try:
                    conn.send(P.CONFIG, parts=[pickle.dumps({"beat_slot": (os.getpid(), self._beats_fd, off)})])
                except ConnectionError:
                    pass
            for frame in self.waiting.pop(rank, ()):
                self._send_worker(conn, *frame)
        else:
            log.warning("relay: ignoring frame of kind %d from a worker", kind)

    def _on_worker_close(self, conn: Connection, exc) -> None:
        rank = self.rank_of.pop(conn, None)
        self.defined.pop(conn, None)
        if rank is None or self.workers.get(rank) is not conn:
            return
        del self.workers[rank]
        self.last_seen.pop(rank, None)
        # its replies never come: the calls waiting for them end with DIED for it (the
        # controller says why: it knows the exit status)
        for mid, g in list(self.gathers.items()):
            pos = g.pos.get(rank)
            if pos is not None and not any(e[0] == pos for e in g.entries):
                g.entries.append((pos, P.DIED, b""))
                g.left -= 1
                if g.left == 0:
                    del self.gathers[mid]
                    self._answer(mid, g)

    def _send_worker(self, conn: Connection, kind, flags, msg_id, target, view, parts) -> None:
        if view and view not in self.defined.get(conn, ()):
            self.defined.setdefault(conn, set()).add(view)
            conn.send(P.VIEW, 0, 0, view, 0, [self.views[view]])
        try:
            conn.send(kind, flags, msg_id, target, view, parts)
        except ConnectionError:
            pass  # gone: its close handler answers for it

    # -- the controller ------------------------------------------------------------------
    def _on_ctl_frame(self, conn: Connection, kind, flags, msg_id, target, view, payload) -> None:
        if kind == P.RELAY:
            self._relay(flags, msg_id, target, view, payload)
        elif kind == P.VIEW:
            self.views[target] = bytes(payload)
        elif kind == P.FENCE:
            w = self.workers.get(target)
            if w is not None:
                w.send(P.FENCE, 0, msg_id, 0, 0)
            elif target in self.waiting or target in self.ranks:
                self.waiting.setdefault(target, []).append((P.FENCE, 0, msg_id, 0, 0, ()))
        elif kind == P.GONE:
            self._gone(target)
        elif kind == P.INTROSPECT:
            # on a thread of its own: asking the ranks connects to each (a stopped one takes its
            # timeout), and this thread forwards the host's frames and reads its heartbeats meanwhile
            threading.Thread(target=self._introspect, args=(msg_id, bytes(payload)), daemon=True,
                             name="mesharray-relay-telemetry").start()
        elif kind == P.CONFIG:
            cfg = pickle.loads(payload)
            self.interval = float(cfg.get("heartbeat_interval", self.interval))
        elif kind == P.STOP:
            self.done.set()
        else:
            log.warning("relay: ignoring frame of kind %d from the controller", kind)

    def _gone(self, rank: int) -> None:
        """The controller recorded ``rank``'s death: answer its part of each call in flight (``GONE``), drop it.

        Its part is the reply it sent before it went, if any (a rank may reply, then exit),
        else ``DIED``; the controller delivers it at once instead of waiting for the host's
        other ranks. Frames that come for it later are answered ``DIED``.
        """
        self.gone.add(rank)
        self.waiting.pop(rank, None)
        conn = self.workers.pop(rank, None)
        for mid, g in list(self.gathers.items()):
            pos = g.pos.get(rank)
            if pos is None:
                continue
            entry = next((e for e in g.entries if e[0] == pos), None)
            if entry is None:
                entry = (pos, P.DIED, b"")
                g.entries.append(entry)
                g.left -= 1
            try:
                self.ctl.send(P.GONE, 0, mid, rank, 0, P.pack_gathered([entry], 1))
            except ConnectionError:
                self.done.set()
                return
            if g.left == 0:
                del self.gathers[mid]
                self._answer(mid, g)
        if conn is not None:
            self.rank_of.pop(conn, None)
            self.defined.pop(conn, None)
            self.last_seen.pop(rank, None)
            conn.close(join=False)

    def _on_ctl_close(self, conn: Connection, exc) -> None:
        self.done.set()

    def _relay(self, flags: int, msg_id: int, target: int, view: int, payload) -> None:
        inner = flags >> 4
        reply = flags & P.F_REPLY
        ranks, mask, off = P.unpack_targets(payload)
        body = memoryview(payload)[off:]
        g = None
        if reply:
            pos = {r: i for i, r in enumerate(ranks) if mask is None or mask[i]}
            g = self.gathers[msg_id] = _Gather(pos)
        relay_forward(self, ranks, mask, inner, bool(reply), msg_id, target, view, body, g)  # (compiled)
        if g is not None and g.left == 0:
            del self.gathers[msg_id]
            self._answer(msg_id, g)

    def _absent(self, i: int, r: int, inner: int, f: int, msg_id: int, target: int, view: int, body,
                g: _Gather | None) -> None:
        """A relayed frame for rank ``r`` (position ``i``), which has no connection here: kept for it
        if it has not joined yet, else (gone) answered ``DIED`` if it asks for a reply."""
        if r not in self.addresses and r in self.ranks and r not in self.gone:  # not joined yet: later
            self.waiting.setdefault(r, []).append((inner, f, msg_id, target, view, [bytes(body)]))
        elif g is not None and f:  # gone: the controller says why
            g.entries.append((i, P.DIED, b""))
            g.left -= 1

    def _define_view(self, w: Connection, view: int) -> None:
        """Send rank connection ``w`` the view ``view`` before its first frame that names it."""
        self.defined[w].add(view)
        w.send(P.VIEW, 0, 0, view, 0, [self.views[view]])

    def _answer(self, msg_id: int, g: _Gather) -> None:
        try:
            self.ctl.send(P.REPLY, 0, msg_id, P.GATHERED, 0, P.pack_gathered(g.entries, g.count))
        except ConnectionError:
            self.done.set()

    # -- telemetry ---------------------------------------------------------------------
    def _introspect(self, msg_id: int, payload) -> None:
        """Ask every rank of the host (``req["per_rank"]``: each one's request) and answer once."""
        req = pickle.loads(payload)
        per_rank: dict = req["per_rank"]
        g = _Gather({r: i for i, r in enumerate(per_rank)}, time.monotonic() + float(req.get("timeout", 3.0)))
        mid = self._ids()
        with self._asks_lock:
            self.asks[mid] = (g, msg_id)
        for r, ask in per_rank.items():
            try:
                link = self._link(r)
                link.send(P.INTROSPECT, P.F_REPLY, mid, 0, 0, [pickle.dumps(ask)])
            except Exception as exc:
                with self._asks_lock:
                    g.entries.append((g.pos[r], P.DIED, f"unreachable: {exc}".encode()))
                    g.left -= 1
        self._ask_done(mid)

    def _link(self, rank: int) -> Connection:
        with self._links_lock:  # (two queries at once: one connection per rank)
            return self._link_locked(rank)

    def _link_locked(self, rank: int) -> Connection:
        link = self.links.get(rank)
        if link is None or link.closed:
            address = self.addresses.get(rank)
            if not address:
                raise ConnectionError(f"rank {rank} has not joined this relay")
            link = Connection(connect(address, self.secret, timeout=3.0), handler=self._on_link_frame,
                              on_close=self._on_link_close, name=f"telemetry {rank}")
            link.send(P.HELLO, parts=[pickle.dumps({"role": "telemetry", "pid": os.getpid()})])
            self.links[rank] = link
            self.link_rank[link] = rank
            link.start_polled()
        return link

    def _on_link_frame(self, conn: Connection, kind, flags, msg_id, target, view, payload) -> None:
        if kind != P.REPLY:
            return
        with self._asks_lock:
            got = self.asks.get(msg_id)
            if got is None:
                return
            g = got[0]
            pos = g.pos.get(self.link_rank.get(conn, -1))
            if pos is None or any(e[0] == pos for e in g.entries):
                return
            g.entries.append((pos, target, payload))
            g.left -= 1
        self._ask_done(msg_id)

    def _on_link_close(self, conn: Connection, exc) -> None:
        rank = self.link_rank.pop(conn, -1)
        if self.links.get(rank) is conn:
            del self.links[rank]

    def _ask_done(self, mid: int, now: float | None = None) -> None:
        with self._asks_lock:
            got = self.asks.get(mid)
            if got is None:
                return
            g, ctl_id = got
            if g.left > 0 and (now is None or now < g.deadline):
                return
            del self.asks[mid]
        answered = {e[0] for e in g.entries}
        for r, pos in g.pos.items():
            if pos not in answered:
                g.entries.append((pos, P.DIED, b"no answer within the deadline"))
                link = self.links.pop(r, None)
                if link is not None:
                    link.close(join=False)
        self._answer(ctl_id, g)

    # -- the main thread: beats and deadlines ---------------------------------------------
    def serve(self) -> None:
        """Send the host's beats until the controller goes away or stops the relay."""
        last = time.monotonic()
        next_beat = last
        while not self.done.wait(0.05):
            now = time.monotonic()
            stalled = now - last - 0.05
            last = now
            if stalled > self.interval:  # this process was paused: nobody read the heartbeats meanwhile
                for r in list(self.last_seen):
                    self.last_seen[r] = self.last_seen.get(r, now) + stalled
            with self._asks_lock:
                due = [m for m, (g, _) in self.asks.items() if now >= g.deadline]
            for mid in due:
                self._ask_done(mid, now)
            if now >= next_beat:
                next_beat = now + self.interval
                self._read_slots()
                late = {r: round(now - t, 3) for r, t in list(self.last_seen.items()) if now - t > 2 * self.interval}
                try:
                    self.ctl.send(P.BEAT, parts=[pickle.dumps(late)])
                except ConnectionError:
                    break

    def _read_slots(self) -> None:
        """Take in the heartbeats the ranks wrote into their slots since the last look."""
        beats = self._beats
        if beats is None:
            return
        seen, slots, unpack = self.last_seen, self._slots, P.BEAT_SLOT.unpack_from
        for r, t in list(seen.items()):
            off = slots.get(r)
            if off is not None:
                (b,) = unpack(beats, off)
                if b > t and r in seen:  # (not one the poller thread dropped meanwhile: dead or gone)
                    seen[r] = b

    def close(self) -> None:
        self.listener.close()
        for c in list(self.workers.values()) + list(self.links.values()):
            c.close(join=False)
        self.ctl.close(join=False)
        if self._beats is not None:
            self._beats.close()
            os.close(self._beats_fd)
            self._beats = None


def run_relay(cfg: dict, address_fd: int) -> None:
    """The relay process's main (forked by a zygote): write the listening address to ``address_fd``, serve, exit.

    ``cfg``: ``controller`` (address), ``secret``, ``ranks``, ``host``, ``host_id``. The relay
    dies with the zygote (``PR_SET_PDEATHSIG``) and runs in the workers' scheduling class: woken by
    the controller's frame it does not preempt it (the controller goes on sending to the other
    hosts), nor is it preempted by the workers it wakes (it goes on forwarding).
    """
    from .router import set_secret
    from .worker import _set_pdeathsig, prepare_process

    _set_pdeathsig()
    prepare_process()
    set_secret(cfg["secret"])
    try:
        relay = Relay(cfg["controller"], cfg["secret"], cfg["ranks"], cfg["host"], cfg["host_id"])
    except BaseException as exc:
        os.write(address_fd, b"!" + f"{type(exc).__name__}: {exc}".encode()[:1000] + b"\n")
        os.close(address_fd)
        raise
    os.write(address_fd, relay.address.encode() + b"\n")
    os.close(address_fd)
    try:
        relay.serve()
    finally:
        relay.close()
        sys.stdout.flush()
