"""Registered data buffers in a few size classes, with FIFO waiting when they run out.

NVMe-oF RDMA moves up to MDTS (1 MiB) per command, but most commands are a few KiB: giving
every queue slot a 1 MiB buffer would register gigabytes.  :class:`SlotClasses` keeps one
:class:`~blockd.rdma.verbs.BufferPool` per size class (registered once, at start-up; never a
registration per I/O) and hands out the smallest free slot that fits.  When none fits, the
caller's callback is queued and called (synchronously, from :meth:`SlotClasses.put`) as soon
as a slot is returned, in arrival order.
"""

from __future__ import annotations

import collections
from typing import Callable, Iterable

from .verbs import ACCESS_LOCAL, BufferPool, Device, Slot

__all__ = ["SlotClasses"]


class SlotClasses:
    """Slots of several sizes on one device; ``get(length, cb)`` calls ``cb(slot)`` once one fits."""

    def __init__(self, device: Device, classes: Iterable[tuple[int, int]],
                 access: int = ACCESS_LOCAL) -> None:
        self.device = device
        self.pools: list[BufferPool] = [device.create_pool(size, count, access)
                                        for size, count in sorted(classes)]
        if not self.pools:
            raise ValueError("at least one size class")
        self.max_size = self.pools[-1].slot_size
        self._waiters: collections.deque[tuple[int, Callable[[Slot], None]]] = collections.deque()
        self.closed = False

    @property
    def mrs(self) -> list:
        return [p.mr for p in self.pools]

    def try_get(self, length: int) -> Slot | None:
        for p in self.pools:
            if p.slot_size >= length and p.available:
                return p.get()
        return None

    def get_now(self, length: int) -> Slot | None:
        """A free slot of at least ``length`` bytes now, or None (also while callers wait:
        they come first)."""
        if self._waiters or length > self.max_size:
            return None
        return self.try_get(length)

    def get(self, length: int, callback: Callable[[Slot], None]) -> None:
        """``callback(slot)`` now if a slot of at least ``length`` bytes is free, else later."""
        if length > self.max_size:
            raise ValueError(f"{length} bytes exceed the largest buffer ({self.max_size})")
        if not self._waiters:
            slot = self.try_get(length)
            if slot is not None:
                callback(slot)
                return
        self._waiters.append((length, callback))

    def cancel(self, owner: object) -> None:
        """Drop queued callbacks bound to ``owner`` (``callback.__self__``), e.g. a dead connection."""
        self._waiters = collections.deque(
            (n, cb) for n, cb in self._waiters if getattr(cb, "__self__", None) is not owner
            and getattr(getattr(cb, "func", None), "__self__", None) is not owner)

    def put(self, slot: Slot) -> None:
        if self.closed:
            return
        slot.pool.put(slot)
        while self._waiters:
            length, cb = self._waiters[0]
            got = self.try_get(length)
            if got is None:
                return
            self._waiters.popleft()
            cb(got)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._waiters.clear()
        for p in self.pools:
            p.close()
