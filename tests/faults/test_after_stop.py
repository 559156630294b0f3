"""After ``stop()``: everything that would use the mesh raises MeshStoppedError (issue item 11)."""

from __future__ import annotations

import pytest

import mesharray as ma
from tests.support.actors import Faulty

pytestmark = pytest.mark.timeout(60)


def test_arrays_and_spawn_after_stop_raise_mesh_stopped():
    procs = ma.proc_mesh(procs=2)
    x = procs.ones(3)
    procs.stop()
    for _what, fn in [("ones", lambda: procs.ones(3)), ("from_numpy", lambda: procs.from_numpy([[[1.0], [2.0]]])),
                     ("x + 1", lambda: x + 1), ("sum", lambda: x.sum(axis="procs")), ("fetch", x.fetch),
                     ("spawn", lambda: procs.spawn("a", Faulty)), ("view ones", lambda: procs[0, 1:].ones(2))]:
        with pytest.raises(ma.MeshStoppedError):
            fn()
