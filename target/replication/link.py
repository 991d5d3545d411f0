"""One replica of a replicated namespace, as the primary sees it: its connection, its state and
what it misses.

States (``blockctl target replicas`` shows them):

* ``connecting``: no connection yet, or reconnecting after a failure;
* ``resyncing``: connected, the generations agree on the direction, the regions it misses are
  being copied (writes to regions already copied go to it as to an in-sync copy);
* ``in_sync``: every write goes to it, and the host's write completes only once it has it;
* ``degraded``: it failed (an error, or no answer within ``timeout``); writes go on without it
  and the regions they touch are remembered for the resync;
* ``split_brain``: both sides took writes while apart; nothing is copied until an operator
  discards one side (``blockctl target resolve``);
* ``refused``: the replica holds writes this copy lacks, or another data set altogether; this
  copy must not overwrite it (the reason says which).

A link never talks to the replica on the per-write path itself: the mirror
(:mod:`target.replication.mirror`) sends the writes, the link keeps the state they are decided on.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, Protocol

from target.replication.bitmap import WriteIntentBitmap
from target.replication.blockio import BlockIO
from target.replication.metadata import Metadata

CONNECTING = "connecting"
RESYNCING = "resyncing"
IN_SYNC = "in_sync"
DEGRADED = "degraded"
SPLIT_BRAIN = "split_brain"
REFUSED = "refused"

RECONNECT_DELAY = 1.0
"""Seconds between attempts to reach a replica that is away."""
LOCAL_RETRY_MAX = 60.0
"""Longest wait before a resync that this copy's own device failed (EIO on a read) is tried
again: the wait doubles from :data:`RECONNECT_DELAY` after each such failure, so a bad sector
costs a few reads an hour, not one a second, while a transient error still heals soon."""


class LocalCopyError(OSError):
    """This copy's device failed a read that a resync or a verify needed: the replica is not to
    blame, and the region stays in what it misses (its errno is the device's)."""


class ReplicaIO(BlockIO, Protocol):
    """What the mirror needs of a replica beyond :class:`BlockIO` (``initiator.replica``'s
    ``RemoteNamespace`` has it): a write that reports through a callback, so that a host write
    sent to N replicas costs no Task or Future per replica, zeroing, and a way to hang up."""

    name: str
    block_size: int
    """The replica namespace's logical block (a kernel nvmet file namespace has 4096)."""
    stale_for: float
    """Seconds after this side gave up on a command (a timeout) during which the replica may
    still execute commands sent on that association: they may be in the network, or held by a
    partition, until its keep-alive expiry tears the association down there."""
    gave_up: bool
    """A command on this association timed out (any: a keep-alive's too), so this side reset it."""

    def submit_write(self, offset: int, data: memoryview | bytes, fua: bool,
                     done: Callable[[BaseException | None], None]) -> None: ...

    async def write_zeroes(self, offset: int, length: int) -> None: ...

    async def read_into(self, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` with the bytes at ``offset`` (a verify reuses its buffers)."""

    async def close(self) -> None: ...


Opener = Callable[[], Awaitable[ReplicaIO]]
"""Connects to one replica (a new association each time); raises ``OSError``/``ConnectionError``/
``ValueError`` with a one-line reason when it cannot."""


class Progress:
    """A resync's progress: what was to copy, what was copied, since when."""

    def __init__(self, regions: int, region_size: int) -> None:
        self.started = time.monotonic()
        self.total = regions * region_size
        self.copied = 0

    def add(self, nbytes: int, remaining_regions: int, region_size: int) -> None:
        self.copied += nbytes
        # regions dirtied during the resync grow the work: the total follows
        self.total = max(self.total, self.copied + remaining_regions * region_size)

    def view(self) -> dict[str, Any]:
        elapsed = max(time.monotonic() - self.started, 1e-6)
        rate = self.copied / elapsed
        left = max(self.total - self.copied, 0)
        return {"percent": round(100.0 * self.copied / self.total, 1) if self.total else 100.0,
                "copied_bytes": self.copied, "total_bytes": self.total,
                "mb_per_s": round(rate / 1e6, 2), "eta_s": round(left / rate, 1) if rate else None}


class ReplicaLink:
    """One configured replica. ``slot`` is its peer slot in this copy's metadata and ``bitmap``
    that slot's write-intent bitmap, both known once the replica was reached (a slot belongs to
    a peer's node id, which only the replica's own metadata tells)."""

    def __init__(self, name: str, opener: Opener) -> None:
        self.name = name
        self.opener = opener
        self.slot: int | None = None
        self.bitmap: WriteIntentBitmap | None = None
        self.state = CONNECTING
        self.reason = ""
        """Why the state is what it is, for people (the last error, the refusal)."""
        self.io: ReplicaIO | None = None
        self.peer_md: Metadata | None = None
        self.missing: set[int] = set()
        """Regions this replica may lack: its slot's dirty bits when it connects (after a crash
        the bitmap bounds them), and every region written since while it could not take the
        write. The on-disk bitmap is a superset (it also holds regions with writes in flight or
        not yet flushed everywhere)."""
        self.progress: Progress | None = None
        self.copied_total = 0
        """Bytes copied to this replica by resyncs since the daemon started."""
        self.local_errors = 0
        """Resyncs to this replica that this copy's own device failed (:class:`LocalCopyError`)."""
        self.discard_next = False
        """An operator discarded this replica's data: the next connection overwrites it."""
        self.stale_for = 0.0
        """The connected replica's :attr:`ReplicaIO.stale_for` (kept once it is hung up)."""
        self.fenced_until = 0.0
        """Monotonic time before which nothing is written to this replica again: a write this
        copy gave up on may still land there until then (see :meth:`abandoned`)."""

    @property
    def sendable(self) -> bool:
        return self.state == IN_SYNC or self.state == RESYNCING

    def view(self) -> dict[str, Any]:
        out: dict[str, Any] = {"replica": self.name, "slot": self.slot, "state": self.state,
                               "reason": self.reason, "missing_regions": len(self.missing),
                               "dirty_regions": self.bitmap.dirty_count() if self.bitmap else None,
                               "resynced_bytes": self.copied_total, "local_errors": self.local_errors}
        if self.state == RESYNCING and self.progress is not None:
            out["resync"] = self.progress.view()
        return out

    def abandoned(self, exc: BaseException) -> None:
        """A command to the replica failed with ``exc``. A timeout means this copy gave up on a
        live association with commands perhaps still on their way (a slow link, a partition
        that heals): a resync that copied a region before such a write lands would be undone
        by it, and the copies differ with no bit set. So no new association writes until the
        old one is dead at the replica. An error the replica answered, or a connection it
        closed, leaves nothing on its way. (A write may fail as a lost connection because
        another command, a keep-alive say, timed out first: :attr:`ReplicaIO.gave_up`.)"""
        if isinstance(exc, TimeoutError) or (self.io is not None and self.io.gave_up):
            self.fenced_until = max(self.fenced_until, time.monotonic() + self.stale_for)

    def hang_up(self) -> None:
        """Drop the connection. Its close runs in the background: a replica that hangs must not
        hold up the write that found it out."""
        io, self.io = self.io, None
        if io is not None:
            task = asyncio.get_running_loop().create_task(_close(io))
            _closing.add(task)
            task.add_done_callback(_closing.discard)


_closing: set[asyncio.Task[None]] = set()
"""Closes under way (the event loop keeps only weak references to tasks)."""


async def _close(io: ReplicaIO) -> None:
    try:
        await io.close()
    except (OSError, ConnectionError, TimeoutError):
        pass
