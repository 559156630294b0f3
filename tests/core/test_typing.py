"""What a type checker sees through ``import mesharray as ma``.

mypy runs once (its API, a fresh cache in a temporary directory) on a small
user script; each test reads its verdict on one line. The checks: ``ma.*``
names resolve, endpoints keep their parameter and return types through
``spawn`` and the adverbs, and mistakes (a misspelt endpoint, a wrong argument)
are reported.
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import pytest

import mesharray

api = pytest.importorskip("mypy.api")

ROOT = Path(__file__).resolve().parents[2]

SNIPPET = textwrap.dedent(
    '''
    import mesharray as ma


    class Counter(ma.Actor):
        def __init__(self, start: int) -> None:
            self.value = start
            self.name = "counter"  # an actor's own attributes may share names with the mesh's
            self.shape = (2, 3)

        @ma.endpoint
        def incr(self, by: int = 1) -> None:
            self.value += by

        @ma.endpoint
        def get(self) -> int:
            return self.value

        @ma.endpoint(concurrent=True)
        async def label(self, prefix: str) -> str:
            return prefix + str(self.value)


    procs = ma.proc_mesh(hosts=1, procs=2)
    counters = procs.spawn("counters", Counter, 0)
    reveal_type(procs)  # L:proc_mesh
    reveal_type(counters.get.call_one().get())  # L:call_one
    reveal_type(counters.get.choose().result())  # L:choose
    reveal_type(counters.label.call_one("n=").get())  # L:async
    reveal_type(counters.get.call().get())  # L:call
    reveal_type(counters[0, 1:3].incr.broadcast(by=2))  # L:broadcast
    reveal_type(counters.slice(procs=-1).get.stream())  # L:stream
    reveal_type(counters.sizes)  # L:sizes
    counters.gett  # L:typo
    counters.incr.call_one("one")  # L:wrong_arg
    counters.label.call_one()  # L:missing_arg
    procs.spawn("c2", Counter, "zero")  # L:wrong_ctor_arg
    counters.get()  # L:not_callable


    async def main(fut: ma.Future[int]) -> None:
        reveal_type(await counters.get.call_one())  # L:await
        reveal_type(fut.get(timeout=1.0))  # L:future_annotation
    '''
)


@pytest.fixture(scope="module")
def mypy_lines(tmp_path_factory):
    """{label: mypy's messages on the snippet's line marked ``# L:label``}."""
    tmp = tmp_path_factory.mktemp("mypy")
    script = tmp / "user_script.py"
    script.write_text(SNIPPET)
    # mypy cannot follow an editable install's import hook: point it at this checkout
    mp = pytest.MonkeyPatch()
    mp.setenv("MYPYPATH", str(ROOT))
    try:
        stdout, stderr, _ = api.run([
            "--config-file", str(ROOT / "pyproject.toml"),
            "--cache-dir", str(tmp / "cache"),
            "--no-error-summary", "--show-error-codes", "--hide-error-context",
            str(script),
        ])
    finally:
        mp.undo()
    assert not stderr, stderr
    labels = {}
    for n, line in enumerate(SNIPPET.splitlines(), 1):
        m = re.search(r"# L:(\w+)", line)
        if m:
            labels[n] = m.group(1)
    out: dict[str, list[str]] = {label: [] for label in labels.values()}
    for line in stdout.splitlines():
        m = re.match(r".*user_script\.py:(\d+): (?:error|note): (.*)", line)
        assert m, f"mypy reports something outside the snippet: {line}"
        n = int(m.group(1))
        assert n in labels, f"unexpected mypy message on line {n}: {line}"
        out[labels[n]].append(m.group(2))
    return out


def _revealed(messages: list[str]) -> str:
    found = [m for m in messages if m.startswith("Revealed type is")]
    assert len(found) == 1, messages
    return found[0].split('"')[1]


@pytest.mark.parametrize("label, expected", [
    ("proc_mesh", "mesharray.proc.ProcMesh"),
    ("call_one", "builtins.int"),
    ("choose", "builtins.int"),
    ("async", "builtins.str"),
    ("call", "mesharray.array.MeshArray"),
    ("broadcast", "None"),
    ("stream", "typing.Iterator[mesharray.runtime.future.Future[builtins.int]]"),
    ("sizes", "builtins.dict[builtins.str, builtins.int]"),
    ("await", "builtins.int"),
    ("future_annotation", "builtins.int"),
])
def test_types_are_revealed(mypy_lines, label, expected):
    got = _revealed(mypy_lines[label])
    # mypy names builtins with or without their module, depending on its version
    assert got.replace("builtins.", "") == expected.replace("builtins.", ""), (label, got)


@pytest.mark.parametrize("label, pattern", [
    ("typo", r'has no attribute "gett".*\[attr-defined\]'),
    ("wrong_arg", r'Argument 1 to "call_one" of "Endpoint" has incompatible type "str"; expected "int"'),
    ("missing_arg", r'Missing positional argument "prefix"'),
    ("wrong_ctor_arg", r'(Argument 3 to "spawn" of "ProcMesh" has incompatible type "str"; expected "int"'
                       r'|No overload variant of "spawn" of "ProcMesh" matches argument types "str", "type\[Counter\]", "str")'),
    ("not_callable", r'not callable'),
])
def test_mistakes_are_reported(mypy_lines, label, pattern):
    errors = mypy_lines[label]
    assert any(re.search(pattern, e) for e in errors), (label, errors)


def test_correct_lines_have_no_errors(mypy_lines):
    for label, messages in mypy_lines.items():
        if label in ("typo", "wrong_arg", "missing_arg", "wrong_ctor_arg", "not_callable"):
            continue
        assert [m for m in messages if not m.startswith("Revealed type is")] == [], (label, messages)


def test_every_lazy_name_is_imported_for_type_checkers():
    """``mesharray/__init__.py`` imports each lazy name (and lazy submodule) under ``TYPE_CHECKING``."""
    tree = ast.parse((ROOT / "mesharray" / "__init__.py").read_text())
    seen = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.level == 1
                for alias in imp.names:
                    assert alias.asname == alias.name, "re-export explicitly: 'import X as X'"
                    # "from . import k8s as k8s": a submodule reached as an attribute (_SUBMODULES)
                    seen[alias.name] = f"mesharray.{imp.module or alias.name}"
    assert seen == {**mesharray._LAZY, **getattr(mesharray, "_SUBMODULES", {})}
