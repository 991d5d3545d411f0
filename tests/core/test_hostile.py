"""Hostile bytes over real sockets: what a malicious or broken host may send the target.

Every case runs against a fresh target whose namespace file is full of a known pattern, with a
well-behaved host connected. Afterwards that host must still read and write, and the file must
hold exactly the pattern plus what the good host wrote: same size, no stray bytes anywhere.
"""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path
from typing import Awaitable, Callable

import pytest

from protocol.constants import IoOpcode, SglId
from protocol.nvme import CQE_FAST, NSID_ALL, build_sgl_data_block, build_sqe
from protocol.status import Status, to_wire
from protocol.tcp import COMMON_HEADER_SIZE, PduType
from target.backend import FileBackend

from .conftest import (
    NQN, RawConn, capsule, config, connect, connect_data, connect_sqe, fill_file, free_port, h2c_data,
    icreq, incapsule_sgl, ns, prop_sqe, raw_admin, raw_io, run, serving, sub, transport_sgl,
)

SIZE = 4 << 20
BLOCKS = SIZE // 512
GOOD_LBA = 1000
GOOD_DATA = b"\xa5" * 4096


def check_survives(tmp_path: Path, attack: Callable[[int], Awaitable[None]]) -> None:
    """Run ``attack(port)`` next to a good host; then prove the daemon and the file are intact."""
    port = free_port()
    path = tmp_path / "vol.img"
    original = fill_file(path, SIZE)
    cfg = config([port], [sub(namespaces=[ns(path, size=SIZE)])])

    async def main() -> None:
        async with serving(cfg) as service:
            good = await connect(port, nr_io_queues=1)
            try:
                await attack(port)
                await good.write(1, GOOD_LBA, GOOD_DATA)
                assert await good.read(1, GOOD_LBA, 8) == GOOD_DATA
                assert await good.read(1, 0, 1) == original[:512]
                assert good.cntlid in service.target.controllers
            finally:
                await good.close()

    run(main(), timeout=30)
    expected = bytearray(original)
    expected[GOOD_LBA * 512:GOOD_LBA * 512 + len(GOOD_DATA)] = GOOD_DATA
    data = path.read_bytes()
    assert len(data) == SIZE
    assert data == expected


async def expect_termination(conn: RawConn, fes: int, fei: int | None = None) -> None:
    """A C2HTermReq with ``fes`` (and FEI), then the target closes the connection."""
    pdu = await conn.recv()
    assert pdu is not None, "closed without a termination request"
    assert pdu.ptype == PduType.C2H_TERM_REQ, pdu
    got_fes, got_fei = struct.unpack_from("<HI", pdu.header, 8)
    assert got_fes == fes, (got_fes, got_fei)
    if fei is not None:
        assert got_fei == fei, (got_fes, got_fei)
    assert await conn.closed()
    await conn.close()


# -- framing errors: termination request and a closed connection -------------------------------------

def _capsule_bad_pdo() -> bytes:
    raw = bytearray(capsule(build_sqe(0x01, 1, nsid=1, dptr=incapsule_sgl(512), cdw10=0), b"\0" * 512))
    raw[3] = 80
    return bytes(raw)


def _capsule_plen(plen: int) -> bytes:
    raw = bytearray(capsule(build_sqe(0x01, 1, nsid=1, dptr=incapsule_sgl(512)), b"\0" * 512))
    raw[4:8] = plen.to_bytes(4, "little")
    return bytes(raw)


FRAMING_BEFORE_IC = {
    # name: (bytes sent on a fresh connection, FES, FEI)
    "http-garbage": (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", 1, 0),
    "zero-garbage": (bytes(16), 1, 2),  # type 0 = ICReq, but HLEN 0
    "bad-pfv": (icreq(pfv=1), 1, 8),
    "bad-hpda": (icreq(hpda=3), 1, 10),
    "icreq-wrong-hlen": (icreq(hlen=120), 1, 2),
    "icreq-with-data": (icreq(plen=132) + bytes(4), 1, 4),
    "icreq-plen-too-short": (icreq(plen=64), 1, 4),
    "capsule-before-icreq": (capsule(connect_sqe(), connect_data()), 2, 0),
    "h2c-data-before-icreq": (h2c_data(0, 0, 0, b"\0" * 512), 2, 0),
    "c2h-type-from-host": (struct.pack("<BBBBI", PduType.C2H_DATA, 0, 24, 24, 28) + bytes(20), 1, 0),
}


@pytest.mark.parametrize("name", sorted(FRAMING_BEFORE_IC))
def test_framing_error_before_icreq(tmp_path: Path, name: str) -> None:
    raw, fes, fei = FRAMING_BEFORE_IC[name]

    async def attack(port: int) -> None:
        conn = await RawConn.open(port)
        conn.send(raw)
        await expect_termination(conn, fes, fei)

    check_survives(tmp_path, attack)


FRAMING_AFTER_IC = {
    "second-icreq": (icreq(), 2, 0),
    "capsule-bad-pdo": (_capsule_bad_pdo(), 1, 3),
    "capsule-wrong-hlen": (bytes([4, 0, 64, 0]) + (72).to_bytes(4, "little") + bytes(64), 1, 2),
    "capsule-plen-shorter-than-header": (_capsule_plen(40), 1, 4),
    "capsule-oversized-plen": (_capsule_plen(72 + (64 << 20)), 4, 4),
    "capsule-header-digest-flag-unnegotiated": (bytes([4, 1, 72, 0]) + (76).to_bytes(4, "little") + bytes(68), 1, 1),
    "r2t-from-host": (struct.pack("<BBBBI", PduType.R2T, 0, 24, 0, 24) + bytes(16), 1, 0),
    "h2c-unknown-ttag": (h2c_data(1, 77, 0, b"\0" * 512), 1, 10),
}


@pytest.mark.parametrize("name", sorted(FRAMING_AFTER_IC))
def test_framing_error_after_icreq(tmp_path: Path, name: str) -> None:
    raw, fes, fei = FRAMING_AFTER_IC[name]

    async def attack(port: int) -> None:
        admin, io = await raw_io(port)
        io.send(raw)
        await expect_termination(io, fes, fei)
        await admin.close()

    check_survives(tmp_path, attack)


@pytest.mark.parametrize("case", ["wrong-offset", "beyond-length", "wrong-cid", "datal-mismatch"])
def test_h2c_data_against_a_real_r2t(tmp_path: Path, case: str) -> None:
    async def attack(port: int) -> None:
        admin, io = await raw_io(port)
        length = 32 << 10  # above the in-capsule limit: the target asks with R2T
        io.send(capsule(build_sqe(0x01, 9, nsid=1, dptr=transport_sgl(length), cdw10=0, cdw12=length // 512 - 1)))
        r2t = await io.recv()
        assert r2t is not None and r2t.ptype == PduType.R2T
        cid, ttag, r2to, r2tl = struct.unpack_from("<HHII", r2t.header, 8)
        assert (cid, r2to, r2tl) == (9, 0, length)
        if case == "wrong-offset":
            io.send(h2c_data(9, ttag, 512, b"\x66" * 4096, last=False))
            await expect_termination(io, 4, 12)
        elif case == "beyond-length":
            io.send(h2c_data(9, ttag, 0, b"\x66" * (length + 512)))
            await expect_termination(io, 4, 12)
        elif case == "wrong-cid":
            io.send(h2c_data(10, ttag, 0, b"\x66" * length))
            await expect_termination(io, 1, 10)
        else:
            raw = bytearray(h2c_data(9, ttag, 0, b"\x66" * 4096))
            raw[16:20] = (8192).to_bytes(4, "little")  # DATAL says more than the PDU carries
            io.send(bytes(raw))
            await expect_termination(io, 1, 16)
        await admin.close()

    check_survives(tmp_path, attack)


def test_host_termination_request_just_closes(tmp_path: Path) -> None:
    async def attack(port: int) -> None:
        admin, io = await raw_io(port)
        io.send(struct.pack("<BBBBIHI", PduType.H2C_TERM_REQ, 0, 24, 0, 24, 1, 0) + bytes(10))
        assert await io.closed()
        await admin.close()

    check_survives(tmp_path, attack)


# -- command errors: the precise NVMe status, and the queue keeps working ------------------------------

def _sqe(opc: int, cid: int = 1, *, flags: int = 0x40, nsid: int = 1, sgl: bytes | None = None, **cdw: int) -> bytes:
    return build_sqe(opc, cid, flags=flags, nsid=nsid, dptr=sgl if sgl is not None else transport_sgl(0), **cdw)


def _rw(opc: int, slba: int, nblocks: int, length: int | None = None, sgl_id: int | None = None,
        flags: int = 0x40, nsid: int = 1, control: int = 0) -> bytes:
    n = nblocks * 512 if length is None else length
    sgl = build_sgl_data_block(sgl_id if sgl_id is not None else SglId.TRANSPORT_DATA_BLOCK, 0, n)
    return _sqe(opc, flags=flags, nsid=nsid, sgl=sgl, cdw10=slba & 0xFFFFFFFF, cdw11=slba >> 32,
                cdw12=(nblocks - 1) | (control << 16))


def _connect_raw(qid: int, sqsize: int, cntlid: int, recfmt: int = 0, nqn: str = NQN) -> tuple[bytes, bytes]:
    return connect_sqe(qid=qid, sqsize=sqsize, recfmt=recfmt), connect_data(nqn, cntlid=cntlid)


W512 = b"\x99" * 512
U64 = (1 << 64) - 1

# name: (queue kind, sqe, in-capsule data, wire status word[, dw0]). A word with 0x4000 (More)
# has an Error Information log entry behind it, as nvmet sets it (target.controller.ERROR_LOCATIONS):
# never before Connect (no controller yet), nor for a sequence error, SGL offset/type or Keep Alive.
COMMAND_CASES: dict[str, tuple] = {
    # before Connect
    "identify-before-connect": ("fresh", _sqe(0x06, nsid=0, sgl=transport_sgl(4096), cdw10=1), b"", 0x8002),
    "read-before-connect": ("fresh", _rw(0x02, 0, 1), b"", 0x8002),
    "write-before-connect": ("fresh", _rw(0x01, 0, 1, sgl_id=1), W512, 0x8002),
    "property-get-before-connect": ("fresh", prop_sqe(1, True, 0x1C), b"", 0x8002),
    # Connect itself
    "connect-bad-recfmt": ("fresh", *_connect_raw(0, 31, 0xFFFF, recfmt=1), 0x8300),
    "connect-sqsize-zero": ("fresh", *_connect_raw(0, 0, 0xFFFF), 0x8304, 44),
    "connect-admin-sqsize-too-big": ("fresh", *_connect_raw(0, 64, 0xFFFF), 0x8304, 44),
    "connect-admin-static-cntlid": ("fresh", *_connect_raw(0, 31, 5), 0x8304, 0x10010),
    "connect-io-unknown-cntlid": ("fresh", *_connect_raw(1, 127, 0x1234), 0x8304, 0x10010),
    "connect-unknown-nqn": ("fresh", *_connect_raw(0, 31, 0xFFFF, nqn="nqn.2026-11.io.blockd:nope"), 0x8304, 0x10100),
    "connect-short-data": ("fresh", connect_sqe(length=512), connect_data()[:512], 0x801E),
    "connect-no-data": ("fresh", connect_sqe(length=0), b"", 0x801E),
    "connect-io-bad-qid": ("io-fresh", None, None, 0x8304, 42),
    "connect-io-sqsize-too-big": ("io-fresh", None, None, 0x8304, 44),
    "connect-io-qid-taken": ("io-fresh", None, None, 0x8018),
    "second-connect": ("admin", *_connect_raw(0, 31, 0xFFFF), 0x8018),
    # admin queue, controller not yet enabled
    "identify-before-enable": ("admin-disabled", _sqe(0x06, nsid=0, sgl=transport_sgl(4096), cdw10=1), b"", 0x8018),
    # fabrics / properties
    "property-get-unknown-offset": ("admin", prop_sqe(1, True, 0x40), b"", 0xC004),
    "property-get-cap-as-4-bytes": ("admin", prop_sqe(1, True, 0x00), b"", 0xC004),
    "property-get-huge-offset": ("admin", prop_sqe(1, True, 0xFFFFFFF0), b"", 0xC004),
    "property-set-unknown-offset": ("admin", prop_sqe(1, False, 0x24, value=1), b"", 0xC004),
    "property-set-csts": ("admin", prop_sqe(1, False, 0x1C, value=1), b"", 0xC004),
    "property-get-on-io-queue": ("io", prop_sqe(1, True, 0x1C), b"", 0xC002),  # Invalid Opcode, as nvmet
    "fabrics-auth-send": ("admin", bytes([0x7F, 0x40, 1, 0, 0x05]) + bytes(19) + transport_sgl(0) + bytes(24), b"", 0xC002),
    # admin commands
    "admin-unknown-opcode": ("admin", _sqe(0x04, nsid=0), b"", 0xC002),
    "admin-vendor-opcode": ("admin", _sqe(0xC0, nsid=0), b"", 0xC002),
    "admin-opcode-bidirectional": ("admin", _sqe(0x83, nsid=0), b"", 0xC002),
    "admin-bad-flags-psdt0": ("admin", _sqe(0x06, flags=0x00, nsid=0, sgl=transport_sgl(4096), cdw10=1), b"", 0xC004),
    "admin-fuse-bits": ("admin", _sqe(0x06, flags=0x42, nsid=0, sgl=transport_sgl(4096), cdw10=1), b"", 0xC004),
    "identify-bad-cns": ("admin", _sqe(0x06, nsid=0, sgl=transport_sgl(4096), cdw10=0x55), b"", 0xC004),
    "identify-short-buffer": ("admin", _sqe(0x06, nsid=0, sgl=transport_sgl(512), cdw10=1), b"", 0xC01E),
    "identify-ns-invalid": ("admin", _sqe(0x06, nsid=7, sgl=transport_sgl(4096), cdw10=0), b"", 0xC016),
    "identify-ns-list-ffffffff": ("admin", _sqe(0x06, nsid=0xFFFFFFFF, sgl=transport_sgl(4096), cdw10=2), b"", 0xC016),
    "get-log-bad-lid": ("admin", _sqe(0x02, nsid=0, sgl=transport_sgl(512), cdw10=0x7F | (127 << 16)), b"", 0xC004),
    "get-log-odd-lpo": ("admin", _sqe(0x02, nsid=0, sgl=transport_sgl(512), cdw10=0x02 | (127 << 16), cdw12=2), b"", 0xC004),
    "get-log-numd-mismatch": ("admin", _sqe(0x02, nsid=0, sgl=transport_sgl(512), cdw10=0x02 | (63 << 16)), b"", 0xC01E),
    # commands that return no data, sent with a data buffer: they must still complete
    "get-features-with-data-buffer": ("admin", _sqe(0x0A, nsid=0, sgl=transport_sgl(4096), cdw10=0x07), b"", 0xC01E),
    "property-get-with-data-buffer": ("admin", prop_sqe(1, True, 0x1C)[:24] + transport_sgl(4096)
                                      + prop_sqe(1, True, 0x1C)[40:], b"", 0xC01E),
    "set-features-unknown": ("admin", _sqe(0x09, nsid=0, cdw10=0x7E), b"", 0xC004),
    "keep-alive-without-kato": ("admin", _sqe(0x18, nsid=0), b"", 0x0034),  # no DNR, as nvmet
    # I/O commands: flags and SGLs
    "io-psdt-00": ("io", _rw(0x02, 0, 1, flags=0x00), b"", 0xC004),
    "io-psdt-10": ("io", _rw(0x02, 0, 1, flags=0x80), b"", 0xC004),
    "io-fuse-first": ("io", _rw(0x01, 0, 1, sgl_id=1, flags=0x41), W512, 0xC004),
    "io-fuse-second": ("io", _rw(0x02, 0, 1, flags=0x42), b"", 0xC004),
    "io-sgl-last-segment": ("io", _rw(0x02, 0, 1, sgl_id=0x30), b"", 0x8022),
    "io-sgl-keyed-over-tcp": ("io", _rw(0x02, 0, 1, sgl_id=0x40), b"", 0x8022),
    "io-sgl-type0-bad-subtype": ("io", _rw(0x02, 0, 1, sgl_id=0x0F), b"", 0xC004),
    "io-read-length-short": ("io", _rw(0x02, 0, 2, length=512), b"", 0xC01E),
    "io-read-length-long": ("io", _rw(0x02, 0, 1, length=1024), b"", 0xC01E),
    "io-write-incapsule-length-mismatch": ("io", _rw(0x01, 0, 2, length=512, sgl_id=1), W512, 0xC01E),
    "io-read-over-mdts": ("io", _rw(0x02, 0, 4096), b"", 0xC01E),
    "io-incapsule-offset": ("io", _sqe(0x01, sgl=build_sgl_data_block(1, 64, 512), cdw12=0), W512 + bytes(64), 0x802C),
    "io-incapsule-more-than-sent": ("io", _rw(0x01, 0, 2, sgl_id=1), W512, 0x802C),
    "io-incapsule-read": ("io", _rw(0x02, 0, 1, sgl_id=1), b"", 0xC004),
    "io-unknown-opcode": ("io", _sqe(0x04), b"", 0xC002),
    "io-vendor-opcode": ("io", _sqe(0x80), b"", 0xC002),
    "io-admin-opcode-on-io-queue": ("io", _sqe(0x06, sgl=transport_sgl(4096), cdw10=1), b"", 0xC002),
    # I/O commands: namespaces and ranges
    "io-invalid-ns": ("io", _rw(0x02, 0, 1, nsid=7), b"", 0xC016),
    "io-ns-zero": ("io", _rw(0x02, 0, 1, nsid=0), b"", 0xC016),
    "io-ns-broadcast-write": ("io", _rw(0x01, 0, 1, nsid=0xFFFFFFFF, sgl_id=1), W512, 0xC016),
    "io-lba-past-end": ("io", _rw(0x02, BLOCKS, 1), b"", 0xC100),
    "io-lba-straddles-end": ("io", _rw(0x01, BLOCKS - 1, 2, sgl_id=1, length=1024), W512 * 2, 0xC100),
    "io-lba-near-2^64-write": ("io", _rw(0x01, U64, 1, sgl_id=1), W512, 0xC100),
    "io-lba-wraps-2^64-write": ("io", _rw(0x01, U64 - 1, 4, sgl_id=1, length=2048), W512 * 4, 0xC100),
    "io-lba-near-2^64-read": ("io", _rw(0x02, U64 - 1, 1), b"", 0xC100),
    "io-write-zeroes-past-end": ("io", _sqe(0x08, cdw10=BLOCKS - 4, cdw12=7), b"", 0xC100),
    "io-write-zeroes-near-2^64": ("io", _sqe(0x08, cdw10=0xFFFFFFFF, cdw11=0xFFFFFFFF, cdw12=0xFFFF), b"", 0xC100),
    "io-write-zeroes-with-data": ("io", _sqe(0x08, sgl=incapsule_sgl(512)), W512, 0xC004),  # nvmet: in-capsule data on a non-write
    "io-dsm-range-past-end": ("io", _sqe(0x09, sgl=incapsule_sgl(16), cdw10=0, cdw11=4),
                              struct.pack("<IIQ", 0, 8, BLOCKS - 4), 0xC100),
    "io-dsm-range-near-2^64": ("io", _sqe(0x09, sgl=incapsule_sgl(16), cdw10=0, cdw11=4),
                               struct.pack("<IIQ", 0, 0xFFFFFFFF, U64), 0xC100),
    "io-dsm-too-few-ranges": ("io", _sqe(0x09, sgl=incapsule_sgl(16), cdw10=3, cdw11=4),
                              struct.pack("<IIQ", 0, 1, 0), 0xC01E),
    "io-dsm-no-data": ("io", _sqe(0x09, cdw10=0, cdw11=4), b"", 0xC01E),
    "io-flush-with-data": ("io", _sqe(0x00, sgl=incapsule_sgl(512)), W512, 0xC004),
}


async def _queue_for(kind: str, port: int) -> tuple[RawConn, list[RawConn], int]:
    """The raw queue a case runs on, the other raw connections to close, and its CNTLID."""
    if kind == "fresh":
        conn = await RawConn.open(port)
        await conn.initialize()
        return conn, [], 0
    if kind == "admin-disabled":
        conn = await RawConn.open(port)
        await conn.initialize()
        return conn, [], await conn.connect_admin()
    if kind == "admin":
        conn, cntlid = await raw_admin(port)
        return conn, [], cntlid
    if kind == "io":
        admin, io = await raw_io(port)
        return io, [admin], 0
    admin, cntlid = await raw_admin(port)  # io-fresh: an unconnected queue beside a live controller
    if kind == "io-fresh":
        conn = await RawConn.open(port)
        await conn.initialize()
        return conn, [admin], cntlid
    raise AssertionError(kind)


@pytest.mark.parametrize("name", sorted(COMMAND_CASES))
def test_command_error_status(tmp_path: Path, name: str) -> None:
    kind, sqe, data, want, *dw0_want = COMMAND_CASES[name]

    async def attack(port: int) -> None:
        conn, others, cntlid = await _queue_for(kind, port)
        nonlocal sqe, data
        if kind == "io-fresh":
            if name == "connect-io-qid-taken":
                first = await RawConn.open(port)
                await first.initialize()
                await first.connect_io(cntlid, qid=1)
                others.append(first)
                sqe, data = _connect_raw(1, 127, cntlid)
            elif name == "connect-io-bad-qid":
                sqe, data = _connect_raw(17, 127, cntlid)  # max_io_queues is 16
            else:
                sqe, data = _connect_raw(1, 128, cntlid)  # SQSIZE 0's based; MQES is 127
        status, dw0, cid, got = await conn.command(sqe, data)
        assert status == want, f"status {status:#06x}, want {want:#06x}"
        assert cid == int.from_bytes(sqe[2:4], "little")
        assert got == b""  # a failed command sends no data
        if dw0_want:
            assert dw0 == dw0_want[0], hex(dw0)
        # The queue survives the error: a valid command on it still works.
        if kind == "io":
            status, _, _, got = await conn.command(_rw(0x02, 0, 1))
            assert status == 0 and len(got) == 512
        elif kind == "admin":
            status, dw0, _, _ = await conn.command(prop_sqe(2, True, 0x1C))
            assert status == 0 and dw0 & 1
        else:
            assert not conn.reader.at_eof()
        for c in [conn, *others]:
            await c.close()

    check_survives(tmp_path, attack)


def test_data_digest_error_fails_command_only(tmp_path: Path) -> None:
    """A corrupt in-capsule data digest: Data Transfer Error, no write, connection lives."""
    async def attack(port: int) -> None:
        conn = await RawConn.open(port)
        await conn.initialize(dgst=3)
        sqe = connect_sqe()
        conn.send(capsule(sqe, connect_data(), hdgst=True, ddgst=True))
        pdu = await conn.recv()
        assert pdu is not None and pdu.ptype == PduType.CAPSULE_RESP and pdu.flags & 1
        status = int.from_bytes(pdu.header[22:24], "little")
        assert status == 0
        cntlid = int.from_bytes(pdu.header[8:10], "little")
        conn.send(capsule(prop_sqe(2, False, 0x14, value=0x00460001), hdgst=True))
        assert (await conn.recv()).ptype == PduType.CAPSULE_RESP
        io = await RawConn.open(port)
        await io.initialize(dgst=3)
        io.send(capsule(connect_sqe(qid=1, sqsize=127), connect_data(cntlid=cntlid), hdgst=True, ddgst=True))
        resp = await io.recv()
        assert int.from_bytes(resp.header[22:24], "little") == 0
        bad = bytearray(capsule(_rw(0x01, 0, 1, sgl_id=1), W512, hdgst=True, ddgst=True))
        bad[-1] ^= 0xFF
        io.send(bytes(bad))
        resp = await io.recv()
        assert resp.ptype == PduType.CAPSULE_RESP
        assert int.from_bytes(resp.header[22:24], "little") == 0x0008
        io.send(capsule(_rw(0x02, 0, 1), hdgst=True))
        data = await io.recv()
        assert data.ptype == PduType.C2H_DATA and struct.unpack_from("<I", data.header, 16)[0] == 512
        await io.close()
        await conn.close()

    check_survives(tmp_path, attack)


def test_header_digest_error_terminates(tmp_path: Path) -> None:
    async def attack(port: int) -> None:
        conn = await RawConn.open(port)
        await conn.initialize(dgst=1)
        bad = bytearray(capsule(connect_sqe(), connect_data(), hdgst=True))
        bad[72] ^= 0x01  # first byte of the header digest
        conn.send(bytes(bad))
        await expect_termination(conn, 3, 0)

    check_survives(tmp_path, attack)


def test_queue_depth_overflow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """More commands than the queue's command pool: exactly the excess fail, with Command
    Sequence Error, and the queue keeps working.

    The pool is 2 x the negotiated SQ size, as nvmet-tcp's: a slot comes back only once its
    response has left, and a host may reuse an SQ entry as soon as it sees the CQE, before our
    side has seen the send complete. The commands must really be outstanding together, so each
    is a Flush (of every namespace) held at a gate in the file backend until the test has seen
    every refusal.
    (nvmet-tcp tears the connection down when a capsule finds no free slot; we refuse the one
    command, a status the host can act on, and the queue lives.)"""
    gate = asyncio.Event()
    real_flush = FileBackend.flush

    async def gated_flush(self: FileBackend) -> None:
        await gate.wait()
        await real_flush(self)
    monkeypatch.setattr(FileBackend, "flush", gated_flush)
    depth, sent = 4, 64
    pool = 2 * depth

    async def attack(port: int) -> None:
        try:
            admin, cntlid = await raw_admin(port)
            io = await RawConn.open(port)
            await io.initialize()
            status, *_ = await io.command(connect_sqe(qid=1, sqsize=depth - 1), connect_data(cntlid=cntlid))
            assert status == 0
            # (of every namespace: a queue's thread serves a one-namespace Flush itself, ungated)
            io.send(b"".join(capsule(_sqe(IoOpcode.FLUSH, cid, nsid=NSID_ALL)) for cid in range(sent)))
            statuses = {}
            while len(statuses) < sent - pool:
                pdu = await io.recv()
                assert pdu is not None and pdu.ptype == PduType.CAPSULE_RESP, pdu
                _, _, _, _, cid, status = CQE_FAST.unpack_from(pdu.header, COMMON_HEADER_SIZE)
                statuses[cid] = status
            assert statuses == {cid: to_wire(Status.COMMAND_SEQUENCE_ERROR) for cid in range(pool, sent)}
            gate.set()  # the held ones, and only they, now complete with success
            while len(statuses) < sent:
                pdu = await io.recv()
                assert pdu is not None and pdu.ptype == PduType.CAPSULE_RESP, pdu
                _, _, _, _, cid, status = CQE_FAST.unpack_from(pdu.header, COMMON_HEADER_SIZE)
                assert cid not in statuses and status == 0, (cid, status)
                statuses[cid] = status
            status, _, _, got = await io.command(_rw(IoOpcode.READ, 0, 1))
            assert status == 0 and len(got) == 512
            await io.close()
            await admin.close()
        finally:
            gate.set()  # a failed assertion must not leave flushes held through the drain

    check_survives(tmp_path, attack)
