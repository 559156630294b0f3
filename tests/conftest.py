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
