"""A plain DistributedDataParallel training script, written for torchrun: mesharray runs it unmodified.

With torch's own launcher, then with mesharray's, on this machine::

    torchrun --standalone --nproc-per-node 2 examples/ddp_train.py
    python -m mesharray torchrun --standalone --nproc-per-node 2 examples/ddp_train.py

Across two hosts of a job (``ma.job``'s cached job file), or of agents you
started (``python -m mesharray host``, secret in ``MESHARRAY_SECRET``)::

    python -m mesharray torchrun --job .mesharray/job.json --nproc-per-node 2 examples/ddp_train.py
    python -m mesharray torchrun --hosts tcp://node1:26600,tcp://node2:26600 --nproc-per-node 2 examples/ddp_train.py

From a script, on any process mesh (which stays usable afterwards)::

    procs = ma.proc_mesh(procs=2)
    codes = ma.spmd.run(procs, "examples/ddp_train.py", args=["--steps", "20"])

Every way prints the same loss and the same digest of the final weights.
``--save PATH`` writes them (rank 0) with ``torch.save``.
"""

from __future__ import annotations

import argparse
import hashlib
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--save", default=None, help="write the final weights here (rank 0)")
    args = parser.parse_args()

    dist.init_process_group("gloo")  # env:// : RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the launcher
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])

    torch.manual_seed(0)  # the same initial weights everywhere (DDP also broadcasts rank 0's)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of the data

    for step in range(args.steps):
        x = torch.randn(args.batch, 8, generator=data)
        y = torch.sin(x.sum(dim=1, keepdim=True))
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()  # gradients are averaged over the ranks here
        opt.step()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.6f}", flush=True)

    if rank == 0:
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
        print(f"world {world} (local rank {local_rank}): final weights sha256 {digest[:16]}", flush=True)
        if args.save:
            torch.save(model.state_dict(), args.save)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
