"""The web view in a real headless browser, ``/metrics`` and the JSON API over HTTP, ``top`` in tmux."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest

import mesharray as ma
from tests.support.actors import Busy
from tests.support.browser import HEADLESS, chromium

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def served():
    procs = ma.proc_mesh(procs=4)
    busy = procs.spawn("busy", Busy)
    for _ in range(20):
        busy.step.call(1).get()
    with pytest.raises(ma.ActorError):
        busy.slice(procs=1).boom.call_one().get()
    busy.say.call("a line for the web view").get()
    # (a printed line travels from the worker's pipe on its own, after the call's reply: wait for all four)
    deadline = time.monotonic() + 10
    while (len(procs.telemetry.sql("SELECT rank FROM logs WHERE text = 'a line for the web view'")) < 4
           and time.monotonic() < deadline):
        time.sleep(0.02)
    url = procs.telemetry.serve(port=0)
    yield procs, busy, url
    procs.stop()


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read()


def test_the_json_api_and_metrics(served):
    procs, _, url = served
    assert url.startswith("http://127.0.0.1:")
    state = json.loads(_get(url + "api/state"))
    assert [r["state"] for r in state["ranks"]] == ["idle"] * 4
    eps = {(e["actor"], e["endpoint"]): e for e in state["endpoints"]}
    assert eps[("busy", "step")]["calls"] >= 80 and eps[("busy", "boom")]["errors"] == 1
    assert state["errors"][-1]["type"] == "KeyError" and "raise KeyError" in state["errors"][-1]["traceback"]
    assert any(line["text"] == "a line for the web view" for line in state["logs"])
    sql = json.loads(_get(url + "api/sql?q=" + urllib.request.quote("SELECT count(*) AS n FROM messages")))
    assert sql["rows"][0]["n"] >= 80 and sql["missing"] == []
    bad = json.loads(_get(url + "api/sql?q=" + urllib.request.quote("SELEC nope")))
    assert "syntax error" in bad["error"]
    assert b"mesharray_calls_total" in _get(url + "metrics")
    stacks = json.loads(_get(url + "api/stacks"))
    assert set(stacks) == {"0", "1", "2", "3"}


def test_the_web_view_in_a_headless_browser(served, tmp_path):
    browser = chromium()
    if browser is None:
        pytest.skip("no Chromium here (make test installs Debian's `chromium` when it runs as root with apt)")
    procs, busy, url = served
    fut = busy.slice(procs=3).hang_here_for_a_while.call_one(15.0)  # one rank busy while the page loads
    try:
        args = [browser, *HEADLESS,
                "--virtual-time-budget=8000", "--window-size=1280,1000"]
        dom = subprocess.run(args + ["--dump-dom", url], capture_output=True, text=True, timeout=90).stdout
        # a click on a cell goes to #rank-N: the page then shows that rank's details
        detail = subprocess.run(args + ["--dump-dom", url + "#rank-3"], capture_output=True, text=True,
                                timeout=90).stdout
        shot = tmp_path / "view.png"
        subprocess.run(args + [f"--screenshot={shot}", url], capture_output=True, timeout=90)
    finally:
        fut.get(timeout=30)
    states = re.findall(r'class="rank (idle|busy|unresponsive|dead)" data-rank="(\d)"', dom)
    assert sorted(states, key=lambda s: s[1]) == [("idle", "0"), ("idle", "1"), ("idle", "2"), ("busy", "3")], dom[-3000:]
    assert "busy.hang_here_for_a_while" in dom
    info = detail[detail.index('class="rankinfo" data-rank="3"'):]
    assert f"<td>pid</td><td>{procs.pids[3]}</td>" in info and "<td>busy</td>" in info, detail[-3000:]
    assert "busy.hang_here_for_a_while" in info
    assert "<td>step</td>" in dom and "KeyError" in dom
    assert "a line for the web view" in dom
    assert shot.exists() and shot.stat().st_size > 10_000
    out = os.environ.get("MESHARRAY_SCREENSHOT")  # where to keep it (the README's picture is made this way)
    if out:
        shutil.copy(shot, out)


def test_top_in_a_terminal(served):
    if shutil.which("tmux") is None:
        pytest.skip("no tmux here (make test installs Debian's `tmux` when it runs as root with apt)")
    procs, busy, url = served
    session = f"matop{os.getpid()}"
    cmd = f"{sys.executable} -m mesharray top {url} --interval 0.5"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "150", "-y", "30", cmd], check=True,
                   env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    try:
        screen = ""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            busy.step.call(1).get()
            screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True,
                                    text=True).stdout
            if "RANK" in screen and screen.count("idle") + screen.count("busy") >= 4:
                break
            time.sleep(0.3)
        assert "mesharray top" in screen and "RANK" in screen, screen
        rows = [ln for ln in screen.splitlines() if ln.split()[:1] and ln.split()[0].isdigit()]
        assert [int(r.split()[0]) for r in rows] == [0, 1, 2, 3], screen
        assert all(("idle" in r) or ("busy" in r) for r in rows)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
