"""Host agents: ``python -m mesharray host --listen tcp://0.0.0.0:26600``.

One agent runs on each machine (started by hand, ssh, SLURM, Kubernetes).
It serves **one controller at a time**: a script attaches
(``ma.attach([...])``, :mod:`.remote`), asks it to start worker processes for
a process mesh, and when that controller goes away — it detaches, its
connection closes, or it dies — the agent kills that controller's processes
and waits for the next one.

Protocol (after the mutual HMAC challenge on the agent's secret, so nothing is
unpickled from an unauthenticated peer): length-prefixed pickles.

- controller → agent ``{"op": "attach", "nonce", "wrapped", "controller_pid", "controller_host",
  "sys_path", "preload"}``:
  the controller's *job secret* (the one its workers authenticate with)
  travels wrapped as ``job XOR HMAC(agent secret, "mesharray-job" + nonce)``
  with a fresh nonce — a one-time pad only holders of the agent's secret can
  remove, so it never crosses the network in the clear. The agent answers
  ``{"ok": True, "host_id", "hostname", "advertise", "pid", "cpus", "relays"}``
  (``relays``: it starts relays when a spawn asks for one), or
  ``{"ok": False, "error"}`` when it already serves another controller.
- ``{"op": "spawn", "mesh", "ranks", "controller", ...}``: a zygote
  (:mod:`.local`) forks one worker per rank; workers connect to the
  controller themselves. Reports go back as
  ``("report", mesh, "forked", rank, pid)`` and ``("report", mesh, "exit", rank, pid, status)``.
  The spawn request may carry ``env`` (variables for the workers), ``python``
  (the interpreter of the zygote, hence of the workers) and ``workspace``
  (True: the agent's copy of the controller's tree goes first on
  ``sys.path`` and is the workers' working directory), and ``relay``
  (``{"host": index}``: the mesh spans hosts; the zygote forks this host's
  relay first, :mod:`mesharray.runtime.relay`, reported as rank -1).
  The agent keeps its zygotes while the controller is attached, one per
  interpreter, environment, workspace (and its copy's generation) and path
  (at most :data:`MAX_ZYGOTES` idle ones): a mesh like an earlier one costs
  forks only. An attach that names the controller's ``sys_path`` starts the
  zygote a plain ``spawn_procs`` will want at once, while the script goes on.
- ``{"op": "kill", "mesh", "rank"}``, ``{"op": "release", "mesh"}`` (the mesh stopped).
- ``{"op": "sync", "id", "files"}``, ``{"op": "sync_put", "id", "rel", "offset", "data", "last",
  "executable", "sha"}`` ..., ``{"op": "sync_done", "id"}``: copy the controller's tree
  (:mod:`.workspace`) into the agent's own directory; ``sync`` and ``sync_done`` are
  answered ``("reply", id, {...})``.
- EOF (or keepalive failure): the controller is gone; every zygote of the
  session is closed, which kills its workers.

Workers of an agent get ``MESHARRAY_HOST_ID`` (so two agents with different
host ids never share memory, even on one machine), listen on the advertised
interface over TCP (other hosts) and on a unix socket (this host), and start
a data plane (:mod:`mesharray.transport.dataplane`) for bulk data.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import pickle
import socket
import struct
import sys
import threading
import time
import warnings
from typing import Any

from ..errors import BootstrapError
from ..transport import auth
from ..transport.listener import Listener
from ..transport.sockio import recv_exactly
from .local import LocalBootstrap, Zygote, user_paths, zygote_env
from .workspace import Workspace

__all__ = ["HostAgent", "parse_url", "send_msg", "recv_msg", "wrap_secret", "DEFAULT_PORT", "secret_from_env",
           "write_ready_file", "MAX_ZYGOTES"]

log = logging.getLogger("mesharray.agent")

DEFAULT_PORT = 26600
#: zygotes an agent keeps with no mesh on them (the least recently used beyond it are closed)
MAX_ZYGOTES = 4
_LEN = struct.Struct("!I")
_MAX_MSG = 64 << 20


def send_msg(sock: socket.socket, obj: Any, lock: threading.Lock | None = None) -> None:
    data = pickle.dumps(obj, protocol=5)
    if lock is None:
        sock.sendall(_LEN.pack(len(data)) + data)
    else:
        with lock:
            sock.sendall(_LEN.pack(len(data)) + data)


def recv_msg(sock: socket.socket) -> Any:
    """One message (``EOFError`` when the peer closed; only call on an authenticated socket)."""
    (n,) = _LEN.unpack(recv_exactly(sock, _LEN.size))
    if n > _MAX_MSG:
        raise BootstrapError(f"agent protocol message of {n} bytes; at most {_MAX_MSG}")
    return pickle.loads(recv_exactly(sock, n))


def wrap_secret(job: bytes, key: bytes, nonce: bytes) -> bytes:
    """``job`` XOR ``HMAC-SHA256(key, "mesharray-job" + nonce)`` (its own inverse).

    Examples
    --------
    >>> w = wrap_secret(b"j" * 32, b"agent", b"n" * 16)
    >>> w != b"j" * 32, wrap_secret(w, b"agent", b"n" * 16) == b"j" * 32
    (True, True)
    """
    if len(job) != 32:
        raise ValueError(f"job secret must be 32 bytes, got {len(job)}")
    pad = hmac.new(key, b"mesharray-job" + nonce, hashlib.sha256).digest()
    return bytes(a ^ b for a, b in zip(job, pad))


def secret_from_env(value: str | bytes | None = None) -> bytes | None:
    """The agents' shared secret: ``value``, else ``MESHARRAY_SECRET`` (``None`` when neither is set)."""
    if value is None:
        value = os.environ.get("MESHARRAY_SECRET") or None
    if value is None:
        return None
    return value.encode() if isinstance(value, str) else bytes(value)


def parse_url(url: str, default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    """``tcp://HOST:PORT`` (or ``tcp:HOST:PORT``, ``HOST:PORT``, ``HOST``) → ``(host, port)``.

    Examples
    --------
    >>> parse_url("tcp://node7:26600"), parse_url("tcp:10.0.0.2:5"), parse_url("node1")
    (('node7', 26600), ('10.0.0.2', 5), ('node1', 26600))
    >>> parse_url("tcp://[::1]:7")
    ('::1', 7)
    >>> parse_url("http://x:1")
    Traceback (most recent call last):
    ...
    ValueError: bad host agent address 'http://x:1': expected tcp://HOST:PORT
    """
    if not isinstance(url, str):
        raise TypeError(f"host agent address must be a str, got {type(url).__name__}")
    rest = url
    if rest.startswith("tcp://"):
        rest = rest[6:]
    elif rest.startswith("tcp:"):
        rest = rest[4:]
    elif "://" in rest:
        raise ValueError(f"bad host agent address {url!r}: expected tcp://HOST:PORT")
    if rest.startswith("["):
        host, _, tail = rest[1:].partition("]")
        port = tail[1:] if tail.startswith(":") else ""
    elif rest.count(":") == 1:
        host, _, port = rest.partition(":")
    else:
        host, port = rest, ""
    if not host or (port and not port.isdigit()):
        raise ValueError(f"bad host agent address {url!r}: expected tcp://HOST:PORT")
    return host, int(port) if port else default_port


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _is_wildcard(host: str) -> bool:
    return host in ("", "0.0.0.0", "::")


def _resolve(host: str) -> str:
    try:
        return str(socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
    except OSError as exc:
        raise BootstrapError(f"cannot resolve {host!r}: {exc}") from exc


def _route_ip() -> str | None:
    """The address of the interface of the default route (a UDP 'connect' sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if _is_loopback(ip) or ip == "0.0.0.0" else ip


def advertised_host(bind: str, advertise: str | None) -> str:
    """The IP workers listen on and the address the agent prints.

    ``--advertise`` wins; else the bind address when it is a specific one;
    else (all interfaces) the hostname's address — unless that is a loopback
    address (Debian maps the hostname to 127.0.1.1: advertising it would send
    other hosts to themselves), then the default route's interface; with
    neither, a clear error asking for ``--advertise``.
    """
    if advertise:
        return _resolve(parse_url(advertise)[0] if "://" in advertise or ":" in advertise else advertise)
    if not _is_wildcard(bind):
        return _resolve(bind)
    ip = _resolve(socket.gethostname())
    if not _is_loopback(ip):
        return ip
    route = _route_ip()
    if route is None:
        raise BootstrapError(f"this host's name {socket.gethostname()!r} resolves to the loopback address {ip} "
                             f"and no other interface has a route; other hosts could not reach this one: "
                             f"pass --advertise tcp://ADDRESS:PORT")
    return route



def _close_all(things: list, timeout: float = 10.0) -> None:
    """``close()`` each of ``things`` at once, each in a thread (each may wait for processes to exit)."""
    threads = [threading.Thread(target=t.close, daemon=True) for t in things]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)

class _Session:
    """One attached controller: the socket to it, its meshes' processes and the zygotes that fork them."""

    def __init__(self, agent: HostAgent, sock: socket.socket, job: bytes, peer: str) -> None:
        self.agent = agent
        self.sock = sock
        self.job = job
        self.peer = peer
        self.lock = threading.Lock()
        self.boots: dict[str, LocalBootstrap] = {}
        self.since = time.time()
        self.closing = False
        self.sync_error: str | None = None
        self.zygotes: dict[tuple, Zygote] = {}  # by what makes them (see zygote()), least recently used first
        self._zlock = threading.Lock()

    def zygote(self, sys_path: list[str], python: str | None, env: dict, workspace: bool, nprocs: int,
               preload: list[str] | None = None) -> Zygote:
        """The zygote for a mesh of ``nprocs`` processes per host started with these settings (kept, or started).

        ``sys_path``: the controller's (entries that do not exist here are
        dropped); ``python``: the interpreter (None: the agent's); ``env``: the
        workers' variables; ``workspace``: put the synced copy first;
        ``preload``: the modules the controller's layers want imported before forks.
        """
        preload = [str(m) for m in preload or ()]
        a = self.agent
        sys_path = [p for p in sys_path if p and os.path.exists(p)]
        first: list[str] = []
        cwd = None
        if workspace:
            if a.workspace is None:
                raise BootstrapError(f"host {a.host_id} has no workspace: call sync_workspace before spawn_procs")
            cwd = a.workspace.path
            first = [cwd]
        if python is None:
            sys_path += [p for p in sys.path if p not in sys_path]
            sys_path = first + [p for p in sys_path if p not in first]
            first = []
        else:  # its own sys.path; the controller's own directories in front
            first += [p for p in user_paths(sys_path) if p not in first]
            sys_path = []
        wenv = {"MESHARRAY_HOST_ID": a.host_id, "MESHARRAY_BUFFER_HOST": a.advertise}
        wenv.update({str(k): str(v) for k, v in env.items()})
        zenv = zygote_env(nprocs, wenv)
        key = (python, tuple(sorted(zenv.items())), cwd, a.workspace_gen if workspace else None,
               tuple(sys_path), tuple(first), tuple(preload))
        idle: list[Zygote] = []
        with self._zlock:
            if self.closing:
                raise BootstrapError("the controller detached")
            z = self.zygotes.pop(key, None)
            if z is not None and not z.alive:
                idle.append(z)
                z = None
            if z is None:
                z = Zygote(python, zenv, cwd, sys_path if python is None else [], first, preload)
            self.zygotes[key] = z  # (most recently used last)
            spare = [k for k, v in self.zygotes.items() if not v.meshes and v is not z]
            for k in spare[:max(0, len(spare) - MAX_ZYGOTES)]:
                idle.append(self.zygotes.pop(k))
        for old in idle:
            threading.Thread(target=old.close, name="mesharray-zygote-close", daemon=True).start()
        return z

    def prewarm(self, sys_path: list[str], preload: list[str] | None = None) -> None:
        """Start the zygote a plain ``spawn_procs`` of this controller will want (its path, no env, one
        process per core), so that its interpreter's start and imports are done by then."""
        try:
            self.zygote(sys_path, None, {}, False, os.cpu_count() or 1, preload)
        except Exception as exc:  # (the spawn will say what is wrong)
            log.info("host agent: could not start a zygote ahead: %s", exc)

    def report(self, mesh: str, msg: tuple) -> None:
        try:
            send_msg(self.sock, ("report", mesh, *msg), self.lock)
        except OSError:
            pass  # the controller is gone: the session's loop sees it too

    def spawn(self, msg: dict) -> None:
        mesh = str(msg["mesh"])
        if mesh in self.boots:
            raise BootstrapError(f"mesh {mesh!r} already has processes on this host")
        a = self.agent
        ranks = list(msg["ranks"])
        zyg = self.zygote(msg.get("sys_path", []), msg.get("python") or None, msg.get("env") or {},
                       bool(msg.get("workspace")), len(ranks), msg.get("preload"))
        relay = msg.get("relay")
        if relay:
            relay = {"controller": msg["controller"], "ranks": ranks, "host": int(relay["host"]),
                     "host_id": a.host_id}
        self.boots[mesh] = LocalBootstrap(
            None, 0, forward_logs=bool(msg.get("forward_logs", True)), listen="tcp", address=msg["controller"],
            secret=self.job, ranks=ranks, listen_host=a.advertise, data_plane=msg.get("data_plane"),
            on_report=lambda m, mesh=mesh: self.report(mesh, m), zygote=zyg, mesh=mesh, relay=relay or None)

    def reply(self, rid: Any, value: Any) -> None:
        try:
            send_msg(self.sock, ("reply", rid, value), self.lock)
        except OSError:
            pass  # the controller is gone: the session's loop sees it too

    def sync(self, msg: dict) -> None:
        """Plan a copy of the controller's tree: delete what it no longer has, answer which files to send."""
        ws = self.agent.open_workspace()
        self.sync_error = None
        need, deleted = ws.plan({str(k): tuple(v) for k, v in dict(msg["files"]).items()})
        self.reply(msg.get("id"), {"ok": True, "need": need, "deleted": deleted, "path": ws.path})

    def sync_put(self, msg: dict) -> None:
        if self.sync_error is not None:
            return  # the sync already failed: sync_done says why
        ws = self.agent.open_workspace()
        try:
            ws.put(str(msg["rel"]), int(msg["offset"]), bytes(msg["data"]), bool(msg["last"]),
                   bool(msg["executable"]), str(msg["sha"]))
        except Exception as exc:
            self.sync_error = f"{type(exc).__name__}: {exc}"

    def sync_done(self, msg: dict) -> None:
        ws = self.agent.open_workspace()
        ws.finish()
        self.agent.workspace_gen += 1  # (zygotes started on the older copy are not used again)
        err, self.sync_error = self.sync_error, None
        if err is not None:
            self.reply(msg.get("id"), {"ok": False, "error": f"host {self.agent.host_id}: {err}"})
        else:
            self.reply(msg.get("id"), {"ok": True, "path": ws.path})

    def serve(self) -> None:
        while True:
            try:
                msg = recv_msg(self.sock)
            except (EOFError, OSError):
                return
            op = msg.get("op") if isinstance(msg, dict) else None
            try:
                if op == "spawn":
                    self.spawn(msg)
                elif op == "kill":
                    boot = self.boots.get(str(msg["mesh"]))
                    if boot is not None:
                        boot.kill(int(msg["rank"]))
                elif op == "release":
                    boot = self.boots.pop(str(msg["mesh"]), None)
                    if boot is not None:
                        threading.Thread(target=boot.close, name="mesharray-release", daemon=True).start()
                elif op == "ping":
                    send_msg(self.sock, ("pong", msg.get("n")), self.lock)
                elif op == "sync":
                    self.sync(msg)
                elif op == "sync_put":
                    self.sync_put(msg)
                elif op == "sync_done":
                    self.sync_done(msg)
                else:
                    log.warning("host agent: unknown request %r from %s", op, self.peer)
            except Exception as exc:  # a bad request costs that request, never the session
                log.warning("host agent: request %r from %s failed: %s", op, self.peer, exc)
                if op in ("sync", "sync_done"):
                    self.reply(msg.get("id"), {"ok": False, "error": f"host {self.agent.host_id}: "
                                                                     f"{type(exc).__name__}: {exc}"})
                    continue
                mesh = msg.get("mesh") if isinstance(msg, dict) else None
                self.report(str(mesh), ("error", f"{type(exc).__name__}: {exc}"))

    def close(self) -> None:
        boots, self.boots = list(self.boots.values()), {}
        _close_all(boots)
        with self._zlock:
            self.closing = True  # (a zygote started ahead after this is closed at once: see zygote())
            zygotes, self.zygotes = list(self.zygotes.values()), {}
        _close_all(zygotes)
        try:
            self.sock.close()
        except OSError:
            pass


class HostAgent:
    """Serves one controller at a time on ``listen``; starts its processes, kills them when it goes.

    Parameters
    ----------
    listen : str
        ``tcp://HOST:PORT`` to bind (``0.0.0.0`` for every interface; port 0: any free one).
    secret : bytes
        The secret every controller must prove (``MESHARRAY_SECRET``). Required.
    advertise : str, optional
        The address other machines reach this one at (see :func:`advertised_host`).
    host_id : str, optional
        This host's name (default: the hostname); agents with different ids never share memory.
    workdir : str, optional
        The agent's own directory, where ``sync_workspace`` copies a controller's
        tree (default: a new temporary directory, made on the first sync and
        removed when the agent stops).
    """

    def __init__(self, listen: str = f"tcp://0.0.0.0:{DEFAULT_PORT}", secret: bytes | None = None,
                 advertise: str | None = None, host_id: str | None = None, workdir: str | None = None) -> None:
        bind, port = parse_url(listen)
        if not secret:
            where = "every interface" if _is_wildcard(bind) else bind
            raise BootstrapError(f"a host agent needs a secret to authenticate controllers (binding {where}): "
                                 f"set MESHARRAY_SECRET to the same value here and in the script")
        self.secret = secret
        self.host_id = host_id or socket.gethostname()
        self.advertise = advertised_host(bind, advertise)
        with warnings.catch_warnings():  # binding every interface is the point of an agent; it is authenticated
            warnings.simplefilter("ignore", RuntimeWarning)
            self.listener = Listener(secret, self._on_socket, kind="tcp", host=bind, port=port)
        self.port = int(self.listener.address.rpartition(":")[2])
        adv = f"[{self.advertise}]" if ":" in self.advertise else self.advertise
        self.url = f"tcp://{adv}:{self.port}"
        self.session: _Session | None = None
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._stop_requested = False
        self.sessions_served = 0
        self.workdir = workdir
        self._own_workdir = False
        self.workspace: Workspace | None = None
        self.workspace_gen = 0

    def _on_socket(self, sock: socket.socket) -> None:
        threading.Thread(target=self._serve, args=(sock,), name="mesharray-agent-session", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            peer = "%s:%s" % sock.getpeername()[:2]
        except OSError:
            peer = "?"
        try:
            sock.settimeout(auth.HANDSHAKE_TIMEOUT)
            hello = recv_msg(sock)
            sock.settimeout(None)
            if not isinstance(hello, dict) or hello.get("op") != "attach":
                raise BootstrapError(f"expected an attach request, got {type(hello).__name__}")
            job = wrap_secret(bytes(hello["wrapped"]), self.secret, bytes(hello["nonce"]))
        except Exception as exc:
            log.warning("host agent: bad attach from %s: %s", peer, exc)
            sock.close()
            return
        with self._lock:
            # a controller that just went away is still being cleaned up after: wait for it
            # (also one whose connection already ended, before its session thread read the EOF:
            # a controller that detaches and attaches again at once must not find the agent busy)
            t0 = time.monotonic()
            while self.session is not None and time.monotonic() - t0 < 15.0:
                if not (self.session.closing or _ended(self.session.sock)) and time.monotonic() - t0 >= 1.0:
                    break  # a live controller: refuse
                # (up to 1 s for the end of one that looks alive: on loopback its FIN and this
                # attach can come through two CPUs' packet queues in either order; seen once
                # in CI, a re-attach right after detach refused, under load)
                self._lock.wait(0.05)
            busy = self.session
            if busy is None:
                self.session = _Session(self, sock, job, peer)
        if busy is not None:
            since = time.strftime("%H:%M:%S", time.localtime(busy.since))
            try:
                send_msg(sock, {"ok": False, "error": f"host agent {self.host_id} at {self.url} already serves "
                                                      f"the controller at {busy.peer} (since {since}); it serves "
                                                      f"one controller at a time"})
            finally:
                sock.close()
            return
        sess = self.session
        assert sess is not None
        _keepalive(sock)
        log.info("host agent: controller %s attached (pid %s on %s)", peer, hello.get("controller_pid"),
                 hello.get("controller_host"))
        if hello.get("sys_path"):
            threading.Thread(target=sess.prewarm, args=(list(hello["sys_path"]), hello.get("preload")),
                             name="mesharray-prewarm", daemon=True).start()
        try:
            send_msg(sock, {"ok": True, "host_id": self.host_id, "hostname": socket.gethostname(),
                            "advertise": self.advertise, "pid": os.getpid(), "cpus": os.cpu_count(),
                            "relays": True}, sess.lock)
            sess.serve()
        except OSError:
            pass
        finally:
            sess.closing = True
            sess.close()
            with self._lock:
                self.session = None
                self.sessions_served += 1
                self._lock.notify_all()
            log.info("host agent: controller %s detached; its processes are gone", peer)

    def serve_forever(self) -> None:
        """Serve until :meth:`stop` is called, or :meth:`request_stop` (SIGINT/SIGTERM in :func:`main`).

        Polls (0.2 s): a signal may be delivered to any thread of the process, and
        the main thread only runs Python signal handlers when it runs at all, so
        it must not block forever on a lock.
        """
        while not self._stop.wait(0.2):
            if self._stop_requested:
                self.stop()

    def request_stop(self) -> None:
        """Ask :meth:`serve_forever` to stop (safe in a signal handler: takes no lock)."""
        self._stop_requested = True

    def open_workspace(self) -> Workspace:
        """The copy of the controllers' trees (``workdir/workspace``), made on first use."""
        if self.workspace is None:
            if self.workdir is None:
                import tempfile

                safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.host_id)
                self.workdir = tempfile.mkdtemp(prefix=f"mesharray-{safe}-")
                self._own_workdir = True
            self.workspace = Workspace(os.path.join(self.workdir, "workspace"))
        return self.workspace

    def stop(self) -> None:
        self.listener.close()
        sess = self.session
        if sess is not None:
            try:
                sess.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sess.close()

        if self._own_workdir and self.workdir is not None:
            import shutil

            shutil.rmtree(self.workdir, ignore_errors=True)
        self._stop.set()


def _ended(sock: socket.socket) -> bool:
    """Whether the peer closed ``sock`` (EOF or reset waiting to be read), without consuming any data."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


def _keepalive(sock: socket.socket) -> None:
    """Notice a controller whose machine vanished (no FIN ever comes) in about 10 s."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 5)):
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    except OSError:  # pragma: no cover - best effort
        pass


def main(argv: list[str]) -> int:
    """``python -m mesharray host --listen tcp://0.0.0.0:26600 [--advertise URL] [--host-id NAME]``."""
    import argparse
    import signal

    ap = argparse.ArgumentParser(prog="python -m mesharray host",
                                 description="Serve one controller at a time: start its worker processes on "
                                             "this machine, kill them when it goes away. The secret comes from "
                                             "MESHARRAY_SECRET (never from the command line: argv is public).")
    ap.add_argument("--listen", default=f"tcp://0.0.0.0:{DEFAULT_PORT}",
                    help=f"address to bind (default tcp://0.0.0.0:{DEFAULT_PORT})")
    ap.add_argument("--advertise", default=None, help="address other machines reach this one at")
    ap.add_argument("--host-id", default=None, help="this host's name (default: the hostname)")
    ap.add_argument("--workdir", default=None,
                    help="the agent's directory for synced workspaces (default: a temporary one, removed at exit)")
    ap.add_argument("--ready-file", default=None,
                    help="once listening, write {url, host_id, pid} as JSON to this file (mode 0600)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s mesharray host: %(message)s")
    try:
        agent = HostAgent(args.listen, secret_from_env(), advertise=args.advertise, host_id=args.host_id,
                          workdir=args.workdir)
    except (BootstrapError, ValueError, OSError) as exc:
        print(f"mesharray host: {exc}", file=sys.stderr)
        return 2
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *a: agent.request_stop())
    print(f"mesharray host listening on {agent.url}", flush=True)
    if args.ready_file:
        write_ready_file(args.ready_file, agent)
    agent.serve_forever()
    return 0


def write_ready_file(path: str, agent: HostAgent, **extra: Any) -> None:
    """Say where ``agent`` listens: ``{"url", "host_id", "pid", **extra}`` as JSON in ``path`` (0600, atomic).

    What a job reads to find the agents it started (:mod:`mesharray.job`).
    """
    import json

    info = {"url": agent.url, "host_id": agent.host_id, "pid": os.getpid(), "hostname": socket.gethostname(),
            **extra}
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)
