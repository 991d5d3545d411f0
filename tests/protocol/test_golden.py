"""Golden bytes for every wire structure, written by hand from the spec's offsets.

Each expected byte string is built by placing values at the offsets that NVMe Base 2.0,
NVMe-oF 1.1, NVMe TCP Transport 1.0 and the NVMe RDMA Transport spec give (tabulated in
docs/wire-facts.md) -- never by asking protocol/ where a field lives.  Each test then checks both directions: the construct definition (and, where one
exists, the derived fast layout or helper) builds exactly those bytes, and parsing those
bytes gives back the values.
"""

from __future__ import annotations

import uuid
from typing import Any

import construct as c
import pytest

from blockd.tcp_pdu import PduReader, PduWriter, term_req
from protocol import fabrics, identify, logpage, nvme, rdma_cm, reservation, status, tcp
from protocol.status import Status

# --------------------------------------------------------------------------------------------
# helpers


def put(buf: bytearray, off: int, value: int, size: int) -> None:
    """Place ``value`` little-endian at ``off`` (all NVMe/NVMe-oF integers are LE)."""
    buf[off:off + size] = value.to_bytes(size, "little")


def put_bytes(buf: bytearray, off: int, raw: bytes) -> None:
    buf[off:off + len(raw)] = raw


def zeroed(con: c.Construct) -> Any:
    """All fields of a fixed-size construct set to zero/empty (the parse of all-zero bytes)."""
    return con.parse(bytes(con.sizeof()))


def check(con: c.Construct, golden: bytes, values: dict[str, Any]) -> None:
    """``con`` builds ``golden`` from ``values`` (others zero) and parses it back to them."""
    obj = zeroed(con)
    obj.update(values)
    built = con.build(obj)
    assert len(built) == len(golden)
    if built != golden:  # show the first differing offset, far more useful than a hex blob
        first = next(i for i, (a, b) in enumerate(zip(built, golden)) if a != b)
        pytest.fail(f"built differs from golden at byte {first}: "
                    f"{built[first:first + 8].hex()} != {golden[first:first + 8].hex()}")
    parsed = con.parse(golden)
    for name, value in values.items():
        assert parsed[name] == value, name


NQN_SUB = "nqn.2024-01.io.blockd:vol-1"
NQN_HOST = "nqn.2014-08.org.nvmexpress:uuid:8e2a0ad4-6f1c-4c2e-9b1a-43c4f8f1d2a0"
HOSTID = uuid.UUID("8e2a0ad4-6f1c-4c2e-9b1a-43c4f8f1d2a0").bytes

# --------------------------------------------------------------------------------------------
# docs/wire-facts.md, "Commands and completions": SQE / CQE / status word


def test_sqe_generic():
    sgl = bytes(range(0xB0, 0xC0))
    b = bytearray(64)
    b[0] = 0x02                      # OPC: Read
    b[1] = 0x40                      # FLAGS: PSDT = 01b
    put(b, 2, 0xA5C3, 2)             # CID
    put(b, 4, 0x00000001, 4)         # NSID
    put(b, 8, 0x11223344, 4)         # CDW2
    put(b, 12, 0x55667788, 4)        # CDW3
    put(b, 16, 0x0102030405060708, 8)  # MPTR
    put_bytes(b, 24, sgl)            # DPTR (SGL1)
    for i, off in enumerate(range(40, 64, 4)):  # CDW10..CDW15
        put(b, off, 0xC0DE0000 + 10 + i, 4)
    values = dict(opcode=0x02, flags=0x40, cid=0xA5C3, nsid=1, cdw2=0x11223344, cdw3=0x55667788,
                  mptr=0x0102030405060708, dptr=sgl, cdw10=0xC0DE000A, cdw11=0xC0DE000B,
                  cdw12=0xC0DE000C, cdw13=0xC0DE000D, cdw14=0xC0DE000E, cdw15=0xC0DE000F)
    check(nvme.SQE, bytes(b), values)
    fast = nvme.SQE_FAST
    assert fast.size == 64
    assert fast.as_dict(bytes(b)) == values
    assert nvme.build_sqe(0x02, 0xA5C3, nsid=1, dptr=sgl, cdw2=0x11223344, cdw3=0x55667788,
                          cdw10=0xC0DE000A, cdw11=0xC0DE000B, cdw12=0xC0DE000C, cdw13=0xC0DE000D,
                          cdw14=0xC0DE000E, cdw15=0xC0DE000F) == bytes(b[:16]) + bytes(8) + bytes(b[24:])


def test_cqe_with_lba_out_of_range():
    b = bytearray(16)
    put(b, 0, 0xDEADBEEF, 4)   # DW0
    put(b, 4, 0x01234567, 4)   # DW1
    put(b, 8, 0x0007, 2)       # SQHD
    put(b, 10, 0x0003, 2)      # SQID
    put(b, 12, 0xF00D, 2)      # CID
    # status word: P bit 0, SC bits 8:1, SCT bits 11:9, DNR bit 15
    sc, sct, dnr = 0x80, 0, 1
    word = sc << 1 | sct << 9 | dnr << 15
    assert word == 0x8100
    put(b, 14, word, 2)
    assert b[14:16] == b"\x00\x81"
    values = dict(dw0=0xDEADBEEF, dw1=0x01234567, sqhd=7, sqid=3, cid=0xF00D, status=0x8100)
    check(nvme.CQE, bytes(b), values)
    assert nvme.CQE_FAST.as_dict(bytes(b)) == values
    assert nvme.CQE_FAST.pack(*values.values()) == bytes(b)
    assert status.to_wire(Status.LBA_RANGE) == 0x8100
    assert status.from_wire(0x8100) == Status.LBA_RANGE


# (name, SCT, SC, DNR, wire word): docs/wire-facts.md, "Status word"
STATUS_TABLE = [
    ("SUCCESS", 0, 0x00, 0, 0x0000),
    ("INVALID_OPCODE", 0, 0x01, 1, 0x8002),
    ("INVALID_FIELD", 0, 0x02, 1, 0x8004),
    ("DATA_TRANSFER_ERROR", 0, 0x04, 0, 0x0008),
    ("INTERNAL_ERROR", 0, 0x06, 1, 0x800C),
    ("INVALID_NS", 0, 0x0B, 1, 0x8016),
    ("COMMAND_SEQUENCE_ERROR", 0, 0x0C, 1, 0x8018),
    ("SGL_INVALID_DATA_LENGTH", 0, 0x0F, 1, 0x801E),
    ("SGL_INVALID_TYPE", 0, 0x11, 1, 0x8022),
    ("SGL_INVALID_OFFSET", 0, 0x16, 1, 0x802C),
    ("KEEP_ALIVE_EXPIRED", 0, 0x19, 0, 0x0032),
    ("NS_WRITE_PROTECTED", 0, 0x20, 0, 0x0040),
    ("LBA_RANGE", 0, 0x80, 1, 0x8100),
    ("CAPACITY_EXCEEDED", 0, 0x81, 1, 0x8102),
    ("NS_NOT_READY", 0, 0x82, 0, 0x0104),
    ("INVALID_QID", 1, 0x01, 1, 0x8202),
    ("INVALID_LOG_PAGE", 1, 0x09, 1, 0x8212),
    ("CONNECT_INCOMPATIBLE_FORMAT", 1, 0x80, 1, 0x8300),
    ("CONNECT_CONTROLLER_BUSY", 1, 0x81, 1, 0x8302),
    ("CONNECT_INVALID_PARAMETERS", 1, 0x82, 1, 0x8304),
    ("CONNECT_RESTART_DISCOVERY", 1, 0x83, 0, 0x0306),
    ("CONNECT_INVALID_HOST", 1, 0x84, 1, 0x8308),
    ("RESERVATION_CONFLICT", 0, 0x83, 1, 0x8106),
    ("HOST_ID_INCONSISTENT_FORMAT", 0, 0x18, 1, 0x8030),
    ("WRITE_FAULT", 2, 0x80, 0, 0x0500),
    ("UNRECOVERED_READ_ERROR", 2, 0x81, 0, 0x0502),
]


@pytest.mark.parametrize("name,sct,sc,dnr,wire", STATUS_TABLE, ids=[r[0] for r in STATUS_TABLE])
def test_status_word(name, sct, sc, dnr, wire):
    assert sc << 1 | sct << 9 | dnr << 15 == wire  # the table itself obeys the encoding
    code = Status[name]
    assert status.to_wire(code) == wire
    assert status.from_wire(wire) == code
    assert status.from_wire(wire | 1) == code  # phase bit dropped
    text = status.describe(code)
    assert text.startswith(name) and f"sct {sct}" in text and f"sc {sc:#04x}" in text
    assert ("dnr" in text) == bool(dnr)


# --------------------------------------------------------------------------------------------
# docs/wire-facts.md, "SGL descriptors per transport"


@pytest.mark.parametrize("sgl_id", [0x40, 0x4F])
def test_sgl_keyed(sgl_id):
    b = bytearray(16)
    put(b, 0, 0x00007F1234567000, 8)   # address
    put(b, 8, 0x123456, 3)             # length, 24 bits
    put(b, 11, 0xDEADBEEF, 4)          # key
    b[15] = sgl_id
    assert b[8:11] == b"\x56\x34\x12" and b[11:15] == b"\xef\xbe\xad\xde"
    values = dict(address=0x00007F1234567000, length=0x123456, key=0xDEADBEEF, sgl_id=sgl_id)
    check(nvme.SGL_KEYED, bytes(b), values)
    assert nvme.build_sgl_keyed(0x00007F1234567000, 0x123456, 0xDEADBEEF, sgl_id) == bytes(b)
    assert nvme.parse_sgl_keyed(bytes(b)) == (0x00007F1234567000, 0x123456, 0xDEADBEEF, sgl_id)
    assert nvme.parse_sgl_keyed(memoryview(bytes(b))) == nvme.parse_sgl_keyed(bytes(b))


def test_sgl_keyed_null_rdma():
    # no-data command over RDMA: 0x40, address 0, length 0, key 0
    b = bytearray(16)
    b[15] = 0x40
    assert nvme.build_sgl_keyed(0, 0, 0) == bytes(b)


@pytest.mark.parametrize("sgl_id,address,length", [
    (0x5A, 0, 0x20000),      # transport SGL data block (TCP, data via R2T/C2HData)
    (0x5A, 0, 0),            # TCP null SGL
    (0x01, 0, 4096),         # data block, subtype offset: in-capsule data at ICDOFF 0
    (0x01, 0x10, 0x30),
])
def test_sgl_data_block(sgl_id, address, length):
    b = bytearray(16)
    put(b, 0, address, 8)    # address / offset
    put(b, 8, length, 4)     # length u32
    b[15] = sgl_id           # bytes 12-14 reserved
    values = dict(address=address, length=length, sgl_id=sgl_id)
    check(nvme.SGL_DATA_BLOCK, bytes(b), values)
    assert nvme.build_sgl_data_block(sgl_id, address, length) == bytes(b)
    assert nvme.SGL_DATA_BLOCK_FAST.unpack_from(bytes(b)) == (address, length, sgl_id)


# --------------------------------------------------------------------------------------------
# docs/wire-facts.md, "NVM I/O commands"


def test_rw_command_with_fua():
    sgl = bytearray(16)
    put(sgl, 8, 8 * 512, 4)
    sgl[15] = 0x5A
    b = bytearray(64)
    b[0] = 0x01                         # Write
    b[1] = 0x40
    put(b, 2, 0x1234, 2)
    put(b, 4, 2, 4)                     # NSID
    put_bytes(b, 24, sgl)
    put(b, 40, 0x0000000100000001, 8)   # SLBA (CDW10-11)
    put(b, 48, 7, 2)                    # NLB, 0's based (8 blocks)
    put(b, 48, 7 | 1 << 30, 4)          # CDW12 with FUA = bit 30
    assert b[51] == 0x40
    put(b, 52, 0x00000007, 4)           # CDW13 DSM hints
    values = dict(opcode=1, flags=0x40, cid=0x1234, nsid=2, dptr=bytes(sgl),
                  slba=0x0000000100000001, nlb=7, control=0x4000, dsmgmt=7)
    check(nvme.RW_COMMAND, bytes(b), values)
    assert nvme.RW_FAST.as_dict(bytes(b)) == values
    assert nvme.IO_COMMAND_FAST.as_dict(bytes(b)) == dict(
        opcode=1, flags=0x40, cid=0x1234, nsid=2, sgl_address=0, sgl_length=8 * 512, sgl_id=0x5A,
        slba=0x0000000100000001, nlb=7, control=0x4000)
    assert nvme.RW_CONTROL_FUA == 0x4000  # CDW12 bit 30 seen from the upper half-word


def test_write_zeroes_deac():
    b = bytearray(64)
    b[0] = 0x08
    b[1] = 0x40
    put(b, 48, 15 | 1 << 25, 4)         # CDW12: NLB 15, DEAC = bit 25
    assert b[51] == 0x02
    check(nvme.RW_COMMAND, bytes(b), dict(opcode=8, flags=0x40, nlb=15, control=nvme.RW_CONTROL_DEAC))


def test_dsm_range():
    b = bytearray(16)
    put(b, 0, 0x00000004, 4)            # context attributes
    put(b, 4, 0x00000800, 4)            # length in LBAs, 1's based
    put(b, 8, 0x0000001234567890, 8)    # SLBA
    values = dict(attributes=4, nlb=0x800, slba=0x1234567890)
    check(nvme.DSM_RANGE, bytes(b), values)
    assert nvme.DSM_RANGE_FAST.unpack_from(bytes(b)) == (4, 0x800, 0x1234567890)


def test_get_log_page_command():
    b = bytearray(64)
    b[0] = 0x02
    b[1] = 0x40
    put(b, 2, 7, 2)
    put(b, 4, 0xFFFFFFFF, 4)
    b[40] = 0x70                        # LID
    b[41] = 0x80                        # RAE (CDW10 bit 15)
    put(b, 42, 0x03FF, 2)               # NUMDL
    put(b, 44, 0x0001, 2)               # NUMDU
    put(b, 46, 0x0005, 2)               # LSI
    put(b, 48, 4096, 8)                 # LPO
    b[59] = 0x02                        # CSI (CDW14 31:24)
    check(nvme.GET_LOG_PAGE_COMMAND, bytes(b), dict(
        opcode=2, flags=0x40, cid=7, nsid=0xFFFFFFFF, lid=0x70, lsp_rae=0x80, numdl=0x3FF,
        numdu=1, lsi=5, lpo=4096, csi=2))


def test_identify_command():
    b = bytearray(64)
    b[0] = 0x06
    b[1] = 0x40
    put(b, 4, 1, 4)
    b[40] = 0x03                        # CNS
    put(b, 42, 0x0011, 2)               # CNTID (CDW10 31:16)
    put(b, 44, 0x2233, 2)               # CNSSID (CDW11 15:0)
    b[47] = 0x01                        # CSI (CDW11 31:24)
    check(nvme.IDENTIFY_COMMAND, bytes(b), dict(opcode=6, flags=0x40, nsid=1, cns=3, cntid=0x11,
                                                cnssid=0x2233, csi=1))


# --------------------------------------------------------------------------------------------
# docs/wire-facts.md, "Fabrics commands"


def test_connect_command():
    sgl = bytearray(16)
    put(sgl, 8, 1024, 4)
    sgl[15] = 0x01                      # in-capsule Connect data
    b = bytearray(64)
    b[0] = 0x7F
    b[1] = 0x40
    put(b, 2, 0x0001, 2)
    b[4] = 0x01                         # FCTYPE Connect
    put_bytes(b, 24, sgl)
    put(b, 40, 0, 2)                    # RECFMT
    put(b, 42, 3, 2)                    # QID
    put(b, 44, 127, 2)                  # SQSIZE (0's based)
    b[46] = 0x04                        # CATTR: disable SQ flow control
    put(b, 48, 5000, 4)                 # KATO ms
    values = dict(opcode=0x7F, flags=0x40, cid=1, fctype=1, dptr=bytes(sgl), recfmt=0, qid=3,
                  sqsize=127, cattr=4, kato=5000)
    check(fabrics.CONNECT_COMMAND, bytes(b), values)
    # the generic fabrics view sees fctype at byte 4 and the specific bytes 40-63
    generic = fabrics.FABRICS_COMMAND.parse(bytes(b))
    assert generic.fctype == 1 and generic.specific == bytes(b[40:64])


def test_connect_data():
    b = bytearray(1024)
    put_bytes(b, 0, HOSTID)             # HOSTID
    put(b, 16, 0xFFFF, 2)               # CNTLID: dynamic
    put_bytes(b, 256, NQN_SUB.encode())  # SUBNQN, NUL padded
    put_bytes(b, 512, NQN_HOST.encode())  # HOSTNQN
    values = dict(hostid=HOSTID, cntlid=0xFFFF, subnqn=NQN_SUB, hostnqn=NQN_HOST)
    check(fabrics.CONNECT_DATA, bytes(b), values)
    assert fabrics.CONNECT_DATA.sizeof() == 1024


def test_property_get_cap():
    b = bytearray(64)
    b[0] = 0x7F
    b[1] = 0x40
    put(b, 2, 9, 2)
    b[4] = 0x04                         # FCTYPE Property Get
    b[40] = 0x01                        # ATTRIB: 8-byte property
    put(b, 44, 0x00, 4)                 # OFST = CAP
    check(fabrics.PROPERTY_COMMAND, bytes(b), dict(opcode=0x7F, flags=0x40, cid=9, fctype=4,
                                                   attrib=1, offset=0, value=0))


def test_property_set_cc():
    b = bytearray(64)
    b[0] = 0x7F
    b[1] = 0x40
    put(b, 2, 10, 2)
    b[4] = 0x00                         # FCTYPE Property Set
    b[40] = 0x00                        # ATTRIB: 4 bytes
    put(b, 44, 0x14, 4)                 # OFST = CC
    put(b, 48, 0x00460001, 8)           # VALUE (low 4 bytes used)
    check(fabrics.PROPERTY_COMMAND, bytes(b), dict(opcode=0x7F, flags=0x40, cid=10, fctype=0,
                                                   attrib=0, offset=0x14, value=0x00460001))


def test_property_set_8_byte_value():
    b = bytearray(64)
    b[0] = 0x7F
    b[1] = 0x40
    b[40] = 0x01
    put(b, 48, 0x000000200F00007F, 8)
    check(fabrics.PROPERTY_COMMAND, bytes(b), dict(attrib=1, value=0x000000200F00007F,
                                                   opcode=0x7F, flags=0x40))


# --------------------------------------------------------------------------------------------
# docs/wire-facts.md, "Identify"


def test_identify_controller():
    b = bytearray(4096)
    put(b, 0, 0x1B36, 2)                         # VID
    put(b, 2, 0x1AF4, 2)                         # SSVID
    put_bytes(b, 4, b"blockd-0001".ljust(20, b" "))   # SN, space padded
    put_bytes(b, 24, b"blockd volume".ljust(40, b" "))  # MN
    put_bytes(b, 64, b"0.1.0".ljust(8, b" "))    # FR
    b[72] = 6                                    # RAB
    b[76] = 0x02                                 # CMIC
    b[77] = 8                                    # MDTS
    put(b, 78, 0x0042, 2)                        # CNTLID
    put(b, 80, 0x00010300, 4)                    # VER 1.3.0
    put(b, 92, 0x00000100, 4)                    # OAES
    put(b, 96, 0x00000001, 4)                    # CTRATT
    b[111] = 1                                   # CNTRLTYPE I/O
    put(b, 256, 0x0000, 2)                       # OACS
    b[258] = 3                                   # ACL
    b[259] = 3                                   # AERL
    b[260] = 0x03                                # FRMW
    b[261] = 0x04                                # LPA
    b[262] = 63                                  # ELPE
    put(b, 320, 10, 2)                           # KAS
    b[512] = 0x66                                # SQES
    b[513] = 0x44                                # CQES
    put(b, 514, 128, 2)                          # MAXCMD
    put(b, 516, 1024, 4)                         # NN
    put(b, 520, 0x000C, 2)                       # ONCS
    b[525] = 0x01                                # VWC
    put(b, 536, 0x00100005, 4)                   # SGLS
    put(b, 540, 1024, 4)                         # MNAN
    put_bytes(b, 768, NQN_SUB.encode())          # SUBNQN, NUL padded
    put(b, 1792, 1028, 4)                        # IOCCSZ
    put(b, 1796, 1, 4)                           # IORCSZ
    put(b, 1800, 0, 2)                           # ICDOFF
    b[1802] = 0                                  # FCATT
    b[1803] = 1                                  # MSDBD
    values = dict(vid=0x1B36, ssvid=0x1AF4, sn="blockd-0001", mn="blockd volume", fr="0.1.0",
                  rab=6, cmic=2, mdts=8, cntlid=0x42, ver=0x00010300, oaes=0x100, ctratt=1,
                  cntrltype=1, acl=3, aerl=3, frmw=3, lpa=4, elpe=63, kas=10, sqes=0x66,
                  cqes=0x44, maxcmd=128, nn=1024, oncs=0xC, vwc=1, sgls=0x00100005, mnan=1024,
                  subnqn=NQN_SUB, ioccsz=1028, iorcsz=1, icdoff=0, fcatt=0, msdbd=1)
    check(identify.IDENTIFY_CONTROLLER, bytes(b), values)
    assert identify.IDENTIFY_CONTROLLER.sizeof() == 4096


def test_identify_controller_distinct_offsets():
    """One distinct value per field, so a field at a wrong offset cannot hide behind zeros."""
    fields = {  # name: (offset, size)
        "vid": (0, 2), "ssvid": (2, 2), "rab": (72, 1), "cmic": (76, 1), "mdts": (77, 1),
        "cntlid": (78, 2), "ver": (80, 4), "rtd3r": (84, 4), "rtd3e": (88, 4), "oaes": (92, 4),
        "ctratt": (96, 4), "cntrltype": (111, 1), "crdt1": (128, 2), "crdt2": (130, 2),
        "crdt3": (132, 2), "oacs": (256, 2), "acl": (258, 1), "aerl": (259, 1), "frmw": (260, 1),
        "lpa": (261, 1), "elpe": (262, 1), "npss": (263, 1), "avscc": (264, 1),
        "apsta": (265, 1), "kas": (320, 2), "anatt": (342, 1), "anacap": (343, 1),
        "anagrpmax": (344, 4), "nanagrpid": (348, 4), "sqes": (512, 1), "cqes": (513, 1),
        "maxcmd": (514, 2), "nn": (516, 4), "oncs": (520, 2), "fuses": (522, 2), "fna": (524, 1),
        "vwc": (525, 1), "awun": (526, 2), "awupf": (528, 2), "icsvscc": (530, 1),
        "nwpc": (531, 1), "acwu": (532, 2), "sgls": (536, 4), "mnan": (540, 4),
        "ioccsz": (1792, 4), "iorcsz": (1796, 4), "icdoff": (1800, 2), "fcatt": (1802, 1),
        "msdbd": (1803, 1), "ofcs": (1804, 2),
    }
    b = bytearray(4096)
    b[4:72] = b" " * 68  # empty SN, MN, FR are all spaces (ASCII fields are space padded)
    values = {}
    for i, (name, (off, size)) in enumerate(fields.items(), start=1):
        value = (0x81 + i) if size == 1 else int.from_bytes(bytes([0x80 + i] * size), "little")
        put(b, off, value, size)
        values[name] = value
    check(identify.IDENTIFY_CONTROLLER, bytes(b), values)


def test_identify_namespace():
    nguid = bytes.fromhex("0123456789abcdeffedcba9876543210")
    eui64 = bytes.fromhex("0011223344556677")
    b = bytearray(4096)
    put(b, 0, 0x200000, 8)        # NSZE
    put(b, 8, 0x200000, 8)        # NCAP
    put(b, 16, 0x1000, 8)         # NUSE
    b[24] = 0x00                  # NSFEAT
    b[25] = 1                     # NLBAF (0's based: 2 formats)
    b[26] = 0x01                  # FLBAS: format 1
    b[30] = 0x01                  # NMIC shared
    b[33] = 0x09                  # DLFEAT
    put(b, 46, 0x0100, 2)         # NOIOB
    put(b, 92, 0x00000007, 4)     # ANAGRPID
    b[99] = 0x01                  # NSATTR read-only
    put_bytes(b, 104, nguid)      # NGUID
    put_bytes(b, 120, eui64)      # EUI64
    # LBAF[i] at 128 + 4*i: MS u16 @+0, LBADS @+2, RP @+3
    b[128 + 2] = 9                # LBAF0: 512-byte blocks
    b[132 + 2] = 12               # LBAF1: 4096-byte blocks
    b[132 + 3] = 0x02             # RP
    put(b, 136, 8, 2)             # LBAF2: MS = 8
    obj = zeroed(identify.IDENTIFY_NAMESPACE)
    obj.update(dict(nsze=0x200000, ncap=0x200000, nuse=0x1000, nlbaf=1, flbas=1, nmic=1,
                    dlfeat=9, noiob=0x100, anagrpid=7, nsattr=1, nguid=nguid, eui64=eui64))
    obj.lbaf[0].lbads = 9
    obj.lbaf[1].lbads = 12
    obj.lbaf[1].rp = 2
    obj.lbaf[2].ms = 8
    assert identify.IDENTIFY_NAMESPACE.build(obj) == bytes(b)
    parsed = identify.IDENTIFY_NAMESPACE.parse(bytes(b))
    assert (parsed.nsze, parsed.ncap, parsed.nuse) == (0x200000, 0x200000, 0x1000)
    assert (parsed.nlbaf, parsed.flbas, parsed.nmic, parsed.dlfeat) == (1, 1, 1, 9)
    assert (parsed.noiob, parsed.anagrpid, parsed.nsattr) == (0x100, 7, 1)
    assert parsed.nguid == nguid and parsed.eui64 == eui64
    assert parsed.lbaf[0] == dict(ms=0, lbads=9, rp=0)
    assert parsed.lbaf[1] == dict(ms=0, lbads=12, rp=2)
    assert parsed.lbaf[2] == dict(ms=8, lbads=0, rp=0)
    assert len(parsed.lbaf) == 64  # 128 + 64*4 = 384


def test_identify_csi_independent_ns():
    b = bytearray(4096)
    b[0] = 0x01            # NSFEAT
    b[1] = 0x01            # NMIC
    b[2] = 0x02            # RESCAP
    b[3] = 0x03            # FPI
    put(b, 4, 0x11, 4)     # ANAGRPID
    b[8] = 0x01            # NSATTR
    put(b, 10, 0x22, 2)    # NVMSETID
    put(b, 12, 0x33, 2)    # ENDGID
    b[14] = 0x01           # NSTAT: ready
    check(identify.IDENTIFY_CSI_INDEPENDENT_NS, bytes(b), dict(
        nsfeat=1, nmic=1, rescap=2, fpi=3, anagrpid=0x11, nsattr=1, nvmsetid=0x22, endgid=0x33,
        nstat=1))


def test_active_ns_list():
    b = bytearray(4096)
    for i, nsid in enumerate([1, 2, 7, 0x1000]):
        put(b, 4 * i, nsid, 4)
    ids = [1, 2, 7, 0x1000] + [0] * 1020
    assert identify.ACTIVE_NS_LIST.build(ids) == bytes(b)
    assert list(identify.ACTIVE_NS_LIST.parse(bytes(b))) == ids


def test_ns_descriptor_list():
    nguid = bytes(range(0x10, 0x20))
    uid = uuid.UUID("12345678-9abc-def0-1234-56789abcdef0").bytes
    b = bytearray(4096)
    # {NIDT u8, NIDL u8, rsvd u16, NID[NIDL]}
    put_bytes(b, 0, b"\x02\x10\x00\x00" + nguid)     # NGUID
    put_bytes(b, 20, b"\x03\x10\x00\x00" + uid)      # UUID
    put_bytes(b, 40, b"\x04\x01\x00\x00\x00")        # CSI = NVM
    # NIDL 0 ends the list; the rest of the 4096 bytes is zero
    descs = [dict(nidt=2, nidl=16, nid=nguid), dict(nidt=3, nidl=16, nid=uid),
             dict(nidt=4, nidl=1, nid=b"\x00"), dict(nidt=0, nidl=0, nid=b"")]
    assert identify.NS_DESCRIPTOR_LIST.build(descs) == bytes(b)
    parsed = identify.NS_DESCRIPTOR_LIST.parse(bytes(b))
    assert [(d.nidt, d.nidl, d.nid) for d in parsed] == [(d["nidt"], d["nidl"], d["nid"]) for d in descs]


# --------------------------------------------------------------------------------------------
# docs/wire-facts.md, "Log pages and the discovery log"


def test_discovery_header():
    b = bytearray(1024)
    put(b, 0, 0x0102030405060708, 8)   # GENCTR
    put(b, 8, 3, 8)                    # NUMREC
    put(b, 16, 0, 2)                   # RECFMT
    check(logpage.DISCOVERY_HEADER, bytes(b), dict(genctr=0x0102030405060708, numrec=3, recfmt=0))


def test_discovery_entry_tcp():
    b = bytearray(1024)
    b[0] = 3                           # TRTYPE TCP
    b[1] = 1                           # ADRFAM IPv4
    b[2] = 2                           # SUBTYPE NVMe subsystem
    b[3] = 0x02 | 0x04                 # TREQ: not required + SQ flow control disable supported
    put(b, 4, 1, 2)                    # PORTID
    put(b, 6, 0xFFFF, 2)               # CNTLID
    put(b, 8, 32, 2)                   # ASQSZ
    put(b, 10, 0x0001, 2)              # EFLAGS
    put_bytes(b, 32, b"4420")          # TRSVCID, NUL padded
    put_bytes(b, 256, NQN_SUB.encode())
    put_bytes(b, 512, b"192.0.2.10")   # TRADDR
    b[768] = 0                         # TSAS: SECTYPE none
    check(logpage.DISCOVERY_ENTRY, bytes(b), dict(
        trtype=3, adrfam=1, subtype=2, treq=6, portid=1, cntlid=0xFFFF, asqsz=32, eflags=1,
        trsvcid="4420", subnqn=NQN_SUB, traddr="192.0.2.10", tsas=bytes(256)))


def test_discovery_entry_rdma_tsas():
    tsas = bytearray(256)
    tsas[0] = 1                        # QPTYPE connected        (entry byte 768)
    tsas[1] = 4                        # PRTYPE RoCEv2           (769)
    tsas[2] = 1                        # CMS RDMA_CM             (770)
    put(tsas, 8, 0xFFFF, 2)            # PKEY                    (776)
    check(logpage.TSAS_RDMA, bytes(tsas), dict(qptype=1, prtype=4, cms=1, pkey=0xFFFF))
    b = bytearray(1024)
    b[0] = 1
    b[1] = 1
    b[2] = 3                           # this discovery subsystem
    put_bytes(b, 32, b"4420")
    put_bytes(b, 256, b"nqn.2014-08.org.nvmexpress.discovery")
    put_bytes(b, 512, b"192.0.2.1")
    put_bytes(b, 768, bytes(tsas))
    assert b[776:778] == b"\xff\xff"
    check(logpage.DISCOVERY_ENTRY, bytes(b), dict(
        trtype=1, adrfam=1, subtype=3, trsvcid="4420",
        subnqn="nqn.2014-08.org.nvmexpress.discovery", traddr="192.0.2.1", tsas=bytes(tsas)))


def test_error_log_entry():
    b = bytearray(64)
    put(b, 0, 0x0000000000000005, 8)   # error count
    put(b, 8, 1, 2)                    # SQID
    put(b, 10, 0x1234, 2)              # CID
    put(b, 12, 0x8100, 2)              # status word (CQE encoding)
    put(b, 14, 0x0028, 2)              # parameter error location
    put(b, 16, 0x00000000DEADBEEF, 8)  # LBA
    put(b, 24, 1, 4)                   # NSID
    b[28] = 0x00                       # VS
    b[29] = 3                          # transport type TCP
    put(b, 32, 0x0102030405060708, 8)  # command specific
    put(b, 40, 0x0203, 2)              # transport type specific
    check(logpage.ERROR_LOG_ENTRY, bytes(b), dict(
        error_count=5, sqid=1, cid=0x1234, status=0x8100, param_location=0x28, lba=0xDEADBEEF,
        nsid=1, vs=0, trtype=3, cs=0x0102030405060708, trtype_specific=0x0203))


def test_ana_log_page():
    """ANA log (LID 0Ch), as nvmet writes it (struct nvme_ana_rsp_hdr, nvme_ana_group_desc):
    a 16-byte header, then per group a 32-byte descriptor followed by its NSIDs."""
    b = bytearray(16 + 32 + 8 + 32)
    put(b, 0, 0x0000000000000009, 8)   # CHGCNT
    put(b, 8, 2, 2)                    # NGRPS
    put(b, 16, 1, 4)                   # group 1: ANAGRPID
    put(b, 20, 2, 4)                   # NNSIDS
    put(b, 24, 9, 8)                   # CHGCNT
    b[32] = 0x01                       # state optimized, then 15 reserved bytes
    put(b, 48, 1, 4)                   # NSIDs 1 and 3
    put(b, 52, 3, 4)
    put(b, 56, 7, 4)                   # group 7, no NSIDs listed
    put(b, 64, 9, 8)
    b[72] = 0x03                       # inaccessible
    built = logpage.ANA_LOG.build(dict(header=dict(chgcnt=9, ngrps=2), groups=[
        dict(grpid=1, nnsids=2, chgcnt=9, state=1, nsids=[1, 3]),
        dict(grpid=7, nnsids=0, chgcnt=9, state=3, nsids=[])]))
    assert built == bytes(b)
    parsed = logpage.ANA_LOG.parse(bytes(b) + bytes(100))  # the host's buffer is larger
    assert [(g.grpid, g.state, list(g.nsids)) for g in parsed.groups] == [(1, 1, [1, 3]), (7, 3, [])]
    assert (logpage.ANA_HEADER.sizeof(), logpage.ANA_HEADER_SIZE, logpage.ANA_GROUP_SIZE) == (16, 16, 32)


# --------------------------------------------------------------------------------------------
# docs/wire-facts.md, "NVMe/TCP"


def common(ptype: int, flags: int, hlen: int, pdo: int, plen: int) -> bytearray:
    b = bytearray(8)
    b[0] = ptype        # PDU-type
    b[1] = flags        # FLAGS
    b[2] = hlen         # HLEN
    b[3] = pdo          # PDO
    put(b, 4, plen, 4)  # PLEN
    return b


def test_common_header():
    b = bytes(common(0x07, 0x04, 24, 24, 24 + 4096))
    assert b == b"\x07\x04\x18\x18\x18\x10\x00\x00"
    values = dict(pdu_type=7, flags=4, hlen=24, pdo=24, plen=4120)
    check(tcp.COMMON_HEADER, b, values)
    assert tcp.COMMON_HEADER_FAST.unpack_from(b) == (7, 4, 24, 24, 4120)


def test_icreq():
    b = bytearray(128)
    b[:8] = common(0x00, 0, 128, 0, 128)
    put(b, 8, 0, 2)          # PFV
    b[10] = 0                # HPDA
    b[11] = 0x03             # DGST: header + data digest
    put(b, 12, 0, 4)         # MAXR2T (0's based)
    check(tcp.IC_REQ, bytes(b), dict(pdu_type=0, flags=0, hlen=128, pdo=0, plen=128, pfv=0,
                                     hpda=0, dgst=3, maxr2t=0))
    b[12] = 0x07
    assert tcp.IC_REQ.parse(bytes(b)).maxr2t == 7


def test_icresp():
    b = bytearray(128)
    b[:8] = common(0x01, 0, 128, 0, 128)
    put(b, 8, 0, 2)          # PFV
    b[10] = 0                # CPDA
    b[11] = 0x01             # DGST echo
    put(b, 12, 0x400000, 4)  # MAXH2CDATA
    check(tcp.IC_RESP, bytes(b), dict(pdu_type=1, flags=0, hlen=128, pdo=0, plen=128, pfv=0,
                                      cpda=0, dgst=1, maxh2cdata=0x400000))


@pytest.mark.parametrize("ptype,flags,pdo,datal,ttag", [
    (0x06, 0x04, 24, 8192, 0x0102),   # H2CData, LAST_PDU, TTAG echoes R2T
    (0x07, 0x0C, 24, 4096, 0),        # C2HData, LAST_PDU | SUCCESS
    (0x09, 0x00, 0, 65536, 0x7FFF),   # R2T: no data (PDO 0, PLEN 24)
])
def test_data_pdu_header(ptype, flags, pdo, datal, ttag):
    plen = 24 if ptype == 0x09 else 24 + datal
    b = bytearray(24)
    b[:8] = common(ptype, flags, 24, pdo, plen)
    put(b, 8, 0xBEEF, 2)      # CCCID
    put(b, 10, ttag, 2)       # TTAG
    put(b, 12, 0x3000, 4)     # DATAO / R2TO
    put(b, 16, datal, 4)      # DATAL / R2TL
    values = dict(pdu_type=ptype, flags=flags, hlen=24, pdo=pdo, plen=plen, cccid=0xBEEF,
                  ttag=ttag, datao=0x3000, datal=datal)
    check(tcp.DATA_PDU_HEADER, bytes(b), values)
    assert tcp.DATA_PDU_HEADER_FAST.as_dict(bytes(b)) == values
    assert tcp.DATA_PDU_HEADER_FAST.pack(*values.values()) == bytes(b)


def test_writer_c2hdata_and_r2t_bytes():
    data = bytes(range(256)) * 4
    w = PduWriter()
    b = bytearray(24)
    b[:8] = common(0x07, 0x04, 24, 24, 24 + len(data))
    put(b, 8, 0x0042, 2)
    put(b, 12, 0x200, 4)
    put(b, 16, len(data), 4)
    assert b"".join(w.data_pdu(0x07, 0x42, 0, 0x200, data, 0x04)) == bytes(b) + data
    r = bytearray(24)
    r[:8] = common(0x09, 0, 24, 0, 24)
    put(r, 8, 0x0042, 2)
    put(r, 10, 0x0005, 2)
    put(r, 12, 0, 4)
    put(r, 16, 0x10000, 4)
    assert b"".join(w.r2t(0x42, 5, 0, 0x10000)) == bytes(r)


def test_writer_with_digests():
    data = b"\xa5" * 100
    w = PduWriter()
    w.hdgst = w.ddgst = True
    b = bytearray(24)
    # HDGSTF | DDGSTF | LAST_PDU; PDO after header + HDGST; PLEN includes both digests
    b[:8] = common(0x06, 0x07, 24, 28, 24 + 4 + 100 + 4)
    put(b, 8, 1, 2)
    put(b, 10, 2, 2)
    put(b, 16, 100, 4)
    hdgst = tcp.crc32c(bytes(b)).to_bytes(4, "little")
    ddgst = tcp.crc32c(data).to_bytes(4, "little")
    golden = bytes(b) + hdgst + data + ddgst
    assert b"".join(w.data_pdu(0x06, 1, 2, 0, data, 0x04)) == golden
    # and a capsule response: header digest only
    cqe = bytes(16)
    resp = common(0x05, 0x01, 24, 0, 28) + cqe
    assert b"".join(w.pdu(0x05, cqe)) == bytes(resp) + tcp.crc32c(bytes(resp)).to_bytes(4, "little")


def test_capsule_cmd_with_incapsule_data():
    sqe = nvme.build_sqe(0x01, 3, nsid=1, dptr=nvme.build_sgl_data_block(0x01, 0, 512))
    data = bytes(512)
    golden = bytes(common(0x04, 0, 72, 72, 72 + 512)) + sqe + data   # no padding: PDO = 72
    assert b"".join(PduWriter().pdu(0x04, sqe, data)) == golden
    golden_resp = bytes(common(0x05, 0, 24, 0, 24)) + bytes(16)
    assert b"".join(PduWriter().pdu(0x05, bytes(16))) == golden_resp


def test_term_req():
    offending = bytes(common(0x04, 0, 99, 0, 72))  # a header with a bad HLEN
    b = bytearray(24)
    b[:8] = common(0x03, 0, 24, 0, 24 + len(offending))
    put(b, 8, 1, 2)          # FES: invalid header field
    put(b, 10, 2, 4)         # FEI: byte offset of HLEN
    golden = bytes(b) + offending
    assert term_req(0x03, 1, 2, offending) == golden
    check(tcp.TERM_REQ_HEADER, bytes(b), dict(pdu_type=3, flags=0, hlen=24, pdo=0,
                                              plen=32, fes=1, fei=2))
    # the copied header is capped at 128 bytes (PLEN 24..152)
    long = term_req(0x02, 2, 0, bytes(200))
    assert len(long) == 152 and long[4:8] == (152).to_bytes(4, "little")


def test_crc32c_vector():
    assert tcp.crc32c(b"123456789") == 0xE3069283
    assert tcp.digest_bytes(b"123456789") == b"\x83\x92\x06\xe3"
    # running CRC continues across pieces
    assert tcp.crc32c(b"56789", tcp.crc32c(b"1234")) == 0xE3069283


def test_reader_accepts_golden_bytes():
    """Hand-built PDUs (with digests) go through the reader and come out intact."""
    data = bytes(range(64))
    h = bytearray(24)
    h[:8] = common(0x06, 0x07, 24, 28, 24 + 4 + 64 + 4)
    put(h, 8, 9, 2)
    put(h, 16, 64, 4)
    pdu = bytes(h) + tcp.crc32c(bytes(h)).to_bytes(4, "little") + data + \
        tcp.crc32c(data).to_bytes(4, "little")
    reader = PduReader(frozenset({0x06}), max_data=4096)
    reader.hdgst = reader.ddgst = True
    got = [(p.pdu_type, p.flags, bytes(p.header), bytes(p.data)) for p in reader.feed(pdu)]
    assert got == [(0x06, 0x07, bytes(h), data)]


# --------------------------------------------------------------------------------------------
# docs/wire-facts.md, "RDMA CM private data"


def test_rdma_cm_private_data():
    req = bytearray(32)
    put(req, 0, 0, 2)        # RECFMT
    put(req, 2, 1, 2)        # QID
    put(req, 4, 128, 2)      # HRQSIZE, 1's based
    put(req, 6, 127, 2)      # HSQSIZE, 0's based
    put(req, 8, 0x0042, 2)   # CNTLID
    check(rdma_cm.CmConnectRequest, bytes(req), dict(recfmt=0, qid=1, hrqsize=128, hsqsize=127,
                                                     cntlid=0x42))
    assert rdma_cm.ConnectRequest(qid=1, hrqsize=128, hsqsize=127, cntlid=0x42).pack() == bytes(req)
    assert rdma_cm.parse_request(bytes(req) + bytes(24)) == rdma_cm.ConnectRequest(1, 128, 127, 0x42)

    acc = bytearray(32)
    put(acc, 2, 128, 2)      # CRQSIZE
    check(rdma_cm.CmAccept, bytes(acc), dict(recfmt=0, crqsize=128))
    assert rdma_cm.Accept(crqsize=128).pack() == bytes(acc)
    assert rdma_cm.parse_accept(bytes(acc) + bytes(164)).crqsize == 128

    rej = bytearray(4)
    put(rej, 2, 3, 2)        # STS invalid QID
    check(rdma_cm.CmReject, bytes(rej), dict(recfmt=0, sts=3))
    assert rdma_cm.Reject(sts=rdma_cm.STS_INVALID_QID).pack() == bytes(rej)
    assert rdma_cm.parse_reject(bytes(rej) + bytes(144)).sts == 3


# --------------------------------------------------------------------------------------------
# docs/wire-facts.md, "Reservations"


def test_reservation_commands_and_data():
    golden = bytearray(64)
    put(golden, 40, 0x0A, 1)  # RACQA preempt-and-abort (2) | IEKEY (8)
    put(golden, 41, 0x06, 1)  # RTYPE
    put(golden, 43, 0xC0, 1)  # CPTPL 11b in bits 31:30
    check(reservation.RESERVATION_COMMAND, bytes(golden), {"action": 0x0A, "rtype": 6, "cptpl": 0xC0})
    golden = bytearray(64)
    put(golden, 40, 1023, 4)  # NUMD
    put(golden, 44, 1, 4)  # EDS
    check(reservation.REPORT_COMMAND, bytes(golden), {"numd": 1023, "cdw11": 1})
    golden = bytearray(16)
    put(golden, 0, 0x1122334455667788, 8)
    put(golden, 8, 0x99AABBCCDDEEFF00, 8)
    check(reservation.REGISTER_DATA, bytes(golden), {"crkey": 0x1122334455667788, "nrkey": 0x99AABBCCDDEEFF00})
    check(reservation.ACQUIRE_DATA, bytes(golden), {"crkey": 0x1122334455667788, "prkey": 0x99AABBCCDDEEFF00})
    check(reservation.RELEASE_DATA, bytes(golden[:8]), {"crkey": 0x1122334455667788})


def test_reservation_status_extended():
    golden = bytearray(64)
    put(golden, 0, 0x01020304, 4)  # GEN
    put(golden, 4, 3, 1)  # RTYPE
    put(golden, 5, 2, 2)  # REGCTL
    put(golden, 9, 1, 1)  # PTPLS
    check(reservation.EXT_STATUS_HEADER, bytes(golden), {"gen": 0x01020304, "rtype": 3, "regctl": 2, "ptpls": 1})
    golden = bytearray(64)
    put(golden, 0, 0xFFFF, 2)  # CNTLID
    put(golden, 2, 1, 1)  # RCSTS: holds
    put(golden, 8, 0xABCDEF, 8)  # RKEY
    put_bytes(golden, 16, HOSTID)
    check(reservation.EXT_REGISTRANT, bytes(golden), {"cntlid": 0xFFFF, "rcsts": 1, "rkey": 0xABCDEF, "hostid": HOSTID})
    golden = bytearray(24)
    put(golden, 0, 7, 2)
    put_bytes(golden, 8, HOSTID[:8])
    put(golden, 16, 0x42, 8)
    check(reservation.REGISTRANT, bytes(golden), {"cntlid": 7, "hostid": HOSTID[:8], "rkey": 0x42})


def test_reservation_notification_log():
    golden = bytearray(64)
    put(golden, 0, 5, 8)  # log page count
    put(golden, 8, 1, 1)  # registration preempted
    put(golden, 9, 2, 1)  # available
    put(golden, 12, 1, 4)  # NSID
    check(reservation.NOTIFICATION_LOG, bytes(golden), {"count": 5, "type": 1, "available": 2, "nsid": 1})
