"""A disk in memory with a volatile cache, that records, holds, fails, tears and crashes writes:
the one cache model of the replication tests. It is a
:class:`target.replication.blockio.BlockIO` (the metadata tests) and a
:class:`target.backend.Backend` (the mirror's local copy, and the store behind the mirror tests'
fake replica), so the local copy's data and its metadata share one cache, as on a real disk.

Storage is sparse (a dict of 4 KiB pages), so a device of many GiB costs only what is written.
Durability is modelled as a disk with a volatile cache: a write is visible to reads at once,
but survives a crash only if it had FUA or a flush followed it (Write Zeroes and Deallocate are
writes of zeroes without FUA). After :meth:`MemoryBlockIO.crash` (or the write that ``crash_at``
names) every call raises :class:`Crashed`, and :meth:`MemoryBlockIO.survivor` is the device as
a restarted node finds it. ``on_issue`` lets a test look at the other devices, or crash one, at
the instant a write arrives, before it lands.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable

PAGE = 4096


class Crashed(Exception):
    """The simulated node is down."""


@dataclass(frozen=True)
class Write:
    offset: int
    length: int
    fua: bool


class _Pages:
    def __init__(self, pages: dict[int, bytes] | None = None) -> None:
        self.pages: dict[int, bytes] = dict(pages or {})

    def read(self, offset: int, length: int) -> bytes:
        out = bytearray(length)
        pos = offset
        while pos < offset + length:
            page, within = divmod(pos, PAGE)
            n = min(PAGE - within, offset + length - pos)
            data = self.pages.get(page)
            if data is not None:
                out[pos - offset:pos - offset + n] = data[within:within + n]
            pos += n
        return bytes(out)

    def write(self, offset: int, data: bytes) -> None:
        pos = 0
        while pos < len(data):
            page, within = divmod(offset + pos, PAGE)
            n = min(PAGE - within, len(data) - pos)
            current = bytearray(self.pages.get(page, bytes(PAGE)))
            current[within:within + n] = data[pos:pos + n]
            self.pages[page] = bytes(current)
            pos += n


class MemoryBlockIO:
    """``crash_at=N``: the N-th write (0-based) crashes the node; with ``tear`` its first half
    reaches the disk first. ``hold``: while the event is clear, writes wait before landing.
    ``fail``: the next write raises it instead of landing (then writes work again)."""

    read_only = False
    can_trim = can_zero = can_fua = can_flush = True
    """As a :class:`target.backend.Backend`: FUA and flush are what this model is about."""

    def __init__(self, size: int, *, crash_at: int | None = None, tear: bool = False,
                 image: dict[int, bytes] | None = None) -> None:
        self.size = size
        self.on_issue: list[Callable[[int, bytes, bool], None]] = []
        """Called with ``(offset, data, fua)`` as each write arrives, before it lands: a test
        can see every device's state at that instant, or crash one (this one included: the
        write then does not land)."""
        self.crash_at = crash_at
        self.tear = tear
        self.visible = _Pages(image)
        self.durable = _Pages(image)
        self.writes: list[Write] = []
        self.flushes = 0
        self._unflushed: list[tuple[int, bytes]] = []
        self.hold: asyncio.Event | None = None
        self.fail: Exception | None = None
        self.crashed = False

    def _check(self) -> None:
        if self.crashed:
            raise Crashed()

    async def read(self, offset: int, length: int) -> bytes:
        self._check()
        if offset < 0 or offset + length > self.size:
            raise ValueError(f"read {offset}+{length} beyond {self.size}")
        return self.visible.read(offset, length)

    async def write(self, offset: int, data: bytes | memoryview, fua: bool = False) -> None:
        self._check()
        data = bytes(data)
        if offset < 0 or offset + len(data) > self.size:
            raise ValueError(f"write {offset}+{len(data)} beyond {self.size}")
        for watch in self.on_issue:
            watch(offset, data, fua)
        self._check()
        if self.hold is not None:
            await self.hold.wait()
        await asyncio.sleep(0)  # a real write yields; concurrent callers interleave here
        self._check()
        if self.fail is not None:
            exc, self.fail = self.fail, None
            raise exc
        if self.crash_at is not None and len(self.writes) == self.crash_at:
            if self.tear:
                self.durable.write(offset, data[:len(data) // 2])
            self.crash()
            raise Crashed()
        self.writes.append(Write(offset, len(data), fua))
        self.visible.write(offset, data)
        if fua:
            self.durable.write(offset, data)
        else:
            self._unflushed.append((offset, data))

    async def flush(self) -> None:
        self._check()
        await asyncio.sleep(0)
        self._check()
        for offset, data in self._unflushed:
            self.durable.write(offset, data)
        self._unflushed.clear()
        self.flushes += 1

    async def read_into(self, offset: int, buf: memoryview) -> None:
        buf[:] = await self.read(offset, len(buf))

    async def write_zeroes(self, offset: int, length: int) -> None:
        await self.write(offset, bytes(length))

    async def discard(self, offset: int, length: int) -> None:
        await self.write(offset, bytes(length))

    def close(self) -> None:
        """Nothing to release; a close is not a crash (what the cache holds stays)."""

    def crash(self) -> None:
        """Power is lost: every later call raises :class:`Crashed`; :meth:`survivor` keeps
        what was durable. Callable from an ``on_issue`` watcher (it does not raise)."""
        self.crashed = True

    def unflushed(self, offset: int, length: int) -> bool:
        """Whether the cache holds a write, not yet durable, that overlaps the range."""
        end = offset + length
        return any(o < end and offset < o + len(d) for o, d in self._unflushed)

    def survivor(self) -> MemoryBlockIO:
        """The device after the crash: what was durable, and nothing else."""
        return MemoryBlockIO(self.size, image=self.durable.pages)

    def durable_bytes(self, offset: int, length: int) -> bytes:
        return self.durable.read(offset, length)

    def corrupt(self, offset: int) -> None:
        """Flip one byte on the medium (visible and durable)."""
        for pages in (self.visible, self.durable):
            pages.write(offset, bytes([pages.read(offset, 1)[0] ^ 0xFF]))
