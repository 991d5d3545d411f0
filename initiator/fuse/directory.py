"""The mount's one directory: a file ``ns<nsid>`` per namespace of the connection, with the
metadata requests on it (LOOKUP, GETATTR, OPEN, READDIR, SETATTR, STATFS...). Files opened with
O_DIRECT get FOPEN_DIRECT_IO (no page cache); sizes and modes cannot change, as on a block device."""

from __future__ import annotations

import errno
import os
import stat
import time
from typing import TYPE_CHECKING, Mapping

from initiator.fuse.abi import (
    ATTR_OUT, DIRENT, ENTRY_OUT, FATTR_GID, FATTR_MODE, FATTR_SIZE, FATTR_UID, FOPEN_DIRECT_IO,
    FOPEN_PARALLEL_DIRECT_WRITES, OPEN_IN, OPEN_OUT, ROOT_ID, RW_IN, SETATTR_IN, STATFS_OUT,
)
from initiator.fuse.errors import FsError

if TYPE_CHECKING:
    from initiator.controller import NamespaceInfo
    from initiator.fuse.needs import MountController
    from initiator.fuse.session import FuseSession


def _attr(ino: int, size: int, mode: int, nlink: int, mtime: int, uid: int, gid: int) -> tuple[int, ...]:
    return (ino, size, (size + 511) // 512, mtime, mtime, mtime, 0, 0, 0, mode, nlink, uid, gid, 0, 4096, 0)


class NamespaceDir:
    """The metadata requests of one mount; node id ``nsid + 1`` is the file of namespace nsid."""

    def __init__(self, session: FuseSession, connections: Mapping[str, MountController], name: str,
                 attr_ttl: float) -> None:
        self.session = session
        self.connections = connections
        self.name = name
        self.uid = os.getuid()
        self.gid = os.getgid()
        self.mtime = int(time.time())
        self.ttl = (int(attr_ttl), int(attr_ttl % 1 * 1e9))
        """How long the kernel may cache names and attributes: (seconds, nanoseconds)."""

    def namespaces(self) -> dict[int, NamespaceInfo]:
        ctrl = self.connections.get(self.name)
        return dict(ctrl.namespaces) if ctrl is not None else {}

    def _node_attr(self, nodeid: int) -> tuple[int, ...]:
        if nodeid == ROOT_ID:
            return _attr(ROOT_ID, 0, stat.S_IFDIR | 0o755, 2, self.mtime, self.uid, self.gid)
        info = self.namespaces().get(nodeid - 1)
        if info is None:
            raise FsError(errno.ENOENT)
        mode = stat.S_IFREG | (0o444 if info.read_only else 0o644)
        return _attr(nodeid, info.size, mode, 1, self.mtime, self.uid, self.gid)

    # -- the directory's rows of the opcode table (initiator.fuse.ops): FsError for a refusal ------

    def get_attr(self, unique: int, nodeid: int, arg: memoryview) -> None:
        secs, nsecs = self.ttl
        self.session.reply(unique, ATTR_OUT.pack(secs, nsecs, 0, *self._node_attr(nodeid)))

    def lookup(self, unique: int, nodeid: int, arg: memoryview) -> None:
        name = bytes(arg).split(b"\0", 1)[0]
        nsid = int(name[2:]) if nodeid == ROOT_ID and name[:2] == b"ns" and name[2:].isdigit() else 0
        if nsid not in self.namespaces() or name != b"ns%d" % nsid:
            raise FsError(errno.ENOENT)
        secs, nsecs = self.ttl
        self.session.reply(unique, ENTRY_OUT.pack(nsid + 1, 0, secs, secs, nsecs, nsecs, *self._node_attr(nsid + 1)))

    def open(self, unique: int, nodeid: int, arg: memoryview) -> None:
        flags, _ = OPEN_IN.unpack_from(arg)
        info = self.namespaces().get(nodeid - 1)
        if info is None:
            raise FsError(errno.ENOENT)
        if info.read_only and flags & os.O_ACCMODE != os.O_RDONLY:
            raise FsError(errno.EROFS)
        open_flags = FOPEN_PARALLEL_DIRECT_WRITES
        if flags & os.O_DIRECT:
            open_flags |= FOPEN_DIRECT_IO
        self.session.reply(unique, OPEN_OUT.pack(0, open_flags, 0))

    def opendir(self, unique: int, nodeid: int, arg: memoryview) -> None:
        if nodeid != ROOT_ID:
            raise FsError(errno.ENOTDIR)
        self.session.reply(unique, OPEN_OUT.pack(0, 0, 0))

    def readdir(self, unique: int, nodeid: int, arg: memoryview) -> None:
        fh, offset, size, _, _, _, _ = RW_IN.unpack_from(arg)
        self.session.reply(unique, self._readdir(offset, size))

    def set_attr(self, unique: int, nodeid: int, arg: memoryview) -> None:
        valid = SETATTR_IN.unpack_from(arg)[0]
        size = SETATTR_IN.unpack_from(arg)[3]
        attr = self._node_attr(nodeid)
        if valid & (FATTR_MODE | FATTR_UID | FATTR_GID):
            raise FsError(errno.EPERM)
        if valid & FATTR_SIZE and size != attr[1]:
            raise FsError(errno.EINVAL)  # like a block device: its size is the volume's
        secs, nsecs = self.ttl
        self.session.reply(unique, ATTR_OUT.pack(secs, nsecs, 0, *attr))

    def statfs(self, unique: int, nodeid: int, arg: memoryview) -> None:
        total = sum(ns.size for ns in self.namespaces().values()) // 4096
        self.session.reply(unique, STATFS_OUT.pack(total, 0, 0, 0, 0, 4096, 255, 4096, 0, *(0,) * 6))

    def _readdir(self, offset: int, size: int) -> bytes:
        entries = [(ROOT_ID, b".", stat.S_IFDIR), (ROOT_ID, b"..", stat.S_IFDIR)]
        entries += [(nsid + 1, b"ns%d" % nsid, stat.S_IFREG) for nsid in sorted(self.namespaces())]
        out = bytearray()
        for i, (ino, name, kind) in enumerate(entries[offset:], offset + 1):
            rec = DIRENT.pack(ino, i, len(name), kind >> 12) + name
            rec += bytes(-len(rec) % 8)
            if len(out) + len(rec) > size:
                break
            out += rec
        return bytes(out)
