"""The on-disk layout of replication metadata (protocol/replication.py): golden superblock bytes
written from the documented offsets, and the placement rules of ``layout`` for any device size,
region size and peer count."""

from __future__ import annotations

import crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import replication as r
from protocol.replication import MetadataError, PeerSlot, Superblock


def put(buf: bytearray, off: int, value: int, size: int) -> None:
    buf[off:off + size] = value.to_bytes(size, "little")


def golden_superblock() -> tuple[Superblock, bytes]:
    """A superblock and its bytes, placed by hand at the offsets docs/replication.md gives."""
    sb = Superblock(sequence=7, node_id=0x1122334455667788, region_size=65536, max_peers=2,
                    device_size=1 << 30, data_size=1073717248, current=0xA1A2A3A4A5A6A7A8,
                    history=(0xB1, 0xB2), peers=(PeerSlot(0xC1, 0xD1), PeerSlot()),
                    flags=r.FLAG_INCONSISTENT)
    raw = bytearray(4096)
    raw[0:8] = b"BLKDREPL"
    put(raw, 8, 1, 4)           # version
    put(raw, 12, 1, 4)          # flags: inconsistent
    put(raw, 16, 7, 8)          # sequence
    put(raw, 24, 0x1122334455667788, 8)
    put(raw, 32, 65536, 4)      # region size
    put(raw, 36, 2, 4)          # max peers
    put(raw, 40, 1 << 30, 8)    # device size
    put(raw, 48, 1073717248, 8)  # data size
    put(raw, 56, 0xA1A2A3A4A5A6A7A8, 8)
    put(raw, 64, 0xB1, 8)       # history[0]
    put(raw, 72, 0xB2, 8)       # history[1]; [2] and [3] stay 0
    put(raw, 128, 0xC1, 8)      # peer slot 0: node id
    put(raw, 136, 0xD1, 8)      #              bitmap generation
    put(raw, 4092, crc32c.crc32c(bytes(raw[:4092])), 4)
    return sb, bytes(raw)


def test_superblock_golden_bytes() -> None:
    sb, raw = golden_superblock()
    assert r.build_superblock(sb) == raw
    parsed = r.parse_superblock(raw)
    assert parsed == Superblock(**{**sb.__dict__, "history": (0xB1, 0xB2, 0, 0)})


def test_superblock_errors_name_the_fault() -> None:
    sb, raw = golden_superblock()
    torn = raw[:2048] + bytes(2048)
    cases = {
        bytes(4096): "no blockd replication superblock",
        torn: "checksum mismatch",
        raw[:-1]: "4095 bytes",
        r.SUPERBLOCK.build(dict(body=dict(value={**r.SUPERBLOCK_BODY.parse(raw), "version": 2}),
                                crc=None)): "version 2; this blockd reads version 1",
        r.SUPERBLOCK.build(dict(body=dict(value={**r.SUPERBLOCK_BODY.parse(raw), "max_peers": 33}),
                                crc=None)): "max_peers 33",
    }
    for data, words in cases.items():
        with pytest.raises(MetadataError) as info:
            r.parse_superblock(data)
        assert words in str(info.value) and "\n" not in str(info.value)


def test_layout_of_one_gib() -> None:
    lay = r.layout(1 << 30, 65536, 4)
    # 16384 regions of the whole device: 2048 bytes of bits, one 4 KiB block per slot.
    assert lay.bitmap_length == 4096
    assert lay.superblock_offsets == ((1 << 30) - 8192, (1 << 30) - 4096)
    assert lay.data_size == (1 << 30) - 8192 - 4 * 4096
    assert [lay.bitmap_offset(s) for s in range(4)] == [lay.data_size + 4096 * s for s in range(4)]
    assert lay.regions == 16384  # the last one short by the metadata
    with pytest.raises(IndexError):
        lay.bitmap_offset(4)


@settings(max_examples=400, deadline=None)
@given(device_size=st.integers(0, 1 << 44), region_shift=st.integers(12, 30),
       max_peers=st.integers(1, r.MAX_PEERS))
def test_layout_never_overlaps(device_size: int, region_shift: int, max_peers: int) -> None:
    region_size = 1 << region_shift
    end = device_size // 4096 * 4096
    bitmap = -(-(-(-end // region_size)) // (8 * 4096)) * 4096  # bits for the whole device
    fits = end >= 8192 and end - 8192 - max_peers * bitmap >= region_size
    try:
        lay = r.layout(device_size, region_size, max_peers)
    except MetadataError as exc:
        assert not fits and ("too small" in str(exc) or "no room" in str(exc))
        return
    assert fits
    assert lay.data_size % 4096 == 0 and lay.data_size >= region_size
    assert lay.bitmap_length % 4096 == 0 and lay.bitmap_length * 8 >= lay.regions
    assert (lay.regions - 1) * region_size < lay.data_size <= lay.regions * region_size
    spans = [(0, lay.data_size)]
    spans += [(lay.bitmap_offset(s), lay.bitmap_length) for s in range(max_peers)]
    spans += [(off, 4096) for off in lay.superblock_offsets]
    for (a, alen), (b, _) in zip(spans, spans[1:]):
        assert a + alen <= b  # in order, no overlap
    assert spans[-1][0] + 4096 <= device_size
    assert lay.superblock_offsets == r.superblock_offsets(device_size)


@pytest.mark.parametrize("region_size, max_peers, words", [
    (65536 + 4096, 4, "not a power of two"),
    (2048, 4, "not a power of two in 4096.."),
    (1 << 31, 4, "not a power of two in 4096.."),
    (65536, 0, "max_peers 0 is outside 1..32"),
    (65536, 33, "max_peers 33 is outside 1..32"),
])
def test_layout_refuses_bad_parameters(region_size: int, max_peers: int, words: str) -> None:
    with pytest.raises(MetadataError, match=words):
        r.layout(1 << 30, region_size, max_peers)


def test_layout_too_small_device() -> None:
    with pytest.raises(MetadataError) as info:
        r.layout(65536, 65536, 1)
    assert str(info.value) == ("device of 65536 bytes is too small for replication with "
                               "65536-byte regions and 1 peers (needs at least 77824)")
    assert r.layout(77824, 65536, 1).data_size == 65536
    with pytest.raises(MetadataError, match="no room"):
        r.layout(8191, 4096, 1)


def test_bitmap_bit_order_matches_the_reference_definition() -> None:
    block = bytearray(4096)
    for region in (0, 7, 8, 9, 32767):
        block[region >> 3] |= 1 << (region & 7)
    assert r.bitmap_regions(bytes(block), first_region=32768) == [
        32768 + x for x in (0, 7, 8, 9, 32767)]
