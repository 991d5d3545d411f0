"""NVMe/TCP PDUs (NVMe TCP Transport 1.0, section 3.6) and their CRC-32C digests."""

from __future__ import annotations

from enum import IntEnum

import construct as c
import crc32c as _crc32c

from protocol.layout import at_offsets, field_offset, fixed_layout
from protocol.nvme import CQE_SIZE, SQE_SIZE


class PduType(IntEnum):
    IC_REQ = 0x00
    IC_RESP = 0x01
    H2C_TERM_REQ = 0x02
    C2H_TERM_REQ = 0x03
    CAPSULE_CMD = 0x04
    CAPSULE_RESP = 0x05
    H2C_DATA = 0x06
    C2H_DATA = 0x07
    R2T = 0x09


class PduFlags:
    HDGST = 0x01
    DDGST = 0x02
    LAST_PDU = 0x04
    SUCCESS = 0x08


class TermReqFes(IntEnum):
    """Fatal Error Status of a termination request."""

    INVALID_HEADER_FIELD = 1
    PDU_SEQUENCE_ERROR = 2
    HEADER_DIGEST_ERROR = 3
    DATA_OUT_OF_RANGE = 4
    R2T_LIMIT_EXCEEDED = 5
    UNSUPPORTED_PARAMETER = 6


COMMON_HEADER_SIZE = 8
IC_SIZE = 128
CAPSULE_CMD_HLEN = COMMON_HEADER_SIZE + SQE_SIZE
CAPSULE_RESP_HLEN = COMMON_HEADER_SIZE + CQE_SIZE
DATA_HLEN = 24
TERM_HLEN = 24
MAX_TERM_COPY = 128
DIGEST_SIZE = 4

COMMON_HEADER = c.Struct(
    "pdu_type" / c.Int8ul,
    "flags" / c.Int8ul,
    "hlen" / c.Int8ul,
    "pdo" / c.Int8ul,
    "plen" / c.Int32ul,
)
COMMON_HEADER_FAST = fixed_layout(COMMON_HEADER)

_COMMON_ROWS = [
    (0, "pdu_type", c.Int8ul),
    (1, "flags", c.Int8ul),
    (2, "hlen", c.Int8ul),
    (3, "pdo", c.Int8ul),
    (4, "plen", c.Int32ul),
]

IC_REQ = at_offsets(IC_SIZE, _COMMON_ROWS + [
    (8, "pfv", c.Int16ul),
    (10, "hpda", c.Int8ul),
    (11, "dgst", c.Int8ul),
    (12, "maxr2t", c.Int32ul),
])
"""DGST bit 0 = header digest, bit 1 = data digest; MAXR2T is 0's based."""
IC_REQ_FAST = fixed_layout(IC_REQ)

IC_RESP = at_offsets(IC_SIZE, _COMMON_ROWS + [
    (8, "pfv", c.Int16ul),
    (10, "cpda", c.Int8ul),
    (11, "dgst", c.Int8ul),
    (12, "maxh2cdata", c.Int32ul),
])

DATA_PDU_HEADER = at_offsets(DATA_HLEN, _COMMON_ROWS + [
    (8, "cccid", c.Int16ul),
    (10, "ttag", c.Int16ul),
    (12, "datao", c.Int32ul),
    (16, "datal", c.Int32ul),
])
"""Header shared by H2CData, C2HData and R2T (R2T: datao = R2TO, datal = R2TL)."""
DATA_PDU_HEADER_FAST = fixed_layout(DATA_PDU_HEADER)


def fei_of(header: c.Struct, name: str) -> int:
    """Terminate request FEI for a bad header field: its byte offset in the PDU header."""
    return field_offset(header, name)

TERM_REQ_HEADER = at_offsets(TERM_HLEN, _COMMON_ROWS + [
    (8, "fes", c.Int16ul),
    (10, "fei", c.Int32ul),
])
"""Followed by up to 128 bytes of the offending PDU header; never digests."""

CAPSULE_HEADER = COMMON_HEADER_FAST
"""CapsuleCmd = common header + SQE (HLEN 72); CapsuleResp = common header + CQE (HLEN 24)."""


def crc32c(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC-32C (Castagnoli) as NVMe/TCP digests use it; ``value`` continues a running CRC."""
    return _crc32c.crc32c(data, value)


def digest_bytes(data: bytes | bytearray | memoryview) -> bytes:
    """The 4-byte little-endian digest that follows ``data`` on the wire."""
    return crc32c(data).to_bytes(4, "little")
