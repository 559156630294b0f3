"""Project-wide test policy: every test that starts processes must clean them up.

A process left behind by a test fails *that* test (and is killed, so the next
test starts clean).
"""

from __future__ import annotations

import os
import time
import warnings

import pytest

# The libucx wheel's UCX before anything imports mpi4py: Open MPI's pip wheel carries an
# older UCX, and once that one is loaded into the test process the wheel's cannot load
# (the other order works). Only where the `ucx` extra is installed.
try:
    from mesharray.transport.dataplane import ucx_status

    ucx_status()
except Exception:  # pragma: no cover - not installed, or broken: tests/transport/test_ucx.py says which
    pass

try:
    import psutil
except ImportError:  # pragma: no cover - psutil is in the [test] extra
    psutil = None

# When a hypothesis test fails, its pytest plugin imports hypothesis.extra._patching
# (→ libcst → mypy_extensions, which warns DeprecationWarning at import).  Under
# pytest's -W error that import turns a plain test failure into an INTERNALERROR
# that hides the falsifying example, so import it once here with the warning muted.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    try:
        import hypothesis.extra._patching  # noqa: F401
    except ImportError:  # libcst not installed: the plugin skips the patch too
        pass


def _children() -> set[int]:
    if psutil is None:
        return set()
    pids = set()
    try:
        children = psutil.Process(os.getpid()).children(recursive=True)
    except psutil.Error:
        return pids
    for p in children:
        try:
            # multiprocessing's resource tracker lives for the whole session by design;
            # killing it as a "leak" breaks every later test that uses multiprocessing
            if "resource_tracker" in " ".join(p.cmdline()):
                continue
        except psutil.Error:
            continue
        pids.add(p.pid)
    return pids


@pytest.fixture(autouse=True)
def no_leaked_processes(request):
    """Fail a test that leaves child processes behind (after a short grace period)."""
    before = _children()
    yield
    if psutil is None:
        return
    deadline = time.monotonic() + 3.0
    leaked = _children() - before
    while leaked and time.monotonic() < deadline:
        time.sleep(0.05)
        leaked = {pid for pid in _children() - before if psutil.pid_exists(pid)}
        leaked = {pid for pid in leaked if _alive(pid)}
    if leaked:
        descr = []
        for pid in leaked:
            try:
                p = psutil.Process(pid)
                descr.append(f"{pid} {' '.join(p.cmdline())[:120]}")
                p.kill()
            except psutil.Error:
                pass
        pytest.fail(f"test left {len(leaked)} process(es) behind: {descr}", pytrace=False)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False



#: the DDP example every way of running it is checked against (tests/spmd, tests/slurm)
_DDP_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "ddp_train.py")


def _ddp_digest(output: str) -> str:
    """The final weights' digest that examples/ddp_train.py prints (rank 0), from a run's output."""
    import re

    found = re.findall(r"final weights sha256 ([0-9a-f]{16})", output)
    assert len(found) == 1, f"expected one digest line in the output, got {found}:\n{output[-3000:]}"
    return found[0]


@pytest.fixture(scope="session")
def torchrun_ddp():
    """examples/ddp_train.py run once a session by torch's own ``torchrun --standalone --nproc-per-node 2``.

    ``script``, ``args``, ``digest`` (of the final weights it printed) and
    ``digest_of(output)`` (the same, from another run's output).
    """
    import shutil
    import subprocess
    import sys
    from types import SimpleNamespace

    pytest.importorskip("torch")
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    args = ["--steps", "6"]
    # torch's own launcher is the reference here, and its gloo teardown sometimes aborts a rank
    # after the script finished ("terminate called without an active exception", ~1 run in 5-8
    # on this machine, more under load, with or without a barrier before destroy_process_group):
    # a run that died so is tried again, up to three times; any other failure fails at once. If
    # every try died so, a run whose rank 0 printed the digest still stands: the digest comes
    # after the last step's allreduce, so both ranks trained to the end before the abort
    aborted = "terminate called without an active exception"
    for _ in range(3):
        r = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", _DDP_SCRIPT, *args],
                           capture_output=True, text=True, timeout=300)
        if r.returncode == 0 or aborted not in r.stderr:
            break
    torn_down = aborted in r.stderr and r.stdout.count("final weights sha256") == 1
    assert r.returncode == 0 or torn_down, r.stdout + r.stderr
    return SimpleNamespace(script=_DDP_SCRIPT, args=args, digest=_ddp_digest(r.stdout), digest_of=_ddp_digest)
