"""``python -m mesharray job status|kill [PATH]``: the job a job file names.

``status`` prints the job's kind, id, state (``pending``, ``starting``,
``running`` or ``dead``, with the scheduler's own words) and hosts; it exits
0 while the job is pending, starting or running, 1 when it is dead or there
is no job file. ``kill`` ends the job and removes its file (1 when there is
none). ``PATH`` defaults to ``.mesharray/job.json``.
"""

from __future__ import annotations

import sys
from typing import Sequence

from ..errors import BootstrapError
from .base import DEFAULT_PATH, load

__all__ = ["main"]

USAGE = "usage: python -m mesharray job {status,kill} [PATH]   (PATH: a job file, default .mesharray/job.json)"


def main(argv: Sequence[str]) -> int:
    """Run ``python -m mesharray job ...``; the exit status.

    >>> main(["status", "/nonexistent/job.json"])
    1
    """
    args = list(argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE, file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    cmd, rest = args[0], args[1:]
    if cmd not in ("status", "kill") or len(rest) > 1 or any(a.startswith("-") for a in rest):
        print(f"mesharray job: unknown arguments {args}\n{USAGE}", file=sys.stderr)
        return 2
    path = rest[0] if rest else DEFAULT_PATH
    try:
        job = load(path)
    except FileNotFoundError:
        print(f"mesharray job: no job file at {path}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"mesharray job: {exc}", file=sys.stderr)
        return 1
    try:
        if cmd == "kill":
            what = f"the {job.kind} job {job.id}"
            job.kill()
            print(f"mesharray job: ended {what} of {path}")
            return 0
        st = job.status()
    except (BootstrapError, ImportError) as exc:
        print(f"mesharray job: {exc}", file=sys.stderr)
        return 1
    print(f"job:   {path}")
    print(f"kind:  {st.kind}")
    print(f"id:    {st.id}")
    print(f"state: {st.state}" + (f"  ({st.detail})" if st.detail else ""))
    for i, (host, url) in enumerate(st.hosts):
        print(f"{'hosts:' if i == 0 else '':<7}{' '.join(x for x in (host, url) if x)}")
    return 0 if st.alive else 1
