"""examples/linreg.py trains across the mesh and prints the same numbers as NumPy."""

import contextlib
import io
import runpy
from pathlib import Path

import pytest

proc_mod = pytest.importorskip("mesharray.proc", reason="needs the runtime (ProcMesh)")
if not hasattr(proc_mod.ProcMesh, "from_numpy"):
    pytest.skip("ProcMesh does not inherit ArrayFactory yet", allow_module_level=True)


@pytest.mark.timeout(120)
def test_linreg_example_matches_numpy():
    path = Path(__file__).resolve().parents[2] / "examples" / "linreg.py"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        runpy.run_path(str(path), run_name="__main__")
    text = out.getvalue()
    assert "same numbers: yes" in text
    for line in text.splitlines():
        if line.startswith("step"):
            parts = line.split()
            assert parts[4] == parts[6], line  # loss numpy == loss mesh, as printed


@pytest.mark.timeout(180)
def test_rl_weight_sync_example_matches_one_process_torch():
    pytest.importorskip("torch")
    path = Path(__file__).resolve().parents[2] / "examples" / "rl_weight_sync.py"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        runpy.run_path(str(path), run_name="not_main")["main"](6)
    text = out.getvalue()
    assert "same numbers: yes" in text, text
    assert "loss per trainer" in text
