"""The write-intent bitmap of one peer slot (md raid1's rule, DRBD's quick-sync bitmap).

A set bit says "this region may differ between this copy and the peer". The rule that makes it
safe: a region's bit is on disk (FUA) before any write to the region is issued, and it is
cleared only once the peer has every write to it. After a crash, a reconnect or a restart the
set bits bound what a resync copies.

Three views of the bits are kept:

* ``_bits``: the wanted state. ``mark`` sets bits here first; ``clear`` clears them here.
* ``_persisted``: bits known to be set on disk, and still set in ``_bits``. ``mark`` returns at
  once only when every bit of its range is here, so its fast path is one byte test. A clear
  removes the bit here too, so a region marked again after a clear is written again, even
  though the disk may still hold the old set bit (the clear has not been written): otherwise a
  later write of the block would persist the clear under a new write to the region.
* the snapshot of a block being written: a ``mark`` whose bits are already in that snapshot
  waits for that write instead of queueing another.

Each bitmap block has at most one write in flight and at most one queued; the queued write
takes its snapshot when it starts, so every mark that set a bit while the previous write ran
shares it. Clears ride along with any write of their block and are otherwise persisted by
:meth:`WriteIntentBitmap.sync_clears`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from protocol.replication import BITMAP_BLOCK_SHIFT, BITMAP_BLOCK_SIZE
from target.replication.blockio import BlockIO

_ZERO_BLOCK = bytes(BITMAP_BLOCK_SIZE)


class WriteIntentBitmap:
    """One slot's bitmap: ``regions`` bits over a data area of ``data_size`` bytes, stored at
    ``offset`` of ``io`` (``len(initial)`` bytes, whole bitmap blocks)."""

    def __init__(self, io: BlockIO, offset: int, region_size: int, data_size: int,
                 initial: bytes) -> None:
        if region_size & (region_size - 1) or len(initial) % BITMAP_BLOCK_SIZE:
            raise ValueError("region size must be a power of two and the bitmap whole blocks")
        self.io = io
        self.offset = offset
        self.region_size = region_size
        self.data_size = data_size
        self.regions = -(-data_size // region_size)
        if self.regions > len(initial) * 8:
            raise ValueError(f"{len(initial)} bitmap bytes cannot hold {self.regions} regions")
        self._shift = region_size.bit_length() - 1
        self._bits = bytearray(initial)
        self._persisted = bytearray(initial)
        self._queued: dict[int, asyncio.Future[None]] = {}
        self._inflight: dict[int, tuple[bytes, asyncio.Future[None]]] = {}
        self._writers: dict[int, asyncio.Task[None]] = {}
        self._unsynced_clears: set[int] = set()

    async def mark(self, offset: int, length: int) -> None:
        """Set the bits of the regions that ``[offset, offset + length)`` touches; return once
        they are all on disk. Bits already on disk cost one byte test each and no I/O."""
        first, last = self._unmarked(offset, length)
        if first <= last:
            await self._set(first, last)

    def marked(self, offset: int, length: int) -> bool:
        """Whether every region ``[offset, offset + length)`` touches has its bit on disk, so
        that :meth:`mark` would write nothing (the compiled mirror path takes only such writes:
        ``target/replication/_mirror_io.pyx``)."""
        first, last = self._unmarked(offset, length)
        return first > last

    def _unmarked(self, offset: int, length: int) -> tuple[int, int]:
        """The first region of the range whose bit is not on disk, and the range's last region."""
        first = offset >> self._shift
        last = (offset + length - 1) >> self._shift
        persisted = self._persisted
        while first <= last and persisted[first >> 3] >> (first & 7) & 1:
            first += 1
        return first, last

    async def _set(self, first: int, last: int) -> None:
        if last >= self.regions or first < 0:
            raise ValueError(f"regions {first}..{last} outside the bitmap's 0..{self.regions - 1}")
        bits, persisted = self._bits, self._persisted
        waits: list[asyncio.Future[None]] = []
        region = first
        while region <= last:
            block = region >> BITMAP_BLOCK_SHIFT
            block_last = min(last, ((block + 1) << BITMAP_BLOCK_SHIFT) - 1)
            inflight = self._inflight.get(block)
            snapshot = inflight[0] if inflight is not None else None
            base = block * BITMAP_BLOCK_SIZE
            needed, covered = False, snapshot is not None
            for r in range(region, block_last + 1):
                byte, mask = r >> 3, 1 << (r & 7)
                if not persisted[byte] & mask:
                    needed = True
                    bits[byte] |= mask
                    if covered and not snapshot[byte - base] & mask:  # type: ignore[index]
                        covered = False
            if needed:
                waits.append(inflight[1] if covered and inflight is not None else self._request(block))
            region = block_last + 1
        for wait in waits:
            await asyncio.shield(wait)

    def _request(self, block: int) -> asyncio.Future[None]:
        """The block's next write (queued, not started), made if there is none."""
        queued = self._queued.get(block)
        if queued is None:
            queued = self._queued[block] = asyncio.get_running_loop().create_future()
            queued.add_done_callback(_retrieved)
            if block not in self._writers:
                self._writers[block] = asyncio.get_running_loop().create_task(self._writer(block))
        return queued

    async def _writer(self, block: int) -> None:
        """Write ``block`` until no write of it is queued; one task per block at a time."""
        base = block * BITMAP_BLOCK_SIZE
        try:
            while (done := self._queued.pop(block, None)) is not None:
                snapshot = bytes(self._bits[base:base + BITMAP_BLOCK_SIZE])
                self._inflight[block] = (snapshot, done)
                self._unsynced_clears.discard(block)
                try:
                    await self.io.write(self.offset + base, snapshot, fua=True)
                except Exception as exc:
                    self._unsynced_clears.add(block)
                    done.set_exception(exc)
                except BaseException:
                    self._unsynced_clears.add(block)
                    done.cancel()
                    raise
                else:
                    # Set on disk and still wanted: a bit cleared during the write is not.
                    now = int.from_bytes(self._bits[base:base + BITMAP_BLOCK_SIZE], "little")
                    self._persisted[base:base + BITMAP_BLOCK_SIZE] = (
                        int.from_bytes(snapshot, "little") & now).to_bytes(BITMAP_BLOCK_SIZE, "little")
                    done.set_result(None)
                finally:
                    del self._inflight[block]
        finally:
            del self._writers[block]
            queued = self._queued.pop(block, None)  # left by a cancelled writer
            if queued is not None and not queued.done():
                queued.cancel()

    def clear(self, region: int) -> None:
        """The peer has every write to ``region``: clear its bit in memory; it reaches the disk
        with the block's next write or :meth:`sync_clears`. The caller makes sure no write to
        the region is in flight."""
        byte, mask = region >> 3, 1 << (region & 7)
        if self._bits[byte] & mask:
            self._bits[byte] &= ~mask & 0xFF
            self._persisted[byte] &= ~mask & 0xFF
            self._unsynced_clears.add(region >> BITMAP_BLOCK_SHIFT)

    async def sync_clears(self) -> None:
        """Write every block that has clears not yet on disk."""
        await self._write_blocks(sorted(self._unsynced_clears))

    async def set_all(self) -> None:
        """Mark every region (a peer that needs a full sync) and return once it is on disk."""
        whole, rest = divmod(self.regions, 8)
        self._bits[:whole] = b"\xff" * whole
        if rest:
            self._bits[whole] |= (1 << rest) - 1
        used = -(-self.regions // 8)
        await self._write_blocks([
            block for block in range(-(-used // BITMAP_BLOCK_SIZE))
            if self._persisted[block * BITMAP_BLOCK_SIZE:(block + 1) * BITMAP_BLOCK_SIZE]
            != self._bits[block * BITMAP_BLOCK_SIZE:(block + 1) * BITMAP_BLOCK_SIZE]])

    async def _write_blocks(self, blocks: list[int]) -> None:
        for fut in [self._request(block) for block in blocks]:
            await asyncio.shield(fut)

    def is_dirty(self, region: int) -> bool:
        return bool(self._bits[region >> 3] >> (region & 7) & 1)

    def dirty_count(self) -> int:
        return int.from_bytes(self._bits, "little").bit_count()

    def dirty_regions(self) -> Iterator[int]:
        """Set regions in ascending order, from a copy of the bits taken at the call."""
        bits = bytes(self._bits)
        for base in range(0, len(bits), BITMAP_BLOCK_SIZE):
            chunk = bits[base:base + BITMAP_BLOCK_SIZE]
            if chunk == _ZERO_BLOCK:
                continue
            for i, value in enumerate(chunk):
                if value:
                    yield from ((base + i) * 8 + k for k in range(8) if value >> k & 1)

    def span(self, region: int) -> tuple[int, int]:
        """``(offset, length)`` of a region in the data area (the last one may be short)."""
        start = region << self._shift
        return start, min(self.region_size, self.data_size - start)


def _retrieved(fut: asyncio.Future[None]) -> None:
    """A failed block write raises in every mark that waits for it; one whose waiters were all
    cancelled has nobody to tell, and asyncio would log it as never retrieved."""
    if not fut.cancelled():
        fut.exception()
