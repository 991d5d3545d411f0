"""Large reads sent by reference (``target/file_send.py`` and ``TcpFastPath._read_by_reference``,
over ``target/_file_io.pyx``) against the ordinary path (``pread`` into the reply and one ``send``), in both twins, over real
loopback sockets (``splice`` needs one).

Each test runs the same commands with reads by reference and without (``BY_REFERENCE_MIN`` out of
reach: today's path, the reference) and compares every byte the host receives; the twin is the
compiled path, or the Python queue alone (``TcpFastPath`` None, as in pure mode). The streams mix
large reads with small replies that are still queued in the output batcher (in-capsule writes and
small reads of the same receive) or in the transport (a target socket with a small send buffer
and a host that reads late, so that the socket fills and the rest of a reply goes through the
transport), on asyncio's loop and on uvloop (which keeps every ``write`` until the end of the loop
iteration).
"""

from __future__ import annotations

import asyncio
import random
import socket
from pathlib import Path
from typing import Any

import pytest
import uvloop

import target.tcp
from protocol.constants import IoOpcode, SglId
from protocol.fabrics import CATTR_DISABLE_SQFLOW
from protocol.nvme import CQE_FAST, build_sgl_data_block, build_sqe
from protocol.status import Status, to_wire
from protocol.tcp import PduFlags, PduType
from target import file_send
from target.io_fast import TcpFastPath

from .conftest import RawConn, capsule, config, connect_data, connect_sqe, fill_file, free_port, ns, raw_admin, serving, sub
from .test_io_fast import _run, _stream

TWINS = ["python", pytest.param("compiled", marks=pytest.mark.skipif(
    TcpFastPath is None, reason="the compiled data plane is not in use (BLOCKD_PURE=1 or not built)"))]
OFF = 1 << 62
"""A ``BY_REFERENCE_MIN`` no read reaches: the ordinary path."""
SIZE = 4 << 20
BLOCK = 512
_CQE_STATUS = CQE_FAST.index("status")


def _twin(monkeypatch: pytest.MonkeyPatch, twin: str) -> None:
    if twin == "python":
        monkeypatch.setattr(target.tcp, "TcpFastPath", None)  # every capsule to the Python queue


def _by_reference(stats: tuple[int, int]) -> int:
    """Reads sent by reference, by either twin (compiled, Python)."""
    return stats[0] + stats[1]


@pytest.mark.parametrize("twin", TWINS)
@pytest.mark.parametrize("seed,cattr,split", [(11, 0, None), (12, CATTR_DISABLE_SQFLOW, None), (13, 0, 90),
                                              (14, CATTR_DISABLE_SQFLOW, 95)])
def test_random_streams_answer_as_the_ordinary_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, twin: str,
                                                    seed: int, cattr: int, split: int | None) -> None:
    """The differential test's random streams (reads up to 128 KiB among writes, refusals, FUA,
    Flush, R2T writes; SQ flow control on and off; cut at random points) with every read of
    8 KiB or more by reference, against the same twin without."""
    _twin(monkeypatch, twin)
    chunks = _stream(seed, 300)
    monkeypatch.setattr(file_send, "BY_REFERENCE_MIN", 8192)
    got = _run(tmp_path / "by_reference", chunks, cattr, 0, split)
    monkeypatch.setattr(file_send, "BY_REFERENCE_MIN", OFF)
    want = _run(tmp_path / "ordinary", chunks, cattr, 0, split)
    assert _by_reference(want["by_reference"]) == 0
    assert _by_reference(got["by_reference"]) > 20  # 44 of seed 11's reads are 8 KiB or more
    if twin == "python":
        assert got["by_reference"][0] == 0
    else:
        assert got["by_reference"][0] > 20
    for i, (g, w) in enumerate(zip(got["wire"], want["wire"])):
        assert g == w, f"chunk {i}: commands {[sqe.hex()[:16] for sqe, _ in chunks[i]]}"
    assert len(got["wire"]) == len(want["wire"])
    for key in ("files", "counters", "error_log", "in_flight", "sqhd", "completed"):
        assert got[key] == want[key], key


# -- large reads among small replies, with a socket that fills -----------------------------------------


def _read_sqe(cid: int, slba: int, nlb: int) -> bytes:
    return build_sqe(IoOpcode.READ, cid, nsid=1, cdw10=slba & 0xFFFFFFFF, cdw11=slba >> 32, cdw12=nlb - 1,
                     dptr=build_sgl_data_block(SglId.TRANSPORT_DATA_BLOCK, 0, nlb * BLOCK))


def _read(cid: int, slba: int, nlb: int) -> bytes:
    return capsule(_read_sqe(cid, slba, nlb))


def _write(cid: int, slba: int, data: bytes) -> bytes:
    return capsule(build_sqe(IoOpcode.WRITE, cid, nsid=1, cdw10=slba & 0xFFFFFFFF, cdw11=slba >> 32,
                             cdw12=len(data) // BLOCK - 1,
                             dptr=build_sgl_data_block(SglId.DATA_BLOCK_OFFSET, 0, len(data))), data)


def _commands(seed: int, count: int) -> list[tuple[str, int, int, int]]:
    """(kind, cid, slba, blocks): 128 KiB and 64 KiB reads in the first half of the namespace,
    most after a small write to the second half, a 4 KiB read or a 32 KiB read (replies queued
    before it: in the batcher, or in the transport when the 32 KiB read's data flushed it)."""
    rng = random.Random(seed)
    half = SIZE // BLOCK // 2
    out = []
    cid = 1
    for _ in range(count):
        before = rng.choice(["write", "small", "mid", "none"])
        if before == "write":
            out.append(("write", cid, half + rng.randrange(0, half - 8), 8))
        elif before == "small":
            out.append(("read", cid, rng.randrange(0, half - 8), 8))
        elif before == "mid":
            out.append(("read", cid, rng.randrange(0, half - 64), 64))
        cid += 1 if before != "none" else 0
        nlb = rng.choice([256, 128])
        out.append(("read", cid, rng.randrange(0, half - nlb), nlb))
        cid += 1
    return out


def _exchange(tmp: Path, commands: list[tuple[str, int, int, int]], loop: str, slow: bool, cattr: int,
              flush_often: bool, threads: bool) -> tuple[list[bytes], tuple[int, int, int, int], bytes]:
    """Send all ``commands`` in one write on a fresh target whose socket has a small send buffer
    (with ``slow`` the host reads nothing for a while, so the target's socket is full; with
    ``flush_often`` a 32 KiB read's data is past the batch's flush point, so its reply goes to
    the transport at once, where uvloop keeps it until the end of the loop iteration); every
    PDU received, (by reference, of those spilled, served compiled, served on the queue's thread),
    the file. ``threads``: ``[target] threaded_queues``."""
    tmp.mkdir()
    image = tmp / "rw.img"
    fill_file(image, SIZE, seed=5)
    port = free_port()
    limits: dict[str, Any] = {"threaded_queues": threads}
    if flush_often:
        limits["max_unsent"] = 65536  # flushed past a quarter of it
    cfg = config([port], [sub(namespaces=[ns(image, size=SIZE, block_size=BLOCK)])], target=limits)
    made = target.tcp.TcpTargetConnection.connection_made

    def small_sndbuf(self: target.tcp.TcpTargetConnection, transport: Any) -> None:
        made(self, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)

    out: dict[str, Any] = {}

    async def main() -> None:
        async with serving(cfg) as service:
            admin, cntlid = await raw_admin(port)
            io = await RawConn.open(port)
            io.writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
            await io.initialize()
            sqe = connect_sqe(qid=1, sqsize=127, cattr=cattr)
            io.send(capsule(sqe, connect_data(cntlid=cntlid)))
            resp = await io.recv()
            assert resp is not None and CQE_FAST.unpack_from(resp.header, 8)[_CQE_STATUS] == 0
            raw = []
            for kind, cid, slba, nlb in commands:
                raw.append(_read(cid, slba, nlb) if kind == "read"
                           else _write(cid, slba, bytes([cid & 0xFF]) * (nlb * BLOCK)))
            io.send(b"".join(raw))
            if slow:
                await asyncio.sleep(0.3)
            wire = []
            done = 0
            while done < len(commands):
                pdu = await io.recv()
                assert pdu is not None, "the target closed the connection"
                wire.append(pdu.header + pdu.data)
                if pdu.ptype == PduType.CAPSULE_RESP or pdu.flags & PduFlags.SUCCESS:
                    done += 1
            conn = service.target.controllers[cntlid].queues[1].transport
            fast, pipe = conn.fast, conn.pipe
            out["stats"] = (
                (fast.by_reference if fast else 0) + (pipe.sent if pipe else 0),
                (fast.spilled if fast else 0) + (pipe.spilled if pipe else 0),
                fast.served if fast else 0,
                fast.thread_served if fast else 0)
            out["wire"] = wire
            await io.close()
            await admin.close()

    target.tcp.TcpTargetConnection.connection_made = small_sndbuf  # type: ignore[method-assign]
    try:
        runner = uvloop.run if loop == "uvloop" else asyncio.run
        runner(asyncio.wait_for(main(), 60))
    finally:
        target.tcp.TcpTargetConnection.connection_made = made  # type: ignore[method-assign]
    return out["wire"], out["stats"], image.read_bytes()


@pytest.mark.parametrize("twin,threads", [("python", False), pytest.param("compiled", False, marks=TWINS[1].marks),
                                           pytest.param("compiled", True, marks=TWINS[1].marks)])
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("slow,cattr,flush_often", [
    (False, 0, False), (True, 0, False), (True, CATTR_DISABLE_SQFLOW, False), (False, 0, True)])
def test_large_reads_keep_their_order_among_queued_replies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           twin: str, threads: bool, loop: str, slow: bool,
                                                           cattr: int, flush_often: bool) -> None:
    """Large reads, each after a write's or a smaller read's reply still queued, all in one
    receive: the same bytes as the ordinary path, the data the file's. On the loop, with a host
    that reads late, some replies did not fit in the socket and their rest went through the
    transport; on the queue's thread (``threads``) they are served there, the blocking socket
    taking each reply whole, and the thread keeps the socket throughout."""
    _twin(monkeypatch, twin)
    commands = _commands(21 + slow, 40)
    monkeypatch.setattr(file_send, "BY_REFERENCE_MIN", 65536)
    got, stats, image = _exchange(tmp_path / "by_reference", commands, loop, slow, cattr, flush_often, threads)
    monkeypatch.setattr(file_send, "BY_REFERENCE_MIN", OFF)
    want, ordinary, _ = _exchange(tmp_path / "ordinary", commands, loop, slow, cattr, flush_often, threads)
    assert ordinary[:2] == (0, 0)
    assert stats[0] == 40  # every large read (some meet a transport with bytes queued: all through it)
    if twin == "compiled":
        assert stats[2] == len(commands)
    if threads:
        assert stats[3] == len(commands), "a large read handed the socket back to the loop"
        assert stats[1] == 0  # nothing spills from a blocking socket
    elif slow:
        assert stats[1] > 0, "the socket never filled: the fallback did not run"
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"PDU {i}"
    # and the data is the file's (the writes went to the other half)
    data = [pdu for pdu in got if pdu[0] == PduType.C2H_DATA]
    reads = [c for c in commands if c[0] == "read"]
    assert len(data) == len(reads)
    for pdu, (_, cid, slba, nlb) in zip(data, reads):
        assert int.from_bytes(pdu[8:10], "little") == cid
        assert pdu[24:] == image[slba * BLOCK:(slba + nlb) * BLOCK]


# -- a file shorter than the namespace -----------------------------------------------------------------


@pytest.mark.parametrize("twin", [*TWINS, pytest.param("compiled-alone", marks=TWINS[1].marks)])
def test_a_short_file_fails_the_read_as_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, twin: str) -> None:
    """The backing file cut short under the target: a read past its end comes short from the
    file before anything was sent, so it fails with Unrecovered Read Error and nothing before the
    CapsuleResp, as without reads by reference; the pipe is empty again for the next read.
    ``compiled-alone``: the Python twin sends nothing by reference once the compiled one is bound
    (it took ``BY_REFERENCE_MIN`` then), so the compiled twin's own emptying of the pipe is what
    the last read relies on."""
    _twin(monkeypatch, twin)

    def once(tmp: Path, by_reference: bool) -> tuple[list[tuple[int, bytes]], tuple[int, int]]:
        monkeypatch.setattr(file_send, "BY_REFERENCE_MIN", 65536 if by_reference else OFF)
        tmp.mkdir()
        image = tmp / "rw.img"
        data = fill_file(image, SIZE, seed=9)
        port = free_port()
        cfg = config([port], [sub(namespaces=[ns(image, size=SIZE, block_size=BLOCK)])])
        out: dict[str, Any] = {}

        async def main() -> None:
            async with serving(cfg) as service:
                admin, cntlid = await raw_admin(port)
                io = await RawConn.open(port)
                await io.initialize()
                await io.command(connect_sqe(qid=1, sqsize=31), connect_data(cntlid=cntlid))
                with open(image, "r+b") as f:
                    f.truncate(SIZE // 2)
                results = []
                for cid, slba in enumerate([0, SIZE // BLOCK // 2 - 128, SIZE // BLOCK // 2 + 256, 1024], 1):
                    status, _, got_cid, got = await io.command(_read_sqe(cid, slba, 256))
                    assert got_cid == cid
                    results.append((status, got))
                    if twin == "compiled-alone":
                        monkeypatch.setattr(file_send, "BY_REFERENCE_MIN", OFF)
                conn = service.target.controllers[cntlid].queues[1].transport
                out["results"] = results
                out["stats"] = (conn.fast.by_reference if conn.fast else 0, conn.pipe.sent if conn.pipe else 0)
                await io.close()
                await admin.close()

        asyncio.run(asyncio.wait_for(main(), 60))
        assert out["results"][0][1] == data[:128 << 10]
        assert out["results"][3][1] == data[1024 * BLOCK:1024 * BLOCK + (128 << 10)]
        return out["results"], out["stats"]

    got, stats = once(tmp_path / "by_reference", True)
    want, _ = once(tmp_path / "ordinary", False)
    assert got == want
    statuses = [status for status, _ in got]
    assert statuses[0] == statuses[3] == 0
    assert statuses[1] & 0x7FF == statuses[2] & 0x7FF == to_wire(Status.UNRECOVERED_READ_ERROR) & 0x7FF
    assert _by_reference(stats) == 2
    if twin == "compiled-alone":
        assert stats == (2, 0)
