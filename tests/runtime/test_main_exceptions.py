"""An exception class defined in the user's script (``__main__``) keeps its type across the wire."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_exception_class_from_main_keeps_its_type(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import mesharray as ma

        class Boom(ValueError):
            pass

        class A(ma.Actor):
            @ma.endpoint
            def go(self):
                raise Boom("bad input 7")

        with ma.proc_mesh(procs=1) as procs:
            a = procs.spawn("a", A)
            try:
                a.go.call_one().get()
            except ma.ActorError as e:
                assert type(e.exception) is Boom, type(e.exception)
                assert isinstance(e.exception, ValueError)
                assert str(e.exception) == "bad input 7"
            print("kept")
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "kept"
