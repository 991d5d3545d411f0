"""Generation identifiers and the rules that pick a sync direction from them (DRBD's UUIDs).

Each copy of a volume records which data set it holds as a chain of random 64-bit identifiers:

* ``current``: the generation the copy's data belongs to. Every copy that is in sync with the
  primary has the primary's current. 0 (:data:`BLANK`) means the copy holds no generation yet
  (a new replica before its first full sync).
* ``bitmap``: seen from one peer slot of this copy, the generation the peer had when this copy
  started recording in that slot's bitmap the writes the peer lacks; 0 when the peer has
  ``current``. A sync of the bitmap's regions brings a peer at ``bitmap`` up to ``current``.
* ``history``: earlier currents, newest first.

A new generation starts when the primary loses a replica and when a copy is promoted (or forced)
to primary: the old current goes to the front of the history and into the bitmap of every peer
slot that had none, and a fresh random current is drawn. A copy that took writes therefore
always has a current no other copy has, and two copies that both did so after parting share
only older identifiers: that is how split brain is told from a copy that merely fell behind.

:func:`decide` runs on the node that acts as primary when a peer copy connects; its rules are
those of DRBD's ``drbd_uuid_compare`` (the kernel's drivers/block/drbd/drbd_receiver.c) for
the primary side, without DRBD's roles-at-crash-time arbitration: here the node deciding is the
primary by configuration, and a crashed primary's write-intent bits are passed in as
``local_dirty``. The rules as a table: docs/replication.md, "Generations and split brain".
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from enum import Enum

from protocol.replication import HISTORY_LENGTH

BLANK = 0
"""The current of a copy that holds no generation's data (and "none" in the other fields)."""


def new_id() -> int:
    """A random nonzero 64-bit identifier (generations and node ids)."""
    while True:
        value = secrets.randbits(64)
        if value != BLANK:
            return value


@dataclass(frozen=True)
class GenerationIds:
    """One copy's identifiers, seen from one of its peer slots (``bitmap`` is that slot's)."""

    current: int
    bitmap: int = BLANK
    history: tuple[int, ...] = field(default=())

    def ancestors(self) -> frozenset[int]:
        """Older generations this copy descends from (history and bitmap), without BLANK."""
        return frozenset(self.history + (self.bitmap,)) - {BLANK}


def new_generation(ids: GenerationIds, current: int | None = None) -> GenerationIds:
    """The identifiers after a new generation starts: ``current`` (default: a fresh random
    one) replaces the current, which moves to the front of the history and, when the bitmap has
    no generation yet, becomes the bitmap's (from now on the bitmap records what a peer at the
    old current lacks). An existing bitmap generation stays: its bitmap already covers more."""
    old = ids.current
    history = ((old,) + ids.history)[:HISTORY_LENGTH] if old != BLANK else ids.history
    return GenerationIds(current=new_id() if current is None else current,
                         bitmap=ids.bitmap or old, history=history)


def synced(source: GenerationIds) -> GenerationIds:
    """The identifiers a sync target takes once a sync from ``source`` has completed: it now
    holds the source's generation, with the source's history, and no bitmap of its own."""
    return GenerationIds(current=source.current, bitmap=BLANK, history=source.history)


class SyncPlan(Enum):
    """What to do with a peer copy that connects to this primary; the value says it in words."""

    IN_SYNC = "in sync: same generation, nothing to copy"
    BITMAP = "behind: copy the regions in this node's bitmap for the peer (and the peer's own)"
    FULL = "behind by more than a bitmap covers, or blank: copy the whole data area"
    PEER_AHEAD = "the peer has writes this node lacks: this node must not stay primary"
    SPLIT_BRAIN = "both copies took writes since they parted: refused until one side is discarded"
    UNRELATED = "the copies share no generation: different data sets, refused"


def decide(local: GenerationIds, peer: GenerationIds, *, local_dirty: bool = False,
           peer_dirty: bool = False) -> SyncPlan:
    """The sync plan when a peer copy connects to this (primary) node.

    ``local`` is this node's identifiers seen from the peer's slot, ``peer`` the peer's seen
    from its slot for this node (``bitmap`` BLANK when it has none). ``local_dirty`` says this
    node's bitmap for the peer has set bits (writes that were in flight when the primary
    crashed, or that the peer missed); ``peer_dirty`` likewise for the peer's bitmap for this
    node (the peer was primary once and crashed with writes in flight to this node).
    """
    if local.current == BLANK:
        return SyncPlan.FULL if peer.current == BLANK else SyncPlan.PEER_AHEAD
    if peer.current == BLANK:
        return SyncPlan.FULL
    if local.current == peer.current:
        return SyncPlan.BITMAP if local_dirty or peer_dirty else SyncPlan.IN_SYNC
    if local.current == peer.bitmap or local.current in peer.history:
        return SyncPlan.PEER_AHEAD
    if local.bitmap == peer.current:
        return SyncPlan.BITMAP
    if peer.current in local.history:
        return SyncPlan.FULL
    if local.ancestors() & peer.ancestors():
        return SyncPlan.SPLIT_BRAIN
    return SyncPlan.UNRELATED


def discard_plan(local: GenerationIds, peer: GenerationIds) -> SyncPlan:
    """How to overwrite a peer whose own writes an operator chose to discard (split brain, or a
    peer that is ahead or unrelated): BITMAP when both sides' bitmaps start at the generation
    where they parted (then the union of this node's bitmap for the peer and the peer's bitmap
    for this node covers every region either side wrote since), FULL otherwise."""
    if local.bitmap != BLANK and local.bitmap == peer.bitmap:
        return SyncPlan.BITMAP
    return SyncPlan.FULL
