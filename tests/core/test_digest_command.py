"""blockd's Digest command served by the target (target/digest.py), through the host library
over a real socket on 127.0.0.1: a digest per chunk, the checks' statuses, a read error, and
the Commands Supported and Effects log that advertises it."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import xxhash

from initiator.controller import Controller
from initiator.errors import NvmeError
from initiator.replica import serves_digests
from protocol.commands import digest_command
from protocol.constants import IoOpcode, LogPageId
from protocol.digest import DigestAlgorithm, digest_length
from protocol.logpage import COMMANDS_EFFECTS_LOG, COMMANDS_EFFECTS_LOG_SIZE, EFFECTS_CSUPP, EFFECTS_LBCC
from protocol.status import Status
from target import digest as digest_mod

from .conftest import NQN, config, connect, fill_file, free_port, ns, run, serving, sub

SIZE = 8 << 20
BLOCK = 512
XXH3 = DigestAlgorithm.XXH3_128


async def digests(ctrl: Controller, slba: int, blocks: int, chunk: int, algorithm: int = XXH3,
                  length: int | None = None) -> bytes:
    buf = bytearray(digest_length(blocks, chunk) if length is None else length)
    await ctrl.io_command(digest_command(1, slba, blocks - 1, chunk, algorithm), data_in=memoryview(buf))
    return bytes(buf)


def expected(data: bytes, slba: int, blocks: int, chunk: int) -> bytes:
    start, end, step = slba * BLOCK, (slba + blocks) * BLOCK, chunk * BLOCK
    return b"".join(xxhash.xxh3_128_digest(data[at:min(at + step, end)]) for at in range(start, end, step))


@pytest.mark.parametrize("slba,blocks,chunk", [
    (0, 1, 1),  # one block
    (8, 300, 128),  # two whole chunks and a short one
    (5, 6000, 4000),  # pieces of target.digest.PIECE end inside a chunk
    (0, SIZE // BLOCK, 128),  # the whole namespace: 8 pieces, 128 digests
])
def test_a_digest_per_chunk_of_the_namespace_s_data(tmp_path: Path, slba: int, blocks: int, chunk: int) -> None:
    data = fill_file(tmp_path / "a.img", SIZE)
    port = free_port()

    async def main() -> None:
        async with serving(config([port], [sub(namespaces=[ns(tmp_path / "a.img")])])):
            ctrl = await connect(port)
            try:
                assert await digests(ctrl, slba, blocks, chunk) == expected(data, slba, blocks, chunk)
            finally:
                await ctrl.close()
    run(main())


def test_the_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A range past the namespace's end: LBA Out of Range; a chunk of 0 blocks or an unknown
    algorithm: Invalid Field; a transfer that is not one digest per chunk: SGL Invalid Data
    Length. Nothing of it runs (no backend read, by the Python loop or the compiled one)."""
    fill_file(tmp_path / "a.img", SIZE)
    port = free_port()
    last = SIZE // BLOCK - 1

    async def main() -> None:
        async with serving(config([port], [sub(namespaces=[ns(tmp_path / "a.img")])])) as service:
            ctrl = await connect(port)
            backend = service.target.subsystems[NQN].namespaces[1].backend
            reads = []
            real = backend.read_into

            async def counted(offset: int, buf: memoryview) -> None:
                reads.append(offset)
                await real(offset, buf)
            backend.read_into = counted
            real_hash = digest_mod.hash_file

            async def counted_hash(file: object, offset: int, *args: object) -> None:
                reads.append(offset)
                await real_hash(file, offset, *args)  # type: ignore[arg-type]
            monkeypatch.setattr(digest_mod, "hash_file", counted_hash)
            try:
                cases = [
                    (dict(slba=last, blocks=2, chunk=1), Status.LBA_RANGE),
                    (dict(slba=last + 1, blocks=1, chunk=1), Status.LBA_RANGE),
                    (dict(slba=0, blocks=8, chunk=0, length=16), Status.INVALID_FIELD),
                    (dict(slba=0, blocks=8, chunk=8, algorithm=0), Status.INVALID_FIELD),
                    (dict(slba=0, blocks=8, chunk=8, algorithm=2), Status.INVALID_FIELD),
                    (dict(slba=0, blocks=9, chunk=8, length=16), Status.SGL_INVALID_DATA_LENGTH),
                    (dict(slba=0, blocks=8, chunk=8, length=32), Status.SGL_INVALID_DATA_LENGTH),
                ]
                for kw, status in cases:
                    with pytest.raises(NvmeError) as err:
                        await digests(ctrl, **kw)
                    assert err.value.status == status, (kw, err.value)
                assert reads == []
                assert len(await digests(ctrl, last, 1, 1)) == 16 and reads  # the edge itself is inside
            finally:
                await ctrl.close()
    run(main())


def test_a_backend_read_error_fails_it_as_a_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend fails a read in the range's second piece (while the first is hashed):
    Unrecovered Read Error, the status Controller._read gives an EIO, and the target serves on.
    The Python loop's case (the error is injected into ``read_into``, which the compiled loop of
    a plain file does not call): the next test fails both."""
    monkeypatch.setattr(digest_mod, "_file_digests", None)
    fill_file(tmp_path / "a.img", SIZE)
    port = free_port()
    bad = digest_mod.PIECE + 4096

    async def main() -> None:
        async with serving(config([port], [sub(namespaces=[ns(tmp_path / "a.img")])])) as service:
            ctrl = await connect(port)
            backend = service.target.subsystems[NQN].namespaces[1].backend
            real = backend.read_into

            async def failing(offset: int, buf: memoryview) -> None:
                if offset <= bad < offset + len(buf):
                    raise OSError(errno.EIO, "injected")
                await real(offset, buf)
            backend.read_into = failing
            try:
                with pytest.raises(NvmeError) as err:
                    await digests(ctrl, 0, 4 * digest_mod.PIECE // BLOCK, 128)
                assert err.value.status == Status.UNRECOVERED_READ_ERROR
                assert len(await digests(ctrl, 0, 64, 64)) == 16  # before the bad block: served
            finally:
                await ctrl.close()
    run(main())


def test_a_file_truncated_under_it_fails_it_as_a_read(tmp_path: Path) -> None:
    """The namespace's file shrank under the target: a range past its new end is Unrecovered
    Read Error (the short read's EIO), on either plane (the compiled loop reads a plain file,
    the Python one under BLOCKD_PURE=1), and a range before it is still served."""
    data = fill_file(tmp_path / "a.img", SIZE)
    port = free_port()

    async def main() -> None:
        async with serving(config([port], [sub(namespaces=[ns(tmp_path / "a.img")])])):
            ctrl = await connect(port)
            try:
                os.truncate(tmp_path / "a.img", SIZE // 2 + 4096)
                with pytest.raises(NvmeError) as err:
                    await digests(ctrl, 0, SIZE // BLOCK, 128)
                assert err.value.status == Status.UNRECOVERED_READ_ERROR
                blocks = SIZE // 2 // BLOCK
                assert await digests(ctrl, 0, blocks, 128) == expected(data, 0, blocks, 128)
            finally:
                await ctrl.close()
    run(main())


def test_the_effects_log_lists_the_command(tmp_path: Path) -> None:
    """Commands Supported and Effects (05h): CSUPP for Read and the Digest command, LBCC for
    Write, nothing for an opcode the target does not have; a host finds it (serves_digests)."""
    fill_file(tmp_path / "a.img", SIZE)
    port = free_port()

    async def main() -> None:
        async with serving(config([port], [sub(namespaces=[ns(tmp_path / "a.img")])])):
            ctrl = await connect(port)
            try:
                log = COMMANDS_EFFECTS_LOG.parse(await ctrl.get_log_page(LogPageId.COMMANDS_EFFECTS,
                                                                         COMMANDS_EFFECTS_LOG_SIZE))
                assert log.iocs[IoOpcode.BLOCKD_DIGEST] == EFFECTS_CSUPP
                assert log.iocs[IoOpcode.READ] == EFFECTS_CSUPP
                assert log.iocs[IoOpcode.WRITE] == EFFECTS_CSUPP | EFFECTS_LBCC
                assert log.iocs[0x83] == 0 and log.acs[0x06] == EFFECTS_CSUPP  # Identify
                assert await serves_digests(ctrl)
            finally:
                await ctrl.close()
    run(main())


def test_a_controller_without_the_command_is_not_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A blockd whose controllers lack the command (as the kernel's nvmet): its effects log has
    no CSUPP for it, so a host does not send it (serves_digests False: a verify reads the data
    instead); sent anyway, it gets Invalid Command Opcode."""
    from target.controller import Controller as TargetController
    real_init = TargetController.__init__

    def without_digest(self: TargetController, *args: object, **kw: object) -> None:
        real_init(self, *args, **kw)
        del self.io_commands[IoOpcode.BLOCKD_DIGEST]
    monkeypatch.setattr(TargetController, "__init__", without_digest)
    fill_file(tmp_path / "a.img", SIZE)
    port = free_port()

    async def main() -> None:
        async with serving(config([port], [sub(namespaces=[ns(tmp_path / "a.img")])])):
            ctrl = await connect(port)
            try:
                assert not await serves_digests(ctrl)
                with pytest.raises(NvmeError) as err:
                    await digests(ctrl, 0, 8, 8)
                assert err.value.status == Status.INVALID_OPCODE
            finally:
                await ctrl.close()
    run(main())
