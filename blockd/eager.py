"""Run a coroutine at once, and make it a Task only if it really has to wait.

A command served from the page cache never waits: its coroutine finishes in the same call
that started it. ``loop.create_task`` would still cost a Task object and a trip round the
event loop (one more ``epoll_wait``) before the first line runs, which on loopback was a
sizeable share of a 4 KiB I/O. Python 3.12 has eager tasks for this; we run on 3.11.
"""

from __future__ import annotations

import asyncio
import collections.abc
from typing import Any, Coroutine, Generator


def start(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
    """Run ``coro`` up to its first suspension; returns the Task that carries on, or None
    when it already finished. Exceptions raised before it suspends propagate to the caller."""
    try:
        pending = coro.send(None)
    except StopIteration:
        return None
    return asyncio.get_running_loop().create_task(_Resumed(coro, pending))


_STARTED = object()


class _Resumed(collections.abc.Coroutine):  # type: ignore[type-arg]
    """A started coroutine, as a coroutine a Task can drive: the Task's first step gets the
    future the coroutine already yielded, every later step (or a cancellation, even one before
    that first step) goes to the coroutine itself."""

    __slots__ = ("coro", "first")

    def __init__(self, coro: Coroutine[Any, Any, None], first: Any) -> None:
        self.coro = coro
        self.first = first

    def send(self, value: Any) -> Any:
        first = self.first
        if first is not _STARTED:
            self.first = _STARTED
            return first
        return self.coro.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        self.first = _STARTED
        if val is None and tb is None:
            return self.coro.throw(typ)
        return self.coro.throw(typ, val, tb)

    def close(self) -> None:
        self.coro.close()

    def __await__(self) -> Generator[Any, None, None]:
        raise TypeError("a started coroutine is driven by its Task only")
