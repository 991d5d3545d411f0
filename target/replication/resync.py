"""Resync: copy to a returning replica the regions it misses, in the background.

Only the regions in the link's ``missing`` set are copied (its write-intent bitmap at start, plus
what was written while it was away; every region for a new replica). Host writes go on: a write
to a region already copied goes to the replica as to an in-sync copy, a write to a region not
yet copied only adds it to the set. One region is copied at a time under a per-region lock
(host writes to it wait, writes in flight to it finish first), so the copy never carries older
data over a newer write. The rate is limited to ``resync_rate`` bytes per second.

Resumable: the bits are cleared only by the mirror's sweep, after a flush, for regions copied;
a restart of either side finds the rest still set. Progress (percent, MB/s, ETA) is in the log
every :data:`LOG_EVERY` seconds and in ``blockctl target replicas``.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import structlog

from target.replication.link import RESYNCING, Progress, ReplicaLink

if TYPE_CHECKING:
    from target.replication.mirror import ReplicatedBackend

log = structlog.get_logger("blockd.target.replication")

LOG_EVERY = 5.0
"""Seconds between progress lines in the log."""


async def run(mirror: ReplicatedBackend, link: ReplicaLink) -> None:
    """Bring ``link`` in sync; raises what the replica's I/O raises (the caller's link loop then
    marks it out of sync and tries again later, from where this stopped)."""
    link.state, link.reason = RESYNCING, ""
    size = mirror.region_size
    progress = link.progress = Progress(len(link.missing), size)
    started = time.monotonic()
    last_log = started
    if link.missing:
        log.info("resync started", namespace=mirror.name, replica=link.name, regions=len(link.missing),
                 bytes=progress.total)
    while link.missing:
        for region in sorted(link.missing):
            if region not in link.missing:
                continue
            copied = await copy_region(mirror, link, region)
            link.copied_total += copied
            # rate limit: never ahead of resync_rate bytes per second since the start; the region
            # joins the progress after the wait, so the MB/s and ETA shown follow the limit (counted
            # before it, the first region made the rate look unbounded and the ETA 0)
            ahead = (progress.copied + copied) / mirror.resync_rate - (time.monotonic() - started)
            if ahead > 0:
                await asyncio.sleep(ahead)
            progress.add(copied, len(link.missing), size)
            now = time.monotonic()
            if now - last_log >= LOG_EVERY:
                last_log = now
                log.info("resync progress", namespace=mirror.name, replica=link.name, **progress.view())
    assert link.io is not None
    await link.io.flush()
    await mirror.push_generations(link)
    progress.total = progress.copied  # the estimate counted the last region whole
    mirror.resync_done(link)
    log.info("replica in sync", namespace=mirror.name, replica=link.name, **progress.view())


async def copy_region(mirror: ReplicatedBackend, link: ReplicaLink, region: int) -> int:
    """Copy one region from the local copy to the replica under the region's lock; returns the
    bytes copied (the last region may be short)."""
    async with mirror.region_lock(region):
        offset, buf = await mirror.read_local(region)
        assert link.io is not None
        await link.io.write(offset, buf)
        link.missing.discard(region)
        return len(buf)
