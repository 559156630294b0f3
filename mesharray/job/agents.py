"""``AgentsJob``: host agents somebody else started (by hand, ssh, a launcher), named by their addresses.

The allocation is the agents themselves: applying starts nothing, ``state()``
attaches to them (``ma.attach`` per mesh), ``kill()`` detaches and removes
the job file but cannot stop agents it did not start. The agents' secret is
``secret=`` or ``MESHARRAY_SECRET`` when applied; the job file keeps it (0600)
so a later process re-attaches without it. The status is ``running`` while
every agent accepts connections, ``dead`` when one does not.
"""

from __future__ import annotations

import os
import secrets
from typing import Any

from ..errors import BootstrapError
from .base import Job, JobStatus, check_meshes, reachable

__all__ = ["AgentsJob"]


class AgentsJob(Job):
    """Running host agents: ``AgentsJob(meshes={"workers": ["tcp://node1:26600", "tcp://node2:26600"]})``.

    Parameters
    ----------
    meshes : dict of str to list of str
        Mesh name -> the agents' addresses, in host order.
    secret : str, optional
        The agents' secret (default ``MESHARRAY_SECRET``); not an argument
        compared by ``state(cached_path=...)``.

    Examples
    --------
    >>> job = ma.job.AgentsJob(meshes={"workers": ["tcp://node1:26600", "tcp://node2:26600"]})
    >>> hosts = job.state().workers   # doctest: +SKIP
    """

    kind = "agents"

    def __init__(self, meshes: dict[str, list[str]], *, secret: str | None = None) -> None:
        super().__init__(check_meshes(meshes, "list"))
        self._given = secret

    def _args(self) -> dict[str, Any]:
        return {"meshes": self._meshes}

    def _create(self) -> None:
        key = self._given if self._given is not None else (os.environ.get("MESHARRAY_SECRET") or None)
        if not key:
            raise BootstrapError("an AgentsJob needs the agents' secret: set MESHARRAY_SECRET (as on the agents) "
                                 "or pass secret=")
        self._secret = key
        self._id = secrets.token_hex(4)
        self._alloc = {"hosts": self._meshes}

    def _wait_urls(self, deadline: float | None) -> dict[str, list[str]]:
        return {k: list(v) for k, v in self._alloc.get("hosts", self._meshes).items()}

    def _status(self) -> JobStatus:
        urls = [u for us in self._wait_urls(None).values() for u in us]
        gone = [u for u in urls if not reachable(u)]
        hosts = [("", u) for u in urls]
        if gone:
            return JobStatus(self.kind, self._id, "dead", f"agents not answering: {', '.join(gone)}", hosts)
        return JobStatus(self.kind, self._id, "running", f"{len(urls)} agents answer", hosts)

    def _kill(self) -> None:
        pass  # the agents are not this job's to stop
