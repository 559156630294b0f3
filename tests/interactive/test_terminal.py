"""Ctrl-C and the debugger as a user at a terminal meets them: scripts run in a pty (pexpect), keys typed.

- A Ctrl-C typed while the script waits for a call interrupts the script only: the terminal's
  SIGINT goes to its foreground process group, where no worker (nor LocalJob agent) is.
- ``breakpoint()`` in an actor: the ``(ma-debug)`` console on the script's terminal.
- ``python -m mesharray debug``: the console of a controller without a terminal, from another pty.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

pexpect = pytest.importorskip("pexpect", reason="pexpect is in the [test] extra")

HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def _rendezvous_here(tmp_path, monkeypatch):
    """Debuggers announce themselves in the test's directory, not the user's."""
    monkeypatch.setenv("MESHARRAY_DEBUG_DIR", str(tmp_path))


def _spawn(args, env=None, cwd=None):
    e = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return pexpect.spawn(sys.executable, args, encoding="utf-8", timeout=60, env=e, cwd=cwd or HERE,
                         dimensions=(50, 200))


def _finish(child):
    child.expect(pexpect.EOF, timeout=60)
    child.close()
    assert child.exitstatus == 0, (child.exitstatus, child.signalstatus, child.before)


@pytest.mark.parametrize("mode", ["call_one", "call", "job"])
def test_ctrl_c_at_the_terminal_interrupts_the_script_only(mode, tmp_path):
    child = _spawn(["ctrl_c_script.py", mode, str(tmp_path / "job.json")])
    try:
        child.expect("READY", timeout=120)
        time.sleep(0.5)
        child.sendcontrol("c")  # the terminal sends SIGINT to its foreground process group
        child.expect(r"INTERRUPTED after (\d+\.\d) s")
        assert float(child.match.group(1)) < 5
        child.expect(r"NEXT ([^\r\n]+)\r\n")
        assert child.match.group(1).strip() == ("[[42, 42]]" if mode == "call" else "42")
        child.expect(r"ALIVE (\S+) (\d+) (\d+)")
        assert child.match.group(1) in ("True", "remote"), "a worker died of the Ctrl-C"
        assert child.match.group(2) == "0" and child.match.group(3) == "2", child.match.group(0)
        child.expect("DONE")
        _finish(child)
    finally:
        child.terminate(force=True)


def _breakpoint_line() -> int:
    with open(os.path.join(HERE, "debug_script.py")) as f:
        return next(i for i, line in enumerate(f, 1) if line.strip() == "breakpoint()")


def test_debugger_at_the_terminal():
    bp = _breakpoint_line() + 1  # (pdb stops at the line after breakpoint())
    child = _spawn(["debug_script.py", "2"])
    try:
        child.expect(r"\(ma-debug\) ")
        # both ranks pause; wait until the list shows both
        for _ in range(50):
            child.sendline("list")
            child.expect(r"\(ma-debug\) ")
            if "stepper.work" in child.before and re.search(r"\n\s+0 .*\n\s+1 ", child.before.replace("\r", "")):
                break
            time.sleep(0.2)
        listing = child.before.replace("\r", "")
        assert re.search(rf"^\s+0\s+hosts=0,procs=0\s+stepper\.work\s+\S+:{bp}", listing, re.M), listing
        assert re.search(rf"^\s+1\s+hosts=0,procs=1\s+stepper\.work\s+\S+:{bp}", listing, re.M), listing
        child.sendline("attach 1")
        child.expect(r"\(Pdb\) ")
        assert f"({bp})work()" in child.before
        child.sendline("p x")
        child.expect(r"\(Pdb\) ")
        assert child.before.strip().splitlines()[-1].strip() == "6"
        child.sendline("n")
        child.expect(r"\(Pdb\) ")
        assert f"({bp + 1})work()" in child.before
        child.sendline("w")
        child.expect(r"\(Pdb\) ")
        assert "work()" in child.before
        child.sendline("detach")
        child.expect(r"\(ma-debug\) ")
        child.sendline("cast 0,1 p x")
        child.expect(r"\(ma-debug\) ")
        out = child.before.replace("\r", "")
        assert re.search(r"^\[0\] 5$", out, re.M) and re.search(r"^\[1\] 6$", out, re.M), out
        child.sendline("continue")
        child.expect(r"RESULT \[\[50, 60\]\]")
        child.expect(r"STATS 0 0")  # nobody died; nobody paused any more
        _finish(child)
    finally:
        child.terminate(force=True)


def test_paused_rank_keeps_its_timeouts_and_is_never_killed():
    """kill_unresponsive with a 1 s heartbeat timeout: a rank paused for longer is reported as
    paused, a call to it times out as asked, and it is not killed."""
    child = _spawn(["debug_script.py", "paused"])
    try:
        child.expect(r"TIMEOUT ([^\r\n]+)\r\n", timeout=90)
        assert "paused in the debugger" in child.match.group(1), child.match.group(1)
        child.expect(r"STATE unresponsive=0 paused=1 deaths=0")
        child.sendline("continue")  # (the console waits at its prompt, printed before)
        child.expect(r"RESULT \[\[50\]\]")
        _finish(child)
    finally:
        child.terminate(force=True)


def test_debug_0_makes_breakpoint_a_no_op():
    out = subprocess.run([sys.executable, "debug_script.py", "1"], cwd=HERE, capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, MESHARRAY_DEBUG="0"), stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    assert "RESULT [[50]]" in out.stdout
    assert "ignored: the debugger is off (MESHARRAY_DEBUG=0)" in out.stderr + out.stdout


def test_debug_cli_from_another_terminal(tmp_path):
    """A controller without a terminal (as a notebook's): `python -m mesharray debug` finds it and attaches,
    with the mesh's secret only."""
    env = dict(os.environ, MESHARRAY_DEBUG_DIR=str(tmp_path), PYTHONUNBUFFERED="1")
    script = subprocess.Popen([sys.executable, "debug_script.py", "2"], cwd=HERE, env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        from mesharray.errors import AuthenticationError
        from mesharray.observe.debug import DebugClient, find

        deadline = time.monotonic() + 90
        rec = None
        while time.monotonic() < deadline:
            try:
                rec = find()  # (in MESHARRAY_DEBUG_DIR: tmp_path)
                break
            except LookupError:
                time.sleep(0.2)
        assert rec is not None, "the controller announced no debugger"
        assert oct(os.stat(rec["path"]).st_mode & 0o777) == "0o600"
        with pytest.raises(AuthenticationError):
            DebugClient(rec["address"], b"x" * 32)
        cli = pexpect.spawn(sys.executable, ["-m", "mesharray", "debug"], encoding="utf-8", timeout=60, env=env,
                            cwd=HERE)
        try:
            cli.expect(r"\(ma-debug\) ")
            for _ in range(50):
                cli.sendline("list")
                cli.expect(r"\(ma-debug\) ")
                if re.search(r"\n\s+1 ", cli.before.replace("\r", "")) and "\n    0 " in cli.before.replace("\r", ""):
                    break
                time.sleep(0.2)
            cli.sendline("cast * p x")
            cli.expect(r"\(ma-debug\) ")
            assert "[0] 5" in cli.before and "[1] 6" in cli.before, cli.before
            cli.sendline("continue")
            cli.expect(["no rank is paused any more", "its script went on and finished"])
            cli.expect(pexpect.EOF)
        finally:
            cli.terminate(force=True)
        out, _ = script.communicate(timeout=60)
        assert "RESULT [[50, 60]]" in out, out
        assert "python -m mesharray debug" in out, out
    finally:
        if script.poll() is None:
            script.kill()
            script.wait()
