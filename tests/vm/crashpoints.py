"""Power loss of a replicated pair, replayed from the dm-log-writes logs of both disks
(issue 35, deliverable 3; the group is tests/vm/test_crash_replay.py).

**Recording** (in the VM, tests/vm/guest_tests/test_crash_replay.py). The primary's disk and
the replica's disk are each a dm-log-writes device over a loop device. The replica is a
``blockd target`` process exporting its disk over NVMe/TCP; the primary is a
``ReplicatedBackend`` in the test process, over a ``FileBackend`` on its disk, reaching the
replica through the host library as the target daemon does. A writer issues 4 KiB writes, each
carrying its sequence number (:func:`payload`), some with FUA, with Flushes between.

**Pairing the two logs.** A crash point of one disk is a prefix of its log (see
tests/vm/logwrites.py for why a prefix is what a power loss leaves). A crash of the *pair* is
a prefix of each log, and not every combination is one the machines could reach: the
replica writes a region only after the primary's bit for it is on disk, and the primary
clears a bit only after the replica's flush completed. So every message between the machines
is bracketed by a *tick*: a numbered mark ``t<N>`` put into both logs at once (two ioctls back
to back), before a command goes to the replica and after its completion comes back, before the
primary acts on it (:class:`TickedReplica`); the writer ticks after each acknowledgement too.
Between two ticks neither machine can learn anything from the other, so any prefix of the
primary's log and any prefix of the replica's log that both end between the same two ticks
form a state both machines could be in when the power fails: a power loss of both, or of one
with the other's state at that moment. The pairs checked per tick interval: each end of either
side with each chosen point of the other (both ends, every FLUSH/FUA point, one random point),
plus one random pair.

**At each crash point** (:func:`check`):

* the metadata of each copy opens (``Metadata.open``: the superblock fallback);
* every write the writer saw acknowledged with FUA, or acknowledged before a Flush that
  completed, before that point, is on that copy (its block holds that write or a later one);
* the pair, restarted (``ReplicatedBackend`` over the replayed primary, its replica in RAM),
  resyncs from the bitmaps, and verify then reports 0 regions differing.
"""

from __future__ import annotations

import asyncio
import json
import random
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import structlog.testing

from tests.vm.logwrites import Entry, Log, Marker, apply, read_log

BLOCK = 4096
REGION = 32 << 10
MAX_PEERS = 2
DEVICE_SIZE = 2 << 20
DEVICES = ("crash-p", "crash-r")
"""The dm-log-writes devices: the primary's disk, the replica's disk."""
LOG_FILES = {"p": "crash-p.log", "r": "crash-r.log"}
EVENTS_FILE = "crash-events.json"


def payload(seq: int, offset: int) -> bytes:
    """Write ``seq``'s 4 KiB: its number and offset, repeated (any block tells which write it is)."""
    head = struct.pack("<8sQQ", b"crashrep", seq, offset)
    return (head * (BLOCK // len(head) + 1))[:BLOCK]


# ------------------------------------------------------------------------------ recording ---
class Ticker:
    """Numbered marks put into both logs at once; ``events`` names those that matter to the check."""

    def __init__(self, marker: Marker, devices: tuple[str, ...] = DEVICES) -> None:
        self.marker = marker
        self.devices = devices
        self.count = 0
        self.events: list[dict[str, Any]] = []

    def tick(self, kind: str | None = None, **info: Any) -> int:
        n = self.count
        self.count += 1
        for dev in self.devices:
            self.marker.mark(dev, f"t{n}")
        if kind:
            self.events.append({"tick": n, "kind": kind, **info})
        return n


class TickedReplica:
    """A replica's I/O (``initiator.replica.RemoteNamespace``) with a tick before each command
    goes out and after each completes, before the mirror sees the completion: the cut points
    of the two logs (module docstring)."""

    def __init__(self, inner: Any, tick: Callable[[], int]) -> None:
        self.inner = inner
        self.tick = tick
        self.name = inner.name
        self.size = inner.size
        self.stale_for = inner.stale_for

    @property
    def block_size(self) -> int:
        return self.inner.block_size

    @property
    def gave_up(self) -> bool:
        return self.inner.gave_up

    def submit_write(self, offset: int, data: Any, fua: bool, done: Callable[[BaseException | None], None]) -> None:
        def completed(exc: BaseException | None) -> None:
            self.tick()
            done(exc)
        self.tick()
        self.inner.submit_write(offset, data, fua, completed)

    async def _call(self, op: Callable[..., Any], *args: Any) -> Any:
        self.tick()
        try:
            return await op(*args)
        finally:
            self.tick()

    async def read(self, offset: int, length: int) -> bytes:
        return await self._call(self.inner.read, offset, length)

    async def read_into(self, offset: int, buf: memoryview) -> None:
        await self._call(self.inner.read_into, offset, buf)

    async def write(self, offset: int, data: Any, fua: bool = False) -> None:
        await self._call(self.inner.write, offset, data, fua)

    async def flush(self) -> None:
        await self._call(self.inner.flush)

    async def write_zeroes(self, offset: int, length: int) -> None:
        await self._call(self.inner.write_zeroes, offset, length)

    async def close(self) -> None:
        await self.inner.close()


# --------------------------------------------------------------------------------- replay ---
@dataclass
class Side:
    """One disk's log: its writes and flushes in log order, and where each tick falls."""

    name: str
    sectorsize: int
    entries: list[Entry]
    """The log without its marks: state ``k`` is the first ``k`` of them replayed."""
    at_tick: dict[int, int]
    """Tick number -> the state it marks (entries logged before it)."""

    @classmethod
    def of(cls, name: str, log: Log) -> Side:
        entries: list[Entry] = []
        at: dict[int, int] = {}
        for e in log.entries:
            mark = e.mark
            if mark is None:
                entries.append(e)
            elif mark[:1] == "t" and mark[1:].isdigit():
                at[int(mark[1:])] = len(entries)
        return cls(name, log.sectorsize, entries, at)

    def durable_points(self, lo: int, hi: int) -> list[int]:
        """The states just after each FLUSH or FUA entry in ``lo..hi``."""
        return [k + 1 for k in range(lo, hi) if self.entries[k].durable_point]


@dataclass
class Recording:
    p: Side
    r: Side
    writes: dict[int, tuple[int, bool]]
    """seq -> (offset, fua)."""
    events: list[dict[str, Any]]
    ticks: int
    device_size: int

    @classmethod
    def load(cls, results: Path) -> Recording:
        meta = json.loads((results / EVENTS_FILE).read_text())
        sides = {k: Side.of(k, read_log((results / f).read_bytes())) for k, f in LOG_FILES.items()}
        return cls(sides["p"], sides["r"], {s: (o, f) for s, o, f in meta["writes"]}, meta["events"],
                   meta["ticks"], meta["device_size"])

    def durable_acks(self) -> list[tuple[int, int]]:
        """(tick, seq): the tick after which write ``seq`` must be on every copy."""
        out = []
        for ev in self.events:
            if ev["kind"] == "ack" and ev["fua"]:
                out.append((ev["tick"], ev["seq"]))
            elif ev["kind"] == "flushed":
                out += [(ev["tick"], s) for s in range(1, ev["upto"] + 1)]
        return out


@dataclass
class Report:
    p_states: int = 0
    r_states: int = 0
    pairs: int = 0
    pairs_differing_before_resync: int = 0
    durable_points: int = 0
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        return (f"crash points: {self.p_states} states of the primary's disk and {self.r_states} of the "
                f"replica's checked (metadata, acknowledged writes; {self.durable_points} of them right "
                f"after a FLUSH/FUA entry), {self.pairs} pairs restarted, resynced and verified "
                f"({self.pairs_differing_before_resync} with copies differing before the resync); "
                f"{len(self.failures)} failures; {self.seconds:.1f}s")


class _Images:
    """One side's image at the start of the current tick interval, and states within it."""

    def __init__(self, side: Side, size: int) -> None:
        self.side = side
        self.base = bytearray(size)
        self.state = 0

    def advance(self, state: int) -> None:
        for e in self.side.entries[self.state:state]:
            apply(self.base, e, self.side.sectorsize)
        self.state = state

    def at(self, state: int) -> bytearray:
        img = bytearray(self.base)
        for e in self.side.entries[self.state:state]:
            apply(img, e, self.side.sectorsize)
        return img


def check(rec: Recording, seed: int, max_failures: int = 12) -> Report:
    """Every crash point of the recording, checked as the module docstring says (the
    restarted pairs' log lines, four or so per pair, are kept out of the test's output)."""
    with structlog.testing.capture_logs():
        return _check(rec, seed, max_failures)


def _check(rec: Recording, seed: int, max_failures: int) -> Report:
    t0 = time.monotonic()
    report = Report()
    rng = random.Random(seed)
    ready = next(ev["tick"] for ev in rec.events if ev["kind"] == "ready")
    for side in (rec.p, rec.r):
        missing = [t for t in range(rec.ticks) if t not in side.at_tick]
        assert not missing, f"ticks missing from the {side.name} log: {missing[:10]}"
    durable = sorted(rec.durable_acks())
    by_offset: dict[int, list[int]] = {}
    for seq, (offset, _) in rec.writes.items():
        by_offset.setdefault(offset, []).append(seq)
    imgs = {"p": _Images(rec.p, rec.device_size), "r": _Images(rec.r, rec.device_size)}
    seen: dict[str, set[int]] = {"p": set(), "r": set()}
    pairs_done: set[tuple[int, int]] = set()

    def fail(msg: str) -> None:
        report.failures.append(msg)

    def side_ok(name: str, side: Side, state: int, img: bytearray, where: str) -> None:
        if state in seen[name]:
            return
        seen[name].add(state)
        if state and side.entries[state - 1].durable_point:
            report.durable_points += 1
        try:
            asyncio.run(_open_metadata(img))
        except Exception as exc:  # what Metadata.open raises is the finding
            fail(f"{where}: the {name} copy's metadata does not open: {exc}")
        for tick, seq in durable:
            if side.at_tick[tick] > state:
                break
            offset = rec.writes[seq][0]
            block = bytes(img[offset:offset + BLOCK])
            if not any(block == payload(s, offset) for s in by_offset[offset] if s >= seq):
                fail(f"{where}: write {seq} (at {offset}, acknowledged durable at tick {tick}) "
                     f"is not on the {name} copy")
                break

    ticks = list(range(ready, rec.ticks)) + [None]
    for i, tick in enumerate(ticks[:-1]):
        nxt = ticks[i + 1]
        lo_p, lo_r = rec.p.at_tick[tick], rec.r.at_tick[tick]
        hi_p = rec.p.at_tick[nxt] if nxt is not None else len(rec.p.entries)
        hi_r = rec.r.at_tick[nxt] if nxt is not None else len(rec.r.entries)
        imgs["p"].advance(lo_p)
        imgs["r"].advance(lo_r)
        ps = _choices(rec.p, lo_p, hi_p, rng)
        rs = _choices(rec.r, lo_r, hi_r, rng)
        pairs = {(p, r) for p in (lo_p, hi_p) for r in rs} | {(p, r) for p in ps for r in (lo_r, hi_r)}
        pairs.add((rng.randint(lo_p, hi_p), rng.randint(lo_r, hi_r)))
        for sp, sr in sorted(pairs - pairs_done):
            pairs_done.add((sp, sr))
            where = f"tick {tick}, primary state {sp}, replica state {sr}"
            p_img, r_img = imgs["p"].at(sp), imgs["r"].at(sr)
            side_ok("p", rec.p, sp, p_img, where)
            side_ok("r", rec.r, sr, r_img, where)
            report.pairs += 1
            try:
                differed, mismatched = asyncio.run(_restart(p_img, r_img))
            except Exception as exc:
                fail(f"{where}: the restarted pair did not resync: {type(exc).__name__}: {exc}")
            else:
                report.pairs_differing_before_resync += differed
                if mismatched:
                    fail(f"{where}: after the restart and the resync from the bitmaps, verify finds "
                         f"regions {mismatched} differing")
            if len(report.failures) >= max_failures:
                break
        if len(report.failures) >= max_failures:
            break
    report.p_states, report.r_states = len(seen["p"]), len(seen["r"])
    report.seconds = time.monotonic() - t0
    return report


def _choices(side: Side, lo: int, hi: int, rng: random.Random) -> set[int]:
    """One side's crash states in a tick interval: both ends, each FLUSH/FUA point, a random one."""
    return {lo, hi, rng.randint(lo, hi), *side.durable_points(lo, hi)}


async def _open_metadata(img: bytearray) -> None:
    from target.backend import MemoryBackend
    from target.replication.blockio import BackendBlockIO
    from target.replication.metadata import Metadata
    mem = MemoryBackend(len(img))
    mem.data[:] = img
    await Metadata.open(BackendBlockIO(mem))


async def _restart(p_img: bytearray, r_img: bytearray, timeout: float = 30.0) -> tuple[bool, list[int]]:
    """Restart the primary over ``p_img`` with its replica over ``r_img`` (in RAM), wait for the
    resync from the bitmaps, verify: (whether the data areas differed before, the regions
    verify finds differing)."""
    from target.backend import MemoryBackend
    from target.replication.link import DEGRADED, IN_SYNC, REFUSED, SPLIT_BRAIN
    from target.replication.mirror import ReplicatedBackend
    from target.replication.verify import verify
    from tests.replication.test_mirror import FakeReplica
    local, store = MemoryBackend(len(p_img)), MemoryBackend(len(r_img))
    local.data[:] = p_img
    store.data[:] = r_img

    async def opener() -> FakeReplica:
        return FakeReplica(store, "replica")

    rb = await ReplicatedBackend.open(local, [("replica", opener)], REGION, 1, 1 << 40, MAX_PEERS, "replay", BLOCK)
    differed = local.data[:rb.data_size] != store.data[:rb.data_size]
    rb.start()
    try:
        link = rb.links[0]
        deadline = time.monotonic() + timeout
        while link.state != IN_SYNC:
            if link.state in (SPLIT_BRAIN, REFUSED, DEGRADED):
                raise RuntimeError(f"the replica went {link.state}: {link.reason}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the replica is still {link.state} after {timeout}s")
            await asyncio.sleep(0.001)
        result = await verify(rb, link)
    finally:
        await rb.stop()
    return differed, [m["region"] for m in result["mismatched"]]
