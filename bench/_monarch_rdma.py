"""Run by bench_moves.py with an interpreter that has torchmonarch: the weight-sync step with RDMABuffer.

Two trainer actors each hold NBYTES of weights and hand out an ``RDMABuffer``
of them (once); each step, two generator actors (another process mesh) read
their trainer's weights with ``read_into`` at once. Prints one JSON line
{"read_into": median seconds of a step}.

Usage: python bench/_monarch_rdma.py REPS NBYTES
"""

import json
import os
import sys
import tempfile
import time

ACTORS = '''
import torch
from monarch.actor import Actor, endpoint
from monarch.rdma import RDMABuffer


class Trainer(Actor):
    def __init__(self, n):
        self.w = torch.ones(n, dtype=torch.uint8)

    @endpoint
    def buffer(self):
        return RDMABuffer(self.w)


class Generator(Actor):
    def __init__(self, n):
        self.w = torch.zeros(n, dtype=torch.uint8)

    @endpoint
    async def pull(self, buf):
        await buf.read_into(self.w)
        return int(self.w[-1])
'''


def main() -> None:
    reps, nbytes = int(sys.argv[1]), int(sys.argv[2])
    d = tempfile.mkdtemp(prefix="bench-monarch-rdma-")
    with open(os.path.join(d, "monarch_rdma_actors.py"), "w") as f:
        f.write(ACTORS)
    sys.path.insert(0, d)
    os.environ["PYTHONPATH"] = d + os.pathsep + os.environ.get("PYTHONPATH", "")
    import warnings

    import monarch
    import numpy as np

    warnings.simplefilter("ignore")
    monarch.configure(rdma_allow_tcp_fallback=True)
    from monarch.actor import this_host
    from monarch_rdma_actors import Generator, Trainer

    host = this_host()
    trainers = host.spawn_procs(per_host={"procs": 2}).spawn("t", Trainer, nbytes)
    generators = host.spawn_procs(per_host={"procs": 2}).spawn("g", Generator, nbytes)
    bufs = [trainers.slice(procs=i).buffer.call_one().get() for i in range(2)]
    gens = [generators.slice(procs=i) for i in range(2)]

    def step():
        futs = [g.pull.call_one(b) for g, b in zip(gens, bufs)]
        assert [f.get() for f in futs] == [1, 1]

    step()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t)
    print(json.dumps({"read_into": float(np.median(ts))}), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
