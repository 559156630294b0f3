"""The ``local`` bootstrap: worker processes on this host, forked from a zygote.

Starting a Python process that imports NumPy costs far more CPU than a fork,
and a mesh starts many on a few cores. So the controller starts **one** clean
process, the *zygote* (``python -c ...`` with the controller's ``sys.path``),
which imports the worker's modules once and then ``fork()``\\s one worker per
rank on request: a fork shares the imported modules copy-on-write. The
controller itself is never forked (it has threads).

The zygote runs in a session of its own, and so do the workers it forks: a
Ctrl-C at the controller's terminal interrupts the controller only.
The zygote is single-threaded. It reads commands from its stdin (the job
secret travels there, never on argv), reports ``(mesh, rank, pid)`` after each
fork and ``(mesh, rank, pid, status)`` when it reaps a worker (``SIGCHLD``
through a wake-up fd) on a separate pipe. When its stdin closes (the
controller stopped or died) it kills its workers and exits; each worker also
has ``PR_SET_PDEATHSIG`` on the zygote and exits on EOF of its controller
connection, so no process outlives its controller.

One zygote may serve several meshes, one after the other or at once
(:class:`Zygote`): each mesh is declared with its own settings (controller,
job secret, listening kind) and its processes are forked for it and killed
when it is closed, while the zygote itself lives on. A local mesh owns its
zygote; a host agent keeps one per interpreter, environment, working
directory and path (:mod:`.agent`), so that a mesh started there costs forks,
not an interpreter's start and imports. A mesh that spans hosts also gets a
*relay* (:mod:`mesharray.runtime.relay`), forked before its workers, whose
address the workers are given.
"""

from __future__ import annotations

import importlib
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import time

from .._core import Shape
from ..errors import BootstrapError
from ..runtime.controller import Controller
from ..transport.sockio import read_exactly
from .launch import Launch, wait_exit_status

__all__ = ["LocalBootstrap", "Zygote", "PRELOAD", "start_local", "user_paths", "zygote_env"]

_LEN = struct.Struct("<I")

#: modules a zygote imports before it forks, besides the worker's own: the layers above name
#: theirs (``mesharray.darray`` its worker side), so that the workers share them instead of
#: each importing them at its first distributed-array operation
PRELOAD: list[str] = []

#: seconds a zygote waits for a relay it forked to say its address (it connects to its
#: controller first); past that the mesh's workers on this host start without it
RELAY_START_TIMEOUT = 30.0


def _write_msg(fd: int, obj) -> None:
    data = pickle.dumps(obj)
    os.write(fd, _LEN.pack(len(data)) + data)


def _read_msg(fd: int):
    (n,) = _LEN.unpack(read_exactly(fd, 4))
    return pickle.loads(read_exactly(fd, n))


def user_paths(paths: list[str]) -> list[str]:
    """The entries of ``paths`` (a ``sys.path``) that are not an interpreter's own.

    What workers of *another* interpreter (``python=``) still need from the
    controller's path: the script's directory, ``PYTHONPATH`` entries, a
    source checkout; not the standard library nor a ``site-packages``, whose
    compiled modules belong to this interpreter.

    >>> user_paths(["/home/u/proj", "/opt/py/lib/python311.zip", "/v/lib/python3.11/site-packages", ""])
    ['/home/u/proj']
    """
    import sysconfig

    own = {os.path.normpath(p) for p in (sysconfig.get_paths().values()) if p}
    own |= {os.path.normpath(os.path.join(b, "lib")) for b in (sys.prefix, sys.base_prefix)}
    out = []
    for p in paths:
        if not p or p.endswith(".zip") or os.path.basename(p) in ("site-packages", "dist-packages", "lib-dynload"):
            continue
        n = os.path.normpath(p)
        if any(n == o or n.startswith(o + os.sep) for o in own):
            continue
        out.append(p)
    return out


def zygote_env(nprocs: int, env: dict | None = None) -> dict:
    """The environment variables a zygote for ``nprocs`` workers sets over this process's (``env`` last)."""
    out = {}
    if "OMP_NUM_THREADS" not in os.environ:
        # as torchrun does: the workers of a host share its cores. Left to their
        # defaults, N workers each start a pool of all-the-cores threads that spin
        # against each other, and a tiny torch step waits for all of them
        out["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(1, nprocs)))
    out.update(env or {})
    return out


class Zygote:
    """A zygote process (see the module docstring): it forks the processes of the meshes declared to it.

    ``python``: its interpreter (default this one's); ``env``: variables set over
    this process's environment (:func:`zygote_env`); ``cwd``: its (and its
    workers') directory; ``sys_path``: its ``sys.path`` (default this
    process's; ``[]`` with another interpreter: that one's own), with
    ``sys_path_first`` in front; ``preload``: modules it imports before it forks
    (default :data:`PRELOAD`).
    """

    def __init__(self, python: str | None = None, env: dict | None = None, cwd: str | None = None,
                 sys_path: list[str] | None = None, sys_path_first: list[str] | None = None,
                 preload: list[str] | None = None) -> None:
        self.meshes: dict[str, LocalBootstrap] = {}
        self.gone = False
        self._lock = threading.Lock()
        r, w = os.pipe()
        cmd = [python or sys.executable, "-c",
               "from mesharray.bootstrap.local import _zygote_main; _zygote_main()", str(w)]
        zenv = dict(os.environ)
        zenv.pop("PYTHONSTARTUP", None)
        zenv.update(env or {})
        try:
            # a session of its own: a Ctrl-C typed at the controller's terminal (or a kernel
            # interrupt, sent to the kernel's process group) reaches the controller only
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, pass_fds=(w,), env=zenv, close_fds=True,
                                         cwd=cwd, start_new_session=True)
        except OSError as exc:
            os.close(r)
            raise BootstrapError(f"could not start the zygote with {cmd[0]!r}: {exc}") from exc
        finally:
            os.close(w)
        self._report_fd = r
        if python is not None and sys_path is None:
            sys_path = []  # the other interpreter's own path (and sys_path_first)
        self.send({"sys_path": list(sys.path) if sys_path is None else sys_path,
                   "sys_path_first": list(sys_path_first or ()),
                   "preload": list(PRELOAD if preload is None else preload)})
        self._reader = threading.Thread(target=self._read_reports, name="mesharray-zygote", daemon=True)
        self._reader.start()

    def send(self, obj) -> None:
        data = pickle.dumps(obj)
        assert self.proc.stdin is not None  # Popen(stdin=PIPE)
        with self._lock:
            try:
                self.proc.stdin.write(_LEN.pack(len(data)) + data)
                self.proc.stdin.flush()
            except (OSError, ValueError) as exc:  # (a closed pipe: ValueError)
                raise BootstrapError(f"the zygote (pid {self.proc.pid}) is gone: {exc}") from exc

    def _read_reports(self) -> None:
        fd = self._report_fd
        try:
            while True:
                msg = _read_msg(fd)
                mesh = self.meshes.get(msg[1])
                if mesh is not None:
                    mesh._report((msg[0], *msg[2:]))
        except (EOFError, OSError):
            pass
        finally:
            os.close(fd)
            self.gone = True
            for mesh in list(self.meshes.values()):
                mesh._zygote_ended()

    @property
    def alive(self) -> bool:
        return not self.gone and self.proc.poll() is None

    def close(self, timeout: float = 5.0) -> None:
        """Close the zygote's stdin (it kills what is left of its processes) and reap it."""
        try:
            if self.proc.stdin is not None:
                with self._lock:
                    self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(2.0)


class LocalBootstrap:
    """The processes of one mesh forked by a zygote, as seen from the controller (or a host agent).

    Without ``zygote`` it starts one of its own (``python``, ``env``, ``cwd``,
    ``sys_path``, ``sys_path_first``: see :class:`Zygote`) and closes it with
    the mesh; a host agent passes the zygote it keeps. ``controller`` None: a
    host agent runs this for a remote controller (``address``, ``secret``), and
    ``on_report(msg)`` relays each ``("forked", rank, pid)`` and ``("exit",
    rank, pid, status)`` to it. ``relay``: the settings of the mesh's relay on
    this host (``controller``, ``ranks``, ``host``, ``host_id``), forked before
    the workers (its reports have rank -1).
    """

    def __init__(self, controller, nprocs: int, forward_logs: bool = True, listen: str = "unix", *,
                 address: str | None = None, secret: bytes | None = None, ranks: list[int] | None = None,
                 listen_host: str = "127.0.0.1", data_plane: str | None = None, env: dict | None = None,
                 sys_path: list[str] | None = None, on_report=None, python: str | None = None,
                 cwd: str | None = None, sys_path_first: list[str] | None = None, zygote: Zygote | None = None,
                 mesh: str | None = None, relay: dict | None = None) -> None:
        self.controller = controller
        self.nprocs = nprocs
        self.on_report = on_report
        self.pids: dict[int, int] = {}
        self.status: dict[int, tuple] = {}
        self._cond = threading.Condition()
        self._zygote_gone = False
        self.owns_zygote = zygote is None
        if zygote is None:
            zygote = Zygote(python, zygote_env(nprocs, env), cwd, sys_path, sys_path_first)
        self.zygote = zygote
        self.mesh = mesh or f"mesh-{os.urandom(6).hex()}"
        zygote.meshes[self.mesh] = self
        self.ranks = list(range(nprocs)) if ranks is None else list(ranks)
        cfg = {
            "secret": controller.secret if secret is None else secret,
            "address": controller.address if address is None else address,
            "forward_logs": forward_logs,
            "listen": listen,
            "listen_host": listen_host,
            "data_plane": data_plane,
            "relay": relay,
        }
        try:
            zygote.send(("mesh", self.mesh, cfg))
            zygote.send(("fork", self.mesh, self.ranks))
        except BaseException:
            zygote.meshes.pop(self.mesh, None)
            if self.owns_zygote:
                zygote.close()
            raise
        if controller is not None:
            controller.exit_status = self.exit_status
            controller.kill = self.kill

    @property
    def proc(self) -> subprocess.Popen:
        """The zygote's process."""
        return self.zygote.proc

    def _report(self, msg: tuple) -> None:
        with self._cond:
            if msg[0] == "forked":
                self.pids[msg[1]] = msg[2]
            elif msg[0] == "exit" and self.pids.get(msg[1]) == msg[2]:
                # (the exit of an earlier process of a restarted rank says nothing of the new one)
                self.status[msg[1]] = (msg[2], msg[3])
            self._cond.notify_all()
        if self.on_report is not None:
            self.on_report(msg)

    def _zygote_ended(self) -> None:
        with self._cond:
            self._zygote_gone = True
            self._cond.notify_all()

    def exit_status(self, rank: int, timeout: float):
        """``(exitcode, signal)`` of a dead worker, waiting at most ``timeout`` s."""
        return wait_exit_status(self._cond, self.status, rank, timeout, lambda: self._zygote_gone)

    def restart(self, rank: int) -> None:
        """Fork a new worker for ``rank`` (whose process died); it says hello as that rank."""
        with self._cond:
            if self._zygote_gone:
                raise BootstrapError(f"cannot restart rank {rank}: the zygote is gone")
            self.status.pop(rank, None)
            self.pids.pop(rank, None)
        self.zygote.send(("fork", self.mesh, [rank]))

    def kill(self, rank: int) -> None:
        pid = self.pids.get(rank)
        if pid is not None and rank not in self.status:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def check(self) -> None:
        """Raise :class:`BootstrapError` if the zygote or a worker died while starting."""
        if self.proc.poll() is not None:
            raise BootstrapError(f"the zygote process exited with code {self.proc.returncode} while "
                                 f"starting {self.nprocs} workers")
        with self._cond:
            for rank, st in self.status.items():
                if rank not in self.controller.workers:
                    code = os.waitstatus_to_exitcode(st[1])
                    raise BootstrapError(f"worker rank {rank} (pid {self.pids.get(rank)}) exited with "
                                         f"{'signal ' + str(-code) if code < 0 else 'code ' + str(code)} "
                                         f"before joining")

    def close(self, timeout: float = 5.0) -> None:
        """End the mesh's processes: the zygote kills what is left of them (and is closed, if it is the mesh's own)."""
        if self.owns_zygote:
            self.zygote.close(timeout)
        else:
            try:
                self.zygote.send(("close", self.mesh))
            except BootstrapError:
                pass
            deadline = time.monotonic() + timeout
            with self._cond:
                while (not self._zygote_gone and any(r not in self.status for r in self.pids)
                       and time.monotonic() < deadline):
                    self._cond.wait(0.05)
        self.zygote.meshes.pop(self.mesh, None)


def start_local(controller, nprocs: int, forward_logs: bool = True, timeout: float = 60.0,
                progress: bool = True, env: dict | None = None, python: str | None = None,
                cwd: str | None = None, sys_path_first: list[str] | None = None) -> LocalBootstrap:
    """Fork ``nprocs`` workers and let ``controller`` adopt them (``env``, ``python``: see :func:`launch`)."""
    boot = LocalBootstrap(controller, nprocs, forward_logs=forward_logs, env=env, python=python, cwd=cwd,
                          sys_path_first=sys_path_first)
    try:
        controller.adopt(nprocs, timeout=timeout, progress=progress, check=boot.check)
    except BaseException:
        controller.stop(timeout=0.5)
        boot.close()
        raise
    return boot


def launch(hosts: int, procs: int, *, forward_logs: bool = True, timeout: float = 60.0,
           heartbeat_timeout: float = 5.0, heartbeat_interval: float = 0.5, name: str = "procs",
           kill_unresponsive: bool = False, env: dict | None = None, python: str | None = None,
           cwd: str | None = None, sys_path_first: list[str] | None = None) -> Launch:
    """Start ``hosts * procs`` workers on this host, laid out as ``{hosts, procs}``.

    What ``proc_mesh(bootstrap="local")`` runs; ``hosts > 1`` lays the
    workers out as if they were on several hosts (all on this machine).
    ``env`` is set in every worker's environment; ``python`` is the
    interpreter of the zygote and so of the workers (it keeps its own
    ``sys.path``; ``sys_path_first`` goes in front either way); ``cwd`` is
    the workers' working directory.
    """
    for label, v in (("hosts", hosts), ("procs", procs)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{label} must be an int, got {type(v).__name__}")
        if v < 1:
            raise ValueError(f"{label} must be >= 1, got {v}")
    shape = Shape({"hosts": hosts, "procs": procs})
    ctl = Controller(heartbeat_timeout=heartbeat_timeout, heartbeat_interval=heartbeat_interval, name=name,
                     kill_unresponsive=kill_unresponsive)
    for r in range(shape.size):  # labels before the workers start printing
        c = shape.coordinates(r)
        ctl.labels[r] = f"hosts={c['hosts']},procs={c['procs']}" if hosts > 1 else f"procs={c['procs']}"
    if python is not None:  # its own sys.path, with this script's own directories in front
        sys_path_first = list(sys_path_first or ()) + user_paths(sys.path)
    boot = start_local(ctl, shape.size, forward_logs=forward_logs, timeout=timeout, env=env, python=python, cwd=cwd,
                       sys_path_first=sys_path_first)
    return Launch(ctl, shape, boot.close, boot.restart)


# --------------------------------------------------------------------------- zygote
def _zygote_main() -> None:
    report_fd = int(sys.argv[1])
    stdin_fd = sys.stdin.fileno()
    cfg = _read_msg(stdin_fd)
    path = list(cfg["sys_path"] or sys.path)
    first = [p for p in cfg.get("sys_path_first") or () if p]
    sys.path[:] = first + [p for p in path if p not in first]
    # import once, here, what every worker needs: forks then share it copy-on-write
    import asyncio  # noqa: F401
    import gc
    import selectors

    import cloudpickle  # noqa: F401
    import numpy  # noqa: F401

    from .. import actor  # noqa: F401
    from ..runtime import relay as relay_mod
    from ..runtime import worker as worker_mod

    for name in cfg.get("preload") or ():
        try:
            importlib.import_module(name)
        except Exception:  # (a worker that needs it imports it, and says what is wrong)
            pass

    # Everything imported so far is shared with the forks until someone writes to its pages. A
    # collection in a fork writes to every object it visits (and so copies its page): frozen
    # objects are never visited, so a worker copies only what it really touches.
    gc.collect()
    gc.freeze()
    worker_mod.prepare_process()  # (its forks inherit the workers' scheduling class and settings)

    meshes: dict[str, dict] = {}  # mesh -> its settings
    children: dict[int, tuple[str, int]] = {}  # pid -> (mesh, rank); a relay's rank is -1
    closing: dict[str, float] = {}  # mesh -> when its processes that are left get SIGKILL
    starting: dict[int, list] = {}  # a starting relay's pipe -> [mesh, what it wrote so far, deadline]
    rfd, wfd = os.pipe()
    os.set_blocking(rfd, False)
    os.set_blocking(wfd, False)
    signal.set_wakeup_fd(wfd)
    signal.signal(signal.SIGCHLD, lambda *a: None)
    sel = selectors.DefaultSelector()
    sel.register(stdin_fd, selectors.EVENT_READ, "cmd")
    sel.register(rfd, selectors.EVENT_READ, "chld")

    def report(msg: tuple) -> None:
        try:
            _write_msg(report_fd, msg)
        except OSError:
            pass

    def reap() -> None:
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            got = children.pop(pid, None)
            if got is not None:
                report(("exit", got[0], got[1], pid, status))

    def child(run, *args) -> int:
        pid = os.fork()
        if pid == 0:
            try:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                sel.close()
                for fd in (rfd, wfd, report_fd):
                    os.close(fd)
                devnull = os.open(os.devnull, os.O_RDONLY)
                os.dup2(devnull, stdin_fd)
                os.close(devnull)
                run(*args)
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                os._exit(70)
        return pid

    def run_one(mesh: dict, rank: int) -> None:
        worker_mod.run_worker(mesh["address"], mesh["secret"], rank, listen=mesh["listen"],
                              listen_host=mesh.get("listen_host", "127.0.0.1"), data_plane=mesh.get("data_plane"),
                              forward_logs=mesh["forward_logs"], exit_process=True, relay=mesh.get("relay_address"))

    def run_relay(rcfg: dict, fd: int) -> None:
        relay_mod.run_relay(rcfg, fd)
        os._exit(0)

    def start_relay(name: str, mesh: dict) -> None:
        # Forked now; its address comes back on a pipe that the loop watches with the rest, so a
        # relay slow to reach its controller holds back only its own mesh's forks (queued in
        # "starting" until the address or the deadline), never another mesh's forks or the exits
        r, w = os.pipe()
        rcfg = dict(mesh["relay"], secret=mesh["secret"])
        pid = child(run_relay, rcfg, w)
        os.close(w)
        children[pid] = (name, -1)
        report(("forked", name, -1, pid))
        os.set_blocking(r, False)
        mesh["starting"] = []
        starting[r] = [name, b"", time.monotonic() + RELAY_START_TIMEOUT]
        sel.register(r, selectors.EVENT_READ, "relay")

    def relay_read(r: int) -> None:
        entry = starting[r]
        try:
            chunk = os.read(r, 4096)
        except BlockingIOError:
            return
        entry[1] += chunk
        if chunk and not entry[1].endswith(b"\n"):
            return
        relay_started(r)

    def relay_started(r: int) -> None:
        """The relay on pipe ``r`` wrote its address (or an error, or nothing in time): fork what waited for it."""
        name, line, _ = starting.pop(r)
        sel.unregister(r)
        os.close(r)
        mesh = meshes.get(name)
        if mesh is None:
            return
        text = line.decode(errors="replace").strip()
        if text and not text.startswith("!"):
            mesh["relay_address"] = text
        else:
            report(("error", name, f"the relay of this host did not start: {text[1:] or 'no address given'}"))
        for rank in mesh.pop("starting", ()):
            fork_one(name, mesh, rank)

    def fork_one(name: str, mesh: dict, rank: int) -> None:
        pid = child(run_one, mesh, rank)
        children[pid] = (name, rank)
        report(("forked", name, rank, pid))

    def kill_mesh(name: str) -> None:
        for pid, (m, _) in list(children.items()):
            if m == name:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        closing.pop(name, None)
        meshes.pop(name, None)
        for r, entry in list(starting.items()):
            if entry[0] == name:
                relay_started(r)  # (the mesh is gone: nothing is forked)

    try:
        while True:
            timeout = None
            ends = [*closing.values(), *(e[2] for e in starting.values())]
            if ends:
                timeout = max(0.0, min(ends) - time.monotonic())
            for key, _ in sel.select(timeout):
                if key.data == "relay":
                    if key.fd in starting:
                        relay_read(key.fd)
                elif key.data == "chld":
                    try:
                        while os.read(rfd, 512):
                            pass
                    except BlockingIOError:
                        pass
                    reap()
                else:
                    try:
                        msg = _read_msg(stdin_fd)
                    except EOFError:
                        raise SystemExit from None
                    if msg[0] == "mesh":
                        meshes[msg[1]] = dict(msg[2])
                        if msg[2].get("relay"):
                            start_relay(msg[1], meshes[msg[1]])
                    elif msg[0] == "fork":
                        mesh = meshes.get(msg[1])
                        if mesh is None:
                            pass
                        elif "starting" in mesh:  # (its relay's address first)
                            mesh["starting"].extend(msg[2])
                        else:
                            for rank in msg[2]:
                                fork_one(msg[1], mesh, rank)
                    elif msg[0] == "close":
                        # the controller already asked them to stop: what is left after a grace is killed
                        closing[msg[1]] = time.monotonic() + 0.5
            now = time.monotonic()
            for r in [r for r, e in starting.items() if now >= e[2]]:
                relay_started(r)
            for name, t in list(closing.items()):
                if now >= t or not any(m == name for m, _ in children.values()):
                    kill_mesh(name)
    except SystemExit:
        pass
    # the controller is gone or done: no worker may outlive it
    deadline = time.monotonic() + 0.5  # the controller already waited for them to stop
    while children and time.monotonic() < deadline:
        reap()
        time.sleep(0.01)
    for pid in list(children):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    while children:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        children.pop(pid, None)
    os._exit(0)
