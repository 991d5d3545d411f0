"""One copy's replication metadata: superblock, generation identifiers, peer slots, bitmaps.

The byte layout is :mod:`protocol.replication`'s; this module reads and writes it through a
:class:`target.replication.blockio.BlockIO`, so the same class serves the local copy and a
replica's namespace (the primary keeps a replica's metadata for it).

Every change of the superblock goes through :meth:`Metadata.save`, which writes the copy that
does not hold the newest good superblock, with FUA: a crash during the write leaves the other
copy, and :meth:`Metadata.open` takes the good copy with the highest sequence number.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from protocol.replication import (
    DEFAULT_MAX_PEERS, DEFAULT_REGION_SIZE, FLAG_INCONSISTENT,
    METADATA_BLOCK, Layout, MetadataError, PeerSlot, Superblock, build_superblock, layout,
    parse_superblock, superblock_offsets)
from target.replication.bitmap import WriteIntentBitmap
from target.replication.fs_probe import PROBE_LENGTH, file_system
from target.replication.blockio import BlockIO
from target.replication.generations import BLANK, GenerationIds, new_generation, new_id, synced

__all__ = ["Metadata", "MetadataError", "create"]

_ZERO_CHUNK = bytes(1 << 20)


class Metadata:
    """A copy's metadata, open. Build one with :meth:`format` or :meth:`open`."""

    def __init__(self, io: BlockIO, sb: Superblock, copy: int, layout_: Layout,
                 bitmaps: dict[int, bytes]) -> None:
        self.io = io
        self.layout = layout_
        self._sb = sb
        self._copy = copy
        """Which superblock copy (0 or 1) holds ``_sb``; the next save writes the other."""
        self._lock = asyncio.Lock()
        self._bitmaps = {slot: WriteIntentBitmap(io, layout_.bitmap_offset(slot), layout_.region_size,
                                                 layout_.data_size, data)
                         for slot, data in bitmaps.items()}

    # -- creating and opening -------------------------------------------------------------

    @classmethod
    async def format(cls, io: BlockIO, region_size: int = DEFAULT_REGION_SIZE,
                     max_peers: int = DEFAULT_MAX_PEERS, *, blank: bool = False) -> Metadata:
        """Write fresh metadata at the end of ``io``: a new node id, no peers, empty bitmaps,
        and a new random generation (``blank``: no generation, for a new replica whose data
        area holds nothing yet; it then gets a FULL sync). The data area is not touched."""
        lay = layout(io.size, region_size, max_peers)
        await _zero(io, lay.data_size, max_peers * lay.bitmap_length)
        sb = Superblock(sequence=0, node_id=new_id(), region_size=region_size, max_peers=max_peers,
                        device_size=io.size, data_size=lay.data_size,
                        current=BLANK if blank else new_id(), history=(),
                        peers=(PeerSlot(),) * max_peers)
        # Both copies, so that no older superblock with a higher sequence survives there.
        for copy in (0, 1):
            sb = replace(sb, sequence=copy + 1)
            await io.write(lay.superblock_offsets[copy], build_superblock(sb), fua=True)
        return cls(io, sb, 1, lay, {})

    @classmethod
    async def open(cls, io: BlockIO) -> Metadata:
        """Read the metadata at the end of ``io``: the newest good superblock copy and the
        bitmaps of the slots in use. :class:`MetadataError` names what is wrong."""
        offsets = superblock_offsets(io.size)
        good: list[tuple[Superblock, int]] = []
        problems: list[str] = []
        for copy, offset in enumerate(offsets):
            try:
                good.append((parse_superblock(await io.read(offset, METADATA_BLOCK)), copy))
            except MetadataError as exc:
                problems.append(f"copy {copy} at {offset}: {exc}")
        if not good:
            raise MetadataError(f"no usable replication superblock on a device of {io.size} bytes ("
                                + "; ".join(problems) + ")")
        sb, copy = max(good, key=lambda found: found[0].sequence)
        if sb.device_size != io.size:
            raise MetadataError(f"metadata was made for a device of {sb.device_size} bytes, "
                                f"this one has {io.size}")
        lay = layout(io.size, sb.region_size, sb.max_peers)
        if sb.data_size != lay.data_size:
            raise MetadataError(f"superblock data size {sb.data_size} does not match the layout's "
                                f"{lay.data_size}")
        bitmaps = {slot: await io.read(lay.bitmap_offset(slot), lay.bitmap_length)
                   for slot, peer in enumerate(sb.peers) if peer.node_id != BLANK}
        return cls(io, sb, copy, lay, bitmaps)

    # -- what it holds ------------------------------------------------------------------------

    @property
    def node_id(self) -> int:
        return self._sb.node_id

    @property
    def region_size(self) -> int:
        return self.layout.region_size

    @property
    def max_peers(self) -> int:
        return self.layout.max_peers

    @property
    def data_size(self) -> int:
        return self.layout.data_size

    @property
    def sequence(self) -> int:
        return self._sb.sequence

    @property
    def current(self) -> int:
        return self._sb.current

    @property
    def history(self) -> tuple[int, ...]:
        return tuple(h for h in self._sb.history if h != BLANK)

    @property
    def inconsistent(self) -> bool:
        """This copy is the target of an unfinished sync (see :meth:`begin_sync`)."""
        return bool(self._sb.flags & FLAG_INCONSISTENT)

    @property
    def peers(self) -> tuple[PeerSlot, ...]:
        return self._sb.peers

    def ids(self, slot: int | None = None) -> GenerationIds:
        """This copy's generation identifiers seen from peer slot ``slot`` (None: no bitmap)."""
        bitmap = BLANK if slot is None else self._sb.peers[slot].bitmap_generation
        return GenerationIds(current=self._sb.current, bitmap=bitmap, history=self.history)

    def slot_of(self, node_id: int) -> int | None:
        for slot, peer in enumerate(self._sb.peers):
            if peer.node_id == node_id and node_id != BLANK:
                return slot
        return None

    def bitmap(self, slot: int) -> WriteIntentBitmap:
        """The bitmap of a slot in use (:meth:`assign_slot`)."""
        try:
            return self._bitmaps[slot]
        except KeyError:
            raise MetadataError(f"peer slot {slot} is not in use") from None

    # -- changes (each one saved before it returns; one at a time) ---------------------------

    async def assign_slot(self, node_id: int, bitmap_generation: int = BLANK) -> int:
        """Give peer ``node_id`` a slot (its existing one if it has one) and return it. A new
        slot's bitmap starts empty on disk; ``bitmap_generation`` is the generation the peer
        is known to have (BLANK: none, so the peer gets a FULL sync on first contact)."""
        if node_id == BLANK:
            raise MetadataError("peer node id 0 is reserved")
        async with self._lock:
            existing = self.slot_of(node_id)
            if existing is not None:
                return existing
            free = [slot for slot, peer in enumerate(self._sb.peers) if peer.node_id == BLANK]
            if not free:
                raise MetadataError(f"all {self.max_peers} peer slots are in use")
            slot = free[0]
            length = self.layout.bitmap_length
            offset = self.layout.bitmap_offset(slot)
            await _zero(self.io, offset, length)
            await self._write(peers=_with(self._sb.peers, slot, PeerSlot(node_id, bitmap_generation)))
            self._bitmaps[slot] = WriteIntentBitmap(self.io, offset, self.region_size,
                                                    self.data_size, bytes(length))
            return slot

    async def release_slot(self, slot: int) -> None:
        """Forget the peer of ``slot`` (its bitmap goes with it)."""
        async with self._lock:
            await self._write(peers=_with(self._sb.peers, slot, PeerSlot()))
            self._bitmaps.pop(slot, None)

    async def new_generation(self) -> GenerationIds:
        """Start a new generation (the primary lost a replica, or this copy is promoted): see
        :func:`target.replication.generations.new_generation`. Every slot in use that had no
        bitmap generation gets the old current. Returns the new identifiers (no slot's view)."""
        async with self._lock:
            ids = new_generation(self.ids())
            old = self._sb.current
            peers = tuple(replace(p, bitmap_generation=p.bitmap_generation or old)
                          if p.node_id != BLANK else p for p in self._sb.peers)
            await self._write(current=ids.current, history=ids.history, peers=peers)
            return ids

    async def peer_in_sync(self, slot: int) -> None:
        """The peer of ``slot`` now has this copy's current generation (its metadata says so):
        the slot's bitmap records nothing more than writes in flight."""
        async with self._lock:
            peer = replace(self._sb.peers[slot], bitmap_generation=BLANK)
            await self._write(peers=_with(self._sb.peers, slot, peer))

    async def begin_sync(self) -> None:
        """Mark this copy as the target of a sync that has started (FLAG_INCONSISTENT)."""
        async with self._lock:
            await self._write(flags=self._sb.flags | FLAG_INCONSISTENT)

    async def adopt(self, source: GenerationIds) -> None:
        """A sync from ``source`` into this copy has completed: take the source's generation
        (:func:`target.replication.generations.synced`) and drop the inconsistent flag."""
        ids = synced(source)
        async with self._lock:
            await self._write(current=ids.current, history=ids.history,
                              flags=self._sb.flags & ~FLAG_INCONSISTENT)

    @property
    def reservations(self) -> bytes:
        """The namespace's reservation state kept here (``protocol.replication.RESERVATION_STATE``)."""
        return self._sb.reservations

    async def save_reservations(self, state: bytes) -> None:
        """Keep ``state`` in the superblock (written with FUA before this returns)."""
        async with self._lock:
            await self._write(reservations=state)

    async def save(self) -> None:
        """Write the superblock as it is (a new sequence number) to the copy that does not hold
        the newest good one, with FUA."""
        async with self._lock:
            await self._write()

    async def _write(self, **changes: object) -> None:
        """Save the superblock with ``changes``; they take effect once it is on disk. The
        caller holds ``_lock``, so that a change computed from ``_sb`` is not lost to another."""
        sb = replace(self._sb, sequence=self._sb.sequence + 1, **changes)  # type: ignore[arg-type]
        copy = 1 - self._copy
        await self.io.write(self.layout.superblock_offsets[copy], build_superblock(sb), fua=True)
        self._sb, self._copy = sb, copy


async def create(io: BlockIO, region_size: int = DEFAULT_REGION_SIZE, max_peers: int = DEFAULT_MAX_PEERS, *,
                 force: bool = False) -> Metadata:
    """Format the metadata of a copy that already holds data (``blockctl target create-md``,
    DRBD's ``create-md``): a new generation, so that this copy's data is what every replica gets
    by a full sync; the data area is not touched. The metadata area must hold zeroes only, and
    a file system at the volume's start must end before it: anything else (a file system's
    last blocks, metadata of an earlier format) is overwritten only with ``force``.
    :class:`MetadataError` says what is there."""
    lay = layout(io.size, region_size, max_peers)
    if not force:
        fs = await _file_system_past(io, lay)
        if fs:
            raise MetadataError(f"{fs}; nothing was written (--force writes the metadata over its end)")
        found = await _occupied(io, lay)
        if found:
            raise MetadataError(f"the metadata area (bytes {lay.data_size} to {io.size}) is not blank: {found}; "
                                "nothing was written (--force overwrites it)")
    return await Metadata.format(io, region_size, max_peers)


async def _file_system_past(io: BlockIO, lay: Layout) -> str:
    """What says that a file system at the volume's start reaches past the data area of
    ``lay`` ('' when none does): its end may be blank, so :func:`_occupied` would not see it
    (:mod:`target.replication.fs_probe`)."""
    fs = file_system(await io.read(0, min(PROBE_LENGTH, io.size)))
    if fs is None or fs.end <= lay.data_size:
        return ""
    how = (f"shrink it to at most {lay.data_size // 1024} KiB first ({fs.shrink_tool} DEVICE {lay.data_size // 1024}K), or"
           if fs.shrink_tool else f"{fs.kind} cannot shrink:")
    return (f"an {fs.kind} file system on the volume ends at byte {fs.end}, past the data area's end at byte "
            f"{lay.data_size} (the rest holds the metadata): {how} keep the whole volume with external metadata "
            "(metadata_path)")


async def _occupied(io: BlockIO, lay: Layout) -> str:
    """What the metadata area of ``lay`` holds besides zeroes ('' when nothing)."""
    try:
        md = await Metadata.open(io)
    except MetadataError:
        pass
    else:
        return (f"it holds replication metadata already (generation {md.current:016x}, region size "
                f"{md.region_size}); formatting anew makes every replica take a full sync")
    end = lay.superblock_offsets[1] + METADATA_BLOCK
    for start in range(lay.data_size, end, len(_ZERO_CHUNK)):
        chunk = await io.read(start, min(len(_ZERO_CHUNK), end - start))
        if chunk != _ZERO_CHUNK[:len(chunk)]:
            first = start + len(chunk) - len(chunk.lstrip(b"\0"))
            return f"byte {first} is not zero (data written before replication, e.g. a file system's end)"
    return ""


def _with(peers: tuple[PeerSlot, ...], slot: int, peer: PeerSlot) -> tuple[PeerSlot, ...]:
    return peers[:slot] + (peer,) + peers[slot + 1:]


async def _zero(io: BlockIO, offset: int, length: int) -> None:
    """Zero ``length`` bytes (bitmaps), durable before the superblock that relies on them."""
    for start in range(0, length, len(_ZERO_CHUNK)):
        await io.write(offset + start, _ZERO_CHUNK[:min(len(_ZERO_CHUNK), length - start)])
    await io.flush()
