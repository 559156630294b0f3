"""Fixtures of the runtime tests: one module-scoped mesh for tests that kill nothing."""

from __future__ import annotations

import pytest

import mesharray as ma


@pytest.fixture(scope="module")
def procs():
    mesh = ma.proc_mesh(hosts=1, procs=4)
    yield mesh
    mesh.stop()


@pytest.fixture(scope="module")
def probes(procs):
    from tests.support.actors import Probe

    return procs.spawn("probes", Probe, "t")
