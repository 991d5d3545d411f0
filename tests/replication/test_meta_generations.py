"""Generation identifiers: every outcome of ``decide`` as a table, including DRBD's cases (a
primary that crashed with bits set, a replica that missed writes, split brain, unrelated data),
then the same cases reached by driving real metadata through the events that make them."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from protocol.replication import HISTORY_LENGTH
from target.replication.generations import (
    BLANK, GenerationIds, SyncPlan, decide, discard_plan, new_generation, new_id, synced)
from target.replication.metadata import Metadata
from tests.replication.fake_blockio import MemoryBlockIO

G = GenerationIds
A, B, C, D, E, F = 0xA, 0xB, 0xC, 0xD, 0xE, 0xF

DECIDE_TABLE = [
    # name, local, peer, local_dirty, peer_dirty, plan
    ("same generation, clean", G(A), G(A), False, False, SyncPlan.IN_SYNC),
    ("same generation, history differs only in depth", G(A, 0, (B,)), G(A, 0, (B, C)), False, False,
     SyncPlan.IN_SYNC),
    ("primary crashed with bits set", G(A), G(A), True, False, SyncPlan.BITMAP),
    ("peer was a primary that crashed with bits for us", G(A), G(A), False, True, SyncPlan.BITMAP),
    ("replica missed writes: our bitmap starts at its generation", G(B, A, (A,)), G(A), False, False,
     SyncPlan.BITMAP),
    ("replica missed writes, several generations ago", G(C, A, (B, A)), G(A), False, False, SyncPlan.BITMAP),
    ("replica older than any bitmap", G(C, 0, (B, A)), G(A), False, False, SyncPlan.FULL),
    ("replica older, our bitmap for it started later", G(C, B, (B, A)), G(A), False, False, SyncPlan.FULL),
    ("new replica: blank", G(A, 0, (B,)), G(BLANK), False, False, SyncPlan.FULL),
    ("both blank", G(BLANK), G(BLANK), False, False, SyncPlan.FULL),
    ("we are blank, the peer has data", G(BLANK), G(A), False, False, SyncPlan.PEER_AHEAD),
    ("peer moved on from our generation (its bitmap for us)", G(A), G(B, A, (A,)), False, False,
     SyncPlan.PEER_AHEAD),
    ("peer moved on, no slot for us", G(A), G(C, 0, (B, A)), True, False, SyncPlan.PEER_AHEAD),
    ("split brain: both moved on from A, both track it", G(B, A, (A,)), G(C, A, (A,)), False, False,
     SyncPlan.SPLIT_BRAIN),
    ("split brain: the peer has no slot for us", G(B, A, (A,)), G(C, 0, (A,)), False, False,
     SyncPlan.SPLIT_BRAIN),
    ("split brain: common ancestor deeper in history", G(D, 0, (B, A)), G(E, 0, (C, A)), False, False,
     SyncPlan.SPLIT_BRAIN),
    ("split brain: our bitmap and its history", G(D, A, (B,)), G(E, 0, (C, A)), False, False,
     SyncPlan.SPLIT_BRAIN),
    ("unrelated: nothing shared", G(A, 0, (B,)), G(C, 0, (D,)), False, False, SyncPlan.UNRELATED),
    ("unrelated even when dirty", G(A), G(F), True, True, SyncPlan.UNRELATED),
]


@pytest.mark.parametrize("name, local, peer, local_dirty, peer_dirty, plan", DECIDE_TABLE,
                         ids=[row[0] for row in DECIDE_TABLE])
def test_decide(name: str, local: GenerationIds, peer: GenerationIds, local_dirty: bool,
                peer_dirty: bool, plan: SyncPlan) -> None:
    assert decide(local, peer, local_dirty=local_dirty, peer_dirty=peer_dirty) is plan


def test_the_table_covers_every_plan() -> None:
    assert {row[-1] for row in DECIDE_TABLE} == set(SyncPlan)


def test_decide_is_symmetric_where_it_must_be() -> None:
    """A peer that is behind sees this node as ahead, and the reverse; split brain and
    unrelated look the same from both sides."""
    mirror = {SyncPlan.BITMAP: SyncPlan.PEER_AHEAD, SyncPlan.SPLIT_BRAIN: SyncPlan.SPLIT_BRAIN,
              SyncPlan.UNRELATED: SyncPlan.UNRELATED}
    checked = 0
    for name, local, peer, _, _, plan in DECIDE_TABLE:
        if plan in mirror and local.current != peer.current:
            assert decide(peer, local) is mirror[plan], name
            checked += 1
    assert checked >= 8


@pytest.mark.parametrize("local, peer, plan", [
    (G(B, A, (A,)), G(C, A, (A,)), SyncPlan.BITMAP),   # both bitmaps start where they parted
    (G(B, A, (A,)), G(C, 0, (A,)), SyncPlan.FULL),     # the peer tracked nothing for us
    (G(D, 0, (B, A)), G(E, 0, (C, A)), SyncPlan.FULL),
    (G(A), G(F), SyncPlan.FULL),
])
def test_discard_plan(local: GenerationIds, peer: GenerationIds, plan: SyncPlan) -> None:
    assert discard_plan(local, peer) is plan


def test_new_generation() -> None:
    ids = new_generation(G(A), current=B)
    assert ids == G(B, A, (A,))
    assert new_generation(ids, current=C) == G(C, A, (B, A))  # the older bitmap covers more
    long = G(A, 0, tuple(range(1, HISTORY_LENGTH + 1)))
    assert new_generation(long, current=B).history == (A,) + tuple(range(1, HISTORY_LENGTH))
    assert new_generation(G(BLANK), current=B) == G(B, BLANK, ())
    fresh = new_generation(G(A))
    assert fresh.current not in (BLANK, A)
    assert synced(G(C, A, (B, A))) == G(C, BLANK, (B, A))
    assert len({new_id() for _ in range(1000)}) == 1000 and BLANK not in {new_id() for _ in range(1000)}


# --------------------------------------------------------------------------------------------
# the same cases reached through Metadata, as the mirror drives it

SIZE = 16 << 20


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


class Pair:
    """A primary and a replica, each with a slot for the other, in sync."""

    @classmethod
    async def make(cls) -> Pair:
        self = cls()
        self.p = await Metadata.format(MemoryBlockIO(SIZE))
        self.r = await Metadata.format(MemoryBlockIO(SIZE), blank=True)
        self.ps = await self.p.assign_slot(self.r.node_id)
        self.rs = await self.r.assign_slot(self.p.node_id)
        return self

    def plan(self, primary: Metadata, replica: Metadata) -> SyncPlan:
        mine, theirs = primary.slot_of(replica.node_id), replica.slot_of(primary.node_id)
        return decide(primary.ids(mine), replica.ids(theirs),
                      local_dirty=mine is not None and primary.bitmap(mine).dirty_count() > 0,
                      peer_dirty=theirs is not None and replica.bitmap(theirs).dirty_count() > 0)

    async def sync(self, source: Metadata, target: Metadata) -> None:
        """What a completed resync leaves behind."""
        slot = source.slot_of(target.node_id)
        assert slot is not None
        for region in list(source.bitmap(slot).dirty_regions()):
            source.bitmap(slot).clear(region)
        await source.bitmap(slot).sync_clears()
        await target.adopt(source.ids(slot))
        await source.peer_in_sync(slot)


def test_flows_through_metadata() -> None:
    async def go() -> None:
        pair = await Pair.make()
        p, r = pair.p, pair.r
        assert pair.plan(p, r) is SyncPlan.FULL                 # a new, blank replica
        await pair.sync(p, r)
        assert pair.plan(p, r) is SyncPlan.IN_SYNC

        await p.bitmap(pair.ps).mark(0, 1)                       # primary crashes, write in flight
        p2 = await Metadata.open(p.io)
        assert pair.plan(p2, r) is SyncPlan.BITMAP
        await pair.sync(p2, r)
        p = pair.p = p2

        await p.new_generation()                                 # the replica is lost
        await p.bitmap(pair.ps).mark(1 << 20, 4096)              # and misses a write
        assert pair.plan(p, r) is SyncPlan.BITMAP
        assert pair.plan(r, p) is SyncPlan.PEER_AHEAD            # it must not take over
        await pair.sync(p, r)
        assert pair.plan(p, r) is SyncPlan.IN_SYNC and r.current == p.current

        await p.new_generation()                                 # parted again...
        await r.new_generation()                                 # ...and the replica promoted
        assert pair.plan(p, r) is SyncPlan.SPLIT_BRAIN
        assert pair.plan(r, p) is SyncPlan.SPLIT_BRAIN
        assert discard_plan(p.ids(pair.ps), r.ids(pair.rs)) is SyncPlan.BITMAP

        other = await Metadata.format(MemoryBlockIO(SIZE))       # a different volume
        await p.assign_slot(other.node_id)
        assert pair.plan(p, other) is SyncPlan.UNRELATED
    run(go())


def test_an_in_sync_replica_follows_a_new_generation_and_a_crash_between_is_safe() -> None:
    async def go() -> None:
        pair = await Pair.make()
        await pair.sync(pair.p, pair.r)
        await pair.p.new_generation()         # another replica was lost; this one stays in sync
        # crash here, before the replica adopted the new generation: a bitmap sync, not FULL
        assert pair.plan(pair.p, pair.r) is SyncPlan.BITMAP
        await pair.r.adopt(pair.p.ids(pair.ps))
        await pair.p.peer_in_sync(pair.ps)
        assert pair.plan(pair.p, pair.r) is SyncPlan.IN_SYNC
    run(go())
