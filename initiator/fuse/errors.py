"""How a failure reaches the program using the mount: one errno per kind of failure."""

from __future__ import annotations

import asyncio
import errno
import os

from initiator.errors import NvmeError, QueueLost
from protocol.status import Status


class FsError(Exception):
    """A request refused with ``errno`` (ENOENT, EROFS, ...): the answer, not a fault."""

    def __init__(self, err: int) -> None:
        super().__init__(os.strerror(err))
        self.errno = err


def errno_for(exc: Exception | asyncio.CancelledError) -> int | None:
    """The errno a failed request answers with; None for a fault of ours (a bug: the caller logs
    it with its traceback and answers EIO). Any failure of the connection or the target is EIO,
    as a block device reports it, but a Reservation Conflict, which is EBADE as the Linux block
    layer makes it (BLK_STS_RESV_CONFLICT); an interrupted request is EINTR."""
    if isinstance(exc, FsError):
        return exc.errno
    if isinstance(exc, NvmeError) and exc.status == Status.RESERVATION_CONFLICT:
        return errno.EBADE
    if isinstance(exc, asyncio.CancelledError):
        return errno.EINTR
    if isinstance(exc, (NvmeError, QueueLost, ConnectionError, TimeoutError, OSError)):
        return errno.EIO
    if isinstance(exc, ValueError):
        return errno.EINVAL
    return None
