"""The README's tour runs as written: a newcomer's first copy-paste must work."""

from __future__ import annotations

import doctest
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


@pytest.mark.timeout(120)
def test_tour_script_runs():
    tour = next(b for b in _python_blocks() if "proc_mesh" in b)
    # the tour's bare expressions (vals.sum(), y.fetch()) are checked by printing them
    checked = tour.replace("vals.sum()  ", "assert vals.sum() == 4, vals  ")
    assert checked != tour, "the tour no longer has the vals.sum() line this test checks"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", checked], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_shape_examples_are_right():
    block = next(b for b in _python_blocks() if b.lstrip().startswith(">>>"))
    parser = doctest.DocTestParser()
    test = parser.get_doctest(block, {"ma": __import__("mesharray")}, "README", "README.md", 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test)
    assert runner.failures == 0


@pytest.mark.timeout(180)
def test_torch_tour_and_captured_step_run():
    pytest.importorskip("torch")
    moves = next(b for b in _python_blocks() if "trainers, generators" in b)
    step = next(b for b in _python_blocks() if "@ma.function" in b)
    script = ("import torch\nimport mesharray as ma\n" + moves + step
              + "w.fetch()\ntrainers.sync()\ntrainers.stop(); generators.stop()\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
