"""Unmounting never waits on the daemon's own mount: the daemon serves its mounts from its
event loop, so a stat of a mount root whose cached attributes have expired, made on that loop,
waits for an answer only the loop could give. The mounts here cache attributes for a fifth of a
second, so they have always expired by the time the mount verbs come."""

from __future__ import annotations

import errno
import mmap
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from blockd_stack import Stack, mounted

TTL = 0.2
BOUND = 20.0
"""Seconds an unmount or a SIGTERM may take here (the daemon's own bounds are 5 s + 5 s)."""


def _expire(s: Stack) -> None:
    """Let the kernel cache the mount root's attributes, then let them expire."""
    os.stat(s.mnt)
    assert os.listdir(s.mnt) == ["ns1"]
    time.sleep(TTL * 3)


def test_mount_verbs_after_the_attribute_cache_expired(tmp_path: Path) -> None:
    with Stack(tmp_path, size=16 << 20, attr_ttl=TTL) as s:
        _expire(s)
        again = s.blockctl("mount", "vol", str(s.mnt), check=False, timeout=BOUND)
        assert again.returncode == 1 and "already a blockd mount" in again.stderr
        for path in (s.mnt, tmp_path / "link"):  # as mounted, then through a symlink (resolved)
            if path != s.mnt:
                path.symlink_to(s.mnt)
                s.mount()
            _expire(s)
            t0 = time.monotonic()
            s.blockctl("umount", str(path), timeout=BOUND)
            assert time.monotonic() - t0 < BOUND
            assert not mounted(s.mnt)
            assert s.blockctl("mounts", timeout=BOUND).stdout.strip() == "no mounts"


class _Load:
    """Threads reading and writing 4 KiB O_DIRECT blocks of the mounted file until the mount
    goes away (the errors a detached, then aborted mount gives) or ``stop``."""

    def __init__(self, path: Path, jobs: int = 4) -> None:
        self.path = path
        self.ios = 0
        self.errors: list[int] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(jobs)]
        for t in self.threads:
            t.start()

    def _run(self, job: int) -> None:
        buf = mmap.mmap(-1, 4096)
        fd = os.open(self.path, os.O_RDWR | os.O_DIRECT)
        try:
            n = 0
            while not self.stop.is_set():
                offset = ((job * 1024 + n) % 4096) * 4096
                try:
                    if n % 2:
                        os.preadv(fd, [buf], offset)
                    else:
                        os.pwritev(fd, [buf], offset)
                except OSError as exc:
                    self.errors.append(exc.errno)
                    return
                self.ios += 1
                n += 1
        finally:
            try:
                os.close(fd)
            except OSError:
                pass

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "I/O still blocked on the mount"


@pytest.mark.parametrize("how", ["umount", "sigterm"])
def test_unmount_under_load_is_bounded(tmp_path: Path, how: str) -> None:
    s = Stack(tmp_path, size=16 << 20, attr_ttl=TTL)
    try:
        s.start()
        load = _Load(s.file)
        try:
            time.sleep(1.0)  # I/O running; the root's attributes expire meanwhile
            assert load.ios > 0 and not load.errors
            t0 = time.monotonic()
            if how == "umount":
                busy = s.blockctl("umount", str(s.mnt), check=False, timeout=BOUND)
                assert busy.returncode == 1 and "busy" in busy.stderr
                s.blockctl("umount", "--lazy", str(s.mnt), timeout=BOUND)
                assert s.initiator.poll() is None
                assert "vol" in s.blockctl("list", timeout=BOUND).stdout  # still answering
            else:
                s.initiator.send_signal(signal.SIGTERM)
                assert s.initiator.wait(BOUND) == 0
            assert time.monotonic() - t0 < BOUND
            assert not mounted(s.mnt)
            load.join(BOUND)  # the aborted connection ends every open file's I/O
            assert load.errors and set(load.errors) <= {errno.ENOTCONN, errno.ECONNABORTED, errno.EIO}
        finally:
            load.stop.set()
            load.join(BOUND)
    finally:
        s.stop()
