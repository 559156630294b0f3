"""The controller's side of log forwarding, without processes: LogSink's lines, rows and aggregation; counters."""

from __future__ import annotations

import doctest

from mesharray.runtime import logs
from mesharray.runtime.counters import Counters
from mesharray.runtime.logs import LogSink, compress_labels


def test_docstring_examples_run():
    result = doctest.testmod(logs, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_identical_lines_of_several_ranks_print_once(capsys):
    sink = LogSink(aggregate=True, window=60.0)  # (emitted by flush() here, not by the timer)
    for rank in range(4):
        sink.write(f"procs={rank}", 1, b"step done\nrank-own ", rank=rank)
        sink.write(f"procs={rank}", 1, f"{rank}\n".encode(), rank=rank)
    sink.flush()
    out = capsys.readouterr().out.splitlines()
    assert out == ["[procs=0:4] step done"] + [f"[procs={r}] rank-own {r}" for r in range(4)]
    rows = sink.rows()
    assert len(rows) == 8 and {r[3] for r in rows} == {"stdout"}
    assert [r[5] for r in rows if r[1] == 2] == ["step done", "rank-own 2"]


def test_a_rank_keeps_its_order(capsys):
    # rank 0 prints b then a; rank 1 prints a: rank 1's a may not join an entry before rank 0's b
    sink = LogSink(aggregate=True, window=60.0)
    sink.write("procs=0", 1, b"a\nb\n", rank=0)
    sink.write("procs=1", 1, b"b\na\n", rank=1)
    sink.flush()
    assert capsys.readouterr().out.splitlines() == ["[procs=0] a", "[procs=0:2] b", "[procs=1] a"]


def test_without_aggregation_every_line_prints_as_it_comes(capsys):
    sink = LogSink(aggregate=False)
    sink.write("procs=0", 2, b"Traceback (most recent call last):\n", rank=0)
    sink.write("procs=1", 2, b"Traceback (most recent call last):\n", rank=1)
    assert capsys.readouterr().err.splitlines() == ["[procs=0] Traceback (most recent call last):",
                                                   "[procs=1] Traceback (most recent call last):"]
    assert [r[4] for r in sink.rows()] == ["ERROR", "ERROR"]  # the level a traceback on stderr gets


def test_a_partial_line_prints_at_flush(capsys):
    sink = LogSink(aggregate=True, window=60.0)
    sink.write("procs=3", 1, b"no newline yet", rank=3)
    assert sink.rows() == []
    sink.flush()
    assert capsys.readouterr().out == "[procs=3] no newline yet\n"


def test_labels_that_do_not_parse_are_joined():
    assert compress_labels(["a", "b"]) == "a,b"
    assert compress_labels(["procs=0", "hosts=0"]) == "procs=0,hosts=0"


def test_counters_as_dict():
    c = Counters()
    c.tally[0] += 3
    c.tally[1] += 1
    c.spawns += 2
    assert c.as_dict() == {"replies": 3, "errors": 1, "deaths": 0, "log_bytes": 0, "spawns": 2, "unresponsive": 0}


def test_a_synced_connection_leaves_every_frame_to_its_send(monkeypatch):
    # the notebook mode: a reply waits for the worker's output; the compiled paths write small
    # frames with write_frame, which must then leave them to the replaced send
    import socket

    from mesharray._core import pack_frame
    from mesharray.transport.connection import SMALL_FRAME, Connection

    a, b = socket.socketpair()
    conn = Connection(a, name="synced")
    drained = []
    monkeypatch.setattr(logs, "_pipes", [(-1, 1)])  # (as if this process forwarded its output)
    monkeypatch.setattr(logs, "drain_output", lambda: drained.append(1))
    try:
        frame = pack_frame(4, 0, 7, 0, 0, [b"ok"], SMALL_FRAME, conn.limit)[1]
        assert conn.write_frame(frame) is True  # (not synced: written at once)
        logs.sync_replies(conn, 4)
        assert conn.write_frame(frame) is False  # (left to send, which drains the output first)
        conn.send(4, 0, 8, 0, 0, [b"ok"])
        assert drained == [1]
        assert len(b.recv(1024)) >= 2 * len(frame)
    finally:
        conn.close()
        b.close()
