"""Submission and completion queue entries and SGL descriptors (NVMe Base 2.0, section 4).

Each wire structure is a construct definition; the ``*_FAST`` layouts are derived from them
(see :mod:`protocol.layout`) for the per-I/O path.
"""

from __future__ import annotations

import construct as c

from protocol.layout import at_offsets, fixed_layout

SQE_SIZE = 64
CQE_SIZE = 16
SGL_SIZE = 16

SQE = c.Struct(
    "opcode" / c.Int8ul,
    "flags" / c.Int8ul,
    "cid" / c.Int16ul,
    "nsid" / c.Int32ul,
    "cdw2" / c.Int32ul,
    "cdw3" / c.Int32ul,
    "mptr" / c.Int64ul,
    "dptr" / c.Bytes(SGL_SIZE),
    "cdw10" / c.Int32ul,
    "cdw11" / c.Int32ul,
    "cdw12" / c.Int32ul,
    "cdw13" / c.Int32ul,
    "cdw14" / c.Int32ul,
    "cdw15" / c.Int32ul,
)
"""Generic 64-byte command; command-specific views below reinterpret the same bytes."""

CQE = c.Struct(
    "dw0" / c.Int32ul,
    "dw1" / c.Int32ul,
    "sqhd" / c.Int16ul,
    "sqid" / c.Int16ul,
    "cid" / c.Int16ul,
    "status" / c.Int16ul,
)
"""16-byte completion; ``status`` is the wire word (see :mod:`protocol.status`)."""

# SGL descriptors (byte 15 = identifier, see protocol.constants.SglId).
SGL_DATA_BLOCK = c.Struct(
    "address" / c.Int64ul,
    "length" / c.Int32ul,
    c.Padding(3),
    "sgl_id" / c.Int8ul,
)
"""Data Block (in-capsule, subtype Offset: address = offset) and Transport Data Block."""

SGL_KEYED = c.Struct(
    "address" / c.Int64ul,
    "length" / c.Int24ul,
    "key" / c.Int32ul,
    "sgl_id" / c.Int8ul,
)
"""Keyed SGL Data Block (RDMA): remote virtual address, 24-bit length, rkey."""

SQE_FAST = fixed_layout(SQE)
CQE_FAST = fixed_layout(CQE)
SGL_DATA_BLOCK_FAST = fixed_layout(SGL_DATA_BLOCK)

# Views of the command-specific dwords (offsets are from the start of the 64-byte SQE).
NVM_COMMAND_HEAD = [
    (0, "opcode", c.Int8ul),
    (1, "flags", c.Int8ul),
    (2, "cid", c.Int16ul),
    (4, "nsid", c.Int32ul),
    (24, "dptr", c.Bytes(SGL_SIZE)),
]
"""Rows every admin and NVM command view starts with."""

RW_COMMAND = at_offsets(SQE_SIZE, NVM_COMMAND_HEAD + [
    (40, "slba", c.Int64ul),
    (48, "nlb", c.Int16ul),
    (50, "control", c.Int16ul),
    (52, "dsmgmt", c.Int32ul),
])
"""Read / Write / Write Zeroes: NLB is 0's based; control bit 14 = FUA, bit 9 = DEAC."""

RW_FAST = fixed_layout(RW_COMMAND)

IO_COMMAND = at_offsets(SQE_SIZE, [
    (0, "opcode", c.Int8ul),
    (1, "flags", c.Int8ul),
    (2, "cid", c.Int16ul),
    (4, "nsid", c.Int32ul),
    (24, "sgl_address", c.Int64ul),
    (32, "sgl_length", c.Int32ul),
    (39, "sgl_id", c.Int8ul),
    (40, "slba", c.Int64ul),
    (48, "nlb", c.Int16ul),
    (50, "control", c.Int16ul),
])
"""A command as the target first reads it, in one unpack: the head, SGL1 as a (Transport)
Data Block (a keyed descriptor splits address/length/key differently, see
:func:`parse_sgl_keyed`) and the Read/Write/Write Zeroes dwords (meaningless for others)."""
IO_COMMAND_FAST = fixed_layout(IO_COMMAND)
IO_OPCODE, IO_FLAGS, IO_CID, IO_NSID = (IO_COMMAND_FAST.index(n) for n in ("opcode", "flags", "cid", "nsid"))
IO_SLBA, IO_NLB, IO_CONTROL = (IO_COMMAND_FAST.index(n) for n in ("slba", "nlb", "control"))
"""Positions in the tuple :data:`IO_COMMAND_FAST` unpacks, derived from the layout."""
SGL1_OFFSET = 24
"""SGL1 (DPTR) sits at bytes 24-39 of every fabrics SQE."""
FLAGS_PSDT_FUSE_MASK = 0xC3
"""FLAGS bits that must read PSDT=01b, no fused operation, over fabrics."""
NSID_ALL = 0xFFFFFFFF
RW_CONTROL_FUA = 1 << 14
RW_CONTROL_DEAC = 1 << 9

DSM_RANGE = c.Struct(
    "attributes" / c.Int32ul,
    "nlb" / c.Int32ul,
    "slba" / c.Int64ul,
)
"""Dataset Management range; ``nlb`` is 1's based (unlike Read/Write)."""
DSM_RANGE_FAST = fixed_layout(DSM_RANGE)
DSM_ATTR_DEALLOCATE = 1 << 2

GET_LOG_PAGE_COMMAND = at_offsets(SQE_SIZE, NVM_COMMAND_HEAD + [
    (40, "lid", c.Int8ul),
    (41, "lsp_rae", c.Int8ul),
    (42, "numdl", c.Int16ul),
    (44, "numdu", c.Int16ul),
    (46, "lsi", c.Int16ul),
    (48, "lpo", c.Int64ul),
    (59, "csi", c.Int8ul),
])
GET_LOG_PAGE_RAE = 0x80
"""Retain Asynchronous Event: bit 7 of byte 41 (CDW10 bit 15)."""

FEATURES_COMMAND = at_offsets(SQE_SIZE, NVM_COMMAND_HEAD + [
    (40, "fid", c.Int8ul),
    (43, "sv", c.Int8ul),
    (44, "value", c.Int32ul),
])
"""Get / Set Features: FID in CDW10 bits 7:0, SV in bit 31 (byte 43 bit 7), the value in CDW11."""
FEATURES_SAVE = 0x80

DSM_COMMAND = at_offsets(SQE_SIZE, NVM_COMMAND_HEAD + [
    (40, "nr", c.Int8ul),
    (44, "attributes", c.Int32ul),
])
"""Dataset Management: NR (0's based range count) in CDW10, the attributes (AD, IDR, IDW) in CDW11."""
DSM_COMMAND_FAST = fixed_layout(DSM_COMMAND)

IDENTIFY_COMMAND = at_offsets(SQE_SIZE, NVM_COMMAND_HEAD + [
    (40, "cns", c.Int8ul),
    (42, "cntid", c.Int16ul),
    (44, "cnssid", c.Int16ul),
    (47, "csi", c.Int8ul),
])


def build_sqe(opcode: int, cid: int, *, flags: int = 0x40, nsid: int = 0, dptr: bytes = bytes(16),
              cdw10: int = 0, cdw11: int = 0, cdw12: int = 0, cdw13: int = 0, cdw14: int = 0,
              cdw15: int = 0, cdw2: int = 0, cdw3: int = 0) -> bytes:
    """Pack a generic SQE through the fast layout."""
    return SQE_FAST.pack(opcode, flags, cid, nsid, cdw2, cdw3, 0, dptr, cdw10, cdw11, cdw12,
                         cdw13, cdw14, cdw15)


def build_sgl_data_block(sgl_id: int, address: int, length: int) -> bytes:
    """An SGL Data Block / Transport Data Block descriptor."""
    return SGL_DATA_BLOCK_FAST.pack(address, length, sgl_id)


def build_sgl_keyed(address: int, length: int, key: int, sgl_id: int = 0x40) -> bytes:
    """A Keyed SGL Data Block descriptor (RDMA)."""
    return SGL_KEYED.build(dict(address=address, length=length, key=key, sgl_id=sgl_id))


def parse_sgl_keyed(raw: bytes | memoryview) -> tuple[int, int, int, int]:
    """(address, length, key, sgl_id) of a keyed descriptor without construct's overhead.

    struct has no 24-bit integer, so this slices by SGL_KEYED's offsets; the protocol tests
    check it against SGL_KEYED for arbitrary descriptors.
    """
    return (int.from_bytes(raw[0:8], "little"), int.from_bytes(raw[8:11], "little"),
            int.from_bytes(raw[11:15], "little"), raw[15])
