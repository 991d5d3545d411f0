"""Resync: copy to a returning replica the regions it misses, in the background, at disk speed.

Only the regions in the link's ``missing`` set are copied (its write-intent bitmap at start, plus
what was written while it was away; every region for a new replica). Host writes go on: a write
to a region already copied goes to the replica as to an in-sync copy, a write to a region not
yet copied only adds it to the set.

How it keeps up with a plain copy of the file (``cp``), as DRBD's resync keeps up with the disk:

* **Large units.** Consecutive missing regions are copied together, up to :data:`UNIT` bytes
  (4 MiB; the host library splits a unit at the replica's largest transfer, and the commands go
  out together over its queues).
* **More than one in flight.** :data:`DEPTH` units are copied at once: while one unit's write
  travels to the replica, the next one is read from the local copy.
* **No new memory per unit.** A unit is read into a buffer that a unit copied before hands on
  (a new ``bytearray`` is zero-filled and page-faulted in, which a profile of verify showed to
  cost most of the primary's time), and that buffer starts on a page
  (:func:`blockd.buffers.page_aligned`: the copy into a ``bytearray``, 16 bytes into its page,
  ran ~7x slower).
* **Holes skipped.** The local copy's holes (``SEEK_DATA``/``SEEK_HOLE`` on a sparse file, see
  :meth:`target.backend.FileBackend.data_extents`) are neither read nor sent: the replica gets
  one Write Zeroes for each hole of at least :data:`MIN_HOLE` bytes instead.

Each unit is copied under the per-region lock of all its regions (host writes to them wait,
writes in flight to them finish first), so the copy never carries older data over a newer write.
The rate is limited to ``resync_rate`` bytes of the data area per second (a hole counts as
its length, as if copied); at low rates the units shrink so that the rate stays smooth
(:func:`unit_regions`).

Resumable: the bits are cleared only by the mirror's sweep, after a flush, for regions copied;
a restart of either side finds the rest still set. Progress (percent, MB/s, ETA) is in the log
every :data:`LOG_EVERY` seconds and in ``blockctl target replicas``.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Iterator

import structlog

from blockd.buffers import page_aligned
from target.replication.link import RESYNCING, LocalCopyError, Progress, ReplicaLink

if TYPE_CHECKING:
    from target.replication.mirror import ReplicatedBackend

log = structlog.get_logger("blockd.target.replication")

LOG_EVERY = 5.0
"""Seconds between progress lines in the log."""
UNIT = 4 << 20
"""Most bytes copied as one unit: consecutive regions, under one lock, read at once and sent as
commands of the replica's largest transfer (1 MiB to blockd), all at once. Measured on loopback
(256 MiB full sync to a blockd replica, `blockd target` processes, the variants alternated in
each round with cp+sync after them, a machine shared with other sessions, load 4-6; 2026-12-07
18:15 UTC): 4 MiB units beat 1 MiB units in all 8 rounds of two runs (1.09-2.0x: 93-204 MB/s
against 60-188), 8 MiB units were about the same as 4 (median ratio to cp 0.71 / 0.55 against
0.71 / 0.58) and 16 MiB slower (0.39): more bytes in flight cover the round trips (command, R2T,
data, response) between two processes that each wait for the CPU, until a unit's read before
its first send costs more than that. A host write to a region of a unit being copied waits for
the unit (4 MiB at 200 MB/s: ~20 ms)."""
DEPTH = 2
"""Units copied at once. Measured in the runs of :data:`UNIT` (median ratio to cp): 4 MiB units
4 at once 0.69 against 0.71 for 2 (run 1), 8 MiB units 4 at once 0.44 against 0.55 (run 2). Earlier, with 1 MiB units (3 alternated rounds,
in process): 2 at once 196-256 MB/s, 4 at once 168-229, 8 at once 113-145, and one 64 KiB region
at a time 102-157; deeper queues of large writes only slow the replica's side down.

Measured again at 512 MiB (2026-12-08 00:40-01:17 UTC, a scratch script: the variants alternated
in each round, cp+sync after them; ratios are a variant over 4 MiB x 2 in the same round, 11
runs of 2-3 rounds; docs/benchmarks.md, "Full resync at 512 MiB and 1 GiB"), none kept:

* 4 MiB x 4: 0.67-1.99 (median 0.98); x 3: 0.64-1.16; 2 MiB x 6 or x 8: 0.61-1.13; 8 MiB x 2:
  0.73 / 0.97; 8 MiB x 4: 0.52 / 0.68 (32 MiB in flight, twice the blockd replica's R2T budget
  of a queue, 16 MiB, so presumably its writes wait in the queue's line, off the thread's path).
* Units spread over the replica's two I/O queues (a queue of its own per unit: 0.78-0.98; each
  1 MiB command on the next queue: 0.89-1.16; not explained: the two queue threads of the
  replica write one file, and this host is one thread); the controller's packing onto the first
  queue with room stays.
* A Flush to the replica every 64, 128 or 256 MiB, so that its write-back overlaps the copy:
  the final flush fell from ~0.2 s to 0.03-0.1 s, but the copy mostly took 0.9-2.0 s instead of
  0.4-0.95 (0.51-0.89 in 7 of 10 rounds, 1.70-2.03 in the 3 where the plain copy was itself
  slow): on 2 CPUs the write-back competes with both sides' copies.
* The local read in the executor's thread (the loop free for the replica's R2Ts meanwhile):
  1.00-1.04; read and sent in 1 MiB pieces with the loop between them: 0.35 / 0.85 / 1.18."""
MIN_HOLE = 64 << 10
"""A hole of the local copy at least this long becomes one Write Zeroes to the replica; a
shorter one is read and sent as zeroes (a command's round trip costs more than its bytes)."""
_HOLE_ALIGN = 4096
"""Holes are trimmed to whole 4 KiB blocks, so a Write Zeroes is whole blocks of any replica."""


def unit_regions(region_size: int, rate: int, most: int = UNIT) -> int:
    """Regions per unit: ``most`` bytes, but at most an eighth of a second's worth of
    ``rate``, so that a low rate is kept as a steady trickle rather than bursts (one region at
    least)."""
    return max(1, min(most, rate // 8) // region_size)


def units(regions: list[int], most: int) -> Iterator[tuple[int, int]]:
    """``(first, count)`` of each run of consecutive regions in sorted ``regions``, cut at
    ``most`` regions."""
    first = count = 0
    for region in regions:
        if count and region == first + count and count < most:
            count += 1
            continue
        if count:
            yield first, count
        first, count = region, 1
    if count:
        yield first, count


def pieces(backend: object, offset: int, length: int) -> list[tuple[int, int, bool]]:
    """``(start, length, is_data)`` covering ``[offset, offset + length)``: the holes of the
    local copy that are worth a Write Zeroes (:data:`MIN_HOLE`, whole 4 KiB blocks), and the
    data between them. A backend that does not know its holes is data throughout."""
    extents = getattr(backend, "data_extents", None)
    if extents is None:
        return [(offset, length, True)]
    out: list[tuple[int, int, bool]] = []
    pos = offset  # start of the data piece being built
    end = offset + length
    for hole_start, hole_end in _holes(extents(offset, length), offset, end):
        hole_start = -(-hole_start // _HOLE_ALIGN) * _HOLE_ALIGN
        hole_end -= hole_end % _HOLE_ALIGN if hole_end != end else 0
        if hole_end - hole_start < MIN_HOLE:
            continue
        if hole_start > pos:
            out.append((pos, hole_start - pos, True))
        out.append((hole_start, hole_end - hole_start, False))
        pos = hole_end
    if pos < end:
        out.append((pos, end - pos, True))
    return out


def _holes(data: list[tuple[int, int]], offset: int, end: int) -> Iterator[tuple[int, int]]:
    pos = offset
    for start, n in data:
        if start > pos:
            yield pos, start
        pos = max(pos, start + n)
    if pos < end:
        yield pos, end


async def run(mirror: ReplicatedBackend, link: ReplicaLink) -> None:
    """Bring ``link`` in sync; raises what the replica's I/O raises (the caller's link loop then
    marks it out of sync and tries again later, from where this stopped)."""
    link.state, link.reason = RESYNCING, ""
    size = mirror.region_size
    progress = link.progress = Progress(len(link.missing), size)
    started = time.monotonic()
    last_log = started
    started_bytes = 0  # bytes of the units started, for the rate limit
    if link.missing:
        log.info("resync started", namespace=mirror.name, replica=link.name, regions=len(link.missing),
                 bytes=progress.total)
    running: set[asyncio.Task[int]] = set()
    spare: list[memoryview] = []  # buffers of units copied, for the next ones
    try:
        while link.missing:
            most = unit_regions(size, mirror.resync_rate)
            for first, count in units(sorted(link.missing), most):
                while len(running) >= DEPTH:
                    finished, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                    _account(link, progress, size, finished)
                # rate limit: never ahead of resync_rate bytes per second since the start, counting
                # each unit as it starts (so at most one unit is ever early)
                ahead = started_bytes / mirror.resync_rate - (time.monotonic() - started)
                if ahead > 0:
                    await asyncio.sleep(ahead)
                if not all(r in link.missing for r in range(first, first + count)):
                    continue  # copied meanwhile (the next pass finds what is left)
                started_bytes += mirror.span(first, count)[1]
                running.add(asyncio.get_running_loop().create_task(copy_unit(mirror, link, first, count, spare)))
                now = time.monotonic()
                if now - last_log >= LOG_EVERY:
                    last_log = now
                    log.info("resync progress", namespace=mirror.name, replica=link.name, **progress.view())
            while running:  # this pass's last units: a region they copy must not start again
                finished, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                _account(link, progress, size, finished)
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
    assert link.io is not None
    await link.io.flush()
    await mirror.push_generations(link)
    progress.total = progress.copied  # the estimate counted the last region whole
    mirror.resync_done(link)
    log.info("replica in sync", namespace=mirror.name, replica=link.name, **progress.view())


def _account(link: ReplicaLink, progress: Progress, size: int, finished: set[asyncio.Task[int]]) -> None:
    """Count the units that ended; then raise the first failure among them (every one's
    outcome is taken, so that none is reported as never retrieved)."""
    failed: BaseException | None = None
    for task in finished:
        error = asyncio.CancelledError() if task.cancelled() else task.exception()
        if error is not None:
            failed = failed or error
            continue
        covered = task.result()
        link.copied_total += covered
        progress.add(covered, len(link.missing), size)
    if failed is not None:
        raise failed


async def copy_unit(mirror: ReplicatedBackend, link: ReplicaLink, first: int, count: int,
                    spare: list[memoryview]) -> int:
    """Copy regions ``first`` .. ``first + count - 1`` from the local copy to the replica under
    their lock, holes as Write Zeroes; returns the bytes covered (the last region may be short).
    A unit this copy fails to read is copied again region by region: the regions before a bad
    one are copied, and the error names the bad region. ``spare``: buffers that units copied
    before hand on (see the module docstring)."""
    async with mirror.regions_lock(first, count):
        try:
            return await _copy(mirror, link, first, count, spare)
        except LocalCopyError:
            if count == 1:
                raise
        return sum([await _copy(mirror, link, region, 1, spare) for region in range(first, first + count)])


async def _copy(mirror: ReplicatedBackend, link: ReplicaLink, first: int, count: int, spare: list[memoryview]) -> int:
    offset, length = mirror.span(first, count)
    io = link.io
    assert io is not None
    buf = spare.pop() if spare and len(spare[-1]) >= length else page_aligned(length)
    for start, n, data in pieces(mirror.inner, offset, length):
        if data:
            view = buf[:n]
            await mirror.read_local_into(start, view)
            await io.write(start, view)
        else:
            await io.write_zeroes(start, n)
    if len(spare) < DEPTH:  # handed on only once every write took it (a failed one's may still be queued)
        spare.append(buf)
    for region in range(first, first + count):
        link.missing.discard(region)
    return length
