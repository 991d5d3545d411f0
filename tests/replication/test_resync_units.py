"""The resync at disk speed (target/replication/resync.py), in one process: units of consecutive
regions, several in flight, the local copy's holes sent as Write Zeroes, and the rules that must
survive that: the per-region lock over a whole unit, and the rate limit."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from blockd.iostats import KINDS
from initiator.controller import ConnectParams
from initiator.errors import NvmeError
from initiator.replica import RemoteNamespace, open_remote
from protocol.constants import ONCS_DSM, ONCS_WRITE_ZEROES
from protocol.replication import layout
from target.backend import FileBackend, MemoryBackend
from target.replication import resync
from target.replication.link import IN_SYNC

from .test_mirror import DEVICE, REGION, Bed, FakeReplica, data_hash, run, until


class Recording(FakeReplica):
    """A replica that records each data-area write and Write Zeroes, and how many writes were
    at the store at once."""

    def __init__(self, store: Any, name: str, data_size: int) -> None:
        super().__init__(store, name)
        self.data_size = data_size
        self.writes: list[tuple[int, int]] = []
        self.zeroes: list[tuple[int, int]] = []
        self.busy = 0
        self.most_busy = 0

    async def write(self, offset: int, data: Any, fua: bool = False) -> None:
        if offset < self.data_size:
            self.writes.append((offset, len(data)))
        self.busy += 1
        self.most_busy = max(self.most_busy, self.busy)
        try:
            await self.pause(offset)
            await super().write(offset, data, fua)
        finally:
            self.busy -= 1

    async def pause(self, offset: int) -> None:
        """A replica takes a moment: the next units go out meanwhile."""
        await asyncio.sleep(0.001)

    async def write_zeroes(self, offset: int, length: int) -> None:
        self.zeroes.append((offset, length))
        self._check()
        await self.store.write_zeroes(offset, length)


async def _meet(self: Recording, offset: int) -> None:
    """:meth:`Recording.pause` that holds the first data write (up to 5 s) until a second one is
    at the replica too: units sent together meet here whatever the machine's load (a 1 ms pause
    let a loaded CI machine finish one unit before the next arrived: most_busy 1); one unit at a
    time, the first waits out its 5 s alone and most_busy stays 1."""
    if offset >= self.data_size:
        return
    second = self.__dict__.setdefault("second", asyncio.Event())
    if self.busy > 1:
        second.set()
    elif not second.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(second.wait(), 5)


def recording_bed(local: Any = None, garbage: bool = True, device: int = DEVICE) -> tuple[Bed, list[Recording]]:
    """A one-replica bed whose replica records; its store starts as garbage (a replica that held
    something else), so a region the resync skips would show."""
    store = MemoryBackend(device)
    if garbage:
        store.data[:] = os.urandom(device)
        store.data[-8192:] = bytes(8192)  # blank superblocks: formatted as a new replica
    bed = Bed(1, local=local, stores=[store])
    opened: list[Recording] = []

    def opener(i: int) -> Any:
        async def open_() -> Recording:
            r = Recording(store, "r0", layout(device, REGION, 4).data_size)
            opened.append(r)
            bed.opened[i].append(r)
            return r
        return open_
    bed.opener = opener  # type: ignore[method-assign]
    return bed, opened


def test_a_full_sync_copies_units_of_consecutive_regions_several_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Recording, "pause", _meet)

    async def main() -> None:
        device = 4 * resync.UNIT  # several units
        local = MemoryBackend(device)
        local.data[:] = os.urandom(device)
        local.data[-(64 << 10):] = bytes(64 << 10)  # blank metadata: formatted at open
        bed, opened = recording_bed(local, device=device)
        m = await bed.primary()
        await until(lambda: m.links[0].state == IN_SYNC)
        writes = opened[-1].writes
        assert max(n for _, n in writes) == resync.UNIT  # 64 regions in one write
        assert len(writes) == -(-m.size // resync.UNIT)  # and no region twice
        assert opened[-1].most_busy > 1  # several units at the replica at once
        assert data_hash(bed.stores[0], m.size) == data_hash(local, m.size)
        await m.stop()
    run(main())


def test_the_holes_of_a_sparse_local_file_go_as_write_zeroes(tmp_path: Path) -> None:
    path = tmp_path / "local.img"
    with open(path, "wb") as f:  # data in 1 MiB of every 2; one 4 KiB block in the second hole
        f.truncate(DEVICE)
        f.write(os.urandom(1 << 20))
        f.seek(2 << 20)
        f.write(os.urandom(1 << 20))
        f.seek((1 << 20) + 12 * 4096)
        f.write(b"\x07" * 4096)

    async def main() -> None:
        local = FileBackend(str(path))
        # tmp_path's file system knows its holes (ext4, xfs, btrfs, tmpfs do)
        assert local.data_extents(0, 4 << 20) == [(0, 1 << 20), ((1 << 20) + 12 * 4096, 4096), (2 << 20, 1 << 20)]
        bed, opened = recording_bed(local)
        m = await bed.primary()
        await until(lambda: m.links[0].state == IN_SYNC)
        r = opened[-1]
        sent = sum(n for _, n in r.writes)
        zeroed = sum(n for _, n in r.zeroes)
        assert sent + zeroed == m.size
        assert zeroed >= m.size - (2 << 20) - 4096 - 2 * resync.MIN_HOLE  # the holes were not read and sent
        assert ((1 << 20) + 12 * 4096, 4096) in r.writes or any(
            o <= (1 << 20) + 12 * 4096 < o + n for o, n in r.writes)  # the lone block in a hole went as data
        buf = bytearray(m.size)
        await local.read_into(0, memoryview(buf))
        assert bytes(bed.stores[0].data[:m.size]) == bytes(buf)  # the replica's garbage is gone
        await m.stop()
        local.close()
    run(main())


def test_pieces_cut_holes_to_whole_blocks_and_keep_short_ones_as_data() -> None:
    class Extents:
        def __init__(self, data: list[tuple[int, int]]) -> None:
            self.data = data

        def data_extents(self, offset: int, length: int) -> list[tuple[int, int]]:
            return self.data
    hole = resync.MIN_HOLE
    # data at 0..1000, a hole to 1000 + hole + 5000 (trimmed to whole blocks), data, a short hole, data
    b = Extents([(0, 1000), (1000 + hole + 5000, 4096), (1000 + hole + 5000 + 4096 + 512, 10)])
    end = 1000 + hole + 5000 + 4096 + 512 + 10
    pieces = resync.pieces(b, 0, end)
    assert pieces == [(0, 4096, True), (4096, (1000 + hole + 5000) // 4096 * 4096 - 4096, False),
                      ((1000 + hole + 5000) // 4096 * 4096, end - (1000 + hole + 5000) // 4096 * 4096, True)]
    assert resync.pieces(Extents([]), 0, 2 * hole) == [(0, 2 * hole, False)]  # all hole
    assert resync.pieces(object(), 0, 100) == [(0, 100, True)]  # a backend without holes


def test_a_host_write_to_any_region_of_a_unit_being_copied_waits_for_the_copy() -> None:
    async def main() -> None:
        local = MemoryBackend(DEVICE)
        bed, opened = recording_bed(local, garbage=False)
        m = await bed.primary()
        await until(lambda: m.links[0].state == IN_SYNC and not m.links[0].bitmap.dirty_count())
        bed.kill(0)
        await m.write(0, b"A" * (8 * REGION))  # regions 0..7 missed: one unit
        gate = asyncio.Event()
        real = bed.opener(0)

        async def gated() -> Any:
            r = await real()
            r.gates[0] = gate
            return r
        m.links[0].opener = gated
        bed.up[0] = True
        await until(lambda: 5 in m.copying)  # the unit read A and waits at the replica
        host = asyncio.get_running_loop().create_task(m.write(5 * REGION + 4096, b"B" * 4096))
        for _ in range(50):  # the copy is held: the host write must stay held with it
            await asyncio.sleep(0.001)
            assert not host.done()
        gate.set()
        await host
        await until(lambda: m.links[0].state == IN_SYNC)
        assert bed.stores[0].data[5 * REGION + 4096:5 * REGION + 8192] == b"B" * 4096
        assert data_hash(bed.stores[0], m.size) == data_hash(local, m.size)
        await m.stop()
    run(main())


def test_the_rate_limit_holds_with_units() -> None:
    async def main() -> None:
        local = MemoryBackend(DEVICE)
        local.data[:] = os.urandom(DEVICE)
        local.data[-(64 << 10):] = bytes(64 << 10)  # blank metadata: formatted at open
        bed, opened = recording_bed(local)
        rate = 32 * REGION  # 2 MiB/s: 256 KiB units, the 4 MiB in about 2 s
        m = await bed.primary(rate=rate)
        await until(lambda: m.links[0].state == "resyncing" and m.links[0].progress is not None)
        started = time.monotonic()
        await until(lambda: m.links[0].state == IN_SYNC, timeout=30)
        elapsed = time.monotonic() - started
        assert max(n for _, n in opened[-1].writes) == resync.unit_regions(REGION, rate) * REGION == rate // 8
        # never ahead of the rate by more than one unit
        assert elapsed >= (m.size - rate // 8) / rate - 0.1, elapsed
        await m.stop()
    run(main())


def test_a_replica_that_refuses_write_zeroes_gets_zeroes_written() -> None:
    """nvmet answers Write Zeroes with ONCS Not Supported (SCT 1, SC 0x83) on a file system
    that cannot zero a range (tmpfs): the hole is then written as zeroes, and so is every later
    one, without asking again (found in the VM bed: the resync failed at every hole)."""
    class Ctrl:
        def __init__(self) -> None:
            self.params = ConnectParams(traddr="127.0.0.1", subnqn="nqn.2026-11.io.blockd:c")
            self.zeroes: list[tuple[int, int]] = []
            self.writes: list[tuple[int, int]] = []
            self.store = bytearray(b"\x55" * (8 << 20))
            self.identity = SimpleNamespace(oncs=ONCS_WRITE_ZEROES)

        def namespace(self, nsid: int) -> Any:
            return type("Ns", (), {"size": len(self.store), "block_size": 4096})()

        async def write_zeroes(self, nsid: int, slba: int, nblocks: int, deallocate: bool = False) -> None:
            self.zeroes.append((slba, nblocks))
            raise NvmeError(0x183 | 0x4000, "write_zeroes on namespace 1")

        async def write_bytes(self, nsid: int, offset: int, data: Any, fua: bool = False) -> None:
            self.writes.append((offset, len(data)))
            self.store[offset:offset + len(data)] = data

    async def main() -> None:
        ctrl = Ctrl()
        ns = RemoteNamespace(ctrl, 1)  # type: ignore[arg-type]
        await ns.write_zeroes(4096, (3 << 20) - 4096)
        await ns.write_zeroes(5 << 20, 8192)
        assert ctrl.zeroes == [(1, 767)]  # asked once
        assert sum(n for _, n in ctrl.writes) == (3 << 20) - 4096 + 8192
        assert ctrl.store[4096:3 << 20] == bytes((3 << 20) - 4096) and ctrl.store[:4096] == b"\x55" * 4096
        assert ctrl.store[5 << 20:(5 << 20) + 8192] == bytes(8192)
    run(main())


class ZeroingCtrl:
    """A replica controller's side of a hole: Identify ONCS as given, and every command that
    changes data recorded (Write Zeroes with its DEAC, writes, Dataset Management)."""

    def __init__(self, oncs: int) -> None:
        self.params = ConnectParams(traddr="127.0.0.1", subnqn="nqn.2026-11.io.blockd:c")
        self.identity = SimpleNamespace(oncs=oncs)
        self.sent: list[tuple[str, int, int, bool]] = []
        self.store = bytearray(b"\x55" * (4 << 20))

    def namespace(self, nsid: int) -> Any:
        return SimpleNamespace(size=len(self.store), block_size=4096)

    async def write_zeroes(self, nsid: int, slba: int, nblocks: int, deallocate: bool = False) -> None:
        self.sent.append(("write zeroes", slba, nblocks, deallocate))
        self.store[slba * 4096:(slba + nblocks) * 4096] = bytes(nblocks * 4096)

    async def deallocate(self, nsid: int, ranges: list[tuple[int, int]]) -> None:
        self.sent.append(("deallocate", ranges[0][0], ranges[0][1], True))

    async def write_bytes(self, nsid: int, offset: int, data: Any, fua: bool = False) -> None:
        self.sent.append(("write", offset // 4096, len(data) // 4096, False))
        self.store[offset:offset + len(data)] = data


@pytest.mark.parametrize("oncs, dlfeat, sent", [
    # deallocated blocks read as zeroes and DEAC honoured: Write Zeroes with DEAC (a thin replica stays thin)
    (ONCS_WRITE_ZEROES | ONCS_DSM, 0x09, "write zeroes+deac"),
    # reads as zeroes but DEAC not honoured (bit 3 clear), or deallocated blocks read as FFh: no DEAC
    (ONCS_WRITE_ZEROES | ONCS_DSM, 0x01, "write zeroes"),
    (ONCS_WRITE_ZEROES | ONCS_DSM, 0x0A, "write zeroes"),
    # nvmet's file namespace: ONCS DSM and Write Zeroes, DLFEAT 0
    (ONCS_WRITE_ZEROES | ONCS_DSM, 0x00, "write zeroes"),
    # no Write Zeroes: writes of zeroes, never the advisory Dataset Management (it may do nothing)
    (ONCS_DSM, 0x09, "write"),
    (0, 0x00, "write"),
])
def test_a_hole_is_zeroed_as_the_replica_says_it_can(oncs: int, dlfeat: int, sent: str) -> None:
    async def main() -> None:
        ctrl = ZeroingCtrl(oncs)
        ns = RemoteNamespace(ctrl, 1, dlfeat)  # type: ignore[arg-type]
        await ns.write_zeroes(1 << 20, 2 << 20)
        kinds = {kind + ("+deac" if deac and kind == "write zeroes" else "") for kind, *_, deac in ctrl.sent}
        assert kinds == {sent}, ctrl.sent
        assert sum(n for _, _, n, _ in ctrl.sent) == (2 << 20) // 4096  # the hole, once
        assert ctrl.store[1 << 20:3 << 20] == bytes(2 << 20)
        assert ctrl.store[:1 << 20] == ctrl.store[3 << 20:] == b"\x55" * (1 << 20)
    run(main())


def test_a_blockd_replica_over_a_file_takes_write_zeroes_with_deac(tmp_path: Path) -> None:
    """blockd's target reports DLFEAT 0x09 for a file (its deallocate punches a hole, which
    reads as zeroes): the replica connection reads that from Identify Namespace and zeroes a
    hole with DEAC, and the range reads back as zeroes."""
    from .nodes import RNQN, Node
    node = Node(tmp_path, "r", 8 << 20)
    with open(node.file, "wb") as f:
        f.write(b"\x77" * (8 << 20))
    node.start()

    async def main() -> None:
        ns = await open_remote("tcp", "127.0.0.1", node.port, RNQN, 1, None, 5.0)
        try:
            assert ns.zeroes_supported and ns.deallocate
            await ns.write_zeroes(1 << 20, 1 << 20)
            counted = ns.ctrl.counters
            assert counted.ops[KINDS.index("other")] == 1 and counted.ops[KINDS.index("write")] == 0  # no data sent
            assert await ns.read(1 << 20, 1 << 20) == bytes(1 << 20)
            assert await ns.read((1 << 20) - 4096, 4096) == b"\x77" * 4096
        finally:
            await ns.close()
    try:
        run(main())
    finally:
        node.stop()


def test_a_full_sync_of_a_sparse_primary_leaves_a_blockd_replica_thin(tmp_path: Path) -> None:
    """Two `blockd target` processes: a primary whose file holds 1 MiB of data and holes, and a
    replica whose file is all written (it held something else). The full sync sends the holes
    as Write Zeroes with DEAC, which the replica's target punches: its file ends about as thin
    as the primary's (a zeroed range of ext4 or xfs stays allocated), and reads as the primary."""
    from .nodes import DATA, Node, all_in_sync
    primary, replica = Node(tmp_path, "primary"), Node(tmp_path, "r1")
    content = os.urandom(1 << 20)
    with open(primary.file, "wb") as f:
        f.truncate(DEVICE)  # blank metadata: formatted at start
        f.write(content)
    replica.file.write_bytes(b"\x77" * DEVICE)
    try:
        replica.start()
        primary.start([replica])
        primary.wait_states(all_in_sync(settled=True), timeout=60)
    finally:
        primary.stop()
        replica.stop()
    with open(replica.file, "rb") as f:
        copied = f.read(DATA)
    assert copied[:1 << 20] == content and copied[1 << 20:] == bytes(DATA - (1 << 20))
    allocated = replica.file.stat().st_blocks * 512
    assert allocated <= primary.file.stat().st_blocks * 512 + (1 << 20), (allocated, DEVICE)


def test_units_finishing_out_of_order_never_share_a_buffer() -> None:
    """A full sync of 32 units through a replica whose writes take uneven times, so that units
    finish out of order and hand their buffers on in any order: the replica ends equal to this
    copy (two units in one buffer would send one's data to the other's place)."""
    device = 32 << 20
    local, store = MemoryBackend(device), MemoryBackend(device)
    local.data[:] = os.urandom(device)
    local.data[-(1 << 20):] = bytes(1 << 20)  # blank metadata: formatted at open
    bed = Bed(1, local=local, stores=[store])
    delays = iter([0.004, 0.0, 0.001, 0.003] * 64)

    class Uneven(FakeReplica):
        async def write(self, offset: int, data: Any, fua: bool = False) -> None:
            await asyncio.sleep(next(delays, 0.0))
            await super().write(offset, bytes(data), fua)  # the bytes as they are when the write lands

    async def open_() -> Uneven:
        return Uneven(store, "r0")
    bed.opener = lambda i: open_  # type: ignore[method-assign]

    async def main() -> None:
        m = await bed.primary(rate=1 << 40)
        await until(lambda: m.links[0].state == IN_SYNC, timeout=30)
        assert data_hash(store, m.size) == data_hash(local, m.size)
        await m.stop()
    run(main())


def test_the_units_are_read_into_buffers_that_start_on_a_page() -> None:
    """Every unit's data reaches the replica from a buffer on a page boundary (a ``bytearray``
    starts 16 bytes into one, where the kernel's copy into it ran ~7x slower:
    blockd/buffers.py), and the copies still end equal."""
    device = 16 << 20
    local = MemoryBackend(device)
    local.data[:] = os.urandom(device)
    local.data[-(1 << 20):] = bytes(1 << 20)  # blank metadata: formatted at open
    bed, opened = recording_bed(local=local, device=device)
    offsets: list[int] = []
    write = Recording.write

    async def recorded(self: Recording, offset: int, data: Any, fua: bool = False) -> None:
        if offset < self.data_size:
            offsets.append(ctypes.addressof(ctypes.c_char.from_buffer(data)) % 4096)
        await write(self, offset, data, fua)

    async def main() -> None:
        m = await bed.primary(rate=1 << 40)
        await until(lambda: m.links[0].state == IN_SYNC, timeout=30)
        assert data_hash(opened[0].store, m.size) == data_hash(local, m.size)
        await m.stop()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Recording, "write", recorded)
        run(main())
    assert len(offsets) >= 3 and set(offsets) == {0}, offsets
