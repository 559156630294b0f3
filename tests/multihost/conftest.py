"""Several "hosts" on one machine: host agents on 127.0.0.2, 127.0.0.3, ... with distinct host ids.

Agents with different host ids never share memory, so everything between them
takes the network path a real cluster would: TCP control, the data plane for
bulk data, hierarchical collectives. Every agent is a real
``python -m mesharray host`` process; the fixtures stop them all.
"""

from __future__ import annotations

import pytest
from mh_agents import SECRET, agents


@pytest.fixture(scope="module")
def two_agents():
    with agents(2) as a:
        yield a


@pytest.fixture(scope="module")
def cluster(two_agents):
    """Two attached hosts with two processes each: ``(hosts, procs)``."""
    import mesharray as ma

    hosts = ma.attach([a.url for a in two_agents], secret=SECRET, transport="tcp")
    procs = hosts.spawn_procs(per_host={"procs": 2})
    yield hosts, procs
    procs.stop()
    hosts.detach()
