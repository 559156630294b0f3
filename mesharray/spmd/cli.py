"""``python -m mesharray torchrun [torchrun's flags] script.py [args]``: a torchrun script on a mesh.

Takes the flags of torch's ``torchrun`` that one controller can honour:
``--nproc-per-node`` (a number; ``cpu``, ``gpu``, ``auto`` count this
machine's, so only without ``--job``/``--hosts``), ``--nnodes`` (the number
of hosts: ``N`` or ``N:N``; the first N of the job's or ``--hosts``'), ``--standalone``,
``--master-addr``, ``--master-port``, ``--role``, ``--max-restarts 0``; and,
without effect (there is nothing for them to tune), ``--run-path``,
``--start-method`` and ``--monitor-interval``. The others are refused, each
with the reason: ``--node-rank`` (one command starts every host),
``--rdzv-*`` and ``--local-addr`` (no rendezvous: the controller hands out the
ranks), ``--nnodes MIN:MAX`` (no elastic membership), ``--max-restarts`` > 0,
``--no-python``, ``-m``, the log-file flags (output comes to this terminal,
rank-prefixed), ``--numa-binding``, ``--virtual-local-rank``,
``--signals-to-handle``, ``--shutdown-timeout``, ``--event-log-handler``.

mesharray's own: ``--job PATH`` (the hosts of a cached ``ma.job``, its job
file; ``--mesh NAME`` picks one of several meshes; the allocation stays for
the next run), ``--hosts ADDR,...`` (host agents, secret in
``MESHARRAY_SECRET``) and ``--workspace DIR`` (copied to every host first,
``sync_workspace``; the script is then run from the copies).

Exit status: 0 when every rank exited 0; else the first failing rank's
(its ``sys.exit`` code or process exit status, 128+N for signal N, 1 for an
exception), after the others were ended and that rank's traceback or status
printed, each line prefixed with its rank. Ctrl-C ends every rank: 130.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Sequence

from ..errors import ActorDiedError, ActorError, MeshArrayError
from ..proc import HostMesh, ProcMesh, attach, this_host
from .launch import ENDED, Outcome, run_outcome

__all__ = ["main", "parse"]

PROG = "python -m mesharray torchrun"
_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # mesharray's directory

_RENDEZVOUS = ("there is no rendezvous to configure: this controller starts every rank and hands each its RANK "
               "and WORLD_SIZE (elastic membership is not supported; the hosts come from --job or --hosts)")
_OUTPUT = ("output comes to this terminal, each line prefixed with its rank; log files and filters are not "
           "supported (redirect this command's output instead)")
_ENDING = ("a failing rank or Ctrl-C ends every rank at once (their processes exit); signals are not forwarded "
           "and there is no shutdown timeout")

#: torchrun's flags that are refused: (spellings, takes a value, why)
REFUSED: list[tuple[tuple[str, ...], bool, str]] = [
    (("--node-rank", "--node_rank"), True,
     "one command starts every host from this controller: run it once, not once per node"),
    (("--rdzv-backend", "--rdzv_backend"), True, _RENDEZVOUS),
    (("--rdzv-endpoint", "--rdzv_endpoint"), True, _RENDEZVOUS),
    (("--rdzv-id", "--rdzv_id"), True, _RENDEZVOUS),
    (("--rdzv-conf", "--rdzv_conf"), True, _RENDEZVOUS),
    (("--local-addr", "--local_addr"), True, _RENDEZVOUS),
    (("--no-python", "--no_python"), False,
     "every rank runs Python in a mesharray worker process: a program that is not a Python script cannot run there"),
    (("-m", "--module"), False, "running a module is not supported: pass the module's file"),
    (("--log-dir", "--log_dir"), True, _OUTPUT),
    (("-r", "--redirects"), True, _OUTPUT),
    (("-t", "--tee"), True, _OUTPUT),
    (("--local-ranks-filter", "--local_ranks_filter"), True, _OUTPUT),
    (("--duplicate-stdout-filters", "--duplicate_stdout_filters"), True, _OUTPUT),
    (("--duplicate-stderr-filters", "--duplicate_stderr_filters"), True, _OUTPUT),
    (("--logs-specs", "--logs_specs"), True, _OUTPUT),
    (("--numa-binding", "--numa_binding"), True, "CPU binding is not supported"),
    (("--virtual-local-rank", "--virtual_local_rank"), False,
     "not supported: LOCAL_RANK is the process's index on its host and CUDA_VISIBLE_DEVICES is left alone"),
    (("--signals-to-handle", "--signals_to_handle"), True, _ENDING),
    (("--shutdown-timeout", "--shutdown_timeout"), True, _ENDING),
    (("--event-log-handler", "--event_log_handler"), True, "elastic event logs are not supported"),
]


class UsageError(Exception):
    """A command line that cannot run (exit status 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # (argparse's own errors: a UsageError, not SystemExit)
        raise UsageError(message)


def _parser() -> _Parser:
    p = _Parser(prog=PROG, allow_abbrev=False, add_help=True,
                description="Run a script written for torchrun on a mesh: every rank runs it as __main__ with "
                            "torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...).")
    p.add_argument("--nproc-per-node", "--nproc_per_node", default="1",
                   help="processes per host: a number, or cpu, gpu, auto (this machine's count; local runs only)")
    p.add_argument("--nnodes", default=None, help="hosts: N or N:N (default: every host of --job or --hosts, else 1)")
    p.add_argument("--standalone", action="store_true", help="accepted: a single controller needs no rendezvous")
    p.add_argument("--master-addr", "--master_addr", default=None, help="MASTER_ADDR (default: rank 0's host)")
    p.add_argument("--master-port", "--master_port", type=int, default=None,
                   help="MASTER_PORT (default: a port free on rank 0's host)")
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=0, help="0 only")
    p.add_argument("--role", default="default", help="ROLE_NAME")
    p.add_argument("--run-path", "--run_path", action="store_true", help="accepted (ranks always run in-process)")
    p.add_argument("--start-method", "--start_method", default=None, help="accepted, no effect")
    p.add_argument("--monitor-interval", "--monitor_interval", default=None, help="accepted, no effect")
    for names, takes_value, _why in REFUSED:
        if takes_value:
            p.add_argument(*names, dest=names[-1].lstrip("-").replace("-", "_"), default=None, help=argparse.SUPPRESS)
        else:
            p.add_argument(*names, dest=names[-1].lstrip("-").replace("-", "_"), action="store_true",
                           help=argparse.SUPPRESS)
    p.add_argument("--job", default=None, metavar="PATH", help="run on the hosts of the ma.job saved in PATH")
    p.add_argument("--mesh", default=None, metavar="NAME", help="with --job: the job's mesh (when it has several)")
    p.add_argument("--hosts", default=None, metavar="ADDR,...",
                   help="run on these host agents (tcp://HOST:PORT,...; secret in MESHARRAY_SECRET)")
    p.add_argument("--workspace", default=None, metavar="DIR",
                   help="copy DIR to every host first (sync_workspace); the script is run from the copies")
    p.add_argument("training_script", help="the script")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER, help="its arguments")
    return p


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """The command line checked: a namespace with ``nproc`` and ``nnodes`` as ints (or None), or :class:`UsageError`.

    >>> parse(["--nproc-per-node", "2", "train.py", "--lr", "0.1"]).training_script_args
    ['--lr', '0.1']
    >>> parse(["--node-rank", "1", "train.py"])
    Traceback (most recent call last):
    ...
    mesharray.spmd.cli.UsageError: --node-rank is not supported: one command starts every host from this controller: run it once, not once per node
    """
    args = _parser().parse_args(list(argv))
    for names, takes_value, why in REFUSED:
        value = getattr(args, names[-1].lstrip("-").replace("-", "_"))
        if (value is not None) if takes_value else value:
            raise UsageError(f"{names[0]} is not supported: {why}")
    if args.max_restarts != 0:
        raise UsageError(f"--max-restarts {args.max_restarts} is not supported: restarts are not, a failing rank "
                         f"ends the run (give 0 or leave it out)")
    if args.job is not None and args.hosts is not None:
        raise UsageError("--job and --hosts both name hosts: give one")
    if args.mesh is not None and args.job is None:
        raise UsageError("--mesh names a mesh of a job: it needs --job PATH")
    remote = args.job is not None or args.hosts is not None
    args.nnodes = _nnodes(args.nnodes, remote)
    args.nproc = _nproc(args.nproc_per_node, remote)
    return args


def _nnodes(value: str | None, remote: bool) -> int | None:
    if value is None:
        return None
    lo, _, hi = value.partition(":")
    try:
        n, m = int(lo), int(hi or lo)
    except ValueError:
        raise UsageError(f"--nnodes takes a number of hosts, got {value!r}") from None
    if n != m:
        raise UsageError(f"--nnodes {value} is not supported: elastic membership is not; give one number of hosts")
    if n < 1:
        raise UsageError(f"--nnodes must be >= 1, got {value!r}")
    if n > 1 and not remote:
        raise UsageError(f"--nnodes {n} needs hosts: --job PATH (a cached ma.job) or --hosts ADDR,...")
    return n


def _nproc(value: str, remote: bool) -> int:
    try:
        n = int(value)
    except ValueError:
        if remote:
            raise UsageError(f"--nproc-per-node {value} counts this machine's devices; with --job or --hosts give "
                             f"a number") from None
        try:
            from torch.distributed.run import determine_local_world_size
        except ImportError:
            raise UsageError(f"--nproc-per-node {value} needs torch on this machine; give a number") from None
        try:
            n = int(determine_local_world_size(value))
        except ValueError as exc:
            raise UsageError(f"--nproc-per-node {value}: {exc}") from None
    if n < 1:
        raise UsageError(f"--nproc-per-node must be >= 1, got {value!r}")
    return n


def _hosts(args: argparse.Namespace) -> tuple[HostMesh, Any]:
    """The hosts to run on, and what to detach at the end (None: nothing)."""
    if args.hosts is not None:
        addrs = [a for a in args.hosts.split(",") if a]
        hosts = attach(addrs)
        owner: Any = hosts
    elif args.job is not None:
        from ..job import load

        state = load(args.job).state()
        owner = state
        meshes = state.meshes
        if args.mesh is not None:
            hosts = state[args.mesh]
        elif len(meshes) == 1:
            (hosts,) = meshes.values()
        else:
            state.detach()
            raise UsageError(f"the job of {args.job} has meshes {sorted(meshes)}: pick one with --mesh NAME")
    else:
        return this_host(), None
    n = args.nnodes
    if n is not None:
        if n > hosts.size():
            owner.detach()
            raise UsageError(f"--nnodes {n}: only {hosts.size()} hosts are there ({', '.join(hosts.host_ids)})")
        hosts = hosts[:n]
    return hosts, owner


def script_traceback(text: str) -> str:
    r"""A remote traceback without its leading frames in mesharray's code (what ``python script.py`` would show).

    >>> print(script_traceback(
    ...     'Traceback (most recent call last):\n'
    ...     f'  File "{_PKG}/runtime/worker.py", line 1, in _run_async\n    result = await result\n'
    ...     '  File "/x/train.py", line 6, in <module>\n    raise ValueError("boom")\nValueError: boom\n'), end="")
    Traceback (most recent call last):
      File "/x/train.py", line 6, in <module>
        raise ValueError("boom")
    ValueError: boom
    """
    lines = text.splitlines()
    if not lines or not lines[0].startswith("Traceback"):
        return text
    i = 1
    while i < len(lines) and lines[i].startswith(f'  File "{_PKG}{os.sep}'):
        i += 1
        while i < len(lines) and lines[i].startswith("    "):
            i += 1
    return "\n".join(lines[:1] + lines[i:]) + "\n"


def _report(out: Outcome) -> None:
    """The failed ranks' tracebacks or statuses, each line prefixed with its rank, and a summary line."""
    err = sys.stderr
    order = [p for p in range(len(out.codes)) if p in out.errors or out.codes[p] not in (0, ENDED)]
    order.sort(key=lambda p: p != out.first)
    for pos in order:
        label = out.labels[pos]
        exc = out.errors.get(pos)
        if isinstance(exc, ActorError):
            text = script_traceback(exc.traceback_text).rstrip() or f"{type(exc.exception).__name__}: {exc.exception}"
        elif isinstance(exc, ActorDiedError):
            text = str(exc)
        elif exc is not None:
            text = f"{type(exc).__name__}: {exc}"
        else:
            text = f"exited with code {out.codes[pos]}"
        err.write("".join(f"[{label}] {line}\n" for line in text.splitlines()))
    ended = sum(1 for c in out.codes if c == ENDED)
    first = out.first
    assert first is not None
    exc = out.errors.get(first)
    why = (f"{type(exc.exception).__name__}: {exc.exception}" if isinstance(exc, ActorError)
           else str(exc) if exc is not None else f"exit code {out.codes[first]}")
    tail = f"; ended the {ended} rank(s) still running" if ended else ""
    err.write(f"mesharray torchrun: rank {out.ranks[first]} ({out.labels[first]}) failed ({why}){tail}; "
              f"exit status {out.status()}\n")
    err.flush()


def main(argv: Sequence[str]) -> int:
    """Run ``python -m mesharray torchrun ...``; the exit status.

    >>> main(["--rdzv-backend", "c10d", "train.py"])
    2
    """
    try:
        args = parse(argv)
    except UsageError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    script = args.training_script
    if args.job is None and args.hosts is None and args.workspace is None and not os.path.isfile(script):
        print(f"{PROG}: can't open file {script!r}: no such file", file=sys.stderr)
        return 2
    owner: Any = None
    procs: ProcMesh | None = None
    try:
        try:
            hosts, owner = _hosts(args)
        except UsageError as exc:
            print(f"{PROG}: {exc}", file=sys.stderr)
            return 2
        if args.workspace is not None:
            hosts.sync_workspace(args.workspace)
        kw: dict[str, Any] = {"bootstrap": "local"} if owner is None else {}
        procs = hosts.spawn_procs(per_host={"procs": args.nproc}, **kw)
        env: dict[str, str] = {"ROLE_NAME": args.role}
        if args.master_addr is not None:
            env["MASTER_ADDR"] = args.master_addr
        if args.master_port is not None:
            env["MASTER_PORT"] = str(args.master_port)
        out = run_outcome(procs, script, args.training_script_args, env)
        procs.stop()  # (every rank's output printed before the report)
        if not out.ok:
            _report(out)
        return out.status()
    except KeyboardInterrupt:
        if procs is not None:
            procs.stop()
        print(f"{PROG}: interrupted; every rank was ended", file=sys.stderr)
        return 130
    except (MeshArrayError, OSError) as exc:
        print(f"{PROG}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        if procs is not None:
            procs.stop()
        if owner is not None:
            owner.detach()
