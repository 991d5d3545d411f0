"""The FUSE kernel ABI the mount speaks on /dev/fuse: opcodes, flags and message layouts, as
``include/uapi/linux/fuse.h`` declares them. Only what the kernel fixes lives here; the values we
choose when we answer INIT (sizes, limits) belong to the session (see ``session.py``)."""

from __future__ import annotations

import struct

FUSE_KERNEL_VERSION = 7
FUSE_KERNEL_MINOR = 31
FUSE_MIN_MINOR = 28
"""The oldest protocol minor we serve (the INIT_OUT layout below needs it)."""

ROOT_ID = 1
"""FUSE_ROOT_ID: the node id of the mount's root directory."""

LOOKUP, FORGET, GETATTR, SETATTR = 1, 2, 3, 4
OPEN, READ, WRITE, STATFS, RELEASE, FSYNC = 14, 15, 16, 17, 18, 20
GETXATTR, LISTXATTR, FLUSH, INIT, OPENDIR, READDIR, RELEASEDIR, FSYNCDIR = 22, 23, 25, 26, 27, 28, 29, 30
ACCESS, INTERRUPT, DESTROY, BATCH_FORGET, FALLOCATE = 34, 36, 38, 42, 43

FUSE_ASYNC_READ = 1 << 0
FUSE_ATOMIC_O_TRUNC = 1 << 3
FUSE_BIG_WRITES = 1 << 5
FUSE_ASYNC_DIO = 1 << 15
FUSE_PARALLEL_DIROPS = 1 << 18
FUSE_MAX_PAGES = 1 << 22

FOPEN_DIRECT_IO = 1 << 0
FOPEN_PARALLEL_DIRECT_WRITES = 1 << 6

FATTR_MODE, FATTR_UID, FATTR_GID, FATTR_SIZE = 1, 2, 4, 8

IN_HEADER = struct.Struct("<IIQQIIIHH")
OUT_HEADER = struct.Struct("<IiQ")
INIT_IN = struct.Struct("<IIII")
INIT_OUT = struct.Struct("<IIIIHHIIHHI7I")
_ATTR = "QQQQQQIIIIIIIIII"
ENTRY_OUT = struct.Struct("<QQQQII" + _ATTR)
ATTR_OUT = struct.Struct("<QII" + _ATTR)
OPEN_IN = struct.Struct("<II")
OPEN_OUT = struct.Struct("<QIi")
RW_IN = struct.Struct("<QQIIQII")
WRITE_OUT = struct.Struct("<II")
FSYNC_IN = struct.Struct("<QII")
FALLOCATE_IN = struct.Struct("<QQQII")
SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")
STATFS_OUT = struct.Struct("<QQQQQIIII6I")
DIRENT = struct.Struct("<QQII")
INTERRUPT_IN = struct.Struct("<Q")
