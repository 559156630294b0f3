"""``python -m mesharray`` and the ``mesharray`` entry point, outside any launcher."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mesharray.__main__ import main
from tests.support.mpirun import ROOT, clean_env

pytestmark = pytest.mark.timeout(60)


def cli(*args: str, cwd=ROOT, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mesharray", *args], cwd=cwd,
                          env=clean_env(**env), capture_output=True, text=True, timeout=60)


# --------------------------------------------------------------------------- info


def test_info_names_version_engines_transports_and_launcher():
    import mesharray

    out = cli("info")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.startswith(f"mesharray {mesharray.__version__} (python ")
    assert "engines:" in text and "  numpy  numpy " in text
    assert "transports:" in text and "  tcp    " in text
    assert "launcher: none (plain process)" in text
    assert "bootstrap: local" in text


def test_info_json_is_machine_readable():
    out = cli("info", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert set(data) >= {"version", "python", "engines", "transports", "launcher", "bootstrap"}
    assert data["engines"]["numpy"].startswith("numpy ")
    assert data["launcher"] is None and data["bootstrap"] == "local"


def test_info_says_how_workers_would_wait_here():
    from mesharray import _platform

    data = json.loads(cli("info", "--json").stdout)
    assert data["workers"]["spin_us"] == pytest.approx(_platform.worker_spin() * 1e6)
    text = cli("info", MESHARRAY_WORKER_SPIN_US="0").stdout
    why = "one CPU" if _platform.usable_cpus() < 2 else "MESHARRAY_WORKER_SPIN_US=0"
    assert f"; block at once: {why}" in text
    # a bad setting is reported, not raised: info is where one looks when something is wrong
    out = cli("info", MESHARRAY_WORKER_SPIN_US="soon", MESHARRAY_WORKER_SCHED="fifo")
    assert out.returncode == 0, out.stderr
    assert ("workers: invalid: MESHARRAY_WORKER_SCHED must be 'batch' or 'normal', got 'fifo'; "
            "invalid: MESHARRAY_WORKER_SPIN_US must be a number of microseconds >= 0, got 'soon'") in out.stdout


def test_info_says_how_callers_would_wait_for_replies_here():
    from mesharray import _platform

    data = json.loads(cli("info", "--json").stdout)
    assert data["callers"]["spin_us"] == pytest.approx(_platform.caller_spin() * 1e6)
    why = "one CPU" if _platform.usable_cpus() < 2 else "MESHARRAY_CALLER_SPIN_US=0"
    assert f"callers: block at once: {why}" in cli("info", MESHARRAY_CALLER_SPIN_US="0").stdout
    if data["callers"]["spin_us"]:
        assert "callers: poll 50 µs for a reply before blocking (MESHARRAY_CALLER_SPIN_US)" in cli("info").stdout
    out = cli("info", MESHARRAY_CALLER_SPIN_US="later")
    assert out.returncode == 0, out.stderr
    assert ("callers: invalid: MESHARRAY_CALLER_SPIN_US must be a number of microseconds >= 0, got 'later'"
            in out.stdout)


def test_info_reports_the_detected_launcher_without_starting_mpi():
    out = cli("info", "--json", PMI_RANK="3", PMI_SIZE="8")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["launcher"]["name"] == "mpich"
    assert data["launcher"]["description"] == "mpich: rank 3 of 8"
    assert data["bootstrap"] == "mpi"


def test_info_rejects_unknown_arguments():
    out = cli("info", "--yaml")
    assert out.returncode == 2
    assert "mesharray info: unknown arguments ['--yaml']; expected [--probe] [--json]" in out.stderr


def test_no_arguments_prints_usage_and_fails():
    out = cli()
    assert out.returncode == 2
    assert out.stderr.startswith("usage: python -m mesharray script.py [args...]")
    assert cli("--help").returncode == 0


def test_version():
    import mesharray

    assert cli("--version").stdout.strip() == f"mesharray {mesharray.__version__}"


# --------------------------------------------------------------------------- running scripts


def test_script_runs_as_main_with_its_arguments_and_directory_on_the_path(tmp_path):
    (tmp_path / "helper.py").write_text("VALUE = 42\n")
    (tmp_path / "prog.py").write_text(
        "import sys, helper\n"
        "print(__name__, sys.argv, helper.VALUE)\n"
    )
    out = cli(str(tmp_path / "prog.py"), "a", "--b")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"__main__ ['{tmp_path / 'prog.py'}', 'a', '--b'] 42"


def test_unhandled_exception_exits_one_with_the_users_traceback(tmp_path):
    (tmp_path / "boom.py").write_text("def f():\n    raise ValueError('bad value 7')\nf()\n")
    out = cli(str(tmp_path / "boom.py"))
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[-1] == "ValueError: bad value 7"
    # the traceback starts in the user's script, not in mesharray's runner
    assert "boom.py" in lines[1] and "__main__.py" not in out.stderr and "runpy" not in out.stderr


@pytest.mark.parametrize("code, status, message", [
    ("raise SystemExit(3)", 3, ""),
    ("import sys; sys.exit('giving up')", 1, "giving up"),
    ("import sys; sys.exit(0)", 0, ""),
    ("import sys; sys.exit()", 0, ""),
])
def test_sys_exit_status_is_kept(tmp_path, code, status, message):
    (tmp_path / "exit.py").write_text(code + "\n")
    out = cli(str(tmp_path / "exit.py"))
    assert out.returncode == status
    assert out.stderr.strip() == message


def test_module_and_command_forms(tmp_path):
    (tmp_path / "tool.py").write_text("import sys\nif __name__ == '__main__':\n    print('tool', sys.argv[1:])\n")
    out = cli("-m", "tool", "x", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "tool ['x']"
    out = cli("-c", "import sys; print('cmd', sys.argv)", "y")
    assert out.stdout.strip() == "cmd ['-c', 'y']"
    assert cli("-c").returncode == 2


def test_run_subcommand_runs_a_script_named_like_a_subcommand(tmp_path):
    (tmp_path / "info").write_text("print('my own info script')\n")
    out = cli("run", "info", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "my own info script"
    assert cli("run").returncode == 2


def test_missing_script_and_unknown_option():
    out = cli("no_such_script.py")
    assert out.returncode == 2
    assert "can't open file 'no_such_script.py': no such file" in out.stderr
    out = cli("--frobnicate")
    assert out.returncode == 2
    assert "unknown option '--frobnicate'" in out.stderr


def test_main_is_callable_in_process(capsys):
    # the `mesharray` console script is `mesharray.__main__:main`
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("mesharray ")
    assert main(["info", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["version"]


def test_mpi_bootstrap_asked_for_in_a_plain_process_is_a_world_of_one():
    # no launcher: MPI starts as a singleton; rank 0's worker is a thread here
    pytest.importorskip("mpi4py", reason="the mpi bootstrap needs mpi4py (pip install 'mesharray[mpi]')")
    out = subprocess.run(
        [sys.executable, "-c",
         "import os, numpy as np, mesharray as ma\n"
         "class Pid(ma.Actor):\n"
         "    @ma.endpoint\n"
         "    def pid(self):\n"
         "        return os.getpid()\n"
         "m = ma.proc_mesh(bootstrap='mpi')\n"
         "got = np.asarray(m.spawn('p', Pid).pid.call().get()).ravel().tolist()\n"
         "print(m.sizes, got == [os.getpid()])\n"],
        cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "{'hosts': 1, 'procs': 1} True"
