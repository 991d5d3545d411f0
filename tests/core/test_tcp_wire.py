"""What the target puts on the wire for reads, with and without SQ flow control (raw client)."""

from __future__ import annotations

from pathlib import Path

from protocol.fabrics import CATTR_DISABLE_SQFLOW
from protocol.nvme import CQE_FAST, build_sqe
from protocol.status import MORE, Status, to_wire
from protocol.tcp import PduFlags, PduType

from .conftest import (
    RawConn, capsule, config, connect_data, connect_sqe, fill_file, free_port, ns, raw_admin, run,
    serving, sub, transport_sgl,
)

SIZE = 1 << 20


def read_sqe(cid: int, slba: int, blocks: int) -> bytes:
    return build_sqe(0x02, cid, nsid=1, dptr=transport_sgl(blocks * 512), cdw10=slba, cdw12=blocks - 1)


def test_sq_flow_control_decides_how_a_read_completes(tmp_path: Path) -> None:
    """SQ flow control on: C2HData then a response capsule whose SQHD advances. Off (CATTR bit 2,
    as Linux's nvme connect --disable-sqflow): the last C2HData carries SUCCESS and no response
    follows; a failed read still gets its response capsule."""
    port = free_port()
    path = tmp_path / "vol.img"
    original = fill_file(path, SIZE)
    cfg = config([port], [sub(namespaces=[ns(path, size=SIZE)])])

    async def main() -> None:
        async with serving(cfg):
            for cattr in (0, CATTR_DISABLE_SQFLOW):
                admin, cntlid = await raw_admin(port)
                io = await RawConn.open(port)
                await io.initialize()
                sqe = connect_sqe(qid=1, sqsize=127, cattr=cattr)
                status, _, _, _ = await io.command(sqe, connect_data(cntlid=cntlid))
                assert status == 0
                for cid in (5, 6):
                    io.send(capsule(read_sqe(cid, 8 * cid, 8)))
                    pdu = await io.recv()
                    assert pdu is not None and pdu.ptype == PduType.C2H_DATA
                    assert pdu.data == original[8 * cid * 512:(8 * cid + 8) * 512]
                    if cattr:
                        assert pdu.flags & (PduFlags.LAST_PDU | PduFlags.SUCCESS) == PduFlags.LAST_PDU | PduFlags.SUCCESS
                        continue  # the next PDU read is the next command's data: no response between
                    assert not pdu.flags & PduFlags.SUCCESS
                    resp = await io.recv()
                    assert resp is not None and resp.ptype == PduType.CAPSULE_RESP
                    _, _, sqhd, _, got_cid, status = CQE_FAST.unpack_from(resp.header, 8)
                    assert (got_cid, status) == (cid, 0)
                    assert sqhd == cid - 3  # Connect was entry 0, cid 5 entry 1, cid 6 entry 2
                status, _, cid, data = await io.command(read_sqe(7, SIZE // 512, 1))
                assert (cid, status, data) == (7, to_wire(Status.LBA_RANGE | MORE), b"")
                await io.close()
                await admin.close()

    run(main(), timeout=30)
