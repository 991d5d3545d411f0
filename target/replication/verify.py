"""Online verify: compare every region of this copy with each in-sync replica, by checksum.

DRBD's verify hashes on both nodes and ships digests; a replica here is a plain NVMe-oF
namespace (another blockd, or the kernel's nvmet) that cannot hash, so the primary reads the
replica's region and hashes both sides itself. Each region is compared under the resync's
per-region lock, so a host write cannot make the copies differ for the moment of the reads (no
false positives from writes in flight, which DRBD's verify reports). A mismatching region goes
into what the replica misses, with its bit set, and the resync mends it.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import TYPE_CHECKING, Any

import structlog

from target.replication.link import IN_SYNC, RESYNCING, ReplicaLink

if TYPE_CHECKING:
    from target.replication.mirror import ReplicatedBackend

log = structlog.get_logger("blockd.target.replication")


def _digest(data: bytes | bytearray) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


async def verify(mirror: ReplicatedBackend, link: ReplicaLink) -> dict[str, Any]:
    """Compare every region with ``link``'s copy; returns the mismatching regions (numbers and
    byte offsets). Raises what the replica's I/O raises, and
    :class:`~target.replication.link.LocalCopyError` (naming the region) when this copy's device
    fails a read: the verify stops there."""
    if link.state != IN_SYNC or link.io is None:
        raise ValueError(f"replica {link.name} is {link.state}: only an in-sync replica is verified")
    size = mirror.region_size
    started = time.monotonic()
    mismatched: list[int] = []
    try:
        for region in range(link.bitmap.regions):
            if link.state != IN_SYNC:
                raise ValueError(f"replica {link.name} went {link.state} during the verify: {link.reason}")
            local, remote = await _read_both(mirror, link, region)
            if _digest(local) != _digest(remote):
                mismatched.append(region)
                offset = region * size
                await link.bitmap.mark(offset, len(local))
                link.missing.add(region)
                log.warning("verify: region differs", namespace=mirror.name, replica=link.name, region=region,
                            offset=offset, length=len(local))
            ahead = (region + 1) * size / mirror.resync_rate - (time.monotonic() - started)
            if ahead > 0:  # the resync's rate limit holds for verify reads too
                await asyncio.sleep(ahead)
    finally:  # a verify cut short (this copy's read failed: LocalCopyError) still mends what it found
        if mismatched and link.state == IN_SYNC:
            link.state = RESYNCING  # the link's loop resyncs what is now missing
    log.info("verify done", namespace=mirror.name, replica=link.name, regions=link.bitmap.regions,
             mismatched=len(mismatched), seconds=round(time.monotonic() - started, 2))
    return {"replica": link.name, "regions": link.bitmap.regions, "region_size": size,
            "mismatched": [{"region": r, "offset": r * size,
                            "length": min(size, mirror.data_size - r * size)} for r in mismatched]}


async def _read_both(mirror: ReplicatedBackend, link: ReplicaLink, region: int) -> tuple[bytearray, bytes]:
    """Both copies of one region, read under the region's lock (as a resync copies it)."""
    async with mirror.region_lock(region):
        offset, local = await mirror.read_local(region)
        assert link.io is not None
        return local, await link.io.read(offset, len(local))
