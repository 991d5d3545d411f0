"""A backend filter that fails chosen calls: the disk-full and I/O-error cases of a device,
in process, without dm-error or a full file system.

A :class:`Fault` names an operation, an errno, a byte range and how many times it fires; a call
of that operation overlapping the range raises ``OSError(errno)`` before it reaches the wrapped
backend (nothing of it is done), as a write to a full thin file or a read of a bad sector fails.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

from target.backend import Backend
from target.filter import BackendFilter

OPS = ("read", "write", "flush", "discard", "write_zeroes")


@dataclass
class Fault:
    """Fail ``op`` calls that touch ``[start, end)`` with ``err``; ``count`` times, or every time
    while ``count`` is None. ``hits`` counts the calls it failed (a flush matches any range)."""

    op: str
    err: int
    start: int = 0
    end: int = 1 << 62
    count: int | None = None
    hits: int = 0

    def matches(self, op: str, offset: int, length: int) -> bool:
        if op != self.op or (self.count is not None and self.hits >= self.count):
            return False
        return op == "flush" or (offset < self.end and offset + max(length, 1) > self.start)


class FaultyBackend(BackendFilter):
    """Forwards to ``inner`` unless an injected :class:`Fault` matches the call."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.faults: list[Fault] = []

    def inject(self, op: str, err: int, start: int = 0, end: int = 1 << 62, count: int | None = None) -> Fault:
        if op not in OPS:
            raise ValueError(f"op {op!r} is not one of {OPS}")
        fault = Fault(op, err, start, end, count)
        self.faults.append(fault)
        return fault

    def heal(self) -> None:
        """The device works again (space freed, the bad sector remapped)."""
        self.faults.clear()

    def _check(self, op: str, offset: int = 0, length: int = 0) -> None:
        for fault in self.faults:
            if fault.matches(op, offset, length):
                fault.hits += 1
                raise OSError(fault.err, f"injected {errno.errorcode[fault.err]} ({os.strerror(fault.err)}) "
                                         f"on {op} at {offset}+{length}")

    async def read_into(self, offset: int, buf: memoryview) -> None:
        self._check("read", offset, len(buf))
        await self.inner.read_into(offset, buf)

    async def write(self, offset: int, data: memoryview | bytes, fua: bool = False) -> None:
        self._check("write", offset, len(data))
        await self.inner.write(offset, data, fua)

    async def flush(self) -> None:
        self._check("flush")
        await self.inner.flush()

    async def discard(self, offset: int, length: int) -> None:
        self._check("discard", offset, length)
        await self.inner.discard(offset, length)

    async def write_zeroes(self, offset: int, length: int) -> None:
        self._check("write_zeroes", offset, length)
        await self.inner.write_zeroes(offset, length)
