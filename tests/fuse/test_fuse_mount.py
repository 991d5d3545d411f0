"""``blockctl mount``: namespaces as files through FUSE, against real daemons."""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import errno
import json
import mmap
import os
import random
import shutil
import signal
import subprocess
import threading
import time

import pytest

from blockd_stack import Stack, mounted

FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE = 1, 2, 0x10
SEEK_DATA, SEEK_HOLE = 3, 4
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    if _libc.fallocate(fd, mode, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def need_fio() -> None:
    if shutil.which("fio") is None:
        pytest.skip("fio is not installed")


def backing(stack: Stack, offset: int, length: int) -> bytes:
    with open(stack.backing, "rb") as f:
        f.seek(offset)
        return f.read(length)


def test_mount_shows_each_namespace_as_a_file(stack: Stack) -> None:
    assert os.listdir(stack.mnt) == ["ns1"]
    st = os.stat(stack.file)
    assert st.st_size == stack.size
    assert str(stack.mnt) in stack.blockctl("mounts").stdout
    with pytest.raises(FileNotFoundError):
        os.stat(stack.mnt / "ns2")


def test_write_read_unaligned(stack: Stack) -> None:
    rng = random.Random(1)
    base = 1 << 20
    span = 256 << 10
    model = bytearray(backing(stack, base, span))
    fd = os.open(stack.file, os.O_RDWR)
    try:
        for _ in range(200):
            off = rng.randrange(0, span - 1)
            n = rng.randrange(1, min(9000, span - off))
            data = rng.randbytes(n)
            assert os.pwrite(fd, data, base + off) == n
            model[off:off + n] = data
        os.fsync(fd)
        assert os.pread(fd, span, base) == bytes(model)
    finally:
        os.close(fd)
    assert backing(stack, base, span) == bytes(model)
    # reads at odd offsets and past the end of the file
    fd = os.open(stack.file, os.O_RDONLY | os.O_DIRECT)
    try:
        assert os.pread(fd, 777, base + 13) == bytes(model[13:790])
        assert os.pread(fd, 4096, stack.size - 100) == backing(stack, stack.size - 100, 100)
        assert os.pread(fd, 4096, stack.size) == b""
    finally:
        os.close(fd)


def test_o_direct_bypasses_the_page_cache(stack: Stack) -> None:
    off = 3 << 20
    buf = mmap.mmap(-1, 1 << 16)
    buf.write(os.urandom(1 << 16))
    fd = os.open(stack.file, os.O_RDWR | os.O_DIRECT)
    try:
        assert os.pwritev(fd, [buf], off) == 1 << 16
        assert backing(stack, off, 1 << 16) == bytes(buf)  # no page cache held it back
        # change the volume behind the mount's back: an O_DIRECT read must see it
        with open(stack.backing, "r+b") as f:
            f.seek(off)
            f.write(b"\xab" * 4096)
        out = mmap.mmap(-1, 4096)
        assert os.preadv(fd, [out], off) == 4096
        assert bytes(out) == b"\xab" * 4096
    finally:
        os.close(fd)


def test_fsync_and_fdatasync(stack: Stack) -> None:
    fd = os.open(stack.file, os.O_RDWR)
    try:
        os.pwrite(fd, b"durable" * 100, 5 << 20)
        os.fsync(fd)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    assert backing(stack, 5 << 20, 700) == b"durable" * 100


def test_an_fsync_waits_out_a_reconnect_and_fails_eio_once_the_controller_gives_up(fresh_stack: Stack) -> None:
    """An fsync is a Flush the controller holds while it reconnects: the caller waits, then
    gets its answer; once ``ctrl_loss_tmo`` passes without the target, EIO."""
    s = fresh_stack.start()
    fd = os.open(s.file, os.O_RDWR)
    try:
        os.fsync(fd)
        s.stop_target(signal.SIGKILL)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(os.fsync, fd)
            time.sleep(1)
            assert not waiting.done()
            s.start_target()
            assert waiting.result(timeout=30) is None
            s.stop_target(signal.SIGKILL)
            with pytest.raises(OSError) as exc:
                pool.submit(os.fsync, fd).result(timeout=30)
            assert exc.value.errno == errno.EIO
    finally:
        os.close(fd)


def test_punch_hole_deallocates_on_the_target(stack: Stack) -> None:
    off, length = 8 << 20, 4 << 20
    fd = os.open(stack.file, os.O_RDWR)
    try:
        os.pwrite(fd, b"\x5a" * (length + 2048), off - 1024)
        os.fsync(fd)
        before = os.stat(stack.backing).st_blocks
        fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off - 100, length + 200)  # unaligned edges
        assert os.pread(fd, length + 200, off - 100) == bytes(length + 200)
        assert os.pread(fd, 924, off - 1024) == b"\x5a" * 924
        assert os.pread(fd, 824, off + length + 100) == b"\x5a" * 824
    finally:
        os.close(fd)
    assert os.stat(stack.backing).st_blocks < before - (3 << 20) // 512
    with open(stack.backing, "rb") as f:
        hole = os.lseek(f.fileno(), off - 100, SEEK_HOLE)
        assert off - 100 <= hole < off + 4096
    with pytest.raises(OSError) as exc:  # punching needs KEEP_SIZE, as on any file
        fd = os.open(stack.file, os.O_RDWR)
        try:
            fallocate(fd, FALLOC_FL_PUNCH_HOLE, 0, 4096)
        finally:
            os.close(fd)
    assert exc.value.errno == errno.EOPNOTSUPP


def test_zero_range(stack: Stack) -> None:
    off = 16 << 20
    fd = os.open(stack.file, os.O_RDWR)
    try:
        os.pwrite(fd, b"\xff" * (3 << 20), off)
        fallocate(fd, FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE, off + 333, (2 << 20) + 1000)
        data = os.pread(fd, 3 << 20, off)
    finally:
        os.close(fd)
    assert data[:333] == b"\xff" * 333
    assert data[333:333 + (2 << 20) + 1000] == bytes((2 << 20) + 1000)
    assert data[333 + (2 << 20) + 1000:] == b"\xff" * ((1 << 20) - 1333)
    assert backing(stack, off, 3 << 20) == data


def test_concurrent_unaligned_writers_share_blocks(stack: Stack) -> None:
    """Eight threads write interleaved 100-byte slots of the same blocks: read-modify-write must
    not lose any of them."""
    base, slot, threads, rounds = 20 << 20, 100, 8, 40
    expect = bytearray(slot * threads * rounds)
    errors: list[BaseException] = []

    def writer(i: int) -> None:
        try:
            fd = os.open(stack.file, os.O_RDWR | (os.O_DIRECT if i % 2 else 0))
            try:
                for r in range(rounds):
                    pos = (r * threads + i) * slot
                    data = bytes([i + 1]) * slot
                    os.pwrite(fd, data, base + pos)
                    expect[pos:pos + slot] = data
            finally:
                os.close(fd)
        except BaseException as exc:
            errors.append(exc)

    ts = [threading.Thread(target=writer, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    fd = os.open(stack.file, os.O_RDONLY | os.O_DIRECT)
    try:
        assert os.pread(fd, len(expect), base) == bytes(expect)
    finally:
        os.close(fd)


def test_fio_verify_through_the_mount(stack: Stack) -> None:
    need_fio()
    proc = subprocess.run(["fio", "--name=verify", f"--filename={stack.file}", "--direct=1",
                           "--ioengine=libaio", "--iodepth=16", "--rw=randwrite", "--bs=4k",
                           "--offset=32M", "--size=16M", "--numjobs=1", "--verify=crc32c",
                           "--verify_fatal=1", "--do_verify=1", "--verify_state_save=0", "--output-format=json"],
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr + proc.stdout[-2000:]
    job = json.loads(proc.stdout)["jobs"][0]
    assert job["error"] == 0
    assert job["write"]["io_bytes"] == 16 << 20
    assert job["read"]["io_bytes"] == 16 << 20  # the verify pass read everything back


def test_fio_parallel_jobs(stack: Stack) -> None:
    need_fio()
    proc = subprocess.run(["fio", "--name=par", f"--filename={stack.file}", "--direct=1",
                           "--ioengine=psync", "--rw=randrw", "--bs=4k", "--offset=48M", "--size=8M",
                           "--numjobs=4", "--runtime=2", "--time_based", "--group_reporting",
                           "--output-format=json"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    job = json.loads(proc.stdout)["jobs"][0]
    assert job["error"] == 0 and job["read"]["total_ios"] > 0 and job["write"]["total_ios"] > 0


def test_umount_refuses_busy_then_unmounts(stack: Stack) -> None:
    fd = os.open(stack.file, os.O_RDONLY)
    try:
        busy = stack.blockctl("umount", str(stack.mnt), check=False)
        assert busy.returncode == 1 and "busy" in busy.stderr
    finally:
        os.close(fd)
    stack.blockctl("umount", str(stack.mnt))
    assert not mounted(stack.mnt)
    assert not os.path.exists(stack.file)
    stack.mount()  # and it mounts again
    assert os.path.getsize(stack.file) == stack.size


def test_sigterm_unmounts(fresh_stack: Stack) -> None:
    s = fresh_stack.start()
    fd = os.open(s.file, os.O_RDONLY)  # even with a file open
    try:
        s.initiator.send_signal(signal.SIGTERM)
        assert s.initiator.wait(15) == 0
        assert not mounted(s.mnt)
        with pytest.raises(OSError):
            os.pread(fd, 512, 0)
    finally:
        try:
            os.close(fd)
        except OSError as exc:  # the FLUSH of close() cannot reach a detached mount
            assert exc.errno == errno.ENOTCONN


def test_target_restart_mid_io_never_corrupts(fresh_stack: Stack) -> None:
    """A writer keeps writing numbered 4 KiB records while the target is killed and restarted:
    each write succeeds (retried after reconnecting) or fails with EIO; every record that
    succeeded reads back intact, and the mount works afterwards."""
    s = fresh_stack.start()
    records = 2048
    done: dict[int, bytes] = {}
    failures: list[int] = []
    errors: list[BaseException] = []
    """What ended the writer thread early: an assertion there fails the test, not only the thread."""
    stop = threading.Event()

    def writer() -> None:
        try:
            write_records()
        except BaseException as exc:
            errors.append(exc)

    def write_records() -> None:
        fd = os.open(s.file, os.O_RDWR | os.O_DIRECT)
        buf = mmap.mmap(-1, 4096)
        n = 0
        try:
            while not stop.is_set():
                rec = n % records
                payload = (b"%08d:" % n) * (4096 // 9) + bytes(4096 % 9)
                buf.seek(0)
                buf.write(payload)
                try:
                    os.pwritev(fd, [buf], rec * 4096)
                    done[rec] = payload
                except OSError as exc:
                    assert exc.errno in (errno.EIO, errno.EINTR), exc
                    failures.append(rec)
                    done.pop(rec, None)  # old or new content: unknown, not checked
                n += 1
        finally:
            os.close(fd)

    t = threading.Thread(target=writer)
    t.start()
    time.sleep(1)
    s.stop_target(signal.SIGKILL)
    time.sleep(1.5)
    s.start_target()
    time.sleep(2)
    stop.set()
    t.join(30)
    assert not t.is_alive()
    assert not errors, f"the writer thread failed: {errors[0]!r}"
    assert len(done) > 100
    fd = os.open(s.file, os.O_RDWR | os.O_DIRECT)
    try:
        for rec, payload in done.items():
            assert os.pread(fd, 4096, rec * 4096) == payload, f"record {rec} corrupt"
        # the mount works afterwards: a new record written now reads back
        after = mmap.mmap(-1, 4096)
        after.write(b"after the restart".ljust(4096, b"."))
        assert os.pwritev(fd, [after], records * 4096) == 4096
        assert os.pread(fd, 4096, records * 4096) == bytes(after)
    finally:
        os.close(fd)
    assert "reconnected" in s.log("initiator", 200)


def test_lost_connection_gives_eio_and_mount_recovers(fresh_stack: Stack) -> None:
    s = fresh_stack.start()  # ctrl_loss_tmo 4 s
    fd = os.open(s.file, os.O_RDWR | os.O_DIRECT)
    try:
        os.pwrite(fd, b"A" * 4096, 0)
        s.stop_target(signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(OSError) as exc:
            os.pread(fd, 4096, 0)
        assert exc.value.errno == errno.EIO
        assert time.monotonic() - t0 < 15
        with pytest.raises(OSError) as exc:  # fails fast once the connection is given up
            os.pwrite(fd, b"B" * 4096, 0)
        assert exc.value.errno == errno.EIO
        # the target comes back; the user reconnects under the same name: the mount works again
        s.start_target()
        s.blockctl("disconnect", "vol")
        s.connect()
        assert os.pread(fd, 4096, 0) == b"A" * 4096
        os.pwrite(fd, b"C" * 4096, 4096)
        assert os.pread(fd, 4096, 4096) == b"C" * 4096
    finally:
        os.close(fd)
