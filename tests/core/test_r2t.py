"""A write answered over several H2CData PDUs, from a raw NVMe/TCP client.

Neither our host (MAXH2CDATA is 1 MiB, so it never splits) nor the kernel host in the VM tests
(every write fits our 128 KiB in-capsule size) takes the target's "more data follows" branch.
Here a hand-framed client sends a write larger than the in-capsule size with its data
announced by the Transport SGL, takes the target's R2T, and answers it with 2 or 3 H2CData PDUs
of uneven sizes (framed by ``blockd.tcp_pdu.PduWriter``, so with digests when negotiated). The
data must land exactly; an H2CData that skips ahead of or overlaps what arrived, or a last one
without LAST_PDU, ends the connection with the precise termination request (NVMe/TCP 7.4.7,
3.6.2.x) and writes nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from blockd.tcp_pdu import PduWriter
from protocol.constants import IoOpcode
from protocol.nvme import CQE_FAST, build_sqe
from protocol.tcp import DATA_PDU_HEADER, DATA_PDU_HEADER_FAST, PduFlags, PduType, TermReqFes, fei_of

from .conftest import (
    RawConn, capsule, config, connect_data, connect_sqe, fill_file, free_port, ns, raw_admin, run, serving,
    sub, transport_sgl,
)
from .test_hostile import check_survives, expect_termination

SIZE = 4 << 20
LENGTH = 192 << 10
"""Above the 128 KiB in-capsule size of an I/O queue: the data can only come after an R2T."""
SLBA = 2048
CID = 9
_FEI_DATAO, _FEI_FLAGS = fei_of(DATA_PDU_HEADER, "datao"), fei_of(DATA_PDU_HEADER, "flags")


async def io_queue(port: int, digests: bool) -> tuple[RawConn, RawConn]:
    """A raw admin queue and a raw I/O queue 1 (header and data digests on it if ``digests``)."""
    admin, cntlid = await raw_admin(port)
    io = await RawConn.open(port)
    await io.initialize(dgst=3 if digests else 0)
    io.send(capsule(connect_sqe(qid=1, sqsize=127), connect_data(cntlid=cntlid), hdgst=digests, ddgst=digests))
    resp = await io.recv()
    assert resp is not None and resp.ptype == PduType.CAPSULE_RESP
    assert CQE_FAST.unpack_from(resp.header, 8)[5] == 0
    return admin, io


async def write_asking_r2t(io: RawConn, digests: bool) -> int:
    """Send the write command without its data; returns the R2T's tag (after checking it asks
    for the whole transfer)."""
    sqe = build_sqe(IoOpcode.WRITE, CID, nsid=1, dptr=transport_sgl(LENGTH), cdw10=SLBA,
                    cdw12=LENGTH // 512 - 1)
    io.send(capsule(sqe, hdgst=digests))
    r2t = await io.recv()
    assert r2t is not None and r2t.ptype == PduType.R2T, r2t
    _, _, _, _, _, cccid, ttag, r2to, r2tl = DATA_PDU_HEADER_FAST.unpack_from(r2t.header)
    assert (cccid, r2to, r2tl) == (CID, 0, LENGTH)
    return ttag


def h2c(writer: PduWriter, ttag: int, offset: int, data: bytes, last: bool) -> bytes:
    return b"".join(writer.data_pdu(PduType.H2C_DATA, CID, ttag, offset, data,
                                    PduFlags.LAST_PDU if last else 0))


@pytest.mark.parametrize("cuts,digests", [
    ((LENGTH - 4096,), False),
    ((40960, 40960 + 65536), False),
    ((512, LENGTH - 512), True),
], ids=["2-pdus", "3-pdus", "3-pdus-with-digests"])
def test_r2t_answered_by_several_h2c_data_pdus(tmp_path: Path, cuts: tuple[int, ...], digests: bool) -> None:
    port = free_port()
    path = tmp_path / "vol.img"
    original = fill_file(path, SIZE)
    payload = bytes(range(256)) * (LENGTH // 256)
    payload = payload[7:] + payload[:7]  # no piece of it looks like any other at its offset

    async def main() -> None:
        async with serving(config([port], [sub(namespaces=[ns(path, size=SIZE)])])):
            admin, io = await io_queue(port, digests)
            writer = PduWriter()
            writer.hdgst = writer.ddgst = digests
            ttag = await write_asking_r2t(io, digests)
            bounds = [0, *cuts, LENGTH]
            for start, end in zip(bounds, bounds[1:]):
                io.send(h2c(writer, ttag, start, payload[start:end], last=end == LENGTH))
            resp = await io.recv()
            assert resp is not None and resp.ptype == PduType.CAPSULE_RESP, resp
            _, _, _, _, cid, status = CQE_FAST.unpack_from(resp.header, 8)
            assert (cid, status) == (CID, 0)
            await io.close()
            await admin.close()

    run(main(), timeout=30)
    expected = bytearray(original)
    expected[SLBA * 512:SLBA * 512 + LENGTH] = payload
    assert path.read_bytes() == expected


BAD_SEQUENCES = {
    # name: (H2CData PDUs as (offset, length, LAST_PDU), FES, FEI). A refused PDU carries little
    # data: the target judges its header and closes, and a large unread remainder would make
    # the close a reset that can overtake the termination request on its way to this client.
    "skips-ahead": ([(0, 65536, False), (98304, 512, False)], TermReqFes.DATA_OUT_OF_RANGE, _FEI_DATAO),
    "second-piece-first": ([(65536, 512, False)], TermReqFes.DATA_OUT_OF_RANGE, _FEI_DATAO),
    "overlaps": ([(0, 65536, False), (32768, 512, False)], TermReqFes.DATA_OUT_OF_RANGE, _FEI_DATAO),
    "resends-a-piece": ([(0, 65536, False), (0, 512, False)], TermReqFes.DATA_OUT_OF_RANGE, _FEI_DATAO),
    "no-last-pdu": ([(0, 65536, False), (65536, LENGTH - 65536, False)], TermReqFes.INVALID_HEADER_FIELD,
                    _FEI_FLAGS),
}


@pytest.mark.parametrize("name", sorted(BAD_SEQUENCES))
def test_bad_h2c_data_sequence_terminates(tmp_path: Path, name: str) -> None:
    """Each breach ends the connection with its FES/FEI; the file keeps none of the data (the
    write never ran) and a good host beside it carries on (``check_survives``)."""
    pieces, fes, fei = BAD_SEQUENCES[name]

    async def attack(port: int) -> None:
        admin, io = await io_queue(port, digests=False)
        writer = PduWriter()
        ttag = await write_asking_r2t(io, digests=False)
        io.send(b"".join(h2c(writer, ttag, offset, b"\x66" * length, last) for offset, length, last in pieces))
        await expect_termination(io, fes, fei)
        await admin.close()

    check_survives(tmp_path, attack)
