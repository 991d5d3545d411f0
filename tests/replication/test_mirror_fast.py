"""The compiled replicated write (target/replication/_mirror_io.pyx) against the Python mirror.

In one process: a ReplicatedBackend over a real file (the lane needs a plain FileBackend as its
local copy) and RAM replicas behind test_mirror's FakeReplica. The lane takes a write only when
the reference would neither wait nor write metadata, and answers it only once every copy has it;
everything else it declines before anything happened. The differential test sends the same
random stream of writes, overlapping ones among them and at once, through lane-or-reference and
through the reference alone, and compares every copy with what arrival order says; the
loopback tests (test_overlap.py, test_loopback.py) run the daemons, whose compiled TCP path
hands the lane its writes (``compiled_writes`` in their replicas view shows it ran).

Each rule broken on purpose, one edit at a time in ``_mirror_io.pyx`` (2026-12-07):

- the overlap decline removed (``if earlier:`` never taken): the overlap decline case and the
  differential (3 seeds) fail here, ``test_overlap.py`` ends with different copies;
- the lane leaving the region lists at once (its write invisible to later commands): the
  cross-path wait test, a failing replica's test and the differential fail;
- the bit check removed: the ``bit_clear`` decline case fails;
- the in-sync check removed: the ``replica_away`` decline case fails;
- the host answered before the replicas (``done`` called at send): the steady-write test, the
  cross-path wait, both failing-replica cases and the differential fail;
- a replica's failure taken as success: both failing-replica cases fail.

The local ``pwrite`` after the sends (2026-12-07, second pass), each break rebuilt and run:

- the ``pwrite`` moved back before the sends: the send-order test fails (the replicas were
  handed the write when the local copy already held it);
- ``local_failed`` not called when the ``pwrite`` fails after the sends: the local-failure
  test without a failing replica fails (the replica stays in sync, missing nothing);
- the ``pwrite``'s error dropped (the write answered as a success): the same test fails (the
  host got None).
"""

from __future__ import annotations

import asyncio
import errno
import os
import random
from pathlib import Path
from typing import Any

import pytest

from blockd import eager
from protocol.status import Status
from target.backend import FileBackend
from target.replication import mirror as mirror_mod
from target.replication.link import DEGRADED, IN_SYNC
from target.replication.mirror import ReplicatedBackend, ReplicationError

from .test_mirror import DEVICE, REGION, Bed, run, until

pytestmark = pytest.mark.skipif(mirror_mod.MirrorLane is None,
                                reason="the compiled data plane is not in use (BLOCKD_PURE=1 or not built)")

BLOCK = 4096


@pytest.fixture(autouse=True)
def fast_links(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mirror_mod, "RECONNECT_DELAY", 0.02)
    monkeypatch.setattr(mirror_mod, "SWEEP_INTERVAL", 3600.0)  # no clear of bits during a test


class Replies:
    """The ``reply`` of the lane's writes: what each got, in the order they ended."""

    def __init__(self) -> None:
        self.got: list[tuple[int, BaseException | None]] = []

    def __call__(self, tag: int) -> Any:
        return lambda exc: self.got.append((tag, exc))


async def _bed(tmp: Path, n: int = 1, min_in_sync: int = 1) -> tuple[Bed, ReplicatedBackend, FileBackend]:
    local = FileBackend(str(tmp / "local.img"), DEVICE)
    bed = Bed(n, local=local)
    m = await bed.primary(min_in_sync)
    await until(lambda: all(link.state == IN_SYNC for link in m.links))
    assert m.lane is not None
    for offset in range(0, m.size - REGION + 1, REGION):  # every bit on disk, as on a volume in use
        await m.write(offset, bytes(BLOCK))
    return bed, m, local


def _local(local: FileBackend, offset: int, length: int) -> bytes:
    return os.pread(local.fd, length, offset)


def test_the_lane_writes_every_copy_and_answers_only_after_the_replicas(tmp_path: Path) -> None:
    async def main() -> None:
        bed, m, local = await _bed(tmp_path, n=2)
        gate = asyncio.Event()
        for r in (bed.opened[0][-1], bed.opened[1][-1]):
            r.gates[8 * BLOCK] = gate
        replies = Replies()
        data = os.urandom(BLOCK)
        assert m.lane.write(8 * BLOCK, data, replies(1))
        assert _local(local, 8 * BLOCK, BLOCK) == data
        assert m.inflight  # joined: a later overlapping write would wait for it
        for _ in range(20):
            await asyncio.sleep(0)
        assert replies.got == []  # the replicas have not taken it yet
        gate.set()
        await until(lambda: bool(replies.got))
        assert replies.got == [(1, None)]
        assert not m.inflight and m.lane.served == 1
        for store in bed.stores:
            assert bytes(store.data[8 * BLOCK:9 * BLOCK]) == data
        await m.stop()
    run(main())


@pytest.mark.parametrize("case", ["secondary", "copying", "replica_away", "bit_clear", "overlap", "local_closed",
                                  "too_few_copies"])
def test_the_lane_declines_what_the_reference_must_decide_before_anything_happens(tmp_path: Path, case: str) -> None:
    """Each state in which the Python write would wait, write metadata, skip a replica or fail:
    the lane returns False, writes nothing anywhere and leaves the region lists as they were."""
    async def main() -> None:
        bed, m, local = await _bed(tmp_path, n=1)
        offset = 3 * REGION + 2 * BLOCK
        before = _local(local, offset, BLOCK)
        replica = bed.opened[0][-1]
        written = replica.written
        pending: asyncio.Task[None] | None = None
        if case == "secondary":
            m.primary = False
        elif case == "copying":
            m.copying[77] = asyncio.get_running_loop().create_future()
        elif case == "replica_away":
            m.links[0].state = DEGRADED
        elif case == "bit_clear":
            for bm in m._bitmaps:
                bm._persisted[3 >> 3] &= ~(1 << 3)  # region 3's bit not on disk: the write would set it
        elif case == "overlap":
            gate = replica.gates[offset - BLOCK] = asyncio.Event()
            pending = asyncio.get_running_loop().create_task(m.write(offset - BLOCK, bytes(2 * BLOCK)))
            await until(lambda: bool(m.inflight))
            written = replica.written
            before = _local(local, offset, BLOCK)
        elif case == "local_closed":
            m.lane.file.fd = -1  # as FileBackend.close leaves it
        elif case == "too_few_copies":
            m.min_in_sync = 3  # the reference refuses it: Namespace Not Ready
        lists = {r: list(here) for r, here in m.inflight.items()}
        replies = Replies()
        assert not m.lane.write(offset, os.urandom(BLOCK), replies(1))
        assert m.lane.declined == 1 and m.lane.served == 0
        assert _local(local, offset, BLOCK) == before
        assert {r: list(here) for r, here in m.inflight.items()} == lists
        for _ in range(10):
            await asyncio.sleep(0)
        assert replica.written == written and replies.got == []
        if pending is not None:
            gate.set()
            await pending
        m.primary, m.min_in_sync = True, 1
        m.copying.clear()
        if case == "local_closed":
            m.lane.file.fd = local.fd
        await m.stop()
    run(main())


def test_a_python_write_waits_for_an_overlapping_one_the_lane_sent(tmp_path: Path) -> None:
    """The ordering across the two paths: the lane's write is in the region lists, and the
    reference's ``_begin`` waits for it to be on every copy before it sends anything."""
    async def main() -> None:
        bed, m, local = await _bed(tmp_path, n=1)
        replica = bed.opened[0][-1]
        gate = replica.gates[0] = asyncio.Event()
        replies = Replies()
        first, second = os.urandom(2 * BLOCK), os.urandom(BLOCK)
        written = replica.written
        assert m.lane.write(0, first, replies(1))
        later = asyncio.get_running_loop().create_task(m.write(BLOCK, second))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not later.done() and replica.written == written
        assert _local(local, BLOCK, BLOCK) == first[BLOCK:]  # the later one has not been written here
        gate.set()
        await later
        assert replies.got == [(1, None)]
        want = first[:BLOCK] + second
        assert _local(local, 0, 2 * BLOCK) == want == bytes(bed.stores[0].data[:2 * BLOCK])
        await m.stop()
    run(main())


@pytest.mark.parametrize("min_in_sync", [1, 2])
def test_a_replica_failing_a_lane_write_is_left_behind_as_the_reference_leaves_it(tmp_path: Path,
                                                                                  min_in_sync: int) -> None:
    """The replica leaves the copies in sync (a new generation, its regions missed); the host's
    write succeeds while ``min_in_sync`` copies took it, else gets Write Fault."""
    async def main() -> None:
        bed, m, local = await _bed(tmp_path, n=1, min_in_sync=min_in_sync)
        generation = m.md.current
        replica = bed.opened[0][-1]
        replica.fail_with = OSError(5, "replica says no")
        got: list[tuple[BaseException | None, str, bool, int, bool]] = []
        link = m.links[0]

        def reply(exc: BaseException | None) -> None:  # what the host's answer follows
            got.append((exc, link.state, 5 in link.missing, m.md.current, bool(m.inflight)))
        assert m.lane.write(5 * REGION, os.urandom(BLOCK), reply)
        await until(lambda: bool(got))
        ((exc, state, missed, current, joined),) = got
        if min_in_sync == 1:
            assert exc is None
        else:
            assert isinstance(exc, ReplicationError) and exc.status == Status.WRITE_FAULT
        assert state != IN_SYNC and missed and current != generation and not joined
        assert m.lane.served == 0
        await m.stop()
    run(main())


def test_the_lane_sends_to_the_replicas_before_it_writes_the_local_copy(tmp_path: Path) -> None:
    """The reference's order (``ReplicatedBackend.write``: the replicas first, then the local
    write): the local ``pwrite`` runs while the replicas' writes travel, so a QD1 write costs
    the longer of the two rather than their sum. Seen from the replicas: when each was handed
    the write, the local copy did not hold it yet; when the lane returned, it did."""
    async def main() -> None:
        bed, m, local = await _bed(tmp_path, n=2)
        offset = 6 * REGION + BLOCK
        old, data = _local(local, offset, BLOCK), os.urandom(BLOCK)
        seen: list[bytes] = []
        for r in (bed.opened[0][-1], bed.opened[1][-1]):
            orig = r.submit_write

            def spy(off: int, buf: Any, fua: bool, done: Any, orig: Any = orig) -> None:
                seen.append(_local(local, offset, BLOCK))
                orig(off, buf, fua, done)
            r.submit_write = spy  # type: ignore[method-assign]
        replies = Replies()
        assert m.lane.write(offset, data, replies(1))
        assert seen == [old, old]  # both sent before this copy was written
        assert _local(local, offset, BLOCK) == data
        await until(lambda: bool(replies.got))
        assert replies.got == [(1, None)] and m.lane.served == 1 and not m.inflight
        await m.stop()
    run(main())


@pytest.mark.parametrize("replica_fails", [False, True])
def test_a_local_write_failing_after_the_sends_ends_as_the_references(tmp_path: Path, replica_fails: bool) -> None:
    """This copy's ``pwrite`` fails after the replicas were sent the write (they cannot be
    called back): as ``ReplicatedBackend.write`` when ``_write_local`` raises, every replica
    misses the write's regions (an in-sync one resyncs them from this copy), the region lists
    are left once every copy answered, and the host gets the device's error (its errno, which
    ``Controller.write_error`` makes Write Fault or, for ENOSPC, Capacity Exceeded), or Write
    Fault when a replica failed too and too few copies took it."""
    async def main() -> None:
        bed, m, local = await _bed(tmp_path, n=1, min_in_sync=2 if replica_fails else 1)
        replica = bed.opened[0][-1]
        if replica_fails:
            replica.fail_with = OSError(5, "replica says no")
        offset, data = 9 * REGION, os.urandom(BLOCK)
        region = offset // REGION
        sent: list[int] = []
        orig = replica.submit_write

        def spy(off: int, buf: Any, fua: bool, done: Any) -> None:
            sent.append(off)
            orig(off, buf, fua, done)
        replica.submit_write = spy  # type: ignore[method-assign]
        read_only = os.open(local.path, os.O_RDONLY)  # the lane's pwrite fails (EBADF), the reference's would not
        m.lane.file.fd = read_only
        got: list[tuple[BaseException | None, str, bool, bool]] = []
        link = m.links[0]

        def reply(exc: BaseException | None) -> None:  # what the host's answer follows
            got.append((exc, link.state, region in link.missing, bool(m.inflight)))
        try:
            assert m.lane.write(offset, data, reply)  # taken: the replicas had it before the pwrite failed
            await until(lambda: bool(got))
        finally:
            m.lane.file.fd = local.fd
            os.close(read_only)
        ((exc, state, missed, joined),) = got
        assert state != IN_SYNC and missed and not joined
        if replica_fails:
            assert isinstance(exc, ReplicationError) and exc.status == Status.WRITE_FAULT
        else:
            assert isinstance(exc, OSError) and not isinstance(exc, ReplicationError) and exc.errno == errno.EBADF
        assert sent == [offset]  # sent before the local write failed (a resync may overwrite it since)
        assert m.lane.served == 0 and m.lane.declined == 0
        await m.stop()
    run(main())


def _model(writes: list[tuple[int, bytes]], size: int) -> bytes:
    out = bytearray(size)
    for offset, data in writes:
        out[offset:offset + len(data)] = data
    return bytes(out)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_lane_or_reference_ends_with_every_copy_as_arrival_order_says(tmp_path: Path, seed: int) -> None:
    """Differential: batches of writes arrive at once (some overlapping, some FUA, some to a
    region whose bit is clear), each offered to the lane first as the transport does and to
    the reference when declined (started eagerly, as the target's queue starts a command: it
    joins the region lists when it arrives); the replicas answer in random order. Every copy ends as the
    writes applied in arrival order, as with the reference alone (run beside it on another
    bed), and the lane took a share of them."""
    async def one(use_lane: bool, sub: str) -> tuple[bytes, list[bytes], int]:
        rng = random.Random(seed)
        (tmp_path / sub).mkdir()
        bed, m, local = await _bed(tmp_path / sub, n=2)
        for i, r in enumerate((bed.opened[0][-1], bed.opened[1][-1])):
            orig = r.write

            async def slow(offset: int, data: Any, fua: bool = False, orig: Any = orig,
                           rr: random.Random = random.Random(seed * 7 + i)) -> None:
                for _ in range(rr.randrange(6)):
                    await asyncio.sleep(0)
                await orig(offset, data, fua)
            r.write = slow  # type: ignore[method-assign]
        span = 8 * REGION // BLOCK
        applied: list[tuple[int, bytes]] = []
        tasks: list[asyncio.Task[None]] = []
        replies = Replies()
        for _batch in range(40):
            for _ in range(rng.randrange(1, 9)):
                block = rng.randrange(span - 4)
                data = rng.randbytes(BLOCK * rng.randrange(1, 4))
                fua = rng.random() < 0.1
                applied.append((block * BLOCK, data))
                if rng.random() < 0.05:  # a region whose bit the sweeper cleared: the reference sets it
                    for bm in m._bitmaps:
                        r = (block * BLOCK) >> (REGION.bit_length() - 1)
                        if not m.inflight.get(r):
                            bm._persisted[r >> 3] &= ~(1 << (r & 7))
                            bm._bits[r >> 3] &= ~(1 << (r & 7))
                if use_lane and not fua and m.lane.write(block * BLOCK, data, replies(len(applied))):
                    continue
                task = eager.start(m.write(block * BLOCK, data, fua))  # as TargetQueue._run: joins at arrival
                if task is not None:
                    tasks.append(task)
            await asyncio.sleep(0)
            if rng.random() < 0.3:
                await asyncio.gather(*tasks)
        await asyncio.gather(*tasks)
        await until(lambda: not m.inflight)
        assert all(exc is None for _, exc in replies.got)
        size = span * BLOCK
        copies = [bytes(s.data[:size]) for s in bed.stores]
        lane_served = m.lane.served
        await m.stop()
        want = _model(applied, size)
        assert _local(local, 0, size) == want
        assert copies == [want, want]
        return want, copies, lane_served

    async def main() -> None:
        with_lane = await one(True, "lane")
        reference = await one(False, "reference")
        assert with_lane[0] == reference[0]
        assert with_lane[2] > 0 and reference[2] == 0
    run(main())
