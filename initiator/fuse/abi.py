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

FUSE_INIT_EXT = 1 << 30
"""INIT: ``fuse_init_in``/``fuse_init_out`` carry ``flags2``, the flags' upper 32 bits."""
FUSE_OVER_IO_URING = 1 << 41
"""INIT (in ``flags2``): the kernel offers requests over io_uring (only while the fuse module's
``enable_uring`` parameter is on); answered, it holds every request until each per-CPU queue has
a registered ring entry (docs/wire-facts.md, "FUSE over io_uring")."""
INIT_IN_EXT = struct.Struct("<IIIII")
"""``fuse_init_in`` up to ``flags2`` (sent whole by the kernels that have FUSE_INIT_EXT)."""

FUSE_IO_URING_CMD_REGISTER, FUSE_IO_URING_CMD_COMMIT_AND_FETCH = 1, 2
"""``cmd_op`` of an IORING_OP_URING_CMD on /dev/fuse (``enum fuse_uring_cmd``)."""
URING_IN_OUT, URING_OP_IN = 128, 128
"""``fuse_uring_req_header``: ``in_out`` (the in header, then our out header) and ``op_in`` (the
opcode's first argument, e.g. ``fuse_read_in``) sizes; ``ring_ent_in_out`` follows them."""
URING_ENT_IN_OUT = struct.Struct("<QQIIQ")
"""``fuse_uring_ent_in_out``: flags, commit_id, payload_sz, padding, reserved."""
URING_REQ_HEADER_SIZE = URING_IN_OUT + URING_OP_IN + URING_ENT_IN_OUT.size
URING_CMD_REQ = struct.Struct("<QQH6x")
"""``fuse_uring_cmd_req``, in the SQE's 80-byte command area (so the ring needs 128-byte SQEs):
flags, commit_id, qid."""
