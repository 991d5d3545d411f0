"""The target's compiled Read/Write path (target/_tcp_io.pyx) against the Python TargetQueue.

The differential test sends the same random command streams to a target whose connections use
the compiled path and to one where every capsule goes to the Python queue (the reference), and
compares every byte the host receives, the backing files, the host's and the namespaces'
counters, the error logs and what is left in flight. The streams mix what the compiled path
serves (Read, in-capsule Write) with everything it must hand over: out-of-range LBAs, unknown
and missing namespaces, a read-only namespace, wrong transfer lengths and SGLs, bad FLAGS, FUA,
Flush, R2T writes, unknown opcodes, SQ flow control on and off, digests.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import dataclasses
import random
import struct
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import pytest

import target.tcp
from blockd.dataplane import COMPILED
from protocol.constants import IoOpcode, SglId
from protocol.fabrics import CATTR_DISABLE_SQFLOW
from protocol.nvme import CQE_FAST, RW_CONTROL_FUA, build_sgl_data_block, build_sqe
from protocol.status import Status, to_wire
from protocol.tcp import DATA_HLEN, DATA_PDU_HEADER_FAST, DIGEST_SIZE, PduFlags, PduType, crc32c
from target.filter import BackendFilter
from target.io_fast import TcpFastPath
from target.service import TargetService

from .conftest import (
    NQN, RawConn, capsule, comparable_counters, config, connect_data, connect_sqe, fill_file, free_port, h2c_data,
    ns, raw_admin, run, serving, sub,
)

compiled_only = pytest.mark.skipif(
    TcpFastPath is None, reason="the compiled data plane is not in use (BLOCKD_PURE=1 or not built)")

RW_SIZE = 1 << 20  # nsid 1: 512-byte blocks
RO_SIZE = 256 << 10  # nsid 2: read-only, 4096-byte blocks (3 does not exist)
RW4K_SIZE = 512 << 10  # nsid 4: 4096-byte blocks
SIZES = {1: (RW_SIZE, 512), 2: (RO_SIZE, 4096), 4: (RW4K_SIZE, 4096)}
MAX_BLOCKS = 64
LARGE_BLOCKS = 256  # 128 KiB of 512-byte blocks: the TCP in-capsule size (some R2T writes: 1 MiB)
_CQE_STATUS = CQE_FAST.index("status")


def _command(rng: random.Random, cid: int) -> tuple[bytes, bytes, bool]:
    """One random capsule: (SQE, in-capsule data, whether it may complete late: FUA, Flush, R2T)."""
    roll = rng.random()
    nsid = rng.choice([1] * 6 + [2] * 3 + [4] * 3 + [3, 0, 0xFFFFFFFF])
    size, block = SIZES.get(nsid, (RW_SIZE, 512))
    blocks = size // block
    large = rng.random() < 0.15  # up to the in-capsule size (and beyond for R2T writes, below)
    nlb = rng.randrange(1, (LARGE_BLOCKS if large else MAX_BLOCKS) // (block // 512) + 1)
    slba = rng.choice([rng.randrange(0, max(1, blocks - nlb + 1))] * 6
                      + [blocks - nlb + 1, blocks, (1 << 64) - 1, (1 << 64) - nlb])
    length = nlb * block
    if rng.random() < 0.08:
        length += rng.choice([-block, block, 1, -1])
    flags = 0x40 if rng.random() > 0.05 else rng.choice([0x00, 0x41, 0x80])
    control = RW_CONTROL_FUA if rng.random() < 0.1 else 0
    late = False
    data = b""
    if roll < 0.45:
        opcode = IoOpcode.READ
        sgl_id = SglId.TRANSPORT_DATA_BLOCK if rng.random() > 0.05 else SglId.DATA_BLOCK_OFFSET
    elif roll < 0.85:
        opcode = IoOpcode.WRITE
        late = control != 0
        if rng.random() < 0.1:  # data by R2T
            sgl_id = SglId.TRANSPORT_DATA_BLOCK
            late = True
            if large and rng.random() < 0.5:  # up to 1 MiB, the largest transfer
                nlb = rng.randrange(nlb, LARGE_BLOCKS * 8 // (block // 512) + 1)
                length = nlb * block
                slba = rng.choice([rng.randrange(0, max(1, blocks - nlb + 1)), blocks - nlb + 1])
        else:
            sgl_id = SglId.DATA_BLOCK_OFFSET
            # more than the queue takes in a capsule would end the connection (a framing error)
            data = rng.randbytes(min(target.tcp.TCP_IO_INLINE, max(1, length + rng.choice([0] * 12 + [-1, 7]))))
    elif roll < 0.92:
        opcode, sgl_id, length, late = IoOpcode.FLUSH, SglId.TRANSPORT_DATA_BLOCK, 0, True
    else:
        opcode = rng.choice([IoOpcode.WRITE_ZEROES, 0x03, 0x7E, 0xC1, 0x81])
        sgl_id = SglId.TRANSPORT_DATA_BLOCK
        late = True
    address = rng.choice([0] * 20 + [8])
    dptr = build_sgl_data_block(sgl_id, address if sgl_id == SglId.DATA_BLOCK_OFFSET else 0, max(0, length))
    sqe = build_sqe(int(opcode), cid, flags=flags, nsid=nsid, dptr=dptr, cdw10=slba & 0xFFFFFFFF,
                    cdw11=slba >> 32, cdw12=(nlb - 1) | control << 16)
    return sqe, data, late


def _stream(seed: int, count: int) -> list[list[tuple[bytes, bytes]]]:
    """Chunks of commands sent in one write each; a command that may complete late ends its
    chunk, so every command before it has completed when it does, whatever the executor's
    timing or however the target's reads split the chunk (the completion order, and with it
    SQHD, is then the same on both paths)."""
    rng = random.Random(seed)
    chunks: list[list[tuple[bytes, bytes]]] = []
    cid = 0
    while cid < count:
        chunk: list[tuple[bytes, bytes]] = []
        for _ in range(rng.randrange(1, 9)):
            cid += 1
            sqe, data, late = _command(rng, cid)
            chunk.append((sqe, data))
            if late:
                break
        chunks.append(chunk)
    return chunks


async def _answers(io: RawConn, chunk: list[tuple[bytes, bytes]], digests: bool,
                   split: random.Random | None) -> list[bytes]:
    """Every PDU the target sends until each command of ``chunk`` completed (R2Ts answered).
    With ``split`` the chunk's bytes go out in pieces cut at random points (inside headers,
    SQEs and data too), each given its own turn of the event loop, so that the target receives
    them in as many reads: its receive loop then finds capsules whole, in part, and several in
    one buffer."""
    raw = b"".join(capsule(sqe, data, hdgst=digests, ddgst=digests) for sqe, data in chunk)
    if split is None:
        io.send(raw)
    else:
        cuts = sorted(split.sample(range(1, len(raw)), min(len(raw) - 1, split.randrange(1, 12))))
        for start, end in zip([0, *cuts], [*cuts, len(raw)]):
            io.send(raw[start:end])
            await io.writer.drain()
            await asyncio.sleep(0)
    by_cid = {int.from_bytes(sqe[2:4], "little"): sqe for sqe, _ in chunk}
    got: list[bytes] = []
    done = 0
    while done < len(chunk):
        pdu = await io.recv()
        assert pdu is not None, "the target closed the connection"
        got.append(pdu.header + pdu.data)
        if pdu.ptype == PduType.R2T:
            cid = int.from_bytes(pdu.header[8:10], "little")
            ttag = int.from_bytes(pdu.header[10:12], "little")
            length = int.from_bytes(pdu.header[16:20], "little")
            data = bytes([cid & 0xFF]) * length
            io.send(_h2c_with_digests(cid, ttag, data) if digests else h2c_data(cid, ttag, 0, data))
            assert by_cid[cid]
        elif pdu.ptype == PduType.CAPSULE_RESP or (pdu.ptype == PduType.C2H_DATA and pdu.flags & PduFlags.SUCCESS):
            done += 1
    return got


def _h2c_with_digests(cid: int, ttag: int, data: bytes) -> bytes:
    header = DATA_PDU_HEADER_FAST.pack(PduType.H2C_DATA, PduFlags.LAST_PDU | PduFlags.HDGST | PduFlags.DDGST,
                                       DATA_HLEN, DATA_HLEN + DIGEST_SIZE, DATA_HLEN + len(data) + 2 * DIGEST_SIZE,
                                       cid, ttag, 0, len(data))
    return header + crc32c(header).to_bytes(4, "little") + data + crc32c(data).to_bytes(4, "little")


def _run(tmp: Path, chunks: list[list[tuple[bytes, bytes]]], cattr: int, dgst: int,
         split: int | None = None, threaded: bool = True, ring: bool = False) -> dict[str, Any]:
    tmp.mkdir()
    rw, ro, rw4k = tmp / "rw.img", tmp / "ro.img", tmp / "rw4k.img"
    fill_file(rw, RW_SIZE, seed=1)
    fill_file(ro, RO_SIZE, seed=2)
    fill_file(rw4k, RW4K_SIZE, seed=3)
    port = free_port()
    cfg = config([port], [sub(namespaces=[
        ns(rw, size=RW_SIZE), ns(ro, nsid=2, size=RO_SIZE, block_size=4096, read_only=True),
        ns(rw4k, nsid=4, size=RW4K_SIZE, block_size=4096)])],
                 target={"threaded_queues": threaded, "io_uring_queues": ring})
    out: dict[str, Any] = {}

    async def main() -> None:
        async with serving(cfg) as service:
            admin, cntlid = await raw_admin(port)
            io = await RawConn.open(port)
            await io.initialize(dgst=dgst)
            sqe = connect_sqe(qid=1, sqsize=127, cattr=cattr)
            io.send(capsule(sqe, connect_data(cntlid=cntlid), hdgst=dgst != 0, ddgst=dgst != 0))
            resp = await io.recv()
            assert resp is not None and resp.ptype == PduType.CAPSULE_RESP
            assert CQE_FAST.unpack_from(resp.header, 8)[_CQE_STATUS] == 0
            cutter = None if split is None else random.Random(split)
            if ring:  # every Read and Write it may take on the ring, whatever file system /tmp is
                service.target.controllers[cntlid].queues[1].transport.fast.all_file_steps = True
            out["wire"] = [await _answers(io, chunk, dgst != 0, cutter) for chunk in chunks]
            ctrl = service.target.controllers[cntlid]
            queue = ctrl.queues[1]
            fast = queue.transport.fast
            out["served"] = fast.served if fast is not None else 0
            out["threaded"] = (fast.thread_entries, fast.thread_served) if fast is not None else (0, 0)
            out["ring"] = getattr(fast, "ring_served", 0)
            pipe = queue.transport.pipe
            out["by_reference"] = (fast.by_reference if fast is not None else 0, pipe.sent if pipe is not None else 0)
            out["in_flight"] = (queue.in_flight, [n.in_flight for n in ctrl.subsystem.namespaces.values()])
            out["counters"] = [comparable_counters(c.snapshot()) for c in
                               [ctrl.counters] + [n.counters for n in ctrl.subsystem.namespaces.values()]]
            out["error_log"] = list(ctrl.error_log)
            out["sqhd"] = queue.sqhd
            out["completed"] = queue.transport.reader.completed  # PDUs received (the PDU timeout's clock)
            await io.close()
            await admin.close()

    run(main(), timeout=120)
    out["files"] = (rw.read_bytes(), ro.read_bytes(), rw4k.read_bytes())
    return out


@compiled_only
@pytest.mark.parametrize("threaded", [False, True, "ring"], ids=["loop", "thread", "ring"])
@pytest.mark.parametrize("seed,cattr,dgst,split", [
    (1, 0, 0, None), (2, CATTR_DISABLE_SQFLOW, 0, None), (3, 0, 0, None), (4, 0, 3, None),
    (5, CATTR_DISABLE_SQFLOW, 0, None), (6, 0, 0, 60), (7, CATTR_DISABLE_SQFLOW, 0, 70), (8, 0, 3, 80),
])
def test_compiled_path_answers_exactly_as_the_python_queue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           seed: int, cattr: int, dgst: int,
                                                           split: int | None, threaded: bool | str) -> None:
    """The compiled receive loop and fast path against the Python ``_receive`` and queue; with
    ``split`` the streams reach the target in pieces cut at random points. ``threaded``: the
    queue goes to its thread whenever it is idle and back to the loop for every command the
    thread does not serve (the streams interleave those with served ones, so it moves in and
    out many times); else it stays on the loop. ``ring``: that thread on io_uring
    (``target/_uring_loop.pyx``, tests/core/test_uring_loop.py)."""
    chunks = _stream(seed, 300)
    fast = _run(tmp_path / "fast", chunks, cattr, dgst, split, bool(threaded), threaded == "ring")
    monkeypatch.setattr(target.tcp, "TcpFastPath", None)  # every capsule to the Python queue
    reference = _run(tmp_path / "reference", chunks, cattr, dgst, split)
    assert reference["served"] == 0
    if dgst:
        assert fast["served"] == 0  # digests are left to the Python path
        assert fast["threaded"] == (0, 0)
    else:
        assert fast["served"] > 50  # a good part of the stream went the compiled way (80 of 300 for seed 1)
        if threaded:  # in and out of the thread many times, a good part served there
            entries, served = fast["threaded"]
            assert entries > 20 and served > 20, fast["threaded"]
            assert (fast["ring"] > 10) == (threaded == "ring"), fast["ring"]  # (29-38 of them on the ring)
        else:
            assert fast["threaded"] == (0, 0)
    for i, (got, want) in enumerate(zip(fast["wire"], reference["wire"])):
        for pdu, (got_pdu, want_pdu) in enumerate(zip(got, want)):
            assert got_pdu[:96] == want_pdu[:96] and got_pdu == want_pdu, (
                f"chunk {i}, PDU {pdu}: commands {[sqe.hex() for sqe, _ in chunks[i]]}")
        assert len(got) == len(want), f"chunk {i}"
    for key in ("files", "counters", "error_log", "in_flight", "sqhd", "completed"):
        assert fast[key] == reference[key], key
    assert fast["in_flight"] == (0, [0, 0, 0])


@contextlib.asynccontextmanager
async def _small_target(tmp_path: Path, size: int = 64 << 10) -> AsyncIterator[tuple[TargetService, RawConn, int]]:
    """A target with one namespace of ``size`` bytes, our raw admin queue on it, and a raw I/O
    connection past ICReq (not yet connected); yields the service, that connection and the
    controller id."""
    path = tmp_path / "vol.img"
    fill_file(path, size)
    port = free_port()
    async with serving(config([port], [sub(namespaces=[ns(path, size=size)])])) as service:
        admin, cntlid = await raw_admin(port)
        io = await RawConn.open(port)
        await io.initialize()
        try:
            yield service, io, cntlid
        finally:
            await io.close()
            await admin.close()


@compiled_only
def test_what_the_compiled_path_leaves_to_python(tmp_path: Path) -> None:
    """A grown namespace is served up to its new end by the compiled path; a namespace whose
    copy is marked inaccessible or whose backend was wrapped in a filter and a removed namespace
    (its copy withdrawn, the descriptor given up) are answered by the Python queue. (FUA writes:
    test_tcp_thread.py, served on the queue's thread and by the Python queue on the loop.)"""
    async def main() -> None:
        async with _small_target(tmp_path) as (service, io, cntlid):
            await io.connect_io(cntlid)
            fast = service.target.controllers[cntlid].queues[1].transport.fast
            read_end = build_sqe(IoOpcode.READ, 9, nsid=1, dptr=build_sgl_data_block(
                SglId.TRANSPORT_DATA_BLOCK, 0, 512), cdw10=(128 << 10) // 512 - 1)
            status, *_ = await io.command(read_end)
            assert status != 0 and fast.served == 0  # past the end: Python's LBA range error
            sub_ = service.target.subsystems[NQN]
            service.target.resize_namespace(sub_, 1, 128 << 10)
            status, _, _, data = await io.command(read_end)
            assert (status, data, fast.served) == (0, bytes(512), 1)
            namespace = sub_.namespaces[1]
            namespace.fast.accessible = False  # as ANA will for a namespace that must refuse I/O
            status, _, _, data = await io.command(read_end)
            assert (status, data, fast.served) == (0, bytes(512), 1)  # answered by the Python queue
            namespace.fast.accessible = True
            plain = namespace.backend
            namespace.backend = BackendFilter(plain)  # a filter wrapped around it after the fact
            status, _, _, data = await io.command(read_end)
            assert (status, data, fast.served) == (0, bytes(512), 1)  # the filter's read, in Python
            namespace.backend = plain
            service.target.remove_namespace(sub_, 1)
            assert not namespace.fast.accessible and namespace.fast.file.fd == -1
            status, *_ = await io.command(read_end)
            assert status != 0 and fast.served == 1

    run(main(), timeout=30)


def test_the_compiled_target_path_runs_with_the_compiled_plane() -> None:
    """The glue offers the compiled path exactly when the data plane is compiled (so the tests
    above skip only under BLOCKD_PURE=1, never because target/_tcp_io alone failed to build)."""
    assert (TcpFastPath is not None) == COMPILED


@compiled_only
def test_a_full_command_pool_is_left_to_the_python_queue(tmp_path: Path) -> None:
    """Writes waiting for their R2T data hold their pool slots; a read beyond the pool is refused
    with a sequence error by the Python queue, not served by the compiled path."""
    async def main() -> None:
        async with _small_target(tmp_path) as (service, io, cntlid):
            status, *_ = await io.command(connect_sqe(qid=1, sqsize=1), connect_data(cntlid=cntlid))
            assert status == 0
            queue = service.target.controllers[cntlid].queues[1]
            transport_sgl = build_sgl_data_block(SglId.TRANSPORT_DATA_BLOCK, 0, 512)
            for cid in range(queue.pool):  # each gets an R2T that we leave unanswered
                io.send(capsule(build_sqe(IoOpcode.WRITE, cid, nsid=1, dptr=transport_sgl)))
                pdu = await io.recv()
                assert pdu is not None and pdu.ptype == PduType.R2T
            read = build_sqe(IoOpcode.READ, 99, nsid=1, dptr=transport_sgl)
            status, _, cid, data = await io.command(read)
            assert (cid, status, data) == (99, to_wire(Status.COMMAND_SEQUENCE_ERROR), b"")
            assert queue.transport.fast.served == 0

    run(main(), timeout=30)


def test_in_capsule_data_beyond_the_queue_size_is_a_framing_error(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A write whose capsule carries more data than the queue takes in a capsule ends the
    connection (Data Transfer Out of Range) even when its SGL asks for no more than that and the
    whole capsule is in the receive buffer, where the compiled receive loop would serve it: the
    refusal is the reader's ``place`` callback's, which that loop does not call, so it applies
    the queue's size itself. (A 4 KiB queue size: at 128 KiB such a capsule never fits the
    reader's 64 KiB staging whole.)"""
    monkeypatch.setattr(target.tcp.TcpTargetConnection, "info", dataclasses.replace(target.tcp.INFO, io_inline=4096))

    async def main() -> None:
        async with _small_target(tmp_path) as (service, io, cntlid):
            await io.connect_io(cntlid)
            before = (tmp_path / "vol.img").read_bytes()
            write = build_sqe(IoOpcode.WRITE, 5, nsid=1, dptr=build_sgl_data_block(SglId.DATA_BLOCK_OFFSET, 0, 512))
            io.send(capsule(write, b"\x01" * 8192))
            term = await io.recv()
            assert term is not None and term.ptype == PduType.C2H_TERM_REQ
            assert await io.closed()
            assert (tmp_path / "vol.img").read_bytes() == before
            assert service.target.rejections.counts["incapsule_too_large"] == 1

    run(main(), timeout=30)


@compiled_only
def test_a_large_write_capsule_is_written_from_staging(tmp_path: Path) -> None:
    """A 128 KiB write capsule is received whole into the reader's staging and written to the file
    from there: after the first one (which grows staging, moving what had arrived), the reader
    copies none of their bytes (it used to copy what arrived with the header, ~64 KiB a write)."""
    async def main() -> None:
        async with _small_target(tmp_path, 1 << 20) as (service, io, cntlid):
            await io.connect_io(cntlid)
            conn = service.target.controllers[cntlid].queues[1].transport
            length = target.tcp.TCP_IO_INLINE
            copied = []
            for i in range(4):
                data = bytes([i + 1]) * length
                write = build_sqe(IoOpcode.WRITE, i, nsid=1, dptr=build_sgl_data_block(
                    SglId.DATA_BLOCK_OFFSET, 0, length), cdw10=i * length // 512, cdw12=length // 512 - 1)
                status, *_ = await io.command(write, data)
                assert status == 0
                copied.append(conn.reader.copied)
            assert conn.fast.served == 4
            assert copied[-1] == copied[0], copied
            written = (tmp_path / "vol.img").read_bytes()[:4 * length]
            assert written == b"".join(bytes([i + 1]) * length for i in range(4))

    run(main(), timeout=30)


def _r2t_write(cid: int, slba: int, length: int, control: int = 0, nsid: int = 1) -> bytes:
    return build_sqe(IoOpcode.WRITE, cid, nsid=nsid, dptr=build_sgl_data_block(SglId.TRANSPORT_DATA_BLOCK, 0, length),
                     cdw10=slba, cdw12=(length // 512 - 1) | control << 16)


async def _r2t_of(io: RawConn) -> tuple[int, int, int]:
    pdu = await io.recv()
    assert pdu is not None and pdu.ptype == PduType.R2T, pdu
    cid, ttag, offset, length = struct.unpack_from("<HHII", pdu.header, 8)
    assert offset == 0
    return cid, ttag, length


@compiled_only
def test_r2t_writes_are_written_and_answered_by_the_compiled_path(tmp_path: Path) -> None:
    """A 1 MiB R2T write, its data in one H2CData or in two: the compiled path sends the R2T,
    writes the placed data and answers; the slot, the namespace hold and both R2T budgets are
    given back. A FUA one, and one whose R2T waits for budget, go the Python queue's way."""
    async def main() -> None:
        async with _small_target(tmp_path, 4 << 20) as (service, io, cntlid):
            await io.connect_io(cntlid)
            queue = service.target.controllers[cntlid].queues[1]
            conn, namespace = queue.transport, service.target.subsystems[NQN].namespaces[1]
            length = 1 << 20
            for i, pieces in enumerate((1, 2, 1)):
                io.send(capsule(_r2t_write(i, i * length // 512, length)))
                cid, ttag, asked = await _r2t_of(io)
                assert (cid, asked, queue.in_flight, namespace.in_flight) == (i, length, 1, 1)
                assert (conn.r2t_held, service.target.r2t_budget.used) == (length, length)
                data = bytes([i + 1]) * length
                step = length // pieces
                for at in range(0, length, step):
                    io.send(h2c_data(cid, ttag, at, data[at:at + step], last=at + step == length))
                pdu = await io.recv()
                assert pdu is not None and pdu.ptype == PduType.CAPSULE_RESP
                assert CQE_FAST.unpack_from(pdu.header, 8)[_CQE_STATUS] == 0
                assert (queue.in_flight, namespace.in_flight, conn.r2t_held, service.target.r2t_budget.used) == (
                    0, 0, 0, 0)
            assert conn.fast.served == 3
            written = (tmp_path / "vol.img").read_bytes()[:3 * length]
            assert written == b"".join(bytes([i + 1]) * length for i in range(3))
            # FUA: the Python queue's write (the disk's wait on its thread), answered as ever
            io.send(capsule(_r2t_write(7, 0, 4096, RW_CONTROL_FUA)))
            cid, ttag, asked = await _r2t_of(io)
            io.send(h2c_data(cid, ttag, 0, b"\x07" * asked))
            pdu = await io.recv()
            assert pdu is not None and CQE_FAST.unpack_from(pdu.header, 8)[_CQE_STATUS] == 0
            assert conn.fast.served == 3
            # the daemon's budget full: the queue makes the write wait, and serves it once it frees
            budget = service.target.r2t_budget
            budget.used = budget.limit
            io.send(capsule(_r2t_write(8, 0, 4096)))
            with pytest.raises(asyncio.TimeoutError):  # no R2T yet
                await io.recv(timeout=0.3)
            budget.give(budget.limit)
            cid, ttag, asked = await _r2t_of(io)
            io.send(h2c_data(cid, ttag, 0, b"\x08" * asked))
            pdu = await io.recv()
            assert pdu is not None and CQE_FAST.unpack_from(pdu.header, 8)[_CQE_STATUS] == 0
            assert conn.fast.served == 4  # its R2T was the queue's, its write the compiled path's
            assert (queue.in_flight, namespace.in_flight, conn.r2t_held, budget.used) == (0, 0, 0, 0)

    run(main(), timeout=30)


def _r2t_ends(tmp: Path) -> dict[str, Any]:
    """R2T writes whose end the compiled path leaves to the Python queue: its write fails (here:
    the descriptor of the namespace's C copy swapped for a read-only one, so ``pwrite`` fails
    with EBADF while the backend's own write works), the namespace is removed during the round
    trip (it keeps its file until the write is done, then closes), the connection is lost before
    the data (the write fails with Data Transfer Error: error log, counters, holds, budgets)."""
    tmp.mkdir()
    paths = [tmp / "one.img", tmp / "two.img"]
    for path in paths:
        fill_file(path, 1 << 20)
    port = free_port()
    out: dict[str, Any] = {}

    async def main() -> None:
        async with serving(config([port], [sub(namespaces=[ns(paths[0], size=1 << 20),
                                                           ns(paths[1], nsid=2, size=1 << 20)])])) as service:
            admin, cntlid = await raw_admin(port)
            io = await RawConn.open(port)
            await io.initialize()
            await io.connect_io(cntlid)
            ctrl = service.target.controllers[cntlid]
            one, two = ctrl.subsystem.namespaces[1], ctrl.subsystem.namespaces[2]
            wire: list[bytes] = []

            async def write(cid: int, nsid: int, between: Callable[[], None] | None = None) -> None:
                io.send(capsule(_r2t_write(cid, cid * 8, 4096, nsid=nsid)))
                _, ttag, length = await _r2t_of(io)
                if between is not None:
                    between()
                io.send(h2c_data(cid, ttag, 0, bytes([cid]) * length))
                pdu = await io.recv()
                assert pdu is not None
                wire.append(pdu.header)

            fast_file = one.fast.file if one.fast is not None else None
            saved = []
            read_only = os.open(paths[0], os.O_RDONLY)
            try:
                def swap() -> None:
                    if fast_file is not None:
                        saved.append(fast_file.fd)
                        fast_file.fd = read_only
                await write(1, 1, swap)
                if fast_file is not None:
                    fast_file.fd = saved[0]
            finally:
                os.close(read_only)
            await write(2, 1)
            await write(3, 2, lambda: service.target.remove_namespace(ctrl.subsystem, 2))
            io.send(capsule(_r2t_write(4, 0, 4096, nsid=2)))  # a write to a namespace no longer there
            pdu = await io.recv()
            assert pdu is not None
            wire.append(pdu.header)
            fast = ctrl.queues[1].transport.fast
            out["served"] = fast.served if fast is not None else 0
            out["closed"] = (two.backend.fd, two.in_flight)
            io.send(capsule(_r2t_write(5, 0, 4096)))
            await _r2t_of(io)
            await io.close()  # before the data
            for _ in range(100):
                if not one.in_flight:
                    break
                await asyncio.sleep(0.01)
            out["wire"] = wire
            out["after_loss"] = (one.in_flight, service.target.r2t_budget.used)
            out["counters"] = [comparable_counters(c.snapshot()) for c in (ctrl.counters, one.counters, two.counters)]
            out["error_log"] = list(ctrl.error_log)
            await admin.close()

    run(main(), timeout=30)
    out["files"] = [path.read_bytes() for path in paths]
    return out


@compiled_only
def test_r2t_write_ends_left_to_python_are_the_queues(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The R2T writes of ``_r2t_ends`` through the compiled path and through the Python queue
    alone: the same answers, files, counters, error log, holds and budgets."""
    fast = _r2t_ends(tmp_path / "fast")
    monkeypatch.setattr(target.tcp, "TcpFastPath", None)
    reference = _r2t_ends(tmp_path / "reference")
    assert fast["served"] == 1 and reference["served"] == 0  # write 2 alone: 1 failed in C, 3 lost its C copy
    for key in ("wire", "files", "counters", "error_log", "after_loss", "closed"):
        assert fast[key] == reference[key], key
    assert fast["after_loss"] == (0, 0) and fast["closed"] == (-1, 0) and fast["error_log"]
