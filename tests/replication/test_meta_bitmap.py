"""The write-intent bitmap: a bit is on disk (a FUA write) before ``mark`` returns, concurrent
marks share block writes, clears are lazy, a reopened bitmap has exactly the persisted bits."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from protocol import replication as r
from target.replication.bitmap import WriteIntentBitmap
from target.replication.metadata import Metadata
from tests.replication.fake_blockio import MemoryBlockIO

RS = 4096
"""Small regions, so that a modest device has several bitmap blocks (32768 regions each)."""
SIZE = 3 * 32768 * RS + (4 << 20)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


async def bitmap(size: int = SIZE, region_size: int = RS) -> tuple[MemoryBlockIO, Metadata, WriteIntentBitmap]:
    io = MemoryBlockIO(size)
    md = await Metadata.format(io, region_size, 2)
    slot = await md.assign_slot(0xAA)
    io.writes.clear()
    return io, md, md.bitmap(slot)


def on_disk(io: MemoryBlockIO, bm: WriteIntentBitmap) -> list[int]:
    """The regions set in the durable bytes of the bitmap, read through protocol/'s definition."""
    found = []
    for block in range(len(bm._bits) // r.BITMAP_BLOCK_SIZE):
        raw = io.durable_bytes(bm.offset + block * r.BITMAP_BLOCK_SIZE, r.BITMAP_BLOCK_SIZE)
        if any(raw):
            found += r.bitmap_regions(raw, block * r.BITS_PER_BITMAP_BLOCK)
    return found


async def reopened(io: MemoryBlockIO) -> list[int]:
    md = await Metadata.open(io.survivor())
    return list(md.bitmap(md.slot_of(0xAA)).dirty_regions())  # type: ignore[arg-type]


def test_the_bit_is_on_disk_before_mark_returns() -> None:
    async def go() -> None:
        io, _, bm = await bitmap()
        io.hold = asyncio.Event()
        task = asyncio.ensure_future(bm.mark(5 * RS + 100, 10))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not task.done() and on_disk(io, bm) == []
        io.hold.set()
        await task
        assert on_disk(io, bm) == [5]
        assert len(io.writes) == 1 and io.writes[0].fua
        assert io.writes[0].offset == bm.offset and io.writes[0].length == r.BITMAP_BLOCK_SIZE
    run(go())


def test_concurrent_marks_of_one_block_share_one_write() -> None:
    async def go() -> None:
        io, _, bm = await bitmap()
        await asyncio.gather(*(bm.mark(region * RS, RS) for region in range(0, 3000, 7)))
        assert len(io.writes) == 1
        assert on_disk(io, bm) == list(range(0, 3000, 7))
        # marks while a write is in flight share the next one
        io.writes.clear()
        io.hold = asyncio.Event()
        first = asyncio.ensure_future(bm.mark(9000 * RS, 1))
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # the writer has taken its snapshot and waits in write()
        later = [asyncio.ensure_future(bm.mark(region * RS, 1)) for region in range(9001, 9100)]
        same = asyncio.ensure_future(bm.mark(9000 * RS + 5, 1))  # its bit is in the write in flight
        await asyncio.sleep(0)
        io.hold.set()
        await asyncio.gather(first, same, *later)
        assert len(io.writes) == 2
        assert on_disk(io, bm)[-100:] == list(range(9000, 9100))
    run(go())


def test_a_mark_whose_bit_is_in_the_write_in_flight_waits_for_it() -> None:
    async def go() -> None:
        io, _, bm = await bitmap()
        io.hold = asyncio.Event()
        first = asyncio.ensure_future(bm.mark(0, 1))
        for _ in range(3):
            await asyncio.sleep(0)
        second = asyncio.ensure_future(bm.mark(100, 1))  # same region, not yet on disk
        for _ in range(10):
            await asyncio.sleep(0)
        assert not second.done()
        io.hold.set()
        await asyncio.gather(first, second)
        assert len(io.writes) == 1
    run(go())


def test_mark_on_set_bits_does_no_io() -> None:
    async def go() -> None:
        io, _, bm = await bitmap()
        await bm.mark(0, 3 * RS)
        count = len(io.writes)
        coro = bm.mark(RS + 7, 2 * RS - 7)  # regions 1 and 2: both on disk
        with pytest.raises(StopIteration):
            coro.send(None)  # finished at the first step: nothing awaited
        await bm.mark(0, 1)
        assert len(io.writes) == count == 1
    run(go())


def test_ranges_across_region_and_block_boundaries() -> None:
    async def go() -> None:
        io, _, bm = await bitmap()
        await bm.mark(RS - 1, 2)                        # regions 0 and 1
        await bm.mark(32767 * RS, 2 * RS)               # last of block 0, first of block 1
        await bm.mark(65535 * RS + 1, 32768 * RS)       # blocks 1 and 2 (regions 65535..98303)
        expected = [0, 1, 32767, 32768] + list(range(65535, 98304))
        assert on_disk(io, bm) == expected == await reopened(io) == list(bm.dirty_regions())
        assert bm.dirty_count() == len(expected)
        assert {w.offset for w in io.writes} == {bm.offset + b * 4096 for b in range(3)}
        assert bm.is_dirty(32768) and not bm.is_dirty(2)
        with pytest.raises(ValueError, match="outside the bitmap"):
            await bm.mark(bm.regions * RS, 1)
    run(go())


def test_clear_is_lazy_and_sync_clears_persists_it() -> None:
    async def go() -> None:
        io, _, bm = await bitmap()
        await bm.mark(0, 4 * RS)
        io.writes.clear()
        bm.clear(1)
        bm.clear(2)
        bm.clear(50)  # not set: nothing to do
        assert io.writes == [] and list(bm.dirty_regions()) == [0, 3]
        assert await reopened(io) == [0, 1, 2, 3]
        await bm.sync_clears()
        assert len(io.writes) == 1 and await reopened(io) == [0, 3]
        await bm.sync_clears()
        assert len(io.writes) == 1  # nothing left to persist
    run(go())


def test_a_region_marked_again_after_a_clear_is_written_again() -> None:
    async def go() -> None:
        io, _, bm = await bitmap()
        await bm.mark(0, 1)
        bm.clear(0)
        io.writes.clear()
        await bm.mark(0, 1)  # the disk still has the old bit, but a later write of the block
        assert len(io.writes) == 1  # would carry the clear: the bit is written again now
        await bm.mark(RS * 9, 1)
        await bm.sync_clears()
        assert await reopened(io) == [0, 9]
    run(go())


def test_a_clear_during_a_write_is_not_taken_as_persisted() -> None:
    async def go() -> None:
        io, _, bm = await bitmap()
        io.hold = asyncio.Event()
        task = asyncio.ensure_future(bm.mark(0, 1))
        for _ in range(3):
            await asyncio.sleep(0)
        bm.clear(0)  # after the snapshot, before the write lands
        io.hold.set()
        await task
        io.writes.clear()
        await bm.mark(0, 1)
        assert len(io.writes) == 1
    run(go())


def test_reopened_bitmap_has_exactly_the_persisted_bits() -> None:
    async def go() -> None:
        rng = random.Random(13)
        io, _, bm = await bitmap()
        model: set[int] = set()
        for _ in range(300):
            region = rng.randrange(bm.regions - 3)
            if rng.random() < 0.6:
                length = rng.randrange(1, 3 * RS)
                await bm.mark(region * RS, length)
                model |= set(range(region, (region * RS + length - 1) // RS + 1))
            elif model:
                victim = rng.choice(sorted(model))
                bm.clear(victim)
                model.discard(victim)
            if rng.random() < 0.1:
                await bm.sync_clears()
                assert await reopened(io) == sorted(model) == list(bm.dirty_regions())
        await bm.sync_clears()
        assert await reopened(io) == sorted(model) == on_disk(io, bm)
    run(go())


def test_a_failed_write_fails_the_mark_and_the_next_mark_retries() -> None:
    async def go() -> None:
        io, _, bm = await bitmap()
        io.fail = OSError(5, "I/O error")
        results = await asyncio.gather(bm.mark(0, 1), bm.mark(RS, 1), return_exceptions=True)
        assert all(isinstance(res, OSError) for res in results)
        assert on_disk(io, bm) == []
        await bm.mark(0, 1)
        assert on_disk(io, bm) == [0, 1]  # the failed marks' bits stay wanted
    run(go())


def test_a_cancelled_mark_does_not_cancel_the_shared_write() -> None:
    async def go() -> None:
        io, _, bm = await bitmap()
        io.hold = asyncio.Event()
        a = asyncio.ensure_future(bm.mark(0, 1))
        b = asyncio.ensure_future(bm.mark(RS, 1))
        await asyncio.sleep(0)
        a.cancel()
        await asyncio.sleep(0)
        io.hold.set()
        await b
        assert on_disk(io, bm) == [0, 1]
    run(go())


def test_set_all_and_span() -> None:
    async def go() -> None:
        size = 40 << 20
        io, md, bm = await bitmap(size, 1 << 16)
        await bm.mark(0, 1)
        io.writes.clear()
        await bm.set_all()
        assert bm.dirty_count() == bm.regions == md.layout.regions
        assert await reopened(io) == list(range(bm.regions))  # no bit past the last region
        assert all(w.fua for w in io.writes) and len(io.writes) == 1
        assert bm.span(0) == (0, 1 << 16)
        last = bm.span(bm.regions - 1)
        assert last[0] + last[1] == md.data_size and 0 < last[1] <= 1 << 16
    run(go())

