"""The kernel's dm-log-writes target, from user space: marks put into a log, and a log read back
and replayed onto an image, for the crash-point replay (tests/vm/test_crash_replay.py).

dm-log-writes (Documentation/admin-guide/device-mapper/log-writes.rst) passes every bio to the
device under it and records each write in a log device: a write without FUA is recorded only
when a later FLUSH is issued (then the writes completed by that moment, then the flush), a FUA
write as soon as it completes. So replaying the first N entries of the log onto a blank image
gives what a disk with a volatile write cache may hold after a power loss at that moment: a
write is there only once a flush or its FUA made it durable. Its format
(``drivers/md/dm-log-writes.c``):

* sector 0: ``struct log_write_super`` {le64 magic, le64 version, le64 nr_entries, le32 sectorsize};
* from the next ``sectorsize`` block on, one entry after another: a ``sectorsize`` block holding
  ``struct log_write_entry`` {le64 sector, le64 nr_sectors, le64 flags, le64 data_len} (a mark's
  text follows the struct in the same block), then ``nr_sectors`` blocks of data (none for a
  discard or a mark). ``sector`` and ``nr_sectors`` count ``sectorsize`` units.

A mark is a message to the target (``dmsetup message NAME 0 mark TEXT``); :class:`Marker` sends
it with the device-mapper ioctl directly, which takes microseconds where a dmsetup process
takes milliseconds (the replay pairs two logs by marks put in both at once: see
tests/vm/crashpoints.py).
"""

from __future__ import annotations

import fcntl
import os
import struct
from dataclasses import dataclass
from pathlib import Path

WRITE_LOG_MAGIC = 0x6A736677736872
WRITE_LOG_VERSION = 1
LOG_FLUSH_FLAG = 1 << 0
LOG_FUA_FLAG = 1 << 1
LOG_DISCARD_FLAG = 1 << 2
LOG_MARK_FLAG = 1 << 3

_SUPER = struct.Struct("<QQQI")
_ENTRY = struct.Struct("<QQQQ")

# include/uapi/linux/dm-ioctl.h: struct dm_ioctl is 312 bytes (version[3], data_size,
# data_start, target_count, open_count, flags, event_nr, padding, dev, name[128], uuid[129],
# data[7]); DM_TARGET_MSG is _IOWR(0xfd, 14, struct dm_ioctl), its payload a struct
# dm_target_msg {u64 sector; char message[]}.
_DM_IOCTL = struct.Struct("<3IIIIiIIIQ128s129s7s")
_DM_TARGET_MSG = (3 << 30) | (_DM_IOCTL.size << 16) | (0xFD << 8) | 14
_DM_VERSION = (4, 0, 0)


@dataclass(frozen=True)
class Entry:
    """One logged write, flush, discard or mark."""

    sector: int
    nr_sectors: int
    flags: int
    data: bytes
    """The written bytes (a mark: its text, UTF-8)."""

    @property
    def mark(self) -> str | None:
        return self.data.decode() if self.flags & LOG_MARK_FLAG else None

    @property
    def durable_point(self) -> bool:
        """A FLUSH or a FUA write: a point the replay must visit."""
        return bool(self.flags & (LOG_FLUSH_FLAG | LOG_FUA_FLAG))


@dataclass
class Log:
    sectorsize: int
    entries: list[Entry]
    used_bytes: int
    """Where the last entry ends: what of the log device needs keeping."""


def read_log(data: bytes | bytearray | memoryview) -> Log:
    """Parse a log device's contents (the whole device, or its first ``used_bytes``)."""
    magic, version, count, sectorsize = _SUPER.unpack_from(data, 0)
    if magic != WRITE_LOG_MAGIC:
        raise ValueError(f"not a dm-log-writes log: magic {magic:#x}")
    if version != WRITE_LOG_VERSION:
        raise ValueError(f"dm-log-writes log version {version}, this reader knows {WRITE_LOG_VERSION}")
    entries: list[Entry] = []
    pos = sectorsize
    for i in range(count):
        sector, nr, flags, datalen = _ENTRY.unpack_from(data, pos)
        if flags & LOG_MARK_FLAG:
            payload = bytes(data[pos + _ENTRY.size:pos + _ENTRY.size + datalen])
            pos += sectorsize
        else:
            pos += sectorsize
            length = 0 if flags & LOG_DISCARD_FLAG else nr * sectorsize
            payload = bytes(data[pos:pos + length])
            if len(payload) != length:
                raise ValueError(f"entry {i} runs past the end of the log ({pos + length} > {len(data)})")
            pos += length
        entries.append(Entry(sector, nr, flags, payload))
    return Log(sectorsize, entries, pos)


def apply(image: bytearray, entry: Entry, sectorsize: int) -> None:
    """Replay one entry onto ``image`` (a flush or a mark changes nothing; a discard zeroes,
    as the loop device under the target does)."""
    if entry.flags & LOG_MARK_FLAG or not entry.nr_sectors:
        return
    start = entry.sector * sectorsize
    if entry.flags & LOG_DISCARD_FLAG:
        image[start:start + entry.nr_sectors * sectorsize] = bytes(entry.nr_sectors * sectorsize)
    else:
        image[start:start + len(entry.data)] = entry.data


class Marker:
    """Puts marks into dm-log-writes devices by name (one word each: the target's message
    parser splits on spaces)."""

    def __init__(self, control: str | Path = "/dev/mapper/control") -> None:
        self.fd = os.open(control, os.O_RDWR | os.O_CLOEXEC)

    def mark(self, device: str, text: str) -> None:
        if not text or " " in text:
            raise ValueError(f"a mark is one word, not {text!r}")
        msg = struct.pack("<Q", 0) + f"mark {text}".encode() + b"\0"
        head = _DM_IOCTL.pack(*_DM_VERSION, _DM_IOCTL.size + len(msg), _DM_IOCTL.size, 0, 0, 0, 0, 0, 0,
                              device.encode(), b"", b"")
        fcntl.ioctl(self.fd, _DM_TARGET_MSG, bytearray(head + msg), True)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
