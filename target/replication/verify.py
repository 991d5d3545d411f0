"""Online verify: compare every region of this copy with each in-sync replica, at disk speed.

Two ways, chosen per replica when the verify starts (the result's ``method``):

* **digest** (a blockd replica): as DRBD's verify, each side hashes its own copy and only the
  digests cross the link. The replica answers blockd's Digest command (:mod:`protocol.digest`,
  one XXH3-128 digest per region) while this copy's part is read and hashed here, and the
  digests are compared. Reading the replica's data instead copies each of its bytes three times
  (its read, its send, our receive): measured at 0.12-0.19x the rate of reading both files
  (docs/benchmarks.md), where hashing both copies at once runs near that rate.
* **read** (a replica whose controller does not list the command in its Commands Supported and
  Effects log: the kernel's nvmet): the primary reads the replica's data and compares it with
  its own, byte for byte.

How either keeps up with reading both copies:

* **Large units.** Consecutive regions are compared :data:`UNIT` bytes at a time: the replica's
  part goes out as commands of the replica's largest transfer, all sent at once over the
  association's queues, and is asked for before this copy's part is read, so the replica serves
  it meanwhile.
* **Several at once.** :data:`DEPTH` units are in flight (:data:`DIGEST_DEPTH` by digests).
* **No new memory per unit.** Both copies are read into buffers that the finished units hand on
  (a new 8 MiB ``bytearray`` is zero-filled and page-faulted in: in a profile of the earlier
  verify that was 43 % of the primary's time), and compared with ``bytearray ==`` (one
  ``memcmp``; a ``memoryview`` compares item by item, ~50x slower).
* **Hashing off the event loop.** This copy's unit is hashed in the default executor (8 MiB
  take ~2 ms), so host I/O on this target keeps flowing meanwhile. When this copy is a plain
  file, on the compiled plane, the unit is read and hashed there too, in one call that releases
  the GIL (``target/_digest.pyx``, :func:`target.digest.hash_file`), and no buffer holds its data.

Each unit is read under the resync's per-region lock, so a host write cannot make the copies
differ for the moment of the reads (no false positives from writes in flight, which DRBD's
verify reports). A mismatching region goes into what the replica misses, with its bit set, and
the resync mends it. The rate is limited to ``resync_rate`` bytes per second of this copy's data
read (at low rates the units shrink as the resync's do: :func:`~target.replication.resync.unit_regions`).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import structlog

from protocol.digest import DIGEST_SIZE, MAX_BLOCKS, DigestAlgorithm, Digests
from target.digest import compiled_file, hash_file
from target.replication.link import IN_SYNC, RESYNCING, LocalCopyError, ReplicaLink
from target.replication.resync import unit_regions, units

if TYPE_CHECKING:
    from target.replication.mirror import ReplicatedBackend

log = structlog.get_logger("blockd.target.replication")

UNIT = 8 << 20
"""Most bytes compared as one unit (the resync's :data:`~target.replication.resync.UNIT` is
smaller: there, deeper queues of large writes slowed the replica down; reads do not)."""
DEPTH = 4
"""Units compared at once by reading (so a verify holds up to 64 MiB of buffers while it runs).
Measured on loopback, 256 MiB against a blockd replica, alternated, 2 runs each twice: 4 at once
389-516 MB/s, 2 at once 271-407 MB/s."""
DIGEST_DEPTH = 8
"""Units compared at once by digests (their buffers hold 16 bytes a region). Against 4, 512 MiB
on loopback, 3 runs of 4 alternated rounds (tests/bench/bench_resync.py --verify-only,
2026-12-08; the digest loop over a mapping in both): 8 at once 0.77-1.80x 4 at once, faster in
8 rounds, even in 3 (a quiet machine: both hash as fast as the 2 CPUs allow), slower in 1.
More units out keep both ends hashing while other work shares the CPUs, and the Digest
command's round trip (a unit's 8 MiB hashed in ~1-4 ms, answered in ~3-7 ms) overlapped."""

Buffers = list[tuple[bytearray, bytearray]]
"""Pairs of buffers of finished units, for the next ones: (this copy's data, the replica's
data) reading, (this copy's data, the replica's digests) with digests."""
Differing = Callable[["ReplicatedBackend", ReplicaLink, int, int, Buffers], Awaitable[list[int]]]
"""How one unit is compared: :func:`_differing` (reading) or :func:`_differing_digests`."""


def method(mirror: ReplicatedBackend, link: ReplicaLink) -> str:
    """``"digest"`` when the replica serves blockd's Digest command for regions of this size
    (``serves_digests``: ``initiator.replica.RemoteNamespace`` read it from the replica's
    Commands Supported and Effects log; other replicas, test doubles among them, lack it), else
    ``"read"``."""
    io = link.io
    if not getattr(io, "serves_digests", False):
        return "read"
    bs = io.block_size
    return "digest" if mirror.region_size % bs == 0 and mirror.region_size // bs <= MAX_BLOCKS else "read"


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
    running: set[asyncio.Task[tuple[list[int], LocalCopyError | None]]] = set()
    read = 0
    regions = link.bitmap.regions
    spare: Buffers = []
    how = method(mirror, link)
    differing: Differing = _differing_digests if how == "digest" else _differing
    depth = DIGEST_DEPTH if how == "digest" else DEPTH
    log.info("verify started", namespace=mirror.name, replica=link.name, regions=regions, method=how,
             **({} if how == "digest" else {"why": "the replica does not serve blockd's Digest command: its data "
                                                   "is read and compared here"}))

    async def collect(block: bool) -> None:
        nonlocal running
        if not running:
            return
        finished, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED if block else
                                               asyncio.ALL_COMPLETED)
        failed: BaseException | None = None
        for task in finished:  # every outcome taken (none is reported as never retrieved), then the first failure
            if task.exception() is not None:
                failed = failed or task.exception()
                continue
            found, error = task.result()
            failed = failed or error
            for region in found:
                mismatched.append(region)
                offset, length = mirror.span(region)
                await link.bitmap.mark(offset, length)
                link.missing.add(region)
                log.warning("verify: region differs", namespace=mirror.name, replica=link.name, region=region,
                            offset=offset, length=length)
        if failed is not None:
            raise failed

    try:
        for first, count in units(range(regions), unit_regions(size, mirror.resync_rate, UNIT)):
            if link.state != IN_SYNC:
                raise ValueError(f"replica {link.name} went {link.state} during the verify: {link.reason}")
            while len(running) >= depth:
                await collect(block=True)
            ahead = read / mirror.resync_rate - (time.monotonic() - started)
            if ahead > 0:  # the resync's rate limit holds for verify reads too
                await asyncio.sleep(ahead)
            read += mirror.span(first, count)[1]
            running.add(asyncio.get_running_loop().create_task(_compare(mirror, link, first, count, spare, differing)))
        while running:
            await collect(block=False)
    finally:  # a verify cut short (this copy's read failed: LocalCopyError) still mends what it found
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        if mismatched and link.state == IN_SYNC:
            link.state = RESYNCING  # the link's loop resyncs what is now missing
    mismatched.sort()
    log.info("verify done", namespace=mirror.name, replica=link.name, regions=regions, method=how,
             mismatched=len(mismatched), seconds=round(time.monotonic() - started, 3))
    return {"replica": link.name, "regions": regions, "region_size": size, "method": how,
            "mismatched": [{"region": r, "offset": r * size, "length": mirror.span(r)[1]} for r in mismatched]}


async def _compare(mirror: ReplicatedBackend, link: ReplicaLink, first: int, count: int,
                   spare: Buffers, differing: Differing) -> tuple[list[int], LocalCopyError | None]:
    """The regions of ``first`` .. ``first + count - 1`` whose copies differ, both read under
    the regions' lock (as a resync copies them). A unit this copy fails to read is compared
    again region by region: the differing regions before a bad one are returned with the error,
    which names the bad region."""
    async with mirror.regions_lock(first, count):
        try:
            return await differing(mirror, link, first, count, spare), None
        except LocalCopyError as exc:
            if count == 1:
                return [], exc
        found: list[int] = []
        for region in range(first, first + count):
            try:
                found += await differing(mirror, link, region, 1, spare)
            except LocalCopyError as exc:
                return found, exc
        return found, None


async def _differing(mirror: ReplicatedBackend, link: ReplicaLink, first: int, count: int,
                     spare: Buffers) -> list[int]:
    offset, length = mirror.span(first, count)
    io = link.io
    assert io is not None
    mine, theirs = spare.pop() if spare and len(spare[-1][0]) == length else (bytearray(length), bytearray(length))
    # the replica's part is asked for first: it is served while this copy's part is read (on a
    # failure the buffers are dropped, not reused: a late answer lands where no one looks)
    await asyncio.gather(io.read_into(offset, memoryview(theirs)), mirror.read_local_into(offset, memoryview(mine)))
    found = _unequal(first, count, mine, theirs, mirror.region_size)
    spare.append((mine, theirs))
    return found


async def _differing_digests(mirror: ReplicatedBackend, link: ReplicaLink, first: int, count: int,
                             spare: Buffers) -> list[int]:
    """As :func:`_differing`, by digests: the replica hashes its part while this copy's part is
    read and hashed here (in the default executor: hashing 8 MiB holds a thread ~2 ms), by the
    compiled loop when this copy is a plain file (then ``mine`` stays empty)."""
    offset, length = mirror.span(first, count)
    size = mirror.region_size
    io = link.io
    assert io is not None
    file = compiled_file(mirror.inner, DigestAlgorithm.XXH3_128)
    need = 0 if file is not None else length
    mine, theirs = spare.pop() if spare and len(spare[-1][0]) == need and len(spare[-1][1]) == count * DIGEST_SIZE \
        else (bytearray(need), bytearray(count * DIGEST_SIZE))
    ours = bytearray(count * DIGEST_SIZE)

    async def hash_mine() -> None:
        if file is not None:
            try:
                await hash_file(file, offset, length, size, ours)
            except OSError as exc:
                raise mirror.local_copy_error(exc, offset, length) from exc
            return
        await mirror.read_local_into(offset, memoryview(mine))
        digests = Digests(DigestAlgorithm.XXH3_128, length, size, ours)
        await asyncio.get_running_loop().run_in_executor(None, digests.feed, mine)

    await asyncio.gather(io.digests(offset, length, size, memoryview(theirs)), hash_mine())
    found = _unequal(first, count, ours, theirs, DIGEST_SIZE)
    spare.append((mine, theirs))
    return found


def _unequal(first: int, count: int, a: bytearray, b: bytearray, stride: int) -> list[int]:
    """The regions ``first`` .. ``first + count - 1`` whose ``stride`` bytes (a region's data,
    or its digest) differ between ``a`` and ``b``: one ``memcmp`` of the whole when they are
    equal, as they nearly always are."""
    if a == b:
        return []
    return [first + k for k in range(count) if a[k * stride:(k + 1) * stride] != b[k * stride:(k + 1) * stride]]
