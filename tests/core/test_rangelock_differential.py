"""The compiled range locks (``initiator/fuse/_rangelock.pyx``) against their Python reference
(``initiator/fuse/rangelock.py``): the same random sequences of ``acquire`` (shared and
exclusive, overlapping ranges, so that writers wait behind read-modify-writes and those behind
each other), ``share_now``, cancelled waiters and releases (of unknown tokens too), with the
event loop run a random number of steps between them, must grant the same tokens at the same
steps, raise the same errors and leave the same state. Every grant is also checked against the
guarantee itself: no two holds granted at once overlap where one of them is exclusive."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from initiator.fuse import rangelock

_compiled = pytest.importorskip("initiator.fuse._rangelock", reason="compiled data plane not built")
TWINS = {"python": rangelock.RangeLocks, "compiled": _compiled.RangeLocks}


def _state(locks: Any) -> tuple[Any, ...]:
    return (locks.exclusive, [(t, s, e, x, fut is not None) for t, (s, e, x, fut) in locks.active.items()])


def _outcome(task: asyncio.Task[int]) -> tuple[Any, ...]:
    if not task.done():
        return ("pending",)
    if task.cancelled():
        return ("cancelled",)
    exc = task.exception()
    return ("raised", type(exc).__name__) if exc is not None else ("granted", task.result())


class _Run:
    """One twin's side of a sequence: its locks, its acquire tasks, the holds granted to it."""

    def __init__(self, cls: type) -> None:
        self.locks = cls()
        self.tasks: list[asyncio.Task[int]] = []
        self.ranges: list[tuple[int, int, bool]] = []
        self.held: dict[int, tuple[int, int, bool]] = {}
        self.seen: set[int] = set()

    def collect(self) -> None:
        """Holds granted since the last step, once each."""
        for i, task in enumerate(self.tasks):
            if i not in self.seen and task.done() and not task.cancelled() and task.exception() is None:
                self.seen.add(i)
                self.held[task.result()] = self.ranges[i]

    def check_exclusion(self) -> None:
        holds = list(self.held.values())
        for i, (s1, e1, x1) in enumerate(holds):
            for s2, e2, x2 in holds[i + 1:]:
                assert not (s1 < e2 and s2 < e1 and (x1 or x2)), (holds, self.locks.active)


def _call(fn: Any, *args: Any) -> tuple[Any, ...]:
    try:
        return ("ok", fn(*args))
    except Exception as exc:
        return ("raised", type(exc).__name__)


async def _sequence(seed: int) -> None:
    rng = random.Random(seed)
    runs = {name: _Run(cls) for name, cls in TWINS.items()}
    log: dict[str, list[Any]] = {name: [] for name in runs}
    span = rng.choice([4, 12, 40])
    for _ in range(rng.randint(5, 60)):
        op = rng.random()
        start = rng.randrange(span)
        end = start + rng.randint(1, 6)
        if op < 0.35:
            exclusive = rng.random() < 0.4
            for run in runs.values():
                run.tasks.append(asyncio.get_running_loop().create_task(run.locks.acquire(start, end, exclusive)))
                run.ranges.append((start, end, exclusive))
        elif op < 0.6:
            for name, run in runs.items():
                answer = _call(run.locks.share_now, start, end)
                log[name].append(("share_now", start, end, answer))
                if answer[0] == "ok" and answer[1] is not None:
                    run.held[answer[1]] = (start, end, False)
        elif op < 0.7:
            count = len(runs["python"].tasks)
            index = rng.randrange(count) if count else None
            for name, run in runs.items():
                if index is not None:
                    log[name].append(("cancel", index, run.tasks[index].cancel()))
        else:
            held = sorted(runs["python"].held)
            token = rng.choice(held) if held and rng.random() < 0.9 else rng.randrange(-1, 200)
            for name, run in runs.items():
                log[name].append(("release", token, _call(run.locks.release, token)))
                run.held.pop(token, None)
        for _ in range(rng.choice([0, 1, 1, 2, 3, 8])):
            await asyncio.sleep(0)
        for name, run in runs.items():
            run.collect()
            run.check_exclusion()
            log[name].append(("state", _state(run.locks), [_outcome(t) for t in run.tasks]))
        assert log["python"] == log["compiled"], f"seed {seed}"
    for run in runs.values():
        for task in run.tasks:
            task.cancel()
    await asyncio.sleep(0)


@pytest.mark.parametrize("chunk", range(6))
def test_random_sequences_match(chunk: int) -> None:
    async def main() -> None:
        for seed in range(chunk * 100, chunk * 100 + 100):
            await _sequence(seed)

    asyncio.run(main())

