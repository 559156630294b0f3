"""``python -m mesharray`` (also the ``mesharray`` command).

Usage::

    python -m mesharray script.py [args...]     # run a script (any rank of a job)
    python -m mesharray -m module [args...]     # run a module, like python -m
    python -m mesharray -c "code" [args...]     # run a string, like python -c
    python -m mesharray run script.py [args...] # the same, for a script named "info"
    python -m mesharray info [--probe] [--json] # version, engines, transports, launcher
    python -m mesharray host --listen tcp://0.0.0.0:26600 [--advertise URL] [--host-id NAME]
                                                # a host agent (secret: MESHARRAY_SECRET)
    python -m mesharray k8s manifest --name NAME --hosts N --image IMAGE [...]
                                                # Kubernetes objects of a mesh (| kubectl apply -f -)
    python -m mesharray job status|kill [PATH]  # the job of a job file (ma.job; default .mesharray/job.json)
    python -m mesharray torchrun [torchrun's flags] [--job PATH | --hosts ADDR,...] script.py [args...]
                                                # a torchrun script on a mesh (ma.spmd)
    python -m mesharray debug [JOBFILE] [--pid PID]
                                                # the (ma-debug) console of a controller whose actors
                                                # called breakpoint() (a notebook's), from another terminal

Running through ``python -m mesharray`` adds one guarantee to a launch such as
``mpirun -n 4 python -m mesharray train.py``: an unhandled exception (or a
non-zero ``sys.exit``) on *any* rank aborts the whole MPI job with a non-zero
exit status, instead of leaving the other ranks waiting forever — what
``python -m mpi4py`` does. Without a launcher it behaves like ``python``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import runpy
import sys
import traceback
from typing import Any, Callable, Sequence

__all__ = ["main", "info", "run_path", "run_module", "run_command"]

USAGE = """\
usage: python -m mesharray script.py [args...]
       python -m mesharray -m module [args...]
       python -m mesharray -c command [args...]
       python -m mesharray run script.py [args...]
       python -m mesharray info [--probe] [--json]
       python -m mesharray host --listen tcp://0.0.0.0:26600 [--advertise URL] [--host-id NAME]
       python -m mesharray k8s manifest --name NAME --hosts N --image IMAGE [--procs-per-host 8]
                                  [--namespace NS] [--jobset] [--resources gpu=8] [--secret-name S]
       python -m mesharray job status|kill [PATH] # a job (ma.job) of a job file, default .mesharray/job.json
       python -m mesharray torchrun [--nproc-per-node N] [--nnodes N] [--standalone] [--master-addr A]
                                  [--master-port P] [--job PATH | --hosts ADDR,...] script.py [args...]
       python -m mesharray top URL                # live per-rank table of procs.telemetry.serve()'s URL
       python -m mesharray debug [JOBFILE] [--pid PID]  # the debugger of a controller without a terminal
       python -m mesharray --version

Runs a script so that an unhandled exception on any MPI rank aborts the
whole job (non-zero exit) instead of hanging the others; `info` prints the
version, the engines and transports available and the detected launcher;
`info --probe` also loads every engine and reports its device, collective
backend and the dtypes that worked on it (imports torch: seconds); `host`
runs a host agent that scripts attach to (ma.attach), with the secret taken
from MESHARRAY_SECRET; `k8s manifest` prints the Kubernetes objects of a mesh
of host agents (pipe it to `kubectl apply -f -`; the script then calls
ma.k8s.attach(NAME)); `job status` prints a job's kind, id, state and hosts
(exit 0 while it is pending or running, 1 when it is dead or there is no job
file) and `job kill` ends it. A script named like a subcommand runs with
`run`."""


# --------------------------------------------------------------------------- running


def _abort_job(code: int) -> None:
    """Abort every rank of an MPI job this process belongs to (no-op otherwise)."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None:
        # MPI never initialized here: exiting non-zero is enough, launchers
        # end the job when a process exits non-zero
        return
    try:
        if MPI.Is_initialized() and not MPI.Is_finalized():
            _flush()
            MPI.COMM_WORLD.Abort(code)
    except Exception:  # pragma: no cover - a broken MPI: exit non-zero anyway
        pass


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _guarded(run: Any) -> int:
    from mesharray.spmd.rank import exit_status  # the status `python script.py` would exit with

    try:
        run()
    except SystemExit as exc:
        code = exit_status(exc)
    except BaseException:
        # print like the interpreter would, without this module's frames
        kind, value, tb = sys.exc_info()
        skip = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"}
        while tb is not None and (tb.tb_frame.f_code.co_filename in skip
                                  or os.path.abspath(tb.tb_frame.f_code.co_filename) in skip):
            tb = tb.tb_next
        traceback.print_exception(kind, value, tb)
        code = 1
    else:
        return 0
    if code != 0:
        _abort_job(code if 0 < code < 256 else 1)
    return code


def run_path(path: str, args: Sequence[str] = ()) -> int:
    """Run a script as ``__main__`` with abort-on-failure semantics; return its exit code.

    Parameters
    ----------
    path : str
        The script.
    args : sequence of str
        Its arguments (``sys.argv[1:]`` inside it).

    Returns
    -------
    int
        0, or the non-zero status (after ``MPI_Abort`` when MPI is up).

    Examples
    --------
    >>> import tempfile, os
    >>> from mesharray.__main__ import run_path
    >>> with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
    ...     _ = f.write("import sys; sys.exit(3)")
    >>> run_path(f.name)
    3
    >>> os.unlink(f.name)
    """
    if not os.path.exists(path):
        print(f"mesharray: can't open file {path!r}: no such file", file=sys.stderr)
        _abort_job(2)
        return 2
    sys.argv[:] = [path, *args]
    # like `python script.py`: the script's directory comes first on sys.path
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    return _guarded(lambda: runpy.run_path(path, run_name="__main__"))


def run_module(module: str, args: Sequence[str] = ()) -> int:
    """Run a module as ``__main__`` (like ``python -m``) with abort-on-failure semantics."""
    sys.argv[:] = [module, *args]
    sys.path.insert(0, os.getcwd())
    return _guarded(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True))


def run_command(command: str, args: Sequence[str] = ()) -> int:
    """Run a string of code (like ``python -c``) with abort-on-failure semantics."""
    sys.argv[:] = ["-c", *args]
    sys.path.insert(0, "")
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    return _guarded(lambda: exec(compile(command, "<string>", "exec"), namespace))


# --------------------------------------------------------------------------- info


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _mpi_library() -> str | None:
    """The MPI library's version string, read without initializing MPI."""
    if "mpi4py.MPI" in sys.modules:
        MPI = sys.modules["mpi4py.MPI"]
    else:
        try:
            import mpi4py

            # MPI_Get_library_version may be called before MPI_Init; not
            # initializing keeps `info` fast and safe outside a launcher
            mpi4py.rc.initialize = False
            mpi4py.rc.finalize = False
            from mpi4py import MPI
        except Exception:
            return None
    try:
        return MPI.Get_library_version().splitlines()[0].split(",")[0].strip()
    except Exception:
        return None


def info(probe: bool = False) -> dict[str, Any]:
    """What this installation can do, without importing torch or starting MPI.

    Parameters
    ----------
    probe : bool
        Also load every engine and try it (:func:`mesharray.engines.probe_engines`:
        device, collective backend, dtypes); imports torch when installed.

    Returns
    -------
    dict
        ``version``, ``python``, ``engines`` and ``transports`` (name -> a short
        description, or None when unavailable), ``data_plane`` (what carries
        bulk data on one host and between hosts, and why UCX is or is not
        available), ``platform`` (the code paths this OS takes: see
        :mod:`mesharray._platform`), ``launcher`` (or None), ``bootstrap`` (what
        ``proc_mesh()`` would use here), ``workers`` and ``callers`` (how workers
        and this process would wait for messages: ``spin_us``, and ``spin_why``
        where it is 0) and, with ``probe``, ``engine_probes`` (name -> capabilities).

    Examples
    --------
    >>> from mesharray.__main__ import info
    >>> info()["engines"]["numpy"] is not None
    True
    """
    import mesharray
    from mesharray._platform import caller_spin
    from mesharray.bootstrap import detect_launcher, resolve_bootstrap

    engines: dict[str, str | None] = {}
    numpy_version = _version("numpy")
    engines["numpy"] = f"numpy {numpy_version}" if numpy_version else None
    torch_version = _version("torch") if _has("torch") else None
    # device probing needs `import torch` (seconds); report what is installed
    engines["torch"] = f"torch {torch_version}" if torch_version else None
    engines["xla"] = f"torch_xla {_version('torch_xla')}" if _has("torch_xla") else None

    # UCX before MPI: Open MPI's wheel carries an older UCX that, once loaded, keeps the libucx wheel's from loading
    from mesharray.transport.dataplane import plane_kind, ucx_status

    ucx_ok, ucx_why = ucx_status() if _has("libucx") else (False, "libucx is not installed; pip install 'mesharray[ucx]'")
    transports: dict[str, str | None] = {"tcp": "tcp (loopback unless told otherwise)"}
    transports["unix"] = "unix sockets" if hasattr(__import__("socket"), "AF_UNIX") else None
    transports["shm"] = "shared memory" if os.name == "posix" else None
    if ucx_ok:
        from mesharray.transport import ucx

        try:
            d = ucx.describe()
            transports["ucx"] = (f"UCX {d['version']} (UCX_TLS={d['UCX_TLS']}: {', '.join(d['transports']) or 'none'};"
                                 f" Buffer RMA {d['rma']})")
        except Exception as exc:  # UCX loads but cannot start here: say why
            transports["ucx"] = f"UCX {ucx.ucx_version()} (cannot start: {exc})"
    else:
        transports["ucx"] = None
    if _has("mpi4py"):
        library = _mpi_library()
        transports["mpi"] = f"mpi4py {_version('mpi4py')}" + (f" ({library})" if library else "")
    else:
        transports["mpi"] = None

    setting = os.environ.get("MESHARRAY_DATA_PLANE") or "auto"
    try:
        between = plane_kind(setting)
    except Exception as exc:  # a bad setting, or ucx asked for without the extra: say so
        between = f"invalid: {exc}"
    data_plane = {"setting": setting, "same host": "shared memory", "between hosts": between,
                  "tcp": "built in", "ucx": ucx_why if ucx_ok else f"unavailable: {ucx_why}"}
    launcher = detect_launcher()
    try:
        bootstrap = resolve_bootstrap("auto")
    except ValueError as exc:
        bootstrap = f"invalid: {exc}"
    from mesharray.bootstrap.mpirun import find_mpirun

    mpirun = find_mpirun()
    out = {
        "version": mesharray.__version__,
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "engines": engines,
        "transports": transports,
        "data_plane": data_plane,
        "launcher": None if launcher is None else {
            "name": launcher.name, "rank": launcher.rank, "size": launcher.size,
            "local_rank": launcher.local_rank, "local_size": launcher.local_size,
            "description": launcher.describe(),
        },
        "bootstrap": bootstrap,
        "mpirun": mpirun,
        "platform": _platform_paths(),
        "workers": _worker_policy(),
        "callers": _spin_policy(caller_spin, "MESHARRAY_CALLER_SPIN_US"),
    }
    if probe:
        from mesharray.engines import probe_engines

        out["engine_probes"] = probe_engines()
    return out


def _platform_paths() -> dict[str, Any]:
    """The OS-specific code paths this process takes (``MESHARRAY_PORTABLE=1`` forces the portable ones)."""
    from mesharray._platform import LINUX_NATIVE, PORTABLE, abstract_sockets, memfd_via_proc
    from mesharray.transport import shm
    from mesharray.transport.readiness import READ, readiness_set

    readiness = readiness_set(READ, oneshot=True)
    if shm.available():
        memory = "memfd, opened through /proc" if memfd_via_proc() else \
            "shm_open, descriptors passed over unix sockets (SCM_RIGHTS)"
    else:
        memory = None
    return {
        "system": sys.platform,
        "portable": PORTABLE,
        "poller": readiness.kind,
        "listeners": "abstract unix sockets" if abstract_sockets() else "unix socket files (0700 directory)",
        "shared_memory": memory,
        "process_stats": "/proc" if LINUX_NATIVE else "psutil",
    }


def _worker_policy() -> dict[str, Any]:
    """How worker processes started from here would wait: their scheduling class and read spin
    (``MESHARRAY_WORKER_SCHED``, ``MESHARRAY_WORKER_SPIN_US``), and why the spin is 0 where it is."""
    from mesharray._platform import LINUX_NATIVE, worker_sched, worker_spin

    out: dict[str, Any] = {}
    try:
        sched = worker_sched()
        out["sched"] = "SCHED_BATCH" if sched == "batch" and LINUX_NATIVE else "the system's default"
    except ValueError as exc:
        out["sched"] = f"invalid: {exc}"
    out.update(_spin_policy(worker_spin, "MESHARRAY_WORKER_SPIN_US"))
    return out


def _spin_policy(setting: Callable[[], float], var: str) -> dict[str, Any]:
    """``{"spin_us", "spin_why"}`` of a spin setting (``_platform.worker_spin``/``caller_spin``)."""
    from mesharray._platform import cpu_quota, usable_cpus

    out: dict[str, Any] = {}
    try:
        out["spin_us"] = round(setting() * 1e6, 3)
    except ValueError as exc:
        out["spin_us"], out["spin_why"] = None, f"invalid: {exc}"
        return out
    if out["spin_us"] == 0:
        quota = cpu_quota()
        raw = os.environ.get(var, "").strip()
        out["spin_why"] = ("one CPU" if usable_cpus() < 2 else
                           f"{var}={raw}" if raw else
                           f"a CPU quota of {quota:g} CPUs" if quota is not None else "")
    return out


def _spin_text(w: dict[str, Any], what: str, var: str) -> str:
    if w["spin_us"] is None:
        return w["spin_why"]
    if w["spin_us"]:
        return f"poll {w['spin_us']:g} µs {what}before blocking ({var})"
    return f"block at once: {w['spin_why']}"


_HINTS = {"torch": "pip install 'mesharray[torch]'", "xla": "pip install torch_xla",
          "ucx": "pip install 'mesharray[ucx]'", "mpi": "pip install 'mesharray[mpi]'"}


def _print_info(data: dict[str, Any]) -> None:
    print(f"mesharray {data['version']} (python {data['python']}, {data['executable']})")
    probes = data.get("engine_probes")
    sections = ("engines", "transports") if probes is None else ("transports",)
    if probes is not None:
        print("engines (probed):")
        for name, p in probes.items():
            if not p["available"]:
                print(f"  {name:<6} unavailable: {p['reason']}")
                continue
            coll = p["collective"] if p["collective_available"] else f"unavailable ({p['collective']})"
            print(f"  {name:<6} device {p['device']}; collectives: {p['collective_backend']}, {coll}")
            print(f"  {'':<6} dtypes: {' '.join(p['dtypes'])}")
    for section in sections:
        print(f"{section}:")
        for name, descr in data[section].items():
            text = descr if descr else f"unavailable ({_HINTS.get(name, 'not installed')})"
            print(f"  {name:<6} {text}")
    dp = data["data_plane"]
    print(f"data plane (MESHARRAY_DATA_PLANE={dp['setting']}): same host {dp['same host']}; between hosts "
          f"{dp['between hosts']} (tcp: {dp['tcp']}; ucx: {dp['ucx']})")
    plat = data["platform"]
    print(f"platform: {plat['system']}{' (MESHARRAY_PORTABLE)' if plat['portable'] else ''}; poller {plat['poller']}; "
          f"{plat['listeners']}; shared memory: {plat['shared_memory'] or 'none (data inline)'}; "
          f"process stats: {plat['process_stats']}")
    w = data["workers"]
    sched = w["sched"] if w["sched"].startswith("invalid") else f"{w['sched']} (MESHARRAY_WORKER_SCHED)"
    print(f"workers: {sched}; {_spin_text(w, '', 'MESHARRAY_WORKER_SPIN_US')}")
    print(f"callers: {_spin_text(data['callers'], 'for a reply ', 'MESHARRAY_CALLER_SPIN_US')}")
    launcher = data["launcher"]
    print(f"launcher: {launcher['description'] if launcher else 'none (plain process)'}")
    print(f"bootstrap: {data['bootstrap']}  (what proc_mesh() uses here)")
    print(f"mpirun: {data['mpirun'] or 'not found'}")


# --------------------------------------------------------------------------- main


#: the subcommands that live in a module of their own: name -> (module, its main function)
_SUBCOMMANDS = {
    "top": (".observe", "top_main"),
    "host": (".bootstrap.agent", "main"),
    "k8s": (".bootstrap.k8s", "main"),
    "job": (".job.cli", "main"),
    "torchrun": (".spmd.cli", "main"),
    "debug": (".observe.debug", "debug_main"),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m mesharray`` and the ``mesharray`` command.

    Parameters
    ----------
    argv : sequence of str, optional
        Arguments after the program name; ``sys.argv[1:]`` by default.

    Returns
    -------
    int
        The exit status.

    Examples
    --------
    >>> from mesharray.__main__ import main
    >>> main(["-c", "print('hi')"])
    hi
    0
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(USAGE, file=sys.stderr)
        return 2
    first = args[0]
    if first in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if first == "--version":
        import mesharray

        print(f"mesharray {mesharray.__version__}")
        return 0
    if first in _SUBCOMMANDS:  # (imported when used: `python -m mesharray -c` stays light)
        module, func = _SUBCOMMANDS[first]
        return getattr(importlib.import_module(module, __package__), func)(args[1:])
    if first == "info":
        extra = args[1:]
        unknown = [a for a in extra if a not in ("--json", "--probe")]
        if unknown:
            print(f"mesharray info: unknown arguments {unknown}; expected [--probe] [--json]", file=sys.stderr)
            return 2
        data = info(probe="--probe" in extra)
        if "--json" in extra:
            print(json.dumps(data, indent=2))
        else:
            _print_info(data)
        return 0
    if first == "run":
        args = args[1:]
        if not args:
            print("mesharray run: missing the script to run\n\n" + USAGE, file=sys.stderr)
            return 2
        first = args[0]
    if first in ("-m", "-c"):
        if len(args) < 2:
            print(f"mesharray: argument expected for the {first} option", file=sys.stderr)
            return 2
        runner = run_module if first == "-m" else run_command
        return runner(args[1], args[2:])
    if first.startswith("-"):
        print(f"mesharray: unknown option {first!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return run_path(first, args[1:])


if __name__ == "__main__":
    sys.exit(main())
