"""A two-node SLURM cluster for the tests of this folder (see slurmcluster.py); each test runs in a directory of its
own and may leave no job behind: a job still queued or running after it fails the test (and is cancelled)."""

from __future__ import annotations

import os
import subprocess

import pytest
from slurmcluster import SlurmCluster, missing


@pytest.fixture(scope="package")
def slurm(tmp_path_factory):
    why = missing()
    if why:
        pytest.skip(why)
    cluster = SlurmCluster(str(tmp_path_factory.mktemp("slurm")))
    cluster.start()
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(cluster.env)  # SLURM_CONF for every command, and no SLURM_JOB_ID of an outer job
    try:
        yield cluster
    finally:
        os.environ.clear()
        os.environ.update(saved)
        cluster.stop()


@pytest.fixture
def slurm_dir(slurm, tmp_path, monkeypatch):
    """The test's working directory; no job the test started may still be queued or running after it."""
    monkeypatch.chdir(tmp_path)
    before = set(slurm.live_jobs())
    yield tmp_path
    left = [j for j in slurm.live_jobs() if j not in before]
    for j in left:
        subprocess.run(["scancel", j], env=slurm.env, capture_output=True, timeout=30)
    assert not left, f"the test left SLURM jobs {left} queued or running"
