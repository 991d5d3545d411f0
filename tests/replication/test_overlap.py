"""Overlapping writes in flight on a replicated namespace, with real daemons: every copy must end
with the same data whatever order the hosts' writes to the same blocks arrive in.

NVMe leaves the result of two overlapping commands in flight at once undefined, so either
write may win; what replication must add is that every copy keeps the *same* winner. Without
ordering, the replica association spreads writes over its queues (``REPLICA_QUEUES``) and the
replica serves each queue on its own thread, so two writes to one block could land on the
replica in the other order than on the primary: every write acknowledged, the copies different,
nothing said until a verify (issue 35)."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path
from typing import Iterator

import pytest

from initiator.controller import Controller

from .nodes import NQN, Node, all_in_sync, connect

HOSTS = int(os.environ.get("BLOCKD_OVERLAP_HOSTS", "4"))
BLOCKS = 64
"""Each host writes this many consecutive 4 KiB blocks per round, all at once: with four hosts,
256 writes in flight, more than one replica queue holds (its depth is 128)."""
ROUNDS = int(os.environ.get("BLOCKD_OVERLAP_ROUNDS", "40"))


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Node, Node]]:
    primary, replica = Node(tmp_path, "primary"), Node(tmp_path, "replica")
    try:
        replica.start()
        primary.start([replica])
        yield primary, replica
    finally:
        for n in (primary, replica):
            n.stop()


async def _rounds(primary: Node, rounds: int) -> int:
    """``rounds`` rounds of every host writing the same ``BLOCKS`` blocks at once; the number of
    writes acknowledged (every one must be)."""
    hosts: list[Controller] = [await connect(primary) for _ in range(HOSTS)]
    acked = 0
    try:
        for rnd in range(rounds):
            base = (rnd % 8) * BLOCKS * 4096  # a few ranges, so the writes also cross regions

            async def one(host: int, block: int) -> None:
                nonlocal acked
                data = hashlib.sha256(f"{rnd}/{host}/{block}".encode()).digest() * 128
                await hosts[host].write_bytes(1, base + block * 4096, data, fua=block % 2 == 0)
                acked += 1
            await asyncio.gather(*(one(h, b) for b in range(BLOCKS) for h in range(HOSTS)))
    finally:
        for h in hosts:
            await h.close()
    return acked


def test_overlapping_writes_of_several_hosts_leave_every_copy_equal(pair: tuple[Node, Node]) -> None:
    primary, replica = pair
    primary.wait_states(all_in_sync())
    assert asyncio.run(_rounds(primary, ROUNDS)) == ROUNDS * HOSTS * BLOCKS
    reps = primary.replicas()
    assert [r["state"] for r in reps] == ["in_sync"], reps  # no write left the replica behind
    assert primary.data_hash() == replica.data_hash()
    res = primary.ctl("verify", NQN, "1")
    assert res.returncode == 0 and b" 0 differ" in res.stdout, (res.stdout, res.stderr)
