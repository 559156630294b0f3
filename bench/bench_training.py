"""A whole training step from the controller next to torch DDP (gloo), same model, same data, same run.

The same data-parallel MLP on 2 ranks, trained three ways from the same
initial weights, each rank its own shard of the batch:

- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` over gloo in two
  spawned processes, ``SGD(lr)``, MSE loss: the SPMD peer;
- ``op by op``: the controller issues every op, as the README teaches:
  weights are torch-engine MeshArrays that require grad,
  ``loss = torch.mean((model(xs, *ws) - ys) ** 2)``, ``loss.backward()``,
  ``w - lr * w.grad.mean(axis="procs", keepdims=True)``;
- ``captured``: the same step through ``ma.function`` (recorded at its first
  call, replayed as one message per rank after).

A step ends when a value of its result is known at the controller (one
element of the new weights fetched; for DDP, read on rank 0); the figure is
the median over steps 4 to ``--steps``. The final weights of the three are
compared (max abs difference against DDP's). Also: the controller's CPU per
op (``time.thread_time`` over a step, divided by the ops it issues).

    python bench/bench_training.py                    # both models, 30 steps
    python bench/bench_training.py --model small --steps 60 --rounds 3
    python bench/bench_training.py --interleaved 10 --rounds 12   # side by side, in chunks of 10 steps

With ``--interleaved`` the three run side by side in one run, a chunk of steps
of each in turn, and each ratio is of adjacent chunks: on a shared VM whose
speed drifts from minute to minute, runs seconds apart differ more than the
three do.

Models (per rank): small 32->64->8, batch 32; medium 256->512->512->64, batch 256.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MODELS = {"small": ((32, 64, 8), 32), "medium": ((256, 512, 512, 64), 256)}
LR = 0.05


def problem(model: str, seed: int = 0) -> tuple:
    sizes, batch = MODELS[model]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, batch, sizes[0])).astype("float32")
    y = rng.standard_normal((2, batch, sizes[-1])).astype("float32")
    params = []
    for a, b in zip(sizes[:-1], sizes[1:]):  # nn.Linear's layout: weight (out, in), bias (out,)
        params.append((rng.standard_normal((b, a)) / np.sqrt(a)).astype("float32"))
        params.append(np.zeros(b, dtype="float32"))
    return x, y, params


def mlp(x, *ps):
    """The model, as torch calls: the same code runs on tensors and on MeshArrays of them."""
    import torch
    import torch.nn.functional as F

    n = len(ps) // 2
    for i in range(n):
        x = F.linear(x, ps[2 * i], ps[2 * i + 1])
        if i < n - 1:
            x = torch.relu(x)
    return x


# --- DDP (gloo), the peer ------------------------------------------------------------


def _ddp_rank(rank: int, model: str, steps: int, port: int, q, cmds=None) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    x, y, params = problem(model)
    layers = []
    for i in range(0, len(params), 2):
        lin = torch.nn.Linear(params[i].shape[1], params[i].shape[0])
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(params[i]))
            lin.bias.copy_(torch.from_numpy(params[i + 1]))
        layers += [lin, torch.nn.ReLU()]
    net = DDP(torch.nn.Sequential(*layers[:-1]))
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    xs, ys = torch.from_numpy(x[rank]), torch.from_numpy(y[rank])

    def run(n: int) -> list:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(net(xs), ys)
            loss.backward()
            opt.step()
            float(net.module[0].weight[0, 0].detach())  # the step's result known here
            times.append(time.perf_counter() - t0)
        return times

    if cmds is None:
        times = run(steps)
    else:  # (interleaved: a chunk of steps per command, until None)
        times = []
        while (n := cmds.get()) is not None:
            q.put((rank, run(n), None))
    final = [p.detach().numpy().copy() for p in net.module.parameters()]
    q.put((rank, times, final))
    dist.destroy_process_group()


def run_ddp(model: str, steps: int) -> tuple[float, list]:
    import socket

    import torch.multiprocessing as tmp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = tmp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_ddp_rank, args=(r, model, steps, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((r, (t, f)) for r, t, f in (q.get(timeout=600) for _ in procs))
    for p in procs:
        p.join(60)
    times = got[0][0]
    return statistics.median(times[3:]) * 1e3, got[0][1]


# --- mesharray ---------------------------------------------------------------------------


def mesharray_setup(procs, model: str) -> tuple:
    """``(xs, ys, ws, train_step)`` of ``model`` on a 2-process mesh: each rank its shard, the weights
    replicated, and the step the README teaches (also ``bench/step_costs.py``'s)."""
    import torch

    x, y, params = problem(model)
    xs = procs.from_numpy(x[None], engine="torch")
    ys = procs.from_numpy(y[None], engine="torch")
    ws = [procs.from_numpy(np.broadcast_to(p, (1, 2) + p.shape).copy(), engine="torch").requires_grad_()
          for p in params]

    def train_step(xs, ys, *ws):
        loss = torch.mean((mlp(xs, *ws) - ys) ** 2)
        loss.backward()
        return [(w - LR * w.grad.mean(axis="procs", keepdims=True)).detach().requires_grad_() for w in ws]

    return xs, ys, ws, train_step


def run_mesharray(model: str, steps: int, capture: bool) -> tuple[float, list, float]:
    """(ms per step, final weights, controller CPU per op in us)."""
    import mesharray as ma
    from mesharray.darray import data_context

    with ma.proc_mesh(procs=2) as procs:
        xs, ys, ws, train_step = mesharray_setup(procs, model)
        step = ma.function(train_step) if capture else train_step
        ctx = data_context(procs)
        times, cpu, ops = [], [], 0
        for _ in range(steps):
            t0 = time.perf_counter()
            c0 = time.thread_time()
            n0 = ctx.new_id()
            ws = step(xs, ys, *ws)
            ops = ctx.new_id() - n0 - 1  # (every op mints one block id)
            cpu.append(time.thread_time() - c0)
            float(np.asarray(ws[0][0, 0, 0, 0].fetch()).reshape(-1)[0])
            times.append(time.perf_counter() - t0)
        final = [np.asarray(w.fetch())[0, 0] for w in ws]
    return statistics.median(times[3:]) * 1e3, final, statistics.median(cpu[3:]) * 1e6 / max(ops, 1)


class _DDP:
    """Two DDP ranks that run chunks of steps on command (:func:`interleaved`)."""

    def __init__(self, model: str) -> None:
        import socket

        import torch.multiprocessing as tmp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = tmp.get_context("spawn")
        self.q = ctx.Queue()
        self.cmds = [ctx.Queue() for _ in range(2)]
        self.procs = [ctx.Process(target=_ddp_rank, args=(r, model, 0, port, self.q, self.cmds[r])) for r in range(2)]
        for p in self.procs:
            p.start()

    def run(self, n: int) -> list:
        for c in self.cmds:
            c.put(n)
        got = dict((r, t) for r, t, _ in (self.q.get(timeout=600) for _ in self.procs))
        return got[0]

    def close(self) -> list:
        for c in self.cmds:
            c.put(None)
        got = dict((r, f) for r, _, f in (self.q.get(timeout=600) for _ in self.procs))
        for p in self.procs:
            p.join(60)
        return got[0]


def interleaved(model: str, rounds: int, chunk: int) -> list[tuple]:
    """The three side by side in one run: a chunk of ``chunk`` steps of each in turn (DDP, op by op,
    captured; the order rotates each round), ``rounds`` times, after a warm-up chunk of each. Per
    round: ``(ddp ms, op by op ms, captured ms, controller us per op)``, each the median of its chunk;
    and, last, the max abs difference of the final weights. On a machine whose speed drifts from
    minute to minute (a shared VM), a ratio of adjacent chunks is steadier than one of runs
    seconds apart."""
    import mesharray as ma
    from mesharray.darray import data_context

    ddp = _DDP(model)
    try:
        with ma.proc_mesh(procs=2) as p1, ma.proc_mesh(procs=2) as p2:
            meshes = []
            for procs, capture in ((p1, False), (p2, True)):
                xs, ys, ws, train_step = mesharray_setup(procs, model)
                meshes.append({"xs": xs, "ys": ys, "ws": ws, "ctx": data_context(procs),
                               "step": ma.function(train_step) if capture else train_step})

            def run_ma(m: dict, n: int) -> tuple[list, float]:
                times, cpu, ops = [], [], 1
                for _ in range(n):
                    t0 = time.perf_counter()
                    c0 = time.thread_time()
                    n0 = m["ctx"].new_id()
                    m["ws"] = m["step"](m["xs"], m["ys"], *m["ws"])
                    ops = max(1, m["ctx"].new_id() - n0 - 1)
                    cpu.append(time.thread_time() - c0)
                    float(np.asarray(m["ws"][0][0, 0, 0, 0].fetch()).reshape(-1)[0])
                    times.append(time.perf_counter() - t0)
                return times, statistics.median(cpu) * 1e6 / ops

            runs = {"ddp": lambda n: (ddp.run(n), 0.0), "op": lambda n: run_ma(meshes[0], n),
                    "cap": lambda n: run_ma(meshes[1], n)}
            order = ["ddp", "op", "cap"]
            for k in order:
                runs[k](chunk)  # (warm-up: groups, plans, the capture's record)
            rows = []
            for r in range(rounds):
                got = {}
                for k in order[r % 3:] + order[:r % 3]:
                    got[k] = runs[k](chunk)
                rows.append((statistics.median(got["ddp"][0]) * 1e3, statistics.median(got["op"][0]) * 1e3,
                             statistics.median(got["cap"][0]) * 1e3, got["op"][1]))
            ours = [[np.asarray(w.fetch())[0, 0] for w in m["ws"]] for m in meshes]
    finally:
        wd = ddp.close()
    diff = max(max(float(np.abs(a - b).max()) for a, b in zip(wd, w)) for w in ours)
    rows.append((diff,))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["small", "medium", "both"], default="both")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--interleaved", type=int, default=0, metavar="CHUNK",
                    help="run the three side by side in chunks of CHUNK steps, --rounds rounds (see interleaved)")
    args = ap.parse_args(argv)
    models = ["small", "medium"] if args.model == "both" else [args.model]
    if args.interleaved:
        print(f"{'model':8s} {'ddp ms':>8s} {'op by op':>9s} {'ratio':>6s} {'captured':>9s} {'ratio':>6s} "
              f"{'ctl us/op':>9s}   (each the median of a chunk of {args.interleaved} steps)")
        for model in models:
            rows = interleaved(model, args.rounds, args.interleaved)
            *rows, (diff,) = rows
            for d, e, c, ce in rows:
                print(f"{model:8s} {d:8.2f} {e:9.2f} {e / d:6.2f} {c:9.2f} {c / d:6.2f} {ce:9.1f}", flush=True)
            med = [statistics.median(x) for x in zip(*[(e / d, c / d, ce) for d, e, c, ce in rows])]
            print(f"{model:8s} median ratio: op by op {med[0]:.2f}, captured {med[1]:.2f}; ctl {med[2]:.1f} us/op; "
                  f"max |dw| {diff:.1e}", flush=True)
        return
    print(f"{'model':8s} {'ddp ms':>8s} {'op by op':>9s} {'ratio':>6s} {'captured':>9s} {'ratio':>6s} "
          f"{'ctl us/op':>9s} {'max |dw|':>9s}")
    for model in models:
        for _ in range(args.rounds):
            d, wd = run_ddp(model, args.steps)
            e, we, ce = run_mesharray(model, args.steps, capture=False)
            c, wc, _ = run_mesharray(model, args.steps, capture=True)
            diff = max(max(float(np.abs(a - b).max()) for a, b in zip(wd, w)) for w in (we, wc))
            print(f"{model:8s} {d:8.2f} {e:9.2f} {e / d:6.2f} {c:9.2f} {c / d:6.2f} "
                  f"{ce:9.1f} {diff:9.1e}", flush=True)


# --- under pytest (make bench) -------------------------------------------------------------


def test_training_step_small_captured(benchmark):
    import torch

    import mesharray as ma

    x, y, params = problem("small")
    with ma.proc_mesh(procs=2) as procs:
        xs = procs.from_numpy(x[None], engine="torch")
        ys = procs.from_numpy(y[None], engine="torch")
        ws = [procs.from_numpy(np.broadcast_to(p, (1, 2) + p.shape).copy(), engine="torch").requires_grad_()
              for p in params]

        @ma.function
        def step(xs, ys, *ws):
            loss = torch.mean((mlp(xs, *ws) - ys) ** 2)
            loss.backward()
            return [(w - LR * w.grad.mean(axis="procs", keepdims=True)).detach().requires_grad_() for w in ws]

        state = {"ws": ws}

        def one():
            state["ws"] = step(xs, ys, *state["ws"])
            float(np.asarray(state["ws"][0][0, 0, 0, 0].fetch()).reshape(-1)[0])

        benchmark(one)


if __name__ == "__main__":
    main()
