"""Fabrics commands (opcode 7Fh): Connect and its 1024-byte data, Property Get/Set (NVMe-oF 1.1)."""

from __future__ import annotations

import construct as c

from protocol.layout import at_offsets, field_offset, fixed_layout, nul_padded
from protocol.nvme import SGL_SIZE, SQE_SIZE

NQN_FIELD = 256
CONNECT_DATA_SIZE = 1024

FABRICS_COMMAND_HEAD = [
    (0, "opcode", c.Int8ul),
    (1, "flags", c.Int8ul),
    (2, "cid", c.Int16ul),
    (4, "fctype", c.Int8ul),
    (24, "dptr", c.Bytes(SGL_SIZE)),
]
"""Rows every fabrics command (opcode 7Fh) starts with: FCTYPE replaces NSID."""

FABRICS_COMMAND = at_offsets(SQE_SIZE, FABRICS_COMMAND_HEAD + [
    (40, "specific", c.Bytes(24)),
])

CONNECT_COMMAND = at_offsets(SQE_SIZE, FABRICS_COMMAND_HEAD + [
    (40, "recfmt", c.Int16ul),
    (42, "qid", c.Int16ul),
    (44, "sqsize", c.Int16ul),
    (46, "cattr", c.Int8ul),
    (48, "kato", c.Int32ul),
])
"""SQSIZE is 0's based; KATO in milliseconds (admin queue only); CATTR bit 2 disables SQ flow control."""
CATTR_DISABLE_SQFLOW = 0x04
"""The host keeps within the queue size itself: no SQ head in completions, and over NVMe/TCP a
read may end with a C2HData PDU flagged SUCCESS instead of a response capsule."""

CONNECT_AUTHREQ_ATR = 1 << 17
"""Connect response DW0: the queue must authenticate (DH-HMAC-CHAP) before any other command;
bits 15:0 carry the CNTLID."""

CONNECT_DATA = at_offsets(CONNECT_DATA_SIZE, [
    (0, "hostid", c.Bytes(16)),
    (16, "cntlid", c.Int16ul),
    (256, "subnqn", nul_padded(NQN_FIELD)),
    (512, "hostnqn", nul_padded(NQN_FIELD)),
])

PROPERTY_COMMAND = at_offsets(SQE_SIZE, FABRICS_COMMAND_HEAD + [
    (40, "attrib", c.Int8ul),
    (44, "offset", c.Int32ul),
    (48, "value", c.Int64ul),
])
"""ATTRIB bits 2:0: 0 = 4-byte property, 1 = 8-byte property."""

PROPERTY_COMMAND_FAST = fixed_layout(PROPERTY_COMMAND)
PROPERTY_SIZE_8 = 1
"""ATTRIB value of an 8-byte property access."""
PROPERTY_SIZE_MASK = 0x07

# Connect: CQE DW0 for Invalid Parameters points at the bad field: IATTR bit 16 set means the
# field is in the Connect data, clear means in the SQE; IPO is its byte offset (as the kernel's
# IPO_IATTR_CONNECT_DATA / IPO_IATTR_CONNECT_SQE macros).
IATTR_DATA = 1 << 16


def ipo_connect_data(name: str) -> int:
    """Connect Invalid Parameters DW0 pointing at Connect data field ``name``."""
    return IATTR_DATA | field_offset(CONNECT_DATA, name)


def ipo_connect_sqe(name: str) -> int:
    """Connect Invalid Parameters DW0 pointing at Connect SQE field ``name``."""
    return field_offset(CONNECT_COMMAND, name)


IPO_CONNECT_CNTLID = ipo_connect_data("cntlid")
IPO_CONNECT_SUBNQN = ipo_connect_data("subnqn")
IPO_CONNECT_QID = ipo_connect_sqe("qid")
IPO_CONNECT_SQSIZE = ipo_connect_sqe("sqsize")
