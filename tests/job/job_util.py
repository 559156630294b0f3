"""Helpers of the job tests (a module of its own: other test folders have a conftest too)."""

from __future__ import annotations

import os


def processes_naming(text: str) -> list[tuple[int, str]]:
    """``(pid, command line)`` of every live process whose command line contains ``text``."""
    out: list[tuple[int, str]] = []
    if not os.path.isdir("/proc"):
        return out
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    continue
        except OSError:
            continue
        if text in cmd:
            out.append((int(pid), cmd))
    return out
