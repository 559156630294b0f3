"""The README's cluster example, as written, on the test cluster: the first run submits, the second re-attaches
in seconds without queueing, and the user's code (not installed anywhere) runs from each node's copy."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]

MODEL = """
import os
import mesharray as ma


class Trainer(ma.Actor):
    @ma.endpoint
    def step(self):
        return os.path.dirname(os.path.abspath(__file__))
"""


def _example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    block = next(b for b in blocks if "ma.job.SlurmJob" in b)
    # 8 processes per node are a real node's; the test machine's two nodes share its cores
    small = block.replace('per_host={"procs": 8}', 'per_host={"procs": 2}')
    assert small != block, "the README's cluster example no longer spawns 8 processes per host"
    return small


def test_the_readme_cluster_example_runs_twice_and_reattaches(slurm_dir, slurm, capsys):
    (slurm_dir / "model.py").write_text(MODEL)
    (slurm_dir / "train.py").write_text(_example())
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    runs = []
    try:
        for _ in range(2):
            t = time.monotonic()
            out = subprocess.run([sys.executable, "train.py"], cwd=slurm_dir, env=env, capture_output=True,
                                 text=True, timeout=120)
            runs.append(time.monotonic() - t)
            assert out.returncode == 0, out.stderr[-3000:]
            # Trainer ran from each node's copy of this directory, not from here
            where = out.stdout.split("]]")[0]
            assert where.count("/workspace") == 4 and str(slurm_dir) not in where, out.stdout
            assert "[[2. 2. 2." in out.stdout, out.stdout  # the sum over the 2 nodes
            if len(runs) == 1:
                jobs = slurm.jobs()
            else:
                assert slurm.jobs() == jobs  # the second run submitted nothing
        status = subprocess.run([sys.executable, "-m", "mesharray", "job", "status"], cwd=slurm_dir, env=env,
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0 and "state: running" in status.stdout, status
    finally:
        killed = subprocess.run([sys.executable, "-m", "mesharray", "job", "kill"], cwd=slurm_dir, env=env,
                                capture_output=True, text=True, timeout=90)
    assert killed.returncode == 0, killed.stderr
    with capsys.disabled():
        print(f"\nREADME cluster example: first run {runs[0]:.1f} s (submits), second {runs[1]:.1f} s (re-attaches)")
