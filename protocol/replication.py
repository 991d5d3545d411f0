"""On-disk replication metadata: the superblock, the write-intent bitmaps and where they sit.

Every copy of a replicated volume (the primary's local file and each replica's NVMe-oF
namespace) carries the same metadata at the END of its device, so a replica that is only a
namespace of the kernel's nvmet carries it too, written by the primary through the fabric.
From the end of the device backwards (``end`` is the device size rounded down to
:data:`METADATA_BLOCK`)::

    [ data area: data_size bytes, exported ][ bitmap slot 0 ] ... [ bitmap slot max_peers-1 ]
    [ superblock copy 0 ][ superblock copy 1 ]  <- end

The two superblock copies sit at fixed offsets from the end, so they are found knowing only the
device size; the superblock then says the region size and peer count that place the bitmaps.
A save writes the copy that does NOT hold the newest good one (sequence number + CRC-32C), so a
torn superblock write never loses the last good superblock.

A bitmap block is raw bits, without header or checksum: bit ``i`` (byte ``i // 8``, bit
``i % 8``, least significant first) is region ``i`` of the data area. A torn bitmap write
leaves each bit either old or new; a new bit that did not land was never reported persisted, so
no data write depended on it, and an old set bit only makes resync copy more. A checksum would
turn that harmless tear into an unreadable block.

docs/replication.md ("On-disk metadata") tabulates the superblock and says why it is so.
All integers are little-endian. Generation identifiers and node ids are random 64-bit values;
0 means "none" (a blank copy, a free peer slot, no bitmap generation).
"""

from __future__ import annotations

from dataclasses import dataclass

import construct as c
import crc32c as _crc32c

from protocol.layout import at_offsets

MAGIC = b"BLKDREPL"
VERSION = 1
METADATA_BLOCK = 4096
"""Unit of every metadata write and of the data area's alignment."""
SUPERBLOCK_SIZE = METADATA_BLOCK
BITMAP_BLOCK_SIZE = METADATA_BLOCK
BITS_PER_BITMAP_BLOCK = BITMAP_BLOCK_SIZE * 8
BITMAP_BLOCK_SHIFT = 15
"""``region >> BITMAP_BLOCK_SHIFT`` is the bitmap block holding the region's bit."""
assert 1 << BITMAP_BLOCK_SHIFT == BITS_PER_BITMAP_BLOCK
HISTORY_LENGTH = 4
"""Older generation identifiers kept (DRBD keeps two; more lets a longer-absent copy be
recognised as an ancestor, which turns an UNRELATED verdict into a FULL sync)."""
MAX_PEERS = 32
"""Peer slots the superblock has room for; a volume uses ``max_peers`` of them."""
MIN_REGION_SIZE = METADATA_BLOCK
MAX_REGION_SIZE = 1 << 30
DEFAULT_REGION_SIZE = 64 * 1024
DEFAULT_MAX_PEERS = 4

FLAG_INCONSISTENT = 1 << 0
"""This copy is the target of an unfinished sync: its data area mixes generations and must
not be promoted or used as a sync source."""

RESERVATIONS_AREA = 2048
"""Bytes of the superblock that hold the namespace's reservation state
(:data:`RESERVATION_STATE`, issue 38): the superblock reaches every copy, so the state holds on
the standby after a failover. Zero in a superblock written before it existed: no state."""
RESERVATION_REGISTRANT = c.Struct("hostid" / c.Bytes(16), "key" / c.Int64ul)
RESERVATION_STATE = c.Struct(
    "generation" / c.Int32ul,
    "rtype" / c.Int8ul,
    "ptpl" / c.Int8ul,
    "holder" / c.Int8ul,
    "count" / c.Int8ul,
    "registrants" / c.Array(c.this.count, RESERVATION_REGISTRANT),
)
"""A namespace's reservations as the superblock keeps them: ``holder`` is the index of the
holding registrant (FFh: none, or every registrant under an all-registrants type); at most
:data:`MAX_STORED_REGISTRANTS` registrants fit."""
NO_HOLDER = 0xFF
MAX_STORED_REGISTRANTS = (RESERVATIONS_AREA - 8) // RESERVATION_REGISTRANT.sizeof()

PEER_SLOT = c.Struct(
    "node_id" / c.Int64ul,
    "bitmap_generation" / c.Int64ul,
)
"""A peer slot: the peer copy's node id (0: free) and the generation from which this slot's
bitmap records every write the peer may lack (0: the peer has this copy's current generation)."""

SUPERBLOCK_BODY = at_offsets(SUPERBLOCK_SIZE - 4, [
    (0, "magic", c.Bytes(len(MAGIC))),
    (8, "version", c.Int32ul),
    (12, "flags", c.Int32ul),
    (16, "sequence", c.Int64ul),
    (24, "node_id", c.Int64ul),
    (32, "region_size", c.Int32ul),
    (36, "max_peers", c.Int32ul),
    (40, "device_size", c.Int64ul),
    (48, "data_size", c.Int64ul),
    (56, "current", c.Int64ul),
    (64, "history", c.Array(HISTORY_LENGTH, c.Int64ul)),
    (128, "peers", c.Array(MAX_PEERS, PEER_SLOT)),
    (1024, "reservations_length", c.Int16ul),
    (1026, "reservations", c.Bytes(RESERVATIONS_AREA)),
])
"""Everything but the CRC. ``magic`` is plain bytes (not ``Const``) so that a wrong magic gets
its own message; ``device_size`` is the size the layout was made for (a device that changed
size moves the end, and with it the metadata)."""

SUPERBLOCK = c.Struct(
    "body" / c.RawCopy(SUPERBLOCK_BODY),
    "crc" / c.Checksum(c.Int32ul, lambda data: _crc32c.crc32c(data), c.this.body.data),
)
"""One superblock copy: the body and the CRC-32C (Castagnoli) of the body's bytes."""
assert SUPERBLOCK.sizeof() == SUPERBLOCK_SIZE


class MetadataError(ValueError):
    """Replication metadata that is missing, damaged or does not fit; the message is one line
    naming what is wrong."""


@dataclass(frozen=True)
class PeerSlot:
    node_id: int = 0
    bitmap_generation: int = 0


@dataclass(frozen=True)
class Superblock:
    sequence: int
    node_id: int
    region_size: int
    max_peers: int
    device_size: int
    data_size: int
    current: int
    history: tuple[int, ...]
    peers: tuple[PeerSlot, ...]
    """``max_peers`` slots."""
    flags: int = 0
    reservations: bytes = b""
    """The encoded :data:`RESERVATION_STATE`, or nothing."""


def build_superblock(sb: Superblock) -> bytes:
    if not 1 <= sb.max_peers <= MAX_PEERS or len(sb.peers) != sb.max_peers:
        raise ValueError(f"{len(sb.peers)} peer slots for max_peers {sb.max_peers}")
    if len(sb.reservations) > RESERVATIONS_AREA:
        raise ValueError(f"reservation state of {len(sb.reservations)} bytes; the superblock holds {RESERVATIONS_AREA}")
    history = (tuple(sb.history) + (0,) * HISTORY_LENGTH)[:HISTORY_LENGTH]
    peers = list(sb.peers) + [PeerSlot()] * (MAX_PEERS - sb.max_peers)
    body = dict(magic=MAGIC, version=VERSION, flags=sb.flags, sequence=sb.sequence,
                node_id=sb.node_id, region_size=sb.region_size, max_peers=sb.max_peers,
                device_size=sb.device_size, data_size=sb.data_size, current=sb.current,
                history=list(history),
                peers=[dict(node_id=p.node_id, bitmap_generation=p.bitmap_generation)
                       for p in peers],
                reservations_length=len(sb.reservations),
                reservations=sb.reservations.ljust(RESERVATIONS_AREA, b"\0"))
    return SUPERBLOCK.build(dict(body=dict(value=body), crc=None))


def parse_superblock(raw: bytes) -> Superblock:
    """One superblock copy; :class:`MetadataError` says why it is not a good one."""
    if len(raw) != SUPERBLOCK_SIZE:
        raise MetadataError(f"superblock is {len(raw)} bytes, not {SUPERBLOCK_SIZE}")
    if raw[:len(MAGIC)] != MAGIC:
        raise MetadataError(f"no blockd replication superblock (magic {raw[:len(MAGIC)].hex()})")
    try:
        body = SUPERBLOCK.parse(raw).body.value
    except c.ChecksumError:
        raise MetadataError("superblock checksum mismatch (torn or damaged write)") from None
    if body.version != VERSION:
        raise MetadataError(f"superblock version {body.version}; this blockd reads version {VERSION}")
    if not 1 <= body.max_peers <= MAX_PEERS:
        raise MetadataError(f"superblock max_peers {body.max_peers} is outside 1..{MAX_PEERS}")
    return Superblock(
        sequence=body.sequence, node_id=body.node_id, region_size=body.region_size,
        max_peers=body.max_peers, device_size=body.device_size, data_size=body.data_size,
        current=body.current, history=tuple(body.history),
        peers=tuple(PeerSlot(p.node_id, p.bitmap_generation) for p in body.peers[:body.max_peers]),
        flags=body.flags, reservations=body.reservations[:min(body.reservations_length, RESERVATIONS_AREA)])


def superblock_offsets(device_size: int) -> tuple[int, int]:
    """Where the two superblock copies of a device of ``device_size`` bytes are."""
    end = device_size // METADATA_BLOCK * METADATA_BLOCK
    if end < 2 * SUPERBLOCK_SIZE:
        raise MetadataError(f"device of {device_size} bytes has no room for replication metadata")
    return (end - 2 * SUPERBLOCK_SIZE, end - SUPERBLOCK_SIZE)


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


@dataclass(frozen=True)
class Layout:
    """Where a device's data area and metadata are (see the module docstring)."""

    device_size: int
    region_size: int
    max_peers: int
    data_size: int
    """Bytes the namespace exports: a multiple of :data:`METADATA_BLOCK`, ending where the
    metadata begins."""
    regions: int
    """Regions of the data area (the last one may be partial)."""
    bitmap_length: int
    """Bytes of one peer slot's bitmap, whole bitmap blocks."""
    superblock_offsets: tuple[int, int]

    def bitmap_offset(self, slot: int) -> int:
        if not 0 <= slot < self.max_peers:
            raise IndexError(f"peer slot {slot} outside 0..{self.max_peers - 1}")
        return self.data_size + slot * self.bitmap_length

    @property
    def metadata_length(self) -> int:
        return self.max_peers * self.bitmap_length + 2 * SUPERBLOCK_SIZE


def layout(device_size: int, region_size: int, max_peers: int) -> Layout:
    """Place the metadata at the end of a device of ``device_size`` bytes.

    Each bitmap is sized for the whole device rather than the (smaller) data area: the sizes
    then follow without a fixed-point search, at the cost of a few bits past the data area that
    are never set.
    """
    if region_size & (region_size - 1) or not MIN_REGION_SIZE <= region_size <= MAX_REGION_SIZE:
        raise MetadataError(f"region size {region_size} is not a power of two in "
                            f"{MIN_REGION_SIZE}..{MAX_REGION_SIZE}")
    if not 1 <= max_peers <= MAX_PEERS:
        raise MetadataError(f"max_peers {max_peers} is outside 1..{MAX_PEERS}")
    sb_offsets = superblock_offsets(device_size)
    end = sb_offsets[1] + SUPERBLOCK_SIZE
    bitmap_length = _round_up(_round_up(-(-end // region_size), 8) // 8, BITMAP_BLOCK_SIZE)
    data_size = sb_offsets[0] - max_peers * bitmap_length
    if data_size < region_size:
        need = region_size + max_peers * bitmap_length + 2 * SUPERBLOCK_SIZE
        raise MetadataError(f"device of {device_size} bytes is too small for replication with "
                            f"{region_size}-byte regions and {max_peers} peers (needs at least {need})")
    return Layout(device_size=device_size, region_size=region_size, max_peers=max_peers,
                  data_size=data_size, regions=-(-data_size // region_size),
                  bitmap_length=bitmap_length, superblock_offsets=sb_offsets)


BITMAP_BLOCK = c.Bitwise(c.Array(BITS_PER_BITMAP_BLOCK, c.Flag))
"""Reference definition of a bitmap block, for tests: construct reads bits most significant
first, so flag ``8*b + (7 - k)`` of this parse is region ``8*b + k`` (see :func:`bitmap_regions`)."""


def bitmap_regions(block: bytes, first_region: int = 0) -> list[int]:
    """The regions a bitmap block marks, read through :data:`BITMAP_BLOCK`."""
    flags = BITMAP_BLOCK.parse(block)
    return sorted(first_region + (i & ~7) + (7 - (i & 7)) for i, bit in enumerate(flags) if bit)
