"""The standby side of a failover pair: this copy, as its primary writes it.

Two targets present one host-facing subsystem (ANA, docs/replication.md "A failover pair");
each one's replicated namespace names the other as its replica. The node whose ANA group is
inaccessible is the *standby* (its :class:`~target.replication.mirror.ReplicatedBackend` is in
the secondary role: it mirrors nothing and refuses host I/O). Its copy is then written by the
primary, over the fabric, through a second subsystem of its own, the **standby subsystem**
(``standby_nqn``): one namespace exporting the whole device, data and metadata, exactly as a
plain replica namespace would (the primary keeps the replica's metadata for it).

:class:`StandbyExport` is that namespace's backend: the same local file as the replicated
namespace, serving I/O only while the copy is the standby. Once the copy is promoted it refuses
every read and write with Namespace Not Ready (a Flush only flushes the file, as a
shutdown's does), so an old primary that still believes it is one cannot
write under the new primary: its link to this copy fails, it starts a new generation, and when
the two meet again the generations show which copy took writes (split brain, never a merge).

A second subsystem rather than a second port or an exemption from ANA: the primary reaches it
with the plain replica link (any NVMe-oF namespace can be a replica), and hosts of the volume
never see it (another NQN). Its namespace sits in ANA group
:data:`~target.ana.STANDBY_ANA_GROUP`, which nothing makes inaccessible.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol.status import Status
from target.filter import BackendFilter
from target.replication.mirror import ReplicationError

if TYPE_CHECKING:
    from target.replication.mirror import ReplicatedBackend


class StandbyExport(BackendFilter):
    """The whole device of ``copy``'s local file, for its primary, while ``copy`` is the standby."""

    def __init__(self, copy: ReplicatedBackend) -> None:
        super().__init__(copy.inner)
        self.copy = copy

    def _check(self) -> None:
        if self.copy.primary or self.copy.demoting:
            raise ReplicationError(Status.NS_NOT_READY, f"{self.copy.name}: this copy is the primary "
                                   "(or being demoted); its standby subsystem takes no I/O")

    async def read_into(self, offset: int, buf: memoryview) -> None:
        self._check()
        await self.inner.read_into(offset, buf)

    async def write(self, offset: int, data: memoryview | bytes, fua: bool = False) -> None:
        self._check()
        await self.inner.write(offset, data, fua)

    async def discard(self, offset: int, length: int) -> None:
        self._check()
        await self.inner.discard(offset, length)

    async def write_zeroes(self, offset: int, length: int) -> None:
        self._check()
        await self.inner.write_zeroes(offset, length)

    def resize(self, size: int | None) -> int:
        raise ValueError(f"{self.copy.name}: a standby subsystem's namespace cannot be resized")

    def close(self) -> None:
        """The file is the replicated namespace's: it closes it."""
