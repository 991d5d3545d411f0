"""One NVMe-oF namespace as a replica's block device: what a replicated namespace of the target
(``target/replication``) writes its copies through.

:class:`RemoteNamespace` satisfies the target's ``BlockIO`` protocol structurally (``size``,
``read``, ``write``, ``flush``), plus the callback write and the zeroing the mirror uses, without
importing ``target/`` (tests/test_layers.py). The composition root (``blockd/cli/daemon.py``)
hands :func:`open_remote` to the target service.

One association per connection: ``ctrl_loss_tmo`` is 0, so a lost connection fails the
commands in flight at once instead of parking them for a reconnect. The replication link
reconnects itself, with a new association, after it has marked the replica out of sync: a write
parked across a reconnect would otherwise land on the replica after the resync had copied its
region, and overwrite newer data with older.
"""

from __future__ import annotations

import asyncio

from initiator.controller import Controller, IoDone
from initiator.errors import NvmeError
from initiator.params import ConnectParams
from protocol.commands import digest_command, identify_command
from protocol.constants import (
    DLFEAT_DEAC, DLFEAT_READ_MASK, DLFEAT_READS_ZEROES, LPA_COMMANDS_EFFECTS, ONCS_WRITE_ZEROES, Cns, IoOpcode,
    LogPageId,
)
from protocol.digest import DIGEST_SIZE, MAX_BLOCKS, DigestAlgorithm
from protocol.identify import IDENTIFY_NAMESPACE, IDENTIFY_SIZE
from protocol.logpage import COMMANDS_EFFECTS_LOG, COMMANDS_EFFECTS_LOG_SIZE, EFFECTS_CSUPP

REPLICA_QUEUES = 2
"""I/O queues per replica association: the controller packs commands onto the first queue
with room (see ``Controller._io_with_room``), a second only takes the overflow."""


_ZEROS = bytes(1 << 20)
"""What a replica without Write Zeroes is written with, 1 MiB at a time."""

STALE_MARGIN = 1.0
"""Seconds beyond two keep-alive timeouts: the target's keep-alive check runs periodically
(blockd's every 0.5 s)."""


class RemoteNamespace:
    """Namespace ``nsid`` of a live :class:`Controller`, addressed in bytes."""

    def __init__(self, ctrl: Controller, nsid: int, dlfeat: int = 0, serves_digests: bool = False) -> None:
        """``dlfeat``: the namespace's Identify DLFEAT (what :meth:`write_zeroes` may ask);
        ``serves_digests``: its controller has blockd's Digest command (:func:`serves_digests`)."""
        self.ctrl = ctrl
        self.serves_digests = serves_digests
        """:meth:`digests` works here: a verify asks for digests instead of reading the data."""
        self.nsid = nsid
        self.size = ctrl.namespace(nsid).size
        """Bytes of the whole namespace (the replica's metadata included)."""
        self.name = f"{ctrl.params.transport}://{ctrl.params.traddr}:{ctrl.params.trsvcid}/{ctrl.params.subnqn}/{nsid}"
        self.zeroes_supported = bool(ctrl.identity.oncs & ONCS_WRITE_ZEROES)
        """Write Zeroes works on this replica (Identify ONCS bit 3, until it refuses one: see
        :meth:`write_zeroes`)."""
        self.deallocate = dlfeat & DLFEAT_READ_MASK == DLFEAT_READS_ZEROES and bool(dlfeat & DLFEAT_DEAC)
        """Write Zeroes goes with DEAC: the replica may deallocate the range (a thin replica
        can stay thin) and it still reads as zeroes (DLFEAT 001b, bit 3), as the Linux host
        decides for REQ_OP_WRITE_ZEROES (``nvme_update_ns_info_block``)."""
        self.stale_for = 2 * ctrl.params.keep_alive_tmo + STALE_MARGIN
        """How long a command this side gave up on may still run at the replica: a target tears
        an association down between one and two KATO after the last command it received (nvmet's
        traffic-based keep-alive, and blockd's), which a delayed path or a partition that heals
        shifts but does not stretch (the replica receives nothing meanwhile)."""

    @property
    def gave_up(self) -> bool:
        """Whether a command on this association went unanswered past its timeout: the
        association was then reset from this side, perhaps with commands still on their way."""
        return self.ctrl.timeouts > 0

    @property
    def block_size(self) -> int:
        return self.ctrl.namespace(self.nsid).block_size

    def submit_write(self, offset: int, data: memoryview | bytes, fua: bool, done: IoDone) -> None:
        """Start a write; ``done`` runs once it completed or failed (no Task, no Future: the
        mirror's per-write path)."""
        self.ctrl.transfer(True, self.nsid, offset, memoryview(data), done, fua)

    async def read(self, offset: int, length: int) -> bytes:
        return bytes(await self.ctrl.read_bytes(self.nsid, offset, length))

    async def read_into(self, offset: int, buf: memoryview) -> None:
        """Read ``len(buf)`` bytes at ``offset`` into ``buf`` (commands of ``max_transfer``
        bytes, all sent at once over the association's queues)."""
        await self.ctrl.read_bytes_into(self.nsid, offset, buf)

    async def write(self, offset: int, data: bytes | memoryview, fua: bool = False) -> None:
        await self.ctrl.write_bytes(self.nsid, offset, data, fua)

    async def flush(self) -> None:
        await self.ctrl.flush(self.nsid)

    async def write_zeroes(self, offset: int, length: int) -> None:
        """Zero a block-aligned range (a resync's hole): one Write Zeroes per 65536 blocks (the
        field's limit), with DEAC where the replica says a deallocated block reads as zeroes
        (:attr:`deallocate`); writes of zeroes where it has no Write Zeroes, or refuses one,
        from then on: nvmet answers ONCS Not Supported (SCT 1, SC 0x83) when its file system
        cannot zero a range (a file on tmpfs: no ``FALLOC_FL_ZERO_RANGE``).

        Never a Dataset Management deallocate, even with DLFEAT 001b: that command is advisory
        (the controller may deallocate the ranges, or do nothing and keep the old data), while
        after a Write Zeroes, DEAC or not, the range reads as zeroes."""
        bs = self.block_size
        slba, blocks = offset // bs, length // bs
        while blocks and self.zeroes_supported:
            n = min(blocks, 1 << 16)
            try:
                await self.ctrl.write_zeroes(self.nsid, slba, n, self.deallocate)
            except NvmeError:  # it answered, and refused: not a lost connection
                self.zeroes_supported = False
                break
            slba += n
            blocks -= n
        zeros = memoryview(_ZEROS)
        while blocks:
            n = min(blocks, len(_ZEROS) // bs)
            await self.ctrl.write_bytes(self.nsid, slba * bs, zeros[:n * bs])
            slba += n
            blocks -= n

    async def digests(self, offset: int, length: int, chunk: int, out: memoryview) -> None:
        """The XXH3-128 digests of the block-aligned range at ``offset``, one per ``chunk`` bytes
        (a multiple of the block size; the last one shorter when the range ends first), into
        ``out``: commands of whole chunks, as many blocks as one may cover and as many digests as
        one transfer holds, all sent at once (:mod:`protocol.digest`). Raises
        :class:`NvmeError` as a read does."""
        bs = self.block_size
        chunk_blocks = chunk // bs
        if chunk % bs or offset % bs or length % bs or not 0 < chunk_blocks <= MAX_BLOCKS:
            raise ValueError(f"a digest of {length} bytes at {offset} in chunks of {chunk} "
                             f"does not fit blocks of {bs} bytes")
        per_command = chunk_blocks * min(MAX_BLOCKS // chunk_blocks, self.ctrl.max_transfer // DIGEST_SIZE)
        commands = []
        slba, end = offset // bs, (offset + length) // bs
        at = 0
        while slba < end:
            blocks = min(per_command, end - slba)
            n = -(-blocks // chunk_blocks) * DIGEST_SIZE
            commands.append(self.ctrl.io_command(
                digest_command(self.nsid, slba, blocks - 1, chunk_blocks, DigestAlgorithm.XXH3_128),
                data_in=out[at:at + n]))
            slba += blocks
            at += n
        await asyncio.gather(*commands)

    async def close(self) -> None:
        await self.ctrl.close()


async def serves_digests(ctrl: Controller) -> bool:
    """Whether the controller has blockd's Digest command: its Commands Supported and Effects log
    (if it has one, Identify LPA bit 1) says CSUPP for the opcode. Asking up front, not sending
    the command to find out, because a vendor specific opcode means something else to another
    vendor's controller (a passthrough nvmet forwards it to its device); the kernel's nvmet
    serves the log without it."""
    if not ctrl.identity.lpa & LPA_COMMANDS_EFFECTS:
        return False
    try:
        page = await ctrl.get_log_page(LogPageId.COMMANDS_EFFECTS, COMMANDS_EFFECTS_LOG_SIZE)
    except NvmeError:  # refused: as if not advertised
        return False
    return bool(COMMANDS_EFFECTS_LOG.parse(page).iocs[IoOpcode.BLOCKD_DIGEST] & EFFECTS_CSUPP)


async def open_remote(transport: str, address: str, port: int, nqn: str, nsid: int,
                      hostnqn: str | None, timeout: float) -> RemoteNamespace:
    """Connect to one replica namespace; ``timeout`` bounds the connect and every command.
    Raises what :meth:`Controller.connect` raises, or ``ValueError`` when the namespace is not
    there."""
    params = ConnectParams(traddr=address, subnqn=nqn, transport=transport, trsvcid=port,
                           nr_io_queues=REPLICA_QUEUES, ctrl_loss_tmo=0, keep_alive_tmo=max(timeout, 1.0),
                           command_timeout=timeout, connect_timeout=timeout,
                           **({"hostnqn": hostnqn} if hostnqn else {}))
    ctrl = await Controller.connect(params)
    if nsid not in ctrl.namespaces:
        await ctrl.close()
        raise ValueError(f"{nqn} at {address}:{port} has no namespace {nsid}")
    identify = bytearray(IDENTIFY_SIZE)
    try:
        await ctrl.admin_command(identify_command(Cns.NAMESPACE, nsid), data_in=memoryview(identify))
        digests = await serves_digests(ctrl)
    except BaseException:
        await ctrl.close()
        raise
    return RemoteNamespace(ctrl, nsid, IDENTIFY_NAMESPACE.parse(identify).dlfeat, digests)

