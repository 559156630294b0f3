"""``python -m mesharray debug [JOBFILE]``: the ``(ma-debug)`` console of a controller, from another terminal.

For a controller without a terminal of its own (a notebook's kernel): when an
actor's code calls ``breakpoint()``, its controller's debugger
(:mod:`mesharray.runtime.debugger`) listens on a unix socket and announces it
in a rendezvous file (mode 0600) of the user's rendezvous directory and of the
directory of each job file that controller attached through. This client
finds it (beside ``JOBFILE`` if given, else in the user's directory; the
newest live controller, or the one of ``--pid``), connects with the mesh's
secret (from that file: only the controller's user can read it; the
controller refuses any client that cannot prove it knows the secret) and then
relays lines: ``list``, ``attach N``, ``cast RANKS CMD``, ``continue``, and
pdb's own commands once attached. It ends when no rank is paused any more
after a command, when the controller goes away, or at ``quit`` / end of input.
"""

from __future__ import annotations

import os
import pickle
import queue
import sys
from typing import Any, Sequence

from ..errors import AuthenticationError
from ..runtime import protocol as P
from ..runtime.channel import Channel
from ..runtime.debugger import read_rendezvous, rendezvous_dir
from ..transport.address import connect

__all__ = ["debug_main", "find", "DebugClient"]

USAGE = "usage: python -m mesharray debug [JOBFILE] [--pid PID]"


def find(jobfile: str | None = None, pid: int | None = None) -> dict:
    """The rendezvous of the controller to debug (see the module docstring); ``LookupError`` if none."""
    d = os.path.dirname(os.path.abspath(jobfile)) if jobfile else rendezvous_dir()
    if jobfile and not os.path.exists(jobfile):
        raise LookupError(f"no job file {jobfile}")
    recs = read_rendezvous(d)
    if pid is not None:
        recs = [r for r in recs if int(r.get("pid", -1)) == pid]
    if not recs:
        where = f"beside {jobfile}" if jobfile else f"in {d}"
        raise LookupError(f"no controller with a paused rank announces a debugger {where}"
                          + (f" with pid {pid}" if pid is not None else "")
                          + "; the debugger starts when an actor's code calls breakpoint()")
    return recs[0]


class DebugClient:
    """A connection to a controller's debugger: :meth:`line` sends one console line and returns the answer."""

    def __init__(self, address: str, secret: bytes, timeout: float = 600.0) -> None:
        self._answers: queue.SimpleQueue[dict] = queue.SimpleQueue()
        self.timeout = timeout
        sock = connect(address, secret)  # (AuthenticationError: not the mesh's secret)
        self.chan = Channel(sock, handler=self._on_frame, on_close=self._on_close, name="debugger")
        self.chan.start()

    def _on_frame(self, chan: Any, kind: int, flags: int, msg_id: int, target: int, view: int,
                  payload: Any) -> None:
        if kind == P.DEBUG:
            self._answers.put(pickle.loads(payload))

    def _on_close(self, chan: Any, exc: Any) -> None:
        self._answers.put({"closed": True})

    def line(self, text: str) -> dict:
        """``{"text": ..., "prompt": ..., "paused": n}`` (or ``{"closed": True}``) for one console line."""
        self.chan.send(P.DEBUG, parts=[pickle.dumps({"line": text})])
        return self._answers.get(timeout=self.timeout)

    def close(self) -> None:
        self.chan.close(join=False)


def debug_main(argv: Sequence[str]) -> int:
    """``python -m mesharray debug [JOBFILE] [--pid PID]``."""
    args = list(argv)
    pid = None
    if "--pid" in args:
        i = args.index("--pid")
        try:
            pid = int(args[i + 1])
        except (IndexError, ValueError):
            print(USAGE, file=sys.stderr)
            return 2
        del args[i:i + 2]
    if len(args) > 1 or any(a.startswith("-") for a in args):
        print(USAGE, file=sys.stderr)
        return 2
    try:
        rec = find(args[0] if args else None, pid)
        client = DebugClient(rec["address"], bytes.fromhex(rec["secret"]))
    except (LookupError, OSError, ValueError, AuthenticationError) as exc:
        print(f"mesharray debug: {exc}", file=sys.stderr)
        return 1
    print(f"mesharray debug: attached to the controller of pid {rec['pid']} ({' '.join(rec.get('argv', []))})")
    ans = client.line("list")
    seen_paused = False
    try:
        while not ans.get("closed"):
            print(ans.get("text", ""), end="", flush=True)
            seen_paused = seen_paused or ans.get("paused", 0) > 0
            if seen_paused and not ans.get("paused") and ans.get("prompt") == "(ma-debug) ":
                print("mesharray debug: no rank is paused any more", flush=True)
                return 0
            try:
                text = input(ans.get("prompt", "(ma-debug) "))
            except EOFError:
                return 0
            if text.strip() in ("quit", "exit") and ans.get("prompt") == "(ma-debug) ":
                return 0
            ans = client.line(text)
    finally:
        client.close()
    print("mesharray debug: the controller's connection ended (its script went on and finished)", flush=True)
    return 0
