"""Golden bytes for every command builder in protocol/commands.py.

As in test_golden.py, each expected SQE is written by hand from the spec's offsets (NVMe Base
2.0 sections 5 and 7, NVMe-oF 1.1 section 3; tabulated in docs/wire-facts.md),
never by asking protocol/ where a field lives. Every builder leaves CID 0 and SGL1 zero, with
FLAGS = 0x40 (PSDT: SGL), and returns a mutable 64-byte bytearray.
"""

from __future__ import annotations

import uuid

import pytest

from protocol import commands
from protocol.nvme import CQE_SIZE, SQE_SIZE
from protocol.status import DNR, Status, describe


def sqe(opcode: int, *fields: tuple[int, int, int]) -> bytes:
    """64 bytes: OPC at 0, FLAGS 0x40 at 1, then (offset, value, size) little-endian."""
    b = bytearray(SQE_SIZE)
    b[0] = opcode
    b[1] = 0x40
    for off, value, size in fields:
        b[off:off + size] = value.to_bytes(size, "little")
    return bytes(b)


def same(built: bytearray, golden: bytes) -> None:
    assert isinstance(built, bytearray) and len(built) == SQE_SIZE
    if bytes(built) != golden:
        first = next(i for i, (a, b) in enumerate(zip(built, golden)) if a != b)
        pytest.fail(f"built differs from golden at byte {first}: {built[first:first + 8].hex()} "
                    f"!= {golden[first:first + 8].hex()}")


def test_field_offsets() -> None:
    assert commands.SQE_CID_OFFSET == 2       # CDW0 bits 31:16
    assert commands.SQE_SGL_OFFSET == 24      # DPTR, CDW6-9
    assert commands.SQE_SGL_END == 40
    assert commands.CQE_CID_OFFSET == 12      # CQE DW3 bits 15:0
    assert CQE_SIZE == 16


def test_read() -> None:
    # NSID at 4, SLBA (CDW10-11) at 40, NLB 0's based (CDW12 15:0) at 48
    same(commands.read_command(3, 0x0000000123456789, 7),
         sqe(0x02, (4, 3, 4), (40, 0x0000000123456789, 8), (48, 7, 2)))


@pytest.mark.parametrize("fua", [False, True])
def test_write(fua: bool) -> None:
    cdw12 = 15 | (1 << 30 if fua else 0)        # FUA: CDW12 bit 30
    same(commands.write_command(1, 2048, 15, fua), sqe(0x01, (4, 1, 4), (40, 2048, 8), (48, cdw12, 4)))


def test_flush() -> None:
    same(commands.flush_command(0xFFFFFFFF), sqe(0x00, (4, 0xFFFFFFFF, 4)))


@pytest.mark.parametrize("deallocate", [False, True])
def test_write_zeroes(deallocate: bool) -> None:
    cdw12 = 255 | (1 << 25 if deallocate else 0)  # DEAC: CDW12 bit 25
    same(commands.write_zeroes_command(2, 100, 255, deallocate),
         sqe(0x08, (4, 2, 4), (40, 100, 8), (48, cdw12, 4)))


def test_dataset_management() -> None:
    # NR (0's based) in CDW10 7:0, AD = CDW11 bit 2
    same(commands.dsm_command(1, 9, 1 << 2), sqe(0x09, (4, 1, 4), (40, 9, 4), (44, 1 << 2, 4)))


def test_identify() -> None:
    # CNS in CDW10 7:0, CNTID in CDW10 31:16
    same(commands.identify_command(0x02, 0, 0x11), sqe(0x06, (40, 0x02, 1), (42, 0x11, 2)))
    same(commands.identify_command(0x00, 5), sqe(0x06, (4, 5, 4)))


@pytest.mark.parametrize("rae", [False, True])
def test_get_log_page(rae: bool) -> None:
    numd0 = 0x1_0003                          # NUMDL CDW10 31:16, NUMDU CDW11 15:0
    cdw10 = 0x70 | (1 << 15 if rae else 0) | ((numd0 & 0xFFFF) << 16)
    same(commands.get_log_page_command(0x70, numd0, offset=4096, nsid=0xFFFFFFFF, rae=rae),
         sqe(0x02, (4, 0xFFFFFFFF, 4), (40, cdw10, 4), (44, numd0 >> 16, 4), (48, 4096, 8)))


def test_set_features() -> None:
    # FID in CDW10 7:0, CDW11 feature specific (Number of Queues: NSQR 15:0, NCQR 31:16)
    same(commands.set_features_command(0x07, 3 | 3 << 16), sqe(0x09, (40, 0x07, 4), (44, 3 | 3 << 16, 4)))


def test_keep_alive_and_async_event_request() -> None:
    same(commands.keep_alive_command(), sqe(0x18))
    same(commands.async_event_request_command(), sqe(0x0C))


def test_connect() -> None:
    # FCTYPE at 4; RECFMT 40, QID 42, SQSIZE 44, CATTR 46, KATO 48 (NVMe-oF 1.1 figure 20)
    same(commands.connect_command(3, 127, 5000, 0x04),
         sqe(0x7F, (4, 0x01, 1), (42, 3, 2), (44, 127, 2), (46, 0x04, 1), (48, 5000, 4)))


def test_connect_data() -> None:
    hostid = uuid.UUID("8e2a0ad4-6f1c-4c2e-9b1a-43c4f8f1d2a0").bytes
    raw = commands.connect_data(hostid, 0xFFFF, "nqn.sub", "nqn.host")
    golden = bytearray(1024)
    golden[0:16] = hostid
    golden[16:18] = b"\xff\xff"
    golden[256:263] = b"nqn.sub"
    golden[512:520] = b"nqn.host"
    assert raw == bytes(golden)


def test_property_get_and_set() -> None:
    # ATTRIB at 40 (0: 4 bytes, 1: 8 bytes), OFST at 44, VALUE at 48
    same(commands.property_get_command(0x00, 8), sqe(0x7F, (4, 0x04, 1), (40, 1, 1), (44, 0x00, 4)))
    same(commands.property_get_command(0x1C, 4), sqe(0x7F, (4, 0x04, 1), (44, 0x1C, 4)))
    same(commands.property_set_command(0x14, 0x00460001),
         sqe(0x7F, (4, 0x00, 1), (44, 0x14, 4), (48, 0x00460001, 8)))


def test_unknown_field_is_refused() -> None:
    with pytest.raises(TypeError):
        commands._packer(commands.fixed_layout(commands.DSM_COMMAND))(nosuch=1)


def test_describe_command() -> None:
    assert commands.describe_command(commands.read_command(1, 0, 0), admin=False) == "read on namespace 1"
    assert commands.describe_command(commands.identify_command(1), admin=True) == "IDENTIFY"
    # the same opcode means Get Log Page on the admin queue
    assert commands.describe_command(commands.get_log_page_command(2, 0), admin=True) == "GET_LOG_PAGE"
    assert commands.describe_command(commands.connect_command(0, 31), admin=True) == "fabrics CONNECT"
    assert commands.describe_command(bytearray(b"\xee" + bytes(63)), admin=True) == "0xee"


def test_sct1_0x83_is_named_by_the_command_it_answers() -> None:
    """SCT 1 SC 0x83: ONCS Not Supported on a Write Zeroes (nvmet's answer when its backend cannot
    zero), Connect Restart Discovery on a Connect -- also an I/O queue's Connect, sent on that queue."""
    zeroes, connect = commands.write_zeroes_command(1, 0, 8), commands.connect_command(1, 31)
    assert commands.is_io_command(zeroes, admin=False) and not commands.is_io_command(zeroes, admin=True)
    assert not commands.is_io_command(connect, admin=False)
    code = 0x183 | DNR
    assert describe(code, io=commands.is_io_command(zeroes, admin=False)).startswith("ONCS_NOT_SUPPORTED (sct 1 sc 0x83, dnr")
    assert describe(0x183, io=commands.is_io_command(connect, admin=False)).startswith("CONNECT_RESTART_DISCOVERY")
    assert describe(Status.LBA_RANGE, io=True).startswith("LBA_RANGE")  # other codes keep their names
