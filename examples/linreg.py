"""Data-parallel linear regression on a mesh of processes, checked against plain NumPy.

Each of 4 worker processes holds a shard of the data as a distributed
MeshArray; every step computes the local gradient on the workers and averages
it across ranks with ``sum(axis="procs")`` (a shared-memory collective), then
updates the weights at the controller. The same loop in one process with NumPy
prints the same numbers.

    python examples/linreg.py
"""

import numpy as np

import mesharray as ma

PROCS, ROWS, DIM, STEPS, LR = 4, 512, 8, 50, 0.1


def make_data(seed: int = 0):
    rng = np.random.default_rng(seed)
    w_true = rng.standard_normal(DIM)
    X = rng.standard_normal((PROCS, ROWS, DIM))
    y = X @ w_true + 0.01 * rng.standard_normal((PROCS, ROWS))
    return X, y, w_true


def numpy_reference(X, y):
    # the same computation in one process: per-shard gradients, summed in rank order
    w = np.zeros(DIM)
    losses = []
    for _ in range(STEPS):
        resid = X @ w - y                                   # (PROCS, ROWS)
        grad = np.einsum("prd,pr->pd", X, resid).sum(axis=0) / (PROCS * ROWS)
        losses.append(float((resid**2).sum() / (PROCS * ROWS)))
        w = w - LR * grad
    return w, losses


def mesh_run(X, y):
    with ma.proc_mesh(hosts=1, procs=PROCS) as procs:
        Xd = procs.from_numpy(X[None])                      # shape (hosts=1, procs=4, ROWS, DIM)
        yd = procs.from_numpy(y[None])
        w = np.zeros(DIM)
        losses = []
        for _ in range(STEPS):
            resid = Xd @ w - yd                             # on the workers: (1, 4, ROWS)
            grad_local = procs.apply(lambda x, r: x.T @ r, Xd, resid)
            grad = grad_local.sum(axis="procs").fetch().to_numpy()[0] / (PROCS * ROWS)
            loss = (resid * resid).sum().fetch().to_numpy() / (PROCS * ROWS)
            losses.append(float(loss))
            w = w - LR * grad
        return w, losses


def main() -> None:
    X, y, w_true = make_data()
    w_np, l_np = numpy_reference(X, y)
    w_ma, l_ma = mesh_run(X, y)
    for step in (0, 1, 2, 10, STEPS - 1):
        print(f"step {step:3d}  loss numpy {l_np[step]:.6f}  mesh {l_ma[step]:.6f}")
    print("weights numpy:", np.round(w_np, 6))
    print("weights mesh: ", np.round(w_ma, 6))
    print("true weights: ", np.round(w_true, 6))
    assert np.allclose(w_np, w_ma, rtol=1e-9, atol=1e-12), "mesh and numpy runs disagree"
    print("same numbers: yes")


if __name__ == "__main__":
    main()
