"""Ending a split brain (or a refusal): an operator discards one side's writes.

* :func:`discard_replica`: the replica's writes go; it is overwritten from this copy at its
  next connection (a bitmap resync when both sides' bitmaps cover what they wrote since they
  parted, else a full one).
* :func:`discard_local`: this copy's writes go; with one replica, the replica's data area is
  copied over this copy at once, host I/O refused meanwhile.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import structlog

from protocol.status import Status
from target.replication.link import CONNECTING, DEGRADED, REFUSED, SPLIT_BRAIN, ReplicaLink
from target.replication.metadata import Metadata
from target.replication.mirror import ReplicatedBackend, ReplicationError

log = structlog.get_logger("blockd.target.replication")


def discard_replica(mirror: ReplicatedBackend, which: str | int) -> ReplicaLink:
    """Resolve a split brain (or a refusal) for one replica by discarding its data: it gets a
    full sync from this copy at the next connection."""
    link = mirror.link(which)
    if link.state not in (SPLIT_BRAIN, REFUSED, CONNECTING, DEGRADED):
        raise ValueError(f"replica {link.name} is {link.state}: nothing to resolve")
    link.discard_next = True
    log.warning("replica's data discarded by the operator; it is overwritten from this copy",
                namespace=mirror.name, replica=link.name, was=link.state)
    link.state, link.reason = CONNECTING, "its data discarded: resync from this copy next"
    return link


async def discard_local(mirror: ReplicatedBackend, which: str | int) -> ReplicaLink:
    """Resolve a split brain (or a refusal) by discarding THIS copy's writes: the replica's
    data area is copied over this one, then this copy takes the replica's generation and the
    replica is in sync. Only with a single replica (another would hold neither side's data
    then). Host I/O gets Namespace Not Ready until the copy ends; a crash meanwhile leaves
    this copy flagged inconsistent (never promoted as it is)."""
    link = mirror.link(which)
    if len(mirror.links) != 1:
        raise ValueError("--discard local needs a namespace with one replica: with more, run the "
                         "copy to keep as the primary and discard this one there")
    if link.state not in (SPLIT_BRAIN, REFUSED):
        raise ValueError(f"replica {link.name} is {link.state}: nothing to resolve")
    refusing = _refuse_io(mirror.name)
    for name in _HOST_IO:
        setattr(mirror, name, refusing)  # instance attributes shadow the methods: no per-I/O test
    try:
        # the state stays split_brain/refused meanwhile: the link's own loop leaves it alone
        link.reason = "discarding this copy: copying the replica over it"
        link.io = io = await link.opener()
        peer = await Metadata.open(io)
        if peer.region_size != mirror.region_size or peer.data_size != mirror.data_size:
            raise ValueError("the replica's metadata has another geometry: nothing copied")
        log.warning("this copy's writes discarded by the operator; copying the replica over it",
                    namespace=mirror.name, replica=link.name)
        await mirror.md.begin_sync()
        for region in range(-(-mirror.data_size // mirror.region_size)):
            offset = region * mirror.region_size
            data = await io.read(offset, min(mirror.region_size, mirror.data_size - offset))
            await mirror.inner.write(offset, data)
        await mirror.inner.flush()
        await mirror.take_slot(link, peer.node_id)
        assert link.slot is not None and link.bitmap is not None
        link.peer_md = peer
        await mirror.md.adopt(peer.ids(peer.slot_of(mirror.md.node_id)))
        await mirror.md.peer_in_sync(link.slot)
        for region in list(link.bitmap.dirty_regions()):
            link.bitmap.clear(region)
        await link.bitmap.sync_clears()
        link.missing.clear()
        mirror.resync_done(link)
        log.info("this copy now holds the replica's data", namespace=mirror.name, replica=link.name)
    except BaseException as exc:
        link.state, link.reason = REFUSED, f"discarding this copy failed: {exc}"
        link.hang_up()
        raise
    finally:
        for name in _HOST_IO:
            delattr(mirror, name)
        mirror.read_into = mirror.inner.read_into  # type: ignore[method-assign]
    return link


_HOST_IO = ("read_into", "write", "flush", "write_zeroes", "discard")


def _refuse_io(name: str) -> Callable[..., Awaitable[None]]:
    async def refuse(*args: Any, **kwargs: Any) -> None:
        raise ReplicationError(Status.NS_NOT_READY, f"{name}: this copy is being overwritten from its replica")
    return refuse
