"""Smoke test of an installed wheel, run by ``make test-wheel`` in a fresh venv.

Checks that no C compiler is reachable (the wheel must need none), that
``mesharray`` comes from the venv's site-packages (not a source tree), and
runs the runtime end to end: actors, a distributed array, a reduction
across ranks, the telemetry web view's page (package data), ``python -m
mesharray info``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import urllib.request

import numpy as np


def main(argv: list[str]) -> None:
    # cibuildwheel tests in its build environment, compilers included: --allow-compiler there
    if "--allow-compiler" not in argv:
        for cc in ("cc", "gcc", "clang", "zig"):
            assert shutil.which(cc) is None, f"a compiler is on PATH ({shutil.which(cc)}): the test would prove nothing"
    import mesharray as ma
    from mesharray import _core

    site = sysconfig.get_paths()["purelib"]
    for mod in (ma, _core):
        assert mod.__file__ is not None and mod.__file__.startswith(site), f"{mod.__name__} from {mod.__file__}"
    with ma.proc_mesh(hosts=1, procs=2) as procs:
        x = procs.ones((1000,), dtype="float32")
        y = (x * procs.rank_array() + 1).sum(axis="procs").fetch()
        assert np.allclose(np.asarray(y), 3.0), y  # (1*0 + 1) + (1*1 + 1)
        # the web view's page is package data (mesharray/observe/static): served from the installed wheel
        with urllib.request.urlopen(procs.telemetry.serve(), timeout=30) as r:
            page = r.read()
        assert b"<title>mesharray" in page and b"api/state" in page, page[:200]
    info = subprocess.run([sys.executable, "-m", "mesharray", "info"], capture_output=True, text=True, timeout=60)
    assert info.returncode == 0, info.stderr
    print(info.stdout)
    print(f"smoke test passed: mesharray from {ma.__file__}")


if __name__ == "__main__":
    main(sys.argv[1:])
