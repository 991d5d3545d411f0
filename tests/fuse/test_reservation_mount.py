"""A reservation through the FUSE mount: another host (a second connection of the initiator
daemon with its own host NQN, hence its own host identifier) takes a Write Exclusive reservation
and the mount's writes fail with EBADE, as the Linux block layer answers a Reservation Conflict;
its reads go on. Released, the mount writes again."""

from __future__ import annotations

import errno
import mmap
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from blockd_stack import NQN, Stack  # noqa: E402


def test_write_exclusive_elsewhere_is_ebade_through_the_mount(fresh_stack: Stack) -> None:
    s = fresh_stack.start()
    s.blockctl("connect", "-a", "127.0.0.1", "-s", str(s.port), "-n", NQN, "--name", "other",
               "-q", "nqn.2014-08.org.example:other-host")
    s.blockctl("resv-register", "other", "-k", "0x0b")
    s.blockctl("resv-acquire", "other", "-c", "0x0b", "-t", "1")
    buf = mmap.mmap(-1, 4096)
    buf.write(b"\x5a" * 4096)
    fd = os.open(s.file, os.O_RDWR | os.O_DIRECT)
    try:
        with pytest.raises(OSError) as refused:
            os.pwritev(fd, [buf], 1 << 20)
        assert refused.value.errno == errno.EBADE
        out = mmap.mmap(-1, 4096)
        assert os.preadv(fd, [out], 1 << 20) == 4096  # write exclusive: reads go on
        s.blockctl("resv-release", "other", "-c", "0x0b", "-t", "1")
        assert os.pwritev(fd, [buf], 1 << 20) == 4096
    finally:
        os.close(fd)
