"""The mirror's durability promises (docs/replication.md, Guarantees), over disks with a
volatile cache: the local copy and every replica's store are ``fake_blockio.MemoryBlockIO``,
which keeps a completed write in a cache until FUA or a flush makes it durable and loses the
cache at ``crash()``. The local copy's metadata (superblock and bitmaps) shares its device's
cache, as on a real disk.

Three promises are checked as the host's commands arrive, and each test here failed under the
matching break of test-audit.md §1 (see docs/replication.md, "How the guarantees are tested"):

* a write with FUA is durable on every copy when the host sees it complete, and a Flush makes
  every completed write durable on every copy (B2: FUA not passed to the replicas);
* a region's write-intent bit is durable on the local device at the instant any copy receives
  data for the region (B3: the bit written in the background);
* a bit's clear is written only once every copy holds the region's writes durably (B5: the
  sweep clears without flushing the copies).

The crash tests then cut the power of the primary, of a replica, or of every copy at chosen
instants, restart from what was durable, resync from the bitmaps, and check that every write
the host had with FUA or flushed is on every copy and that the copies are equal.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Callable

import pytest

from target.replication import mirror as mirror_mod
from target.replication.link import DEGRADED, IN_SYNC
from target.replication.metadata import Metadata
from target.replication.mirror import ReplicatedBackend
from tests.replication.fake_blockio import Crashed, MemoryBlockIO, Write
from tests.replication.test_mirror import DEVICE, REGION, Bed, run, until

BLOCK = 4096


@pytest.fixture(autouse=True)
def fast_links(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reconnect and sweep quickly; a bit leaves the activity window at the first sweep after
    its region's last write, so a test waits a few sweeps, not ten."""
    monkeypatch.setattr(mirror_mod, "RECONNECT_DELAY", 0.02)
    monkeypatch.setattr(mirror_mod, "SWEEP_INTERVAL", 0.01)
    monkeypatch.setattr(mirror_mod, "IDLE_SWEEPS", 1)


def cached_bed(n: int = 2, images: list[dict[int, bytes]] | None = None) -> Bed:
    """A bed of blank disks, or of the disks ``images`` holds (the local one first)."""
    disks = [MemoryBlockIO(DEVICE, image=image) for image in images or [{}] * (n + 1)]
    return Bed(n, local=disks[0], stores=disks[1:])


def copies(bed: Bed) -> list[tuple[str, MemoryBlockIO]]:
    """Every copy's device by name: the local one, then the replicas' stores."""
    return [("local", bed.local)] + [(f"r{i}", store) for i, store in enumerate(bed.stores)]


async def durable_dirty(device: MemoryBlockIO) -> set[tuple[int, int]]:
    """``(slot, region)`` of every bit set in the metadata a restart of ``device`` would find."""
    md = await Metadata.open(device.survivor())
    return {(slot, region) for slot, peer in enumerate(md.peers) if peer.node_id
            for region in md.bitmap(slot).dirty_regions()}


async def bits_cleared(bed: Bed, regions: range | None = None, stop: Callable[[], bool] = lambda: False) -> None:
    """Wait until no bit (of ``regions``) is set in the metadata on the local disk: the sweeps
    cleared them and the clears reached the disk; or until ``stop()``."""
    deadline = asyncio.get_running_loop().time() + 10
    while not stop() and any(regions is None or region in regions for _, region in await durable_dirty(bed.local)):
        assert asyncio.get_running_loop().time() < deadline, "the bits were never cleared on disk"
        await asyncio.sleep(0.01)


async def settled(bed: Bed) -> ReplicatedBackend:
    """A primary whose replicas are in sync after their first full sync, with no bit set in
    memory or on the local disk: every region a test writes then needs its bit written."""
    m = await bed.primary()
    await until(lambda: all(link.state == IN_SYNC and not link.bitmap.dirty_count() for link in m.links))
    await bits_cleared(bed)
    return m


def regions_of(offset: int, length: int) -> range:
    return range(offset // REGION, (offset + length - 1) // REGION + 1)


class Host:
    """Sends the host's commands to the mirror and keeps what was promised: the ranges of writes
    completed with FUA, and of every command completed before a completed Flush. ``expected``
    is what the data area reads after the commands completed; a command never overlaps a
    range already promised, so a promised range must read ``expected`` after any crash."""

    def __init__(self, m: ReplicatedBackend) -> None:
        self.m = m
        self.expected = bytearray(m.size)
        self.done: list[tuple[int, int]] = []
        """Ranges completed and not yet covered by a flush."""
        self.promised: list[tuple[int, int]] = []

    def _completed(self, offset: int, data: bytes, promised: bool) -> None:
        end = offset + len(data)
        assert all(end <= o or o + n <= offset for o, n in self.promised), "the workload overwrote a promise"
        self.expected[offset:end] = data
        (self.promised if promised else self.done).append((offset, len(data)))

    def promises(self) -> list[tuple[int, bytes]]:
        return [(offset, bytes(self.expected[offset:offset + n])) for offset, n in self.promised]

    async def write(self, offset: int, length: int, fua: bool) -> bytes:
        data = os.urandom(length)
        await self.m.write(offset, data, fua=fua)
        self._completed(offset, data, fua)
        return data

    async def write_zeroes(self, offset: int, length: int) -> None:
        await self.m.write_zeroes(offset, length)
        self._completed(offset, bytes(length), False)

    async def discard(self, offset: int, length: int) -> None:
        await self.m.discard(offset, length)
        self._completed(offset, bytes(length), False)

    async def flush(self) -> None:
        await self.m.flush()
        self.promised += self.done
        self.done = []

    async def workload(self, first_region: int) -> None:
        """Each kind of command, with FUA and without, flushed or not, from ``first_region`` on
        (7 regions; one write spans two). Zeroes and deallocations go over written data, so
        that they change what a copy holds."""
        r = first_region * REGION
        await self.write(r, BLOCK, fua=True)
        await self.write(r + REGION, 2 * BLOCK, fua=False)
        await self.write(r + 2 * REGION - BLOCK, 2 * BLOCK, fua=True)  # regions +1 and +2
        await self.write(r + 3 * REGION, 4 * BLOCK, fua=False)
        await self.write_zeroes(r + 3 * REGION, BLOCK)
        await self.discard(r + 3 * REGION + 2 * BLOCK, BLOCK)
        await self.flush()
        await self.write(r + 4 * REGION, BLOCK, fua=False)  # completed, never flushed
        await self.write(r + 5 * REGION, 3 * BLOCK, fua=True)
        await self.write(r + 6 * REGION, BLOCK, fua=False)
        await self.flush()
        await self.write(r + 6 * REGION + BLOCK, BLOCK, fua=False)  # completed, never flushed


async def check_promises_and_equal_copies(bed: Bed, host: Host, size: int) -> None:
    """Every promised write reads back from every copy, and the copies' data areas are equal."""
    local = bytes(await bed.local.read(0, size))
    for name, device in copies(bed):
        data = local if device is bed.local else bytes(await device.read(0, size))
        for offset, expected in host.promises():
            assert data[offset:offset + len(expected)] == expected, f"{name} lost a promised write at {offset}"
        differ = sorted({i // REGION for i in range(0, size, BLOCK)
                         if data[i:i + BLOCK] != local[i:i + BLOCK]})
        assert not differ, f"{name} differs from the local copy in regions {differ}"


# -- the three promises, watched as the host's commands arrive -------------------------------------


class CheckingHost(Host):
    """A :class:`Host` that checks, as each FUA write and each Flush completes, that what it
    promises is durable on every copy already (and that each replica got FUA itself)."""

    def __init__(self, m: ReplicatedBackend, bed: Bed) -> None:
        super().__init__(m)
        self.bed = bed
        self.checked_fua = self.checked_flush = 0

    async def write(self, offset: int, length: int, fua: bool) -> bytes:
        data = await super().write(offset, length, fua)
        if fua:
            for name, device in copies(self.bed):
                assert device.durable_bytes(offset, length) == data, f"FUA write at {offset} not durable on {name}"
            for store in self.bed.stores:
                assert store.writes[-1] == Write(offset, length, True)
            self.checked_fua += 1
        return data

    async def flush(self) -> None:
        await super().flush()
        for name, device in copies(self.bed):
            assert not device.unflushed(0, self.m.size), f"a completed write is not durable on {name} after Flush"
            for offset, expected in self.promises():
                assert device.durable_bytes(offset, len(expected)) == expected, f"{name} at {offset}"
        self.checked_flush += 1


def test_a_fua_write_is_durable_on_every_copy_at_its_completion_and_a_flush_makes_all_durable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """B2, and a Flush that misses a copy. No sweep runs here: its flushes would make a write
    durable that FUA did not."""
    monkeypatch.setattr(mirror_mod, "SWEEP_INTERVAL", 3600.0)

    async def main() -> None:
        bed = cached_bed(2)
        m = await bed.primary()
        await until(lambda: all(link.state == IN_SYNC for link in m.links))
        host = CheckingHost(m, bed)
        await host.workload(first_region=2)
        assert host.checked_fua == 3 and host.checked_flush == 2
        assert all(store.unflushed(0, m.size) for store in bed.stores)  # the last write is still cached
        await m.stop()
    run(main())


def test_the_bit_is_durable_on_the_local_disk_before_any_copy_receives_the_data() -> None:
    """B3: the local device's durable state is taken at the instant each copy receives data for
    the data area, and its metadata opened as a restart after a crash at that instant would."""
    async def main() -> None:
        bed = cached_bed(2)
        m = await settled(bed)
        seen: list[tuple[str, int, int, dict[int, bytes]]] = []
        for name, device in copies(bed):
            def watch(offset: int, data: bytes, fua: bool, name: str = name) -> None:
                if offset < m.size:
                    seen.append((name, offset, len(data), dict(bed.local.durable.pages)))
            device.on_issue.append(watch)
        host = Host(m)
        await host.workload(first_region=2)
        assert {name for name, *_ in seen} == {"local", "r0", "r1"}
        assert len(seen) == 3 * 10  # each of the 10 commands that carry data, on each of the 3 copies
        slots = [link.slot for link in m.links]
        for name, offset, length, pages in seen:
            md = await Metadata.open(MemoryBlockIO(DEVICE, image=pages))
            for slot in slots:
                for region in regions_of(offset, length):
                    assert md.bitmap(slot).is_dirty(region), (
                        f"{name} received data for region {region} before slot {slot}'s bit was durable")
        await m.stop()
    run(main())


def test_a_bit_is_cleared_on_disk_only_once_every_copy_holds_the_region_durably() -> None:
    """B5: at each write of a bitmap block to the local device, the bits it clears (set on the
    disk, clear in the block) must belong to regions no copy holds unflushed writes for."""
    async def main() -> None:
        bed = cached_bed(2)
        m = await settled(bed)
        store_of_slot = {link.slot: bed.stores[int(link.name[1:])] for link in m.links}
        bitmaps = {slot: m.md.bitmap(slot) for slot in store_of_slot}
        cleared: list[tuple[int, int]] = []
        early: list[str] = []

        def watch(offset: int, data: bytes, fua: bool) -> None:
            for slot, bm in bitmaps.items():
                start = bm.offset
                if not start <= offset < start + m.md.layout.bitmap_length:
                    continue
                old = bed.local.durable_bytes(offset, len(data))
                base_region = (offset - start) * 8
                for i, (was, now) in enumerate(zip(old, data)):
                    gone = was & ~now
                    for bit in range(8):
                        if gone >> bit & 1:
                            region = base_region + i * 8 + bit
                            cleared.append((slot, region))
                            span = bm.span(region)
                            for name, device in (("local", bed.local), (f"slot {slot}'s replica", store_of_slot[slot])):
                                if device.unflushed(*span):
                                    early.append(f"region {region} of slot {slot}: {name} not flushed")
        bed.local.on_issue.append(watch)
        written = (3, 5, 6, 9)
        for region in written:  # without FUA, never flushed by the host
            await m.write(region * REGION + BLOCK, os.urandom(2 * BLOCK))
        await bits_cleared(bed)
        assert set(cleared) >= {(slot, region) for slot in bitmaps for region in written}
        assert early == []
        await m.stop()
    run(main())


# -- crashes at chosen instants, then restart and resync from the bitmaps --------------------------


async def restart_primary(bed: Bed, m: ReplicatedBackend, *writes: asyncio.Task[Any]) -> tuple[Bed, ReplicatedBackend]:
    """The primary lost power: the old one is dropped (its writes in flight fail), a new one
    starts on what its disk kept, with the same replicas, and resyncs them."""
    m.close()
    for outcome in await asyncio.gather(*writes, return_exceptions=True):
        assert isinstance(outcome, BaseException)  # never acknowledged
    again = Bed(len(bed.stores), local=bed.local.survivor(), stores=bed.stores)
    m2 = await again.primary()
    await until(lambda: all(link.state == IN_SYNC for link in m2.links))
    return again, m2


def test_the_primary_losing_power_as_its_disk_receives_a_write_loses_nothing_promised() -> None:
    """B3 end to end: the primary loses power at the instant its own disk receives a write's
    data, already sent to the replicas, which take it; the bit on the local disk makes the
    restarted primary copy the region back over them."""
    async def main() -> None:
        bed = cached_bed(2)
        m = await settled(bed)
        host = Host(m)
        await host.workload(first_region=2)
        target = 12 * REGION

        def cut(offset: int, data: bytes, fua: bool) -> None:
            if offset == target:
                bed.local.crash()
        bed.local.on_issue.append(cut)
        write = asyncio.get_running_loop().create_task(m.write(target, b"z" * BLOCK))
        await until(lambda: all(store.visible.read(target, 1) == b"z" for store in bed.stores))
        bed, m2 = await restart_primary(bed, m, write)
        assert bed.local.visible.read(target, 1) == b"\0"  # the write never reached the local disk
        await check_promises_and_equal_copies(bed, host, m2.size)
        await m2.stop()
    run(main())


@pytest.mark.parametrize("who", ["primary", "replica"])
def test_a_copy_losing_power_after_the_sweep_cleared_its_bits_loses_nothing(who: str) -> None:
    """B5 end to end: writes completed without FUA, their bits cleared by the sweep, then one
    copy loses power: the other copies' data must already have been durable there, or the
    restart finds a clear bit over a region where the copies differ."""
    async def main() -> None:
        bed = cached_bed(2)
        m = await settled(bed)
        host = Host(m)
        await host.workload(first_region=2)
        for region in (12, 13):
            await m.write(region * REGION, os.urandom(BLOCK))  # not promised: no FUA, no flush
        await bits_cleared(bed, range(2, 14))
        if who == "primary":
            bed.local.crash()
            bed, m2 = await restart_primary(bed, m)
        else:
            bed.stores[1].crash()
            bed.kill(1)
            await host.write(20 * REGION, BLOCK, fua=True)  # the primary finds out
            assert m.links[1].state == DEGRADED
            bed.stores[1] = bed.stores[1].survivor()
            bed.up[1] = True
            await until(lambda: m.links[1].state == IN_SYNC)
            m2 = m
        await check_promises_and_equal_copies(bed, host, m2.size)
        await m2.stop()
    run(main())


def test_every_copy_losing_power_with_a_write_in_flight_keeps_every_promised_write() -> None:
    """A site's power cut: every copy loses its cache at the instant the first replica receives
    a FUA write that the local disk has already made durable (never acknowledged), with
    unflushed writes behind it; all restart on what their disks kept, and the primary's bits
    bring the replicas to its copy."""
    async def main() -> None:
        bed = cached_bed(2)
        m = await settled(bed)
        host = Host(m)
        await host.workload(first_region=2)
        target = 15 * REGION + BLOCK
        data = os.urandom(BLOCK)

        def cut(offset: int, _: bytes, fua: bool) -> None:
            if offset == target:
                for _name, device in copies(bed):
                    device.crash()
        bed.stores[0].on_issue.append(cut)
        write = asyncio.get_running_loop().create_task(m.write(target, data, fua=True))
        await until(lambda: bed.local.crashed)
        bed.stores = [store.survivor() for store in bed.stores]
        assert all(store.visible.read(target, BLOCK) != data for store in bed.stores)
        bed, m2 = await restart_primary(bed, m, write)
        assert bed.local.visible.read(target, BLOCK) == data  # the local disk had it: now every copy
        await check_promises_and_equal_copies(bed, host, m2.size)
        await m2.stop()
    run(main())


async def synced_images() -> list[dict[int, bytes]]:
    """The disks of a primary and two replicas after their first full sync and a clean stop, as
    a power cut would leave them: a bed made of them starts in sync without a resync."""
    bed = cached_bed(2)
    m = await settled(bed)
    await m.stop()
    return [device.survivor().durable.pages for _, device in copies(bed)]


async def power_cut_run(who: str, cut_at: int, images: list[dict[int, bytes]]) -> bool:
    """A workload in two phases, with the sweeps clearing the first phase's bits between them;
    the primary's disk (``who`` "primary") or the first replica's loses power at the write it
    receives ``cut_at``-th (metadata included). Then the primary restarts, or the replica comes
    back on what its disk kept, and is resynced; every promise is checked. Whether the cut
    happened (False: ``cut_at`` was past the last write)."""
    bed = cached_bed(2, images)
    m = await settled(bed)
    assert all(link.copied_total == 0 for link in m.links)
    device = bed.local if who == "primary" else bed.stores[0]
    count = 0

    def cut(offset: int, data: bytes, fua: bool) -> None:
        nonlocal count
        if count == cut_at:
            device.crash()
        count += 1
    device.on_issue.append(cut)
    host = Host(m)
    try:
        await host.workload(first_region=2)
        await bits_cleared(bed, stop=lambda: device.crashed)
        await host.write(20 * REGION, BLOCK, fua=True)
        await host.write(21 * REGION, 2 * BLOCK, fua=False)
        await host.flush()
        await host.write(22 * REGION, BLOCK, fua=False)
    except Crashed:
        assert who == "primary"  # a replica's loss never fails the host
    if not device.crashed:
        await m.stop()
        return False
    if who == "primary":
        bed, m = await restart_primary(bed, m)
    else:
        bed.stores[0] = device.survivor()
        await until(lambda: m.links[0].state == IN_SYNC)
    await check_promises_and_equal_copies(bed, host, m.size)
    await m.stop()
    return True


@pytest.mark.parametrize("who", ["primary", "replica"])
def test_a_power_cut_at_any_write_a_copy_receives_loses_nothing_promised(who: str) -> None:
    """Every instant, one after the other: the copy loses power at its first write, then its
    second, and so on until a run ends with no write left to cut at. The primary's disk gets 10
    data writes, 14 + 6 bit marks (a write per slot for each new region) and at least 2 writes
    of clears; the replica 13 data writes."""
    images = run(synced_images())
    cut_at = 0
    while run(power_cut_run(who, cut_at, images)):
        cut_at += 1
    assert cut_at >= (35 if who == "primary" else 13), f"only {cut_at} writes to cut at"
