"""Partitions, slow replicas and kill -9 during a resync, with real processes (issue 35, items 4
and 6): a primary `blockd target` whose one replica, another `blockd target`, is reached
through a TCP proxy the test controls (:mod:`tests.replication.proxy`), while a host writes.

Every test waits on the primary's replica states and counters (its control socket), and ends
with the copies compared: the data areas' sha256 as files, and (at the full resync rate) the
primary's ``verify``. Run time: about 2 minutes on a shared 2-core machine."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from .nodes import NQN, REGION, Node, all_in_sync, connect, load
from .proxy import BLACKHOLE, RESET, Proxy

TIMEOUT = 2.0
"""The replica's ``timeout`` in :meth:`Node.config`."""
SLACK = 1.5
"""Beyond ``TIMEOUT``: the host library's timeout sweep (0.5 s) and a loaded test machine."""
REGIONS = list(range(3, 13))
"""The regions the hosts write (10 of the volume's 128): what a resync may copy at most."""


def blocks_at(*ks: int) -> list[int]:
    """Block ``k`` (of 16) of each written region, for each ``k``."""
    return [r * (REGION // 4096) + k for r in REGIONS for k in ks]


STEADY = blocks_at(15)
"""What the host that writes throughout writes (during the resyncs too). The host writing while
the replica is away stops before the link heals, on other blocks: a later write to a block
would mend on both copies whatever a resync got wrong there."""


class Writer:
    """A host writing ``blocks`` to ``node`` on a thread of its own (the test blocks on the
    control socket meanwhile): counts what was acknowledged, how long each write took, and
    what failed."""

    def __init__(self, node: Node, blocks: list[int], depth: int = 8) -> None:
        self.acked: list[int] = []
        self.errors: list[BaseException] = []
        self.latencies: list[float] = []
        self._node, self._blocks, self._depth = node, blocks, depth
        self._ready = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(),), name="host")
        self._thread.start()
        assert self._ready.wait(20), "the host never connected"

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        ctrl = await connect(self._node)
        self._ready.set()
        try:
            await load(ctrl, self._blocks, self._stop, self.acked, self.errors, self._depth,
                       latencies=self.latencies)
        finally:
            await ctrl.close()

    def wait_acked(self, more: int, timeout: float = 20.0) -> None:
        """Until ``more`` writes beyond those acknowledged now complete."""
        want = len(self.acked) + more
        deadline = time.monotonic() + timeout
        while len(self.acked) < want:
            assert not self.errors, self.errors
            assert time.monotonic() < deadline, f"host writes stalled: {len(self.acked)} of {want}"
            time.sleep(0.02)

    def stop(self) -> None:
        """End the load (again: nothing more) and raise what failed."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(30)
        assert not self._thread.is_alive()
        assert not self.errors, self.errors


def replica(node: Node) -> dict[str, Any]:
    return node.replicas()[0]


def out_of_sync(reps: list[dict[str, Any]]) -> bool:
    return reps[0]["state"] in ("degraded", "connecting")


def assert_equal(primary: Node, replica_node: Node) -> None:
    """The copies are the same: the primary's verify finds no region that differs, and the
    data areas hash alike."""
    res = primary.ctl("verify", NQN, "1")
    assert res.returncode == 0 and "0 differ" in res.stdout.decode(), (res.stdout, res.stderr)
    assert primary.data_hash() == replica_node.data_hash()


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Node, Node, Proxy]]:
    """A primary and its replica, in sync, the link through a proxy."""
    primary, copy = Node(tmp_path, "primary"), Node(tmp_path, "copy")
    proxy = Proxy(copy.port)
    try:
        copy.start()
        primary.start([proxy])
        primary.wait_states(all_in_sync(settled=True))  # the first full sync's bits cleared
        yield primary, copy, proxy
    finally:
        primary.stop()
        copy.stop()
        proxy.close()


@pytest.mark.parametrize("mode", [RESET, BLACKHOLE])
def test_a_cut_link_under_load_resyncs_only_the_regions_written(pair: tuple[Node, Node, Proxy], mode: str) -> None:
    primary, copy, proxy = pair
    base = replica(primary)["resynced_bytes"]
    steady = Writer(primary, STEADY, depth=4)
    apart = Writer(primary, blocks_at(1, 7), depth=4)
    try:
        apart.wait_acked(100)
        cut = time.monotonic()
        proxy.cut(mode)
        primary.wait_states(out_of_sync, timeout=TIMEOUT + SLACK)  # within its timeout
        noticed = time.monotonic() - cut
        apart.wait_acked(200)  # host writes go on while the replica is away
        apart.stop()
        slowest = max(apart.latencies + steady.latencies)
        assert slowest <= TIMEOUT + SLACK, slowest
        proxy.heal()
        reps = primary.wait_states(all_in_sync(), timeout=30)  # under the steady load
    finally:
        apart.stop()
        steady.stop()
    copied = reps[0]["resynced_bytes"] - base
    assert 0 < copied <= len(REGIONS) * REGION, copied
    assert_equal(primary, copy)
    print(f"{mode}: out of sync after {noticed:.2f}s, slowest write {slowest:.2f}s, resynced {copied} bytes")


def test_a_replica_slower_than_its_timeout_is_left_behind(pair: tuple[Node, Node, Proxy]) -> None:
    """Three times: the replica answers 3.6 s late. The primary gives up after 2 s and writes
    go on; the writes it gave up on still reach the replica, late, unless the replica's
    keep-alive expiry (2 to 4 s of silence) ended their association first. Until then no resync
    may run, or such a write lands after the resync copied its region: without that fence two
    of the first four runs (and one in four of the next) ended with regions that differ."""
    primary, copy, proxy = pair
    for _ in range(3):
        base = replica(primary)["resynced_bytes"]
        steady = Writer(primary, STEADY, depth=4)
        apart = Writer(primary, blocks_at(1, 7), depth=4)
        try:
            apart.wait_acked(100)
            proxy.slow(TIMEOUT + 1.6)
            primary.wait_states(out_of_sync, timeout=TIMEOUT + SLACK)
            apart.wait_acked(200)
            apart.stop()
            slowest = max(apart.latencies + steady.latencies)
            assert slowest <= TIMEOUT + SLACK, slowest
            late = proxy.open_pipes()
            proxy.slow(0.0)  # new connections are quick again; what was sent slowly still arrives late
            reps = primary.wait_states(all_in_sync(), timeout=30)
        finally:
            apart.stop()
            steady.stop()
        proxy.wait_gone(late, timeout=30)  # every write the primary gave up on arrived, or never will
        copied = reps[0]["resynced_bytes"] - base
        assert 0 < copied <= len(REGIONS) * REGION, copied
        assert_equal(primary, copy)
        print(f"slow: slowest write {slowest:.2f}s, resynced {copied} bytes")


def test_twenty_cuts_and_heals_in_a_row(pair: tuple[Node, Node, Proxy]) -> None:
    primary, copy, proxy = pair
    generations = primary.log.read_bytes().count(b"new generation")
    resynced = []
    steady = Writer(primary, STEADY, depth=4)
    try:
        for cycle in range(20):
            before = replica(primary)["resynced_bytes"]
            apart = Writer(primary, blocks_at(cycle % 15), depth=4)  # blocks of its own, mostly
            try:
                apart.wait_acked(10)
                proxy.cut(RESET)
                primary.wait_states(out_of_sync, timeout=TIMEOUT + SLACK)
                apart.wait_acked(20)
            finally:
                apart.stop()
            proxy.heal()
            resynced.append(primary.wait_states(all_in_sync(), timeout=30)[0]["resynced_bytes"] - before)
    finally:
        steady.stop()
    assert all(0 < n <= len(REGIONS) * REGION for n in resynced), resynced
    assert primary.log.read_bytes().count(b"new generation") - generations <= 20  # one per outage
    assert_equal(primary, copy)
    print(f"resynced per cycle: {resynced}")


SMALL = 2 << 20
"""The device of the kill -9 tests: 32 regions (the last short), so a resync at :data:`RATE` lasts seconds."""
RATE = 320 << 10
"""Their resync rate, bytes per second: slow enough to kill a process halfway."""
LAG = RATE * 3 // 2 + REGION
"""What a resync may copy twice after a kill: bits are cleared once a second after a flush of
both copies, so the regions copied in the last 1.5 s (and one under way) may still be set."""


async def write_regions(node: Node, regions: range) -> None:
    ctrl = await connect(node)
    try:
        for r in regions:
            await ctrl.write_bytes(1, r * REGION + 4096, bytes([r]) * 4096)
    finally:
        await ctrl.close()


def resync_past(fraction: float) -> Any:
    """A replica resyncing with ``fraction`` of its resync's bytes copied."""
    return lambda reps: (reps[0]["state"] == "resyncing" and "resync" in reps[0]
                         and reps[0]["resync"]["copied_bytes"] >= fraction * reps[0]["resync"]["total_bytes"])


@pytest.mark.parametrize("victim", ["primary", "copy"])
@pytest.mark.parametrize("first", [False, True], ids=["bitmap_resync", "first_full_sync"])
def test_kill_9_mid_resync_resumes_where_it_stopped(tmp_path: Path, victim: str, first: bool) -> None:
    primary, copy = Node(tmp_path, "primary", SMALL), Node(tmp_path, "copy", SMALL)
    try:
        copy.start()
        if not first:  # the replica misses the 20 regions written while it was away
            primary.start([copy])
            primary.wait_states(all_in_sync(settled=True))
            copy.stop()
            asyncio.run(write_regions(primary, range(5, 25)))
            primary.stop()
            copy.start()
        primary.start([copy], resync_rate=f"{RATE}B")
        rep = primary.wait_states(resync_past(0.6))[0]
        total, done = rep["resync"]["total_bytes"], rep["resync"]["copied_bytes"]
        assert total == (20 if not first else -(-primary.data // REGION)) * REGION, total
        if victim == "primary":
            primary.kill()
            primary.start([copy], resync_rate=f"{RATE}B")
        else:
            copy.kill()
            copy.start()
        rep = primary.wait_states(all_in_sync(), timeout=30)[0]
        if victim == "primary":  # a new process: its count is the resumed resync's alone
            assert 0 < rep["resynced_bytes"] <= total - done + LAG, (rep["resynced_bytes"], total, done)
        else:  # the same primary: both runs of the resync, each region once, the last ones again
            assert total <= rep["resynced_bytes"] <= total + LAG, (rep["resynced_bytes"], total, done)
        assert primary.data_hash() == copy.data_hash()  # (a verify would read at the slow RATE)
        print(f"kill -9 of the {victim}: {done} of {total} bytes copied, then {rep['resynced_bytes']} by the "
              f"{'restarted primary' if victim == 'primary' else 'primary over both runs'}")
    finally:
        primary.stop()
        copy.stop()
