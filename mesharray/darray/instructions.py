"""The instruction schema of distributed arrays: what the controller sends, what a worker runs.

Both sides import these types, so the wire format is written down once. A
*program* is a list of instructions; the controller sends it to the ranks that
hold the blocks involved (fire-and-forget, ordered per sender), and each
rank's :class:`~mesharray.darray.worker.DataActor` runs it in order.

Blocks are named by integer ids minted by the controller; the same id names
the block of one array on every rank holding one. An instruction that makes a
block (``out``) and fails keeps its exception as that block's failure, raised
when the block is used or fetched; :class:`Fetch`, :class:`SetItem` and
:class:`Collective` report differently (see the worker).

Operands of elementwise ops and ``apply`` are :class:`BlockRef` (a block of
this rank), :class:`PerRank` (a value per global rank) or :class:`Value` (the
same value everywhere).

These are ``NamedTuple``s (fields by name in the code). On the wire each is
a plain tuple ``(code, *fields)`` (:data:`CODES`, :func:`encode`, :func:`decode`): a named
tuple pickled by reference names its class, which the sender writes and the receiver looks
up again for every instruction, and a tiny reduction in a loop would pay that every step.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Union

from ..errors import MeshArrayError

__all__ = [
    "CODES",
    "InputFailed",
    "decode",
    "encode",
    "map_ids",
    "block_ids",
    "remap",
    "AsType",
    "BlockRef",
    "Collective",
    "Copy",
    "Elementwise",
    "Fetch",
    "Free",
    "GetItem",
    "Instruction",
    "MAKES_BLOCK",
    "Move",
    "New",
    "Operand",
    "Planned",
    "PerRank",
    "Put",
    "Reduce",
    "Reshape",
    "SetItem",
    "Value",
]


class InputFailed(MeshArrayError):
    """Kept by the members of a collective whose input failed on other ranks.

    The controller, on meeting it, asks ``ranks[0]`` for its block ``bid``,
    which raises the original failure (or the next link of a chain of them).
    """

    def __init__(self, ranks: list[int], bid: int, token: str | None = None) -> None:
        self.ranks = [int(r) for r in ranks]
        self.bid = int(bid)
        #: the mesh (data-context token) of ``ranks``, when not the failing block's own
        self.token = token
        super().__init__(f"the input of this collective or move failed on rank(s) {self.ranks}")

    def __reduce__(self) -> tuple:
        return (InputFailed, (self.ranks, self.bid, self.token))


# -- operands ------------------------------------------------------------------------


class BlockRef(NamedTuple):
    """This rank's block ``bid``."""

    bid: int


class PerRank(NamedTuple):
    """A value per global rank: ``values[rank]``."""

    values: dict


class Value(NamedTuple):
    """The same value on every rank."""

    value: Any


Operand = Union[BlockRef, PerRank, Value]


# -- instructions that make block ``out`` ---------------------------------------------


class New(NamedTuple):
    """A fresh block: ``kind`` is zeros, ones, empty, full (``extra``: the value),
    rand (``extra``: seed or None; rank r uses seed + r), arange, or rank (filled
    with the rank)."""

    out: int
    kind: str
    shape: tuple
    dtype: str
    engine: str
    extra: Any = None


class Put(NamedTuple):
    """A block from a host value (``value`` is an operand, usually :class:`PerRank` or :class:`Value`)."""

    out: int
    value: Operand
    engine: str


class Elementwise(NamedTuple):
    """``numpy.<name>(*operands, **kwargs)`` (or the engine's op; ``matmul`` included)."""

    out: int
    name: str
    operands: list
    kwargs: dict


class Apply(NamedTuple):
    """``fn(*operands)``, a user function run on each rank's blocks."""

    out: int
    fn: Any
    operands: list


class Reduce(NamedTuple):
    """Reduce block ``src`` over its local ``axes`` with ``op`` (sum, prod, min, max, mean, any, all)."""

    out: int
    src: int
    op: str
    axes: tuple
    keepdims: bool
    dtype: str | None


class AsType(NamedTuple):
    out: int
    src: int
    dtype: str


class Reshape(NamedTuple):
    out: int
    src: int
    shape: tuple


class GetItem(NamedTuple):
    """A copy of ``src[key]`` (a key over local axes only)."""

    out: int
    src: int
    key: tuple


class Copy(NamedTuple):
    out: int
    src: int


class Collective(NamedTuple):
    """A collective among the ranks of each group; this rank's result is block ``out``.

    ``op`` is a reduction (``"sum"``, ``"prod"``, ``"min"``, ``"max"``, ``"mean"``)
    for an allreduce, or ``"allgather"``, ``"broadcast:ROOT"``,
    ``"reduce_scatter:OP"``. ``groups`` are the groups of
    :func:`~mesharray.reduction_plan` (global ranks, the root first); a rank
    takes part in the one holding it. ``backend`` is None (MPI under mpirun,
    else shared memory) or ``"torch"``; ``torch_init`` is ``(init_method,
    world_size)`` for torch; ``pids`` maps ranks to process ids (a member that
    never joins is noticed); ``hosts``, only when the members span hosts, maps
    ranks to ``(memory domain, data-plane address)`` (a hierarchical group). Failures are kept as ``out``'s, never raised out
    of the program: the collective is sent fire-and-forget.
    """

    out: int
    src: int
    op: str
    groups: list
    backend: str | None
    dtype: str
    torch_init: tuple = ()
    pids: dict | None = None
    hosts: dict | None = None


class Move(NamedTuple):
    """Blocks travelling worker to worker: each group's sender sends its block ``src`` to the others,
    which make it their block ``out``.

    A *participant* is a process, named by an id: its global rank when the move
    stays in one process mesh, else a number that ``ids`` maps from
    ``(mesh token, rank)`` (a move to another process mesh). ``groups`` are
    lists of participant ids, the sender first, in the one order every
    participant runs them (by sender: a process that both sends and receives
    never waits on a peer that waits on it). ``copies``: participants that make
    ``out`` from their own ``src`` (the block stays where it is). ``shape``,
    ``dtype`` and ``engine`` describe the block. ``pids`` maps ids to process
    ids (a member that dies is noticed); ``hosts``, only when the participants
    span hosts, maps ids to ``(memory domain, data-plane address)``; ``mpi``:
    the participants are ranks of one mesh launched under mpirun. ``token``
    names the move's groups (the mesh's token, or both meshes'). Failures are
    kept as ``out``'s.
    """

    out: int
    src: int
    groups: list
    copies: list
    ids: dict
    shape: tuple
    dtype: str
    engine: str
    pids: dict
    hosts: dict | None
    mpi: bool
    token: str


class Moves(NamedTuple):
    """Consecutive :class:`Move` s (wire tuples) that share their groups, participants and token, merged
    by the controller: their blocks of at most :data:`INLINE_MOVE` bytes each travel in one broadcast
    per group (a model's weights sent to another mesh each step)."""

    moves: list


#: the largest block (bytes) a move on one host sends inside its header's broadcast; moves of such
#: blocks to the same ranks are merged (:class:`Moves`)
INLINE_MOVE = 64 << 10


class Planned(NamedTuple):
    """A :class:`Collective` whose fields other than ``out`` and ``src`` travel as ``plan``:
    ``pickle.dumps((op, groups, backend, dtype, torch_init, pids, hosts))``, made once per
    reduction plan by the controller, so every op of one plan sends the same bytes and a
    worker unpickles and prepares them once (its group, its reduction kernel); ``fetch``:
    the ranks that return ``out`` right after (as a :class:`Fetch` with those ranks would).

    This is the message of a reduction in a loop (a loss, a norm): its block ids are all
    that changes from one op to the next.
    """

    out: int
    src: int
    plan: bytes
    fetch: tuple = ()
    nbytes: int = 0  # the size of ``src``'s block: what a worker's gradient buckets are cut by


# -- instructions that make no block ---------------------------------------------------


class SetItem(NamedTuple):
    """``block[key] = value`` in place (``value`` an operand)."""

    block: int
    key: tuple
    value: Operand


class Fetch(NamedTuple):
    """Return block ``block`` to the caller (as host memory).

    ``ranks``: only these ranks return it (the others skip it: one program for
    the members of a reduction, of which only the result's holders reply);
    empty: every rank that runs it.
    """

    block: int
    ranks: tuple = ()


class Free(NamedTuple):
    """Drop these blocks (their failures are kept a little longer for chains of errors)."""

    blocks: list


Instruction = Union[New, Put, Elementwise, Apply, Reduce, AsType, Reshape, GetItem, Copy, Collective,
                    Planned, Move, Moves, SetItem, Fetch, Free]

#: the instruction types whose failure is kept as the failure of their ``out`` block
MAKES_BLOCK = (New, Put, Elementwise, Apply, Reduce, AsType, Reshape, GetItem, Copy)

#: the code of each type on the wire
CODES: dict[type, str] = {
    BlockRef: "b", PerRank: "r", Value: "v",
    New: "new", Put: "put", Elementwise: "ew", Apply: "apply", Reduce: "reduce", AsType: "astype",
    Reshape: "reshape", GetItem: "getitem", Copy: "copy", Collective: "coll", Planned: "plan", Move: "move", Moves: "moves",
    SetItem: "setitem",
    Fetch: "fetch", Free: "free",
}
_BY_CODE: dict[str, Any] = {code: cls for cls, code in CODES.items()}
_OPERANDS = (BlockRef, PerRank, Value)


def _wire_operand(a: Any) -> Any:
    return (CODES[type(a)], *a) if isinstance(a, _OPERANDS) else a


def encode(program: list) -> list:
    """A program as it travels: each instruction a plain ``(code, *fields)`` tuple (operands too)."""
    out = []
    for ins in program:
        if isinstance(ins, (Elementwise, Apply)):
            ins = ins._replace(operands=[_wire_operand(a) for a in ins.operands])
        elif isinstance(ins, Put):
            ins = ins._replace(value=_wire_operand(ins.value))
        elif isinstance(ins, SetItem):
            ins = ins._replace(value=_wire_operand(ins.value))
        out.append((CODES[type(ins)], *ins))
    return out


def decode(raw: tuple) -> Any:
    """The instruction of a wire tuple (its operands stay wire tuples: ``("b", bid)``, ``("r", {...})``, ``("v", x)``)."""
    return _BY_CODE[raw[0]]._make(raw[1:])


# -- block ids in wire instructions (captured steps: see mesharray.darray.function) --------

#: per code of a wire instruction: positions of block ids, of operand lists, of id lists
_IDS = {"new": (1,), "put": (1,), "ew": (1,), "apply": (1,), "reduce": (1, 2), "astype": (1, 2),
        "reshape": (1, 2), "getitem": (1, 2), "copy": (1, 2), "coll": (1, 2), "plan": (1, 2), "kplan": (1, 2),
        "move": (1, 2), "setitem": (1,)}
_OPERAND_AT = {"ew": 3, "apply": 3, "setitem": 3, "put": 2}
_LISTS = {"free": 1, "check": 1}


def block_ids(ins: tuple) -> list:
    """Every block id ``ins`` names (its fields by code: :data:`_IDS`), as :func:`map_ids` visits them."""
    code = ins[0]
    if code == "effect":
        return block_ids(ins[1])
    out = [ins[i] for i in _IDS.get(code, ())]
    k = _OPERAND_AT.get(code)
    if k is not None:
        v = ins[k]
        if type(v) is list:
            out += [o[1] for o in v if o[0] == "b"]
        elif type(v) is tuple and v and v[0] == "b":
            out.append(v[1])
    k = _LISTS.get(code)
    if k is not None:
        out += ins[k]
    return out


def map_ids(ins: tuple, f: Callable[[Any], Any]) -> tuple:
    """``ins`` with every block id ``b`` replaced by ``f(b)`` (its fields by code: :data:`_IDS`)."""
    code = ins[0]
    if code == "effect":  # (an op run for its effect: the ids of the op it wraps)
        return ("effect", map_ids(ins[1], f))
    out = list(ins)
    for i in _IDS.get(code, ()):
        out[i] = f(out[i])
    k = _OPERAND_AT.get(code)
    if k is not None:
        v = out[k]
        if type(v) is list:
            out[k] = [(o[0], f(o[1])) if o[0] == "b" else o for o in v]
        elif type(v) is tuple and v and v[0] == "b":
            out[k] = ("b", f(v[1]))
    k = _LISTS.get(code)
    if k is not None:
        out[k] = [f(b) for b in out[k]]
    return tuple(out)


def remap(program: list, base: int, args: list) -> list:
    """A captured step's program with its symbolic ids filled in: ``("i", k)`` is block ``base + k``,
    ``("a", j)`` the block of argument ``j`` (a worker's side of a replay: see :mod:`.function`)."""
    def f(b: Any) -> Any:
        if type(b) is tuple:
            return base + b[1] if b[0] == "i" else args[b[1]]
        return b
    return [map_ids(ins, f) for ins in program]
