"""Metadata on a device: format and open, the two alternating superblock copies, fallback from a
torn or damaged newest copy, one-line errors, peer slots and generation changes that persist."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from protocol import replication as r
from target.backend import MemoryBackend
from target.replication.blockio import BackendBlockIO
from target.replication.generations import BLANK
from target.replication.metadata import Metadata, MetadataError
from tests.core.test_durability import NoNativeFua
from tests.replication.fake_blockio import Crashed, MemoryBlockIO

SIZE = 64 << 20


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


async def formatted(**kw: Any) -> tuple[MemoryBlockIO, Metadata]:
    io = MemoryBlockIO(SIZE)
    return io, await Metadata.format(io, **kw)


def test_format_then_open() -> None:
    async def go() -> None:
        io, md = await formatted(region_size=1 << 16, max_peers=3)
        again = await Metadata.open(io.survivor())
        assert (again.node_id, again.current, again.region_size, again.max_peers, again.data_size) \
            == (md.node_id, md.current, 1 << 16, 3, r.layout(SIZE, 1 << 16, 3).data_size)
        assert md.current != BLANK and md.node_id != BLANK and again.history == ()
        assert again.peers == (r.PeerSlot(),) * 3 and not again.inconsistent
        blank = await Metadata.format(MemoryBlockIO(SIZE), blank=True)
        assert blank.current == BLANK and blank.node_id not in (BLANK, md.node_id)
        # only metadata written: nothing in the data area
        assert all(w.offset >= md.data_size for w in io.writes)
    run(go())


def test_format_over_a_backend() -> None:
    async def go() -> None:
        io = BackendBlockIO(MemoryBackend(SIZE))
        md = await Metadata.format(io)
        slot = await md.assign_slot(99)
        await md.bitmap(slot).mark(0, 1)
        again = await Metadata.open(io)
        assert again.current == md.current and list(again.bitmap(slot).dirty_regions()) == [0]
    run(go())


def test_saves_alternate_between_the_two_copies() -> None:
    async def go() -> None:
        io, md = await formatted()
        offsets = r.superblock_offsets(SIZE)
        assert [w.offset for w in io.writes if w.offset in offsets] == [offsets[0], offsets[1]]
        start = len(io.writes)
        for _ in range(3):
            await md.save()
        written = io.writes[start:]
        assert [w.offset for w in written] == [offsets[0], offsets[1], offsets[0]]
        assert all(w.fua for w in written)
        assert md.sequence == 5
        assert [r.parse_superblock(io.durable_bytes(o, 4096)).sequence for o in offsets] == [5, 4]
    run(go())


def test_torn_newest_superblock_falls_back_to_the_other() -> None:
    async def go() -> None:
        io, md = await formatted()
        before = md.current
        crashing = MemoryBlockIO(SIZE, crash_at=0, tear=True, image=io.durable.pages)
        md2 = await Metadata.open(crashing)
        with pytest.raises(Crashed):
            await md2.new_generation()
        after = await Metadata.open(crashing.survivor())
        assert after.current == before and after.sequence == 2  # the save never happened
    run(go())


def test_damaged_newest_copy_falls_back_and_the_next_save_replaces_it() -> None:
    async def go() -> None:
        io, md = await formatted()
        first = md.current
        await md.new_generation()                     # sequence 3, in copy 0
        newest = r.superblock_offsets(SIZE)[0]
        io.corrupt(newest + 100)
        old = await Metadata.open(io)
        assert (old.sequence, old.current) == (2, first)
        await old.save()                              # sequence 3 again, over the damaged copy
        assert io.writes[-1].offset == newest
        assert (await Metadata.open(io)).sequence == 3
        io.corrupt(r.superblock_offsets(SIZE)[1] + 5)  # copy 1 (sequence 2) damaged: 0 still good
        assert (await Metadata.open(io)).sequence == 3
    run(go())


def test_both_copies_bad_is_a_one_line_error() -> None:
    async def go() -> None:
        io, _ = await formatted()
        for offset in r.superblock_offsets(SIZE):
            io.corrupt(offset + 4000)
        with pytest.raises(MetadataError) as info:
            await Metadata.open(io)
        text = str(info.value)
        assert "\n" not in text
        assert text.startswith(f"no usable replication superblock on a device of {SIZE} bytes")
        assert text.count("checksum mismatch") == 2
        with pytest.raises(MetadataError, match="copy 0 .*no blockd replication superblock"):
            await Metadata.open(MemoryBlockIO(SIZE))
    run(go())


async def _rewrite(io: MemoryBlockIO, **fields: Any) -> None:
    """Write both superblock copies with ``fields`` changed (and a valid CRC)."""
    for offset in r.superblock_offsets(io.size):
        body = r.SUPERBLOCK_BODY.parse(io.durable_bytes(offset, 4096)[:4092])
        raw = r.SUPERBLOCK.build(dict(body=dict(value={**body, **fields}), crc=None))
        await io.write(offset, raw, fua=True)


@pytest.mark.parametrize("fields, words", [
    ({"magic": b"NOTBLKD!"}, "no blockd replication superblock (magic 4e4f54424c4b4421)"),
    ({"version": 9}, "superblock version 9; this blockd reads version 1"),
    ({"region_size": 1000}, "region size 1000 is not a power of two"),
    ({"data_size": 4096}, "superblock data size 4096 does not match the layout's"),
    ({"device_size": SIZE * 2}, f"metadata was made for a device of {SIZE * 2} bytes, this one has {SIZE}"),
])
def test_wrong_fields_are_named(fields: dict[str, Any], words: str) -> None:
    async def go() -> None:
        io, _ = await formatted()
        await _rewrite(io, **fields)
        with pytest.raises(MetadataError) as info:
            await Metadata.open(io)
        assert words in str(info.value) and "\n" not in str(info.value)
    run(go())


def test_a_device_that_grew_is_refused() -> None:
    async def go() -> None:
        io, _ = await formatted()
        grown = MemoryBlockIO(SIZE + (1 << 20), image=io.durable.pages)
        with pytest.raises(MetadataError, match="no usable replication superblock"):
            await Metadata.open(grown)
    run(go())


def test_peer_slots() -> None:
    async def go() -> None:
        io, md = await formatted(max_peers=2)
        a = await md.assign_slot(0xAA)
        assert await md.assign_slot(0xAA) == a
        b = await md.assign_slot(0xBB, bitmap_generation=0x55)
        assert {a, b} == {0, 1}
        with pytest.raises(MetadataError, match="all 2 peer slots are in use"):
            await md.assign_slot(0xCC)
        with pytest.raises(MetadataError, match="reserved"):
            await md.assign_slot(BLANK)
        again = await Metadata.open(io)
        assert again.slot_of(0xBB) == b and again.slot_of(0xCC) is None and again.slot_of(BLANK) is None
        assert again.ids(b).bitmap == 0x55 and again.ids(a).bitmap == BLANK
        # a released slot's bits do not leak to its next peer
        await md.bitmap(a).mark(0, 1 << 20)
        await md.release_slot(a)
        with pytest.raises(MetadataError, match=f"peer slot {a} is not in use"):
            md.bitmap(a)
        assert await md.assign_slot(0xCC) == a
        reopened = await Metadata.open(io.survivor())
        assert reopened.bitmap(a).dirty_count() == 0 and reopened.peers[a].node_id == 0xCC
    run(go())


def test_generation_changes_persist() -> None:
    async def go() -> None:
        io, md = await formatted()
        first = md.current
        slot = await md.assign_slot(0xAA)
        ids = await md.new_generation()
        assert ids.current == md.current != first and md.history == (first,)
        assert md.ids(slot).bitmap == first and md.ids().bitmap == BLANK
        second = md.current
        await md.new_generation()
        assert md.history == (second, first) and md.ids(slot).bitmap == first  # kept: covers more
        await md.peer_in_sync(slot)
        replica = await Metadata.format(MemoryBlockIO(SIZE), blank=True)
        await replica.begin_sync()
        assert replica.inconsistent
        await replica.adopt(md.ids(slot))
        for copy in (await Metadata.open(io.survivor()), await Metadata.open(replica.io)):
            assert copy.current == md.current and copy.history == md.history
        assert (await Metadata.open(io)).ids(slot).bitmap == BLANK
        assert not (await Metadata.open(replica.io)).inconsistent
    run(go())


def test_a_failed_save_changes_nothing() -> None:
    async def go() -> None:
        io, md = await formatted()
        before = (md.current, md.sequence)
        io.fail = OSError(5, "I/O error")
        with pytest.raises(OSError):
            await md.new_generation()
        assert (md.current, md.sequence) == before
        await md.save()
        assert (await Metadata.open(io)).current == before[0]
    run(go())



def test_backend_without_fua_gets_a_flush_after_each_fua_write() -> None:
    async def go() -> None:
        backend = NoNativeFua(MemoryBackend(1 << 20))
        io = BackendBlockIO(backend)
        await io.write(0, b"x", fua=True)
        await io.write(1, b"y")
        assert backend.events == ["write", "flush", "write"]
        assert await io.read(0, 3) == b"xy\0" and io.size == 1 << 20
    run(go())


def test_concurrent_changes_are_all_kept() -> None:
    async def go() -> None:
        io, md = await formatted(max_peers=4)
        slots = await asyncio.gather(*(md.assign_slot(node) for node in (0xA1, 0xA2, 0xA3, 0xA1)))
        assert sorted(set(slots)) == [0, 1, 2] and slots[0] == slots[3]
        first = md.current
        await asyncio.gather(md.new_generation(), md.new_generation(), md.begin_sync())
        again = await Metadata.open(io.survivor())
        assert len(again.history) == 2 and again.history[1] == first and again.inconsistent
        assert {p.node_id for p in again.peers} == {0xA1, 0xA2, 0xA3, BLANK}
    run(go())


def test_reservation_state_round_trips_and_an_older_superblock_has_none():
    MAX_STORED_REGISTRANTS, RESERVATION_STATE = r.MAX_STORED_REGISTRANTS, r.RESERVATION_STATE
    sb = r.Superblock(sequence=3, node_id=1, region_size=65536, max_peers=4, device_size=1 << 30,
                    data_size=(1 << 30) - (1 << 20), current=9, history=(), peers=(r.PeerSlot(),) * 4)
    assert r.parse_superblock(r.build_superblock(sb)).reservations == b""  # bytes 1024.. zero: no state
    state = RESERVATION_STATE.build(dict(generation=7, rtype=2, ptpl=1, holder=0, count=MAX_STORED_REGISTRANTS,
                                         registrants=[dict(hostid=bytes([i]) * 16, key=i + 1)
                                                      for i in range(MAX_STORED_REGISTRANTS)]))
    assert len(state) <= r.RESERVATIONS_AREA
    assert r.parse_superblock(r.build_superblock(replace(sb, reservations=state))).reservations == state
