"""RL-style weight sync: a trainer mesh trains, a generator mesh runs the newest weights.

Two process meshes on this machine. The trainers each hold a shard of the data
and a replica of a small torch MLP; every step they run forward and
``loss.backward()`` where their blocks live, average the gradients across
ranks (a collective), and update. The new weights then go to the generators
with ``to_mesh`` — worker to worker, never through this script — and the
generators run the policy on their prompts.

At the end the generators' outputs are compared with the same training loop
run in this one process with plain torch.

    python examples/rl_weight_sync.py [steps]
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

import mesharray as ma

N_IN, N_HIDDEN, N_OUT = 8, 32, 4
SHARD, PROMPTS, LR = 64, 16, 0.1


def problem(seed: int = 0) -> tuple:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2 * SHARD, N_IN)).astype("float32")
    a = rng.standard_normal((N_IN, N_OUT)).astype("float32")
    y = np.sin(x @ a).astype("float32")
    params = [(rng.standard_normal((N_IN, N_HIDDEN)) / np.sqrt(N_IN)).astype("float32"),
              np.zeros(N_HIDDEN, dtype="float32"),
              (rng.standard_normal((N_HIDDEN, N_OUT)) / np.sqrt(N_HIDDEN)).astype("float32")]
    prompts = rng.standard_normal((2, PROMPTS, N_IN)).astype("float32")
    return x, y, params, prompts


def policy(x, w1, b1, w2):
    """The model: the same code runs on torch tensors and on MeshArrays of them."""
    return torch.matmul(torch.tanh(torch.matmul(x, w1) + b1), w2)


def reference(steps: int) -> np.ndarray:
    """The same loop in one process: full-batch gradients (the mean of the shards')."""
    x, y, params, prompts = problem()
    ps = [torch.tensor(p, requires_grad=True) for p in params]
    xs, ys = torch.tensor(x).reshape(2, SHARD, N_IN), torch.tensor(y).reshape(2, SHARD, N_OUT)
    for _ in range(steps):
        loss = torch.stack([torch.mean((policy(xs[i], *ps) - ys[i]) ** 2) for i in range(2)]).mean()
        grads = torch.autograd.grad(loss, ps)
        ps = [(p - LR * g).detach().requires_grad_() for p, g in zip(ps, grads)]
    with torch.no_grad():
        return np.stack([policy(torch.tensor(prompts[i]), *ps).numpy() for i in range(2)])


def main(steps: int = 20) -> None:
    x, y, params, prompts = problem()
    with ma.proc_mesh(procs=2) as trainers, ma.proc_mesh(procs=2) as generators:
        # each trainer its own shard of the data; the generators their prompts
        xs = trainers.from_numpy(x.reshape(1, 2, SHARD, N_IN), engine="torch")
        ys = trainers.from_numpy(y.reshape(1, 2, SHARD, N_OUT), engine="torch")
        ps_gen = generators.from_numpy(prompts.reshape(1, 2, PROMPTS, N_IN), engine="torch")
        # the initial weights: made on the first trainer, then fanned out to every trainer
        # worker to worker (its size-1 mesh dim broadcasts), and marked as leaves of autograd
        first = trainers.slice(procs=slice(0, 1))
        ws = [first.from_numpy(p[None, None], engine="torch").to_mesh(trainers).requires_grad_() for p in params]
        for step in range(steps):
            if step == 1:
                t0 = time.perf_counter()  # (the first step also makes the collective groups)
            loss = torch.mean((policy(xs, *ws) - ys) ** 2)    # runs on each trainer's block
            loss.backward()                                    # each trainer's own backward pass
            # gradients averaged across trainers (a collective), then the update, all in the workers
            ws = [(w - LR * w.grad.mean(axis="procs", keepdims=True)).detach().requires_grad_() for w in ws]
            # the new weights go to the generators, worker to worker
            gen_ws = [w.to_mesh(generators) for w in ws]
            out = policy(ps_gen, *gen_ws)                      # the generators act with them
            if step % 5 == 0 or step == steps - 1:
                print(f"step {step:3d}  loss per trainer {np.round(np.asarray(loss).ravel(), 5).tolist()}")
        took = time.perf_counter() - t0
        got = np.asarray(out.fetch())[0]
    want = reference(steps)
    diff = float(np.abs(got - want).max())
    print(f"{(took / max(steps - 1, 1)) * 1e3:.1f} ms a step after the first (forward, backward, allreduce, "
          f"update, weights to the generators, generate)")
    print(f"generator outputs vs one-process torch: max abs diff {diff:.2e}")
    print("same numbers:", "yes" if diff < 1e-4 else "NO")
    if diff >= 1e-4:
        raise SystemExit(1)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
