"""A notebook session against a real IPython kernel: examples/notebook.ipynb (nbclient), and a kernel
interrupted during a ``get()``, then restarted and re-attached to its job (jupyter_client)."""

from __future__ import annotations

import os
import queue
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbclient and ipykernel are in the [test] extra")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pexpect = pytest.importorskip("pexpect")
from jupyter_client import KernelManager  # noqa: E402  (after the skips)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "notebook.ipynb"
pytestmark = pytest.mark.timeout(240)


def _texts(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")


def test_example_notebook(tmp_path):
    nb = nbformat.read(EXAMPLE, as_version=4)
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    # a call's output is in the cell that made it, aggregated over the ranks that printed the same line
    assert _texts(code[1]) == "[procs=0:2] hello, notebook\n", code[1].outputs
    # the class redefined in a cell: the new definition ran
    lines = sorted(_texts(code[2]).splitlines())
    assert lines == ["[procs=0] hi from rank 0, again", "[procs=1] hi from rank 1, again"], code[2].outputs
    # aggregate_window=0: each rank's line as it comes
    assert sorted(_texts(code[3]).splitlines()) == ["[procs=0] hello, unaggregated", "[procs=1] hello, unaggregated"]
    assert _texts(code[4]) == "[procs=0] hello, one rank\n"
    assert "notebook" in _texts(code[5])  # on the job's hosts
    for c in code:
        assert not [o for o in c.outputs if o.get("output_type") == "error"], c.outputs


class _Kernel:
    """A real kernel (jupyter_client), run cell by cell."""

    def __init__(self, cwd: str) -> None:
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(cwd=cwd, env=dict(os.environ))
        self._client()

    def _client(self) -> None:
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def run(self, code: str, timeout: float = 120, interrupt_after: float | None = None) -> tuple[str, list]:
        """(stream text, errors) of one cell; ``interrupt_after``: interrupt the kernel that long after it starts."""
        return self.wait(self.kc.execute(code), timeout, interrupt_after)

    def wait(self, msg_id: str, timeout: float = 120, interrupt_after: float | None = None) -> tuple[str, list]:
        """(stream text, errors) of the cell ``msg_id`` (:meth:`run`), once it is done."""
        code = msg_id
        out: list[str] = []
        errors: list = []
        deadline = time.monotonic() + timeout
        t_busy = None
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"cell did not finish: {code!r}; output so far {''.join(out)!r}"
            if interrupt_after is not None and t_busy is not None and time.monotonic() - t_busy > interrupt_after:
                self.km.interrupt_kernel()
                interrupt_after = None
            try:
                msg = self.kc.get_iopub_msg(timeout=min(left, 0.2))
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            t, c = msg["msg_type"], msg["content"]
            if t == "status" and c["execution_state"] == "busy":
                t_busy = time.monotonic()
            elif t == "stream":
                out.append(c["text"])
            elif t == "error":
                errors.append((c["ename"], c["evalue"]))
            elif t == "status" and c["execution_state"] == "idle":
                return "".join(out), errors

    def restart(self) -> None:
        self.kc.stop_channels()
        self.km.restart_kernel(now=True)  # the old kernel is killed, as a crash or a hard restart does
        self._client()

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


def test_kernel_interrupt_and_restart(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHARRAY_DEBUG_DIR", str(tmp_path / "rendezvous"))  # (not the user's directory)
    job_path = str(tmp_path / "job.json")
    k = _Kernel(str(tmp_path))
    try:
        out, err = k.run(f"""
import mesharray as ma, time

class Slow(ma.Actor):
    @ma.endpoint
    def nap(self, s):
        print("napping", s)
        time.sleep(s)
        return s

job = ma.job.LocalJob(meshes={{"workers": 2}})
hosts = job.state(cached_path={job_path!r}).workers
local = ma.proc_mesh(hosts=1, procs=2)
s = local.spawn("s", Slow)
r = hosts.spawn_procs(per_host={{"procs": 1}}).spawn("r", Slow)
print("hosts", hosts.host_ids, "pids", local.pids)
""")
        assert not err, err
        host_ids = out.split("hosts ", 1)[1].split(" pids")[0]
        # interrupted during get(): the cell ends with KeyboardInterrupt, nothing else breaks
        t0 = time.monotonic()
        out, err = k.run("s.slice(procs=0).nap.call_one(6).get()", interrupt_after=1.0)
        assert [e[0] for e in err] == ["KeyboardInterrupt"], (out, err)
        assert time.monotonic() - t0 < 5
        out, err = k.run("""
print("next", s.slice(procs=1).nap.call_one(0).get(timeout=60), r.nap.call(0).get(timeout=60).tolist())
st = local.stats()
print("deaths", st["deaths"], "alive", st["alive"], "pids", local.pids)
""")
        assert not err, err
        assert "next 0 [[0], [0]]" in out, out
        assert "deaths 0 alive 2" in out, out
        # the output of those calls showed in this cell
        assert "[procs=1] napping 0" in out and "napping 0" in out, out
        # breakpoint() in a cell's actor: the kernel has no terminal; another one attaches, beside the job file
        cell = k.kc.execute("""
class Paused(ma.Actor):
    @ma.endpoint
    def work(self, x):
        y = x + 1
        breakpoint()
        return y * 2

print("result", local.slice(procs=0).spawn("p", Paused).work.call_one(1).get(timeout=120))
""")
        cli = pexpect.spawn(sys.executable, ["-m", "mesharray", "debug", job_path], encoding="utf-8", timeout=60,
                            env=dict(os.environ), cwd=str(tmp_path))
        try:
            deadline = time.monotonic() + 60
            while True:  # (until the kernel's debugger announced itself and its rank paused)
                i = cli.expect([r"\(ma-debug\) ", pexpect.EOF])
                if i == 0 and " p.work " in cli.before:
                    break
                assert time.monotonic() < deadline, cli.before
                if i == 1:
                    time.sleep(0.3)
                    cli = pexpect.spawn(sys.executable, ["-m", "mesharray", "debug", job_path], encoding="utf-8",
                                        timeout=60, env=dict(os.environ), cwd=str(tmp_path))
                else:
                    cli.sendline("list")
            cli.sendline("attach 0")
            cli.expect(r"\(Pdb\) ")
            cli.sendline("p y")
            cli.expect(r"\(Pdb\) ")
            assert cli.before.strip().splitlines()[-1].strip() == "2", cli.before
            cli.sendline("c")
            cli.expect(["no rank is paused any more", "runs on"])
        finally:
            cli.terminate(force=True)
        out, err = k.wait(cell)
        assert not err, err
        assert "result 4" in out and "python -m mesharray debug" in out, out
        # after a restart (the controller is gone, and with it its processes), the job's hosts come back
        k.restart()
        out, err = k.run(f"""
import mesharray as ma

class Echo(ma.Actor):
    @ma.endpoint
    def echo(self, x):
        return x

hosts = ma.job.load({job_path!r}).state().workers
print("hosts", hosts.host_ids, "answer", hosts.spawn_procs(per_host={{"procs": 1}}).spawn("e", Echo).echo.call(3).get().tolist())
""")
        assert not err, err
        assert f"hosts {host_ids} answer [[3], [3]]" in out, (out, host_ids)
        out, err = k.run(f"import mesharray as ma; ma.job.load({job_path!r}).kill(); print('killed')")
        assert "killed" in out and not err, (out, err)
    finally:
        k.close()
        if os.path.exists(job_path):  # (a failed test ends its job too: no agent left behind)
            import mesharray as ma

            ma.job.load(job_path).kill()
