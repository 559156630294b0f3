"""Many machines, one script: attach to host agents, start processes on every host, use them.

On each machine (the same secret everywhere; never put it on a command line)::

    export MESHARRAY_SECRET=...            # e.g. python -c "import secrets; print(secrets.token_hex(32))"
    python -m mesharray host --listen tcp://0.0.0.0:26600

Then, from anywhere that reaches them::

    MESHARRAY_SECRET=... python examples/multihost.py tcp://node1:26600 tcp://node2:26600

With no addresses, the script starts two agents on this machine itself
(127.0.0.2 and 127.0.0.3, host ids ``h0`` and ``h1``: they never share memory,
so everything between them takes the network path) and stops them at the end.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys

import numpy as np

import mesharray as ma


class Worker(ma.Actor):
    @ma.endpoint
    def where(self) -> str:
        return f"{os.environ.get('MESHARRAY_HOST_ID', '?')}/pid {os.getpid()}"

    @ma.endpoint
    def share(self, n: int) -> ma.Buffer:
        self.data = np.arange(n, dtype=np.float32)      # kept alive by the actor
        return ma.Buffer(self.data)

    @ma.endpoint
    def read(self, buf: ma.Buffer) -> float:
        dst = np.empty(buf.nbytes // 4, dtype=np.float32)
        buf.read_into(dst).get()                         # one-sided: the owner's code does not run
        return float(dst.sum(dtype=np.float64))


def run(addresses: list[str]) -> None:
    hosts = ma.attach(addresses)                         # a HostMesh, dims {"hosts": N}
    print("attached", hosts)
    procs = hosts.spawn_procs(per_host={"procs": 2})     # a ProcMesh, dims {"hosts": N, "procs": 2}
    try:
        w = procs.spawn("w", Worker)
        print("workers:", w.where.call().get().tolist())

        x = procs.ones((1 << 20,), dtype="float32") * (procs.rank_array() + 1)   # 4 MiB per rank
        per_host = x.sum(axis="procs").fetch()           # shared memory inside each host
        across = x.sum(axis="hosts").fetch()             # then the ring between hosts
        total = float(x.sum().fetch())
        print("sum over procs, first element per host:", np.asarray(per_host)[:, 0].tolist())
        print("sum over hosts, first element per proc:", np.asarray(across)[:, 0].tolist())
        n = procs.size()
        print("sum of everything:", total, "(numpy:", float(np.sum(np.arange(1, n + 1)) * (1 << 20)), ")")

        buf = w[0, 0].share.call_one(1 << 20).get()      # a buffer on the first host ...
        print("read from the last host:", w[-1, -1].read.call_one(buf).get())   # ... read from the last
    finally:
        procs.stop()
        hosts.detach()


def main() -> None:
    if sys.argv[1:]:
        run(sys.argv[1:])
        return
    os.environ.setdefault("MESHARRAY_SECRET", secrets.token_hex(32))
    agents: list[subprocess.Popen] = []
    urls = []
    try:
        for i in range(2):
            p = subprocess.Popen([sys.executable, "-m", "mesharray", "host", "--listen", f"tcp://127.0.0.{2 + i}:0",
                                  "--host-id", f"h{i}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            agents.append(p)
            assert p.stdout is not None
            line = p.stdout.readline().strip()           # "mesharray host listening on tcp://HOST:PORT"
            print(line)
            urls.append(line.rsplit(" ", 1)[1])
        run(urls)
    finally:
        for p in agents:
            p.terminate()
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout is not None:
                p.stdout.close()


if __name__ == "__main__":
    main()
