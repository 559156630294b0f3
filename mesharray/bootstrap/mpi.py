"""The MPI bootstrap: the world of an ``mpirun``-launched script as a ProcMesh.

The same script runs unchanged on a laptop and under a launcher::

    mpirun -n 4 python train.py        # Open MPI, MPICH/Intel MPI (mpiexec), srun

This module is what runs inside each rank of such a job; building the
launcher's command line is :mod:`mesharray.bootstrap.mpirun`.

Inside the script, ``ma.proc_mesh()`` returns the MPI world as a :class:`~mesharray.ProcMesh`
over all N ranks. Its global ranks *are* the MPI world ranks. What each rank does:

* **rank 0** runs the user's script as the controller. It also hosts rank 0's
  actors, in a worker that runs in a thread of the controller process.
* **ranks 1..N-1** become workers inside their ``proc_mesh()`` call, which never
  returns: they serve until the controller finishes, then finalize MPI and exit
  with status 0. They never run the user's script past that call (no ``finally``
  block or ``atexit`` handler of the script runs there).

Mesh dimensions come from the topology: ``(hosts, procs)`` from a
``COMM_TYPE_SHARED`` split when every host has the same number of ranks (hosts
ordered by their lowest rank, ranks ascending within a host, so the usual
block-by-host mapping is a plain row-major mesh), else a flat ``(procs,)``.

The handshake, step by step (all MPI traffic of the handshake uses point-to-point
messages on ``COMM_WORLD`` with tags of its own, so a hung rank cannot hold up
the others inside a collective, and the controller can tell exactly which ranks
are missing):

1. every rank other than 0 sends a *join* message (host name, pid) to rank 0;
2. rank 0 waits for N-1 joins, at most ``timeout`` seconds (30 s by default,
   ``MESHARRAY_BOOTSTRAP_TIMEOUT`` or ``proc_mesh(timeout=...)``), then starts
   the runtime's controller listener — a unix socket when every rank is on its
   host, else TCP on this host's address — and sends its address and the job
   secret to every rank (point to point, never on a command line);
3. all ranks then make mesharray's own communicators (a ``Dup`` of the world and
   the shared-memory split), so mesharray's collectives never mix with the
   user's messages on ``COMM_WORLD``;
4. every rank runs the runtime's worker (rank 0 in a thread), which connects to
   the controller and proves it knows the secret; the controller adopts the N
   workers. From here on control traffic uses the runtime's transport, exactly
   as for local meshes.

What users see when things fail
-------------------------------
* **A rank that never joins** (hung, or never calls ``proc_mesh()``): the
  controller raises :class:`~mesharray.BootstrapError` naming the missing ranks
  once the timeout has passed. Left unhandled, it aborts the MPI job
  (``MPI_Abort``) so ``mpirun`` exits non-zero instead of hanging in
  ``MPI_Finalize``. The MPI world cannot be used after a BootstrapError.
* **A rank that joins but cannot connect** to the controller's listener
  (firewall, wrong interface: set ``MESHARRAY_MPI_HOST`` to the address to
  listen on): that worker prints why and exits non-zero, which makes the
  launcher end the whole job; had it stayed, the controller's BootstrapError
  would name it.
* **A rank that dies** (crash, ``os._exit``, signal) is reported by the launcher
  itself. With Open MPI's defaults ``mpirun`` then terminates *every* rank and
  exits non-zero within a second or two ("prterun detected that one or more
  processes exited with non-zero status"), so the controller may be killed
  before it sees anything (it does see it: the controller notices the closed
  connection within milliseconds, mpirun's kill comes a second or two later).
  Under ``mpirun --enable-recovery`` (Open MPI 5) the other ranks keep running
  and the controller sees the death exactly as on a local mesh: pending and
  later calls to actors on that rank fail with
  :class:`~mesharray.ActorDiedError` ("process of rank 2 (pid ...) died
  (connection lost)": the exit status belongs to the launcher, not to us),
  views without that rank keep working, and ``mpirun`` still exits non-zero
  at the end. (With Open MPI 5.0.11 we saw ``--enable-recovery`` keep the
  survivors of 3 or more ranks alive, but still end a 2-rank job.) MPICH's
  ``mpiexec`` behaves like Open MPI's default unless given
  ``-disable-auto-cleanup``.
* **Output**: what ranks 1..N-1 print reaches the terminal through mpirun
  itself (``mpirun --tag-output`` prefixes each line with its rank), not
  through the runtime's log forwarding.
* **An unhandled exception on rank 0** after the bootstrap aborts the job
  (like ``python -m mpi4py``); ``python -m mesharray script.py`` gives the same
  guarantee on every rank, also before the bootstrap.

Collectives
-----------
:func:`mesh_comm` gives code running inside a worker (an actor, the data plane's
MPI backend) a communicator over any set of the mesh's ranks, created once and
cached; :func:`world_comm` is the one over the whole world and
:func:`local_comm` the one over this host's ranks.

>>> from mesharray.bootstrap.mpi import mesh_layout
>>> mesh_layout([0, 0, 2, 2])        # two hosts with two ranks each
(('hosts', 'procs'), (2, 2), (0, 1, 2, 3))
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import socket
import sys
import threading
import time
import traceback
from typing import Any, Iterable, Sequence

from .._core import Shape
from ..collectives import mpi_comms
from ..collectives.mpi_comms import is_active, local_comm, mesh_comm, world_comm, world_rank, world_size
from ..errors import ActorDiedError, BootstrapError
from ..runtime.controller import Controller
from ..runtime.worker import run_worker, set_sched_class, set_spin
from ._detect import detect_launcher
from .launch import Launch
from .mpirun import INSTALL_HINT

__all__ = [
    "DEFAULT_TIMEOUT",
    "abort_world",
    "bootstrap",
    "import_mpi",
    "is_active",
    "local_comm",
    "mesh_comm",
    "mesh_layout",
    "world_comm",
    "world_rank",
    "world_size",
]

#: Seconds the controller waits for every rank to join, unless told otherwise.
DEFAULT_TIMEOUT = 30.0

# Tags of the handshake's point-to-point messages on COMM_WORLD ("ma" = 0x6d61).
# A user's own receive with ANY_TAG from rank 0 racing the bootstrap is the only
# way to steal them, and that would be a bug in the script anyway.
_TAG_JOIN = 0x6D61
_TAG_ADDRESS = 0x6D62

_POLL_S = 0.002

class _State:
    """What the MPI bootstrap left in this process (one per process)."""

    def __init__(self) -> None:
        self.launch: Launch | None = None
        self.worker_thread: threading.Thread | None = None
        self.controller: Any = None


_state: _State | None = None
_state_lock = threading.Lock()


# --------------------------------------------------------------------------- mpi4py


def import_mpi(timeout: float | None = None) -> Any:
    """Import and return ``mpi4py.MPI``, or fail with the extra to install.

    Importing it runs ``MPI_Init``, which waits for every rank of the job. A
    rank that exits before it (with any status) or never gets there would
    leave the others waiting there forever; with ``timeout``, a process still
    inside ``MPI_Init`` after that many seconds says so and exits with status
    1, which ends the job.

    Returns
    -------
    module
        ``mpi4py.MPI`` (importing it initializes MPI).

    Raises
    ------
    BootstrapError
        mpi4py (or the MPI library it was built against) is missing; the
        message names ``pip install 'mesharray[mpi]'`` and the launcher seen.

    Examples
    --------
    >>> from mesharray.bootstrap.mpi import import_mpi
    >>> MPI = import_mpi()      # doctest: +SKIP
    """
    watchdog = timeout is not None and "mpi4py.MPI" not in sys.modules
    if timeout is not None and watchdog:
        # MPI_Init runs inside the import holding the GIL: no Python thread can
        # time it out, but faulthandler's watchdog is a C thread (it dumps where
        # this rank is stuck, then exits with status 1)
        faulthandler.dump_traceback_later(timeout, exit=True)
    try:
        MPI = _mpi_init_waits_for_every_rank_of_the_job()
    except ImportError as exc:
        launcher = detect_launcher()
        where = f" (launched by {launcher.describe()})" if launcher else ""
        raise BootstrapError(
            f"the mpi bootstrap needs mpi4py, which cannot be imported{where}: {exc}; "
            f"install it with: {INSTALL_HINT}"
        ) from exc
    finally:
        if watchdog:
            faulthandler.cancel_dump_traceback_later()
    return MPI


def _mpi_init_waits_for_every_rank_of_the_job() -> Any:
    # Named for what a hung job shows: faulthandler's dump ends in this frame when
    # a rank exited (even with status 0) or never started MPI
    from mpi4py import MPI

    return MPI


# --------------------------------------------------------------------------- topology


def mesh_layout(node_of: Sequence[int]) -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]:
    """Mesh dimensions for a world whose rank ``r`` lives on node ``node_of[r]``.

    Parameters
    ----------
    node_of : sequence of int
        For each world rank, an id of its node (mesharray uses the lowest world
        rank on that node, from a ``COMM_TYPE_SHARED`` split).

    Returns
    -------
    names, sizes, ranks : tuple, tuple, tuple
        ``("hosts", "procs")`` with ``(hosts, ranks per host)`` when every node
        has the same number of ranks, else ``("procs",)``; ``ranks`` lists the
        world ranks in row-major order of the mesh (hosts ordered by their
        lowest rank, ranks ascending within a host).

    Examples
    --------
    >>> from mesharray.bootstrap.mpi import mesh_layout
    >>> mesh_layout([0, 0, 0, 0])
    (('hosts', 'procs'), (1, 4), (0, 1, 2, 3))
    >>> mesh_layout([0, 1, 0, 1])      # round-robin mapping over two hosts
    (('hosts', 'procs'), (2, 2), (0, 2, 1, 3))
    >>> mesh_layout([0, 0, 0, 3])      # uneven hosts: flat
    (('procs',), (4,), (0, 1, 2, 3))
    """
    if len(node_of) == 0:
        raise ValueError("an MPI world has at least one rank; got an empty node list")
    hosts: dict[int, list[int]] = {}
    for rank, node in enumerate(node_of):
        hosts.setdefault(int(node), []).append(rank)
    groups = sorted(hosts.values(), key=lambda ranks: ranks[0])
    per_host = {len(g) for g in groups}
    if len(per_host) == 1:
        return ("hosts", "procs"), (len(groups), len(groups[0])), tuple(r for g in groups for r in g)
    return ("procs",), (len(node_of),), tuple(range(len(node_of)))


def _make_shape(names: tuple[str, ...], sizes: tuple[int, ...], ranks: tuple[int, ...]) -> Shape:
    if ranks == tuple(range(len(ranks))):
        return Shape(dict(zip(names, sizes)))
    import numpy as np

    return Shape.from_ranks(names, sizes, np.asarray(ranks, dtype=np.int64))


# --------------------------------------------------------------------------- bootstrap


def _timeout_from_env(timeout: float | None) -> float:
    if timeout is None:
        raw = os.environ.get("MESHARRAY_BOOTSTRAP_TIMEOUT")
        if raw is None or raw.strip() == "":
            return DEFAULT_TIMEOUT
        try:
            timeout = float(raw)
        except ValueError:
            raise ValueError(
                f"MESHARRAY_BOOTSTRAP_TIMEOUT must be a number of seconds; got {raw!r}"
            ) from None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, not {type(timeout).__name__}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds; got {timeout}")
    return float(timeout)


def _listen_host(hostnames: Iterable[str]) -> str:
    """Where the controller listens: loopback when all ranks share its host.

    Otherwise the address of the interface that routes to another rank's
    host (``gethostbyname(gethostname())`` is often 127.0.1.1 on clusters);
    ``MESHARRAY_MPI_HOST`` overrides both.
    """
    forced = os.environ.get("MESHARRAY_MPI_HOST", "").strip()
    if forced:
        return forced
    me = socket.gethostname()
    others = sorted({h for h in hostnames if h != me})
    if not others:
        return "127.0.0.1"
    for host in others:
        try:
            return _route_ip(socket.gethostbyname(host))
        except OSError:
            continue
    try:
        mine = socket.gethostbyname(me)
    except OSError:
        mine = "127.0.0.1"
    if mine.startswith("127."):
        raise BootstrapError(
            f"cannot find an address of {me!r} that ranks on {others[:4]} can reach "
            f"(their names do not resolve here); set MESHARRAY_MPI_HOST to this host's address"
        )
    return mine


def _fmt_ranks(ranks: Sequence[int]) -> str:
    return "[" + ", ".join(map(str, ranks)) + "]"


def _poll(request: Any, deadline: float | None = None) -> bool:
    """Wait for an MPI request without spinning a core (ranks share cores)."""
    while not request.Test():
        if deadline is not None and time.monotonic() > deadline:
            return False
        time.sleep(_POLL_S)
    return True


def bootstrap(*, hosts: int | None = None, procs: int | None = None,
              timeout: float | None = None, **options: Any) -> Launch:
    """Join the MPI world; return its launch on rank 0, serve on the others.

    This is what ``ma.proc_mesh(bootstrap="mpi")`` (or ``"auto"`` under a
    launcher) runs. On rank 0 it returns the world's
    :class:`~mesharray.bootstrap.launch.Launch`, of which ``proc_mesh`` makes
    the ``ProcMesh`` (the same object on every later call); on every other rank it never
    returns: the process serves as a worker until the controller finishes, then
    finalizes MPI and exits with status 0.

    Parameters
    ----------
    hosts, procs : int, optional
        Expected mesh sizes. Left out, the topology decides; given, they must
        match it (``hosts=1, procs=4`` under ``mpirun -n 4`` on one host).
    timeout : float, optional
        Seconds to wait for every rank to join (default 30, or
        ``$MESHARRAY_BOOTSTRAP_TIMEOUT``).
    **options
        Passed on to the runtime's controller (``heartbeat_timeout``,
        ``heartbeat_interval``, ``name``).

    Returns
    -------
    Launch
        On rank 0 only (the same one on every later call).

    Raises
    ------
    BootstrapError
        mpi4py is missing, or ranks did not join within ``timeout`` (named).
    ValueError
        ``hosts``/``procs`` do not match the world.

    Examples
    --------
    ``mpirun -n 4 python -c "import mesharray as ma; print(ma.proc_mesh().sizes)"``
    prints ``{'hosts': 1, 'procs': 4}`` once (from rank 0).
    """
    global _state
    timeout = _timeout_from_env(timeout)
    for name, value in (("hosts", hosts), ("procs", procs)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, not {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1; got {value}")
    MPI = import_mpi(timeout)
    with _state_lock:
        state = _state
        if state is not None and state.launch is not None:
            _check_sizes(state.launch.shape.extent, hosts, procs)
            return state.launch
        if state is not None:
            raise BootstrapError("the mpi bootstrap already ran in this process and failed")
        if MPI.COMM_WORLD.Get_rank() != 0:
            _serve(MPI, timeout)  # never returns
        # from here on, an exception nobody catches on the controller aborts the job
        # (a size mismatch included): the other ranks are waiting for it
        _abort_on_unhandled(MPI)
        return _bootstrap_controller(MPI, hosts, procs, timeout, options)


def _check_sizes(sizes: dict, hosts: int | None, procs: int | None) -> None:
    want = {}
    if hosts is not None:
        want["hosts"] = hosts
    if procs is not None:
        want["procs"] = procs
    have = dict(sizes)
    flat = have.get("hosts", 1) * have["procs"] if "hosts" in have else have["procs"]
    ok = all(have.get(k, 1 if k == "hosts" else None) == v for k, v in want.items())
    # a flat world also matches hosts=1, procs=N
    if not ok and "hosts" not in have:
        ok = want.get("hosts", 1) == 1 and want.get("procs", flat) == flat
    if not ok:
        asked = ", ".join(f"{k}={v}" for k, v in want.items())
        raise ValueError(
            f"proc_mesh({asked}) does not match the MPI world of {flat} ranks laid out as "
            f"{have}; launch with the matching number of ranks or leave the sizes out"
        )


def _bootstrap_controller(MPI: Any, hosts: int | None, procs: int | None,
                          timeout: float, options: dict) -> Launch:
    global _state
    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    deadline = time.monotonic() + timeout

    # 1. joins, point to point: a hung rank cannot block the others
    joined: dict[int, tuple[str, int]] = {0: (socket.gethostname(), os.getpid())}
    status = MPI.Status()
    while len(joined) < size:
        msg = comm.improbe(source=MPI.ANY_SOURCE, tag=_TAG_JOIN, status=status)
        if msg is not None:
            joined[status.Get_source()] = msg.recv()
            continue
        if time.monotonic() > deadline:
            missing = sorted(set(range(size)) - set(joined))
            _abort_on_unhandled(MPI)
            raise BootstrapError(
                f"ranks {_fmt_ranks(missing)} of the MPI world of {size} did not join the mesh "
                f"within {timeout:g} s (they are hung, or never called proc_mesh()); "
                f"ranks {_fmt_ranks(sorted(joined))} joined"
            )
        time.sleep(_POLL_S)

    # 2. the controller's listener; its address and the secret go to every rank
    host = _listen_host(h for h, _ in joined.values())
    controller = _runtime_controller(host, options)
    # the runtime's per-process job secret: rank 0's worker thread shares it
    secret = controller.secret
    address = controller.address
    payload = {"address": address, "secret": secret}
    requests = [comm.isend(payload, dest=r, tag=_TAG_ADDRESS) for r in range(1, size)]

    # 3. mesharray's communicators (every rank has joined, so this cannot hang
    # on a missing rank)
    node_of = mpi_comms.install(MPI)
    state = _State()
    _state = state

    # 4. rank 0's worker in a thread; adopt all N workers
    state.worker_thread = threading.Thread(
        target=_thread_worker, args=(address, secret), name="mesharray-mpi-worker-0", daemon=True,
    )
    state.worker_thread.start()
    # every rank is known alive and on its way: a join near the deadline
    # still gets a few seconds to connect
    remaining = max(deadline - time.monotonic(), min(timeout, 5.0))
    try:
        _runtime_adopt(controller, size, remaining, joined)
    except BaseException:
        _abort_on_unhandled(MPI)
        raise
    for req in requests:
        _poll(req)

    names, sizes, ranks = mesh_layout(node_of)
    shape = _make_shape(names, sizes, ranks)
    launch = Launch(controller, shape, _join_worker_thread)
    state.launch = launch
    state.controller = controller
    _check_sizes(dict(zip(names, sizes)), hosts, procs)
    # LIFO: runs before mpi4py finalizes MPI, so workers are told to stop first
    atexit.register(_shutdown_controller)
    _abort_on_unhandled(MPI)
    return launch


def _thread_worker(address: str, secret: bytes) -> None:
    try:
        _runtime_run_worker(address, secret, 0)
    except BaseException:  # the controller sees the EOF; say why here
        sys.stderr.write("mesharray: rank 0's worker failed:\n" + traceback.format_exc())


def _shutdown_controller() -> None:
    """Stop the world mesh (its workers serve until then); idempotent.

    If a worker rank died during the job (possible under ``mpirun
    --enable-recovery``), the job is aborted instead: ``MPI_Finalize`` waits on
    every rank of the world and was seen to hang on the dead one. The job's
    status is non-zero either way, since a rank died.
    """
    state = _state
    if state is None or state.launch is None:
        return
    launch = state.launch
    dead = _dead_ranks(state.controller)
    try:
        if launch.mesh is not None:
            launch.mesh.stop()  # the mesh made from the launch stops its root (idempotent)
        else:
            launch.controller.stop()
            launch.close()
    finally:
        mpi_comms.release()
    if dead:
        sys.stderr.write(
            f"mesharray: ranks {_fmt_ranks(dead)} died during the job; aborting the MPI job "
            f"rather than risk MPI_Finalize waiting for them\n"
        )
        abort_world(1)


def _dead_ranks(controller: Any) -> list[int]:
    workers = getattr(controller, "workers", {}) if controller is not None else {}
    return sorted(r for r, info in workers.items() if isinstance(info.error, ActorDiedError))


def _serve(MPI: Any, timeout: float) -> None:
    """Ranks 1..N-1: join, get the controller's address, serve, finalize, exit.

    A rank that has joined waits for the controller's address at most twice
    the bootstrap timeout (the controller waits ``timeout`` for the other
    joins): past that the controller is gone or hung, and the rank exits
    with status 1, which ends the job.
    """
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    code = 0
    try:
        comm.send((socket.gethostname(), os.getpid()), dest=0, tag=_TAG_JOIN)
        req = comm.irecv(source=0, tag=_TAG_ADDRESS)
        deadline = time.monotonic() + 2 * timeout + 5.0
        while True:
            done, payload = req.test()
            if done:
                break
            if time.monotonic() > deadline:
                raise BootstrapError(
                    f"rank {rank} joined the mesh but rank 0 (the controller) did not answer within "
                    f"{2 * timeout + 5.0:g} s; it is hung or gone")
            time.sleep(_POLL_S)
        mpi_comms.install(MPI)
        set_sched_class()  # (this rank's process is a worker and nothing else: rank 0's is the controller)
        set_spin()
        _runtime_run_worker(payload["address"], payload["secret"], rank)
    except KeyboardInterrupt:
        # Ctrl-C reaches every rank through mpirun; rank 0 reports it
        code = 130
    except BaseException:
        sys.stderr.write(f"mesharray: rank {rank}'s worker failed:\n" + traceback.format_exc())
        code = 1
    _exit_worker(MPI, code)


def _exit_worker(MPI: Any, code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    if code == 0:
        mpi_comms.release()
        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()
    # os._exit, not sys.exit: the user's script must not go on (no finally, no atexit)
    os._exit(code)


_hook_installed = False


def _abort_on_unhandled(MPI: Any) -> None:
    """Make an unhandled exception on the controller abort the MPI job.

    Without it, rank 0 would print the traceback and then wait forever in
    ``MPI_Finalize`` for ranks that are still serving (or never joined).
    """
    global _hook_installed
    if _hook_installed or MPI.COMM_WORLD.Get_size() == 1:
        return
    _hook_installed = True
    previous = sys.excepthook

    def excepthook(kind, value, tb):
        try:
            previous(kind, value, tb)
        finally:
            abort_world(1)

    sys.excepthook = excepthook


def abort_world(code: int = 1) -> None:
    """``MPI_Abort`` the whole job if MPI is up in this process; else do nothing."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None:
        return
    if MPI.Is_initialized() and not MPI.Is_finalized():
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        MPI.COMM_WORLD.Abort(code)


# --------------------------------------------------------------------------- runtime glue
# The only places that touch the runtime's API (mesharray.runtime, mesharray.proc).


def _route_ip(peer_host: str) -> str:
    """This host's address on the interface that routes to ``peer_host``."""
    forced = os.environ.get("MESHARRAY_MPI_HOST", "").strip()
    if forced:
        return forced
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            # a UDP "connect" sends nothing; it only asks the kernel for a route
            probe.connect((peer_host, 9))
            return probe.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def _runtime_controller(host: str, options: dict) -> Controller:
    listen = "unix" if host.startswith("127.") or host == "localhost" else "tcp"
    return Controller(listen=listen, host=host, **options)


def _runtime_adopt(controller: Any, size: int, timeout: float, joined: dict) -> None:
    try:
        controller.adopt(size, timeout=timeout, progress=size > 1)
    except BootstrapError as exc:
        missing = [r for r in range(size) if r not in controller.workers]
        where = ", ".join(f"{r} on {joined[r][0]} (pid {joined[r][1]})" for r in missing if r in joined)
        raise BootstrapError(
            f"ranks {_fmt_ranks(missing)} of the MPI world of {size} joined over MPI but did not "
            f"connect to the controller at {controller.address} within {timeout:.3g} s "
            f"({where}); set MESHARRAY_MPI_HOST to an address every host can reach"
        ) from exc


def _join_worker_thread() -> None:
    """The launch's close: after the workers stopped, rank 0's worker thread ends."""
    thread = _state.worker_thread if _state is not None else None
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=10.0)


def _runtime_run_worker(address: str, secret: bytes, rank: int) -> None:
    if address.startswith("unix:"):
        listen, listen_host = "unix", "127.0.0.1"
    else:
        controller_host = address[4:].rpartition(":")[0].strip("[]")
        listen, listen_host = "tcp", _route_ip(controller_host)
    # exit_process=False on every rank: ranks 1..N-1 must finalize MPI before
    # they exit, which run_worker's own os._exit would skip; mpirun forwards
    # their stdout/stderr itself
    run_worker(address, secret, rank, listen=listen, listen_host=listen_host,
               exit_process=False, forward_logs=False)
