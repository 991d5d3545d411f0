"""The compiled FUSE request loop (``initiator/fuse/_loop.pyx``) against its Python reference:
the same random request streams, fed through a SEQPACKET pair standing in for /dev/fuse, must
get the same replies in the same order and leave the same bytes in the controller's store."""

from __future__ import annotations

import asyncio
import random
import socket
from typing import Any

import pytest

from initiator.controller import NamespaceInfo
from initiator.fuse import blockfile
from initiator.fuse import session as session_module
from initiator.fuse.abi import FORGET, FSYNC, FSYNC_IN, GETATTR, IN_HEADER, OUT_HEADER, RW_IN, WRITE
from initiator.fuse.session import COPY_LIMIT, MAX_BATCH, FuseSession
from protocol.commands import flush_command

from .conftest import run
from .test_fuse_loop import BS, _interrupt, _RamCtrl, _read, _write

_loop = pytest.importorskip("initiator.fuse._loop", reason="compiled data plane not built")
_rangelock = pytest.importorskip("initiator.fuse._rangelock", reason="compiled data plane not built")


@pytest.fixture(autouse=True)
def _compiled_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled loop is there to compare even under BLOCKD_PURE=1 (which leaves it unused),
    with the compiled range locks it runs with (it cimports them; the Python loop takes either)."""
    monkeypatch.setattr(session_module, "FuseLoop", _loop.FuseLoop)
    monkeypatch.setattr(blockfile, "RangeLocks", _rangelock.RangeLocks)


BLOCKS = 64
SIZE = BLOCKS * BS


class _Ctrl(_RamCtrl):
    """The tests' RAM controller with a read-only second namespace and Flush."""

    def __init__(self) -> None:
        super().__init__(blocks=BLOCKS)
        self.namespaces[2] = NamespaceInfo(2, BLOCKS, BS, True)
        self.flushes: list[tuple[bytes, Any, Any]] = []

    def submit_io(self, sqe: bytearray, data_out: Any, data_in: Any, done: Any) -> None:
        """fsync's Flush (the only command the mount sends other than ``transfer``): kept for
        the comparison, completed on the next loop iteration."""
        self.flushes.append((bytes(sqe), data_out, data_in))
        asyncio.get_running_loop().call_soon(done, None)


def _plain(opcode: int, unique: int, nodeid: int, arg: bytes = b"") -> bytes:
    return IN_HEADER.pack(IN_HEADER.size + len(arg), opcode, unique, nodeid, 0, 0, 0, 0, 0) + arg


def _request(rng: random.Random, unique: int) -> bytes:
    """One request of the kinds the fast path takes and the ones it hands on."""
    kind = rng.randrange(12)
    offset = rng.choice([rng.randrange(BLOCKS) * BS, rng.randrange(SIZE), SIZE - BS, SIZE, SIZE + BS])
    if kind < 3:
        size = rng.choice([BS, 2 * BS, rng.randrange(1, 3 * BS), 32 * BS])
        raw = _read(unique, offset, size)
    elif kind < 6:
        size = rng.choice([BS, rng.randrange(1, 2 * BS), COPY_LIMIT, COPY_LIMIT + BS, 32 * BS])
        raw = _write(unique, offset, rng.randbytes(size))
    elif kind == 6:  # a WRITE whose size field claims more than it carries
        raw = bytearray(_write(unique, offset, rng.randbytes(BS)))
        RW_IN.pack_into(raw, IN_HEADER.size, 0, offset, 2 * BS, 0, 0, 0, 0)
        raw = bytes(raw)
    elif kind == 7:
        raw = _plain(FSYNC, unique, 2, FSYNC_IN.pack(0, 0, 0))
    elif kind == 8:
        raw = _plain(GETATTR, unique, rng.choice([1, 2, 3, 9]), bytes(16))
    elif kind == 9:
        raw = _interrupt(unique, rng.randrange(max(unique - 8, 1), unique + 1))
    elif kind == 10:
        raw = _plain(FORGET, unique, 2, bytes(8))
    else:
        raw = _plain(99, unique, 2)  # no such opcode
    if rng.random() < 0.1:  # on the read-only namespace, or one that does not exist
        raw = bytearray(raw)
        IN_HEADER.pack_into(raw, 0, *(IN_HEADER.unpack_from(raw)[:3] + (rng.choice([3, 9]),)
                                      + IN_HEADER.unpack_from(raw)[4:]))
        raw = bytes(raw)
    return raw


async def _serve(compiled: bool, rounds: list[list[bytes]]) -> tuple[list[list[tuple[int, int, bytes]]], bytes, list[Any]]:
    ctrl = _Ctrl()
    ctrl.data[:] = random.Random(1).randbytes(SIZE)
    mount = FuseSession({"c": ctrl}, "c", "/nonexistent", 60.0, compiled=compiled)
    assert (mount.on_readable == mount.py_on_readable) is not compiled
    mount.directory.mtime = 0
    ours, kernel = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    kernel.setblocking(False)
    mount.attach(ours.fileno())
    out = []
    try:
        for requests in rounds:
            for raw in requests:
                while True:
                    try:
                        kernel.send(raw)
                        break
                    except BlockingIOError:  # big writes filled the pair: serve some first (alike in both)
                        mount.on_readable()
            for _ in range(-(-len(requests) // MAX_BATCH)):
                mount.on_readable()
            for _ in range(20):  # the RAM controller completes on the next loop iterations
                await asyncio.sleep(0)
            replies = []
            while True:
                try:
                    raw = kernel.recv(1 << 21)
                except BlockingIOError:
                    break
                length, err, unique = OUT_HEADER.unpack_from(raw)
                assert length == len(raw)
                replies.append((unique, err, raw[OUT_HEADER.size:]))
            out.append(replies)
    finally:
        asyncio.get_running_loop().remove_reader(ours.fileno())
        ours.close()
        kernel.close()
    return out, bytes(ctrl.data), ctrl.flushes


@pytest.mark.parametrize("seed", range(40))
def test_compiled_and_python_loops_answer_alike(seed: int) -> None:
    rng = random.Random(seed)
    unique = 1
    rounds = []
    for _ in range(12):
        batch = []
        for _ in range(rng.choice([1, 1, 2, 3, MAX_BATCH, MAX_BATCH + 3])):
            batch.append(_request(rng, unique))
            unique += 1
        rounds.append(batch)

    async def main() -> Any:
        return await _serve(False, rounds), await _serve(True, rounds)
    reference, compiled = run(main())
    assert compiled[0] == reference[0]
    assert compiled[1:] == reference[1:]
    assert sum(map(len, reference[0])) > len(rounds)  # the stream was answered, not just dropped
    assert all(sqe in (flush_command(1), flush_command(2)) for sqe, _, _ in reference[2])


def test_the_stream_exercises_every_path() -> None:
    """The generator covers what the fast path must get right: big writes (the buffer handed
    over), short ones (copied), reads, and every other opcode going to the Python handler."""
    rng = random.Random(0)
    raws = [_request(rng, u) for u in range(1, 400)]
    opcodes = {IN_HEADER.unpack_from(r)[1] for r in raws}
    sizes = {RW_IN.unpack_from(r, IN_HEADER.size)[2] for r in raws if IN_HEADER.unpack_from(r)[1] == WRITE}
    assert {15, WRITE, FSYNC, GETATTR, FORGET, 99} <= opcodes
    assert any(s > COPY_LIMIT for s in sizes) and any(s <= COPY_LIMIT for s in sizes)
