"""Power loss of a replicated pair, recorded with dm-log-writes (issue 35, deliverable 3).

Inside the VM; run from the host by tests/vm/test_crash_replay.py, whose twin replays the logs
this writes to RESULTS and checks every crash point (tests/vm/crashpoints.py says how and why).
Here: the primary's and the replica's disks are dm-log-writes devices over loop devices; the
replica is a ``blockd target`` on 127.0.0.1 exporting its disk; the primary is a
``ReplicatedBackend`` in this process over its disk, mirroring to that target through the host
library. A writer goes through four phases (FUA writes; writes and Flushes; writes left to the
bit sweeper, then a Flush; FUA writes to regions the sweeper cleared), then the primary and
the replica stop cleanly.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from typing import Callable

import pytest

from target.backend import FileBackend
from target.replication import mirror
from target.replication.link import IN_SYNC
from target.replication.mirror import ReplicatedBackend
from initiator.replica import open_remote
from tests.vm.crashpoints import (
    BLOCK, DEVICE_SIZE, DEVICES, EVENTS_FILE, LOG_FILES, MAX_PEERS, REGION, Ticker, TickedReplica, payload,
)
from tests.vm.logwrites import Marker, read_log

from .util import RESULTS, Daemon, sh, tool, wait_tcp

NQN = "nqn.2026-11.io.blockd:crash-replica"
PORT = 4420
LOG_SIZE = 64 << 20
SEED = int(os.environ.get("BLOCKD_CRASH_SEED", "35"))
REGION_BLOCKS = REGION // BLOCK


@pytest.fixture
def disks(scratch):
    """The two disks as dm-log-writes devices (``/dev/mapper/crash-p``, ``crash-r``), each over a
    loop device with a loop device for its log; yields the log files. One shell for all of it:
    each costs a second under TCG."""
    logs = {dev: f"{scratch}/{dev}.log" for dev in DEVICES}
    steps = ["modprobe loop", "modprobe dm-log-writes"]
    for dev in DEVICES:
        steps.append(f"truncate -s {DEVICE_SIZE} {scratch}/{dev}.img && truncate -s {LOG_SIZE} {logs[dev]} && "
                     f"d=$(losetup -f --show {scratch}/{dev}.img) && l=$(losetup -f --show {logs[dev]}) && "
                     f"dmsetup create --noudevsync {dev} --table \"0 {DEVICE_SIZE // 512} log-writes $d $l\"")
    try:
        sh("export DM_DISABLE_UDEV=1; " + "; ".join(steps))
        yield logs
    finally:
        # the VM is thrown away after the group: every loop device is this fixture's
        sh(f"export DM_DISABLE_UDEV=1; for d in {' '.join(DEVICES)}; do dmsetup remove --noudevsync $d || true; done; "
           "losetup -D", check=False)


def _replica_target() -> Daemon:
    cfg = RESULTS / "crash-replica.toml"
    cfg.write_text(f"""\
[[port]]
transport = "tcp"
address = "127.0.0.1"
port = {PORT}

[[subsystem]]
nqn = "{NQN}"
allow_any_host = true

[[subsystem.namespace]]
nsid = 1
path = "/dev/mapper/{DEVICES[1]}"
block_size = {BLOCK}
""")
    d = Daemon("crash-replica-target", [tool("blockd"), "target", "--config", str(cfg)])
    try:
        wait_tcp("127.0.0.1", PORT, timeout=120, proc=d.proc, what="blockd target")
    except AssertionError:
        d.stop()
        raise
    return d


async def _until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"no {what} after {timeout}s"
        await asyncio.sleep(0.05)


class Writer:
    """The host: QD1 writes of :func:`payload` blocks, a tick after each acknowledgement."""

    def __init__(self, rb: ReplicatedBackend, ticker: Ticker, rng: random.Random) -> None:
        self.rb, self.ticker, self.rng = rb, ticker, rng
        self.seq = 0
        self.writes: list[tuple[int, int, bool]] = []

    async def write(self, region: int, fua: bool) -> None:
        self.seq += 1
        offset = (region * REGION_BLOCKS + self.rng.randrange(REGION_BLOCKS)) * BLOCK
        self.writes.append((self.seq, offset, fua))
        await self.rb.write(offset, payload(self.seq, offset), fua)
        self.ticker.tick("ack", seq=self.seq, fua=fua)

    async def flush(self) -> None:
        upto = self.seq  # every write acknowledged before the Flush is issued
        await self.rb.flush()
        self.ticker.tick("flushed", upto=upto)


async def _record(ticker: Ticker, rng: random.Random) -> Writer:
    inner = FileBackend(f"/dev/mapper/{DEVICES[0]}")

    async def opener() -> TickedReplica:
        return TickedReplica(await open_remote("tcp", "127.0.0.1", PORT, NQN, 1, None, 10.0), ticker.tick)

    rb = await ReplicatedBackend.open(inner, [("replica", opener)], REGION, 1, 1 << 30, MAX_PEERS, "crash", BLOCK)
    rb.start()
    w = Writer(rb, ticker, rng)
    try:
        link = rb.links[0]
        await _until(lambda: link.state == IN_SYNC, 120, "first full sync")
        ticker.tick("ready")
        # FUA writes: the first to each region (its bit is written before the data), then overwrites
        for region in range(12):
            await w.write(region, fua=True)
        for _ in range(8):
            await w.write(rng.randrange(12), fua=True)
        # writes without FUA, made durable by the host's Flush
        for _ in range(3):
            for _ in range(5):
                await w.write(12 + rng.randrange(12), fua=False)
            await w.flush()
        # writes without FUA left to the sweeper, which clears their bits (after flushing every
        # copy, the rule B5 breaks); then the host's Flush
        for region in range(24, 32):
            await w.write(region, fua=False)
        await _until(lambda: link.bitmap is not None and link.bitmap.dirty_count() == 0, 60,
                     "sweep clearing every bit")
        ticker.tick("swept")
        await w.flush()
        # FUA writes to regions whose bits are clear (the rule B3 breaks: the bit before the data)
        for region in range(32, 44):
            await w.write(region, fua=True)
        # writes left for the clean stop (which flushes every copy)
        for _ in range(4):
            await w.write(44 + rng.randrange(12), fua=False)
        assert link.state == IN_SYNC, link.reason
    finally:
        await rb.stop()
        inner.close()
    return w


def test_power_loss_at_every_flush_fua_and_between(disks, record_property):
    """Record both disks' logs under the four phases (the host twin replays and checks them):
    both logs hold every tick, the replica's log holds FUA writes and flushes."""
    target = _replica_target()
    marker = Marker()
    ticker = Ticker(marker)
    saved = mirror.IDLE_SWEEPS
    # bits of idle regions are cleared after 2 sweeps instead of 10: the sweeper's clear is
    # part of the recording without 10 s of idling under TCG
    mirror.IDLE_SWEEPS = 2
    t0 = time.monotonic()
    try:
        writer = asyncio.run(_record(ticker, random.Random(SEED)))
    finally:
        mirror.IDLE_SWEEPS = saved
        marker.close()
        target.stop()
    record_property("record_s", round(time.monotonic() - t0, 1))
    # the target's removal writes the log's final super block
    sh(f"export DM_DISABLE_UDEV=1; for d in {' '.join(DEVICES)}; do dmsetup remove --noudevsync $d; done")
    counts = {}
    for (key, name), dev in zip(LOG_FILES.items(), DEVICES):
        with open(disks[dev], "rb") as f:
            raw = f.read()
        log = read_log(raw)
        (RESULTS / name).write_bytes(raw[:log.used_bytes])
        marks = [e.mark for e in log.entries if e.mark and e.mark.startswith("t")]
        assert marks == [f"t{n}" for n in range(ticker.count)], f"{dev}: ticks out of order or missing"
        flags = [e.flags for e in log.entries if e.mark is None]
        counts[key] = {"entries": len(flags), "fua": sum(bool(f & 2) for f in flags),
                       "flush": sum(bool(f & 1) for f in flags)}
        record_property(f"{key}_log", json.dumps(counts[key]))
    print(f"ticks {ticker.count}, writes {writer.seq}, logs {counts}")
    assert counts["r"]["fua"] + counts["r"]["flush"] > 0 and counts["p"]["flush"] > 0, counts
    (RESULTS / EVENTS_FILE).write_text(json.dumps({
        "seed": SEED, "device_size": DEVICE_SIZE, "ticks": ticker.count,
        "writes": writer.writes, "events": ticker.events}))
