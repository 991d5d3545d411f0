"""Crash ordering: a workload of host writes (mark, then the data write), peer acknowledgements
(clears), lazy clear syncs and new generations is cut by a crash at every one of its writes,
whole or torn. After each crash the metadata opens, and every region whose data write was
issued after its bit was set, and not cleared since, is dirty."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import pytest

from target.replication.metadata import Metadata
from tests.replication.fake_blockio import Crashed, MemoryBlockIO

RS = 4096
SIZE = 40 * 32768 * RS // 16  # 80 MiB: 20480 regions, one bitmap block per slot
PEER = 0xFEED


@dataclass
class Log:
    formatted: bool = False
    issued: set[int] = field(default_factory=set)
    """Regions with a data write issued since their last clear: must be dirty after a crash."""
    current: int = 0
    """The current generation last saved (a save in progress may have landed too)."""


async def workload(io: MemoryBlockIO, log: Log, seed: int) -> None:
    rng = random.Random(seed)
    md = await Metadata.format(io, RS, 2)
    slot = await md.assign_slot(PEER)
    bm = md.bitmap(slot)
    log.formatted, log.current = True, md.current
    # a few hot regions so that marks hit set bits, cleared bits and shared blocks
    hot = [rng.randrange(bm.regions - 4) for _ in range(12)]

    async def host_write(offset: int, length: int) -> None:
        await bm.mark(offset, length)
        log.issued |= set(range(offset // RS, (offset + length - 1) // RS + 1))
        await io.write(offset, bytes([rng.randrange(256)]) * length, fua=rng.random() < 0.5)

    for _ in range(60):
        op = rng.random()
        if op < 0.55:
            spans = [(rng.choice(hot) * RS + rng.randrange(RS), rng.randrange(1, 2 * RS))
                     for _ in range(rng.randrange(1, 5))]
            await asyncio.gather(*(host_write(o, n) for o, n in spans))
            if rng.random() < 0.7:  # every copy has them now: clear, as the mirror does
                for offset, length in spans:
                    for region in range(offset // RS, (offset + length - 1) // RS + 1):
                        bm.clear(region)
                        log.issued.discard(region)
        elif op < 0.75:
            await bm.sync_clears()
        elif op < 0.85:
            log.current = (await md.new_generation()).current
        else:
            await md.save()


def total_writes(seed: int) -> int:
    io = MemoryBlockIO(SIZE)
    asyncio.run(workload(io, Log(), seed))
    return len(io.writes)


async def check_after_crash(crash_at: int, tear: bool, seed: int) -> None:
    io = MemoryBlockIO(SIZE, crash_at=crash_at, tear=tear)
    log = Log()
    with pytest.raises(Crashed):
        await workload(io, log, seed)
    if not log.formatted:
        return  # a crash while formatting: the operator formats again
    md = await Metadata.open(io.survivor())
    slot = md.slot_of(PEER)
    assert slot is not None
    dirty = set(md.bitmap(slot).dirty_regions())
    assert log.issued <= dirty, f"crash at write {crash_at}: {sorted(log.issued - dirty)} clean"
    # the last saved generation, or the one whose save the crash cut (which then follows it)
    assert md.current == log.current or md.history[0] == log.current


@pytest.mark.parametrize("seed", [1, 2])
def test_every_written_region_is_dirty_after_a_crash_at_any_write(seed: int) -> None:
    writes = total_writes(seed)
    assert writes > 40  # the workload does reach the disk often enough to be worth cutting
    for crash_at in range(writes):
        for tear in (False, True):
            asyncio.run(check_after_crash(crash_at, tear, seed))
