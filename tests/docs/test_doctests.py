"""The docstring examples that need processes run too: a mesh is started for them.

Docstring examples that need a running mesh are marked ``# doctest: +SKIP``
in the source, so that a plain ``doctest.testmod`` (and the docs build) does
not start processes. Here the marks are lifted: every docstring with such an
example runs whole, with ``procs`` (a fresh ``{hosts: 1, procs: 4}`` mesh),
``counters`` (a ``Counter`` mesh on it, when the docstring uses one it does
not spawn), ``Counter``, ``Echo``, ``np`` and ``ma`` defined. Only the
examples listed in :data:`STILL_SKIPPED` stay skipped, each with its reason.
"""

from __future__ import annotations

import doctest
import importlib
import pathlib
import re

import pytest

PKG = pathlib.Path(__file__).resolve().parents[2] / "mesharray"

#: (docstring name, start of the example's source; "" for all) -> why it cannot run in this test
STILL_SKIPPED = {
    ("mesharray.proc.attach", ""): "needs host agents on other machines (tests/multihost runs attach)",
    ("mesharray.k8s.attach", ""): "needs a Kubernetes cluster (tests/bootstrap/k8s runs it against an in-test API server)",
    ("mesharray.k8s.create", ""): "needs a Kubernetes cluster (tests/bootstrap/k8s runs it against an in-test API server)",
    ("mesharray.observe.collect.Telemetry.sql", "procs.telemetry.sql"): "shows the rows of a workload it does not run",
    ("mesharray.proc.ProcMesh.telemetry", "procs.telemetry.sql"): "shows the rows of a workload it does not run",
    ("mesharray.collectives.mpi_comms.mesh_comm", "comm = mesh_comm"): "needs 4 MPI ranks (tests/mpi runs it)",
    ("mesharray.collectives.mpi_comms.mesh_comm", "comm.allreduce"): "needs 4 MPI ranks (tests/mpi runs it)",
    ("mesharray.runtime.worker.run_worker", "t = threading.Thread"): "needs a controller's address and secret",
    ("mesharray.proc.HostMesh.sync_workspace", ""): "starts a job's agents (tests/job syncs workspaces)",
    ("mesharray.job.base.Job.state", ""): "starts agents and writes a job file here (tests/job runs LocalJob)",
    ("mesharray.job.base.load", ""): "needs a job file (tests/job loads them)",
    ("mesharray.job.local.LocalJob", ""): "starts agents and writes a job file here (tests/job runs LocalJob)",
    ("mesharray.job.agents.AgentsJob", ""): "needs host agents on other machines (tests/job runs AgentsJob)",
    ("mesharray.job.slurm.SlurmJob", ""): "needs a SLURM cluster (tests/slurm starts one)",
    ("mesharray.job.kubernetes.KubernetesJob", ""): "needs a Kubernetes cluster (tests/k8s/test_job.py has one)",
    ("mesharray.collectives.mpi_comms.world_comm", "world_comm()"): "needs a mesh launched under mpirun (tests/mpi)",
    ("mesharray.spmd", ""): "runs a torch training script (tests/spmd runs examples/ddp_train.py)",
    ("mesharray.spmd.launch.run", ""): "runs a torch training script (tests/spmd runs examples/ddp_train.py)",
}


def _module_names() -> list[str]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        if "+SKIP" not in path.read_text(encoding="utf-8"):
            continue
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out.append(".".join(parts))
    return out


def _skipped_tests() -> list[tuple[str, str]]:
    """(module, docstring name) of every docstring with a +SKIP example."""
    out = []
    for mod in _module_names():
        module = importlib.import_module(mod)
        for t in doctest.DocTestFinder(exclude_empty=True).find(module):
            if any(ex.options.get(doctest.SKIP) for ex in t.examples):
                out.append((mod, t.name))
    return out


def _unskip(test: doctest.DocTest) -> list[str]:
    """Lift the SKIP marks (but those of STILL_SKIPPED); the sources of the examples that stay skipped."""
    kept = []
    for ex in test.examples:
        if not ex.options.get(doctest.SKIP):
            continue
        if any(name == test.name and ex.source.startswith(src) for name, src in STILL_SKIPPED):
            kept.append(ex.source)
            continue
        del ex.options[doctest.SKIP]
    return kept


def _uses(test: doctest.DocTest, name: str) -> bool:
    """Whether the examples use ``name`` before (or without) binding it themselves."""
    for ex in test.examples:
        if ex.options.get(doctest.SKIP):
            continue
        if re.search(rf"^\s*(with .* as {name}\b|{name}\s*=)", ex.source, re.M):
            return False
        if re.search(rf"\b{name}\b", ex.source):
            return True
    return False


@pytest.mark.timeout(180)
@pytest.mark.parametrize("module, name", _skipped_tests())
def test_docstring_runs(module, name):
    import numpy as np

    import mesharray as ma
    from tests.support.actors import Counter, Echo

    mod = importlib.import_module(module)
    (test,) = [t for t in doctest.DocTestFinder(exclude_empty=True).find(mod) if t.name == name]
    kept = _unskip(test)
    if all(ex.options.get(doctest.SKIP) for ex in test.examples):
        pytest.skip("every example is in STILL_SKIPPED: " + "; ".join(kept))
    # __main__: classes a docstring defines are pickled by value, as in a user's script
    test.globs.update(__name__="__main__", np=np, ma=ma, Counter=Counter, Echo=Echo)
    procs = None
    try:
        if _uses(test, "procs") or _uses(test, "counters"):
            procs = test.globs["procs"] = ma.proc_mesh(hosts=1, procs=4)
            if _uses(test, "counters"):
                test.globs["counters"] = procs.spawn("counters", Counter, 0)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        report: list[str] = []
        runner.run(test, out=report.append, clear_globs=False)
        assert runner.failures == 0, (f"{runner.failures} of {runner.tries} examples of {name} failed:\n"
                                      + "".join(report))
        assert runner.tries > 0
    finally:
        if procs is not None:
            procs.stop()
        for v in list(test.globs.values()):  # meshes a docstring started and left running
            if isinstance(v, ma.ProcMesh) and v is not procs and not v.stopped:
                v.stop()
        test.globs.clear()
