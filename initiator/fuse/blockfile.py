"""Block-device semantics for the namespace files of a mount, on top of the controller.

The file size is the namespace size; unaligned writes read-modify-write their edge blocks under a
per-namespace range lock; fsync/fdatasync send Flush; fallocate PUNCH_HOLE deallocates and
ZERO_RANGE sends Write Zeroes; any failure of the connection is EIO to the caller. The controller
is looked up by connection name on every request, so a mount keeps working once the connection
comes back, even as a new connection under the same name.
"""

from __future__ import annotations

import asyncio
import errno
import functools
from typing import TYPE_CHECKING, Mapping

from blockd.linux_files import FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE
from initiator.fuse.abi import WRITE_OUT
from initiator.fuse.errors import FsError
from initiator.fuse.rangelock import RangeLocks

if TYPE_CHECKING:
    from initiator.controller import NamespaceInfo
    from initiator.fuse.needs import MountController
    from initiator.fuse.session import FuseSession

WRITE_ZEROES_MAX_BLOCKS = 1 << 16
DSM_MAX_BLOCKS = 0xFFFFFFFF
PARALLEL_ZEROING = 32
_FALLOC_MODES = FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE


class BlockFiles:
    """READ, WRITE, FSYNC and FALLOCATE on the files ``ns<nsid>`` of one mount."""

    def __init__(self, session: FuseSession, connections: Mapping[str, MountController], name: str) -> None:
        self.session = session
        self.connections = connections
        self.name = name
        self.locks: dict[int, RangeLocks] = {}
        self.stats = session.stats
        self._send = session.send
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

    def _range_lock(self, nsid: int) -> RangeLocks:
        locks = self.locks.get(nsid)
        if locks is None:
            locks = self.locks[nsid] = RangeLocks()
        return locks

    # The common case, a block-aligned read or write of at most one command inside the namespace,
    # is served by callbacks: the command goes out from the request's own callback and the reply
    # is written from the completion's, with no Task per request. Everything else (edges, RMW,
    # splitting, a connection that is down) takes the coroutines below.

    def _fast_target(self, nsid: int, offset: int, length: int) -> tuple[MountController, NamespaceInfo] | None:
        ctrl = self.connections.get(self.name)
        if ctrl is None or ctrl.state != "live":
            return None
        info = ctrl.namespaces.get(nsid)
        if info is None:
            return None
        bs = info.block_size
        if offset % bs or length % bs or not length or length > ctrl.max_transfer or offset + length > info.size:
            return None
        return ctrl, info

    def read(self, unique: int, nsid: int, offset: int, size: int) -> None:
        found = self._fast_target(nsid, offset, size)
        if found is None:
            self.session.spawn(unique, self._read(unique, nsid, offset, size))
            return
        ctrl, info = found
        buf = bytearray(size)
        self._inflight.add(unique)
        ctrl.submit_read(nsid, offset // info.block_size, memoryview(buf),
                         functools.partial(self._read_done, unique, buf))

    def _read_done(self, unique: int, buf: bytearray, exc: BaseException | None) -> None:
        self._inflight.discard(unique)
        if exc is not None:
            self._fail(unique, exc, "read")
            return
        self.stats["read"] += 1
        self.session.reply_data(unique, buf)

    def write(self, unique: int, nsid: int, offset: int, data: bytes | memoryview,
              owned: bytearray | None) -> None:
        found = self._fast_target(nsid, offset, len(data))
        token = None
        if found is not None:
            ctrl, info = found
            if not info.read_only:
                bs = info.block_size
                locks = self._range_lock(nsid)
                token = locks.share_now(offset // bs, (offset + len(data)) // bs)
        if token is None:
            self.session.spawn(unique, self._write(unique, nsid, offset, data, owned))
            return
        self._inflight.add(unique)
        ctrl.submit_write(nsid, offset // bs, data,
                          functools.partial(self._write_done, unique, len(data), owned, locks, token))

    def _write_done(self, unique: int, length: int, owned: bytearray | None, locks: RangeLocks,
                    token: int, exc: BaseException | None) -> None:
        self._inflight.discard(unique)
        locks.release(token)
        if exc is not None:
            self._fail(unique, exc, "write")
            return
        self.stats["write"] += 1
        self._reply(unique, WRITE_OUT.pack(length, 0))
        if owned is not None:
            self.session.recycle(owned)

    async def _read(self, unique: int, nsid: int, offset: int, size: int) -> None:
        try:
            ctrl, info = self._target(nsid)
            end = min(offset + size, info.size)
            if offset >= end:
                self._reply(unique)
                return
            bs = info.block_size
            start = offset - offset % bs
            stop = -(-end // bs) * bs
            buf = bytearray(stop - start)
            await self._read_blocks(ctrl, info, start, memoryview(buf))
            self.stats["read"] += 1
            if start == offset and stop == end:
                self.session.reply_data(unique, buf)
            else:
                self._reply(unique, memoryview(buf)[offset - start:end - start])
        except BaseException as exc:
            self._fail(unique, exc, "read")

    async def _read_blocks(self, ctrl: MountController, info: NamespaceInfo, offset: int, view: memoryview) -> None:
        bs = info.block_size
        step = ctrl.max_transfer
        if len(view) <= step:
            await ctrl.read_into(info.nsid, offset // bs, view)
        else:
            await asyncio.gather(*(ctrl.read_into(info.nsid, (offset + pos) // bs, view[pos:pos + step])
                                   for pos in range(0, len(view), step)))

    async def _write_blocks(self, ctrl: MountController, info: NamespaceInfo, offset: int,
                            data: bytes | bytearray | memoryview) -> None:
        bs = info.block_size
        step = ctrl.max_transfer
        if len(data) <= step:
            await ctrl.write(info.nsid, offset // bs, data)
        else:
            view = memoryview(data)
            await asyncio.gather(*(ctrl.write(info.nsid, (offset + pos) // bs, view[pos:pos + step])
                                   for pos in range(0, len(view), step)))

    async def _write(self, unique: int, nsid: int, offset: int, data: bytes | memoryview,
                     owned: bytearray | None = None) -> None:
        try:
            ctrl, info = self._target(nsid)
            if info.read_only:
                raise FsError(errno.EROFS)
            if offset >= info.size:
                raise FsError(errno.ENOSPC)
            if offset + len(data) > info.size:
                data = data[:info.size - offset]
            await self._write_range(ctrl, info, offset, data)
            self.stats["write"] += 1
            self._reply(unique, WRITE_OUT.pack(len(data), 0))
            if owned is not None:
                self.session.recycle(owned)
        except BaseException as exc:
            self._fail(unique, exc, "write")

    async def _write_range(self, ctrl: MountController, info: NamespaceInfo, offset: int,
                           data: bytes | bytearray | memoryview) -> None:
        bs = info.block_size
        end = offset + len(data)
        first, last = offset // bs, -(-end // bs)
        aligned = not (offset % bs or end % bs)
        locks = self._range_lock(info.nsid)
        token = await locks.acquire(first, last, not aligned)
        try:
            if aligned:
                await self._write_blocks(ctrl, info, offset, data)
            else:
                await self._patch(ctrl, info, offset, data)
        finally:
            locks.release(token)

    async def _patch(self, ctrl: MountController, info: NamespaceInfo, offset: int,
                     data: bytes | bytearray | memoryview) -> None:
        """Read-modify-write of an unaligned range (the caller holds its blocks exclusively)."""
        bs = info.block_size
        end = offset + len(data)
        start, stop = offset - offset % bs, -(-end // bs) * bs
        buf = bytearray(stop - start)
        view = memoryview(buf)
        edges = []
        if offset % bs:
            edges.append(self._read_blocks(ctrl, info, start, view[:bs]))
        if end % bs and (stop - bs > start or not offset % bs):
            edges.append(self._read_blocks(ctrl, info, stop - bs, view[len(buf) - bs:]))
        await asyncio.gather(*edges)
        buf[offset - start:end - start] = data
        await self._write_blocks(ctrl, info, start, buf)

    async def fsync(self, unique: int, nsid: int) -> None:
        try:
            ctrl, info = self._target(nsid)
            await ctrl.flush(info.nsid)
            self._reply(unique)
        except BaseException as exc:
            self._fail(unique, exc, "fsync")

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
        locks = self._range_lock(info.nsid)
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
                    for i in range(0, len(ranges), 256):
                        await ctrl.deallocate(info.nsid, ranges[i:i + 256])
                else:
                    starts = list(range(first, last, WRITE_ZEROES_MAX_BLOCKS))
                    for i in range(0, len(starts), PARALLEL_ZEROING):
                        await asyncio.gather(*(
                            ctrl.write_zeroes(info.nsid, b, min(WRITE_ZEROES_MAX_BLOCKS, last - b))
                            for b in starts[i:i + PARALLEL_ZEROING]))
        finally:
            locks.release(token)
