"""``procs.logging(stream=..., aggregate_window=..., level=...)``: worker output per mesh, changed at run time."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.timeout(120)


def _wait_for(capsys, needle: str, seen: list, limit: float = 10.0) -> str:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        cap = capsys.readouterr()
        seen.append(cap.out + cap.err)  # (logging goes to the workers' stderr)
        text = "".join(seen)
        if needle in text:
            return text
        time.sleep(0.05)
    raise AssertionError(f"{needle!r} never printed; got {''.join(seen)!r}")


def test_stream_window_and_level(procs, probes, capsys):
    try:
        seen: list = []
        procs.logging(aggregate_window=3.0)  # (wide: the four lines join however loaded the machine)
        probes.say.call("together").get(timeout=30)
        assert "[procs=0:4] together" in _wait_for(capsys, "together", seen)

        procs.logging(aggregate_window=0)  # every line as it comes, one per rank
        seen.clear()
        probes.say.call("apart").get(timeout=30)
        for r in range(4):  # (the ranks' lines come on four connections, in any order)
            text = _wait_for(capsys, f"[procs={r}] apart", seen)
        assert "[procs=0:4] apart" not in text and text.count("] apart") == 4

        procs[0, 1:].logging(stream=False, aggregate_window=0)  # ranks 1..3 kept quiet here
        seen.clear()
        probes.say.call("muted").get(timeout=30)
        probes.say.call("marker").get(timeout=30)
        text = _wait_for(capsys, "[procs=0] marker", seen)
        time.sleep(0.3)
        text += capsys.readouterr().out
        assert "[procs=0] muted" in text and "[procs=1] muted" not in text and "[procs=3] marker" not in text
        rows = procs.telemetry.sql("SELECT rank FROM logs WHERE text = 'muted' ORDER BY rank")
        assert [r["rank"] for r in rows] == [0, 1, 2, 3], "muted lines are kept for telemetry"

        procs.logging(level="WARNING", aggregate_window=0)  # every rank streams again
        seen.clear()
        probes[0, 1].log_at.call_one("INFO", "quiet").get(timeout=30)
        probes[0, 1].log_at.call_one("WARNING", "loud").get(timeout=30)
        text = _wait_for(capsys, "loud", seen)
        assert "[procs=1] WARNING probe: loud" in text and "quiet" not in text
    finally:
        procs.logging(level="INFO")  # (the mesh is the module's)


def test_bad_arguments(procs):
    with pytest.raises(TypeError, match="stream must be a bool"):
        procs.logging(stream="yes")
    with pytest.raises(ValueError, match="aggregate_window must be >= 0"):
        procs.logging(aggregate_window=-1)
    with pytest.raises(ValueError, match="unknown logging level 'loud'"):
        procs.logging(level="loud")
    with pytest.raises(TypeError, match="level must be a logging level"):
        procs.logging(level=2.5)
