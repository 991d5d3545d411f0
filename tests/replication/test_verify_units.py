"""Verify at disk speed (target/replication/verify.py), in one process: large units read from
both copies into reused buffers, several at once, and a difference found wherever it is in a
unit (its first byte, its middle, its last), in a unit whose buffers were used before."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from protocol.digest import DigestAlgorithm, Digests
from target.backend import MemoryBackend
from target.replication import verify as verify_mod
from target.replication.link import IN_SYNC
from target.replication.mirror import ReplicatedBackend
from target.replication.verify import verify

from .nodes import NQN, Node, all_in_sync
from .nodes import REGION as NODE_REGION
from .test_mirror import REGION, Bed, FakeReplica, run, until

UNITS = 2 * verify_mod.DEPTH
"""The data area holds a little more than this many of verify's units: with DEPTH in flight,
the later ones take the buffers the first ones used (and as many as DIGEST_DEPTH fit at once)."""
DEVICE = UNITS * verify_mod.UNIT + (1 << 20)


class Reading(FakeReplica):
    """A replica that records each read of the data area and how many were under way at once."""

    def __init__(self, store: Any, name: str) -> None:
        super().__init__(store, name)
        self.reads: list[tuple[int, int]] = []
        self.busy = 0
        self.most_busy = 0

    async def read_into(self, offset: int, buf: memoryview) -> None:
        self.reads.append((offset, len(buf)))
        self.busy += 1
        self.most_busy = max(self.most_busy, self.busy)
        try:
            await asyncio.sleep(0.001)  # a replica takes a moment: the next unit goes out meanwhile
            await super().read_into(offset, buf)
        finally:
            self.busy -= 1


class Digesting(Reading):
    """A replica that answers digests (as a blockd replica does), recording each Digest range;
    the first ones wait (up to 5 s) until :data:`~target.replication.verify.DIGEST_DEPTH` are
    under way, so units sent together always meet, however loaded the machine."""

    serves_digests = True

    def __init__(self, store: Any, name: str) -> None:
        super().__init__(store, name)
        self.full = asyncio.Event()

    async def digests(self, offset: int, length: int, chunk: int, out: memoryview) -> None:
        self._check()
        self.reads.append((offset, length))
        self.busy += 1
        self.most_busy = max(self.most_busy, self.busy)
        if self.busy >= verify_mod.DIGEST_DEPTH:
            self.full.set()
        try:
            await asyncio.wait_for(self.full.wait(), 5)
        except asyncio.TimeoutError:
            pass
        try:
            data = bytearray(length)
            await self.store.read_into(offset, memoryview(data))
            Digests(DigestAlgorithm.XXH3_128, length, chunk, out).feed(data)
        finally:
            self.busy -= 1


async def in_sync_pair(rate: int = 1 << 40, replica: type[Reading] = Reading
                       ) -> tuple[ReplicatedBackend, MemoryBackend, list[Reading]]:
    """A primary over random data with one ``replica`` that got all of it by a full sync
    (``rate``: no limit by default)."""
    local, store = MemoryBackend(DEVICE), MemoryBackend(DEVICE)
    local.data[:] = os.urandom(DEVICE)
    local.data[-(1 << 20):] = bytes(1 << 20)  # blank metadata: formatted at open
    bed = Bed(1, local=local, stores=[store])
    opened: list[Reading] = []

    async def open_() -> Reading:
        r = replica(store, "r0")
        opened.append(r)
        return r
    bed.opener = lambda i: open_  # type: ignore[method-assign]
    m = await bed.primary(rate=rate)
    await until(lambda: m.links[0].state == IN_SYNC, timeout=30)
    assert m.size > UNITS * verify_mod.UNIT
    return m, store, opened


@pytest.mark.parametrize("where", ["first byte", "middle", "last byte"])
def test_verify_finds_one_byte_anywhere_in_a_large_unit(where: str) -> None:
    """The byte differs in the first unit and in the last whole one (whose buffers an earlier
    unit filled before); a compare of a unit's head only, of a shorter range, or of stale
    buffers misses one."""
    unit = verify_mod.UNIT
    at = {"first byte": 0, "middle": unit // 2 + 3, "last byte": unit - 1}[where]

    async def main() -> None:
        m, store, _ = await in_sync_pair()
        last = (UNITS - 1) * unit + at
        for byte in (at, last):
            store.data[byte] ^= 0x01
        report = await verify(m, m.links[0])
        assert report["method"] == "read"  # the test double has no Digest command: its data is read
        assert [x["region"] for x in report["mismatched"]] == [at // REGION, last // REGION]
        await until(lambda: m.links[0].state == IN_SYNC and not m.links[0].missing)
        assert (await verify(m, m.links[0]))["mismatched"] == []  # mended by the resync
        await m.stop()
    run(main())


def test_verify_reads_whole_units_several_at_once() -> None:
    async def main() -> None:
        m, _, opened = await in_sync_pair()
        replica = opened[-1]
        replica.reads.clear()
        assert (await verify(m, m.links[0]))["mismatched"] == []
        data = [(o, n) for o, n in replica.reads if o < m.size]
        assert max(n for _, n in data) == verify_mod.UNIT
        assert len(data) == -(-m.size // verify_mod.UNIT)  # every byte once, in whole units
        assert replica.most_busy == verify_mod.DEPTH > 1
        await m.stop()
    run(main())


def test_verify_asks_for_the_digests_of_more_units_at_once() -> None:
    """By digests, DIGEST_DEPTH units are out at once (more than by reading: their buffers are
    16 bytes a region). Broken (DEPTH for both ways): 4 at most, and the test fails."""
    async def main() -> None:
        m, _, opened = await in_sync_pair(replica=Digesting)
        replica = opened[-1]
        replica.reads.clear()
        report = await verify(m, m.links[0])
        assert report["method"] == "digest" and report["mismatched"] == []
        assert len(replica.reads) == -(-m.size // verify_mod.UNIT)  # every byte once, in whole units
        assert replica.most_busy == verify_mod.DIGEST_DEPTH > verify_mod.DEPTH
        await m.stop()
    run(main())


def test_verify_keeps_the_rate_limit_with_large_units() -> None:
    async def main() -> None:
        rate = 64 << 20  # 8 MiB units at most an eighth of a second's worth: whole units here
        m, _, opened = await in_sync_pair()
        m.resync_rate = rate
        started = time.monotonic()
        await verify(m, m.links[0])
        elapsed = time.monotonic() - started
        assert elapsed >= (m.size - verify_mod.UNIT) / rate - 0.05, elapsed  # never ahead by more than a unit
        m.resync_rate = 16 << 20  # a lower rate: units shrink to an eighth of a second's worth
        opened[-1].reads.clear()
        await verify(m, m.links[0])
        assert max(n for o, n in opened[-1].reads if o < m.size) == (16 << 20) // 8
        await m.stop()
    run(main())


def test_verify_through_a_blockd_replica_finds_a_unit_s_last_byte_and_a_reused_unit_s_middle(tmp_path: Path) -> None:
    """The same over loopback: a `blockd target` primary and replica, compared by digests (the
    replica hashes each 64 KiB region of an 8 MiB unit with blockd's Digest command while the
    primary hashes its own into buffers that earlier units used): a byte flipped in the
    replica's file at the first unit's last byte and in the middle of the fifth unit (which
    reuses a buffer: four units run at once)."""
    unit = verify_mod.UNIT
    device = 6 * unit
    primary, replica = Node(tmp_path, "p", device), Node(tmp_path, "r", device)
    with open(primary.file, "wb") as f:  # data before replication: a new replica gets it all
        f.write(os.urandom(primary.data))
        f.truncate(device)
    flips = [unit - 1, 4 * unit + unit // 2]
    replica.start()
    primary.start([replica], nqn=NQN, resync_rate="64GiB")
    try:
        primary.wait_states(all_in_sync(), timeout=120)
        fd = os.open(replica.file, os.O_RDWR)
        try:
            for at in flips:
                os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x10]), at)
        finally:
            os.close(fd)
        before = replica.counters()
        res = primary.ctl("verify", NQN, "1", "--json")
        assert res.returncode == 1, res.stdout + res.stderr  # differences found
        after = replica.counters()
        [result] = json.loads(res.stdout)["replicas"]
        assert result["method"] == "digest"  # a blockd replica hashes its own copy
        # only digests crossed: no data read from the replica, a Digest command (kind "other")
        # per unit at least, 16 bytes per region
        assert after["bytes"]["read"] == before["bytes"]["read"], (before, after)
        assert after["ops"]["other"] - before["ops"]["other"] >= primary.data // unit
        assert after["bytes"]["other"] - before["bytes"]["other"] == result["regions"] * 16
        found = result["mismatched"]
        assert [m["region"] for m in found] == [at // NODE_REGION for at in flips]
        primary.wait_states(all_in_sync(), timeout=120)
        assert primary.data_hash() == replica.data_hash()
    finally:
        primary.stop()
        replica.stop()
