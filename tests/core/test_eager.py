"""blockd.eager: run at once, become a Task only when the coroutine really waits."""

from __future__ import annotations

import asyncio

import pytest

from blockd import eager

from .conftest import run


def test_a_coroutine_that_never_waits_runs_inside_the_call() -> None:
    async def main() -> None:
        seen: list[str] = []

        async def inner() -> None:
            seen.append("ran")

        assert eager.start(inner()) is None
        assert seen == ["ran"]
    run(main())


def test_a_waiting_coroutine_carries_on_as_a_task() -> None:
    async def main() -> None:
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        seen: list[object] = []

        async def inner() -> None:
            seen.append("before")
            seen.append(await fut)
            await asyncio.sleep(0)
            seen.append(await asyncio.sleep(0.01, "after sleep"))

        task = eager.start(inner())
        assert isinstance(task, asyncio.Task) and seen == ["before"]
        fut.set_result(42)
        await task
        assert seen == ["before", 42, "after sleep"]
    run(main())


def test_exceptions_reach_the_caller_or_the_task() -> None:
    async def main() -> None:
        async def fails_at_once() -> None:
            raise ValueError("now")

        with pytest.raises(ValueError, match="now"):
            eager.start(fails_at_once())

        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def fails_later() -> None:
            await fut
            raise KeyError("later")

        task = eager.start(fails_later())
        fut.set_result(None)
        with pytest.raises(KeyError):
            await task
    run(main())


def test_cancelling_the_task_cancels_the_coroutine_where_it_waits() -> None:
    async def main() -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        cleaned: list[bool] = []

        async def inner() -> None:
            try:
                await fut
            finally:
                cleaned.append(True)

        task = eager.start(inner())
        task.cancel()  # before the Task's first step
        with pytest.raises(asyncio.CancelledError):
            await task
        assert cleaned == [True]

        fut2: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def waits() -> None:
            await fut2

        task = eager.start(waits())
        await asyncio.sleep(0)  # the Task now waits on fut2 itself
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert fut2.cancelled()
    run(main())
