"""mesharray quick start: a mesh of processes is an array.

Run it with ``make demo`` (or ``python examples/quickstart.py``).
"""

import mesharray as ma


class Counter(ma.Actor):
    def __init__(self, start: int):
        self.value = start

    @ma.endpoint
    def incr(self, by: int = 1) -> None:
        self.value += by

    @ma.endpoint
    def get(self) -> int:
        return self.value

    @ma.endpoint
    def fail(self) -> None:
        raise ValueError(f"counter at {ma.current_rank()} refuses")


def main() -> None:
    with ma.proc_mesh(hosts=1, procs=4) as procs:        # 4 local worker processes
        counters = procs.spawn("counters", Counter, 0)   # an ActorMesh, {hosts: 1, procs: 4}
        print("spawned", counters)

        counters.incr.broadcast()                        # fire and forget, ordered per sender
        vals = counters.get.call().get()                 # MeshArray with the mesh's dims
        print("values:", vals.tolist(), "sum:", int(vals.sum()))

        counters[0, 1:3].incr.call().get()               # positional, NumPy-style indexing
        last = counters.slice(procs=-1).get.call_one().get()   # named indexing, negative index
        print("after incrementing procs 1:3 ->", counters.get.call().get().tolist(), "last:", last)

        try:
            counters[0, 2].fail.call_one().get()
        except ma.ActorError as e:                       # the remote exception, type preserved
            print(f"caught {type(e.exception).__name__} from rank {e.rank}: {e.exception}")

        totals = counters.get.call().get()
        print("reduced over procs:", totals.sum(axis="procs").tolist(), "max:", int(totals.max()))
    print("stopped:", procs.stopped)


if __name__ == "__main__":
    main()
