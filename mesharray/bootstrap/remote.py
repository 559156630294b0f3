"""The controller's side of host agents: attach to them, start a process mesh across them.

:func:`attach_agents` connects to every agent (``python -m mesharray host``,
see :mod:`.agent`) in parallel, proves the shared secret, and hands each the
controller's job secret wrapped in a one-time pad. :func:`launch` asks each
agent for ``procs`` workers of a new mesh; the workers connect back to a TCP
listener of the controller on the address the agents see it at, and the mesh
is laid out ``{hosts, procs}`` in the order the agents were given.

A mesh over several hosts also gets one relay process per host (forked by
the host's zygote before the workers, :mod:`mesharray.runtime.relay`):
messages to the ranks of several hosts leave the controller once per host
(:mod:`mesharray.runtime.hosts`). ``MESHARRAY_RELAY=0`` starts none (every
message then goes to each rank directly, as for a one-host mesh).

An agent that goes away while attached (killed, its machine gone) takes its
processes with it: their calls fail with :class:`~mesharray.ActorDiedError`
naming the host; the other hosts keep working.

:func:`sync_workspace` copies a directory tree to every agent (the files that
changed since the last copy, deletions too; see :mod:`.workspace`); the
processes of meshes started afterwards put the copy first on ``sys.path``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import socket
import sys
import threading
import time
import warnings
from typing import Any, Callable

from .._core import Shape
from ..errors import AuthenticationError, BootstrapError
from ..runtime.controller import Controller
from ..runtime.router import get_router
from ..transport import auth
from ..transport.dataplane import plane_kind
from ..transport.sockio import shut_and_close
from .agent import parse_url, recv_msg, send_msg, wrap_secret
from .launch import Launch, wait_exit_status
from .local import PRELOAD
from .workspace import CHUNK, scan

__all__ = ["AgentClient", "attach_agents", "launch", "plane_kind", "sync_workspace"]

log = logging.getLogger("mesharray.remote")


class AgentClient:
    """An attached host agent, as the controller sees it."""

    def __init__(self, url: str, sock: socket.socket, info: dict) -> None:
        self.url = url
        self.sock = sock
        self.info = info
        self.host_id: str = info["host_id"]
        #: this process's address on the route to the agent (where its workers reach the controller)
        self.local_ip: str = sock.getsockname()[0]
        self.lock = threading.Lock()
        self.lost: BaseException | None = None
        self.handlers: dict[str, Callable[[tuple], None]] = {}
        self.on_lost: list[Callable[[BaseException], None]] = []
        #: the agent's copy of this controller's tree, once synced (spawned processes use it), and that tree
        self.workspace: str | None = None
        self.workspace_source: str | None = None
        self._replies: dict[int, Any] = {}
        self._reply_cond = threading.Condition()
        self._ids = itertools.count(1)
        self._reader = threading.Thread(target=self._read, name=f"mesharray-agent-{self.host_id}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            while True:
                msg = recv_msg(self.sock)
                if isinstance(msg, tuple) and msg and msg[0] == "report":
                    h = self.handlers.get(msg[1])
                    if h is not None:
                        h(msg[2:])
                elif isinstance(msg, tuple) and len(msg) == 3 and msg[0] == "reply":
                    with self._reply_cond:
                        self._replies[msg[1]] = msg[2]
                        self._reply_cond.notify_all()
        except (EOFError, OSError) as exc:
            err: BaseException = exc
        except Exception as exc:  # pragma: no cover - a broken message: the link is lost
            err = exc
        self.lost = BootstrapError(f"host agent {self.host_id} at {self.url} is gone ({type(err).__name__}: {err})")
        with self._reply_cond:
            self._reply_cond.notify_all()
        for cb in list(self.on_lost):
            try:
                cb(self.lost)
            except Exception:  # pragma: no cover
                log.exception("agent-lost callback failed")

    def send(self, msg: dict) -> None:
        if self.lost is not None:
            raise self.lost
        try:
            send_msg(self.sock, msg, self.lock)
        except OSError as exc:
            raise BootstrapError(f"host agent {self.host_id} at {self.url} is unreachable: {exc}") from exc

    def request(self, msg: dict, timeout: float) -> Any:
        """Send ``msg`` with a fresh ``id`` and wait for the agent's answer to it."""
        rid = next(self._ids)
        self.send({**msg, "id": rid})
        deadline = time.monotonic() + timeout
        with self._reply_cond:
            while rid not in self._replies:
                if self.lost is not None:
                    raise self.lost
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BootstrapError(f"host agent {self.host_id} at {self.url} did not answer {msg.get('op')!r} "
                                         f"within {timeout:g} s")
                self._reply_cond.wait(left)
            return self._replies.pop(rid)

    def close(self) -> None:
        """Detach: the agent kills what is left of this controller's processes and serves the next one."""
        shut_and_close(self.sock)
        self._reader.join(2.0)

    def __repr__(self) -> str:
        state = " lost" if self.lost else ""
        return f"<AgentClient {self.host_id} {self.url}{state}>"


def _attach_one(url: str, secret: bytes, job: bytes, deadline: float) -> AgentClient:
    host, port = parse_url(url)
    last: BaseException | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{url}: {last or 'no answer'}")
        sock = None
        try:
            sock = socket.create_connection((host, port), timeout=min(left, 5.0))
            auth.client_handshake(sock, secret, timeout=min(left, auth.HANDSHAKE_TIMEOUT))
            nonce = os.urandom(16)
            send_msg(sock, {"op": "attach", "nonce": nonce, "wrapped": wrap_secret(job, secret, nonce),
                            "controller_pid": os.getpid(), "controller_host": socket.gethostname(),
                            "sys_path": [p for p in sys.path if p], "preload": list(PRELOAD)})
            sock.settimeout(min(max(left, 1.0), 30.0))
            reply = recv_msg(sock)
            sock.settimeout(None)
        except AuthenticationError:
            if sock is not None:
                sock.close()
            raise
        except (OSError, EOFError) as exc:  # not up yet, or going away: try again until the deadline
            if sock is not None:
                sock.close()
            last = exc
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
            continue
        except BaseException:  # a reply that is not the protocol's (or an interrupt): never retried
            if sock is not None:
                sock.close()
            raise
        if not isinstance(reply, dict):
            sock.close()
            raise BootstrapError(f"host agent at {url} answered the attach with a {type(reply).__name__}, "
                                 f"not the agent protocol's reply (is it a mesharray agent of this version?)")
        if not reply.get("ok"):
            sock.close()
            raise BootstrapError(f"host agent at {url} refused to attach: {reply.get('error')}")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return AgentClient(url, sock, reply)


def attach_agents(urls: list[str], secret: bytes, job: bytes | None = None,
                  timeout: float = 30.0) -> list[AgentClient]:
    """Attach to every agent in ``urls`` (in parallel); all or nothing.

    ``secret`` is the agents' own; ``job`` the secret of the meshes to start
    (default: this process's router's, the one its controllers use).

    Raises :class:`AuthenticationError` when an agent refuses the secret, and
    :class:`BootstrapError` naming every agent not reached within ``timeout``.
    """
    deadline = time.monotonic() + timeout
    job_secret = get_router().secret if job is None else job
    results: list[Any] = [None] * len(urls)

    def run(i: int) -> None:
        try:
            results[i] = _attach_one(urls[i], secret, job_secret, deadline)
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(urls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [(u, r) for u, r in zip(urls, results) if isinstance(r, BaseException)]
    if errors:
        for r in results:
            if isinstance(r, AgentClient):
                r.close()
        for _, r in errors:
            if isinstance(r, AuthenticationError):
                raise AuthenticationError(f"a host agent refused the secret: {r} (is MESHARRAY_SECRET the "
                                          f"same here and on the agents?)") from r
        refused = [(u, r) for u, r in errors if isinstance(r, BootstrapError)]
        if refused:
            raise refused[0][1]
        unreachable = [u for u, _ in errors]
        why = "; ".join(str(r) for _, r in errors)
        raise BootstrapError(f"could not attach to host agents {unreachable} within {timeout:g} s ({why})")
    return results


class _RemoteProcs:
    """The workers of one mesh across agents: pids, exit statuses, kills."""

    def __init__(self, agents: list[AgentClient], mesh: str, ranks: list[list[int]]) -> None:
        self.agents = agents
        self.mesh = mesh
        self.host_of = {r: h for h, rs in enumerate(ranks) for r in rs}
        self.pids: dict[int, int] = {}
        self.status: dict[int, tuple] = {}
        self.relay_pids: dict[int, int] = {}  # host -> its relay's pid (reported as rank -1)
        self.relay_status: dict[int, tuple] = {}
        self.errors: list[str] = []
        self._cond = threading.Condition()
        self.controller: Controller | None = None  # set once the mesh's workers all joined
        for h, a in enumerate(agents):
            a.handlers[mesh] = functools.partial(self._on_report, h)
            a.on_lost.append(self._on_lost)

    def _on_report(self, host: int, msg: tuple) -> None:
        with self._cond:
            if msg[0] == "forked":
                if msg[1] == -1:
                    self.relay_pids[host] = msg[2]
                else:
                    self.pids[msg[1]] = msg[2]
            elif msg[0] == "exit" and msg[1] == -1:
                self.relay_status[host] = (msg[2], msg[3])
            elif msg[0] == "exit" and self.pids.get(msg[1]) == msg[2]:
                self.status[msg[1]] = (msg[2], msg[3])
            elif msg[0] == "error":
                self.errors.append(f"host {self.agents[host].host_id}: {msg[1]}")
            self._cond.notify_all()

    def _on_lost(self, err: BaseException) -> None:
        with self._cond:
            self._cond.notify_all()
        ctl = self.controller
        if ctl is None:
            return
        # its processes die with it (their zygote's stdin closed): say which host, before their
        # connections do (the zygote waits 0.5 s before it kills them)
        lost = next((h for h, a in enumerate(self.agents) if a.lost is err), None)
        if lost is None:
            return
        a = self.agents[lost]
        for rank, h in self.host_of.items():
            if h == lost:
                ctl.declare_dead(rank, f"host {a.host_id} is lost: its host agent at {a.url} is gone")

    def exit_status(self, rank: int, timeout: float):
        agent = self.agents[self.host_of[rank]]
        return wait_exit_status(self._cond, self.status, rank, timeout, lambda: agent.lost is not None)

    def kill(self, rank: int) -> None:
        try:
            self.agents[self.host_of[rank]].send({"op": "kill", "mesh": self.mesh, "rank": rank})
        except BootstrapError:
            pass

    def check(self, controller: Controller) -> None:
        """Raise :class:`BootstrapError` if an agent or a worker failed while the mesh starts."""
        with self._cond:
            if self.errors:
                raise BootstrapError(f"a host agent could not start processes: {self.errors[0]}")
            for a in self.agents:
                if a.lost is not None:
                    raise a.lost
            for rank, st in self.status.items():
                if rank not in controller.workers:
                    code = os.waitstatus_to_exitcode(st[1])
                    raise BootstrapError(
                        f"worker rank {rank} (pid {self.pids.get(rank)}) on host "
                        f"{self.agents[self.host_of[rank]].host_id} exited with "
                        f"{'signal ' + str(-code) if code < 0 else 'code ' + str(code)} before joining")
            for host, st in self.relay_status.items():
                if controller.plane is None:
                    code = os.waitstatus_to_exitcode(st[1])
                    raise BootstrapError(
                        f"the relay (pid {st[0]}) of host {self.agents[host].host_id} exited with "
                        f"{'signal ' + str(-code) if code < 0 else 'code ' + str(code)} before joining")

    def release(self) -> None:
        for a in self.agents:
            a.handlers.pop(self.mesh, None)
            try:
                a.on_lost.remove(self._on_lost)
            except ValueError:
                pass
            try:
                a.send({"op": "release", "mesh": self.mesh})
            except BootstrapError:
                pass


def launch(agents: list[AgentClient], procs: int, *, forward_logs: bool = True, timeout: float = 60.0,
           heartbeat_timeout: float = 5.0, heartbeat_interval: float = 0.5, name: str = "procs",
           kill_unresponsive: bool = False, data_plane: str = "tcp", progress: bool = True,
           dim: str = "procs", env: dict | None = None, python: str | None = None) -> Launch:
    """Start ``procs`` workers on each agent; the mesh is ``{hosts: len(agents), dim: procs}``.

    ``env`` is set in every worker's environment (it travels on the
    authenticated connection, never on a command line); ``python`` is the
    interpreter of the workers on every host (default: the agent's). An agent
    with a synced workspace (:func:`sync_workspace`) puts it first on the
    workers' ``sys.path`` and makes it their working directory; the workers'
    ``MESHARRAY_WORKSPACE`` names that copy and ``MESHARRAY_WORKSPACE_SOURCE``
    the tree it copies (``ma.spmd`` finds a script of the tree there).
    """
    if not isinstance(procs, int) or isinstance(procs, bool) or procs < 1:
        raise ValueError(f"procs per host must be an int >= 1, got {procs!r}")
    for a in agents:
        if a.lost is not None:
            raise a.lost
    ips = {a.local_ip for a in agents}
    # one interface reaches every agent: listen there; else every interface (authenticated)
    bind = next(iter(ips)) if len(ips) == 1 else "0.0.0.0"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        ctl = Controller(listen="tcp", host=bind, heartbeat_timeout=heartbeat_timeout,
                         heartbeat_interval=heartbeat_interval, name=name, kill_unresponsive=kill_unresponsive)
    port = ctl.address.rpartition(":")[2]
    shape = Shape({"hosts": len(agents), dim: procs})
    ranks = [[h * procs + p for p in range(procs)] for h in range(len(agents))]
    mesh_id = f"{name}-{os.getpid()}-{os.urandom(4).hex()}"
    remote = _RemoteProcs(agents, mesh_id, ranks)
    ctl.exit_status = remote.exit_status
    ctl.kill = remote.kill
    # (agents of a version that starts no relays say nothing of them when they attach: none then)
    relays = (len(agents) > 1 and os.environ.get("MESHARRAY_RELAY", "1") != "0"
              and all(a.info.get("relays") for a in agents))
    try:
        for h, (a, rs) in enumerate(zip(agents, ranks)):
            a.send({"op": "spawn", "mesh": mesh_id, "ranks": rs, "controller": f"tcp:{a.local_ip}:{port}",
                    "forward_logs": forward_logs, "sys_path": [p for p in sys.path if p],
                    "data_plane": data_plane, "env": _workspace_env(a, env), "python": python,
                    "workspace": a.workspace is not None, "relay": {"host": h} if relays else None,
                    "preload": list(PRELOAD)})
        ctl.adopt(shape.size, timeout=timeout, progress=progress, check=lambda: remote.check(ctl))
        if relays:
            ctl.adopt_relays([h for h, rs in enumerate(ranks) for _ in rs], timeout=timeout,
                             check=lambda: remote.check(ctl))
        remote.controller = ctl
    except BaseException:
        ctl.stop(timeout=0.5)
        remote.release()
        raise
    return Launch(ctl, shape, remote.release, None)


def _workspace_env(agent: AgentClient, env: dict | None) -> dict:
    """``env`` plus, for an agent with a synced workspace, where the copy is and what it copies."""
    out = dict(env or {})
    if agent.workspace is not None and agent.workspace_source is not None:
        out.setdefault("MESHARRAY_WORKSPACE", agent.workspace)
        out.setdefault("MESHARRAY_WORKSPACE_SOURCE", agent.workspace_source)
    return out


def sync_workspace(agents: list[AgentClient], root: str, timeout: float = 300.0) -> dict[str, dict[str, int]]:
    """Copy the tree at ``root`` to every agent (in parallel); what each copied: ``{host_id: {...}}``.

    Each agent answers which files differ from its copy (and deletes what the
    tree no longer has); only those are sent, in chunks of
    :data:`~.workspace.CHUNK` bytes. Per host: ``files`` (in the tree),
    ``copied``, ``bytes`` and ``deleted``. Raises :class:`BootstrapError`
    naming the host and the file when a copy fails.
    """
    files = scan(root)
    manifest = {rel: list(entry) for rel, (entry, _) in files.items()}
    deadline = time.monotonic() + timeout
    results: list[Any] = [None] * len(agents)

    def one(i: int) -> None:
        a = agents[i]
        try:
            plan = a.request({"op": "sync", "files": manifest}, max(deadline - time.monotonic(), 1.0))
            if not plan.get("ok"):
                raise BootstrapError(f"workspace sync failed: {plan.get('error')}")
            sent = 0
            for rel in plan["need"]:
                (size, executable, sha), path = files[rel]
                with open(path, "rb") as f:
                    offset = 0
                    while True:
                        data = f.read(CHUNK)
                        last = offset + len(data) >= size or not data
                        a.send({"op": "sync_put", "rel": rel, "offset": offset, "data": data, "last": last,
                                "executable": executable, "sha": sha})
                        offset += len(data)
                        if last:
                            break
                sent += offset
            done = a.request({"op": "sync_done"}, max(deadline - time.monotonic(), 1.0))
            if not done.get("ok"):
                raise BootstrapError(f"workspace sync failed: {done.get('error')}")
            a.workspace, a.workspace_source = str(done["path"]), root
            results[i] = {"files": len(files), "copied": len(plan["need"]), "bytes": sent,
                          "deleted": int(plan.get("deleted", 0))}
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,), name="mesharray-sync", daemon=True)
               for i in range(len(agents))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return {a.host_id: r for a, r in zip(agents, results)}
