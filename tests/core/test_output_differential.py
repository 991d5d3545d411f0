"""The compiled output batcher (``blockd/_output.pyx``) against its Python reference
(``blockd/output.py``): the same random sequences of hold, release, send and flush, with the
flushes they schedule run at random points, given a transport whose ``is_closing`` and write
buffer size answer at random (the same answers for both), must make the same calls to the
transport, the loop and ``on_backlog``, with the same arguments, in the same order."""

from __future__ import annotations

import asyncio
import random
from typing import Any, Callable

import pytest

from blockd import output

_compiled = pytest.importorskip("blockd._output", reason="compiled data plane not built")
TWINS = {"python": output.OutputBatcher, "compiled": _compiled.OutputBatcher}
SIZES = [0, 1, 100, 4096, 20000, 32767, 32768, 32769, 65535, 65536, 65537]
"""Buffer sizes; pairs and singles of them land on both sides of the 64 KiB join limit."""


def _described(buf: Any) -> tuple[str, bytes]:
    return type(buf).__name__, bytes(buf)


class _Transport:
    """Records every call; ``is_closing`` and ``get_write_buffer_size`` answer from ``rng``."""

    def __init__(self, log: list[tuple[Any, ...]], rng: random.Random, closing: float) -> None:
        self.log = log
        self.rng = rng
        self.closing = closing

    def is_closing(self) -> bool:
        answer = self.rng.random() < self.closing
        self.log.append(("is_closing", answer))
        return answer

    def get_write_buffer_size(self) -> int:
        answer = self.rng.choice([0, 0, 0, 1, 70000])
        self.log.append(("get_write_buffer_size", answer))
        return answer

    def write(self, data: Any) -> None:
        self.log.append(("write", *_described(data)))

    def writelines(self, bufs: Any) -> None:
        self.log.append(("writelines", type(bufs).__name__, [_described(b) for b in bufs]))


class _Loop:
    """Records ``call_soon`` and keeps the callbacks for the test to run."""

    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        self.log = log
        self.ready: list[Callable[[], None]] = []

    def call_soon(self, callback: Callable[[], None]) -> None:
        self.log.append(("call_soon", callback.__name__))
        self.ready.append(callback)


def _buffer(rng: random.Random) -> Any:
    n = rng.choice(SIZES)
    data = rng.randbytes(n)
    kind = rng.randrange(4)
    if kind == 0:
        return data
    if kind == 1:
        return bytearray(data)
    if kind == 2:
        return memoryview(data)
    return memoryview(data[:n - n % 4]).cast("I")  # len() counts items, not bytes


def _ops(rng: random.Random) -> list[tuple[Any, ...]]:
    ops: list[tuple[Any, ...]] = []
    for _ in range(rng.randrange(1, 40)):
        r = rng.random()
        if r < 0.2:
            ops.append(("hold",))
        elif r < 0.4:
            ops.append(("release",))
        elif r < 0.75:
            bufs = [_buffer(rng) for _ in range(rng.choice([0, 1, 1, 2, 2, 3, 5]))]
            ops.append(("send", tuple(bufs) if rng.random() < 0.3 else bufs))
        elif r < 0.85:
            ops.append(("flush",))
        else:
            ops.append(("run_ready",))
    ops.append(("run_ready",))
    return ops


def _run(kind: str, seed: int) -> list[tuple[Any, ...]]:
    rng = random.Random(seed)
    ops = _ops(rng)
    backlog = rng.random() < 0.7
    reenter = rng.random() < 0.3
    answers = random.Random(seed + 1)
    log: list[tuple[Any, ...]] = []
    loop = _Loop(log)
    transport = _Transport(log, answers, rng.choice([0.0, 0.1, 0.5]))
    batcher: Any = None

    def on_backlog() -> None:
        log.append(("on_backlog",))
        if reenter and answers.random() < 0.5:  # as a backlogged target pauses and sends a reply
            batcher.send([b"again"])

    batcher = TWINS[kind](transport, on_backlog if backlog else None, loop=loop)
    for op in ops:
        name = op[0]
        if name == "send":
            batcher.send(op[1])
        elif name == "run_ready":
            ready, loop.ready = loop.ready, []
            for callback in ready:
                log.append(("run", callback.__self__ is batcher))
                callback()
        else:
            getattr(batcher, name)()
        log.append(("did", name))
    return log


@pytest.mark.parametrize("seed", range(400))
def test_compiled_and_python_batcher_alike(seed: int) -> None:
    python = _run("python", seed)
    compiled = _run("compiled", seed)
    assert compiled == python


@pytest.mark.parametrize("kind", TWINS)
def test_the_join_limit_is_inclusive(kind: str) -> None:
    """64 KiB in two buffers is one joined write; one byte more goes to writelines."""
    log: list[tuple[Any, ...]] = []
    batcher = TWINS[kind](_Transport(log, random.Random(0), 0.0), loop=_Loop(log))
    half = output.JOIN_LIMIT // 2
    for extra in (0, 1):
        batcher.hold()
        batcher.send([bytes(half), bytes(half + extra)])
        batcher.release()
    assert [entry[0] for entry in log] == ["is_closing", "write", "is_closing", "writelines"]


@pytest.mark.parametrize("kind", TWINS)
def test_runs_on_the_running_loop(kind: str) -> None:
    """Without a ``loop`` the flush a send schedules runs on the running event loop."""
    log: list[tuple[Any, ...]] = []

    async def main() -> None:
        batcher = TWINS[kind](_Transport(log, random.Random(0), 0.0))
        batcher.send([b"a", b"b"])
        assert log == []
        await asyncio.sleep(0)

    asyncio.run(main())
    assert log == [("is_closing", False), ("write", "bytes", b"ab")]
