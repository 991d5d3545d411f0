"""How far a file system at the start of a volume reaches, so that ``create-md`` can refuse
to put internal metadata over its end.

Why: internal metadata takes the volume's last bytes, and the namespace then exports only the
data area before them. A file system made on the whole volume before replication was switched on
usually leaves its last blocks unwritten (ext4 and XFS write nothing there at ``mkfs``), so the
metadata area looks blank and the zero check of :func:`target.replication.metadata.create` lets
it through; the host then sees a device smaller than the file system's block count, and the
kernel refuses to mount it ("bad geometry" for ext4, "device too small" for XFS), or, were the
file system to grow into those blocks first, it would overwrite the metadata. The operator must
shrink the file system first (``resize2fs`` for ext2/3/4; XFS cannot shrink) or keep the whole
volume with external metadata.

Only the two file systems an operator of these machines makes with ``mkfs`` are read; the
superblock fields come from the on-disk formats (the kernel's ``struct ext4_super_block`` in
fs/ext4/ext4.h, ``struct xfs_dsb`` in fs/xfs/libxfs/xfs_format.h). ``blkid`` (util-linux 2.38,
Debian 12) names the type but not the size, and ``dumpe2fs``/``xfs_db`` would need a path,
which an rbd backend does not have: the fields are read through the same block I/O as the
metadata. Other file systems (and partition tables, whose last partition may end anywhere) are
not recognised: docs/replication.md tells the operator to check them.
"""

from __future__ import annotations

from dataclasses import dataclass

import construct as c

EXT_SUPERBLOCK_OFFSET = 1024
EXT_MAGIC = 0xEF53
EXT_INCOMPAT_64BIT = 0x80
"""``s_feature_incompat`` bit: ``s_blocks_count_hi`` holds the block count's upper 32 bits."""

ExtSuperblock = c.Struct(
    c.Padding(4),
    "blocks_count_lo" / c.Int32ul,      # 0x04
    c.Padding(0x18 - 0x08),
    "log_block_size" / c.Int32ul,       # 0x18: block size = 1024 << this
    c.Padding(0x38 - 0x1C),
    "magic" / c.Int16ul,                # 0x38
    c.Padding(0x60 - 0x3A),
    "feature_incompat" / c.Int32ul,     # 0x60
    c.Padding(0x150 - 0x64),
    "blocks_count_hi" / c.Int32ul,      # 0x150
)
"""The fields of ext2/3/4's superblock (at byte 1024 of the volume) that give its size."""

XFS_MAGIC = b"XFSB"
XfsSuperblock = c.Struct(
    "magic" / c.Bytes(4),               # 0x00
    "blocksize" / c.Int32ub,            # 0x04
    "dblocks" / c.Int64ub,              # 0x08: blocks of the data section
)
"""The fields of XFS's primary superblock (at byte 0, big-endian) that give its size."""

PROBE_LENGTH = EXT_SUPERBLOCK_OFFSET + ExtSuperblock.sizeof()
"""Bytes read from the volume's start: enough for both superblocks."""


@dataclass(frozen=True)
class FileSystem:
    """A file system found at the start of a volume."""
    kind: str
    """``ext2/3/4`` or ``xfs``."""
    end: int
    """The byte after its last block."""
    shrink_tool: str | None
    """The command that shrinks it, or None (XFS cannot shrink)."""


def file_system(head: bytes) -> FileSystem | None:
    """The file system whose superblock ``head`` (the volume's first :data:`PROBE_LENGTH`
    bytes) holds, or None."""
    if len(head) >= XfsSuperblock.sizeof():
        xfs = XfsSuperblock.parse(head)
        if xfs.magic == XFS_MAGIC:
            return FileSystem("xfs", xfs.dblocks * xfs.blocksize, None)
    if len(head) >= PROBE_LENGTH:
        ext = ExtSuperblock.parse(head[EXT_SUPERBLOCK_OFFSET:])
        if ext.magic == EXT_MAGIC and ext.log_block_size < 32:  # a block size the kernel accepts
            blocks = ext.blocks_count_lo
            if ext.feature_incompat & EXT_INCOMPAT_64BIT:
                blocks |= ext.blocks_count_hi << 32
            return FileSystem("ext2/3/4", blocks * (1024 << ext.log_block_size), "resize2fs")
    return None
