"""Run a coroutine at once, and make it a Task only if it really has to wait.

A command served from the page cache never waits: its coroutine finishes in the same call
that started it. ``loop.create_task`` would still cost a Task object and a trip round the
event loop (one more ``epoll_wait``) before the first line runs, which on loopback was a
sizeable share of a 4 KiB I/O. Python 3.12 has eager tasks for this; we run on 3.11.
"""

from __future__ import annotations

import asyncio
from typing import Any, Coroutine, Generator


def start(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
    """Run ``coro`` up to its first suspension; returns the Task that carries on, or None
    when it already finished. Exceptions raised before it suspends propagate to the caller."""
    try:
        pending = coro.send(None)
    except StopIteration:
        return None
    return asyncio.get_running_loop().create_task(_carry_on(_Resume(coro, pending)))


async def _carry_on(resume: _Resume) -> None:
    await resume


class _Resume:
    """Awaitable that hands a started coroutine's pending future to the awaiting Task."""

    __slots__ = ("coro", "pending")

    def __init__(self, coro: Coroutine[Any, Any, None], pending: Any) -> None:
        self.coro = coro
        self.pending = pending

    def __await__(self) -> Generator[Any, None, None]:
        coro, pending = self.coro, self.pending
        while True:
            try:
                yield pending  # the Task waits on it exactly as if the coroutine had yielded it
            except GeneratorExit:  # the Task is being destroyed
                coro.close()
                raise
            except BaseException as exc:  # cancellation or an exception thrown into the Task
                try:
                    pending = coro.throw(exc)
                except StopIteration:
                    return
            else:
                try:
                    pending = coro.send(None)
                except StopIteration:
                    return
