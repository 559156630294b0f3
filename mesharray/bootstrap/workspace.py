"""Workspaces: a directory tree copied to host agents (``HostMesh.sync_workspace``).

Two halves, one per side of the agent protocol:

- **The controller's** :func:`scan` walks the tree and describes every file
  to copy as ``relative path -> (size, executable, sha256)``. Left out:
  ``.git`` (and other version-control directories), ``__pycache__``,
  ``.mesharray`` (job files: they hold secrets), virtual environments (a
  directory with a ``pyvenv.cfg``, or a conda environment's ``conda-meta``)
  and what the tree's ``.gitignore`` files list (see :class:`GitIgnore`).
  Nothing outside the tree is read: a symbolic link is followed only when its
  target lies inside the tree (it is copied as what it points to), never
  otherwise.
- **The agent's** :class:`Workspace` keeps a copy in a directory of its own
  and an index of what it wrote (size, mtime, sha256). :meth:`Workspace.plan`
  deletes what the tree no longer has and answers which files it needs
  (those whose content differs from its copy's); :meth:`Workspace.put`
  writes them in chunks, each file under a temporary name renamed into place
  when complete, so a reader never sees half a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from typing import Iterator

__all__ = ["scan", "GitIgnore", "Workspace", "FileEntry", "check_rel", "CHUNK"]

#: bytes of file content per message (the agent protocol bounds a message at 64 MiB)
CHUNK = 8 << 20

#: directories never copied, wherever they are in the tree
SKIP_DIRS = frozenset({".git", ".hg", ".svn", "__pycache__", ".mesharray", ".mypy_cache", ".pytest_cache",
                       ".ruff_cache", ".tox", ".nox", ".ipynb_checkpoints"})

#: (size, executable, sha256 hex)
FileEntry = tuple[int, bool, str]


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _translate(pattern: str) -> str:
    """A gitignore glob (no leading ``/``, no trailing ``/``) as a regular expression body."""
    out, i, n = [], 0, len(pattern)
    while i < n:
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("/**", i) and i + 3 == n:
            out.append("/.*")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            j = pattern.find("]", i + 2 if pattern[i + 1:i + 2] in ("!", "^") else i + 1)
            if j < 0:
                out.append(re.escape(c))
                i += 1
            else:
                body = pattern[i + 1:j]
                if body[:1] in ("!", "^"):
                    body = "^" + body[1:]
                out.append("[" + body.replace("\\", "\\\\") + "]")
                i = j + 1
        elif c == "\\" and i + 1 < n:
            out.append(re.escape(pattern[i + 1]))
            i += 2
        else:
            out.append(re.escape(c))
            i += 1
    return "".join(out)


class GitIgnore:
    """The patterns of one ``.gitignore`` file, relative to its directory ``base`` (``""``: the tree's root).

    The rules of git's documentation: blank lines and ``#`` comments are
    ignored; ``!`` negates; a trailing ``/`` matches directories only; a
    pattern with a ``/`` at its start or middle is anchored to the file's
    directory, one without matches a name at any depth below it; ``*``,
    ``?`` and ``[...]`` do not match ``/``; ``**`` matches across directories.
    The last matching pattern wins, deeper files after shallower ones; a
    directory left out is not entered (a negation cannot bring back a file
    inside it), as in git.

    >>> g = GitIgnore("", "*.log\\n!keep.log\\nbuild/\\n/data\\ndocs/**/*.tmp\\n")
    >>> [g.match(p, d) for p, d in [("a.log", False), ("x/keep.log", False), ("build", True), ("build", False)]]
    [True, False, True, None]
    >>> [g.match(p, d) for p, d in [("data", True), ("x/data", True), ("docs/a/b/c.tmp", False)]]
    [True, None, True]
    """

    def __init__(self, base: str, text: str) -> None:
        self.base = base
        self.rules: list[tuple[re.Pattern[str], bool, bool]] = []  # (regex, negated, directories only)
        for raw in text.splitlines():
            line = raw.rstrip()
            if raw.endswith("\\ "):  # an escaped trailing space is kept
                line = raw[:-2] + " "
            if not line or line.startswith("#"):
                continue
            negated = line.startswith("!")
            if negated:
                line = line[1:]
            elif line.startswith("\\!") or line.startswith("\\#"):
                line = line[1:]
            dir_only = line.endswith("/")
            line = line.rstrip("/")
            if not line:
                continue
            anchored = "/" in line
            line = line.lstrip("/")
            body = _translate(line)
            rx = re.compile(("^" if anchored else "^(?:.*/)?") + body + "$", re.S)
            self.rules.append((rx, negated, dir_only))

    def match(self, rel: str, is_dir: bool) -> bool | None:
        """True (left out), False (kept by a negation) or None (no pattern matches) for ``rel`` (from the root)."""
        if self.base:
            if not rel.startswith(self.base + "/"):
                return None
            rel = rel[len(self.base) + 1:]
        verdict = None
        for rx, negated, dir_only in self.rules:
            if dir_only and not is_dir:
                continue
            if rx.match(rel):
                verdict = not negated
        return verdict


def _ignored(rules: list[GitIgnore], rel: str, is_dir: bool) -> bool:
    verdict = False
    for g in rules:
        v = g.match(rel, is_dir)
        if v is not None:
            verdict = v
    return verdict


def _is_env(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "pyvenv.cfg")) or os.path.isdir(os.path.join(path, "conda-meta"))


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root + os.sep)


def _walk(root: str) -> Iterator[tuple[str, str]]:
    """``(relative path, real path)`` of every file to copy (see the module's docstring for what is left out)."""
    real_root = os.path.realpath(root)
    seen_dirs = {real_root}
    rules: list[GitIgnore] = []

    def visit(real_dir: str, rel_dir: str) -> Iterator[tuple[str, str]]:
        pushed = False
        gi = os.path.join(real_dir, ".gitignore")
        if os.path.isfile(gi):
            try:
                with open(gi, encoding="utf-8", errors="replace") as f:
                    rules.append(GitIgnore(rel_dir, f.read()))
                pushed = True
            except OSError:
                pass
        try:
            entries = sorted(os.scandir(real_dir), key=lambda e: e.name)
        except OSError:
            entries = []
        try:
            for e in entries:
                rel = f"{rel_dir}/{e.name}" if rel_dir else e.name
                path = os.path.join(real_dir, e.name)
                target = os.path.realpath(path) if e.is_symlink() else path
                if e.is_symlink() and not _inside(target, real_root):
                    continue  # nothing outside the tree
                try:
                    st = os.stat(target)
                except OSError:
                    continue  # a dangling link
                if stat.S_ISDIR(st.st_mode):
                    if e.name in SKIP_DIRS or _ignored(rules, rel, True) or _is_env(target):
                        continue
                    real = os.path.realpath(target)
                    if real in seen_dirs:
                        continue  # a link back up the tree
                    seen_dirs.add(real)
                    yield from visit(target, rel)
                elif stat.S_ISREG(st.st_mode):
                    if not _ignored(rules, rel, False):
                        yield rel, target
        finally:
            if pushed:
                rules.pop()

    yield from visit(real_root, "")


def scan(root: str) -> dict[str, tuple[FileEntry, str]]:
    """Every file of the tree at ``root`` to copy: ``relative path -> ((size, executable, sha256), real path)``.

    Relative paths use ``/`` whatever the system.
    """
    if not os.path.isdir(root):
        raise NotADirectoryError(f"workspace {root!r} is not a directory")
    out: dict[str, tuple[FileEntry, str]] = {}
    for rel, path in _walk(root):
        try:
            st = os.stat(path)
            out[rel] = ((st.st_size, bool(st.st_mode & 0o111), _sha256(path)), path)
        except OSError:
            continue  # removed while scanning
    return out


def check_rel(rel: str) -> str:
    """``rel`` if it is a plain relative path inside a tree (no ``..``, not absolute), else ``ValueError``.

    >>> check_rel("pkg/mod.py")
    'pkg/mod.py'
    >>> check_rel("../etc/passwd")
    Traceback (most recent call last):
    ...
    ValueError: workspace path '../etc/passwd' leaves the workspace
    """
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel or "\0" in rel:
        raise ValueError(f"bad workspace path {rel!r}")
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"workspace path {rel!r} leaves the workspace")
    return rel


class Workspace:
    """An agent's copy of a controller's tree, in ``path`` (the index beside it: ``path + ".index.json"``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.index_path = path + ".index.json"
        self.index: dict[str, list] = {}  # rel -> [size, mtime_ns, sha256]
        try:
            with open(self.index_path) as f:
                self.index = json.load(f)
        except (OSError, ValueError):
            self.index = {}
        self._open: dict[str, tuple[int, str, bool, str]] = {}  # rel -> (fd, temporary path, executable, sha)

    def _full(self, rel: str) -> str:
        return os.path.join(self.path, *check_rel(rel).split("/"))

    def _current(self, rel: str, entry: FileEntry) -> bool:
        """Whether the copy of ``rel`` already holds ``entry``'s content (and mode)."""
        full = self._full(rel)
        try:
            st = os.lstat(full)
        except OSError:
            return False
        known = self.index.get(rel)
        if not stat.S_ISREG(st.st_mode) or bool(st.st_mode & 0o111) != bool(entry[1]):
            return False
        if known is not None and known[0] == st.st_size == entry[0] and known[1] == st.st_mtime_ns:
            return bool(known[2] == entry[2])
        return st.st_size == entry[0] and _sha256(full) == entry[2]

    def plan(self, files: dict[str, FileEntry]) -> tuple[list[str], int]:
        """Delete what ``files`` does not list; ``(paths whose content is needed, files deleted)``."""
        for rel in files:
            check_rel(rel)
        os.makedirs(self.path, exist_ok=True)
        deleted = 0
        for dirpath, dirnames, filenames in os.walk(self.path, topdown=False):
            rel_dir = os.path.relpath(dirpath, self.path).replace(os.sep, "/")
            rel_dir = "" if rel_dir == "." else rel_dir
            for name in filenames:
                rel = f"{rel_dir}/{name}" if rel_dir else name
                if rel not in files:
                    try:
                        os.unlink(os.path.join(dirpath, name))
                        deleted += 1
                    except OSError:
                        pass
                    self.index.pop(rel, None)
            for name in dirnames:
                full = os.path.join(dirpath, name)
                if os.path.islink(full):
                    os.unlink(full)
                    continue
                try:
                    os.rmdir(full)  # only when empty: what the tree no longer has
                except OSError:
                    pass
        need = [rel for rel, entry in files.items() if not self._current(rel, tuple(entry))]  # type: ignore[arg-type]
        for rel in files:
            if rel not in need:
                try:
                    st = os.stat(self._full(rel))
                    self.index[rel] = [st.st_size, st.st_mtime_ns, files[rel][2]]
                except OSError:
                    pass
        return need, deleted

    def put(self, rel: str, offset: int, data: bytes, last: bool, executable: bool, sha: str) -> None:
        """Write ``data`` at ``offset`` of ``rel``; on the ``last`` chunk, check the sha256 and move it into place."""
        full = self._full(rel)
        if offset == 0:
            self._discard(rel)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            if os.path.isdir(full) and not os.path.islink(full):
                import shutil

                shutil.rmtree(full)  # a directory that became a file
            tmp = f"{full}.mesharray-part"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o755 if executable else 0o644)
            self._open[rel] = (fd, tmp, executable, sha)
        if rel not in self._open:
            raise ValueError(f"workspace file {rel!r}: a chunk at offset {offset} without its first one")
        fd, tmp, _, _ = self._open[rel]
        os.pwrite(fd, data, offset)
        if last:
            del self._open[rel]
            os.close(fd)
            got = _sha256(tmp)
            if got != sha:
                os.unlink(tmp)
                raise ValueError(f"workspace file {rel!r} arrived with sha256 {got}, expected {sha}")
            os.chmod(tmp, 0o755 if executable else 0o644)
            os.replace(tmp, full)
            st = os.stat(full)
            self.index[rel] = [st.st_size, st.st_mtime_ns, sha]

    def _discard(self, rel: str) -> None:
        fd_tmp = self._open.pop(rel, None)
        if fd_tmp is not None:
            os.close(fd_tmp[0])
            try:
                os.unlink(fd_tmp[1])
            except OSError:
                pass

    def finish(self) -> None:
        """Drop unfinished files and save the index."""
        for rel in list(self._open):
            self._discard(rel)
        tmp = self.index_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.index, f)
        os.replace(tmp, self.index_path)
