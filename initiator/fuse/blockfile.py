"""Block-device semantics for the namespace files of a mount, on top of the controller.

The file size is the namespace size; fsync/fdatasync send Flush; fallocate PUNCH_HOLE deallocates
and ZERO_RANGE sends Write Zeroes; any failure of the connection is EIO to the caller. The
controller is looked up by connection name on every request, so a mount keeps working once the
connection comes back, even as a new connection under the same name.

One path per operation. A read of any range, and a block-aligned write of any length, is one
``Controller.transfer`` (which splits at the controller's max transfer) sent from the request's
own callback, its reply written from the completion callback: no Task per request, and while the
connection is down the controller holds the command until it is back or given up. An fsync is
one Flush sent the same way, through ``submit_io`` (the primitive under ``transfer``). An
unaligned write is a read-modify-write of its edge blocks under the namespace's range lock, a
coroutine that ends in the same calls.
"""

from __future__ import annotations

import asyncio
import errno
import functools
from typing import TYPE_CHECKING, Mapping

from blockd.dataplane import twin
from blockd.linux_files import FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE
from initiator.fuse.abi import WRITE_OUT
from initiator.fuse.errors import FsError
from protocol.commands import flush_command

if TYPE_CHECKING:
    from initiator.controller import NamespaceInfo
    from initiator.fuse.needs import MountController
    from initiator.fuse.session import FuseSession

RangeLocks = twin("initiator.fuse._rangelock").RangeLocks
"""The namespaces' range locks: the compiled twin on the compiled plane (the compiled FUSE loop
calls its C methods), else the Python reference."""
WRITE_ZEROES_MAX_BLOCKS = 1 << 16
"""Blocks one Write Zeroes covers (its NLB field is 16 bits, 0's based)."""
DSM_MAX_BLOCKS = 0xFFFFFFFF
"""Blocks one Dataset Management range covers (a 32-bit length)."""
DSM_MAX_RANGES = 256
"""Ranges one Dataset Management command carries (NR is 8 bits, 0's based)."""
PARALLEL_ZEROING = 32
"""Write Zeroes commands of one fallocate(ZERO_RANGE) in flight at once."""
_FALLOC_MODES = FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE


class BlockFiles:
    """READ, WRITE, FSYNC and FALLOCATE on the files ``ns<nsid>`` of one mount."""

    def __init__(self, session: FuseSession, connections: Mapping[str, MountController], name: str) -> None:
        self.session = session
        self.connections = connections
        self.name = name
        self.locks: dict[int, RangeLocks] = {}
        self.stats = session.stats
        self._reply = session.reply
        self._fail = session.fail
        self._inflight = session.inflight

    def _target(self, nsid: int) -> tuple[MountController, NamespaceInfo]:
        ctrl = self.connections.get(self.name)
        if ctrl is None or ctrl.failed is not None:
            raise FsError(errno.EIO)
        info = ctrl.namespaces.get(nsid)
        if info is None:
            raise FsError(errno.EIO)
        return ctrl, info

    def range_lock(self, nsid: int) -> RangeLocks:
        locks = self.locks.get(nsid)
        if locks is None:
            locks = self.locks[nsid] = RangeLocks()
        return locks

    # -- READ ---------------------------------------------------------------------------------------

    def read(self, unique: int, nsid: int, offset: int, size: int) -> None:
        """Read the blocks covering the range (clipped at the end of the file); reply with the
        range. Reads take no lock: a read racing a write to the same bytes may see either, as
        on a block device."""
        try:
            ctrl, info = self._target(nsid)
            end = offset + size
            if end > info.size:
                end = info.size
            if offset >= end:
                self._reply(unique)
                return
            bs = info.block_size
            if offset % bs or end % bs:  # read the blocks around it, reply with a view
                start = offset - offset % bs
                buf = bytearray(-(-end // bs) * bs - start)
                done = functools.partial(self._read_part_done, unique, buf, offset - start, end - start)
            else:
                start = offset
                buf = bytearray(end - offset)
                done = functools.partial(self._read_done, unique, buf)
            self._inflight[unique] = True
            ctrl.transfer(False, nsid, start, memoryview(buf), done)
        except Exception as exc:
            self._inflight.pop(unique, None)
            self._fail(unique, exc, "read")

    def _read_done(self, unique: int, buf: bytearray | memoryview, exc: BaseException | None) -> None:
        if not self._inflight.pop(unique, False):
            return  # interrupted: answered already
        if exc is not None:
            self._fail(unique, exc, "read")
            return
        self.stats["read"] += 1
        self._reply(unique, buf)

    def _read_part_done(self, unique: int, buf: bytearray, lo: int, hi: int, exc: BaseException | None) -> None:
        if exc is None:
            self._read_done(unique, memoryview(buf)[lo:hi], None)
        else:
            self._read_done(unique, buf, exc)

    # -- WRITE --------------------------------------------------------------------------------------

    def write(self, unique: int, nsid: int, offset: int, data: memoryview, owned: bytearray | None) -> None:
        """Write ``data`` at ``offset`` (clipped at the end of the file). ``owned``: the request
        buffer ``data`` lies in, given back to the session once the write succeeded."""
        try:
            ctrl, info = self._target(nsid)
            if info.read_only:
                raise FsError(errno.EROFS)
            if offset >= info.size:
                raise FsError(errno.ENOSPC)
            if offset + len(data) > info.size:
                data = data[:info.size - offset]
            bs = info.block_size
            end = offset + len(data)
            locks = self.range_lock(nsid)
            if offset % bs or end % bs:
                self.session.spawn(unique, self._patch_write(unique, ctrl, info, offset, data, owned, locks))
                return
            first, last = offset // bs, end // bs
            token = locks.share_now(first, last)
            if token is None:  # a read-modify-write holds blocks: the same write once it is done
                self.session.spawn(unique, self._write_when_free(unique, ctrl, nsid, offset, data, owned,
                                                                 locks, first, last))
                return
            self._write_blocks(unique, ctrl, nsid, offset, data, owned, locks, token)
        except Exception as exc:
            self._fail(unique, exc, "write")

    async def _write_when_free(self, unique: int, ctrl: MountController, nsid: int, offset: int,
                               data: memoryview, owned: bytearray | None, locks: RangeLocks,
                               first: int, last: int) -> None:
        try:
            token = await locks.acquire(first, last, False)
            self._write_blocks(unique, ctrl, nsid, offset, data, owned, locks, token)
        except BaseException as exc:
            self._fail(unique, exc, "write")

    def _write_blocks(self, unique: int, ctrl: MountController, nsid: int, offset: int, data: memoryview,
                      owned: bytearray | None, locks: RangeLocks, token: int) -> None:
        """Send an aligned write whose blocks ``token`` holds shared."""
        self._inflight[unique] = True
        try:
            ctrl.transfer(True, nsid, offset, data,
                          functools.partial(self._write_done, unique, len(data), owned, locks, token))
        except BaseException:
            self._inflight.pop(unique, None)
            locks.release(token)
            raise

    def _write_done(self, unique: int, length: int, owned: bytearray | None, locks: RangeLocks,
                    token: int, exc: BaseException | None) -> None:
        """Every write's end, aligned or not: its blocks released, then its answer."""
        locks.release(token)
        if not self._inflight.pop(unique, False):
            return  # interrupted: answered already
        if exc is not None:
            self._fail(unique, exc, "write")
            return
        self.stats["write"] += 1
        self._reply(unique, WRITE_OUT.pack(length, 0))
        if owned is not None:
            self.session.recycle(owned)

    async def _patch_write(self, unique: int, ctrl: MountController, info: NamespaceInfo, offset: int,
                           data: memoryview, owned: bytearray | None, locks: RangeLocks) -> None:
        bs = info.block_size
        try:
            token = await locks.acquire(offset // bs, -(-(offset + len(data)) // bs), True)
        except BaseException as exc:
            self._fail(unique, exc, "write")
            return
        self._inflight[unique] = True
        try:
            await self._patch(ctrl, info, offset, data)
        except BaseException as exc:
            self._write_done(unique, len(data), owned, locks, token, exc)
        else:
            self._write_done(unique, len(data), owned, locks, token, None)

    async def _patch(self, ctrl: MountController, info: NamespaceInfo, offset: int,
                     data: bytes | memoryview) -> None:
        """Read-modify-write of an unaligned range (the caller holds its blocks exclusively):
        the partial edge blocks are read, ``data`` laid over them, the whole span written."""
        bs = info.block_size
        end = offset + len(data)
        start, stop = offset - offset % bs, -(-end // bs) * bs
        buf = bytearray(stop - start)
        view = memoryview(buf)
        edges = []
        if offset % bs:
            edges.append(ctrl.read_into(info.nsid, start // bs, view[:bs]))
        if end % bs and (stop - bs > start or not offset % bs):
            edges.append(ctrl.read_into(info.nsid, stop // bs - 1, view[len(buf) - bs:]))
        await asyncio.gather(*edges)
        buf[offset - start:end - start] = data
        await ctrl.write_bytes(info.nsid, start, view)

    # -- FSYNC and FALLOCATE ------------------------------------------------------------------------

    def fsync(self, unique: int, nsid: int) -> None:
        """Send a Flush of the namespace through ``submit_io``, as READ and WRITE send theirs:
        the reply is written by its completion, an INTERRUPT answers it at once (``inflight``).
        It was a Task, which sent the Flush one loop iteration late and replied one after the
        completion: with the builder's cost, ~30 µs of the initiator's user CPU per fio
        ``fsync=1`` write (docs/dataplane.md, "FSYNC on the host as a callback request")."""
        try:
            ctrl, info = self._target(nsid)
            self._inflight[unique] = True
            ctrl.submit_io(flush_command(info.nsid), None, None, functools.partial(self._fsync_done, unique))
        except Exception as exc:
            self._inflight.pop(unique, None)
            self._fail(unique, exc, "fsync")

    def _fsync_done(self, unique: int, exc: BaseException | None) -> None:
        if not self._inflight.pop(unique, False):
            return  # interrupted: answered already
        if exc is not None:
            self._fail(unique, exc, "fsync")
            return
        self._reply(unique)

    async def fallocate(self, unique: int, nsid: int, offset: int, length: int, mode: int) -> None:
        try:
            ctrl, info = self._target(nsid)
            if mode & ~_FALLOC_MODES:
                raise FsError(errno.EOPNOTSUPP)
            if mode & FALLOC_FL_PUNCH_HOLE and not mode & FALLOC_FL_KEEP_SIZE:
                raise FsError(errno.EOPNOTSUPP)
            if mode & (FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE):
                if info.read_only:
                    raise FsError(errno.EROFS)
                end = min(offset + length, info.size)
                if offset + length > info.size and not mode & FALLOC_FL_KEEP_SIZE:
                    raise FsError(errno.EFBIG)
                if offset < end:
                    await self._zero(ctrl, info, offset, end, bool(mode & FALLOC_FL_PUNCH_HOLE))
            elif offset + length > info.size:  # plain allocation: everything below size exists
                raise FsError(errno.EFBIG)
            self._reply(unique)
        except BaseException as exc:
            self._fail(unique, exc, "fallocate")

    async def _zero(self, ctrl: MountController, info: NamespaceInfo, offset: int, end: int, punch: bool) -> None:
        """Zero [offset, end): whole blocks by Deallocate (punch) or Write Zeroes, edges by RMW."""
        bs = info.block_size
        first, last = -(-offset // bs), end // bs
        locks = self.range_lock(info.nsid)
        token = await locks.acquire(offset // bs, -(-end // bs), True)
        try:
            jobs = []
            if first >= last:  # inside one block, or two partial blocks
                jobs.append(self._patch(ctrl, info, offset, bytes(end - offset)))
            else:
                if offset % bs:
                    jobs.append(self._patch(ctrl, info, offset, bytes(first * bs - offset)))
                if end % bs:
                    jobs.append(self._patch(ctrl, info, last * bs, bytes(end - last * bs)))
            await asyncio.gather(*jobs)
            if first < last:
                if punch:
                    ranges = [(b, min(DSM_MAX_BLOCKS, last - b)) for b in range(first, last, DSM_MAX_BLOCKS)]
                    for i in range(0, len(ranges), DSM_MAX_RANGES):
                        await ctrl.deallocate(info.nsid, ranges[i:i + DSM_MAX_RANGES])
                else:
                    starts = list(range(first, last, WRITE_ZEROES_MAX_BLOCKS))
                    for i in range(0, len(starts), PARALLEL_ZEROING):
                        await asyncio.gather(*(
                            ctrl.write_zeroes(info.nsid, b, min(WRITE_ZEROES_MAX_BLOCKS, last - b))
                            for b in starts[i:i + PARALLEL_ZEROING]))
        finally:
            locks.release(token)
