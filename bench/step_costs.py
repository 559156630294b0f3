"""What a small training step costs in pickling, the buckets' look-ahead, and an op's dispatch, measured in this process.

Two figures of ``bench/README.md`` ("Whole programs"). For an A/B of two trees
run a copy of this script from each (it puts its own tree first on ``sys.path``):

- ``--pickles``: the small model of ``bench_training.py`` trained op by op on
  2 ranks; the messages the controller pickles during steps 50 to 60 are kept,
  then each is pickled again (``framing``'s pickler) and unpickled
  (``pickle.loads``, what each worker does with it) 200 times: µs per step,
  and the bytes per step sent to each rank.
- ``--prepare``: ``overlap.prepare`` on the program a rank gets for one small
  step with 4 parameters, 20,000 times, with no group to make (its look-ahead
  only): µs per backward.
- ``--dispatch``: the controller's CPU (``time.thread_time``) per op of a few ops
  of a training step on small torch-engine blocks of a 2-rank mesh (``F.linear``,
  ``torch.relu``, ``x * 2.0``, ...), issued 300 at a time and not waited for: the
  best of 25 batches (the least disturbed by the rest of the machine).

- ``--bytecodes``: the Python bytecodes the controller runs for one small step
  issued op by op (``bench_training.py``'s, steps 31 to 35, ``sys.settrace``
  with opcode events), by line of the step and in all: the measure that does not
  move with the machine's load.

    python bench/step_costs.py --pickles
    python bench/step_costs.py --prepare
    python bench/step_costs.py --dispatch
    python bench/step_costs.py --bytecodes
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))


def pickles(rounds: int = 200) -> None:
    import numpy as np
    from bench_training import mesharray_setup

    import mesharray as ma
    from mesharray.transport import framing

    kept: list = []
    dumps = framing._pickle5

    def keep(obj, buffers):
        kept.append(obj)
        return dumps(obj, buffers)

    with ma.proc_mesh(procs=2) as procs:
        xs, ys, ws, step = mesharray_setup(procs, "small")
        for i in range(60):
            if i == 50:
                framing._pickle5 = keep
            ws = step(xs, ys, *ws)
            float(np.asarray(ws[0][0, 0, 0, 0].fetch()).reshape(-1)[0])
        framing._pickle5 = dumps
    steps = 10
    t_dump = t_load = 0.0
    size = 0
    for obj in kept:
        data = dumps(obj, [])
        size += len(data)
        t = time.perf_counter()
        for _ in range(rounds):
            dumps(obj, [])
        t_dump += (time.perf_counter() - t) / rounds
        t = time.perf_counter()
        for _ in range(rounds):
            pickle.loads(data)
        t_load += (time.perf_counter() - t) / rounds
    print(f"{ma.__file__}: {len(kept)} messages over {steps} steps; per step: {size / steps:.0f} bytes, "
          f"pickling {t_dump / steps * 1e6:.0f} us (controller), unpickling {t_load / steps * 1e6:.0f} us (each worker)")


def prepare(rounds: int = 20000) -> None:
    import mesharray
    from mesharray.darray import overlap
    from mesharray.darray.autograd import grad_of
    from mesharray.darray.blockfn import BlockCall

    plan = pickle.dumps(("mean", [[0, 1]], None, "float32", (), {0: 11, 1: 12}, None), protocol=5)
    fn = BlockCall(len, (), {})
    prog: list = [("apply", 19, fn, [("b", 1), ("b", 2), ("b", 3)]), ("apply", 20, fn, [("b", 19)]),
                  ("apply", 21, fn, [("b", 20), ("b", 4), ("b", 5)]), ("ew", 22, "subtract", [("b", 21), ("b", 6)], {}),
                  ("ew", 23, "power", [("b", 22), ("v", 2)], {}), ("apply", 24, fn, [("b", 23)]),
                  ("effect", ("apply", 25, BlockCall(len, (), {}), [("b", 24)]))]
    base = 26
    for w in (2, 3, 4, 5):  # per parameter: g = w.grad, its mean over the ranks, the update
        g, m, a, b, d = range(base, base + 5)
        prog += [("apply", g, grad_of, [("b", w)]), ("plan", m, g, plan, (), 8192),
                 ("ew", a, "multiply", [("v", 0.05), ("b", m)], {}), ("ew", b, "subtract", [("b", w), ("b", a)], {}),
                 ("apply", d, fn, [("b", b)]), ("apply", d, fn, [("b", d)])]
        base += 5
    prog.append(("free", list(range(19, base))))
    t = time.perf_counter()
    for _ in range(rounds):
        overlap.prepare(prog, 6, lambda b: None, lambda f, s: None, lambda b: None)
    print(f"{mesharray.__file__}: {(time.perf_counter() - t) / rounds * 1e6:.1f} us per prepare "
          f"(a 4-parameter step, no group)")


def dispatch(batches: int = 25, batch: int = 300) -> None:
    import numpy as np
    import torch
    import torch.nn.functional as F

    import mesharray
    import mesharray as ma

    with ma.proc_mesh(procs=2) as p:
        def block(*shape, rg=False):
            a = p.from_numpy(np.ones((1, 2) + shape, "float32"), engine="torch")
            return a.requires_grad_() if rg else a

        x, w, b = block(8, 4), block(5, 4), block(5)
        wg, bg = block(5, 4, rg=True), block(5, rg=True)
        ops = {"F.linear(x, w, b)": lambda: F.linear(x, w, b), "F.linear, w and b requiring grad": lambda: F.linear(x, wg, bg),
               "torch.relu(x)": lambda: torch.relu(x), "x * 2.0": lambda: x * 2.0, "wg * 2.0": lambda: wg * 2.0,
               "x.mean(axis='procs', keepdims=True)": lambda: x.mean(axis="procs", keepdims=True)}
        best = dict.fromkeys(ops, float("inf"))
        for _ in range(batches):
            for name, op in ops.items():
                c0 = time.thread_time()
                for _ in range(batch):
                    op()
                best[name] = min(best[name], (time.thread_time() - c0) / batch)
            p.sync()
    print(mesharray.__file__)
    for name, t in best.items():
        print(f"  {t * 1e6:6.2f} us per op  {name}")


def _small_step(xs, ys, w0, b0, w1, b1):  # (bench_training's step, a statement a line)
    import torch
    import torch.nn.functional as F
    from bench_training import LR
    h = F.linear(xs, w0, b0)
    h = torch.relu(h)
    o = F.linear(h, w1, b1)
    loss = torch.mean((o - ys) ** 2)
    loss.backward()
    out = []
    for w in (w0, b0, w1, b1):
        m = w.grad.mean(axis="procs", keepdims=True)
        out.append((w - LR * m).detach().requires_grad_())
    return out


def _small_fetch(ws):
    import numpy as np

    v = ws[0][0, 0, 0, 0]
    return float(np.asarray(v.fetch()).reshape(-1)[0])


def bytecodes(steps: int = 5) -> None:
    import collections
    import linecache

    from bench_training import mesharray_setup

    import mesharray
    import mesharray as ma

    mine = {_small_step.__code__, _small_fetch.__code__}
    line: list = [None]
    count: collections.Counter = collections.Counter()

    def trace(frame, event, arg):
        if frame.f_code in mine:
            if event == "line":
                line[0] = (frame.f_code.co_filename, frame.f_lineno)
            return trace
        frame.f_trace_opcodes = True
        if event == "opcode":
            count[line[0]] += 1
        return trace

    with ma.proc_mesh(procs=2) as p:
        xs, ys, ws, _ = mesharray_setup(p, "small")
        for _ in range(30):  # (recipes, plans, keys: what a step in a loop finds made)
            ws = _small_step(xs, ys, *ws)
            _small_fetch(ws)
        for _ in range(steps):
            sys.settrace(trace)
            ws = _small_step(xs, ys, *ws)
            _small_fetch(ws)
            sys.settrace(None)
    print(mesharray.__file__)
    for (f, n), k in sorted(count.items(), key=lambda kv: kv[0][1]):
        print(f"  {k / steps:7.0f}  {linecache.getline(f, n).strip()}")
    print(f"  {sum(count.values()) / steps:7.0f}  bytecodes per step at the controller")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pickles", action="store_true")
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--dispatch", action="store_true")
    ap.add_argument("--bytecodes", action="store_true")
    args = ap.parse_args(argv)
    if not (args.pickles or args.prepare or args.dispatch or args.bytecodes):
        ap.error("say what to measure: --pickles, --prepare, --dispatch and/or --bytecodes")
    if args.pickles:
        pickles()
    if args.prepare:
        prepare()
    if args.dispatch:
        dispatch()
    if args.bytecodes:
        bytecodes()


if __name__ == "__main__":
    main()
