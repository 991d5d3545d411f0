"""Backends say what they can do, Identify says only that, and filters stack on backends.

Driven through the whole target core with the fake transport of ``test_sans_io``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from protocol.constants import ONCS_DSM, ONCS_RESERVATIONS, ONCS_WRITE_ZEROES
from protocol.nvme import build_sqe
from protocol.status import MORE, Status, to_wire
from target.backend import FileBackend, MemoryBackend
from target.filter import BackendFilter
from target.queue import TargetQueue
from target.target import Target

from .conftest import incapsule_sgl, transport_sgl
from .test_sans_io import BLOCKS, admin_and_io, complete, run, rw_sqe

FUA = 1 << 30
DEAC = 1 << 25
"""CDW12 bit 25 of Write Zeroes: the controller may deallocate the range."""
"""CDW12 bit 30: FUA (bit 14 of the control word in the upper half)."""


class CountingFilter(BackendFilter):
    """Counts what reaches the backend below: flushes and writes with FUA."""

    def __init__(self, inner: BackendFilter | MemoryBackend) -> None:
        super().__init__(inner)
        self.flushes = 0
        self.fua_writes = 0

    async def write(self, offset: int, data: memoryview | bytes, fua: bool = False) -> None:
        self.fua_writes += fua
        await super().write(offset, data, fua)

    async def flush(self) -> None:
        self.flushes += 1
        await super().flush()


class NoFua(BackendFilter):
    can_fua = False


class Plain(BackendFilter):
    """A disk without a volatile cache, trim or write zeroes."""

    can_trim = can_zero = can_fua = can_flush = False


class ReadOnly(BackendFilter):
    read_only = True


def identify(admin: TargetQueue, cns: int, nsid: int = 0) -> bytes:
    status, _, data = complete(admin, build_sqe(0x06, 50 + cns, nsid=nsid, dptr=transport_sgl(4096), cdw10=cns))
    assert status == 0
    return data


def oncs_vwc(admin: TargetQueue) -> tuple[int, int]:
    data = identify(admin, 1)
    return int.from_bytes(data[520:522], "little"), data[525]


def test_filter_forwards_and_counts_flush_and_fua() -> None:
    def body() -> Target:
        counter = CountingFilter(MemoryBackend(BLOCKS * 512))
        target, _, admin, io = admin_and_io(counter)
        assert oncs_vwc(admin) == (ONCS_DSM | ONCS_WRITE_ZEROES | ONCS_RESERVATIONS, 1)
        assert complete(io, rw_sqe(0x01, 1, 2, 1, incapsule_sgl(512), cdw12_extra=FUA), b"\7" * 512)[0] == 0
        assert complete(io, rw_sqe(0x01, 2, 3, 1, incapsule_sgl(512)), b"\7" * 512)[0] == 0
        assert complete(io, build_sqe(0x00, 3, nsid=1, dptr=transport_sgl(0)))[0] == 0
        assert complete(io, build_sqe(0x00, 4, nsid=0xFFFFFFFF, dptr=transport_sgl(0)))[0] == 0
        assert (counter.fua_writes, counter.flushes) == (1, 2)
        assert counter.inner.data[1024:2048] == b"\7" * 1024  # forwarded to the backend below
        return target
    run(body)


def test_fua_without_native_fua_is_a_write_then_a_flush() -> None:
    def body() -> Target:
        counter = CountingFilter(NoFua(MemoryBackend(BLOCKS * 512)))
        target, _, admin, io = admin_and_io(NoFua(counter))
        assert complete(io, rw_sqe(0x01, 1, 0, 1, incapsule_sgl(512), cdw12_extra=FUA), b"\1" * 512)[0] == 0
        assert (counter.fua_writes, counter.flushes) == (0, 1)
        return target
    run(body)


def test_identify_and_commands_follow_what_the_backend_can_do() -> None:
    def body() -> Target:
        counter = CountingFilter(MemoryBackend(BLOCKS * 512))
        target, _, admin, io = admin_and_io(Plain(counter))
        assert oncs_vwc(admin) == (ONCS_RESERVATIONS, 0)  # the core serves reservations on any backend
        assert identify(admin, 0, nsid=1)[33] == 0  # DLFEAT: deallocated blocks read as anything
        counter.inner.data[:512] = b"\xee" * 512
        status, _, _ = complete(io, rw_sqe(0x08, 1, 0, 1, transport_sgl(0)))
        assert status == to_wire(Status.INVALID_OPCODE | MORE)
        dsm = build_sqe(0x09, 2, nsid=1, dptr=incapsule_sgl(16), cdw10=0, cdw11=1 << 2)
        rng = (0).to_bytes(4, "little") + (1).to_bytes(4, "little") + (0).to_bytes(8, "little")
        assert complete(io, dsm, rng)[0] == 0  # a deallocate is a hint: done by nothing
        assert complete(io, build_sqe(0x00, 3, nsid=1, dptr=transport_sgl(0)))[0] == 0
        assert counter.inner.data[:512] == b"\xee" * 512 and counter.flushes == 0
        assert complete(io, rw_sqe(0x01, 4, 0, 1, incapsule_sgl(512), cdw12_extra=FUA), b"\2" * 512)[0] == 0
        assert (counter.fua_writes, counter.flushes) == (0, 0)  # no cache: durable already
        return target
    run(body)


def test_read_only_is_the_backends() -> None:
    def body() -> Target:
        backend = ReadOnly(MemoryBackend(BLOCKS * 512))
        target, _, admin, io = admin_and_io(backend)
        assert target.subsystems[next(n for n in target.subsystems if "test" in n)].namespaces[1].read_only
        assert identify(admin, 0, nsid=1)[99] & 1  # NSATTR write protected
        status, _, _ = complete(io, rw_sqe(0x01, 1, 0, 1, incapsule_sgl(512)), b"\3" * 512)
        assert status == to_wire(Status.NS_WRITE_PROTECTED | MORE)
        assert complete(io, rw_sqe(0x02, 2, 0, 1, transport_sgl(512)))[0] == 0
        return target
    run(body)


def dsm_deallocate(io: TargetQueue, cid: int, slba: int, nlb: int) -> int:
    """One Dataset Management deallocate range; its wire status."""
    sqe = build_sqe(0x09, cid, nsid=1, dptr=incapsule_sgl(16), cdw10=0, cdw11=1 << 2)
    return complete(io, sqe, bytes(4) + nlb.to_bytes(4, "little") + slba.to_bytes(8, "little"))[0]


def test_write_zeroes_with_deac_punches_a_file_and_without_it_zeroes_in_place(tmp_path: Path) -> None:
    """A file says deallocated blocks read as zeroes (DLFEAT 0x09), so a Write Zeroes with DEAC
    punches its range (a resync's hole keeps a thin replica thin), and one without DEAC zeroes
    in place, keeping the blocks (tmp_path's file system has both fallocate modes)."""
    path = tmp_path / "ns.img"
    path.write_bytes(b"\x5a" * (2 << 20))
    backend = FileBackend(str(path))
    half = (1 << 20) // 512

    def body() -> Target:
        target, _, admin, io = admin_and_io(backend)
        assert identify(admin, 0, nsid=1)[33] == 0x09
        assert complete(io, rw_sqe(0x08, 1, 0, half, transport_sgl(0)))[0] == 0
        assert complete(io, rw_sqe(0x08, 2, half, half, transport_sgl(0), cdw12_extra=DEAC))[0] == 0
        return target
    try:
        run(body)
    finally:
        backend.close()
    assert path.read_bytes() == bytes(2 << 20)
    allocated = path.stat().st_blocks * 512
    assert 1 << 20 <= allocated <= (1 << 20) + (64 << 10), allocated  # the first MiB kept, the second punched


@contextlib.contextmanager
def loop_device(backing: Path) -> Iterator[str]:
    dev = subprocess.run(["losetup", "-f", "--show", str(backing)], check=True, capture_output=True,
                         text=True).stdout.strip()
    try:
        yield dev
    finally:
        subprocess.run(["losetup", "-d", dev], check=True)


@contextlib.contextmanager
def ramfs(where: Path) -> Iterator[Path]:
    """A ramfs mount: its files have no fallocate, so a loop device over one has neither
    discard nor Write Zeroes."""
    where.mkdir()
    subprocess.run(["mount", "-t", "ramfs", "ramfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("losetup") is None, reason="loop devices need root")
def test_a_block_device_promises_zeroes_only_where_its_deallocate_zeroes(tmp_path: Path) -> None:
    """Two loop devices. Over a file of tmp_path's file system the device has Write Zeroes: DLFEAT
    says deallocated blocks read as zeroes, and a deallocate zeroes them. Over a ramfs file it has
    no Write Zeroes: DLFEAT 0 (a BLKDISCARD may leave the old data; blockd does not promise
    zeroes it cannot give), and a deallocate is the hint that does nothing."""
    data = b"\x5a" * (1 << 20)
    (tmp_path / "disk.img").write_bytes(data)

    def namespace(dev: str, dlfeat: int, after: bytes) -> None:
        backend = FileBackend(dev)

        def body() -> Target:
            target, _, admin, io = admin_and_io(backend)
            assert identify(admin, 0, nsid=1)[33] == dlfeat
            assert dsm_deallocate(io, 1, 0, 128) == 0
            assert os.pread(backend.fd, 64 << 10, 0) == after
            assert os.pread(backend.fd, 512, 64 << 10) == data[:512]
            return target
        try:
            run(body)
        finally:
            backend.close()
    with ramfs(tmp_path / "ram") as ram:
        (ram / "disk.img").write_bytes(data)
        with loop_device(tmp_path / "disk.img") as zeroing, loop_device(ram / "disk.img") as plain:
            namespace(zeroing, 0x09, bytes(64 << 10))
            namespace(plain, 0, data[:64 << 10])
