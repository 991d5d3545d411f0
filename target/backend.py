"""Storage behind a namespace, in the spirit of nbdkit plugins.

The controller only ever calls the small :class:`Backend` interface, so files, block devices
and (later) replicated volumes plug in without touching it. Offsets and lengths are in bytes and
already checked against ``size`` by the controller. A backend also says what it can do (as
nbdkit's ``can_trim``/``can_zero``/``can_fua``/``can_flush``): Identify advertises only that,
and a command the backend cannot do gets a precise status (see :mod:`target.controller`).
A backend may wrap another (:class:`target.filter.BackendFilter`).
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import stat
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable, Protocol

from blockd.linux_files import FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE, fallocate
from target.io_fast import FastFile

if TYPE_CHECKING:
    from target.config import NamespaceConfig

_BLKGETSIZE64 = 0x80081272
_BLKZEROOUT = 0x127F
_ZERO_CHUNK = bytes(1 << 20)

class Backend(Protocol):
    """What a namespace needs from its storage."""

    size: int
    """Capacity in bytes."""
    read_only: bool
    """Writes are refused (Identify NSATTR write protect); the one place this is kept."""
    can_trim: bool
    """``discard`` deallocates, and the range reads back as zeroes (Identify ONCS DSM, DLFEAT);
    without it a deallocate is the hint the spec allows it to be, and does nothing."""
    can_zero: bool
    """``write_zeroes`` works (Identify ONCS Write Zeroes); without it Write Zeroes is refused."""
    can_fua: bool
    """``write(fua=True)`` makes the data durable itself; without it the controller flushes."""
    can_flush: bool
    """Completed writes may sit in a volatile cache that ``flush`` empties (Identify VWC);
    without it every completed write is durable and Flush has nothing to do."""

    async def read_into(self, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` with the bytes at ``offset``."""

    async def write(self, offset: int, data: memoryview | bytes, fua: bool = False) -> None:
        """Store ``data``; with ``fua`` it is durable before this returns."""

    async def flush(self) -> None:
        """Make every completed write durable."""

    async def discard(self, offset: int, length: int) -> None:
        """Deallocate a range; it reads back as zeroes afterwards."""

    async def write_zeroes(self, offset: int, length: int) -> None:
        """Zero a range."""

    def resize(self, size: int | None) -> int:
        """Make the capacity ``size`` bytes (None: what the storage holds now, after it grew
        outside the target) and return it. Growing adds zeroes; the caller has made sure no
        host uses what a shrink takes away."""

    def close(self) -> None:
        """Release the storage; further calls are errors."""


@dataclass(frozen=True)
class NamespaceHooks:
    """What the service hands a backend whose storage changes outside the target (an RBD image
    resized by ``rbd resize``, another gateway taking the image over): a backend with an
    ``attach(hooks)`` method gets them once its namespace is in its subsystem, and ``close``
    ends what ``attach`` started."""

    resized: Callable[[], None]
    """The storage's size changed: resize the namespace to it and tell the hosts (the resize
    verb's path, with the Namespace Attribute Changed event)."""
    serving: Callable[[], bool]
    """Whether the namespace's ANA group serves I/O on any of its subsystem's ports now."""
    set_serving: Callable[[bool], Awaitable[None]]
    """Make the namespace's ANA group optimized (True) or inaccessible (False) on every port,
    as ``blockctl target ana promote|demote`` does, with the ANA change event."""


class FileBackend:
    """A regular file or a block device.

    Reads and writes are synchronous ``preadv``/``pwrite`` on the event-loop thread: on the page
    cache they take microseconds, less than handing them to a thread. Anything that waits for the
    disk (fsync, FUA) runs in the default executor so keep-alives and other queues keep flowing.
    """

    can_trim = True  # punch hole (a block device: only one that zeroes, see _punch_zeroes)
    can_zero = True  # zero range / BLKZEROOUT, else writes of zeroes
    can_fua = True  # fdatasync after the write
    can_flush = True  # the page cache

    def __init__(self, path: str, size: int | None = None, read_only: bool = False,
                 create: bool = True) -> None:
        self.path = path
        self.read_only = read_only
        flags = os.O_RDONLY if read_only else os.O_RDWR
        if create and not read_only and not os.path.exists(path):
            if size is None:
                raise ValueError(f"{path} does not exist and no size was given to create it")
            flags |= os.O_CREAT
        self.fd = os.open(path, flags | os.O_CLOEXEC, 0o600)
        st = os.fstat(self.fd)
        self.is_block_device = stat.S_ISBLK(st.st_mode)
        if self.is_block_device:
            self.can_trim = _punch_zeroes(st.st_rdev)
        self.fast = None
        """The compiled I/O path's copy of ``fd`` and ``size`` (:mod:`target.io_fast`), kept in
        step here; None in pure mode, and for a subclass, which may change what a read or write
        does (only this class's reads and writes are done again in C)."""
        try:
            self.size = 0
            self.resize(None if self.is_block_device else size)  # a device is its own size
        except ValueError:
            os.close(self.fd)
            raise
        if FastFile is not None and type(self) is FileBackend:
            self.fast = FastFile(self.fd, self.size, read_only)

    def resize(self, size: int | None) -> int:
        """A block device is as large as the kernel says (``size`` must match or be None); a
        file grows to ``size`` (sparse) unless read-only, and never shrinks on disk: a smaller
        namespace leaves the bytes past its end alone."""
        if self.is_block_device:
            actual = struct.unpack("<Q", fcntl.ioctl(self.fd, _BLKGETSIZE64, b"\0" * 8))[0]
            if size is not None and size != actual:
                raise ValueError(f"{self.path} is a block device of {actual} bytes, not {size}")
            self._set_size(actual)
            return actual
        actual = os.fstat(self.fd).st_size
        if size is not None and actual < size and not self.read_only:
            os.ftruncate(self.fd, size)
            actual = size
        new = size if size is not None else actual
        if actual < new:
            raise ValueError(f"{self.path} is smaller than the configured size {new}")
        self._set_size(new)
        return new

    def _set_size(self, size: int) -> None:
        self.size = size
        if self.fast is not None:
            self.fast.size = size

    async def read_into(self, offset: int, buf: memoryview) -> None:
        got = os.preadv(self.fd, [buf], offset)
        if got != len(buf):
            raise OSError(errno.EIO, f"short read at {offset}: {got} of {len(buf)} bytes")

    async def write(self, offset: int, data: memoryview | bytes, fua: bool = False) -> None:
        done = os.pwrite(self.fd, data, offset)
        while done < len(data):
            done += os.pwrite(self.fd, memoryview(data)[done:], offset + done)
        if fua:
            await asyncio.get_running_loop().run_in_executor(None, os.fdatasync, self.fd)

    async def flush(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, os.fdatasync, self.fd)

    async def discard(self, offset: int, length: int) -> None:
        """A hole punched in a file; on a block device the same call is the kernel's zeroing
        that may unmap (``blkdev_fallocate``: Write Zeroes without the fallback of writing
        zeroes, EOPNOTSUPP where the device has none). Not BLKDISCARD: a discarded block of a
        device may read back as its old data, and Identify promises zeroes (DLFEAT)."""
        fallocate(self.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length)

    async def write_zeroes(self, offset: int, length: int) -> None:
        if self.is_block_device:
            fcntl.ioctl(self.fd, _BLKZEROOUT, struct.pack("<QQ", offset, length))
            return
        try:
            fallocate(self.fd, FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE, offset, length)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            end = offset + length
            while offset < end:
                n = min(len(_ZERO_CHUNK), end - offset)
                os.pwrite(self.fd, _ZERO_CHUNK[:n], offset)
                offset += n

    def data_extents(self, offset: int, length: int) -> list[tuple[int, int]]:
        """``(start, length)`` of the parts of ``[offset, offset + length)`` that hold data; the
        rest are holes of a sparse file, which read as zeroes (``SEEK_DATA``/``SEEK_HOLE``), so a
        resync need not read or send them. A block device, or a file system without the two
        seeks, is data throughout."""
        end = offset + length
        if self.is_block_device:
            return [(offset, length)]
        out: list[tuple[int, int]] = []
        pos = offset
        try:
            while pos < end:
                try:
                    start = os.lseek(self.fd, pos, os.SEEK_DATA)
                except OSError as exc:
                    if exc.errno == errno.ENXIO:  # no data from pos to the end of the file
                        break
                    raise
                if start >= end:
                    break
                stop = min(os.lseek(self.fd, start, os.SEEK_HOLE), end)
                out.append((start, stop - start))
                pos = stop
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            return [(offset, length)]
        return out

    def close(self) -> None:
        if self.fd >= 0:
            if self.fast is not None:
                self.fast.fd = -1  # withdrawn before the number can be reused
            os.close(self.fd)
            self.fd = -1


def _punch_zeroes(rdev: int) -> bool:
    """Whether the block device ``rdev`` has Write Zeroes (its queue's ``write_zeroes_max_bytes``
    in sysfs), which a punch of it needs (see :meth:`FileBackend.discard`). A device without it
    deallocates nothing: the hint is dropped and DLFEAT says nothing of zeroes, rather than a
    BLKDISCARD whose blocks may read back as anything, or a whole-device trim (mkfs does one)
    turned into writing zeroes."""
    device = f"/sys/dev/block/{os.major(rdev)}:{os.minor(rdev)}"
    for queue in (f"{device}/queue", f"{device}/../queue"):  # a partition's limits are its disk's
        try:
            with open(f"{queue}/write_zeroes_max_bytes") as f:
                return int(f.read()) > 0
        except FileNotFoundError:
            continue
    return False


def open_file(nc: NamespaceConfig) -> FileBackend:
    """The ``file`` backend's opener (:mod:`target.backend_registry`): ``path`` is the file or
    device, created at ``size`` when missing."""
    if nc.options:
        raise ValueError(f"the file backend takes no options (got {', '.join(k for k, _ in nc.options)})")
    return FileBackend(nc.path, nc.size, read_only=nc.read_only)


class MemoryBackend:
    """A RAM volume, for tests of the controller logic and for benchmarks without a disk.

    It claims a volatile cache (flush and FUA succeed and do nothing) so a host treats it as it
    treats a file; nothing in it survives the process anyway."""

    can_trim = can_zero = can_fua = can_flush = True

    def __init__(self, size: int, read_only: bool = False) -> None:
        self.size = size
        self.read_only = read_only
        self.data = bytearray(size)

    def resize(self, size: int | None) -> int:
        if size is not None:
            if size > len(self.data):
                self.data.extend(bytes(size - len(self.data)))
            self.size = size
        return self.size

    async def read_into(self, offset: int, buf: memoryview) -> None:
        buf[:] = self.data[offset:offset + len(buf)]

    async def write(self, offset: int, data: memoryview | bytes, fua: bool = False) -> None:
        self.data[offset:offset + len(data)] = data

    async def flush(self) -> None:
        pass

    async def discard(self, offset: int, length: int) -> None:
        self.data[offset:offset + length] = bytes(length)

    async def write_zeroes(self, offset: int, length: int) -> None:
        self.data[offset:offset + length] = bytes(length)

    def close(self) -> None:
        self.data = bytearray()
