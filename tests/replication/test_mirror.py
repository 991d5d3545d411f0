"""ReplicatedBackend in one process: a RAM local copy and RAM replicas behind a fake link that
can fail, hang up and come back. The loopback tests (test_loopback.py) do the same through
real target processes; these pin the rules one at a time, fast."""

from __future__ import annotations

import asyncio
import hashlib
import os
from typing import Any, Callable

import pytest

from protocol.status import Status
from target.backend import Backend, MemoryBackend
from target.replication import mirror as mirror_mod
from target.replication.blockio import BackendBlockIO
from target.replication.link import DEGRADED, IN_SYNC, REFUSED, SPLIT_BRAIN
from target.replication.metadata import Metadata
from target.replication.mirror import ReplicatedBackend, ReplicationError
from target.replication.resolve import discard_local, discard_replica
from target.replication.verify import verify

DEVICE = 4 << 20
REGION = 64 << 10


class FakeReplica:
    """A replica namespace over ``store``; ``down`` makes every call fail as a lost connection
    would. FUA and Flush go to the store: a :class:`MemoryBackend` ignores them, the volatile
    cache of ``fake_blockio.MemoryBlockIO`` keeps them (test_mirror_durability.py)."""

    def __init__(self, store: Backend, name: str) -> None:
        self.store = store
        self.size = store.size
        self.name = name
        self.block_size = 512
        self.stale_for = 0.0
        self.gave_up = False
        self.down = False
        self.written = 0
        self.closed = False
        self.fail_with: Exception | None = None
        """Every call raises this (a status from the replica, as the host library's NvmeError)."""
        self.gates: dict[int, asyncio.Event] = {}
        """offset -> event: a write that covers that offset waits for the event (a slow replica,
        on cue; a resync copies several regions in one write)."""

    def _check(self) -> None:
        if self.down or self.closed:
            raise ConnectionError(f"{self.name} is down")
        if self.fail_with is not None:
            raise self.fail_with

    def submit_write(self, offset: int, data: Any, fua: bool, done: Callable[[BaseException | None], None]) -> None:
        async def go() -> None:
            try:
                await self.write(offset, bytes(data), fua)
            except Exception as exc:
                done(exc)
            else:
                done(None)
        asyncio.get_running_loop().create_task(go())

    async def read(self, offset: int, length: int) -> bytes:
        self._check()
        buf = bytearray(length)
        await self.store.read_into(offset, memoryview(buf))
        return bytes(buf)

    async def read_into(self, offset: int, buf: memoryview) -> None:
        self._check()
        await self.store.read_into(offset, buf)

    async def write(self, offset: int, data: Any, fua: bool = False) -> None:
        self._check()
        await asyncio.sleep(0)
        for at, gate in list(self.gates.items()):
            if offset <= at < offset + len(data):
                await gate.wait()
        await self.store.write(offset, data, fua)
        self.written += len(data)

    async def flush(self) -> None:
        self._check()
        await self.store.flush()

    async def write_zeroes(self, offset: int, length: int) -> None:
        await self.write(offset, bytes(length))

    async def close(self) -> None:
        self.closed = True


class Bed:
    """A primary over RAM with ``n`` RAM replicas; ``up[i]`` says whether replica ``i`` answers."""

    def __init__(self, n: int = 2, local: Backend | None = None,
                 stores: list[Backend] | None = None) -> None:
        self.local = local or MemoryBackend(DEVICE)
        self.stores = stores or [MemoryBackend(DEVICE) for _ in range(n)]
        self.up = [True] * n
        self.opened: list[list[FakeReplica]] = [[] for _ in range(n)]
        self.stale_for = 0.0
        """What the replicas opened from now on say of an association given up on."""

    def opener(self, i: int) -> Callable[[], Any]:
        async def open_() -> FakeReplica:
            if not self.up[i]:
                raise ConnectionRefusedError(f"replica {i} refuses")
            r = FakeReplica(self.stores[i], f"r{i}")
            r.stale_for = self.stale_for
            self.opened[i].append(r)
            return r
        return open_

    async def primary(self, min_in_sync: int = 1, rate: int = 1 << 30) -> ReplicatedBackend:
        backend = await ReplicatedBackend.open(self.local, [(f"r{i}", self.opener(i)) for i in range(len(self.stores))],
                                               REGION, min_in_sync, rate, 4, name="test")
        backend.start()
        return backend

    def kill(self, i: int) -> None:
        self.up[i] = False
        for r in self.opened[i]:
            r.down = True


def data_hash(store: MemoryBackend, size: int) -> str:
    return hashlib.sha256(store.data[:size]).hexdigest()


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


@pytest.fixture(autouse=True)
def fast_links(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mirror_mod, "RECONNECT_DELAY", 0.02)
    monkeypatch.setattr(mirror_mod, "SWEEP_INTERVAL", 0.05)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_writes_reach_every_copy_and_the_data_area_excludes_metadata() -> None:
    async def main() -> None:
        bed = Bed(2)
        m = await bed.primary()
        assert m.size < DEVICE and m.size % 4096 == 0
        await until(lambda: all(link.state == IN_SYNC for link in m.links))
        payload = os.urandom(3 * REGION)
        await m.write(REGION // 2, payload, fua=True)
        for store in bed.stores:
            assert store.data[REGION // 2:REGION // 2 + len(payload)] == payload
        await m.stop()
    run(main())


def test_a_failed_replica_is_left_behind_and_resync_copies_only_what_it_missed() -> None:
    async def main() -> None:
        bed = Bed(2)
        m = await bed.primary()
        await until(lambda: all(link.state == IN_SYNC for link in m.links))
        await m.write(0, os.urandom(m.size))  # everything written once, then settled
        await until(lambda: all(not link.bitmap.dirty_count() for link in m.links))
        bed.kill(1)
        await m.write(5 * REGION, os.urandom(4096))  # the host sees no error
        assert m.links[1].state == DEGRADED and m.links[0].state == IN_SYNC
        await m.write(9 * REGION + 100 * 512, os.urandom(2 * REGION))  # regions 9, 10, 11
        assert m.links[1].missing >= {5, 9, 10, 11}
        base = m.links[1].copied_total
        bed.up[1] = True
        await until(lambda: m.links[1].state == IN_SYNC)
        assert m.links[1].copied_total - base == 4 * REGION
        for store in bed.stores:
            assert data_hash(store, m.size) == data_hash(bed.local, m.size)
        await m.stop()
    run(main())


def test_min_in_sync_refuses_writes_with_namespace_not_ready() -> None:
    async def main() -> None:
        bed = Bed(1)
        m = await bed.primary(min_in_sync=2)
        await until(lambda: m.links[0].state == IN_SYNC)
        await m.write(0, bytes(4096))
        bed.kill(0)
        with pytest.raises(ReplicationError) as err:
            await m.write(0, bytes(4096))  # the replica fails during this one: Write Fault
        assert err.value.status == Status.WRITE_FAULT
        with pytest.raises(ReplicationError) as err:
            await m.write(0, bytes(4096))  # known out of sync: refused before anything is written
        assert err.value.status == Status.NS_NOT_READY
        await m.stop()
    run(main())


def test_a_write_during_resync_is_never_overwritten_by_the_copy() -> None:
    async def main() -> None:
        bed = Bed(1)
        m = await bed.primary(rate=8 * REGION)  # slow: about 8 regions per second
        await until(lambda: m.links[0].state == IN_SYNC)
        bed.kill(0)
        await m.write(0, os.urandom(m.size))
        bed.up[0] = True
        await until(lambda: m.links[0].state == "resyncing" and m.links[0].progress is not None
                    and m.links[0].progress.copied > 0)
        progress = m.view()["replicas"][0]["resync"]
        assert 0 < progress["percent"] < 100 and progress["mb_per_s"] > 0 and progress["eta_s"] > 0
        assert progress["total_bytes"] >= m.size - REGION
        for _ in range(30):  # writes while the copy runs, across copied and uncopied regions
            region = int.from_bytes(os.urandom(2), "little") % (m.size // REGION)
            await m.write(region * REGION, os.urandom(REGION))
            await asyncio.sleep(0.01)
        m.resync_rate = 1 << 30
        await until(lambda: m.links[0].state == IN_SYNC)
        assert data_hash(bed.stores[0], m.size) == data_hash(bed.local, m.size)
        await m.stop()
    run(main())


def test_a_host_write_to_the_region_being_copied_waits_for_the_copy() -> None:
    async def main() -> None:
        bed = Bed(1)
        m = await bed.primary()
        await until(lambda: m.links[0].state == IN_SYNC)
        bed.kill(0)
        await m.write(2 * REGION, b"X" * 4096)
        gate = asyncio.Event()
        real_opener = bed.opener(0)

        async def slow_opener() -> FakeReplica:
            r = await real_opener()
            r.gates[2 * REGION] = gate
            return r
        m.links[0].opener = slow_opener
        bed.up[0] = True
        await until(lambda: 2 in m.copying)  # the copy of region 2 read X and waits at the replica
        host = asyncio.get_running_loop().create_task(m.write(2 * REGION, b"Y" * 4096))
        await asyncio.sleep(0.05)
        assert not host.done()  # held by the region's lock
        gate.set()
        await host
        await until(lambda: m.links[0].state == IN_SYNC)
        assert bed.stores[0].data[2 * REGION:2 * REGION + 4096] == b"Y" * 4096
        await m.stop()
    run(main())


@pytest.mark.parametrize("second", ["write", "write_zeroes", "discard"])
def test_an_overlapping_command_waits_until_the_earlier_write_is_on_every_copy(second: str) -> None:
    """The replica applies the first write after the second (a gate holds it, as another queue's
    thread would): without ordering the copies keep different winners; with it the second waits
    and both copies end with the second. A write beside the held one overlaps nothing and does
    not wait."""
    async def main() -> None:
        bed = Bed(1)
        m = await bed.primary()
        await until(lambda: m.links[0].state == IN_SYNC)
        replica = bed.opened[0][-1]
        at = 2 * REGION + 8192
        gate = asyncio.Event()
        replica.gates[at] = gate
        loop = asyncio.get_running_loop()
        first = loop.create_task(m.write(at, b"A" * 4096))
        await until(lambda: len(m.inflight.get(2, ())) == 1)
        beside = loop.create_task(m.write(at + 4096, b"C" * 4096))  # no overlap: goes through
        await asyncio.wait_for(beside, 5)
        if second == "write":
            op = m.write(at - 4096, b"B" * 8192)
        else:
            op = getattr(m, second)(at - 4096, 8192)
        later = loop.create_task(op)
        # the later command either completed (no ordering: the break) or waits on the first
        await until(lambda: later.done() or m.inflight[2][0].done is not None)
        gate.set()
        await first
        await later
        want = (b"B" * 8192) if second == "write" else bytes(8192)
        assert bytes(bed.local.data[at - 4096:at + 4096]) == want
        assert bytes(bed.stores[0].data[at - 4096:at + 4096]) == want
        assert data_hash(bed.stores[0], m.size) == data_hash(bed.local, m.size)
        assert not m.inflight
        await m.stop()
    run(main())


def test_a_command_waiting_on_two_earlier_writes_goes_on_when_the_second_ended_first() -> None:
    """The later write overlaps two in flight: it waits for the first (held at the replica),
    while the second completes; once the first completes it must go on, not wait for the second
    again (found by the twenty cuts of test_partitions.py: four host writes hung for ever)."""
    async def main() -> None:
        bed = Bed(1)
        m = await bed.primary()
        await until(lambda: m.links[0].state == IN_SYNC)
        replica = bed.opened[0][-1]
        at = 2 * REGION + 8192
        gate = asyncio.Event()
        replica.gates[at] = gate
        loop = asyncio.get_running_loop()
        first = loop.create_task(m.write(at, b"A" * 4096))
        await until(lambda: len(m.inflight.get(2, ())) == 1)
        second_gate = asyncio.Event()
        replica.gates[at + 4096] = second_gate
        second = loop.create_task(m.write(at + 4096, b"B" * 4096))
        await until(lambda: len(m.inflight.get(2, ())) == 2)
        later = loop.create_task(m.write(at, b"C" * 8192))
        await until(lambda: m.inflight[2][0].done is not None)  # waiting on the first
        second_gate.set()
        await asyncio.wait_for(second, 5)
        gate.set()
        await asyncio.wait_for(first, 5)
        await asyncio.wait_for(later, 5)
        assert bytes(bed.local.data[at:at + 8192]) == bytes(bed.stores[0].data[at:at + 8192]) == b"C" * 8192
        assert not m.inflight
        await m.stop()
    run(main())


def test_bits_are_cleared_lazily_after_every_copy_has_the_write() -> None:
    async def main() -> None:
        bed = Bed(1)
        m = await bed.primary()
        await until(lambda: m.links[0].state == IN_SYNC)
        await m.write(3 * REGION, bytes(4096))
        assert m.links[0].bitmap.is_dirty(3)  # set before the write went out
        await until(lambda: not m.links[0].bitmap.is_dirty(3))
        await m.stop()
    run(main())


def test_a_full_sync_clears_its_bits_at_once_not_a_sweep_later(monkeypatch: pytest.MonkeyPatch) -> None:
    """A full sync sets every bit of the replica's slot; they are cleared (and written: the
    replica's copy of the metadata has them too) as soon as it ends, not at the next periodic
    sweep: a failover in between made the promoted replica resync the whole volume back
    (tests/fuse/test_failover_pair.py). The sweep interval is an hour here. Break: no
    ``_sweep_now.set()`` in resync_done -> the bits stay set."""
    monkeypatch.setattr(mirror_mod, "SWEEP_INTERVAL", 3600.0)

    async def main() -> None:
        bed = Bed(1)
        m = await bed.primary()
        await until(lambda: m.links[0].state == IN_SYNC, 10)
        await until(lambda: not m.links[0].bitmap.dirty_count(), 5)
        for store in (bed.local, bed.stores[0]):  # on disk, in this copy's metadata and the replica's
            md = await Metadata.open(BackendBlockIO(store))
            assert [md.bitmap(slot).dirty_count() for slot, peer in enumerate(md.peers) if peer.node_id] == [0]
        await m.stop()
    run(main())


def test_primary_restart_resyncs_the_regions_its_bitmap_holds() -> None:
    async def main() -> None:
        bed = Bed(1)
        m = await bed.primary()
        await until(lambda: m.links[0].state == IN_SYNC and not m.links[0].bitmap.dirty_count())
        bed.kill(0)
        await m.write(7 * REGION, b"x" * 4096)
        data = bed.local.data
        m.close()  # a crash: nothing more persisted (close() does not sweep)
        bed.local.data = data
        bed.up[0] = True
        m2 = await bed.primary()
        await until(lambda: m2.links[0].state == IN_SYNC)
        assert m2.links[0].copied_total == REGION
        assert bed.stores[0].data[7 * REGION:7 * REGION + 4096] == b"x" * 4096
        await m2.stop()
    run(main())


async def split_brain(bed: Bed) -> ReplicatedBackend:
    """The primary writes "A" at 0 while its replica is away, then the replica, as a primary of
    its own (its replica, the first copy, away), writes "B" at one region; the first copy,
    restarted, meets it again: split brain. Returns that restarted primary."""
    a = await bed.primary()
    await until(lambda: a.links[0].state == IN_SYNC)
    bed.kill(0)
    await a.write(0, b"A" * 4096)
    await a.stop()
    other = Bed(1, local=bed.stores[0], stores=[bed.local])
    other.up[0] = False
    b = await other.primary()
    await b.write(REGION, b"B" * 4096)
    await b.stop()
    bed.up[0] = True
    a2 = await bed.primary()
    await until(lambda: a2.links[0].state == SPLIT_BRAIN)
    return a2


def test_split_brain_is_refused_and_discarding_the_replica_resolves_it() -> None:
    async def main() -> None:
        bed = Bed(1)
        a2 = await split_brain(bed)
        assert bed.stores[0].data[REGION:REGION + 4096] == b"B" * 4096  # nothing overwritten
        discard_replica(a2, "r0")
        await until(lambda: a2.links[0].state == IN_SYNC)
        assert data_hash(bed.stores[0], a2.size) == data_hash(bed.local, a2.size)
        await a2.stop()
    run(main())


def test_a_replica_ahead_of_this_copy_is_refused() -> None:
    async def main() -> None:
        bed = Bed(1)
        a = await bed.primary()
        await until(lambda: a.links[0].state == IN_SYNC)
        await a.stop()
        other = Bed(1, local=bed.stores[0], stores=[bed.local])
        other.up[0] = False
        b = await other.primary()
        await b.write(0, b"B" * 4096)
        await b.stop()
        a2 = await bed.primary()
        await until(lambda: a2.links[0].state == REFUSED)
        await a2.stop()
    run(main())


def test_verify_names_the_flipped_region_and_resync_mends_it() -> None:
    async def main() -> None:
        bed = Bed(1)
        m = await bed.primary()
        await until(lambda: m.links[0].state == IN_SYNC)
        await m.write(0, os.urandom(m.size))
        bed.stores[0].data[13 * REGION + 777] ^= 0xFF
        report = await verify(m, m.links[0])
        assert [x["region"] for x in report["mismatched"]] == [13]
        await until(lambda: m.links[0].state == IN_SYNC)
        assert data_hash(bed.stores[0], m.size) == data_hash(bed.local, m.size)
        assert (await verify(m, m.links[0]))["mismatched"] == []
        await m.stop()
    run(main())


def test_zeroes_deallocate_and_flush_reach_every_copy() -> None:
    async def main() -> None:
        bed = Bed(2)
        m = await bed.primary()
        await until(lambda: all(link.state == IN_SYNC for link in m.links))
        await m.write(0, b"\xaa" * (4 * REGION))
        await m.write_zeroes(4096, 8192)
        await m.discard(2 * REGION, REGION)
        flushed = []
        for r in (bed.opened[0][-1], bed.opened[1][-1]):
            async def flush(r: FakeReplica = r) -> None:
                flushed.append(r.name)
            r.flush = flush  # type: ignore[method-assign]
        await m.flush()
        assert sorted(flushed) == ["r0", "r1"]
        for store in bed.stores:
            assert store.data[:4 * REGION] == bed.local.data[:4 * REGION]
            assert store.data[4096:12288] == bytes(8192) and store.data[2 * REGION:3 * REGION] == bytes(REGION)
        await m.stop()
    run(main())


def test_a_write_in_flight_when_the_primary_dies_is_resynced_after_restart() -> None:
    async def main() -> None:
        bed = Bed(1)
        m = await bed.primary()
        await until(lambda: m.links[0].state == IN_SYNC and not m.links[0].bitmap.dirty_count())
        replica = bed.opened[0][-1]
        replica.gates[9 * REGION] = asyncio.Event()  # the replica never gets this write
        write = asyncio.get_running_loop().create_task(m.write(9 * REGION, b"z" * 4096))
        await until(lambda: bed.local.data[9 * REGION:9 * REGION + 4096] == b"z" * 4096)
        data = bed.local.data
        m.close()  # the primary dies: the local copy has the write, the replica not
        write.cancel()
        bed.local.data = data
        replica.down = True
        m2 = await bed.primary()
        await until(lambda: m2.links[0].state == IN_SYNC)
        assert m2.links[0].copied_total == REGION  # that region, from the bit set before the write
        assert data_hash(bed.stores[0], m2.size) == data_hash(bed.local, m2.size)
        await m2.stop()
    run(main())


def test_a_replica_with_larger_blocks_than_the_namespace_is_refused_with_the_reason() -> None:
    async def main() -> None:
        bed = Bed(1)
        real = bed.opener(0)

        async def big_blocks() -> FakeReplica:
            r = await real()
            r.block_size = 4096
            return r
        m = await bed.primary()  # a 512-byte-block namespace
        m.links[0].opener = big_blocks
        await until(lambda: "could not take a write of one block" in m.links[0].reason)
        assert m.links[0].state == "connecting"
        await m.stop()
    run(main())


def test_a_resync_cut_by_a_primary_restart_resumes_where_it_stopped() -> None:
    async def main() -> None:
        bed = Bed(1)
        m = await bed.primary(rate=8 * REGION)  # 8 regions a second
        await until(lambda: m.links[0].state == IN_SYNC and not m.links[0].bitmap.dirty_count())
        bed.kill(0)
        for r in range(20):
            await m.write(r * REGION, os.urandom(4096))
        bed.up[0] = True
        await until(lambda: m.links[0].state == "resyncing" and m.links[0].copied_total >= 12 * REGION)
        await until(lambda: m.links[0].bitmap.dirty_count() <= 9)  # copied regions' bits cleared
        data = bed.local.data
        m.close()  # the primary dies mid-resync
        bed.local.data = data
        for r in bed.opened[0]:
            r.down = True
        m2 = await bed.primary()
        await until(lambda: m2.links[0].state == IN_SYNC)
        assert 0 < m2.links[0].copied_total <= 9 * REGION  # the rest only, not the 20 regions again
        assert data_hash(bed.stores[0], m2.size) == data_hash(bed.local, m2.size)
        await m2.stop()
    run(main())


def test_a_replica_refusing_with_an_error_status_is_retried_not_given_up() -> None:
    class StatusError(Exception):  # not an OSError: as the host library's NvmeError
        pass

    async def main() -> None:
        bed = Bed(1)
        real = bed.opener(0)
        refusing = True

        async def opener() -> FakeReplica:
            if refusing:
                raise StatusError("Connect failed: CONNECT_INVALID_HOST (sct 1 sc 0x84, dnr)")
            return await real()
        m = await bed.primary()
        m.links[0].opener = opener
        await until(lambda: "CONNECT_INVALID_HOST" in m.links[0].reason)
        await m.write(0, b"w" * 4096)  # the host sees no error
        refusing = False  # the operator fixed the replica's host list
        await until(lambda: m.links[0].state == IN_SYNC)
        assert bed.stores[0].data[:4096] == b"w" * 4096
        await m.stop()
    run(main())


def test_a_clean_stop_leaves_no_bit_for_the_copies_in_sync() -> None:
    async def main() -> None:
        bed = Bed(1)
        m = await bed.primary()
        await until(lambda: m.links[0].state == IN_SYNC and not m.links[0].bitmap.dirty_count())
        for r in range(5):
            await m.write(r * REGION, os.urandom(4096))
        assert m.links[0].bitmap.dirty_count() == 5  # the activity window keeps them while running
        await m.stop()
        m2 = await bed.primary()
        await until(lambda: m2.links[0].state == IN_SYNC)
        assert m2.links[0].copied_total == 0  # nothing to resync after a clean restart
        await m2.stop()
    run(main())


def test_discarding_this_copy_takes_the_replicas_data() -> None:
    async def main() -> None:
        bed = Bed(1)
        a2 = await split_brain(bed)
        with pytest.raises(ReplicationError) as err:  # host I/O waits while this copy is overwritten
            gate = asyncio.Event()
            real = a2.links[0].opener

            async def slow() -> Any:
                await gate.wait()
                return await real()
            a2.links[0].opener = slow
            task = asyncio.get_running_loop().create_task(discard_local(a2, "r0"))
            await asyncio.sleep(0.01)
            try:
                await a2.read_into(0, memoryview(bytearray(4096)))
            finally:
                gate.set()
                await task
        assert err.value.status == Status.NS_NOT_READY
        assert a2.links[0].state == IN_SYNC and not a2.md.inconsistent
        assert bed.local.data[REGION:REGION + 4096] == b"B" * 4096 and bed.local.data[:4096] != b"A" * 4096
        await a2.write(0, b"C" * 4096)  # host I/O is back, and reaches the replica
        assert bed.stores[0].data[:4096] == b"C" * 4096
        assert data_hash(bed.stores[0], a2.size) == data_hash(bed.local, a2.size)
        await a2.stop()
        a3 = await bed.primary()  # the generations agree from now on
        await until(lambda: a3.links[0].state == IN_SYNC)
        await a3.stop()
    run(main())


@pytest.mark.parametrize("failure, gave_up, fenced", [
    (TimeoutError("write timed out"), False, True),
    (ConnectionError("lost: a keep-alive timed out first"), True, True),
    (ConnectionError("closed by the replica"), False, False)])
def test_a_replica_that_timed_out_gets_nothing_until_its_old_association_is_dead(
        failure: Exception, gave_up: bool, fenced: bool) -> None:
    """A write the primary gave up on (its timeout, or another command's on the association)
    may still land on the replica until its ``stale_for`` has passed: no new association, so
    no resync, before then. A connection the replica closed leaves nothing on its way:
    reconnected at once."""
    async def main() -> None:
        loop = asyncio.get_running_loop()
        bed = Bed(1)
        bed.stale_for = 0.5
        m = await bed.primary()
        await until(lambda: m.links[0].state == IN_SYNC)
        bed.opened[0][0].fail_with = failure
        bed.opened[0][0].gave_up = gave_up
        await m.write(0, b"x" * 4096)  # the replica fails it; the host's write completes
        lost = loop.time()
        assert m.links[0].state != IN_SYNC
        await until(lambda: m.links[0].state == IN_SYNC)
        back = loop.time() - lost
        assert (back >= 0.5) == fenced, back
        assert len(bed.opened[0]) == 2
        assert data_hash(bed.local, m.size) == data_hash(bed.stores[0], m.size)
        await m.stop()
    run(main())
