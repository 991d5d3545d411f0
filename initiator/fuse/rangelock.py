"""Block-range locks of one namespace, so a read-modify-write never interleaves with a write to
the same blocks: the one ordering rule the mount adds on top of the controller.

This is the Python reference; ``initiator/fuse/_rangelock.pyx`` is its compiled twin (the
compiled FUSE loop takes and releases a write's shared hold there with C calls), and
:mod:`initiator.fuse.blockfile` picks one through :func:`blockd.dataplane.twin`."""

from __future__ import annotations

import asyncio


class RangeLocks:
    """Writes in flight on one namespace, as block ranges. Aligned writes share; a read-modify-
    write (or a hole punch) is exclusive against every overlapping write, in arrival order."""

    def __init__(self) -> None:
        self.active: dict[int, tuple[int, int, bool, asyncio.Future[None] | None]] = {}
        """token -> (first block, end block, exclusive, future made once someone waits on it)"""
        self.exclusive = 0
        self._next = 0

    async def acquire(self, start: int, end: int, exclusive: bool) -> int:
        token = self._next
        self._next += 1
        self.active[token] = (start, end, exclusive, None)
        if exclusive:
            self.exclusive += 1
        elif not self.exclusive:
            return token
        try:
            while True:
                for t, (s, e, x, fut) in self.active.items():
                    if t == token:
                        return token
                    if s < end and start < e and (exclusive or x):
                        if fut is None:
                            fut = asyncio.get_running_loop().create_future()
                            self.active[t] = (s, e, x, fut)
                        await asyncio.wait((fut,))
                        break
        except BaseException:
            self.release(token)
            raise

    def share_now(self, start: int, end: int) -> int | None:
        """A shared hold taken without waiting, or None when an exclusive one is active."""
        if self.exclusive:
            return None
        token = self._next
        self._next += 1
        self.active[token] = (start, end, False, None)
        return token

    def release(self, token: int) -> None:
        _, _, exclusive, fut = self.active.pop(token)
        if exclusive:
            self.exclusive -= 1
        if fut is not None:
            fut.set_result(None)
