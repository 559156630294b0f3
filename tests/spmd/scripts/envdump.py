"""Writes what this rank sees (torchrun's variables, sys.argv, __file__, its pid) to OUT/rank<RANK>.json, then
acts as asked: ``--sleep S`` waits, ``--exit N`` calls sys.exit(N) on rank 0, ``--raise`` raises on rank 1,
``--os-exit N`` calls os._exit(N) on rank 1."""

import json
import os
import sys
import time

VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
        "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS", "SPMD_TEST_VAR")

out, args = sys.argv[1], sys.argv[2:]
rank = int(os.environ["RANK"])
rec = {"env": {k: os.environ.get(k) for k in VARS}, "argv": sys.argv, "file": __file__, "pid": os.getpid(),
       "name": __name__}
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(rec, f)
print(f"rank {rank} of {os.environ['WORLD_SIZE']} wrote its record", flush=True)
if "--exit" in args and rank == 0:
    sys.exit(int(args[args.index("--exit") + 1]))
if "--raise" in args and rank == 1:
    raise ValueError(f"rank {rank} raised on purpose")
if "--os-exit" in args and rank == 1:
    os._exit(int(args[args.index("--os-exit") + 1]))
if "--sleep" in args:
    time.sleep(float(args[args.index("--sleep") + 1]))
