"""Linux file calls that Python's ``os`` module lacks, shared by the target (its file backend
punches and zeroes ranges) and the initiator (its FUSE mount answers fallocate(2) with the same
modes): one libc binding and one copy of the flag values from ``include/uapi/linux/falloc.h``."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10

libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
"""The C library with errno kept per call (``ctypes.get_errno``), for the calls below and for
callers that bind further ones (the FUSE mount binds mount(2) and umount2(2))."""
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def check(ret: int, what: str) -> None:
    """Raise the OSError of a libc call that returned non-zero, naming ``what`` was attempted."""
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    """fallocate(2) on ``fd``; OSError (EOPNOTSUPP when the file system lacks ``mode``)."""
    check(libc.fallocate(fd, mode, offset, length), "fallocate")
