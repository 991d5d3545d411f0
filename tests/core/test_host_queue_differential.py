"""The compiled host command and queue (``initiator/_queue.pyx``) against their Python reference
(``initiator/queue.py``): the same random sequences of start, finish (of ids in flight, already
finished and never given), get, complete, fail, expire, take_all and count must hand out the
same command ids, write the same SQE bytes, return the same commands, run the same callbacks once
with the same fields, count the same I/O, and leave the same commands in flight in the same
order."""

from __future__ import annotations

import random
from types import ModuleType
from typing import Any

import pytest

from blockd import iostats
from initiator import queue as py_queue
from protocol.commands import flush_command, read_command, write_command, write_zeroes_command

_compiled = pytest.importorskip("initiator._queue", reason="compiled data plane not built")
_counters = pytest.importorskip("blockd._iostats", reason="compiled data plane not built")
COUNTERS = {_compiled: _counters.IoCounters, py_queue: iostats.IoCounters}
"""Each queue counts into its own plane's counters (the compiled one takes no other)."""


def _run(mod: ModuleType, seed: int) -> list[Any]:
    """Every observable result of one random sequence, commands named by creation index."""
    rng = random.Random(seed)
    depth = rng.choice([1, 2, 3, 8, 300])
    q = mod.HostQueue(rng.randrange(4), depth)
    cmds: list[Any] = []
    index: dict[int, int] = {}
    seen: list[Any] = []
    counters = COUNTERS[mod]()
    given: list[int] = []  # every id handed out, in order (finished ones stay: stale ids)

    def name(cmd: Any) -> int | None:
        return None if cmd is None else index[id(cmd)]

    def on_done(cmd: Any, exc: BaseException | None) -> None:
        seen.append(("done", name(cmd), cmd.cid, cmd.status, cmd.dw0, cmd.dw1, cmd.transferred, repr(exc)))

    def some_id() -> int:
        pick = rng.random()
        if given and pick < 0.7:
            return rng.choice(given[-depth - 2:])  # in flight or recently finished
        return rng.choice([depth, depth + 7, 65535, -1, 0])

    for _ in range(rng.randrange(1, 120)):
        op = rng.random()
        if op < 0.4:
            sqe = rng.choice([write_command, read_command, write_zeroes_command])(1, rng.randrange(1 << 20), rng.randrange(8))
            if rng.random() < 0.1:
                sqe = flush_command(1)
            data = rng.choice([None, b"", memoryview(bytearray(rng.choice([512, 4096, 131072])))])
            out, into = (data, None) if rng.random() < 0.5 else (None, data)
            cmd = mod.HostCommand(sqe, out, into, on_done, deadline=rng.choice([1.0, 2.0, 3.0, 1e12, float("inf")]))
            cmd.status, cmd.transferred = 0x4004, 512  # start resets both
            index[id(cmd)] = len(cmds)
            cmds.append(cmd)
            try:
                q.start(cmd)
            except IndexError:
                seen.append(("full", q.has_room))
                continue
            given.append(cmd.cid)
            seen.append(("start", cmd.cid, bytes(cmd.sqe), cmd.status, cmd.transferred, q.has_room))
        elif op < 0.6:
            cid = some_id()
            seen.append(("finish", cid, name(q.finish(cid)), q.has_room))
        elif op < 0.7:
            cid = some_id()
            seen.append(("get", cid, name(q.get(cid))))
        elif op < 0.8 and cmds:
            cmd = rng.choice(cmds)
            cmd.status, cmd.dw0, cmd.dw1 = rng.choice([0, 0x0281, 0x4004]), rng.randrange(1 << 32), rng.randrange(1 << 32)
            cmd.transferred += rng.randrange(4096)
            if rng.random() < 0.5:
                cmd.complete()
            else:
                cmd.fail(ConnectionError("lost"))
            seen.append(("finished", name(cmd), cmd.finished))
        elif op < 0.9:
            now = rng.choice([0.5, 1.5, 2.5, 10.0])
            seen.append(("expired", now, [name(c) for c in q.expired(now)]))
        elif op < 0.95:
            seen.append(("take_all", [name(c) for c in q.take_all()], q.has_room))
        elif cmds:  # the completion's counters: latency from the send (0: never sent) to now
            cmd = rng.choice(cmds)
            cmd.sent_ns = rng.choice([0, 1, 10 ** 9, 2 ** 40, 2 ** 62])
            cmd.count(counters, rng.choice([0, 1, 1023, 10 ** 9 + 5000, 2 ** 40 + 1024, 2 ** 62 + 2 ** 61, 2 ** 63 - 1]))
            snap = counters.snapshot()
            snap["latency_ns"] %= 1 << 64  # the compiled sum is a uint64_t (blockd/_iostats.pyx)
            seen.append(("counters", snap))
        seen.append(("pending", [(cid, name(c)) for cid, c in q.pending.items()]))
    return seen


@pytest.mark.parametrize("seed", range(400))
def test_compiled_and_python_queue_alike(seed: int) -> None:
    assert _run(_compiled, seed) == _run(py_queue, seed)


def test_the_sequences_reach_every_outcome() -> None:
    """Queues fill up, stale and unknown ids are refused, ids are reused, deadlines pass."""
    runs = [_run(py_queue, seed) for seed in range(400)]
    events = [e for r in runs for e in r]
    assert any(e[0] == "full" for e in events)
    assert any(e[0] == "finish" and e[2] is None and 0 <= e[1] < 300 for e in events)  # a stale id
    assert any(e[0] == "finish" and e[2] is not None for e in events)
    assert any(e[0] == "expired" and e[2] for e in events)
    assert any(e[0] == "take_all" and len(e[1]) > 1 for e in events)
    last = [[e[1] for e in r if e[0] == "counters"][-1] for r in runs if any(e[0] == "counters" for e in r)]
    assert all(any(c["ops"][k] for c in last) for k in ("read", "write", "flush", "other"))
    assert any(c["latency_ns"] > 10 ** 18 for c in last) and any(c["bytes"]["read"] for c in last)
    reused = [r for r in runs if len([e for e in r if e[0] == "start"]) > len({e[1] for e in r if e[0] == "start"})]
    assert reused


@pytest.mark.parametrize("mod", [_compiled, py_queue], ids=["compiled", "python"])
def test_a_latency_counts_from_the_send_in_nanoseconds(mod: ModuleType) -> None:
    """From ``sent_ns`` to the completion's ``monotonic_ns``, to the nanosecond (the event
    loop's time was uvloop's cached milliseconds); a command never sent counts 0."""
    counters = COUNTERS[mod]()
    cmd = mod.HostCommand(read_command(1, 0, 0), None, memoryview(bytearray(512)))
    cmd.count(counters, 5_000_000)
    assert counters.latency_ns == 0 and counters.buckets[0] == 1
    cmd.sent_ns = 1_000_000
    cmd.count(counters, 1_012_345)
    assert counters.latency_ns == 12_345 and counters.buckets[(12_345 >> 10).bit_length()] == 1


def test_compiled_ids_wrap_and_fill_the_whole_queue() -> None:
    """All 65536 ids of the largest queue, each written into its SQE (both bytes)."""
    q = _compiled.HostQueue(1, 65536)
    cmds = [_compiled.HostCommand(read_command(1, 0, 0)) for _ in range(65536)]
    for cmd in cmds:
        q.start(cmd)
    assert not q.has_room and int.from_bytes(cmds[-1].sqe[2:4], "little") == 65535
    assert q.finish(65535) is cmds[-1] and q.has_room
    with pytest.raises(ValueError):
        _compiled.HostQueue(1, 65537)
