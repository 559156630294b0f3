"""``hosts.sync_workspace``: what is copied (and left out), changed files only, deletions; and the processes'
``sys.path``, working directory, ``env=`` and ``python=``."""

from __future__ import annotations

import doctest
import importlib
import os
import shutil
import stat
import sys

import numpy as np
import pytest

import mesharray as ma
from mesharray.bootstrap.workspace import GitIgnore, Workspace, scan
from tests.support.actors import JobProbe as Probe

pytestmark = pytest.mark.timeout(120)


def _tree(root, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


@pytest.mark.parametrize("module", ["mesharray.bootstrap.workspace", "mesharray.bootstrap.slurm",
                                    "mesharray.bootstrap.local", "mesharray.job", "mesharray.job.cli"])
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_scan_leaves_out_vcs_caches_envs_ignored_files_and_the_outside(tmp_path):
    root = tmp_path / "proj"
    _tree(root, {
        "train.py": "x", "pkg/__init__.py": "", "pkg/mod.py": "y", "data/keep.csv": "1",
        ".gitignore": "*.log\n!important.log\n/build/\nlocal_only/\n# comment\n",
        "run.log": "no", "important.log": "yes", "build/out.o": "no", "sub/build/out.o": "yes",
        "local_only/a.txt": "no", "sub/.gitignore": "*.tmp\n", "sub/x.tmp": "no", "x.tmp": "yes",
        ".git/HEAD": "ref", "pkg/__pycache__/mod.cpython-311.pyc": "no", ".mesharray/job.json": "{}",
        "venv/pyvenv.cfg": "home = /usr", "venv/lib/site.py": "no", "env2/conda-meta/history": "no",
    })
    (root / "outside.txt").symlink_to(tmp_path)  # a directory outside the tree
    (tmp_path / "secret.txt").write_text("outside")
    (root / "leak.txt").symlink_to(tmp_path / "secret.txt")
    (root / "alias.py").symlink_to(root / "pkg" / "mod.py")  # inside: copied as what it points to
    (root / "pkg" / "loop").symlink_to(root)  # a link back up the tree: not walked twice
    (root / "dangling").symlink_to(tmp_path / "nothing")
    got = scan(str(root))
    assert sorted(got) == [".gitignore", "alias.py", "data/keep.csv", "important.log", "pkg/__init__.py",
                           "pkg/mod.py", "sub/.gitignore", "sub/build/out.o", "train.py", "x.tmp"]
    (size, executable, sha), real = got["alias.py"]
    assert size == 1 and real == str(root / "pkg" / "mod.py") and not executable


def test_gitignore_rules():
    g = GitIgnore("sub", "a/b\n**/deep\n*.py[co]\n\\!bang\n")
    assert g.match("sub/a/b", False) and g.match("sub/x/y/deep", True) and g.match("sub/m.pyc", False)
    assert g.match("a/b", False) is None and g.match("sub/x/a/b", False) is None
    assert g.match("sub/!bang", False) and g.match("sub/m.py", False) is None


def test_workspace_copies_changed_files_only_and_deletes(tmp_path):
    src = tmp_path / "src"
    _tree(src, {"a.py": "a", "d/b.py": "b", "run.sh": "#!/bin/sh\n"})
    os.chmod(src / "run.sh", 0o755)
    ws = Workspace(str(tmp_path / "copy"))

    def sync() -> list[str]:
        files = scan(str(src))
        need, _ = ws.plan({k: v[0] for k, v in files.items()})
        for rel in need:
            (size, x, sha), real = files[rel]
            with open(real, "rb") as f:
                data = f.read()
            ws.put(rel, 0, data[:1], len(data) <= 1, x, sha)
            if len(data) > 1:
                ws.put(rel, 1, data[1:], True, x, sha)
        ws.finish()
        return sorted(need)

    assert sync() == ["a.py", "d/b.py", "run.sh"]
    assert os.stat(tmp_path / "copy" / "run.sh").st_mode & stat.S_IXUSR
    assert sync() == []
    (src / "a.py").write_text("changed")
    shutil.rmtree(src / "d")
    assert sync() == ["a.py"]
    assert (tmp_path / "copy" / "a.py").read_text() == "changed" and not (tmp_path / "copy" / "d").exists()
    with pytest.raises(ValueError, match="leaves the workspace"):
        ws.plan({"../evil": (1, False, "0" * 64)})
    with pytest.raises(ValueError, match="arrived with sha256"):
        ws.put("c.py", 0, b"x", True, False, "0" * 64)


MOD_V1 = "def version():\n    return 'v1'\n"
MOD_V2 = "def version():\n    return 'v2'\n"


def test_sync_workspace_code_env_and_python_follow_to_every_host(workdir, tmp_path_factory):
    proj = tmp_path_factory.mktemp("proj")  # outside the working directory: deleted and made again below
    _tree(proj, {"jobmod_ws.py": MOD_V1, "data/cfg.txt": "cfg", "notes.log": "left out", ".gitignore": "*.log\n"})
    job = ma.job.LocalJob(meshes={"workers": 2})
    hosts = job.state(cached_path=".mesharray/job.json").workers
    try:
        first = hosts.sync_workspace(proj)
        assert first == {h: {"files": 3, "copied": 3, "bytes": len(MOD_V1) + 3 + 6, "deleted": 0}
                         for h in ("workers-0", "workers-1")}
        shutil.rmtree(proj)  # the original is gone: the processes run the copies
        procs = hosts.spawn_procs(per_host={"procs": 1}, env={"JOB_WS": "1"})
        p = procs.spawn("p", Probe)
        assert list(np.asarray(p.call.call("jobmod_ws", "version").get(timeout=30)).ravel()) == ["v1", "v1"]
        cwds = list(np.asarray(p.cwd.call().get(timeout=30)).ravel())
        assert list(np.asarray(p.path0.call().get(timeout=30)).ravel()) == cwds and cwds[0] != cwds[1]
        assert list(np.asarray(p.read.call("data/cfg.txt").get(timeout=30)).ravel()) == ["cfg", "cfg"]
        with pytest.raises(ma.ActorError):
            p[0, 0].read.call_one("notes.log").get(timeout=30)
        procs.stop()

        # changed, a file deleted: synced again, only what changed travels
        _tree(proj, {"jobmod_ws.py": MOD_V2, ".gitignore": "*.log\n"})
        again = hosts.sync_workspace(str(proj))
        assert again["workers-0"] == {"files": 2, "copied": 1, "bytes": len(MOD_V2), "deleted": 1}
        # another interpreter (a wrapper that marks its processes), on every host
        wrapper = workdir / "python-wrapper"
        wrapper.write_text(f"#!/bin/sh\nJOB_WRAPPED=yes exec {sys.executable} \"$@\"\n")
        wrapper.chmod(0o755)
        procs = hosts.spawn_procs(per_host={"procs": 1}, python=str(wrapper))
        p = procs.spawn("p", Probe)
        assert list(np.asarray(p.call.call("jobmod_ws", "version").get(timeout=30)).ravel()) == ["v2", "v2"]
        assert list(np.asarray(p.env.call("JOB_WRAPPED").get(timeout=30)).ravel()) == ["yes", "yes"]
        procs.stop()
        with pytest.raises(ma.BootstrapError, match="could not start the zygote with '/nonexistent/python'"):
            hosts.spawn_procs(per_host={"procs": 1}, python="/nonexistent/python", timeout=10)
    finally:
        job.kill()


def test_this_host_uses_the_tree_itself(workdir):
    _tree(workdir / "proj", {"jobmod_here.py": MOD_V1})
    host = ma.this_host()
    assert host.sync_workspace(workdir / "proj")[host.host_ids[0]]["files"] == 1
    wrapper = workdir / "python-wrapper"
    wrapper.write_text(f"#!/bin/sh\nJOB_WRAPPED=here exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    with host.spawn_procs(per_host={"procs": 1}, env={"JOB_WS": "local"}, python=str(wrapper)) as procs:
        p = procs.spawn("p", Probe)
        assert p.call.call_one("jobmod_here", "version").get(timeout=30) == "v1"
        assert p.env.call_one("JOB_WS").get(timeout=30) == "local"
        assert p.env.call_one("JOB_WRAPPED").get(timeout=30) == "here"
        assert p.cwd.call_one().get(timeout=30) == str(workdir / "proj")
    with pytest.raises(TypeError, match="env must map str to str"):
        ma.this_host().spawn_procs(env={"N": 1})
    with pytest.raises(NotADirectoryError):
        ma.this_host().sync_workspace(workdir / "nope")
