"""Workers started by something else (threads here, mpirun elsewhere) adopted by a controller."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import mesharray as ma
from mesharray.proc import ProcMesh
from mesharray.runtime.controller import Controller
from mesharray.runtime.worker import run_worker
from tests.support.actors import Counter, Probe

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("listen", ["unix", "tcp"])
def test_controller_adopts_workers_running_in_threads(listen):
    ctl = Controller(name="threads", listen=listen)
    assert ctl.address.startswith("tcp:127.0.0.1:" if listen == "tcp" else "unix:")
    threads = []
    for r in range(3):
        ready = threading.Event()
        t = threading.Thread(target=run_worker, args=(ctl.address, ctl.secret, r),
                             kwargs={"exit_process": False, "ready": ready, "listen": listen}, daemon=True)
        t.start()
        threads.append(t)
    infos = ctl.adopt(3, timeout=20)
    assert [i.rank for i in infos] == [0, 1, 2]
    procs = ProcMesh._from_controller(ctl, ma.Shape({"hosts": 1, "procs": 3}))
    try:
        c = procs.spawn("c", Counter, 2)
        c.incr.broadcast()
        assert c.get.call().get(timeout=10).tolist() == [[3, 3, 3]]
        p = procs.spawn("p", Probe)
        w = p.where.call().get(timeout=10).tolist()[0]
        assert [o["rank"]["procs"] for o in w] == [0, 1, 2]
        big = np.arange(1 << 18, dtype=np.float64)  # 2 MiB: shared memory or inline over tcp
        np.testing.assert_array_equal(p.slice(procs=2).double.call_one(big).get(timeout=10), big * 2)
        # actor -> actor over the workers' own listeners
        assert p.slice(procs=0).call_peer.call_one(c, "get").get(timeout=10) == [[3, 3, 3]]
    finally:
        procs.stop()
    for t in threads:
        t.join(5)
        assert not t.is_alive()


def test_adopt_times_out_naming_the_missing_ranks():
    ctl = Controller()
    try:
        t = threading.Thread(target=run_worker, args=(ctl.address, ctl.secret, 1),
                             kwargs={"exit_process": False}, daemon=True)
        t.start()
        with pytest.raises(ma.BootstrapError, match=r"only 1 of 2 workers joined .* missing ranks \[0\]"):
            ctl.adopt(2, timeout=1.0, progress=False)
    finally:
        ctl.stop()
    t.join(5)
    assert not t.is_alive()
