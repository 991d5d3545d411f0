"""What both NVMe/TCP PDU readers share: the per-type tables, the errors and the PDU they yield.

Two readers split the byte stream: the Python reference in :mod:`blockd.pdu_reader` and the
compiled one in ``blockd/_pdu_reader.pyx``; :mod:`blockd.tcp_pdu` hands callers the one in use
(:mod:`blockd.dataplane`). Both take their sizes and rules from here and from ``protocol/``, so
the compiled reader types nothing twice.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from protocol.tcp import (
    CAPSULE_CMD_HLEN, CAPSULE_RESP_HLEN, DATA_HLEN, IC_SIZE, TERM_HLEN, PduType,
)

HLEN = {
    PduType.IC_REQ: IC_SIZE,
    PduType.IC_RESP: IC_SIZE,
    PduType.H2C_TERM_REQ: TERM_HLEN,
    PduType.C2H_TERM_REQ: TERM_HLEN,
    PduType.CAPSULE_CMD: CAPSULE_CMD_HLEN,
    PduType.CAPSULE_RESP: CAPSULE_RESP_HLEN,
    PduType.H2C_DATA: DATA_HLEN,
    PduType.C2H_DATA: DATA_HLEN,
    PduType.R2T: DATA_HLEN,
}
NO_DIGEST = frozenset({PduType.IC_REQ, PduType.IC_RESP, PduType.H2C_TERM_REQ, PduType.C2H_TERM_REQ})
TERM_REQS = frozenset({PduType.H2C_TERM_REQ, PduType.C2H_TERM_REQ})
CARRIES_DATA = frozenset({PduType.CAPSULE_CMD, PduType.H2C_DATA, PduType.C2H_DATA,
                          PduType.H2C_TERM_REQ, PduType.C2H_TERM_REQ})


class FramingError(Exception):
    """A PDU the connection cannot survive; ``header`` is the offending PDU's header."""

    def __init__(self, fes: int, fei: int, message: str, header: bytes = b"") -> None:
        super().__init__(message)
        self.fes = fes
        self.fei = fei
        self.header = header


class Pdu(NamedTuple):
    """One received PDU. ``header`` (and ``data`` unless ``placed``) are views into the reader's
    buffer, valid until the reader is given more bytes. ``placed``: ``data`` is the buffer the
    ``place`` callback gave, already filled."""

    pdu_type: int
    flags: int
    header: memoryview
    data: memoryview | None
    placed: bool = False


Place = Callable[[int, memoryview, int], "memoryview | None"]
"""``place(pdu_type, header, data_length)``: where a data PDU's data should land, or None to
keep it in the reader's buffer. May raise :class:`FramingError` (data nobody asked for)."""

STAGING = 64 << 10
"""Initial receive buffer of a connection; it grows for a PDU that does not fit."""
MIN_FREE = 16 << 10


class DataDigestError(Exception):
    """Data digest mismatch: the command fails (Data Transfer Error), the connection may live."""

    def __init__(self, pdu_type: int, header: bytes) -> None:
        super().__init__("data digest mismatch")
        self.pdu_type = pdu_type
        self.header = header
