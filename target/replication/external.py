"""External metadata: a copy whose superblocks and bitmaps live on a separate file or device.

DRBD's external meta-disk: a volume whose data already fills its device is replicated
unchanged, because nothing is taken from its end. The copy is then the data device followed by
the metadata area, seen as one device by :class:`ExternalMetadata`, laid out exactly as a device
with internal metadata (:func:`protocol.replication.layout`) of the combined size. Everything
above (the metadata code, the mirror, a failover pair's standby subsystem) works on that one
device and cannot tell the difference; and a replica is a plain namespace of the combined size
(``blockctl target create-md`` prints it), carrying its metadata at its end as usual.

The metadata area's length follows from the data device's size, the region size and the peer
slots (:func:`external_layout`); a metadata file is made that long, a metadata block device must
be at least that long and only its first bytes are used.
"""

from __future__ import annotations

import os
import stat

from protocol.replication import METADATA_BLOCK, Layout, MetadataError, layout
from target.backend import Backend, FileBackend


def external_layout(data_size: int, region_size: int, max_peers: int) -> Layout:
    """The layout of a combined device whose data area is exactly ``data_size`` bytes (a
    multiple of :data:`METADATA_BLOCK`): the smallest metadata area that leaves it whole. The
    bitmaps cover the combined device, so their length depends on the area's own length: grown
    until it no longer changes (twice at most in practice)."""
    if data_size % METADATA_BLOCK or data_size <= 0:
        raise MetadataError(f"a data area of {data_size} bytes is not a positive multiple of {METADATA_BLOCK}")
    regions = -(-data_size // region_size)
    bitmaps = -(-regions // (8 * METADATA_BLOCK)) * METADATA_BLOCK  # a lower bound: the data area alone
    while True:
        lay = layout(data_size + max_peers * bitmaps + 2 * METADATA_BLOCK, region_size, max_peers)
        if lay.data_size == data_size:
            return lay
        bitmaps = lay.bitmap_length


def data_area(size: int) -> int:
    """The part of a data device of ``size`` bytes that is replicated and exported: whole
    metadata blocks (a tail shorter than one is left out)."""
    return size - size % METADATA_BLOCK


class ExternalMetadata:
    """The data backend ``data`` (its first :func:`data_area` bytes) followed by the metadata
    area ``meta`` (its first ``meta_length`` bytes), as one :class:`~target.backend.Backend`.

    I/O within one part goes straight to it; the rare range that spans both (a whole-device read)
    is split. Capabilities are those both parts have."""

    def __init__(self, data: Backend, meta: Backend, meta_length: int) -> None:
        self.data = data
        self.meta = meta
        self.boundary = data_area(data.size)
        if meta.size < meta_length:
            raise ValueError(f"the metadata area has {meta.size} bytes, {meta_length} are needed "
                             "(run 'blockctl target create-md' to make it)")
        self.size = self.boundary + meta_length
        self.read_only = data.read_only
        self.can_trim = data.can_trim and meta.can_trim
        self.can_zero = data.can_zero and meta.can_zero
        self.can_fua = data.can_fua and meta.can_fua
        self.can_flush = data.can_flush or meta.can_flush

    @classmethod
    def open(cls, data: Backend, meta_path: str, region_size: int, max_peers: int,
             create: bool = False) -> ExternalMetadata:
        """``data`` with the metadata file or device at ``meta_path`` (``create``: make a missing
        file, or grow a short one, to the length needed; only ``blockctl target create-md`` does)."""
        lay = external_layout(data_area(data.size), region_size, max_peers)
        length = lay.metadata_length
        is_device = os.path.exists(meta_path) and stat.S_ISBLK(os.stat(meta_path).st_mode)
        if not create and not os.path.exists(meta_path):
            raise ValueError(f"the metadata file {meta_path} does not exist (run 'blockctl target create-md' "
                             "to make it)")
        grow = create and not is_device and (not os.path.exists(meta_path) or os.path.getsize(meta_path) < length)
        meta = FileBackend(meta_path, length if grow else None, create=create)
        try:
            return cls(data, meta, length)
        except ValueError:
            meta.close()
            raise

    def _parts(self, offset: int, length: int) -> list[tuple[Backend, int, int, int]]:
        """``(backend, its offset, length, offset into the caller's buffer)`` per part touched."""
        end = offset + length
        parts = []
        if offset < self.boundary:
            parts.append((self.data, offset, min(end, self.boundary) - offset, 0))
        if end > self.boundary:
            start = max(offset, self.boundary)
            parts.append((self.meta, start - self.boundary, end - start, start - offset))
        return parts

    async def read_into(self, offset: int, buf: memoryview) -> None:
        if offset + len(buf) <= self.boundary:
            await self.data.read_into(offset, buf)
            return
        for part, at, n, skip in self._parts(offset, len(buf)):
            await part.read_into(at, buf[skip:skip + n])

    async def write(self, offset: int, data: memoryview | bytes, fua: bool = False) -> None:
        if offset + len(data) <= self.boundary:
            await self.data.write(offset, data, fua)
            return
        view = memoryview(data)
        for part, at, n, skip in self._parts(offset, len(data)):
            await part.write(at, view[skip:skip + n], fua)

    async def flush(self) -> None:
        for part in (self.data, self.meta):
            if part.can_flush:
                await part.flush()

    async def discard(self, offset: int, length: int) -> None:
        for part, at, n, _ in self._parts(offset, length):
            await part.discard(at, n)

    async def write_zeroes(self, offset: int, length: int) -> None:
        for part, at, n, _ in self._parts(offset, length):
            await part.write_zeroes(at, n)

    def data_extents(self, offset: int, length: int) -> list[tuple[int, int]]:
        """The data device's extents in ``[offset, offset + length)`` of the data area (see
        :meth:`target.backend.FileBackend.data_extents`): a resync skips its holes."""
        extents = getattr(self.data, "data_extents", None)
        return extents(offset, length) if extents is not None else [(offset, length)]

    def resize(self, size: int | None) -> int:
        if size is None or size == self.size:
            return self.size
        raise ValueError("a copy with external metadata cannot be resized")

    def close(self) -> None:
        self.data.close()
        self.meta.close()
