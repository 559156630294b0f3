"""The worker side of ``ma.spmd.run``: one :class:`ScriptRank` actor per process runs the script.

:meth:`ScriptRank.run` hands the script to the worker process's main thread
(:func:`~mesharray.runtime.worker.run_on_main_thread`) and awaits it from the
worker's event loop, so the connections' reader threads stay free: the
controller can still stop the worker while the script is blocked in a
collective. On the main thread :func:`run_script` does what ``python
script.py`` would do in a fresh process, then undoes it:

- the environment gets the run's variables (``RANK``, ``WORLD_SIZE``, ...;
  a value of None removes a variable), ``sys.argv`` is ``[script, *args]``,
  the script's directory goes first on ``sys.path``, the working directory
  stays the worker's;
- torch.distributed process groups this process already has (the mesh's own
  collectives, ``collective="torch"``) are set aside, so the script's
  ``init_process_group`` starts from nothing, and put back afterwards; what the
  script left initialised is destroyed;
- the script runs as ``__main__`` (:func:`runpy.run_path`); ``sys.exit(n)``
  gives the exit code, as the interpreter would (``sys.exit("text")`` prints
  the text and gives 1); an exception propagates, its traceback cut to the
  script's frames;
- afterwards the environment, ``sys.argv``, ``sys.path``, the working
  directory, ``__main__``, signal handlers, the root logger's handlers and
  level, torch's thread count and process groups are as before, and the
  modules the script imported from its own directory are forgotten (a next
  run imports them afresh; packages imported before the run stay whole).
"""

from __future__ import annotations

import asyncio
import logging
import os
import runpy
import signal
import socket
import stat
import struct
import sys
import time
from types import TracebackType
from typing import Any

from ..actor import Actor, endpoint
from ..runtime.worker import run_on_main_thread

__all__ = ["ScriptRank", "run_script", "find_script"]


def find_script(path: str) -> str:
    """Where the script the controller calls ``path`` (absolute) is on this host.

    In the copy of a synced workspace first (``MESHARRAY_WORKSPACE_SOURCE`` is
    the controller's tree, ``MESHARRAY_WORKSPACE`` this host's copy of it,
    both set in the processes a host agent spawns after ``sync_workspace``),
    else at the same path. ``FileNotFoundError`` names the host and every
    place looked at.
    """
    tried = []
    source, copy = os.environ.get("MESHARRAY_WORKSPACE_SOURCE"), os.environ.get("MESHARRAY_WORKSPACE")
    if source and copy:
        rel = os.path.relpath(path, source)
        if rel != os.pardir and not rel.startswith(os.pardir + os.sep):
            there = os.path.join(copy, rel)
            if os.path.isfile(there):
                return there
            tried.append(there)
    if os.path.isfile(path):
        return path
    tried.append(path)
    raise FileNotFoundError(f"script not found on host {socket.gethostname()}: looked at {', '.join(tried)}")


def exit_status(exc: SystemExit) -> int:
    """The status ``python script.py`` exits with after ``exc``."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr, flush=True)  # sys.exit("message"): printed, status 1
    return 1


def _script_frames(tb: TracebackType | None, path: str) -> TracebackType | None:
    """``tb`` from the script's first frame on (runpy's and ours left out), as ``python script.py`` shows it."""
    t = tb
    while t is not None and t.tb_frame.f_code.co_filename != path:
        t = t.tb_next
    return t if t is not None else tb


class _ProcessGroups:
    """torch.distributed's state of this process, set aside while a script runs and put back after.

    torch keeps it in ``distributed_c10d``: the default group, the groups'
    tables and a C++ registry of group names. A script's ``init_process_group``
    refuses to run while a default group exists, so the mesh's own (its
    ``collective="torch"`` reductions) is hidden: the tables are emptied and
    the names unregistered, then restored. Only when torch.distributed is
    already imported: a script that imports it first finds it fresh anyway.
    """

    _TABLES = ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag", "tags_to_pg",
               "pg_coalesce_state")

    def __init__(self) -> None:
        self.saved: dict[str, Any] | None = None
        c10d: Any = sys.modules.get("torch.distributed.distributed_c10d")
        if c10d is None or not c10d.is_initialized():
            return
        world = c10d._world
        self.saved = {name: dict(getattr(world, name)) for name in self._TABLES}
        self.saved["tags_to_pg"] = {k: list(v) for k, v in self.saved["tags_to_pg"].items()}
        self.saved["default_pg"] = world.default_pg
        self.saved["group_count"] = world.group_count
        self.saved["init_method"] = c10d._default_pg_init_method
        for name in self.saved["pg_names"].values():
            c10d._unregister_process_group(name)
        for name in self._TABLES:
            getattr(world, name).clear()
        c10d._update_default_pg(None)
        world.group_count = 0
        c10d._default_pg_init_method = None

    def restore(self) -> None:
        c10d: Any = sys.modules.get("torch.distributed.distributed_c10d")
        if c10d is None:
            return
        if c10d.is_initialized():  # the script did not destroy its groups: as a process exit would
            c10d.destroy_process_group()
        saved = self.saved
        if saved is None:
            return
        world = c10d._world
        for name in self._TABLES:
            getattr(world, name).update(saved[name])
        c10d._update_default_pg(saved["default_pg"])
        world.group_count = saved["group_count"]
        c10d._default_pg_init_method = saved["init_method"]
        for pg, name in saved["pg_names"].items():
            c10d._register_process_group(name, pg)


class _Saved:
    """What a script may change in its process, taken before it runs (:meth:`restore` puts it back)."""

    def __init__(self) -> None:
        self.environ = dict(os.environ)
        self.argv = list(sys.argv)
        self.path = list(sys.path)
        self.cwd = os.getcwd()
        self.main = sys.modules.get("__main__")
        self.modules = set(sys.modules)
        self.signals = {}
        for s in signal.valid_signals():
            try:
                self.signals[s] = signal.getsignal(s)
            except (OSError, ValueError):
                pass
        root = logging.getLogger()
        self.log_handlers, self.log_level = list(root.handlers), root.level
        torch = sys.modules.get("torch")
        self.threads = torch.get_num_threads() if torch is not None else None

    def restore(self, script_dir: str) -> None:
        for s, h in self.signals.items():
            try:
                if signal.getsignal(s) is not h and h is not None:
                    signal.signal(s, h)
            except (OSError, ValueError):
                pass
        root = logging.getLogger()
        root.handlers[:] = self.log_handlers
        root.setLevel(self.log_level)
        torch = sys.modules.get("torch")
        if torch is not None and self.threads is not None:
            torch.set_num_threads(self.threads)
        os.chdir(self.cwd)
        os.environ.clear()
        os.environ.update(self.environ)
        sys.argv[:] = self.argv
        sys.path[:] = self.path
        if self.main is not None:
            sys.modules["__main__"] = self.main
        # the script's own modules (a package imported before the run, mesharray's, stays whole)
        prefix = os.path.join(script_dir, "")
        before = {m.partition(".")[0] for m in self.modules}
        for name in set(sys.modules) - self.modules:
            f = getattr(sys.modules.get(name), "__file__", None)
            if (name.partition(".")[0] not in before and isinstance(f, str)
                    and os.path.abspath(f).startswith(prefix)):
                del sys.modules[name]


def run_script(path: str, args: list[str], env: dict[str, str | None]) -> int:
    """Run the script at ``path`` (on this host) as ``__main__``, with ``env``; its exit code.

    On this process's main thread (see the module's docstring for what is
    set and restored). An exception of the script propagates.
    """
    script_dir = os.path.dirname(path)
    saved = _Saved()
    groups = _ProcessGroups()
    try:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        torch = sys.modules.get("torch")
        threads = env.get("OMP_NUM_THREADS")
        if torch is not None and threads and threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))  # (torch read OMP_NUM_THREADS when this process imported it)
        sys.argv[:] = [path, *args]
        sys.path.insert(0, script_dir)
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as exc:
            return exit_status(exc)
        return 0
    finally:
        _drain_output()
        try:
            groups.restore()
        finally:
            saved.restore(script_dir)


def _drain_output(timeout: float = 1.0) -> None:
    """Flush the script's output and wait (at most ``timeout``) until the log forwarder read it from its pipes.

    The run's reply travels on another connection than the output: without
    this, a controller that stops the mesh on the reply could stop the
    worker before its last lines left (``FIONREAD`` on fds 1 and 2, when they
    are the forwarder's pipes).
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    try:
        import fcntl
        import termios
    except ImportError:  # pragma: no cover - not POSIX
        return
    deadline = time.monotonic() + timeout
    for fd in (1, 2):
        try:
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                continue
            while struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0] \
                    and time.monotonic() < deadline:
                time.sleep(0.001)
        except OSError:
            continue


class ScriptRank(Actor):
    """One rank of an SPMD run (spawned by ``ma.spmd.run`` as ``__mesharray_spmd__``)."""

    @endpoint
    def rendezvous(self, many_hosts: bool, port: int | None) -> tuple[str, int]:
        """``(MASTER_ADDR, MASTER_PORT)`` for a run whose rank 0 is this process.

        The address other hosts reach this one at (``MESHARRAY_BUFFER_HOST``,
        set by its agent; else the hostname's address) when the run spans
        several hosts, else the loopback address; the port is ``port`` or one
        free here now.
        """
        if many_hosts:
            addr = os.environ.get("MESHARRAY_BUFFER_HOST") or socket.gethostbyname(socket.gethostname())
        else:
            addr = "127.0.0.1"
        if port is None:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("", 0))
                port = int(s.getsockname()[1])
        return addr, port

    @endpoint
    async def run(self, path: str, args: list[str], env: dict[str, str | None]) -> int:
        """Run the script on this process's main thread (:func:`run_script`); its exit code.

        ``path`` is the controller's (absolute): :func:`find_script` says where
        it is here. An exception of the script is raised here with its
        traceback from the script's first frame on.
        """
        found = os.path.abspath(find_script(path))
        fut = run_on_main_thread(lambda: run_script(found, args, env))
        try:
            return await asyncio.wrap_future(fut)
        except BaseException as exc:
            exc.__traceback__ = _script_frames(exc.__traceback__, found)
            raise

