"""Benchmark collection and the ratio summary.

``pytest bench`` collects ``bench_*.py`` (pytest's default only collects
``test_*.py``).  After the run, every benchmark group that has a *baseline*
(a benchmark that set ``benchmark.extra_info["baseline"] = True``) gets a
short table: each benchmark's median and its ratio to the baseline's median.
"""

from __future__ import annotations

import pytest


def pytest_collect_file(file_path, parent):
    # a file named on the command line is collected by pytest itself
    if file_path.suffix == ".py" and file_path.name.startswith("bench_") and not parent.session.isinitpath(file_path):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def _fmt_ns(seconds: float) -> str:
    ns = seconds * 1e9
    if ns >= 1e6:
        return f"{ns / 1e6:,.2f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:,.2f} us"
    return f"{ns:,.0f} ns"


def pytest_terminal_summary(terminalreporter, config):
    session = getattr(config, "_benchmarksession", None)
    if session is None or not getattr(session, "benchmarks", None):
        return
    groups: dict[str, list] = {}
    for bench in session.benchmarks:
        if bench.stats is None or not getattr(bench.stats, "data", None) and not hasattr(bench.stats, "median"):
            continue
        groups.setdefault(bench.group or "", []).append(bench)
    lines = []
    for group, benches in sorted(groups.items()):
        base = [b for b in benches if b.extra_info.get("baseline")]
        if not base:
            continue
        base_median = base[0].stats.median
        lines.append(f"{group}:")
        for b in sorted(benches, key=lambda b: b.stats.median):
            ratio = b.stats.median / base_median if base_median else float("nan")
            name = b.name.split("[", 1)[-1].rstrip("]") if "[" in b.name else b.name
            lines.append(f"    {name:<40s} median {_fmt_ns(b.stats.median):>12s}   x{ratio:6.2f} of {base[0].extra_info.get('label', 'baseline')}")
    if lines:
        terminalreporter.section("medians and ratios to the baseline of each group")
        for line in lines:
            terminalreporter.write_line(line)
