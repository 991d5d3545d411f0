"""FUSE over io_uring against /dev/fuse: the same workloads through a mount on each path, real
daemons and a real kernel (docs/wire-facts.md, "FUSE over io_uring").

The path is chosen at mount by the fuse module's ``enable_uring`` parameter (on: the ring; off:
the fallback), which these tests set around each mount and put back. Without the parameter (a
kernel without CONFIG_FUSE_IO_URING) they skip, and under ``CI=true`` that skip is a failure.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import mmap
import os
import random
import re
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from blockd.dataplane import COMPILED
from blockd_stack import Stack

ENABLE = Path("/sys/module/fuse/parameters/enable_uring")
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 1, 2
PATHS = ("io_uring", "/dev/fuse")
"""The path each mount is asked for (``enable_uring`` on or off at its INIT)."""
SERVED_BY = {"io_uring": "io_uring" if COMPILED else "/dev/fuse", "/dev/fuse": "/dev/fuse"}
"""The path that then serves it: the ring needs the compiled loop, so on the Python plane
(BLOCKD_PURE=1, which the daemons inherit) both mounts run the /dev/fuse fallback."""
_libc = ctypes.CDLL(None, use_errno=True)


@pytest.fixture(autouse=True)
def _needs_the_ring() -> None:
    if not ENABLE.exists():
        pytest.skip("this kernel has no FUSE over io_uring (no /sys/module/fuse/parameters/enable_uring)")
    if subprocess.run(["which", "fio"], capture_output=True).returncode:
        pytest.skip("fio is not installed")


@contextlib.contextmanager
def _mounted(tmp: Path, path: str, size: int = 64 << 20, target_settings: dict[str, bool] | None = None
             ) -> Iterator[Stack]:
    """A stack whose mount runs on ``path``: ``enable_uring`` set for its INIT only."""
    before = ENABLE.read_text().strip()
    stack = Stack(tmp, size=size, target_settings=target_settings)
    try:
        ENABLE.write_text("Y" if path == "io_uring" else "N")
        try:
            stack.start()
        finally:
            ENABLE.write_text(before)
        yield stack
    finally:
        stack.stop()


def _mount_line(stack: Stack) -> str:
    """The mount's line of ``blockctl mounts``."""
    return next(line for line in stack.blockctl("mounts").stdout.splitlines() if str(stack.mnt) in line)


def _ring_requests(line: str) -> int:
    """The requests the ring served, from a ``blockctl mounts`` line ("...; N requests from the ring")."""
    return int(re.search(r"(\d+) requests from the ring", line).group(1))


def _busy_polls(line: str) -> tuple[int, int]:
    """The busy-polls begun and those in time, from a ``blockctl mounts`` line (none: absent)."""
    found = re.search(r"busy-polls (\d+), (\d+) in time", line)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def _fio(stack: Stack, *args: str) -> dict:
    proc = subprocess.run(["fio", "--name=j", f"--filename={stack.file}", "--direct=1", "--verify=crc32c",
                           "--verify_fatal=1", "--do_verify=1", "--verify_state_save=0", "--group_reporting",
                           "--output-format=json", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr + proc.stdout[-2000:] + stack.log("initiator")
    job = json.loads(proc.stdout[proc.stdout.index("{"):])["jobs"][0]  # after fio's warnings
    assert job["error"] == 0
    return job


def _workload(stack: Stack) -> str:
    """A fixed mix through the mount (aligned 4 KiB to 1 MiB writes, unaligned ones, a punched
    hole, fsyncs, reads back, names and statfs): the sha256 of what the file reads back."""
    rng = random.Random(42)
    assert os.listdir(stack.mnt) == ["ns1"]
    assert os.statvfs(stack.mnt).f_bsize > 0
    fd = os.open(stack.file, os.O_RDWR)
    try:
        for size in (4096, 128 << 10, 1 << 20):
            for _ in range(6):
                off = rng.randrange(0, (stack.size - size) // 4096) * 4096
                assert os.pwrite(fd, rng.randbytes(size), off) == size
        for _ in range(40):  # read-modify-write on the daemon's Python path
            off = rng.randrange(0, stack.size - 9000)
            n = rng.randrange(1, 9000)
            assert os.pwrite(fd, rng.randbytes(n), off) == n
        os.fsync(fd)
        assert _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                              ctypes.c_long(8 << 20), ctypes.c_long(1 << 20)) == 0
        digest = hashlib.sha256()
        for off in range(0, stack.size, 1 << 20):
            digest.update(os.pread(fd, 1 << 20, off))
        return digest.hexdigest()
    finally:
        os.close(fd)


def test_the_same_workload_leaves_the_same_bytes_on_both_paths(tmp_path: Path) -> None:
    seen: dict[str, tuple[str, str]] = {}
    for path in PATHS:
        with _mounted(tmp_path / path.replace("/", "_"), path) as stack:
            read_back = _workload(stack)
            with open(stack.backing, "rb") as f:
                on_target = hashlib.sha256(f.read()).hexdigest()
            line = _mount_line(stack)
            assert f"via {SERVED_BY[path]} " in line, line
            # the ring took the requests (not the kernel falling back to /dev/fuse), or none
            assert (_ring_requests(line) > 100) if SERVED_BY[path] == "io_uring" else _ring_requests(line) == 0, line
            seen[path] = (read_back, on_target)
    assert read_back == on_target
    assert seen["io_uring"] == seen["/dev/fuse"]


@pytest.mark.parametrize("path", PATHS)
def test_fio_verify_on_each_path(tmp_path: Path, path: str) -> None:
    with _mounted(tmp_path, path) as stack:
        job = _fio(stack, "--ioengine=libaio", "--iodepth=16", "--rw=randwrite", "--bs=4k",
                   "--size=16M", "--numjobs=1")
        assert job["write"]["io_bytes"] == 16 << 20 and job["read"]["io_bytes"] == 16 << 20
        # four writers, each on its own 8 MiB, big blocks: entries of both queues in use at once
        job = _fio(stack, "--ioengine=psync", "--rw=write", "--bsrange=128k-1m", "--size=8M",
                   "--offset_increment=8M", "--offset=16M", "--numjobs=4")
        assert job["write"]["io_bytes"] == 32 << 20 and job["read"]["io_bytes"] == 32 << 20
        line = _mount_line(stack)
        assert f"via {SERVED_BY[path]} " in line, line
        assert (_ring_requests(line) > 4096) if SERVED_BY[path] == "io_uring" else _ring_requests(line) == 0, line


def _writes(line: str) -> int:
    """The WRITE requests the mount served, from a ``blockctl mounts`` line ("... writes N errors ...")."""
    words = line.split()
    return int(words[words.index("writes") + 1])


@pytest.mark.parametrize("path", PATHS)
def test_a_1mib_direct_write_arrives_as_one_request(tmp_path: Path, path: str) -> None:
    """INIT grants max_write 1 MiB with FUSE_MAX_PAGES (256 pages), so the kernel hands a 1 MiB
    O_DIRECT write over whole: one WRITE request, one NVMe Write. Without the flag the kernel keeps
    its 32-page default and the same write comes as eight 128 KiB requests, each its own round
    trip to the target (nbdfuse's libfuse asks for the same 1 MiB)."""
    with _mounted(tmp_path, path) as stack:
        before = _writes(_mount_line(stack))
        data = random.Random(7).randbytes(8 << 20)
        buf = mmap.mmap(-1, 1 << 20)  # page-aligned, as O_DIRECT wants
        fd = os.open(stack.file, os.O_WRONLY | os.O_DIRECT)
        try:
            for i in range(8):
                buf[:] = data[i << 20:(i + 1) << 20]
                assert os.pwrite(fd, buf, (4 << 20) + (i << 20)) == 1 << 20
        finally:
            os.close(fd)
        line = _mount_line(stack)
        assert _writes(line) - before == 8, line
        with open(stack.backing, "rb") as f:
            f.seek(4 << 20)
            assert f.read(8 << 20) == data


def _qd1_reads(stack: Stack, count: int) -> None:
    """``count`` 4 KiB O_DIRECT reads, one after the other."""
    buf = mmap.mmap(-1, 4096)
    fd = os.open(stack.file, os.O_RDONLY | os.O_DIRECT)
    try:
        for i in range(count):
            assert os.preadv(fd, [buf], (i * 4096) % (32 << 20)) == 4096
    finally:
        os.close(fd)


def _pin(pid: int, cpus: set[int]) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), cpus)


@pytest.mark.parametrize("path", PATHS)
def test_qd1_requests_are_awaited_by_a_bounded_busy_poll_on_the_ring(tmp_path: Path, path: str) -> None:
    """Once it answered the last request in flight through the ring, the loop spins a while for
    the next one (``FuseLoop.busy_poll_ns``, on by default): after each QD1 read one busy-poll,
    and some see the next read in time; on /dev/fuse none (measured no faster there), nor on the
    Python plane (BLOCKD_PURE=1: the busy-poll is the compiled loop's, and the mount runs on
    /dev/fuse). Pinned to one CPU it does not spin (the spin would hold the CPU the reader needs);
    it looks at its CPUs again every 4,096 busy-polls, so the pinned reads outnumber that."""
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    with _mounted(tmp_path, path) as stack:
        _qd1_reads(stack, 2000)
        spins, in_time = _busy_polls(_mount_line(stack))
        if SERVED_BY[path] == "/dev/fuse":
            assert spins == 0 and "via /dev/fuse " in _mount_line(stack), _mount_line(stack)
            return
        assert spins >= 1900 and in_time > 0, _mount_line(stack)
        _pin(stack.initiator.pid, {min(cpus)})
        try:
            _qd1_reads(stack, 12000)
            pinned, _ = _busy_polls(_mount_line(stack))
        finally:
            _pin(stack.initiator.pid, cpus)
        assert pinned - spins <= 4096 + 100, (spins, pinned)


def _rings(pid: int) -> int:
    """io_uring instances a process holds open (each queue thread's ring, on the target)."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:[io_uring]"
    return count


def test_fio_verify_with_io_uring_on_both_ends(tmp_path: Path) -> None:
    """Issue 42's two rings together: the mount on FUSE over io_uring, the target's queue threads
    on io_uring (``[target] io_uring_queues``, target/_uring_loop.pyx); fio writes and verifies at
    queue depth 1 and 16. The target says which loop it chose, and its queue threads hold rings.
    On the Python plane (BLOCKD_PURE=1) the same settings must run both fallbacks, said as such:
    the /dev/fuse mount, and the target's log naming why its queues are not on io_uring (not a
    count of rings: the event loop may hold one of its own there)."""
    with _mounted(tmp_path, "io_uring", target_settings={"io_uring_queues": True}) as stack:
        if not COMPILED:
            assert "not running on this plane" in stack.log("target")
            job = _fio(stack, "--ioengine=libaio", "--iodepth=16", "--rw=randwrite", "--bs=4k", "--size=8M",
                       "--numjobs=1")
            assert job["write"]["io_bytes"] == 8 << 20 and job["read"]["io_bytes"] == 8 << 20
            assert "via /dev/fuse " in _mount_line(stack)
            return
        assert "NVMe/TCP queue threads on io_uring" in stack.log("target")
        job = _fio(stack, "--ioengine=psync", "--rw=randwrite", "--bs=4k", "--size=8M", "--numjobs=1")
        assert job["write"]["io_bytes"] == 8 << 20 and job["read"]["io_bytes"] == 8 << 20
        job = _fio(stack, "--ioengine=libaio", "--iodepth=16", "--rw=randwrite", "--bs=4k", "--size=8M",
                   "--offset=8M", "--numjobs=1")
        assert job["write"]["io_bytes"] == 8 << 20 and job["read"]["io_bytes"] == 8 << 20
        assert _rings(stack.target.pid) >= stack.nr_io_queues  # one per queue thread (the loop may hold one more)
        line = _mount_line(stack)
        assert "via io_uring " in line and _ring_requests(line) > 4096, line
