"""The controller side of ``ma.spmd.run``: torchrun's environment per rank, the run, its end.

Layout (what torchrun calls the worker group): the ranks of the mesh are
grouped by host (:attr:`~mesharray.ProcMesh.host_ids`; hosts in the order
their first process comes in the mesh). ``GROUP_RANK`` is the host's index,
``LOCAL_RANK`` the process's index on its host, ``LOCAL_WORLD_SIZE`` the
host's number of processes, and ``RANK`` counts host by host, so that a
host's ranks are contiguous as torchrun's are (for a ``{hosts, procs}``
mesh it is the position in the mesh). ``MASTER_ADDR``/``MASTER_PORT`` are
where rank 0's process can listen (:meth:`~.rank.ScriptRank.rendezvous`):
the loopback address when every rank is on one host, else the address its
agent advertises; a port free there. The script's ``init_process_group``
(``env://``) then makes rank 0 host the store, as under torchrun's static
rendezvous without an agent store (``TORCHELASTIC_USE_AGENT_STORE=False``).

The run: one :class:`~.rank.ScriptRank` actor per process
(``__mesharray_spmd__``), one ``run`` call per rank with that rank's
variables, the replies awaited as they come. When a rank fails (an
exception, a non-zero exit status, its process gone) the others get
:data:`GRACE` seconds to end by themselves (a bug that hits every rank ends
them all); then the root mesh is stopped, which ends the ranks still
running: their workers leave their scripts behind and exit.
"""

from __future__ import annotations

import os
import queue
import signal
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..array import MeshArray
from ..errors import ActorDiedError, ActorError
from ..proc import ProcMesh
from .rank import ScriptRank

__all__ = ["run", "layout", "torchrun_env", "Outcome", "run_outcome", "GRACE", "ENDED"]

#: seconds the other ranks get to end by themselves after one failed, before they are ended
GRACE = 1.0

#: the exit code reported for a rank ended because another failed (torchrun's SIGTERM)
ENDED = -int(signal.SIGTERM)


def layout(host_ids: Sequence[str]) -> list[tuple[int, int, int, int]]:
    """``(RANK, LOCAL_RANK, GROUP_RANK, LOCAL_WORLD_SIZE)`` of each process, given its host, in mesh order.

    >>> layout(["a", "a", "b", "b"])
    [(0, 0, 0, 2), (1, 1, 0, 2), (2, 0, 1, 2), (3, 1, 1, 2)]
    >>> layout(["b", "a", "b"])   # a host's ranks are contiguous, hosts in order of first appearance
    [(0, 0, 0, 2), (2, 0, 1, 1), (1, 1, 0, 2)]
    """
    groups: dict[str, list[int]] = {}
    for pos, h in enumerate(host_ids):
        groups.setdefault(h, []).append(pos)
    out: list[tuple[int, int, int, int]] = [(0, 0, 0, 0)] * len(host_ids)
    rank = 0
    for group_rank, members in enumerate(groups.values()):
        for local_rank, pos in enumerate(members):
            out[pos] = (rank, local_rank, group_rank, len(members))
            rank += 1
    return out


def torchrun_env(rank: int, local_rank: int, group_rank: int, local_world_size: int, world_size: int,
                 group_world_size: int, master_addr: str, master_port: int, run_id: str,
                 role: str = "default") -> dict[str, str | None]:
    """The variables torchrun gives one worker process (None: removed from its environment).

    ``OMP_NUM_THREADS`` as torchrun sets it: this (the controller's) process's value when it
    has one, else ``1`` when a host runs several processes, else none.

    >>> env = torchrun_env(1, 1, 0, 2, 2, 1, "127.0.0.1", 29500, "r")
    >>> env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]
    ('1', '1', '2', '29500')
    """
    omp = os.environ.get("OMP_NUM_THREADS") or ("1" if local_world_size > 1 else None)
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "GROUP_RANK": str(group_rank),
        "ROLE_RANK": str(rank),
        "ROLE_NAME": role,
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "WORLD_SIZE": str(world_size),
        "GROUP_WORLD_SIZE": str(group_world_size),
        "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "OMP_NUM_THREADS": omp,
    }


class Outcome:
    """How a run ended, rank by rank (in the mesh's row-major order).

    Attributes
    ----------
    codes : list of int or None
        Exit codes: 0, the ``sys.exit`` code, the status of a process that
        exited on its own (``-N`` for signal N), :data:`ENDED` for a rank
        ended because another failed; None for a rank that raised.
    errors : dict
        Position -> the exception a rank raised (:class:`~mesharray.ActorError`),
        or the infrastructure error that ended it.
    first : int or None
        Position of the first rank that failed (None: every rank exited 0).
    labels : list of str
        Each rank's label (its coordinates, as its output is prefixed).
    ranks : list of int
        Each one's ``RANK``.
    stopped : bool
        The mesh was stopped (a rank was ended, or a process is gone).
    """

    def __init__(self, labels: list[str], ranks: list[int]) -> None:
        n = len(labels)
        self.ranks = ranks
        self.codes: list[int | None] = [None] * n
        self.errors: dict[int, BaseException] = {}
        self.first: int | None = None
        self.labels = labels
        self.stopped = False

    @property
    def ok(self) -> bool:
        """Every rank exited 0."""
        return self.first is None

    def status(self) -> int:
        """A process exit status for the whole run: 0, or what the first failing rank's says (1 for an exception)."""
        if self.first is None:
            return 0
        code = self.codes[self.first]
        if code is None or code == 0:
            return 1
        if code < 0:
            return 128 - code  # killed by signal N: 128 + N, as a shell says
        return code if code < 256 else 1


def _labels(procs: ProcMesh) -> list[str]:
    shape = procs.mesh_shape
    sizes = shape.extent
    shown = [k for k in shape.names if sizes[k] > 1] or list(shape.names[-1:])
    out = []
    for r in shape:
        c = shape.coordinates(r)
        out.append(",".join(f"{k}={c[k]}" for k in shown) if shown else f"rank={r}")
    return out


def _check_args(script: Any, args: Any, env: Any) -> tuple[str, list[str], dict[str, str]]:
    if not isinstance(script, (str, os.PathLike)):
        raise TypeError(f"script must be a path (str), got {type(script).__name__}")
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise TypeError(f"args must be a sequence of str (the script's sys.argv[1:]), got {type(args).__name__}")
    bad = [a for a in args if not isinstance(a, str)]
    if bad:
        raise TypeError(f"args must be str, got {bad[0]!r} ({type(bad[0]).__name__})")
    if env is None:
        env = {}
    if not isinstance(env, dict) or any(not isinstance(k, str) or not isinstance(v, str) for k, v in env.items()):
        raise TypeError(f"env must be a dict of str to str, got {env!r}")
    bad_names = [k for k in env if not k or "=" in k or "\0" in k or "\0" in env[k]]
    if bad_names:
        raise ValueError(f"env: {bad_names[0]!r} is not a valid environment variable name (or its value holds a NUL)")
    return os.path.abspath(os.fspath(script)), list(args), dict(env)


def _tell(done: queue.Queue[int], pos: int) -> Any:
    """A done-callback that puts ``pos`` in ``done``."""
    return lambda _fut: done.put(pos)


def run_outcome(procs: ProcMesh, script: str, args: Sequence[str] = (), env: dict[str, str] | None = None) -> Outcome:
    """Run ``script`` on every process of ``procs`` (see :func:`run`); how each rank ended, nothing raised for them.

    What ``python -m mesharray torchrun`` uses; infrastructure errors before
    the run (a stopped mesh, a worker that cannot run scripts) still raise.
    """
    if not isinstance(procs, ProcMesh):
        raise TypeError(f"spmd.run needs a ProcMesh, got {type(procs).__name__}")
    path, argv, user_env = _check_args(script, args, env)
    procs.check_live()
    labels = _labels(procs)
    lay = layout(procs.host_ids)
    n = len(lay)
    if n == 0:
        raise ValueError(f"spmd.run needs at least one process; {procs!r} has none")
    groups = max((g for _, _, g, _ in lay), default=-1) + 1
    actors = procs.spawn("__mesharray_spmd__", ScriptRank).flatten("rank")
    first = next(pos for pos, t in enumerate(lay) if t[0] == 0)
    port = user_env.get("MASTER_PORT")
    addr, master_port = actors[first].rendezvous.call_one(groups > 1, int(port) if port else None).get(timeout=60)
    run_id = str(uuid.uuid4())
    done: queue.Queue[int] = queue.Queue()
    futs = []
    for pos, (rank, local_rank, group_rank, lws) in enumerate(lay):
        e = torchrun_env(rank, local_rank, group_rank, lws, n, groups, addr, master_port, run_id)
        e.update(user_env)
        fut = actors[pos].run.call_one(path, argv, e)
        fut.add_done_callback(_tell(done, pos))
        futs.append(fut)
    out = Outcome(labels, [t[0] for t in lay])
    left = set(range(n))
    died = False
    failed_at = 0.0
    try:
        while left:
            if out.first is None:
                pos = done.get()
            else:
                try:
                    pos = done.get(timeout=max(0.0, failed_at + GRACE - time.monotonic()))
                except queue.Empty:
                    break
            left.discard(pos)
            try:
                code = futs[pos].get()
            except ActorError as exc:
                out.errors[pos] = exc
                failed = True
            except ActorDiedError as exc:  # its process is gone: the mesh is stopped at the end
                died = True
                if exc.exitcode is not None or exc.signal is not None:
                    out.codes[pos] = exc.exitcode if exc.exitcode is not None else -int(exc.signal or 0)
                failed = out.codes[pos] != 0  # (os._exit(0) ended the script as a success would)
                if failed:
                    out.errors[pos] = exc
            else:
                out.codes[pos] = int(code)
                failed = code != 0
            if failed and out.first is None:
                out.first, failed_at = pos, time.monotonic()
    except BaseException:  # Ctrl-C (or anything else here): every rank ends, as under torchrun
        procs.stop()
        out.stopped = True
        raise
    if left or died:
        for pos in left:
            out.codes[pos] = ENDED
        procs.stop()
        out.stopped = True
    else:
        actors.stop()
    return out


def run(procs: ProcMesh, script: str, args: Sequence[str] = (), env: dict[str, str] | None = None) -> MeshArray:
    """Run an existing SPMD script (written for ``torchrun``) on every process of ``procs``, as ``__main__``.

    Each process runs the script on its main thread with ``sys.argv ==
    [script, *args]`` and torchrun's variables in its environment: ``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (the
    index of its host), ``ROLE_RANK``, ``ROLE_WORLD_SIZE``, ``ROLE_NAME``,
    ``GROUP_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` (where rank 0
    listens, reachable from every host), ``TORCHELASTIC_RUN_ID``,
    ``TORCHELASTIC_RESTART_COUNT``/``MAX_RESTARTS`` (0),
    ``TORCHELASTIC_USE_AGENT_STORE`` (False: rank 0 hosts the store) and
    ``OMP_NUM_THREADS`` as torchrun sets it (this controller's value, else 1 when
    a host runs several ranks); ``env`` is applied last. So
    ``init_process_group("gloo")`` with its ``env://`` defaults works, whatever
    the mesh uses for its own collectives (torch.distributed groups it already
    has are set aside while the script runs). Ranks are grouped by host,
    a host's ranks contiguous (see :mod:`mesharray.spmd.launch`).

    The script is found on each host in the copy of a synced workspace
    (``hosts.sync_workspace(root)`` before ``spawn_procs``: ``root/x/s.py``
    is run from the host's copy of ``x/s.py``), else at the same (absolute)
    path. Its output reaches this process rank-prefixed, aggregated like
    actors' output.

    Parameters
    ----------
    procs : ProcMesh
        Where to run (local, on host agents, of any job; a view runs on its processes).
    script : str
        The script's path here (relative to this process's working directory).
    args : sequence of str
        The script's arguments.
    env : dict of str to str, optional
        More environment variables (they win over torchrun's).

    Returns
    -------
    MeshArray
        The exit codes, with ``procs``' dims: 0, or the ``sys.exit`` code; the
        status of a process that exited on its own (``os._exit(n)``: n; ``-N``
        for signal N); :data:`ENDED` (-15) for a rank ended because another
        failed.

    Raises
    ------
    ActorError
        A rank raised: the first one's exception (``e.exception``, with its
        remote traceback), after the others ended.
    ActorDiedError, MeshStoppedError
        A rank was lost without an exit status (its host vanished), or the mesh was stopped.

    Notes
    -----
    After a run where every rank ended by itself, the mesh stays usable and
    each process's environment, ``sys.argv``, working directory,
    ``__main__``, torch process groups (and signal handlers, logging) are as
    before. After a failure, the ranks still running get :data:`GRACE`
    seconds, then are ended with the whole mesh, which is stopped (a rank
    blocked in a collective can only be killed); so is a mesh that lost a
    process. Ctrl-C ends every rank (the mesh is stopped) and raises
    ``KeyboardInterrupt``. Workers that do not own their processes (rank 0
    of an MPI world runs in the controller's) cannot run scripts:
    ``ActorError`` (``RuntimeError``).

    Examples
    --------
    >>> procs = ma.proc_mesh(procs=2)                                          # doctest: +SKIP
    >>> ma.spmd.run(procs, "examples/ddp_train.py", args=["--steps", "20"])   # doctest: +SKIP
    MeshArray(hosts=1, procs=2, dtype=int64)
    [[0 0]]
    """
    out = run_outcome(procs, script, args, env)
    for pos in sorted(out.errors, key=lambda p: p != out.first):
        exc = out.errors[pos]
        if isinstance(exc, ActorError) or out.codes[pos] is None:
            raise exc
    codes = np.array([ENDED if c is None else c for c in out.codes], dtype=np.int64)
    return MeshArray(codes.reshape(procs.shape), mesh_shape=procs.mesh_shape)
