"""A backend that wraps another (nbdkit's filters): one layer per concern.

:class:`BackendFilter` forwards every call and every capability to the backend it wraps; a
filter overrides only what it changes (hide a capability, count flushes, later replicate writes)
and stacks on any :class:`target.backend.Backend`, another filter included.
"""

from __future__ import annotations

from target.backend import Backend


class BackendFilter:
    """Forwards everything to ``inner``; subclass and override what the filter changes."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner

    @property
    def size(self) -> int:
        return self.inner.size

    @property
    def read_only(self) -> bool:
        return self.inner.read_only

    @property
    def can_trim(self) -> bool:
        return self.inner.can_trim

    @property
    def can_zero(self) -> bool:
        return self.inner.can_zero

    @property
    def can_fua(self) -> bool:
        return self.inner.can_fua

    @property
    def can_flush(self) -> bool:
        return self.inner.can_flush

    async def read_into(self, offset: int, buf: memoryview) -> None:
        await self.inner.read_into(offset, buf)

    async def write(self, offset: int, data: memoryview | bytes, fua: bool = False) -> None:
        await self.inner.write(offset, data, fua)

    async def flush(self) -> None:
        await self.inner.flush()

    async def discard(self, offset: int, length: int) -> None:
        await self.inner.discard(offset, length)

    async def write_zeroes(self, offset: int, length: int) -> None:
        await self.inner.write_zeroes(offset, length)

    def resize(self, size: int | None) -> int:
        return self.inner.resize(size)

    def close(self) -> None:
        self.inner.close()
