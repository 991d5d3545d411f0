"""The one interface the replication engine uses to reach a copy of a volume.

A copy is the whole device: its data area and the metadata at its end
(:mod:`protocol.replication`). The local copy is a :class:`target.backend.Backend` adapted by
:class:`BackendBlockIO`; a remote copy (an NVMe-oF namespace reached through the host library)
satisfies :class:`BlockIO` structurally, without importing anything from ``target/``.
"""

from __future__ import annotations

from typing import Protocol

from target.backend import Backend


class BlockIO(Protocol):
    """Byte-addressed access to a whole device, metadata included."""

    size: int
    """Bytes of the whole device."""

    async def read(self, offset: int, length: int) -> bytes:
        """The ``length`` bytes at ``offset``."""

    async def write(self, offset: int, data: bytes | memoryview, fua: bool = False) -> None:
        """Store ``data``; with ``fua`` it is durable before this returns."""

    async def flush(self) -> None:
        """Make every completed write durable."""


class BackendBlockIO:
    """A :class:`Backend` (the local file) as a :class:`BlockIO`.

    A backend that cannot do FUA itself gets a flush after the write, as the controller does for
    a host's FUA write: the metadata's ordering rests on FUA meaning durable."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    @property
    def size(self) -> int:
        return self.backend.size

    async def read(self, offset: int, length: int) -> bytes:
        buf = bytearray(length)
        await self.backend.read_into(offset, memoryview(buf))
        return bytes(buf)

    async def write(self, offset: int, data: bytes | memoryview, fua: bool = False) -> None:
        backend = self.backend
        await backend.write(offset, data, fua and backend.can_fua)
        if fua and not backend.can_fua and backend.can_flush:
            await backend.flush()

    async def flush(self) -> None:
        if self.backend.can_flush:
            await self.backend.flush()
