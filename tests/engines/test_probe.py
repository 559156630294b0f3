"""Engine capability probes (``python -m mesharray info --probe``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mesharray.engines import ENGINE_NAMES, probe_engine, probe_engines


def test_numpy_probe():
    p = probe_engine("numpy")
    assert p["available"] and p["reason"] is None
    assert (p["device"], p["collective_backend"], p["collective_available"]) == ("cpu", "shm", True)
    assert {"bool", "int64", "float32", "float64"} <= set(p["dtypes"])
    assert "bfloat16" not in p["dtypes"]  # NumPy has none


def test_torch_cpu_probe():
    pytest.importorskip("torch")
    p = probe_engine("torch")
    assert p["available"] and p["device"] == "cpu" and p["collective_backend"] == "shm"
    assert {"float16", "float32", "int32"} <= set(p["dtypes"])


@pytest.mark.parametrize("name", ["cuda", "rocm", "mps", "xla"])
def test_device_probe_says_what_is_missing_or_what_it_found(name):
    p = probe_engine(name)
    if p["available"]:  # a machine with that device: the probe used it
        assert p["device"] != "cpu" and p["dtypes"] and p["collective_backend"] in ("nccl", "shm", "xla")
    else:
        assert p["reason"] and p["dtypes"] == [] and p["device"] is None
        if name == "xla":
            assert "torch_xla" in p["reason"]


def test_probe_engines_covers_every_engine():
    assert list(probe_engines()) == list(ENGINE_NAMES)


def test_info_probe_cli():
    out = subprocess.run([sys.executable, "-m", "mesharray", "info", "--probe", "--json"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["engine_probes"]["numpy"]["available"]
    assert data["platform"]["poller"] in ("epoll", "PollSelector", "KqueueSelector", "EpollSelector", "SelectSelector")
    text = subprocess.run([sys.executable, "-m", "mesharray", "info", "--probe"], capture_output=True, text=True,
                          timeout=120)
    assert text.returncode == 0 and "engines (probed):" in text.stdout and "dtypes: bool" in text.stdout
    bad = subprocess.run([sys.executable, "-m", "mesharray", "info", "--prob"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "expected [--probe] [--json]" in bad.stderr
