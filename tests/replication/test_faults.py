"""Disk full and I/O errors on the local copy of a replicated namespace (issue 35, item 5).

The local copy is a :class:`FaultyBackend` over RAM: ENOSPC or EIO on its data writes, on its
metadata (bitmap and superblock) writes, on reads a resync or a verify needs, on flushes. Each
test pins: the status the host gets (``target.controller``'s mapping, and once on the wire), that
the affected regions stay in the bitmaps and in what the replicas miss, that every acknowledged
write is on every copy afterwards, and that no loop retries the failure without a pause.
"""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from initiator.errors import NvmeError
from protocol.replication import superblock_offsets
from protocol.status import Status
from target.backend import MemoryBackend
from target.controller import _write_status
from target.replication.blockio import BackendBlockIO
from target.replication.link import DEGRADED, IN_SYNC, LocalCopyError
from target.replication.metadata import Metadata
from target.replication.mirror import ReplicatedBackend
from target.replication.verify import verify
from tests.core.conftest import NQN, config, connect, free_port, ns, serving, sub

from .faulty import FaultyBackend
from .test_mirror import DEVICE, REGION, Bed, data_hash, fast_links, run, until

__all__ = ["fast_links"]  # the autouse fixture: fast reconnects and sweeps here too


def faulty_bed(n: int) -> tuple[Bed, FaultyBackend, MemoryBackend]:
    ram = MemoryBackend(DEVICE)
    local = FaultyBackend(ram)
    return Bed(n, local=local), local, ram  # type: ignore[arg-type]


async def settled(m: ReplicatedBackend) -> None:
    """Every replica in sync, nothing missed, no bit set."""
    await until(lambda: all(link.state == IN_SYNC and not link.missing and not link.bitmap.dirty_count()
                            for link in m.links))


def same_everywhere(bed: Bed, ram: MemoryBackend, size: int) -> bool:
    return all(data_hash(store, size) == data_hash(ram, size) for store in bed.stores)


ERRORS = pytest.mark.parametrize("err, status", [(errno.ENOSPC, Status.CAPACITY_EXCEEDED),
                                                 (errno.EIO, Status.WRITE_FAULT)], ids=["ENOSPC", "EIO"])
"""Each error of the device, and the status the host gets for a write it fails."""


@ERRORS
@pytest.mark.parametrize("op", ["write", "write_zeroes"])
def test_a_local_write_the_device_refuses_fails_precisely_and_the_copies_converge(
        op: str, err: int, status: Status) -> None:
    """The replicas took the write (or the zeroes) this copy refused: they miss the region until
    the resync has copied this copy's data back, and no acknowledged byte of it is lost anywhere."""
    async def main() -> None:
        bed, local, ram = faulty_bed(2)
        m = await bed.primary()
        acked = os.urandom(3 * REGION)
        await until(lambda: all(link.state == IN_SYNC for link in m.links))
        await m.write(4 * REGION, acked)
        await settled(m)
        fault = local.inject(op, err, 5 * REGION, 6 * REGION, count=1)
        with pytest.raises(OSError) as refused:
            if op == "write":
                await m.write(5 * REGION + 4096, os.urandom(8192))
            else:
                await m.write_zeroes(5 * REGION + 4096, 8192)
        assert fault.hits == 1 and refused.value.errno == err and _write_status(refused.value) == status
        for link in m.links:  # the replicas hold the refused write: the region is theirs to get back
            assert 5 in link.missing and link.bitmap.is_dirty(5)
        await until(lambda: all(link.state == IN_SYNC and not link.missing for link in m.links))
        assert same_everywhere(bed, ram, m.size)
        for store in (ram, *bed.stores):
            assert store.data[4 * REGION:7 * REGION] == acked
        for link in m.links:
            assert (await verify(m, link))["mismatched"] == []
        await m.stop()
    run(main())


def test_a_full_metadata_area_refuses_the_write_before_any_copy_takes_it() -> None:
    """The region's bit cannot reach the disk: the data must not go out (after a crash nothing
    would say the copies may differ there). The host gets Capacity Exceeded; once space is
    back the same write goes through with its bit on disk."""
    async def main() -> None:
        bed, local, ram = faulty_bed(1)
        m = await bed.primary()
        await settled(m)
        fault = local.inject("write", errno.ENOSPC, m.data_size, DEVICE)
        with pytest.raises(OSError) as refused:
            await m.write(9 * REGION, b"n" * 4096)
        assert fault.hits >= 1 and _write_status(refused.value) == Status.CAPACITY_EXCEEDED
        assert ram.data[9 * REGION:9 * REGION + 4096] == bytes(4096)
        assert bed.stores[0].data[9 * REGION:9 * REGION + 4096] == bytes(4096)
        assert m.links[0].bitmap.is_dirty(9)  # kept in memory: the next mark writes it again
        local.heal()
        await m.write(9 * REGION, b"y" * 4096)
        on_disk = await Metadata.open(BackendBlockIO(ram))
        assert on_disk.bitmap(m.links[0].slot).is_dirty(9)
        assert bed.stores[0].data[9 * REGION:9 * REGION + 4096] == b"y" * 4096
        await m.stop()
    run(main())


def test_a_generation_the_full_superblock_could_not_record_is_started_by_the_next_write() -> None:
    """Writes while a replica is away need a new generation on disk first (so that a copy
    promoted meanwhile shows as split brain, not as behind): while the superblock cannot be
    written they are refused with Capacity Exceeded, and once it can, the next write starts it."""
    async def main() -> None:
        bed, local, ram = faulty_bed(2)
        m = await bed.primary()
        await settled(m)
        before = m.md.current
        faults = [local.inject("write", errno.ENOSPC, offset, offset + 4096) for offset in superblock_offsets(DEVICE)]
        bed.kill(1)
        with pytest.raises(OSError) as refused:  # r1 fails under this write: the generation cannot be saved
            await m.write(0, b"a" * 4096)
        assert _write_status(refused.value) == Status.CAPACITY_EXCEEDED
        assert m.links[1].state == DEGRADED and m.md.current == before
        with pytest.raises(OSError) as refused:  # refused before anything is written
            await m.write(REGION, b"b" * 4096)
        assert _write_status(refused.value) == Status.CAPACITY_EXCEEDED
        assert ram.data[REGION:REGION + 4096] == bytes(4096) == bed.stores[0].data[REGION:REGION + 4096]
        assert sum(f.hits for f in faults) >= 2
        local.heal()
        await m.write(REGION, b"c" * 4096)
        assert m.md.current != before
        assert (await Metadata.open(BackendBlockIO(ram))).current == m.md.current
        bed.up[1] = True
        await until(lambda: all(link.state == IN_SYNC for link in m.links))
        assert same_everywhere(bed, ram, m.size)
        await m.stop()
    run(main())


def test_eio_on_a_resync_read_keeps_the_replica_out_of_sync_and_retries_with_backoff() -> None:
    """A bad sector under a region the replica misses: the replica stays degraded with a reason
    naming the region, the error is logged once, each retry waits twice as long as the last, and
    the region never leaves what the replica misses; once the read works the resync ends."""
    async def main() -> None:
        bed, local, ram = faulty_bed(1)
        m = await bed.primary()
        await settled(m)
        bed.kill(0)
        await m.write(3 * REGION, os.urandom(4096))
        await m.write(8 * REGION, os.urandom(4096))
        fault = local.inject("read", errno.EIO, 8 * REGION + 512, 8 * REGION + 1024)
        link = m.links[0]
        bed.up[0] = True
        loop = asyncio.get_running_loop()
        await until(lambda: link.local_errors >= 1)
        first = loop.time()
        await until(lambda: link.local_errors >= 5)
        # between the 1st and the 5th: waits of 2, 4, 8 and 16 x RECONNECT_DELAY (0.02 s here),
        # 0.6 s (less up to two 10 ms polls of until(); without the doubling: 0.08 s)
        assert loop.time() - first >= 0.02 * (2 + 4 + 8 + 16) - 0.05
        assert link.state == DEGRADED and "region 8" in link.reason and "Errno 5" in link.reason
        assert 8 in link.missing and link.bitmap.is_dirty(8)
        assert fault.hits == link.local_errors
        local.heal()
        await until(lambda: link.state == IN_SYNC and not link.missing)
        assert same_everywhere(bed, ram, m.size)
        await m.stop()

    with capture_logs() as logs:
        run(main())
    stopped = [e for e in logs if e["event"].startswith("resync stopped")]
    assert len(stopped) == 1, stopped  # not once per retry
    assert stopped[0]["log_level"] == "error" and "region 8" in stopped[0]["error"]


def test_eio_during_a_verify_names_the_region_and_what_it_found_is_still_mended() -> None:
    async def main() -> None:
        bed, local, ram = faulty_bed(1)
        m = await bed.primary()
        await until(lambda: m.links[0].state == IN_SYNC)
        await m.write(0, os.urandom(m.size))
        await settled(m)
        bed.stores[0].data[2 * REGION + 5] ^= 0xFF  # found before the bad region
        # a bad sector fails each read of it: the read of the unit holding it, then its region's own
        local.inject("read", errno.EIO, 10 * REGION, 11 * REGION, count=2)
        with pytest.raises(LocalCopyError) as failed:
            await verify(m, m.links[0])
        assert failed.value.errno == errno.EIO and "region 10" in str(failed.value)
        await until(lambda: m.links[0].state == IN_SYNC and not m.links[0].missing)
        assert same_everywhere(bed, ram, m.size)
        assert (await verify(m, m.links[0]))["mismatched"] == []
        await m.stop()
    run(main())


def test_a_failing_flush_gets_write_fault_and_no_bit_is_cleared_until_it_works() -> None:
    """The sweeper clears a bit only after every copy flushed: while this copy's flush fails
    (EIO from fdatasync), the written region keeps its bit however often the sweeper tries, and
    says so once, not at every sweep."""
    async def main() -> None:
        bed, local, ram = faulty_bed(1)
        m = await bed.primary()
        await settled(m)
        fault = local.inject("flush", errno.EIO)
        await m.write(6 * REGION, b"f" * 4096)
        with pytest.raises(OSError) as refused:
            await m.flush()
        assert _write_status(refused.value) == Status.WRITE_FAULT
        await until(lambda: fault.hits >= 4)  # the sweeper tried (and failed) three times
        assert m.links[0].bitmap.is_dirty(6)
        local.heal()
        await until(lambda: not m.links[0].bitmap.dirty_count())
        await m.stop()

    with capture_logs() as logs:
        run(main())
    failed = [e for e in logs if e["event"].startswith("clearing write-intent bits failed")]
    assert len(failed) == 1, failed


@ERRORS
def test_the_host_sees_the_status_on_the_wire(tmp_path: Path, err: int, status: Status) -> None:
    """A target serving a replicated namespace over NVMe/TCP: the refused write completes with
    the status (and the More bit: an Error Information entry), the next write succeeds."""
    port = free_port()
    cfg = config([port], [sub(namespaces=[ns(tmp_path / "a.img", 1, DEVICE)])])

    async def main() -> None:
        async with serving(cfg) as service:
            namespace = service.target.subsystems[NQN].namespaces[1]
            local = FaultyBackend(namespace.backend)
            bed = Bed(1)
            m = namespace.backend = await ReplicatedBackend.open(
                local, [("r0", bed.opener(0))], REGION, 1, 1 << 30, 4, name="wire")
            m.start()
            await until(lambda: m.links[0].state == IN_SYNC)
            host = await connect(port, nr_io_queues=1)
            try:
                local.inject("write", err, 0, REGION, count=1)
                with pytest.raises(NvmeError) as refused:
                    await host.write(1, 8, b"w" * 4096)
                assert refused.value.status == status and refused.value.more
                await host.write(1, 8, b"v" * 4096)
                await until(lambda: m.links[0].state == IN_SYNC and not m.links[0].missing)
                assert bed.stores[0].data[4096:8192] == b"v" * 4096
            finally:
                await host.close()
                await m.stop()

    run(main())
